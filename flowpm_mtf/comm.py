"""The small communicator jobs use outside the TF graph (errors, memory, writable OUT).

Anything ranks must agree on outside the graph goes through an object with
mpi4py's lower-case API: ``rank``, ``size``, ``bcast``, ``allgather``,
``allreduce``, ``barrier``. The CLI passes ``mpi4py.MPI.COMM_WORLD`` for the
Horovod backend and :class:`SingleProcessComm` for the one-process placement
backend; ``flowpm_mtf`` itself never imports MPI or Horovod.
"""

__all__ = ["SingleProcessComm"]


class SingleProcessComm:
    """A communicator of one process (rank 0 of 1) with mpi4py's lower-case API."""

    rank = 0
    size = 1

    def bcast(self, obj, root=0):
        return obj

    def allgather(self, obj):
        return [obj]

    def gather(self, obj, root=0):
        return [obj]

    def allreduce(self, obj, op=None):
        return obj

    def barrier(self):
        return None

