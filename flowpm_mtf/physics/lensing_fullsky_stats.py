r"""Statistics of full-sky convergence maps (numpy + healpy, after the graph).

* :func:`kappa_cl_fullsky`: the angular power of a HEALPix map (``healpy.anafast``)
  in bins of :math:`\ell`.
* :func:`shear_fullsky`: the Born shear from the potential's harmonics. With
  :math:`\nabla^2\psi = 2\kappa`, :math:`\psi_{\ell m} = -2\kappa_{\ell m}/(\ell(\ell+1))`
  and :math:`\gamma = \tfrac12 \eth\eth\psi`, the spin-2 E-mode coefficients are
  :math:`\gamma_{E,\ell m} = \tfrac12\sqrt{(\ell+2)!/(\ell-2)!}\,\psi_{\ell m}
  = -\sqrt{(\ell+2)(\ell-1)/(\ell(\ell+1))}\,\kappa_{\ell m}` and B = 0;
  ``healpy.alm2map_spin`` makes :math:`(\gamma_1, \gamma_2)` in healpy's
  :math:`(\hat e_\theta, \hat e_\phi)` basis (its spin-2 coefficients are
  :math:`{}_2a_{\ell m} = -(E + iB)`, so healpy's E is :math:`-\gamma_E`). For an
  axisymmetric convergence around the north pole
  :math:`\gamma_1(\theta) = \kappa(\theta) - \tfrac{2\cos\theta}{1+\cos\theta}
  \bar\kappa(<\theta)` (the flat-sky :math:`\kappa - \bar\kappa`: tangential shear
  :math:`-\gamma_1 > 0` around a mass), tested in ``tests/test_lensing_fullsky.py``.
* :func:`shear_eb`: E and B power of a shear map (``healpy.map2alm_spin``).
* :func:`fullsky_prediction`: the Limber convergence power of the run's shells from
  the run's P(k) and from halofit, the HEALPix pixel window, the shot noise of the
  particles, and the resolved range.

Limber for the shells
---------------------
:math:`\kappa = \sum_i c_i \delta_i` with :math:`\delta_i` the shell-averaged contrast,
so :math:`C_\ell = \sum_i c_i^2 \Delta r_i^{-2} \int_{\rm shell} P_i\big((\ell +
\tfrac12)/r\big) r^{-2} dr` (thin shells: :math:`c_i^2 P_i((\ell+\tfrac12)/r_i)/(r_i^2\Delta r_i)`)
(:math:`c_i` the Born weights, :math:`P_i` the 3D power at the shell's scale factor).
The nearest-pixel painting multiplies the power by the pixel window
:math:`w_\ell^2` (:func:`pixel_window`), and the particles' Poisson noise adds
:math:`\sum_i c_i^2\, 4\pi / N_i` (:math:`N_i` the expected particles in shell ``i``).
"""
import logging

import numpy as np

from . import lensing_geometry, lensing_theory
from .lensing_fullsky import mean_count

__all__ = ["RESOLVED_WINDOW", "RESOLVED_LMAX_PER_NSIDE", "kappa_cl_fullsky", "bin_edges", "bin_cl",
           "shear_fullsky", "shear_eb", "pixel_window", "limber_shells", "shot_noise", "fullsky_prediction"]

log = logging.getLogger(__name__)

# As on the flat sky: a bin is resolved where the pixel window keeps at least half of C_ell
# and the particles' shot noise is at most half of the run's continuous C_ell ...
RESOLVED_WINDOW = lensing_theory.RESOLVED_WINDOW
# ... and ell <= 2 nside: above, HEALPix's harmonic transforms of maps that are not band-
# limited alias (the B-modes of the pure-E shear pass 1 % of E at ell ~ 2.3 nside).
RESOLVED_LMAX_PER_NSIDE = 2
# The pixel window: sub-pixels per pixel side 2^_PIXWIN_SUB (midpoint rule on cells of 1/8
# pixel: ~0.6 % at ell = 3 nside), over _PIXWIN_PIXELS pixels spread over the rings.
_PIXWIN_SUB = 3
_PIXWIN_PIXELS = 48
# Nodes of the midpoint rule across a shell in the Limber sum (the nearest shell, from r = 0,
# is far from thin: its r^-2 weight changes by orders of magnitude across it).
_LIMBER_NODES = 32
# Iterations of healpy's map2alm (its quadrature refinement): 3 is healpy's anafast default.
_ALM_ITER = 3


def _healpy():
    import healpy   # imported on use: the flat-sky lensing and the other jobs do not need it
    return healpy


