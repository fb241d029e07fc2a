"""Benchmark against the peers: our PM step, 2LPT ICs and FFT vs JaxPM and mpi4py-fft.

Everything runs in one invocation on the same machine, so the ratios compare
like with like even on a loaded machine::

    # the table (incremental: records are merged into results/raw/bench_peers.json)
    python scripts/bench_peers.py all --sizes 64 128 --ranks 1 2
    python scripts/bench_peers.py all --sizes 192 256 --ranks 1 2 4
    # before/after: also run the code of another revision (extracted with git archive)
    python scripts/bench_peers.py all --sizes 64 128 --ranks 1 2 --baseline b789294
    # graph build: HvdSimdMeshImpl per rank vs PlacementMeshImpl's master, N devices
    python scripts/bench_peers.py all --peers build --build-n 4 16 64
    # rewrite the Markdown and the plot from the JSON
    python scripts/bench_peers.py render
    # the FFT round trip against mpi4py-fft, separate launches, 4 pairs per case
    python scripts/bench_peers.py fft-pairs --sizes 128 192 --ranks 2 4 --repeat 4

Peers (``--peers``, default ``ours jaxpm mpi4py-fft``):

``ours``
    ``mpirun -np R``: the simulation graph of ``flowpm-mtf simulate``
    (:class:`flowpm_mtf.jobs.nbody_run.SimulationGraph`: 2LPT at a = 0.1, FastPM
    kick-drift-kick steps, 200 Mpc/h, float32, halo 25 Mpc/h as
    ``scripts/bench_sim.py``) with ``HvdSimdMeshImpl``: graph build [s]; ICs
    (white noise, 2LPT, the first PM force) on their first run, as a job runs
    them (``ics_s``), and warm (``ics_warm_s``, a second run); the median warm
    step [s] (steps 2..); the round trip ``c2r(r2c(rho))`` of the distributed FFT
    (median of 5 after a warm-up); peak resident memory per rank [MB]. Under the host
    allocator of the jobs (:mod:`flowpm_mtf.allocator`, tcmalloc by default; recorded).
``jaxpm``
    JaxPM 0.1.6 from PyPI, in its own virtualenv created here
    (``results/tmp/venv-jaxpm``: ``pip install jaxpm==0.1.6 packaging``; JaxPM
    needs a newer numpy than our TensorFlow stack) runs
    ``flowpm_bench/peers/jaxpm_force.py``: the jitted
    ``jaxpm.pm.pm_forces`` on a perturbed lattice (one PM force: paint, FFTs,
    gradient kernels, readout), and a jitted kick-drift-kick step built from it
    with constant factors (the same work as our step). JaxPM's ``lpt`` needs an
    unreleased jax_cosmo (KeyError 'h' with jax-cosmo 0.1.0), so its ICs are not
    timed. One process, XLA's CPU threads (all cores).
``mpi4py-fft``
    ``mpirun -np R``: mpi4py-fft (FFTW) real-to-complex forward + backward on
    the same process grid as ours, float32, median of 5 after a warm-up.
``build``
    Graph build + lowering of a small simulation graph (16^3 per rank, 1 step):
    per rank with ``HvdSimdMeshImpl`` under ``mpirun -np N --oversubscribe``
    (the slowest rank), and in one process with Mesh TF's ``PlacementMeshImpl``
    on N logical CPU devices (the master builds every device's graph). Nothing
    is run. Wall and CPU time per rank (under oversubscription the CPU time is
    what a rank with its own core spends), and the memory private to each process.

``fft-pairs``
    ``ours --fft-only`` (the round trip alone, on an N(0, 1) field; both round trips are
    ``flowpm_bench.fft_timing``'s runners) and
    ``mpi4py-fft`` in separate launches, back to back, the order alternating,
    repeated: with more ranks than cores one launch's ratio moves by 2x, the median
    over pairs much less. Writes ``results/fft_pairs.md`` and
    ``results/raw/fft_pairs.json``.

Outputs: ``results/raw/bench_peers.json`` (unversioned; records keyed by peer, code,
size and ranks; a new run replaces the records it measures), ``results/bench_peers.md``
and ``results/bench_peers.png`` (time per particle vs mesh size); with ``--out DIR``
outside ``results/`` the JSON goes to ``DIR`` (:func:`flowpm_bench.results.raw_dir`).
Oversubscription: with more ranks than cores the times are totals of work.
"""
import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types

import numpy as np

from flowpm_bench import REPO, RESULTS, configs, peers, provenance
from flowpm_bench.launch import clean_env, default_grid, mpirun_command
from flowpm_bench.measure import peak_mb, private_mb  # noqa: F401  (private_mb: tests)
from flowpm_bench.results import json_path, read_json, read_raw, write_json, write_table

log = logging.getLogger("bench_peers")

JAXPM_VENV = os.path.join(REPO, "results", "tmp", "venv-jaxpm")
JAXPM_PKGS = ["jaxpm==0.1.6", "packaging"]
#: The JaxPM program, run by path with JaxPM's python.
JAXPM_PROGRAM = os.path.join(peers.HERE, "jaxpm_force.py")
BUILD_NC_PER_RANK = 16
SCRIPT = "scripts/bench_peers.py"


