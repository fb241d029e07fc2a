r"""3D Shepp-Logan head phantom from analytic ellipsoids, generated slice by slice.

Ellipsoid table
---------------
:data:`SHEPP_LOGAN_3D` is the "modified Shepp-Logan" 3D head phantom of M. Schabel's
``phantom3d.m`` (MATLAB Central File Exchange 9416, 2005), the table that common
toolkits reuse (e.g. TIGRE's ``sheppLogan3D``, tsadakane/sl3d): the 2D Shepp-Logan
geometry (Shepp & Logan 1974; Kak & Slaney, *Principles of Computerized Tomographic
Imaging*, 1988, p. 102) extended to ten ellipsoids, with the higher-contrast
intensities of P. Toft, *The Radon Transform* (1996), pp. 199-200. Columns::

    A      additive intensity                        [phantom intensity]
    a b c  semi-axes along the ellipsoid's own axes  [half field of view]
    x0 y0 z0  centre                                 [half field of view]
    phi theta psi  Euler angles (z-x-z)              [degrees]

Geometry
--------
The field of view is the cube ``[-1, 1]^3``; voxel ``i`` of an axis of ``n`` voxels
has its centre at ``-1 + (2 i + 1) / n``; array axes 0, 1, 2 are the table's x, y,
z (our dimensions ``x, y, z``). A voxel centre ``r`` lies in ellipsoid ``e`` when
``|D^{-1} R (r - c)|^2 <= 1``, with ``c`` the centre, ``D = diag(a, b, c)`` and ``R``
the z-x-z Euler rotation of ``phi, theta, psi`` (the matrix of ``phantom3d.m``);
unlike ``phantom3d.m``, which rotates the coordinates about the origin before
subtracting the centre, the rotation here is about the ellipsoid's own centre. The
value of a voxel is the sum of the intensities of the ellipsoids that hold its centre
(no partial-volume averaging): 1 in the skull, 0.2 in the brain, 0 outside.

Distribution
------------
:func:`phantom` builds the phantom as Mesh TF operations on ``[x, y, z]``: the voxel
coordinates come from ``mtf.range`` (global indices), so every rank evaluates the
ellipsoids on its own slice only and no rank holds the volume; the value does not
depend on the process grid. :func:`phantom_numpy` is the whole-volume reference;
both evaluate the same float64 expressions in the same order, so they agree except,
possibly, for a voxel centre within rounding (~1e-15) of an ellipsoid's surface
(:func:`boundary_margin` finds those).
"""
import logging

import mesh_tensorflow as mtf
import numpy as np
import tensorflow.compat.v1 as tf

from flowpm_mtf.layout import REAL_DIMS

__all__ = ["SHEPP_LOGAN_3D", "rotation_matrix", "voxel_centres", "phantom_numpy",
           "boundary_margin", "phantom", "perturbed_table", "table_rows", "phantom_fed",
           "TABLE_ROW_WIDTH"]

log = logging.getLogger(__name__)

#           A      a      b      c      x0      y0     z0    phi  theta  psi
SHEPP_LOGAN_3D = np.array([
    [1.0, 0.6900, 0.920, 0.810, 0.00, 0.0000, 0.00, 0.0, 0.0, 0.0],
    [-0.8, 0.6624, 0.874, 0.780, 0.00, -0.0184, 0.00, 0.0, 0.0, 0.0],
    [-0.2, 0.1100, 0.310, 0.220, 0.22, 0.0000, 0.00, -18.0, 0.0, 10.0],
    [-0.2, 0.1600, 0.410, 0.280, -0.22, 0.0000, 0.00, 18.0, 0.0, 10.0],
    [0.1, 0.2100, 0.250, 0.410, 0.00, 0.3500, -0.15, 0.0, 0.0, 0.0],
    [0.1, 0.0460, 0.046, 0.050, 0.00, 0.1000, 0.25, 0.0, 0.0, 0.0],
    [0.1, 0.0460, 0.046, 0.050, 0.00, -0.1000, 0.25, 0.0, 0.0, 0.0],
    [0.1, 0.0460, 0.023, 0.050, -0.08, -0.6050, 0.00, 0.0, 0.0, 0.0],
    [0.1, 0.0230, 0.023, 0.020, 0.00, -0.6060, 0.00, 0.0, 0.0, 0.0],
    [0.1, 0.0230, 0.046, 0.020, 0.06, -0.6050, 0.00, 0.0, 0.0, 0.0],
])
"""The modified 3D Shepp-Logan table (see the module docstring), shape (10, 10)."""


