"""Benchmark flowpm_mtf workloads on three Mesh TF backends, plus an MPI FFT reference.

Backends, each on N = P * Q processes or devices:

hvd
    ``HvdSimdMeshImpl``: N MPI ranks (``mpirun``), each builds and runs the graph of
    its own slice (SPMD); collectives are Horovod ops.
placement
    Mesh TF's ``PlacementMeshImpl`` in **one** process on N logical CPU devices.
cluster
    ``PlacementMeshImpl`` on a real TF cluster: N worker processes, each a
    ``tf.distribute.Server`` on a free loopback port, and a separate master process
    that builds the whole graph and runs it through a gRPC session (the set-up of
    FlowPM's 2020 Mesh TF benchmarks).
mpi4py-fft
    Reference row for the FFT only: ``mpi4py_fft.PFFT`` (FFTW + MPI Alltoallw) on
    the same N ranks and the same pencil grid, a complex-to-complex round trip
    like ``flowpm_mtf.mesh.fft`` (which transforms the real field cast to complex).

Workloads (SimConfig with ``nc`` cells per side, box ``nc * 3.125`` Mpc/h, i.e. the
cell size of the default 64^3 / 200 Mpc/h run):

fft
    ``fft.r2c`` then ``fft.c2r`` of a field held in per-slice variables.
halo
    ``halo.halo_fill`` then ``halo.halo_reduce`` of the padded block field.
lpt
    ``ics.linear_field`` (noise, FFT, P(k)) then 2LPT ``lpt.lpt_init``.
nbody_step
    One ``nbody.kdk_step`` (one PM force: paint, 1 forward + 3 inverse FFTs,
    halos, readout) from an LPT state held in Mesh TF variables (as
    ``flowpm-mtf simulate``); the variables are initialised once, untimed.

Measured per workload, backend, size and grid: wall time of one ``session.run``
(``--warmup`` untimed runs, the first reported as ``first_run_s``, then the median
of ``--repeats`` runs; for hvd, each run's time is the slowest rank's), graph
construction time (mtf graph + lowering), peak resident memory of every process
(``ru_maxrss``; cluster: master and every worker server), and bytes received per
rank in the timed graph: the collectives are counted at lowering from their static
slice shapes (identically for every backend); for hvd the counts are checked
against ``HvdSimdMeshImpl.comm_bytes_received`` (run-time tensor sizes).

Usage::

    # everything (writes results/bench/bench_compare.md and PNG plots, and the raw
    # results/raw/bench/bench_compare.json, unversioned):
    python scripts/bench_compare.py --backend all --sizes 32 64 128 --grids 1x2 2x1 2x2
    python scripts/scaling_model.py        # regenerates docs/scaling.md's tables
    # CI smoke test (16^3, one grid, 1 repeat):
    python scripts/bench_compare.py --backend all --smoke --out /tmp/bench
    # one measurement (what the driver launches):
    mpirun -np 4 python scripts/bench_compare.py --backend hvd --size 32 --grid 2x2 \\
        --workloads fft --record rec.json
"""
import argparse
import logging
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from flowpm_bench import RESULTS, configs, provenance
from flowpm_bench.launch import clean_env, mpirun_command, run
from flowpm_bench.measure import peak_mb
from flowpm_bench.results import json_path, read_json, read_raw, write_json, write_table

log = logging.getLogger("bench_compare")
SCRIPT = "scripts/bench_compare.py"

WORKLOADS = ("fft", "halo", "lpt", "nbody_step")
BACKENDS = ("hvd", "placement", "cluster", "mpi4py-fft")
MESH_BACKENDS = ("hvd", "placement", "cluster")
CELL_MPC_H = 200.0 / 64  # cell size [Mpc/h] of every benchmark configuration
TIMED_SCOPE = "timed"    # mtf variable scope of the part of the graph that is timed
# A sub-run (one mpirun / one cluster) that takes longer than this is killed.
SUBRUN_TIMEOUT_S = 3600
# Seconds a cluster worker may take to start its gRPC server.
WORKER_START_TIMEOUT_S = 120
SMOKE = {"sizes": [16], "grids": ["1x2"], "repeats": 1, "warmup": 1, "halo": 2}


# ============================================================================ helpers
def parse_grid(text):
    """``"2x1"`` -> (2, 1)."""
    try:
        p, q = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError("a grid is PxQ, e.g. 2x1, got %r" % text)
    if p < 1 or q < 1:
        raise argparse.ArgumentTypeError("grid entries must be >= 1, got %r" % text)
    return (p, q)


def grid_str(grid):
    return "%dx%d" % tuple(grid)