def roundtrip_times(fn, comm, repeats):
    """Wall and CPU time of one call of ``fn`` (a distributed FFT round trip) on ``comm``.

    Returns
    -------
    tuple of float
        The slowest rank's median wall time [s] over ``repeats`` calls after one
        warm-up call, and the median over the calls of the process CPU time [s]
        summed over the ranks (all threads: with more ranks than cores the wall
        time is about this sum over the cores; MPI waits busy-poll and count).
    """
    fn()
    walls, cpus = [], []
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - t)
        cpus.append(time.process_time() - c)
    wall = max(comm.allgather(statistics.median(walls)))
    cpu = statistics.median(np.sum(comm.allgather(cpus), axis=0))
    return wall, float(cpu)


# ----------------------------------------------------------------------------- ours (MPI)
def simulation_graph_class():
    """The simulation graph of ``flowpm-mtf simulate``, in the current or an older tree."""
    try:
        from flowpm_mtf.jobs.nbody_run import SimulationGraph
    except ImportError:  # before the jobs package (e.g. a --baseline revision)
        from flowpm_mtf.simulate import SimulationGraph
    return SimulationGraph


def start_allocator():
    """Start as the ``flowpm-mtf`` entry point does, so ours is timed as a job runs:
    MPI's waiting policy (:mod:`flowpm_mtf.launch_env`, before MPI loads) and the
    host allocator (:mod:`flowpm_mtf.allocator`, a re-execution before TensorFlow
    loads); the allocator mode in effect, or ``"tf"`` for a revision without the
    module."""
    try:
        from flowpm_mtf import launch_env
    except ImportError:  # a baseline revision without it
        pass
    else:
        launch_env.apply()
    try:
        from flowpm_mtf import allocator
    except ImportError:
        return "tf"
    allocator.ensure()
    return allocator.active()


def cmd_ours(args):
    mode = start_allocator()
    import mesh_tensorflow as mtf
    import tensorflow.compat.v1 as tf
    from mpi4py import MPI

    from hvd_mesh_impl import HvdSimdMeshImpl, export_local_slice
    try:
        from flowpm_mtf.mesh import fft
    except ImportError:  # a --baseline revision before the folders
        from flowpm_mtf import fft
    from flowpm_mtf.backend import session_config

    tf.disable_eager_execution()
    SimulationGraph = simulation_graph_class()
    comm = MPI.COMM_WORLD
    size = comm.Get_size()
    conf = configs.sim_config(args.nc, default_grid(size), args.steps)
    impl = HvdSimdMeshImpl(conf.mesh_shape, conf.layout_rules)
    rec = {"peer": "ours", "nc": args.nc, "ranks": size, "grid": list(conf.grid),
           "halo": conf.halo_size, "n_steps": conf.n_steps,
           "native": os.environ.get("FLOWPM_MTF_NATIVE", "auto"), "allocator": mode,
           "cores_per_rank": min(comm.allgather(len(os.sched_getaffinity(0))))}
    if args.fft_only:
        return _ours_fft_only(args, conf, impl, rec, comm)
    comm.Barrier()
    t0 = time.perf_counter()
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "mesh")
    sim = SimulationGraph(conf, mesh)
    rt = fft.c2r(fft.r2c(sim.rho, conf, name="bench_r2c"), conf, name="bench_c2r")
    lowering = mtf.Lowering(graph, {mesh: impl})
    init_op = tf.group([lowering.lowered_operation(op) for op in sim.init_ops])
    # the first PM force: a second run after the LPT state (None before that split)
    init_force = [lowering.lowered_operation(op) for op in getattr(sim, "init_force_ops", [])]
    step_op = tf.group([lowering.lowered_operation(op) for op in sim.step_ops])
    lpt = getattr(sim, "lpt_state", None)  # None in a revision before it
    if init_force:
        # The 2LPT state alone is init_op (the first force is its own run); since 2241518 its
        # vectors are written into the variables' buffers (flowpm_mtf.mesh.donate), so it runs only
        # with the assignments that give them back.
        lpt_op = init_op
    else:
        lpt_op = (tf.group([export_local_slice(lowering, t) for t in (lpt.positions,
                                                                       lpt.momenta)])
                  if lpt is not None else None)
    rho_local = export_local_slice(lowering, sim.rho)
    rt_local = export_local_slice(lowering, rt)
    copy_masters = lowering.copy_masters_to_slices()
    rec["graph_build_s"] = max(comm.allgather(time.perf_counter() - t0))
    from flowpm_mtf.jobs import runner as job_runner
    initialize = getattr(job_runner, "initialize_variables", None)   # None in older --baseline revisions
    with tf.Session(config=session_config("hvd")) as sess:  # as the jobs (Grappler off)
        if initialize is not None:
            initialize(sess)        # one by one, as the jobs
        else:
            sess.run(tf.global_variables_initializer())
        sess.run(copy_masters)
        for key in ("ics", "ics_warm"):
            comm.Barrier()
            t, c = time.perf_counter(), time.process_time()
            sess.run(init_op)
            if init_force:
                sess.run(init_force)
            rec[key + "_cpu_s"] = sum(comm.allgather(time.process_time() - c))
            rec[key + "_s"] = max(comm.allgather(time.perf_counter() - t))
        if lpt_op is not None:  # 2LPT alone (warm: init_op ran it), without the first force
            lpt_t, lpt_c = [], []
            for _ in range(3):
                comm.Barrier()
                t, c = time.perf_counter(), time.process_time()
                sess.run(lpt_op)
                lpt_c.append(sum(comm.allgather(time.process_time() - c)))
                lpt_t.append(max(comm.allgather(time.perf_counter() - t)))
            rec["lpt_s"], rec["lpt_cpu_s"] = statistics.median(lpt_t), statistics.median(lpt_c)
        steps, cpu = [], []
        for factors in sim.step_factors:
            comm.Barrier()
            t, c = time.perf_counter(), time.process_time()
            sess.run(step_op, {sim.factors: factors})
            cpu.append(sum(comm.allgather(time.process_time() - c)))
            steps.append(max(comm.allgather(time.perf_counter() - t)))
        rec["steps_s"] = steps
        rec["step_s"] = statistics.median(steps[1:]) if len(steps) > 1 else steps[0]
        rec["step_cpu_s"] = statistics.median(cpu[1:]) if len(cpu) > 1 else cpu[0]
        rho = sess.run(rho_local)

        _time_roundtrip(sess, rt_local, rho_local, rho, args.fft_repeats, comm, rec)
    rec["peak_memory_mb"] = comm.allgather(peak_mb())
    if comm.Get_rank() == 0:
        write_json(args.json, rec)


