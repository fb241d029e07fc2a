r"""Background cosmology, linear growth and the linear matter power spectrum (numpy, float64).

Everything here is evaluated once, at graph-construction time, in double
precision; nothing is cached in module state: every function takes the
cosmology explicitly and recomputes what it needs (an ODE solve costs about a
millisecond).

Cosmology objects are duck-typed: any object with the attributes (or mapping
with the keys) ``Omega_c``, ``Omega_b``, ``h``, ``n_s``, ``sigma8``, ``w0``,
``wa``, ``Omega_k`` works, e.g. ``flowpm_mtf.config.Cosmology`` or a
``types.SimpleNamespace``. ``w0``, ``wa`` and ``Omega_k`` default to -1, 0, 0
when absent. The model has cold matter (``Omega_m = Omega_c + Omega_b``),
curvature and dark energy with the CPL equation of state
:math:`w(a) = w_0 + w_a (1 - a)`, ``Omega_de = 1 - Omega_m - Omega_k``, and no
radiation (as FlowPM and FastPM).

Conventions
-----------
* Distances in [Mpc/h], wavenumbers in [h/Mpc], power spectra in [(Mpc/h)^3],
  Hubble rates in units of :math:`H_0` (``E``) or [km/s/(Mpc/h)] (``H``).
* Linear growth: :math:`D_1(a=1) = 1`; :math:`D_1 \to a / D_1^{\rm raw}(1)` deep
  in matter domination.
* Second-order growth is *physical*: :math:`D_2` solves
  :math:`D_2'' + (2 + d\ln E/d\ln a) D_2' = \tfrac32 \Omega_m(a) (D_2 - D_1^2)`
  (primes: :math:`d/d\ln a`) with :math:`D_2 = -\tfrac37 D_1^2` in matter
  domination, so it is negative and :math:`D_2(1) \approx -\tfrac37
  \Omega_m^{-1/143}` (Bouchet et al. 1995). With this normalisation the 2LPT
  displacement is :math:`\Psi = -D_1 \nabla\phi^{(1)} + D_2 \nabla\phi^{(2)}`,
  :math:`\nabla^2\phi^{(1)} = \delta_L(a{=}1)`,
  :math:`\nabla^2\phi^{(2)} = \sum_{i>j} [\phi^{(1)}_{,ii}\phi^{(1)}_{,jj} -
  (\phi^{(1)}_{,ij})^2]` (Scoccimarro 1998, eqs. (A1)-(A4)): **no extra 3/7 in
  the source** (the factor is in :math:`D_2`; applying it twice is the bug
  discussed in fastpm-python issue #17).
  FlowPM (and fastpm-python) instead normalise :math:`D_2(1) = 1` and put
  :math:`+3/7` into the source; their ``D2(a)`` equals ``D2(a) / D2(1)`` here.
  Growth *rates* :math:`f_i = d\ln D_i / d\ln a` and the ratios ``gf2 / D2``
  do not depend on the normalisation.
* FastPM factors (Feng et al. 2016, eqs. 19-20, as used by ``flowpm.tfpm``):
  ``Gf = a^3 E dD1/da`` and ``gf = dGf/da`` (and ``Gf2``, ``gf2`` for
  :math:`D_2`), ``gp = dD1/da``. They enter :func:`kick_factor` and
  :func:`drift_factor`.

The Eisenstein & Hu (1998) transfer functions follow ``flowpm.tfpower`` (0.1.1)
formula by formula, with :math:`T_{\rm CMB} = 2.726` K.
"""
import logging
from dataclasses import dataclass

import numpy as np
from scipy.integrate import solve_ivp

__all__ = [
    "C_KMS", "RH", "TCMB", "Omega_m0", "Omega_de0", "w", "de_density_ratio", "E", "H",
    "dlnE_dlna", "dE_da", "Omega_m_a", "Omega_de_a", "comoving_distance",
    "transverse_comoving_distance", "angular_diameter_distance", "a_of_chi", "Growth",
    "growth", "D1", "D2", "f1", "f2", "gp", "Gf", "gf", "Gf2", "gf2", "kick_factor",
    "drift_factor", "transfer_eisenstein_hu", "sigma_r", "linear_matter_power",
    "linear_matter_power_function",
    "PowerTable", "linear_power_table", "load_power_table",
]

log = logging.getLogger(__name__)

#: Speed of light [km/s].
C_KMS = 299792.458
#: Hubble distance c/H0 [Mpc/h].
RH = C_KMS / 100.0
#: CMB temperature [K] used by the Eisenstein & Hu fitting formulae (as FlowPM).
TCMB = 2.726

