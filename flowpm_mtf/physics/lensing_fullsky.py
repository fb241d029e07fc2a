r"""Full-sky lensing: HEALPix shells of the replicated box and the Born convergence.

The flat-sky planes (:mod:`flowpm_mtf.physics.lensing`) see a few degrees along
one axis of the box. Here the observer sees the whole sky: the lightcone's shells
(the same shells as the flat sky, :func:`~flowpm_mtf.physics.lensing_geometry.geometry`:
equal comoving thickness, each painted from the particles at its own scale factor)
become HEALPix maps (RING ordering).

Geometry
--------
The observer sits at the **corner** of the box, global position 0 (the box is
periodic, so a corner is as good as the centre); the box is replicated
periodically around it, replica :math:`\mathbf n \in \mathbb Z^3` spanning
:math:`[\mathbf n L, (\mathbf n + 1) L)`, out to the last shell. For shell ``i``
only the replicas whose cube intersects the spherical shell
:math:`r_{\rm lo} \le |\mathbf x| < r_{\rm hi}` are visited
(:func:`shell_replicas`). As on the flat sky, shells deeper than the box would
repeat the same structures coherently; each shell therefore sees the box with
its own random periodic shift and axis flips (seeded by ``conf.seed``, off with
``LensingConfig(randomize=False)``).

Painting
--------
Every rank paints the particles of its own blocks: for each replica of the shell,
the particle's position relative to the observer, the radial selection, and the
HEALPix pixel of its direction (:func:`vec2pix_ring`, HEALPix's ``vec2pix`` in
TensorFlow ops: nearest grid point on the sphere). The counts per pixel are a
``tf.math.unsorted_segment_sum`` of the particle weights; the per-block maps
``[bx, by, hpix]`` are summed by ``mtf.reduce_sum`` (an all-reduce over the mesh, on
any MeshImpl). Each rank then holds the shell's map of :math:`12 N_{\rm side}^2`
pixels, no more. The shell's density contrast is the count over its mean
:math:`\bar n V_{\rm shell} / N_{\rm pix}` minus one (:math:`\bar n` the
particles per volume of the box).

Born convergence
----------------

.. math::

    \kappa(\hat{\mathbf n}) = \sum_i \frac32 \Omega_m \Big(\frac{H_0}{c}\Big)^2
        \Delta r\, \frac{r_i}{a_i}\, \delta_i(\hat{\mathbf n})\,
        \Big(1 - \frac{r_i}{r_s}\Big)_+ ,

the weights of :func:`~flowpm_mtf.physics.lensing_geometry.born_coefficients`
(n(z) bins included).

What is differentiable
----------------------
The maps are exact linear functions of the particle weights (the counts are a
segment sum), so gradients with respect to the weights are exact. The pixel of a
particle and its radial selection are step functions of its position: the
gradient of :math:`\kappa` with respect to the positions, hence to the initial
field, is **zero** (nearest grid point painting). The flat-sky maps, painted with
CIC, have a non-zero gradient; a smooth kernel on the sphere is not done.
"""
import dataclasses
import logging

import mesh_tensorflow as mtf
import numpy as np
import tensorflow.compat.v1 as tf

from . import lensing_geometry
# the sky's settings, decided before any graph (public here too: __all__)
from .lensing_geometry import MAX_NSIDE, SKIES, FullSkyConfig  # noqa: F401
from .painting import _local_particles, block_origins

__all__ = ["SKIES", "HPIX", "FullSkyConfig", "FullSkyGeometry", "fullsky_geometry",
           "shell_replicas", "vec2pix_ring", "shell_counts", "shell_delta",
           "born_convergence_fullsky", "mean_count", "MAX_NSIDE", "SRC"]

log = logging.getLogger(__name__)

HPIX, SRC = "hpix", "src"
"""Dimensions of the HEALPix maps ``[src, hpix]`` (replicated on every rank; ``src`` as the
flat-sky maps')."""
# Replicas processed together in one vectorised pass: at most _REPLICA_CHUNK, and at most
# CHUNK_ELEMENTS particle-replica pairs per pass (the pass's temporaries, ~100 bytes a pair).
_REPLICA_CHUNK = 16
CHUNK_ELEMENTS = 2**21
# Key mixed with conf.seed for the shells' random shifts and flips (independent of the ICs'
# stream and of the flat-sky planes' key).
_RANDOMIZE_KEY = 0x5e11
# An unused replica slot (padding of the last chunk): this many box sides away, far beyond
# every shell, so none of its particles is selected.
_FAR_REPLICA = 1.0e6