def make_conf(nc, grid, halo):
    """The benchmark SimConfig: ``nc^3`` cells, constant cell size, 2LPT, float32."""
    from flowpm_mtf.config import SimConfig

    # The byte model (scripts/scaling_model.py) is that of the fixed (Lagrangian)
    # decomposition: no particle migration in these workloads.
    return SimConfig(nc=nc, box_size=nc * CELL_MPC_H, grid=tuple(grid), halo_size=halo,
                     a_start=0.1, a_end=1.0, n_steps=10, lpt_order=2, dtype="float32",
                     decomposition="lagrangian")


def free_ports(n):
    """``n`` distinct free TCP ports on 127.0.0.1 (bound then released)."""
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


# ============================================================================ byte counting
class CommCounter:
    """Counts the bytes every processor receives in the collectives of a MeshImpl.

    Wraps the instance's ``alltoall``, ``allconcat``, ``allreduce`` and ``receive``
    (every Mesh TF collective, including shifts, goes through them), and
    ``alltoall_pieces`` where the MeshImpl has it (``HvdSimdMeshImpl``; the FFT's
    exchanges of laid-out pieces, counted as an ``alltoall`` of the same slice), and records,
    at lowering time and from static slice shapes, for every processor number:

    * ``recv``: bytes as ``HvdSimdMeshImpl.comm_bytes_received`` counts them (the
      whole received tensor: an alltoall's or allconcat's own piece included);
    * ``wire``: bytes that arrive from *other* processors: alltoall ``(n-1)/n``
      of the slice, allconcat ``(n-1)`` slices, a shift the slice when the source
      is another processor, allreduce ``2 (n-1)/n`` of the slice (ring).

    Each record is tagged with the TF name scope active while it is lowered; Mesh
    TF lowers every operation inside ``tf.name_scope(op.name)``, so operations
    built under ``tf.variable_scope(TIMED_SCOPE)`` are recognisable.
    """

    KINDS = ("alltoall", "allconcat", "allreduce", "receive")

    def __init__(self, impl):
        import mesh_tensorflow as mtf

        self.impl = impl
        self.size = impl.size
        self.records = []  # (kind, scope, recv[pnum], wire[pnum])
        self._depth = 0
        self._coords = [mtf.pnum_to_processor_coordinates(impl.shape, p)
                        for p in range(impl.size)]
        for kind in self.KINDS:
            self._wrap(kind)
        if hasattr(impl, "alltoall_pieces"):
            self._wrap("alltoall_pieces", counted_as="alltoall")

    def _wrap(self, kind, counted_as=None):
        orig = getattr(self.impl, kind)

        def wrapped(x, *args, **kwargs):
            if self._depth == 0:
                self._count(counted_as or kind, x, args, kwargs)
            self._depth += 1
            try:
                return orig(x, *args, **kwargs)
            finally:
                self._depth -= 1

        setattr(self.impl, kind, wrapped)

    def _count(self, kind, x, args, kwargs):
        import tensorflow.compat.v1 as tf

        t = x.to_laid_out_tensor().tensor_list[0]
        itemsize = 4 if t.dtype == tf.bool else t.dtype.size  # bool travels as int32
        nbytes = int(np.prod(t.shape.as_list())) * itemsize
        dims = self.impl.shape.to_integer_list
        recv = np.zeros(self.size, np.int64)
        wire = np.zeros(self.size, np.float64)
        if kind in ("alltoall", "allconcat"):
            n = dims[args[0]]
            if n > 1:
                recv[:] = nbytes if kind == "alltoall" else n * nbytes
                wire[:] = nbytes * (n - 1) / n if kind == "alltoall" else (n - 1) * nbytes
        elif kind == "allreduce":
            axes = [a for a in args[0] if dims[a] > 1]
            nontrivial = [a for a in range(len(dims)) if dims[a] > 1]
            if axes:
                # HvdSimdMeshImpl: one global allreduce when every non-trivial axis is
                # reduced, else one per axis.
                groups = [int(np.prod([dims[a] for a in axes]))] if len(axes) == len(
                    nontrivial) else [dims[a] for a in axes]
                recv[:] = nbytes * len(groups)
                wire[:] = sum(2.0 * (n - 1) / n * nbytes for n in groups)
        else:  # receive
            mesh_axis, source = args[0], args[1]
            if list(source) != list(range(dims[mesh_axis])):
                for p in range(self.size):
                    me = self._coords[p][mesh_axis]
                    src = source[me]
                    if src is not None and src != me:
                        recv[p] = nbytes
                        wire[p] = nbytes
        scope = tf.get_default_graph().get_name_scope()
        self.records.append((kind, scope, recv, wire))

    def totals(self, timed_only=False, kind=None):
        """(recv, wire): arrays over processor numbers [bytes]."""
        recv = np.zeros(self.size, np.int64)
        wire = np.zeros(self.size, np.float64)
        for k, scope, r, w in self.records:
            if kind is not None and k != kind:
                continue
            if timed_only and not _in_timed_scope(scope):
                continue
            recv += r
            wire += w
        return recv, wire

    def by_kind(self, timed_only=True, pnum=None):
        """{kind: recv bytes} of one processor (default: the maximum over processors)."""
        out = {}
        for k in self.KINDS:
            r, _ = self.totals(timed_only, k)
            out[k] = int(r.max() if pnum is None else r[pnum])
        return out


