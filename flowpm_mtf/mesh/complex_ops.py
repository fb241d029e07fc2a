"""Arithmetic on complex (k-space) Mesh TF tensors with exact gradients.

TensorFlow's convention for a real loss ``L`` and a complex tensor
``z = a + i b`` is ``grad z = dL/da + i dL/db``; for a complex-linear map ``A``
this gives ``grad x = A^H grad y`` (conjugate transpose). Stock Mesh TF skips
operations with complex tensors in ``mtf.gradients``; importing this module applies
our Mesh TF fixes, :func:`hvd_mesh_impl.mtf_compat.apply` (no Horovod import), as
:mod:`flowpm_mtf.mesh.fft` does. Products of complex tensors with ``*`` get Mesh TF's
gradient ``dy * other``, which lacks the complex conjugate: multiply k-space fields
by kernels with :func:`apply_kernel` (real kernel times a constant complex phase,
e.g. ``1j`` for the gradient kernel ``i k``), whose gradient is exact. The real and
imaginary parts (:func:`real_part`, :func:`imag_part`), ``|z|^2`` (:func:`abs2`) and
the real inner product of two fields (:func:`real_vdot`) complete the set.
"""
import mesh_tensorflow as mtf
import numpy as np
import tensorflow.compat.v1 as tf

from hvd_mesh_impl import mtf_compat

from .fft_local import complex_dtype, real_dtype

mtf_compat.apply()  # complex gradients (the one place Mesh TF is patched)


class KernelMultiplyOperation(mtf.Operation):
    """``y = phase * kernel * field`` for a complex field and a real kernel.

    Parameters
    ----------
    field : mtf.Tensor
        Complex tensor.
    kernel : mtf.Tensor
        Real tensor whose dimensions are a subset of ``field``'s (broadcast by
        name).
    phase : complex
        Constant factor, e.g. ``1j`` for the gradient kernel ``i k``.

    Notes
    -----
    Gradients (TF convention, see the module docstring)::

        grad field  = conj(phase) * kernel * grad y
        grad kernel = sum over the broadcast dims of Re(conj(phase * field) * grad y)
    """

    def __init__(self, field, kernel, phase=1.0, name=None):
        super().__init__([field, kernel], name=name or "apply_kernel")
        if not field.dtype.is_complex:
            raise TypeError("apply_kernel: the field must be complex, got %s" % field.dtype.name)
        if kernel.dtype.is_complex or not kernel.dtype.is_floating:
            raise TypeError("apply_kernel: the kernel must be real floating, got %s"
                            % kernel.dtype.name)
        missing = [d for d in kernel.shape.dims if d not in field.shape.dims]
        if missing:
            raise ValueError("apply_kernel: kernel dimensions %s are not in the field shape %s"
                             % (missing, field.shape))
        self._phase = complex(phase)
        self._outputs = [mtf.Tensor(self, field.shape, field.dtype)]

    @property
    def has_gradient(self):
        return True

    def gradient(self, grad_ys):
        dy = grad_ys[0]
        field, kernel = self.inputs
        d_field = apply_kernel(dy, kernel, np.conj(self._phase))
        phase = self._phase
        prod = mtf.slicewise(
            lambda f, g: tf.math.real(tf.math.conj(f * tf.constant(phase, f.dtype)) * g),
            [field, dy], output_shape=field.shape, output_dtype=kernel.dtype,
            splittable_dims=field.shape.dims, name="apply_kernel_grad")
        d_kernel = mtf.reduce_sum(prod, output_shape=kernel.shape)
        return [d_field, d_kernel]

    def lower(self, lowering):
        mesh_impl = lowering.mesh_impl(self)
        field, kernel = self.inputs
        phase = self._phase

        def fn(f, k):
            # The phase is folded into the kernel (a [k_d] kernel stays small):
            # one pass over the field instead of two; x * (i k) = i (x k)
            # exactly. Cast when the field is ready: a kernel is
            # data-independent, and its full-size complex copy would otherwise
            # be made at the start of the run and held until this product (16
            # MB per 2M cells in complex64).
            with tf.control_dependencies([f.op]):
                k = tf.cast(mtf.ops._expand_dims(k, kernel.shape, field.shape), f.dtype)
                if phase != 1:
                    k = k * tf.constant(phase, f.dtype)
            return f * k

        lowering.set_tensor_lowering(
            self.outputs[0],
            mesh_impl.slicewise(fn, lowering.tensors[field], lowering.tensors[kernel]))


def apply_kernel(kfield, kernel, phase=1.0, name=None):
    """Multiply a complex field by ``phase * kernel`` with an exact gradient.

    Parameters
    ----------
    kfield : mtf.Tensor
        Complex field (typically on ``kx, ky, kz``).
    kernel : mtf.Tensor
        Real kernel on a subset of ``kfield``'s dimensions (e.g. ``[kx]`` from
        :func:`kvec`, or ``[kx, ky, kz]``).
    phase : complex, optional
        Constant factor; ``1j`` with ``kernel = k_x`` gives the derivative
        kernel ``i k_x``.
    name : str, optional

    Returns
    -------
    mtf.Tensor
        ``phase * kernel * kfield``, shape and dtype of ``kfield``.
    """
    return KernelMultiplyOperation(kfield, kernel, phase, name=name).outputs[0]


def real_part(z, name="real_part"):
    """Real part of a complex tensor (gradient ``dy + 0i``)."""
    return mtf.cwise(tf.math.real, [z], output_dtype=real_dtype(z.dtype), name=name)


def imag_part(z, name="imag_part"):
    """Imaginary part of a complex tensor (gradient ``0 + i dy``)."""
    return mtf.cwise(tf.math.imag, [z], output_dtype=real_dtype(z.dtype), name=name)


def abs2(z, name="abs2"):
    """``|z|^2`` of a complex tensor, as a real tensor (e.g. for power spectra)."""
    return mtf.cwise(lambda t: tf.math.real(t * tf.math.conj(t)), [z],
                     output_dtype=real_dtype(z.dtype), name=name)


def real_vdot(u, v, name="real_vdot"):
    """Real inner product ``Re(sum(conj(u) * v))`` of two tensors of equal shape.

    Parameters
    ----------
    u, v : mtf.Tensor
        Real or complex tensors of the same shape.

    Returns
    -------
    mtf.Tensor
        Real scalar, summed over the whole (distributed) tensor.
    """
    if u.shape != v.shape:
        raise ValueError("real_vdot: shapes differ: %s vs %s" % (u.shape, v.shape))
    out = real_dtype(u.dtype)

    def fn(a, b):
        if a.dtype.is_complex or b.dtype.is_complex:
            c = complex_dtype(a.dtype)
            return tf.math.real(tf.math.conj(tf.cast(a, c)) * tf.cast(b, c))
        return a * b

    if u is v:
        # one input: Mesh TF's generic gradient of a slicewise op takes tf.gradients with
        # respect to each input, and with the same tensor twice each already holds the
        # total, which it then adds again (the gradient of <u, u> came out 4u, not 2u)
        prod = mtf.slicewise(lambda a: fn(a, a), [u], output_shape=u.shape, output_dtype=out,
                             splittable_dims=u.shape.dims, name=name)
    else:
        prod = mtf.slicewise(fn, [u, v], output_shape=u.shape, output_dtype=out,
                             splittable_dims=u.shape.dims, name=name)
    return mtf.reduce_sum(prod)
