"""Cloud-in-cell painting and readout on padded blocks.

The 3D painter and readout (and their checks and native kernels); the force VJP's
fused passes built on them are :mod:`flowpm_mtf.physics.painting_vjp`, the 2D plane
painter of the lens planes :mod:`flowpm_mtf.physics.painting_plane`.

Particles
---------
Each block (see :mod:`flowpm_mtf.mesh.halo`) holds its particles with positions in
**block-local coordinates** [cells]: global position minus the block origin
``(i sx, j sy, 0)``. Which particles a block holds is the business of
:mod:`flowpm_mtf.mesh.domain`: with the eulerian decomposition (default) those it
contains, migrated after every drift (so ``halo_size = 2`` suffices); with the
lagrangian one those it started with, for the whole run. Empty slots of the
eulerian buffers are painted with weight 0 (the ``weight`` argument). A position tensor has the shape
``[bx, by, <particle dims>, xyz]`` (``bx`` on ``row``, ``by`` on ``col``;
``<particle dims>`` are any unsplit dimensions, e.g. ``npart`` or a particle
lattice); weights and read-out values have the shape
``[bx, by, <particle dims>]``.

CIC on the padded block: a particle at block-local ``(x, y, z)`` touches the
padded cells ``floor(x) + h + {0, 1}`` along x (same for y) and
``(floor(z) + {0, 1}) mod nz`` along z. The stencil fits in the padded block
iff, along x and y::

    -h <= x < s + h - 1      (s = sx or sy, h = conf.halo_size)

i.e. a particle may move about ``h - 1`` cells away from its block.

Escaping particles
------------------
A particle outside that range (or with a non-finite coordinate) has *escaped*.
It is never dropped silently: :func:`cic_paint` and :func:`cic_readout` count
the escaped particles of all blocks (:func:`escaped_count`, one tiny allreduce)
and make their result depend on ``tf.debugging.assert_equal(count, 0)``.
Evaluating the result then raises ``tf.errors.InvalidArgumentError`` with a
message starting ``"flowpm_mtf.physics.painting: particles escaped"`` -- on every rank
at once, since the count is global (no rank is left waiting in a collective).
:func:`escaped_count` is public for monitoring (e.g. to log the count per step).

Local kernels: native (CPU) or TensorFlow
-----------------------------------------
On the CPU the local paint, readout and escape count are the fused C++ ops of
``flowpm_mtf/native/cic_ops.cc`` (:func:`flowpm_mtf.native.load`, chosen by
``FLOWPM_MTF_NATIVE``): they loop over the 8 corners of each particle instead of
materialising ``[n, 8]`` index and weight rows (and ``[n, 8, C]`` gathered
rows), which is what the TensorFlow path does. The TensorFlow path (a flat
``tf.math.unsorted_segment_sum`` / ``tf.gather`` over the stencil of
:func:`_stencil`) is kept for GPUs (a tensor placed on a GPU, or no device and
a visible GPU: TF's GPU kernels are the path there), for float16/bfloat16, and
when the native library is not built or ``FLOWPM_MTF_NATIVE=0``. Both give the
same stencil; the native paint adds every cell's terms in the same order as
``unsorted_segment_sum`` (equal to the last bit).

Particles with a non-finite coordinate are skipped by the native kernels (they
paint nothing and read 0), so masked slots of fixed-capacity buffers are
harmless; they are still counted as escaped.

Gradients
---------
The TensorFlow path's local scatter and gather are differentiated by
TensorFlow inside ``mtf.slicewise`` (w.r.t. positions, weights and mesh
values). The native ops have exact gradients registered below
(:func:`_paint_grad`, :func:`_readout_grad`): the paint's gradient is a readout
(w.r.t. weights) and the derivative-kernel readout ``FlowpmCicReadoutGradPos``
(w.r.t. positions); the readout's gradient is a paint of the upstream gradient
(w.r.t. the mesh) and the same derivative readout (w.r.t. positions), both in one
pass (``FlowpmCicReadoutGrad``: one stencil per particle; in the adjoint's
reverse step this is the transpose of the force readout). Second derivatives of
the native ops are not defined (``tf.gradients`` raises ``LookupError`` for
``FlowpmCicReadoutGradPos`` and ``FlowpmCicReadoutGrad``). The halo exchange is linear
with an exact adjoint.
The slicewise gradients recompute the local forward function on fresh copies
of the input slices (:func:`_isolated_grad`): Mesh TF's default
(``GenericGradOperation``) calls ``tf.gradients`` on the *lowered* input
slices, which counts a second time every path by which one input depends on
another in the TF graph -- e.g. a PM force reads out a mesh painted from the
same positions, and the mesh path was counted twice.
"""
import logging