def _in_timed_scope(scope):
    return scope == TIMED_SCOPE or scope.startswith(TIMED_SCOPE + "/") \
        or ("/" + TIMED_SCOPE + "/") in scope


# ============================================================================ workloads
def _slice_input(impl, mesh, shape, dtype, devices, name):
    """An mtf tensor whose slices are TF variables (N(0,1)) on the slices' devices."""
    import mesh_tensorflow as mtf
    import tensorflow.compat.v1 as tf

    sshape = impl.slice_shape(shape)
    slices = []
    for i, dev in enumerate(devices):
        with tf.device(dev):
            v = tf.Variable(tf.random.normal(sshape, seed=i + 1, dtype=dtype),
                            name="%s_%d" % (name, i), trainable=False)
            slices.append(v.read_value())
    return mtf.import_laid_out_tensor(mesh, impl.LaidOutTensor(slices), shape, name=name)


def build_workload(workload, conf, impl, devices):
    """Build and lower one workload on ``impl``.

    Parameters
    ----------
    workload : str
        One of :data:`WORKLOADS`.
    conf : SimConfig
    impl : mtf.MeshImpl
    devices : list of str
        The TF device of each slice this process builds ([""] for hvd).

    Returns
    -------
    dict
        ``fetch``: list of scalar tensors (one element of every output slice, a
        data dependency on the whole computation); ``init``: list of ops to run
        once before timing, in a :func:`flowpm_mtf.jobs.runner.session` of
        ``lowering`` (variables initialised, masters copied); ``lowering``.
    """
    import mesh_tensorflow as mtf
    import tensorflow.compat.v1 as tf

    from flowpm_mtf.mesh import fft, halo
    from flowpm_mtf.physics import ics, lpt, nbody
    from flowpm_mtf.jobs import runner

    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "mesh")
    init_assign = []
    if workload == "fft":
        x = _slice_input(impl, mesh, fft.real_shape(conf), tf.float32, devices, "field")
        with tf.variable_scope(TIMED_SCOPE):
            outs = [fft.c2r(fft.r2c(x, conf), conf)]
    elif workload == "halo":
        x = _slice_input(impl, mesh, halo.padded_shape(conf), tf.float32, devices, "padded")
        with tf.variable_scope(TIMED_SCOPE):
            outs = [halo.halo_reduce(halo.halo_fill(x, conf), conf)]
    elif workload == "lpt":
        with tf.variable_scope(TIMED_SCOPE):
            linear = ics.linear_field(conf, mesh)
            state = lpt.lpt_init(linear, conf, a=conf.a_start)
            outs = [state.positions, state.momenta, state.forces]
    elif workload == "nbody_step":
        init = lpt.lpt_init(ics.linear_field(conf, mesh), conf, a=conf.a_start)
        variables = lpt.State(*[
            mtf.get_variable(mesh, name, init.positions.shape, dtype=conf.tf_dtype,
                             trainable=False, initializer=tf.zeros_initializer())
            for name in ("positions", "momenta", "forces")])
        init_assign = [mtf.assign(v, t) for v, t in zip(variables[:3], init[:3])]
        a0, a1 = nbody.default_stages(conf)[:2]
        with tf.variable_scope(TIMED_SCOPE):
            new = nbody.kdk_step(variables, conf, a0, a1)
            outs = [new.positions, new.momenta, new.forces]
    else:
        raise ValueError("unknown workload %r (choose from %s)" % (workload, WORKLOADS))
    lowering = runner.lower(graph, mesh, impl)
    fetch = []
    for out in outs:
        for t in lowering.tensors[out].to_laid_out_tensor().tensor_list:
            with tf.device(t.device):
                fetch.append(tf.reshape(t, [-1])[0])
    init_ops = [runner.lowered_group(lowering, init_assign)] if init_assign else []
    return {"fetch": fetch, "init": init_ops, "lowering": lowering}


# ============================================================================ sub-runs
def _timed_runs(sess, fetch, warmup, repeats, barrier=None, reduce_max=None):
    """(first run [s], list of timed runs [s]); runs synchronised by ``barrier``."""
    def one():
        if barrier is not None:
            barrier()
        t0 = time.perf_counter()
        sess.run(fetch)
        dt = time.perf_counter() - t0
        return reduce_max(dt) if reduce_max is not None else dt

    first = one()
    for _ in range(max(0, warmup - 1)):
        one()
    return first, [one() for _ in range(repeats)]


