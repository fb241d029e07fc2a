r"""Weak gravitational lensing: lightcone density planes and the Born convergence.

Geometry
--------
The observer sits at the origin of the box's z axis, looking along **+z**; the
box is replicated periodically along z wherever the lightcone is deeper than
the box. The lightcone from the observer to the farthest source,
:math:`0 \le r \le \chi_{\max} = \chi(z_{s,\max})`, is cut into ``n_planes``
shells of equal comoving thickness :math:`\Delta r = \chi_{\max}/n_{\rm planes}`
(shells must be thinner than the box, :math:`\Delta r \le L_z`, so that no
particle is counted twice in one shell). Plane ``i`` has its centre at
:math:`r_i`, scale factor :math:`a_i = a(r_i)`, and collects the particles
whose line-of-sight distance :math:`z + n L_z` (for some replica ``n``) lies in
:math:`[r_i - \Delta r/2, r_i + \Delta r/2)`, with the positions of the
N-body state at :math:`a_i` (the N-body stages include every :math:`a_i`, see
:func:`lightcone_stages`).

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
        \Big(1 - \frac{r_i}{r_s}\Big)_+ ,

with :math:`\bar\delta_i(\mathbf x)` the bilinear interpolation of plane ``i``
(grid node ``j`` at transverse position ``j`` cells, as the CIC painting) and
:math:`\langle\cdot\rangle` the plane's mean. Bilinear weights factorise:
the ray grid is a tensor product, so the interpolation of a plane is the
matrix product :math:`W_x\, \bar\delta\, W_y^{T}` with :math:`W_x` of shape
``[npix, nx]`` (two non-zeros per row). It is one ``mtf.einsum`` whose
contraction over ``x`` and ``y`` ends in one all-reduce over ``row`` and ``col``
(summed lazily over planes); gradients are Mesh TF's einsum gradients (exact;
no tensorflow_addons). Memory per rank: :math:`O(n_{\rm pix}(n_x/P + n_y/Q))`.

Sources with a redshift distribution: a tomographic bin of an n(z) (Smail or a
table, :class:`LensingConfig`) replaces :math:`(1 - r_i/r_s)_+` by its mean over
the bin's n(z), :math:`g_b(r_i)` (:func:`nz_efficiency`); the Born sum is
otherwise the same einsum (``geom.efficiency``, one row per map). Shear maps
come from the convergence maps by Kaiser-Squires (:func:`shear_maps`).

Decorrelating the replicas: shells deeper than the box share particles (a shell
of 192 Mpc/h in a 256 Mpc/h box overlaps its neighbour's z range modulo the box
by 2/3), and the same box modes then add up coherently in the map (we measured
C_ell twice the Limber value without this). As in multiple-plane ray tracing
codes, each plane is therefore used with its own random periodic shift,
random flips of both axes and, when the box is square in (x, y), a random
transposition (seeded by ``conf.seed``; ``LensingConfig(randomize=False)``
turns it off). These are changes of the ray coordinates in the interpolation
weights only: the planes themselves are unchanged and no data moves.
"""
import dataclasses
import logging
from typing import Tuple

import mesh_tensorflow as mtf
import numpy as np
import tensorflow.compat.v1 as tf

from . import cosmology as cosmo_mod
from ..mesh import domain
from .. import layout
from . import sizing, timeloop
from .kernels import make_kernels
from .lpt import lpt_init
from ..config import default_stages
from .nbody import kdk_step
from .painting import cic_paint_plane

__all__ = ["SRC", "THX", "THY", "LensingConfig", "LightconeGeometry", "geometry",
           "lightcone_stages", "source_nz", "read_nz_table", "nz_efficiency", "density_plane",
           "interpolation_weights", "born_coefficients",
           "born_convergence", "kaiser_squires_kernels", "shear_maps", "lightcone_forward",
           "kappa_power_spectrum",
           "interpolated_power", "limber_cl"]

log = logging.getLogger(__name__)

SRC, THX, THY = "src", "thx", "thy"
"""Dimensions of a convergence map ``[src, thx, thy]`` (replicated on every rank)."""

# A plane scale factor within this fraction of a regular time step of a regular stage
# replaces that stage (instead of adding a much shorter step next to it).
_STAGE_SNAP_FRACTION = 0.25
# Default apodisation of kappa_power_spectrum: 10 % of the side at each edge keeps 64 %
# of the map's area at full weight and removed the edge leakage in our tests.
DEFAULT_TAPER = 0.1
# Key mixed with conf.seed for the plane randomisation (independent of the ICs' stream).
_RANDOMIZE_KEY = 0x1e45
# Relative slack when comparing the nearest plane's scale factor with a_end.
_A_END_RTOL = 1e-9


