"""Horovod start-up, process-set registry, TF thread pools and fail-fast hooks.

Everything here is per process and idempotent. Horovod is initialised once with
*dynamic* process sets so that any number of :class:`~hvd_mesh_impl.HvdSimdMeshImpl`
objects, of different shapes, can live in one program: each registers the
process sets of its mesh axes through :func:`process_set_for`, which every rank
calls with the same arguments in the same order.
"""
import logging
import os
import sys
import threading

import horovod.tensorflow as hvd
from mpi4py import MPI

log = logging.getLogger(__name__)

_lock = threading.Lock()
_process_sets = {}  # tuple(ranks) -> hvd.ProcessSet


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
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    with _lock:
        if not hvd.is_initialized():
            # Dynamic process sets let several meshes register their axes later.
            os.environ.setdefault("HOROVOD_DYNAMIC_PROCESS_SETS", "1")
            hvd.init(comm=comm, process_sets="dynamic")
            log.debug("horovod initialised: rank %d of %d", hvd.rank(), hvd.size())
        if hvd.size() != comm.Get_size():
            raise RuntimeError(
                "Horovod runs on %d ranks but the communicator given has %d; "
                "use one communicator per program" % (hvd.size(), comm.Get_size()))
    return comm


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
            MPI.COMM_WORLD.Abort(1)

    sys.excepthook = _hook