def code_state():
    """Which code was measured: git commit, whether the package sources differ from it,
    and the structure of the PM force (readouts per force, see scripts/scaling_model.py).
    Other engineers edit the same tree, so every record carries this."""
    return {"commit": provenance.git("rev-parse", "--short", "HEAD"),
            "dirty": provenance.code_dirty("flowpm_mtf", "hvd_mesh_impl", untracked=True),
            "readouts_per_force": configs.readout_calls_per_force()}


def _record(args, backend, workload, conf, build_s, first, times, rss, roles, counter,
            n_procs, extra=None):
    recv, wire = counter.totals(timed_only=True) if counter is not None else (None, None)
    rec = {"backend": backend, "workload": workload, "nc": conf.nc[0], "grid": list(conf.grid),
           "n": n_procs, "halo": conf.halo_size, "dtype": conf.dtype,
           "warmup": args.warmup, "repeats": args.repeats,
           "times_s": times, "median_s": statistics.median(times), "min_s": min(times),
           "build_s": build_s, "first_run_s": first,
           "rss_mb": rss, "rss_roles": roles, "rss_max_mb": max(rss),
           "rss_scope": "workload" if len(args.workloads) == 1 else "cumulative",
           "code": code_state()}
    if counter is not None:
        rec["bytes"] = {"recv_per_rank": [int(v) for v in recv],
                        "wire_per_rank": [float(v) for v in wire],
                        "wire_max": float(wire.max()), "recv_max": int(recv.max()),
                        "by_kind": counter.by_kind(timed_only=True),
                        "all_by_kind": counter.by_kind(timed_only=False),
                        "source": "counted at lowering (static slice shapes)"}
    if extra:
        rec.update(extra)
    return rec


def run_hvd(args):
    """One rank of the hvd sub-run (under mpirun)."""
    import tensorflow.compat.v1 as tf

    tf.disable_eager_execution()
    from mpi4py import MPI

    from flowpm_mtf.backend import install_abort_on_exception, make_mesh_impl, session_config
    from flowpm_mtf.jobs import runner

    install_abort_on_exception()
    comm = MPI.COMM_WORLD
    conf = make_conf(args.size, args.grid, args.halo)
    records = []
    for workload in args.workloads:
        with tf.Graph().as_default():
            comm.Barrier()
            t0 = time.perf_counter()
            impl = make_mesh_impl("hvd", conf.mesh_shape, conf.layout_rules)
            counter = CommCounter(impl)
            built = build_workload(workload, conf, impl, [""])
            measured = {k: impl.comm_bytes_received(k) for k in CommCounter.KINDS}
            build_s = max(comm.allgather(time.perf_counter() - t0))
            with runner.session(session_config("hvd"), built["lowering"]) as sess:
                for op in built["init"]:  # the LPT state of nbody_step
                    sess.run(op)
                first, times = _timed_runs(
                    sess, built["fetch"], args.warmup, args.repeats, barrier=comm.Barrier,
                    reduce_max=lambda dt: max(comm.allgather(dt)))
                measured = sess.run(measured)
        rss = comm.allgather(peak_mb())
        measured_all = comm.allgather({k: int(v) for k, v in measured.items()})
        counted_all = [counter.by_kind(timed_only=False, pnum=p) for p in range(impl.size)]
        rec = _record(args, "hvd", workload, conf, build_s, first, times, rss,
                      ["rank %d" % r for r in range(comm.Get_size())], counter, comm.Get_size(),
                      {"hvd_comm_bytes_received_per_rank": measured_all,
                       "counted_all_per_rank": counted_all})
        records.append(rec)
    if comm.Get_rank() == 0:
        write_json(args.record, records)


def _placement_session_config(n, threads=None):
    import tensorflow.compat.v1 as tf

    kw = {}
    if threads:
        kw = {"intra_op_parallelism_threads": threads,
              "inter_op_parallelism_threads": max(2, threads)}
    return tf.ConfigProto(device_count={"CPU": n}, allow_soft_placement=False, **kw)


