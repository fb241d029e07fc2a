r"""The linear power a run uses: Eisenstein & Hu, a table file, or CAMB (numpy, float64).

A run's initial conditions are coloured with :math:`P(k, a=1)`
(:func:`flowpm_mtf.physics.ics.power_function`). By default that is the Eisenstein & Hu
(1998) fit of the run's cosmology (:mod:`flowpm_mtf.physics.linear_power`). With
:class:`LinearPowerOptions` it is instead

* a **table file** (``--linear-power FILE``): two text columns, k [h/Mpc] and
  P(k) [(Mpc/h)^3], as CAMB (``*_matterpower.dat``) and CLASS (``*_pk.dat``) write
  them (``#`` starts a comment), at redshift ``--linear-power-z``; or
* **CAMB** (``--boltzmann camb``): the linear matter power of the run's cosmology,
  computed in-process (:func:`camb_table`).

:func:`resolve` reads or computes the table **once, on rank 0**, broadcasts it
with the run's comm object (mpi4py lower-case API) and checks it on every rank
before anything is built: every rank raises the same one-line
:class:`~flowpm_mtf.errors.ConfigError` for a file that cannot be read, a row
that is not two finite numbers, k that is not positive or not strictly
increasing (unsorted or repeated), P that is not positive, or a table that does
not cover the mesh's k range (:func:`k_range`: the fundamental mode to the
Nyquist corner, :math:`\sqrt 3\,\pi/{\rm cell}` in a cubic mesh).

Normalisation and growth
------------------------
``--linear-power-norm sigma8`` (the default) rescales the table so that
:math:`\sigma(8\,{\rm Mpc}/h)` at :math:`a = 1` is the run's ``--cosmo-sigma8``: the
one amplitude every other part of a run reads (the buffer sizing, the preflight,
the plots, the EH path) stays the one the run states, and the table's redshift
does not matter (only its shape is used). ``none`` takes the table's amplitude as
it is and brings it from the table's redshift :math:`z_t` to :math:`a = 1` with the
**run's own** growth, :math:`P(k, 1) = P_t(k) / D_1^2(a_t)`
(:func:`flowpm_mtf.physics.cosmology.D1`, normalised to 1 today, no radiation); the
ICs then apply :math:`D_1^2(a_{\rm start})` as with the fit. A table computed with
radiation (CAMB, CLASS) grows slightly differently: the run's :math:`D_1^2` and CAMB's
:math:`P(k, z)/P(k, 0)` at linear k agree to 2e-4 at z = 0.5 and 1 for Planck 2015
(tests/test_linear_power_table.py).

CAMB (``--boltzmann camb``)
---------------------------
The run's :class:`~flowpm_mtf.config.Cosmology` maps to ``camb.CAMBparams`` as:
``H0 = 100 h``, ``ombh2 = Omega_b h^2``, ``omch2 = Omega_c h^2``, ``omk = Omega_k``,
``ns = n_s``, and, assumed (the cosmology has no such fields): massless neutrinos
(``mnu = 0``, CAMB's default ``N_eff = 3.046``), :data:`CAMB_TCMB`, no tensor
modes, CAMB's default reionisation; ``w0``/``wa`` other than a cosmological constant
use CAMB's PPF dark energy. The cosmology has no :math:`A_s`: CAMB runs with
:data:`CAMB_AS_REF` and the table is normalised to ``sigma8`` as above (the
:math:`A_s` that gives it is logged and recorded). The table is CAMB's total matter
power (``delta_tot``) at z = 0, over :func:`k_range` (widened to
:data:`SIGMA8_K_RANGE`, then by :data:`CAMB_K_MARGIN`) on :data:`CAMB_POINTS_PER_DECADE` log-spaced k per decade.

Identity
--------
The run records the table in its config (``linear_power_digest``: the SHA-256 of
the file's bytes, or ``camb <version>``); a resume with another table or another CAMB
version is refused (the checkpoint's config hash, and :func:`resolve`'s check of a
given digest).

Who uses the table
------------------
The ``simulate`` job (:class:`flowpm_mtf.jobs.simulate.SimulateJob`): its ICs
(:class:`flowpm_mtf.jobs.nbody_run.SimulationGraph` ``power=``) and the linear curve of
its ``overview.png``. The estimates made before the graph keep the Eisenstein & Hu fit
of the same ``sigma8``: the particle buffers' sizes (:mod:`flowpm_mtf.physics.sizing`,
a margin over the linear density contrast; a buffer that would overflow is detected and
the run rebuilt larger) and the float-resolution check
(:mod:`flowpm_mtf.runs.preflight`); with ``linear_power_norm none`` and a table far
from the fit they are estimates of another spectrum. The ``lensing`` job (its halofit
prediction, :mod:`flowpm_mtf.physics.lensing_theory`) and ``reconstruct`` (its prior and
its cosmology gradient through P(k)) take no table: they use the fit. Gradients: a
table does not move with the cosmology, so
:class:`flowpm_mtf.gradients.model_gradient.ModelGradient` with a table
(``power=``) refuses cosmology parameters (``params=()``: the field's gradient).
"""
import dataclasses
import hashlib
import logging
import math
import numpy as np

