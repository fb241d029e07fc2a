r"""Particles follow the mesh: ownership by current position, migration, capacity.

Decomposition (``conf.decomposition``)
--------------------------------------
``"eulerian"`` (default; FastPM's ``fastpm_decompose`` after every drift): a
particle belongs to the block (see :mod:`flowpm_mtf.halo`) that contains its
**current** position. After every drift (:func:`flowpm_mtf.nbody.kdk_step`)
and after the LPT displacement (:func:`flowpm_mtf.lpt.lpt_init`) the
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
**slots**, ``capacity(conf)`` (>= its ``sx sy nz`` lattice particles), and each
slot carries the particle's global id (:func:`lattice_ids`: its initial
lattice index, row-major over the particle grid) or ``-1`` for an empty slot.
Empty slots have zero position (block-local), momentum and force, and zero
weight when painted (:func:`weights`). The lagrangian decomposition has no
empty slots.

A migration round along one axis (all in ``mtf.slicewise`` on the local
blocks, plus two ``mtf.shift`` of ``send_capacity`` rows):

1. *split*: the valid particles with block-local coordinate ``< 0`` (``>= s``)
   are copied, in slot order, into the first rows of the send buffer to the
   lower (upper) neighbour and moved into its frame (``+ s`` / ``- s``; a
   coordinate that rounds to ``s`` is set to the largest float below ``s``);
   their slots are emptied;
2. *shift*: the two send buffers go to the neighbours (``mtf.shift`` by one
   block, periodic: a single block along an axis sends to itself, which wraps
   positions into the box);
3. *merge*: the received particles fill the first empty slots, in order.

Data moves as one packed float tensor per block ``[bx, by, slots, mig_f]``:
the position, the other per-particle fields (momenta; also the LPT forces in
:func:`flowpm_mtf.lpt.lpt_init`), the id as two integers below ``2**24``
(exact in float32) and the validity flag.

Overflow and escape checks (never a silent loss)
------------------------------------------------
Each migration computes, per block, the largest send count, the slots needed
after every merge, the particles still outside their block after the last
round, the particles moved, the particle count and (from
:func:`flowpm_mtf.nbody.kdk_step`) the largest displacement of the step; their
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
(:func:`flowpm_mtf.painting._isolated_grad`), the shifts are exact adjoints.

Automatic sizes
---------------
:func:`capacity` grows the lattice count of a block by its linear density
contrast at ``a_end`` (top-hat sphere of the block's volume); :func:`send_capacity`
holds the particles of a face layer a few cells deep plus the linear
displacement per step; :func:`migration_rounds` covers the LPT displacement.
Both are conservative estimates: an overflow is caught and reported with the
values that would work (and the jobs retry with them).
"""
import functools
import logging
import math
import re

import mesh_tensorflow as mtf
import numpy as np
import tensorflow.compat.v1 as tf

from . import config as cfg
from .errors import CapacityError, ConfigError, ParticleEscapeError

__all__ = ["CHECK_MESSAGE", "STATS", "capacity", "send_capacity", "migration_rounds",
           "id_dtype", "lattice_ids", "weights", "pad_particles", "migrate",
           "error_from_tf", "bytes_per_migration"]

log = logging.getLogger(__name__)

CHECK_MESSAGE = "flowpm_mtf.domain: migration check failed"
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
ROWS_DIM = "mig_rows"
SEND_DIM = "mig_send"
STAT_DIM = "mig_stat"

_ID_SPLIT = 2**24     # ids travel as (id // 2^24, id % 2^24): exact in float32
_N_ID_COLS = 3        # id_hi, id_lo, valid


# ----------------------------------------------------------------------------- sizes
@functools.lru_cache(maxsize=64)
def _sigma_psi(conf):
    """1D rms linear displacement at a = 1 [Mpc/h], from the box's modes (k_f .. k_Nyquist)."""
    from . import cosmology as cm
    kmin = 2 * np.pi / max(conf.box_size)
    kmax = np.pi / min(conf.cell_size) * np.sqrt(3.0)
    k = np.logspace(np.log10(kmin), np.log10(kmax), 512)
    pk = cm.linear_matter_power(conf.cosmology, k)
    return float(np.sqrt(np.trapz(pk, k) / (6 * np.pi**2)))