# Start of the growth ODE: deep enough in matter domination that the growing-mode
# initial conditions are exact to double precision for Lambda (Omega_de(a)/Omega_m(a)
# ~ a^3), and any residual decaying mode (~a^{-3/2} relative) is negligible by a~1e-3.
_GROWTH_A_INIT = 1e-6
_GROWTH_RTOL = 1e-11
_GROWTH_ATOL = 1e-15
# Gauss-Legendre nodes for the distance integral in ln a: the integrand 1/(a E) is
# analytic in ln a, so 128 nodes reach double precision over ln a in [-20, 0].
_GL_NODES, _GL_WEIGHTS = np.polynomial.legendre.leggauss(128)
# ln k grid of the sigma(R) integral: [k] = h/Mpc. Below 1e-5 and above 1e4 the
# integrand k^3 P(k) W^2(kR) is below 1e-12 of its peak for R >= 1 Mpc/h.
_SIGMA_LNK = (np.log(1e-5), np.log(1e4), 16385)


# ----------------------------------------------------------------------- parameters
def _param(cosmo, name, default=None):
    if isinstance(cosmo, dict):
        value = cosmo.get(name, default)
    else:
        value = getattr(cosmo, name, default)
    if value is None:
        raise AttributeError("cosmology %r has no parameter %r" % (cosmo, name))
    return float(value)


def Omega_m0(cosmo):
    """Matter density today, ``Omega_c + Omega_b`` [dimensionless]."""
    return _param(cosmo, "Omega_c") + _param(cosmo, "Omega_b")


def Omega_de0(cosmo):
    """Dark energy density today, ``1 - Omega_m - Omega_k`` [dimensionless]."""
    return 1.0 - Omega_m0(cosmo) - _param(cosmo, "Omega_k", 0.0)


def _asarray(a, name="a"):
    a = np.asarray(a, dtype=np.float64)
    if np.any(~np.isfinite(a)) or np.any(a <= 0):
        raise ValueError("%s must be finite and positive, got %s" % (name, a))
    return a


def _out(x, like):
    """Return a python float for scalar input, an array of the input's shape otherwise."""
    x = np.asarray(x, dtype=np.float64).reshape(np.shape(like))
    return float(x) if x.ndim == 0 else x


# ----------------------------------------------------------------------- background
def w(cosmo, a):
    """Dark-energy equation of state :math:`w(a) = w_0 + w_a (1 - a)` [dimensionless].

    Parameters
    ----------
    cosmo : cosmology
    a : array_like
        Scale factor [dimensionless].
    """
    a = _asarray(a)
    return _out(_param(cosmo, "w0", -1.0) + _param(cosmo, "wa", 0.0) * (1.0 - a), a)


def de_density_ratio(cosmo, a):
    r"""Dark-energy density relative to today, :math:`\rho_{de}(a)/\rho_{de}(1)`.

    For CPL, :math:`a^{-3(1 + w_0 + w_a)} \exp(-3 w_a (1 - a))` [dimensionless].
    """
    a = _asarray(a)
    w0, wa = _param(cosmo, "w0", -1.0), _param(cosmo, "wa", 0.0)
    return _out(np.exp(-3.0 * (1.0 + w0 + wa) * np.log(a) - 3.0 * wa * (1.0 - a)), a)


def _e2_terms(cosmo, a):
    om, ok, ode = Omega_m0(cosmo), _param(cosmo, "Omega_k", 0.0), Omega_de0(cosmo)
    return om * a**-3, ok * a**-2, ode * np.asarray(de_density_ratio(cosmo, a))


def E(cosmo, a):
    r"""Dimensionless Hubble rate :math:`E(a) = H(a)/H_0`.

    :math:`E^2 = \Omega_m a^{-3} + \Omega_k a^{-2} + \Omega_{de}\,\rho_{de}(a)/\rho_{de}(1)`.

    Parameters
    ----------
    cosmo : cosmology
    a : array_like
        Scale factor [dimensionless].

    Returns
    -------
    float or ndarray
        E(a) [dimensionless].
    """
    a = _asarray(a)
    m, k, de = _e2_terms(cosmo, a)
    return _out(np.sqrt(m + k + de), a)


def H(cosmo, a):
    """Hubble rate :math:`100\\,E(a)` [km/s/(Mpc/h)]."""
    return _out(100.0 * np.asarray(E(cosmo, a)), np.asarray(a))


def dlnE_dlna(cosmo, a):
    r"""Logarithmic derivative :math:`d\ln E / d\ln a` [dimensionless]."""
    a = _asarray(a)
    m, k, de = _e2_terms(cosmo, a)
    dde = -3.0 * (1.0 + np.asarray(w(cosmo, a)))  # d ln rho_de / d ln a
    return _out(0.5 * (-3.0 * m - 2.0 * k + dde * de) / (m + k + de), a)


