"""The one atomic-write path, the rank-0 writers built on it, and what every output records.

Plain, serial h5py: the caller gathers the arrays (e.g. with
``lowering.export_to_tf_tensor``) and **rank 0 writes**; on other ranks the
writers return ``None`` without touching the file system. Every file is
written through :func:`atomic_path` (a temporary name in the same directory,
renamed when complete and removed on failure), so a reader never sees a
half-written file.

Generic building blocks of every format (:mod:`flowpm_mtf.runs.io`):
:func:`write_hdf5` (datasets with attributes), :func:`write_table` (text
columns), :func:`write_json`, :func:`write_markdown_table`; and the records every
output carries: the package versions (:func:`versions`) and the configuration as
JSON (:func:`to_jsonable`).
"""
import contextlib
import dataclasses
import importlib.metadata
import json
import os
import platform
import sys

import numpy as np

from ..logs import detect_rank

__all__ = ["versions", "to_jsonable", "fsync_path", "atomic_path", "write_hdf5", "write_table",
           "write_json", "write_markdown_table"]

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
