r"""Multi-coil acquisition: birdcage coil sensitivities and the SENSE operator, distributed.

Coil sensitivities
------------------
:func:`birdcage_numpy` is the analytic birdcage model of ``sigpy.mri.birdcage_maps``
(sigpy 0.1.27, 4D case) with the coils ringed around our ``z`` axis (the head's
inferior-superior axis of the MNI volume): for coil ``c`` of ``C`` (``nzz`` coils per
ring, radius ``r`` in half fields of view), at voxel ``(i, j, k)`` of ``(n0, n1, n2)``::

    u = (i - n0/2) / (n0/2) - r cos(2 pi c / nzz)
    v = (j - n1/2) / (n1/2) - r sin(2 pi c / nzz)
    w = (k - n2/2) / (n2/2) - (floor(c / nzz) - (ceil(C / nzz) - 1) / 2)
    S_c = exp(i (atan2(u, -v) - 2 pi (c + floor(c / nzz)) / nzz)) / sqrt(u^2 + v^2 + w^2)

normalised so that ``sum_c |S_c|^2 = 1`` at every voxel. It equals
``sigpy.mri.birdcage_maps((C, n2, n1, n0)).transpose(0, 3, 2, 1)`` (sigpy's axes are
``(coil, z, y, x)`` with x last). :func:`birdcage` evaluates the same float64
expressions on every rank's own slice (``mtf.range``, the coils included) and normalises
them with a ``mtf.reduce_sum`` over the coils.

SENSE
-----
With the orthonormal 3D DFT ``F`` and the phase-encode mask ``M``
(:mod:`mri_mtf.operators`), the coil images and k-space ``[coil, kx, ky, kz]``::

    (A x)_c = M F (S_c x),        A^H y = sum_c conj(S_c) F^H (M y_c).

Since ``sum_c |S_c|^2 = 1``, ``||A|| <= 1`` (``= 1`` without undersampling). The coil
dimension is a batch dimension of the distributed FFT (one transform for all coils of a
rank); it can be split over a third mesh axis (``ImagingConfig.coil_split``: the FFT's
all-to-alls run within the ``row`` and ``col`` groups, every sum over the coils is a
``mtf.reduce_sum``, an all-reduce over that axis);
the products with the complex maps are two :func:`flowpm_mtf.mesh.complex_ops.apply_kernel`
(real and imaginary parts of ``S``: exact complex gradients), the coil sum a
``mtf.reduce_sum``. The measurement is ``y_c = M (F S_c x + n_c)`` with independent
complex noise per coil (``E|n_c|^2 = sigma^2``; white noise on ``[coil, kx, ky, kz]``,
seeds ``seed +`` :data:`mri_mtf.sampling.NOISE_SEED_OFFSETS`). The zero-filled
reconstruction is the root-sum-of-squares ``(sum_c |F^H M y_c|^2)^{1/2}``
(:meth:`Sense.rss`).
"""
import logging

import mesh_tensorflow as mtf
import numpy as np
import tensorflow.compat.v1 as tf

from flowpm_mtf.layout import K_DIMS, REAL_DIMS
from flowpm_mtf.mesh import complex_ops, noise
from flowpm_mtf.mesh.fft import FFT3DOperation

from . import config
from .sampling import NOISE_SEED_OFFSETS

__all__ = ["COIL", "BIRDCAGE_RADIUS", "COILS_PER_RING", "coil_dim", "coil_sum", "materialised",
           "birdcage_numpy",
           "birdcage", "Sense", "sense_numpy"]

log = logging.getLogger(__name__)

COIL = config.COIL
"""Name of the coil dimension (on mesh axis ``coil_axis`` when ``conf.coil_split > 1``)."""

BIRDCAGE_RADIUS = 1.5
"""Radius of the coil ring [half field of view] (sigpy's default ``r``)."""

COILS_PER_RING = 8
"""Coils per ring (sigpy's default ``nzz``): more coils stack further rings along z."""


def coil_dim(n):
    """The mtf dimension of ``n`` coils."""
    return mtf.Dimension(COIL, int(n))


def _birdcage_expr(xp, c, i, j, k, nc, n_coils, r=BIRDCAGE_RADIUS, nzz=COILS_PER_RING):
    """Unnormalised ``S_c`` and its real/imaginary parts (float64, broadcast arrays)."""
    n0, n1, n2 = (float(n) for n in nc)
    ring = xp.floor(c / nzz)
    u = (i - n0 / 2.0) / (n0 / 2.0) - r * xp.cos(c * (2.0 * np.pi / nzz))
    v = (j - n1 / 2.0) / (n1 / 2.0) - r * xp.sin(c * (2.0 * np.pi / nzz))
    w = (k - n2 / 2.0) / (n2 / 2.0) - (ring - 0.5 * (np.ceil(n_coils / nzz) - 1.0))
    rr = xp.sqrt(u * u + v * v + w * w)
    atan2 = np.arctan2 if xp is np else xp.atan2
    phi = atan2(u, -v) - (c + ring) * (2.0 * np.pi / nzz)
    return xp.cos(phi) / rr, xp.sin(phi) / rr


