r"""The flat-sky estimator's side of a lensing run's prediction: its modes, bins and
mode coupling (numpy).

:func:`flowpm_mtf.physics.lensing_stats.kappa_power_spectrum` measures a tapered periodogram
of a map sampled at the ray pixels, averaged over the FFT modes of each bin. What it
returns in expectation for a given power is :func:`expected_pseudo_cl` (ray-sampling
aliases and the taper's mode coupling); :func:`coupling_matrix` is that expectation for a
power that is constant (times a fixed shape) within each bin, the MASTER matrix, and
:func:`decouple` inverts it, giving bandpowers: averages of :math:`C(|\boldsymbol\ell|)`
over each bin's modes, the average :func:`bin_average` takes of a continuum.
:mod:`flowpm_mtf.physics.lensing_theory` builds a run's prediction on these (and
re-exports them).
"""
import numpy as np

from . import lensing_stats

__all__ = ["DEFAULT_PAD", "DEFAULT_IMAGES", "bin_average", "expected_pseudo_cl",
           "coupling_matrix", "decouple"]

# Padding of the map for the taper convolution (the continuous ell' integral is sampled on a
# grid `pad` times finer than the map's fundamental; 2 reproduced a Monte-Carlo of the
# estimator to 0.5 % in tests/test_lensing_theory.py).
DEFAULT_PAD = 2
# Aliases of the ray sampling summed per axis and side by expected_pseudo_cl (one each way,
# as lensing_theory's grid powers sum their images).
DEFAULT_IMAGES = 1


def _taper(n, taper):
    x = (np.arange(n) + 0.5) / n
    ramp = np.minimum(1.0, np.minimum(x, 1.0 - x) / taper) if taper > 0 else np.ones(n)
    w1 = 0.5 - 0.5 * np.cos(np.pi * ramp)
    return w1[:, None] * w1[None, :]


def _mode_bins(npix, field_deg, edges=None):
    """The map's FFT modes in the bins of
    :func:`flowpm_mtf.physics.lensing_stats.kappa_power_spectrum`.

    Returns
    -------
    ell, b, ok, edges : ndarray
        ``|ell|`` of the ``npix**2`` modes (FFT order, flattened), each one's bin index, the
        modes inside a bin (the mean excluded), and the bin edges (default: 2 fundamentals
        wide from half a fundamental).
    """
    n = int(npix)
    dth = np.deg2rad(field_deg) / n
    if edges is None:
        edges = np.arange(0.5, n / 2 + 1e-9, 2.0) * (2.0 * np.pi / (n * dth))
    edges = np.asarray(edges, np.float64)
    lk = 2.0 * np.pi * np.fft.fftfreq(n, d=dth)
    ell = np.sqrt(lk[:, None]**2 + lk[None, :]**2).ravel()
    b = np.digitize(ell, edges) - 1
    return ell, b, (b >= 0) & (b < edges.size - 1) & (ell > 0), edges


def bin_average(cl_of_ell, npix, field_deg, edges=None):
    r"""An isotropic power averaged over the modes of each bin, as the estimator averages.

    :func:`flowpm_mtf.physics.lensing_stats.kappa_power_spectrum` averages
    :math:`|\tilde\kappa(\boldsymbol\ell)|^2` over the FFT modes of a bin, and the
    decoupled measurement (:func:`sky_cl`) is that bandpower; a continuum prediction compared
    with it is the same average of :math:`C(|\boldsymbol\ell|)`, not :math:`C` at the
    bin's mean :math:`\ell`: for :math:`C \propto \ell^{-1.4}` the average is 17 % above it
    in the lowest bin (20 modes, from 1 to 2.2 fundamentals), 4 % in the second, < 1 % from
    the fourth on.

    Parameters
    ----------
    cl_of_ell : callable
        ``C(ell)`` [sr] on a 1-d array of multipoles (called once, on each distinct
        ``|ell|`` of the binned modes).
    npix, field_deg, edges :
        As :func:`flowpm_mtf.physics.lensing_stats.kappa_power_spectrum`.

    Returns
    -------
    ndarray
        ``[n_bins]`` [sr] (0 in a bin without modes).
    """
    ell, b, ok, edges = _mode_bins(npix, field_deg, edges)
    nb = edges.size - 1
    uniq, inv = np.unique(ell[ok], return_inverse=True)
    c = np.asarray(cl_of_ell(uniq), np.float64)[inv]
    modes = np.bincount(b[ok], minlength=nb)
    return np.bincount(b[ok], c, nb) / np.maximum(modes, 1)