def run_placement(args, target=None, devices=None, backend="placement", rss_extra=None):
    """PlacementMeshImpl in this process (local devices or a cluster's)."""
    import tensorflow.compat.v1 as tf

    from flowpm_mtf.backend import make_mesh_impl
    from flowpm_mtf.jobs import runner

    tf.disable_eager_execution()
    conf = make_conf(args.size, args.grid, args.halo)
    n = conf.n_ranks
    devices = devices or ["/cpu:%d" % i for i in range(n)]
    records = []
    for workload in args.workloads:
        with tf.Graph().as_default():
            t0 = time.perf_counter()
            impl = make_mesh_impl("placement", conf.mesh_shape, conf.layout_rules, devices)
            counter = CommCounter(impl)
            built = build_workload(workload, conf, impl, devices)
            if target is not None:
                pin_py_funcs_to_master(tf.get_default_graph())
            build_s = time.perf_counter() - t0
            config = _placement_session_config(n) if target is None else tf.ConfigProto(
                allow_soft_placement=False)
            with runner.session(config, built["lowering"], target or "") as sess:
                for op in built["init"]:  # the LPT state of nbody_step
                    sess.run(op)
                first, times = _timed_runs(sess, built["fetch"], args.warmup, args.repeats)
        records.append((workload, build_s, first, times, counter))
    out = []
    for workload, build_s, first, times, counter in records:
        rss, roles = [peak_mb()], ["process" if target is None else "master"]
        if rss_extra is not None:
            rss, roles = rss + rss_extra[0], roles + rss_extra[1]
        out.append(_record(args, backend, workload, conf, build_s, first, times, rss, roles,
                           counter, n))
    return out


def run_cluster_worker(args):
    """A TF gRPC server (one cluster task); exits when its stdin closes."""
    import tensorflow.compat.v1 as tf

    from flowpm_mtf import native

    # The graph the master sends may hold our CPU custom ops (FFT, CIC, noise, particles): a worker
    # must register their kernels before it runs it.
    for lib in native.names():
        native.load(lib)
    cluster, n = _cluster_spec(args.ports)
    threads = max(1, (os.cpu_count() or 1) // n)
    config = tf.ConfigProto(intra_op_parallelism_threads=threads,
                            inter_op_parallelism_threads=max(2, threads))
    server = tf.distribute.Server(cluster, job_name="worker", task_index=args.task,
                                  config=config, start=True)
    sys.stdout.write("ready %s\n" % server.target)
    sys.stdout.flush()
    sys.stdin.read()  # the driver closes stdin when the master is done (or dies)
    write_json(args.record, {"task": args.task, "rss_mb": peak_mb()})
    sys.stdout.flush()
    os._exit(0)  # a TF1 server has no clean shutdown; nothing else to flush


def _cluster_spec(ports):
    """ClusterSpec of ``--ports``: the first is the master's, the others the workers'."""
    import tensorflow.compat.v1 as tf

    ports = [int(p) for p in ports.split(",")]
    return tf.train.ClusterSpec({
        "master": ["127.0.0.1:%d" % ports[0]],
        "worker": ["127.0.0.1:%d" % p for p in ports[1:]]}), len(ports) - 1


MASTER_DEVICE = "/job:master/task:0/device:CPU:0"


def pin_py_funcs_to_master(graph):
    """Place every ``tf.numpy_function`` op on the master: a Python callback exists
    only in the process that built the graph (``ics.linear_amplitude`` uses one).
    Returns the number of ops moved."""
    moved = 0
    for op in graph.get_operations():
        if op.type in ("PyFunc", "PyFuncStateless", "EagerPyFunc"):
            op._set_device(MASTER_DEVICE)  # no public API to re-place a built op
            moved += 1
    return moved


def run_cluster_master(args):
    """Build and run on the cluster given by ``--ports``; worker RSS added by the driver.

    The master process runs its own server (job ``master``, no slices): the
    session goes through it, and the graph's Python callbacks run there.
    """
    import tensorflow.compat.v1 as tf

    cluster, n = _cluster_spec(args.ports)
    config = tf.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=2)
    server = tf.distribute.Server(cluster, job_name="master", task_index=0, config=config,
                                  start=True)
    devices = ["/job:worker/task:%d/device:CPU:0" % i for i in range(n)]
    recs = run_placement(args, target=server.target, devices=devices, backend="cluster")
    write_json(args.record, recs)
    sys.stdout.flush()
    os._exit(0)  # a TF1 server has no clean shutdown


def run_mpi4py_fft(args):
    """FFT round trip with mpi4py-fft (FFTW) on the same pencil grid, complex64."""
    from mpi4py import MPI

    try:
        import mpi4py_fft  # noqa: F401  (used by fft_timing)
    except ImportError:
        raise SystemExit("mpi4py-fft is not installed (pip install mpi4py-fft; needs "
                         "libfftw3-dev); skip with --backend hvd placement cluster")
    from flowpm_bench import fft_timing

    comm = MPI.COMM_WORLD
    conf = make_conf(args.size, args.grid, args.halo)
    P, Q = conf.grid
    res = fft_timing.time_mpi4py_fft_roundtrip(comm, conf.nc, conf.grid, real=False,
                                               warmup=args.warmup, repeats=args.repeats)
    first, times, setup_s, err = (res["first_s"], res["times_s"], res["build_s"],
                                  res["max_abs_error"])
    local = int(np.prod(conf.nc)) // (P * Q) * 8  # complex64 slice [bytes]
    rss = comm.allgather(peak_mb())
    # Analytic: each of the 2 transposes per direction moves (n-1)/n of the local
    # complex array over its sub-communicator (n = P or Q).
    wire = 2 * sum(local * (n - 1) / n for n in (P, Q) if n > 1)
    rec = {"backend": "mpi4py-fft", "workload": "fft", "nc": conf.nc[0], "grid": [P, Q],
           "n": P * Q, "halo": conf.halo_size, "dtype": "complex64",
           "warmup": args.warmup, "repeats": args.repeats, "times_s": times,
           "median_s": statistics.median(times), "min_s": min(times), "build_s": setup_s,
           "first_run_s": first, "rss_mb": rss, "rss_roles": ["rank %d" % r for r in
                                                             range(comm.Get_size())],
           "rss_max_mb": max(rss), "rss_scope": "workload", "round_trip_max_abs_error": err,
           "code": code_state(),
           "bytes": {"wire_max": float(wire), "source": "analytic (2 transposes per direction)"}}
    if comm.Get_rank() == 0:
        write_json(args.record, [rec])


