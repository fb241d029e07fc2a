r"""Weak gravitational lensing: lightcone density planes and the Born convergence.

The lightcone's geometry is :mod:`flowpm_mtf.physics.lensing_geometry` (what to
lens; the shells, sources, rays and stages: plane ``i`` collects the particles of
the shell around :math:`r_i`, at its scale factor :math:`a_i`), the sources' n(z)
:mod:`flowpm_mtf.physics.lensing_sources`, the maps' statistics
:mod:`flowpm_mtf.physics.lensing_stats`. Their names are re-exported here: a user of
the lensing imports this one module.

Density planes (after ``flowpm.raytracing.density_plane``, FlowPM HEAD)
------------------------------------------------------------------------
The particles of a shell are painted with 2D CIC on the (x, y) cells of the 3D
mesh and normalised by the expected count :math:`\Delta r / \Delta_z` per
column, so a plane holds :math:`1 + \bar\delta`, the density contrast averaged
over the shell. With the line of sight along z, which is local on every rank
(x on mesh axis ``row``, y on ``col``), a plane ``[x, y]`` is distributed
exactly like the first two dimensions of the 3D field: the projection along
the line of sight is a local sum, i.e. **the reduction "over the mesh axis
along the line of sight" is no communication at all**; only the 2D CIC halo
margins travel to the x and y neighbours (:mod:`flowpm_mtf.mesh.halo`). No rank
ever holds the full 3D field or a full plane.

Born convergence (after ``flowpm.raytracing.convergenceBorn``, FlowPM HEAD)
--------------------------------------------------------------------------
Rays leave the observer on a regular angular grid of ``field_npix`` x
``field_npix`` pixel centres :math:`\boldsymbol\theta` spanning
``field_deg`` degrees, centred on the box's (x, y) centre; in plane ``i`` a ray
hits the transverse position :math:`(L_x/2, L_y/2) + r_i\boldsymbol\theta`
(flat sky; the field must fit in the box at the farthest plane). The
convergence for a source at comoving distance :math:`r_s` is

.. math::

    \kappa(\boldsymbol\theta) = \frac32 \Omega_m \Big(\frac{H_0}{c}\Big)^2
        \sum_i \Delta r\, \frac{r_i}{a_i}
        \big(\bar\delta_i(r_i\boldsymbol\theta) - \langle\bar\delta_i\rangle\big)
        \Big(1 - \frac{r_i}{r_s}\Big)_+ .

**Planes at the rays' resolution** (:func:`ray_born_terms`, what the job and
:func:`lightcone_forward` use): the shell's particles are painted with 2D CIC on
the plane's own ray grid, one cell of comoving side :math:`r_i\Delta\theta` per
ray, centred on it, so the rays read the cells themselves; the window is one
angular :math:`\mathrm{sinc}^2(\ell\Delta\theta/2)` per axis for every plane,
however far, instead of the PM mesh's at :math:`k = \ell/r_i`. Each rank paints
its own particles (global coordinates, nearest periodic image of the field
centre) into a map-sized term; the terms are linear in the counts (the shell's
mean, its count over the whole box, is subtracted the same way), so the map is
their sum over the blocks (:func:`born_from_terms`, one all-reduce of the map).
Point particles carry their shot noise into the map
(:func:`flowpm_mtf.physics.lensing_theory.shot_noise_cl`).

**Planes on the PM mesh** (:func:`density_plane`, :func:`born_convergence`):
the shell painted on the (x, y) cells of the 3D mesh and read by bilinear
interpolation, :math:`W_x\, \bar\delta\, W_y^{T}` with :math:`W_x` of shape
``[npix, nx]`` (two non-zeros per row), one ``mtf.einsum`` per plane. The job
still paints and writes these planes (they are the shells' density on the
mesh), but its maps no longer come from them: their windows kept 17 % of
C_ell at ell 700 on the default run.

Sources with a redshift distribution: a tomographic bin of an n(z) (Smail or a
table, :class:`~flowpm_mtf.physics.lensing_geometry.LensingConfig`) replaces
:math:`(1 - r_i/r_s)_+` by its mean over the bin's n(z), :math:`g_b(r_i)`
(:func:`~flowpm_mtf.physics.lensing_sources.nz_efficiency`); the Born sum is
otherwise the same sum (``geom.efficiency``, one row per map). Shear maps come
from the convergence maps' potential on a zero-padded field
(:func:`shear_from_potential`; :func:`shear_maps` is the periodic
Kaiser-Squires inversion).

Decorrelating the replicas: shells deeper than the box share particles (a shell
of 192 Mpc/h in a 256 Mpc/h box overlaps its neighbour's z range modulo the box
by 2/3), and the same box modes then add up coherently in the map (we measured
C_ell twice the Limber value without this). As in multiple-plane ray tracing
codes, each plane is therefore used with its own random periodic shift,
random flips of both axes and, when the box is square in (x, y), a random
transposition (seeded by ``conf.seed``; ``LensingConfig(randomize=False)``
turns it off). These are changes of the ray coordinates only (in the painting
on the ray grid, :func:`ray_plane_coordinates`, and in the interpolation
weights): no data moves.
"""
import logging

