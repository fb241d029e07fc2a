"""Every file format of ``flowpm_mtf`` and the one atomic-write path.

Plain, serial h5py: the caller gathers the arrays (e.g. with
``lowering.export_to_tf_tensor``) and **rank 0 writes**; on other ranks the
writers return ``None`` without touching the file system. Every file is
written through :func:`atomic_path` (a temporary name in the same directory,
renamed when complete and removed on failure), so a reader never sees a
half-written file.

Formats
-------
snapshot.h5 (:func:`write_snapshot`)
    Particles and density of one simulation state (layout below).
power.txt (:func:`write_power`)
    Text columns k [h/Mpc], P(k) [(Mpc/h)^3], modes.
kappa.h5, kappa_power.txt (:func:`write_kappa`, :func:`write_kappa_power`)
    Born convergence maps, lens planes, and their angular power spectra.
reconstruction.h5, reconstruction.txt (:func:`write_reconstruction`,
:func:`write_reconstruction_table`)
    Reconstructed and true linear fields, loss history; r(k), T(k).
summary.json, fft_demo.json (:func:`write_summary`, :func:`write_json`)
    JSON documents (the run summary: configs, timings, memory, versions).

Generic building blocks: :func:`write_hdf5` (datasets with attributes),
:func:`write_table` (text columns), :func:`write_json`. A new output format is a
new ``write_*`` function here built on them.

Snapshot layout (readable with h5py alone)::

    /position   float [N, 3]          particle positions [Mpc/h]
    /velocity   float [N, 3]          particle velocities (units in its attribute)
    /id         int [N]               particle ids (initial lattice index; sort by it)
    /density    float [NX, NY, NZ]    density on the mesh (units in its attribute)
    attrs:  config            JSON of the run configuration
            versions          JSON of the package versions (see :func:`versions`)
            version.<package> the same, one attribute per package
            format            "flowpm_mtf.snapshot/1"

Each dataset has a ``units`` attribute.
"""
import contextlib
import dataclasses
import importlib.metadata
import json
import logging
import os
import platform
import sys

import numpy as np

from ..logs import detect_rank

__all__ = ["SNAPSHOT_FORMAT", "KAPPA_FORMAT", "DEFAULT_UNITS", "versions", "to_jsonable",
           "atomic_path", "write_hdf5", "write_table", "write_json", "write_summary",
           "write_snapshot", "read_snapshot", "write_power", "read_power", "write_kappa",
           "write_kappa_power", "write_reconstruction", "write_reconstruction_table",
           "lagrangian_ids", "particle_part", "write_snapshot_distributed",
           "fsync_path"]

log = logging.getLogger(__name__)

#: Value of the ``format`` attribute of the snapshots written here.
SNAPSHOT_FORMAT = "flowpm_mtf.snapshot/1"
#: Value of the ``format`` attribute of ``kappa.h5``.
KAPPA_FORMAT = "flowpm_mtf.kappa/1"
#: Units recorded for each dataset unless the caller overrides them.
DEFAULT_UNITS = {"position": "Mpc/h", "velocity": "km/s",
                 "density": "dimensionless (rho / mean rho)",
                 "id": "Lagrangian index, row-major over the particle grid"}

_DISTRIBUTIONS = {  # key in versions() -> distribution names, first found wins
    "tensorflow": ("tensorflow-cpu", "tensorflow", "tensorflow-gpu", "tf-nightly"),
    "mesh_tensorflow": ("mesh-tensorflow",),
    "numpy": ("numpy",),
    "h5py": ("h5py",),
    "flowpm_mtf": ("flowpm-mtf",),
}
_MODULES = {"tensorflow": "tensorflow", "mesh_tensorflow": "mesh_tensorflow", "numpy": "numpy",
            "h5py": "h5py", "flowpm_mtf": "flowpm_mtf"}


def versions():
    """Versions of the packages that produced a result.

    Read from the installed distributions' metadata (no import needed), falling
    back to an imported module's ``__version__``.

    Returns
    -------
    dict
        ``{"python", "tensorflow", "mesh_tensorflow", "numpy", "h5py",
        "flowpm_mtf"}`` -> version string (``"unknown"`` if not found).
    """
    out = {"python": platform.python_version()}
    for key, dists in _DISTRIBUTIONS.items():
        version = None
        for dist in dists:
            try:
                version = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
        if version is None:
            module = sys.modules.get(_MODULES[key])
            version = getattr(module, "__version__", None)
        out[key] = version or "unknown"
    return out


