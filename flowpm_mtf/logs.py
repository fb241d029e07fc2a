"""Logging set-up for multi-process runs.

Every record is prefixed with the MPI rank and the wall-clock time elapsed since
:func:`setup_logging` was first called::

    [rank 1 +12.3s] INFO flowpm_mtf.physics.nbody: step 4/10, a=0.52

Modules obtain their logger with ``logging.getLogger(__name__)``; progress
messages that every rank would repeat identically are restricted to rank 0 with
:func:`rank0_only` (or by attaching :class:`Rank0Filter` to a logger or handler).

The rank is read from the environment variables set by the common launchers
(Open MPI, MPICH/Intel MPI/Hydra, Slurm, Horovod's ``horovodrun``), so this module
never imports MPI or Horovod.
"""
import logging
import os
import sys
import time

__all__ = ["RANK_ENV_VARS", "SIZE_ENV_VARS", "detect_rank", "detect_size", "setup_logging", "RankFormatter", "Rank0Filter",
           "rank0_only"]

#: Environment variables holding the process rank, in order of precedence.
RANK_ENV_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID", "HOROVOD_RANK")
#: Environment variables holding the number of processes, in the same order.
SIZE_ENV_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "SLURM_NTASKS", "HOROVOD_SIZE")

_HANDLER_NAME = "flowpm_mtf.logs"


def detect_rank(environ=None):
    """Rank of this process as announced by the launcher.

    Parameters
    ----------
    environ : mapping, optional
        Environment to inspect (default ``os.environ``).

    Returns
    -------
    int
        The value of the first variable of :data:`RANK_ENV_VARS` that is set to an
        integer, or 0 when none is (a plain single-process run).
    """
    return _from_launcher(environ)[0]


def detect_size(environ=None):
    """Number of processes of the job (:data:`SIZE_ENV_VARS` of the launcher that gave
    the rank in :func:`detect_rank`), or 1; ``environ`` as there."""
    return _from_launcher(environ)[1]


def _from_launcher(environ):
    """(rank, size) from the first launcher of :data:`RANK_ENV_VARS` that set a rank."""
    environ = os.environ if environ is None else environ

    def number(name):
        value = environ.get(name, "").strip()
        return int(value) if value.isdigit() else None

    # A launcher that sets both wins: srun --mpi=pmix sets PMIX_RANK without a
    # PMIX_SIZE, so its size comes from SLURM_NTASKS further down the list.
    for rank_name, size_name in zip(RANK_ENV_VARS, SIZE_ENV_VARS):
        if number(rank_name) is not None and number(size_name) is not None:
            return number(rank_name), number(size_name)
    for rank_name in RANK_ENV_VARS:
        if number(rank_name) is not None:
            return number(rank_name), 1
    return 0, 1


class RankFormatter(logging.Formatter):
    """Formatter adding ``[rank R +T s]`` in front of ``LEVEL name: message``.

    Parameters
    ----------
    rank : int
        Rank written into every record.
    start_time : float
        Reference time [s since the epoch, as ``time.time()``] for the elapsed time.
    """

    def __init__(self, rank, start_time):
        super().__init__("%(levelname)s %(name)s: %(message)s")
        self.rank = int(rank)
        self.start_time = float(start_time)

    def format(self, record):
        elapsed = record.created - self.start_time
        return "[rank %d +%.1fs] %s" % (self.rank, elapsed, super().format(record))


class Rank0Filter(logging.Filter):
    """Logging filter letting records through on rank 0 only.

    Parameters
    ----------
    rank : int, optional
        Rank of this process (default: :func:`detect_rank`).
    """

    def __init__(self, rank=None):
        super().__init__()
        self.rank = detect_rank() if rank is None else int(rank)

    def filter(self, record):
        return self.rank == 0


def rank0_only(logger, rank=None):
    """Make ``logger`` emit on rank 0 only; returns the logger.

    Use it for progress messages that all ranks would repeat identically::

        log = rank0_only(logging.getLogger(__name__ + ".progress"))

    Calling it twice on the same logger adds a single filter.

    Parameters
    ----------
    logger : logging.Logger or str
        A logger, or the name of one.
    rank : int, optional
        Rank of this process (default: :func:`detect_rank`).

    Returns
    -------
    logging.Logger
    """
    if isinstance(logger, str):
        logger = logging.getLogger(logger)
    for existing in logger.filters:
        if isinstance(existing, Rank0Filter):
            existing.rank = detect_rank() if rank is None else int(rank)
            return logger
    logger.addFilter(Rank0Filter(rank))
    return logger


def setup_logging(level="INFO", rank=None, stream=None):
    """Configure the root logger with a rank and elapsed-time prefix.

    Idempotent: a second call updates the level (and the rank, if given) of the
    handler installed by the first one instead of adding another handler, points
    it at the current ``sys.stderr`` when the first call gave no ``stream``, and
    keeps the original start time.

    Parameters
    ----------
    level : str or int, optional
        Level of the root logger and of the handler (default ``"INFO"``).
    rank : int, optional
        Rank written into the prefix (default: :func:`detect_rank`).
    stream : file-like, optional
        Destination of the records (default ``sys.stderr``); only used by the
        first call.

    Returns
    -------
    logging.Handler
        The handler installed on the root logger.
    """
    if isinstance(level, str):
        level = logging.getLevelName(level.upper())
        if not isinstance(level, int):
            raise ValueError("unknown logging level %r" % (level,))
    root = logging.getLogger()
    handler = next((h for h in root.handlers if h.get_name() == _HANDLER_NAME), None)
    if handler is None:
        handler = logging.StreamHandler(sys.stderr if stream is None else stream)
        handler.set_name(_HANDLER_NAME)
        handler.setFormatter(RankFormatter(detect_rank() if rank is None else rank, time.time()))
        handler.follows_stderr = stream is None
        root.addHandler(handler)
    else:
        if rank is not None:
            handler.formatter.rank = int(rank)
        if getattr(handler, "follows_stderr", False) and handler.stream is not sys.stderr:
            # follow the current stderr: the one of the first call may be gone (replaced
            # and closed, e.g. by a test's capture), and writing there fails per record
            # (not setStream: it flushes the old stream, which may be closed)
            handler.acquire()
            try:
                handler.stream = sys.stderr
            finally:
                handler.release()
    handler.setLevel(level)
    root.setLevel(level)
    return handler