# ----------------------------------------------------------------------------- config
@dataclasses.dataclass(frozen=True)
class LensingConfig:
    """What to lens: sources, field of view, map size, number of lens planes.

    Parameters
    ----------
    z_source : float or tuple of float
        Source redshift(s) [dimensionless], positive.
    field_deg : float
        Side of the square field of view [deg].
    field_npix : int
        Pixels (rays) per side of the convergence map.
    n_planes : int
        Number of lens planes (shells of equal comoving thickness between the
        observer and the farthest source).
    randomize : bool
        Random shift, flips and transposition of each plane (module docstring).
    nz_smail : tuple of float
        Sources with a Smail-type redshift distribution n(z) ~ z^alpha
        exp(-(z/z0)^beta), given as alpha,beta,z0 (empty: none), one map per
        tomographic bin of nz_bins, besides the z_source maps.
    nz_file : str
        Sources with a tabulated n(z): a text file of two columns, z and n(z)
        (linear in between, 0 outside; empty: none). Exclusive with nz_smail.
    nz_bins : tuple of float
        Edges of the tomographic bins in z of the n(z) sources (at least two,
        increasing): one convergence map per bin.

    Raises
    ------
    ValueError
        For non-positive or non-finite values (the message names the value).
    """

    z_source: Tuple[float, ...] = (1.0,)
    field_deg: float = 5.0
    field_npix: int = 128
    n_planes: int = 12
    randomize: bool = True
    nz_smail: Tuple[float, ...] = ()
    nz_file: str = ""
    nz_bins: Tuple[float, ...] = ()

    def __post_init__(self):
        zs = self.z_source
        zs = (zs,) if np.isscalar(zs) else tuple(zs)
        if len(zs) == 0:
            raise ValueError("LensingConfig: z_source must hold at least one redshift")
        for z in zs:
            if isinstance(z, bool) or not np.isfinite(float(z)) or float(z) <= 0:
                raise ValueError("LensingConfig: source redshifts must be positive and finite, "
                                 "got z_source=%r" % (self.z_source,))
        object.__setattr__(self, "z_source", tuple(float(z) for z in zs))
        if not (np.isfinite(float(self.field_deg)) and float(self.field_deg) > 0):
            raise ValueError("LensingConfig: field_deg must be positive, got %r" % self.field_deg)
        object.__setattr__(self, "field_deg", float(self.field_deg))
        for name in ("field_npix", "n_planes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not float(v).is_integer() or v < 1:
                raise ValueError("LensingConfig: %s must be a positive integer, got %r"
                                 % (name, v))
            object.__setattr__(self, name, int(v))
        object.__setattr__(self, "randomize", bool(self.randomize))
        for name in ("nz_smail", "nz_bins"):
            v = getattr(self, name)
            v = (v,) if np.isscalar(v) else tuple(v)
            if any(isinstance(x, bool) or not np.isfinite(float(x)) for x in v):
                raise ValueError("LensingConfig: %s must hold finite numbers, got %r" % (name, v))
            object.__setattr__(self, name, tuple(float(x) for x in v))
        object.__setattr__(self, "nz_file", str(self.nz_file or ""))
        sm, bins = self.nz_smail, self.nz_bins
        if sm and (len(sm) != 3 or sm[0] < 0 or sm[1] <= 0 or sm[2] <= 0):
            raise ValueError("LensingConfig: nz_smail takes alpha,beta,z0 with alpha >= 0, "
                             "beta > 0, z0 > 0, got %r" % (sm,))
        if sm and self.nz_file:
            raise ValueError("LensingConfig: give nz_smail or nz_file, not both")
        if (sm or self.nz_file) and len(bins) < 2:
            raise ValueError("LensingConfig: n(z) sources need nz_bins with at least two "
                             "redshift edges, got %r" % (bins,))
        if bins and not (sm or self.nz_file):
            raise ValueError("LensingConfig: nz_bins=%r without an n(z) (nz_smail or nz_file)"
                             % (bins,))
        if bins and bins[0] < 0:
            raise ValueError("LensingConfig: nz_bins: redshifts are >= 0, got the edge %g in %r"
                             % (min(bins), bins))
        if bins and np.any(np.diff(bins) <= 0):
            i = int(np.nonzero(np.diff(bins) <= 0)[0][0])
            raise ValueError("LensingConfig: nz_bins must be increasing redshifts, got %g after "
                             "%g in %r" % (bins[i + 1], bins[i], bins))

    @property
    def n_bins(self):
        """Number of tomographic n(z) bins."""
        return max(0, len(self.nz_bins) - 1)

    @property
    def n_maps(self):
        """Number of convergence maps: delta-function sources plus n(z) bins."""
        return len(self.z_source) + self.n_bins

    def to_dict(self):
        """A JSON-able dict."""
        d = dataclasses.asdict(self)
        for name in ("z_source", "nz_smail", "nz_bins"):
            d[name] = list(getattr(self, name))
        return d


@dataclasses.dataclass(frozen=True)
class LightconeGeometry:
    r"""Lens planes, sources and rays derived from a SimConfig and a LensingConfig.

    Attributes
    ----------
    r_edges : ndarray
        ``n_planes + 1`` shell edges [Mpc/h], from 0 (observer) to ``chi_max``.
    r : ndarray
        Shell centres :math:`r_i` [Mpc/h].
    width : ndarray
        Shell thicknesses :math:`\Delta r` [Mpc/h].
    a : ndarray
        Scale factors :math:`a(r_i)` of the plane centres [dimensionless].
    z_source, chi_source : ndarray
        Source redshifts [dimensionless] and comoving distances [Mpc/h].
    theta : ndarray
        ``field_npix`` pixel-centre angles along x and y [rad], centred on 0.
    field_deg : float
        Field of view [deg].
    shift : ndarray
        ``[n_planes, 2]`` periodic shift of each plane along x, y [Mpc/h].
    flip : ndarray
        ``[n_planes, 2]`` sign (+-1) of the ray angles theta_x, theta_y in each plane.
    transpose : ndarray
        ``[n_planes]`` bool: theta_x runs along the plane's y axis (and theta_y
        along x).
    labels : tuple of str
        One per map: ``z_s=<z>`` for the delta-function sources, then
        ``bin<b>:<zlo>-<zhi>`` for the n(z) bins.
    efficiency : ndarray
        ``[n_maps, n_planes]`` lensing efficiency of each plane for each map,
        :math:`\langle (1 - r_i/\chi_s)_+ \rangle` over the map's sources
        [dimensionless] (:func:`nz_efficiency` for the n(z) bins).
    """

    r_edges: np.ndarray
    r: np.ndarray
    width: np.ndarray
    a: np.ndarray
    z_source: np.ndarray
    chi_source: np.ndarray
    theta: np.ndarray
    field_deg: float
    shift: np.ndarray
    flip: np.ndarray
    transpose: np.ndarray
    labels: Tuple[str, ...] = ()
    efficiency: np.ndarray = None

    @property
    def n_planes(self):
        return int(self.r.size)

    @property
    def n_source(self):
        """Number of maps (delta-function sources and n(z) bins)."""
        return len(self.labels)

    @property
    def npix(self):
        return int(self.theta.size)

    def to_dict(self):
        """A JSON-able dict (arrays as lists)."""
        return {f.name: (getattr(self, f.name).tolist()
                         if isinstance(getattr(self, f.name), np.ndarray)
                         else getattr(self, f.name)) for f in dataclasses.fields(self)}


def geometry(conf, lconf):
    """Lens planes and rays for a simulation, with every consistency check.

    Parameters
    ----------
    conf : SimConfig
    lconf : LensingConfig

    Returns
    -------
    LightconeGeometry

    Raises
    ------
    ValueError
        If a source lies beyond the simulated lightcone (its comoving distance
        exceeds :math:`\\chi(a_{\\rm start})`), if the shells are thicker than the
        box along z, if the nearest plane is later than ``a_end``, or if the field
        of view is wider than the box at the farthest plane. Raised at graph
        construction, identically on every rank.
    """
    cosmo = conf.cosmology
    zs = np.asarray(lconf.z_source, np.float64)
    chi_s = np.atleast_1d(np.asarray(cosmo_mod.comoving_distance(cosmo, 1.0 / (1.0 + zs))))
    chi_start = float(cosmo_mod.comoving_distance(cosmo, conf.a_start))
    if chi_s.max() > chi_start:
        raise ValueError(
            "z_source=%g is beyond the simulated lightcone: it lies at a comoving distance of "
            "%.1f Mpc/h, but the simulation starts at a_start=%g (z=%.3g, %.1f Mpc/h); lower "
            "a_start or the source redshift" % (zs.max(), chi_s.max(), conf.a_start,
                                                1.0 / conf.a_start - 1.0, chi_start))
    nz = source_nz(lconf)
    chi_max = float(chi_s.max())
    if nz is not None:
        z_top = lconf.nz_bins[-1]
        chi_top = float(cosmo_mod.comoving_distance(cosmo, 1.0 / (1.0 + z_top)))
        if chi_top > chi_start:
            raise ValueError(
                "nz_bins reach z=%g, beyond the simulated lightcone: %.1f Mpc/h, but the "
                "simulation starts at a_start=%g (z=%.3g, %.1f Mpc/h); lower a_start or the "
                "last bin edge" % (z_top, chi_top, conf.a_start, 1.0 / conf.a_start - 1.0,
                                   chi_start))
        chi_max = max(chi_max, chi_top)
    n = lconf.n_planes
    edges = np.linspace(0.0, chi_max, n + 1)
    width = np.diff(edges)
    lz = conf.box_size[2]
    if width[0] > lz * (1.0 + 1e-12):
        raise ValueError(
            "n_planes=%d gives shells %.1f Mpc/h thick, thicker than the box along the line of "
            "sight (box_size[2] = %.1f Mpc/h): use n_planes >= %d"
            % (n, width[0], lz, int(np.ceil(chi_max / lz))))
    r = 0.5 * (edges[1:] + edges[:-1])
    a = np.asarray(cosmo_mod.a_of_chi(cosmo, r), np.float64)
    if a.max() > conf.a_end * (1.0 + _A_END_RTOL):
        raise ValueError("the nearest lens plane is at a=%.4f, later than a_end=%g; use "
                         "a_end >= %.4f" % (a.max(), conf.a_end, a.max()))
    npix = lconf.field_npix
    fov = np.deg2rad(lconf.field_deg)
    theta = (np.arange(npix) + 0.5 - 0.5 * npix) * (fov / npix)
    span = fov * r.max()
    lmin = min(conf.box_size[:2])
    if span > lmin:
        raise ValueError(
            "field_deg=%g is wider than the box allows: at the farthest plane (%.1f Mpc/h) it "
            "spans %.1f Mpc/h > box side %.1f Mpc/h; use field_deg <= %.3g or a larger box"
            % (lconf.field_deg, r.max(), span, lmin, np.rad2deg(lmin / r.max())))
    if lconf.randomize:
        rng = np.random.RandomState(np.random.SeedSequence([conf.seed, _RANDOMIZE_KEY])
                                    .generate_state(1)[0])
        shift = rng.uniform(0.0, 1.0, (n, 2)) * np.asarray(conf.box_size[:2])
        flip = rng.choice([-1.0, 1.0], (n, 2))
        square = conf.nc[0] == conf.nc[1] and conf.box_size[0] == conf.box_size[1]
        transpose = rng.uniform(size=n) < 0.5 if square else np.zeros(n, bool)
    else:
        shift, flip, transpose = np.zeros((n, 2)), np.ones((n, 2)), np.zeros(n, bool)
    eff = [np.clip(1.0 - r[None, :] / chi_s[:, None], 0.0, None)]
    labels = ["z_s=%g" % z for z in zs]
    if nz is not None:
        eff.append(nz_efficiency(cosmo, nz, lconf.nz_bins, r))
        b = lconf.nz_bins
        labels += ["bin%d:%g-%g" % (i, b[i], b[i + 1]) for i in range(lconf.n_bins)]
    return LightconeGeometry(r_edges=edges, r=r, width=width, a=a, z_source=zs,
                             chi_source=chi_s, theta=theta, field_deg=float(lconf.field_deg),
                             shift=shift, flip=flip, transpose=transpose, labels=tuple(labels),
                             efficiency=np.concatenate(eff, axis=0))


# Points per tomographic bin of the n(z) integrals (midpoint rule; the efficiency is smooth
# in z but for the kink at chi(z) = r: 512 points give ~1e-6 relative error against scipy's quad, tests/test_lensing.py).
NZ_POINTS = 512
# A bin holding less than this fraction of the n(z) has "no sources".
NZ_EMPTY_FRACTION = 1e-6


def source_nz(lconf):
    r"""The source redshift distribution of a LensingConfig, or None.

    Returns
    -------
    callable or None
        ``n(z)`` [arbitrary units] on arrays of redshifts: Smail
        :math:`z^\alpha \exp(-(z/z_0)^\beta)` or the table of ``nz_file``
        (linear interpolation, 0 outside).

    Raises
    ------
    ValueError
        If the table file breaks a rule of :func:`read_nz_table` (named with its
        line).
    """
    if lconf.nz_smail:
        alpha, beta, z0 = lconf.nz_smail
        return lambda z: np.asarray(z, np.float64)**alpha * np.exp(-(np.asarray(z) / z0)**beta)
    if not lconf.nz_file:
        return None
    z_t, n_t = read_nz_table(lconf.nz_file)
    return lambda z: np.interp(z, z_t, n_t, left=0.0, right=0.0)


def read_nz_table(path):
    """The table of a source redshift distribution: two columns, z and n(z).

    Text, one row per line, the two numbers separated by blanks; ``#`` starts a
    comment, blank lines are skipped.

    Parameters
    ----------
    path : str

    Returns
    -------
    z, n : ndarray
        float64: redshifts [dimensionless], >= 0 and strictly increasing, and
        n(z) [arbitrary units], >= 0, not all zero.

    Raises
    ------
    ValueError
        One line ``nz_file=PATH: ...`` naming the rule that failed and, for a
        row, its line: the file cannot be read; a row without exactly two
        columns; a value that is no number, or NaN or infinite; a negative z or
        n(z); z not increasing; fewer than two rows; n(z) zero everywhere.
    """
    where = "nz_file=%s" % path
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except UnicodeDecodeError as e:
        raise ValueError("%s: cannot read a table of z, n(z): not text (byte %d)"
                         % (where, e.start)) from None
    except OSError as e:
        raise ValueError("%s: cannot read a table of z, n(z): %s"
                         % (where, e.strerror or e)) from None
    rows, at = [], []
    for number, line in enumerate(lines, 1):
        cols = line.split("#", 1)[0].split()
        if not cols:
            continue
        if len(cols) != 2:
            raise ValueError("%s: line %d has %d columns, expected 2 (z and n(z)): %r"
                             % (where, number, len(cols), line.strip()))
        try:
            z, n = float(cols[0]), float(cols[1])
        except ValueError:
            raise ValueError("%s: line %d: %r is not a number" % (
                where, number, next(c for c in cols if not _is_float(c)))) from None
        for name, v in (("z", z), ("n(z)", n)):
            if not np.isfinite(v):
                raise ValueError("%s: line %d: %s = %s; z and n(z) must be finite"
                                 % (where, number, name, cols[0 if name == "z" else 1]))
            if v < 0:
                raise ValueError("%s: line %d: %s = %g is negative; %s"
                                 % (where, number, name, v, "redshifts are >= 0" if name == "z"
                                    else "n(z) is a density of sources, >= 0"))
        if rows and z <= rows[-1][0]:
            raise ValueError("%s: line %d: z = %g after z = %g on line %d; z must increase "
                             "from row to row" % (where, number, z, rows[-1][0], at[-1]))
        rows.append((z, n))
        at.append(number)
    if len(rows) < 2:
        raise ValueError("%s: %d row%s of z, n(z); the table needs at least two"
                         % (where, len(rows), "" if len(rows) == 1 else "s"))
    tab = np.asarray(rows, np.float64)
    if not np.any(tab[:, 1] > 0):
        raise ValueError("%s: n(z) is zero on every row; there are no sources" % where)
    return tab[:, 0].copy(), tab[:, 1].copy()


def _is_float(text):
    try:
        float(text)
    except ValueError:
        return False
    return True


def nz_efficiency(cosmo, nz, bins, r):
    r"""Lensing efficiency of each tomographic bin at distances ``r`` (numpy, float64).

    .. math::

        g_b(r) = rac{\int_{z_b}^{z_{b+1}} dz\, n(z)\, (1 - r/\chi(z))_+}
                      {\int_{z_b}^{z_{b+1}} dz\, n(z)}

    (midpoint rule on :data:`NZ_POINTS` points per bin).

    Parameters
    ----------
    cosmo : Cosmology
    nz : callable
        :func:`source_nz`.
    bins : sequence of float
        Bin edges in z.
    r : ndarray
        Comoving distances [Mpc/h].

    Returns
    -------
    ndarray
        ``[n_bins, r.size]`` [dimensionless].

    Raises
    ------
    ValueError
        If a bin holds less than :data:`NZ_EMPTY_FRACTION` of the sources of all bins.
    """
    bins = np.asarray(bins, np.float64)
    out, mass = [], []
    for lo, hi in zip(bins[:-1], bins[1:]):
        z = lo + (np.arange(NZ_POINTS) + 0.5) * (hi - lo) / NZ_POINTS
        w = np.asarray(nz(z), np.float64) * (hi - lo) / NZ_POINTS
        chi = np.asarray(cosmo_mod.comoving_distance(cosmo, 1.0 / (1.0 + z)))
        lens = np.clip(1.0 - np.asarray(r)[None, :] / chi[:, None], 0.0, None)
        mass.append(w.sum())
        out.append(w @ lens / w.sum() if w.sum() > 0 else np.zeros(np.size(r)))
    mass = np.asarray(mass)
    empty = np.nonzero(mass <= NZ_EMPTY_FRACTION * mass.sum())[0]
    if empty.size:
        i = int(empty[0])
        raise ValueError("nz_bins: bin %d (z %g-%g) holds no sources (fraction %.2g of the "
                         "n(z)); change the bins or the n(z)"
                         % (i, bins[i], bins[i + 1], mass[i] / max(mass.sum(), 1e-300)))
    return np.asarray(out)


def lightcone_stages(conf, geom):
    """N-body stages of a lightcone run and the stage of each lens plane.

    The stages are :func:`flowpm_mtf.config.default_stages` with the plane scale
    factors merged in: a plane within a quarter of a regular step of a regular
    stage (other than ``a_start``) moves that stage onto the plane, otherwise it
    adds a stage; so no step is much shorter than needed. The run stops at the
    latest plane: the lightcone needs no later stage (so it ends before
    ``conf.a_end`` in general).

    Parameters
    ----------
    conf : SimConfig
    geom : LightconeGeometry

    Returns
    -------
    stages : ndarray
        Increasing scale factors [dimensionless], from ``conf.a_start`` to the
        latest plane.
    plane_stage : ndarray of int
        For each plane, the index into ``stages`` at which it is painted
        (``stages[plane_stage[i]] == geom.a[i]``).
    """
    regular = default_stages(conf)
    snap = _STAGE_SNAP_FRACTION * (conf.a_end - conf.a_start) / conf.n_steps
    stages = {float(a): None for a in regular}
    taken = set()
    for a in sorted(geom.a):
        j = 1 + int(np.argmin(np.abs(regular[1:] - a))) if regular.size > 1 else 0
        if j > 0 and j not in taken and abs(regular[j] - a) <= snap:
            del stages[float(regular[j])]
            taken.add(j)
        stages[float(a)] = None
    stages = np.array(sorted(stages))
    idx = np.array([int(np.argmin(np.abs(stages - a))) for a in geom.a])
    return stages[:idx.max() + 1], idx


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
        ``[bx, by, npart]`` slot weights (:func:`flowpm_mtf.mesh.domain.weights`).

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


def born_coefficients(conf, geom):
    r"""Born weights :math:`\tfrac32\Omega_m (H_0/c)^2 \Delta r\, r_i/a_i\, g_s(r_i)`,
    with :math:`g_s = (1 - r_i/r_s)_+` for a source at :math:`r_s` and the
    n(z)-weighted mean of it for a tomographic bin (``geom.efficiency``).

    Returns
    -------
    ndarray
        ``[n_maps, n_planes]`` [dimensionless per unit density contrast].
    """
    pref = 1.5 * conf.cosmology.Omega_m / cosmo_mod.RH**2                 # [(h/Mpc)^2]
    return pref * (geom.width * geom.r / geom.a)[None, :] * geom.efficiency


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


def lightcone_forward(linear, conf, geom):
    """LPT, N-body through the lightcone stages, density planes and Born convergence.

    The same computation as the job (:mod:`flowpm_mtf.jobs.lensing`) in one
    graph, for gradients and tests.

    Parameters
    ----------
    linear : mtf.Tensor
        Linear density contrast at a = 1, real ``[x, y, z]``, dtype ``conf.dtype``.
    conf : SimConfig
    geom : LightconeGeometry

    Returns
    -------
    kappa : mtf.Tensor
        ``[src, thx, thy]`` (see :func:`born_convergence`).
    planes : list of mtf.Tensor
        The ``[x, y]`` density planes.
    final : State
        The particle state at the last stage.
    """
    stages, plane_stage = lightcone_stages(conf, geom)
    kernels = make_kernels(conf, linear.mesh)
    planes = [None] * geom.n_planes

    def paint_planes(j, a, state):
        for i in np.nonzero(plane_stage == j)[0]:
            planes[i] = density_plane(state.positions, conf, geom, int(i),
                                      weight=domain.weights(state.ids, conf))

    rows = sizing.send_capacity(conf, stages=stages)   # the migration's, from these stages
    state = timeloop.integrate(
        timeloop.initial_state(lpt_init(linear, conf, a=stages[0], forces=False, kernels=kernels),
                               conf, kernels),
        stages,
        lambda s, i, a0, a1: kdk_step(s, conf, a0, a1, kernels, send_rows=rows), [paint_planes])
    log.debug("lightcone_forward: %d stages, %d planes", stages.size, geom.n_planes)
    return born_convergence(planes, conf, geom), planes, state


# ----------------------------------------------------------------------------- statistics
def kappa_power_spectrum(kappa, field_deg, edges=None, taper=DEFAULT_TAPER):
    r"""Flat-sky angular power spectrum of a square map (numpy).

    :math:`\hat C_\ell = \langle |\tilde\kappa(\boldsymbol\ell)|^2 \rangle /
    (\Omega\, \overline{w^2})` with :math:`\tilde\kappa = \Delta\theta^2\,
    \mathrm{FFT}(w\,(\kappa - \bar\kappa))` and :math:`\Omega = (n\Delta\theta)^2`,
    averaged over the modes of each :math:`|\boldsymbol\ell|` bin. The map is
    not periodic: without apodisation its edges leak low-ell power to all ell
    (we measured up to 3x the Limber C_ell at ell ~ 2000 on the default run), so
    it is multiplied by :math:`w`, a cosine taper from 0 to 1 over the fraction
    ``taper`` of the side at each edge (1 inside); :math:`\overline{w^2}`
    restores the normalisation of a statistically homogeneous map.

    Parameters
    ----------
    kappa : ndarray
        ``[npix, npix]`` map [dimensionless].
    field_deg : float
        Side of the map [deg].
    edges : array_like, optional
        Bin edges in ell; default: width = 2 fundamentals, from 1/2 fundamental
        to the pixel Nyquist frequency.
    taper : float, optional
        Fraction of the side tapered at each edge, in [0, 0.5] (0: no taper).

    Returns
    -------
    ell, cl, n_modes : ndarray
        Mean ell of each bin, :math:`\hat C_\ell` [sr] and the number of FFT modes
        (both members of each :math:`\pm\boldsymbol\ell` pair); empty bins hold 0.
    """
    kappa = np.asarray(kappa, np.float64)
    n = kappa.shape[0]
    if kappa.ndim != 2 or kappa.shape[1] != n:
        raise ValueError("kappa_power_spectrum: expected a square map, got shape %s"
                         % (kappa.shape,))
    if not 0.0 <= taper <= 0.5:
        raise ValueError("kappa_power_spectrum: taper must be in [0, 0.5], got %r" % taper)
    x = (np.arange(n) + 0.5) / n
    ramp = np.minimum(1.0, np.minimum(x, 1.0 - x) / taper) if taper > 0 else np.ones(n)
    w1 = 0.5 - 0.5 * np.cos(np.pi * ramp)
    w = w1[:, None] * w1[None, :]
    dtheta = np.deg2rad(field_deg) / n
    lf = 2.0 * np.pi / (n * dtheta)
    if edges is None:
        edges = np.arange(0.5, n / 2 + 1e-9, 2.0) * lf
    edges = np.asarray(edges, np.float64)
    lk = 2.0 * np.pi * np.fft.fftfreq(n, d=dtheta)
    ell = np.sqrt(lk[:, None]**2 + lk[None, :]**2).ravel()
    power = (np.abs(np.fft.fft2(w * (kappa - kappa.mean())))**2).ravel() * dtheta**2 / n**2
    power /= np.mean(w**2)
    b = np.digitize(ell, edges) - 1
    ok = (b >= 0) & (b < edges.size - 1) & (ell > 0)
    nb = edges.size - 1
    modes = np.bincount(b[ok], minlength=nb).astype(np.float64)
    safe = np.maximum(modes, 1.0)
    return (np.bincount(b[ok], ell[ok], nb) / safe, np.bincount(b[ok], power[ok], nb) / safe,
            modes)


def interpolated_power(k, conf, table, n_angles=64):
    r"""Expected power of a bilinearly interpolated plane at transverse ``k`` (numpy).

    Bilinear interpolation of grid values is a convolution of the sampled field
    with the tent kernel, so the power of the interpolated field is
    :math:`\mathrm{sinc}^4(k_x\Delta_x/2)\,\mathrm{sinc}^4(k_y\Delta_y/2)\,
    P_g(\mathbf k)` with :math:`P_g` the (periodic) power of the grid: for
    :math:`|k_i|` beyond the Nyquist frequency it is the grid's power at the
    folded wavevector (images). Averaged over ``n_angles`` directions.

    Parameters
    ----------
    k : array_like
        Transverse wavenumbers [h/Mpc].
    conf : SimConfig
    table : (k_tab, p_tab)
        Increasing wavenumbers [h/Mpc] and the grid's power [(Mpc/h)^3]
        (e.g. :func:`flowpm_mtf.physics.power.power_spectrum` of the painted particles,
        not deconvolved); log-log interpolation, 0 below ``k_tab[0]`` (no mode
        below the box's fundamental), the last value above ``k_tab[-1]`` (the
        corners of the Nyquist square).

    Returns
    -------
    ndarray
        [(Mpc/h)^3], shape of ``k``.
    """
    k = np.asarray(k, np.float64)
    k_tab, p_tab = (np.asarray(v, np.float64) for v in table)
    phi = (np.arange(n_angles) + 0.5) * (0.5 * np.pi / n_angles)
    out = np.ones(k.shape + (n_angles,))
    folded = np.zeros(k.shape + (n_angles,))
    for axis, trig in ((0, np.cos), (1, np.sin)):
        d = conf.cell_size[axis]
        kk = k[..., None] * trig(phi)
        out *= np.sinc(kk * d / (2 * np.pi))**4
        nyq = np.pi / d
        folded += (np.mod(kk + nyq, 2 * nyq) - nyq)**2
    folded = np.sqrt(folded)
    p = np.exp(np.interp(np.log(np.maximum(folded, k_tab[0])), np.log(k_tab), np.log(p_tab)))
    p[folded < k_tab[0]] = 0.0
    return (out * p).mean(axis=-1)


def limber_cl(ell, conf, geom, power_at_planes, source=0, interpolation=True):
    r"""Limber prediction of :math:`C_\ell` from the planes' 3D power spectra (numpy).

    .. math::

        C_\ell = \Big(\frac32\Omega_m\frac{H_0^2}{c^2}\Big)^2 \sum_i \Delta r\,
            \frac{(1 - r_i/r_s)_+^2}{a_i^2}\, \tilde P_i(k = \ell / r_i)

    (flat sky, :math:`k = \ell/r`): the discrete form of the Born sum for
    uncorrelated shells, each contributing :math:`P_i(\ell/r_i)/(\Delta r\,
    r_i^2)` (Limber: :math:`k_\perp\Delta r \gg 1`). :math:`\tilde P_i` is the
    3D power at plane ``i`` as seen through the bilinear interpolation
    (:func:`interpolated_power`, with images beyond the Nyquist frequency), or,
    with ``interpolation=False``, :math:`P_i` itself (log-log interpolated, 0
    outside the table).

    Parameters
    ----------
    ell : array_like
        Multipoles.
    conf : SimConfig
    geom : LightconeGeometry
    power_at_planes : list of (k, pk)
        Per plane: increasing wavenumbers [h/Mpc] and the 3D power [(Mpc/h)^3],
        e.g. the simulation's measured P(k) at :math:`a_i` (CIC window not
        deconvolved: the planes are painted with the same window).
    source : int
        Index of the source redshift.
    interpolation : bool
        Include the interpolation window and images.

    Returns
    -------
    ndarray
        :math:`C_\ell` [sr], shape of ``ell``.
    """
    ell = np.asarray(ell, np.float64)
    coef = born_coefficients(conf, geom)[source]
    out = np.zeros_like(ell)
    for i in range(geom.n_planes):
        if coef[i] <= 0:
            continue
        k_tab, p_tab = (np.asarray(v, np.float64) for v in power_at_planes[i])
        k = ell / geom.r[i]
        if interpolation:
            pk = interpolated_power(k, conf, (k_tab, p_tab))
        else:
            inside = (k >= k_tab[0]) & (k <= k_tab[-1])
            pk = np.zeros_like(k)
            pk[inside] = np.exp(np.interp(np.log(k[inside]), np.log(k_tab), np.log(p_tab)))
        # coef_i^2 / (width r_i^2) = (3/2 Om/RH^2)^2 width (1 - r/rs)^2 / a^2
        out += coef[i]**2 / (geom.width[i] * geom.r[i]**2) * pk
    return out
