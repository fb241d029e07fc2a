"""Benchmark of the gradient of the N-body reconstruction: adjoint vs stored, memory and time.

Modes::

    # one measurement under MPI (HvdSimdMeshImpl), one JSON record
    mpirun -np 2 python scripts/bench_gradient.py run --nc 64 --steps 10 --mode adjoint --json r.json
    # the matrix: results/bench_gradient.md and the raw results/raw/bench_gradient.json
    python scripts/bench_gradient.py all
    # rewrite the Markdown from the JSON
    python scripts/bench_gradient.py render
    # the gradient's accuracy, adjoint vs stored, float32 and float64 (one process):
    # results/bench_gradient_accuracy.md
    python scripts/bench_gradient.py accuracy --sizes 32 --cell 4 --steps 5 10 20 40

What is measured (``run``), one process per rank, one configuration per launch
------------------------------------------------------------------------------
The reconstruction of ``flowpm-mtf reconstruct --forward nbody`` (the default
simulation of the other benchmarks: 2LPT at a = 0.1, KDK steps to a = 1, 200
Mpc/h, float32, eulerian; ``flowpm_bench.configs.sim_config``):

``forward``   the forward model alone: the loss at the current field through the
              adjoint's forward pass (2LPT from the field variable, the N-body,
              the CIC density, the loss), as one iteration runs it (the data are
              made once before: their graph depends on constants only, which
              TensorFlow folds, so it is no forward run to time);
``adjoint``   one Adam iteration with ``--gradient adjoint`` (forward keeping
              the final state, reverse loop, LPT chain, prior, Adam);
``stored``    one Adam iteration with ``--gradient stored`` (``mtf.gradients``
              through the unrolled model).

Time: median of ``--repeats`` runs after ``--warmup`` runs (the first run of a
graph includes TensorFlow's one-time graph optimisation), slowest rank. Peak:
the peak resident memory of the process (``ru_maxrss``) at the end, largest
rank; it includes TF's own ~0.4 GB and the graph.

Each rank starts as a ``flowpm-mtf`` job does: MPI's waiting policy
(:mod:`flowpm_mtf.launch_env`) and the host allocator of the jobs
(:mod:`flowpm_mtf.allocator`: ``tcmalloc`` unless ``FLOWPM_MTF_ALLOCATOR`` says
otherwise; recorded as ``allocator``). Records without it ran under TensorFlow's
own allocator, which no job uses: its held memory grows with the steps, tcmalloc's
does not.

A stored run whose peak, extrapolated linearly in the steps from the measured
runs of the same size and ranks, would exceed ``--max-memory-fraction`` of the
machine is not launched (the table says so).
"""
import argparse
import logging
import os
import statistics
import sys
import time

from flowpm_bench import RESULTS, provenance
from flowpm_bench.configs import sim_config
from flowpm_bench.launch import default_grid, mpirun_command, run
from flowpm_bench.measure import peak_mb
from flowpm_bench.results import json_path, read_raw, write_json, write_result, write_table

log = logging.getLogger("bench_gradient")
SCRIPT = "scripts/bench_gradient.py"
NAME = "bench_gradient"
MODES = ("forward", "adjoint", "stored")


