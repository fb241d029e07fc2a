r"""The expected convergence power of a lensing run: Limber through the run's windows.

:func:`flowpm_mtf.physics.lensing_stats.limber_cl` is the textbook Limber sum. What
:func:`flowpm_mtf.physics.lensing_stats.kappa_power_spectrum` measures on a map of a
lensing run differs from it by the windows and the noise below, all of them applied here to the prediction (``C_ell_limber``, ``C_ell_halofit``),
and undone from the data by :func:`sky_cl` (``C_ell_sky``, comparable with the
continuum columns ``C_ell_limber_cont``, ``C_ell_halofit_cont``):

1. **Shell thickness** in the periodic box: a plane averages the k_z modes
   with sinc^2 weights (:func:`shell_power`).
2. **Plane painting at the rays' resolution**
   (:func:`flowpm_mtf.physics.lensing.ray_born_terms`): an angular CIC window,
   :func:`pixel_window`, the same for every plane.
3. **Shot noise**: each particle's own footprint adds white noise through that
   window (:func:`shot_noise_cl`, exact in expectation for any arrangement);
   the continuous P(k) is the run's measured 3D grid P(k) deconvolved
   (:func:`true_power`) minus :math:`1/\bar n` (:func:`pair_power`).
4. **Ray sampling**: the map samples the field at the pixel centres, so its
   power is folded at the pixel Nyquist :math:`\ell_N = \pi/\Delta\theta`.
5. **Taper**: the estimator multiplies the map by a cosine taper; its
   expectation is the aliased power convolved with :math:`|\tilde w|^2`
   (mode coupling: +10 % at :math:`\ell` 200-1300 for the default run's steep
   spectrum). :func:`coupling_matrix` (MASTER) and :func:`decouple` undo it.

So the measured :math:`\hat C_\ell` and :func:`expected_cl` agree in expectation
at every :math:`\ell` where the run's P(k) is known (below the 3D mesh's Nyquist
frequency; a power law beyond it); the ratio is the self-check of a run. A bin is
**resolved** where the windows keep half of C_ell (:data:`RESOLVED_WINDOW`) and
half of C_ell comes from wavenumbers the PM force resolves
(:func:`mesh_share`, :data:`RESOLVED_K_NYQUIST`; with PGD, :data:`RESOLVED_K_NYQUIST_PGD`):
:func:`resolved_range`.
(The bilinear-readout windows of planes on the PM mesh, :func:`plane_grid_power`,
are kept for :func:`flowpm_mtf.physics.lensing.born_convergence`'s users.)
"""
import logging

import numpy as np

from . import halofit as halofit_mod
from . import lensing_geometry, lensing_stats, linear_power
# the flat-sky estimator's modes, bins and mode coupling (MASTER), re-exported here
from .lensing_master import (DEFAULT_PAD, _mode_bins, bin_average, coupling_matrix,  # noqa: F401
                             decouple, expected_pseudo_cl)

__all__ = ["RESOLVED_WINDOW", "true_power", "plane_grid_power", "pixel_window", "continuous_cl",
           "shell_power", "expected_pseudo_cl", "expected_cl", "window_factor", "resolved_range",
           "RESOLVED_MESH_SHARE", "RESOLVED_K_NYQUIST", "RESOLVED_K_NYQUIST_PGD", "mean_density",
           "grid_shot_noise", "shot_noise_cl", "pair_power", "mesh_share", "coupling_matrix",
           "decouple", "sky_cl", "bin_average", "run_prediction", "DEFAULT_PAD"]

log = logging.getLogger(__name__)