@dataclasses.dataclass(frozen=True)
class FullSkyGeometry:
    """The shells of a full-sky run (those of a :class:`LightconeGeometry`) and their replicas.

    Attributes
    ----------
    base : lensing_geometry.LightconeGeometry
        Shells, sources, Born efficiencies (its rays are unused).
    nside : int
    shift : ndarray
        ``[n_planes, 3]`` periodic shift of the box in each shell [cells].
    flip : ndarray
        ``[n_planes, 3]`` sign (+-1) of each axis in each shell.
    replicas : list of ndarray
        Per shell, ``[m_i, 3]`` integer replica indices whose cube meets the shell.
    """

    base: object
    nside: int
    shift: np.ndarray
    flip: np.ndarray
    replicas: tuple

    @property
    def npix(self):
        return 12 * self.nside**2

    @property
    def n_planes(self):
        return self.base.n_planes

    @property
    def n_source(self):
        return self.base.n_source

    def __getattr__(self, name):     # r, a, width, r_edges, labels, chi_source, ...
        if name.startswith("__") or name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)


def shell_replicas(box, r_lo, r_hi):
    """Integer replica indices whose cube :math:`[\\mathbf n L, (\\mathbf n+1)L)` meets
    the shell :math:`r_{\\rm lo} \\le |\\mathbf x| < r_{\\rm hi}` (observer at 0).

    Parameters
    ----------
    box : array_like
        Box sides [Mpc/h], 3 values.
    r_lo, r_hi : float
        Shell radii [Mpc/h].

    Returns
    -------
    ndarray
        ``[m, 3]`` int64.
    """
    box = np.asarray(box, np.float64)
    nmax = np.ceil(r_hi / box).astype(int)
    axes = [np.arange(-n - 1, n + 1) for n in nmax]
    n = np.stack(np.meshgrid(*axes, indexing="ij"), -1).reshape(-1, 3)
    lo, hi = n * box, (n + 1) * box
    near = np.where(lo > 0, lo, np.where(hi < 0, -hi, 0.0))       # closest point per axis
    far = np.maximum(np.abs(lo), np.abs(hi))
    keep = (np.sqrt((near**2).sum(-1)) < r_hi) & (np.sqrt((far**2).sum(-1)) >= r_lo)
    return n[keep]


def fullsky_geometry(conf, lconf, sconf):
    """The full-sky shells and replicas, with the checks of the flat-sky geometry.

    The shells, sources and efficiencies are those of
    :func:`~flowpm_mtf.physics.lensing_geometry.geometry` (a source beyond the
    lightcone, shells thicker than the box or a nearest shell after ``a_end`` are
    refused there); the flat field of view is not used.

    Parameters
    ----------
    conf : SimConfig
    lconf : lensing_geometry.LensingConfig
    sconf : FullSkyConfig

    Returns
    -------
    FullSkyGeometry
    """
    flat = dataclasses.replace(lconf, field_deg=1e-6, field_npix=1)
    base = lensing_geometry.geometry(conf, flat)
    n = base.n_planes
    if lconf.randomize:
        rng = np.random.RandomState(np.random.SeedSequence([conf.seed, _RANDOMIZE_KEY])
                                    .generate_state(1)[0])
        shift = rng.uniform(0.0, 1.0, (n, 3)) * np.asarray(conf.nc, np.float64)
        flip = rng.choice([-1.0, 1.0], (n, 3))
    else:
        shift, flip = np.zeros((n, 3)), np.ones((n, 3))
    reps = tuple(shell_replicas(conf.box_size, base.r_edges[i], base.r_edges[i + 1])
                 for i in range(n))
    return FullSkyGeometry(base=base, nside=int(sconf.nside), shift=shift, flip=flip,
                           replicas=reps)


