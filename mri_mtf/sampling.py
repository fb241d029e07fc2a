r"""Variable-density random Cartesian undersampling of k-space, and complex noise.

Mask
----
A 3D Cartesian acquisition reads out along ``kx`` (fully sampled, the axis that is
local in our k-space layout) and phase-encodes the plane ``(ky, kz)``; the mask
selects positions of that plane and is broadcast over ``kx``. With
``n_pe = ny * nz`` positions and acceleration ``R`` (:class:`ImagingConfig`):

1. ``M = round(n_pe / R)`` positions are sampled in all;
2. the ``round(centre_fraction * M)`` positions nearest ``k = 0`` (by the radius
   ``r = |(f_y, f_z)| / f_Nyquist``, ties in row-major order) form the fully sampled
   centre;
3. the other positions are drawn without replacement with weights
   ``w = (1 - r / sqrt 2)^d + 1e-3`` (``d = density_power``; Efraimidis & Spirakis
   2006: the largest keys ``ln(u) / w`` of uniforms ``u`` from
   ``numpy.random.default_rng(seed)``).

The plane (``ny * nz`` values, not a volume) is computed in numpy on every rank from
the seed, so the mask is the same on every grid; each rank imports it and keeps its
``[ky, kz]`` block. ``R`` is exact up to the rounding of ``M``.

Noise
-----
Complex Gaussian noise on ``[kx, ky, kz]`` with ``E|n|^2 = sigma^2``: real and
imaginary parts are :func:`flowpm_mtf.mesh.noise.white_noise` fields (seeds ``seed + 1``
and ``seed + 2``) times ``sigma / sqrt 2``, indexed by their stored k-space position
(the same on every grid), generated slice by slice.

Measurement: ``y = mask * (F x + n)`` with ``F`` the orthonormal 3D DFT
(:func:`mri_mtf.operators.forward`).
"""
import logging

import mesh_tensorflow as mtf
import numpy as np
import tensorflow.compat.v1 as tf

from flowpm_mtf import layout
from flowpm_mtf.mesh import noise
from flowpm_mtf.layout import K_DIMS, KY, KZ

__all__ = ["mask_numpy", "mask", "mask_shape", "complex_noise_numpy", "complex_noise",
           "NOISE_SEED_OFFSETS"]

log = logging.getLogger(__name__)

NOISE_SEED_OFFSETS = (1, 2)
"""White-noise seeds of the real and imaginary parts: ``conf.seed + offset``."""


def mask_shape(conf):
    """mtf Shape ``[ky, kz]`` of a phase-encode mask."""
    return mtf.Shape([mtf.Dimension(KY, conf.nc[1]), mtf.Dimension(KZ, conf.nc[2])])


def mask_numpy(conf, stored=False):
    """The sampling mask of the phase-encode plane.

    Parameters
    ----------
    conf : ImagingConfig
    stored : bool
        Return the mirror-pair order of k-space fields (:func:`flowpm_mtf.layout.k_order`)
        instead of numpy's FFT order.

    Returns
    -------
    ndarray of float64, shape ``(ny, nz)``
        1 where the position is sampled, else 0; ``conf.n_samples`` ones, among them the
        ``conf.n_centre`` positions nearest ``k = 0``.
    """
    ny, nz = conf.nc[1], conf.nc[2]
    fy, fz = np.fft.fftfreq(ny), np.fft.fftfreq(nz)
    r = np.sqrt((fy[:, None] / 0.5) ** 2 + (fz[None, :] / 0.5) ** 2).ravel()
    n_pe, m_total, m_centre = conf.n_phase_encodes, conf.n_samples, conf.n_centre
    chosen = np.zeros(n_pe, bool)
    chosen[np.argsort(r, kind="stable")[:m_centre]] = True
    u = np.random.default_rng(conf.seed).random(n_pe)
    w = np.maximum(1.0 - r / np.sqrt(2.0), 0.0) ** conf.density_power + 1e-3
    key = np.log(np.maximum(u, 1e-300)) / w
    key[chosen] = -np.inf
    chosen[np.argsort(-key, kind="stable")[:m_total - m_centre]] = True
    out = chosen.reshape(ny, nz).astype(np.float64)
    return layout.to_stored(out, axes=(0, 1)) if stored else out


def mask(mesh, conf, name="mask"):
    """The sampling mask as an mtf tensor ``[ky, kz]`` (stored order), dtype ``conf.dtype``.

    Parameters
    ----------
    mesh : mtf.Mesh
    conf : ImagingConfig

    Returns
    -------
    mtf.Tensor
        0/1 per phase-encode position [dimensionless]; each rank keeps its block.
    """
    m = mask_numpy(conf, stored=True).astype(conf.np_dtype)
    log.debug("mask %s: R=%g, %d of %d phase encodes (%d in the centre)", m.shape,
              conf.acceleration, conf.n_samples, conf.n_phase_encodes, conf.n_centre)
    return mtf.import_tf_tensor(mesh, tf.constant(m), mask_shape(conf), name=name)


def complex_noise_numpy(conf, stored=False):
    """The whole complex noise field in numpy (reference of :func:`complex_noise`).

    Returns
    -------
    ndarray, shape ``conf.nc``, dtype ``conf.np_complex_dtype``
        In numpy's FFT order (``stored=False``) or the stored mirror-pair order
        [phantom intensity].
    """
    s = conf.noise_sigma / np.sqrt(2.0)
    re, im = (noise.white_noise_numpy(conf.seed + o, conf.nc, conf.np_dtype)
              for o in NOISE_SEED_OFFSETS)
    n = (re.astype(np.float64) * s + 1j * (im.astype(np.float64) * s))
    n = n.astype(conf.np_complex_dtype)
    return n if stored else layout.to_natural(n)


def complex_noise(mesh, conf, name="kspace_noise"):
    """Complex Gaussian noise on ``[kx, ky, kz]``, the same on every grid.

    Returns
    -------
    mtf.Tensor
        Complex (``conf.tf_complex_dtype``), ``E|n|^2 = conf.noise_sigma^2``
        [phantom intensity].
    """
    shape = mtf.Shape([mtf.Dimension(d, n) for d, n in zip(K_DIMS, conf.nc)])
    re, im = (noise.white_noise(mesh, shape, conf.seed + o, conf.tf_dtype, name=name + str(o))
              for o in NOISE_SEED_OFFSETS)
    s = conf.noise_sigma / np.sqrt(2.0)
    cdtype = conf.tf_complex_dtype

    def fn(a, b):
        a64, b64 = tf.cast(a, tf.float64) * s, tf.cast(b, tf.float64) * s
        return tf.cast(tf.complex(a64, b64), cdtype)

    return mtf.cwise(fn, [re, im], output_dtype=cdtype, name=name)
