"""Horovod start-up, process-set registry, TF thread pools and fail-fast hooks.

Everything here is per process and idempotent. Horovod is initialised once with
*dynamic* process sets so that any number of :class:`~hvd_mesh_impl.HvdSimdMeshImpl`
objects, of different shapes, can live in one program: each registers the
process sets of its mesh axes through :func:`process_set_for`, which every rank
calls with the same arguments in the same order.

Exit. Horovod registers ``hvd.shutdown`` with ``atexit``; a rank that reaches
the end of its program first would shut Horovod down while other ranks are
still inside a collective of their own process set (e.g. the last
``allconcat`` of an export on another mesh row), and those fail with "Horovod
has been shut down". :func:`init` therefore registers an **exit barrier**
(after Horovod's own handler, so it runs first): at a normal exit every rank
waits until all ranks reach their exit, then Horovod shuts down. After an
uncaught exception the handler aborts the MPI job instead (the other ranks may
be waiting for this one in a collective). See :func:`exit_barrier`.
"""
import atexit
import logging
import os
import socket
import sys
import threading
import time

import horovod
import horovod.tensorflow as hvd
from mpi4py import MPI

from . import liveness

log = logging.getLogger(__name__)

_lock = threading.Lock()
_process_sets = {}  # tuple(ranks) -> hvd.ProcessSet
_exit = {"comm": None, "done": False}  # the exit barrier's communicator (a Dup), state

FUSION_THRESHOLD_BYTES = 4 << 20
"""Default of ``HOROVOD_FUSION_THRESHOLD`` set by :func:`init` [bytes] (Horovod's own: 128 MiB).

Workaround of Horovod's memory use: the first time Horovod fuses two
collectives (allreduce, allgather) it allocates a fusion buffer of the whole
threshold through TensorFlow's allocator, and keeps it for the life of the
process. With the default that is 128 MiB on every rank of a multi-rank run
(measured: the largest single live buffer of the initial conditions on 2x2),
while our fused collectives are scalars and P(k) bins. A collective larger
than the threshold simply runs unfused, on its own buffers. A value already
in the environment (e.g. ``HOROVOD_FUSION_THRESHOLD=134217728``) is kept."""

PATCHED_HOROVOD_VERSION = "0.28.1+flowpm.2"
"""``horovod.__version__`` of the build ``scripts/setup_env.sh`` makes from the PyPI source
with ``patches/horovod-0.28.1-flowpm.patch``.

The patch re-anchors the cycle of Horovod's background thread at the collective that
synchronises all ranks every cycle. Upstream, a rank whose cycle starts early
busy-polls in that collective for its phase offset to the latest rank, every cycle:
idle ranks burnt up to a full core each here (0.02 and 1.00 of a core on 2 ranks,
0.21-0.71 on 4 oversubscribed ranks; patched: 0.03-0.05), taken from TensorFlow's
threads whenever the rank computes while its collectives wait. It also imports
``SyncBatchNormalization`` on first use, so that ``import horovod.tensorflow`` does not
load Keras. :func:`init` warns on another build (it works, only slower)."""

EXIT_BARRIER_TIMEOUT_S = 1800.0
"""Default of ``FLOWPM_MTF_EXIT_TIMEOUT``: seconds a rank waits at exit for the others
before it aborts the job (0: wait forever)."""


