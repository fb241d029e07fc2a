"""The backend factory of the command line and the benchmarks: MeshImpl, session, comm.

One place decides how a job runs on the processes of a launch:

``"hvd"``
    :class:`hvd_mesh_impl.HvdSimdMeshImpl`, one slice per MPI rank (SPMD), the
    session configuration of :mod:`hvd_mesh_impl.runtime`, and
    ``mpi4py.MPI.COMM_WORLD`` as the comm object.
``"placement"``
    Mesh TF's ``PlacementMeshImpl`` in one process on ``P * Q`` logical CPU
    devices (the reference implementation of every collective), with a
    :class:`SerialComm`.

This module is the **only** place in ``flowpm_mtf`` that imports
``hvd_mesh_impl`` (lazily, inside :func:`make_mesh_impl` and
:func:`session_config`): the rest of the package runs on any Mesh TF
MeshImpl and never imports Horovod. Anything a job must agree on across ranks
outside the TF graph (errors, memory statistics, writable outputs) goes
through the comm object (mpi4py's lower-case API: ``rank``, ``size``,
``bcast``, ``allgather``, ``allreduce``, ``barrier``).
"""
import dataclasses
import os
import logging

from .errors import ConfigError
from .logs import detect_rank, detect_size

__all__ = ["BACKENDS", "SerialComm", "Backend", "world", "default_grid", "make_comm",
           "install_abort_on_exception",
           "make_mesh_impl", "session_config", "make_backend"]

log = logging.getLogger(__name__)

BACKENDS = ("hvd", "placement")
"""Names of the backends (``--backend``)."""


class SerialComm:
    """A one-process stand-in for an mpi4py communicator (lower-case API).

    Parameters
    ----------
    rank : int
        The rank this process reports (0 for a real single-process run).
    """

    def __init__(self, rank=0):
        self.rank = int(rank)
        self.size = 1

    def bcast(self, obj, root=0):
        """``obj`` (there is nobody to send it to)."""
        return obj

    def allgather(self, obj):
        """``[obj]``."""
        return [obj]

    def allreduce(self, obj, op=None):
        """``obj`` (the reduction of one value)."""
        return obj

    def barrier(self):
        """Nothing to wait for."""

    def Get_rank(self):  # noqa: N802 (mpi4py's name)
        return self.rank

    def Get_size(self):  # noqa: N802 (mpi4py's name)
        return self.size


def world():
    """(rank, size) of this launch, from the launcher's environment (MPI not initialised).

    See :func:`flowpm_mtf.logs.detect_rank` and :func:`flowpm_mtf.logs.detect_size`.
    """
    return detect_rank(), detect_size()


