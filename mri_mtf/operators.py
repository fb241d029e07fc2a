r"""The MRI forward operator (undersampled 3D Fourier transform) and its adjoint.

With the orthonormal 3D DFT ``F`` (``numpy.fft.fftn(x, norm="ortho")``,
``F^H F = I``) and the phase-encode mask ``M`` (0/1 on ``[ky, kz]``, broadcast over
``kx``; :mod:`mri_mtf.sampling`)::

    A x   = M * F x                    (image [x, y, z] -> k-space [kx, ky, kz])
    A^H y = F^H (M * y)                = sqrt(N) * numpy.fft.ifftn(M * y)

Both go through the distributed pencil FFT of :mod:`flowpm_mtf.mesh.fft`
(``FFT3DOperation`` with the scales ``1 / sqrt(N)`` and ``sqrt(N)``; its gradients
are exact), and the mask product through :func:`flowpm_mtf.mesh.complex_ops.apply_kernel`
(exact complex gradient). k-space fields hold their modes in the mirror-pair order of
:func:`flowpm_mtf.layout.k_order` (convert numpy arrays with
:func:`flowpm_mtf.layout.to_stored`). The image may be real (the phantom) or complex
(a reconstruction); ``adjoint(..., real=True)`` is the adjoint for real images
(``Re F^H``). The zero-filled reconstruction is ``|A^H y|``.
"""
import logging

import mesh_tensorflow as mtf
import numpy as np
import tensorflow.compat.v1 as tf

from flowpm_mtf.mesh import complex_ops
from flowpm_mtf.mesh.fft import FFT3DOperation
from flowpm_mtf.mesh.fft_local import complex_dtype, real_dtype
from flowpm_mtf.layout import K_DIMS, REAL_DIMS

from .sampling import mask_shape

__all__ = ["CHAN", "to_channels", "to_complex", "fft_ortho", "ifft_ortho", "forward",
           "adjoint", "zero_filled", "magnitude", "image_shape", "kspace_shape"]

log = logging.getLogger(__name__)


CHAN = mtf.Dimension("chan", 2)
"""The real and imaginary parts of an image as channels (:func:`to_channels`)."""


def to_channels(z, name="to_channels"):
    """Complex ``[x, y, z]`` -> real ``[x, y, z, chan]`` (real, imaginary part).

    The gradient is TensorFlow's (``dRe + i dIm``, the convention of
    :mod:`flowpm_mtf.mesh.complex_ops`), per slice.
    """
    shape = mtf.Shape(z.shape.dims + [CHAN])
    return mtf.slicewise(lambda t: tf.stack([tf.math.real(t), tf.math.imag(t)], axis=-1),
                         [z], output_shape=shape, output_dtype=real_dtype(z.dtype),
                         splittable_dims=z.shape.dims, name=name)


def to_complex(x2, name="to_complex"):
    """Real ``[x, y, z, chan]`` -> complex ``[x, y, z]`` (the inverse of :func:`to_channels`)."""
    dims = [d for d in x2.shape.dims if d != CHAN]
    if len(dims) + 1 != len(x2.shape.dims) or x2.shape.dims[-1] != CHAN:
        raise ValueError("to_complex expects [x, y, z, chan], got %s" % x2.shape.to_string)
    cdtype = complex_dtype(x2.dtype)
    return mtf.slicewise(lambda t: tf.complex(t[..., 0], t[..., 1]), [x2],
                         output_shape=mtf.Shape(dims), output_dtype=cdtype,
                         splittable_dims=dims, name=name)


def image_shape(conf):
    """mtf Shape ``[x, y, z]`` of an image."""
    return mtf.Shape([mtf.Dimension(d, n) for d, n in zip(REAL_DIMS, conf.nc)])


def kspace_shape(conf):
    """mtf Shape ``[kx, ky, kz]`` of k-space."""
    return mtf.Shape([mtf.Dimension(d, n) for d, n in zip(K_DIMS, conf.nc)])


def _fmt(shape):
    return "[%s]" % ", ".join("%s=%d" % (d.name, d.size) for d in shape.dims)


def _check(t, shape, what):
    if t.shape != shape:
        raise ValueError("%s must have shape %s (from the volume nc), got %s"
                         % (what, _fmt(shape), _fmt(t.shape)))