def dE_da(cosmo, a):
    """Derivative :math:`dE/da` [dimensionless]."""
    a = _asarray(a)
    return _out(np.asarray(E(cosmo, a)) * np.asarray(dlnE_dlna(cosmo, a)) / a, a)


def Omega_m_a(cosmo, a):
    r"""Matter density parameter at ``a``, :math:`\Omega_m a^{-3} / E^2` [dimensionless]."""
    a = _asarray(a)
    m, k, de = _e2_terms(cosmo, a)
    return _out(m / (m + k + de), a)


def Omega_de_a(cosmo, a):
    """Dark-energy density parameter at ``a`` [dimensionless]."""
    a = _asarray(a)
    m, k, de = _e2_terms(cosmo, a)
    return _out(de / (m + k + de), a)


# ----------------------------------------------------------------------- distances
def comoving_distance(cosmo, a):
    r"""Radial comoving distance :math:`\chi(a) = R_H \int_a^1 da'/(a'^2 E(a'))` [Mpc/h].

    Gauss-Legendre quadrature in :math:`\ln a` (double precision for
    :math:`a \gtrsim 10^{-8}`).

    Parameters
    ----------
    cosmo : cosmology
    a : array_like
        Scale factor [dimensionless], positive (``a > 1`` gives negative distances).

    Returns
    -------
    float or ndarray
        :math:`\chi` [Mpc/h], same shape as ``a``.
    """
    a = _asarray(a)
    lna = np.log(a).reshape(-1, 1)
    # map nodes from [-1, 1] to [ln a, 0]
    x = 0.5 * lna * (1.0 - _GL_NODES)
    aa = np.exp(x)
    integrand = 1.0 / (aa * np.asarray(E(cosmo, aa)))
    chi = -0.5 * lna[:, 0] * (integrand @ _GL_WEIGHTS) * RH
    return _out(chi, a)


def transverse_comoving_distance(cosmo, a):
    r"""Transverse comoving distance :math:`f_K(\chi)` [Mpc/h].

    :math:`R_H/\sqrt{\Omega_k}\,\sinh(\sqrt{\Omega_k}\chi/R_H)` for an open
    universe (``Omega_k > 0``), the ``sin`` form for a closed one, ``chi`` if flat.
    """
    chi = np.asarray(comoving_distance(cosmo, a))
    ok = _param(cosmo, "Omega_k", 0.0)
    if ok > 0:
        fk = RH / np.sqrt(ok) * np.sinh(np.sqrt(ok) * chi / RH)
    elif ok < 0:
        fk = RH / np.sqrt(-ok) * np.sin(np.sqrt(-ok) * chi / RH)
    else:
        fk = chi
    return _out(fk, np.asarray(a))


def angular_diameter_distance(cosmo, a):
    """Angular diameter distance :math:`a f_K(\\chi(a))` [Mpc/h]."""
    a = _asarray(a)
    return _out(a * np.asarray(transverse_comoving_distance(cosmo, a)), a)


def a_of_chi(cosmo, chi, a_min=1e-4):
    r"""Scale factor at radial comoving distance ``chi`` (inverse of :func:`comoving_distance`).

    A table guess refined by Newton iterations with :math:`d\chi/da = -R_H/(a^2 E)`,
    converged to a relative precision of 1e-13.

    Parameters
    ----------
    cosmo : cosmology
    chi : array_like
        Radial comoving distance [Mpc/h], ``0 <= chi <= chi(a_min)``.
    a_min : float, optional
        Smallest scale factor searched [dimensionless].

    Returns
    -------
    float or ndarray
        Scale factor [dimensionless], same shape as ``chi``.

    Raises
    ------
    ValueError
        If ``chi`` is negative or beyond :math:`\chi(a_{\min})`.
    """
    chi_in = np.asarray(chi, dtype=np.float64)
    flat = chi_in.reshape(-1)
    chi_max = comoving_distance(cosmo, a_min)
    if np.any(flat < 0) or np.any(flat > chi_max):
        raise ValueError("a_of_chi: chi must lie in [0, %.6g] Mpc/h (a >= %g), got range [%g, %g]"
                         % (chi_max, a_min, flat.min(), flat.max()))
    lna_tab = np.linspace(np.log(a_min), 0.0, 512)
    chi_tab = np.asarray(comoving_distance(cosmo, np.exp(lna_tab)))
    a = np.exp(np.interp(flat, chi_tab[::-1], lna_tab[::-1]))
    for _ in range(20):
        step = (np.asarray(comoving_distance(cosmo, a)) - flat) * a**2 * np.asarray(E(cosmo, a)) / RH
        a = np.clip(a + step, a_min, 1.0)
        if np.all(np.abs(step) <= 1e-13 * a):
            break
    return _out(a, chi_in)


