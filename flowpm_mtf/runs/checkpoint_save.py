"""Writing a checkpoint atomically (collective), with the outputs written before it.

A checkpoint is written into ``.tmp-step_NNNNNN/`` (every rank its part
files, by the snapshots' writer: space reserved first, data written with
``O_DIRECT`` where the file system allows it, hashed while written and
fsynced, see :mod:`flowpm_mtf.runs.h5dist`; rank 0 then links the outputs the run
has staged so far into ``outputs/`` and writes ``manifest.json`` with the step
index, scale factor, config, process grid, the job's identity
(:func:`flowpm_mtf.runs.checkpoint_identity.identity`) and the size and digest
(:mod:`flowpm_mtf.runs.digest`) of every part and output file, fsyncs and renames
the directory to ``step_NNNNNN``). Only then are older checkpoints
removed (the newest ``keep`` survive), so a crash at any moment leaves the
previous checkpoint intact. The layout, the manifest and the part files:
:mod:`flowpm_mtf.runs.checkpoint_identity`.

Outputs written before the checkpoint
-------------------------------------
Files a job writes during its time loop (snapshots, P(k) per step) go to the
run directory's staging area; every checkpoint holds hard links (copies where
links are impossible) of all of them, with size and digest, and a resumed run
puts them back into its staging area
(:func:`flowpm_mtf.runs.checkpoint_load.restore_outputs`) before it continues, so it
publishes the same files as an uninterrupted run. Writers
replace files by rename (:func:`flowpm_mtf.runs.writers.atomic_path`, ``h5dist``), never
in place, so a link in a checkpoint never changes afterwards.
"""
import json
import logging
import os
import re
import shutil

import numpy as np

from . import digest
from .checkpoint_identity import (FIELDS_GROUP, FORMAT, OUTPUTS_DIR, STATE_NAMES, _part_name,
                                  _step_dirs, checkpoint_root, read_manifest, step_dir)
from .collective import _agree, collective
from .h5dist_part import _write_h5, known_digest
from .writers import fsync_path

__all__ = ["save"]

log = logging.getLogger(__name__)

# Temporary files of the writers (``<file>.tmp-<pid>``, ``*.tmp``): never part of a checkpoint.
_TMP_RE = re.compile(r"\.tmp-\d+$|\.tmp$")


