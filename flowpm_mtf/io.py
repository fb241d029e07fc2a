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

from .logs import detect_rank

__all__ = ["SNAPSHOT_FORMAT", "KAPPA_FORMAT", "DEFAULT_UNITS", "versions", "to_jsonable",
           "atomic_path", "write_hdf5", "write_table", "write_json", "write_summary",
           "write_snapshot", "read_snapshot", "write_power", "read_power", "write_kappa",
           "write_kappa_power", "write_reconstruction", "write_reconstruction_table"]

log = logging.getLogger(__name__)

#: Value of the ``format`` attribute of the snapshots written here.
SNAPSHOT_FORMAT = "flowpm_mtf.snapshot/1"
#: Value of the ``format`` attribute of ``kappa.h5``.
KAPPA_FORMAT = "flowpm_mtf.kappa/1"
#: Units recorded for each dataset unless the caller overrides them.
DEFAULT_UNITS = {"position": "Mpc/h", "velocity": "km/s",
                 "density": "dimensionless (rho / mean rho)"}

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
    """
    path = os.fspath(path)
    tmp = _tmp_name(path)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_hdf5(path, datasets, attrs=None, *, compression=None, rank=None):
    """Write an HDF5 file of datasets and file attributes (rank 0 only), atomically.

    Parameters
    ----------
    path : str or os.PathLike
    datasets : sequence of (name, array_like, dict)
        Datasets in creation order, each with its attributes (e.g. ``units``).
    attrs : dict, optional
        File attributes (strings, numbers or arrays).
    compression : str, optional
        h5py compression filter for the datasets.
    rank : int, optional
        Rank of this process (default: from the launcher's environment).

    Returns
    -------
    str or None
        The path written, on rank 0; ``None`` elsewhere.
    """
    import h5py

    if not _is_writer(rank):
        return None
    with atomic_path(path) as tmp:
        with h5py.File(tmp, "w") as f:
            for name, value, dattrs in datasets:
                dset = f.create_dataset(name, data=value, compression=compression)
                for key, v in (dattrs or {}).items():
                    dset.attrs[key] = v
            for key, v in (attrs or {}).items():
                f.attrs[key] = v
    return os.fspath(path)


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
    if not _is_writer(rank):
        return None
    with atomic_path(path) as tmp:
        np.savetxt(tmp, np.column_stack(columns), header=header, fmt=fmt)
    return os.fspath(path)


def write_json(path, obj, rank=None):
    """Write a JSON document (indent 1; numpy scalars as floats) on rank 0, atomically.

    Returns
    -------
    str or None
        The path written, on rank 0; ``None`` elsewhere.
    """
    if not _is_writer(rank):
        return None
    with atomic_path(path) as tmp:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1, default=float)
    return os.fspath(path)


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
                   units=None, compression=None, rank=None):
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
    """Read a snapshot written by :func:`write_snapshot`.

    Parameters
    ----------
    path : str or os.PathLike

    Returns
    -------
    dict
        ``position``, ``velocity``, ``density`` (ndarrays, or ``None`` when absent),
        ``config`` and ``versions`` (dicts decoded from JSON), ``units`` (dict of
        dataset -> units string) and ``attrs`` (all raw file attributes).
    """
    import h5py

    out = {"position": None, "velocity": None, "density": None, "units": {}}
    with h5py.File(os.fspath(path), "r") as f:
        for name in ("position", "velocity", "density"):
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
def write_kappa(path, kappa, planes, plane_k, plane_pk, conf, lconf, geom, rank=None):
    """Write ``kappa.h5`` (rank 0 only).

    Datasets: ``kappa`` [n_source, npix, npix] (``kappa[s, i, j]`` at
    ``theta[i], theta[j]``), ``theta`` [npix] [rad], ``planes`` [n_planes, NX,
    NY] (1 + delta), ``plane_k`` [n_planes, nbins] [h/Mpc], ``plane_pk``
    [n_planes, nbins] [(Mpc/h)^3]. Attributes: ``format``
    (:data:`KAPPA_FORMAT`), ``config`` (SimConfig JSON), ``lensing``
    (LensingConfig JSON), ``geometry`` (JSON), ``z_source``, ``field_deg``,
    ``plane_r`` [Mpc/h], ``versions``.

    Parameters
    ----------
    path : str or os.PathLike
    kappa, planes, plane_k, plane_pk : ndarray
    conf : SimConfig
    lconf : lensing.LensingConfig
    geom : lensing.LightconeGeometry
    rank : int, optional

    Returns
    -------
    str or None
    """
    datasets = [("kappa", kappa, {"units": "dimensionless"}),
                ("theta", geom.theta, {"units": "rad"}),
                ("planes", planes, {"units": "1 + delta (shell average)"}),
                ("plane_k", plane_k, {"units": "h/Mpc"}),
                ("plane_pk", plane_pk, {"units": "(Mpc/h)^3"})]
    attrs = {"format": KAPPA_FORMAT, "config": conf.to_json(),
             "lensing": json.dumps(lconf.to_dict(), sort_keys=True),
             "geometry": json.dumps(geom.to_dict(), sort_keys=True),
             "z_source": geom.z_source, "field_deg": geom.field_deg, "plane_r": geom.r,
             "versions": json.dumps(versions(), sort_keys=True)}
    return write_hdf5(path, datasets, attrs, rank=rank)


def write_kappa_power(path, ell, measured, limber, n_modes, geom, rank=None):
    """Write ``kappa_power.txt``: ell, per source the measured C_ell and the Limber
    prediction [sr], then the number of modes per bin (rank 0 only)."""
    cols, names = [ell], ["ell"]
    for s, z in enumerate(geom.z_source):
        cols += [measured[s], limber[s]]
        names += ["C_ell(z_s=%g)" % z, "C_ell_limber(z_s=%g)" % z]
    cols.append(n_modes)
    names.append("modes")
    header = ("flat-sky C_ell [sr] of the Born convergence (field %g deg, %d pixels) and the "
              "Limber prediction from the simulation's P(k) at the %d plane redshifts\n%s"
              % (geom.field_deg, geom.npix, geom.n_planes, "  ".join(names)))
    return write_table(path, cols, header, fmt="%.10g", rank=rank)


# ----------------------------------------------------------------------------- reconstruction
def write_reconstruction(path, conf, rconf, fields, history, rank=None):
    """Write ``reconstruction.h5`` (rank 0 only).

    Parameters
    ----------
    path : str or os.PathLike
    conf : SimConfig
    rconf : reconstruct.ReconConfig
    fields : dict
        ``truth``, ``reconstruction`` (linear density contrast at a = 1) and
        ``observed`` (1 + delta at ``a_end``, with noise), each [NX, NY, NZ].
    history : dict
        ``loss``, ``chi2``, ``prior``: one value per iteration (before each
        step) plus the final value.
    rank : int, optional

    Returns
    -------
    str or None
    """
    units = {"truth": "linear density contrast at a=1",
             "reconstruction": "linear density contrast at a=1",
             "observed": "1 + delta at a_end (CIC), with noise"}
    datasets = [(n, fields[n], {"units": units[n]}) for n in ("truth", "reconstruction",
                                                               "observed")]
    for n, v in history.items():
        datasets.append((n, np.asarray(v, np.float64), {} if n != "loss" else {
            "description": "(chi2 + prior) / N before each iteration, then the final value"}))
    attrs = {"config": conf.to_json(), "reconstruction": json.dumps(rconf.to_dict()),
             "versions": json.dumps(versions())}
    return write_hdf5(path, datasets, attrs, rank=rank)


def write_reconstruction_table(path, conf, rconf, k, r, tk, modes, rank=None):
    """Write ``reconstruction.txt``: k [h/Mpc], r(k), T(k), modes (rank 0 only)."""
    header = ("flowpm-mtf reconstruct: cross-correlation r(k) = P_tr / sqrt(P_t P_r) and "
              "transfer function T(k) = sqrt(P_r / P_t) of the reconstructed (r) vs true "
              "(t) linear field\ncolumns: k [h/Mpc], r, T, modes\nconfig: %s\nsettings: %s"
              % (conf.to_json(), json.dumps(rconf.to_dict())))
    return write_table(path, [k, r, tk, modes], header, fmt=["%.6e", "%.6f", "%.6f", "%d"],
                       rank=rank)
