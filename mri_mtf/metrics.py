r"""Image quality by reductions over the split volume: PSNR and SSIM.

No rank holds the volume: every statistic is a Mesh TF reduction (an allreduce of
per-rank partial sums), and the local windows of SSIM are box sums built from
``mtf.shift`` (a halo of 3 planes from the neighbouring ranks).

* PSNR [dB]: ``10 log10(peak^2 / mean((x - t)^2))`` with ``peak`` the data range
  (default ``max(t) - min(t)``).
* SSIM (Wang, Bovik, Sheikh & Simoncelli 2004) as ``skimage.metrics.
  structural_similarity`` computes it with its defaults for 3D volumes: a uniform
  7 x 7 x 7 window, ``K1 = 0.01``, ``K2 = 0.03``, ``C_i = (K_i L)^2`` with ``L`` the
  data range, sample (co)variances (``n / (n - 1)`` with ``n = 343``), and the mean
  of the SSIM map over the voxels whose window lies inside the volume.
"""
import logging

import mesh_tensorflow as mtf
import numpy as np
import tensorflow.compat.v1 as tf

from flowpm_mtf.layout import REAL_DIMS

__all__ = ["psnr", "ssim", "psnr_numpy", "ssim_numpy", "SSIM_WINDOW"]

log = logging.getLogger(__name__)

SSIM_WINDOW = 7
"""Side of the uniform SSIM window [voxels]."""
_K1, _K2 = 0.01, 0.03


def _check_pair(x, truth):
    if x.shape != truth.shape or x.shape.dimension_names != list(REAL_DIMS):
        raise ValueError("metrics need two [x, y, z] images of the same shape, got %s and %s"
                         % (x.shape.to_string, truth.shape.to_string))
    if x.dtype.is_complex or truth.dtype.is_complex:
        raise ValueError("metrics need real images (take the magnitude first)")


def _data_range(truth, data_range):
    if data_range is None:
        return mtf.reduce_max(truth) - mtf.reduce_min(truth)
    if not np.isfinite(data_range) or data_range <= 0:
        raise ValueError("data_range must be a positive number, got %r" % (data_range,))
    return mtf.constant(truth.mesh, float(data_range), dtype=truth.dtype)


def psnr(x, truth, data_range=None, name="psnr", weights=None):
    """Peak signal-to-noise ratio of ``x`` against ``truth`` [dB] (a replicated scalar).

    Parameters
    ----------
    x, truth : mtf.Tensor
        Real ``[x, y, z]`` images [phantom intensity].
    data_range : float, optional
        Peak ``L`` [phantom intensity]; default ``max(truth) - min(truth)``.
    weights : mtf.Tensor, optional
        Real 0/1 ``[x, y, z]`` mask (e.g. the brain): the mean squared error over it.
    """
    _check_pair(x, truth)
    peak = _data_range(truth, data_range)
    if weights is None:
        mse = mtf.reduce_mean(mtf.square(x - truth))
    else:
        mse = mtf.reduce_sum(mtf.square(x - truth) * weights) / mtf.reduce_sum(weights)
    return mtf.cwise(lambda p, m: 10.0 * tf.math.log(p * p / m) / np.log(10.0), [peak, mse],
                     name=name)


def _box_sum(t, width):
    """Sum of ``t`` over the ``width^3`` box centred on each voxel (zero outside)."""
    h = width // 2
    for dim in t.shape.dims:
        parts = [t] + [mtf.shift(t, s, dim, wrap=False) for o in range(1, h + 1)
                       for s in (o, -o)]
        t = mtf.add_n(parts)
    return t


def _valid(mesh, conf_nc, width, dtype):
    """1 where the window centred on the voxel lies inside the volume, else 0."""
    h = width // 2
    out = None
    for d, n in zip(REAL_DIMS, conf_nc):
        i = mtf.range(mesh, mtf.Dimension(d, n), tf.int32)
        v = mtf.cwise(lambda t, n=n: tf.cast((t >= h) & (t < n - h), dtype), [i],
                      output_dtype=dtype)
        out = v if out is None else out * v
    return out