def _time_roundtrip(sess, rt_local, rho_local, rho, repeats, comm, rec):
    """Time ``rt_local`` (the round trip of ``rho_local``, fed ``rho``) into ``rec``:
    ``fft_roundtrip_s``, ``fft_roundtrip_cpu_s``, ``fft_repeats``, ``fft_roundtrip_max_err``."""
    feed = {rho_local: rho}
    err = float(np.max(np.abs(sess.run(rt_local, feed) - rho)))
    runner = types.SimpleNamespace(run=lambda: sess.run(rt_local, feed),
                                   info={"max_abs_error": err})
    _time_runner(runner, comm, repeats, rec)


def _ours_fft_only(args, conf, impl, rec, comm):
    """The FFT round trip alone (:func:`flowpm_bench.fft_timing.mtf_roundtrip_runner`:
    an N(0, 1) field of the run's mesh and grid)."""
    from flowpm_mtf.backend import session_config
    from flowpm_bench.fft_timing import mtf_roundtrip_runner

    with mtf_roundtrip_runner(conf, impl, session_config=session_config("hvd")) as runner:
        _time_runner(runner, comm, args.fft_repeats, rec)
    rec["fft_only"] = True
    rec["peak_memory_mb"] = comm.allgather(peak_mb())
    if comm.Get_rank() == 0:
        write_json(args.json, rec)


def _time_runner(runner, comm, repeats, rec):
    """Time ``runner.run()`` (a round trip; an :mod:`flowpm_bench.fft_timing` runner or alike,
    ``runner.info["max_abs_error"]`` of this rank) into ``rec`` (see :func:`_time_roundtrip`)."""
    from mpi4py import MPI

    def roundtrip():
        comm.Barrier()
        runner.run()

    rec["fft_roundtrip_s"], rec["fft_roundtrip_cpu_s"] = roundtrip_times(roundtrip, comm, repeats)
    rec["fft_repeats"] = repeats
    rec["fft_roundtrip_max_err"] = comm.allreduce(runner.info["max_abs_error"], op=MPI.MAX)


# ----------------------------------------------------------------------------- mpi4py-fft (MPI)
def cmd_mpi4py_fft(args):
    """mpi4py-fft's FFTW r2c + c2r (:func:`flowpm_bench.fft_timing.mpi4py_fft_roundtrip_runner`,
    float32) on our process grid."""
    from mpi4py import MPI
    from flowpm_bench.fft_timing import mpi4py_fft_roundtrip_runner

    comm = MPI.COMM_WORLD
    size = comm.Get_size()
    P, Q = default_grid(size)
    rec = {"peer": "mpi4py-fft", "nc": args.nc, "ranks": size, "grid": [P, Q, 1]}
    with mpi4py_fft_roundtrip_runner(comm, (args.nc,) * 3, (P, Q), real=True,
                                     single=True) as runner:
        _time_runner(runner, comm, args.fft_repeats, rec)
    rec["peak_memory_mb"] = comm.allgather(peak_mb())
    if comm.Get_rank() == 0:
        write_json(args.json, rec)


# ----------------------------------------------------------------------------- JaxPM (own venv)


def jaxpm_python():
    """The JaxPM virtualenv's python, created (once) if missing."""
    py = os.path.join(JAXPM_VENV, "bin", "python")
    if not os.path.exists(py):
        log.info("creating %s (%s)", JAXPM_VENV, " ".join(JAXPM_PKGS))
        base = shutil.which("python3") or sys.executable
        subprocess.run([base, "-m", "venv", JAXPM_VENV], check=True)
        subprocess.run([py, "-m", "pip", "install", "-q"] + JAXPM_PKGS, check=True)
    return py