def _check_table(table):
    table = np.asarray(SHEPP_LOGAN_3D if table is None else table, np.float64)
    if table.ndim != 2 or table.shape[1] != 10 or table.shape[0] < 1:
        raise ValueError("an ellipsoid table must have shape (n, 10) (A, a, b, c, x0, y0, z0, "
                         "phi, theta, psi), got %s" % (table.shape,))
    if not np.all(np.isfinite(table)) or np.any(table[:, 1:4] <= 0):
        raise ValueError("an ellipsoid table needs finite values and positive semi-axes")
    return table


def rotation_matrix(phi, theta, psi):
    """The z-x-z Euler rotation of ``phantom3d.m``.

    Parameters
    ----------
    phi, theta, psi : float
        Euler angles [degrees].

    Returns
    -------
    ndarray, shape (3, 3)
        ``R`` such that ``R @ (r - c)`` are the coordinates along the ellipsoid's axes.
    """
    phi, theta, psi = np.deg2rad([phi, theta, psi])
    cf, sf, ct, st = np.cos(phi), np.sin(phi), np.cos(theta), np.sin(theta)
    cp, sp = np.cos(psi), np.sin(psi)
    return np.array([[cp * cf - ct * sf * sp, cp * sf + ct * cf * sp, sp * st],
                     [-sp * cf - ct * sf * cp, -sp * sf + ct * cf * cp, cp * st],
                     [st * sf, -st * cf, ct]])


def voxel_centres(n):
    """Centres of ``n`` voxels on ``[-1, 1]``: ``-1 + (2 i + 1) / n`` [half field of view]."""
    return -1.0 + (2.0 * np.arange(n, dtype=np.float64) + 1.0) / float(n)


def _terms(table):
    """Per ellipsoid: (A, [(row of R, [(axis, coefficient)...], centre)...], semi-axes).

    Zero rotation coefficients are dropped (both implementations evaluate the same
    sums in the same order).
    """
    out = []
    for A, a, b, c, x0, y0, z0, phi, theta, psi in table:
        R = rotation_matrix(phi, theta, psi)
        rows = [[(ax, float(R[j, ax])) for ax in range(3) if R[j, ax] != 0.0] for j in range(3)]
        out.append((float(A), rows, (float(x0), float(y0), float(z0)), (float(a), float(b),
                                                                          float(c))))
    return out


def _quadratic_forms(coords, table, xp):
    """``|D^{-1} R (r - c)|^2`` per ellipsoid, in the order of the table.

    ``coords``: the three 1-d coordinate arrays/tensors (broadcast by the backend
    ``xp``: numpy with open grids, or the Mesh TF wrapper below).
    """
    forms = []
    for A, rows, centre, axes in _terms(table):
        d = [xp.sub(coords[ax], centre[ax]) for ax in range(3)]
        q = None
        for j in range(3):
            u = None
            for ax, coeff in rows[j]:
                t = xp.mul(d[ax], coeff)
                u = t if u is None else xp.add(u, t)
            t = xp.square(xp.div(u, axes[j]))
            q = t if q is None else xp.add(q, t)
        forms.append((A, q))
    return forms


class _Np:
    sub = staticmethod(np.subtract)
    mul = staticmethod(np.multiply)
    add = staticmethod(np.add)
    div = staticmethod(np.divide)
    square = staticmethod(np.square)


class _Mtf:
    """Mesh TF versions; scalar operations through ``mtf.cwise`` so that ``x / c`` is a
    division (Mesh TF's own ``x / c`` multiplies by ``1 / c``, which rounds differently)."""

    @staticmethod
    def sub(x, c):
        return mtf.cwise(lambda t: t - c, [x], name="phantom_sub")

    @staticmethod
    def mul(x, c):
        return mtf.cwise(lambda t: t * c, [x], name="phantom_mul")

    @staticmethod
    def add(x, y):
        return x + y

    @staticmethod
    def div(x, c):
        return mtf.cwise(lambda t: t / c, [x], name="phantom_div")

    square = staticmethod(mtf.square)


