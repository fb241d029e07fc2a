"""Block representation of the mesh and periodic halo exchange.

Block representation
--------------------
The real-space mesh of ``nc = (nx, ny, nz)`` cells is cut into ``P x Q``
blocks (``P, Q = conf.grid``) of ``sx x sy x nz`` cells, ``sx = nx // P``,
``sy = ny // Q``. Block ``(i, j)`` holds the cells ``x in [i sx, (i+1) sx)``,
``y in [j sy, (j+1) sy)`` and all of ``z``; its *origin* is ``(i sx, j sy, 0)``.

* **Field**: ``[x, y, z]`` (``x`` on ``row``, ``y`` on ``col``).
* **Blocks**: ``[bx, by, sx, sy, z]`` with ``bx`` (size P) on ``row`` and
  ``by`` (size Q) on ``col``: on a P x Q processor mesh each rank holds exactly
  one block, the same cells as its slice of the field. :func:`to_blocks` and
  :func:`from_blocks` are local reshapes (no communication).
* **Padded blocks**: ``[bx, by, px, py, z]`` with ``px = sx + 2 h``,
  ``py = sy + 2 h`` (``h = conf.halo_size``). Padded index ``p`` along x is the
  global cell ``i sx + p - h``: ``[0, h)`` is the left margin (cells of the
  left neighbour), ``[h, h + sx)`` the block's own cells, ``[h + sx, sx + 2h)``
  the right margin. The y axis is the same; ``z`` is never split and never
  padded (it wraps locally, modulo ``nz``).

The same code runs when the mesh holds several blocks per processor (e.g. a
1-processor mesh with ``conf.grid = (2, 2)``) or when ``P = 1`` (a block is its
own neighbour): :func:`mtf.shift` moves whole blocks along ``bx``/``by``.

Halo exchange
-------------
Both operations are periodic and treat x then y (fill) or y then x (reduce),
so that the corners are exchanged too. Only margins travel: each shift is an
``mtf.shift`` by one block of a ``h``-cell slab, lowered to
``mesh_impl.shift_by_n_processors`` (never an allgather).

* :func:`halo_fill`: the margins receive a copy of the neighbours' boundary
  cells; the inner cells are unchanged.
* :func:`halo_reduce`: the margins are added into the neighbours' boundary
  cells, then set to zero.

As linear maps of the padded block tensor, ``halo_reduce`` is the exact
adjoint (transpose) of ``halo_fill``; each is the other's gradient.
"""
import logging

import mesh_tensorflow as mtf

from .. import config as cfg
from .. import layout
from .fft import real_shape

log = logging.getLogger(__name__)


block_shape = layout.block_shape
padded_shape = layout.padded_shape


def _check_shape(t, shape, what, trailing=False):
    """``t`` with the dimensions of ``shape`` in that order (transposed if needed).

    With ``trailing``, dimensions of ``t`` that are not in ``shape`` are allowed
    and kept after them (e.g. a vector component ``xyz``).
    """
    if trailing:
        extra = [d for d in t.shape.dims if d not in shape.dims]
        shape = mtf.Shape(shape.dims + extra)
    if t.shape != shape:
        if set(t.shape.dims) == set(shape.dims):
            return mtf.transpose(t, shape)
        raise ValueError("%s: expected a tensor of shape %s, got %s" % (what, shape, t.shape))
    return t


def _extra_dims(t, shape):
    """Dimensions of ``t`` after the leading ``shape`` (see ``_check_shape``)."""
    return t.shape.dims[shape.ndims:]


def to_blocks(field, conf):
    """Field ``[x, y, z, ...]`` -> blocks ``[bx, by, sx, sy, z, ...]`` (local reshape).

    Parameters
    ----------
    field : mtf.Tensor
        Real-space field, shape ``[x, y, z]`` optionally followed by unsplit
        dimensions (e.g. ``xyz``), which are kept last.
    conf : SimConfig

    Returns
    -------
    mtf.Tensor
    """
    field = _check_shape(field, real_shape(conf), "to_blocks", trailing=True)
    extra = _extra_dims(field, real_shape(conf))
    b = block_shape(conf)
    # [bx, sx, by, sy, z] keeps each split dimension at the same position in the
    # flattened order as x and y, so the reshape is local.
    inter = mtf.Shape([b.dims[0], b.dims[2], b.dims[1], b.dims[3], b.dims[4]] + extra)
    return mtf.transpose(mtf.reshape(field, inter), mtf.Shape(b.dims + extra))