import mesh_tensorflow as mtf
import numpy as np
import tensorflow.compat.v1 as tf

from .. import config as cfg
from .. import layout
from .. import native
from ..mesh.halo import (
    _check_shape, field_to_padded, halo_fill, halo_reduce, padded_shape, padded_to_field,
    reduced_to_field)

log = logging.getLogger(__name__)

ESCAPE_MESSAGE = "flowpm_mtf.physics.painting: particles escaped"
"""Start of the error message raised when particles left the halo."""

# ----------------------------------------------------------------------------- particles
def lattice(conf, mesh):
    """One particle at the corner of every cell of each block, block-local.

    Parameters
    ----------
    conf : SimConfig
    mesh : mtf.Mesh

    Returns
    -------
    mtf.Tensor
        ``[bx, by, npart, xyz]`` with ``npart = sx * sy * nz``, positions
        ``(i, j, k)`` [cells] in C order (k fastest); dtype ``conf.dtype``.
    """
    dims = layout.block_cell_dims(conf)
    cell = mtf.Shape(dims)
    # built from ranges (no large graph constant); all dimensions here are local
    axes = [mtf.broadcast(mtf.range(mesh, d, dtype=conf.tf_dtype), cell) for d in dims]
    bx, by, npart = layout.particle_dims(conf)
    xyz = mtf.Dimension(cfg.XYZ, 3)
    base = mtf.reshape(mtf.stack(axes, cfg.XYZ, axis=3), mtf.Shape([npart, xyz]))
    return mtf.broadcast(base, mtf.Shape([bx, by, npart, xyz]))


def lattice_added_tf(y):
    """TensorFlow ops: ``y`` ``[..., sx, sy, nz, 3]`` plus the lattice site ``(i, j, k)`` of
    each cell [cells], added one axis at a time (``((y + i) + j) + k``, the other components
    of each step zero: no full-size lattice tensor)."""
    shp = y.shape.as_list()
    lead, dims = len(shp) - 4, shp[-4:-1]
    for ax, n in enumerate(dims):
        shape = [1] * (lead + 3) + [3]
        shape[lead + ax] = n
        unit = np.zeros((1, 3), y.dtype.as_numpy_dtype)
        unit[0, ax] = 1
        r = tf.range(n, dtype=y.dtype)[:, None] * tf.constant(unit, y.dtype)   # [n, 3]
        y = y + tf.reshape(r, shape)
    return y


def block_origins(conf, mesh):
    """Global position of each block's origin, ``[bx, by, xyz]`` [cells]."""
    P, Q = conf.grid
    sx, sy, _ = conf.block_shape
    o = np.zeros((P, Q, 3), conf.np_dtype)
    o[..., 0] = (np.arange(P) * sx)[:, None]
    o[..., 1] = (np.arange(Q) * sy)[None, :]
    return mtf.import_tf_tensor(
        mesh, tf.constant(o),
        mtf.Shape([mtf.Dimension(cfg.BX, P), mtf.Dimension(cfg.BY, Q),
                   mtf.Dimension(cfg.XYZ, 3)]), name="block_origins")


def to_global(positions, conf):
    """Block-local positions -> global positions [cells] (not wrapped into the box)."""
    return positions + block_origins(conf, positions.mesh)


def from_global(positions, conf):
    """Global positions [cells] of each block's particles -> block-local positions."""
    return positions - block_origins(conf, positions.mesh)