def save(out_dir, comm, step, a, config, parts, *, grid, ident, outputs_dir=None, keep=2,
         extra=None, fields=None):
    """Write a checkpoint atomically (collective over ``comm``).

    Parameters
    ----------
    out_dir : str
        The run directory OUT.
    comm : object
        mpi4py-like communicator.
    step : int
        Number of completed N-body steps (or iterations).
    a : float or None
        Scale factor of the state (None: a loop that is no time integration).
    config : dict
        The run's configuration (``SimConfig.to_dict()``).
    parts : dict
        ``pnum -> {"block": (bx, by), "origin": [3], "id": [n], "positions",
        "momenta", "forces": arrays}`` for the slices this process holds
        (empty for a job without particles).
    grid : tuple of int
        The process grid of the run.
    ident : dict
        :func:`identity` of the run (job, state config, stages, hash).
    outputs_dir : str, optional
        The run's staging area: every file in it (the outputs written so far)
        is linked into the checkpoint's ``outputs/`` (rank 0; the writers have
        finished, this call being collective).
    keep : int
        Number of complete checkpoints kept (older ones are removed after the
        new one is complete; at least 1).
    extra : dict, optional
        More JSON-able fields for the manifest.
    fields : dict, optional
        ``pnum -> {name: (array, begin)}``: this process's slices of the
        job's distributed fields besides the particles (e.g. lens planes, the
        optimiser's variables; a replicated scalar has ``begin == ()``), each
        with the index of its first element in the global field. Written into
        the part file of ``pnum`` as the dataset ``fields/<name>`` (attribute
        ``begin``); never gathered.

    Returns
    -------
    str
        The checkpoint directory, on every rank.
    """
    fields = fields or {}

    final = step_dir(out_dir, step)
    tmp = os.path.join(checkpoint_root(out_dir), ".tmp-" + os.path.basename(final))
    error = None
    if comm.rank == 0:
        try:
            if os.path.exists(tmp):
                shutil.rmtree(tmp)  # a torn attempt of an earlier run
            os.makedirs(tmp)
        except OSError as exc:
            error = "%s: %s" % (type(exc).__name__, exc)
    _agree(comm, error, "creating checkpoint directory %s" % tmp)
    def write_parts():
        files = {}
        for pnum in sorted(set(parts) | set(fields)):
            arrays = parts.get(pnum)
            mine = {name: (np.asarray(v), tuple(int(b) for b in begin))
                    for name, (v, begin) in fields.get(pnum, {}).items()}
            name = _part_name(pnum)
            path = os.path.join(tmp, name)
            # One writer for all part files (h5dist_part._write_h5): the space is reserved first
            # (a full disk fails cleanly, not inside HDF5's close), the data are written with
            # O_DIRECT past HDF5 and hashed while written (no second read of the file).
            datasets, dattrs = {}, {}
            if arrays is not None:
                for key in ("id",) + STATE_NAMES:
                    datasets[key] = np.asarray(arrays[key])
            for fname, (value, begin) in sorted(mine.items()):
                datasets[FIELDS_GROUP + "/" + fname] = value
                dattrs[FIELDS_GROUP + "/" + fname] = {"begin": np.asarray(begin, np.int64)}
            fattrs = {}
            if arrays is not None:
                fattrs["block"] = np.asarray(arrays["block"], np.int64)
                fattrs["origin"] = np.asarray(arrays["origin"], np.float64)
            fattrs.update(pnum=int(pnum), step=int(step))
            written = _write_h5(path, datasets, fattrs, dattrs)
            files[name] = {"pnum": int(pnum), "size": int(written["size"]),
                           digest.DIGEST: written["digest"]}
            if arrays is not None:
                files[name].update({
                    "block": [int(b) for b in arrays["block"]],
                    "n": int((np.asarray(arrays["id"]) >= 0).sum()),  # valid slots
                    "slots": int(np.asarray(arrays["id"]).size),
                    "xy_range": _xy_range(arrays)})
            if mine:
                files[name]["fields"] = {
                    fname: {"begin": list(begin), "shape": [int(n) for n in value.shape],
                            "dtype": str(value.dtype)}
                    for fname, (value, begin) in sorted(mine.items())}
        return files

    def publish(all_files):
        manifest = {"format": FORMAT, "step": int(step),
                    "a": None if a is None else float(a),
                    "config": config, "grid": [int(g) for g in grid],
                    "files": all_files,
                    "n_particles": sum(v.get("n", 0) for v in all_files.values()),
                    "fields": sorted({n for v in all_files.values() for n in v.get("fields", {})}),
                    "outputs": {}}
        manifest.update(extra or {})
        manifest.update(ident)
        if outputs_dir is not None:
            previous = next((m for m in map(read_manifest, _step_dirs(out_dir)) if m), {})
            manifest["outputs"] = _capture_outputs(outputs_dir, os.path.join(tmp, OUTPUTS_DIR),
                                                   previous.get("outputs", {}))
        mpath = os.path.join(tmp, "manifest.json")
        with open(mpath, "w") as fh:
            json.dump(manifest, fh, indent=1, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        fsync_path(tmp)
        if os.path.exists(final):  # the same step written again (e.g. after a resume)
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_path(checkpoint_root(out_dir))
        for old in _step_dirs(out_dir)[max(1, int(keep)):]:
            shutil.rmtree(old, ignore_errors=True)

    collective(comm, write_parts, publish, "writing checkpoint %s" % final)
    log.info("checkpoint after %s %d%s written to %s", "iteration" if a is None else "step",
             step, "" if a is None else " (a=%.4f)" % a, final)
    return final


def _link_or_copy(src, dst):
    """Hard-link ``src`` to ``dst`` (a copy where the file system has no links)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _file_key(path):
    st = os.stat(path)
    return [int(st.st_dev), int(st.st_ino), int(st.st_size), int(st.st_mtime_ns)]


def _capture_outputs(src, dest, previous):
    """Link every output file under ``src`` into ``dest``; their records for the manifest.

    Parameters
    ----------
    src : str
        The staging area (dot files and temporary ``*.tmp-<pid>`` files skipped).
    dest : str
        ``<checkpoint>/outputs``.
    previous : dict
        The ``outputs`` of the newest earlier checkpoint: a file that is still
        the same inode, size and mtime keeps its recorded digest (outputs are
        replaced by rename, never changed in place), so a snapshot is hashed
        once, not at every checkpoint.

    Returns
    -------
    dict
        Relative path -> ``{"size", "blake3", "key"}`` (:data:`flowpm_mtf.runs.digest.DIGEST`).
    """
    files = {}
    if not os.path.isdir(src):
        return files
    for root, dirs, names in os.walk(src):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            if name.startswith(".") or _TMP_RE.search(name):
                continue
            path = os.path.join(root, name)
            rel = os.path.relpath(path, src)
            target = os.path.join(dest, rel)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            _link_or_copy(path, target)
            key = _file_key(target)
            old = previous.get(rel)
            hexdigest = (old[digest.DIGEST] if old is not None and old.get("key") == key
                         and digest.DIGEST in old
                         else known_digest(path) or digest.file_digest(target))
            files[rel] = {"size": key[2], digest.DIGEST: hexdigest, "key": key}
    return files



def _xy_range(arrays):
    """``[[x_min, x_max], [y_min, y_max]]`` [cells] of the valid particles of a part (unwrapped).

    Global positions (block origin + block-local position) before wrapping into
    the box; ``None`` for a part without particles. Stored per part file in the
    manifest so that re-slicing reads only the parts that can hold particles of
    a block (:func:`_may_overlap`).
    """
    ids = np.asarray(arrays["id"]).reshape(-1)
    valid = ids >= 0
    if not valid.any():
        return None
    pos = np.asarray(arrays["positions"]).reshape(-1, 3)[valid, :2].astype(np.float64)
    pos += np.asarray(arrays["origin"], np.float64)[:2]
    return [[float(pos[:, d].min()), float(pos[:, d].max())] for d in range(2)]

