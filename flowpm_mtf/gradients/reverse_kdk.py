r"""The particle arithmetic of the adjoint's reverse step, fused: reverse drift and reverse kick.

:func:`flowpm_mtf.gradients.adjoint.reverse_step` re-creates a step's state while it
propagates the cotangents; apart from the force and its VJP, its work is a
dozen elementwise products and sums on ``[bx, by, npart, xyz]`` arrays and four
per-block dot products (a sixth of a reverse step as TensorFlow ops). Here they are
two ops:

:func:`reverse_drift`
    ``p_h = p - K1 f``, ``dx = -(D p_h)``, ``x_new = x + dx``,
    ``pb_h = pb + D xb`` and the block sums of ``w pb . f`` and ``w xb . p_h``;
:func:`reverse_kick`
    ``p = p_h - K0 f``, ``xb_new = xb + c vjp`` and the block sums of
    ``w pb_h . f`` and ``w (c pb_h) . f``,

with ``w`` the slot weights (:func:`flowpm_mtf.mesh.slots.weights`: 1 valid, 0
empty; 1 everywhere for the lagrangian decomposition). On the CPU each is one
native op (``flowpm_mtf/native/adjoint_ops.cc``) whose elementwise outputs equal
the TensorFlow expressions bit for bit and whose sums agree to rounding (summed
in double); elsewhere (GPU, ``FLOWPM_MTF_NATIVE=0``, ``native=False``) the same
expressions as Mesh TF ops. Both are differentiable: the gradient of the native
op is ``mtf.gradients`` of those expressions (the reverse step itself is not
differentiated by the package, but a user's graph may).
"""
import mesh_tensorflow as mtf
import tensorflow.compat.v1 as tf

from .. import native

__all__ = ["DOT_DIM", "reverse_drift", "reverse_kick"]

DOT_DIM = "adjoint_sum"
"""The dimension of the per-block dot products (the adjoint's ``SUM_DIM``)."""


def _weights(ids, dtype):
    """``[bx, by, npart]`` 1 for a valid slot (id >= 0), 0 for an empty one; None without ids
    (as :func:`flowpm_mtf.mesh.slots.weights`)."""
    if ids is None:
        return None
    return mtf.cast(mtf.greater_equal(ids, mtf.zeros(ids.mesh, ids.shape, ids.dtype)), dtype)


def _block_dot(u, v, weight):
    """``sum(weight * u . v)`` over the particles of each block: ``[bx, by]`` (no collective)."""
    # u . v per particle first: the weight then multiplies [bx, by, npart], not a
    # broadcast over xyz (TensorFlow's broadcasting product is slower per element)
    prod = mtf.reduce_sum(u * v, output_shape=mtf.Shape(u.shape.dims[:-1]))
    if weight is not None:
        prod = prod * weight
    return mtf.reduce_sum(prod, output_shape=mtf.Shape(u.shape.dims[:2]))


def _dots(a, b):
    """Two ``[bx, by]`` block sums as ``[bx, by, DOT_DIM(2)]``."""
    return mtf.stack([a, b], DOT_DIM, axis=2)


def _drift_mtf(x, p, f, xb, pb, ids, k1, drift):
    p_h = p - f * k1
    w = _weights(ids, x.dtype)
    dots = _dots(_block_dot(pb, f, w), _block_dot(xb, p_h, w))
    dx = -(p_h * drift)
    return x + dx, dx, p_h, pb + xb * drift, dots


def _kick_mtf(p_h, f, pb_h, vjp, xb, ids, k0, c):
    w = _weights(ids, p_h.dtype)
    dots = _dots(_block_dot(pb_h, f, w), _block_dot(pb_h * c, f, w))
    return p_h - f * k0, xb + vjp * c, dots


def _local_dot(u, v, w):
    prod = tf.reduce_sum(u * v, axis=-1)
    if w is not None:
        prod = prod * w
    return tf.reduce_sum(prod, axis=-1)


def _drift_tf(x, p, f, xb, pb, w, k1, drift):
    """:func:`_drift_mtf` on the local slices (TensorFlow ops; ``w`` local weights or None)."""
    p_h = p - f * k1
    dots = tf.stack([_local_dot(pb, f, w), _local_dot(xb, p_h, w)], axis=-1)
    dx = -(p_h * drift)
    return x + dx, dx, p_h, pb + xb * drift, dots


def _kick_tf(p_h, f, pb_h, vjp, xb, w, k0, c):
    """:func:`_kick_mtf` on the local slices."""
    dots = tf.stack([_local_dot(pb_h, f, w), _local_dot(pb_h * c, f, w)], axis=-1)
    return p_h - f * k0, xb + vjp * c, dots


_LOCAL_TF = {"flowpm_adjoint_drift": _drift_tf, "flowpm_adjoint_kick": _kick_tf}


def _lib(t, ids):
    lib = native.ops_for("adjoint_ops", t)
    if lib is not None and ids is not None and ids.dtype not in (tf.int32, tf.int64):
        return None
    return lib


