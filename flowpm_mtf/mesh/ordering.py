"""Execution order of memory-heavy work in the lowered TF graph.

TensorFlow runs an op as soon as its inputs are ready, so data-independent
full-size tensors (the lattice, particle ids, k-space kernels) are computed at
the start of a run and held until their last use, and independent transforms
run side by side. :func:`after` makes a tensor wait for others, which bounds
how many full-size temporaries are live at once (the peak memory of the
initial conditions).
"""
import mesh_tensorflow as mtf
import tensorflow.compat.v1 as tf

__all__ = ["after"]


def after(t, deps, name="after"):
    """``t`` itself (a TF identity, no copy), evaluated only after the ops of ``deps``.

    Orders memory-heavy work: the consumers of the result start only once
    ``deps`` are computed (e.g. one inverse FFT after the previous one's
    fields were consumed), so TensorFlow does not hold the intermediates of
    several of them at once. The gradient is the identity for ``t`` and none
    for ``deps``.

    Parameters
    ----------
    t : mtf.Tensor
    deps : sequence of mtf.Tensor or None
        Tensors (any shape on the same mesh) to compute first; None entries
        are ignored.
    name : str, optional

    Returns
    -------
    mtf.Tensor
        Same value, shape and dtype as ``t``.
    """
    deps = [d for d in deps if d is not None]
    if not deps:
        return t

    def fn(x, *ds):
        # A variable slice is read outside the control dependency (see
        # flowpm_mtf.mesh.domain._gate: a gated read would become a control input of
        # every assignment of that variable in hvd_mesh_impl).
        x = tf.identity(x)
        with tf.control_dependencies([d.op for d in ds]):
            return tf.identity(x)

    dims = []
    for u in [t] + deps:
        dims += [d for d in u.shape.dims if d not in dims]
    return mtf.slicewise(fn, [t] + deps, output_shape=t.shape, output_dtype=t.dtype,
                         splittable_dims=dims,
                         grad_function=lambda op, dy: [dy] + [None] * len(deps), name=name)
