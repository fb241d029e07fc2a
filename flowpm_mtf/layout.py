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
of the pencil FFT (see :mod:`flowpm_mtf.fft`); since Mesh TF broadcasts by
*name*, callers never see a transposed order. The layout rules (dimension ->
mesh axis) are ``SimConfig.layout_rules``.

Shapes: :func:`real_shape`, :func:`k_shape`, :func:`plane_shape`,
:func:`block_shape`, :func:`padded_shape`, :func:`padded_plane_shape`,
:func:`particle_dims`, :func:`block_cell_dims`. Wave numbers: :func:`axis_k`
(numpy) and :func:`kvec_tensors` (1-d mtf tensors on ``kx``, ``ky``, ``kz``).
"""
import numpy as np

__all__ = ["ROW", "COL", "X", "Y", "Z", "REAL_DIMS", "KX", "KY", "KZ", "K_DIMS", "BX", "BY",
           "SX", "SY", "PX", "PY", "PLANE_PX", "PLANE_PY", "NPART", "XYZ", "K_UNITS",
           "real_shape", "k_shape", "plane_shape", "block_shape", "padded_shape",
           "padded_plane_shape", "particle_dims", "block_cell_dims", "axis_k", "kvec_tensors"]

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


# ----------------------------------------------------------------------------- k-vectors
def axis_k(conf, units="h/Mpc"):
    """Wave numbers along each axis in numpy FFT order (float64).

    Parameters
    ----------
    conf : SimConfig
    units : {"h/Mpc", "grid"}
        ``"h/Mpc"``: ``2 pi fftfreq(n, d=cell_size)`` [h/Mpc]; ``"grid"``:
        ``2 pi fftfreq(n)`` [rad / cell].

    Returns
    -------
    list of 3 ndarray
        Zero first, negative frequencies in the upper half.
    """
    if units not in K_UNITS:
        raise ValueError("units must be one of %s, got %r" % (K_UNITS, units))
    return [2 * np.pi * np.fft.fftfreq(n, d=d if units == "h/Mpc" else 1.0)
            for n, d in zip(conf.nc, conf.cell_size)]


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