# ----------------------------------------------------------------------------- native ops
def _native_ops(*tensors):
    """The native CIC op module if it serves these local tensors, else None.

    None when the library is not usable, for dtypes other than float32/float64,
    and on a GPU (:func:`flowpm_mtf.native.ops_for`).
    """
    return native.ops_for("cic_ops", *tensors)


def _empty(dtype):
    """The empty tensor that stands for unit weights in the native ops."""
    return tf.zeros([0], dtype)


def _paint_grad(op, grad):
    """Gradient of ``FlowpmCicPaint`` w.r.t. positions and weights (exact)."""
    lib = native.load("cic_ops")
    pos, w = op.inputs
    halo = op.get_attr("halo")
    d_pos = lib.flowpm_cic_readout_grad_pos(grad, pos, w, halo=halo)
    d_w = None if w.shape.num_elements() == 0 else lib.flowpm_cic_readout(grad, pos, halo=halo)
    return d_pos, d_w


def _readout_grad(op, grad):
    """Gradient of ``FlowpmCicReadout`` (and ``FlowpmCicReadoutInto``, whose donor is not
    read and gets none) w.r.t. the mesh and the positions (exact).

    One fused op (``FlowpmCicReadoutGrad``: the paint of ``grad`` and the position
    gradient with one stencil per particle), equal bit for bit to the paint and
    ``FlowpmCicReadoutGradPos``."""
    lib = native.load("cic_ops")
    field, pos = op.inputs[:2]
    d_field, d_pos = lib.flowpm_cic_readout_grad(field, pos, grad, halo=op.get_attr("halo"))
    return (d_field, d_pos) + (None,) * (len(op.inputs) - 2)   # the donor: not read


for _op_type, _fn in (("FlowpmCicPaint", _paint_grad), ("FlowpmCicReadout", _readout_grad),
                      ("FlowpmCicReadoutInto", _readout_grad)):
    try:
        tf.RegisterGradient(_op_type)(_fn)
    except KeyError:  # already registered (module reloaded)
        pass
tf.no_gradient("FlowpmCicEscaped")


def _native_paint(lib, pos, w, conf):
    """Native paint of the local slice ``[nbx, nby, n, 3]`` -> ``[nbx, nby, px, py, nz]``."""
    nbx, nby, n, _ = pos.shape.as_list()
    px, py, nz = conf.padded_block_shape
    flat = tf.reshape(pos, [nbx * nby, n, 3])
    wt = _empty(pos.dtype) if w is None else tf.reshape(w, [nbx * nby, n, 1])
    field = lib.flowpm_cic_paint(flat, wt, halo=conf.halo_size, px=px, py=py, nz=nz,
                                 components=1)
    return tf.reshape(field, [nbx, nby, px, py, nz])


def _native_readout(lib, m, pos, conf, n_comp, donor=None):
    """Native readout of ``m`` (``[nbx, nby, px, py, nz, ...]``) -> ``[nbx, nby, n, C]``
    (``FlowpmCicReadoutInto`` the ``donor``'s buffer when one is given)."""
    nbx, nby, n, _ = pos.shape.as_list()
    px, py, nz = conf.padded_block_shape
    field = tf.reshape(m, [nbx * nby, px, py, nz, n_comp])
    flat = tf.reshape(pos, [nbx * nby, n, 3])
    if donor is None:
        vals = lib.flowpm_cic_readout(field, flat, halo=conf.halo_size)
    else:
        vals = lib.flowpm_cic_readout_into(field, flat, tf.reshape(donor, [nbx * nby, n, n_comp]),
                                           halo=conf.halo_size)
    return tf.reshape(vals, [nbx, nby, n, n_comp])


# ----------------------------------------------------------------------------- checks
def _check_particles(positions, what):
    names = positions.shape.dimension_names
    if names[:2] != [cfg.BX, cfg.BY] or names[-1] != cfg.XYZ or positions.shape[-1].size != 3:
        raise ValueError("%s: positions must have the shape [bx, by, <particle dims>, xyz(3)], "
                         "got %s" % (what, positions.shape))