# ----------------------------------------------------------------------- growth
@dataclass(frozen=True)
class Growth:
    r"""Linear and second-order growth at a set of scale factors.

    Derivatives are with respect to :math:`\ln a`; see the module docstring for
    the normalisation (:math:`D_1(1) = 1`, physical :math:`D_2 \approx -3/7 D_1^2`).

    Attributes
    ----------
    a : ndarray
        Scale factors [dimensionless].
    D1, dD1, d2D1 : ndarray
        :math:`D_1`, :math:`dD_1/d\ln a`, :math:`d^2D_1/d\ln a^2` [dimensionless].
    D2, dD2, d2D2 : ndarray
        The same for :math:`D_2` [dimensionless].
    E, dlnE : ndarray
        :math:`E(a)` and :math:`d\ln E/d\ln a` [dimensionless].
    """

    a: np.ndarray
    D1: np.ndarray
    dD1: np.ndarray
    d2D1: np.ndarray
    D2: np.ndarray
    dD2: np.ndarray
    d2D2: np.ndarray
    E: np.ndarray
    dlnE: np.ndarray

    @property
    def f1(self):
        r"""Linear growth rate :math:`d\ln D_1/d\ln a` [dimensionless]."""
        return self.dD1 / self.D1

    @property
    def f2(self):
        r"""Second-order growth rate :math:`d\ln D_2/d\ln a` [dimensionless]."""
        return self.dD2 / self.D2

    @property
    def gp(self):
        """:math:`dD_1/da` (FlowPM's ``D1f``, FastPM's ``gp``) [dimensionless]."""
        return self.dD1 / self.a

    @property
    def gp2(self):
        """:math:`dD_2/da` [dimensionless]."""
        return self.dD2 / self.a

    @property
    def Gf(self):
        """FastPM :math:`G_f = a^3 E\\, dD_1/da` [dimensionless]."""
        return self.dD1 * self.a**2 * self.E

    @property
    def Gf2(self):
        """FastPM :math:`G_{f2} = a^3 E\\, dD_2/da` [dimensionless]."""
        return self.dD2 * self.a**2 * self.E

    @property
    def gf(self):
        """FastPM :math:`g_f = dG_f/da` [dimensionless]."""
        return self.a * self.E * (self.d2D1 + self.dD1 * (2.0 + self.dlnE))

    @property
    def gf2(self):
        """FastPM :math:`g_{f2} = dG_{f2}/da` [dimensionless]."""
        return self.a * self.E * (self.d2D2 + self.dD2 * (2.0 + self.dlnE))


def _growth_rhs(cosmo):
    om, ok, ode = Omega_m0(cosmo), _param(cosmo, "Omega_k", 0.0), Omega_de0(cosmo)
    w0, wa = _param(cosmo, "w0", -1.0), _param(cosmo, "wa", 0.0)

    def rhs(lna, y):
        # inlined E^2 terms (called ~10^3 times per solve)
        a = np.exp(lna)
        m, k = om * np.exp(-3.0 * lna), ok * np.exp(-2.0 * lna)
        de = ode * np.exp(-3.0 * (1.0 + w0 + wa) * lna - 3.0 * wa * (1.0 - a))
        e2 = m + k + de
        damping = 2.0 + 0.5 * (-3.0 * m - 2.0 * k - 3.0 * (1.0 + w0 + wa * (1.0 - a)) * de) / e2
        om_a = 1.5 * m / e2
        d1, f1_, d2, f2_ = y
        return [f1_, -damping * f1_ + om_a * d1, f2_, -damping * f2_ + om_a * (d2 - d1 * d1)]
    return rhs


def growth(cosmo, a):
    """Solve the growth ODEs and return :class:`Growth` at the scale factors ``a``.

    The ODEs for :math:`D_1` and :math:`D_2` (module docstring) are integrated
    in :math:`\\ln a` from matter-dominated growing-mode initial conditions at
    :math:`a = 10^{-6}` (or below the smallest ``a``) with an 8th-order
    Runge-Kutta method (rtol 1e-11), evaluated exactly at ``a`` and at
    :math:`a = 1` for the normalisation.

    Parameters
    ----------
    cosmo : cosmology
    a : array_like
        Scale factors [dimensionless], positive.

    Returns
    -------
    Growth
        Arrays of the shape of ``a`` (flattened to 1-d for scalar input).
    """
    a = _asarray(a)
    flat = np.atleast_1d(a).reshape(-1)
    a_init = min(_GROWTH_A_INIT, 0.1 * flat.min())
    lna_eval = np.unique(np.concatenate([np.log(flat), [0.0]]))
    rhs = _growth_rhs(cosmo)
    y0 = [a_init, a_init, -3.0 / 7.0 * a_init**2, -6.0 / 7.0 * a_init**2]
    sol = solve_ivp(rhs, (np.log(a_init), lna_eval[-1]), y0, method="DOP853",
                    t_eval=lna_eval, rtol=_GROWTH_RTOL, atol=_GROWTH_ATOL)
    if not sol.success:
        raise RuntimeError("growth ODE failed: %s" % sol.message)
    y = sol.y
    dy = np.array(rhs(sol.t, y))
    i1 = np.searchsorted(sol.t, 0.0)
    norm1 = y[0, i1]
    idx = np.searchsorted(sol.t, np.log(flat))
    shape = np.shape(np.atleast_1d(a))

    def pick(row, norm):
        return (row[idx] / norm).reshape(shape)

    return Growth(
        a=np.atleast_1d(a).copy(),
        D1=pick(y[0], norm1), dD1=pick(y[1], norm1), d2D1=pick(dy[1], norm1),
        D2=pick(y[2], norm1**2), dD2=pick(y[3], norm1**2), d2D2=pick(dy[3], norm1**2),
        E=np.asarray(E(cosmo, np.atleast_1d(a))), dlnE=np.asarray(dlnE_dlna(cosmo, np.atleast_1d(a))),
    )


