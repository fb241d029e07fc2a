"""Checkpoints of a job's state (every rank its slices), restart, and SIGTERM handling.

Layout (``OUT/checkpoint/``)
----------------------------
::

    OUT/checkpoint/step_000004/manifest.json     written last, before the rename
    OUT/checkpoint/step_000004/rank00000.h5      one file per slice (processor number)
    OUT/checkpoint/step_000004/rank00001.h5
    OUT/checkpoint/.tmp-step_000006/             a checkpoint being written (or torn)

    OUT/checkpoint/step_000004/outputs/...       the run's outputs written before it

A checkpoint is written into ``.tmp-step_NNNNNN/`` (every rank its part
files, by the snapshots' writer: space reserved first, data written with
``O_DIRECT`` where the file system allows it, hashed while written and
fsynced, see :mod:`flowpm_mtf.h5dist`; rank 0 then links the outputs the run has staged so far into
``outputs/`` and writes ``manifest.json`` with the step index, scale factor,
config, process grid, the job's identity (:func:`identity`) and the size and
digest (:mod:`flowpm_mtf.digest`) of every part and output file, fsyncs and
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

A job's distributed fields besides the particles (the lens planes of
``lensing``; the field and Adam's moments and step count of ``reconstruct``)
go into the same part files as datasets ``fields/<name>`` with the index of the
slice's first element (attribute ``begin``), recorded in the manifest per part
(``fields``: ``begin``, ``shape``, ``dtype``) and listed in its ``fields``. A
rank reads back the parts whose slices overlap its own (on the same grid, only
its own part: bit for bit), never a whole field (:func:`load`'s ``fields``).
A job without particles (``reconstruct``) writes parts with fields only, and a
loop that is no time integration records no stages and ``a = None``.

Identity (what a resume is checked against)
-------------------------------------------
The manifest records the job (``simulate``, ...), its stage list (the scale
factors of the time loop), the scale factor of the saved state and
``state_config``: the ``SimConfig`` fields that change the particles'
trajectory (everything but :data:`LAYOUT_FIELDS`: the process grid and the
buffer layout on it, which a resume may change) and the job's own settings that
change its state (``Job.state_sections``, e.g. every lensing setting, every
reconstruction setting but ``log_every``), with ``config_hash``, the SHA-256 of
both (:func:`config_hash`). A resume by another job, with another
state config or stage list, or whose stage at the saved step is not the saved
scale factor, is refused with one line naming what differs
(:func:`check_identity`, :func:`verify_resume`), before anything is computed.
Checkpoints of format 1 (written before this record existed) record no job and
none of the earlier outputs; they are refused, never guessed at.

Outputs written before the checkpoint
-------------------------------------
Files a job writes during its time loop (snapshots, P(k) per step) go to the
run directory's staging area; every checkpoint holds hard links (copies where
links are impossible) of all of them, with size and digest, and a resumed run
puts them back into its staging area (:func:`restore_outputs`) before it
continues, so it publishes the same files as an uninterrupted run. Writers
replace files by rename (:func:`flowpm_mtf.io.atomic_path`, ``h5dist``), never
in place, so a link in a checkpoint never changes afterwards.

SIGTERM
-------
:class:`StopRequest` records SIGTERM (what Slurm sends before the time limit,
also ``scancel --signal=TERM``) and :meth:`StopRequest.agreed` makes all ranks
agree at a step boundary (one small allreduce): the signal may reach only some
ranks, or at different times, but every rank sees the same answer at the same
step, finishes that step, writes the checkpoint and exits 0 (a job that does not
checkpoint stops there with an error instead, see :mod:`flowpm_mtf.jobs.runner`).
A signal after the last step lets the run finish; the ``flowpm-mtf`` command
(``StopRequest(until_exit=True)``) then ignores SIGTERM until the process has
exited, so a rank shutting down is not ended by it (exit 0, not 143).
"""
import glob
import hashlib
import json
import logging
import os
import re
import shutil
import signal

import numpy as np

from .errors import ResumeError
from . import digest
from .h5dist import _agree, _write_h5, collective, known_digest
from .io import fsync_path

