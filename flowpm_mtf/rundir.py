"""Run directories: a run never destroys or mixes results.

Every job writes into one directory ``OUT`` (``--out``), laid out as::

    OUT/manifest.json     written LAST: job, config, every output file with size and sha256
    OUT/<outputs>         the files of the run the manifest describes
    OUT/.lock             while a run is active: fcntl lock held by rank 0, owner inside
    OUT/.staging/         outputs being written; moved into OUT at publish
    OUT/checkpoint/       checkpoints of an unfinished run (owned by flowpm_mtf.checkpoint)

A directory with a valid manifest is a **complete** run; without one it is torn
(a killed run) and holds nothing a reader should use.

Life of a run (:class:`RunDir`)
-------------------------------
1. :meth:`RunDir.open` (before any graph is built; rank 0 acts, the verdict is
   broadcast through ``comm`` so every rank raises the same error):

   * OUT must be creatable and writable (a probe file is written);
   * a second run on the same OUT fails at once (non-blocking lock), naming the
     owner's host and pid;
   * an OUT holding a complete run is refused unless ``overwrite``; one holding
     an unfinished run with a checkpoint is refused unless ``resume`` or
     ``overwrite``; a non-empty directory that is not a run directory is
     always refused (nothing of the user's is ever deleted);
   * leftovers of a killed run (staging directory, ``*.tmp-*`` files, outputs
     of a torn publish) are removed.

2. The job writes its outputs into :attr:`RunDir.staging` (all ranks may).
   An ``--overwrite``n run stays complete and untouched until step 3.
3. :meth:`RunDir.publish` (collective): removes the old manifest, then the old
   run's files, moves the staged files into OUT (renames, no copy), removes the
   checkpoints (the run is complete) and writes ``manifest.json`` last. A kill
   anywhere before the last rename leaves no manifest: a torn run, cleaned up
   by the next run.
4. :meth:`RunDir.close` releases the lock (and drops the staging directory of a
   run that failed).

Notes
-----
``fcntl.flock`` locks work on local file systems and on NFS (Linux emulates
them with POSIX locks); on Lustre the client must be mounted with ``-o flock``.
The staging directory must be visible to every rank that writes into it (a
shared file system), which :meth:`RunDir.open` checks when ``all_ranks_write``.
"""
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import socket
import time

from .backend import SerialComm
from .checkpoint import _fsync_dir  # one directory fsync for checkpoints and runs
from .checkpoint import _sha256 as sha256_file  # SHA-256 of a file, hex, 4 MiB chunks
from .errors import FlowpmError, OutputDirError, ResumeError, error_from_name

