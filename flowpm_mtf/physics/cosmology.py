r"""Background cosmology, distances and linear growth (numpy, float64).

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

The linear matter power spectrum (Eisenstein & Hu transfer functions, the sigma_8
normalisation, tables) is in :mod:`flowpm_mtf.physics.linear_power`.
"""
import logging
import math
from dataclasses import dataclass

import numpy as np

__all__ = [
    "C_KMS", "RH", "Omega_m0", "Omega_de0", "w", "de_density_ratio", "E", "H",
    "dlnE_dlna", "dE_da", "Omega_m_a", "Omega_de_a", "comoving_distance",
    "transverse_comoving_distance", "angular_diameter_distance", "a_of_chi", "Growth",
    "growth", "D1", "D2", "f1", "f2", "gp", "Gf", "gf", "Gf2", "gf2", "kick_factor",
    "drift_factor", "param", "positive_array",
]

log = logging.getLogger(__name__)

#: Speed of light [km/s].
C_KMS = 299792.458
#: Hubble distance c/H0 [Mpc/h].
RH = C_KMS / 100.0

# Start of the growth ODE: deep enough in matter domination that the growing-mode
# initial conditions are exact to double precision for Lambda (Omega_de(a)/Omega_m(a)
# ~ a^3), and any residual decaying mode (~a^{-3/2} relative) is negligible by a~1e-3.
_GROWTH_A_INIT = 1e-6
# Tolerances of the solver on u = D1 / a, v = D2 / a^2 and their derivatives in ln a: u and
# v are of order 1 (u = 1, v = -3/7 in matter domination), their derivatives 0 there, so
# the absolute tolerance is the relative one (a smaller one would only shorten the steps
# of matter domination, where the derivatives are ~Omega_de a^3).
_GROWTH_RTOL = 1e-11
_GROWTH_ATOL = 1e-11
# Longest step [in ln a]: the interpolation between steps stays at the solver's accuracy.
_GROWTH_H_MAX = 0.25
# Dormand-Prince 5(4) tableau (Dormand & Prince 1980): nodes, stages, 5th-order weights
# (= the last stage's row, first same as last) and the 5th minus 4th-order weights.
_DP_C = (0.0, 1 / 5, 3 / 10, 4 / 5, 8 / 9, 1.0, 1.0)
_DP_A = ((), (1 / 5,), (3 / 40, 9 / 40), (44 / 45, -56 / 15, 32 / 9),
         (19372 / 6561, -25360 / 2187, 64448 / 6561, -212 / 729),
         (9017 / 3168, -355 / 33, 46732 / 5247, 49 / 176, -5103 / 18656),
         (35 / 384, 0.0, 500 / 1113, 125 / 192, -2187 / 6784, 11 / 84))
_DP_E = (71 / 57600, 0.0, -71 / 16695, 71 / 1920, -17253 / 339200, 22 / 525, -1 / 40)
# Gauss-Legendre nodes for the distance integral in ln a: the integrand 1/(a E) is
# analytic in ln a, so 128 nodes reach double precision over ln a in [-20, 0].
_GL_NODES, _GL_WEIGHTS = np.polynomial.legendre.leggauss(128)


# ----------------------------------------------------------------------- parameters
def param(cosmo, name, default=None):
    """The parameter ``name`` of a duck-typed cosmology (attribute or mapping key), as a float.

    Parameters
    ----------
    cosmo : object or dict
        Any object with the attribute, or mapping with the key, ``name``.
    name : str
    default : float, optional
        Used when the cosmology lacks ``name``.

    Raises
    ------
    AttributeError
        If the parameter is absent and there is no default.
    """
    if isinstance(cosmo, dict):
        value = cosmo.get(name, default)
    else:
        value = getattr(cosmo, name, default)
    if value is None:
        raise AttributeError("cosmology %r has no parameter %r" % (cosmo, name))
    return float(value)


def Omega_m0(cosmo):
    """Matter density today, ``Omega_c + Omega_b`` [dimensionless]."""
    return param(cosmo, "Omega_c") + param(cosmo, "Omega_b")


def Omega_de0(cosmo):
    """Dark energy density today, ``1 - Omega_m - Omega_k`` [dimensionless]."""
    return 1.0 - Omega_m0(cosmo) - param(cosmo, "Omega_k", 0.0)


def positive_array(a, name="a"):
    """``a`` as a float64 array; ValueError naming ``name`` unless finite and positive."""
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
    a = positive_array(a)
    return _out(param(cosmo, "w0", -1.0) + param(cosmo, "wa", 0.0) * (1.0 - a), a)


def de_density_ratio(cosmo, a):
    r"""Dark-energy density relative to today, :math:`\rho_{de}(a)/\rho_{de}(1)`.

    For CPL, :math:`a^{-3(1 + w_0 + w_a)} \exp(-3 w_a (1 - a))` [dimensionless].
    """
    a = positive_array(a)
    w0, wa = param(cosmo, "w0", -1.0), param(cosmo, "wa", 0.0)
    return _out(np.exp(-3.0 * (1.0 + w0 + wa) * np.log(a) - 3.0 * wa * (1.0 - a)), a)


