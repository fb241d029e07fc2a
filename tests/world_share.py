"""Work that every rank of a multi-rank test run would repeat identically, done once.

A reference computed in one process (FlowPM, numpy, a 1-processor mesh) gives the same
numbers on every rank; on N oversubscribed ranks computing it N times costs N times the
CPU. :func:`on_rank0` computes it on rank 0 and sends it to the others, which wait
*asleep*: Open MPI's blocking calls poll the network in a busy loop (with
``--oversubscribe`` they yield, but the poll still counts as CPU time and competes
with rank 0 for the 2 cores), so a rank blocked in ``bcast`` or ``barrier`` while rank 0
works for 5 s burns ~5 s of CPU. :func:`quiet_barrier` is a barrier that sleeps instead.

Such a reference is also the same in every pass of ``scripts/run_tests.sh`` (1, 2 and 4
ranks) when its inputs are: given a ``key`` (the inputs that determine it), :func:`on_rank0`
keeps it in the run's directory ``FLOWPM_MTF_TEST_REFERENCES`` (made empty by run_tests.sh
for each run and removed after it; unset, nothing is kept), so that the 2- and 4-rank passes
load what the 1-rank pass computed instead of computing it again while the other ranks
wait.
"""
import hashlib
import os
import pickle
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


#: The run's directory of kept references (scripts/run_tests.sh); unset: none kept.
REFERENCES_ENV = "FLOWPM_MTF_TEST_REFERENCES"


def kept(fn, key):
    """``fn()``, or the value kept under ``key`` in ``$FLOWPM_MTF_TEST_REFERENCES``.

    ``key`` is a picklable value naming the reference and every input it depends on (e.g.
    ``("test_nbody.flowpm_1lpt", linear_field, a_start, stages)``): two calls with equal
    keys must compute the same value. Without the variable, or with ``key=None``, ``fn()``.
    """
    root = os.environ.get(REFERENCES_ENV)
    if not root or key is None:
        return fn()
    digest = hashlib.sha256(pickle.dumps(key, protocol=4)).hexdigest()
    path = os.path.join(root, digest + ".pkl")
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except FileNotFoundError:
        pass
    value = fn()
    tmp = "%s.%d.tmp" % (path, os.getpid())
    with open(tmp, "wb") as f:
        pickle.dump(value, f, protocol=4)
    os.replace(tmp, path)   # whole or absent, also with the 1-rank pass's processes side by side
    return value


def on_rank0(fn, comm=None, key=None):
    """``fn()`` computed on rank 0 only and broadcast (pickled) to every rank.

    With ``key``, the value computed by an earlier pass of the same test run is loaded
    instead (:func:`kept`). An exception on rank 0 is re-raised on every rank (the others
    would otherwise wait for ever)."""
    comm = world_comm() if comm is None else comm
    if comm.size == 1:
        return kept(fn, key)
    value, error = None, None
    if comm.rank == 0:
        try:
            value = kept(fn, key)
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