__all__ = ["MANIFEST", "LOCK", "STAGING", "CHECKPOINT", "MANIFEST_FORMAT", "read_manifest",
           "verify_manifest", "has_checkpoint", "sha256_file", "RunDir"]

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
LOCK = ".lock"
STAGING = ".staging"
CHECKPOINT = "checkpoint"
#: Value of the ``format`` key of ``manifest.json``.
MANIFEST_FORMAT = "flowpm_mtf.manifest/1"
# Temporary names of flowpm_mtf.io (``<file>.tmp-<pid>``) and of this module.
_TMP_RE = re.compile(r"\.tmp-\d+$|\.tmp$")


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
        Also recompute every file's sha256 (reads every byte).

    Returns
    -------
    list of str
    """
    m = read_manifest(out)
    if m is None:
        return ["%s: no valid %s" % (out, MANIFEST)]
    problems = []
    for entry in m["files"]:
        path = os.path.join(out, entry["path"])
        if not os.path.isfile(path):
            problems.append("%s: missing" % entry["path"])
        elif os.path.getsize(path) != entry["size"]:
            problems.append("%s: size %d, manifest says %d"
                            % (entry["path"], os.path.getsize(path), entry["size"]))
        elif check_hashes and sha256_file(path) != entry["sha256"]:
            problems.append("%s: sha256 differs from the manifest" % entry["path"])
    return problems


def has_checkpoint(out):
    """Whether ``out/checkpoint/`` holds at least one completed checkpoint directory.

    A completed checkpoint is a directory ``step_NNNNNN`` (renamed from its
    temporary name when complete, see :mod:`flowpm_mtf.checkpoint`).
    """
    d = os.path.join(out, CHECKPOINT)
    try:
        names = os.listdir(d)
    except OSError:
        return False
    return any(re.fullmatch(r"step_\d+", n) and os.path.isdir(os.path.join(d, n)) for n in names)


def _remove(path):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def _is_infrastructure(name):
    return name.startswith(".") or name in (MANIFEST, CHECKPOINT)


class RunDir:
    """The run directory of one job (see the module documentation).

    Parameters
    ----------
    out : str or os.PathLike
        The run directory OUT (created if needed).
    job : str
        Name of the job (``simulate``, ``lensing``, ...), recorded in the manifest.
    comm : object, optional
        Communicator with mpi4py's lower-case API (``rank``, ``bcast``,
        ``allgather``, ``barrier``); default: this process only.
    overwrite : bool
        Replace a complete (or checkpointed) earlier run in OUT.
    resume : bool
        Continue the unfinished, checkpointed run in OUT (its checkpoint is kept).
    all_ranks_write : bool
        Every rank writes into the staging directory: check on every rank that
        it sees and can write it.

    Notes
    -----
    Use as a context manager (``with RunDir(...) as rd:``): ``open`` on entry,
    ``close`` on exit. Every method is collective (call it on every rank).
    """

    def __init__(self, out, job, comm=None, overwrite=False, resume=False,
                 all_ranks_write=False):
        self.out = os.path.abspath(os.fspath(out))
        self.job = str(job)
        self.comm = comm if comm is not None else SerialComm()
        self.overwrite = bool(overwrite)
        self.resume = bool(resume)
        self.all_ranks_write = bool(all_ranks_write)
        self.published = False
        self.is_open = False
        self._lock_fd = None

    # ------------------------------------------------------------------ paths
    @property
    def staging(self):
        """Directory the job writes its outputs into (``OUT/.staging``)."""
        return os.path.join(self.out, STAGING)

    @property
    def checkpoint_dir(self):
        """``OUT/checkpoint``."""
        return os.path.join(self.out, CHECKPOINT)

    @property
    def path(self):
        """The run directory OUT (absolute)."""
        return self.out

    def staged(self, name):
        """Path of output ``name`` inside the staging directory."""
        return os.path.join(self.staging, name)

    def file(self, name):
        """Where the output ``name`` is written: in the staging directory (parents created)."""
        path = self.staged(name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return path

    # ------------------------------------------------------------------ collective steps
    def _collective(self, fn, *args):
        """Run ``fn`` on rank 0, share its verdict, raise the same error on every rank."""
        err = None
        if self.comm.rank == 0:
            try:
                fn(*args)
            except FlowpmError as e:
                err = (type(e).__name__, str(e))
            except OSError as e:
                err = ("OutputDirError", "cannot use --out %s: %s%s" % (
                    self.out, e.strerror or e, " (%s)" % e.filename if e.filename else ""))
        err = self.comm.bcast(err, root=0)
        if err is not None:
            raise error_from_name(*err)

    def open(self):
        """Check, lock and prepare OUT (collective; before building any graph).

        Raises
        ------
        OutputDirError
            OUT not creatable/writable, in use by another run, holding a
            complete run (without ``overwrite``) or an unfinished checkpointed
            run (without ``resume``/``overwrite``), or holding files that are
            not a run of this program.
        ResumeError
            ``resume`` but nothing to resume in OUT.
        """
        try:
            self._collective(self._open_rank0)
            if self.all_ranks_write:
                self._check_every_rank_writes()
        except FlowpmError:
            self._release()
            raise
        self.is_open = True
        return self

    def __enter__(self):
        return self if self.is_open else self.open()

    def __exit__(self, exc_type, exc, tb):
        self.close()
        return False

    def publish(self, config=None, extra=None, keep_checkpoints=False):
        """Make the staged outputs the complete run of OUT (collective).

        Parameters
        ----------
        config : dict or config object, optional
            Recorded in the manifest (JSON-able via :func:`flowpm_mtf.io.to_jsonable`).
        extra : dict, optional
            More JSON-able entries for the manifest.
        keep_checkpoints : bool
            Keep ``OUT/checkpoint`` (default: removed, the run is complete).

        Returns
        -------
        dict
            The manifest written (on every rank).
        """
        self.comm.barrier()  # every rank has finished writing into the staging directory
        box = {}
        self._collective(self._publish_rank0, config, extra, keep_checkpoints, box)
        self.published = True
        return self.comm.bcast(box.get("manifest"), root=0)

    def close(self):
        """Release the lock; a run that did not publish leaves no staging directory behind."""
        if self.comm.rank == 0 and self._lock_fd is not None and not self.published:
            shutil.rmtree(self.staging, ignore_errors=True)
        self._release()
        self.is_open = False

    # ------------------------------------------------------------------ rank 0
    def _lock(self):
        path = os.path.join(self.out, LOCK)
        for _ in range(5):  # retry if the previous owner unlinked the file under us
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise
                try:
                    with open(path) as f:
                        owner = json.load(f)
                    who = "%s run, host %s, pid %s, started %s" % (
                        owner.get("job"), owner.get("host"), owner.get("pid"), owner.get("started"))
                except (OSError, ValueError):
                    who = "owner unknown"
                raise OutputDirError("--out %s is in use by another run (%s); wait for it to end "
                                     "or choose another --out" % (self.out, who))
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        else:
            raise OutputDirError("could not lock %s (it keeps being replaced)" % path)
        owner = {"job": self.job, "host": socket.gethostname(), "pid": os.getpid(),
                 "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(owner).encode())
        os.fsync(fd)
        self._lock_fd = fd

    def _open_rank0(self):
        out = self.out
        if os.path.lexists(out) and not os.path.isdir(out):
            raise OutputDirError("--out %s exists and is not a directory; choose another --out"
                                 % out)
        os.makedirs(out, exist_ok=True)
        names = os.listdir(out)
        if names and not ({MANIFEST, LOCK, STAGING, CHECKPOINT} & set(names)):
            shown = sorted(names)[:3]
            raise OutputDirError("--out %s holds files that are not a flowpm-mtf run (%s%s); "
                                 "choose a new or empty directory"
                                 % (out, ", ".join(shown), ", ..." if len(names) > 3 else ""))
        self._lock()
        complete = read_manifest(out) is not None
        checkpoint = has_checkpoint(out)
        if self.resume:
            if not checkpoint:
                raise ResumeError("--resume %s: %s; run without --resume" % (
                    out, "the run there is complete, nothing to resume" if complete
                    else "no checkpoint in %s" % self.checkpoint_dir))
        elif not self.overwrite:
            if complete:
                raise OutputDirError("--out %s holds a complete run (%s); pass --overwrite to "
                                     "replace it or choose another --out" % (out, MANIFEST))
            if checkpoint:
                raise OutputDirError("--out %s holds an unfinished run with a checkpoint; pass "
                                     "--resume %s to continue it or --overwrite to start over"
                                     % (out, out))
        self._clean_leftovers(complete)
        os.makedirs(self.staging)
        probe = os.path.join(self.staging, ".probe-%d" % os.getpid())
        with open(probe, "wb") as f:  # writable: data, not only a directory entry
            f.write(b"flowpm-mtf")
            f.flush()
            os.fsync(f.fileno())
        os.remove(probe)
        log.info("run directory %s: %s", out, "resuming from its checkpoint" if self.resume
                 else "replacing the complete run there at publish" if complete
                 else "new run")

    def _clean_leftovers(self, complete):
        """Remove what a killed run left: staging, temporary files, a torn run's outputs."""
        removed = []
        for name in os.listdir(self.out):
            path = os.path.join(self.out, name)
            stale = name == STAGING or bool(_TMP_RE.search(name))
            # A torn run (no manifest) holds nothing valid; keep the checkpoint only.
            stale = stale or (not complete and not _is_infrastructure(name))
            stale = stale or (name == CHECKPOINT and not self.resume)  # overwrite: start over
            if stale:
                _remove(path)
                removed.append(name)
        if removed:
            log.warning("run directory %s: removed %s left by an earlier run",
                        self.out, ", ".join(sorted(removed)))

    def _publish_rank0(self, config, extra, keep_checkpoints, box):
        from .io import to_jsonable, versions

        files = []
        for root, dirs, names in os.walk(self.staging):
            dirs.sort()
            for name in sorted(names):
                path = os.path.join(root, name)
                rel = os.path.relpath(path, self.staging)
                files.append({"path": rel, "size": os.path.getsize(path),
                              "sha256": sha256_file(path)})
        manifest = {"format": MANIFEST_FORMAT, "job": self.job, "config": to_jsonable(config),
                    "files": files, "completed": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "versions": versions()}
        manifest.update(to_jsonable(extra or {}))
        # From here until the last rename OUT holds no manifest: a torn run.
        mpath = os.path.join(self.out, MANIFEST)
        if os.path.exists(mpath):
            os.remove(mpath)
            _fsync_dir(self.out)
        for name in os.listdir(self.out):  # the previous run's files
            if not _is_infrastructure(name):
                _remove(os.path.join(self.out, name))
        for name in os.listdir(self.staging):
            os.replace(os.path.join(self.staging, name), os.path.join(self.out, name))
        if not keep_checkpoints:
            shutil.rmtree(self.checkpoint_dir, ignore_errors=True)
        _fsync_dir(self.out)
        tmp = mpath + ".tmp"
        with open(tmp, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, mpath)
        _fsync_dir(self.out)
        shutil.rmtree(self.staging, ignore_errors=True)
        log.info("published %s: %d files, %s", self.out, len(files), MANIFEST)
        box["manifest"] = manifest

    def _check_every_rank_writes(self):
        """Every rank sees the staging directory rank 0 made and can write into it."""
        probe = os.path.join(self.staging, ".probe-rank%d" % self.comm.rank)
        try:
            with open(probe, "wb") as f:
                f.write(b"x")
            os.remove(probe)
            bad = None
        except OSError as e:
            bad = "%s (%s)" % (e.strerror or e, socket.gethostname())
        bad = [(r, b) for r, b in enumerate(self.comm.allgather(bad)) if b]
        if bad:
            raise OutputDirError("rank %d cannot write into %s: %s; OUT must be on a file "
                                 "system every rank sees" % (bad[0][0], self.staging, bad[0][1]))

    def _release(self):
        fd, self._lock_fd = self._lock_fd, None
        if fd is None:
            return
        try:  # unlink before unlocking; a waiter that got the old inode retries (see _lock)
            os.remove(os.path.join(self.out, LOCK))
        except OSError:
            pass
        os.close(fd)