def from_blocks(blocks, conf):
    """Blocks ``[bx, by, sx, sy, z]`` -> field ``[x, y, z]`` (local reshape)."""
    b = block_shape(conf)
    blocks = _check_shape(blocks, b, "from_blocks")
    inter = mtf.Shape([b.dims[0], b.dims[2], b.dims[1], b.dims[3], b.dims[4]])
    return mtf.reshape(mtf.transpose(blocks, inter), real_shape(conf))


def pad_blocks(blocks, conf):
    """Blocks ``[bx, by, sx, sy, z, ...]`` -> padded ``[bx, by, px, py, z, ...]``
    with zero margins (trailing unsplit dimensions are kept).

    Use :func:`halo_fill` afterwards to fill the margins.
    """
    h = conf.halo_size
    blocks = _check_shape(blocks, block_shape(conf), "pad_blocks", trailing=True)
    extra = _extra_dims(blocks, block_shape(conf))
    t = mtf.pad(mtf.pad(blocks, [h, h], cfg.SX), [h, h], cfg.SY)
    return mtf.reshape(t, mtf.Shape(padded_shape(conf).dims + extra))


def unpad_blocks(padded, conf):
    """Padded blocks ``[bx, by, px, py, z]`` -> their inner cells ``[bx, by, sx, sy, z]``."""
    h = conf.halo_size
    sx, sy, _ = conf.block_shape
    padded = _check_shape(padded, padded_shape(conf), "unpad_blocks")
    t = mtf.slice(mtf.slice(padded, h, sx, cfg.PX), h, sy, cfg.PY)
    return mtf.reshape(t, block_shape(conf))


def field_to_padded(field, conf, fill=True):
    """Field ``[x, y, z, ...]`` -> padded blocks, margins filled (or zero if ``fill`` is
    False); trailing unsplit dimensions are kept.

    Filled: ``halo_fill(pad_blocks(...))`` made in one copy per axis (the
    neighbours' boundary slabs concatenated around the block) instead of three
    (zero padding, the inner slice and the concatenation of :func:`halo_fill`);
    the same values.
    """
    blocks = to_blocks(field, conf)
    if not fill:
        return pad_blocks(blocks, conf)
    h = conf.halo_size
    if h == 0 or any(h > s for _, _, s in _axes(conf)):
        return halo_fill(pad_blocks(blocks, conf), conf)
    extra = _extra_dims(blocks, block_shape(conf))
    t = blocks
    for (block_dim, _, s), dim in zip(_axes(conf), (cfg.SX, cfg.SY)):
        bdim = t.shape.get_dim_by_name(block_dim)
        left = mtf.shift(mtf.slice(t, s - h, h, dim), 1, bdim, wrap=True)   # from block i-1
        right = mtf.shift(mtf.slice(t, 0, h, dim), -1, bdim, wrap=True)     # from block i+1
        t = mtf.concat([left, t, right], dim)
    return mtf.reshape(t, mtf.Shape(padded_shape(conf).dims + extra))


def padded_to_field(padded, conf):
    """Padded blocks -> field ``[x, y, z]`` (the margins are ignored; reduce them first)."""
    return from_blocks(unpad_blocks(padded, conf), conf)


def _axes(conf):
    sx, sy, _ = conf.block_shape
    return [(cfg.BX, cfg.PX, sx), (cfg.BY, cfg.PY, sy)]


def _fill_axis(t, block_dim, pad_dim, s, h):
    bdim = t.shape.get_dim_by_name(block_dim)
    last_inner = mtf.slice(t, s, h, pad_dim)     # padded [s, s+h): goes right
    first_inner = mtf.slice(t, h, h, pad_dim)    # padded [h, 2h): goes left
    inner = mtf.slice(t, h, s, pad_dim)
    left = mtf.shift(last_inner, 1, bdim, wrap=True)     # from block i-1
    right = mtf.shift(first_inner, -1, bdim, wrap=True)  # from block i+1
    return mtf.concat([left, inner, right], pad_dim)


def _reduce_axis(t, block_dim, pad_dim, s, h):
    bdim = t.shape.get_dim_by_name(block_dim)
    left_margin = mtf.slice(t, 0, h, pad_dim)
    right_margin = mtf.slice(t, h + s, h, pad_dim)
    inner = mtf.slice(t, h, s, pad_dim)
    from_left = mtf.shift(right_margin, 1, bdim, wrap=True)    # block i-1's right margin
    from_right = mtf.shift(left_margin, -1, bdim, wrap=True)   # block i+1's left margin
    inner = (inner + mtf.pad(from_left, [0, s - h], pad_dim)
             + mtf.pad(from_right, [s - h, 0], pad_dim))
    return mtf.pad(inner, [h, h], pad_dim)