def _fused(op_name, mtf_fn, n_fields, fields, ids, scalars, name):
    """``mtf_fn(*fields, ids, *scalars)`` as one native op per block, or as mtf ops."""
    x = fields[0]
    bdims = x.shape.dims[:2]
    dot_shape = mtf.Shape(bdims + [mtf.Dimension(DOT_DIM, 2)])
    inputs = list(fields) + ([ids] if ids is not None else []) + list(scalars)
    n_float = len(fields)

    def fn(*args):
        sc = args[len(args) - len(scalars):]
        lib = _lib(args[0], ids)
        if lib is None:  # e.g. placed on a GPU: the same expressions as TensorFlow ops
            w = (tf.cast(args[n_float] >= 0, args[0].dtype) if ids is not None else None)
            return _LOCAL_TF[op_name](*args[:n_float], w, *sc)
        local = args[0].shape.as_list()
        flat = [tf.reshape(a, [-1, local[2], 3]) for a in args[:n_float]]
        if ids is not None:
            lid = tf.reshape(args[n_float], [-1, local[2]])
        else:
            lid = tf.zeros([0], tf.int32)
        outs = getattr(lib, op_name)(*flat, lid, *sc)
        fields_out = [tf.reshape(o, local) for o in outs[:n_fields]]
        return tuple(fields_out) + (tf.reshape(outs[n_fields], [local[0], local[1], 2]),)

    def grad_function(op, *dys):
        # mtf.gradients of the same expressions, rebuilt on the op's inputs
        graph = x.graph
        start = len(graph.operations)
        ins = list(op.inputs)
        fl = ins[:n_float]
        rest = ins[n_float:]
        i_ids = rest[0] if ids is not None else None
        sc = rest[1:] if ids is not None else rest
        outs = mtf_fn(*fl, i_ids, *sc)
        pairs = [(o, d) for o, d in zip(outs, dys) if d is not None]
        wrt = fl + list(sc)
        grads = mtf.gradients([o for o, _ in pairs], wrt, grad_ys=[d for _, d in pairs],
                              operations=graph.operations[start:])
        return grads[:n_float] + ([None] if ids is not None else []) + grads[n_float:]

    outs = mtf.slicewise(fn, inputs, output_shape=[x.shape] * n_fields + [dot_shape],
                         output_dtype=[x.dtype] * (n_fields + 1), splittable_dims=bdims,
                         grad_function=grad_function, name=name)
    return outs


def _native_ok(t):
    """Whether the native ops serve ``t``'s dtype (the device is checked at lowering)."""
    return native.load("adjoint_ops") is not None and t.dtype in (tf.float32, tf.float64)


def reverse_drift(x, p, f, xb, pb, ids, k1, drift, native_op=True, name="reverse_drift"):
    r"""The first half of a reverse step: undo the second kick and the drift.

    Parameters
    ----------
    x, p, f : mtf.Tensor
        Positions [cells], momenta and forces at stage ``i + 1``, ``[bx, by, npart, xyz]``.
    xb, pb : mtf.Tensor
        Their cotangents [loss / cells].
    ids : mtf.Tensor or None
        ``[bx, by, npart]`` ids (-1: empty slot, weight 0); None: every slot counts.
    k1, drift : mtf.Tensor or float
        The step's second kick and drift factors (scalars).
    native_op : bool
        Use the fused native op when it serves these tensors (else the mtf expressions).
    name : str

    Returns
    -------
    x_new, dx, p_h, pb_h : mtf.Tensor
        ``x + dx`` [cells], ``dx = -(D p_h)``, ``p_h = p - K1 f`` and ``pb + D xb``.
    dots : mtf.Tensor
        ``[bx, by, adjoint_sum(2)]``: per block, :math:`\sum w\, \bar p \cdot f` and
        :math:`\sum w\, \bar x \cdot p_h` (no collective).
    """
    k1, drift = (_scalar(x, s) for s in (k1, drift))
    if native_op and _native_ok(x):
        return _fused("flowpm_adjoint_drift", _drift_mtf, 4, [x, p, f, xb, pb], ids,
                      [k1, drift], name)
    return _drift_mtf(x, p, f, xb, pb, ids, k1, drift)


def reverse_kick(p_h, f, pb_h, vjp, xb, ids, k0, c, native_op=True, name="reverse_kick"):
    r"""The second half of a reverse step: undo the first kick, add the force VJP.

    Parameters
    ----------
    p_h, f, pb_h : mtf.Tensor
        Half-step momenta, the force at stage ``i`` and the half-step momenta's
        cotangent, ``[bx, by, npart, xyz]``.
    vjp : mtf.Tensor
        :math:`J_F(x_i)^T \bar p_h` (the force's VJP for the cotangent ``pb_h``).
    xb : mtf.Tensor
        The positions' cotangent [loss / cells].
    ids : mtf.Tensor or None
        As :func:`reverse_drift`.
    k0, c : mtf.Tensor or float
        The first kick factor and the force's cotangent factor ``K0_i + K1_{i-1}``.
    native_op : bool
    name : str

    Returns
    -------
    p, xb_new : mtf.Tensor
        ``p_h - K0 f`` and ``xb + c vjp``.
    dots : mtf.Tensor
        ``[bx, by, adjoint_sum(2)]``: :math:`\sum w\, \bar p_h \cdot f` and
        :math:`\sum w\, (c \bar p_h) \cdot f`.
    """
    k0, c = (_scalar(p_h, s) for s in (k0, c))
    if native_op and _native_ok(p_h):
        return _fused("flowpm_adjoint_kick", _kick_mtf, 2, [p_h, f, pb_h, vjp, xb], ids,
                      [k0, c], name)
    return _kick_mtf(p_h, f, pb_h, vjp, xb, ids, k0, c)


def _scalar(like, s):
    """A scalar mtf tensor of ``like``'s dtype from a float or a scalar mtf tensor."""
    if isinstance(s, mtf.Tensor):
        if s.shape.dims:
            raise ValueError("reverse_kdk: factors must be scalars, got shape %s" % s.shape)
        return s if s.dtype == like.dtype else mtf.cast(s, like.dtype)
    return mtf.constant(like.mesh, s, mtf.Shape([]), dtype=like.dtype)
