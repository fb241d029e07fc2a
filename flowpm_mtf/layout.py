"""Layout: Mesh TF dimension names, shape builders and k-vectors, in one place.

Dimension names
---------------
================  =====================  ===========  ==============================
name              size                   mesh axis    meaning
================  =====================  ===========  ==============================
``x``             ``nc[0]``              ``row``      real-space field, axis x
``y``             ``nc[1]``              ``col``      real-space field, axis y
``z``             ``nc[2]``              --           real-space field, axis z (local)
``kx``            ``nc[0]``              --           k-space field, axis x (local)
``ky``            ``nc[1]``              ``row``      k-space field, axis y
``kz``            ``nc[2]``              ``col``      k-space field, axis z
``bx``            ``P``                  ``row``      block index along x
``by``            ``Q``                  ``col``      block index along y
``sx``            ``nc[0] // P``         --           cell inside a block, x
``sy``            ``nc[1] // Q``         --           cell inside a block, y
``px``            ``nc[0] // P + 2 h``   --           cell inside a padded block, x
``py``            ``nc[1] // Q + 2 h``   --           cell inside a padded block, y
``ppx``, ``ppy``  as ``px``, ``py``      --           padded 2D block of a lens plane
``npart``         particles per block    --           particle index inside a block
``xyz``           3                      --           vector component
================  =====================  ===========  ==============================

``P, Q = grid`` and ``h = halo_size``. The k-space layout is the natural output
of the pencil FFT (see :mod:`flowpm_mtf.mesh.fft`); since Mesh TF broadcasts by
*name*, callers never see a transposed order. The layout rules (dimension ->
mesh axis) are ``SimConfig.layout_rules``.

Order of the modes along each k axis (mirror pairs)
---------------------------------------------------
A k-space field does not hold its modes in numpy's FFT order
(``0, 1, .., n/2, -(n/2 - 1), .., -1``) but in *mirror-pair order*: each mode
``j`` next to its mirror ``n - j``,
``0, n/2, 1, n-1, 2, n-2, .., n/2-1, n/2+1`` for even ``n`` (``0, 1, n-1, 2,
n-2, ..`` for odd ``n``; :func:`k_order`). A block of an even number of
positions then holds whole pairs, so the Hermitian symmetry of the transform of
a real field, ``F(-k) = conj(F(k))``, relates values on the same rank and the
distributed FFT moves half the spectrum through its all-to-alls (see
:mod:`flowpm_mtf.mesh.fft`). The order is the same on every process grid, so a
k-space field means the same thing whatever the grid. :func:`axis_k`,
:func:`kvec_tensors` and :func:`kvec` give the wave numbers in this order, so a
kernel built from them needs no care; numpy arrays convert with :func:`to_stored` /
:func:`to_natural`.

Shapes: :func:`real_shape`, :func:`k_shape`, :func:`plane_shape`,
:func:`block_shape`, :func:`padded_shape`, :func:`padded_plane_shape`,
:func:`particle_dims`, :func:`block_cell_dims`; the particles' first slot order,
:func:`slot_tiles`. Mode order: :func:`k_order`,
:func:`k_positions`, :func:`to_stored`, :func:`to_natural`. Wave numbers:
:func:`axis_k` (numpy), :func:`kvec_tensors` (1-d mtf tensors on ``kx``,
``ky``, ``kz``), :func:`kvec` (those of ``conf.dtype``, the kernels' building blocks)
and :func:`wavenumber` (``|k|`` on ``[kx, ky, kz]``). Mesh TF and TensorFlow are
imported by the functions that need them, not by this module.
"""
import numpy as np

__all__ = ["ROW", "COL", "X", "Y", "Z", "REAL_DIMS", "KX", "KY", "KZ", "K_DIMS", "BX", "BY",
           "SX", "SY", "PX", "PY", "PLANE_PX", "PLANE_PY", "NPART", "XYZ", "K_UNITS",
           "real_shape", "k_shape", "plane_shape", "block_shape", "padded_shape",
           "padded_plane_shape", "particle_dims", "block_cell_dims", "SLOT_TILE", "slot_tiles",
           "k_order", "k_positions",
           "to_stored", "to_natural", "axis_k", "kvec_tensors", "kvec", "wavenumber"]

# ----------------------------------------------------------------------------- names
ROW, COL = "row", "col"
"""Names of the two processor-mesh axes."""

X, Y, Z = "x", "y", "z"
"""Real-space field dimensions (``x`` on ``row``, ``y`` on ``col``, ``z`` local)."""
REAL_DIMS = (X, Y, Z)

KX, KY, KZ = "kx", "ky", "kz"
"""k-space field dimensions (``kx`` local, ``ky`` on ``row``, ``kz`` on ``col``)."""
K_DIMS = (KX, KY, KZ)