def bin_edges(nside, lmax=None):
    """Linear multipole bins of width ``max(2, nside // 8)`` from 2 to ``lmax`` (default
    ``3 nside - 1``); returns the ``n + 1`` integer edges (bin ``b``: ``edges[b] <= l <
    edges[b+1]``)."""
    lmax = 3 * int(nside) - 1 if lmax is None else int(lmax)
    width = max(2, int(nside) // 8)
    return np.append(np.arange(2, lmax + 1, width), lmax + 1)


def bin_cl(cl_l, edges):
    """``(ell, cl, modes)`` of per-multipole ``cl_l`` in the bins ``edges`` (mode-weighted)."""
    ell = np.arange(cl_l.size)
    out, lc, modes = [], [], []
    for lo, hi in zip(edges[:-1], edges[1:]):
        sel = (ell >= lo) & (ell < hi)
        w = 2.0 * ell[sel] + 1.0
        out.append(np.sum(w * cl_l[sel]) / w.sum())
        lc.append(np.sum(w * ell[sel]) / w.sum())
        modes.append(w.sum())
    return np.asarray(lc), np.asarray(out), np.asarray(modes)


def kappa_cl_fullsky(kappa, edges=None, lmax=None):
    """Binned angular power of a RING HEALPix map.

    Parameters
    ----------
    kappa : ndarray
        ``[12 nside^2]`` map [dimensionless].
    edges : array_like, optional
        Multipole bin edges (:func:`bin_edges` by default).

    Returns
    -------
    (ell, cl, modes) : ndarray
        Mode-weighted mean multipole, mean :math:`C_\\ell` [sr] and modes
        :math:`\\sum (2\\ell + 1)` per bin.
    """
    hp = _healpy()
    nside = hp.npix2nside(np.asarray(kappa).size)
    edges = bin_edges(nside, lmax) if edges is None else np.asarray(edges, int)
    cl = hp.anafast(np.asarray(kappa, np.float64), lmax=int(edges[-1]) - 1, iter=_ALM_ITER)
    return bin_cl(cl, edges)


def _spin2_factor(lmax):
    ell = np.arange(lmax + 1, dtype=np.float64)
    return np.where(ell >= 2, np.sqrt(np.maximum((ell + 2) * (ell - 1), 0)
                                      / np.maximum(ell * (ell + 1), 1)), 0.0)


def shear_fullsky(kappa, lmax=None):
    """Born shear :math:`(\\gamma_1, \\gamma_2)` of a RING convergence map from the
    lensing potential's harmonics (module docstring).

    Parameters
    ----------
    kappa : ndarray
        ``[12 nside^2]`` [dimensionless].
    lmax : int, optional
        Band limit (default ``3 nside - 1``).

    Returns
    -------
    (gamma1, gamma2) : ndarray
        RING maps in healpy's :math:`(\\hat e_\\theta, \\hat e_\\phi)` basis.
    """
    hp = _healpy()
    kappa = np.asarray(kappa, np.float64)
    nside = hp.npix2nside(kappa.size)
    lmax = 3 * nside - 1 if lmax is None else int(lmax)
    alm = hp.map2alm(kappa, lmax=lmax, iter=_ALM_ITER)
    e = hp.almxfl(alm, _spin2_factor(lmax))   # healpy's E = -gamma_E = +f_l kappa_lm
    g1, g2 = hp.alm2map_spin([e, np.zeros_like(e)], nside, 2, lmax)
    return g1, g2


def shear_eb(gamma1, gamma2, lmax=None):
    """E- and B-mode power spectra of a shear map pair, ``(cl_e, cl_b)`` per multipole
    ``0 .. lmax`` [sr]."""
    hp = _healpy()
    nside = hp.npix2nside(np.asarray(gamma1).size)
    lmax = 3 * nside - 1 if lmax is None else int(lmax)
    e, b = hp.map2alm_spin([np.asarray(gamma1, np.float64), np.asarray(gamma2, np.float64)],
                           2, lmax=lmax)
    return hp.alm2cl(e), hp.alm2cl(b)


def pixel_window(nside, lmax=None):
    """The HEALPix pixel window :math:`w_\\ell` (computed here: healpy's ``pixwin`` reads
    data files it downloads).

    By the addition theorem, the power window of pixel :math:`p` is
    :math:`w_\\ell^2(p) = \\Omega_p^{-2}\\iint_p P_\\ell(\\hat n\\cdot\\hat n')\\,d\\Omega\\,
    d\\Omega'`; the double integral is the mean over the pairs of the pixel's
    ``4^_PIXWIN_SUB`` NESTED sub-pixel centres, averaged over ``_PIXWIN_PIXELS`` pixels
    spread over the rings (the pixels' shapes vary with latitude).

    Returns
    -------
    ndarray
        :math:`w_\\ell`, ``ell = 0 .. lmax`` (default ``3 nside - 1``).
    """
    hp = _healpy()
    nside = int(nside)
    lmax = 3 * nside - 1 if lmax is None else int(lmax)
    npix = 12 * nside**2
    ring = np.unique(np.linspace(0, npix - 1, min(npix, _PIXWIN_PIXELS)).astype(np.int64))
    nest = hp.ring2nest(nside, ring)
    m = 4**_PIXWIN_SUB
    sub = (nest[:, None] * m + np.arange(m)[None, :]).ravel()
    v = np.stack(hp.pix2vec(nside * 2**_PIXWIN_SUB, sub, nest=True), -1).reshape(-1, m, 3)
    c = np.clip(np.einsum("pid,pjd->pij", v, v).reshape(v.shape[0], -1), -1.0, 1.0)
    w2 = np.empty(lmax + 1)
    p0, p1 = np.ones_like(c), c
    w2[0] = 1.0
    if lmax >= 1:
        w2[1] = p1.mean()
    for ell in range(1, lmax):
        p0, p1 = p1, ((2 * ell + 1) * c * p1 - ell * p0) / (ell + 1)
        w2[ell + 1] = p1.mean()
    return np.sqrt(np.clip(w2, 0.0, None))


def limber_shells(ell, conf, geom, pfuns, source=0):
    """Limber sum of the shells [sr]: :math:`\\sum_i c_i^2 \\Delta r_i^{-2}\\int_{\\rm shell}
    P_i((\\ell+1/2)/r)\\,r^{-2}\\,dr` (the shell-averaged contrast; the midpoint rule on
    ``_LIMBER_NODES`` nodes), with ``pfuns[i]`` the 3D power at shell ``i`` (callable of k
    [h/Mpc]); for thin shells :math:`c_i^2 P_i((\\ell+1/2)/r_i)/(r_i^2 \\Delta r_i)`."""
    coef = lensing_geometry.born_coefficients(conf, geom.base)[source]
    ell = np.asarray(ell, np.float64)
    out = np.zeros_like(ell)
    u = (np.arange(_LIMBER_NODES) + 0.5) / _LIMBER_NODES
    for i in range(geom.n_planes):
        if coef[i] > 0:
            lo, w = geom.r_edges[i], geom.width[i]
            r = lo + w * u                                               # midpoint nodes
            k = (ell[:, None] + 0.5) / r[None, :]
            inner = np.mean(pfuns[i](k.ravel()).reshape(k.shape) / r**2, axis=1) / w
            out += coef[i]**2 * inner
    return out


def shot_noise(conf, geom, source=0):
    """Poisson noise of the painted particles in the convergence power,
    :math:`\\sum_i c_i^2\\, 4\\pi / N_i` [sr] (flat in :math:`\\ell`)."""
    coef = lensing_geometry.born_coefficients(conf, geom.base)[source]
    n = np.array([mean_count(conf, geom, i) * geom.npix for i in range(geom.n_planes)])
    return float(np.sum(coef**2 * 4.0 * np.pi / n))


def fullsky_prediction(conf, geom, plane_k, plane_p, ell, edges=None):
    """Everything a full-sky run reports beside its measured C_ell, per source.

    Parameters
    ----------
    conf : SimConfig
    geom : lensing_fullsky.FullSkyGeometry
    plane_k, plane_p : ndarray
        ``[n_planes, n_k]`` the run's grid P(k) at each shell [h/Mpc], [(Mpc/h)^3].
    ell : ndarray
        Bin multipoles (:func:`bin_cl`'s mean multipoles).
    edges : array_like, optional
        The bins' edges: the predictions are then computed at every multipole and averaged
        over each bin with the measurement's weights :math:`2\\ell + 1` (:func:`bin_cl`), as the
        measured C_ell is; without, at ``ell`` (the two differ by a few per cent in the
        lowest bins of a steep spectrum). ``resolved`` is decided at ``ell``.

    Returns
    -------
    dict
        Per source (lists of arrays over ``ell``, [sr]): ``limber`` (run's P(k) x
        pixel window + shot noise), ``limber_cont`` (run's P(k), no window; with
        ``edges``, bin means as the measurement's),
        ``halofit`` (halofit x pixel window + shot noise), ``halofit_cont``, ``shot``,
        ``resolved`` (bool); ``pixwin2`` (the pixel window of the power).
    """
    pfuns = [lensing_theory.true_power(plane_k[i], plane_p[i], conf)
             for i in range(geom.n_planes)]
    hfuns = lensing_theory.halofit_functions(conf.cosmology, geom.a)
    pw = pixel_window(geom.nside)
    ell = np.asarray(ell, np.float64)
    pw2 = np.interp(ell, np.arange(pw.size), pw**2)
    if edges is None:
        at, pw2_at = ell, pw2

        def binned(c):
            return c
    else:
        edges = np.asarray(edges, int)
        at = np.arange(edges[-1], dtype=np.float64)            # every multipole to the last bin
        pw2_at = np.interp(at, np.arange(pw.size), pw**2)

        def binned(c):
            return bin_cl(c, edges)[1]
    out = {k: [] for k in ("limber", "limber_cont", "halofit", "halofit_cont", "shot",
                           "resolved")}
    for s in range(geom.n_source):
        cont_at = limber_shells(at, conf, geom, pfuns, s)
        hcont_at = limber_shells(at, conf, geom, hfuns, s)
        cont, hcont = binned(cont_at), binned(hcont_at)
        shot = np.full_like(cont, shot_noise(conf, geom, s))
        out["limber_cont"].append(cont)
        out["limber"].append(binned(cont_at * pw2_at) + shot)
        out["halofit_cont"].append(hcont)
        out["halofit"].append(binned(hcont_at * pw2_at) + shot)
        out["shot"].append(shot)
        out["resolved"].append((pw2 >= RESOLVED_WINDOW) & (shot <= RESOLVED_WINDOW * cont)
                               & (ell <= RESOLVED_LMAX_PER_NSIDE * geom.nside))
    out["pixwin2"] = pw2
    return out