import mesh_tensorflow as mtf
import numpy as np
import tensorflow.compat.v1 as tf

from ..mesh import slots
from .. import layout
from . import pgd as pgd_mod, sizing, timeloop
from .kernels import make_kernels
from .lpt import lpt_init
from .nbody import kdk_step
from .painting import _isolated_grad
from .painting_plane import cic_paint_plane
from .lensing_geometry import (LensingConfig, LightconeGeometry, born_coefficients,  # noqa: F401
                               geometry, lightcone_stages)
from .lensing_sources import nz_efficiency, read_nz_table, source_nz  # noqa: F401
from .lensing_stats import (DEFAULT_TAPER, interpolated_power,  # noqa: F401
                            kappa_power_spectrum, limber_cl, shear_eb_power)
# (re-exported above: the lensing's public names, one module for its users; the package's
# own modules import them from their homes)

__all__ = ["SRC", "THX", "THY", "LensingConfig", "LightconeGeometry", "geometry",
           "lightcone_stages", "source_nz", "read_nz_table", "nz_efficiency", "density_plane",
           "interpolation_weights", "born_coefficients", "ray_plane_coordinates",
           "ray_born_terms", "born_from_terms",
           "born_convergence", "kaiser_squires_kernels", "shear_maps", "shear_from_potential", "lightcone_forward",
           "kappa_power_spectrum", "shear_eb_power",
           "interpolated_power", "limber_cl", "DEFAULT_TAPER"]

log = logging.getLogger(__name__)

SRC, THX, THY = "src", "thx", "thy"
"""Dimensions of a convergence map ``[src, thx, thy]`` (replicated on every rank)."""


# ----------------------------------------------------------------------------- planes
def density_plane(positions, conf, geom, index, name=None, weight=None):
    """Project the particles of lens shell ``index`` onto a 2D CIC density plane.

    Parameters
    ----------
    positions : mtf.Tensor
        Block-local positions ``[bx, by, npart, xyz]`` [cells], at the plane's
        scale factor ``geom.a[index]``.
    conf : SimConfig
    geom : LightconeGeometry
    index : int
        Plane number.
    name : str, optional
    weight : mtf.Tensor, optional
        ``[bx, by, npart]`` slot weights (:func:`flowpm_mtf.mesh.slots.weights`).

    Returns
    -------
    mtf.Tensor
        ``[x, y]`` (x on ``row``, y on ``col``): :math:`1 + \\bar\\delta`, the
        particle count per (x, y) cell divided by the expected count
        ``width / cell_size[2]`` [dimensionless]; differentiable with respect to
        the x and y positions (the shell membership is a step function of z).

    Raises
    ------
    tf.errors.InvalidArgumentError
        At run time, if a particle escaped its block's halo.
    """
    name = name or "density_plane_%d" % index
    cz = conf.cell_size[2]
    dt = conf.np_dtype
    r_lo = np.asarray(geom.r_edges[index] / cz, dt).item()        # [cells]
    width = np.asarray(geom.width[index] / cz, dt).item()         # [cells]
    plane = cic_paint_plane(positions, conf, r_lo, width, name=name, weight=weight)
    return plane * np.asarray(1.0 / width, dt).item()