# ----------------------------------------------------------------------------- run (MPI)
def cmd_run(args):
    import mesh_tensorflow as mtf
    import tensorflow.compat.v1 as tf
    from mpi4py import MPI

    from flowpm_mtf import allocator
    from flowpm_mtf.backend import make_mesh_impl, session_config
    from flowpm_mtf.jobs import runner
    from flowpm_mtf.gradients.reconstruct import ReconConfig, ReconstructionGraph

    tf.disable_eager_execution()
    comm = MPI.COMM_WORLD
    size = comm.Get_size()
    grid = default_grid(size)
    conf = sim_config(args.nc, grid, args.steps)
    gradient = "adjoint" if args.mode == "forward" else args.mode
    rconf = ReconConfig(iterations=1, forward="nbody", gradient=gradient)
    rec = {"nc": args.nc, "ranks": size, "grid": list(grid), "n_steps": args.steps,
           "mode": args.mode, "dtype": conf.dtype, "box_size": conf.box_size[0],
           "decomposition": conf.decomposition, "warmup": args.warmup, "repeats": args.repeats,
           "allocator": allocator.active()}
    impl = make_mesh_impl("hvd", conf.mesh_shape, conf.layout_rules)
    with tf.Graph().as_default():
        t0 = time.perf_counter()
        graph = mtf.Graph()
        mesh = mtf.Mesh(graph, "mesh")
        rg = ReconstructionGraph(conf, rconf, mesh)
        lowering = runner.lower(graph, mesh, impl)
        ops = rg.lower_iteration(lowering)
        rec["graph_build_s"] = time.perf_counter() - t0
        with runner.session(session_config("hvd"), lowering) as sess:
            rg.observe(sess, ops)
            if args.mode == "forward":
                def once():
                    rg.evaluate(sess, ops)
            else:
                def once():
                    rg.iterate(sess, ops)
            times = []
            for i in range(args.warmup + args.repeats):
                comm.Barrier()
                t = time.perf_counter()
                once()
                comm.Barrier()
                if i >= args.warmup:
                    times.append(time.perf_counter() - t)
    rec["time_s"] = statistics.median(times)
    rec["times_s"] = times
    rec["peak_memory_mb"] = comm.allgather(peak_mb())
    log.info("%s %d^3, %d steps, %d rank(s): %.2f s, peak %.0f MB", args.mode, args.nc,
             args.steps, size, rec["time_s"], max(rec["peak_memory_mb"]))
    if comm.Get_rank() == 0 and args.json:
        write_json(args.json, rec)
    return rec


# ----------------------------------------------------------------------------- the matrix
def _key(r):
    return (r["nc"], r["ranks"], r["mode"], r["n_steps"])


def _predicted_stored_mb(records, nc, ranks, steps):
    """Peak of a stored run extrapolated linearly in the steps (None: < 2 measured)."""
    pts = sorted((r["n_steps"], max(r["peak_memory_mb"])) for r in records
                 if r["nc"] == nc and r["ranks"] == ranks and r["mode"] == "stored"
                 and "peak_memory_mb" in r)
    if len(pts) < 2:
        return None
    (s0, m0), (s1, m1) = pts[-2], pts[-1]
    return m1 + (m1 - m0) / (s1 - s0) * (steps - s1)


def cmd_all(args):
    path = json_path(args.out, NAME)
    data = read_raw(path) if args.resume and os.path.exists(path) else None
    records = list(data["records"]) if data else []
    done = {_key(r) for r in records}
    machine_mb = provenance.memory_gb() * 1024
    plan = []
    for nc in args.sizes:
        for ranks in args.ranks:
            steps = args.steps if (nc, ranks) not in args.only_10 else [10]
            for mode in MODES:
                for s in steps:
                    plan.append((nc, ranks, mode, s))
    for nc, ranks, mode, s in plan:
        if (nc, ranks, mode, s) in done:
            continue
        rec = {"nc": nc, "ranks": ranks, "mode": mode, "n_steps": s}
        if mode == "stored":
            pred = _predicted_stored_mb(records, nc, ranks, s)
            if pred is not None and pred * ranks > args.max_memory_fraction * machine_mb:
                rec["skipped"] = ("predicted peak %.0f MB per rank x %d ranks > %.0f%% of the "
                                  "machine's %.0f MB" % (pred, ranks, 100 * args.max_memory_fraction,
                                                         machine_mb))
                log.info("skip %s: %s", _key(rec), rec["skipped"])
                records.append(rec)
                continue
        tmp = os.path.join(args.out, "raw", "bench_gradient_run.json")
        warmup = args.warmup if nc < 128 else args.warmup_large
        cmd = mpirun_command(ranks) + [sys.executable, os.path.abspath(__file__), "run",
                                       "--nc", str(nc), "--steps", str(s), "--mode", mode,
                                       "--warmup", str(warmup), "--repeats", str(args.repeats),
                                       "--json", tmp]
        try:
            rec["wall_s"] = run(cmd, args.timeout)
            rec.update(read_raw(tmp))
        except Exception as exc:   # a failed run is a result too (e.g. out of memory)
            rec["failed"] = str(exc).splitlines()[0][:300]
            log.warning("%s failed: %s", _key(rec), rec["failed"])
        records.append(rec)
        write_json(path, {"records": records, "command": " ".join(sys.argv[1:])})
    data = {"records": records, "command": " ".join(sys.argv[1:]),
            "load_end": os.getloadavg()[0]}
    write_result(args.out, NAME, data, render(data), SCRIPT)


