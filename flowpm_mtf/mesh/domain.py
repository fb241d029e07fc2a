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
Mesh TF shapes are static: each block holds a fixed number of particle slots,
each with the particle's global id or ``-1`` for an empty slot
(:mod:`flowpm_mtf.mesh.slots`: ids, validity, padding, order).

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
import tensorflow.compat.v1 as tf

from .. import layout
from ..errors import CapacityError, ConfigError, ParticleEscapeError
from .domain_local import (_below, _count_true, _mask_rows, _particle_stats_fn, _rows_of,
                           _scatter_add_rows, _wrap_fn)
from .ordering import after
# re-exported: the slots a migration fills, where a user of the migration looks for them
# (the package's own modules import them from slots)
from .slots import id_dtype, lattice_ids, pad_particles, sort_by_column, weights  # noqa: F401

__all__ = ["CHECK_MESSAGE", "STATS", "id_dtype", "lattice_ids", "weights", "pad_particles",
           "sort_by_column", "migrate", "exchange_axes", "wrap_sizes", "error_from_tf",
           "bytes_per_migration"]

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


# ----------------------------------------------------------------------------- local parts
def _leaving(x, ids, axis, s):
    """Masks ``[.., C]`` of the valid particles below (``< 0``) and above (``>= s``) the block."""
    pos = x[..., axis]
    valid = ids >= 0
    return valid & (pos < 0), valid & (pos >= s)


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
def exchange_axes(conf):
    """The axes (0: x over ``row``, 1: y over ``col``) split into more than one block.

    Only these exchange particles; along an axis of one block the positions are
    wrapped periodically instead (no buffers, no communication).
    """
    return [ax for ax in (0, 1) if conf.grid[ax] > 1]


def wrap_sizes(conf):
    """The sizes [cells] :func:`migrate` wraps the positions to, per axis: the block's
    along an axis of one block (x, y; :func:`exchange_axes`), 0 (none) elsewhere."""
    axes = exchange_axes(conf)
    return [float(conf.block_shape[ax]) if ax in (0, 1) and ax not in axes else 0.0
            for ax in range(3)]


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