# ----------------------------------------------------------------------------- Born
def interpolation_weights(conf, geom, index):
    """Bilinear interpolation matrices of plane ``index`` at the rays (numpy, float64).

    Returns
    -------
    (w_thx, w_thy, axes) :
        ``w_thx[i, j]`` is the weight of plane node ``j`` along the plane axis
        ``axes[0]`` (0 = x, 1 = y; node ``j`` at ``j`` cells, periodic) for the
        ray angle ``theta[i]`` along theta_x; ``w_thy`` likewise for theta_y
        along ``axes[1]``. Without transposition the interpolated plane is
        ``w_thx @ plane @ w_thy.T``; with it, ``w_thx @ plane.T @ w_thy.T``.
    """
    axes = (1, 0) if geom.transpose[index] else (0, 1)
    out = []
    for ray_axis, axis in enumerate(axes):
        n, c, L = conf.nc[axis], conf.cell_size[axis], conf.box_size[axis]
        pos = (0.5 * L + geom.shift[index, axis]
               + geom.flip[index, ray_axis] * geom.r[index] * geom.theta)   # [Mpc/h]
        u = pos / c                                                          # [cells]
        i0 = np.floor(u).astype(np.int64)
        t = u - i0
        w = np.zeros((geom.npix, n))
        rows = np.arange(geom.npix)
        np.add.at(w, (rows, i0 % n), 1.0 - t)
        np.add.at(w, (rows, (i0 + 1) % n), t)
        out.append(w)
    return out[0], out[1], axes


def born_convergence(planes, conf, geom, name="born"):
    """Born convergence maps from the lens planes (distributed, differentiable).

    Parameters
    ----------
    planes : list of mtf.Tensor
        ``n_planes`` planes ``[x, y]`` of :math:`1 + \\bar\\delta` (or any
        offset of it: each plane's mean is subtracted), e.g. from
        :func:`density_plane`.
    conf : SimConfig
    geom : LightconeGeometry

    Returns
    -------
    mtf.Tensor
        :math:`\\kappa` on ``[src, thx, thy]`` [dimensionless], replicated on
        every rank; ``kappa[s, i, j]`` is the ray at ``(theta[i], theta[j])``.
    """
    if len(planes) != geom.n_planes:
        raise ValueError("born_convergence: expected %d planes, got %d"
                         % (geom.n_planes, len(planes)))
    shape = layout.plane_shape(conf)
    dt = conf.np_dtype
    mesh = planes[0].mesh
    src = mtf.Dimension(SRC, geom.n_source)
    thx, thy = mtf.Dimension(THX, geom.npix), mtf.Dimension(THY, geom.npix)
    coef = born_coefficients(conf, geom)
    kappa = None
    for i, plane in enumerate(planes):
        if plane.shape != shape:
            raise ValueError("born_convergence: plane %d must have the shape %s, got %s"
                             % (i, shape, plane.shape))
        if not np.any(coef[:, i] > 0):
            continue                                   # behind every source
        wx, wy, axes = interpolation_weights(conf, geom, i)
        wx = mtf.import_tf_tensor(mesh, tf.constant(wx.astype(dt)),
                                  mtf.Shape([thx, shape.dims[axes[0]]]),
                                  name="%s_wx_%d" % (name, i))
        wy = mtf.import_tf_tensor(mesh, tf.constant(wy.astype(dt)),
                                  mtf.Shape([thy, shape.dims[axes[1]]]),
                                  name="%s_wy_%d" % (name, i))
        c = mtf.import_tf_tensor(mesh, tf.constant(coef[:, i].astype(dt)), mtf.Shape([src]),
                                 name="%s_coef_%d" % (name, i))
        delta = plane - mtf.reduce_mean(plane)
        term = mtf.einsum([wx, delta * c, wy], output_shape=mtf.Shape([src, thx, thy]),
                          name="%s_interp_%d" % (name, i))
        kappa = term if kappa is None else kappa + term
    if kappa is None:
        kappa = mtf.zeros(mesh, mtf.Shape([src, thx, thy]), dtype=planes[0].dtype)
    return kappa