def default_grid(n):
    """The most square process grid ``(P, Q)`` with ``P * Q = n`` and ``P >= Q``."""
    q = int(n ** 0.5)
    while n % q:
        q -= 1
    return (n // q, q)


def make_comm(backend):
    """The comm object of ``backend``: ``MPI.COMM_WORLD`` (hvd) or :class:`SerialComm`."""
    if backend == "hvd":
        from mpi4py import MPI

        return MPI.COMM_WORLD
    return SerialComm()


def make_mesh_impl(backend, mesh_shape, layout_rules, devices=None):
    """The MeshImpl of ``backend`` for a processor mesh and layout.

    Parameters
    ----------
    backend : {"hvd", "placement"}
    mesh_shape : list of (str, int)
        Processor mesh, e.g. ``SimConfig.mesh_shape``.
    layout_rules : list of (str, str)
        Tensor dimension -> mesh axis, e.g. ``SimConfig.layout_rules``.
    devices : list of str, optional
        Placement only: the TF device of each processor (default the local
        logical CPUs ``/cpu:0`` ... ``/cpu:N-1``; e.g. a TF cluster's tasks).

    Returns
    -------
    mtf.MeshImpl
    """
    if backend == "hvd":
        from hvd_mesh_impl import HvdSimdMeshImpl, liveness  # the only import of the backend

        try:   # before Horovod starts: a bad value is one line on every rank (exit 2)
            liveness.peer_timeout()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return HvdSimdMeshImpl(mesh_shape, layout_rules)
    if backend == "placement":
        import mesh_tensorflow as mtf

        if devices is None:
            n = 1
            for _, size in mesh_shape:
                n *= int(size)
            devices = ["/cpu:%d" % i for i in range(n)]
        return mtf.placement_mesh_impl.PlacementMeshImpl(mesh_shape, layout_rules, devices)
    raise ValueError("unknown backend %r (choose from %s)" % (backend, BACKENDS))


def session_config(backend, n_devices=1, threads=None):
    """The ``tf.ConfigProto`` of ``backend``.

    Parameters
    ----------
    backend : {"hvd", "placement"}
    n_devices : int
        Logical CPU devices of a placement run (P * Q).
    threads : int, optional
        Intra-op threads of a placement run (TF's default if None).
    """
    import tensorflow.compat.v1 as tf

    if backend == "hvd":
        from hvd_mesh_impl import runtime

        return graph_options(runtime.session_config())
    kw = {}
    if threads:
        kw = {"intra_op_parallelism_threads": threads,
              "inter_op_parallelism_threads": max(2, threads)}
    return graph_options(tf.ConfigProto(device_count={"CPU": n_devices}, **kw))


def graph_options(config):
    """Switch TensorFlow's graph optimisers off unless ``FLOWPM_MTF_GRAPPLER=1``.

    * **Grappler** rewrites the graph when a session first runs a set of
      fetches. On the simulation graph (custom FFT/CIC ops, elementwise kernels,
      collectives) it finds little to improve and its passes (constant folding,
      arithmetic and layout rewrites, remapping) were the largest part of the
      first run of the ICs, and without them the warm step is not slower
      (``scripts/bench_peers.py``).
    * **The executor's constant folding** (``OptimizerOptions`` level L1, which
      runs even without Grappler) evaluates every constant subgraph when an
      executor is created and keeps the result as a ``Const`` (e.g. the 3D
      inverse-Laplacian kernel of each rank's slice, the ids' initial value),
      with TensorProto copies on the way. Off (level L0; common-subexpression
      elimination and function inlining kept), the graph phase holds less memory,
      the peak is lower and the ICs' first run shorter; the price is that those few
      kernels are recomputed in every run (an elementwise pass over a k-space slice,
      small against a step).

    ``FLOWPM_MTF_GRAPPLER=1`` restores TensorFlow's defaults for both.

    Parameters
    ----------
    config : tf.ConfigProto
        Modified in place.

    Returns
    -------
    tf.ConfigProto
        ``config``.
    """
    if os.environ.get("FLOWPM_MTF_GRAPPLER", "0") != "1":
        config.graph_options.rewrite_options.disable_meta_optimizer = True
        opts = config.graph_options.optimizer_options
        opts.opt_level = -1                       # OptimizerOptions.L0
        opts.do_constant_folding = False
        opts.do_common_subexpression_elimination = True
        opts.do_function_inlining = True
    return config


@dataclasses.dataclass
class Backend:
    """Everything a job needs to run on a launch: MeshImpl, session config, comm.

    Attributes
    ----------
    name : str
        ``"hvd"`` or ``"placement"``.
    mesh_impl : mtf.MeshImpl
    session_config : tf.ConfigProto
    comm : object
        mpi4py-like communicator (:class:`SerialComm` in one process).
    """

    name: str
    mesh_impl: object
    session_config: object
    comm: object

    @property
    def rank(self):
        """This process's rank in ``comm``."""
        return int(self.comm.rank)

    def placement(self):
        """Where this process runs (host, ranks of its node, thread pools), for summaries.

        Returns
        -------
        dict
            hvd: :func:`hvd_mesh_impl.runtime.node_placement`; placement: this host, one
            process (``local_rank`` 0, ``local_size`` 1), TensorFlow's default threads (0).
        """
        if self.name == "hvd":
            from hvd_mesh_impl import runtime

            return runtime.node_placement()
        import socket

        return {"host": socket.gethostname(), "rank": self.rank, "local_rank": 0,
                "local_size": 1, "intra_threads": 0, "inter_threads": 0}


def make_backend(backend, conf, comm=None):
    """The :class:`Backend` of ``backend`` for a ``SimConfig``'s process grid.

    Parameters
    ----------
    backend : {"hvd", "placement"}
    conf : SimConfig
    comm : object, optional
        Default :func:`make_comm`.
    """
    return Backend(backend, make_mesh_impl(backend, conf.mesh_shape, conf.layout_rules),
                   session_config(backend, conf.n_ranks),
                   make_comm(backend) if comm is None else comm)


def install_abort_on_exception():
    """hvd backend: an uncaught exception on one rank aborts the whole MPI job
    (:func:`hvd_mesh_impl.runtime.install_abort_on_exception`), so no rank waits
    forever in a collective."""
    from hvd_mesh_impl import runtime

    runtime.install_abort_on_exception()