# A bin is "resolved" when the windows keep at least this fraction of the continuous C_ell
# (beyond, a deconvolution would more than double the noise and rest on the extrapolation of
# P(k) beyond the mesh Nyquist frequency).
RESOLVED_WINDOW = 0.5
# ... and when at least this share of the continuous C_ell comes from wavenumbers below
# RESOLVED_K_NYQUIST of the PM mesh's Nyquist frequency (mesh_share): there the PM's P(k)
# stayed within ~10 % of halofit in the default run (0.91-0.97 at k <= 0.17 h/Mpc = 0.22 k_N,
# 0.79 at 0.32 k_N: the PM force's own resolution).
RESOLVED_MESH_SHARE = 0.5
RESOLVED_K_NYQUIST = 0.25
# With the PGD correction (--pgd, flowpm_mtf/physics/pgd.py) the particles' P(k) is fitted to
# halofit over 0.25-0.75 of the Nyquist frequency, and stays there within ~12 % at 1, 2 and
# 4 Mpc/h cells (results/fit_pgd_*.md): the PM's P(k) is known up to the fit range's end.
RESOLVED_K_NYQUIST_PGD = 0.75
# Fixed-point iterations of the 3D CIC deconvolution (true_power): converged to < 1e-4 in 4
# on the default run's tables.
_DECONV_ITERS = 6
# Gauss-Legendre nodes in mu (and as many azimuths, one octant) for angle averages in 3D.
_N_DIR = 8
# Images per axis summed in the grid powers (+-1: the CIC weight of the second image is
# sinc^4(5 pi/2) < 3e-3 of the first).
_IMAGES = 1
# Line-of-sight modes of shell_power summed one by one (the rest as an integral).
_M_DENSE = 256


def _w2(k, d):
    """CIC power window of one axis, sinc^4(k d / 2) (np.sinc(x) = sin(pi x)/(pi x))."""
    return np.sinc(k * d / (2.0 * np.pi))**4