# ----------------------------------------------------------------------------- rays' planes

def ray_plane_coordinates(conf, geom, index):
    """The affine map from box coordinates to plane ``index``'s ray-pixel coordinates.

    Returns
    -------
    list of (axis, centre, scale) :
        For ray axis 0 (theta_x) and 1 (theta_y): the box axis it reads (0 = x,
        1 = y, swapped by the plane's transposition), the box coordinate of the
        field's centre on it [Mpc/h] and the factor ``flip / (r_i dtheta)``
        [1/(Mpc/h)]: a particle at box coordinate ``X`` lies at pixel coordinate
        ``u = scale * wrap(X - centre) + npix/2 - 1/2`` (pixel ``j``'s centre at
        ``u = j``; ``wrap`` to the nearest periodic image, in ``[-L/2, L/2)``).
    """
    axes = (1, 0) if geom.transpose[index] else (0, 1)
    dth = np.deg2rad(geom.field_deg) / geom.npix
    return [(ax, 0.5 * conf.box_size[ax] + geom.shift[index, ax],
             geom.flip[index, a] / (geom.r[index] * dth)) for a, ax in enumerate(axes)]


def ray_born_terms(positions, conf, geom, index, name=None, weight=None):
    r"""Born convergence of lens shell ``index`` painted at the rays' resolution, per block.

    The particles of the shell (line-of-sight distance in ``[r_lo, r_lo + Delta r)``
    modulo the box, as :func:`density_plane`) are painted with 2D CIC on the
    ``npix`` x ``npix`` ray grid of the plane: one cell per ray, of comoving side
    :math:`r_i\Delta\theta`, centred on the rays (so the rays read the cells
    themselves: no interpolation). A plane's painting is therefore an angular
    CIC window :math:`\mathrm{sinc}^2(\ell_x\Delta\theta/2)\,\mathrm{sinc}^2(\ell_y
    \Delta\theta/2)` on the map, the same for every plane
    (:mod:`flowpm_mtf.physics.lensing_theory`), instead of the PM mesh's window
    at :math:`k = \ell/r_i`. Counts are normalised by the expected count per
    cell, :math:`\bar n\,\Delta r\,(r_i\Delta\theta)^2`, and the shell's mean
    (its particle count over the whole box) is subtracted, both linear in the
    counts: every rank paints its own particles onto a map-sized block term and
    the terms add up over the blocks (:func:`born_from_terms`); no rank holds a
    plane of the box.

    Parameters
    ----------
    positions : mtf.Tensor
        Block-local positions ``[bx, by, npart, xyz]`` [cells].
    conf : SimConfig
    geom : LightconeGeometry
    index : int
        Plane number.
    name : str, optional
    weight : mtf.Tensor, optional
        ``[bx, by, npart]`` slot weights (:func:`flowpm_mtf.mesh.slots.weights`).

    Returns
    -------
    mtf.Tensor
        ``[bx, by, src, thx, thy]``: block ``(bx, by)``'s share of plane
        ``index``'s Born term, :math:`c_{s,i}(n/\bar n_{\rm cell} - N/\bar N)`
        [dimensionless]; differentiable with respect to the x and y positions.
    """
    name = name or "ray_born_%d" % index
    mesh = positions.mesh
    dt = conf.np_dtype
    bx, by = positions.shape.dims[:2]
    P, Q = bx.size, by.size
    sx, sy, nz = conf.block_shape
    cell = np.asarray(conf.cell_size, np.float64)
    npix = geom.npix
    dth = np.deg2rad(geom.field_deg) / npix
    n_part = float(np.prod(conf.nc))
    nbar = n_part / float(np.prod(conf.box_size))                       # [(h/Mpc)^3]
    per_cell = nbar * geom.width[index] * (geom.r[index] * dth)**2       # expected count
    per_shell = nbar * geom.width[index] * conf.box_size[0] * conf.box_size[1]
    coef = born_coefficients(conf, geom)[:, index]
    z_lo = float(geom.r_edges[index] / cell[2])
    z_w = float(geom.width[index] / cell[2])
    maps = ray_plane_coordinates(conf, geom, index)
    origin = np.zeros((P, Q, 2))
    origin[..., 0] = (np.arange(P) * sx)[:, None]
    origin[..., 1] = (np.arange(Q) * sy)[None, :]
    xy2 = mtf.Dimension("ray_xy", 2)
    org = mtf.import_tf_tensor(mesh, tf.constant(origin.astype(dt)), mtf.Shape([bx, by, xy2]),
                               name=name + "_origin")
    src = mtf.Dimension(SRC, geom.n_source)
    thx, thy = mtf.Dimension(THX, npix), mtf.Dimension(THY, npix)
    out_shape = mtf.Shape([bx, by, src, thx, thy])

    def fn(pos, o, w=None):
        pos = tf.reshape(pos, [pos.shape[0], pos.shape[1], -1, 3])
        nbx, nby, n, _ = pos.shape.as_list()
        inside = tf.cast(tf.math.floormod(pos[..., 2] - z_lo, float(nz)) < z_w, pos.dtype)
        wt = inside if w is None else inside * tf.reshape(w, [nbx, nby, n])
        u = []
        for ax, centre, scale in maps:
            length = conf.box_size[ax]
            d = (pos[..., ax] + o[:, :, None, ax]) * cell[ax] - centre          # [Mpc/h]
            d = d - length * tf.stop_gradient(tf.floor(d / length + 0.5))
            u.append(d * scale + (0.5 * npix - 0.5))
        kern, idx = [], []
        for di in (0, 1):
            for dj in (0, 1):
                ws, ids = wt, []
                for ui, dd in ((u[0], di), (u[1], dj)):
                    i0 = tf.stop_gradient(tf.floor(ui))
                    t = ui - i0
                    node = i0 + dd
                    ws = ws * (t if dd else 1.0 - t) * tf.cast(
                        (node >= 0) & (node < npix), pos.dtype)
                    ids.append(tf.cast(tf.clip_by_value(node, 0, npix - 1), tf.int32))
                kern.append(ws)
                idx.append(tf.stack(ids, -1))
        kern = tf.stack(kern, -1)                                        # [nbx, nby, n, 4]
        cells = tf.stack(idx, -2)                                        # [nbx, nby, n, 4, 2]
        shape = [nbx, nby, n, 4]
        bi = tf.broadcast_to(tf.reshape(tf.range(nbx), [nbx, 1, 1, 1]), shape)
        bj = tf.broadcast_to(tf.reshape(tf.range(nby), [1, nby, 1, 1]), shape)
        ind = tf.reshape(tf.stack([bi, bj, cells[..., 0], cells[..., 1]], -1), [-1, 4])
        counts = tf.scatter_nd(ind, tf.reshape(kern, [-1]), [nbx, nby, npix, npix])
        total = tf.reduce_sum(wt, axis=-1)                                # [nbx, nby]
        term = counts / per_cell - (total / per_shell)[:, :, None, None]
        return term[:, :, None] * tf.constant(coef.astype(dt))[:, None, None]

    inputs = [positions, org] + ([weight] if weight is not None else [])
    return mtf.slicewise(fn, inputs, output_shape=out_shape, output_dtype=positions.dtype,
                         splittable_dims=[bx, by],
                         grad_function=_isolated_grad(fn, [bx, by], name), name=name)


