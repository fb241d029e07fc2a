"""Gadget-4 HDF5 snapshots: Gadget's multi-file layout, one file per rank, read by yt and pynbody.

``simulate --snapshot-format gadget4`` writes each snapshot as Gadget's
multi-file snapshot in the run directory::

    snapdir_NNN/snapshot_NNN.R.hdf5     R = 0 .. NumFilesPerSnapshot - 1

``NNN`` numbers the snapshots of a run by scale factor (the ``--snapshots``
times before ``a_end`` first, the final state last); ``R`` is the processor
number (``pnum``) of the slice whose particles the file holds: every rank writes
its own files (:func:`write_gadget4`), no rank gathers the particles, and only
the per-file counts travel (one allgather) for ``NumPart_Total``.

One file (Gadget-2/3 Header names, Gadget-4's Parameters and Config groups)::

    /Header      NumPart_ThisFile, NumPart_Total, NumPart_Total_HighWord  uint32 [6]
                 (the total split into its low and high 32 bits, Gadget's convention)
                 MassTable float64 [6]     particle mass [1e10 M_sun/h] (type 1 only)
                 Time (a), Redshift, BoxSize [kpc/h], NumFilesPerSnapshot,
                 Omega0, OmegaLambda, HubbleParam, Flag_* (0; Flag_DoublePrecision
                 1 for float64 runs), LengthUnit "kpc/h" (this package's note; each
                 dataset has a ``units`` attribute too)
    /Parameters  UnitLength_in_cm = 3.0856775814913673e21 (kpc), UnitMass_in_g =
                 1.988409870698051e43 (1e10 M_sun), UnitVelocity_in_cm_per_s = 1e5 (km/s),
                 ComovingIntegrationOn = 1, Omega0, OmegaLambda, OmegaBaryon,
                 HubbleParam, BoxSize, w0, wa
    /Config      NTYPES = 6, PERIODIC, IDS_32BIT or IDS_64BIT, DOUBLEPRECISION (float64)
    /PartType1/Coordinates  [n, 3]  comoving positions [kpc/h] in [0, BoxSize)
    /PartType1/Velocities   [n, 3]  peculiar velocity / sqrt(a) [km/s] (Gadget's convention)
    /PartType1/ParticleIDs  [n]     the Lagrangian index (as ``snapshot.h5``'s ``id``),
                                    uint32 when every id fits, else uint64

in the run's dtype (float32 by default). Each dataset carries Gadget-4's unit
attributes (``a_scaling``, ``h_scaling``, ``length_scaling``, ``mass_scaling``,
``velocity_scaling``, ``to_cgs``). The units are Gadget's defaults, which yt
and pynbody assume or read from ``/Parameters``: ``yt.load`` of the first file
reads every file, ``pynbody.load`` of ``snapdir_NNN/snapshot_NNN`` (without
``.0.hdf5``) too. Gadget has one scalar box: a gadget4 snapshot needs a cubic
box (:func:`check_box`, before the run).

The files are written like the package's other per-rank files
(:func:`flowpm_mtf.runs.h5dist_part._write_h5`: atomically, hashed while written,
an error on one rank raised on every rank); the run directory's manifest and the
checkpoints list them like any output.
"""
import logging
import os
import time

import numpy as np

from ..errors import ConfigError
from .collective import collective
from .h5dist_part import Rows, _write_h5, record_digest

__all__ = ["UNIT_LENGTH_IN_CM", "UNIT_MASS_IN_G", "UNIT_VELOCITY_IN_CM_PER_S", "RHO_CRIT",
           "KPC_PER_MPC", "NTYPES", "snapshot_dir", "file_name", "particle_mass",
           "check_box", "gadget_rows", "write_gadget4", "read_gadget4"]

log = logging.getLogger(__name__)