def _growth_attr(name):
    def fn(cosmo, a):
        return _out(getattr(growth(cosmo, a), name), np.asarray(a))
    return fn


def D1(cosmo, a):
    """Linear growth factor, normalised to :math:`D_1(1) = 1` [dimensionless]."""
    return _growth_attr("D1")(cosmo, a)


def D2(cosmo, a):
    r"""Second-order growth factor, physical normalisation :math:`\approx -3/7 D_1^2` [dimensionless]."""
    return _growth_attr("D2")(cosmo, a)


def f1(cosmo, a):
    r"""Linear growth rate :math:`d\ln D_1/d\ln a` [dimensionless]."""
    return _growth_attr("f1")(cosmo, a)


def f2(cosmo, a):
    r"""Second-order growth rate :math:`d\ln D_2/d\ln a` [dimensionless]."""
    return _growth_attr("f2")(cosmo, a)


def gp(cosmo, a):
    """:math:`dD_1/da` [dimensionless]."""
    return _growth_attr("gp")(cosmo, a)


def Gf(cosmo, a):
    """FastPM :math:`G_f = a^3 E\\, dD_1/da` [dimensionless]."""
    return _growth_attr("Gf")(cosmo, a)


def gf(cosmo, a):
    """FastPM :math:`g_f = dG_f/da` [dimensionless]."""
    return _growth_attr("gf")(cosmo, a)


def Gf2(cosmo, a):
    """FastPM :math:`G_{f2} = a^3 E\\, dD_2/da` [dimensionless] (physical :math:`D_2`)."""
    return _growth_attr("Gf2")(cosmo, a)


def gf2(cosmo, a):
    """FastPM :math:`g_{f2} = dG_{f2}/da` [dimensionless] (physical :math:`D_2`)."""
    return _growth_attr("gf2")(cosmo, a)


def kick_factor(cosmo, ai, ac, af):
    r"""FastPM kick factor from ``ai`` to ``af`` with forces at ``ac`` [dimensionless].

    :math:`(G_f(a_f) - G_f(a_i)) / (a_c^2 E(a_c) g_f(a_c))`, as ``flowpm.tfpm.kick``:
    momenta :math:`p = a^3 E\, dx/da` (mesh units, as the drift implies) change by this factor times
    the force :math:`\tfrac32\Omega_m \nabla\nabla^{-2}\delta`.
    """
    g = growth(cosmo, [ai, ac, af])
    gf_ = g.Gf
    return float((gf_[2] - gf_[0]) / (ac**2 * g.E[1] * g.gf[1]))


def drift_factor(cosmo, ai, ac, af):
    r"""FastPM drift factor from ``ai`` to ``af`` with momenta at ``ac`` [dimensionless].

    :math:`(D_1(a_f) - D_1(a_i)) / (a_c^3 E(a_c)\, dD_1/da(a_c))`, as
    ``flowpm.tfpm.drift``: positions change by this factor times the momenta.
    """
    g = growth(cosmo, [ai, ac, af])
    return float((g.D1[2] - g.D1[0]) / (ac**3 * g.E[1] * g.gp[1]))