def born_from_terms(terms):
    """The Born convergence from :func:`ray_born_terms`: the sum over planes and blocks
    (one all-reduce over the process grid).

    Parameters
    ----------
    terms : mtf.Tensor or list of mtf.Tensor
        ``[bx, by, src, thx, thy]`` terms (or their running sum).

    Returns
    -------
    mtf.Tensor
        :math:`\\kappa` on ``[src, thx, thy]``, replicated on every rank.
    """
    terms = [terms] if isinstance(terms, mtf.Tensor) else list(terms)
    tot = terms[0]
    for t in terms[1:]:
        tot = tot + t
    return mtf.reduce_sum(tot, output_shape=mtf.Shape(tot.shape.dims[2:]))


def kaiser_squires_kernels(npix):
    r"""The Kaiser-Squires multipliers on an ``npix`` x ``npix`` FFT grid (numpy).

    :math:`\hat\gamma_1 = (\ell_x^2 - \ell_y^2)/\ell^2\,\hat\kappa`,
    :math:`\hat\gamma_2 = 2\ell_x\ell_y/\ell^2\,\hat\kappa`, 0 at
    :math:`\ell = 0` (axis 0 of the map is :math:`\theta_x`, axis 1
    :math:`\theta_y`; scale-free, so in FFT frequency units).

    Returns
    -------
    (m1, m2) : ndarray
        ``[npix, npix]`` float64.
    """
    f = np.fft.fftfreq(int(npix))
    lx, ly = f[:, None], f[None, :]
    l2 = lx**2 + ly**2
    safe = np.where(l2 > 0, l2, 1.0)
    return np.where(l2 > 0, (lx**2 - ly**2) / safe, 0.0), np.where(l2 > 0, 2 * lx * ly / safe, 0.0)


