"""Run directories: a run never destroys or mixes results.

Every job writes into one directory ``OUT`` (``--out``), laid out as::

    OUT/manifest.json     written LAST: job, config, generation, every output file with
                          size and digest (:mod:`flowpm_mtf.runs.digest`)
    OUT/<outputs>         the files of the run the manifest describes (with the
                          per-rank ``*.parts/`` folders of :mod:`flowpm_mtf.runs.h5dist`)
    OUT/.lock             while a run is active: fcntl lock held by rank 0, owner inside
    OUT/.staging/         outputs being written; becomes the new run at publish
    OUT/checkpoint/       checkpoints of an unfinished run (owned by flowpm_mtf.runs.checkpoint)

and, next to OUT, only while a complete run is being replaced (``P/B`` = OUT)::

    P/.B.flowpm-new/      the new complete run, on its way into OUT
    P/.B.flowpm-old/      the previous run, on its way out (deleted)

A directory with a valid manifest is a **complete** run; without one it is torn
(a killed run) and holds nothing a reader should use. Each manifest carries a
``generation`` (the previous run's plus one): of two complete copies of OUT,
the higher generation is the newer run.

Life of a run (:class:`RunDir`)
-------------------------------
1. :meth:`RunDir.open` (before any graph is built; rank 0 acts, the verdict is
   broadcast through ``comm`` so every rank raises the same error):

   * OUT must be creatable and writable (a probe file is written);
   * a second run on the same OUT fails at once (non-blocking lock), naming the
     owner's host and pid;
   * an interrupted publish is finished (see *Recovery*);
   * an OUT holding a complete run is refused unless ``overwrite``; one holding
     an unfinished run with a checkpoint is refused unless ``resume`` or
     ``overwrite``; a non-empty directory that is not a run directory is
     always refused (nothing of the user's is ever deleted);
   * leftovers of a killed run (staging directory, ``*.tmp-*`` files, outputs
     of a torn publish, the checkpoint of a complete run) are removed.

2. The job writes its outputs into :attr:`RunDir.staging` (all ranks may).
   An ``--overwrite``n run stays complete and untouched until step 3.
3. :meth:`RunDir.publish` (collective; rank 0 acts): the manifest of the staged
   files is written **into the staging directory** (which is then a complete run
   by itself), then

   * *OUT holds no complete run* (new, torn, or only a checkpoint): the staged
     entries are renamed into OUT, ``manifest.json`` last, then the checkpoint
     is removed. A kill before the manifest's rename leaves a torn run (and the
     checkpoint: ``--resume`` still works); nothing complete existed to lose.
   * *OUT holds a complete run*: the new run replaces it as one directory:
     ``OUT/.staging`` is renamed to ``P/.B.flowpm-new`` and swapped with OUT by
     ``renameat2(RENAME_EXCHANGE)`` (one atomic step: a reader of OUT sees the
     old complete run, then the new one, never anything else); the old run,
     now at ``P/.B.flowpm-new``, is deleted. Where the file system has no
     exchange (NFS, Lustre, GPFS...), two renames do it: OUT to
     ``P/.B.flowpm-old``, then ``P/.B.flowpm-new`` to OUT; between them (a few
     microseconds, or until the next start after a kill exactly there) OUT is
     absent and :func:`locate` finds the complete run next to it.
4. :meth:`RunDir.close` releases the lock (and drops the staging directory of a
   run that failed).

Recovery (at the next :meth:`RunDir.open`, of any run on OUT)
-------------------------------------------------------------
If ``P/.B.flowpm-new`` or ``P/.B.flowpm-old`` exists, a publish was killed. Of
OUT and these two, the complete one (manifest present, every listed file with
its size) of the highest generation becomes OUT (OUT itself on a tie) and the
others are deleted; if none is complete, what was OUT stays OUT (with its
checkpoint) and the siblings are deleted. So a publish killed before its new
run left ``OUT/.staging`` keeps the old run; one killed later ends with the new
run, as if it had finished. Recovery is itself safe to kill (it is the same
swap) and is redone by the next start.

Notes
-----
``fcntl.flock`` locks work on local file systems and on NFS (Linux emulates
them with POSIX locks); on Lustre the client must be mounted with ``-o flock``.
While a run holds OUT it also holds the lock files of the ``.B.flowpm-*``
directories, so no other run starts on OUT while OUT is swapped.
Replacing a complete run needs the parent of OUT to be writable and on the same
file system (OUT not a mount point); :meth:`RunDir.open` checks it.
The staging directory must be visible to every rank that writes into it (a
shared file system), which :meth:`RunDir.open` checks when ``all_ranks_write``.
A disk or quota that fills up gives :class:`~flowpm_mtf.errors.OutputDirError`
(exit 5) and leaves the previous complete run untouched.
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

from ..backend import SerialComm
from ..errors import FlowpmError, OutputDirError, error_from_name
from . import digest
from .collective import disk_full_error, is_disk_full
from .h5dist_part import known_digest
# Re-exported: the readers' side of a run directory (docs/running.md names it rundir.*).
from .rundir_manifest import (CHECKPOINT, MANIFEST, MANIFEST_FORMAT, _complete,  # noqa: F401
                              generation, has_checkpoint, locate, nothing_to_resume,
                              read_manifest, verify_manifest)
from .rundir_swap import _remove, _remove_tree, swap_in, swap_paths
from .writers import fsync_path

__all__ = ["MANIFEST", "LOCK", "STAGING", "CHECKPOINT", "MANIFEST_FORMAT", "read_manifest",
           "verify_manifest", "has_checkpoint", "swap_paths", "locate",
           "generation", "RunDir"]

log = logging.getLogger(__name__)

LOCK = ".lock"
STAGING = ".staging"
# Temporary names of flowpm_mtf.runs.writers (``<file>.tmp-<pid>``) and of this module.
_TMP_RE = re.compile(r"\.tmp-\d+$|\.tmp$")


def _is_infrastructure(name):
    return name.startswith(".") or name in (MANIFEST, CHECKPOINT)


def _write_json(path, obj):
    """Write JSON under ``path + .tmp``, fsync, rename onto ``path`` (atomic)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
        # The real path: OUT may be a symlink to the directory, which is what is swapped.
        self.out = os.path.realpath(os.path.abspath(os.fspath(out)))
        self.job = str(job)
        self.comm = comm if comm is not None else SerialComm()
        self.overwrite = bool(overwrite)
        self.resume = bool(resume)
        self.all_ranks_write = bool(all_ranks_write)
        self.published = False
        self.is_open = False
        self._lock_fd = None     # the lock at OUT/.lock
        self._other_locks = []   # locks of trees on their way out (closed when removed)

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
                what = "%s%s" % (e.strerror or e, " (%s)" % e.filename if e.filename else "")
                if is_disk_full(e):
                    err = ("OutputDirError", str(disk_full_error("in --out %s" % self.out, what)))
                else:
                    err = ("OutputDirError", "cannot use --out %s: %s" % (self.out, what))
        err = self.comm.bcast(err, root=0)
        if err is not None:
            raise error_from_name(*err)

    def open(self):
        """Check, lock, recover and prepare OUT (collective; before building any graph).

        Raises
        ------
        OutputDirError
            OUT not creatable/writable, in use by another run, holding a
            complete run (without ``overwrite``) or an unfinished checkpointed
            run (without ``resume``/``overwrite``), holding files that are
            not a run of this program, or a complete run that cannot be
            replaced atomically (its parent not writable, OUT a mount point).
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

        Atomic for readers: OUT holds the previous complete run until, in one
        step, it holds the new one (see the module documentation).

        Parameters
        ----------
        config : dict or config object, optional
            Recorded in the manifest (JSON-able via :func:`flowpm_mtf.runs.writers.to_jsonable`).
        extra : dict, optional
            More JSON-able entries for the manifest.
        keep_checkpoints : bool
            Keep ``OUT/checkpoint`` (default: removed, the run is complete).

        Returns
        -------
        dict
            The manifest written (on every rank).

        Raises
        ------
        OutputDirError
            On every rank, if publishing failed (e.g. the disk is full); the
            previous complete run of OUT is then untouched.
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

    # ------------------------------------------------------------------ rank 0: locks
    def _lock_file(self, tree):
        """Lock ``tree/.lock`` (non-blocking) and write the owner into it; the fd.

        Raises
        ------
        OutputDirError
            Another process holds it.
        FileNotFoundError
            ``tree`` is gone (moved by a publish): the caller scans again.
        """
        path = os.path.join(tree, LOCK)
        for _ in range(5):  # retry if the previous owner unlinked the file under us
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            self._other_locks.append(fd)  # released by _release whatever happens next
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                self._close_lock(fd)
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
            self._close_lock(fd)
        else:
            raise OutputDirError("could not lock %s (it keeps being replaced)" % path)
        owner = {"job": self.job, "host": socket.gethostname(), "pid": os.getpid(),
                 "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        try:
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps(owner).encode())
            os.fsync(fd)
        except OSError:
            self._close_lock(fd)
            raise
        return fd

    def _close_lock(self, fd):
        """Close a lock of ``_other_locks`` (its tree is gone, or not ours)."""
        self._other_locks.remove(fd)
        os.close(fd)

    def _take_lock(self, fd):
        """Make ``fd`` (of ``_other_locks``) the lock at OUT/.lock."""
        self._other_locks.remove(fd)
        self._lock_fd = fd

    def _trees(self):
        """Existing directories among OUT and its swap siblings, in that order."""
        return [t for t in (self.out,) + swap_paths(self.out)
                if os.path.isdir(t) and not os.path.islink(t)]

    def _lock_trees(self):
        """Lock OUT and any swap sibling (a killed publish); ``{tree: fd}``.

        A live publish holds the locks of every tree it moves, so taking all
        of them means no other run is touching OUT; a tree that moved while we
        locked makes us scan again.
        """
        for _ in range(10):
            trees = self._trees()
            if not trees:
                os.makedirs(self.out, exist_ok=True)
                continue
            if self.out in trees:
                self._refuse_foreign()
            fds = {}
            try:
                for t in trees:
                    fds[t] = self._lock_file(t)
                if self._trees() == trees:
                    return fds
            except FileNotFoundError:
                pass
            for fd in fds.values():
                self._close_lock(fd)
        raise OutputDirError("could not lock --out %s (it keeps being replaced)" % self.out)

    def _refuse_foreign(self):
        names = os.listdir(self.out)
        if names and not ({MANIFEST, LOCK, STAGING, CHECKPOINT} & set(names)):
            shown = sorted(names)[:3]
            raise OutputDirError("--out %s holds files that are not a flowpm-mtf run (%s%s); "
                                 "choose a new or empty directory"
                                 % (self.out, ", ".join(shown), ", ..." if len(names) > 3
                                    else ""))

    # ------------------------------------------------------------------ rank 0: open
    def _open_rank0(self):
        out = self.out
        if os.path.lexists(out) and not os.path.isdir(out):
            raise OutputDirError("--out %s exists and is not a directory; choose another --out"
                                 % out)
        locks = self._lock_trees()
        self._recover(locks)
        for fd in locks.values():  # every lock not at OUT belongs to a tree that is gone now
            if fd != self._lock_fd:
                self._close_lock(fd)
        manifest = read_manifest(out)
        complete = manifest is not None
        if complete and manifest.get("checkpoint_kept") is False and os.path.isdir(
                self.checkpoint_dir):  # a publish killed before it removed the checkpoint
            _remove(self.checkpoint_dir)
            log.warning("run directory %s: removed the checkpoint of the complete run there", out)
        checkpoint = has_checkpoint(out)
        if self.resume:
            if not checkpoint:
                raise nothing_to_resume(out)
        elif not self.overwrite:
            if complete:
                raise OutputDirError("--out %s holds a complete run (%s); pass --overwrite to "
                                     "replace it or choose another --out" % (out, MANIFEST))
            if checkpoint:
                from .checkpoint import resume_hint

                raise OutputDirError("--out %s holds an unfinished run with a checkpoint; %s"
                                     % (out, resume_hint(out, self.job)))
        if complete:
            self._check_can_swap()
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

    def _check_can_swap(self):
        """A complete run is replaced by a swap next to OUT: its parent must allow it."""
        parent = os.path.dirname(self.out)
        if not os.access(parent, os.W_OK | os.X_OK):
            why = "its parent %s is not writable" % parent
        elif os.stat(parent).st_dev != os.stat(self.out).st_dev:
            why = "it is a mount point"
        else:
            return
        raise OutputDirError("--out %s holds a complete run that cannot be replaced atomically "
                             "(%s; the new run is built next to it and swapped in); remove its "
                             "%s to discard the old run, or choose another --out"
                             % (self.out, why, MANIFEST))

    def _recover(self, locks):
        """Finish a publish that was killed: one complete run at OUT, no sibling left.

        Of OUT and the swap siblings, the complete tree with the highest
        generation (OUT on a tie) becomes OUT; without any complete tree, what
        was OUT stays (or the sibling that was OUT comes back). Sets
        ``self._lock_fd`` to the lock of the tree at OUT.
        """
        out = self.out
        new, old = swap_paths(out)
        trees = [t for t in (out, new, old) if t in locks]
        if trees == [out]:
            self._take_lock(locks[out])
            return
        found = {t: _complete(t) for t in trees}
        ranked = sorted((t for t in trees if found[t] is not None),
                        key=lambda t: (generation(found[t]), t == out), reverse=True)
        if ranked:
            winner = ranked[0]
        else:  # nothing complete: keep what was OUT (a torn run, its checkpoint)
            winner = out if out in locks else (old if old in locks else new)
        for t in trees:
            if t not in (winner, out):
                _remove(t)  # a failure here leaves OUT as it was: the next start retries
        if winner == out:
            self._take_lock(locks[out])
        elif out in locks:
            previous = swap_in(self.out, winner)
            self._take_lock(locks[winner])
            _remove_tree(previous)
        else:
            os.rename(winner, out)
            fsync_path(os.path.dirname(out))
            self._take_lock(locks[winner])
        m = found.get(winner)
        log.warning("run directory %s: finished a publish that was killed: kept %s", out,
                    "the %s run completed %s (generation %d)" % (
                        m.get("job"), m.get("completed"), generation(m)) if m
                    else "the unfinished run that was there")

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

    # ------------------------------------------------------------------ rank 0: publish
    def _publish_rank0(self, config, extra, keep_checkpoints, box):
        from .writers import to_jsonable, versions

        files = []
        for root, dirs, names in os.walk(self.staging):
            dirs.sort()
            for name in sorted(names):
                path = os.path.join(root, name)
                rel = os.path.relpath(path, self.staging)
                if rel in (MANIFEST, LOCK) or _TMP_RE.search(name):
                    continue
                fsync_path(path)  # on disk before the manifest that vouches for it
                # part files were hashed while written (h5dist_part.known_digest)
                files.append({"path": rel, "size": os.path.getsize(path),
                              digest.DIGEST: known_digest(path) or digest.file_digest(path)})
        previous = read_manifest(self.out)
        keep = bool(keep_checkpoints) and has_checkpoint(self.out)
        manifest = {"format": MANIFEST_FORMAT, "job": self.job, "config": to_jsonable(config),
                    "files": files, "completed": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "versions": versions(), "generation": generation(previous) + 1,
                    "checkpoint_kept": keep}
        manifest.update(to_jsonable(extra or {}))
        # The staging directory becomes a complete run by itself (manifest last).
        _write_json(os.path.join(self.staging, MANIFEST), manifest)
        fsync_path(self.staging)
        if previous is None:
            self._publish_in_place(keep)
        else:
            self._publish_swap(keep)
        log.info("published %s: %d files, %s (generation %d)", self.out, len(files), MANIFEST,
                 manifest["generation"])
        box["manifest"] = manifest

    def _publish_in_place(self, keep):
        """OUT holds no complete run: move the staged entries in, the manifest last."""
        for name in sorted(os.listdir(self.staging)):
            if name != MANIFEST:
                os.replace(os.path.join(self.staging, name), os.path.join(self.out, name))
        fsync_path(self.out)
        os.replace(os.path.join(self.staging, MANIFEST), os.path.join(self.out, MANIFEST))
        fsync_path(self.out)
        if not keep:
            shutil.rmtree(self.checkpoint_dir, ignore_errors=True)
        shutil.rmtree(self.staging, ignore_errors=True)

    def _publish_swap(self, keep):
        """OUT holds a complete run: swap the staged run in as one directory."""
        new, _ = swap_paths(self.out)
        if os.path.lexists(new):  # not ours any more (open removed it): never overwrite
            raise OutputDirError("cannot publish: %s exists" % new)
        fd = self._lock_file(self.staging)  # the new tree's lock: OUT stays locked after the swap
        os.rename(self.staging, new)
        fsync_path(self.out)
        fsync_path(os.path.dirname(self.out))
        try:
            previous = swap_in(self.out, new)
        except OSError:
            if os.path.isdir(new) and read_manifest(self.out) is not None:
                _remove_tree(new)  # OUT still holds the previous run: drop the new one
            raise
        old_fd = self._lock_fd
        self._take_lock(fd)
        self._other_locks.append(old_fd)
        if keep and os.path.isdir(os.path.join(previous, CHECKPOINT)):
            os.rename(os.path.join(previous, CHECKPOINT), self.checkpoint_dir)
        _remove_tree(previous)
        self._close_lock(old_fd)  # the old run's lock, deleted with it

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
        for fd in self._other_locks:
            os.close(fd)
        self._other_locks = []
        fd = self._lock_fd
        if fd is None:
            return
        try:  # unlink before unlocking; a waiter that got the old inode retries (see _lock_file)
            os.remove(os.path.join(self.out, LOCK))
        except OSError:
            pass
        self._lock_fd = None
        os.close(fd)
