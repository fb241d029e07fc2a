r"""The linear matter power spectrum (numpy, float64): transfer function, sigma_8, tables.

* :func:`transfer_eisenstein_hu`: the Eisenstein & Hu (1998) transfer functions,
  following ``flowpm.tfpower`` (0.1.1) formula by formula, with
  :math:`T_{\rm CMB} = 2.726` K;
* :func:`sigma_r`: the rms of the linear density in a top-hat sphere, which
  normalises the spectrum to ``sigma8``;
* :func:`linear_matter_power` (and :func:`linear_matter_power_function`, which
  normalises once): :math:`P(k, a) = A\,k^{n_s} T^2(k) D_1^2(a)`;
* :class:`PowerTable`, :func:`linear_power_table`, :func:`load_power_table`: a
  tabulated spectrum (e.g. from a Boltzmann code) in place of the fitting formula.

Units as in :mod:`flowpm_mtf.physics.cosmology`: wavenumbers in [h/Mpc], radii in
[Mpc/h], power spectra in [(Mpc/h)^3]. The cosmology is duck-typed the same way
and the growth :math:`D_1` comes from :func:`flowpm_mtf.physics.cosmology.D1`.
"""
import logging

import numpy as np

from . import cosmology as cm

__all__ = ["TCMB", "trapezoid", "transfer_eisenstein_hu", "sigma_r", "linear_matter_power",
           "linear_matter_power_function", "PowerTable", "linear_power_table", "load_power_table"]

log = logging.getLogger(__name__)

#: CMB temperature [K] used by the Eisenstein & Hu fitting formulae (as FlowPM).
TCMB = 2.726
# ln k grid of the sigma(R) integral: [k] = h/Mpc. Below 1e-5 and above 1e4 the
# integrand k^3 P(k) W^2(kR) is below 1e-12 of its peak for R >= 1 Mpc/h.
_SIGMA_LNK = (np.log(1e-5), np.log(1e4), 16385)


trapezoid = getattr(np, "trapezoid", None) or np.trapz
"""numpy's trapezoidal rule on both stacks: ``np.trapezoid`` (numpy 2 renamed ``trapz``, and
2.4 removed the old name), ``np.trapz`` on numpy 1.24 (the TF 2.12 stack), which has no
``trapezoid``. The one place the package takes it from (:mod:`~flowpm_mtf.physics.sizing`,
:mod:`~flowpm_mtf.runs.preflight`, :mod:`~flowpm_mtf.physics.halofit`)."""


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
    k = cm.positive_array(k, "k")
    h = cm.param(cosmo, "h")
    om, ob = cm.Omega_m0(cosmo), cm.param(cosmo, "Omega_b")
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
    return k**cm.param(cosmo, "n_s") * transfer_eisenstein_hu(cosmo, k, kind)**2


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
    norm = _sigma8_normalisation(cosmo, kind, sigma8_k_range)
    d1 = _growth_at(cosmo, a)

    def power(k):
        return norm * _unnormalised_power(cosmo, cm.positive_array(k, "k"), kind) * d1**2
    return power


def linear_matter_power_functions(cosmo, scale_factors, kind="eisenhu_osc",
                                  sigma8_k_range=None, max_grids=8):
    r""":func:`linear_matter_power_function` at several scale factors, sharing what does
    not depend on ``a``.

    The :math:`\sigma_8` integral is evaluated once, and the transfer function once per
    distinct ``k`` array (compared by value) for all of them: for callers that evaluate
    every scale factor's P(k) on the same few grids (the lensing predictions: one
    halofit spectrum per lens plane). Each function returns the same values, to the
    bit, as :func:`linear_matter_power_function` at its ``a``.

    Parameters
    ----------
    cosmo, kind, sigma8_k_range :
        As in :func:`linear_matter_power`.
    scale_factors : sequence of float
        [dimensionless].
    max_grids : int
        How many ``k`` arrays' transfer functions are kept (the oldest is dropped
        beyond): the memory is bounded whatever the callers evaluate.

    Returns
    -------
    list of callable
        Per scale factor, ``k`` [h/Mpc] (array_like, positive) -> P(k, a)
        [(Mpc/h)^3].
    """
    norm = _sigma8_normalisation(cosmo, kind, sigma8_k_range)
    kept = {}

    def normalised(k):   # norm * k^n_s T(k)^2, as linear_matter_power_function's
        key = (k.shape, k.dtype.str, k.tobytes())
        if key not in kept:
            if len(kept) >= max_grids:
                del kept[next(iter(kept))]
            kept[key] = norm * _unnormalised_power(cosmo, k, kind)
        return kept[key]

    def at(a):
        d1 = _growth_at(cosmo, float(a))

        def power(k):
            return normalised(cm.positive_array(k, "k")) * d1**2
        return power
    return [at(a) for a in scale_factors]


def _sigma8_normalisation(cosmo, kind, sigma8_k_range):
    """The amplitude that gives the unnormalised spectrum its ``sigma8``."""
    return (cm.param(cosmo, "sigma8") / sigma_r(cosmo, 8.0, kind, sigma8_k_range))**2


def _growth_at(cosmo, a):
    """D1(a), exactly 1 at a = 1 (no ODE solve)."""
    return 1.0 if a == 1.0 else float(cm.D1(cosmo, a))


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