def shear_maps(kappa, name="shear"):
    r"""Shear :math:`(\gamma_1, \gamma_2)` from convergence maps by Kaiser-Squires.

    The maps are replicated on every rank (``[src, thx, thy]``, small), so the
    inversion is a local 2D FFT on each rank (``mtf.slicewise``, no
    communication); differentiable through TensorFlow's FFT gradients. The map
    is treated as periodic: exact for a field periodic on the map, otherwise
    wrong within a few correlation lengths of the edges (the Born sum has no
    boundary; ``docs/lensing.md``).

    Parameters
    ----------
    kappa : mtf.Tensor
        ``[src, thx, thy]`` (:func:`born_convergence`) [dimensionless].

    Returns
    -------
    (gamma1, gamma2) : mtf.Tensor
        Same shape and dtype as ``kappa`` [dimensionless]; :math:`\gamma_1 > 0`
        stretches images along :math:`\theta_x`.
    """
    npix = kappa.shape.dims[-1].size
    if kappa.shape.dims[-2].size != npix:
        raise ValueError("shear_maps: expected square maps, got %s" % kappa.shape)
    m1, m2 = kaiser_squires_kernels(npix)
    dt = kappa.dtype
    cdt = tf.complex128 if dt == tf.float64 else tf.complex64

    def fn(k):
        kh = tf.signal.fft2d(tf.complex(k, tf.zeros_like(k)))   # real gradient, no warning
        g1 = tf.math.real(tf.signal.ifft2d(kh * tf.constant(m1.astype(cdt.as_numpy_dtype))))
        g2 = tf.math.real(tf.signal.ifft2d(kh * tf.constant(m2.astype(cdt.as_numpy_dtype))))
        return tf.cast(g1, dt), tf.cast(g2, dt)

    return mtf.slicewise(fn, [kappa], output_shape=[kappa.shape, kappa.shape],
                         output_dtype=[dt, dt], splittable_dims=[], name=name)


