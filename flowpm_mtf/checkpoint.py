"""Checkpoints of the particle state (every rank its slices), restart, and SIGTERM handling.

Layout (``OUT/checkpoint/``)
----------------------------
::

    OUT/checkpoint/step_000004/manifest.json     written last, before the rename
    OUT/checkpoint/step_000004/rank00000.h5      one file per slice (processor number)
    OUT/checkpoint/step_000004/rank00001.h5
    OUT/checkpoint/.tmp-step_000006/             a checkpoint being written (or torn)

A checkpoint is written into ``.tmp-step_NNNNNN/`` (every rank its part
files; rank 0 then writes ``manifest.json`` with the step index, scale factor,
config, process grid and the size and SHA-256 of every part file, fsyncs and
renames the directory to ``step_NNNNNN``). Only then are older checkpoints
removed (the newest ``keep`` survive), so a crash at any moment leaves the
previous checkpoint intact. A directory is *valid* when its manifest parses and
names this format and every part file exists with the recorded size; the
readers also verify the checksums of the files they read, and all ranks agree
on the newest checkpoint that passed everywhere (a torn or corrupted one is
skipped with a warning, falling back to the previous one).

Part files (plain HDF5): the raw slices of the state variables (``positions``
block-local [cells], ``momenta`` and ``forces`` [cells], dtype of the run, shape
``[1, 1, npart, 3]``), the particles' global ``id`` (Lagrangian index), and
attributes ``block`` (bx, by), ``origin`` [cells] and ``pnum``. Because every
particle carries its id and the block origin is stored, the state can be
re-sliced for another process grid: the same grid restores the slices bit for
bit; another grid places every particle by id into the block that now owns it
(its Lagrangian block; positions are re-expressed relative to the new block
origin in float64), which changes results only at float round-off.

SIGTERM
-------
:class:`StopRequest` records SIGTERM (what Slurm sends before the time limit,
also ``scancel --signal=TERM``) and :meth:`StopRequest.agreed` makes all ranks
agree at a step boundary (one small allreduce): the signal may reach only some
ranks, or at different times, but every rank sees the same answer at the same
step, finishes that step, writes the checkpoint and exits 0.
"""
import glob
import hashlib
import json
import logging
import os
import shutil
import signal

import numpy as np

from .errors import ResumeError
from .h5dist import _agree, collective

__all__ = ["CHECKPOINT_DIR", "FORMAT", "checkpoint_root", "step_dir", "save", "candidates",
           "read_manifest", "load", "StopRequest", "check_resume_config", "resume_command"]

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoint"
FORMAT = "flowpm_mtf.checkpoint/1"
STATE_NAMES = ("positions", "momenta", "forces")
#: Config fields that may differ between a checkpoint and its resumed run.
RESLICEABLE_FIELDS = ("grid",)


def checkpoint_root(out_dir):
    """``OUT/checkpoint``."""
    return os.path.join(os.fspath(out_dir), CHECKPOINT_DIR)


def step_dir(out_dir, step):
    """``OUT/checkpoint/step_NNNNNN``."""
    return os.path.join(checkpoint_root(out_dir), "step_%06d" % step)


def _part_name(pnum):
    return "rank%05d.h5" % pnum


def _sha256(path, chunk=1 << 22):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path):
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