#: Gadget's default length unit, 1 kpc [cm] (positions and BoxSize are in kpc/h): the IAU
#: kpc, which yt assumes and astropy and pynbody define (Gadget's parameter files round it
#: to 3.085678e21, 1.4e-7 more: a reader converting with that value would move a particle
#: at 100 Mpc/h by 1.4e-5 Mpc/h).
UNIT_LENGTH_IN_CM = 3.0856775814913673e21
#: Gadget's default mass unit, 1e10 M_sun [g] (MassTable is in 1e10 M_sun/h): the IAU
#: nominal solar mass of astropy (Gadget's parameter files use 1.989e43, 3e-4 more).
UNIT_MASS_IN_G = 1.988409870698051e43
#: Gadget's default velocity unit, 1 km/s [cm/s].
UNIT_VELOCITY_IN_CM_PER_S = 1e5
#: Critical density today, 3 H0^2 / (8 pi G) [1e10 M_sun/h / (Mpc/h)^3]
#: (2.77536627e11 h^2 M_sun / Mpc^3).
RHO_CRIT = 27.7536627
#: kpc/h per Mpc/h: the package's positions [Mpc/h] times this are Gadget's.
KPC_PER_MPC = 1000.0
#: Particle types of a Gadget file; the N-body particles are type 1 (dark matter).
NTYPES = 6
#: Gadget's particle type of the N-body particles.
PARTTYPE = 1
#: The largest id a uint32 ParticleIDs dataset holds.
_UINT32_MAX = 2**32 - 1


def snapshot_dir(number):
    """Directory of snapshot ``number`` in the run directory: ``snapdir_NNN``."""
    return "snapdir_%03d" % int(number)


def file_name(number, pnum):
    """File of processor ``pnum`` in snapshot ``number``: ``snapshot_NNN.R.hdf5``."""
    return "snapshot_%03d.%d.hdf5" % (int(number), int(pnum))


def particle_mass(conf):
    """Mass of one particle [1e10 M_sun/h]: ``RHO_CRIT * Omega_m * V / N``.

    Parameters
    ----------
    conf : SimConfig
    """
    cosmo = conf.cosmology
    volume = float(np.prod(np.asarray(conf.box_size, np.float64)))
    return RHO_CRIT * (cosmo.Omega_c + cosmo.Omega_b) * volume / conf.n_particles


def check_box(conf):
    """Refuse a non-cubic box (Gadget's BoxSize is one number): one line, before the run.

    Raises
    ------
    ConfigError
    """
    box = tuple(float(b) for b in conf.box_size)
    if len(set(box)) != 1:
        raise ConfigError("--snapshot-format gadget4 needs a cubic box (Gadget's BoxSize is one "
                          "number), got --box-size %s" % ",".join("%g" % b for b in box))


def _ids_dtype(conf):
    return np.dtype(np.uint32 if conf.n_particles - 1 <= _UINT32_MAX else np.uint64)


def gadget_rows(conf, part, a):
    """Gadget's rows of one slice, converted piece by piece while written.

    Parameters
    ----------
    conf : SimConfig
    part : dict
        ``position`` [Mpc/h], ``velocity`` [km/s] (peculiar) and ``id`` as
        :class:`~flowpm_mtf.runs.h5dist_part.Rows`
        (:func:`flowpm_mtf.runs.snapshot.particle_part`).
    a : float
        Scale factor of the state.

    Returns
    -------
    dict
        ``Coordinates`` [kpc/h] in ``[0, BoxSize)``, ``Velocities`` (peculiar
        velocity / sqrt(a) [km/s]) in the run's dtype and ``ParticleIDs``
        (:func:`_ids_dtype`): :class:`Rows` over the same source rows.
    """
    pos, vel, ids = part["position"], part["velocity"], part["id"]
    dtype = pos.dtype
    box = dtype.type(float(conf.box_size[0]) * KPC_PER_MPC)
    kpc = dtype.type(KPC_PER_MPC)
    scale = dtype.type(1.0 / np.sqrt(float(a)))

    def coordinates(rows):   # Mpc/h in [0, L) -> kpc/h in [0, 1000 L): the product may
        out = np.multiply(pos._convert(rows), kpc)   # round up to 1000 L: its image is 0
        if out.size and out.max() >= box:
            out[out >= box] = 0
        return out

    def velocities(rows):
        return np.multiply(vel._convert(rows), scale)

    return {"PartType1/Coordinates": Rows(pos.source, coordinates, dtype, keep=pos.keep),
            "PartType1/Velocities": Rows(vel.source, velocities, dtype, keep=vel.keep),
            "PartType1/ParticleIDs": Rows(ids.source, ids._convert, _ids_dtype(conf),
                                          keep=ids.keep)}