def shear_from_potential(kappa, pad=2, name="shear_potential"):
    r"""Shear :math:`(\gamma_1, \gamma_2)` from the lensing potential of the convergence on a
    zero-padded field (flat sky).

    The map is embedded in a ``pad`` times larger zero field, the potential solved
    there, :math:`\hat\psi = -2\hat\kappa/\ell^2`, and :math:`\gamma_1 =
    (\psi_{,11} - \psi_{,22})/2`, :math:`\gamma_2 = \psi_{,12}` taken by FFT and cut
    back to the map. Unlike :func:`shear_maps` (periodic), no wrap-around jump of the
    map enters the shear: the field outside the map is taken as :math:`\kappa = 0`
    (a small, smooth error near the edges), and the shear is a pure E field up to
    that cut. Local on every rank (the maps are replicated), differentiable.

    Parameters
    ----------
    kappa : mtf.Tensor
        ``[src, thx, thy]`` [dimensionless], square maps.
    pad : int
        Padding factor (>= 1; 1 is :func:`shear_maps`).

    Returns
    -------
    (gamma1, gamma2) : mtf.Tensor
        Same shape and dtype as ``kappa`` [dimensionless].
    """
    npix = kappa.shape.dims[-1].size
    if kappa.shape.dims[-2].size != npix:
        raise ValueError("shear_from_potential: expected square maps, got %s" % kappa.shape)
    big = int(pad) * npix
    m1, m2 = kaiser_squires_kernels(big)
    dt = kappa.dtype
    cdt = tf.complex128 if dt == tf.float64 else tf.complex64

    def fn(k):
        kp = tf.pad(k - tf.reduce_mean(k, axis=[-2, -1], keepdims=True),
                    [[0, 0], [0, big - npix], [0, big - npix]])
        kh = tf.signal.fft2d(tf.complex(kp, tf.zeros_like(kp)))
        out = []
        for m in (m1, m2):
            g = tf.math.real(tf.signal.ifft2d(kh * tf.constant(m.astype(cdt.as_numpy_dtype))))
            out.append(tf.cast(g[:, :npix, :npix], dt))
        return tuple(out)

    return mtf.slicewise(fn, [kappa], output_shape=[kappa.shape, kappa.shape],
                         output_dtype=[dt, dt], splittable_dims=[], name=name)


def lightcone_forward(linear, conf, geom, pgd=None):
    """LPT, N-body through the lightcone stages, density planes and Born convergence.

    The same computation as the job (:mod:`flowpm_mtf.jobs.lensing`) in one
    graph, for gradients and tests.

    Parameters
    ----------
    linear : mtf.Tensor
        Linear density contrast at a = 1, real ``[x, y, z]``, dtype ``conf.dtype``.
    conf : SimConfig
    geom : LightconeGeometry
    pgd : flowpm_mtf.physics.pgd.PGDConfig, optional
        With ``pgd.pgd``, the planes are painted from the particles moved by the PGD
        correction at each plane's scale factor (as the job; the time loop goes on from
        the uncorrected particles).

    Returns
    -------
    kappa : mtf.Tensor
        ``[src, thx, thy]``: the Born sum of the planes painted at the rays'
        resolution (:func:`ray_born_terms`, :func:`born_from_terms`).
    planes : list of mtf.Tensor
        The ``[x, y]`` density planes on the PM mesh (:func:`density_plane`).
    final : State
        The particle state at the last stage.
    """
    stages, plane_stage = lightcone_stages(conf, geom)
    kernels = make_kernels(conf, linear.mesh)
    if pgd is not None:
        pgd = pgd.resolve(conf)   # alpha0, mu by the cell size where None
    planes = [None] * geom.n_planes
    terms = []

    def paint_planes(j, a, state):
        x, mesh_x = state.positions, state.positions
        w = slots.weights(state.ids, conf)
        if pgd is not None and pgd.pgd and np.any(plane_stage == j):
            x = x + pgd_mod.pgd_displacement(x, conf, pgd, pgd.alpha(a), weight=w,
                                             name="pgd_%d" % j)
            mesh_x = pgd_mod.clip_to_blocks(x, conf)
        for i in np.nonzero(plane_stage == j)[0]:
            planes[i] = density_plane(mesh_x, conf, geom, int(i), weight=w)
            if np.any(born_coefficients(conf, geom)[:, i] > 0):
                terms.append(ray_born_terms(x, conf, geom, int(i), weight=w))

    rows = sizing.send_capacity(conf, stages=stages)   # the migration's, from these stages
    state = timeloop.integrate(
        timeloop.initial_state(lpt_init(linear, conf, a=stages[0], forces=False, kernels=kernels),
                               conf, kernels),
        stages,
        lambda s, i, a0, a1: kdk_step(s, conf, a0, a1, kernels, send_rows=rows), [paint_planes])
    log.debug("lightcone_forward: %d stages, %d planes", stages.size, geom.n_planes)
    kappa = born_from_terms(terms) if terms else born_convergence(planes, conf, geom)
    return kappa, planes, state