def birdcage_numpy(n_coils, nc):
    """Reference of :func:`birdcage`: complex128 ``[coil, x, y, z]`` maps, ``sum_c |S_c|^2 = 1``."""
    c, i, j, k = np.meshgrid(np.arange(n_coils, dtype=np.float64),
                             *[np.arange(n, dtype=np.float64) for n in nc], indexing="ij")
    re, im = _birdcage_expr(np, c, i, j, k, nc, n_coils)
    s = re + 1j * im
    return s / np.sqrt(np.sum(np.abs(s) ** 2, axis=0))


def birdcage(mesh, conf, n_coils, name="coil_maps"):
    """Birdcage sensitivities on every rank's slice (module docstring).

    Every rank evaluates its coils (all of them, or its share when the coil dimension is
    split: ``conf.coil_split``) on its voxels; the normalisation ``sum_c |S_c|^2`` is a
    ``mtf.reduce_sum`` over the coil dimension (a sum over the coil axis when it is split).

    Returns
    -------
    (mtf.Tensor, mtf.Tensor)
        Real and imaginary parts ``[coil, x, y, z]``, dtype ``conf.dtype``
        [dimensionless], ``sum_c |S_c|^2 = 1``.
    """
    dims = [mtf.Dimension(d, n) for d, n in zip(REAL_DIMS, conf.nc)]
    cdim = coil_dim(n_coils)
    shape = mtf.Shape([cdim] + dims)
    ranges = [mtf.range(mesh, d, tf.float64, name="%s_%s" % (name, d.name))
              for d in [cdim] + dims]

    def fn(tc, ti, tj, tk, part):
        c = tc[:, None, None, None]
        i, j, k = ti[None, :, None, None], tj[None, None, :, None], tk[None, None, None, :]
        return _birdcage_expr(tf.math, c, i, j, k, conf.nc, n_coils)[part]

    re, im = (mtf.slicewise(lambda a, b, c, d, p=p: fn(a, b, c, d, p), ranges,
                            output_shape=shape, output_dtype=tf.float64,
                            splittable_dims=shape.dims, name="%s_raw_%s" % (name, ("re", "im")[p]))
              for p in (0, 1))
    inv = mtf.rsqrt(coil_sum(re * re + im * im, cdim, name + "_norm2"))
    return tuple(mtf.cast(t * inv, conf.tf_dtype, name="%s_%s" % (name, ("re", "im")[p]))
                 for p, t in enumerate((re, im)))


def materialised(x, name="materialised"):
    """``x`` through an identity that performs a pending all-reduce, forward and backward.

    A ``mtf.reduce_sum`` over a split dimension (the coils) lowers to a lazy all-reduce
    whose consumers must ask for its slices; Mesh TF's ``GenericGradOperation`` (the
    gradient of a ``cwise`` without its own, e.g. the network's ops) reads
    ``tensor_list`` directly and fails on it. The same holds for the gradient of a
    broadcast over the coils (a sum over them). This identity has its own gradient, the
    same identity on ``dy``.
    """
    return mtf.cwise(tf.identity, [x], name=name,
                     grad_function=lambda op, dy: [materialised(dy, name=name + "_grad")])


def coil_sum(x, coil, name):
    """``mtf.reduce_sum`` over the coil dimension (an all-reduce over ``coil_axis`` when
    split), :func:`materialised`."""
    return materialised(mtf.reduce_sum(x, reduced_dim=coil, name=name), name=name + "_reduced")