# ----------------------------------------------------------------------------- saving
def save(out_dir, comm, step, a, config, parts, *, grid, keep=2, extra=None):
    """Write a checkpoint atomically (collective over ``comm``).

    Parameters
    ----------
    out_dir : str
        The run directory OUT.
    comm : object
        mpi4py-like communicator.
    step : int
        Number of completed N-body steps.
    a : float
        Scale factor of the state.
    config : dict
        The run's configuration (``SimConfig.to_dict()``).
    parts : dict
        ``pnum -> {"block": (bx, by), "origin": [3], "id": [n], "positions",
        "momenta", "forces": arrays}`` for the slices this process holds.
    grid : tuple of int
        The process grid of the run.
    keep : int
        Number of complete checkpoints kept (older ones are removed after the
        new one is complete; at least 1).
    extra : dict, optional
        More JSON-able fields for the manifest.

    Returns
    -------
    str
        The checkpoint directory, on every rank.
    """
    import h5py

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
        for pnum, arrays in parts.items():
            name = _part_name(pnum)
            path = os.path.join(tmp, name)
            with h5py.File(path, "w") as f:
                for key in ("id",) + STATE_NAMES:
                    f.create_dataset(key, data=np.asarray(arrays[key]))
                f.attrs["block"] = np.asarray(arrays["block"], np.int64)
                f.attrs["origin"] = np.asarray(arrays["origin"], np.float64)
                f.attrs["pnum"] = int(pnum)
                f.attrs["step"] = int(step)
            with open(path, "rb+") as fh:
                os.fsync(fh.fileno())
            files[name] = {"pnum": int(pnum), "block": [int(b) for b in arrays["block"]],
                           "n": int(np.asarray(arrays["id"]).size),
                           "size": os.path.getsize(path), "sha256": _sha256(path)}
        return files

    def publish(all_files):
        manifest = {"format": FORMAT, "step": int(step), "a": float(a),
                    "config": config, "grid": [int(g) for g in grid],
                    "files": all_files, "n_particles": sum(v["n"] for v in all_files.values())}
        manifest.update(extra or {})
        mpath = os.path.join(tmp, "manifest.json")
        with open(mpath, "w") as fh:
            json.dump(manifest, fh, indent=1, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        _fsync_dir(tmp)
        if os.path.exists(final):  # the same step written again (e.g. after a resume)
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(checkpoint_root(out_dir))
        for old in _step_dirs(out_dir)[max(1, int(keep)):]:
            shutil.rmtree(old, ignore_errors=True)

    collective(comm, write_parts, publish, "writing checkpoint %s" % final)
    log.info("checkpoint after step %d (a=%.4f) written to %s", step, a, final)
    return final


# ----------------------------------------------------------------------------- finding
def _step_dirs(out_dir):
    """``step_*`` directories, newest first."""
    dirs = []
    for d in glob.glob(os.path.join(checkpoint_root(out_dir), "step_*")):
        try:
            dirs.append((int(os.path.basename(d)[5:]), d))
        except ValueError:
            continue
    return [d for _, d in sorted(dirs, reverse=True)]


def read_manifest(path):
    """The manifest of checkpoint directory ``path``, or ``None`` if it is not complete.

    Checks the format and that every part file exists with the recorded size
    (not the checksums: see :func:`load`).
    """
    try:
        with open(os.path.join(path, "manifest.json")) as fh:
            manifest = json.load(fh)
        if manifest.get("format") != FORMAT:
            return None
        for name, info in manifest["files"].items():
            if os.path.getsize(os.path.join(path, name)) != info["size"]:
                return None
        return manifest
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def candidates(out_dir):
    """Complete checkpoints in OUT, newest first: list of ``(path, manifest)``."""
    out = []
    for d in _step_dirs(out_dir):
        manifest = read_manifest(d)
        if manifest is None:
            log.warning("ignoring incomplete checkpoint %s", d)
        else:
            out.append((d, manifest))
    return out


# ----------------------------------------------------------------------------- loading
def _lattice_coords(ids, nc):
    ny, nz = nc[1], nc[2]
    return ids // (ny * nz), (ids // nz) % ny, ids % nz


def _read_file(path, info):
    import h5py

    if _sha256(path) != info["sha256"]:
        raise ValueError("checksum mismatch in %s" % path)
    with h5py.File(path, "r") as f:
        out = {k: f[k][...] for k in ("id",) + STATE_NAMES}
        out["origin"] = np.asarray(f.attrs["origin"], np.float64)
    return out


def _reslice(path, manifest, conf, block):
    """The state of ``block`` on ``conf.grid`` from the part files of another grid."""
    sx, sy, nz = conf.block_shape
    npart = sx * sy * nz
    x0, y0 = block[0] * sx, block[1] * sy
    origin = np.array([x0, y0, 0], np.float64)
    old_conf = conf.replace(grid=tuple(manifest["grid"]))
    osx, osy, _ = old_conf.block_shape
    out = {k: np.zeros((npart, 3), conf.np_dtype) for k in STATE_NAMES}
    filled = np.zeros(npart, bool)
    for name, info in sorted(manifest["files"].items()):
        obx, oby = info["block"]
        if obx * osx >= x0 + sx or (obx + 1) * osx <= x0 or \
                oby * osy >= y0 + sy or (oby + 1) * osy <= y0:
            continue  # no particle of this old block can be in the new one
        data = _read_file(os.path.join(path, name), info)
        i, j, k = _lattice_coords(data["id"], conf.nc)
        mine = (i >= x0) & (i < x0 + sx) & (j >= y0) & (j < y0 + sy)
        idx = ((i[mine] - x0) * sy + (j[mine] - y0)) * nz + k[mine]
        pos = data["positions"].reshape(-1, 3)[mine].astype(np.float64)
        out["positions"][idx] = (pos + data["origin"] - origin).astype(conf.np_dtype)
        for key in ("momenta", "forces"):
            out[key][idx] = data[key].reshape(-1, 3)[mine]
        filled[idx] = True
    if not filled.all():
        raise ValueError("%d particles of block %s are missing" % (npart - filled.sum(), block))
    return out


def load(out_dir, comm, conf, blocks):
    """State slices from the newest checkpoint that every rank can read.

    Collective over ``comm``.

    Parameters
    ----------
    out_dir : str
        The run directory OUT.
    comm : object
        mpi4py-like communicator.
    conf : SimConfig
        The resumed run's config (its grid may differ from the checkpoint's).
    blocks : dict
        ``pnum -> (bx, by)`` for the slices this process holds.

    Returns
    -------
    manifest : dict
    parts : dict
        ``pnum -> {"positions", "momenta", "forces"}`` arrays of shape
        ``[npart, 3]`` in lattice order of the block, dtype ``conf.dtype``.

    Raises
    ------
    ResumeError
        On every rank, if no checkpoint is valid everywhere.
    """
    tried = []
    for path, manifest in candidates(out_dir):
        error, parts = None, {}
        try:
            same_grid = tuple(manifest["grid"]) == tuple(conf.grid)
            for pnum, block in blocks.items():
                if same_grid:
                    name = _part_name(pnum)
                    info = manifest["files"][name]
                    if tuple(info["block"]) != tuple(block):
                        raise ValueError("%s holds block %s, expected %s"
                                         % (name, info["block"], block))
                    data = _read_file(os.path.join(path, name), info)
                    parts[pnum] = {k: data[k].reshape(-1, 3) for k in STATE_NAMES}
                else:
                    parts[pnum] = _reslice(path, manifest, conf, block)
        except Exception as exc:
            error = "%s: %s" % (type(exc).__name__, exc)
        errors = [e for e in comm.allgather(error) if e]
        if not errors:
            log.info("resuming from %s (step %d, a=%.4f, written on grid %s)", path,
                     manifest["step"], manifest["a"], "x".join(map(str, manifest["grid"])))
            return manifest, parts
        log.warning("skipping checkpoint %s: %s", path, errors[0])
        tried.append(os.path.basename(path))
    raise ResumeError("no valid checkpoint in %s%s; start a new run with --overwrite" % (
        checkpoint_root(out_dir), " (tried %s)" % ", ".join(tried) if tried else ""))


def check_resume_config(manifest, overrides, makers):
    """Reject settings that contradict the checkpoint; return the resumed run's configs.

    Parameters
    ----------
    manifest : dict
        Its ``config`` holds the saved configs, section key -> dict (e.g.
        ``{"config": SimConfig fields, "simulate": ...}``).
    overrides : dict
        Section key -> {field: value} set explicitly (command line, ``--config``).
    makers : dict
        Section key -> ``dict -> config instance`` (normalises values for the
        comparison, e.g. ``nc=64`` and ``nc=[64, 64, 64]`` agree).

    Returns
    -------
    dict
        Section key -> config instance: the checkpoint's, with the re-sliceable
        fields (:data:`RESLICEABLE_FIELDS`: the grid) of ``overrides`` applied.

    Raises
    ------
    ResumeError
        Naming the first field that differs.
    """
    out = {}
    for key, make in makers.items():
        saved = dict(manifest["config"].get(key, {}))
        base = make(saved).to_dict()
        keep = {}
        for name, value in sorted(overrides.get(key, {}).items()):
            if value is None:
                continue
            if name in RESLICEABLE_FIELDS:
                keep[name] = value
                continue
            if make(dict(saved, **{name: value})).to_dict() != base:
                raise ResumeError("--resume: %s=%s contradicts the checkpoint's %s=%s (step %d); "
                                  "drop the option or start a new run with --overwrite"
                                  % (name, json.dumps(value), name, json.dumps(saved.get(name)),
                                     manifest["step"]))
        out[key] = make(dict(saved, **keep))
    return out


def resume_command(out_dir, command="simulate"):
    """The command line that continues a run in ``out_dir``."""
    return "flowpm-mtf %s --resume %s" % (command, out_dir)


# ----------------------------------------------------------------------------- SIGTERM
class StopRequest:
    """SIGTERM recorded on this rank, agreed on by all ranks at step boundaries.

    Parameters
    ----------
    comm : object
        mpi4py-like communicator (``allreduce``).
    signals : tuple of int
        Signals to catch (default SIGTERM).

    Notes
    -----
    Use as a context manager; the previous handlers are restored on exit. The
    handler only sets a flag, so the current ``session.run`` completes.
    """

    def __init__(self, comm, signals=(signal.SIGTERM,)):
        self.comm = comm
        self.signals = tuple(signals)
        self.received = None
        self._previous = {}

    def _handler(self, signum, frame):
        if self.received is None:
            self.received = signum
            log.warning("received %s: finishing the current step, then checkpoint and exit",
                        signal.Signals(signum).name)

    def __enter__(self):
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc):
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}
        return False

    def agreed(self):
        """True on every rank if any rank received a stop signal (collective)."""
        return int(self.comm.allreduce(1 if self.received is not None else 0)) > 0
