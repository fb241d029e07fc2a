"""The per-block particle row operations of the migration: native, or TensorFlow ops.

Each is a function on the local slices inside ``mtf.slicewise`` (a process's
blocks, ``[nb, n]`` rows or ``[nbx, nby, n, 3]`` positions): the selection of rows
(:func:`_rows_of`, :func:`_count_true`), the masking of rows (:func:`_mask_rows`),
the scatter-add of rows (:func:`_scatter_add_rows`), the periodic wrap of the
positions (:func:`_wrap_fn`, :func:`wrap_tf`) and the per-block particle statistics
(:func:`_particle_stats_fn`). On the CPU each is one op of
``flowpm_mtf/native/particle_ops.cc`` (:func:`_particle_ops`), else the same result
from TensorFlow ops (a GPU, no library, ``FLOWPM_MTF_NATIVE=0``); the native ops'
gradients are registered here, next to them. The distributed algorithm that uses
them is :mod:`flowpm_mtf.mesh.domain` (and the reordering by column,
:func:`flowpm_mtf.mesh.slots.sort_by_column`). Knows no cosmology.
"""
import numpy as np
import tensorflow.compat.v1 as tf

from .. import native

__all__ = ["wrap_tf"]


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


@tf.RegisterGradient("FlowpmWrap")
def _wrap_grad(op, dy):
    """The wrap is a translation by a whole period: its gradient is the identity."""
    return dy


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