def _power_fn(k_tab, p_tab, slope=None):
    """Log-log interpolation of a table; a power law above its end (slope fitted to the last
    eighth of the table, at most -1 so that image sums converge); 0 below half the first
    wavenumber (the box has no mode between 0 and its fundamental)."""
    lk, lp = np.log(k_tab), np.log(p_tab)
    if slope is None:
        m = max(3, k_tab.size // 8)
        slope = min(float(np.polyfit(lk[-m:], lp[-m:], 1)[0]), -1.0)

    def f(k):
        k = np.asarray(k, np.float64)
        out = np.exp(np.interp(np.log(np.maximum(k, k_tab[0])), lk, lp))
        hi = k > k_tab[-1]
        out[hi] = p_tab[-1] * (k[hi] / k_tab[-1])**slope
        out[k < 0.5 * k_tab[0]] = 0.0
        return out

    f.slope = slope
    return f


def _directions():
    """Unit vectors of one octant and their weights (Gauss-Legendre in mu, uniform in phi)."""
    mu, wmu = np.polynomial.legendre.leggauss(2 * _N_DIR)
    sel = mu > 0
    mu, wmu = mu[sel], wmu[sel]
    phi = (np.arange(_N_DIR) + 0.5) * (0.5 * np.pi / _N_DIR)
    s = np.sqrt(1.0 - mu**2)
    u = np.stack([np.outer(s, np.cos(phi)), np.outer(s, np.sin(phi)),
                  np.outer(mu, np.ones(_N_DIR))], -1).reshape(-1, 3)
    w = np.repeat(wmu, _N_DIR)
    return u, w / w.sum()


def _grid_power_3d(k, pfun, cell):
    """Angle average of the 3D CIC grid power sum_n W^2(k+2kN n) P(|k + 2kN n|)."""
    u, w = _directions()
    kv = k[:, None, None] * u[None]
    knyq = np.pi / np.asarray(cell, np.float64)
    tot = 0.0
    rng = range(-_IMAGES, _IMAGES + 1)
    for n in np.array(np.meshgrid(rng, rng, rng, indexing="ij")).reshape(3, -1).T:
        q = kv + 2.0 * knyq * n
        win = _w2(q[..., 0], cell[0]) * _w2(q[..., 1], cell[1]) * _w2(q[..., 2], cell[2])
        tot = tot + win * pfun(np.sqrt(np.sum(q**2, -1)))
    return np.sum(tot * w, -1)


def true_power(k_tab, p_tab, conf):
    r"""The continuous 3D power whose CIC grid power is the measured table (numpy).

    The run's P(k) is measured on the 3D CIC grid without deconvolution: its
    expectation is the angle average of :math:`\sum_{\mathbf n}W^2(\mathbf k +
    2k_N\mathbf n) P(|\mathbf k + 2k_N\mathbf n|)`. This inverts it by fixed-point
    iteration on the table's nodes, with :math:`P` a power law beyond the
    table (slope of the last eighth of the table, at most -1).

    Parameters
    ----------
    k_tab, p_tab : array_like
        Increasing wavenumbers [h/Mpc] and the measured grid power [(Mpc/h)^3]
        (non-empty bins only).
    conf : SimConfig
        Cell sizes.

    Returns
    -------
    callable
        ``P(k)`` [(Mpc/h)^3] for any array of ``k`` [h/Mpc] (0 at k = 0).
    """
    k_tab = np.asarray(k_tab, np.float64)
    p_meas = np.asarray(p_tab, np.float64)
    if k_tab.ndim != 1 or k_tab.size < 3 or np.any(np.diff(k_tab) <= 0) or np.any(p_meas <= 0):
        raise ValueError("true_power: need >= 3 increasing k with positive P, got %d bins"
                         % k_tab.size)
    cell = np.asarray(conf.cell_size, np.float64)
    p = p_meas.copy()
    for _ in range(_DECONV_ITERS):
        p = p * p_meas / _grid_power_3d(k_tab, _power_fn(k_tab, p), cell)
    return _power_fn(k_tab, p)


def shell_power(pfun, width, depth, k_min=1e-4, k_max=1e2, n_k=512):
    r"""The 3D power seen by a shell of thickness ``width`` in a box of depth ``depth``.

    A plane is the density averaged over its shell, :math:`ar\delta =
    \Delta r^{-1}\int_{
m shell}\delta\,dz`, in a box periodic along the line of
    sight: its 2D power at :math:`k_\perp` is :math:`P_s(k_\perp)/\Delta r` with

    .. math::

        P_s(k_\perp) = rac{\Delta r}{L_z}\sum_m \mathrm{sinc}^2\Big(rac{\pi m
            \Delta r}{L_z}\Big)\, P\Big(\sqrt{k_\perp^2 + (2\pi m/L_z)^2}\Big),

    whose weights sum to 1 (Poisson summation, :math:`\Delta r \le L_z`): Limber's
    :math:`P(k_\perp)` when :math:`k_\perp\Delta r \gg 1`, less at low
    :math:`k_\perp` (-4 % at :math:`k_\perp` = 0.1 h/Mpc for 192 Mpc/h shells).

    Parameters
    ----------
    pfun : callable
        Continuous 3D power [(Mpc/h)^3].
    width, depth : float
        Shell thickness and box depth along the line of sight [Mpc/h].
    k_min, k_max, n_k :
        Log-spaced table on which ``P_s`` is computed [h/Mpc] (log-log
        interpolated in between, 0 outside).

    Returns
    -------
    callable
        ``P_s(k_perp)`` [(Mpc/h)^3].
    """
    kt = np.logspace(np.log10(k_min), np.log10(k_max), n_k)
    # |m| <= _M_DENSE summed term by term; beyond, as an integral over m (log-spaced) of the
    # sinc^2 averaged over its oscillation, 1 / (2 (pi m width/depth)^2), both signs of m.
    m = np.arange(-_M_DENSE, _M_DENSE + 1, dtype=np.float64)
    wm = width / depth * np.sinc(m * width / depth)**2
    m_far = max(4.0 * k_max * depth / (2.0 * np.pi), 2.0 * _M_DENSE)  # kz up to 4 k_max
    edges = np.logspace(np.log10(_M_DENSE + 0.5), np.log10(m_far), 97)
    mt = np.sqrt(edges[1:] * edges[:-1])
    wt = 2.0 * np.diff(edges) * width / depth / (2.0 * (np.pi * mt * width / depth)**2)
    m, wm = np.concatenate([m, mt]), np.concatenate([wm, wt])
    kz = 2.0 * np.pi * m / depth
    # one call of pfun on the [n_k, m] table (not one per k: pfun is numpy throughout)
    ps = np.sum(wm * pfun(np.sqrt(kt[:, None]**2 + kz[None, :]**2)), axis=1)
    good = ps > 0
    lk, lp = np.log(kt[good]), np.log(ps[good])

    def f(k):
        k = np.asarray(k, np.float64)
        out = np.exp(np.interp(np.log(np.maximum(k, 1e-300)), lk, lp))
        out[(k < kt[good][0]) | (k > k_max)] = 0.0
        return out

    return f


def plane_grid_power(kx, ky, pfun, cell_xy):
    r"""Power of a CIC-painted plane's grid at transverse ``(kx, ky)`` (periodic).

    :math:`\sum_{\mathbf n}W^2(\mathbf k + 2k_N\mathbf n)P(|\mathbf k + 2k_N\mathbf n|)`
    at the folded wavevector, in 3D units (divide by the shell thickness for
    the plane's 2D power).

    Parameters
    ----------
    kx, ky : ndarray
        Wavevector components along the plane's two axes [h/Mpc], any values.
    pfun : callable
        Continuous 3D power [(Mpc/h)^3] (e.g. :func:`true_power`).
    cell_xy : (float, float)
        Cell sizes along the two axes [Mpc/h].

    Returns
    -------
    ndarray
        [(Mpc/h)^3], broadcast shape of ``kx``, ``ky``.
    """
    (dx, dy) = cell_xy
    nx, ny = np.pi / dx, np.pi / dy
    fx = np.mod(kx + nx, 2 * nx) - nx
    fy = np.mod(ky + ny, 2 * ny) - ny
    tot = 0.0
    for a in range(-_IMAGES, _IMAGES + 1):
        for b in range(-_IMAGES, _IMAGES + 1):
            qx, qy = fx + 2 * nx * a, fy + 2 * ny * b
            tot = tot + _w2(qx, dx) * _w2(qy, dy) * pfun(np.sqrt(qx**2 + qy**2))
    return tot


def continuous_cl(lx, ly, conf, geom, pfuns, weights, windows=True, shells=None):
    r"""The Born sum's power at flat-sky wavevectors ``(lx, ly)`` before ray sampling.

    .. math::

        C(\boldsymbol\ell) = W_{\rm pix}(\boldsymbol\ell) \sum_i
            \frac{c_i^2}{\Delta r_i\, r_i^2}\, P_{s,i}(|\boldsymbol\ell|/r_i)

    with :math:`c_i` the Born weights, :math:`P_{s,i}` the shell's power
    (:func:`shell_power`: the shell thickness in the periodic box, not Limber's
    :math:`P(k_\perp)`) and :math:`W_{\rm pix}` the rays' CIC painting window
    (:func:`pixel_window`; the planes are painted on the ray grid, so it is the
    same angular window for every plane); with ``windows=False``, the Limber sum
    of the continuous :math:`P(|\boldsymbol\ell|/r_i)` without window.

    Parameters
    ----------
    lx, ly : ndarray
        Multipole vector components (broadcastable).
    conf : SimConfig
    geom : lensing_geometry.LightconeGeometry
    pfuns : list of callable
        Continuous 3D power of each plane [(Mpc/h)^3].
    weights : ndarray
        ``[n_planes]`` Born weights :math:`c_i` of one source (a row of
        :func:`flowpm_mtf.physics.lensing_geometry.born_coefficients`, or an n(z)-weighted one).
    windows : bool
    shells : list of callable, optional
        :func:`shell_power` of each plane (computed from ``pfuns`` if not given).

    Returns
    -------
    ndarray
        [sr].
    """
    out = 0.0
    for i in range(geom.n_planes):
        if weights[i] == 0:
            continue
        kx, ky = lx / geom.r[i], ly / geom.r[i]
        if windows:
            ps = shells[i] if shells is not None else \
                shell_power(pfuns[i], geom.width[i], conf.box_size[2])
            p = ps(np.sqrt(kx**2 + ky**2))
        else:
            p = pfuns[i](np.sqrt(kx**2 + ky**2))
        out = out + weights[i]**2 / (geom.width[i] * geom.r[i]**2) * p
    if windows:
        out = out * pixel_window(lx, ly, np.deg2rad(geom.field_deg) / geom.npix)
    return out


def pixel_window(lx, ly, dtheta):
    r"""Power window of the rays' CIC painting: :math:`\mathrm{sinc}^4(\ell_x\Delta\theta/2)
    \,\mathrm{sinc}^4(\ell_y\Delta\theta/2)` (the same for every plane: each plane is
    painted on its ray grid, :func:`flowpm_mtf.physics.lensing.ray_born_terms`).

    Parameters
    ----------
    lx, ly : ndarray
        Multipole components (any values: the unfolded ones).
    dtheta : float
        Pixel side [rad].

    Returns
    -------
    ndarray
        Broadcast shape of ``lx``, ``ly`` [dimensionless].
    """
    return _w2(lx, dtheta) * _w2(ly, dtheta)


def _source_weights(conf, geom, source):
    w = np.asarray(source, np.float64) if np.ndim(source) else \
        lensing_geometry.born_coefficients(conf, geom)[int(source)]
    if w.shape != (geom.n_planes,):
        raise ValueError("lensing_theory: source weights must have %d planes, got shape %s"
                         % (geom.n_planes, w.shape))
    return w


def expected_cl(conf, geom, pfuns, source=0, edges=None, taper=lensing_stats.DEFAULT_TAPER,
                pad=DEFAULT_PAD, shot=False):
    """The expected measured C_ell of a run: :func:`continuous_cl` with the plane and
    interpolation windows, through the ray sampling and the taper
    (:func:`expected_pseudo_cl`), in the bins of ``kappa_power_spectrum``.

    Parameters
    ----------
    conf : SimConfig
    geom : lensing_geometry.LightconeGeometry
    pfuns : list of callable
        Continuous 3D power at each plane [(Mpc/h)^3] (:func:`true_power`, or a
        model such as halofit).
    source : int or ndarray
        Source index, or ``[n_planes]`` Born weights (n(z) sources).
    edges, taper, pad :
        As :func:`expected_pseudo_cl`.
    shot : bool
        Add the particles' shot noise (:func:`shot_noise_cl`; ``pfuns`` are then the
        pairs' power, without it).

    Returns
    -------
    ell, cl, n_modes : ndarray
        Bins as :func:`flowpm_mtf.physics.lensing_stats.kappa_power_spectrum`; ``cl`` [sr].
    """
    w = _source_weights(conf, geom, source)
    shells = _shells(conf, geom, pfuns, w)

    def cl2d(lx, ly):
        out = continuous_cl(lx, ly, conf, geom, pfuns, w, shells=shells)
        return out + shot_noise_cl(lx, ly, conf, geom, w) if shot else out

    return expected_pseudo_cl(cl2d, geom.npix, geom.field_deg, edges, taper, pad)


def _shells(conf, geom, pfuns, weights):
    return [_shell(pfuns[i], geom.width[i], conf.box_size[2]) if weights[i] != 0
            else None for i in range(geom.n_planes)]


def _shell(pfun, width, depth):
    """:func:`shell_power`, kept on ``pfun`` when it is a function (:func:`run_prediction`
    asks for each plane's several times: per source, with and without the windows)."""
    attrs = getattr(pfun, "__dict__", None)
    if attrs is None:
        return shell_power(pfun, width, depth)
    cache = attrs.setdefault("_shell_power", {})
    key = (float(width), float(depth))
    if key not in cache:
        cache[key] = shell_power(pfun, width, depth)
    return cache[key]


def window_factor(ell, conf, geom, pfuns, source=0, n_angles=32):
    """Fraction of the continuous Limber C_ell left by the plane and interpolation
    windows at ``ell`` (angle-averaged, before ray sampling and taper).

    Returns
    -------
    ndarray
        Shape of ``ell``; 1 without suppression.
    """
    w = _source_weights(conf, geom, source)
    ell = np.asarray(ell, np.float64)
    phi = (np.arange(n_angles) + 0.5) * (0.5 * np.pi / n_angles)
    lx, ly = ell[..., None] * np.cos(phi), ell[..., None] * np.sin(phi)
    win = continuous_cl(lx, ly, conf, geom, pfuns, w, shells=_shells(conf, geom, pfuns, w)
                        ).mean(-1)
    cont = continuous_cl(lx, ly, conf, geom, pfuns, w, windows=False).mean(-1)
    return win / np.where(cont > 0, cont, 1.0)


def pair_power(pfun, conf):
    r"""The pairs' continuous power: ``pfun`` (:func:`true_power` of the run's grid P(k),
    which holds the particles' own white :math:`1/\bar n`) minus :math:`1/\bar n`,
    clipped at 0 (the lattice's anticorrelation at early times is not modelled)."""
    noise = 1.0 / mean_density(conf)

    def f(k):
        return np.maximum(pfun(k) - noise, 0.0)

    return f


def mesh_share(ell, conf, geom, pfuns, source=0, k_nyquist=RESOLVED_K_NYQUIST):
    """Fraction of the continuous Limber C_ell at ``ell`` from planes where
    :math:`k = \\ell/r_i` is at most ``k_nyquist`` of the PM mesh's Nyquist frequency
    (where the PM force keeps the power, see ``docs/lensing.md``;
    :data:`RESOLVED_K_NYQUIST_PGD` with the PGD correction).

    Returns
    -------
    ndarray
        Shape of ``ell``, in [0, 1].
    """
    w = _source_weights(conf, geom, source)
    ell = np.asarray(ell, np.float64)
    k_res = k_nyquist * np.pi / max(conf.cell_size)
    num = np.zeros_like(ell)
    den = np.zeros_like(ell)
    for i in range(geom.n_planes):
        if w[i] == 0:
            continue
        k = ell / geom.r[i]
        c = w[i]**2 / (geom.width[i] * geom.r[i]**2) * pfuns[i](k)
        den += c
        num += np.where(k <= k_res, c, 0.0)
    return num / np.where(den > 0, den, 1.0)


def resolved_range(ell, window):
    """The ell range a run resolves: the bins from the first up to the last one before
    the window factor drops below :data:`RESOLVED_WINDOW`, and below the pixel Nyquist
    frequency of the map (the caller's bins stop there).

    Parameters
    ----------
    ell, window : ndarray
        Bin centres and :func:`window_factor` at them.

    Returns
    -------
    (ell_min, ell_max) : (float, float)
        ``(nan, nan)`` if no bin is resolved.
    """
    ell, window = np.asarray(ell), np.asarray(window)
    bad = np.nonzero(window < RESOLVED_WINDOW)[0]
    last = bad[0] if bad.size else ell.size
    if last == 0:
        return float("nan"), float("nan")
    return float(ell[0]), float(ell[last - 1])


def mean_density(conf):
    """Mean number density of the simulation's particles [(h/Mpc)^3]."""
    return float(np.prod(conf.nc)) / float(np.prod(conf.box_size))


def grid_shot_noise(k, conf):
    r"""Shot noise of the particles in the run's 3D CIC grid P(k), angle-averaged.

    A particle's own CIC weights add :math:`\bar n^{-1}\sum_{\mathbf n}
    W^2(\mathbf k + 2k_N\mathbf n) = \bar n^{-1}\prod_a (1 - \tfrac23
    \sin^2(k_a\Delta_a/2))` to the grid's power (Hockney & Eastwood), whatever the
    particles' arrangement; the rest of the measured power is the pairs'.

    Parameters
    ----------
    k : array_like
        [h/Mpc].
    conf : SimConfig

    Returns
    -------
    ndarray
        [(Mpc/h)^3], shape of ``k``.
    """
    k = np.asarray(k, np.float64)
    u, w = _directions()
    tot = 1.0
    for a in range(3):
        tot = tot * (1.0 - 2.0 / 3.0 * np.sin(k[..., None] * u[:, a] * conf.cell_size[a] / 2)**2)
    return (tot * w).sum(-1) / mean_density(conf)


def shot_noise_cl(lx, ly, conf, geom, weights):
    r"""The map's shot noise before ray sampling: each particle's own CIC footprint on the
    ray grid, :math:`W_{\rm pix}(\boldsymbol\ell)\sum_i c_i^2/(\Delta r_i\, r_i^2\,\bar n)`
    (exact in expectation for any arrangement of the particles) [sr]."""
    tot = np.sum(np.asarray(weights)**2 / (geom.width * geom.r**2)) / mean_density(conf)
    return tot * pixel_window(lx, ly, np.deg2rad(geom.field_deg) / geom.npix)


def run_prediction(conf, geom, plane_k, plane_p, sources, edges=None,
                   taper=lensing_stats.DEFAULT_TAPER, halofit=True, pgd=False):
    """Everything a lensing run reports beside its measured C_ell, per source.

    Parameters
    ----------
    conf : SimConfig
    geom : lensing_geometry.LightconeGeometry
    plane_k, plane_p : ndarray
        ``[n_planes, n_k]`` the run's grid P(k) at each plane (non-empty bins)
        [h/Mpc], [(Mpc/h)^3].
    sources : list
        Per source: its index or its ``[n_planes]`` Born weights.
    edges, taper :
        Bins and taper of the measurement.
    halofit : bool
        Also the predictions from the halofit P(k) at each plane
        (:mod:`flowpm_mtf.physics.halofit` on our linear power, Takahashi et al. 2012):
        through the run's windows and without them.
    pgd : bool
        The planes were painted from particles corrected by PGD with its fitted alpha
        (:func:`flowpm_mtf.physics.pgd.is_fitted`): ``resolved`` counts the power up to
        :data:`RESOLVED_K_NYQUIST_PGD` of the Nyquist frequency as known.

    Returns
    -------
    dict
        ``ell`` and ``n_modes`` of the bins; per source (lists): ``expected``
        (:func:`expected_cl`, [sr]), ``continuous`` (the Limber sum of the
        deconvolved P, no window, averaged over each bin's modes as the measurement is
        (:func:`bin_average`), [sr]), ``window`` (:func:`window_factor`),
        ``resolved`` (bool per bin) and ``ell_range`` (:func:`resolved_range`),
        ``k_nyquist`` (the fraction of the Nyquist frequency ``resolved`` took) and ``pgd``;
        with ``halofit``, ``extra = {"C_ell_halofit": [...], "C_ell_halofit_cont":
        [...]}`` per source [sr] (``_cont``: bin averages as ``continuous``); ``shape``:
        ``(ell, C)`` nodes of the first source's continuous C_ell over the bins' range, the
        shape within a bin for :func:`sky_cl`.
    """
    pfuns = [pair_power(true_power(plane_k[i], plane_p[i], conf), conf)
             for i in range(geom.n_planes)]
    hfuns = halofit_functions(conf.cosmology, geom.a) if halofit else None
    k_nyquist = RESOLVED_K_NYQUIST_PGD if pgd else RESOLVED_K_NYQUIST
    out = {"expected": [], "continuous": [], "window": [], "resolved": [], "ell_range": [],
           "shot": [], "k_nyquist": k_nyquist, "pgd": bool(pgd)}
    extra = {"C_ell_halofit": [], "C_ell_halofit_cont": []}
    bin_edges = _mode_bins(geom.npix, geom.field_deg, edges)[3]
    nodes = np.geomspace(0.5 * bin_edges[0], 1.5 * bin_edges[-1], 512)
    for src in sources:
        w = _source_weights(conf, geom, src)
        ell, cl, modes = expected_cl(conf, geom, pfuns, w, edges, taper, shot=True)
        shot = expected_pseudo_cl(lambda lx, ly: shot_noise_cl(lx, ly, conf, geom, w),
                                  geom.npix, geom.field_deg, edges, taper)[1]
        win = window_factor(ell, conf, geom, pfuns, w)
        mesh = mesh_share(ell, conf, geom, pfuns, w, k_nyquist)
        cont_fn = _continuum(conf, geom, pfuns, w)
        cont = bin_average(cont_fn, geom.npix, geom.field_deg, edges)
        if "shape" not in out:
            out["shape"] = (nodes, cont_fn(nodes))
        rng = resolved_range(ell[modes > 0], np.minimum(win, mesh / RESOLVED_MESH_SHARE
                                                          * RESOLVED_WINDOW)[modes > 0])
        out["shot"].append(shot)
        out["expected"].append(cl)
        out["continuous"].append(cont)
        out["window"].append(win)
        out["resolved"].append((ell >= rng[0]) & (ell <= rng[1]))
        out["ell_range"].append(rng)
        if halofit:
            extra["C_ell_halofit"].append(expected_cl(conf, geom, hfuns, w, edges, taper,
                                                      shot=True)[1])
            extra["C_ell_halofit_cont"].append(bin_average(
                _continuum(conf, geom, hfuns, w), geom.npix, geom.field_deg, edges))
    out["ell"], out["n_modes"] = ell, modes
    if halofit:
        out["extra"] = extra
    return out


def halofit_functions(cosmo, scale_factors):
    """Per lens plane, :func:`flowpm_mtf.physics.halofit.halofit_power_function` on our
    linear power at the plane's ``a``; the planes share the linear power's transfer
    function (:func:`flowpm_mtf.physics.linear_power.linear_matter_power_functions`:
    the same values as each plane's own, computed once per ``k`` grid).

    Returns
    -------
    list of callable
        ``k`` [h/Mpc] -> P_NL(k, a) [(Mpc/h)^3].
    """
    plins = linear_power.linear_matter_power_functions(cosmo, scale_factors)
    return [halofit_mod.halofit_power_function(cosmo, a, plin=p)
            for a, p in zip(scale_factors, plins)]


def _continuum(conf, geom, pfuns, weights):
    """``C(ell)`` [sr]: :func:`continuous_cl` without windows (isotropic) on a 1-d array."""
    def f(ell):
        ell = np.asarray(ell, np.float64)
        return continuous_cl(ell, np.zeros_like(ell), conf, geom, pfuns, weights, windows=False)

    return f


def sky_cl(pseudo, conf, geom, pred, taper=lensing_stats.DEFAULT_TAPER):
    """The measured C_ell as a sky power: the pseudo-C_ell minus the expected shot noise,
    decoupled from the taper's mode coupling, the ray sampling and the pixel window
    (:func:`coupling_matrix` with the first source's continuous C_ell as the shape
    within a bin): bandpowers, averages over each bin's modes, comparable with the
    continuum columns (``C_ell_limber_cont``, ``C_ell_halofit_cont``, the same averages).

    Parameters
    ----------
    pseudo : ndarray
        ``[n_source, n_bins]`` :func:`flowpm_mtf.physics.lensing_stats.kappa_power_spectrum`
        of each map, in the default bins [sr].
    conf, geom :
    pred : dict
        :func:`run_prediction` (``shot``, ``shape``), same bins.

    Returns
    -------
    ndarray
        ``[n_source, n_bins]`` [sr].
    """
    ell, cont = (np.asarray(v) for v in pred["shape"])
    good = (ell > 0) & (cont > 0)
    lg, lc = np.log(ell[good]), np.log(cont[good])

    def shape(x):   # flat when the run has no pair power left (tiny meshes)
        if lg.size < 2:
            return np.ones_like(x)
        return np.exp(np.interp(np.log(np.maximum(x, 1e-30)), lg, lc))

    dth = np.deg2rad(geom.field_deg) / geom.npix
    _, m = coupling_matrix(geom.npix, geom.field_deg, None, taper, shape,
                           lambda lx, ly: pixel_window(lx, ly, dth))
    return np.array([decouple(np.asarray(c) - np.asarray(n), m)
                     for c, n in zip(pseudo, pred["shot"])])
