r"""The force VJP's fused CIC passes: a scaled readout and its VJP, one pass over the particles.

The adjoint's reverse step needs, with the force readout, its vector-Jacobian
product: the paint of the cotangents (the mesh's part) and the position gradient
of the readout. :func:`readout_vjp` computes the three in one native op
(``FlowpmCicReadoutVjp``); where the cotangents are known before the force,
:func:`paint_pair` paints them in the density paint's slab scan
(``FlowpmCicPaintPair``) and :func:`readout_scaled_grad` does the rest in one pass
over the particles (``FlowpmCicReadoutScaledGrad``). Each output equals bit for bit
the paint, readout and ``mtf.gradients`` of :mod:`flowpm_mtf.physics.painting` it
replaces; without the native op (a GPU, ``FLOWPM_MTF_NATIVE=0``) the same as
TensorFlow ops in the slices. They are gradients: not differentiable themselves.
The native-or-TensorFlow choice is painting's (``painting._native_ops``, looked up
there at each call: one switch for every CIC kernel). Used by
:func:`flowpm_mtf.physics.gravity.pm_forces_vjp`.
"""
import mesh_tensorflow as mtf
import numpy as np
import tensorflow.compat.v1 as tf

from .. import native
from ..mesh.halo import _check_shape, padded_shape
from . import painting
from .painting import (_assert_none_escaped, _check_components, _check_halo, _check_particles,
                       _empty, _local_particles, _paint_local_tf, _stencil, escaped_count,
                       readout_padded)

__all__ = ["readout_vjp", "paint_pair", "readout_scaled_grad"]


def readout_vjp(mesh, positions, cotangents, conf, scale, weight=None, name="readout_vjp"):
    r"""A scaled readout and its VJP in one pass: the PM force and the first half of its VJP.

    With :math:`R` the CIC readout of ``mesh`` (padded blocks whose margins are
    filled, as :func:`~flowpm_mtf.physics.painting.readout_padded`) at ``positions``,
    :math:`w` the slot weights and :math:`s` the scale, returns

    * ``values`` :math:`v = (R\,s)\,w`;
    * ``dmesh``, the paint of :math:`d = (\bar v\,w)\,s` on the padded blocks
      (margins included, not reduced): :math:`J_{\rm mesh}^T \bar v`;
    * ``dpositions`` :math:`\sum_c d_c\, \partial R_c/\partial x`: the
      positions' part of :math:`J^T \bar v` through the readout only (the
      mesh's own dependence on the positions is the caller's).

    The products are those of ``readout_padded(...) * scale * weight`` and of its
    ``mtf.gradients`` (one native op ``FlowpmCicReadoutVjp``, the stencil computed
    once per particle; equal bit for bit). Without the native op (GPU,
    ``FLOWPM_MTF_NATIVE=0``) the same as Mesh TF ops and ``mtf.gradients``.
    Not differentiable itself (it is a gradient).

    Parameters
    ----------
    mesh : mtf.Tensor
        Padded blocks ``[bx, by, px, py, z, <components>]``, margins filled.
    positions : mtf.Tensor
        Block-local positions ``[bx, by, npart, xyz]`` [cells]; their stencils
        must fit the padded blocks (checked by the caller, e.g. the migration or
        :func:`~flowpm_mtf.physics.painting.escaped_count`).
    cotangents : mtf.Tensor
        :math:`\bar v`, ``[bx, by, npart, <components>]``.
    conf : SimConfig
    scale : float
        :math:`s` (e.g. the force's :math:`\tfrac32\Omega_m`).
    weight : mtf.Tensor, optional
        ``[bx, by, npart]`` slot weights (default 1).
    name : str

    Returns
    -------
    values, dmesh, dpositions : mtf.Tensor
        Shapes of ``cotangents``, ``mesh`` and ``positions``.
    """
    mesh, out_shape, n_comp = _check_vjp_args(mesh, positions, cotangents, weight, conf, name)
    lib = native.load("cic_ops")
    if lib is None or positions.dtype not in (tf.float32, tf.float64):
        return _readout_vjp_mtf(mesh, positions, cotangents, conf, scale, weight, name)
    inputs = [mesh, positions, cotangents] + ([weight] if weight is not None else [])

    def fn(m, pos, ct, w=None):
        local = _local_particles(pos)
        if painting._native_ops(m, local) is None:  # placed where the native op does not run
            return _readout_vjp_local_tf(m, pos, ct, w, conf, scale, n_comp)
        nbx, nby, n, _ = local.shape.as_list()
        px, py, nz = conf.padded_block_shape
        vals, dm, dpos = lib.flowpm_cic_readout_vjp(
            tf.reshape(m, [nbx * nby, px, py, nz, n_comp]), tf.reshape(local, [nbx * nby, n, 3]),
            tf.reshape(ct, [nbx * nby, n, n_comp]),
            _empty(pos.dtype) if w is None else tf.reshape(w, [nbx * nby, n]),
            tf.constant(scale, pos.dtype), halo=conf.halo_size)
        return (tf.reshape(vals, ct.shape), tf.reshape(dm, m.shape), tf.reshape(dpos, pos.shape))

    return mtf.slicewise(fn, inputs, output_shape=[out_shape, mesh.shape, positions.shape],
                         output_dtype=[mesh.dtype] * 3, splittable_dims=positions.shape.dims[:2],
                         name=name)