def _e2_terms(cosmo, a):
    om, ok, ode = Omega_m0(cosmo), param(cosmo, "Omega_k", 0.0), Omega_de0(cosmo)
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
    a = positive_array(a)
    m, k, de = _e2_terms(cosmo, a)
    return _out(np.sqrt(m + k + de), a)


def H(cosmo, a):
    """Hubble rate :math:`100\\,E(a)` [km/s/(Mpc/h)]."""
    return _out(100.0 * np.asarray(E(cosmo, a)), np.asarray(a))


def dlnE_dlna(cosmo, a):
    r"""Logarithmic derivative :math:`d\ln E / d\ln a` [dimensionless]."""
    a = positive_array(a)
    m, k, de = _e2_terms(cosmo, a)
    dde = -3.0 * (1.0 + np.asarray(w(cosmo, a)))  # d ln rho_de / d ln a
    return _out(0.5 * (-3.0 * m - 2.0 * k + dde * de) / (m + k + de), a)


def dE_da(cosmo, a):
    """Derivative :math:`dE/da` [dimensionless]."""
    a = positive_array(a)
    return _out(np.asarray(E(cosmo, a)) * np.asarray(dlnE_dlna(cosmo, a)) / a, a)


def Omega_m_a(cosmo, a):
    r"""Matter density parameter at ``a``, :math:`\Omega_m a^{-3} / E^2` [dimensionless]."""
    a = positive_array(a)
    m, k, de = _e2_terms(cosmo, a)
    return _out(m / (m + k + de), a)


def Omega_de_a(cosmo, a):
    """Dark-energy density parameter at ``a`` [dimensionless]."""
    a = positive_array(a)
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
    a = positive_array(a)
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
    ok = param(cosmo, "Omega_k", 0.0)
    if ok > 0:
        fk = RH / np.sqrt(ok) * np.sinh(np.sqrt(ok) * chi / RH)
    elif ok < 0:
        fk = RH / np.sqrt(-ok) * np.sin(np.sqrt(-ok) * chi / RH)
    else:
        fk = chi
    return _out(fk, np.asarray(a))


def angular_diameter_distance(cosmo, a):
    """Angular diameter distance :math:`a f_K(\\chi(a))` [Mpc/h]."""
    a = positive_array(a)
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
    """``rhs(lna, y)`` of the growth ODEs in ``y = (u, u', v, v')``, ``u = D_1 / a`` and
    ``v = D_2 / a^2`` (``'`` = d/d ln a): constant in matter domination, where ``D_1 = a``
    and ``D_2 = -3/7 a^2``, so the solver's steps are long until dark energy matters."""
    om, ok, ode = Omega_m0(cosmo), param(cosmo, "Omega_k", 0.0), Omega_de0(cosmo)
    w0, wa = param(cosmo, "w0", -1.0), param(cosmo, "wa", 0.0)

    def rhs(lna, y):
        # inlined E^2 terms, in Python floats (called ~10^3 times per solve, on 4 numbers)
        a = math.exp(lna)
        m, k = om * math.exp(-3.0 * lna), ok * math.exp(-2.0 * lna)
        de = ode * math.exp(-3.0 * (1.0 + w0 + wa) * lna - 3.0 * wa * (1.0 - a))
        e2 = m + k + de
        damping = 2.0 + 0.5 * (-3.0 * m - 2.0 * k - 3.0 * (1.0 + w0 + wa * (1.0 - a)) * de) / e2
        om_a = 1.5 * m / e2
        u, du, v, dv = y
        # D'' + damping D' = om_a D and D2'' + damping D2' = om_a (D2 - D1^2), rewritten
        return (du, -(2.0 + damping) * du - (1.0 + damping - om_a) * u,
                dv, -(4.0 + damping) * dv - (4.0 + 2.0 * damping - om_a) * v - om_a * u * u)
    return rhs


def _dopri5(rhs, t0, y0, t_end, rtol, atol, h_max):
    """Integrate ``y' = rhs(t, y)`` from ``t0`` to ``t_end`` with the adaptive
    Dormand-Prince 5(4) method (local extrapolation, first same as last; steps of at most
    ``h_max``). Returns the accepted steps' ends ``t``, ``y`` and ``rhs(t, y)``
    (``[m]``, ``[len(y0), m]``, ``[len(y0), m]``). In Python floats: the system is a handful
    of numbers, for which numpy's per-call overhead would dominate."""
    t, y = float(t0), tuple(float(v) for v in y0)
    n = len(y)
    k1 = rhs(t, y)
    ts, ys, fs = [t], [y], [k1]
    h = 1e-2
    while t < t_end:
        last = t + h >= t_end
        step = t_end - t if last else h
        ks = [k1]
        for c, row in zip(_DP_C[1:], _DP_A[1:]):
            yi = tuple(y[j] + step * sum(a_ * k[j] for a_, k in zip(row, ks) if a_)
                       for j in range(n))
            ks.append(rhs(t + step * c, yi))
        # yi is the 5th-order solution (the last row is its weights), ks[-1] its rhs
        norm = math.sqrt(sum(
            (step * sum(e * k[j] for e, k in zip(_DP_E, ks) if e)
             / (atol + rtol * max(abs(y[j]), abs(yi[j])))) ** 2 for j in range(n)) / n)
        if not math.isfinite(norm):
            raise RuntimeError("growth ODE failed: non-finite step at ln a = %g" % t)
        if norm <= 1.0:
            t, y, k1 = (t_end if last else t + step), yi, ks[-1]
            ts.append(t), ys.append(y), fs.append(k1)
        h = min(h_max, step * min(5.0, max(0.2, 0.9 * max(norm, 1e-10) ** -0.2)))
        if h < 1e-12:
            raise RuntimeError("growth ODE failed: step size underflow at ln a = %g" % t)
    return np.array(ts), np.array(ys).T, np.array(fs).T