def expected_pseudo_cl(cl2d, npix, field_deg, edges=None, taper=lensing_stats.DEFAULT_TAPER,
                       pad=DEFAULT_PAD, images=DEFAULT_IMAGES):
    r"""Expectation of :func:`flowpm_mtf.physics.lensing_stats.kappa_power_spectrum` for a given
    power.

    A statistically homogeneous field of power :math:`C(\boldsymbol\ell)`
    sampled at the pixel centres has the power :math:`C_a(\boldsymbol\ell) =
    \sum_{\mathbf m} C(\boldsymbol\ell + 2\ell_N\mathbf m)` (``images`` per
    axis); the tapered periodogram's expectation is
    :math:`\int d^2\ell'/(2\pi)^2\, C_a(\boldsymbol\ell')\,|\tilde w(\boldsymbol\ell
    - \boldsymbol\ell')|^2`, evaluated as a circular convolution on a grid
    ``pad`` times finer than the map's fundamental, then binned like the
    estimator. (The estimator's subtraction of the map mean is not modelled:
    it changes the lowest bin by < 1 %.)

    Parameters
    ----------
    cl2d : callable
        ``cl2d(lx, ly)`` [sr] on arrays of multipole components.
    npix : int
        Pixels per side.
    field_deg : float
        Side of the map [deg].
    edges, taper :
        As :func:`flowpm_mtf.physics.lensing_stats.kappa_power_spectrum`.
    pad : int
        Oversampling of the ell' integral.
    images : int
        Aliases summed per axis and side.

    Returns
    -------
    ell, cl, n_modes : ndarray
        As :func:`flowpm_mtf.physics.lensing_stats.kappa_power_spectrum` (same bins).
    """
    n, big = int(npix), int(pad) * int(npix)
    dth = np.deg2rad(field_deg) / n
    lnyq = np.pi / dth
    lk = 2.0 * np.pi * np.fft.fftfreq(big, d=dth)
    lx, ly = lk[:, None], lk[None, :]
    ca = 0.0
    for a in range(-images, images + 1):
        for b in range(-images, images + 1):
            ca = ca + cl2d(lx + 2 * lnyq * a, ly + 2 * lnyq * b)
    w = _taper(n, taper)
    wk2 = np.zeros((big, big))
    wk2[:n, :n] = w
    wk2 = np.abs(np.fft.fft2(wk2))**2
    # E|FFT_n(w kappa)|^2 (l) = (1 / (big dth)^2) sum_l' C_a(l') |W(l - l')|^2
    conv = np.fft.ifft2(np.fft.fft2(ca) * np.fft.fft2(wk2)).real / (big * dth)**2
    power = conv[::pad, ::pad] * dth**2 / n**2 / np.mean(w**2)
    ell, b, ok, edges = _mode_bins(n, field_deg, edges)
    nb = edges.size - 1
    modes = np.bincount(b[ok], minlength=nb).astype(np.float64)
    safe = np.maximum(modes, 1.0)
    return (np.bincount(b[ok], ell[ok], nb) / safe,
            np.bincount(b[ok], power.ravel()[ok], nb) / safe, modes)


def coupling_matrix(npix, field_deg, edges=None, taper=lensing_stats.DEFAULT_TAPER,
                    shape=None, window=None, pad=DEFAULT_PAD):
    r"""MASTER coupling matrix of the flat-sky estimator (numpy).

    :func:`flowpm_mtf.physics.lensing_stats.kappa_power_spectrum` of a field of
    power :math:`C(\ell)` has the expectation :math:`\langle\hat C_b\rangle = \sum_{b'}
    M_{bb'} C_{b'}` when :math:`C` is, within each bin :math:`b'`, the bandpower
    :math:`C_{b'}` times the fixed ``shape`` (normalised to a mode average of 1 in
    the bin): column :math:`b'` is :func:`expected_pseudo_cl` of the shape restricted
    to bin :math:`b'` (taper mode coupling, ray sampling aliases, and ``window``,
    e.g. the pixel window, applied to the field). :func:`decouple` inverts it.

    Parameters
    ----------
    npix, field_deg, edges, taper, pad :
        As :func:`expected_pseudo_cl`.
    shape : callable, optional
        ``shape(ell)``: the spectrum's shape within a bin (default flat).
    window : callable, optional
        ``window(lx, ly)``: a window on the field's power (default none).

    Returns
    -------
    ell, M : ndarray
        Bin centres and ``[n_bins, n_bins]`` (bins with no mode: identity rows).
    """
    n = int(npix)
    dth = np.deg2rad(field_deg) / n
    lf = 2.0 * np.pi / (n * dth)
    if edges is None:
        edges = np.arange(0.5, n / 2 + 1e-9, 2.0) * lf
    edges = np.asarray(edges, np.float64)
    shape = shape or (lambda ell: np.ones_like(ell))
    window = window or (lambda lx, ly: 1.0)
    lkn = 2.0 * np.pi * np.fft.fftfreq(n, d=dth)
    ell_n = np.sqrt(lkn[:, None]**2 + lkn[None, :]**2)
    nb = edges.size - 1
    cols = []
    ell_c = None
    for b in range(nb):
        lo, hi = edges[b], edges[b + 1]
        sel = (ell_n >= lo) & (ell_n < hi) & (ell_n > 0)
        norm = shape(ell_n[sel]).mean() if sel.any() else 1.0

        def cl2d(lx, ly, lo=lo, hi=hi, norm=norm):
            ell = np.sqrt(lx**2 + ly**2)
            inside = (ell >= lo) & (ell < hi)
            return np.where(inside, shape(np.where(inside, ell, lo)) / norm, 0.0) * window(lx, ly)

        ell_c, col, modes = expected_pseudo_cl(cl2d, n, field_deg, edges, taper, pad)
        cols.append(col)
    m = np.array(cols).T
    empty = modes == 0
    m[empty, :] = 0.0
    m[empty, empty] = 1.0
    return ell_c, m


def decouple(pseudo, matrix):
    """Bandpowers :math:`C_b` from measured pseudo-C_ell: :math:`M^{-1}\\hat C` (numpy).

    Parameters
    ----------
    pseudo : ndarray
        ``[..., n_bins]`` measured (shot noise already subtracted if wanted) [sr].
    matrix : ndarray
        :func:`coupling_matrix`.

    Returns
    -------
    ndarray
        Shape of ``pseudo`` [sr].
    """
    return np.linalg.solve(matrix, np.moveaxis(np.asarray(pseudo, np.float64), -1, 0)).T \
        if np.ndim(pseudo) > 1 else np.linalg.solve(matrix, np.asarray(pseudo, np.float64))