def _np_coords(nc):
    c = [voxel_centres(n) for n in nc]
    return [c[0][:, None, None], c[1][None, :, None], c[2][None, None, :]]


def phantom_numpy(nc, table=None, dtype=np.float64):
    """The whole phantom in numpy (the reference of :func:`phantom`).

    Parameters
    ----------
    nc : int or 3 ints
        Voxels per axis [voxels].
    table : array_like, shape (n, 10), optional
        Ellipsoids (default :data:`SHEPP_LOGAN_3D`).
    dtype : numpy dtype
        Output dtype (computed in float64).

    Returns
    -------
    ndarray, shape ``nc``
        Intensity per voxel [phantom intensity].
    """
    nc = (int(nc),) * 3 if np.ndim(nc) == 0 else tuple(int(n) for n in nc)
    out = np.zeros(nc, np.float64)
    for A, q in _quadratic_forms(_np_coords(nc), _check_table(table), _Np):
        out = out + A * (q <= 1.0).astype(np.float64)
    return out.astype(dtype)


def boundary_margin(nc, table=None):
    """``min_e |q_e - 1|`` per voxel: how far a voxel centre is from every surface.

    Returns
    -------
    ndarray of float64, shape ``nc``
        Voxels with a margin below ~1e-12 may differ between :func:`phantom` and
        :func:`phantom_numpy` by rounding.
    """
    nc = (int(nc),) * 3 if np.ndim(nc) == 0 else tuple(int(n) for n in nc)
    margin = np.full(nc, np.inf)
    for _, q in _quadratic_forms(_np_coords(nc), _check_table(table), _Np):
        margin = np.minimum(margin, np.abs(q - 1.0))
    return margin


def phantom(mesh, conf, table=None, name="phantom"):
    """The phantom as a distributed Mesh TF field; each rank computes its own slice.

    Parameters
    ----------
    mesh : mtf.Mesh
    conf : ImagingConfig
    table : array_like, shape (n, 10), optional
        Ellipsoids (default :data:`SHEPP_LOGAN_3D`; see :func:`perturbed_table`).
    name : str

    Returns
    -------
    mtf.Tensor
        Real, shape ``[x, y, z]``, dtype ``conf.dtype`` [phantom intensity]; equal to
        ``phantom_numpy(conf.nc, table)`` on every process grid.
    """
    table = _check_table(table)
    log.debug("phantom %s: %d ellipsoids", conf.nc, len(table))
    with tf.name_scope(name):
        coords = []
        for d, n in zip(REAL_DIMS, conf.nc):
            i = mtf.range(mesh, mtf.Dimension(d, n), tf.float64, name=name + "_index_" + d)
            coords.append(mtf.cwise(lambda t, n=n: -1.0 + (2.0 * t + 1.0) / float(n), [i],
                                    name=name + "_centre_" + d))
        shape = mtf.Shape([mtf.Dimension(d, n) for d, n in zip(REAL_DIMS, conf.nc)])
        # zeros first: the sum then has the dimension order [x, y, z] (Mesh TF orders a
        # broadcast sum by its first operand), as numpy's 0 + A * inside.
        out = mtf.zeros(mesh, shape, tf.float64)
        for A, q in _quadratic_forms(coords, table, _Mtf):
            out = out + mtf.cwise(lambda t, A=A: A * tf.cast(t <= 1.0, tf.float64), [q],
                                  name=name + "_inside")
        return mtf.cast(out, conf.tf_dtype)


def perturbed_table(seed, scale=0.05, table=None):
    """A random variant of a table: centres, semi-axes and intensities perturbed.

    For training data (phantoms "with random ellipsoid perturbations"): each centre
    moves by ``scale * N(0, 1)`` per axis [half field of view], each semi-axis is
    multiplied by ``1 + scale * N(0, 1)`` (clipped to >= 0.5 of its value), each angle
    moves by ``100 * scale * N(0, 1)`` degrees, each intensity is multiplied by
    ``1 + scale * N(0, 1)``; the outer two ellipsoids (skull) keep their shape.

    Parameters
    ----------
    seed : int
    scale : float
        Relative size of the perturbations [dimensionless], >= 0.
    table : array_like, optional
        The table to perturb (default :data:`SHEPP_LOGAN_3D`).

    Returns
    -------
    ndarray, shape (n, 10)
    """
    if not np.isfinite(scale) or scale < 0:
        raise ValueError("scale must be a finite number >= 0, got %r" % (scale,))
    t = _check_table(table).copy()
    rng = np.random.default_rng(seed)
    inner = np.arange(2, len(t))
    k = len(inner)
    t[inner, 0] *= 1.0 + scale * rng.standard_normal(k)
    t[inner, 1:4] *= np.maximum(1.0 + scale * rng.standard_normal((k, 3)), 0.5)
    t[inner, 4:7] += scale * rng.standard_normal((k, 3))
    t[inner, 7:10] += 100.0 * scale * rng.standard_normal((k, 3))
    return t


