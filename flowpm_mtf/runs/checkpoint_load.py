"""Resuming from a checkpoint: the resume checks, the state and fields read back on any
grid, the outputs restored, and the resumed run's configuration.

* :func:`verify_resume`: before any graph is built, rank 0 compares OUT's newest
  complete checkpoint with the run's identity
  (:func:`flowpm_mtf.runs.checkpoint_identity.check_identity`); a checkpoint of another run
  is refused on every rank with one line naming what differs.
* :func:`load`: the readers verify the checksums of the files they read, and all
  ranks agree on the newest checkpoint that passed everywhere (a torn or corrupted
  one is skipped with a warning, falling back to the previous one). The same grid
  restores the slices bit for bit; another grid places every particle by id into
  the block that now owns it (:func:`_reslice`; its Lagrangian block, or the block
  holding its position), which changes results only at float round-off. A rank
  reads back the parts whose slices of a distributed field overlap its own (on the
  same grid, only its own part: bit for bit), never a whole field.
* :func:`restore_outputs`: the outputs written before the checkpoint back into the
  resumed run's staging area, so it publishes the same files as an uninterrupted run.
* :func:`check_resume_config`, :func:`resume_command`, :func:`resume_hint`: the
  resumed run's configuration, and what a new run on OUT is told about the
  checkpointed one.
"""
import json
import logging
import os

import numpy as np

from ..errors import ResumeError
from . import digest
from .checkpoint_identity import (FIELDS_GROUP, FORMAT, OUTPUTS_DIR, RESLICEABLE_FIELDS,
                                  STATE_NAMES, _check_outputs, _part_name, candidates,
                                  check_identity, checkpoint_root)
from .checkpoint_save import _link_or_copy
from .collective import collective

__all__ = ["RANGE_MARGIN", "verify_resume", "load", "restore_outputs", "check_resume_config",
           "resume_command", "resume_hint"]

log = logging.getLogger(__name__)


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



# ----------------------------------------------------------------------------- loading
def _lattice_coords(ids, nc):
    ny, nz = nc[1], nc[2]
    return ids // (ny * nz), (ids // nz) % ny, ids % nz



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
    from ..physics import sizing

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
    from ..physics import sizing

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