def _check_halo(conf, what):
    if conf.halo_size < 1:
        raise ValueError("%s: CIC needs halo_size >= 1 (a particle in a block's last cell "
                         "deposits into the next block), got %d" % (what, conf.halo_size))


def _stencil(pos, conf):
    """CIC cells (flat indices into the padded local slice) and weights.

    Parameters
    ----------
    pos : tf.Tensor
        ``[nbx, nby, n, 3]`` block-local positions [cells].

    Returns
    -------
    idx : tf.Tensor
        ``[nbx, nby, n, 8]``, int32 (int64 when the padded slice holds 2^31 cells
        or more): flat index into the local padded slice
        ``[nbx, nby, px, py, nz]`` (row-major), x and y clipped into the
        padded block, z periodic.
    kernel : tf.Tensor
        ``[nbx, nby, n, 8]`` CIC weights.

    Notes
    -----
    The 8 corners are built from per-axis pairs (``floor``, ``floor + 1``) and
    weights (``1 - f``, ``f``) by broadcasting, and painting is a flat
    ``unsorted_segment_sum``: faster on the CPU than 5-column
    ``tensor_scatter_nd_add`` / ``gather_nd`` indices.
    """
    h = conf.halo_size
    px, py, nz = conf.padded_block_shape
    nbx, nby, n, _ = pos.shape.as_list()
    floor = tf.floor(pos)
    frac = pos - floor
    # int32 flat indices wrap beyond 2^31 cells (e.g. 2048^3 on 4 ranks): int64 there.
    itype = tf.int64 if nbx * nby * px * py * nz >= 2**31 else tf.int32
    cell = tf.cast(floor, itype)
    w = tf.stack([1.0 - frac, frac], axis=-1)        # [nbx, nby, n, 3, 2]
    c = tf.stack([cell, cell + 1], axis=-1)          # [nbx, nby, n, 3, 2]
    ix = tf.clip_by_value(c[..., 0, :] + h, 0, px - 1)
    iy = tf.clip_by_value(c[..., 1, :] + h, 0, py - 1)
    iz = tf.math.floormod(c[..., 2, :], nz)
    block = tf.reshape(tf.range(nbx, dtype=itype)[:, None] * nby
                       + tf.range(nby, dtype=itype)[None, :], [nbx, nby, 1, 1])
    ix = ix + block * px                              # [nbx, nby, n, 2]
    idx = (ix[..., :, None, None] * py + iy[..., None, :, None]) * nz + iz[..., None, None, :]
    kernel = (w[..., 0, :, None, None] * w[..., 1, None, :, None] * w[..., 2, None, None, :])
    return tf.reshape(idx, [nbx, nby, n, 8]), tf.reshape(kernel, [nbx, nby, n, 8])


def _local_particles(t):
    """Reshape a local positions slice ``[nbx, nby, ..., 3]`` to ``[nbx, nby, n, 3]``."""
    s = t.shape.as_list()
    return tf.reshape(t, [s[0], s[1], -1, 3])


def escaped_count(positions, conf, name="escaped_count"):
    """Number of particles whose CIC stencil does not fit in their padded block.

    Parameters
    ----------
    positions : mtf.Tensor
        Block-local positions ``[bx, by, <particle dims>, xyz]`` [cells].
    conf : SimConfig

    Returns
    -------
    mtf.Tensor
        int32 scalar, summed over all blocks (identical on every processor).
        Non-finite positions count as escaped.
    """
    _check_particles(positions, "escaped_count")
    h = conf.halo_size
    sx, sy, _ = conf.block_shape

    def fn(pos):
        pos = _local_particles(pos)
        lib = _native_ops(pos)
        if lib is not None:
            nbx, nby, n, _ = pos.shape.as_list()
            count = lib.flowpm_cic_escaped(tf.reshape(pos, [nbx * nby, n, 3]), halo=h, sx=sx,
                                           sy=sy)
            return tf.reshape(count, [nbx, nby])
        fl = tf.floor(pos)
        ok = tf.reduce_all(tf.math.is_finite(pos), axis=-1)
        for axis, s in ((0, sx), (1, sy)):
            ok = ok & (fl[..., axis] >= -h) & (fl[..., axis] <= s + h - 2)
        return tf.reduce_sum(tf.cast(tf.logical_not(ok), tf.int32), axis=-1)

    per_block = mtf.slicewise(fn, [positions], output_shape=positions.shape.dims[:2],
                              output_dtype=tf.int32, splittable_dims=positions.shape.dims[:2],
                              grad_function=0, name=name)
    return mtf.reduce_sum(per_block)


