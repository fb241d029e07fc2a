r"""Particles follow the mesh: ownership by current position, migration, capacity.

Decomposition (``conf.decomposition``)
--------------------------------------
``"eulerian"`` (default; FastPM's ``fastpm_decompose`` after every drift): a
particle belongs to the block (see :mod:`flowpm_mtf.mesh.halo`) that contains its
**current** position. After every drift (:func:`flowpm_mtf.physics.nbody.kdk_step`)
and after the LPT displacement (:func:`flowpm_mtf.physics.lpt.lpt_init`) the
particles that left their block move to the neighbouring block: first along x
(``bx``, mesh axis ``row``), then along y (``by``, ``col``), so a particle that
crossed a corner travels diagonally in two shifts. Particles are therefore
inside their block whenever they are painted or read out, and the halo only
covers the CIC stencil plus a margin: ``halo_size = 2``, whatever the
resolution and the number of steps. The check after a migration accepts a
particle anywhere its CIC stencil fits in the padded block (``-h <= floor(x)
<= s + h - 2``): one that ends slightly outside its block (a rounding corner
case seen once in 2M particles at 0.5 Mpc/h in float32) is painted correctly
through the halo and moves at the next migration.

``"lagrangian"``: particles stay on the block of their initial lattice site
(FlowPM's mesh code); the halo must cover the largest displacement of the run.

Static shapes: capacity and validity
------------------------------------
Mesh TF shapes are static, so each block holds a fixed number of particle
**slots**, :func:`flowpm_mtf.physics.sizing.capacity` (>= its ``sx sy nz`` lattice particles), and each
slot carries the particle's global id (:func:`lattice_ids`: its initial
lattice index, row-major over the particle grid) or ``-1`` for an empty slot.
Empty slots have zero position (block-local), momentum and force, and zero
weight when painted (:func:`weights`). The lagrangian decomposition has no
empty slots.

A migration round along one axis split into several blocks (all in
``mtf.slicewise`` on the local blocks, plus two ``mtf.shift`` of ``send_capacity``
rows):

1. *send*: the valid particles with block-local coordinate ``< 0`` (``>= s``)
   are gathered, in slot order, into the first rows of the send buffer to the
   lower (upper) neighbour and moved into its frame (``+ s`` / ``- s``; a
   coordinate that rounds to ``s`` is set to the largest float below ``s``).
   A send buffer packs only the leavers: ``[bx, by, send_capacity, mig_f]``
   with the position, the other per-particle fields (momenta; also the LPT
   forces in :func:`flowpm_mtf.physics.lpt.lpt_init`), the id as two integers below
   ``2**24`` (exact in float32) and the validity flag;
2. *shift*: the two send buffers go to the neighbours (``mtf.shift`` by one
   block, periodic);
3. *plan*: the slots that keep their particle and, for each received row, the
   slot it fills (the first empty slots, in order), computed once per round;
4. *merge*, one field at a time: the leavers' slots are zeroed and the
   received rows scatter-added into their slots (``tensor_scatter_nd_add``, or on
   the CPU the native ``FlowpmScatterAddRows``; in place on the zeroed copy). No
   tensor of the whole buffer times all fields exists: each field is rebuilt on its
   own, and each merge waits for the previous one (:func:`flowpm_mtf.mesh.ordering.after`),
   so a round holds at most one extra copy of a field ``[slots, 3]`` and the small
   send buffers.

Along an axis with a single block nothing is exchanged: the positions are
wrapped into the box (periodic); on a 1x1 grid a migration is only that wrap
and the statistics (and :func:`flowpm_mtf.physics.sizing.capacity` is the particle count).

Overflow and escape checks (never a silent loss)
------------------------------------------------
Each migration computes, per block, the largest send count, the slots needed
after every merge, the particles still outside their block after the last
round, the particles moved, the particle count and (from
:func:`flowpm_mtf.physics.nbody.kdk_step`) the largest displacement of the step; their
maximum over blocks (one small reduction, the same on every rank) gates the
migrated state: if a send buffer or a block would overflow, or a particle moved
more than one block in one step, evaluating the state raises
``tf.errors.InvalidArgumentError`` whose message starts with
:data:`CHECK_MESSAGE` on every rank at the same point, before any variable is
updated (nothing is lost: the previous state is intact).
:func:`error_from_tf` turns that message into a :class:`~flowpm_mtf.errors.
CapacityError` (with the capacities that would work) or a
:class:`~flowpm_mtf.errors.ParticleEscapeError` (with a number of steps that
would work).

Gradients
---------
Split and merge are linear in the packed data for a given assignment (which is
piecewise constant in the positions), i.e. a permutation of the valid
particles; their gradients are those of the local gathers and segment sums
(:func:`flowpm_mtf.physics.painting._isolated_grad`), the shifts are exact adjoints.

Sizes
-----
This module knows no cosmology: the buffer sizes are the caller's numbers, fixed
when the graph is built. The slots are the ``npart`` size of the tensors it is
given, the rows of a send buffer :func:`migrate`'s ``send_rows``; the graph
builders (:mod:`flowpm_mtf.physics.nbody`, :mod:`flowpm_mtf.physics.lpt`,
:mod:`flowpm_mtf.gradients.adjoint`, the jobs) estimate them with :mod:`flowpm_mtf.physics.sizing`
from the run's own stages. An overflow is caught here and reported with the
values that would work (and the jobs retry with them).
"""
import logging
import math
import re