def _check_vjp_args(mesh, positions, cotangents, weight, conf, name):
    """The checks of :func:`readout_vjp` and :func:`readout_scaled_grad`.

    Returns ``(mesh, values_shape, n_comp)``: the mesh checked against the padded
    blocks, the shape of the values (and cotangents), the number of components.
    """
    _check_particles(positions, name)
    _check_halo(conf, name)
    mesh = _check_shape(mesh, padded_shape(conf), name, trailing=True)
    extra = mesh.shape.dims[5:]
    _check_components(extra, positions, name)
    out_shape = mtf.Shape(positions.shape.dims[:-1] + extra)
    if cotangents.shape != out_shape:
        raise ValueError("%s: cotangents must have the shape %s, got %s"
                         % (name, out_shape, cotangents.shape))
    if weight is not None and weight.shape.dims != positions.shape.dims[:-1]:
        raise ValueError("%s: weight must have the shape %s, got %s"
                         % (name, positions.shape.dims[:-1], weight.shape))
    return mesh, out_shape, int(np.prod([d.size for d in extra]))


def _readout_vjp_mtf(mesh, positions, cotangents, conf, scale, weight, name):
    """:func:`readout_vjp` as Mesh TF ops and ``mtf.gradients`` (no native op)."""
    graph = positions.graph
    start = len(graph.operations)
    values = readout_padded(mesh, positions, conf, name=name, escape_checked=True) * scale
    if weight is not None:
        values = values * weight
    dmesh, dpos = mtf.gradients([values], [mesh, positions], grad_ys=[cotangents],
                                operations=graph.operations[start:])
    return values, dmesh, dpos