from .. import layout
from ..errors import ConfigError, ResumeError
from ..logs import rank0_only
from . import cosmology as cm
from .linear_power import PowerTable

__all__ = ["NORMS", "BOLTZMANN_CODES", "SIGMA8_K_RANGE", "CAMB_TCMB", "CAMB_AS_REF",
           "CAMB_POINTS_PER_DECADE", "LinearPowerOptions", "LinearPower", "k_range",
           "read_power_table", "file_digest", "sigma8_of_table", "normalise", "camb_table",
           "resolve"]

log = rank0_only(logging.getLogger(__name__))

NORMS = ("sigma8", "none")
"""Values of :attr:`LinearPowerOptions.linear_power_norm`."""
BOLTZMANN_CODES = ("none", "camb")
"""Values of :attr:`LinearPowerOptions.boltzmann` (``none``: no Boltzmann code)."""
#: k range [h/Mpc] a table must cover to be normalised to sigma8: the top-hat integral of
#: sigma(8 Mpc/h) misses 1.4e-5 of sigma8^2 outside it (Eisenstein & Hu, Planck 2015).
SIGMA8_K_RANGE = (2e-3, 4.0)
#: Points of the sigma(8 Mpc/h) integral over SIGMA8_K_RANGE (Simpson in ln k, odd):
#: converged to 1e-9 for a smooth table.
_SIGMA8_POINTS = 8193
#: CMB temperature [K] given to CAMB (CAMB's default; the EH fit uses 2.726).
CAMB_TCMB = 2.7255
#: A_s CAMB runs with before the sigma8 normalisation (the table is rescaled).
CAMB_AS_REF = 2.1e-9
#: Log-spaced k per decade of CAMB's table: log-log interpolation between them is
#: exact to ~1e-5 through the baryon wiggles.
CAMB_POINTS_PER_DECADE = 200
#: CAMB's table reaches this factor beyond the mesh's k range on both sides.
CAMB_K_MARGIN = 1.05