import mesh_tensorflow as mtf
import numpy as np
import tensorflow.compat.v1 as tf

from .. import layout, native
from ..errors import CapacityError, ConfigError, ParticleEscapeError
from .ordering import after

__all__ = ["CHECK_MESSAGE", "STATS", "id_dtype", "lattice_ids", "weights", "pad_particles", "migrate",
           "wrap_sizes", "wrap_tf", "error_from_tf", "bytes_per_migration"]

log = logging.getLogger(__name__)

CHECK_MESSAGE = "flowpm_mtf.mesh.domain: migration check failed"
"""Start of the run-time error raised when a buffer would overflow or a particle escaped."""

STATS = ("send", "need", "outside", "moved", "count", "displacement")
"""Names of the migration statistics (maximum over blocks), in order:
largest send count of one direction and round [particles], largest slot count
needed after a merge [particles], particles outside their block after the last
round, particles sent out of one block [particles], particles of the fullest
block [particles], largest x/y displacement of the step [cells]."""
_S = {name: i for i, name in enumerate(STATS)}

F_DIM = "mig_f"
"""Packed column dimension (fields, id, validity)."""
SEND_DIM = "mig_send"
STAT_DIM = "mig_stat"

_ID_SPLIT = 2**24     # ids travel as (id // 2^24, id % 2^24): exact in float32
_N_ID_COLS = 3        # id_hi, id_lo, valid


# ----------------------------------------------------------------------------- sizes
def bytes_per_migration(conf, n_fields, send_rows, rounds=1):
    """Bytes each block sends per migration [bytes]: ``4 rounds`` buffers of ``send_rows`` rows.

    Parameters
    ----------
    conf : SimConfig
    n_fields : int
        Per-particle vectors travelling with the positions.
    send_rows : int
        Rows of a send buffer [particles] (as given to :func:`migrate`).
    rounds : int
        Migration rounds.
    """
    cols = 3 * (1 + n_fields) + _N_ID_COLS
    return 4 * rounds * int(send_rows) * cols * conf.np_dtype.itemsize


def id_dtype(conf):
    """tf dtype of particle ids: int32, or int64 from 2**31 particles on."""
    return tf.int64 if conf.n_particles >= 2**31 else tf.int32