# ============================================================================ driver
def _sub_args(args, size, grid, workloads):
    return ["--size", str(size), "--grid", grid_str(grid), "--halo", str(args.halo),
            "--warmup", str(args.warmup), "--repeats", str(args.repeats),
            "--workloads", *workloads] + (["--smoke"] if args.smoke else [])


_read = read_json


def run_cluster(args, size, grid, workloads, tmp):
    """N worker servers + a master process; workers always end, whatever happens."""
    n = grid[0] * grid[1]
    ports = free_ports(n + 1)  # master, then the workers
    pstr = ",".join(map(str, ports))
    workers = []
    wrecs = [os.path.join(tmp, "worker_%d.json" % i) for i in range(n)]
    try:
        for i in range(n):
            workers.append(subprocess.Popen(
                [sys.executable, __file__, "--backend", "cluster-worker", "--task", str(i),
                 "--ports", pstr, "--record", wrecs[i]],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                env=clean_env(), text=True, start_new_session=True))
        deadline = time.monotonic() + WORKER_START_TIMEOUT_S
        for w in workers:  # wait for "ready" from every server
            line = w.stdout.readline()
            if not line.startswith("ready") or time.monotonic() > deadline:
                raise RuntimeError("cluster worker failed to start: %r" % line)
        master_rec = os.path.join(tmp, "master.json")
        run([sys.executable, __file__, "--backend", "cluster", "--ports", pstr,
             "--record", master_rec] + _sub_args(args, size, grid, workloads),
            SUBRUN_TIMEOUT_S)
        for w in workers:
            w.stdin.close()
        for w in workers:
            w.wait(timeout=60)
        worker_rss = [_read(p)["rss_mb"] for p in wrecs]
    finally:
        for w in workers:
            if w.poll() is None:
                os.killpg(w.pid, 9)
                w.wait()
    recs = _read(master_rec)
    for r in recs:
        r["rss_mb"] = r["rss_mb"] + worker_rss
        r["rss_roles"] = r["rss_roles"] + ["worker %d" % i for i in range(n)]
        r["rss_max_mb"] = max(r["rss_mb"])
        r["rss_worker_max_mb"] = max(worker_rss)
    return recs


def drive(args):
    """Launch the sub-runs, merge the records, write JSON, Markdown and plots."""
    backends = BACKENDS if "all" in args.backend else args.backend
    os.makedirs(args.out, exist_ok=True)
    path = json_path(args.out, "bench_compare")
    old = _read(path)["records"] if (args.merge and os.path.exists(path)) else []
    records = []
    groups = [list(args.workloads)] if not args.isolate else [[w] for w in args.workloads]
    with tempfile.TemporaryDirectory(prefix="bench_compare_") as tmp:
        for size in args.sizes:
            for grid in args.grids:
                n = grid[0] * grid[1]
                conf = make_conf(size, grid, args.halo)  # validates size/grid/halo early
                for backend in backends:
                    if backend == "mpi4py-fft":
                        if "fft" not in args.workloads:
                            continue
                        out = os.path.join(tmp, "ref.json")
                        run(mpirun_command(n) + [sys.executable, __file__, "--backend",
                                                 "mpi4py-fft", "--record", out]
                            + _sub_args(args, size, grid, ["fft"]), SUBRUN_TIMEOUT_S)
                        records += _read(out)
                        continue
                    for wl in groups:
                        out = os.path.join(tmp, "rec.json")
                        sub = _sub_args(args, size, grid, wl)
                        if backend == "hvd":
                            run(mpirun_command(n) + [sys.executable, __file__, "--backend",
                                                     "hvd", "--record", out] + sub,
                                SUBRUN_TIMEOUT_S)
                            records += _read(out)
                        elif backend == "placement":
                            run([sys.executable, __file__, "--backend", "placement",
                                 "--record", out] + sub, SUBRUN_TIMEOUT_S)
                            records += _read(out)
                        else:
                            records += run_cluster(args, size, grid, wl, tmp)
                    _save(args, old, records, path)  # partial results survive a failure
                del conf
    return _save(args, old, records, path, final=True)