# ----------------------------------------------------------------------- power spectrum
def transfer_eisenstein_hu(cosmo, k, kind="eisenhu_osc"):
    """Eisenstein & Hu (1998) matter transfer function [dimensionless].

    Parameters
    ----------
    cosmo : cosmology
    k : array_like
        Wavenumbers [h/Mpc], positive.
    kind : {"eisenhu_osc", "eisenhu"}
        With baryon acoustic oscillations (EH98 eqs. 11-21) or the zero-baryon
        shape with the effective shape parameter (EH98 eqs. 29-31; "no-wiggle").

    Returns
    -------
    ndarray
        T(k), normalised to 1 at k -> 0.
    """
    k = _asarray(k, "k")
    h = _param(cosmo, "h")
    om, ob = Omega_m0(cosmo), _param(cosmo, "Omega_b")
    t27 = (TCMB / 2.7)**2
    w_m, w_b = om * h**2, ob * h**2
    fb, fc = ob / om, (om - ob) / om

    k_eq = 7.46e-2 * w_m / t27 / h                                  # EH98 (3) [h/Mpc]
    z_eq = 2.50e4 * w_m / t27**2                                     # EH98 (2)
    b1 = 0.313 * w_m**-0.419 * (1.0 + 0.607 * w_m**0.674)
    b2 = 0.238 * w_m**0.223
    z_d = 1291.0 * w_m**0.251 / (1.0 + 0.659 * w_m**0.828) * (1.0 + b1 * w_b**b2)  # EH98 (4)
    R_d = 31.5 * w_b / t27**2 * (1.0e3 / z_d)                       # EH98 (5)
    R_eq = 31.5 * w_b / t27**2 * (1.0e3 / z_eq)
    sh_d = (2.0 / (3.0 * k_eq) * np.sqrt(6.0 / R_eq)                  # EH98 (6) [Mpc/h]
            * np.log((np.sqrt(1.0 + R_d) + np.sqrt(R_eq + R_d)) / (1.0 + np.sqrt(R_eq))))
    k_silk = 1.6 * w_b**0.52 * w_m**0.73 * (1.0 + (10.4 * w_m)**-0.95) / h  # EH98 (7) [h/Mpc]

    if kind == "eisenhu":
        alpha_gamma = (1.0 - 0.328 * np.log(431.0 * w_m) * w_b / w_m
                       + 0.38 * np.log(22.3 * w_m) * fb**2)
        gamma_eff = om * h * (alpha_gamma + (1.0 - alpha_gamma) / (1.0 + (0.43 * k * sh_d)**4))
        q = k * t27 / gamma_eff
        L = np.log(2.0 * np.e + 1.8 * q)
        C = 14.2 + 731.0 / (1.0 + 62.5 * q)
        return L / (L + C * q * q)
    if kind != "eisenhu_osc":
        raise ValueError("unknown transfer function kind %r (use 'eisenhu_osc' or 'eisenhu')"
                         % (kind,))

    a1 = (46.9 * w_m)**0.670 * (1.0 + (32.1 * w_m)**-0.532)          # EH98 (11)
    a2 = (12.0 * w_m)**0.424 * (1.0 + (45.0 * w_m)**-0.582)
    alpha_c = a1**-fb * a2**-(fb**3)
    bb1 = 0.944 / (1.0 + (458.0 * w_m)**-0.708)                       # EH98 (12)
    bb2 = (0.395 * w_m)**-0.0266
    beta_c = 1.0 / (1.0 + bb1 * (fc**bb2 - 1.0))

    def t_tilde(alpha, beta):                                         # EH98 (10, 19)
        q = k / (13.41 * k_eq)
        L = np.log(np.e + 1.8 * beta * q)
        C = 14.2 / alpha + 386.0 / (1.0 + 69.9 * q**1.08)
        return L / (L + C * q * q)

    f = 1.0 / (1.0 + (k * sh_d / 5.4)**4)                            # EH98 (18)
    Tc = f * t_tilde(1.0, beta_c) + (1.0 - f) * t_tilde(alpha_c, beta_c)  # EH98 (17)

    y = (1.0 + z_eq) / (1.0 + z_d)                                    # EH98 (15)
    x = np.sqrt(1.0 + y)
    G = y * (-6.0 * x + (2.0 + 3.0 * y) * np.log((x + 1.0) / (x - 1.0)))
    alpha_b = 2.07 * k_eq * sh_d * (1.0 + R_d)**-0.75 * G              # EH98 (14)
    beta_node = 8.41 * w_m**0.435                                     # EH98 (23)
    tilde_s = sh_d / (1.0 + (beta_node / (k * sh_d))**3)**(1.0 / 3.0)  # EH98 (22)
    beta_b = 0.5 + fb + (3.0 - 2.0 * fb) * np.sqrt((17.2 * w_m)**2 + 1.0)  # EH98 (24)
    ks = k * tilde_s
    Tb = ((t_tilde(1.0, 1.0) / (1.0 + (k * sh_d / 5.2)**2)               # EH98 (21)
           + alpha_b / (1.0 + (beta_b / (k * sh_d))**3) * np.exp(-(k / k_silk)**1.4))
          * np.sin(ks) / ks)
    return fb * Tb + fc * Tc                                          # EH98 (16)