def _assert_none_escaped(t, count, what):
    """``t`` gated by the assertion ``count == 0`` (gradient passes through)."""

    def fn(x, n):
        check = tf.debugging.assert_equal(
            n, tf.constant(0, n.dtype),
            message="%s: %s found particles beyond the halo (their CIC stencil leaves the "
                    "padded block; increase halo_size or take smaller steps); count ="
                    % (ESCAPE_MESSAGE, what))
        with tf.control_dependencies([check]):
            return tf.identity(x)

    return mtf.slicewise(fn, [t, count], output_shape=t.shape, output_dtype=t.dtype,
                         splittable_dims=t.shape.dims,
                         grad_function=lambda op, dy: [dy, None], name="check_" + what)


# ----------------------------------------------------------------------------- CIC
def _isolated_grad(forward_fn, splittable_dims, name):
    """A ``grad_function`` for ``mtf.slicewise(forward_fn, inputs, ...)``.

    The gradient of each input slice is computed by ``tf.gradients`` of
    ``forward_fn`` re-applied to ``tf.identity`` copies of the slices, so only
    the direct dependence of the output on each input is differentiated (not
    paths between the inputs elsewhere in the TF graph). All inputs must be
    floating point.
    """

    def grad_function(op, dy):
        inputs = list(op.inputs)
        n = len(inputs)

        def fn(*args):
            xs = [tf.identity(a) for a in args[:n]]
            y = forward_fn(*xs)
            g = tuple(tf.gradients(y, xs, grad_ys=args[n],
                                   unconnected_gradients=tf.UnconnectedGradients.ZERO))
            return g if n > 1 else g[0]

        one = n == 1  # mtf.slicewise wants a single output unwrapped
        grads = mtf.slicewise(fn, inputs + [dy],
                              output_shape=inputs[0].shape if one else [x.shape for x in inputs],
                              output_dtype=inputs[0].dtype if one else [x.dtype for x in inputs],
                              splittable_dims=splittable_dims, name=name + "_grad")
        return list(grads) if isinstance(grads, (list, tuple)) else [grads]

    return grad_function


def _paint_local_tf(pos, w, conf):
    """The paint of one process's particles ``[nbx, nby, n, 3]`` as TensorFlow ops."""
    idx, kernel = _stencil(pos, conf)
    if w is not None:
        s = w.shape.as_list()
        kernel = kernel * tf.reshape(w, [s[0], s[1], -1, 1])
    nbx, nby = pos.shape.as_list()[:2]
    local_shape = [nbx, nby] + list(conf.padded_block_shape)
    painted = tf.math.unsorted_segment_sum(tf.reshape(kernel, [-1]), tf.reshape(idx, [-1]),
                                           int(np.prod(local_shape)))
    return tf.reshape(painted, local_shape)