class Sense:
    """The SENSE operator ``A`` of ``n_coils`` birdcage coils and a mask (module docstring).

    Parameters
    ----------
    mesh : mtf.Mesh
    conf : ImagingConfig
    n_coils : int
        Coils (>= 1).
    mask : mtf.Tensor
        Real 0/1 ``[ky, kz]`` (:func:`mri_mtf.sampling.mask`).
    maps : (mtf.Tensor, mtf.Tensor), optional
        Real and imaginary sensitivities ``[coil, x, y, z]``; default :func:`birdcage`.
    """

    def __init__(self, mesh, conf, n_coils, mask, maps=None, name="sense"):
        self.mesh, self.conf, self.mask, self.name = mesh, conf, mask, name
        self.coil = coil_dim(n_coils)
        self.maps_re, self.maps_im = maps if maps is not None else birdcage(mesh, conf, n_coils)
        self.image_shape = mtf.Shape([mtf.Dimension(d, n) for d, n in zip(REAL_DIMS, conf.nc)])
        self.coil_image_shape = mtf.Shape([self.coil] + self.image_shape.dims)
        self.kspace_shape = mtf.Shape([self.coil] + [mtf.Dimension(d, n)
                                                     for d, n in zip(K_DIMS, conf.nc)])

    def coil_images(self, x, name=None):
        """``S_c x``: complex ``[coil, x, y, z]`` from a real or complex image."""
        name = name or self.name + "_sx"
        if not x.dtype.is_complex:
            x = mtf.cast(x, self.conf.tf_complex_dtype)
        xb = mtf.broadcast(materialised(x, name=name + "_in"), self.coil_image_shape)
        return (complex_ops.apply_kernel(xb, self.maps_re, name=name + "_re")
                + complex_ops.apply_kernel(xb, self.maps_im, phase=1j, name=name + "_im"))

    def forward(self, x, name=None):
        """``(A x)_c = M F (S_c x)``: complex ``[coil, kx, ky, kz]`` [image intensity]."""
        name = name or self.name + "_forward"
        k = FFT3DOperation(self.coil_images(x, name=name + "_sx"), REAL_DIMS, K_DIMS,
                           inverse=False, scale=1.0 / np.sqrt(self.conf.n_cells),
                           name=name + "_fft").outputs[0]
        return complex_ops.apply_kernel(k, self.mask, name=name + "_mask")

    def _coil_adjoint_images(self, y, name):
        """``F^H (M y_c)``: complex ``[coil, x, y, z]``."""
        return FFT3DOperation(complex_ops.apply_kernel(y, self.mask, name=name + "_mask"),
                              K_DIMS, REAL_DIMS, inverse=True,
                              scale=float(np.sqrt(self.conf.n_cells)),
                              name=name + "_ifft").outputs[0]

    def adjoint(self, y, name=None):
        """``A^H y = sum_c conj(S_c) F^H (M y_c)``: complex ``[x, y, z]``."""
        name = name or self.name + "_adjoint"
        img = self._coil_adjoint_images(y, name)
        s = (complex_ops.apply_kernel(img, self.maps_re, name=name + "_re")
             + complex_ops.apply_kernel(img, self.maps_im, phase=-1j, name=name + "_im"))
        return coil_sum(s, self.coil, name + "_coil_sum")

    def rss(self, y, name=None):
        """Zero-filled root-sum-of-squares ``(sum_c |F^H M y_c|^2)^{1/2}``, real ``[x, y, z]``."""
        name = name or self.name + "_rss"
        a2 = complex_ops.abs2(self._coil_adjoint_images(y, name), name=name + "_abs2")
        return mtf.sqrt(coil_sum(a2, self.coil, name + "_coil_sum"), name=name)

    def noise(self, name="coil_noise"):
        """Complex noise ``[coil, kx, ky, kz]``, ``E|n|^2 = sigma^2`` per coil and sample,
        the same on every grid."""
        conf = self.conf
        re, im = (noise.white_noise(self.mesh, self.kspace_shape, conf.seed + o, conf.tf_dtype,
                                    name=name + str(o)) for o in NOISE_SEED_OFFSETS)
        s = conf.noise_sigma / np.sqrt(2.0)
        cdtype = conf.tf_complex_dtype

        def fn(a, b):
            return tf.cast(tf.complex(tf.cast(a, tf.float64) * s, tf.cast(b, tf.float64) * s),
                           cdtype)

        return mtf.cwise(fn, [re, im], output_dtype=cdtype, name=name)

    def measure(self, x, name="measure"):
        """``y_c = M (F S_c x + n_c)``: the noisy multi-coil measurement of ``x``."""
        y = self.forward(x, name=name + "_forward")
        if self.conf.noise_sigma > 0:
            y = y + complex_ops.apply_kernel(self.noise(name=name + "_noise"), self.mask,
                                             name=name + "_noise_mask")
        return y


def sense_numpy(maps, mask2d):
    """Numpy SENSE (numpy FFT order): ``(A, A^H)`` as functions of whole arrays.

    Parameters
    ----------
    maps : ndarray, complex, ``[coil, x, y, z]``
    mask2d : ndarray, ``(ny, nz)``
    """
    m = mask2d[None, None].astype(np.float64)

    def A(x):
        return m * np.fft.fftn(maps * x[None], axes=(1, 2, 3), norm="ortho")

    def AH(y):
        return np.sum(np.conj(maps) * np.fft.ifftn(m * y, axes=(1, 2, 3), norm="ortho"), axis=0)

    return A, AH