def init(comm=None):
    """Initialise Horovod on ``comm`` (default ``MPI.COMM_WORLD``) once.

    Parameters
    ----------
    comm : mpi4py.MPI.Comm, optional
        Communicator whose ranks become Horovod's ranks.

    Returns
    -------
    mpi4py.MPI.Comm
        The communicator Horovod runs on.

    Raises
    ------
    RuntimeError
        If Horovod was already initialised on a communicator of another size,
        or without dynamic process sets.

    Notes
    -----
    When this call starts Horovod it also registers the exit barrier (module
    docstring), and sets ``HOROVOD_FUSION_THRESHOLD`` to
    :data:`FUSION_THRESHOLD_BYTES` unless it is set. ``FLOWPM_MTF_EXIT_BARRIER=0`` disables it (only to reproduce
    the exit race in tests).
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    with _lock:
        if not hvd.is_initialized():
            # Dynamic process sets let several meshes register their axes later.
            os.environ.setdefault("HOROVOD_DYNAMIC_PROCESS_SETS", "1")
            # Small fusion buffer (read by Horovod at init): FUSION_THRESHOLD_BYTES.
            os.environ.setdefault("HOROVOD_FUSION_THRESHOLD", str(FUSION_THRESHOLD_BYTES))
            hvd.init(comm=comm, process_sets="dynamic")  # registers hvd.shutdown at exit
            log.debug("horovod initialised: rank %d of %d", hvd.rank(), hvd.size())
            if hvd.size() > 1 and not horovod_patched():
                log.warning("Horovod %s is not the patched build %s of scripts/setup_env.sh: "
                            "its background thread busy-polls up to a core per rank "
                            "(see hvd_mesh_impl.runtime.PATCHED_HOROVOD_VERSION)",
                            horovod.__version__, PATCHED_HOROVOD_VERSION)
            _register_exit_barrier(comm)
            liveness.start(comm)   # collective; after the barrier's handler (stop follows it)
        if hvd.size() != comm.Get_size():
            raise RuntimeError(
                "Horovod runs on %d ranks but the communicator given has %d; "
                "use one communicator per program" % (hvd.size(), comm.Get_size()))
    return comm


def horovod_patched():
    """Whether the Horovod in use is the patched build (:data:`PATCHED_HOROVOD_VERSION`)."""
    return horovod.__version__ == PATCHED_HOROVOD_VERSION


def _register_exit_barrier(comm):
    if os.environ.get("FLOWPM_MTF_EXIT_BARRIER", "1") == "0":
        log.warning("FLOWPM_MTF_EXIT_BARRIER=0: no barrier before Horovod shuts down at exit")
        atexit.register(liveness.stop)
        return
    _exit["comm"] = comm.Dup()  # collective: every rank is in init
    # atexit runs handlers last-in first-out: this one before Horovod's shutdown.
    atexit.register(_at_exit)


def _uncaught_exception():
    """Whether the interpreter is exiting because of an uncaught exception."""
    return getattr(sys, "last_type", None) is not None or getattr(sys, "last_exc", None)


def _at_exit():
    if _exit["done"] or _exit["comm"] is None:
        return
    if _uncaught_exception():
        sys.stderr.write("[rank %d] exiting on an uncaught exception: aborting the MPI job\n"
                         % MPI.COMM_WORLD.Get_rank())
        sys.stderr.flush()
        liveness.stop("abort")
        MPI.COMM_WORLD.Abort(1)
    exit_barrier()


def exit_barrier(timeout=None):
    """Wait until every rank of Horovod's communicator calls this (once per program).

    Called automatically at a normal exit (see the module docstring) and by
    :func:`shutdown`; a second call does nothing. The wait is a non-blocking
    ``MPI_Ibarrier`` polled every 10 ms, so a rank that never arrives does not
    hang the job for ever: after ``timeout`` seconds this rank logs an error
    and aborts the MPI job.

    Parameters
    ----------
    timeout : float, optional
        Seconds; default ``FLOWPM_MTF_EXIT_TIMEOUT`` or
        :data:`EXIT_BARRIER_TIMEOUT_S`; 0 waits for ever.
    """
    comm = _exit["comm"]
    if comm is None or _exit["done"]:
        return
    _exit["done"] = True
    if timeout is None:
        timeout = float(os.environ.get("FLOWPM_MTF_EXIT_TIMEOUT", EXIT_BARRIER_TIMEOUT_S))
    req = comm.Ibarrier()
    t0 = time.monotonic()
    next_note = 60.0
    while not req.Test():
        waited = time.monotonic() - t0
        if timeout and waited > timeout:
            log.error("rank %d: other ranks did not reach their exit within %.0f s; "
                      "aborting the MPI job", comm.Get_rank(), timeout)
            liveness.stop("abort")
            comm.Abort(1)
        if waited > next_note:
            log.warning("rank %d: waiting %.0f s at exit for the other ranks",
                        comm.Get_rank(), waited)
            next_note += 60.0
        time.sleep(0.01)
    liveness.stop()  # every rank is at its exit: the peer watchdogs stop


def shutdown():
    """Exit barrier (:func:`exit_barrier`), then ``hvd.shutdown()``; safe to call twice.

    For programs that stop Horovod themselves before the end (e.g. the test
    runner): a bare ``hvd.shutdown()`` would cut other ranks' collectives short.
    """
    exit_barrier()
    if hvd.is_initialized():
        hvd.shutdown()


def process_set_for(ranks):
    """The Horovod process set for a group of Horovod ranks.

    Every rank must call this with the same groups in the same order (Horovod
    registers dynamic sets collectively). A group spanning all ranks is the
    global set (Horovod invalidates a duplicate of it); a group of one rank
    needs no collective and gives ``None``.

    Parameters
    ----------
    ranks : sequence of int
        Horovod ranks, in the order of their coordinate along the mesh axis.

    Returns
    -------
    horovod.common.process_sets.ProcessSet or None
    """
    ranks = tuple(int(r) for r in ranks)
    if len(ranks) == 1:
        return None
    if list(ranks) != sorted(ranks):
        # Horovod orders a set's members by rank; concatenation order relies on it.
        raise ValueError("process-set ranks must be increasing, got %s" % (ranks,))
    if len(ranks) == hvd.size():
        return hvd.global_process_set
    with _lock:
        ps = _process_sets.get(ranks)
        if ps is None:
            ps = hvd.add_process_set(list(ranks))
            _process_sets[ranks] = ps
    return ps


def thread_counts(local_size=None):
    """TF (intra-op, inter-op) thread counts for one rank.

    The cores available to this process are divided among the ranks on the
    node. If the launcher bound the rank to a subset of cores (``--bind-to``),
    that subset is used as is. ``FLOWPM_MTF_INTRA_THREADS`` and
    ``FLOWPM_MTF_INTER_THREADS`` override the result.

    Parameters
    ----------
    local_size : int, optional
        Ranks on this node (default: Horovod's ``local_size()`` once initialised,
        else the launcher's environment, else 1).

    Returns
    -------
    tuple of int
    """
    if local_size is None:
        if hvd.is_initialized():
            local_size = hvd.local_size()
        else:
            local_size = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE",
                             os.environ.get("SLURM_NTASKS_PER_NODE", "1")).split("(")[0])
    total = os.cpu_count() or 1
    try:
        allowed = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        allowed = total
    intra = allowed if allowed < total else max(1, total // max(1, local_size))
    inter = max(2, intra)
    intra = int(os.environ.get("FLOWPM_MTF_INTRA_THREADS", intra))
    inter = int(os.environ.get("FLOWPM_MTF_INTER_THREADS", inter))
    return intra, inter


def node_placement():
    """Where this rank runs: its host, its place among the ranks of that host, its threads.

    Horovod's local rank and size count the ranks that share this rank's node (MPI's
    shared-memory split), so they follow each rank's own host when a job spans hosts;
    the thread pools of :func:`thread_counts` divide that node's cores among them.

    Returns
    -------
    dict
        ``host`` (hostname), ``rank``, ``local_rank``, ``local_size``, ``intra_threads``,
        ``inter_threads``.
    """
    intra, inter = thread_counts()
    return {"host": socket.gethostname(), "rank": hvd.rank(), "local_rank": hvd.local_rank(),
            "local_size": hvd.local_size(), "intra_threads": intra, "inter_threads": inter}


def session_config(local_size=None, **kwargs):
    """A ``tf.compat.v1.ConfigProto`` with per-rank thread pools (see :func:`thread_counts`).

    On GPUs, one visible GPU per local rank and memory growth are set.
    """
    import tensorflow.compat.v1 as tf

    intra, inter = thread_counts(local_size)
    config = tf.ConfigProto(intra_op_parallelism_threads=intra,
                            inter_op_parallelism_threads=inter,
                            allow_soft_placement=True, **kwargs)
    if hvd.is_initialized():
        config.gpu_options.visible_device_list = str(hvd.local_rank())
    config.gpu_options.allow_growth = True
    return config


def install_abort_on_exception():
    """End the whole MPI job when any rank dies of an uncaught exception.

    Without this, a rank that raises leaves its peers blocked in the next
    collective forever. The hook logs the error with the rank, then calls
    ``MPI_Abort`` so the launcher ends every rank with a non-zero exit.
    """
    previous = sys.excepthook

    def _hook(exc_type, exc, tb):
        previous(exc_type, exc, tb)
        rank = MPI.COMM_WORLD.Get_rank()
        try:
            sys.stderr.write("[rank %d] uncaught %s: aborting the MPI job\n"
                             % (rank, exc_type.__name__))
            sys.stderr.flush()
        finally:
            liveness.stop("abort")
            MPI.COMM_WORLD.Abort(1)

    sys.excepthook = _hook