# ----------------------------------------------------------------------------- accuracy
def _loss_fn(conf, weight):
    """``sum(W rho^2) + sum(w(id) . p)`` of a final state (as tests/test_model_gradient.py)."""
    import mesh_tensorflow as mtf
    import tensorflow.compat.v1 as tf

    from flowpm_mtf.mesh import fft, slots
    from flowpm_mtf.physics import gravity
    from flowpm_mtf import layout

    def loss(state):
        mesh = state.positions.mesh
        w = mtf.import_tf_tensor(mesh, tf.constant(weight.astype(conf.np_dtype)),
                                 fft.real_shape(conf))
        rho = gravity.density(state.positions, conf, slots.weights(state.ids, conf))
        ids = state.ids
        k = mtf.cast(mtf.range(mesh, mtf.Dimension(layout.XYZ, 3), dtype=tf.int32),
                     conf.tf_dtype)
        valid = mtf.cast(mtf.greater_equal(ids, mtf.zeros(mesh, ids.shape, ids.dtype)),
                         conf.tf_dtype)
        wp = mtf.sin(mtf.cast(ids, conf.tf_dtype) * 0.618034 + k * 1.3 + 2.0) * valid
        return mtf.reduce_sum(w * rho * rho) + mtf.reduce_sum(wp * state.momenta)
    return loss


def _field_gradient(conf, linear, weight, how):
    """d loss / d linear field, ``how`` = "adjoint" (ModelGradient) or "stored"."""
    import mesh_tensorflow as mtf
    import tensorflow.compat.v1 as tf

    from flowpm_mtf.mesh import fft
    from flowpm_mtf.physics import lpt, nbody
    from flowpm_mtf.gradients import model_gradient
    from flowpm_mtf.backend import make_mesh_impl, session_config
    from flowpm_mtf.jobs import runner

    with tf.Graph().as_default():
        graph = mtf.Graph()
        mesh = mtf.Mesh(graph, "mesh")
        s = mtf.import_tf_tensor(mesh, tf.constant(linear.astype(conf.np_dtype)),
                                 fft.real_shape(conf))
        loss_fn = _loss_fn(conf, weight)
        if how == "adjoint":
            mg = model_gradient.ModelGradient(conf, mesh, loss_fn, linear=s, params=())
            grad = mg.field_gradient
        else:
            loss = loss_fn(nbody.nbody(lpt.lpt_init(s, conf, forces=False), conf))
            grad = mtf.gradients([loss], [s])[0]
        lowering = runner.lower(graph, mesh, make_mesh_impl("hvd", conf.mesh_shape,
                                                            conf.layout_rules))
        out = lowering.export_to_tf_tensor(grad)
        ops = mg.lower(lowering) if how == "adjoint" else None
        with runner.session(session_config("hvd"), lowering) as sess:
            if how == "adjoint":
                return mg.run(sess, ops, extra=out)["extra"]
            return sess.run(out)