def _tophat_window(x):
    """Fourier transform of a spherical top hat, 3 j1(x)/x (series below x = 1e-3)."""
    x = np.asarray(x, dtype=np.float64)
    small = x < 1e-3
    xs = np.where(small, 1.0, x)
    w_ = 3.0 * (np.sin(xs) - xs * np.cos(xs)) / xs**3
    return np.where(small, 1.0 - x**2 / 10.0, w_)


def _unnormalised_power(cosmo, k, kind):
    return k**_param(cosmo, "n_s") * transfer_eisenstein_hu(cosmo, k, kind)**2


def sigma_r(cosmo, R, kind="eisenhu_osc", k_range=None, amplitude=1.0):
    r"""RMS of the linear density in spheres of radius ``R``, for the unnormalised spectrum.

    :math:`\sigma^2(R) = \frac{A}{2\pi^2}\int d\ln k\, k^3 k^{n_s} T^2(k) W^2(kR)`
    by Simpson's rule on a fine :math:`\ln k` grid.

    Parameters
    ----------
    cosmo : cosmology
    R : float
        Radius [Mpc/h].
    kind : str, optional
        Transfer function (see :func:`transfer_eisenstein_hu`).
    k_range : (float, float), optional
        Integration range [h/Mpc] (default 1e-5 .. 1e4: converged to 1e-12).
    amplitude : float, optional
        Multiplies the primordial spectrum :math:`k^{n_s}` [(Mpc/h)^{3+n_s}].

    Returns
    -------
    float
        :math:`\sigma(R)` [dimensionless].
    """
    if k_range is None:
        lnk = np.linspace(*_SIGMA_LNK)
    else:
        lnk = np.linspace(np.log(k_range[0]), np.log(k_range[1]), _SIGMA_LNK[2])
    k = np.exp(lnk)
    integrand = k**3 * amplitude * _unnormalised_power(cosmo, k, kind) * _tophat_window(k * R)**2
    dx = lnk[1] - lnk[0]
    weights = np.ones_like(lnk)
    weights[1:-1:2], weights[2:-1:2] = 4.0, 2.0
    if len(lnk) % 2 == 0:  # Simpson needs an even number of intervals
        raise AssertionError("the sigma(R) grid must have an odd number of points")
    return float(np.sqrt(dx / 3.0 * np.sum(weights * integrand) / (2.0 * np.pi**2)))


def linear_matter_power(cosmo, k, a=1.0, kind="eisenhu_osc", sigma8_k_range=None):
    r"""Linear matter power spectrum :math:`P(k, a)` [(Mpc/h)^3].

    :math:`P = A\,k^{n_s} T^2(k) D_1^2(a)` with :math:`A` such that
    :math:`\sigma(8\,{\rm Mpc}/h) = \sigma_8` at :math:`a = 1`.

    Parameters
    ----------
    cosmo : cosmology
    k : array_like
        Wavenumbers [h/Mpc], positive.
    a : float, optional
        Scale factor [dimensionless].
    kind : {"eisenhu_osc", "eisenhu"}, optional
        Transfer function, with or without baryon wiggles.
    sigma8_k_range : (float, float), optional
        k range [h/Mpc] of the :math:`\sigma_8` integral (default: converged).
        ``flowpm.tfpower.linear_matter_power`` 0.1.1 integrates over
        ``(exp(-4), exp(3))`` (its ``log10`` bounds are used as natural-log
        bounds), which raises its amplitude by 0.36% for Planck15; pass that range to
        reproduce it.

    Returns
    -------
    ndarray
        P(k) [(Mpc/h)^3], shape of ``k``.
    """
    return linear_matter_power_function(cosmo, a, kind, sigma8_k_range)(k)


def linear_matter_power_function(cosmo, a=1.0, kind="eisenhu_osc", sigma8_k_range=None):
    r""":func:`linear_matter_power` as a function of ``k`` alone, normalised once.

    The :math:`\sigma_8` integral (~4 ms) and :math:`D_1(a)` are evaluated here, not
    at every call: for callers that evaluate P(k) many times (the ICs' amplitude,
    every run of the graph).

    Parameters
    ----------
    cosmo, a, kind, sigma8_k_range :
        As in :func:`linear_matter_power`.

    Returns
    -------
    callable
        ``k`` [h/Mpc] (array_like, positive) -> P(k, a) [(Mpc/h)^3], the same values
        as :func:`linear_matter_power`.
    """
    a = float(a)
    sigma8 = _param(cosmo, "sigma8")
    norm = (sigma8 / sigma_r(cosmo, 8.0, kind, sigma8_k_range))**2
    d1 = 1.0 if a == 1.0 else float(D1(cosmo, a))

    def power(k):
        return norm * _unnormalised_power(cosmo, _asarray(k, "k"), kind) * d1**2
    return power