BX, BY = "bx", "by"
"""Block-count dimensions (``bx`` on ``row``, ``by`` on ``col``)."""
SX, SY = "sx", "sy"
"""Unpadded block-size dimensions."""
PX, PY = "px", "py"
"""Padded block-size dimensions (block size + 2 * halo)."""
PLANE_PX, PLANE_PY = "ppx", "ppy"
"""Padded 2D block dimensions of a plane being painted."""

NPART = "npart"
"""Particles of one block, flattened."""
XYZ = "xyz"
"""Vector components (size 3)."""

K_UNITS = ("h/Mpc", "grid")
"""Units of :func:`axis_k`: [h/Mpc], or [rad / cell] (FlowPM's ``fftk``)."""


def _dims(names, sizes):
    import mesh_tensorflow as mtf

    return [mtf.Dimension(n, int(s)) for n, s in zip(names, sizes)]


def _shape(names, sizes):
    import mesh_tensorflow as mtf

    return mtf.Shape(_dims(names, sizes))


# ----------------------------------------------------------------------------- shapes
def real_shape(conf):
    """mtf Shape ``[x, y, z]`` of a real-space field."""
    return _shape(REAL_DIMS, conf.nc)


def k_shape(conf):
    """mtf Shape ``[kx, ky, kz]`` of a k-space field."""
    return _shape(K_DIMS, conf.nc)


def plane_shape(conf):
    """mtf Shape ``[x, y]`` of a 2D plane (x on ``row``, y on ``col``)."""
    return _shape(REAL_DIMS[:2], conf.nc[:2])


def block_shape(conf):
    """mtf Shape ``[bx, by, sx, sy, z]`` of the unpadded blocks."""
    (P, Q), (sx, sy, nz) = conf.grid, conf.block_shape
    return _shape((BX, BY, SX, SY, Z), (P, Q, sx, sy, nz))


def padded_shape(conf):
    """mtf Shape ``[bx, by, px, py, z]`` of the padded blocks."""
    (P, Q), (px, py, nz) = conf.grid, conf.padded_block_shape
    return _shape((BX, BY, PX, PY, Z), (P, Q, px, py, nz))


def padded_plane_shape(conf):
    """mtf Shape ``[bx, by, ppx, ppy]`` of padded 2D plane blocks."""
    (P, Q), (px, py, _) = conf.grid, conf.padded_block_shape
    return _shape((BX, BY, PLANE_PX, PLANE_PY), (P, Q, px, py))


def particle_dims(conf):
    """Dimensions ``[bx, by, npart]`` of the particles of every block (list)."""
    (P, Q), (sx, sy, nz) = conf.grid, conf.block_shape
    return _dims((BX, BY, NPART), (P, Q, sx * sy * nz))


def block_cell_dims(conf):
    """Dimensions ``[sx, sy, z]`` of the cells of one block (list)."""
    return _dims((SX, SY, Z), conf.block_shape)


SLOT_TILE = 16
"""Largest tile side [cells] of :func:`slot_tiles`."""


def slot_tiles(conf):
    """Tile sides ``(tx, ty, tz)`` [cells] of the slot order the ICs give a block's particles.

    With the eulerian decomposition the ICs put the lattice particles of a block
    in slots tile by tile: the tiles of ``tx * ty * tz`` lattice cells in
    row-major order, the cells of a tile row-major inside it
    (``FlowpmLatticeCombine``, :func:`flowpm_mtf.mesh.slots.lattice_ids`). The slots
    keep their particles, and particles that start close together stay close, so
    the CIC paint and readout then walk the field tile by tile instead of plane by
    plane. At 512^3 on one rank the field planes a stretch of slot-ordered particles
    reaches no longer fit the last-level cache: on the particles of a job at a = 1 the
    tiles make the paint and readout about as fast per particle as at 128^3, where
    they change nothing (docs/benchmarks.md, "Speed at size"). Each side is
    the largest power of two up to :data:`SLOT_TILE` that divides the block's side.

    The lagrangian decomposition keeps the lattice order, ``(1, 1, 1)``: its slots
    *are* the lattice sites (their ids implicit).

    Parameters
    ----------
    conf : SimConfig

    Returns
    -------
    tuple of int
    """
    if conf.decomposition == "lagrangian":
        return (1, 1, 1)

    def side(n):
        t = SLOT_TILE
        while n % t:
            t //= 2
        return t

    return tuple(side(n) for n in conf.block_shape)