def _check_mask(m, conf):
    if m.dtype.is_complex or not m.dtype.is_floating:
        raise ValueError("the mask must be real floating, got %s" % m.dtype.name)
    _check(m, mask_shape(conf), "the mask")


def fft_ortho(image, conf, name="fft_ortho"):
    """Orthonormal forward 3D DFT: ``numpy.fft.fftn(image, norm="ortho")`` (stored order).

    Parameters
    ----------
    image : mtf.Tensor
        Real or complex, ``[x, y, z]`` [phantom intensity].
    conf : ImagingConfig

    Returns
    -------
    mtf.Tensor
        Complex ``[kx, ky, kz]`` [phantom intensity].
    """
    _check(image, image_shape(conf), "the image")
    return FFT3DOperation(image, REAL_DIMS, K_DIMS, inverse=False,
                          scale=1.0 / np.sqrt(conf.n_cells), name=name).outputs[0]


def ifft_ortho(kfield, conf, real=False, name="ifft_ortho"):
    """Orthonormal inverse 3D DFT: ``sqrt(N) * numpy.fft.ifftn(kfield)`` (= ``F^H``).

    Parameters
    ----------
    kfield : mtf.Tensor
        Complex ``[kx, ky, kz]`` (stored order).
    conf : ImagingConfig
    real : bool
        Return the real part (``Re F^H``, the adjoint of ``F`` on real images).

    Returns
    -------
    mtf.Tensor
        ``[x, y, z]``, complex (or real with ``real``) [phantom intensity].
    """
    _check(kfield, kspace_shape(conf), "the k-space field")
    if not kfield.dtype.is_complex:
        raise ValueError("ifft_ortho expects a complex k-space field, got %s"
                         % kfield.dtype.name)
    return FFT3DOperation(kfield, K_DIMS, REAL_DIMS, inverse=True,
                          scale=float(np.sqrt(conf.n_cells)), real_output=real,
                          name=name).outputs[0]


def forward(image, mask, conf, name="forward"):
    """``A x = M * F x``: the undersampled k-space of an image.

    Parameters
    ----------
    image : mtf.Tensor
        Real or complex ``[x, y, z]`` [phantom intensity].
    mask : mtf.Tensor
        Real 0/1 ``[ky, kz]`` (:func:`mri_mtf.sampling.mask`).
    conf : ImagingConfig

    Returns
    -------
    mtf.Tensor
        Complex ``[kx, ky, kz]`` (zero where not sampled) [phantom intensity].
    """
    _check_mask(mask, conf)
    return complex_ops.apply_kernel(fft_ortho(image, conf, name=name + "_fft"), mask,
                                    name=name + "_mask")


def adjoint(kdata, mask, conf, real=False, name="adjoint"):
    """``A^H y = F^H (M * y)`` (with ``real``: ``Re F^H (M * y)``, the adjoint on real
    images).

    Parameters
    ----------
    kdata : mtf.Tensor
        Complex ``[kx, ky, kz]`` [phantom intensity].
    mask : mtf.Tensor
        Real 0/1 ``[ky, kz]``.
    conf : ImagingConfig
    real : bool

    Returns
    -------
    mtf.Tensor
        ``[x, y, z]``, complex (real with ``real``) [phantom intensity].
    """
    _check_mask(mask, conf)
    _check(kdata, kspace_shape(conf), "the k-space data")
    return ifft_ortho(complex_ops.apply_kernel(kdata, mask, name=name + "_mask"), conf,
                      real=real, name=name + "_ifft")


def magnitude(z, name="magnitude"):
    """``|z|`` of a complex image, as a real tensor (``sqrt(Re^2 + Im^2)``)."""
    return mtf.sqrt(complex_ops.abs2(z, name=name + "_abs2"), name=name)


def zero_filled(kdata, mask, conf, name="zero_filled"):
    """The zero-filled reconstruction ``|A^H y|`` [phantom intensity], real ``[x, y, z]``."""
    log.debug("zero-filled reconstruction of %s", conf.nc)
    return magnitude(adjoint(kdata, mask, conf, name=name + "_adjoint"), name=name)