def _save(args, old, records, path, final=False):
    """Merge ``records`` over ``old`` and write the JSON and Markdown (and plots)."""
    key = lambda r: (r["backend"], r["workload"], r["nc"], tuple(r["grid"]))  # noqa: E731
    new_keys = {key(r) for r in records}
    records = [r for r in old if key(r) not in new_keys] + records
    m = provenance.machine()
    meta = {"machine": "%s cores, %s GB" % (m["cpus"], m["memory_gb"]),
            "load_note": args.note, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
            "versions": _versions(), "cell_size_mpc_h": CELL_MPC_H,
            "timing": "warm-up runs, then the median of the timed runs; hvd and mpi4py-fft: "
                      "slowest rank per run"}
    write_json(path, {"meta": meta, "records": records})
    table = write_table(os.path.join(args.out, "bench_compare.md"), markdown(meta, records),
                        SCRIPT)
    if final:
        if not args.no_plots:
            plots(records, args.out)
        print(table, flush=True)
    return records


# module -> its distribution names, first installed wins
_DISTRIBUTIONS = {"tensorflow": ("tensorflow-cpu", "tensorflow"),
                  "mesh_tensorflow": ("mesh-tensorflow",), "horovod": ("horovod",),
                  "mpi4py": ("mpi4py",), "mpi4py_fft": ("mpi4py-fft",), "numpy": ("numpy",)}


def _versions():
    """The packages' versions, from their installed metadata: the driver does not import
    TensorFlow (its sub-runs do); None for a package that is not installed."""
    from importlib import metadata

    out = {"python": sys.version.split()[0]}
    for mod, dists in _DISTRIBUTIONS.items():
        out[mod] = None
        for dist in dists:
            try:
                out[mod] = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
    return out


LABELS = {"hvd": "HvdSimdMeshImpl (mpirun)", "placement": "Placement, 1 process",
          "cluster": "Placement, gRPC cluster", "mpi4py-fft": "mpi4py-fft (FFTW+MPI)"}


def markdown(meta, records):
    """The results as a Markdown document."""
    lines = ["# flowpm_mtf backends: HvdSimdMeshImpl vs Mesh TF device placement", "",
             "Machine: %s. %s Generated %s by `%s`." % (meta["machine"], meta["load_note"] or "",
                                                      meta["date"], meta["command"]), "",
             "Time: median of the timed runs of one `session.run` after warm-up [ms] "
             "(hvd, mpi4py-fft: slowest rank). Build: mtf graph + lowering [s] (mpi4py-fft: "
             "plan); first: first run incl. TF graph optimisation [s]. RSS: peak resident "
             "memory, largest process [MB] (cluster: largest of master and workers; the "
             "master's own in brackets). MB/rank: bytes one rank receives from the others "
             "in one run (largest rank), counted from the slice shapes of the lowered "
             "collectives (the same graph for the three Mesh TF backends; checked against "
             "HvdSimdMeshImpl.comm_bytes_received), analytic for mpi4py-fft. "
             "N processes share the machine's cores.", "",
             "time/hvd: this backend's time over HvdSimdMeshImpl's (> 1: slower than hvd).", "",
             "| workload | nc | grid | backend | time [ms] | time/hvd | build [s] | first [s] "
             "| RSS [MB] | MB/rank |", "|---|---|---|---|---|---|---|---|---|---|"]
    by = {(r["backend"], r["workload"], r["nc"], tuple(r["grid"])): r for r in records}
    order = {b: i for i, b in enumerate(BACKENDS)}
    for r in sorted(records, key=lambda r: (WORKLOADS.index(r["workload"]), r["nc"],
                                            r["grid"][0] * r["grid"][1], r["grid"],
                                            order[r["backend"]])):
        h = by.get(("hvd", r["workload"], r["nc"], tuple(r["grid"])))
        ratio = "%.2f" % (r["median_s"] / h["median_s"]) if h else "-"
        rss = "%.0f" % r["rss_max_mb"]
        if r["backend"] == "cluster":
            rss += " (%.0f)" % r["rss_mb"][0]
        mb = "%.2f" % (r["bytes"]["wire_max"] / 2**20) if "bytes" in r else "-"
        lines.append("| %s | %d | %s | %s | %.1f | %s | %.2f | %.2f | %s | %s |" % (
            r["workload"], r["nc"], grid_str(r["grid"]), LABELS[r["backend"]],
            1e3 * r["median_s"], ratio, r["build_s"], r["first_run_s"], rss, mb))
    return "\n".join(lines) + "\n"


