r"""The particle slots of a block: ids, validity, padding, and their order.

Mesh TF shapes are static, so each block holds a fixed number of particle
**slots**, :func:`flowpm_mtf.physics.sizing.capacity` (>= its ``sx sy nz`` lattice particles), and each
slot carries the particle's global id (:func:`lattice_ids`: its initial
lattice index, row-major over the particle grid) or ``-1`` for an empty slot.
Empty slots have zero position (block-local), momentum and force, and zero
weight when painted (:func:`weights`). The lagrangian decomposition has no
empty slots.

The migration (:mod:`flowpm_mtf.mesh.domain`) moves the particles between the
slots of neighbouring blocks; :func:`pad_particles` gives a lattice-ordered tensor
its empty slots, and :func:`sort_by_column` reorders a block's slots by the column
the particles are in (``--sort-every``). Knows no cosmology: the slots are the
caller's number.
"""
import math

import mesh_tensorflow as mtf
import tensorflow.compat.v1 as tf

from .. import layout
from ..errors import ConfigError
from .domain_local import _particle_ops
from .ordering import after

__all__ = ["id_dtype", "lattice_ids", "weights", "pad_particles", "sort_by_column"]


# ----------------------------------------------------------------------------- ids
def id_dtype(conf):
    """tf dtype of particle ids: int32, or int64 from 2**31 particles on."""
    return tf.int64 if conf.n_particles >= 2**31 else tf.int32


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


# ----------------------------------------------------------------------------- order
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