# ----------------------------------------------------------------------------- mode order
def k_order(n):
    """numpy FFT index of the mode at each position of a k axis (mirror-pair order).

    Parameters
    ----------
    n : int
        Number of modes (cells) along the axis.

    Returns
    -------
    ndarray of int64, shape (n,)
        ``[0, n/2, 1, n-1, 2, n-2, ..]`` for even ``n``, ``[0, 1, n-1, 2, n-2, ..]``
        for odd ``n``: position ``p`` holds ``numpy.fft.fftfreq(n)[k_order(n)[p]]``.
        For even ``n`` the mirror (``-k``) of position ``p`` is position ``p`` for
        ``p < 2`` and ``p ^ 1`` otherwise.
    """
    n = int(n)
    if n < 1:
        raise ValueError("k_order: n must be >= 1, got %d" % n)
    head = [0, n // 2] if n % 2 == 0 and n > 1 else [0]
    pairs = np.arange(1, (n - 1) // 2 + 1)
    return np.concatenate([np.array(head, np.int64),
                           np.stack([pairs, n - pairs], axis=1).reshape(-1)]).astype(np.int64)


def k_positions(n):
    """Position of each numpy-order mode on a k axis: the inverse of :func:`k_order`."""
    order = k_order(n)
    pos = np.empty_like(order)
    pos[order] = np.arange(order.size)
    return pos


def to_stored(a, axes=(0, 1, 2)):
    """A numpy array in numpy FFT order along ``axes`` in the stored (pair) order.

    Parameters
    ----------
    a : array_like
    axes : sequence of int
        The k axes (default: the first three).

    Returns
    -------
    ndarray
        ``a`` with each axis in ``axes`` permuted by :func:`k_order`.
    """
    a = np.asarray(a)
    for ax in axes:
        a = np.take(a, k_order(a.shape[ax]), axis=ax)
    return a


def to_natural(a, axes=(0, 1, 2)):
    """Inverse of :func:`to_stored`: a k-space array back in numpy FFT order."""
    a = np.asarray(a)
    for ax in axes:
        a = np.take(a, k_positions(a.shape[ax]), axis=ax)
    return a


# ----------------------------------------------------------------------------- k-vectors
def axis_k(conf, units="h/Mpc", natural=False):
    """Wave numbers along each axis (float64), in the stored order.

    Parameters
    ----------
    conf : SimConfig
    units : {"h/Mpc", "grid"}
        ``"h/Mpc"``: ``2 pi fftfreq(n, d=cell_size)`` [h/Mpc]; ``"grid"``:
        ``2 pi fftfreq(n)`` [rad / cell].
    natural : bool
        Return numpy's FFT order (zero first, negative frequencies in the upper
        half) instead of the mirror-pair order of k-space fields (:func:`k_order`).

    Returns
    -------
    list of 3 ndarray
    """
    if units not in K_UNITS:
        raise ValueError("units must be one of %s, got %r" % (K_UNITS, units))
    ks = [2 * np.pi * np.fft.fftfreq(n, d=d if units == "h/Mpc" else 1.0)
          for n, d in zip(conf.nc, conf.cell_size)]
    return ks if natural else [k[k_order(k.size)] for k in ks]


def kvec_tensors(conf, mesh, dtype, name="kvec", units="h/Mpc", sep="_"):
    """:func:`axis_k` as 1-d mtf tensors ``[kx]``, ``[ky]``, ``[kz]`` of ``dtype``.

    Parameters
    ----------
    conf : SimConfig
    mesh : mtf.Mesh
    dtype : numpy or TF dtype
    name : str
        Tensor names are ``name + sep + dimension``.
    units : {"h/Mpc", "grid"}
    sep : str

    Returns
    -------
    list of 3 mtf.Tensor
    """
    import mesh_tensorflow as mtf
    import tensorflow.compat.v1 as tf

    np_dtype = tf.as_dtype(dtype).as_numpy_dtype
    return [mtf.import_tf_tensor(mesh, tf.constant(k.astype(np_dtype)), _shape([d], [k.size]),
                                 name=name + sep + d)
            for k, d in zip(axis_k(conf, units), K_DIMS)]


def kvec(conf, mesh, units="h/Mpc"):
    """Wave vectors along each axis as mtf tensors on ``kx``, ``ky``, ``kz``.

    Parameters
    ----------
    conf : SimConfig
    mesh : mtf.Mesh
    units : {"h/Mpc", "grid"}
        ``"h/Mpc"``: ``2 pi fftfreq(n, d=cell_size)`` [h/Mpc];
        ``"grid"``: ``2 pi fftfreq(n)`` [rad / cell] (FlowPM's ``fftk``
        convention, which assumes cubic cells).

    Returns
    -------
    list of 3 mtf.Tensor
        Real tensors of shape ``[kx]``, ``[ky]``, ``[kz]`` (dtype ``conf.dtype``)
        in the stored (mirror-pair) order of k-space fields (:func:`k_order`), as
        :func:`kvec_tensors`.
    """
    return kvec_tensors(conf, mesh, conf.np_dtype, "kvec", units)


def wavenumber(conf, mesh, units="h/Mpc"):
    """Norm of the wave vector, ``|k|``, on ``[kx, ky, kz]``.

    Parameters
    ----------
    conf : SimConfig
    mesh : mtf.Mesh
    units : {"h/Mpc", "grid"}
        See :func:`kvec`.

    Returns
    -------
    mtf.Tensor
        Real, shape ``[kx, ky, kz]`` [h/Mpc or rad / cell].
    """
    import mesh_tensorflow as mtf

    kx, ky, kz = kvec(conf, mesh, units)
    return mtf.sqrt(mtf.square(kx) + mtf.square(ky) + mtf.square(kz))
