"""Work that every rank of a multi-rank test run would repeat identically, done once.

A reference computed in one process (FlowPM, numpy, a 1-processor mesh) gives the same
numbers on every rank; on N oversubscribed ranks computing it N times costs N times the
CPU. :func:`on_rank0` computes it on rank 0 and sends it to the others, which wait
*asleep*: Open MPI's blocking calls poll the network in a busy loop (with
``--oversubscribe`` they yield, but the poll still counts as CPU time and competes
with rank 0 for the 2 cores), so a rank blocked in ``bcast`` or ``barrier`` while rank 0
works for 5 s burns ~5 s of CPU. :func:`quiet_barrier` is a barrier that sleeps instead.
"""
import time

# The waiting ranks' polling interval [s]: short next to any reference (>= 0.1 s), long
# enough that a sleeping rank costs no measurable CPU.
POLL_S = 0.005


def world_comm():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def quiet_barrier(comm=None):
    """``comm.Barrier()`` whose waiting ranks sleep between polls (MPI-3 ``Ibarrier``)."""
    comm = world_comm() if comm is None else comm
    if comm.size == 1:
        return
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(POLL_S)


def on_rank0(fn, comm=None):
    """``fn()`` computed on rank 0 only and broadcast (pickled) to every rank.

    An exception on rank 0 is re-raised on every rank (the others would otherwise wait
    for ever)."""
    comm = world_comm() if comm is None else comm
    if comm.size == 1:
        return fn()
    value, error = None, None
    if comm.rank == 0:
        try:
            value = fn()
        except BaseException as e:  # re-raised below, on every rank
            error = e
    quiet_barrier(comm)
    value, failed = comm.bcast((value, None if error is None else repr(error))
                               if comm.rank == 0 else None, root=0)
    if error is not None:
        raise error
    if failed is not None:
        raise RuntimeError("rank 0 failed to compute the shared value: %s" % failed)
    return value
