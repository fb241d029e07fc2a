"""The 2D plane painter: CIC counts on the (x, y) cells of a slab of line-of-sight distance.

The lens planes' paint (:func:`flowpm_mtf.physics.lensing.density_plane`). The
line of sight (z) is local on every rank, so the projection is a local sum and
only the 2D CIC margins travel to the x and y neighbours
(:func:`flowpm_mtf.mesh.halo.halo_reduce_plane`). Block-local positions, the escape
check and the isolated gradient are those of the 3D painter
(:mod:`flowpm_mtf.physics.painting`).
"""
import mesh_tensorflow as mtf
import numpy as np
import tensorflow.compat.v1 as tf

from .. import layout
from ..mesh.halo import halo_reduce_plane
from .painting import _assert_none_escaped, _isolated_grad, _local_particles, escaped_count

__all__ = ["cic_paint_plane"]

PLANE_PX, PLANE_PY = layout.PLANE_PX, layout.PLANE_PY
_OFFSETS_2D = np.array([[0, 0], [1, 0], [0, 1], [1, 1]])


def cic_paint_plane(positions, conf, z_lo, z_width, name="cic_paint_plane", weight=None):
    """2D CIC counts on the (x, y) cells of the particles in a slab of line-of-sight distance.

    A particle is counted when its distance ``z + n * NZ`` (for some periodic
    replica ``n``) from ``z_lo`` lies in ``[0, z_width)`` [cells]; it is painted
    with 2D CIC weights on ``[x, y]``. The line of sight (z) is local on every
    rank, so the projection is a local sum; only the 2D CIC margins travel to
    the x and y neighbours (:func:`flowpm_mtf.mesh.halo.halo_reduce_plane`).

    Parameters
    ----------
    positions : mtf.Tensor
        Block-local positions ``[bx, by, npart, xyz]`` [cells].
    conf : SimConfig
    z_lo, z_width : float
        Start and thickness of the slab along z [cells], python floats.
    name : str
    weight : mtf.Tensor, optional
        ``[bx, by, npart]`` particle weights (0 for the empty slots of the
        eulerian decomposition, :func:`flowpm_mtf.mesh.slots.weights`).

    Returns
    -------
    mtf.Tensor
        ``[x, y]`` (x on ``row``, y on ``col``): CIC-weighted particle counts per
        cell [particles]; differentiable with respect to the x and y positions
        (the slab membership is a step function of z, without gradient).

    Raises
    ------
    ValueError
        At graph construction, if ``conf.halo_size < 1``.
    tf.errors.InvalidArgumentError
        At run time, if a particle escaped its block's halo.
    """
    h = conf.halo_size
    if h < 1:
        raise ValueError("density_plane: CIC needs halo_size >= 1, got %d" % h)
    sx, sy, nz = conf.block_shape
    px, py = sx + 2 * h, sy + 2 * h
    padded = layout.padded_plane_shape(conf)
    bx, by = padded.dims[:2]

    def fn(m, pos, w=None):
        pos = _local_particles(pos)                               # [nbx, nby, n, 3]
        nbx, nby, n, _ = pos.shape.as_list()
        # line-of-sight distance z + k nz of the replica k that reaches the slab
        dist = tf.math.floormod(pos[..., 2] - z_lo, float(nz))
        inside = tf.cast(dist < z_width, pos.dtype)               # no gradient (step in z)
        xy = pos[:, :, :, None, :2]
        nb = tf.floor(xy) + tf.constant(_OFFSETS_2D, pos.dtype)
        kern = 1.0 - tf.abs(xy - nb)
        kern = kern[..., 0] * kern[..., 1] * inside[..., None]    # [nbx, nby, n, 4]
        if w is not None:
            kern = kern * tf.reshape(w, [nbx, nby, n, 1])
        cell = tf.cast(nb, tf.int32)
        ix = tf.clip_by_value(cell[..., 0] + h, 0, px - 1)
        iy = tf.clip_by_value(cell[..., 1] + h, 0, py - 1)
        shape = [nbx, nby, n, 4]
        bi = tf.broadcast_to(tf.reshape(tf.range(nbx), [nbx, 1, 1, 1]), shape)
        bj = tf.broadcast_to(tf.reshape(tf.range(nby), [1, nby, 1, 1]), shape)
        idx = tf.reshape(tf.stack([bi, bj, ix, iy], axis=-1), [-1, 4])
        return tf.tensor_scatter_nd_add(m, idx, tf.reshape(kern, [-1]))

    # painted onto an explicit zero plane, as cic_paint (the isolated gradient needs two
    # inputs)
    empty = mtf.zeros(positions.mesh, padded, dtype=positions.dtype)
    inputs = [empty, positions] + ([weight] if weight is not None else [])
    painted = mtf.slicewise(fn, inputs, output_shape=padded,
                            output_dtype=positions.dtype,
                            splittable_dims=positions.shape.dims[:2],
                            grad_function=_isolated_grad(fn, positions.shape.dims[:2], name),
                            name=name)
    painted = _assert_none_escaped(painted, escaped_count(positions, conf), name)
    painted = halo_reduce_plane(painted, conf, (PLANE_PX, PLANE_PY))
    inner = mtf.slice(mtf.slice(painted, h, sx, PLANE_PX), h, sy, PLANE_PY)
    dsx, dsy, _ = layout.block_cell_dims(conf)
    inner = mtf.reshape(inner, mtf.Shape([bx, by, dsx, dsy]))
    # [bx, sx, by, sy] keeps x and y split at their positions: a local reshape
    inner = mtf.transpose(inner, mtf.Shape([bx, dsx, by, dsy]))
    return mtf.reshape(inner, layout.plane_shape(conf))