# ----------------------------------------------------------------------------- pixels
def vec2pix_ring(x, y, z, nside):
    """HEALPix RING pixel of the direction of ``(x, y, z)`` (TensorFlow, float64).

    The algorithm of HEALPix's ``vec2pix_ring`` (Gorski et al. 2005): the
    equatorial belt :math:`|\\cos\\theta| \\le 2/3` and the polar caps.

    Parameters
    ----------
    x, y, z : tf.Tensor
        float64 Cartesian components (any common shape), not all zero.
    nside : int

    Returns
    -------
    tf.Tensor
        int64 pixel indices, the shape of ``x``.
    """
    ns = int(nside)
    r = tf.sqrt(x * x + y * y + z * z)
    cz = z / r
    za = tf.abs(cz)
    tt = tf.math.floormod(tf.atan2(y, x), 2.0 * np.pi) * (2.0 / np.pi)   # [0, 4]
    i64 = tf.int64

    def floor_int(v):
        return tf.cast(tf.floor(v), i64)

    # equatorial belt
    t1 = ns * (0.5 + tt)
    t2 = ns * cz * 0.75
    jp, jm = floor_int(t1 - t2), floor_int(t1 + t2)
    ir = ns + 1 + jp - jm                                     # ring 1 .. 2 nside + 1
    kshift = 1 - tf.math.floormod(ir, 2)
    ip = tf.math.floormod(tf.math.floordiv(jp + jm - ns + kshift + 1, 2), 4 * ns)
    pix_eq = 2 * ns * (ns - 1) + (ir - 1) * 4 * ns + ip
    # polar caps
    tp = tt - tf.floor(tt)
    tmp = ns * tf.sqrt(3.0 * tf.maximum(1.0 - za, 0.0))
    jp, jm = floor_int(tp * tmp), floor_int((1.0 - tp) * tmp)
    irp = tf.maximum(jp + jm + 1, 1)
    ipp = tf.math.floormod(floor_int(tt * tf.cast(irp, tf.float64)), 4 * irp)
    pix_n = 2 * irp * (irp - 1) + ipp
    pix_s = 12 * ns * ns - 2 * irp * (irp + 1) + ipp
    return tf.where(za <= 2.0 / 3.0, pix_eq, tf.where(cz > 0, pix_n, pix_s))


# ----------------------------------------------------------------------------- shells
def shell_counts(positions, conf, geom, index, weight=None, name=None):
    """Particle counts per HEALPix pixel of shell ``index`` (distributed, then all-reduced).

    Parameters
    ----------
    positions : mtf.Tensor
        Block-local positions ``[bx, by, npart, xyz]`` [cells], at the shell's scale
        factor ``geom.a[index]``.
    conf : SimConfig
    geom : FullSkyGeometry
    index : int
    weight : mtf.Tensor, optional
        ``[bx, by, npart]`` slot weights (:func:`flowpm_mtf.mesh.slots.weights`).
    name : str, optional

    Returns
    -------
    mtf.Tensor
        ``[hpix]``, replicated on every rank: the summed weights of the particles
        (every replica) in the shell, per RING pixel [particles]; differentiable with
        respect to ``weight``, constant with respect to ``positions``.
    """
    name = name or "fullsky_shell_%d" % index
    nside, npix = geom.nside, geom.npix
    nc = np.asarray(conf.nc, np.float64)
    cell = np.asarray(conf.cell_size, np.float64)
    reps = geom.replicas[index].astype(np.float64) * nc                      # [cells]
    r2_lo = float(geom.r_edges[index])**2
    r2_hi = float(geom.r_edges[index + 1])**2
    shift, flip = geom.shift[index], geom.flip[index]
    bx, by = positions.shape.dims[:2]
    hpix = mtf.Dimension(HPIX, npix)
    dt = conf.tf_dtype

    def fn(pos, origin, w=None):
        pos = _local_particles(pos)                              # [nbx, nby, n, 3]
        nbx, nby, n, _ = pos.shape.as_list()
        nb = nbx * nby
        chunks = replica_chunks(reps, nb * n, nc) * cell                  # [Mpc/h]
        g = tf.cast(pos + origin[:, :, None, :], tf.float64)     # global [cells]
        g = tf.math.floormod(g * flip + shift, nc) * cell         # in the box [Mpc/h]
        g = tf.reshape(g, [nb * n, 3])
        wt = tf.ones([nb * n], dt) if w is None else tf.reshape(w, [nb * n])
        block = tf.reshape(tf.range(nb, dtype=tf.int64)[:, None] * npix
                           + tf.zeros([1, n], tf.int64), [nb * n])

        def add(acc, chunk):                                     # chunk [k, 3] [Mpc/h]
            x = g[None, :, :] + chunk[:, None, :]                # [k, N, 3]
            r2 = tf.reduce_sum(x * x, -1)
            sel = tf.where((r2 >= r2_lo) & (r2 < r2_hi))         # [M, 2]: replica, particle
            xs = tf.gather_nd(x, sel)                            # only those in the shell
            pix = vec2pix_ring(xs[:, 0], xs[:, 1], xs[:, 2], nside)
            seg = pix + tf.gather(block, sel[:, 1])
            return acc + tf.math.unsorted_segment_sum(tf.gather(wt, sel[:, 1]), seg, nb * npix)

        acc = tf.foldl(add, tf.constant(chunks), initializer=tf.zeros([nb * npix], dt),
                       back_prop=True)
        return tf.reshape(acc, [nbx, nby, npix])

    origins = block_origins(conf, positions.mesh)
    inputs = [positions, origins] + ([] if weight is None else [weight])
    per_block = mtf.slicewise(fn, inputs, output_shape=mtf.Shape([bx, by, hpix]),
                              output_dtype=dt, splittable_dims=[bx, by], name=name)
    return mtf.reduce_sum(per_block, output_shape=mtf.Shape([hpix]))