TABLE_ROW_WIDTH = 16
"""Columns of :func:`table_rows`: ``A, x0, y0, z0, a, b, c`` and the 9 entries of ``R``."""


def table_rows(table=None):
    """An ellipsoid table as the rows :func:`phantom_fed` reads (numpy, float64).

    Parameters
    ----------
    table : array_like, shape (n, 10), optional
        Ellipsoids (default :data:`SHEPP_LOGAN_3D`).

    Returns
    -------
    ndarray, shape (n, 16)
        Per ellipsoid: intensity ``A``, centre ``x0, y0, z0``, semi-axes ``a, b, c``
        [half field of view], and the rotation matrix ``R`` row by row
        (:func:`rotation_matrix`).
    """
    table = _check_table(table)
    rows = np.zeros((len(table), TABLE_ROW_WIDTH), np.float64)
    for i, (A, a, b, c, x0, y0, z0, phi, theta, psi) in enumerate(table):
        rows[i, :7] = (A, x0, y0, z0, a, b, c)
        rows[i, 7:] = rotation_matrix(phi, theta, psi).ravel()
    return rows


def phantom_fed(mesh, conf, rows, name="phantom_fed"):
    """The phantom of a table given as a TF tensor (e.g. a placeholder fed per step).

    The same volume as :func:`phantom` for the table of :func:`table_rows`, but the
    table is a value of the TF graph, so one lowered graph serves every training
    phantom (:func:`perturbed_table`). Each rank evaluates the ellipsoids on its own
    slice (the voxel indices from ``mtf.range``), in float64 with the operations of
    :func:`phantom_numpy` (a zero rotation coefficient adds an exact zero).

    Parameters
    ----------
    mesh : mtf.Mesh
    conf : ImagingConfig
    rows : tf.Tensor, float64, shape (n, 16)
        :func:`table_rows` of the table (n static).
    name : str

    Returns
    -------
    mtf.Tensor
        Real ``[x, y, z]``, dtype ``conf.dtype`` [phantom intensity].
    """
    shape = rows.shape.as_list()
    if len(shape) != 2 or shape[1] != TABLE_ROW_WIDTH or shape[0] is None:
        raise ValueError("phantom_fed: rows must have the static shape (n, %d), got %s"
                         % (TABLE_ROW_WIDTH, shape))
    n_ell = shape[0]
    idx = [mtf.range(mesh, mtf.Dimension(d, n), tf.float64, name=name + "_index_" + d)
           for d, n in zip(REAL_DIMS, conf.nc)]
    nc = conf.nc
    out_dtype = conf.tf_dtype

    def fn(ix, iy, iz):
        c = [-1.0 + (2.0 * t + 1.0) / float(n) for t, n in zip((ix, iy, iz), nc)]
        coords = [c[0][:, None, None], c[1][None, :, None], c[2][None, None, :]]
        out = tf.zeros(tf.shape(coords[0] + coords[1] + coords[2]), tf.float64)
        for e in range(n_ell):
            r = rows[e]
            d = [coords[ax] - r[1 + ax] for ax in range(3)]
            q = None
            for j in range(3):
                u = d[0] * r[7 + 3 * j] + d[1] * r[8 + 3 * j] + d[2] * r[9 + 3 * j]
                t = tf.square(u / r[4 + j])
                q = t if q is None else q + t
            out = out + r[0] * tf.cast(q <= 1.0, tf.float64)
        return tf.cast(out, out_dtype)

    shape3 = mtf.Shape([mtf.Dimension(d, n) for d, n in zip(REAL_DIMS, conf.nc)])
    return mtf.slicewise(fn, idx, output_shape=shape3, output_dtype=out_dtype,
                         splittable_dims=shape3.dims, name=name)
