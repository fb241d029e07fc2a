"""Replacing a run directory by another in one step, and removing the one replaced.

A complete run ``OUT = P/B`` is replaced by the new complete run built next to it
(``P/.B.flowpm-new``, :func:`swap_paths`): :func:`swap_in` swaps the two with one
``renameat2(RENAME_EXCHANGE)`` (a reader of OUT sees the old complete run, then the new
one, never anything else), or, where the file system has no exchange (NFS, Lustre,
GPFS...), with two renames: OUT to ``P/.B.flowpm-old``, then the new run to OUT (between
them OUT is absent, and :func:`flowpm_mtf.runs.rundir_manifest.locate` finds the run
beside it). :class:`flowpm_mtf.runs.rundir.RunDir` swaps when it publishes over a
complete run and when it recovers a killed publish.
"""
import ctypes
import errno
import logging
import os
import shutil

from .writers import fsync_path

__all__ = ["swap_paths", "swap_in"]

log = logging.getLogger(__name__)

# renameat2(2) flag: swap two paths atomically (Linux >= 3.15, most local file systems).
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
# What renameat2 returns where the file system (or the C library) has no exchange.
_NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP}


def swap_paths(out):
    """``(P/.B.flowpm-new, P/.B.flowpm-old)``: where a run replacing ``out = P/B`` passes."""
    parent, base = os.path.split(os.path.abspath(os.fspath(out)))
    return (os.path.join(parent, ".%s.flowpm-new" % base),
            os.path.join(parent, ".%s.flowpm-old" % base))


class _NoExchange(Exception):
    """The file system (or the C library) cannot swap two paths atomically."""


def _exchange(a, b):
    """Swap the directory entries ``a`` and ``b`` atomically (``renameat2(RENAME_EXCHANGE)``).

    Raises
    ------
    _NoExchange
        Not supported here (then two renames do it, see :func:`swap_in`).
    OSError
        Any other failure (nothing was changed).
    """
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        raise _NoExchange("no renameat2 in the C library") from None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        if err in _NO_EXCHANGE:
            raise _NoExchange(os.strerror(err))
        raise OSError(err, os.strerror(err), a, None, b)


def swap_in(out, src):
    """Put the directory ``src`` (a sibling of OUT) at OUT; the path now holding the old OUT.

    One ``RENAME_EXCHANGE`` where supported; else OUT is renamed to the
    other sibling name and ``src`` to OUT (put back if the second rename
    fails).
    """
    parent = os.path.dirname(out)
    try:
        _exchange(src, out)
        fsync_path(parent)
        return src
    except _NoExchange:
        pass
    new, old = swap_paths(out)
    aside = old if src != old else new
    if os.path.lexists(aside):
        _remove(aside)
    os.rename(out, aside)      # OUT is absent from here ...
    try:
        os.rename(src, out)    # ... to here
    except OSError:
        try:
            os.rename(aside, out)
        except OSError:
            log.error("run directory %s: the previous run is at %s; the next run on this "
                      "--out puts it back", out, aside)
        raise
    fsync_path(parent)
    return aside


def _remove(path):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def _remove_tree(path):
    """Delete a run tree that is no longer OUT; a failure only leaves it for the next start."""
    try:
        _remove(path)
    except OSError as e:
        log.warning("could not remove %s (%s); the next run on this --out removes it",
                    path, e.strerror or e)
