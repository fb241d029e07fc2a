"""What a complete run in a run directory is, for its readers: the manifest and where the run is.

``OUT/manifest.json``, written last by :meth:`flowpm_mtf.runs.rundir.RunDir.publish`,
lists every output file of the run with its size and digest
(:mod:`flowpm_mtf.runs.digest`), with the job, the config and a ``generation`` (the
previous run's plus one). A directory whose manifest is valid and whose listed files
all have their size is a **complete** run (:func:`verify_manifest` also checks the
digests); of two complete copies of OUT, the higher generation is the newer run.
:func:`locate` finds the complete run of OUT, also between the two renames of a
publish on a file system without ``RENAME_EXCHANGE`` (:mod:`flowpm_mtf.runs.rundir_swap`).
Of the checkpoints of an unfinished run (``OUT/checkpoint/``, their own manifests in
:mod:`flowpm_mtf.runs.checkpoint_identity`) only whether one exists
(:func:`has_checkpoint`), and the error of a ``--resume`` with nothing to continue
(:func:`nothing_to_resume`).
"""
import json
import os
import re

from ..errors import ResumeError
from . import digest
from .rundir_swap import swap_paths

__all__ = ["MANIFEST", "CHECKPOINT", "MANIFEST_FORMAT", "read_manifest", "verify_manifest",
           "generation", "locate", "has_checkpoint", "nothing_to_resume"]

MANIFEST = "manifest.json"
CHECKPOINT = "checkpoint"
#: Value of the ``format`` key of ``manifest.json``.
MANIFEST_FORMAT = "flowpm_mtf.manifest/1"


def read_manifest(out):
    """The manifest of a complete run in ``out``, or ``None`` (absent, unreadable, not ours)."""
    try:
        with open(os.path.join(out, MANIFEST)) as f:
            m = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(m, dict) or m.get("format") != MANIFEST_FORMAT or not isinstance(
            m.get("files"), list):
        return None
    return m


def verify_manifest(out, check_hashes=True):
    """Problems of the run in ``out`` against its manifest (empty list: complete and intact).

    Parameters
    ----------
    out : str
    check_hashes : bool
        Also recompute every file's digest (reads every byte; BLAKE3, or SHA-256 for
        a manifest of before BLAKE3, :func:`flowpm_mtf.runs.digest.matches`).

    Returns
    -------
    list of str
    """
    m = read_manifest(out)
    if m is None:
        return ["%s: no valid %s" % (out, MANIFEST)]
    problems = []
    for i, entry in enumerate(m["files"]):
        bad = _entry_problem(entry, check_hashes)
        if bad:
            problems.append("%s entry %d: %s" % (MANIFEST, i, bad))
            continue
        path = os.path.join(out, entry["path"])
        try:
            size = os.path.getsize(path) if os.path.isfile(path) else None
            if size is None:
                problems.append("%s: missing" % entry["path"])
            elif size != entry["size"]:
                problems.append("%s: size %d, manifest says %d"
                                % (entry["path"], size, entry["size"]))
            elif check_hashes and not digest.matches(path, entry):
                problems.append("%s: %s differs from the manifest"
                                % (entry["path"], digest.recorded(entry)[0]))
        except OSError as e:  # removed while we read it (a run being replaced)
            problems.append("%s: %s" % (entry["path"], e.strerror or e))
    return problems


def _entry_problem(entry, check_hashes):
    """Why a manifest entry cannot be checked (None when it can): not a ``{path, size,
    digest}`` record, a path outside the run directory, or (``check_hashes``) no digest of
    a known algorithm. A damaged or hand-edited manifest is then a listed problem, not an
    exception."""
    if not isinstance(entry, dict):
        return "not a record (%s)" % type(entry).__name__
    path, size = entry.get("path"), entry.get("size")
    if not isinstance(path, str) or not path:
        return "no file path"
    if os.path.isabs(path) or os.pardir in os.path.normpath(path).split(os.sep):
        return "%s: outside the run directory" % path
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        return "%s: no valid size (%r)" % (path, size)
    if check_hashes:
        try:
            digest.recorded(entry)
        except ValueError:
            return "%s: no digest (one of: %s)" % (path, ", ".join(digest.ALGORITHMS))
    return None


def generation(manifest):
    """The ``generation`` of a manifest (0 for none, or one written before generations)."""
    try:
        return int((manifest or {}).get("generation", 0))
    except (TypeError, ValueError):
        return 0


def _complete(tree):
    """The manifest of ``tree`` if every file it lists is there with its size, else None."""
    m = read_manifest(tree)
    if m is None or verify_manifest(tree, check_hashes=False):
        return None
    return m


def locate(out):
    """The directory holding the complete run of ``out``, for readers; ``None`` if none.

    ``out`` itself when it holds a complete run, which is always so except
    between the two renames of a publish on a file system without
    ``RENAME_EXCHANGE`` (or after a kill exactly there, until the next start):
    then the newest complete ``.B.flowpm-new``/``.B.flowpm-old`` next to it.
    A reader that gets ``None`` or a vanishing file retries after a moment.

    Parameters
    ----------
    out : str or os.PathLike

    Returns
    -------
    str or None
    """
    out = os.path.abspath(os.fspath(out))
    if _complete(out) is not None:
        return out
    found = [(generation(m), t) for t, m in ((t, _complete(t)) for t in swap_paths(out))
             if m is not None]
    return max(found)[1] if found else None


def has_checkpoint(out):
    """Whether ``out/checkpoint/`` holds at least one completed checkpoint directory.

    A completed checkpoint is a directory ``step_NNNNNN`` (renamed from its
    temporary name when complete, see :mod:`flowpm_mtf.runs.checkpoint`).
    """
    d = os.path.join(out, CHECKPOINT)
    try:
        names = os.listdir(d)
    except OSError:
        return False
    return any(re.fullmatch(r"step_\d+", n) and os.path.isdir(os.path.join(d, n)) for n in names)


def nothing_to_resume(out):
    """The :class:`ResumeError` of ``--resume OUT`` when OUT holds no checkpoint.

    A complete run (:func:`locate`: also one whose publish was killed midway) is
    said to be complete, with the job that wrote it, not "no checkpoint": the
    checkpoints of a run are removed when it publishes. Exit code 6 like every
    resume that has nothing to continue (docs/running.md).

    Parameters
    ----------
    out : str or os.PathLike

    Returns
    -------
    ResumeError
    """
    out = os.fspath(out)
    where = locate(out)
    if where is not None:
        job = (read_manifest(where) or {}).get("job")
        return ResumeError("--resume %s: the %srun there is complete (%s): nothing to resume; "
                           "its outputs are in %s (to run it again: --out %s --overwrite, "
                           "without --resume)" % (out, "%r " % job if job else "", MANIFEST, out,
                                                  out))
    return ResumeError("--resume %s: no valid checkpoint in %s (run with --checkpoint-every K to "
                       "write checkpoints, or start a new run)"
                       % (out, os.path.join(out, CHECKPOINT)))

