"""What a checkpoint is: its layout, its manifest, the identity of the run it records, and
which checkpoint directories are complete.

Layout (``OUT/checkpoint/``)
----------------------------
::

    OUT/checkpoint/step_000004/manifest.json     written last, before the rename
    OUT/checkpoint/step_000004/rank00000.h5      one file per slice (processor number)
    OUT/checkpoint/step_000004/rank00001.h5
    OUT/checkpoint/.tmp-step_000006/             a checkpoint being written (or torn)

    OUT/checkpoint/step_000004/outputs/...       the run's outputs written before it

A checkpoint is written into ``.tmp-step_NNNNNN/`` and renamed to ``step_NNNNNN``
when it is complete (:mod:`flowpm_mtf.runs.checkpoint_save`). Its ``manifest.json``
holds the step index, scale factor, config, process grid, the job's identity
(:func:`identity`) and the size and digest (:mod:`flowpm_mtf.runs.digest`) of every
part and output file. A directory is *valid* (:func:`read_manifest`,
:func:`candidates`) when its manifest parses and names this format and every
part and output file exists with the recorded size; the readers also verify the
checksums of the files they read (:mod:`flowpm_mtf.runs.checkpoint_load`).

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
its own part: bit for bit), never a whole field
(:func:`flowpm_mtf.runs.checkpoint_load.load`'s ``fields``).
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
(:func:`check_identity`, :func:`flowpm_mtf.runs.checkpoint_load.verify_resume`),
before anything is computed.
Checkpoints of format 1 (written before this record existed) record no job and
none of the earlier outputs; they are refused, never guessed at.
"""
import glob
import hashlib
import json
import logging
import os

from . import digest

__all__ = ["CHECKPOINT_DIR", "FORMAT", "FORMAT_V1", "OUTPUTS_DIR", "STATE_NAMES", "FIELDS_GROUP",
           "RESLICEABLE_FIELDS", "LAYOUT_FIELDS", "checkpoint_root", "step_dir", "state_config",
           "config_hash", "identity", "check_identity", "read_manifest", "candidates"]

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoint"
FORMAT = "flowpm_mtf.runs.checkpoint/2"
#: Checkpoints written before the identity and the outputs were recorded: read, and refused.
FORMAT_V1 = "flowpm_mtf.runs.checkpoint/1"
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
    from .writers import to_jsonable

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
    from .writers import to_jsonable

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
        (default :data:`flowpm_mtf.physics.timeloop.STAGE_RTOL`).

    Returns
    -------
    str or None
        One line naming the first difference: an old checkpoint without an
        identity, another job, an inconsistent record, a config field, the
        stage of the saved step, the stage list.
    """
    if rtol is None:
        from ..physics.timeloop import STAGE_RTOL as rtol
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



def _check_outputs(path, manifest, checksums=True):
    """Raise ``ValueError`` if an output file of checkpoint ``path`` is missing or differs."""
    for rel, info in manifest.get("outputs", {}).items():
        f = os.path.join(path, OUTPUTS_DIR, rel)
        if os.path.getsize(f) != info["size"]:
            raise ValueError("%s has %d bytes, the manifest says %d" % (f, os.path.getsize(f),
                                                                        info["size"]))
        if checksums and not digest.matches(f, info):
            raise ValueError("checksum mismatch in %s" % f)



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