def to_jsonable(obj):
    """Convert a configuration to JSON-able python objects.

    Accepts dicts, objects with a ``to_dict()`` method (``SimConfig``,
    ``Cosmology``), dataclasses, tuples, numpy scalars and arrays; anything else
    becomes its ``str``.
    """
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if hasattr(obj, "to_dict") and callable(obj.to_dict):
        return to_jsonable(obj.to_dict())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return to_jsonable(dataclasses.asdict(obj))
    return str(obj)


def _is_writer(rank):
    return (detect_rank() if rank is None else int(rank)) == 0


def _tmp_name(path):
    return "%s.tmp-%d" % (path, os.getpid())


def fsync_path(path):
    """fsync a file or a directory by its path (a file's data, or the renames in a directory).

    Best effort: a path that vanished, or a file system that cannot fsync a
    directory, is skipped (the rename or write itself already happened).
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path):
    """The one atomic-write path: a temporary name that becomes ``path`` when complete.

    Write the file under the yielded name; when the block ends normally it is
    renamed to ``path`` (``os.replace``: atomic on POSIX within a directory),
    and on any error the temporary file is removed, so ``path`` is either the
    previous complete file or the new complete one.

    Parameters
    ----------
    path : str or os.PathLike

    Yields
    ------
    str
        The temporary name (``path`` + ``.tmp-<pid>``).

    Raises
    ------
    OSError
        As the write raised it, also for a full disk (``ENOSPC``/``EDQUOT``):
        the writers run on rank 0 alone, where a :class:`FlowpmError` would
        leave the other ranks waiting; the caller makes it collective
        (:func:`flowpm_mtf.runs.collective.collective` turns a full disk into
        ``OutputDirError``, exit 5, on every rank).
    """
    path = os.fspath(path)
    tmp = _tmp_name(path)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _write_on_rank0(path, rank, write):
    """``write(tmp)`` through :func:`atomic_path` on rank 0; the path there, else None."""
    if not _is_writer(rank):
        return None
    with atomic_path(path) as tmp:
        write(tmp)
    return os.fspath(path)


def write_hdf5(path, datasets, attrs=None, *, compression=None, rank=None):
    """Write an HDF5 file of datasets and file attributes (rank 0 only), atomically.

    Parameters
    ----------
    path : str or os.PathLike
    datasets : sequence of (name, array_like, dict)
        Datasets in creation order, each with its attributes (e.g. ``units``).
    attrs : dict, optional
        File attributes (strings, numbers or arrays).
    compression, rank : optional
        h5py compression filter of every dataset; this process's rank (as
        :func:`write_snapshot`).

    Returns
    -------
    str or None
        ``path`` on the writing rank (0), else ``None``.
    """
    import h5py

    from .collective import HDF5_OVERHEAD_BYTES, reserve_space

    def write(tmp):
        # A full disk fails here, cleanly, not in HDF5's close (see collective.reserve_space).
        reserve_space(tmp, HDF5_OVERHEAD_BYTES + sum(np.asarray(v).nbytes
                                                     for _, v, _ in datasets))
        with h5py.File(tmp, "w") as f:
            for name, value, dattrs in datasets:
                dset = f.create_dataset(name, data=value, compression=compression)
                for key, v in (dattrs or {}).items():
                    dset.attrs[key] = v
            for key, v in (attrs or {}).items():
                f.attrs[key] = v

    return _write_on_rank0(path, rank, write)


def write_table(path, columns, header, fmt="%.17g", rank=None):
    """Write text columns with a ``#`` header (rank 0 only), atomically.

    Parameters
    ----------
    path : str or os.PathLike
    columns : sequence of 1-d array_like
        Columns of equal length.
    header : str
        Header lines (each written after ``# ``).
    fmt : str or sequence of str
        ``numpy.savetxt`` format(s).
    rank : int, optional

    Returns
    -------
    str or None
        The path written, on rank 0; ``None`` elsewhere.
    """
    return _write_on_rank0(path, rank, lambda tmp: np.savetxt(
        tmp, np.column_stack(columns), header=header, fmt=fmt))


def write_json(path, obj, rank=None):
    """Write a JSON document (indent 1; numpy scalars as floats) on rank 0, atomically.

    Returns
    -------
    str or None
        The path written, on rank 0; ``None`` elsewhere.
    """
    def write(tmp):
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1, default=float)

    return _write_on_rank0(path, rank, write)


def write_summary(path, summary, rank=None):
    """Write a run's ``summary.json`` (the one summary writer; see :func:`write_json`).

    Parameters
    ----------
    path : str or os.PathLike
    summary : dict
        Configs, timings [s], peak memory per rank [MB], versions and the
        job's own results (JSON-able; numpy scalars are converted).
    rank : int, optional

    Returns
    -------
    str or None
    """
    return write_json(path, summary, rank=rank)


def write_snapshot(path, position=None, velocity=None, density=None, attrs=None, *,
                   units=None, compression=None, rank=None, ids=None):
    """Write a snapshot to an HDF5 file (on rank 0 only).

    Parameters
    ----------
    path : str or os.PathLike
        Output file; replaced if it exists.
    position : array_like, optional
        Particle positions [Mpc/h], shape [N, 3].
    velocity : array_like, optional
        Particle velocities, shape [N, 3] (same N as ``position``); units per
        ``units["velocity"]`` (default km/s).
    density : array_like, optional
        Density field, shape [NX, NY, NZ].
    attrs : dict or config object, optional
        Run configuration, stored as JSON in the ``config`` attribute (see
        :func:`to_jsonable`).
    units : dict, optional
        Overrides of :data:`DEFAULT_UNITS`.
    compression : str, optional
        h5py compression filter for the datasets (e.g. ``"gzip"``).
    rank : int, optional
        Rank of this process (default: from the launcher's environment).
    ids : array_like, optional
        Global particle ids (initial lattice index), shape [N]: dataset ``id``.

    Returns
    -------
    str or None
        The path written, on rank 0; ``None`` elsewhere.

    Raises
    ------
    ValueError
        On inconsistent shapes (checked on every rank, before writing).
    """
    data = {}
    if position is not None:
        data["position"] = np.asarray(position)
        if data["position"].ndim != 2 or data["position"].shape[1] != 3:
            raise ValueError("position must have shape [N, 3], got %s" % (data["position"].shape,))
    if velocity is not None:
        data["velocity"] = np.asarray(velocity)
        if data["velocity"].ndim != 2 or data["velocity"].shape[1] != 3:
            raise ValueError("velocity must have shape [N, 3], got %s" % (data["velocity"].shape,))
        if position is not None and data["velocity"].shape != data["position"].shape:
            raise ValueError("velocity shape %s differs from position shape %s"
                             % (data["velocity"].shape, data["position"].shape))
    if ids is not None:
        data["id"] = np.asarray(ids)
        if position is not None and data["id"].shape != data["position"].shape[:1]:
            raise ValueError("id shape %s does not match position shape %s"
                             % (data["id"].shape, data["position"].shape))
    if density is not None:
        data["density"] = np.asarray(density)
        if data["density"].ndim != 3:
            raise ValueError("density must be 3-d [NX, NY, NZ], got shape %s"
                             % (data["density"].shape,))
    all_units = dict(DEFAULT_UNITS, **(units or {}))
    config_json = json.dumps(to_jsonable(attrs if attrs is not None else {}), sort_keys=True)
    if not _is_writer(rank):
        return None

    vers = versions()
    attrs = {"format": SNAPSHOT_FORMAT, "config": config_json,
             "versions": json.dumps(vers, sort_keys=True)}
    attrs.update(("version." + key, value) for key, value in vers.items())
    path = write_hdf5(path, [(name, value, {"units": all_units[name]})
                             for name, value in data.items()], attrs, compression=compression,
                      rank=0)
    log.info("wrote snapshot %s (%s)", path,
             ", ".join("%s %s" % (k, v.shape) for k, v in data.items()) or "attributes only")
    return path


def read_snapshot(path):
    """Read a snapshot written by :func:`write_snapshot` or :func:`write_snapshot_distributed`.

    Parameters
    ----------
    path : str or os.PathLike

    Returns
    -------
    dict
        ``position``, ``velocity``, ``density``, ``id`` (ndarrays, or ``None`` when
        absent),
        ``config`` and ``versions`` (dicts decoded from JSON), ``units`` (dict of
        dataset -> units string) and ``attrs`` (all raw file attributes).
    """
    import h5py

    from . import h5dist

    out = {"position": None, "velocity": None, "density": None, "id": None, "units": {}}
    h5dist.check_sources(path)  # a distributed snapshot with a missing part is an error
    with h5py.File(os.fspath(path), "r") as f:
        for name in ("position", "velocity", "density", "id"):
            if name in f:
                out[name] = f[name][()]
                units = f[name].attrs.get("units")
                out["units"][name] = units.decode() if isinstance(units, bytes) else units
        attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in f.attrs.items()}
    out["attrs"] = attrs
    out["config"] = json.loads(attrs.get("config", "{}"))
    out["versions"] = json.loads(attrs.get("versions", "{}"))
    return out


def write_power(path, k, pk, modes=None, *, header=None, rank=None):
    """Write a power spectrum as text columns (on rank 0 only).

    Parameters
    ----------
    path : str or os.PathLike
        Output text file.
    k : array_like
        Wavenumbers [h/Mpc], 1-d.
    pk : array_like
        Power [(Mpc/h)^3], same length as ``k``.
    modes : array_like, optional
        Number of Fourier modes in each bin; the third column is left out if
        omitted.
    header : str or dict, optional
        Extra header text (a dict is written as JSON), e.g. the configuration.
    rank : int, optional
        Rank of this process (default: from the launcher's environment).
    ids : array_like, optional
        Global particle ids (initial lattice index), shape [N]: dataset ``id``.

    Returns
    -------
    str or None
        The path written, on rank 0; ``None`` elsewhere.
    """
    k = np.asarray(k, dtype=np.float64).ravel()
    pk = np.asarray(pk, dtype=np.float64).ravel()
    columns = [k, pk]
    names = "k [h/Mpc]  P(k) [(Mpc/h)^3]"
    if pk.shape != k.shape:
        raise ValueError("k and pk differ in length: %d, %d" % (k.size, pk.size))
    if modes is not None:
        modes = np.asarray(modes, dtype=np.float64).ravel()
        if modes.shape != k.shape:
            raise ValueError("k and modes differ in length: %d, %d" % (k.size, modes.size))
        columns.append(modes)
        names += "  modes"
    if not _is_writer(rank):
        return None
    lines = []
    if header is not None:
        text = header if isinstance(header, str) else json.dumps(to_jsonable(header),
                                                                  sort_keys=True)
        lines.extend(text.splitlines())
    lines.append("versions: " + json.dumps(versions(), sort_keys=True))
    lines.append(names)
    path = write_table(path, columns, "\n".join(lines), fmt="%.17g", rank=0)
    log.info("wrote power spectrum %s (%d bins)", path, k.size)
    return path


def read_power(path):
    """Read a file written by :func:`write_power`.

    Returns
    -------
    tuple
        ``(k [h/Mpc], pk [(Mpc/h)^3], modes or None, header lines)``.
    """
    header = []
    with open(os.fspath(path)) as f:
        for line in f:
            if not line.startswith("#"):
                break
            header.append(line[1:].strip())
    data = np.loadtxt(path, comments="#", ndmin=2)
    modes = data[:, 2] if data.shape[1] > 2 else None
    return data[:, 0], data[:, 1], modes, header


# ----------------------------------------------------------------------------- lensing
def write_kappa(path, comm, kappa, plane_parts, plane_k, plane_pk, conf, lconf, geom,
                gamma=None):
    """Write ``kappa.h5`` (collective over ``comm``: every rank writes its plane blocks).

    Datasets: ``kappa`` [n_source, npix, npix] (``kappa[s, i, j]`` at
    ``theta[i], theta[j]``), ``gamma1``, ``gamma2`` (same shape, the
    Kaiser-Squires shear, if ``gamma`` is given), ``theta`` [npix] [rad],
    ``planes`` [n_planes, NX,
    NY] (1 + delta; a virtual dataset over the per-rank blocks in
    ``kappa.parts/``, see :mod:`flowpm_mtf.runs.h5dist`: no rank gathers a plane),
    ``plane_k`` [n_planes, nbins] [h/Mpc], ``plane_pk`` [n_planes, nbins]
    [(Mpc/h)^3]. Attributes: ``format`` (:data:`KAPPA_FORMAT`), ``config``
    (SimConfig JSON), ``lensing`` (LensingConfig JSON), ``geometry`` (JSON),
    ``z_source``, ``sources`` (JSON list of the map labels: delta-function sources,
    then n(z) bins), ``field_deg``, ``plane_r`` [Mpc/h], ``versions``.

    Parameters
    ----------
    path : str or os.PathLike
    comm : object
        mpi4py-like communicator.
    kappa, plane_k, plane_pk : ndarray
        Small, replicated: written by rank 0.
    plane_parts : dict
        ``pnum -> h5dist.Block`` of the planes ``[n_planes, sx, sy]`` this
        process holds.
    conf : SimConfig
    lconf : lensing.LensingConfig
    geom : lensing.LightconeGeometry
    gamma : (ndarray, ndarray), optional
        Shear maps ``gamma1``, ``gamma2`` (shape of ``kappa``), small, replicated.

    Returns
    -------
    str
        ``path``, on every rank.
    """
    from . import h5dist

    attrs = {"format": KAPPA_FORMAT, "config": conf.to_json(),
             "lensing": json.dumps(lconf.to_dict(), sort_keys=True),
             "geometry": json.dumps(geom.to_dict(), sort_keys=True),
             "z_source": geom.z_source, "sources": json.dumps(list(geom.labels)),
             "field_deg": geom.field_deg, "plane_r": geom.r,
             "versions": json.dumps(versions(), sort_keys=True)}
    units = {"kappa": "dimensionless", "theta": "rad", "planes": "1 + delta (shell average)",
             "plane_k": "h/Mpc", "plane_pk": "(Mpc/h)^3"}
    small = {"kappa": kappa, "theta": geom.theta, "plane_k": plane_k, "plane_pk": plane_pk}
    if gamma is not None:
        small.update(gamma1=gamma[0], gamma2=gamma[1])
        units.update(gamma1="dimensionless", gamma2="dimensionless")
    return h5dist.write_distributed(
        path, comm, {p: {"planes": b} for p, b in plane_parts.items()}, attrs=attrs,
        dataset_attrs={k: {"units": v} for k, v in units.items()},
        small=small)


def write_kappa_power(path, ell, measured, pred, n_modes, geom, rank=None, labels=None):
    """Write ``kappa_power.txt`` (rank 0 only).

    Columns: ell, then per source the measured C_ell, the expected C_ell from the run's
    own P(k) through the run's windows (``C_ell_limber``), the Limber C_ell of the
    deconvolved P(k) without windows (``C_ell_limber_cont``), every further model in
    ``pred`` (e.g. ``C_ell_halofit``), and ``resolved`` (1 in the ell range the run
    resolves, :func:`flowpm_mtf.physics.lensing_theory.resolved_range`), then the number of
    modes per bin. The header gives the resolved range of each source.

    Parameters
    ----------
    ell, n_modes : ndarray
        Bins.
    measured : ndarray
        ``[n_source, n_bins]`` [sr].
    pred : dict
        :func:`flowpm_mtf.physics.lensing_theory.run_prediction` output; optional extra keys
        ``"extra": {name: [n_source, n_bins]}`` [sr].
    geom : lensing.LightconeGeometry
    labels : list of str, optional
        Map names (default ``geom.labels``: ``z_s=<z>``, ``bin<b>:<zlo>-<zhi>``).
    """
    labels = labels or list(geom.labels)
    cols, names, ranges = [ell], ["ell"], []
    extra = pred.get("extra", {})
    for s, lab in enumerate(labels):
        cols += [measured[s], pred["expected"][s], pred["continuous"][s]]
        names += ["C_ell(%s)" % lab, "C_ell_limber(%s)" % lab, "C_ell_limber_cont(%s)" % lab]
        for name, v in extra.items():
            cols.append(v[s])
            names.append("%s(%s)" % (name, lab))
        cols.append(pred["resolved"][s].astype(np.float64))
        names.append("resolved(%s)" % lab)
        lo, hi = pred["ell_range"][s]
        ranges.append("%s: %s" % (lab, "none" if np.isnan(lo) else "%.0f-%.0f" % (lo, hi)))
    cols.append(n_modes)
    names.append("modes")
    header = ("flat-sky C_ell [sr] of the Born convergence (field %g deg, %d pixels, %d planes); "
              "C_ell_limber: the expected measurement from the run's own P(k) through the "
              "plane painting, interpolation, ray sampling and taper windows; "
              "C_ell_limber_cont: Limber from the deconvolved P(k), no window; "
              "C_ell_halofit(_cont): the same from halofit (Takahashi 2012) P(k); resolved: the "
              "windows keep >= half of C_ell (ell range %s)\n%s"
              % (geom.field_deg, geom.npix, geom.n_planes, ", ".join(ranges), "  ".join(names)))
    return write_table(path, cols, header, fmt="%.10g", rank=rank)


# ----------------------------------------------------------------------------- reconstruction
def write_reconstruction(path, comm, conf, rconf, parts, history):
    """Write ``reconstruction.h5`` (collective over ``comm``: every rank writes its blocks).

    Parameters
    ----------
    path : str or os.PathLike
    comm : object
        mpi4py-like communicator.
    conf : SimConfig
    rconf : reconstruct.ReconConfig
    parts : dict
        ``pnum -> {"truth", "reconstruction", "observed": h5dist.Block}`` held by
        this process: linear density contrast at a = 1, and 1 + delta at
        ``a_end`` with noise; virtual datasets [NX, NY, NZ] over the per-rank
        blocks in ``reconstruction.parts/`` (:mod:`flowpm_mtf.runs.h5dist`).
    history : dict
        ``loss``, ``chi2``, ``prior``: one value per iteration (before each
        step) plus the final value (written by rank 0).

    Returns
    -------
    str
        ``path``, on every rank.
    """
    from . import h5dist

    units = {"truth": "linear density contrast at a=1",
             "reconstruction": "linear density contrast at a=1",
             "observed": "1 + delta at a_end (CIC), with noise"}
    dattrs = {n: {"units": u} for n, u in units.items()}
    dattrs["loss"] = {"description": "(chi2 + prior) / N before each iteration, then the "
                                     "final value"}
    return h5dist.write_distributed(
        path, comm, parts, dataset_attrs=dattrs,
        small={n: np.asarray(v, np.float64) for n, v in history.items()},
        attrs={"config": conf.to_json(), "reconstruction": json.dumps(rconf.to_dict()),
               "versions": json.dumps(versions())})


def write_reconstruction_table(path, conf, rconf, k, r, tk, modes, rank=None):
    """Write ``reconstruction.txt``: k [h/Mpc], r(k), T(k), modes (rank 0 only)."""
    header = ("flowpm-mtf reconstruct: cross-correlation r(k) = P_tr / sqrt(P_t P_r) and "
              "transfer function T(k) = sqrt(P_r / P_t) of the reconstructed (r) vs true "
              "(t) linear field\ncolumns: k [h/Mpc], r, T, modes\nconfig: %s\nsettings: %s"
              % (conf.to_json(), json.dumps(rconf.to_dict())))
    return write_table(path, [k, r, tk, modes], header, fmt=["%.6e", "%.6f", "%.6f", "%d"],
                       rank=rank)


def write_imaging(path, comm, configs, parts, loss):
    """Write ``imaging.h5`` of ``flowpm-mtf imaging`` (collective: every rank its blocks).

    Parameters
    ----------
    path : str or os.PathLike
    comm : object
        mpi4py-like communicator.
    configs : dict
        Section key -> config (``to_dict``), written as JSON attributes.
    parts : dict
        ``pnum -> {"truth", "zero_filled", "tv", "unrolled": h5dist.Block}`` held by
        this process (the methods run): magnitude images ``[NX, NY, NZ]``
        [phantom intensity], virtual datasets over the per-rank blocks in
        ``imaging.parts/`` (:mod:`flowpm_mtf.runs.h5dist`).
    loss : sequence of float
        The training loss per step (written by rank 0; may be empty).

    Returns
    -------
    str
        ``path``, on every rank.
    """
    from . import h5dist

    units = {"truth": "phantom intensity (the ground truth)",
             "zero_filled": "phantom intensity, |A^H y|",
             "tv": "phantom intensity, |x| of TV-ADMM",
             "unrolled": "phantom intensity, |x| of the trained unrolled network"}
    dattrs = {n: {"units": u} for n, u in units.items()}
    dattrs["train_loss"] = {"description": "mean |x - truth|^2 per training step, before it"}
    return h5dist.write_distributed(
        path, comm, parts, dataset_attrs=dattrs,
        small={"train_loss": np.asarray(loss, np.float64)},
        attrs={**{k: json.dumps(c.to_dict()) for k, c in configs.items()},
               "versions": json.dumps(versions())})


def write_markdown_table(path, header, rows, title=None, rank=None):
    """Write a Markdown table (rank 0 only), atomically.

    Parameters
    ----------
    path : str or os.PathLike
    header : sequence of str
        Column names.
    rows : sequence of sequence
        Cells (already formatted, or anything ``str`` accepts).
    title : str, optional
        Text written above the table.
    rank : int, optional

    Returns
    -------
    str or None
        The path written, on rank 0; ``None`` elsewhere.
    """
    lines = ([title, ""] if title else []) + [
        "| " + " | ".join(map(str, header)) + " |",
        "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]

    def write(tmp):
        with open(tmp, "w") as f:
            f.write("\n".join(lines) + "\n")

    return _write_on_rank0(path, rank, write)


# ============================================================================= distributed
# Snapshots written by every rank (its own slices) as one logical file; see
# flowpm_mtf.runs.h5dist for the layout (per-rank part files + HDF5 virtual datasets).

def lagrangian_ids(conf, block):
    """Global ids of the lattice particles of one block, in their in-block order.

    The id of a particle is its Lagrangian (initial lattice) index, row-major
    over the particle grid ``conf.nc``.

    Parameters
    ----------
    conf : SimConfig
    block : (int, int)
        Block index ``(bx, by)`` on the process grid.

    Returns
    -------
    ndarray
        int64 ``[sx * sy * nz]``.
    """
    sx, sy, nz = conf.block_shape
    _, ny, _ = conf.nc
    i = np.arange(sx, dtype=np.int64)[:, None, None] + block[0] * sx
    j = np.arange(sy, dtype=np.int64)[None, :, None] + block[1] * sy
    k = np.arange(nz, dtype=np.int64)[None, None, :]
    return ((i * ny + j) * nz + k).reshape(-1)


def particle_part(conf, block, positions, momenta, a, ids=None, valid=None, dtype=None):
    """Snapshot rows (Mpc/h, km/s, id) of one block's particles, in the run's dtype.

    Parameters
    ----------
    conf : SimConfig
    block : (int, int)
        Block index ``(bx, by)``.
    positions, momenta : array_like
        ``[..., 3]`` block-local positions [cells] and canonical momenta
        ``p = a^3 E dx/da`` [cells] (H0 = 1) of the block's particles.
    a : float
        Scale factor of the state.
    ids : array_like, optional
        Particle ids (default: :func:`lagrangian_ids`, the particles in lattice
        order).
    valid : array_like of bool, optional
        Mask of the particles to keep (fixed-capacity buffers).
    dtype : dtype, optional
        Of the positions and velocities written (default ``conf.dtype``: a
        float32 run writes float32, computed in float32 from its float32 state,
        within an ulp of the float64 conversion; a float64 run float64).

    Returns
    -------
    dict
        ``position`` [n, 3] in [0, box) [Mpc/h], ``velocity`` [n, 3] peculiar
        [km/s] (``v = H0 p / a``), ``id`` [n] int64, as :class:`h5dist.Rows`
        converted piece by piece while they are written (no converted or
        masked copy of this rank's whole share).
    """
    from . import h5dist

    dtype = np.dtype(conf.dtype if dtype is None else dtype)
    cell = np.asarray(conf.cell_size, np.float64)
    origin = np.array([block[0] * conf.block_shape[0], block[1] * conf.block_shape[1], 0],
                      np.float64)
    x = np.asarray(positions).reshape(-1, 3)
    p = np.asarray(momenta).reshape(-1, 3)
    ids = lagrangian_ids(conf, block) if ids is None else np.asarray(ids).reshape(-1)
    keep = None if valid is None else np.asarray(valid, bool).reshape(-1)
    box = np.asarray(conf.box_size, np.float64).astype(dtype)
    box_min, box_out = box.min(), _PerAxis(box)
    single = dtype == np.float32
    cell_out, shift_out = _PerAxis(cell.astype(dtype)), _PerAxis((origin * cell).astype(dtype))
    origin64, cell64 = _PerAxis(origin), _PerAxis(cell)
    vel_out, vel64 = _PerAxis((cell * (100.0 / a)).astype(dtype)), _PerAxis(cell * (100.0 / a))

    def position(rows):  # block-local cells -> Mpc/h in [0, box)
        if single and rows.dtype == np.float32:   # in the run's precision (< 1 ulp more)
            out = cell_out.times(rows)
            shift_out.add_to(out)
        else:
            out = rows.astype(np.float64)
            origin64.add_to(out)
            cell64.multiply(out)
            out = out.astype(dtype, copy=False)
        if out.size == 0 or (out.min() >= 0 and out.max() < box_min):
            return out      # every particle in the box: two flat reductions
        box_out.wrap(out)   # particles across the periodic edge
        return out

    def velocity(rows):  # canonical momentum [cells] -> peculiar velocity [km/s]
        if single and rows.dtype == np.float32:
            return vel_out.times(rows)
        return vel64.times(rows.astype(np.float64)).astype(dtype, copy=False)

    return {"position": h5dist.Rows(x, position, dtype, keep=keep),
            "velocity": h5dist.Rows(p, velocity, dtype, keep=keep),
            "id": h5dist.Rows(ids, None, np.int64, keep=keep)}


class _PerAxis:
    """A constant per axis of ``[n, 3]`` rows, applied over the flat rows.

    ``rows * v`` with ``v`` of shape ``[3]`` makes numpy's inner loop three
    elements long (an order of magnitude below memory speed); the same products
    over the flat rows with ``v`` tiled (or a scalar when the three are equal)
    run at memory speed. Equal values element by element.
    """

    def __init__(self, v):
        self.v = np.asarray(v)
        self.zero = not self.v.any()
        self.scalar = self.v.dtype.type(self.v[0]) if np.all(self.v == self.v[0]) else None
        self._tile = self.v[:0]

    def _flat(self, n):
        if self.scalar is not None:
            return self.scalar
        if self._tile.size < n:
            self._tile = np.tile(self.v, -(-n // 3))
        return self._tile[:n]

    def times(self, rows):
        """``rows * v`` (new array)."""
        rows = np.ascontiguousarray(rows)
        return np.multiply(rows.reshape(-1), self._flat(rows.size)).reshape(rows.shape)

    def multiply(self, out):
        """``out *= v`` (``out`` contiguous)."""
        np.multiply(out.reshape(-1), self._flat(out.size), out=out.reshape(-1))

    def add_to(self, out):
        """``out += v`` (``out`` contiguous; nothing for a zero ``v``)."""
        if not self.zero:
            np.add(out.reshape(-1), self._flat(out.size), out=out.reshape(-1))

    def wrap(self, out):
        """``out`` into ``[0, v)`` periodically, in place (``out`` contiguous, ``v`` > 0).

        The values of ``np.mod(out, v)`` (in range: unchanged; one rounding for the
        others), computed as ``out - v floor(out / v)`` over the flat rows: four
        unmasked passes, several times faster than numpy's ``mod`` or its
        masked loops. Where ``out / v`` rounds up to the next integer, or a value
        just below 0 rounds up to ``v`` when shifted (its image is 0), a masked
        pass puts it back, only in the pieces that have one.
        """
        flat = out.reshape(-1)
        v = self._flat(flat.size)
        turns = np.divide(flat, v)
        np.floor(turns, out=turns)
        np.multiply(turns, v, out=turns)
        np.subtract(flat, turns, out=flat)
        if flat.size and flat.min() < 0:
            np.add(flat, v, out=flat, where=flat < 0)
        if flat.size and (flat >= v).any():
            np.subtract(flat, v, out=flat, where=flat >= v)


def write_snapshot_distributed(path, comm, parts, attrs=None, *, units=None, compression=None,
                               stats=None):
    """Write a snapshot from every rank's slices (collective over ``comm``).

    The result opens with plain h5py exactly as a :func:`write_snapshot` file
    (plus the ``id`` dataset); see :mod:`flowpm_mtf.runs.h5dist`.

    Parameters
    ----------
    path : str or os.PathLike
    comm : object
        mpi4py-like communicator (``flowpm_mtf.backend.SerialComm`` in one process).
    parts : dict
        ``pnum -> {"position", "velocity", "id": h5dist.Rows, "density": h5dist.Block}``
        for the slices this process holds (see :func:`particle_part`).
    attrs : dict or config object, optional
        Stored as JSON in the ``config`` attribute.
    units : dict, optional
        Overrides of :data:`DEFAULT_UNITS`.
    compression : {None, "gzip", "lzf"}
        Of the part files (:func:`flowpm_mtf.runs.h5dist.write_distributed`; default none).
    stats : dict, optional
        Filled with the bytes, files and seconds of the write
        (:func:`flowpm_mtf.runs.h5dist.write_distributed`).

    Returns
    -------
    str
        ``path`` on every rank.
    """
    from . import h5dist

    all_units = dict(DEFAULT_UNITS, **(units or {}))
    vers = versions()
    file_attrs = {"format": SNAPSHOT_FORMAT,
                  "config": json.dumps(to_jsonable(attrs if attrs is not None else {}),
                                       sort_keys=True),
                  "versions": json.dumps(vers, sort_keys=True)}
    file_attrs.update({"version." + k: v for k, v in vers.items()})
    names = set()
    for items in parts.values():
        names.update(items)
    return h5dist.write_distributed(path, comm, parts, attrs=file_attrs,
                                    dataset_attrs={n: {"units": all_units[n]} for n in names
                                                   if n in all_units},
                                    compression=compression, stats=stats)