@functools.lru_cache(maxsize=64)
def _sigma_block(conf, a):
    """Linear density rms of a top-hat sphere with a block's volume at ``a``."""
    from . import cosmology as cm
    volume = float(np.prod(conf.block_shape) * np.prod(conf.cell_size))
    radius = (3 * volume / (4 * np.pi))**(1.0 / 3.0)
    c = conf.cosmology
    sig = cm.sigma_r(c, radius) / cm.sigma_r(c, 8.0) * c.sigma8
    return float(sig * cm.D1(c, np.array([a]))[0])


@functools.lru_cache(maxsize=64)
def capacity(conf):
    """Particle slots per block [particles].

    ``conf.capacity`` if set; the lattice count ``sx sy nz`` for the lagrangian
    decomposition or a single block; otherwise the lattice count times
    ``1.1 + 4 sigma``, with ``sigma`` the linear density rms of a sphere with a
    block's volume at ``conf.a_end`` (bounded by the total particle count),
    rounded up to a multiple of 64.
    """
    npb = conf.particles_per_block
    if conf.capacity is not None:
        return conf.capacity
    if conf.decomposition == "lagrangian" or conf.n_ranks == 1:
        return npb
    factor = 1.1 + 4.0 * _sigma_block(conf, conf.a_end)
    return int(min(conf.n_particles, 64 * math.ceil(npb * factor / 64)))


@functools.lru_cache(maxsize=64)
def send_capacity(conf, displacement=None, lattice=False):
    """Rows of one send buffer (one neighbour, one migration round) [particles].

    ``conf.send_capacity`` if set; otherwise the particles of a face layer
    ``0.25 + 2 d`` cells deep (``d`` [cells]: ``displacement``, or the largest
    linear displacement of one step of ``conf``; ``0.75 + 2 d`` with
    ``lattice``, for particles leaving the lattice: those on a block's lower
    face cross it when displaced downwards) plus 64, bounded by
    :func:`capacity`. Measured at 200 Mpc/h / 32^3 on 2x2: about 1/40 of it
    used per step and 1/3 at the ICs.
    """
    if conf.send_capacity is not None:
        return conf.send_capacity
    sx, sy, nz = conf.block_shape
    if displacement is None:
        from . import cosmology as cm
        from .nbody import default_stages
        d1 = cm.D1(conf.cosmology, default_stages(conf))
        step = float(np.max(np.diff(d1)))
        displacement = step * _sigma_psi(conf) / min(conf.cell_size[:2])
    face = max(sx, sy) * nz
    depth = (0.75 if lattice else 0.25) + 2.0 * displacement
    return int(min(capacity(conf), 64 + math.ceil(face * depth)))


@functools.lru_cache(maxsize=64)
def lpt_displacement_cells(conf, a):
    """Estimated largest LPT displacement at ``a`` [cells]: 6 linear rms."""
    from . import cosmology as cm
    d1 = float(cm.D1(conf.cosmology, np.array([a]))[0])
    return 6.0 * d1 * _sigma_psi(conf) / min(conf.cell_size[:2])