def cmd_accuracy(args):
    """Adjoint and stored gradients in float32 and float64 against the float64 stored one."""
    import numpy as np
    import tensorflow.compat.v1 as tf

    from flowpm_mtf.config import SimConfig
    from flowpm_bench.reference import linear_field_numpy

    tf.disable_eager_execution()
    path = json_path(args.out, NAME + "_accuracy")
    data = read_raw(path) if os.path.exists(path) else {"records": []}
    rng = np.random.RandomState(13)
    for nc in args.sizes:
        weight = rng.randn(nc, nc, nc)
        for steps in args.steps:
            conf = SimConfig(nc=nc, box_size=args.cell * nc, grid=(1, 1), lpt_order=2,
                             a_start=0.1, a_end=1.0, n_steps=steps, dtype="float64",
                             decomposition=args.decomposition,
                             halo_size=None if args.decomposition == "eulerian" else 4)
            linear = linear_field_numpy(conf)
            ref = _field_gradient(conf, linear, weight, "stored")
            rec = {"nc": nc, "cell_mpc_h": args.cell, "n_steps": steps,
                   "decomposition": args.decomposition}
            c32 = conf.replace(dtype="float32")
            for name, c, how in (("adjoint64", conf, "adjoint"), ("stored32", c32, "stored"),
                                 ("adjoint32", c32, "adjoint")):
                g = _field_gradient(c, linear, weight, how)
                rec[name] = float(np.abs(g - ref).max() / np.abs(ref).max())
            log.info("accuracy %s", rec)
            data["records"] = [r for r in data["records"] if
                               (r["nc"], r["cell_mpc_h"], r["n_steps"], r["decomposition"]) !=
                               (nc, args.cell, steps, args.decomposition)] + [rec]
            write_json(path, data)
    lines = ["# Gradient accuracy (`%s accuracy`)" % SCRIPT, "",
             "d loss / d linear field (loss: sum(W rho^2) + sum(w(id) . p) of the final state, "
             "2LPT at a=0.1, KDK steps to a=1), max |g - g_ref| / max |g_ref| against the "
             "float64 stored gradient (`mtf.gradients` through the unrolled model), one "
             "process.", "",
             "| mesh | cell [Mpc/h] | decomposition | steps | adjoint float64 | stored float32 "
             "| adjoint float32 |", "|---|---|---|---|---|---|---|"]
    for r in sorted(data["records"], key=lambda r: (r["nc"], r["cell_mpc_h"],
                                                    r["decomposition"], r["n_steps"])):
        lines.append("| %d^3 | %g | %s | %d | %.1e | %.1e | %.1e |" % (
            r["nc"], r["cell_mpc_h"], r["decomposition"], r["n_steps"], r["adjoint64"],
            r["stored32"], r["adjoint32"]))
    write_table(os.path.join(args.out, NAME + "_accuracy.md"), "\n".join(lines) + "\n", SCRIPT)


# ----------------------------------------------------------------------------- render
def render(data):
    recs = {_key(r): r for r in data["records"]}
    lines = ["# Gradient benchmark (`%s`)" % SCRIPT, "",
             "The reconstruction's gradient with an N-body forward model "
             "(`flowpm-mtf reconstruct --forward nbody`): the default simulation (2LPT at "
             "a=0.1, KDK steps to a=1, 200 Mpc/h, float32, eulerian). `forward`: the forward "
             "model alone (2LPT from the field, N-body, density, loss); `adjoint` / `stored`: one "
             "Adam iteration with `--gradient adjoint` / `--gradient stored`. Time: median "
             "after the warm-up runs named in the raw JSON, slowest rank; peak: resident "
             "memory per rank (largest rank, includes TF's ~0.4 GB). Host allocator: %s. "
             "Command: `%s`; 1-min load at the end %.1f."
             % (_allocators(data["records"]), data.get("command", ""),
                data.get("load_end", float("nan"))),
             "",
             "| mesh | ranks | steps | forward [s] | adjoint [s] | stored [s] | adjoint / "
             "forward | stored / forward | peak forward [MB] | peak adjoint [MB] | peak stored "
             "[MB] | adjoint peak / forward peak |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def val(r, what):
        if r is None:
            return None
        if "skipped" in r:
            return "not run"
        if "failed" in r:
            return "failed"
        return r["time_s"] if what == "t" else max(r["peak_memory_mb"])

    def fmt(v, f="%.2f"):
        return "-" if v is None else v if isinstance(v, str) else f % v

    def ratio(a, b, f="%.2f"):
        return f % (a / b) if isinstance(a, float) and isinstance(b, float) else "-"

    combos = sorted({(r["nc"], r["ranks"], r["n_steps"]) for r in data["records"]})
    for nc, ranks, s in combos:
        t = {m: val(recs.get((nc, ranks, m, s)), "t") for m in MODES}
        p = {m: val(recs.get((nc, ranks, m, s)), "p") for m in MODES}
        lines.append("| %d^3 | %d | %d | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            nc, ranks, s, fmt(t["forward"]), fmt(t["adjoint"]), fmt(t["stored"]),
            ratio(t["adjoint"], t["forward"]), ratio(t["stored"], t["forward"]),
            fmt(p["forward"], "%.0f"), fmt(p["adjoint"], "%.0f"), fmt(p["stored"], "%.0f"),
            ratio(p["adjoint"], p["forward"])))
    # the targets
    lines += ["", "## Targets", ""]
    for nc in sorted({r["nc"] for r in data["records"]}):
        for ranks in sorted({r["ranks"] for r in data["records"] if r["nc"] == nc}):
            a = {s: val(recs.get((nc, ranks, "adjoint", s)), "p") for s in (5, 40)}
            if isinstance(a[5], float) and isinstance(a[40], float):
                lines.append("- %d^3, %d rank(s): adjoint peak at 40 steps / at 5 steps = "
                             "**%.3f** (target <= 1.10)." % (nc, ranks, a[40] / a[5]))
            st = [(s, val(recs.get((nc, ranks, "stored", s)), "p")) for s in (5, 10, 20, 40)]
            st = [(s, v) for s, v in st if isinstance(v, float)]
            if len(st) >= 2:
                slope = (st[-1][1] - st[0][1]) / (st[-1][0] - st[0][0])
                lines.append("- %d^3, %d rank(s): the stored gradient grows by %.1f MB per "
                             "step per rank." % (nc, ranks, slope))
    lines += ["", "The gradient/forward time ratio is in the table (target <= 3, aim 2). "
              "The reconstruction target (128^3, 10 steps, 2 ranks, within the forward run's "
              "memory + 30 %) is the column 'adjoint peak / forward peak' of that row."]
    return "\n".join(lines) + "\n"