@dataclasses.dataclass(frozen=True)
class LinearPowerOptions:
    """The linear power spectrum of the initial conditions.

    Parameters
    ----------
    linear_power : str
        Text table of the linear matter power: two columns, k [h/Mpc] and P(k) [(Mpc/h)^3]
        (CAMB's or CLASS's usual output; '#' starts a comment), at redshift
        linear_power_z; k strictly increasing and positive, P positive, covering the
        mesh's k (the fundamental mode 2 pi / L to the Nyquist corner sqrt(3) pi / cell).
        Read on rank 0, interpolated in log-log. Default (empty): the Eisenstein & Hu
        (1998) fit of the cosmology.
    linear_power_z : float
        Redshift of the linear_power table [dimensionless] (used with linear_power_norm
        none: the run's growth D1 brings it to a = 1).
    linear_power_norm : {"sigma8", "none"}
        sigma8 (default): rescale the table to the run's cosmo-sigma8 (the amplitude
        the rest of the run uses; the table needs k in 0.002..4 h/Mpc); none: take its
        amplitude as it is.
    linear_power_digest : str
        The table's identity: 'sha256:HEX' of the linear_power file's bytes, or
        'camb VERSION'; recorded by the run (a resume with another table is refused),
        checked when given (default empty: recorded from the table).
    boltzmann : {"none", "camb"}
        camb: compute the linear power of the cosmology with CAMB (from PyPI, once, on
        rank 0; normalised to cosmo-sigma8; massless neutrinos) instead of the Eisenstein
        & Hu fit (none, the default).
    """

    linear_power: str = ""
    linear_power_z: float = 0.0
    linear_power_norm: str = dataclasses.field(default="sigma8", metadata={"choices": NORMS})
    linear_power_digest: str = ""
    boltzmann: str = dataclasses.field(default="none", metadata={"choices": BOLTZMANN_CODES})

    def __post_init__(self):
        for name in ("linear_power", "linear_power_digest"):
            if not isinstance(getattr(self, name), str):
                raise ValueError("%s must be a string, got %r" % (name, getattr(self, name)))
        path = self.linear_power or None
        z = self.linear_power_z
        if isinstance(z, bool) or not isinstance(z, (int, float, np.integer, np.floating)) \
                or not np.isfinite(z) or z < 0 or z > 1e4:
            raise ValueError("linear_power_z must be a redshift in [0, 1e4], got %r" % (z,))
        object.__setattr__(self, "linear_power_z", float(z))
        if self.linear_power_norm not in NORMS:
            raise ValueError("linear_power_norm must be one of %s, got %r"
                             % (", ".join(NORMS), self.linear_power_norm))
        if self.boltzmann not in BOLTZMANN_CODES:
            raise ValueError("boltzmann must be one of %s, got %r"
                             % (", ".join(BOLTZMANN_CODES), self.boltzmann))
        d = self.linear_power_digest or None
        code = None if self.boltzmann == "none" else self.boltzmann
        if path is not None and code is not None:
            raise ValueError("give linear_power (a table) or boltzmann %s, not both"
                             % self.boltzmann)
        if path is None:
            for name, value, default in (("linear_power_z", self.linear_power_z, 0.0),
                                         ("linear_power_norm", self.linear_power_norm,
                                          "sigma8")):
                if value != default:
                    raise ValueError("%s=%r applies to a linear_power table (%s)"
                                     % (name, value, "boltzmann %s computes z = 0, normalised "
                                        "to sigma8" % code if code else "none given"))
            if d is not None and code is None:
                raise ValueError("linear_power_digest=%r without a table (linear_power or "
                                 "boltzmann)" % d)

    @property
    def source(self):
        """``"eisenstein_hu"``, ``"table"`` or the Boltzmann code's name."""
        if self.linear_power:
            return "table"
        return "eisenstein_hu" if self.boltzmann == "none" else self.boltzmann

    def to_dict(self):
        """A JSON-able dict."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class LinearPower:
    """The resolved linear power of a run (:func:`resolve`).

    Attributes
    ----------
    table : PowerTable
        P(k) at a = 1 [(Mpc/h)^3] on k [h/Mpc], normalised as asked.
    digest : str
        The table's identity (``sha256:...`` or ``camb <version>``).
    record : dict
        JSON-able description for the summary: source, path, digest, redshift,
        normalisation, rows, k range, the factor applied (and CAMB's A_s).
    """

    table: PowerTable
    digest: str
    record: dict


def k_range(conf):
    """Smallest and largest non-zero ``|k|`` of the mesh [h/Mpc].

    Parameters
    ----------
    conf : SimConfig

    Returns
    -------
    (float, float)
        ``k_min``: the fundamental mode of the longest box side, ``2 pi / L_max``
        (over the axes with more than one cell); ``k_max``: the Nyquist corner,
        ``sqrt(sum_i (pi / cell_i)^2)`` for even ``nc`` (``(n-1)/2`` instead of
        ``n/2`` modes along an odd axis). Computed from the same float64
        ``fftfreq`` values as the k-space grid.

    Raises
    ------
    ValueError
        If the mesh has a single cell (no non-zero mode).
    """
    ks = layout.axis_k(conf)
    nonzero = [np.abs(k[k != 0]).min() for k in ks if np.any(k != 0)]
    if not nonzero:
        raise ValueError("the mesh nc=%r has no non-zero wave vector" % (conf.nc,))
    k_min = float(min(nonzero))
    k_max = float(np.sqrt(sum(np.max(k * k) for k in ks)))
    return k_min, k_max


def file_digest(path):
    """``"sha256:<hex>"`` of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def read_power_table(path):
    """The two columns of a linear power table file, checked row by row.

    Text, one row per line: k [h/Mpc] and P(k) [(Mpc/h)^3] separated by blanks;
    ``#`` starts a comment (CAMB's and CLASS's headers), blank lines are skipped.

    Parameters
    ----------
    path : str

    Returns
    -------
    k, pk : ndarray
        float64, at least two rows.

    Raises
    ------
    ValueError
        One line ``linear_power=PATH: ...`` naming the rule that failed and, for a
        row, its line: the file cannot be read; a row without exactly two columns; a
        value that is no number, NaN or infinite; k <= 0; P <= 0; k not strictly
        increasing (unsorted or repeated); fewer than two rows.
    """
    where = "linear_power=%s" % path
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except UnicodeDecodeError as e:
        raise ValueError("%s: cannot read a table of k, P(k): not text (byte %d)"
                         % (where, e.start)) from None
    except OSError as e:
        raise ValueError("%s: cannot read a table of k, P(k): %s"
                         % (where, e.strerror or e)) from None
    k, pk, at = [], [], []
    for number, line in enumerate(lines, 1):
        cols = line.split("#", 1)[0].split()
        if not cols:
            continue
        if len(cols) != 2:
            raise ValueError("%s: line %d has %d columns, expected 2 (k [h/Mpc], P(k) "
                             "[(Mpc/h)^3]): %r" % (where, number, len(cols), line.strip()))
        try:
            kv, pv = float(cols[0]), float(cols[1])
        except ValueError:
            bad = cols[0] if not _is_float(cols[0]) else cols[1]
            raise ValueError("%s: line %d: %r is not a number" % (where, number, bad)) from None
        for name, v, text in (("k", kv, cols[0]), ("P(k)", pv, cols[1])):
            if not math.isfinite(v):
                raise ValueError("%s: line %d: %s = %s; k and P(k) must be finite"
                                 % (where, number, name, text))
            if v <= 0:
                raise ValueError("%s: line %d: %s = %g; %s must be positive (log-log "
                                 "interpolation)" % (where, number, name, v, name))
        if k and kv <= k[-1]:
            raise ValueError("%s: line %d: k = %g after k = %g on line %d; k must increase "
                             "strictly from row to row (unsorted or repeated k)"
                             % (where, number, kv, k[-1], at[-1]))
        k.append(kv)
        pk.append(pv)
        at.append(number)
    if len(k) < 2:
        raise ValueError("%s: %d row(s) of k, P(k); a table needs at least 2"
                         % (where, len(k)))
    return np.asarray(k, np.float64), np.asarray(pk, np.float64)


def _is_float(text):
    try:
        float(text)
    except ValueError:
        return False
    return True


def sigma8_of_table(table):
    r""":math:`\sigma(8\,{\rm Mpc}/h)` of a table [dimensionless], over :data:`SIGMA8_K_RANGE`.

    Simpson's rule in :math:`\ln k` of :math:`k^3 P(k) W^2(kR) / 2\pi^2`, ``P`` interpolated
    in log-log.

    Raises
    ------
    ValueError
        If the table does not cover :data:`SIGMA8_K_RANGE`.
    """
    lo, hi = table.k_range
    if lo > SIGMA8_K_RANGE[0] * (1 + table.EDGE_RTOL) or \
            hi < SIGMA8_K_RANGE[1] * (1 - table.EDGE_RTOL):
        raise ValueError("the table covers k in [%.6g, %.6g] h/Mpc; normalising it to sigma8 "
                         "needs k in [%g, %g] h/Mpc (the sigma(8 Mpc/h) integral): extend it "
                         "or take it as it is (linear_power_norm none)"
                         % (lo, hi, SIGMA8_K_RANGE[0], SIGMA8_K_RANGE[1]))
    lnk = np.linspace(np.log(SIGMA8_K_RANGE[0]), np.log(SIGMA8_K_RANGE[1]), _SIGMA8_POINTS)
    k = np.clip(np.exp(lnk), lo, hi)
    x = k * 8.0
    w = 3.0 * (np.sin(x) - x * np.cos(x)) / x**3
    f = k**3 * table(k) * w * w / (2.0 * np.pi**2)
    weights = np.ones_like(lnk)
    weights[1:-1:2], weights[2:-1:2] = 4.0, 2.0
    return float(np.sqrt((lnk[1] - lnk[0]) / 3.0 * np.sum(weights * f)))


def normalise(table, cosmo, z=0.0, norm="sigma8"):
    """P(k, a = 1) from a table at redshift ``z``.

    Parameters
    ----------
    table : PowerTable
        P(k) [(Mpc/h)^3] at redshift ``z``.
    cosmo : Cosmology
    z : float
        Redshift of ``table`` [dimensionless].
    norm : {"sigma8", "none"}
        ``sigma8``: scaled to ``cosmo.sigma8`` (``z`` does not matter); ``none``: divided
        by the run's :math:`D_1^2(1/(1+z))`.

    Returns
    -------
    (PowerTable, float)
        The table at a = 1 and the factor applied to ``table``'s P.
    """
    if norm == "sigma8":
        factor = (float(cosmo.sigma8) / sigma8_of_table(table))**2
    elif norm == "none":
        factor = 1.0 if z == 0 else 1.0 / float(cm.D1(cosmo, 1.0 / (1.0 + z)))**2
    else:
        raise ValueError("norm must be one of %s, got %r" % (", ".join(NORMS), norm))
    return PowerTable(table.k, table.pk * factor), factor


def camb_table(cosmo, k_min, k_max, z=0.0):
    """CAMB's linear matter power of ``cosmo`` (see the module docstring for the mapping).

    Parameters
    ----------
    cosmo : Cosmology
    k_min, k_max : float
        The k range the table must cover [h/Mpc] (widened to :data:`SIGMA8_K_RANGE`, then
        by :data:`CAMB_K_MARGIN`).
    z : float or sequence of float
        Redshift(s) [dimensionless].

    Returns
    -------
    (ndarray, ndarray, dict)
        k [h/Mpc], P(k) [(Mpc/h)^3] at each ``z`` (rows, at :data:`CAMB_AS_REF`) and
        ``{"camb_version", "sigma8_camb"}`` (CAMB's sigma8 at z = 0 for that A_s).

    Raises
    ------
    ConfigError
        If ``camb`` is not installed.
    """
    try:
        import camb
    except ImportError:
        raise ConfigError("boltzmann camb needs the camb package (pip install camb; "
                          "requirements.txt)") from None
    zs = [float(v) for v in np.atleast_1d(z)]
    lo = min(k_min, SIGMA8_K_RANGE[0]) / CAMB_K_MARGIN
    hi = max(k_max, SIGMA8_K_RANGE[1]) * CAMB_K_MARGIN
    h = float(cosmo.h)
    p = camb.CAMBparams()
    p.set_cosmology(H0=100.0 * h, ombh2=cosmo.Omega_b * h * h, omch2=cosmo.Omega_c * h * h,
                    omk=cosmo.Omega_k, mnu=0.0, num_massive_neutrinos=0, TCMB=CAMB_TCMB)
    if cosmo.w0 != -1.0 or cosmo.wa != 0.0:
        p.set_dark_energy(w=cosmo.w0, wa=cosmo.wa, dark_energy_model="ppf")
    p.InitPower.set_params(As=CAMB_AS_REF, ns=cosmo.n_s)
    # CAMB's kmax is in 1/Mpc; 0 must be last for get_sigma8_0
    p.set_matter_power(redshifts=sorted(set(zs) | {0.0}, reverse=True), kmax=hi * h * 1.2,
                       nonlinear=False)
    res = camb.get_results(p)
    n = int(math.ceil(CAMB_POINTS_PER_DECADE * math.log10(hi / lo))) + 1
    k, zz, pk = res.get_matter_power_spectrum(minkh=lo, maxkh=hi, npoints=n)
    zz = np.asarray(zz, np.float64)
    rows = np.stack([pk[int(np.argmin(np.abs(zz - v)))] for v in zs])
    info = {"camb_version": str(camb.__version__), "sigma8_camb": float(res.get_sigma8_0())}
    return np.asarray(k, np.float64), np.asarray(rows, np.float64), info


def _load(opts, conf):
    """(k, P, digest, extra record) of ``opts``'s table, on rank 0 (raises ValueError)."""
    if opts.linear_power:
        k, pk = read_power_table(opts.linear_power)
        return k, pk, file_digest(opts.linear_power), {"path": opts.linear_power}
    k_min, k_max = k_range(conf)
    k, rows, info = camb_table(conf.cosmology, k_min, k_max, z=0.0)
    return k, rows[0], "camb %s" % info["camb_version"], info


def resolve(opts, conf, comm, resume=False):
    """The run's linear power: read or computed on rank 0, broadcast, checked on every rank.

    Parameters
    ----------
    opts : LinearPowerOptions
    conf : SimConfig
    comm : object
        mpi4py-like communicator (``rank``, ``bcast``; collective).
    resume : bool
        The run resumes a checkpoint: a digest that differs from ``opts``'s raises
        :class:`~flowpm_mtf.errors.ResumeError` instead of ``ConfigError``.

    Returns
    -------
    LinearPower or None
        None for the Eisenstein & Hu fit (no table).

    Raises
    ------
    ConfigError
        On every rank, one line: the file breaks a rule of :func:`read_power_table`,
        its digest is not ``opts.linear_power_digest``, the table does not cover the
        mesh's k range or (sigma8) :data:`SIGMA8_K_RANGE`, camb is missing or fails.
    """
    if opts.source == "eisenstein_hu":
        return None
    verdict = None
    if comm.rank == 0:
        try:
            verdict = ("ok",) + _load(opts, conf)
        except ValueError as e:          # the file's rules, ConfigError (camb missing)
            verdict = ("error", str(e))
        except Exception as e:           # noqa: BLE001: CAMB's errors; every rank must hear
            verdict = ("error", "%s: %s: %s" % ("linear_power" if opts.linear_power else
                                               "boltzmann %s" % opts.boltzmann,
                                               type(e).__name__, " ".join(str(e).split())))
    verdict = comm.bcast(verdict, root=0)
    if verdict[0] == "error":
        raise ConfigError(verdict[1])
    _, k, pk, digest, extra = verdict
    where = ("linear_power=%s" % opts.linear_power if opts.linear_power
             else "boltzmann %s" % opts.boltzmann)
    if opts.linear_power_digest and opts.linear_power_digest != digest:
        cls = ResumeError if resume else ConfigError
        raise cls("%s: the table is %s but the run %s %s; use the run's table (or start a "
                  "new run)" % (where, digest, "that wrote the checkpoint used" if resume
                                else "asks for linear_power_digest", opts.linear_power_digest))
    try:
        raw = PowerTable(k, pk)
        lo, hi = raw.k_range
        k_min, k_max = k_range(conf)
        rtol = PowerTable.EDGE_RTOL
        if k_min < lo * (1 - rtol) or k_max > hi * (1 + rtol):
            raise ValueError(
                "the table covers k in [%.6g, %.6g] h/Mpc but the mesh nc=%s in box %s Mpc/h "
                "needs [%.6g, %.6g] h/Mpc (fundamental mode 2pi/L to the Nyquist corner); "
                "extend the table" % (lo, hi, "x".join(map(str, conf.nc)),
                                      "x".join("%g" % b for b in conf.box_size), k_min, k_max))
        table, factor = normalise(raw, conf.cosmology, opts.linear_power_z,
                                  opts.linear_power_norm)
    except ValueError as e:
        raise ConfigError("%s: %s" % (where, e)) from None
    record = dict(extra, source=opts.source, digest=digest, z=opts.linear_power_z,
                  norm=opts.linear_power_norm, rows=int(k.size), k_range=[lo, hi],
                  factor=factor)
    if "sigma8_camb" in extra:
        record["A_s"] = CAMB_AS_REF * factor
    log.info("linear power from %s (%s): %d rows, k in [%.4g, %.4g] h/Mpc, norm %s (factor "
             "%.6g%s)", where, digest, k.size, lo, hi, opts.linear_power_norm, factor,
             ", A_s %.6g" % record["A_s"] if "A_s" in record else "")
    return LinearPower(table=table, digest=digest, record=record)