def _counts(n):
    """``[6]`` uint32 arrays (low word, high word) of ``n`` type-1 particles."""
    low = np.zeros(NTYPES, np.uint32)
    high = np.zeros(NTYPES, np.uint32)
    low[PARTTYPE] = n & _UINT32_MAX
    high[PARTTYPE] = n >> 32
    return low, high


def _groups(conf, a, n_this, n_total, n_files):
    """The Header, Parameters and Config attributes of one file."""
    cosmo = conf.cosmology
    omega_m = cosmo.Omega_c + cosmo.Omega_b
    omega_l = 1.0 - omega_m - cosmo.Omega_k
    box = float(conf.box_size[0]) * KPC_PER_MPC
    double = int(np.dtype(conf.dtype) == np.float64)
    this = np.zeros(NTYPES, np.uint64 if n_this > _UINT32_MAX else np.uint32)
    this[PARTTYPE] = n_this
    total, high = _counts(int(n_total))
    mass = np.zeros(NTYPES, np.float64)
    mass[PARTTYPE] = particle_mass(conf)
    header = {"NumPart_ThisFile": this, "NumPart_Total": total,
              "NumPart_Total_HighWord": high, "MassTable": mass, "Time": float(a),
              "Redshift": 1.0 / float(a) - 1.0, "BoxSize": box,
              "NumFilesPerSnapshot": np.int32(n_files), "Omega0": omega_m,
              "OmegaLambda": omega_l, "HubbleParam": float(cosmo.h),
              "Flag_Sfr": np.int32(0), "Flag_Cooling": np.int32(0),
              "Flag_StellarAge": np.int32(0), "Flag_Metals": np.int32(0),
              "Flag_Feedback": np.int32(0), "Flag_DoublePrecision": np.int32(double),
              "Flag_IC_Info": np.int32(0), "LengthUnit": "kpc/h"}
    params = {"UnitLength_in_cm": UNIT_LENGTH_IN_CM, "UnitMass_in_g": UNIT_MASS_IN_G,
              "UnitVelocity_in_cm_per_s": UNIT_VELOCITY_IN_CM_PER_S,
              "ComovingIntegrationOn": np.int32(1), "Omega0": omega_m,
              "OmegaLambda": omega_l, "OmegaBaryon": float(cosmo.Omega_b),
              "HubbleParam": float(cosmo.h), "BoxSize": box, "Time": float(a),
              "w0": float(cosmo.w0), "wa": float(cosmo.wa)}
    config = {"NTYPES": np.int32(NTYPES), "PERIODIC": np.int32(1),
              ("IDS_32BIT" if _ids_dtype(conf) == np.uint32 else "IDS_64BIT"): np.int32(1)}
    if double:
        config["DOUBLEPRECISION"] = np.int32(1)
    return {"Header": header, "Parameters": params, "Config": config}


def _dataset_attrs():
    """Gadget-4's unit attributes of the datasets (physical = value * a^a_scaling *
    h^h_scaling * to_cgs [cgs])."""
    def attrs(length, velocity, a_scaling, h_scaling, to_cgs, units):
        return {"a_scaling": float(a_scaling), "h_scaling": float(h_scaling),
                "length_scaling": float(length), "mass_scaling": 0.0,
                "velocity_scaling": float(velocity), "to_cgs": float(to_cgs), "units": units}
    return {"PartType1/Coordinates": attrs(1, 0, 1, -1, UNIT_LENGTH_IN_CM,
                                           "kpc/h (comoving)"),
            "PartType1/Velocities": attrs(0, 1, 0.5, 0, UNIT_VELOCITY_IN_CM_PER_S,
                                          "km/s: peculiar velocity / sqrt(a)"),
            "PartType1/ParticleIDs": attrs(0, 0, 0, 0, 0.0, "Lagrangian index")}


