"""Snapshots (HDF5) and power spectra (text) on disk.

Plain, serial h5py: the caller gathers the arrays (e.g. with
``lowering.export_to_tf_tensor``) and **rank 0 writes**; on other ranks the
writers return ``None`` without touching the file system. Files are written to
a temporary name and renamed, so a reader never sees a half-written file.

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
import dataclasses
import importlib.metadata
import json
import logging
import os
import platform
import sys

import numpy as np

from .logs import detect_rank

__all__ = ["SNAPSHOT_FORMAT", "DEFAULT_UNITS", "versions", "to_jsonable", "write_snapshot",
           "read_snapshot", "write_power", "read_power"]

log = logging.getLogger(__name__)

#: Value of the ``format`` attribute of the snapshots written here.
SNAPSHOT_FORMAT = "flowpm_mtf.snapshot/1"
#: Units recorded for each dataset unless the caller overrides them.
DEFAULT_UNITS = {"position": "Mpc/h", "velocity": "km/s", "id": "initial lattice index",
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
    import h5py

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

    path = os.fspath(path)
    tmp = _tmp_name(path)
    vers = versions()
    try:
        with h5py.File(tmp, "w") as f:
            for name, value in data.items():
                dset = f.create_dataset(name, data=value, compression=compression)
                dset.attrs["units"] = all_units[name]
            f.attrs["format"] = SNAPSHOT_FORMAT
            f.attrs["config"] = config_json
            f.attrs["versions"] = json.dumps(vers, sort_keys=True)
            for key, value in vers.items():
                f.attrs["version." + key] = value
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
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
        ``position``, ``velocity``, ``id``, ``density`` (ndarrays, or ``None`` when absent),
        ``config`` and ``versions`` (dicts decoded from JSON), ``units`` (dict of
        dataset -> units string) and ``attrs`` (all raw file attributes).
    """
    import h5py

    out = {"position": None, "velocity": None, "id": None, "density": None, "units": {}}
    with h5py.File(os.fspath(path), "r") as f:
        for name in ("position", "velocity", "id", "density"):
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
    path = os.fspath(path)
    tmp = _tmp_name(path)
    try:
        np.savetxt(tmp, np.column_stack(columns), header="\n".join(lines), fmt="%.17g")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
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
