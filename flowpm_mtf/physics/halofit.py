r"""Nonlinear matter power spectrum: halofit (Takahashi et al. 2012, ApJ 761, 152).

The revised halofit of Smith et al. (2003) with the coefficients refitted by
Takahashi et al. (2012, their eqs. A6-A13), for a flat or curved LCDM/wCDM
background (:mod:`flowpm_mtf.physics.cosmology`). From the linear dimensionless power
:math:`\Delta_L^2(k) = k^3 P_L(k)/2\pi^2` at a scale factor ``a``:

* the nonlinear scale :math:`k_\sigma = 1/R` with :math:`\sigma(R) = 1`,
  :math:`\sigma^2(R) = \int \Delta_L^2(k)\, e^{-k^2R^2}\, d\ln k`, and at it the
  effective index :math:`n_{\rm eff} = -3 - d\ln\sigma^2/d\ln R` and curvature
  :math:`C = -d^2\ln\sigma^2/d\ln R^2`;
* :math:`\Delta^2_{NL} = \Delta^2_Q + \Delta^2_H` with, for :math:`y = k/k_\sigma`
  and :math:`f(y) = y/4 + y^2/8`,
  :math:`\Delta^2_Q = \Delta_L^2 [(1+\Delta_L^2)^{\beta_n}/(1 + \alpha_n\Delta_L^2)]
  e^{-f(y)}` and :math:`\Delta^2_H = a_n y^{3f_1} / (1 + b_n y^{f_2} +
  (c_n f_3 y)^{3-\gamma_n}) / (1 + \nu_n/y^2)`.

The linear power is ours (:func:`flowpm_mtf.physics.linear_power.linear_matter_power`,
Eisenstein & Hu) unless a table or function is given: the tests feed CAMB's
linear power and compare with CAMB's own halofit (``tests/data/``). numpy, float64.
"""
import numpy as np

from . import cosmology as cm
from .linear_power import linear_matter_power_function, trapezoid

__all__ = ["nonlinear_scale", "halofit_power", "halofit_power_function"]

# Gauss-Hermite-free sigma(R) integral: trapezoid in ln k on this grid (the Gaussian
# filter cuts it off; 1e-5 relative on sigma^2 for LCDM spectra).
_LNK = np.linspace(np.log(1e-5), np.log(1e3), 4000)


def _sigma2_derivs(delta2, lnr):
    """ln sigma^2(R), d ln sigma^2 / d ln R and d^2 ln sigma^2 / d ln R^2 at ln R."""
    k = np.exp(_LNK)
    x2 = (k * np.exp(lnr))**2
    g = np.exp(-x2)
    s0 = trapezoid(delta2 * g, _LNK)
    s1 = trapezoid(delta2 * g * (-2 * x2), _LNK)                 # d sigma^2 / d ln R
    s2 = trapezoid(delta2 * g * (-4 * x2 + 4 * x2**2), _LNK)     # d^2 sigma^2 / d ln R^2
    d1 = s1 / s0
    return np.log(s0), d1, s2 / s0 - d1**2


def nonlinear_scale(plin):
    r"""The halofit nonlinear scale and spectral shape of a linear power spectrum.

    Parameters
    ----------
    plin : callable
        Linear P(k) [(Mpc/h)^3] of ``k`` [h/Mpc].

    Returns
    -------
    (k_sigma, n_eff, curv) : float
        :math:`k_\sigma` [h/Mpc], :math:`n_{\rm eff}`, :math:`C`.

    Raises
    ------
    ValueError
        If sigma(R) does not cross 1 for 1e-4 < R < 1e3 Mpc/h (a linear power too
        small or too large for halofit).
    """
    k = np.exp(_LNK)
    delta2 = k**3 * np.asarray(plin(k), np.float64) / (2 * np.pi**2)
    lo, hi = np.log(1e-4), np.log(1e3)          # sigma decreases with R
    if _sigma2_derivs(delta2, lo)[0] < 0 or _sigma2_derivs(delta2, hi)[0] > 0:
        raise ValueError("halofit: sigma(R) does not cross 1 between 1e-4 and 1e3 Mpc/h")
    for _ in range(80):                         # bisection in ln R to 1e-12
        mid = 0.5 * (lo + hi)
        if _sigma2_derivs(delta2, mid)[0] > 0:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12:
            break
    lnr = 0.5 * (lo + hi)
    _, d1, d2 = _sigma2_derivs(delta2, lnr)
    return float(np.exp(-lnr)), float(-3.0 - d1), float(-d2)


def halofit_power(cosmo, k, a=1.0, plin=None):
    r"""Nonlinear matter power spectrum by halofit (Takahashi et al. 2012).

    Parameters
    ----------
    cosmo : cosmology
    k : array_like
        Wavenumbers [h/Mpc], positive.
    a : float
        Scale factor [dimensionless] (of the background quantities, and of the
        default linear power).
    plin : callable, optional
        Linear P(k) at ``a`` [(Mpc/h)^3]; default our Eisenstein & Hu power.

    Returns
    -------
    ndarray
        P_NL(k) [(Mpc/h)^3], shape of ``k``.
    """
    return halofit_power_function(cosmo, a, plin)(k)


def halofit_power_function(cosmo, a=1.0, plin=None):
    """:func:`halofit_power` as a function of ``k`` alone (the nonlinear scale found once).

    Returns
    -------
    callable
        ``k`` [h/Mpc] -> P_NL(k, a) [(Mpc/h)^3].
    """
    a = float(a)
    plin = plin if plin is not None else linear_matter_power_function(cosmo, a)
    ksig, n, c = nonlinear_scale(plin)
    om = float(cm.Omega_m_a(cosmo, a))
    ode = float(cm.Omega_de_a(cosmo, a))
    wa = float(cm.w(cosmo, a))
    an = 10**(1.5222 + 2.8553 * n + 2.3706 * n**2 + 0.9903 * n**3 + 0.2250 * n**4
              - 0.6038 * c + 0.1749 * ode * (1 + wa))
    bn = 10**(-0.5642 + 0.5864 * n + 0.5716 * n**2 - 1.5474 * c + 0.2279 * ode * (1 + wa))
    cn = 10**(0.3698 + 2.0404 * n + 0.8161 * n**2 + 0.5869 * c)
    gamma = 0.1971 - 0.0843 * n + 0.8460 * c
    alpha = abs(6.0835 + 1.3373 * n - 0.1959 * n**2 - 5.5274 * c)
    beta = 2.0379 - 0.7354 * n + 0.3157 * n**2 + 1.2490 * n**3 + 0.3980 * n**4 - 0.1682 * c
    nu = 10**(5.2105 + 3.6902 * n)
    f1, f2, f3 = om**-0.0307, om**-0.0585, om**0.0743

    def power(k):
        k = cm.positive_array(k, "k")
        pl = np.asarray(plin(k), np.float64)
        d2l = k**3 * pl / (2 * np.pi**2)
        y = k / ksig
        fy = y / 4.0 + y**2 / 8.0
        d2q = d2l * (1 + d2l)**beta / (1 + alpha * d2l) * np.exp(-fy)
        d2h = an * y**(3 * f1) / (1 + bn * y**f2 + (cn * f3 * y)**(3 - gamma))
        d2h = d2h / (1 + nu / y**2)
        return (d2q + d2h) * 2 * np.pi**2 / k**3

    power.k_sigma, power.n_eff, power.curvature = ksig, n, c
    return power