def ssim(x, truth, data_range=None, name="ssim", weights=None):
    """Mean structural similarity of ``x`` and ``truth`` (a replicated scalar in [-1, 1]).

    Parameters
    ----------
    x, truth : mtf.Tensor
        Real ``[x, y, z]`` images, each axis at least :data:`SSIM_WINDOW` voxels.
    data_range : float, optional
        ``L`` [phantom intensity]; default ``max(truth) - min(truth)``.
    weights : mtf.Tensor, optional
        Real 0/1 ``[x, y, z]`` mask: the mean of the SSIM map over its voxels (whose
        window lies inside the volume).
    """
    _check_pair(x, truth)
    nc = [d.size for d in x.shape.dims]
    if min(nc) < SSIM_WINDOW:
        raise ValueError("ssim needs at least %d voxels per axis, got %s" % (SSIM_WINDOW, nc))
    n = float(SSIM_WINDOW ** 3)
    L = _data_range(truth, data_range)
    mean = lambda t: _box_sum(t, SSIM_WINDOW) * (1.0 / n)  # noqa: E731
    ux, uy = mean(x), mean(truth)
    uxx, uyy, uxy = mean(x * x), mean(truth * truth), mean(x * truth)
    cov = n / (n - 1.0)

    def fn(ux, uy, uxx, uyy, uxy, L):
        c1, c2 = (_K1 * L) ** 2, (_K2 * L) ** 2
        vx, vy, vxy = cov * (uxx - ux * ux), cov * (uyy - uy * uy), cov * (uxy - ux * uy)
        return ((2 * ux * uy + c1) * (2 * vxy + c2)) / ((ux * ux + uy * uy + c1) * (vx + vy + c2))

    smap = mtf.slicewise(fn, [ux, uy, uxx, uyy, uxy, L], output_shape=x.shape,
                         output_dtype=x.dtype, splittable_dims=x.shape.dims, name=name + "_map")
    valid = _valid(x.mesh, nc, SSIM_WINDOW, x.dtype)
    if weights is not None:
        valid = valid * weights
    return mtf.reduce_sum(smap * valid) / mtf.reduce_sum(valid)


# ----------------------------------------------------------------------------- numpy
def psnr_numpy(x, truth, data_range=None, weights=None):
    """Reference of :func:`psnr` on whole arrays [dB]."""
    x, truth = np.asarray(x, np.float64), np.asarray(truth, np.float64)
    peak = truth.max() - truth.min() if data_range is None else float(data_range)
    w = np.ones_like(truth) if weights is None else np.asarray(weights, np.float64)
    return float(10.0 * np.log10(peak ** 2 / (np.sum(w * (x - truth) ** 2) / np.sum(w))))


def ssim_numpy(x, truth, data_range=None, weights=None):
    """Reference of :func:`ssim` on whole arrays (``scipy.ndimage.uniform_filter``, the
    filter ``skimage`` uses, cropped to the windows inside the volume)."""
    from scipy.ndimage import uniform_filter

    x, y = np.asarray(x, np.float64), np.asarray(truth, np.float64)
    L = y.max() - y.min() if data_range is None else float(data_range)
    w, h = SSIM_WINDOW, SSIM_WINDOW // 2
    n = float(w ** 3)
    f = lambda a: uniform_filter(a, size=w)  # noqa: E731
    ux, uy, uxx, uyy, uxy = f(x), f(y), f(x * x), f(y * y), f(x * y)
    cov = n / (n - 1)
    vx, vy, vxy = cov * (uxx - ux * ux), cov * (uyy - uy * uy), cov * (uxy - ux * uy)
    c1, c2 = (_K1 * L) ** 2, (_K2 * L) ** 2
    s = ((2 * ux * uy + c1) * (2 * vxy + c2)) / ((ux ** 2 + uy ** 2 + c1) * (vx + vy + c2))
    if weights is None:
        return float(s[h:-h, h:-h, h:-h].mean())
    w = np.asarray(weights, np.float64)[h:-h, h:-h, h:-h]
    return float(np.sum(s[h:-h, h:-h, h:-h] * w) / np.sum(w))