# ----------------------------------------------------------------------------- graph build
def _build_graph(conf, impl):
    import mesh_tensorflow as mtf
    import tensorflow.compat.v1 as tf

    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "mesh")
    sim = simulation_graph_class()(conf, mesh)
    lowering = mtf.Lowering(graph, {mesh: impl})
    tf.group([lowering.lowered_operation(op) for op in sim.init_ops + sim.step_ops +
              list(getattr(sim, "init_force_ops", []))])


def build_config(n):
    from flowpm_mtf.config import SimConfig

    P, Q = default_grid(n)
    nc = (BUILD_NC_PER_RANK * P, BUILD_NC_PER_RANK * Q, BUILD_NC_PER_RANK)
    return SimConfig(nc=nc, grid=(P, Q), halo_size=2, n_steps=1, lpt_order=2)


def cmd_build_hvd(args):
    import tensorflow.compat.v1 as tf
    from mpi4py import MPI

    from hvd_mesh_impl import HvdSimdMeshImpl

    tf.disable_eager_execution()
    comm = MPI.COMM_WORLD
    conf = build_config(comm.Get_size())
    impl = HvdSimdMeshImpl(conf.mesh_shape, conf.layout_rules)
    comm.Barrier()
    t, c = time.perf_counter(), time.process_time()
    with tf.Graph().as_default():
        _build_graph(conf, impl)
    times = comm.allgather(time.perf_counter() - t)
    cpu = comm.allgather(time.process_time() - c)
    peaks = comm.allgather(peak_mb())  # collective: every rank, not only rank 0
    private = comm.allgather(private_mb())
    if comm.Get_rank() == 0:
        write_json(args.json, {"peer": "build", "backend": "HvdSimdMeshImpl", "ranks": len(times),
                           "nc": list(conf.nc), "build_s": max(times),
                           "build_s_median": statistics.median(times),
                           "build_cpu_s": max(cpu), "build_cpu_s_median": statistics.median(cpu),
                           "peak_memory_mb": peaks, "private_memory_mb": private})


def cmd_build_placement(args):
    import mesh_tensorflow as mtf
    import tensorflow.compat.v1 as tf

    tf.disable_eager_execution()
    conf = build_config(args.n)
    impl = mtf.placement_mesh_impl.PlacementMeshImpl(
        conf.mesh_shape, conf.layout_rules, ["/cpu:%d" % i for i in range(args.n)])
    t, c = time.perf_counter(), time.process_time()
    with tf.Graph().as_default():
        _build_graph(conf, impl)
    write_json(args.json, {"peer": "build", "backend": "PlacementMeshImpl", "ranks": args.n,
                       "nc": list(conf.nc), "build_s": time.perf_counter() - t,
                       "build_cpu_s": time.process_time() - c,
                       "peak_memory_mb": [peak_mb()], "private_memory_mb": [private_mb()]})


# ----------------------------------------------------------------------------- driver
def _launch(cmd, path, timeout, pythonpath=None):
    log.info("running: %s", " ".join(cmd))
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=clean_env(pythonpath))
    except subprocess.TimeoutExpired:
        log.warning("timed out after %d s: %s", timeout, " ".join(cmd))
        return {"error": "timeout after %d s" % timeout}
    if proc.returncode != 0 or not os.path.exists(path):
        tail = (proc.stderr or proc.stdout)[-2000:]
        log.warning("failed (%d): %s\n%s", proc.returncode, " ".join(cmd), tail)
        return {"error": "exit %d: %s" % (proc.returncode, tail.strip().splitlines()[-1:]
                                          if tail.strip() else "")}
    with open(path) as f:
        rec = json.load(f)
    rec["wall_s"] = time.perf_counter() - t
    return rec