def halo_fill(padded, conf):
    """Copy each block's boundary cells into its neighbours' margins (periodic).

    Parameters
    ----------
    padded : mtf.Tensor
        Padded blocks ``[bx, by, px, py, z]``, optionally followed by unsplit
        dimensions (all exchanged at once); the margins' values are ignored.
    conf : SimConfig

    Returns
    -------
    mtf.Tensor
        Same shape; inner cells unchanged, margins = the neighbours' cells.
    """
    h = conf.halo_size
    padded = _check_shape(padded, padded_shape(conf), "halo_fill", trailing=True)
    if h == 0:
        return padded
    for block_dim, pad_dim, s in _axes(conf):
        padded = _fill_axis(padded, block_dim, pad_dim, s, h)
    return padded


def halo_reduce(padded, conf):
    """Add each block's margins into its neighbours' boundary cells (periodic).

    Parameters
    ----------
    padded : mtf.Tensor
        Padded blocks ``[bx, by, px, py, z]`` (e.g. freshly painted).
    conf : SimConfig

    Returns
    -------
    mtf.Tensor
        Same shape; inner cells hold the reduced sums, margins are zero. This
        is the adjoint of :func:`halo_fill`.
    """
    h = conf.halo_size
    padded = _check_shape(padded, padded_shape(conf), "halo_reduce")
    if h == 0:
        return padded
    for block_dim, pad_dim, s in reversed(_axes(conf)):
        padded = _reduce_axis(padded, block_dim, pad_dim, s, h)
    return padded


def reduced_to_field(padded, conf):
    """``padded_to_field(halo_reduce(padded))`` with fewer copies of the field.

    Per axis (y, then x, as :func:`halo_reduce`), the neighbours' margins are
    added to the ``h``-cell boundary slabs only and the inner cells are copied
    once (a concatenation), instead of zero-padded full-size sums and the final
    slice of :func:`padded_to_field`: 2 copies of the field per axis instead of
    7. The same values (the sums are the same two-term sums).

    Parameters
    ----------
    padded : mtf.Tensor
        Padded blocks ``[bx, by, px, py, z]`` (e.g. freshly painted).
    conf : SimConfig

    Returns
    -------
    mtf.Tensor
        Field ``[x, y, z]``.
    """
    h = conf.halo_size
    padded = _check_shape(padded, padded_shape(conf), "reduced_to_field")
    if h == 0 or any(2 * h > s for _, _, s in _axes(conf)):
        return padded_to_field(halo_reduce(padded, conf), conf)
    t = padded
    for (block_dim, pad_dim, s), dim in reversed(list(zip(_axes(conf), (cfg.SX, cfg.SY)))):
        bdim = t.shape.get_dim_by_name(block_dim)
        from_left = mtf.shift(mtf.slice(t, h + s, h, pad_dim), 1, bdim, wrap=True)   # i-1's right
        from_right = mtf.shift(mtf.slice(t, 0, h, pad_dim), -1, bdim, wrap=True)    # i+1's left
        parts = [mtf.slice(t, h, h, pad_dim) + from_left]
        if s > 2 * h:
            parts.append(mtf.slice(t, 2 * h, s - 2 * h, pad_dim))
        parts.append(mtf.slice(t, s, h, pad_dim) + from_right)
        t = mtf.rename_dimension(mtf.concat(parts, pad_dim), pad_dim, dim)
    return from_blocks(t, conf)


def halo_reduce_plane(padded, conf, pad_dims):
    """:func:`halo_reduce` of padded 2D blocks ``[bx, by, px', py']`` (no z).

    Parameters
    ----------
    padded : mtf.Tensor
        Padded plane blocks whose padded x and y dimensions are named
        ``pad_dims`` (sizes ``block + 2 * halo_size``), e.g. a freshly painted
        lens plane (:func:`flowpm_mtf.physics.painting_plane.cic_paint_plane`).
    conf : SimConfig
    pad_dims : (str, str)
        Names of the padded x and y dimensions.

    Returns
    -------
    mtf.Tensor
        Same shape; inner cells hold the reduced sums (margins to the x and y
        neighbours), margins are zero.
    """
    h = conf.halo_size
    if h == 0:
        return padded
    for (block_dim, _, s), pad_dim in reversed(list(zip(_axes(conf), pad_dims))):
        padded = _reduce_axis(padded, block_dim, pad_dim, s, h)
    return padded