def migration_rounds(conf, displacement):
    """Migration rounds (one block each) for a displacement [cells]: ``1 + d // block``."""
    sx, sy, _ = conf.block_shape
    return 1 + int(displacement // min(sx, sy))


def bytes_per_migration(conf, n_fields, rounds=1, displacement=None):
    """Bytes each block sends per migration: ``4 rounds`` buffers of :func:`send_capacity` rows."""
    cols = 3 * (1 + n_fields) + _N_ID_COLS
    return 4 * rounds * send_capacity(conf, displacement) * cols * conf.np_dtype.itemsize


def id_dtype(conf):
    """tf dtype of particle ids: int32, or int64 from 2**31 particles on."""
    return tf.int64 if conf.n_particles >= 2**31 else tf.int32


# ----------------------------------------------------------------------------- ids
def lattice_ids(conf, mesh):
    """Global ids of the lattice particles of every block, ``[bx, by, npart]``.

    The id of the particle that starts at global cell ``(i, j, k)`` is
    ``(i ny + j) nz + k`` (row-major; FlowPM's particle order), in the slot
    order of :func:`flowpm_mtf.painting.lattice`; dtype :func:`id_dtype`.
    """
    (P, Q), (sx, sy, nz) = conf.grid, conf.block_shape
    ny = conf.nc[1]
    dt = id_dtype(conf)
    bx, by = mtf.Dimension(cfg.BX, P), mtf.Dimension(cfg.BY, Q)
    dsx, dsy, dz = (mtf.Dimension(cfg.SX, sx), mtf.Dimension(cfg.SY, sy),
                    mtf.Dimension(cfg.Z, nz))
    gx = mtf.range(mesh, bx, dtype=dt) * sx + mtf.range(mesh, dsx, dtype=dt)   # [bx, sx]
    gy = mtf.range(mesh, by, dtype=dt) * sy + mtf.range(mesh, dsy, dtype=dt)   # [by, sy]
    ids = (gx * ny + gy) * nz + mtf.range(mesh, dz, dtype=dt)
    ids = mtf.transpose(ids, mtf.Shape([bx, by, dsx, dsy, dz]))
    return mtf.reshape(ids, mtf.Shape([bx, by, mtf.Dimension(cfg.NPART, sx * sy * nz)]))


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
        decomposition or without ids.
    """
    if ids is None or conf.decomposition == "lagrangian":
        return None
    return mtf.cast(mtf.greater_equal(ids, mtf.zeros(ids.mesh, ids.shape, ids.dtype)),
                    conf.tf_dtype)


def pad_particles(t, conf, value=0):
    """Pad a lattice-ordered ``[bx, by, npart, ...]`` tensor to :func:`capacity` slots."""
    n = t.shape.get_dim_by_name(cfg.NPART).size
    extra = capacity(conf) - n
    if extra == 0:
        return t
    if value == 0:
        return mtf.pad(t, [0, extra], cfg.NPART)
    return mtf.pad(t - value, [0, extra], cfg.NPART) + value


# ----------------------------------------------------------------------------- local ops
def _rows_of(sel, m, nb):
    """For each of ``m`` output rows, the flat source row of the j-th selected row.

    ``sel``: bool ``[nb, n]``. Returns int32 ``[nb, m]`` row indices into the
    flattened ``[nb * n]`` rows (-1 where fewer than ``m`` rows are selected)
    and the count of selected rows per block.
    """
    n = sel.shape.as_list()[-1]
    rank = tf.cumsum(tf.cast(sel, tf.int32), axis=-1, exclusive=True)
    blk = tf.range(nb)[:, None]
    seg = tf.where_v2(sel & (rank < m), rank, m) + blk * (m + 1)
    src = tf.range(nb * n)
    first = tf.math.unsorted_segment_max(src, tf.reshape(seg, [-1]), nb * (m + 1))
    first = tf.reshape(first, [nb, m + 1])[:, :m]
    return tf.where_v2(first >= 0, first, -1), tf.reduce_sum(tf.cast(sel, tf.int32), axis=-1)


def _split_masks(packed, axis, s):
    pos = packed[..., axis]
    valid = packed[..., -1] > 0.5
    return valid & (pos < 0), valid & (pos >= s)


def _split_fn(axis, s, m):
    """Local split: ``packed [nbx, nby, C, F]`` -> ``[lo rows (m), hi rows (m), keep (C)]``."""

    def fn(packed):
        nbx, nby, c, f = packed.shape.as_list()
        nb = nbx * nby
        flat = tf.reshape(packed, [nb * c, f])
        lo, hi = _split_masks(packed, axis, s)
        below_s = np.nextafter(np.asarray(s, packed.dtype.as_numpy_dtype), 0)
        out = []
        for sel, shift in ((lo, s), (hi, -s)):
            src, _ = _rows_of(tf.reshape(sel, [nb, c]), m, nb)
            ok = src >= 0
            rows = tf.gather(flat, tf.maximum(src, 0))                    # [nb, m, f]
            rows = tf.where_v2(ok[..., None], rows, tf.zeros_like(rows))
            pos = rows[..., axis] + tf.cast(shift, packed.dtype)
            if shift > 0:                                              # x + s may round to s
                pos = tf.minimum(pos, tf.constant(below_s, packed.dtype))
            pos = tf.where_v2(ok, pos, tf.zeros_like(pos))
            rows = tf.concat([rows[..., :axis], pos[..., None], rows[..., axis + 1:]], axis=-1)
            out.append(tf.reshape(rows, [nbx, nby, m, f]))
        gone = (lo | hi)[..., None]
        out.append(tf.where_v2(tf.broadcast_to(gone, packed.shape.as_list()), tf.zeros_like(packed),
                            packed))
        return tf.concat(out, axis=2)

    return fn


def _merge_fn(m):
    """Local merge: ``keep [.., C, F]``, two received ``[.., m, F]`` -> ``[.., C, F]``."""

    def fn(keep, from_lo, from_hi):
        nbx, nby, c, f = keep.shape.as_list()
        nb = nbx * nby
        recv = tf.reshape(tf.concat([from_lo, from_hi], axis=2), [nb, 2 * m, f])
        rvalid = recv[..., -1] > 0.5
        empty = tf.reshape(keep[..., -1] < 0.5, [nb, c])
        slot, _ = _rows_of(empty, 2 * m, nb)            # flat slot of the k-th empty slot
        rank = tf.cumsum(tf.cast(rvalid, tf.int32), axis=-1, exclusive=True)
        target = tf.gather(slot, rank, batch_dims=1)     # [nb, 2m]
        target = tf.where_v2(rvalid & (target >= 0), target, nb * c)     # else: dropped row
        placed = tf.math.unsorted_segment_sum(tf.reshape(recv, [-1, f]),
                                              tf.reshape(target, [-1]), nb * c + 1)
        return keep + tf.reshape(placed[:nb * c], [nbx, nby, c, f])

    return fn


def _count_fn(stat, axis=None, s=None, sizes=None):
    """Per-block float64 statistic ``[nbx, nby]`` of packed slices (no gradient)."""

    def fn(*ts):
        valid = [t[..., -1] > 0.5 for t in ts]
        if stat == "send":
            lo, hi = _split_masks(ts[0], axis, s)
            n = tf.maximum(tf.reduce_sum(tf.cast(lo, tf.int32), -1),
                           tf.reduce_sum(tf.cast(hi, tf.int32), -1))
            return tf.cast(n, tf.float64)
        if stat == "need":       # valid kept + valid received
            return tf.add_n([tf.reduce_sum(tf.cast(v, tf.float64), -1) for v in valid])
        if stat == "outside":     # beyond what the padded block's CIC stencil covers
            t = ts[0]
            h = sizes[2]
            bad = ~tf.reduce_all(tf.math.is_finite(t[..., :3]), axis=-1)
            for ax, size in ((0, sizes[0]), (1, sizes[1])):
                fl = tf.floor(t[..., ax])
                bad = bad | (fl < -h) | (fl > size + h - 2)
            return tf.reduce_sum(tf.cast(valid[0] & bad, tf.float64), -1)
        if stat == "displacement":
            d = tf.abs(ts[0][..., :2])
            return tf.cast(tf.reduce_max(tf.reshape(d, d.shape.as_list()[:2] + [-1]), -1),
                           tf.float64)
        raise ValueError(stat)

    return fn


def _block_stat(stat, inputs, name, **kw):
    bdims = inputs[0].shape.dims[:2]
    return mtf.slicewise(_count_fn(stat, **kw), inputs, output_shape=mtf.Shape(bdims),
                         output_dtype=tf.float64, splittable_dims=bdims, grad_function=0,
                         name=name)


def _isolated(fn, inputs, out_shape, name):
    from .painting import _isolated_grad
    bdims = inputs[0].shape.dims[:2]
    return mtf.slicewise(fn, inputs, output_shape=out_shape, output_dtype=inputs[0].dtype,
                         splittable_dims=bdims, grad_function=_isolated_grad(fn, bdims, name),
                         name=name)


# ----------------------------------------------------------------------------- pack
def _pack(conf, positions, fields, ids):
    cols = [mtf.rename_dimension(t, cfg.XYZ, F_DIM) for t in [positions] + list(fields)]
    bdims = positions.shape.dims[:3]
    id_shape = mtf.Shape(bdims + [mtf.Dimension(F_DIM, _N_ID_COLS)])

    def id_cols(i):
        i = tf.cast(i, tf.int64)
        valid = i >= 0
        hi = tf.where_v2(valid, i // _ID_SPLIT, tf.zeros_like(i))
        lo = tf.where_v2(valid, i % _ID_SPLIT, tf.zeros_like(i))
        return tf.cast(tf.stack([hi, lo, tf.cast(valid, tf.int64)], axis=-1),
                       positions.dtype.as_numpy_dtype)

    cols.append(mtf.slicewise(id_cols, [ids], output_shape=id_shape,
                              output_dtype=positions.dtype, splittable_dims=bdims[:2],
                              grad_function=0, name="migrate_pack_ids"))
    return mtf.concat(cols, F_DIM)


def _unpack(conf, packed, n_fields, id_dt):
    out = []
    for i in range(1 + n_fields):
        out.append(mtf.rename_dimension(mtf.slice(packed, 3 * i, 3, F_DIM), F_DIM, cfg.XYZ))
    ncol = packed.shape.get_dim_by_name(F_DIM).size

    def ids_of(t):
        t = t[..., ncol - _N_ID_COLS:]
        i = (tf.cast(tf.round(t[..., 0]), tf.int64) * _ID_SPLIT
             + tf.cast(tf.round(t[..., 1]), tf.int64))
        return tf.cast(tf.where_v2(t[..., 2] > 0.5, i, -tf.ones_like(i)), id_dt)

    bdims = packed.shape.dims[:3]
    ids = mtf.slicewise(ids_of, [packed], output_shape=mtf.Shape(bdims), output_dtype=id_dt,
                        splittable_dims=bdims[:2], grad_function=0, name="migrate_unpack_ids")
    return out[0], out[1:], ids


def _gate(packed, stats, cap, m):
    """``packed`` gated by the assertion that no buffer overflowed and none escaped."""

    def fn(x, st):
        ok = ((st[_S["send"]] <= m) & (st[_S["need"]] <= cap)
              & tf.equal(st[_S["outside"]], 0.0))
        check = tf.debugging.Assert(
            ok, ["%s (capacity %d, send_capacity %d); stats %s:" % (CHECK_MESSAGE, cap, m,
                                                                     ",".join(STATS)), st],
            summarize=len(STATS))
        with tf.control_dependencies([check]):
            return tf.identity(x)

    return mtf.slicewise(fn, [packed, stats], output_shape=packed.shape,
                         output_dtype=packed.dtype, splittable_dims=packed.shape.dims[:2],
                         grad_function=lambda op, dy: [dy, None], name="migrate_check")


# ----------------------------------------------------------------------------- migrate
def migrate(conf, positions, fields, ids, displacement=None, rounds=1, send_rows=None,
            name="migrate"):
    """Move every particle to the block that contains its position.

    Parameters
    ----------
    conf : SimConfig
    positions : mtf.Tensor
        Block-local positions ``[bx, by, npart, xyz]`` [cells], ``npart`` of
        size :func:`capacity`; each valid particle at most ``rounds`` blocks
        away from its block along x and y.
    fields : list of mtf.Tensor
        Other per-particle vectors ``[bx, by, npart, xyz]`` (e.g. momenta) that
        travel with the particles.
    ids : mtf.Tensor
        ``[bx, by, npart]`` integer ids, -1 for an empty slot.
    displacement : mtf.Tensor, optional
        ``[bx, by, npart, xyz]`` displacement of the last drift [cells]; its
        largest x/y component goes into the statistics (for the number of steps
        suggested when a particle escaped).
    rounds : int
        Migration rounds (one block per round along each axis).
    send_rows : int, optional
        Rows of a send buffer (default :func:`send_capacity`).
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
    cap = positions.shape.get_dim_by_name(cfg.NPART).size
    if cap + 2 * cap >= 2**31:
        # The local row bookkeeping (cumsum ranks, flat row indices) is int32.
        raise ConfigError(
            "the eulerian decomposition holds at most %d particle slots per rank, this run "
            "needs %d: use more ranks or --decomposition lagrangian" % ((2**31 - 1) // 3, cap))
    m = int(send_rows if send_rows is not None else send_capacity(conf))
    m = min(m, cap)
    sx, sy, _ = conf.block_shape
    packed = _pack(conf, positions, fields, ids)
    bx, by, npart, fdim = packed.shape.dims
    parts_shape = mtf.Shape([bx, by, mtf.Dimension(ROWS_DIM, 2 * m + cap), fdim])
    send_shape = mtf.Shape([bx, by, mtf.Dimension(SEND_DIM, m), fdim])
    sends, needs, moved = [], [], None
    for r in range(int(rounds)):
        for axis, bdim, s in ((0, bx, sx), (1, by, sy)):
            tag = "%s_r%d_%s" % (name, r, "xy"[axis])
            sends.append(_block_stat("send", [packed], tag + "_send", axis=axis, s=s))
            n_out = _block_stat("need", [packed], tag + "_valid")
            parts = _isolated(_split_fn(axis, s, m), [packed], parts_shape, tag + "_split")

            def part(i, rows, dim_name):
                t = mtf.slice(parts, i, rows, ROWS_DIM)
                return mtf.reshape(t, mtf.Shape([bx, by, mtf.Dimension(dim_name, rows), fdim]))

            to_lo, to_hi, keep = part(0, m, SEND_DIM), part(m, m, SEND_DIM), part(
                2 * m, cap, cfg.NPART)
            from_lo = mtf.shift(to_hi, 1, bdim, wrap=True)     # block i-1's upward movers
            from_hi = mtf.shift(to_lo, -1, bdim, wrap=True)    # block i+1's downward movers
            assert from_lo.shape == send_shape
            needs.append(_block_stat("need", [keep, from_lo, from_hi], tag + "_need"))
            n_keep = _block_stat("need", [keep], tag + "_kept")
            moved = n_out - n_keep if moved is None else moved + n_out - n_keep
            packed = _isolated(_merge_fn(m), [keep, from_lo, from_hi], packed.shape,
                               tag + "_merge")
    per_block = [sends[0] if len(sends) == 1 else _max_of(sends),
                 needs[0] if len(needs) == 1 else _max_of(needs),
                 _block_stat("outside", [packed], name + "_outside",
                             sizes=(sx, sy, conf.halo_size)),
                 moved,
                 _block_stat("need", [packed], name + "_count"),
                 (_block_stat("displacement", [displacement], name + "_disp")
                  if displacement is not None else mtf.zeros(packed.mesh, mtf.Shape([bx, by]),
                                                             dtype=tf.float64))]
    stats = mtf.reduce_max(mtf.stack(per_block, STAT_DIM, axis=2),
                           output_shape=mtf.Shape([mtf.Dimension(STAT_DIM, len(STATS))]))
    packed = _gate(packed, stats, cap, m)
    pos, out_fields, out_ids = _unpack(conf, packed, len(fields), ids.dtype)
    return pos, out_fields, out_ids, stats


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
        the motion per step below 0.8 block.
    """
    info = parse_check(str(getattr(exc, "message", exc)))
    if info is None:
        return None
    st, cap, m = info["stats"], info["capacity"], info["send_capacity"]
    if st["outside"] > 0:
        sx, sy, _ = conf.block_shape
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
