"""Writes that end alike on every rank: the collective error path and the disk-full rule.

A file written by several ranks (:func:`flowpm_mtf.runs.h5dist.write_distributed`,
the checkpoints), or by rank 0 inside :func:`collective` (the runner's outputs),
ends on every rank the same way: done, or one line naming the first failing rank
raised on every rank, never a hang. A full disk or an exhausted quota is the run
directory's fault, :class:`flowpm_mtf.errors.OutputDirError` (exit 5), also when it
reaches another rank as text (:func:`is_disk_full`, :func:`disk_full_error`); and an
HDF5 file is written only after its space was reserved (:func:`reserve_space`), so
that HDF5 never meets a full disk when it closes the file.
"""
import errno
import os
import re

from ..errors import FlowpmError, OutputDirError, error_from_name

__all__ = ["DISK_FULL_ERRNOS", "is_disk_full", "disk_full_error", "reserve_space",
           "HDF5_OVERHEAD_BYTES", "collective"]


# ----------------------------------------------------------------------------- disk full
#: ``errno`` values of a full disk or an exhausted quota: the run directory's
#: fault (:class:`flowpm_mtf.errors.OutputDirError`, exit 5), not an internal error.
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# The same in the text of an error that wraps the OSError (h5py, TensorFlow, another rank).
_DISK_FULL_TEXT = re.compile(r"\[Errno (%s)\]|%s" % (
    "|".join(str(e) for e in DISK_FULL_ERRNOS),
    "|".join(re.escape(os.strerror(e)) for e in DISK_FULL_ERRNOS)), re.IGNORECASE)


def is_disk_full(exc):
    """Whether ``exc`` (an exception, or its text) says the disk or the quota is full.

    Parameters
    ----------
    exc : BaseException or str or None

    Returns
    -------
    bool
        True for an ``OSError`` with ``errno`` ENOSPC or EDQUOT, or an error
        whose text names them (h5py, TensorFlow and other ranks pass them on as
        text).
    """
    if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
        return True
    return exc is not None and bool(_DISK_FULL_TEXT.search(str(exc)))


def disk_full_error(what, exc):
    """The one-line :class:`OutputDirError` (exit 5) for a full disk while doing ``what``.

    Parameters
    ----------
    what : str
        E.g. ``"writing /out/.staging/snapshot.h5"``.
    exc : BaseException or str
        The original error (its first line is kept).

    Returns
    -------
    OutputDirError
    """
    text = (str(exc).strip().splitlines() or [""])[0]
    return OutputDirError("no space left on device (or disk quota exceeded) %s: %s; nothing was "
                          "published and the previous complete run of the run directory, if "
                          "any, is intact; free space (or raise the quota) and run again"
                          % (what, text))


#: Bytes reserved beyond the data of an HDF5 file (object headers, attributes,
#: virtual-dataset mappings; see :func:`reserve_space`).
HDF5_OVERHEAD_BYTES = 1 << 20


def reserve_space(path, nbytes):
    """Fail now, with a plain ``OSError`` (ENOSPC/EDQUOT), if ``nbytes`` do not fit at ``path``.

    HDF5 keeps metadata (and small datasets) in its cache and writes them when
    the file is closed; a disk that fills up then leaves the library with a
    file it can neither flush nor close (an error from a destructor, a crash at
    exit). So an HDF5 file is written only after its size (data plus
    :data:`HDF5_OVERHEAD_BYTES`) was allocated once in a scratch file
    (``posix_fallocate``: real blocks, charged to the quota) and freed again.
    Another process filling the disk in between can still defeat it.

    Parameters
    ----------
    path : str
        The file about to be written (the scratch file is ``path.reserve.tmp-<pid>``).
    nbytes : int
        Bytes to reserve.

    Raises
    ------
    OSError
        With ``errno`` ENOSPC or EDQUOT, before anything was written.
    """
    nbytes = int(nbytes)
    if nbytes <= 0 or not hasattr(os, "posix_fallocate"):
        return
    scratch = "%s.reserve.tmp-%d" % (path, os.getpid())
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno in DISK_FULL_ERRNOS:
            raise OSError(exc.errno, os.strerror(exc.errno), path) from None
        # No fallocate on this file system (EINVAL, EOPNOTSUPP): nothing reserved.
    finally:
        os.close(fd)
        os.remove(scratch)


# ----------------------------------------------------------------------------- every rank
def _describe(error):
    """``(class name, text)`` of a rank's error, as :func:`_agree` sends it."""
    if error is None or isinstance(error, tuple):
        return error
    if isinstance(error, FlowpmError):  # keeps its class (and exit code) on every rank
        name, text = type(error).__name__, str(error)
    elif isinstance(error, BaseException):
        name, text = "FlowpmError", "%s: %s" % (type(error).__name__, error)
    else:
        name, text = "FlowpmError", str(error)
    return name, text


def _agree(comm, error, what):
    """Raise on every rank if any rank reported an error (one line naming the first).

    Parameters
    ----------
    comm : object
        mpi4py-like communicator.
    error : None, str or BaseException
        This rank's error (``None``: none).
    what : str
        What was being done.

    Raises
    ------
    FlowpmError
        The same on every rank: :class:`OutputDirError` (exit 5) if the first
        failing rank ran out of disk space or quota, the class of a
        :class:`FlowpmError` it raised, else :class:`FlowpmError`.
    """
    errors = comm.allgather(_describe(error))
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if bad:
        r, (name, text) = bad[0]
        where = "rank %d%s" % (r, " (and %d other ranks)" % (len(bad) - 1) if len(bad) > 1
                               else "")
        if name != "OutputDirError" and is_disk_full(text):
            raise disk_full_error("%s on %s" % (what, where), text)
        raise error_from_name(name, "%s failed on %s: %s" % (what, where, text))


def collective(comm, local, root, what):
    """Run ``local()`` on every rank, then ``root(merged)`` on rank 0; errors reach every rank.

    Parameters
    ----------
    comm : object
        mpi4py-like communicator.
    local : callable
        ``() -> dict`` of this rank's results (e.g. the files it wrote).
    root : callable
        ``(merged dict of all ranks) -> None``, run on rank 0 only.
    what : str
        What is being done, for the error message.

    Returns
    -------
    dict
        The merged results, on every rank.

    Raises
    ------
    FlowpmError
        On every rank if ``local`` failed on any rank or ``root`` failed (one
        line naming the rank), never a hang.
    """
    mine, error = {}, None
    try:
        mine = local()
    except Exception as exc:  # reported on every rank below
        error = exc
    _agree(comm, error, what)
    merged = {}
    for m in comm.allgather(mine):
        merged.update(m)
    error = None
    if comm.rank == 0:
        try:
            root(merged)
        except Exception as exc:
            error = exc
    _agree(comm, error, what)
    return merged