__all__ = ["CHECKPOINT_DIR", "FORMAT", "LAYOUT_FIELDS", "checkpoint_root", "step_dir",
           "state_config", "config_hash", "identity", "check_identity", "verify_resume", "save",
           "candidates", "read_manifest", "load", "restore_outputs", "StopRequest",
           "check_resume_config", "resume_command", "resume_hint"]

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoint"
FORMAT = "flowpm_mtf.checkpoint/2"
#: Checkpoints written before the identity and the outputs were recorded: read, and refused.
FORMAT_V1 = "flowpm_mtf.checkpoint/1"
OUTPUTS_DIR = "outputs"
STATE_NAMES = ("positions", "momenta", "forces")
#: HDF5 group of a part file holding the job's distributed fields (:func:`save`).
FIELDS_GROUP = "fields"
#: Config fields that may differ between a checkpoint and its resumed run.
RESLICEABLE_FIELDS = ("grid",)
#: SimConfig fields left out of the state config and its hash: the process grid and the
#: buffer layout on it (the halo width and the particle capacities are chosen per grid,
#: and the capacities grow on a rebuild). They change where a particle is stored, not its
#: trajectory (another grid changes results at float round-off only); a resume may change
#: the grid (:data:`RESLICEABLE_FIELDS`).
LAYOUT_FIELDS = ("grid", "halo_size", "capacity", "send_capacity")
# Temporary files of the writers (``<file>.tmp-<pid>``, ``*.tmp``): never part of a checkpoint.
_TMP_RE = re.compile(r"\.tmp-\d+$|\.tmp$")


def checkpoint_root(out_dir):
    """``OUT/checkpoint``."""
    return os.path.join(os.fspath(out_dir), CHECKPOINT_DIR)


def step_dir(out_dir, step):
    """``OUT/checkpoint/step_NNNNNN``."""
    return os.path.join(checkpoint_root(out_dir), "step_%06d" % step)


def _part_name(pnum):
    return "rank%05d.h5" % pnum


# ----------------------------------------------------------------------------- identity
def _to_dict(cfg):
    return cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)


def state_config(configs, sections=None):
    """The configuration that determines the state's trajectory.

    Parameters
    ----------
    configs : dict
        Section key -> config instance or dict; ``configs["config"]`` is the
        ``SimConfig``.
    sections : dict, optional
        Further section key -> tuple of its output-only fields: those sections'
        other fields change the job's state too (e.g. ``{"lensing": ()}``: the
        lens planes; ``{"reconstruction": ("log_every",)}``: the optimiser).

    Returns
    -------
    dict
        The ``SimConfig`` fields (cosmology, ``nc``, box, ``n_steps``,
        ``a_start``/``a_end``, LPT order, dtype, seed, decomposition) without
        :data:`LAYOUT_FIELDS`, and each of ``sections`` under its key without
        its output-only fields. The other sections change the trajectory only
        through the stage list (e.g. snapshot times), which :func:`identity`
        records and hashes with it; their other fields are outputs (e.g.
        ``--power-steps``).
    """
    conf = _to_dict(configs["config"])
    state = {k: v for k, v in conf.items() if k not in LAYOUT_FIELDS}
    for key, output_only in sorted((sections or {}).items()):
        state[key] = {k: v for k, v in _to_dict(configs[key]).items() if k not in output_only}
    return state


