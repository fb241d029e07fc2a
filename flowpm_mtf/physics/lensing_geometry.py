r"""The lightcone's geometry (numpy, before any graph): what to lens and where.

:class:`LensingConfig` says what to lens (sources, field of view, map size, number
of planes), :class:`FullSkyConfig` on which sky (flat planes or HEALPix shells,
:mod:`flowpm_mtf.physics.lensing_fullsky`); :func:`geometry` derives the :class:`LightconeGeometry` with every
consistency check: the shells, the sources' distances and lensing efficiencies
(an n(z): :mod:`flowpm_mtf.physics.lensing_sources`), the rays, and each plane's
random shift, flips and transposition (:mod:`flowpm_mtf.physics.lensing`,
"Decorrelating the replicas"); :func:`lightcone_stages` the N-body stages that
reach every plane; :func:`born_coefficients` the Born weight of each plane for
each map.

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
"""
import dataclasses
from typing import Tuple

import numpy as np

from . import cosmology as cosmo_mod
from ..config import default_stages
from .lensing_sources import nz_efficiency, source_nz

__all__ = ["LensingConfig", "FullSkyConfig", "SKIES", "MAX_NSIDE", "LightconeGeometry",
           "geometry", "lightcone_stages", "born_coefficients"]

# A plane scale factor within this fraction of a regular time step of a regular stage
# replaces that stage (instead of adding a much shorter step next to it).
_STAGE_SNAP_FRACTION = 0.25
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
        Random shift, flips and transposition of each plane
        (:mod:`flowpm_mtf.physics.lensing`).
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


#: Values of ``--sky``: flat-sky planes, or HEALPix shells
#: (:mod:`flowpm_mtf.physics.lensing_fullsky`).
SKIES = ("flat", "full")
# Largest nside accepted: 12 * 8192^2 = 805 M pixels per map is beyond any memory here, and
# int32 segment ids of a block's map must stay < 2^31.
MAX_NSIDE = 8192


@dataclasses.dataclass(frozen=True)
class FullSkyConfig:
    """The sky of a lensing run.

    Parameters
    ----------
    sky : str
        ``flat`` (planes and a square field, :mod:`flowpm_mtf.physics.lensing`) or
        ``full`` (HEALPix shells around the observer,
        :mod:`flowpm_mtf.physics.lensing_fullsky`).
    nside : int
        HEALPix resolution of the full-sky maps (a power of 2; 12 nside^2 pixels).

    Raises
    ------
    ValueError
        For an unknown sky or an nside that is not a power of 2 in [1, MAX_NSIDE].
    """

    sky: str = dataclasses.field(default="flat", metadata={"choices": SKIES})
    nside: int = 128

    def __post_init__(self):
        if self.sky not in SKIES:
            raise ValueError("FullSkyConfig: sky must be one of %s, got %r"
                             % (", ".join(SKIES), self.sky))
        n = self.nside
        if isinstance(n, bool) or not float(n).is_integer() or n < 1 or (int(n) & (int(n) - 1)):
            raise ValueError("FullSkyConfig: nside must be a power of 2, got %r" % (n,))
        if int(n) > MAX_NSIDE:
            raise ValueError("FullSkyConfig: nside=%d is too large (at most %d)"
                             % (n, MAX_NSIDE))
        object.__setattr__(self, "nside", int(n))

    @property
    def npix(self):
        """Pixels of a map, 12 nside^2."""
        return 12 * self.nside**2

    def to_dict(self):
        return dataclasses.asdict(self)


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