def _readout_vjp_local_tf(m, pos, ct, w, conf, scale, n_comp):
    """:func:`readout_vjp` on one process's slices as TensorFlow ops (no native op here)."""
    mi, pi = tf.identity(m), tf.identity(_local_particles(pos))
    idx, kernel = _stencil(pi, conf)
    rows = tf.gather(tf.reshape(mi, [-1, n_comp]), idx)
    vals = tf.reshape(tf.reduce_sum(rows * kernel[..., None], axis=-2), ct.shape) * scale
    if w is not None:
        vals = vals * tf.reshape(w, w.shape.as_list() + [1] * (len(ct.shape) - len(w.shape)))
    dm, dp = tf.gradients(vals, [mi, pi], grad_ys=ct,
                          unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return vals, dm, tf.reshape(dp, pos.shape)


def paint_pair(positions, cotangents, conf, scale, weight=None, name="paint_pair",
               escape_checked=False):
    r"""The density paint and :func:`readout_vjp`'s paint of the cotangents, in one pass.

    In the adjoint's reverse step the force's cotangents are known before the
    force is computed, so the paint of :math:`d = (\bar v\,w)\,s` (the mesh's
    part of the readout's VJP) can share the slab scan of the density paint:
    native ``FlowpmCicPaintPair``; each output equal bit for bit to the op it
    replaces. The rest of :func:`readout_vjp` is then
    :func:`readout_scaled_grad`, parallel over the particles.

    Parameters
    ----------
    positions : mtf.Tensor
        Block-local positions ``[bx, by, npart, xyz]`` [cells].
    cotangents : mtf.Tensor
        :math:`\bar v`, ``[bx, by, npart, <components>]``.
    conf : SimConfig
    scale : float
        :math:`s`.
    weight : mtf.Tensor, optional
        ``[bx, by, npart]`` slot weights (default 1): the density's masses and
        the factor :math:`w` of :math:`d`.
    name : str
    escape_checked : bool, optional
        As in :func:`~flowpm_mtf.physics.painting.cic_paint` (else the density is gated
        by the escape check).

    Returns
    -------
    painted : mtf.Tensor
        ``cic_paint(None, positions, conf, weight, _unreduced=True)``: padded
        blocks ``[bx, by, px, py, z]``, margins not reduced [particles per cell].
    dmesh : mtf.Tensor
        :func:`readout_vjp`'s ``dmesh``: the paint of :math:`d`, padded blocks
        ``[bx, by, px, py, z, <components>]``, margins not reduced.
    """
    _check_particles(positions, name)
    _check_halo(conf, name)
    pdims = positions.shape.dims[:-1]
    extra = cotangents.shape.dims[len(pdims):]
    if cotangents.shape.dims[:len(pdims)] != pdims or not extra:
        raise ValueError("%s: cotangents must have the shape %s + <components>, got %s"
                         % (name, mtf.Shape(pdims), cotangents.shape))
    _check_components(extra, positions, name)
    if weight is not None and weight.shape.dims != pdims:
        raise ValueError("%s: weight must have the shape %s, got %s"
                         % (name, pdims, weight.shape))
    n_comp = int(np.prod([d.size for d in extra]))
    shape = padded_shape(conf)
    dshape = mtf.Shape(shape.dims + extra)
    inputs = [positions, cotangents] + ([weight] if weight is not None else [])

    def fn(pos, ct, w=None):
        local = _local_particles(pos)
        lib = painting._native_ops(local)
        px, py, nz = conf.padded_block_shape
        nbx, nby, n, _ = local.shape.as_list()
        if lib is None:  # placed where the native op does not run
            zeros = tf.zeros([nbx, nby, px, py, nz] + [d.size for d in extra], pos.dtype)
            return (_paint_local_tf(local, w, conf),
                    _readout_vjp_local_tf(zeros, pos, ct, w, conf, scale, n_comp)[1])
        rho, dm = lib.flowpm_cic_paint_pair(
            tf.reshape(local, [nbx * nby, n, 3]), tf.reshape(ct, [nbx * nby, n, n_comp]),
            _empty(pos.dtype) if w is None else tf.reshape(w, [nbx * nby, n]),
            tf.constant(scale, pos.dtype), halo=conf.halo_size, px=px, py=py, nz=nz)
        return (tf.reshape(rho, [nbx, nby, px, py, nz]),
                tf.reshape(dm, [nbx, nby, px, py, nz] + [d.size for d in extra]))

    painted, dmesh = mtf.slicewise(fn, inputs, output_shape=[shape, dshape],
                                   output_dtype=[positions.dtype] * 2,
                                   splittable_dims=shape.dims[:2], name=name)
    if not escape_checked:
        painted = _assert_none_escaped(painted, escaped_count(positions, conf), name)
    return painted, dmesh


def readout_scaled_grad(mesh, positions, cotangents, conf, scale, weight=None,
                        density_bar=None, name="readout_scaled_grad"):
    r""":func:`readout_vjp` without its paint (see :func:`paint_pair`), plus the paint's
    position gradient.

    Returns ``values`` :math:`(R\,s)\,w` and ``dpositions``
    :math:`\sum_c d_c\,\partial R_c/\partial x` with :math:`d = (\bar v\,w)\,s`,
    bit for bit :func:`readout_vjp`'s; with ``density_bar`` :math:`\bar\rho`
    (padded blocks, margins filled) ``dpositions`` also holds the position
    gradient of the weighted paint :math:`w\,\nabla_x (R\bar\rho)`, the
    paint's part of a force VJP. One native pass over the particles
    (``FlowpmCicReadoutScaledGrad``, one stencil per particle). Not
    differentiable itself (it is a gradient).

    Parameters
    ----------
    mesh : mtf.Tensor
        Padded blocks ``[bx, by, px, py, z, <components>]``, margins filled.
    positions : mtf.Tensor
        Block-local positions ``[bx, by, npart, xyz]`` [cells], stencils inside
        the padded blocks (checked by the caller).
    cotangents : mtf.Tensor
        :math:`\bar v`, ``[bx, by, npart, <components>]``.
    conf : SimConfig
    scale : float
    weight : mtf.Tensor, optional
        ``[bx, by, npart]`` slot weights (default 1).
    density_bar : mtf.Tensor, optional
        Padded blocks ``[bx, by, px, py, z]``, margins filled.
    name : str

    Returns
    -------
    values, dpositions : mtf.Tensor
        Shapes of ``cotangents`` and ``positions``.
    """
    mesh, out_shape, n_comp = _check_vjp_args(mesh, positions, cotangents, weight, conf, name)
    if density_bar is not None:
        density_bar = _check_shape(density_bar, padded_shape(conf), name)
    inputs = ([mesh, positions, cotangents] + ([weight] if weight is not None else [])
              + ([density_bar] if density_bar is not None else []))

    def fn(m, pos, ct, *rest):
        w = rest[0] if weight is not None else None
        rb = rest[-1] if density_bar is not None else None
        local = _local_particles(pos)
        lib = painting._native_ops(m, local)
        nbx, nby, n, _ = local.shape.as_list()
        if lib is None:  # placed where the native op does not run
            vals, _, dpos = _readout_vjp_local_tf(m, pos, ct, w, conf, scale, n_comp)
            if rb is not None:
                ones = tf.ones(pos.shape.as_list()[:-1] + [1], pos.dtype)
                dv = ones if w is None else tf.reshape(w, ones.shape)
                dpos = dpos + _readout_vjp_local_tf(rb[..., None], pos, dv, None, conf, 1.0, 1)[2]
            return vals, dpos
        px, py, nz = conf.padded_block_shape
        vals, dpos = lib.flowpm_cic_readout_scaled_grad(
            tf.reshape(m, [nbx * nby, px, py, nz, n_comp]), tf.reshape(local, [nbx * nby, n, 3]),
            tf.reshape(ct, [nbx * nby, n, n_comp]),
            _empty(pos.dtype) if w is None else tf.reshape(w, [nbx * nby, n]),
            tf.constant(scale, pos.dtype),
            _empty(pos.dtype) if rb is None else tf.reshape(rb, [nbx * nby, px, py, nz, 1]),
            halo=conf.halo_size)
        return tf.reshape(vals, ct.shape), tf.reshape(dpos, pos.shape)

    return mtf.slicewise(fn, inputs, output_shape=[out_shape, positions.shape],
                         output_dtype=[mesh.dtype] * 2, splittable_dims=positions.shape.dims[:2],
                         name=name)