class PowerTable:
    """Tabulated power spectrum with log-log interpolation that refuses to extrapolate.

    Parameters
    ----------
    k : array_like
        Wavenumbers [h/Mpc], positive and strictly increasing, at least 2.
    pk : array_like
        Power [(Mpc/h)^3], positive, same length as ``k``.

    Raises
    ------
    ValueError
        On shapes, ordering or signs that cannot be interpolated in log-log.
    """

    #: Relative slack on the table edges (rounding of k computed from a grid).
    EDGE_RTOL = 1e-10

    def __init__(self, k, pk):
        k = np.asarray(k, dtype=np.float64)
        pk = np.asarray(pk, dtype=np.float64)
        if k.ndim != 1 or pk.shape != k.shape or k.size < 2:
            raise ValueError("PowerTable needs two 1-d arrays of equal length >= 2, got shapes %s, %s"
                             % (k.shape, pk.shape))
        if not np.all(np.isfinite(k)) or not np.all(np.isfinite(pk)):
            raise ValueError("PowerTable: k and P(k) must be finite")
        if np.any(k <= 0) or np.any(np.diff(k) <= 0):
            raise ValueError("PowerTable: k must be positive and strictly increasing")
        if np.any(pk <= 0):
            raise ValueError("PowerTable: P(k) must be positive for log-log interpolation")
        self.k = k
        self.pk = pk
        self._lnk = np.log(k)
        self._lnp = np.log(pk)

    @property
    def k_range(self):
        """(k_min, k_max) of the table [h/Mpc]."""
        return float(self.k[0]), float(self.k[-1])

    def __call__(self, k, zero_at_k0=True):
        """Interpolate P(k) [(Mpc/h)^3] at ``k`` [h/Mpc].

        Parameters
        ----------
        k : array_like
            Wavenumbers [h/Mpc].
        zero_at_k0 : bool, optional
            Return 0 at ``k == 0`` (the mean mode of a periodic box carries no
            power) instead of raising.

        Raises
        ------
        ValueError
            If any ``k`` (other than 0 with ``zero_at_k0``) is outside the table's
            k range; the message gives both ranges.
        """
        k = np.asarray(k, dtype=np.float64)
        zero = (k == 0) if zero_at_k0 else np.zeros(k.shape, bool)
        kk = k[~zero]
        lo, hi = self.k_range
        if kk.size and (np.any(~np.isfinite(kk)) or kk.min() < lo * (1 - self.EDGE_RTOL)
                        or kk.max() > hi * (1 + self.EDGE_RTOL)):
            raise ValueError(
                "P(k) requested for k in [%.6g, %.6g] h/Mpc, outside the table's range "
                "[%.6g, %.6g] h/Mpc; extend the table (no extrapolation is done)"
                % (kk.min(), kk.max(), lo, hi))
        out = np.zeros(k.shape, dtype=np.float64)
        out[~zero] = np.exp(np.interp(np.log(np.clip(kk, lo, hi)), self._lnk, self._lnp))
        return out

    def save(self, path, header="k [h/Mpc]  P(k) [(Mpc/h)^3]"):
        """Write the table as two text columns (readable by :func:`load_power_table`)."""
        np.savetxt(path, np.column_stack([self.k, self.pk]), header=header)


def linear_power_table(cosmo, k_min=1e-4, k_max=1e2, n=1024, a=1.0, kind="eisenhu_osc"):
    """:class:`PowerTable` of :func:`linear_matter_power` on ``n`` log-spaced k.

    Parameters
    ----------
    k_min, k_max : float
        Range [h/Mpc].
    n : int
        Number of points.
    a, kind :
        As in :func:`linear_matter_power`.
    """
    k = np.logspace(np.log10(k_min), np.log10(k_max), n)
    return PowerTable(k, linear_matter_power(cosmo, k, a=a, kind=kind))


def load_power_table(path):
    """Read a power spectrum from a text file of two columns, k [h/Mpc] and P [(Mpc/h)^3].

    Lines starting with ``#`` are comments; extra columns are ignored.

    Raises
    ------
    ValueError
        If the file has fewer than two columns or rows, or the values cannot be
        interpolated (see :class:`PowerTable`).
    """
    data = np.loadtxt(path, comments="#", ndmin=2)
    if data.shape[1] < 2 or data.shape[0] < 2:
        raise ValueError("%s: expected at least 2 rows of 2 columns (k, P), got shape %s"
                         % (path, data.shape))
    log.debug("loaded P(k) table %s: %d rows, k in [%g, %g] h/Mpc", path, data.shape[0],
              data[0, 0], data[-1, 0])
    return PowerTable(data[:, 0], data[:, 1])