def plots(records, out):
    """Time and memory per workload vs mesh size, one line per backend and grid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"hvd": "C0", "placement": "C1", "cluster": "C2", "mpi4py-fft": "C3"}
    markers = {(1, 2): "o", (2, 1): "s", (2, 2): "^"}
    for quantity, ylabel, fname in (("median_s", "time per run [ms]", "bench_time.png"),
                                    ("rss_max_mb", "peak RSS, largest process [MB]",
                                     "bench_memory.png")):
        fig, axes = plt.subplots(1, len(WORKLOADS), figsize=(4.2 * len(WORKLOADS), 3.8))
        for ax, wl in zip(axes, WORKLOADS):
            for b in BACKENDS:
                grids = sorted({tuple(r["grid"]) for r in records
                                if r["backend"] == b and r["workload"] == wl})
                for g in grids:
                    rs = sorted((r for r in records if r["backend"] == b and r["workload"] == wl
                                 and tuple(r["grid"]) == g), key=lambda r: r["nc"])
                    y = [r[quantity] * (1e3 if quantity == "median_s" else 1) for r in rs]
                    ax.plot([r["nc"] for r in rs], y, marker=markers.get(g, "x"),
                            color=colors[b], ls="-" if g[0] * g[1] == 4 else "--",
                            label="%s %s" % (b, grid_str(g)))
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(wl)
            ax.set_xlabel("nc (mesh nc^3)")
            ax.set_ylabel(ylabel)
        axes[0].legend(fontsize=6, ncol=2)
        fig.tight_layout()
        fig.savefig(os.path.join(out, fname), dpi=100)
        plt.close(fig)


# ============================================================================ main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", nargs="+", default=["all"],
                    choices=("all",) + BACKENDS + ("cluster-worker",),
                    help="driver: backends to run (default all); with --record: this "
                         "process's role")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--sizes", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--grids", type=parse_grid, nargs="+",
                    default=[(1, 2), (2, 1), (2, 2)])
    ap.add_argument("--halo", type=int, default=8, help="halo size [cells]")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(RESULTS, "bench"),
                    help="tables and plots; the JSON goes to results/raw/bench/ for the "
                         "default (see flowpm_bench.results.raw_dir)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny CI run: 16^3, grid 1x2, halo 2, 1 warm-up, 1 repeat")
    ap.add_argument("--merge", action="store_true",
                    help="keep records of other configurations from an existing JSON")
    ap.add_argument("--no-isolate", dest="isolate", action="store_false",
                    help="run all workloads in one process per backend (faster; the peak "
                         "memory is then cumulative)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--render", action="store_true",
                    help="only rewrite the Markdown table and plots from the JSON of --out")
    ap.add_argument("--note", default="", help="load conditions etc., quoted in the table")
    # sub-run options
    ap.add_argument("--record", help="sub-run: write this process's records here")
    ap.add_argument("--size", type=int)
    ap.add_argument("--grid", type=parse_grid)
    ap.add_argument("--ports", help="cluster: comma-separated worker ports on 127.0.0.1")
    ap.add_argument("--task", type=int, default=0)
    args = ap.parse_args(argv)
    if args.smoke:
        args.sizes, args.grids = SMOKE["sizes"], [parse_grid(g) for g in SMOKE["grids"]]
        args.repeats, args.warmup, args.halo = SMOKE["repeats"], SMOKE["warmup"], SMOKE["halo"]
        args.isolate = False
    elif args.repeats < 5:
        ap.error("--repeats must be at least 5 (or use --smoke)")
    if args.warmup < 1:
        ap.error("--warmup must be at least 1 (the first run is reported separately)")
    if args.record:
        role = args.backend[0]
        if len(args.backend) != 1 or role == "all":
            ap.error("with --record give exactly one --backend")
        if role == "cluster-worker":
            return run_cluster_worker(args)
        if args.size is None or args.grid is None:
            ap.error("a sub-run needs --size and --grid")
        make_conf(args.size, args.grid, args.halo)
        if role == "hvd":
            return run_hvd(args)
        if role == "placement":
            write_json(args.record, run_placement(args))
            return None
        if role == "cluster":
            return run_cluster_master(args)
        return run_mpi4py_fft(args)
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the driver's progress
    if args.render:
        path = json_path(args.out, "bench_compare")
        data = read_raw(path)
        write_table(os.path.join(args.out, "bench_compare.md"),
                    markdown(data["meta"], data["records"]), SCRIPT, rendered_from=path)
        plots(data["records"], args.out)
        return None
    if "cluster-worker" in args.backend:
        ap.error("cluster-worker is a sub-run role (needs --record)")
    for g in args.grids:
        for s in args.sizes:
            make_conf(s, g, args.halo)  # a clear ValueError before anything runs
    drive(args)
    return None


if __name__ == "__main__":
    main()