def cic_paint(mesh, positions, conf, weight=None, name="cic_paint", _unreduced=False,
              escape_checked=False):
    """Paint particles on padded blocks with CIC, then reduce the halos.

    Parameters
    ----------
    mesh : mtf.Tensor or None
        Padded blocks ``[bx, by, px, py, z]`` to add to (margins should be zero),
        or None for an empty mesh.
    positions : mtf.Tensor
        Block-local positions ``[bx, by, <particle dims>, xyz]`` [cells].
    conf : SimConfig
    weight : mtf.Tensor, optional
        ``[bx, by, <particle dims>]`` particle weights (default 1).
    name : str, optional
    _unreduced : bool, optional
        Internal (:func:`paint_field`): return the padded blocks before the halo
        reduction.
    escape_checked : bool, optional
        True when the caller has already verified that every particle's stencil
        fits its padded block (e.g. right after :func:`flowpm_mtf.mesh.domain.migrate`,
        whose gate tests exactly that for the valid particles and leaves empty
        slots at zero): skips the escape count and its reduction over blocks.

    Returns
    -------
    mtf.Tensor
        Padded blocks ``[bx, by, px, py, z]``: inner cells hold the painted
        density (mass per cell, in units of the weights), margins are zero.

    Raises
    ------
    ValueError
        At graph construction, for wrong shapes or ``halo_size < 1``.
    tf.errors.InvalidArgumentError
        At run time, if a particle escaped (see the module docstring).
    """
    _check_particles(positions, name)
    _check_halo(conf, name)
    shape = padded_shape(conf)
    if mesh is not None:
        mesh = _check_shape(mesh, shape, name)
    if weight is not None and weight.shape.dims != positions.shape.dims[:-1]:
        raise ValueError("%s: weight must have the shape %s, got %s"
                         % (name, positions.shape.dims[:-1], weight.shape))
    inputs = (([mesh] if mesh is not None else []) + [positions]
              + ([weight] if weight is not None else []))

    def paint(pos, w):
        pos = _local_particles(pos)
        lib = _native_ops(pos)
        if lib is not None:
            return _native_paint(lib, pos, w, conf)
        return _paint_local_tf(pos, w, conf)

    def fn(*args):
        if mesh is not None:
            return args[0] + paint(args[1], args[2] if len(args) > 2 else None)
        return paint(args[0], args[1] if len(args) > 1 else None)

    painted = mtf.slicewise(fn, inputs, output_shape=shape,
                            output_dtype=positions.dtype if mesh is None else mesh.dtype,
                            splittable_dims=shape.dims[:2],
                            grad_function=_isolated_grad(fn, shape.dims[:2], name), name=name)
    if not escape_checked:
        painted = _assert_none_escaped(painted, escaped_count(positions, conf), "cic_paint")
    return painted if _unreduced else halo_reduce(painted, conf)


def cic_readout(mesh, positions, conf, name="cic_readout"):
    """Fill the halos, then read the mesh out at the particle positions with CIC.

    Parameters
    ----------
    mesh : mtf.Tensor
        Padded blocks ``[bx, by, px, py, z]``, optionally followed by unsplit
        component dimensions (e.g. ``xyz``: the three force components are read
        with one stencil, one escape check and one halo exchange); only the
        inner cells are used (the margins are overwritten by
        :func:`~flowpm_mtf.mesh.halo.halo_fill`).
    positions : mtf.Tensor
        Block-local positions ``[bx, by, <particle dims>, xyz]`` [cells].
    conf : SimConfig
    name : str, optional

    Returns
    -------
    mtf.Tensor
        ``[bx, by, <particle dims>, <component dims>]``, dtype of ``mesh``.

    Raises
    ------
    ValueError
        At graph construction, for wrong shapes or ``halo_size < 1``.
    tf.errors.InvalidArgumentError
        At run time, if a particle escaped (see the module docstring).
    """
    _check_particles(positions, name)
    _check_halo(conf, name)
    mesh = _check_shape(mesh, padded_shape(conf), name, trailing=True)
    _check_components(mesh.shape.dims[5:], positions, name)
    # Check before the halo exchange, so that no rank enters a collective alone.
    mesh = halo_fill(_assert_none_escaped(mesh, escaped_count(positions, conf), "cic_readout"),
                     conf)
    return _readout_filled(mesh, positions, conf, name)