# ----------------------------------------------------------------------------- ids
def lattice_ids(conf, mesh, deps=(), order="slots"):
    """Global ids of the lattice particles of every block, ``[bx, by, npart]``.

    The id of the particle that starts at global cell ``(i, j, k)`` is
    ``(i ny + j) nz + k`` (row-major; FlowPM's particle order); dtype
    :func:`id_dtype`. Built only after ``deps`` (:func:`flowpm_mtf.mesh.ordering.after`),
    if given, by broadcasting sums (no transpose).

    ``order``: ``"slots"``, the order the ICs give the particles
    (:func:`flowpm_mtf.layout.slot_tiles`: tile by tile; the lattice order with the
    lagrangian decomposition), or ``"lattice"``, that of
    :func:`flowpm_mtf.physics.painting.lattice` (row-major in the block).
    """
    if order not in ("slots", "lattice"):
        raise ValueError("lattice_ids: order must be 'slots' or 'lattice', got %r" % (order,))
    (P, Q), (sx, sy, nz) = conf.grid, conf.block_shape
    ny = conf.nc[1]
    dt = id_dtype(conf)
    tx, ty, tz = layout.slot_tiles(conf) if order == "slots" else (1, 1, 1)
    bx, by = mtf.Dimension(layout.BX, P), mtf.Dimension(layout.BY, Q)
    rx = after(mtf.range(mesh, bx, dtype=dt), deps)
    ry = mtf.range(mesh, by, dtype=dt)

    def fn(ix, iy):
        nbx, nby = ix.shape.as_list()[0], iy.shape.as_list()[0]

        def at(t, axis):   # t along axis of [nbx, nby, sx/tx, sy/ty, nz/tz, tx, ty, tz]
            shape = [1] * 8
            shape[axis] = -1
            return tf.reshape(t, shape)

        def rng(n, step=1):
            return tf.range(n, dtype=dt) * step

        gx = (at(ix * sx, 0) + at(rng(sx // tx, tx), 2)) + at(rng(tx), 5)
        gy = (at(iy * sy, 1) + at(rng(sy // ty, ty), 3)) + at(rng(ty), 6)
        gz = at(rng(nz // tz, tz), 4) + at(rng(tz), 7)
        return tf.reshape((gx * ny + gy) * nz + gz, [nbx, nby, sx * sy * nz])

    return mtf.slicewise(fn, [rx, ry], output_shape=mtf.Shape(layout.particle_dims(conf)),
                         output_dtype=dt, splittable_dims=[bx, by], grad_function=0,
                         name="lattice_ids")


def weights(ids, conf):
    """Painting weights of the slots (1 valid, 0 empty), or None without empty slots.

    Parameters
    ----------
    ids : mtf.Tensor or None
        ``[bx, by, npart]`` particle ids (-1: empty slot).
    conf : SimConfig

    Returns
    -------
    mtf.Tensor or None
        ``[bx, by, npart]`` of ``conf.dtype``; None for the lagrangian
        decomposition, without ids, or on a single block whose capacity is its
        lattice count (every slot then holds a particle for the whole run: none
        can leave, and a checkpoint of another grid restores all of them): no
        per-slot weights to compute every step and for the paint to read.
    """
    if ids is None or conf.decomposition == "lagrangian":
        return None
    if conf.n_ranks == 1 and (ids.shape.get_dim_by_name(layout.NPART).size
                              == math.prod(conf.block_shape)):
        return None
    return mtf.cast(mtf.greater_equal(ids, mtf.zeros(ids.mesh, ids.shape, ids.dtype)),
                    conf.tf_dtype)


def pad_particles(t, slots, value=0):
    """Pad a lattice-ordered ``[bx, by, npart, ...]`` tensor to ``slots`` slots.

    Parameters
    ----------
    t : mtf.Tensor
        ``[bx, by, npart, ...]``.
    slots : int
        Particle slots per block [particles] (the caller's
        :func:`flowpm_mtf.physics.sizing.capacity`), at least ``npart``.
    value : scalar
        Value of the added slots (e.g. -1 for ids).
    """
    n = t.shape.get_dim_by_name(layout.NPART).size
    extra = int(slots) - n
    if extra == 0:
        return t
    if value == 0:
        return mtf.pad(t, [0, extra], layout.NPART)
    return mtf.pad(t - value, [0, extra], layout.NPART) + value


# ----------------------------------------------------------------------------- local ops
def _particle_ops(t, floating=True):
    """The native op module (``flowpm_mtf/native/particle_ops.cc``) if it serves the local
    tensor ``t`` (on a CPU; float32/float64 when ``floating``), else None (the
    TensorFlow path: no library, ``FLOWPM_MTF_NATIVE=0``, or a GPU)."""
    return native.ops_for("particle_ops", t, dtypes=native.FLOATS if floating else None)


def _rows_of(sel, m, nb):
    """For each of ``m`` output rows, the flat source row of the j-th selected row.

    ``sel``: bool ``[nb, n]``. Returns int32 ``[nb, m]`` row indices into the
    flattened ``[nb * n]`` rows (-1 where fewer than ``m`` rows are selected)
    and the count of selected rows per block.
    """
    lib = _particle_ops(sel, floating=False)
    if lib is not None:
        # FlowpmSelectRows (particle_ops.cc): one scan per block, the same rows and count.
        return tuple(lib.flowpm_select_rows(sel, m=int(m)))
    n = sel.shape.as_list()[-1]
    rank = tf.cumsum(tf.cast(sel, tf.int32), axis=-1, exclusive=True)
    blk = tf.range(nb)[:, None]
    seg = tf.where_v2(sel & (rank < m), rank, m) + blk * (m + 1)
    src = tf.range(nb * n)
    first = tf.math.unsorted_segment_max(src, tf.reshape(seg, [-1]), nb * (m + 1))
    first = tf.reshape(first, [nb, m + 1])[:, :m]
    return tf.where_v2(first >= 0, first, -1), tf.reduce_sum(tf.cast(sel, tf.int32), axis=-1)


def _count_true(sel, nb):
    """int32 ``[nb]``: the true entries of each block of ``sel`` (bool ``[.., n]``)."""
    sel = tf.reshape(sel, [nb, -1])
    lib = _particle_ops(sel, floating=False)
    if lib is not None:
        return lib.flowpm_select_rows(sel, m=0)[1]      # a scan, no int32 copy
    return tf.reduce_sum(tf.cast(sel, tf.int32), axis=-1)


def _mask_rows(x, keep):
    """``x`` ``[N, C]`` with the rows where ``keep`` (bool ``[N]``) is false set to zero.

    On the CPU the native ``FlowpmMaskRows`` (in place; gradient below), else
    ``x * keep``.
    """
    lib = _particle_ops(x)
    if lib is not None:
        return lib.flowpm_mask_rows(x, keep)
    return x * tf.cast(keep, x.dtype)[:, None]


@tf.RegisterGradient("FlowpmMaskRows")
def _mask_rows_grad(op, dy):
    """Masking rows is linear and self-adjoint: the gradient masks the same rows."""
    return [_mask_rows(dy, op.inputs[1]), None]


def _scatter_add_rows(x, rows, updates):
    """``x`` ``[N, C]`` with row ``r`` of ``updates`` ``[R, C]`` added into row ``rows[r]``.

    ``tf.tensor_scatter_nd_add(x, rows[:, None], updates)``. On the CPU the native
    ``FlowpmScatterAddRows`` (in place, the same bits, a fraction of TensorFlow's ~60 ns
    per update row; gradient below), else TensorFlow's op.
    """
    lib = native.ops_for("particle_ops", x, dtypes=(tf.float32, tf.float64, tf.int32, tf.int64))
    if lib is not None:
        return lib.flowpm_scatter_add_rows(x, rows, updates)
    return tf.tensor_scatter_nd_add(x, tf.reshape(rows, [-1, 1]), updates)


@tf.RegisterGradient("FlowpmScatterAddRows")
def _scatter_add_rows_grad(op, dy):
    """Linear: ``x`` gets ``dy``, update ``r`` gets row ``rows[r]`` of ``dy`` (as
    TensorFlow's gradient of ``tensor_scatter_nd_add``)."""
    return [dy, None, tf.gather(dy, op.inputs[1])]


def _leaving(x, ids, axis, s):
    """Masks ``[.., C]`` of the valid particles below (``< 0``) and above (``>= s``) the block."""
    pos = x[..., axis]
    valid = ids >= 0
    return valid & (pos < 0), valid & (pos >= s)


def _below(s, dtype):
    return tf.constant(np.nextafter(np.asarray(s, dtype.as_numpy_dtype), 0), dtype)


def _wrap_fn(axes, sizes):
    """Local periodic wrap of the coordinates along ``axes`` into ``[0, s)`` (one block).

    On the CPU the native ``FlowpmWrap`` (``flowpm_mtf/native/particle_ops.cc``) does it
    in one pass over the positions, in place, with the same float operations as the
    TensorFlow path below (which unstacks, wraps and restacks the coordinates, a few
    passes over the particles); its gradient is the identity, as the caller's ``grad_function``.
    """

    def fn(x):
        lib = _particle_ops(x)
        if lib is not None:
            return lib.flowpm_wrap(x, sizes=[float(sizes[ax]) if ax in axes else 0.0
                                             for ax in range(3)])
        return wrap_tf(x, [float(sizes[ax]) if ax in axes else 0.0 for ax in range(3)])

    return fn


def wrap_tf(x, sizes):
    """``FlowpmWrap`` as TensorFlow ops: ``x`` ``[..., 3]`` wrapped into ``[0, s)`` along
    every axis of size ``s`` > 0 of ``sizes`` (3 floats; 0: unchanged), the same float
    operations as the native op."""
    cols = tf.unstack(x, axis=-1)
    for ax, size in enumerate(sizes):
        if size == 0:
            continue
        s = tf.cast(size, x.dtype)
        w = cols[ax] - s * tf.floor(cols[ax] / s)
        w = tf.where_v2(w < 0, w + s, w)
        w = tf.where_v2(w >= s, w - s, w)
        cols[ax] = tf.minimum(w, _below(size, x.dtype))
    return tf.stack(cols, axis=-1)


def wrap_sizes(conf):
    """The sizes [cells] :func:`migrate` wraps the positions to, per axis: the block's
    along an axis of one block (x, y; :func:`exchange_axes`), 0 (none) elsewhere."""
    axes = exchange_axes(conf)
    return [float(conf.block_shape[ax]) if ax in (0, 1) and ax not in axes else 0.0
            for ax in range(3)]


@tf.RegisterGradient("FlowpmWrap")
def _wrap_grad(op, dy):
    """The wrap is a translation by a whole period: its gradient is the identity."""
    return dy


def _send_fn(axis, s, m, n_fields):
    """Local send buffers: ``x, fields.., ids [.., C]`` -> ``[nbx, nby, 2m, F]``.

    Rows ``0..m-1``: the particles leaving downwards (moved into the lower
    neighbour's frame, ``+ s``), rows ``m..2m-1``: upwards (``- s``); columns:
    position, fields, id (hi, lo) and validity; unused rows are zero.
    """

    def fn(*args):
        x, fields, ids = args[0], list(args[1:1 + n_fields]), args[1 + n_fields]
        nbx, nby, c, _ = x.shape.as_list()
        nb = nbx * nby
        lo, hi = _leaving(x, ids, axis, s)
        flat = [tf.reshape(t, [nb * c, 3]) for t in [x] + fields]
        flat_ids = tf.reshape(ids, [nb * c])     # cast only the gathered rows (no int64 copy)
        out = []
        for sel, shift in ((lo, s), (hi, -s)):
            src, _ = _rows_of(tf.reshape(sel, [nb, c]), m, nb)
            ok = src >= 0
            at = tf.maximum(src, 0)
            okf = tf.cast(ok, x.dtype)[..., None]
            cols = [tf.gather(t, at) * okf for t in flat]                   # [nb, m, 3]
            pos = cols[0][..., axis] + tf.cast(shift, x.dtype)
            if shift > 0:                                              # x + s may round to s
                pos = tf.minimum(pos, _below(s, x.dtype))
            pos = tf.where_v2(ok, pos, tf.zeros_like(pos))
            cols[0] = tf.concat([cols[0][..., :axis], pos[..., None], cols[0][..., axis + 1:]],
                                axis=-1)
            i = tf.where_v2(ok, tf.cast(tf.gather(flat_ids, at), tf.int64), tf.zeros([], tf.int64))
            idc = tf.stack([i // _ID_SPLIT, i % _ID_SPLIT, tf.cast(ok, tf.int64)], axis=-1)
            cols.append(tf.cast(idc, x.dtype))
            out.append(tf.concat(cols, axis=-1))
        return tf.reshape(tf.concat(out, axis=1), [nbx, nby, 2 * m, -1])

    return fn


def _plan_fn(axis, s):
    """Local merge plan of one round: ``x, recv, ids`` -> ``keep, target, stats``.

    ``keep`` bool ``[.., C]``: the valid slots that stay; ``target`` int32 ``[.., 2m]``:
    for each received row, the flat slot it fills (the first empty slots after the
    leavers left, in order; 0 for an unused row, which adds zeros, and for the rows
    beyond the free slots, which only happens with an overflow the migration check
    reports before the result is used); ``stats`` float64 ``[.., 3]``: the largest send
    count of one direction, the slots needed after the merge, the particles that left.
    """

    def fn(x, recv, ids):
        nbx, nby, c = ids.shape.as_list()
        nb, rows = nbx * nby, recv.shape.as_list()[2]
        lo, hi = _leaving(x, ids, axis, s)
        keep = (ids >= 0) & ~(lo | hi)
        slot, n_empty = _rows_of(tf.reshape(~keep, [nb, c]), rows, nb)  # flat slot of k-th empty
        rvalid = recv[..., -1] > 0.5
        rank = tf.cumsum(tf.cast(tf.reshape(rvalid, [nb, rows]), tf.int32), axis=-1,
                         exclusive=True)
        target = tf.gather(slot, rank, batch_dims=1)
        target = tf.where_v2(tf.reshape(rvalid, [nb, rows]) & (target >= 0), target, 0)
        # exact int32 counts (no float64 copy of the slots), then float64; lo and hi
        # are disjoint, and the kept slots are those _rows_of did not count as empty
        n_lo, n_hi = _count_true(lo, nb), _count_true(hi, nb)
        n_keep = c - n_empty
        f64 = lambda t: tf.cast(tf.reshape(t, [nbx, nby]), tf.float64)  # noqa: E731
        stats = tf.stack([f64(tf.maximum(n_lo, n_hi)), f64(n_keep + _count_true(rvalid, nb)),
                          f64(n_lo + n_hi)], axis=-1)
        return keep, tf.reshape(target, [nbx, nby, rows]), stats

    return fn


def _merge_fn(col):
    """Local merge of one per-particle vector: ``field, recv, keep, target`` -> ``field``.

    The leavers' slots are zeroed and the received rows' columns ``col..col+2``
    are added into their target slots (an unused row adds 0).
    """

    def fn(field, recv, keep, target):
        out = _mask_rows(tf.reshape(field, [-1, 3]), tf.reshape(keep, [-1]))
        upd = tf.reshape(recv[..., col:col + 3], [-1, 3])
        return tf.reshape(_scatter_add_rows(out, tf.reshape(target, [-1]), upd), field.shape)

    return fn


def _merge_ids_fn(ids, recv, keep, target):
    """Local merge of the ids (as :func:`_merge_fn`; -1 for an empty slot)."""
    rid = (tf.cast(tf.round(recv[..., -3]), tf.int64) * _ID_SPLIT
           + tf.cast(tf.round(recv[..., -2]), tf.int64))
    rid = tf.where_v2(recv[..., -1] > 0.5, rid + 1, 0)             # +1: an unused row adds 0
    # In the ids' own dtype (int32 below 2**31 particles: no int64 copy of the slots).
    rid = tf.cast(rid, ids.dtype)
    out = tf.reshape(tf.where_v2(keep, ids + 1, tf.zeros([], ids.dtype)), [-1, 1])
    out = _scatter_add_rows(out, tf.reshape(target, [-1]), tf.reshape(rid, [-1, 1])) - 1
    return tf.reshape(out, ids.shape)


def _count_fn(stat, sizes=None):
    """Per-block float64 statistic ``[nbx, nby]`` (no gradient)."""

    def fn(*ts):
        if stat == "count":
            return tf.reduce_sum(tf.cast(ts[0] >= 0, tf.float64), -1)
        if stat == "outside":     # beyond what the padded block's CIC stencil covers
            x, ids = ts
            h = sizes[2]
            bad = ~tf.reduce_all(tf.math.is_finite(x), axis=-1)
            for ax, size in ((0, sizes[0]), (1, sizes[1])):
                fl = tf.floor(x[..., ax])
                bad = bad | (fl < -h) | (fl > size + h - 2)
            return tf.reduce_sum(tf.cast((ids >= 0) & bad, tf.float64), -1)
        if stat == "displacement":
            return tf.cast(tf.reduce_max(tf.abs(ts[0][..., :2]), axis=[-2, -1]), tf.float64)
        raise ValueError(stat)

    return fn


def _particle_stats_fn(sizes):
    """Per-block float64 ``[nbx, nby, 3]``: the ``outside``, ``count`` and
    ``displacement`` statistics of :func:`_count_fn` (in that order) from
    ``(x, ids[, displacement])``; the displacement column is 0 without it.

    On the CPU the native ``FlowpmParticleStats`` (``flowpm_mtf/native/particle_ops.cc``)
    computes the three in one pass over the particles (the TensorFlow path below
    makes about a dozen), with the same counts and
    maximum (a NaN displacement gives NaN there; the escape count reports it anyway).
    """
    sx, sy, h = sizes

    def fn(x, ids, *disp):
        lib = _particle_ops(x)
        if lib is not None:
            nbx, nby = x.shape.as_list()[:2]
            nb = nbx * nby
            d = tf.reshape(disp[0], [nb, -1, 3]) if disp else tf.zeros([0], x.dtype)
            out = lib.flowpm_particle_stats(tf.reshape(x, [nb, -1, 3]), tf.reshape(ids, [nb, -1]),
                                            d, halo=h, sx=sx, sy=sy)
            return tf.reshape(out, [nbx, nby, 3])
        cols = [_count_fn("outside", sizes=sizes)(x, ids), _count_fn("count")(ids)]
        cols.append(_count_fn("displacement")(disp[0]) if disp else tf.zeros_like(cols[1]))
        return tf.stack(cols, axis=-1)

    return fn


def _block_stat(fn, inputs, name, extra=()):
    bdims = inputs[0].shape.dims[:2]
    return mtf.slicewise(fn, inputs, output_shape=mtf.Shape(bdims + list(extra)),
                         output_dtype=tf.float64, splittable_dims=bdims, grad_function=0,
                         name=name)


def _local(fn, inputs, out_shape, name, n_int=1):
    """``mtf.slicewise`` over the block dims, differentiable w.r.t. its float inputs.

    The last ``n_int`` inputs are integer (ids): no gradient. The gradient of the
    others is ``tf.gradients`` of ``fn`` re-applied to the local slices (as
    :func:`flowpm_mtf.physics.painting._isolated_grad`).
    """
    bdims = inputs[0].shape.dims[:2]
    nf = len(inputs) - n_int

    def grad_function(op, dy):
        ins = list(op.inputs)

        def gfn(*args):
            xs = [tf.identity(a) for a in args[:nf]]
            y = fn(*(xs + list(args[nf:len(ins)])))
            return tuple(tf.gradients(y, xs, grad_ys=args[-1],
                                      unconnected_gradients=tf.UnconnectedGradients.ZERO))

        grads = mtf.slicewise(gfn, ins + [dy], output_shape=[t.shape for t in ins[:nf]],
                              output_dtype=[t.dtype for t in ins[:nf]],
                              splittable_dims=bdims, name=name + "_grad")
        return list(grads) + [None] * n_int

    return mtf.slicewise(fn, inputs, output_shape=out_shape, output_dtype=inputs[0].dtype,
                         splittable_dims=bdims, grad_function=grad_function, name=name)


def _gate(t, stats, cap, m):
    """``t`` gated by the assertion that no buffer overflowed and none escaped."""

    def fn(x, st):
        # A variable slice (ids on a grid with nothing to exchange) is read here, outside
        # the control dependency: a read gated by the assertion would become a control
        # input of every assignment of that variable (hvd_mesh_impl.ordered_update_op),
        # e.g. the initial one, which would then need the step's inputs.
        x = tf.identity(x)
        ok = ((st[_S["send"]] <= m) & (st[_S["need"]] <= cap)
              & tf.equal(st[_S["outside"]], 0.0))
        check = tf.debugging.Assert(
            ok, ["%s (capacity %d, send_capacity %d); stats %s:" % (CHECK_MESSAGE, cap, m,
                                                                     ",".join(STATS)), st],
            summarize=len(STATS))
        with tf.control_dependencies([check]):
            return tf.identity(x)

    return mtf.slicewise(fn, [t, stats], output_shape=t.shape, output_dtype=t.dtype,
                         splittable_dims=t.shape.dims[:2],
                         grad_function=lambda op, dy: [dy, None], name="migrate_check")


# ----------------------------------------------------------------------------- migrate
def sort_by_column(conf, fields, ids, name="sort_by_column"):
    """Reorder every block's particles by the (x, y) column of the padded block they are in.

    The CIC paint and readout touch the field around each particle in slot order;
    the slots start in lattice (Lagrangian) order, which the particles' motion
    scrambles in Eulerian space as the run goes on, so that late in a large run the
    paint and readout spend most of their time on cache misses (``--sort-every`` and
    docs/benchmarks.md). The order is a stable counting sort of the
    columns (native ``FlowpmSortByColumn``; empty slots, id < 0, and non-finite
    positions last), applied to every field and the ids in one pass
    (``FlowpmPermuteRows``). The particles, their ids and the physics are
    unchanged; the paint sums a cell's deposits in the new slot order (other
    last bits). Not differentiable (a job's forward run only).

    Parameters
    ----------
    conf : SimConfig
        ``"eulerian"`` decomposition (the lagrangian one keeps its particles in
        lattice order: its ids are implicit).
    fields : list of mtf.Tensor
        ``[bx, by, npart, ...]``; the first is the positions ``[..., xyz]``
        (block-local cells), whose columns define the order.
    ids : mtf.Tensor
        ``[bx, by, npart]``.
    name : str

    Returns
    -------
    (list of mtf.Tensor, mtf.Tensor)
        The fields and the ids, reordered.
    """
    if conf.decomposition != "eulerian":
        raise ConfigError("sort_by_column: the eulerian decomposition only (got %r)"
                          % conf.decomposition)
    h = conf.halo_size
    px, py, _ = conf.padded_block_shape
    inputs = list(fields) + [ids]

    def fn(*ts):
        pos, idv = ts[0], ts[-1]
        nbx, nby = pos.shape.as_list()[:2]
        flat = [tf.reshape(t, [nbx * nby, -1] + t.shape.as_list()[3:]) for t in ts]
        lib = _particle_ops(pos)
        if lib is not None:
            order = lib.flowpm_sort_by_column(tf.reshape(flat[0], [nbx * nby, -1, 3]), flat[-1],
                                              halo=h, px=px, py=py)
            out = lib.flowpm_permute_rows(order, flat)
        else:   # the same order from TensorFlow ops (GPU; no native library)
            p3 = tf.reshape(flat[0], [nbx * nby, -1, 3])
            ok = tf.reduce_all(tf.math.is_finite(p3), -1) & (flat[-1] >= 0)
            fl = tf.clip_by_value(tf.floor(tf.where_v2(ok[..., None], p3, tf.zeros_like(p3))),
                                  -2.0 ** 30, 2.0 ** 30)
            col = [tf.clip_by_value(tf.cast(fl[..., a], tf.int64) + h, 0, size - 1)
                   for a, size in ((0, px), (1, py))]
            key = tf.where_v2(ok, col[0] * py + col[1], tf.constant(px * py, tf.int64))
            order = tf.argsort(key, axis=-1, stable=True)
            out = [tf.gather(t, order, batch_dims=1) for t in flat]
        return tuple(tf.reshape(o, t.shape) for o, t in zip(out, ts))

    out = mtf.slicewise(fn, inputs, output_shape=[t.shape for t in inputs],
                        output_dtype=[t.dtype for t in inputs],
                        splittable_dims=inputs[0].shape.dims[:2], grad_function=0, name=name)
    out = list(out)
    return out[:-1], out[-1]


def exchange_axes(conf):
    """The axes (0: x over ``row``, 1: y over ``col``) split into more than one block.

    Only these exchange particles; along an axis of one block the positions are
    wrapped periodically instead (no buffers, no communication).
    """
    return [ax for ax in (0, 1) if conf.grid[ax] > 1]


def migrate(conf, positions, fields, ids, *, send_rows, displacement=None, rounds=1,
            wrapped=False, name="migrate"):
    """Move every particle to the block that contains its position.

    Parameters
    ----------
    conf : SimConfig
    positions : mtf.Tensor
        Block-local positions ``[bx, by, npart, xyz]`` [cells], ``npart`` the
        slots of a block; each valid particle at most ``rounds`` blocks away from
        its block along x and y.
    fields : list of mtf.Tensor
        Other per-particle vectors ``[bx, by, npart, xyz]`` (e.g. momenta) that
        travel with the particles.
    ids : mtf.Tensor
        ``[bx, by, npart]`` integer ids, -1 for an empty slot.
    send_rows : int
        Rows of a send buffer [particles] (at most ``npart`` are used), fixed when
        the graph is built: the caller sizes it from its run
        (:func:`flowpm_mtf.physics.sizing.send_capacity` of the run's stages, or of the
        ICs' displacement). More leavers than this in one direction and round
        fail the migration's check (module docstring).
    displacement : mtf.Tensor, optional
        ``[bx, by, npart, xyz]`` displacement of the last drift [cells]; its
        largest x/y component goes into the statistics (for the number of steps
        suggested when a particle escaped).
    rounds : int
        Migration rounds (one block per round along each axis).
    wrapped : bool
        The positions are already wrapped along the axes of one block (to
        :func:`wrap_sizes`, e.g. by :func:`flowpm_mtf.physics.lpt.lattice_combine_potentials`):
        no wrap pass here.
    name : str

    Returns
    -------
    positions, fields, ids
        Migrated (same shapes): every valid particle is in its block,
        ``0 <= x < sx``, ``0 <= y < sy`` (z unchanged), or within the halo of
        it (checked); emptied slots are zero with id -1. Gated by the
        overflow/escape check (module docstring).
    stats : mtf.Tensor
        float64 ``[mig_stat]`` (:data:`STATS`), the maximum over blocks.
    """
    cap = positions.shape.get_dim_by_name(layout.NPART).size
    if cap + 2 * cap >= 2**31:
        # The local row bookkeeping (cumsum ranks, flat row indices) is int32.
        raise ConfigError(
            "the eulerian decomposition holds at most %d particle slots per rank, this run "
            "needs %d: use more ranks or --decomposition lagrangian" % ((2**31 - 1) // 3, cap))
    m = min(int(send_rows), cap)
    sx, sy, _ = conf.block_shape
    x, fields = positions, list(fields)
    bx, by = x.shape.dims[:2]
    axes = exchange_axes(conf)
    wrap = [ax for ax in (0, 1) if ax not in axes]
    if wrap and not wrapped:
        x = mtf.slicewise(_wrap_fn(wrap, (sx, sy)), [x], output_shape=x.shape,
                          output_dtype=x.dtype, splittable_dims=[bx, by],
                          grad_function=lambda op, dy: [dy], name=name + "_wrap")
    n_cols = 3 * (1 + len(fields)) + _N_ID_COLS
    recv_shape = mtf.Shape([bx, by, mtf.Dimension(SEND_DIM, 2 * m), mtf.Dimension(F_DIM, n_cols)])
    rstats = []
    for r in range(int(rounds) if axes else 0):
        for axis in axes:
            bdim, s = (bx, sx) if axis == 0 else (by, sy)
            tag = "%s_r%d_%s" % (name, r, "xy"[axis])
            send = _local(_send_fn(axis, s, m, len(fields)), [x] + fields + [ids], recv_shape,
                          tag + "_send")
            to_lo, to_hi = (mtf.slice(send, i * m, m, SEND_DIM) for i in (0, 1))
            recv = mtf.concat([mtf.shift(to_hi, 1, bdim, wrap=True),    # block i-1's upward
                               mtf.shift(to_lo, -1, bdim, wrap=True)],  # block i+1's downward
                              SEND_DIM)
            bdims = [bx, by]
            keep, target, st = mtf.slicewise(
                _plan_fn(axis, s), [x, recv, ids],
                output_shape=[ids.shape, mtf.Shape(bdims + [recv_shape.dims[2]]),
                              mtf.Shape(bdims + [mtf.Dimension(STAT_DIM, 3)])],
                output_dtype=[tf.bool, tf.int32, tf.float64], splittable_dims=bdims,
                grad_function=0, name=tag + "_plan")
            rstats.append(st)
            # One field at a time (each merge waits for the previous one): the old
            # and new buffers of one field only are live together.
            merged = []
            for k, f in enumerate([x] + fields):
                merged.append(_local(_merge_fn(3 * k), [after(f, merged[-1:], tag + "_after"),
                                                        recv, keep, target],
                                     f.shape, "%s_merge%d" % (tag, k), n_int=2))
            x, *fields = merged
            ids = mtf.slicewise(_merge_ids_fn, [after(ids, merged[-1:], tag + "_after"), recv,
                                                keep, target], output_shape=ids.shape,
                                output_dtype=ids.dtype, splittable_dims=bdims, grad_function=0,
                                name=tag + "_merge_ids")
    zeros = mtf.zeros(x.mesh, mtf.Shape([bx, by]), dtype=tf.float64)
    if rstats:
        def col(i):
            return [mtf.reshape(mtf.slice(t, i, 1, STAT_DIM), mtf.Shape([bx, by])) for t in rstats]
        send_max, need_max, moved = _max_of(col(0)), _max_of(col(1)), mtf.add_n(col(2))
    else:
        send_max = need_max = moved = zeros
    local = _block_stat(_particle_stats_fn((sx, sy, conf.halo_size)),
                        [x, ids] + ([displacement] if displacement is not None else []),
                        name + "_stats", extra=[mtf.Dimension(STAT_DIM, 3)])
    outside, count, disp = (mtf.reshape(mtf.slice(local, i, 1, STAT_DIM), mtf.Shape([bx, by]))
                            for i in range(3))
    per_block = [send_max, need_max, outside, moved, count, disp]
    stats = mtf.reduce_max(mtf.stack(per_block, STAT_DIM, axis=2),
                           output_shape=mtf.Shape([mtf.Dimension(STAT_DIM, len(STATS))]))
    x = _gate(x, stats, cap, m)
    fields = [_gate(f, stats, cap, m) for f in fields]
    ids = _gate(ids, stats, cap, m)
    return x, fields, ids, stats


def _max_of(ts):
    out = ts[0]
    for t in ts[1:]:
        out = mtf.maximum(out, t)
    return out


# ----------------------------------------------------------------------------- errors
_CAP_RE = re.compile(r"capacity (\d+), send_capacity (\d+)")


def parse_check(message):
    """The statistics, capacity and send capacity of a failed migration check message.

    Returns
    -------
    dict or None
        ``{"stats": {name: value}, "capacity": int, "send_capacity": int}``,
        or None if ``message`` is not a migration check failure.
    """
    if CHECK_MESSAGE not in message:
        return None
    caps = _CAP_RE.search(message)
    tail = message[message.index(CHECK_MESSAGE):]
    nums = re.findall(r"-?\d+(?:\.\d*)?(?:e[-+]?\d+)?", tail.split(":", 2)[-1])
    if caps is None or len(nums) < len(STATS):
        return None
    values = [float(v) for v in nums[:len(STATS)]]
    return {"stats": dict(zip(STATS, values)), "capacity": int(caps.group(1)),
            "send_capacity": int(caps.group(2))}


def error_from_tf(exc, conf):
    """The :class:`FlowpmError` for a failed migration check, or None.

    Parameters
    ----------
    exc : Exception
        Typically ``tf.errors.InvalidArgumentError`` from a session run.
    conf : SimConfig

    Returns
    -------
    CapacityError or ParticleEscapeError or None
        ``CapacityError`` names the capacities that would work (1.25 x the
        needed ones); ``ParticleEscapeError`` a number of steps that would keep
        the motion per step below 0.8 block. (Particles that left the halo of a
        lagrangian run: :func:`flowpm_mtf.physics.sizing.lagrangian_escape_error`.)
    """
    info = parse_check(str(getattr(exc, "message", exc)))
    if info is None:
        return None
    st, cap, m = info["stats"], info["capacity"], info["send_capacity"]
    # An overflow first: the rows that found no slot were added into slot 0 of the
    # (discarded) result, so the "outside" count is meaningless then -- unless the
    # step moved particles (the largest x/y displacement, computed before any
    # exchange) farther than a block along a split axis: no capacity can deliver
    # those, a larger buffer would only fail again.
    sx, sy, _ = conf.block_shape
    split = [s for s, g in zip((sx, sy), conf.grid) if g > 1]
    too_far = bool(split) and st["displacement"] > min(split)
    if st["outside"] > 0 and ((st["need"] <= cap and st["send"] <= m) or too_far):
        disp = st["displacement"]
        steps = (int(math.ceil(conf.n_steps * disp / (0.8 * min(sx, sy)))) + 1
                 if disp > 0 else None)
        return ParticleEscapeError(
            "%d particle(s) moved more than one block (%d cells) in one time step (largest "
            "displacement %.1f cells): the time step is too long%s"
            % (st["outside"], min(sx, sy), disp,
               "; use --steps %d or more" % steps if steps else ""), steps_needed=steps)
    new_cap = max(cap, int(math.ceil(1.25 * st["need"]))) if st["need"] > cap else cap
    new_m = max(m, int(math.ceil(1.25 * st["send"]))) if st["send"] > m else m
    new_cap = min(max(new_cap, new_m), conf.n_particles)
    return CapacityError(
        "particle buffer overflow detected before any particle was lost: a block needs %d "
        "slots (capacity %d) and a send buffer %d rows (send_capacity %d); use --capacity %d "
        "--send-capacity %d" % (st["need"], cap, st["send"], m, new_cap, new_m),
        capacity=new_cap, send_capacity=new_m)