def _allocators(records):
    """The host allocators of the runs, as the table's header names them."""
    modes = sorted({r.get("allocator", "tf (runs before 2026-11-28)") for r in records
                    if "time_s" in r})
    return ", ".join("`%s`" % m for m in modes) or "-"


def cmd_render(args):
    path = json_path(args.out, NAME)
    data = read_raw(path)
    write_table(os.path.join(args.out, NAME + ".md"), render(data), SCRIPT, rendered_from=path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run")
    p.add_argument("--nc", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--json")
    p = sub.add_parser("all")
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 128])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--steps", type=int, nargs="+", default=[5, 10, 20, 40])
    p.add_argument("--only-10", type=lambda s: tuple(int(v) for v in s.split("x")),
                   nargs="*", default=[],
                   help="(nc x ranks) pairs run at 10 steps only (cost), e.g. 128x1")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--warmup-large", type=int, default=0,
                   help="warm-up runs from 128^3 on (cost)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--max-memory-fraction", type=float, default=0.6)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--resume", action="store_true",
                   help="keep the records of the raw JSON and run only what is missing")
    p.add_argument("--out", default=RESULTS)
    p = sub.add_parser("render")
    p.add_argument("--out", default=RESULTS)
    p = sub.add_parser("accuracy", help="adjoint vs stored gradient, float32 and float64: "
                       "results/bench_gradient_accuracy.md")
    p.add_argument("--sizes", type=int, nargs="+", default=[32])
    p.add_argument("--cell", type=float, default=4.0, help="cell size [Mpc/h]")
    p.add_argument("--steps", type=int, nargs="+", default=[5, 10, 20, 40])
    p.add_argument("--decomposition", choices=("eulerian", "lagrangian"), default="eulerian")
    p.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s bench_gradient: %(message)s")
    logging.getLogger("tensorflow").setLevel(logging.ERROR)
    if args.cmd == "run":
        # as the flowpm-mtf entry point, before MPI and TensorFlow load (module docstring)
        from flowpm_mtf import allocator, launch_env

        launch_env.apply()
        allocator.ensure()
        from flowpm_mtf.backend import install_abort_on_exception

        install_abort_on_exception()
    {"run": cmd_run, "all": cmd_all, "render": cmd_render,
     "accuracy": cmd_accuracy}[args.cmd](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