def _hermite5(t, ts, y, dy, d2y):
    """The quintic Hermite interpolant of ``y`` (with its first and second derivatives
    ``dy``, ``d2y`` at the nodes ``ts``) and its derivative, at ``t`` (in ``ts``' range)."""
    i = np.clip(np.searchsorted(ts, t, side="right") - 1, 0, len(ts) - 2)
    h = ts[i + 1] - ts[i]
    s = (t - ts[i]) / h
    s2, s3 = s * s, s * s * s
    s4, s5 = s3 * s, s3 * s2
    basis = (1 - 10 * s3 + 15 * s4 - 6 * s5, s - 6 * s3 + 8 * s4 - 3 * s5,
             0.5 * (s2 - 3 * s3 + 3 * s4 - s5), 10 * s3 - 15 * s4 + 6 * s5,
             -4 * s3 + 7 * s4 - 3 * s5, 0.5 * (s3 - 2 * s4 + s5))
    dbasis = (-30 * s2 + 60 * s3 - 30 * s4, 1 - 18 * s2 + 32 * s3 - 15 * s4,
              0.5 * (2 * s - 9 * s2 + 12 * s3 - 5 * s4), 30 * s2 - 60 * s3 + 30 * s4,
              -12 * s2 + 28 * s3 - 15 * s4, 0.5 * (3 * s2 - 8 * s3 + 5 * s4))
    nodes = (y[i], h * dy[i], h * h * d2y[i], y[i + 1], h * dy[i + 1], h * h * d2y[i + 1])
    return (sum(b * v for b, v in zip(basis, nodes)),
            sum(b * v for b, v in zip(dbasis, nodes)) / h)


def growth(cosmo, a):
    """Solve the growth ODEs and return :class:`Growth` at the scale factors ``a``.

    The ODEs for :math:`D_1` and :math:`D_2` (module docstring) are integrated for
    :math:`D_1 / a` and :math:`D_2 / a^2` in :math:`\\ln a` from matter-dominated
    growing-mode initial conditions at :math:`a = 10^{-6}` (or below the smallest ``a``)
    with an adaptive Dormand-Prince 5(4) Runge-Kutta method (rtol 1e-11) to
    :math:`\\max(1, a)`, and read at ``a`` by quintic Hermite interpolation between its
    steps (values, first and second derivatives at both ends).

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
    a = positive_array(a)
    flat = np.atleast_1d(a).reshape(-1)
    a_init = min(_GROWTH_A_INIT, 0.1 * flat.min())
    lna = np.concatenate([np.log(flat), [0.0]])
    rhs = _growth_rhs(cosmo)
    ts, y, f = _dopri5(rhs, np.log(a_init), [1.0, 0.0, -3.0 / 7.0, 0.0], lna.max(),
                       _GROWTH_RTOL, _GROWTH_ATOL, _GROWTH_H_MAX)
    u, du = _hermite5(lna, ts, y[0], y[1], f[1])
    v, dv = _hermite5(lna, ts, y[2], y[3], f[3])
    # the second derivatives from the ODEs themselves (vectorised rhs)
    ae = np.exp(lna)
    damping, om_a = 2.0 + dlnE_dlna(cosmo, ae), 1.5 * Omega_m_a(cosmo, ae)
    d2u = -(2.0 + damping) * du - (1.0 + damping - om_a) * u
    d2v = -(4.0 + damping) * dv - (4.0 + 2.0 * damping - om_a) * v - om_a * u * u
    # back to D1, D2 and their first two derivatives in ln a; the last entry is a = 1
    rows = (ae * u, ae * (u + du), ae * (u + 2.0 * du + d2u),
            ae**2 * v, ae**2 * (2.0 * v + dv), ae**2 * (4.0 * v + 4.0 * dv + d2v))
    norm1 = rows[0][-1]
    shape = np.shape(np.atleast_1d(a))

    def pick(row, norm):
        return (row[:-1] / norm).reshape(shape)

    return Growth(
        a=np.atleast_1d(a).copy(),
        D1=pick(rows[0], norm1), dD1=pick(rows[1], norm1), d2D1=pick(rows[2], norm1),
        D2=pick(rows[3], norm1**2), dD2=pick(rows[4], norm1**2), d2D2=pick(rows[5], norm1**2),
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