def baseline_code(rev):
    """The tree of git revision ``rev``, extracted into results/tmp/code-<rev>.

    Its native ops are built (``flowpm_mtf.native.build``, idempotent) when the
    revision has them: unbuilt, that tree would silently run its TensorFlow path.
    """
    out = os.path.join(REPO, "results", "tmp", "code-" + rev)
    if not os.path.isdir(out):
        os.makedirs(out)
        archive = subprocess.run(["git", "-C", REPO, "archive", rev], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", out], input=archive, check=True)
    if os.path.exists(os.path.join(out, "flowpm_mtf", "native", "build.py")):
        proc = subprocess.run([sys.executable, "-m", "flowpm_mtf.native.build"], cwd=out,
                              capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit("bench_peers: building the native ops of %s failed: %s"
                             % (rev, (proc.stderr.strip().splitlines() or ["?"])[-1]))
    return out


def _key(rec):
    return "%s|%s|%s|%s|%s" % (rec["peer"], rec.get("code", "-"), rec.get("backend", "-"),
                               rec.get("nc"), rec.get("ranks"))


def code_label(code, stack):
    """The ``code`` column of our records: ``code``, with the stack when it is not the default.

    Parameters
    ----------
    code : str
        ``"current"`` or ``"baseline REV"``.
    stack : str
        :func:`flowpm_bench.provenance.stack` of the interpreter that ran it.

    Returns
    -------
    str
        e.g. ``"current"`` (TF 2.21, the default stack), ``"current tf2.12"``.
    """
    return provenance.with_stack(code, stack)


def normalise(result):
    """Our records written before records carried their stack were TF 2.12's: label them so
    (``code`` and key), as :func:`code_label` labels new ones."""
    records = {}
    for rec in result["records"].values():
        if rec.get("peer") == "ours" and "stack" not in rec:
            rec["stack"] = provenance.PREVIOUS_STACK
            rec["code"] = code_label(rec.get("code", "current"), rec["stack"])
        records[_key(rec)] = rec
    result["records"] = records
    return result


def load_results(path):
    return normalise(read_json(path, {"records": {}}))


def cmd_all(args):
    path = json_path(args.out, "bench_peers")
    result = load_results(path)
    tmp = tempfile.mkdtemp(prefix="bench_peers")
    me = os.path.abspath(__file__)
    stack = provenance.stack()   # of sys.executable, which runs every sub-run
    codes = [(code_label("current", stack), REPO)]
    if args.baseline:
        codes.append((code_label("baseline " + args.baseline, stack),
                      baseline_code(args.baseline)))
    jobs = []  # (record fields, command, pythonpath)
    for nc in args.sizes:
        if "jaxpm" in args.peers:
            jobs.append(({"peer": "jaxpm", "nc": nc, "ranks": 1},
                         lambda p, nc=nc: [jaxpm_python(), JAXPM_PROGRAM, str(nc), p], ""))
        for r in args.ranks:
            if "ours" in args.peers:
                for label, code in codes:
                    cmd = (mpirun_command() + ["-np", str(r), sys.executable, me, "ours", "--nc",
                                        str(nc), "--steps", str(args.steps), "--json"])
                    jobs.append(({"peer": "ours", "nc": nc, "ranks": r, "code": label},
                                 lambda p, cmd=cmd: cmd + [p], code))
            if "mpi4py-fft" in args.peers:
                cmd = mpirun_command() + ["-np", str(r), sys.executable, me, "mpi4py-fft", "--nc",
                                   str(nc), "--json"]
                jobs.append(({"peer": "mpi4py-fft", "nc": nc, "ranks": r},
                             lambda p, cmd=cmd: cmd + [p], REPO))
    if "build" in args.peers:
        for n in args.build_n:
            cmd = mpirun_command() + ["-np", str(n), sys.executable, me, "build-hvd", "--json"]
            jobs.append(({"peer": "build", "backend": "HvdSimdMeshImpl", "ranks": n},
                         lambda p, cmd=cmd: cmd + [p], REPO))
            cmd = [sys.executable, me, "build-placement", "--n", str(n), "--json"]
            jobs.append(({"peer": "build", "backend": "PlacementMeshImpl", "ranks": n},
                         lambda p, cmd=cmd: cmd + [p], REPO))
    for i, (fields, make, pythonpath) in enumerate(jobs):
        out = os.path.join(tmp, "rec%d.json" % i)
        rec = _launch(make(out), out, args.timeout, pythonpath or None)
        rec = dict(fields, **rec)
        rec["stack"] = stack
        rec["date"] = time.strftime("%Y-%m-%d %H:%M:%S")
        rec["load_avg_1min"] = os.getloadavg()[0]
        result["records"][_key(rec)] = rec
        log.info("%s", json.dumps({k: v for k, v in rec.items()
                                   if k not in ("steps_s", "peak_memory_mb")}))
        result["machine"] = machine_info()
        write_json(path, result)  # after every record: an interrupted run keeps its results
    render(result, args.out)
    return result


# ----------------------------------------------------------------------------- FFT pairs
FFT_RATIO_TARGET = 1.5  # issue 14: our FFT round trip <= 1.5x mpi4py-fft's on the same ranks
PAIR_FIELDS = ("fft_roundtrip_s", "fft_roundtrip_cpu_s", "fft_roundtrip_max_err", "grid",
               "fft_repeats", "cores_per_rank", "error")


def cmd_fft_pairs(args):
    """Ours (``--fft-only``) and mpi4py-fft in separate launches, repeated.

    One pair per (iteration, size, ranks), the two launches back to back and in
    alternating order (ours first in odd iterations), so a slow spell of the machine
    falls on both or shows up as an outlier pair; the summary takes medians over
    the pairs. Writes ``fft_pairs.json`` after every pair and ``fft_pairs.md``.
    """
    path = json_path(args.out, "fft_pairs")
    tmp = tempfile.mkdtemp(prefix="fft_pairs")
    me = os.path.abspath(__file__)
    result = {"machine": machine_info(), "fft_repeats": args.fft_repeats, "pairs": []}
    for it in range(1, args.repeat + 1):
        order = ["ours", "mpi4py-fft"] if it % 2 else ["mpi4py-fft", "ours"]
        for nc in args.sizes:
            for r in args.ranks:
                pair = {"iteration": it, "nc": nc, "ranks": r, "order": order,
                        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                        "load_avg_1min": os.getloadavg()[0]}
                for peer in order:
                    out = os.path.join(tmp, peer + ".json")
                    if os.path.exists(out):
                        os.remove(out)
                    cmd = (mpirun_command(r) + [sys.executable, me, peer, "--nc", str(nc),
                                        "--fft-repeats", str(args.fft_repeats), "--json", out]
                           + (["--fft-only"] if peer == "ours" else []))
                    rec = _launch(cmd, out, args.timeout, REPO)
                    pair[peer] = {k: rec[k] for k in PAIR_FIELDS if k in rec}
                result["pairs"].append(pair)
                log.info("%s", json.dumps(pair))
                write_json(path, result)
    write_table(os.path.join(args.out, "fft_pairs.md"), fft_pairs_markdown(result), SCRIPT)
    return result


def _ratio_of(pair, key):
    ours, theirs = pair.get("ours", {}).get(key), pair.get("mpi4py-fft", {}).get(key)
    return ours / theirs if ours and theirs else None


def fft_pairs_summary(pairs):
    """Per (size, ranks): the pairs measured and the median, min and max of the ratios.

    Returns
    -------
    list of dict
        ``nc``, ``ranks``, ``pairs`` (with both times), ``ratio_median``,
        ``ratio_min``, ``ratio_max``, ``cpu_ratio_median`` (None without pairs).
    """
    out = []
    for nc, r in sorted({(p["nc"], p["ranks"]) for p in pairs}):
        mine = [p for p in pairs if (p["nc"], p["ranks"]) == (nc, r)]
        wall = [x for x in (_ratio_of(p, "fft_roundtrip_s") for p in mine) if x is not None]
        cpu = [x for x in (_ratio_of(p, "fft_roundtrip_cpu_s") for p in mine) if x is not None]
        out.append({"nc": nc, "ranks": r, "pairs": len(wall),
                    "ratio_median": statistics.median(wall) if wall else None,
                    "ratio_min": min(wall) if wall else None,
                    "ratio_max": max(wall) if wall else None,
                    "cpu_ratio_median": statistics.median(cpu) if cpu else None})
    return out


def fft_pairs_markdown(result):
    m = result.get("machine", {})
    lines = ["# FFT round trip against mpi4py-fft, separate launches (`bench_peers.py fft-pairs`)",
             "",
             "Machine: %s cores, %s GB, %s. Each pair: `mpirun -np R bench_peers.py ours "
             "--fft-only` (`c2r(r2c(rho))` on `HvdSimdMeshImpl`, float32) and `mpirun -np R "
             "bench_peers.py mpi4py-fft` (FFTW r2c + c2r, float32, same process grid), back "
             "to back, the order alternating. Time: the slowest rank's median of %s round "
             "trips after a warm-up; CPU: process CPU time per round trip summed over the "
             "ranks (MPI waits busy-poll and count). Target (issue 14): ratio <= %.1f."
             % (m.get("cpus", "?"), m.get("memory_gb", "?"), m.get("platform", "?"),
                result.get("fft_repeats", "?"), FFT_RATIO_TARGET),
             "",
             "| mesh | ranks | pairs | ratio, median | ratio, min-max | CPU ratio, median | "
             "median <= %.1f |" % FFT_RATIO_TARGET,
             "|---|---|---|---|---|---|---|"]
    for row in fft_pairs_summary(result["pairs"]):
        if row["ratio_median"] is None:
            lines.append("| %d³ | %d | 0 | – | – | – | – |" % (row["nc"], row["ranks"]))
            continue
        lines.append("| %d³ | %d | %d | %s | %s-%s | %s | %s |" % (
            row["nc"], row["ranks"], row["pairs"], _fmt(row["ratio_median"], 2),
            _fmt(row["ratio_min"], 2), _fmt(row["ratio_max"], 2),
            _fmt(row["cpu_ratio_median"], 2),
            "yes" if row["ratio_median"] <= FFT_RATIO_TARGET else "no"))
    lines += ["", "| iteration | mesh | ranks (grid) | ours [s] | mpi4py-fft [s] | ratio | "
              "ours CPU [s] | mpi4py-fft CPU [s] | CPU ratio | load | date |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in result["pairs"]:
        o, t = p.get("ours", {}), p.get("mpi4py-fft", {})
        grid = "x".join(str(g) for g in (o.get("grid") or [])[:2]) or "?"
        lines.append("| %d | %d³ | %d (%s) | %s | %s | %s | %s | %s | %s | %.1f | %s |" % (
            p["iteration"], p["nc"], p["ranks"], grid,
            _fmt(o.get("fft_roundtrip_s") or o.get("error")),
            _fmt(t.get("fft_roundtrip_s") or t.get("error")),
            _fmt(_ratio_of(p, "fft_roundtrip_s"), 2), _fmt(o.get("fft_roundtrip_cpu_s")),
            _fmt(t.get("fft_roundtrip_cpu_s")), _fmt(_ratio_of(p, "fft_roundtrip_cpu_s"), 2),
            p.get("load_avg_1min", float("nan")), p.get("date", "")))
    return "\n".join(lines) + "\n"


def cmd_render(args):
    path = json_path(args.out, "bench_peers")
    render(normalise(read_raw(path)), args.out, rendered_from=path)


def machine_info():
    """:func:`flowpm_bench.provenance.machine` without the load (each record has its own)."""
    m = provenance.machine()
    del m["loadavg"]
    return m


# ----------------------------------------------------------------------------- report
def _fmt(v, digits=3):
    if v is None:
        return "–"
    if isinstance(v, str):
        return v
    return ("%." + str(digits) + "g") % v


def _ns_per_particle(t, nc):
    return None if t is None else 1e9 * t / nc**3


def markdown(result):
    recs = [r for r in result["records"].values() if "error" not in r]
    errs = [r for r in result["records"].values() if "error" in r]
    m = result.get("machine", {})
    rows = ["# Peers benchmark (`scripts/bench_peers.py`)", "",
            "Machine: %s cores, %s GB, %s. Times in seconds; ratios are taken between "
            "records of the same table, each measured on this machine (see `date` and "
            "`load_avg_1min` in the JSON: a loaded machine inflates every time)."
            % (m.get("cpus"), m.get("memory_gb"), m.get("platform")), ""]
    jax = {r["nc"]: r for r in recs if r["peer"] == "jaxpm"}
    mfft = {(r["nc"], r["ranks"]): r for r in recs if r["peer"] == "mpi4py-fft"}
    ours = sorted((r for r in recs if r["peer"] == "ours"),
                  key=lambda r: (r["nc"], r["ranks"], r.get("code", "")))
    if ours or jax:
        rows += ["## PM step, ICs and FFT", "",
                 "`step`: our warm kick-drift-kick step (one PM force); `JaxPM force`/`JaxPM "
                 "step`: jitted `pm_forces` / a jitted KDK step around it (1 process, all "
                 "cores); `ICs`: white noise + 2LPT + first force, first run (as a job) and "
                 "warm; `2LPT`: white noise + 2LPT alone (the issue's \"2LPT ICs\"; warm, "
                 "median of 3), without the first force, which is the integrator's; `FFT rt`: distributed r2c + c2r round trip; ns/particle: step time "
                 "per particle; `load`: the machine's 1-minute load average when the record was "
                 "written. `code`: `current` is this commit on the default stack (TensorFlow "
                 "2.21), `current tf2.12` the same on the previous stack (`FLOWPM_MTF_STACK="
                 "tf2.12`); records without a stack name were measured on TF 2.12.", "",
                 "CPU columns: process CPU time (all threads, summed over ranks; MPI waits "
                 "busy-poll), robust on a loaded machine where wall times are not.", "",
                 "| mesh | code | ranks | step | step / JaxPM force | step / JaxPM step | "
                 "step CPU | CPU: step / JaxPM force | "
                 "ICs (first run) | ICs warm | ICs / step | ICs CPU / step CPU | 2LPT | 2LPT / step | "
                 "FFT rt | FFT rt / mpi4py-fft | ns/particle | peak MB/rank | build | load |",
                 "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in ours:
            j = jax.get(r["nc"], {})
            f = mfft.get((r["nc"], r["ranks"]), {})
            ratio = lambda a, b: a / b if a and b else None  # noqa: E731
            rows.append("| %d³ | %s | %d | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s "
                        "| %s | %s | %s | %s | %s | %s |"
                        % (r["nc"], r.get("code", "current"), r["ranks"], _fmt(r["step_s"]),
                           _fmt(ratio(r["step_s"], j.get("force_s")), 2),
                           _fmt(ratio(r["step_s"], j.get("step_s")), 2),
                           _fmt(r.get("step_cpu_s")),
                           _fmt(ratio(r.get("step_cpu_s"), j.get("force_cpu_s")), 2),
                           _fmt(r["ics_s"]), _fmt(r["ics_warm_s"]),
                           _fmt(ratio(r["ics_s"], r["step_s"]), 2),
                           _fmt(ratio(r.get("ics_cpu_s"), r.get("step_cpu_s")), 2),
                           _fmt(r.get("lpt_s")), _fmt(ratio(r.get("lpt_s"), r["step_s"]), 2),
                           _fmt(r["fft_roundtrip_s"]),
                           _fmt(ratio(r["fft_roundtrip_s"], f.get("fft_roundtrip_s")), 2),
                           _fmt(_ns_per_particle(r["step_s"], r["nc"])),
                           _fmt(max(r["peak_memory_mb"]), 4), _fmt(r["graph_build_s"]),
                           _fmt(r.get("load_avg_1min"), 2)))
        rows += ["", "| mesh | JaxPM force | JaxPM step | force CPU | step CPU | "
                 "ns/particle (force) | peak MB | mpi4py-fft rt (ranks) |",
                 "|---|---|---|---|---|---|---|---|"]
        for nc in sorted(set(jax) | {k[0] for k in mfft}):
            j = jax.get(nc, {})
            ffts = ", ".join("%s (%d)" % (_fmt(v["fft_roundtrip_s"]), k[1])
                             for k, v in sorted(mfft.items()) if k[0] == nc)
            rows.append("| %d³ | %s | %s | %s | %s | %s | %s | %s |"
                        % (nc, _fmt(j.get("force_s")), _fmt(j.get("step_s")),
                           _fmt(j.get("force_cpu_s")), _fmt(j.get("step_cpu_s")),
                           _fmt(_ns_per_particle(j.get("force_s"), nc)),
                           _fmt(max(j["peak_memory_mb"]), 4) if j else "–", ffts or "–"))
        rows.append("")
    build = {}
    for r in recs:
        if r["peer"] == "build":
            build.setdefault(r["ranks"], {})[r["backend"]] = r
    if build:
        rows += ["## Graph build (build + lowering, nothing run)", "",
                 "%d³ cells per rank, 2LPT + 1 step. HvdSimdMeshImpl: the slowest rank of an "
                 "`mpirun -np N --oversubscribe` on this machine's cores; its wall time is "
                 "inflated by the oversubscription (N ranks share the cores), its CPU time is "
                 "what a rank with its own core spends. PlacementMeshImpl: one process (the "
                 "master) with N logical CPU devices. Private MB: memory private to a process "
                 "(the largest rank), what N processes need together." % BUILD_NC_PER_RANK, "",
                 "| N | hvd per rank: wall | hvd per rank: CPU | placement: wall | placement: "
                 "CPU | placement / hvd (CPU) | hvd private MB/rank | placement private MB |",
                 "|---|---|---|---|---|---|---|---|"]
        for n in sorted(build):
            h = build[n].get("HvdSimdMeshImpl", {})
            p = build[n].get("PlacementMeshImpl", {})
            hc, pc = h.get("build_cpu_s"), p.get("build_cpu_s")
            rows.append("| %d | %s | %s | %s | %s | %s | %s | %s |"
                        % (n, _fmt(h.get("build_s")), _fmt(hc), _fmt(p.get("build_s")), _fmt(pc),
                           _fmt(pc / hc if hc and pc else None, 2),
                           _fmt(max(h.get("private_memory_mb") or [0]) or None, 4),
                           _fmt(max(p.get("private_memory_mb") or [0]) or None, 4)))
        rows.append("")
    if errs:
        rows += ["## Failed runs", ""]
        rows += ["- %s %s ranks=%s: %s" % (r["peer"], r.get("nc"), r.get("ranks"), r["error"])
                 for r in errs]
        rows.append("")
    return "\n".join(rows)


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in result["records"].values() if "error" not in r]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    series = {}
    for r in recs:
        if r["peer"] == "ours":
            series.setdefault("ours step, %s, %d rank(s)" % (r.get("code", "current"),
                                                               r["ranks"]), []).append(
                (r["nc"], r["step_s"]))
        elif r["peer"] == "jaxpm":
            series.setdefault("JaxPM force", []).append((r["nc"], r["force_s"]))
            series.setdefault("JaxPM step", []).append((r["nc"], r["step_s"]))
    for label, pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [_ns_per_particle(t, nc) for nc, t in pts], "o-",
                label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("mesh size n (n³ particles and cells)")
    ax.set_ylabel("time per particle [ns]")
    ax.set_title("PM step time per particle")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(result, out, rendered_from=None):
    """Write ``out/bench_peers.md`` and ``out/bench_peers.png`` of ``result``."""
    write_table(os.path.join(out, "bench_peers.md"), markdown(result), SCRIPT, rendered_from)
    try:
        plot(result, os.path.join(out, "bench_peers.png"))
    except ImportError as e:  # matplotlib missing: the tables are the result
        log.warning("no plot: %s", e)


# ----------------------------------------------------------------------------- CLI
def main(argv=None):
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("all", help="run the peers and merge into results/bench_peers.*")
    a.add_argument("--sizes", type=int, nargs="+", default=[64, 128])
    a.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    a.add_argument("--peers", nargs="+", default=["ours", "jaxpm", "mpi4py-fft"],
                   choices=["ours", "jaxpm", "mpi4py-fft", "build"])
    a.add_argument("--build-n", type=int, nargs="+", default=[4, 16, 64])
    a.add_argument("--steps", type=int, default=5, help="N-body steps of our run")
    a.add_argument("--baseline", help="also run our code at this git revision")
    a.add_argument("--timeout", type=int, default=1800, help="per run [s]")
    a.add_argument("--out", default=RESULTS)
    r = sub.add_parser("render", help="rewrite the Markdown and plot from the JSON")
    r.add_argument("--out", default=RESULTS)
    for name in ("ours", "mpi4py-fft"):
        p = sub.add_parser(name, help="one measurement under mpirun (internal)")
        p.add_argument("--nc", type=int, required=True)
        p.add_argument("--steps", type=int, default=5)
        p.add_argument("--fft-repeats", type=int, default=5,
                       help="FFT round trips timed (median; after one warm-up)")
        if name == "ours":
            p.add_argument("--fft-only", action="store_true",
                           help="time the FFT round trip alone (no simulation graph)")
        p.add_argument("--json", required=True)
    f = sub.add_parser("fft-pairs", help="ours vs mpi4py-fft FFT round trip, separate "
                       "launches, repeated -> results/fft_pairs.*")
    f.add_argument("--sizes", type=int, nargs="+", default=[128, 192])
    f.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    f.add_argument("--repeat", type=int, default=4, help="pairs per (size, ranks)")
    f.add_argument("--fft-repeats", type=int, default=11, help="round trips timed per launch")
    f.add_argument("--timeout", type=int, default=900, help="per launch [s]")
    f.add_argument("--out", default=RESULTS)
    p = sub.add_parser("build-hvd", help="graph build under mpirun (internal)")
    p.add_argument("--json", required=True)
    p = sub.add_parser("build-placement", help="graph build, N logical devices (internal)")
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--json", required=True)
    args = ap.parse_args(argv)
    {"all": cmd_all, "render": cmd_render, "fft-pairs": cmd_fft_pairs, "ours": cmd_ours,
     "mpi4py-fft": cmd_mpi4py_fft, "build-hvd": cmd_build_hvd,
     "build-placement": cmd_build_placement}[args.cmd](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
