"""Backend-neutral fixes to Mesh TensorFlow 0.1.21 (no Horovod import).

Stock Mesh TF decides whether an operation takes part in ``mtf.gradients`` with
``Operation.has_gradient``, which requires a *floating* input and output. Every
operation on complex tensors (FFT kernels, collectives that move k-space data)
is therefore silently skipped and the gradient through it is ``None``.

:func:`enable_complex_gradients` widens that test to complex dtypes. The
gradients of Mesh TF's data-movement operations (reshape, alltoall, allconcat,
shift, ...) are linear maps of the upstream gradient and are valid for complex
tensors as they are. Elementwise products of two complex tensors use Mesh TF's
``dy * other`` rule, which lacks the complex conjugate: differentiable code must
multiply complex fields by *real* kernels, or use an op with its own gradient
(as ``flowpm_mtf`` does).

The patch is applied when :mod:`hvd_mesh_impl` or :mod:`flowpm_mtf` is imported;
it is idempotent.
"""
import mesh_tensorflow as mtf

_PATCHED_ATTR = "_flowpm_mtf_complex_gradients"


def _differentiable(dtype):
    return dtype.is_floating or dtype.is_complex


def _has_gradient(self):
    return bool(
        [t for t in self.inputs if _differentiable(t.dtype)]
        and [t for t in self.outputs if _differentiable(t.dtype)]
    )


def enable_complex_gradients():
    """Let ``mtf.gradients`` flow through operations with complex tensors.

    Returns
    -------
    bool
        True if the patch was applied by this call, False if it already was.
    """
    if getattr(mtf.Operation, _PATCHED_ATTR, False):
        return False
    mtf.Operation.has_gradient = property(_has_gradient)
    setattr(mtf.Operation, _PATCHED_ATTR, True)
    return True


def complex_gradients_enabled():
    """Whether :func:`enable_complex_gradients` is in effect."""
    return bool(getattr(mtf.Operation, _PATCHED_ATTR, False))