def write_gadget4(directory, comm, parts, conf, a, number, *, compression=None, stats=None):
    """Write one Gadget-4 snapshot, every rank the files of its slices (collective).

    Parameters
    ----------
    directory : str
        ``snapdir_NNN`` (created); the files are ``snapshot_NNN.R.hdf5`` in it.
    comm : object
        mpi4py-like communicator.
    parts : dict
        ``pnum -> {"position", "velocity", "id": Rows, ...}`` of this process's
        slices (:func:`flowpm_mtf.jobs.nbody_run.snapshot_parts`; a ``density``
        is not written: Gadget's snapshot holds particles).
    conf : SimConfig
    a : float
        Scale factor of the state.
    number : int
        The snapshot's number ``NNN``.
    compression : {None, "gzip", "lzf"}
        Of the datasets (default none: written at disk speed).
    stats : dict, optional
        Filled with ``bytes``, ``files``, ``seconds`` and ``mode`` as
        :func:`flowpm_mtf.runs.h5dist.write_distributed` does.

    Returns
    -------
    list of str
        The files of the snapshot (every rank's), on every rank.

    Raises
    ------
    FlowpmError
        On every rank, if writing failed on any rank.
    """
    t0 = time.perf_counter()
    directory = os.fspath(directory)
    mine = {int(p): int(item["position"].rows_shape[0]) for p, item in parts.items()}
    counts = {}
    for c in comm.allgather(mine):
        counts.update(c)
    n_files, n_total = len(counts), sum(counts.values())
    if sorted(counts) != list(range(n_files)):
        raise ValueError("write_gadget4: the slices %s are not 0 .. %d" % (sorted(counts),
                                                                           n_files - 1))
    dset_attrs = _dataset_attrs()

    def write_files():
        os.makedirs(directory, exist_ok=True)
        out = {}
        for pnum, item in parts.items():
            path = os.path.join(directory, file_name(number, pnum))
            groups = _groups(conf, a, mine[int(pnum)], n_total, n_files)
            written = _write_h5(path, gadget_rows(conf, item, a), {}, dset_attrs,
                                compression, groups=groups)
            out[int(pnum)] = {"file": path, "written": written}
        return out

    def record(merged):
        for m in merged.values():
            w = m["written"]
            record_digest(m["file"], w["key"], w["digest"])

    merged = collective(comm, write_files, record, "writing %s" % directory)
    seconds = time.perf_counter() - t0
    nbytes = sum(m["written"]["size"] for m in merged.values())
    if stats is not None:
        stats.update(bytes=nbytes, files=len(merged), seconds=seconds,
                     mode="+".join(sorted({m["written"]["mode"] for m in merged.values()})))
    if comm.rank == 0:
        log.info("wrote %s (%d files, %d particles, %.3g GB in %.2f s)", directory, len(merged),
                 n_total, nbytes / 1e9, seconds)
    return [merged[p]["file"] for p in sorted(merged)]


def read_gadget4(path):
    """Read every file of a Gadget HDF5 snapshot (small snapshots: tests, checks).

    Parameters
    ----------
    path : str
        The ``snapdir_NNN`` directory, or any of its files.

    Returns
    -------
    dict
        ``header``, ``parameters`` (attribute dicts of file 0), ``Coordinates``,
        ``Velocities``, ``ParticleIDs`` of type 1 as stored (concatenated in
        file order), ``files`` (the paths read).
    """
    import h5py

    path = os.fspath(path)
    if os.path.isdir(path):
        names = [n for n in os.listdir(path) if n.endswith(".0.hdf5")]
        if len(names) != 1:
            raise ValueError("%s: expected one snapshot_NNN.0.hdf5, found %s" % (path, names))
        first = os.path.join(path, names[0])
    else:
        first = path
    stem = first.rsplit(".", 2)[0]
    with h5py.File(first, "r") as f:
        header = dict(f["Header"].attrs)
        params = dict(f["Parameters"].attrs) if "Parameters" in f else {}
    files = ["%s.%d.hdf5" % (stem, i) for i in range(int(header["NumFilesPerSnapshot"]))]
    out = {"header": header, "parameters": params, "files": files}
    data = {k: [] for k in ("Coordinates", "Velocities", "ParticleIDs")}
    for name in files:
        with h5py.File(name, "r") as f:
            group = f.get("PartType%d" % PARTTYPE)
            for k in data:
                if group is not None and k in group:
                    data[k].append(group[k][()])
    for k, v in data.items():
        out[k] = np.concatenate(v) if v else None
    return out