def readout_padded(mesh, positions, conf, name="readout_padded", escape_checked=False,
                   donor=None):
    """:func:`cic_readout` of padded blocks whose margins are already filled.

    E.g. the force field of one block written with its periodic margins
    (:func:`flowpm_mtf.physics.kernels.xyz_from_packed` with ``padded_conf``): no halo
    exchange and no copy of the field. Same checks and escape check
    (``escape_checked`` as in :func:`cic_paint`). ``donor``: a tensor of the output's
    shape and dtype whose buffer the native readout writes into where nothing else holds
    it (``FlowpmCicReadoutInto``; e.g. :func:`flowpm_mtf.mesh.donate.take` of the variable the
    values are assigned to); its values are not read, and it gets no gradient.
    """
    _check_particles(positions, name)
    _check_halo(conf, name)
    mesh = _check_shape(mesh, padded_shape(conf), name, trailing=True)
    _check_components(mesh.shape.dims[5:], positions, name)
    if not escape_checked:
        mesh = _assert_none_escaped(mesh, escaped_count(positions, conf), name)
    return _readout_filled(mesh, positions, conf, name, donor)


def _check_components(extra, positions, name):
    if any(d in positions.shape.dims[:-1] for d in extra):
        raise ValueError("%s: the mesh's component dimensions %s clash with the particle "
                         "dimensions %s" % (name, extra, positions.shape.dims[:-1]))


def _readout_filled(mesh, positions, conf, name, donor=None):
    """The readout of :func:`cic_readout` from padded blocks whose margins are filled
    (into ``donor``'s buffer where it can, see :func:`readout_padded`)."""
    mesh = _check_shape(mesh, padded_shape(conf), name, trailing=True)
    extra = mesh.shape.dims[5:]
    n_comp = int(np.prod([d.size for d in extra]))
    out_shape = mtf.Shape(positions.shape.dims[:-1] + extra)
    if donor is not None and (donor.shape != out_shape or donor.dtype != mesh.dtype):
        raise ValueError("%s: the donor must be %s of %s, got %s of %s"
                         % (name, out_shape, mesh.dtype.name, donor.shape, donor.dtype.name))

    def fn(m, pos, *donors):
        local = _local_particles(pos)
        lib = _native_ops(m, local)
        if lib is not None:
            vals = _native_readout(lib, m, local, conf, n_comp, *donors)
        else:
            idx, kernel = _stencil(local, conf)
            rows = tf.gather(tf.reshape(m, [-1, n_comp]), idx)     # [nbx, nby, n, 8, C]
            vals = tf.reduce_sum(rows * kernel[..., None], axis=-2)
        return tf.reshape(vals, pos.shape.as_list()[:-1] + [d.size for d in extra])

    return mtf.slicewise(fn, [mesh, positions] + ([] if donor is None else [donor]),
                         output_shape=out_shape,
                         output_dtype=mesh.dtype, splittable_dims=positions.shape.dims[:2],
                         grad_function=_isolated_grad(fn, positions.shape.dims[:2], name),
                         name=name)


def paint_field(positions, conf, weight=None, name="paint_field", escape_checked=False):
    """CIC-paint particles and return the real-space field ``[x, y, z]``.

    See :func:`cic_paint` (also for ``escape_checked``); the result is the
    unpadded, halo-reduced mesh (:func:`~flowpm_mtf.mesh.halo.reduced_to_field`: the
    reduction and the unpadding in one, with fewer copies of the field).
    """
    return reduced_to_field(cic_paint(None, positions, conf, weight, name=name,
                                      _unreduced=True, escape_checked=escape_checked), conf)


def readout_field(field, positions, conf, name="readout_field", escape_checked=False,
                  donor=None):
    """CIC-read a real-space field ``[x, y, z]`` (optionally followed by component
    dimensions, e.g. ``xyz``) at the particle positions.

    :func:`cic_readout` of the field's padded blocks, the margins filled as the
    blocks are padded (:func:`~flowpm_mtf.mesh.halo.field_to_padded`: one copy of the
    field per axis instead of three); the same values. The escape check runs
    before the halo exchange, as in :func:`cic_readout` (``escape_checked`` as in
    :func:`cic_paint`; ``donor`` as in :func:`readout_padded`).
    """
    _check_particles(positions, name)
    _check_halo(conf, name)
    _check_components(field.shape.dims[3:], positions, name)
    if not escape_checked:
        field = _assert_none_escaped(field, escaped_count(positions, conf), name)
    return _readout_filled(field_to_padded(field, conf), positions, conf, name, donor)