def config_hash(state, stages):
    """SHA-256 (hex) of a state config and a stage list, in canonical JSON.

    Parameters
    ----------
    state : dict
        From :func:`state_config`.
    stages : sequence of float
        Scale factors of the time loop.
    """
    from .io import to_jsonable

    text = json.dumps({"config": to_jsonable(state), "stages": [float(a) for a in stages]},
                      sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def identity(job, configs, stages, sections=None, fields=(), total=None):
    """What a checkpoint records about the run that wrote it (and a resume must match).

    Parameters
    ----------
    job : str
        Name of the job (``simulate``, ...).
    configs : dict
        Section key -> config (see :func:`state_config`).
    stages : sequence of float
        Scale factors of the job's time loop (empty for a loop that is no
        time integration, e.g. the iterations of ``reconstruct``).
    sections : dict, optional
        The job's own config sections that change its state
        (:func:`state_config`).
    fields : sequence of str
        The distributed fields besides the particles the job's checkpoints
        hold (e.g. ``("planes",)``): a checkpoint without one is refused.
    total : int, optional
        Number of steps (iterations) of the loop when ``stages`` is empty.

    Returns
    -------
    dict
        ``job``, ``state_config``, ``stages`` and ``config_hash`` (with
        ``fields`` and ``total`` where given): JSON-able, merged into the
        manifest.
    """
    from .io import to_jsonable

    state = to_jsonable(state_config(configs, sections))
    stages = [float(a) for a in stages]
    ident = {"job": str(job), "state_config": state, "stages": stages,
             "config_hash": config_hash(state, stages)}
    if fields:
        ident["fields"] = sorted(str(f) for f in fields)
    if total is not None:
        ident["total"] = int(total)
    return ident


def _first_difference(saved, mine, prefix=""):
    """``(name, saved value, this value)`` of the first differing field, or None."""
    if isinstance(saved, dict) and isinstance(mine, dict):
        for key in sorted(set(saved) | set(mine)):
            diff = _first_difference(saved.get(key), mine.get(key), prefix + key + ".")
            if diff is not None:
                return diff
        return None
    if saved != mine:
        return prefix.rstrip("."), saved, mine
    return None


def _show(value):
    return json.dumps(value) if not isinstance(value, str) else value


def check_identity(manifest, ident, where, rtol=None):
    """Why the checkpoint ``manifest`` cannot continue the run ``ident``, or None.

    Parameters
    ----------
    manifest : dict
        A checkpoint manifest (:func:`read_manifest`).
    ident : dict
        :func:`identity` of the run that would resume.
    where : str
        The checkpoint, for the message (its directory).
    rtol : float, optional
        Relative tolerance of the saved scale factor against the stage
        (default :data:`flowpm_mtf.timeloop.STAGE_RTOL`).

    Returns
    -------
    str or None
        One line naming the first difference: an old checkpoint without an
        identity, another job, an inconsistent record, a config field, the
        stage of the saved step, the stage list.
    """
    if rtol is None:
        from .timeloop import STAGE_RTOL as rtol
    if manifest.get("format") == FORMAT_V1 or not all(
            k in manifest for k in ("job", "config_hash", "state_config", "stages")):
        return ("%s was written by an older flowpm-mtf (%s) that recorded neither its job, nor "
                "its configuration hash, nor the outputs written before it, so it cannot be "
                "resumed faithfully; start a new run with --overwrite"
                % (where, manifest.get("format")))
    if manifest["job"] != ident["job"]:
        return "%s was written by job '%s', not '%s'" % (where, manifest["job"], ident["job"])
    stages = [float(a) for a in manifest["stages"]]
    if config_hash(manifest["state_config"], stages) != manifest["config_hash"]:
        return ("%s is damaged: its config_hash does not match its recorded configuration; "
                "start a new run with --overwrite" % where)
    diff = _first_difference(manifest["state_config"], ident["state_config"])
    if diff is not None:
        return "%s: config differs: %s %s (checkpoint) != %s (this run)" % (
            where, diff[0], _show(diff[1]), _show(diff[2]))
    missing = sorted(set(ident.get("fields", ())) - set(manifest.get("fields", ())))
    if missing:
        return ("%s holds no %s (written by an older flowpm-mtf), so it cannot be resumed "
                "faithfully; start a new run with --overwrite" % (where, ", ".join(missing)))
    if not ident["stages"]:   # a loop of iterations: the config fixes the count
        if manifest["stages"]:
            return "%s: stages differ: %d (checkpoint) != 0 (this run)" % (
                where, len(manifest["stages"]))
        total = ident.get("total")
        if total is not None and int(manifest["step"]) >= total:
            return "%s holds the state after %d iterations, but this run has only %d" % (
                where, int(manifest["step"]), total)
        if manifest["config_hash"] != ident["config_hash"]:
            return "%s: config_hash differs from this run's" % where
        return None
    step, a, mine = int(manifest["step"]), float(manifest["a"]), ident["stages"]
    if step >= len(mine) or abs(mine[step] - a) > rtol * abs(a):
        return ("%s holds the state after step %d at a=%.6g, but this run has %s; the stage "
                "lists differ" % (where, step, a, "stage %d at a=%.6g" % (step, mine[step])
                                  if step < len(mine) else "only %d stages" % len(mine)))
    if len(stages) != len(mine):
        return "%s: stages differ: %d (checkpoint) != %d (this run)" % (where, len(stages),
                                                                          len(mine))
    for i, (x, y) in enumerate(zip(stages, mine)):
        if abs(x - y) > rtol * abs(x):
            return "%s: stages differ: stage %d at a=%.6g (checkpoint) != %.6g (this run)" % (
                where, i, x, y)
    if manifest["config_hash"] != ident["config_hash"]:  # equal fields: only a float format
        return "%s: config_hash differs from this run's" % where
    return None


def verify_resume(out_dir, comm, ident):
    """Refuse, on every rank, to resume OUT's newest checkpoint for another run (collective).

    Rank 0 reads the newest complete checkpoint and compares it with ``ident``
    (:func:`check_identity`); its verdict reaches every rank. Reads only the
    manifest: called before any graph is built.

    Parameters
    ----------
    out_dir : str
    comm : object
        mpi4py-like communicator.
    ident : dict
        :func:`identity` of this run.

    Returns
    -------
    dict
        The manifest checked, on every rank.

    Raises
    ------
    ResumeError
        On every rank: no complete checkpoint, or one that does not match.
    """
    verdict = None
    if comm.rank == 0:
        found = candidates(out_dir)
        if not found:
            verdict = (None, "--resume %s: no valid checkpoint in %s; start a new run with "
                             "--overwrite" % (out_dir, checkpoint_root(out_dir)))
        else:
            path, manifest = found[0]
            verdict = (manifest, check_identity(manifest, ident, path))
    manifest, error = comm.bcast(verdict, root=0)
    if error is not None:
        raise ResumeError(error)
    return manifest


# ----------------------------------------------------------------------------- saving
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
            # One writer for all part files (h5dist._write_h5): the space is reserved first
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
        Relative path -> ``{"size", "blake3", "key"}`` (:data:`flowpm_mtf.digest.DIGEST`).
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


def _check_outputs(path, manifest, checksums=True):
    """Raise ``ValueError`` if an output file of checkpoint ``path`` is missing or differs."""
    for rel, info in manifest.get("outputs", {}).items():
        f = os.path.join(path, OUTPUTS_DIR, rel)
        if os.path.getsize(f) != info["size"]:
            raise ValueError("%s has %d bytes, the manifest says %d" % (f, os.path.getsize(f),
                                                                        info["size"]))
        if checksums and not digest.matches(f, info):
            raise ValueError("checksum mismatch in %s" % f)


def restore_outputs(path, manifest, dest, comm):
    """Put the outputs a checkpoint holds into the run's staging area (collective).

    Rank 0 links (or copies) ``<path>/outputs/*`` to ``dest`` (their checksums
    were verified by :func:`load`).

    Parameters
    ----------
    path : str
        The checkpoint directory (``OUT/checkpoint/step_NNNNNN``).
    manifest : dict
        Its manifest.
    dest : str
        The staging area of the resumed run.
    comm : object
        mpi4py-like communicator.

    Returns
    -------
    list of str
        The restored files (paths relative to ``dest``), on every rank.
    """
    def local():
        return {}

    def root(_):
        for rel in sorted(manifest.get("outputs", {})):
            target = os.path.join(dest, rel)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if os.path.lexists(target):
                os.remove(target)
            _link_or_copy(os.path.join(path, OUTPUTS_DIR, rel), target)

    collective(comm, local, root, "restoring the outputs of %s" % path)
    names = sorted(manifest.get("outputs", {}))
    if names and comm.rank == 0:
        log.info("restored %d output files written before step %d from %s", len(names),
                 manifest["step"], path)
    return names


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

    Checks the format (this one, or format 1, which :func:`check_identity`
    refuses) and that every part and output file exists with the recorded
    size (not the checksums: see :func:`load`).
    """
    try:
        with open(os.path.join(path, "manifest.json")) as fh:
            manifest = json.load(fh)
        if manifest.get("format") not in (FORMAT, FORMAT_V1):
            return None
        for name, info in manifest["files"].items():
            if os.path.getsize(os.path.join(path, name)) != info["size"]:
                return None
        _check_outputs(path, manifest, checksums=False)
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


#: Margin [cells] added to the stored position range when testing overlaps, so that
#: round-off in the wrap ``x % L`` (e.g. -1e-7 -> L) can never make a part skipped.
RANGE_MARGIN = 1e-3


def _may_overlap(xy_range, lo, hi, box):
    """Whether periodic images of a part's position range meet the block ``[lo, hi)`` in x and y.

    Parameters
    ----------
    xy_range : list or None
        :func:`_xy_range` of the part (``None``: no particles, never overlaps).
    lo, hi : sequence of 2 float
        Block bounds [cells].
    box : sequence of 2 float
        Box size [cells].

    Returns
    -------
    bool
        False only if no particle of the part can lie in the block (conservative).
    """
    if xy_range is None:
        return False
    for (a, b), l, h, n in zip(xy_range, lo, hi, box):
        a, b = a - RANGE_MARGIN, b + RANGE_MARGIN
        if b - a >= n:
            continue
        m = np.ceil((l - b) / n)  # the first image [a + m n, b + m n] that ends at or after l
        if a + m * n >= h:
            return False
    return True


def _read_file(path, info):
    import h5py

    if not digest.matches(path, info):
        raise ValueError("checksum mismatch in %s" % path)
    with h5py.File(path, "r") as f:
        out = {k: f[k][...] for k in ("id",) + STATE_NAMES}
        out["origin"] = np.asarray(f.attrs["origin"], np.float64)
    return out


def _reslice(path, manifest, conf, block):
    """The state of ``block`` on ``conf`` from the part files of another grid or capacity.

    Lagrangian decomposition: every particle goes to its Lagrangian block, in
    lattice slot order (positions re-expressed relative to the new block origin,
    unwrapped). Eulerian: to the block that contains its current position
    (x, y wrapped into the box), in id order, the ``sizing.capacity(conf) - n``
    trailing slots empty (id -1). Only the old part files that can hold a
    particle of ``block`` are read: in the lagrangian case by their block, in
    the eulerian one by the position range recorded in the manifest
    (:func:`_may_overlap`; checkpoints without it are read whole), so a rank
    reads about its own share, one part at a time, never the whole state.
    """
    from . import sizing

    sx, sy, nz = conf.block_shape
    x0, y0 = block[0] * sx, block[1] * sy
    origin = np.array([x0, y0, 0], np.float64)
    old_conf = conf.replace(grid=tuple(manifest["grid"]))
    osx, osy, _ = old_conf.block_shape
    lagrangian = conf.decomposition == "lagrangian"
    slots = sizing.capacity(conf)
    got = {k: [] for k in ("id", "slot") + STATE_NAMES}
    for name, info in sorted(manifest["files"].items()):
        obx, oby = info["block"]
        if lagrangian and (obx * osx >= x0 + sx or (obx + 1) * osx <= x0 or
                           oby * osy >= y0 + sy or (oby + 1) * osy <= y0):
            continue  # no particle of this old block can be in the new one
        if (not lagrangian and "xy_range" in info and
                not _may_overlap(info["xy_range"], (x0, y0), (x0 + sx, y0 + sy), conf.nc[:2])):
            continue  # no particle of this part lies in the new block
        data = _read_file(os.path.join(path, name), info)
        ids = np.asarray(data["id"], np.int64).reshape(-1)
        pos = data["positions"].reshape(-1, 3).astype(np.float64) + data["origin"]
        valid = ids >= 0
        if lagrangian:
            i, j, k = _lattice_coords(ids, conf.nc)
            mine = valid & (i >= x0) & (i < x0 + sx) & (j >= y0) & (j < y0 + sy)
            got["slot"].append(((i[mine] - x0) * sy + (j[mine] - y0)) * nz + k[mine])
        else:
            pos[:, :2] %= np.asarray(conf.nc[:2], np.float64)
            owner = np.floor(pos[:, :2] / [sx, sy]).astype(np.int64)
            mine = valid & (owner[:, 0] == block[0]) & (owner[:, 1] == block[1])
        got["id"].append(ids[mine])
        got["positions"].append(pos[mine] - origin)
        for key in ("momenta", "forces"):
            got[key].append(data[key].reshape(-1, 3)[mine])
    cat = {k: np.concatenate(v) if v else np.zeros((0,) if k in ("id", "slot") else (0, 3))
           for k, v in got.items()}
    n = cat["id"].size
    if n > slots:
        raise ValueError("block %s would hold %d particles, more than its %d slots; resume with "
                         "--capacity %d" % (block, n, slots, n))
    out = {k: np.zeros((slots, 3), conf.np_dtype) for k in STATE_NAMES}
    out["id"] = np.full(slots, -1, np.int64)
    if lagrangian:
        dest, src = cat["slot"], np.arange(n)
    else:
        dest, src = np.arange(n), np.argsort(cat["id"], kind="stable")
    out["id"][dest] = cat["id"][src]
    for key in STATE_NAMES:
        out[key][dest] = cat[key][src].astype(conf.np_dtype)
    if lagrangian and n != sx * sy * nz:
        raise ValueError("%d particles of block %s are missing" % (slots - n, block))
    return out, n


def _replicas(comm, blocks):
    """How many times each block is held over the ranks (1 unless slices are replicated)."""
    held = [p for bl in comm.allgather(sorted(blocks.values())) for p in bl]
    return max(1, len(held) // max(1, len(set(map(tuple, held)))))


class _Refused(Exception):
    """A checkpoint that is complete but belongs to another run (never skipped: refused)."""


def load(out_dir, comm, conf, blocks, ident=None, fields=None):
    """State slices from the newest checkpoint that every rank can read.

    Collective over ``comm``. Rank 0 also verifies the checksums of the
    checkpoint's outputs (:func:`restore_outputs`); a damaged output file
    makes every rank fall back to the previous checkpoint, as a damaged part.

    Parameters
    ----------
    out_dir : str
        The run directory OUT.
    comm : object
        mpi4py-like communicator.
    conf : SimConfig
        The resumed run's config (its grid may differ from the checkpoint's).
    blocks : dict or None
        ``pnum -> (bx, by)`` for the particle slices this process holds (None:
        a job without particles).
    ident : dict, optional
        :func:`identity` of the resumed run: a checkpoint that does not match
        it (:func:`check_identity`) is refused, not skipped.
    fields : dict, optional
        ``name -> [(pnum, shape, begin), ...]``: the slices of the job's
        distributed fields this process holds (:func:`save`'s ``fields``).
        Each is read from the part files whose slice overlaps it (only its
        own one on the same grid), so no rank reads a whole field.

    Returns
    -------
    manifest : dict
        Its directory is ``step_dir(out_dir, manifest["step"])``.
    parts : dict
        ``pnum -> {"positions", "momenta", "forces", "id"}``: ``[slots, 3]``
        arrays of dtype ``conf.dtype`` and ``[slots]`` ids (-1: empty slot),
        ``slots = sizing.capacity(conf)``; the same grid and capacity restore
        the saved buffers bit for bit.
    values : dict
        Only with ``fields``: ``pnum -> {name: ndarray}`` of the requested
        slices (bit for bit what was saved on the same grid).

    Raises
    ------
    ResumeError
        On every rank, if no checkpoint is valid everywhere, or the newest
        valid one does not match ``ident``.
    """
    from . import sizing

    tried = []
    slots = sizing.capacity(conf) if blocks else 0
    for path, manifest in candidates(out_dir):
        error, parts, values, count = None, {}, {}, 0
        try:
            if ident is not None:
                refused = check_identity(manifest, ident, path)
                if refused is not None:
                    raise _Refused(refused)
            if comm.rank == 0:
                _check_outputs(path, manifest)
            same = tuple(manifest["grid"]) == tuple(conf.grid)
            for pnum, block in (blocks or {}).items():
                name = _part_name(pnum)
                info = manifest["files"].get(name) if same else None
                if info is not None and info.get("slots", info["n"]) == slots:
                    if tuple(info["block"]) != tuple(block):
                        raise ValueError("%s holds block %s, expected %s"
                                         % (name, info["block"], block))
                    data = _read_file(os.path.join(path, name), info)
                    parts[pnum] = {k: data[k].reshape(-1, 3) for k in STATE_NAMES}
                    parts[pnum]["id"] = data["id"].reshape(-1)
                    n = int((parts[pnum]["id"] >= 0).sum())
                else:  # another grid or another capacity: place every particle anew
                    parts[pnum], n = _reslice(path, manifest, conf, block)
                count += n
            if fields:
                values = _read_fields(path, manifest, fields)
        except _Refused as exc:
            error = ("refused", str(exc))
        except Exception as exc:
            error = "%s: %s" % (type(exc).__name__, exc)
        gathered = comm.allgather((error, count))
        refused = [e[1] for e, _ in gathered if isinstance(e, (tuple, list))]
        if refused:
            raise ResumeError(refused[0])
        errors = [e for e, _ in gathered if e]
        total = sum(c for _, c in gathered)
        if not errors and blocks is not None and \
                total != conf.n_particles * _replicas(comm, blocks):
            errors = ["the checkpoint holds %d particles, expected %d"
                      % (total, conf.n_particles)]
        if not errors:
            log.info("resuming from %s (%s %d%s, written on grid %s)", path,
                     "iteration" if manifest.get("a") is None else "step", manifest["step"],
                     "" if manifest.get("a") is None else ", a=%.4f" % manifest["a"],
                     "x".join(map(str, manifest["grid"])))
            return (manifest, parts, values) if fields is not None else (manifest, parts)
        log.warning("skipping checkpoint %s: %s", path, errors[0])
        tried.append(os.path.basename(path))
    raise ResumeError("no valid checkpoint in %s%s; start a new run with --overwrite" % (
        checkpoint_root(out_dir), " (tried %s)" % ", ".join(tried) if tried else ""))


def _read_fields(path, manifest, wanted):
    """The requested slices of the checkpoint's distributed fields (see :func:`load`).

    Every slice is assembled from the part files whose slice of that field
    overlaps it (checksums verified once per file); a region no part covers
    is an error (``ValueError``).
    """
    import h5py

    verified = set()
    out = {}
    for fname, slices in sorted(wanted.items()):
        holders = [(name, info["fields"][fname]) for name, info in sorted(manifest["files"].items())
                   if fname in info.get("fields", {})]
        if not holders:
            raise ValueError("%s holds no field '%s'" % (path, fname))
        for pnum, shape, begin in slices:
            shape, begin = tuple(int(n) for n in shape), tuple(int(b) for b in begin)
            value, covered = None, np.zeros(shape, bool)
            for name, rec in holders:
                lo = [max(b, c) for b, c in zip(begin, rec["begin"])]
                hi = [min(b + n, c + m) for b, n, c, m in zip(begin, shape, rec["begin"],
                                                              rec["shape"])]
                if any(h <= l for l, h in zip(lo, hi)):
                    continue
                dst = tuple(slice(l - b, h - b) for l, h, b in zip(lo, hi, begin))
                if covered[dst].all():
                    continue   # a replicated copy of a region read already
                if len(rec["shape"]) != len(shape):
                    raise ValueError("field '%s' of %s has rank %d, expected %d"
                                     % (fname, name, len(rec["shape"]), len(shape)))
                file_path = os.path.join(path, name)
                if name not in verified:
                    if not digest.matches(file_path, manifest["files"][name]):
                        raise ValueError("checksum mismatch in %s" % file_path)
                    verified.add(name)
                src = tuple(slice(l - c, h - c) for l, h, c in zip(lo, hi, rec["begin"]))
                with h5py.File(file_path, "r") as f:
                    part = f[FIELDS_GROUP + "/" + fname][src]
                if value is None:
                    value = np.empty(shape, part.dtype)
                value[dst] = part
                covered[dst] = True
                if covered.all():
                    break   # a replicated slice is complete after its first copy
            if value is None or not covered.all():
                raise ValueError("the parts of %s do not cover the slice at %s of field '%s'"
                                 % (path, list(begin), fname))
            out.setdefault(pnum, {})[fname] = value
    return out


def check_resume_config(manifest, overrides, makers, job=None):
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
    job : str, optional
        The job that resumes: a checkpoint recording another job is foreign
        even where the two jobs have the same config sections.

    Returns
    -------
    dict
        Section key -> config instance: the checkpoint's, with the re-sliceable
        fields (:data:`RESLICEABLE_FIELDS`: the grid) of ``overrides`` applied.

    Raises
    ------
    ResumeError
        Naming the first field that differs.

    Notes
    -----
    A checkpoint of another job (another recorded ``job``, or config sections
    that are not ``makers``'s) is not compared field by field: the configs returned are then this job's
    saved-or-default ones, and the job's resume check (:func:`verify_resume`,
    before any graph is built) refuses it naming both jobs.
    """
    out = {}
    foreign = "job" in manifest and (set(manifest["config"]) != set(makers) or
                                     (job is not None and manifest["job"] != job))
    for key, make in makers.items():
        saved = dict(manifest["config"].get(key, {}))
        if foreign:
            saved = {k: v for k, v in saved.items() if k not in RESLICEABLE_FIELDS}
            try:
                out[key] = make(dict(saved, **{k: v for k, v in overrides.get(key, {}).items()
                                               if v is not None}))
            except (ValueError, TypeError):
                raise ResumeError("--resume: the checkpoint of step %d was written by job '%s' "
                                  "(config sections %s), not by this job (%s)" % (
                                      manifest["step"], manifest["job"],
                                      ", ".join(sorted(manifest["config"])),
                                      ", ".join(sorted(makers)))) from None
            continue
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


def resume_hint(out_dir, job):
    """What a new run of ``job`` can do about the checkpointed, unfinished run in OUT.

    Parameters
    ----------
    out_dir : str
        A run directory holding ``checkpoint/step_*`` directories.
    job : str
        The job about to run there.

    Returns
    -------
    str
        One sentence that is true for the newest checkpoint: ``pass --resume
        OUT ...`` only when it was written by ``job`` in this format; the
        command of the job that wrote it; or ``--overwrite`` alone for a torn
        checkpoint or one of an older flowpm-mtf.
    """
    found = candidates(out_dir)
    if not found:
        return ("its checkpoint in %s is incomplete and cannot be resumed; pass --overwrite to "
                "start over" % checkpoint_root(out_dir))
    path, manifest = found[0]
    saved = manifest.get("job")
    if manifest.get("format") != FORMAT or saved is None:
        return ("%s was written by an older flowpm-mtf and cannot be resumed; pass --overwrite "
                "to start over" % path)
    if saved != job:
        return ("that run is a '%s' run: continue it with '%s', or pass --overwrite to replace "
                "it with this %s run" % (saved, resume_command(out_dir, saved), job))
    return "pass --resume %s to continue it or --overwrite to start over" % out_dir


# ----------------------------------------------------------------------------- SIGTERM
class StopRequest:
    """SIGTERM recorded on this rank, agreed on by all ranks at step boundaries.

    Parameters
    ----------
    comm : object
        mpi4py-like communicator (``allreduce``).
    signals : tuple of int
        Signals to catch (default SIGTERM).
    until_exit : bool
        The process ends after the block (the ``flowpm-mtf`` command): a block
        left without an exception leaves the signals **ignored** instead of
        restoring the previous handlers, so that a signal after the last step
        (the run complete, or stopped after its checkpoint) cannot kill the rank
        while it shuts down (Horovod, MPI, the interpreter: about a second) and
        make ``mpirun`` report "exited on signal 15" (exit 143). Ignored, not
        caught: Python resets the handlers it called to the default action
        while it finalizes, an ignored signal stays ignored. A block left by an
        exception restores the previous handlers (the failing rank stays
        killable).

    Attributes
    ----------
    received : int or None
        The first signal recorded on this rank.
    finished : bool
        Set once the job's loop is done (:func:`flowpm_mtf.jobs.runner.run`):
        a signal after it lets the run finish, which the log then says.

    Notes
    -----
    Use as a context manager; the previous handlers are restored on exit
    (see ``until_exit``). The handler only sets a flag, so the current
    ``session.run`` completes.
    """

    def __init__(self, comm, signals=(signal.SIGTERM,), until_exit=False):
        self.comm = comm
        self.signals = tuple(signals)
        self.until_exit = bool(until_exit)
        self.received = None
        self.finished = False
        self._previous = {}

    def _handler(self, signum, frame):
        if self.received is None:
            self.received = signum
            log.warning("received %s: %s", signal.Signals(signum).name,
                        "the last step is done, finishing the run (outputs, exit 0)"
                        if self.finished else
                        "stopping at the end of the current step (or iteration)")

    def __enter__(self):
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, exc_type, *exc):
        for s, h in self._previous.items():
            signal.signal(s, signal.SIG_IGN if self.until_exit and exc_type is None else h)
        self._previous = {}
        return False

    def agreed(self):
        """True on every rank if any rank received a stop signal (collective)."""
        return int(self.comm.allreduce(1 if self.received is not None else 0)) > 0