def replica_chunks(reps, n_particles, nc):
    """The replica offsets ``[m, 3]`` [cells] in chunks ``[n_chunks, k, 3]`` of ``k``
    replicas (at most ``_REPLICA_CHUNK`` and ``CHUNK_ELEMENTS / n_particles``), the last one
    padded with offsets far beyond every shell."""
    m = reps.shape[0]
    k = max(1, min(_REPLICA_CHUNK, CHUNK_ELEMENTS // max(1, int(n_particles))))
    n_chunks = max(1, -(-m // k))
    padded = np.full((n_chunks * k, 3), _FAR_REPLICA * np.max(nc))
    padded[:m] = reps
    return padded.reshape(n_chunks, k, 3)


def mean_count(conf, geom, index):
    """Expected particles per pixel of shell ``index``: :math:`\\bar n V_{\\rm shell} /
    N_{\\rm pix}` [particles] (:math:`\\bar n` the particles per volume of the box)."""
    nbar = conf.n_particles / float(np.prod(conf.box_size))
    lo, hi = geom.r_edges[index], geom.r_edges[index + 1]
    return nbar * 4.0 * np.pi / 3.0 * (hi**3 - lo**3) / geom.npix


def shell_delta(counts, conf, geom, index):
    """Density contrast of a shell map, counts over :func:`mean_count` minus one."""
    return counts * float(1.0 / mean_count(conf, geom, index)) - 1.0


def born_convergence_fullsky(shells, conf, geom, name="born_fullsky"):
    """Born convergence HEALPix maps from the shells' count maps.

    Parameters
    ----------
    shells : list of mtf.Tensor
        ``n_planes`` count maps ``[hpix]`` (:func:`shell_counts`).
    conf : SimConfig
    geom : FullSkyGeometry

    Returns
    -------
    mtf.Tensor
        :math:`\\kappa` ``[src, hpix]`` (RING) [dimensionless], replicated.
    """
    if len(shells) != geom.n_planes:
        raise ValueError("born_convergence_fullsky: expected %d shells, got %d"
                         % (geom.n_planes, len(shells)))
    coef = lensing_geometry.born_coefficients(conf, geom.base)
    mesh = shells[0].mesh
    src = mtf.Dimension(SRC, geom.n_source)
    kappa = None
    for i, counts in enumerate(shells):
        if not np.any(coef[:, i] > 0):
            continue
        c = mtf.import_tf_tensor(mesh, tf.constant(coef[:, i].astype(conf.np_dtype)),
                                 mtf.Shape([src]), name="%s_coef_%d" % (name, i))
        term = c * shell_delta(counts, conf, geom, i)
        kappa = term if kappa is None else kappa + term
    if kappa is None:
        kappa = mtf.zeros(mesh, mtf.Shape([src, shells[0].shape.dims[0]]), dtype=conf.tf_dtype)
    return kappa

