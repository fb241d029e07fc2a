"""Benchmark Mesh TF collectives: HvdSimdMeshImpl (one process per rank, Horovod)
against PlacementMeshImpl (one process, N logical devices).

Each collective moves a per-slice tensor of ``--mbytes`` MB (float32) on a 1-axis
mesh of N processors: alltoall, allreduce (SUM), allconcat, shift by one (wrap).
After ``--warmup`` untimed runs, ``--repeats`` timed runs; the median is reported.

Usage::

    # everything: spawns the mpirun jobs and placement runs, writes
    # results/bench_collectives.md and the raw results/raw/bench_collectives.json
    python scripts/bench_collectives.py --all --sizes 2 4
    # one measurement (what --all runs):
    mpirun -np 4 python scripts/bench_collectives.py --backend hvd --out r.json
    python scripts/bench_collectives.py --backend placement --devices 4 --out r.json
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from flowpm_bench import RESULTS
from flowpm_bench.launch import clean_env, mpirun_command
from flowpm_bench.results import read_json, write_json, write_result

SCRIPT = "scripts/bench_collectives.py"

OPS = ("alltoall", "allreduce", "allconcat", "shift")


def _measure(sess, fetch, warmup, repeats):
    for _ in range(warmup):
        sess.run(fetch)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sess.run(fetch)
        times.append(time.perf_counter() - t0)
    return times


def _build(impl, slices, n):
    """Lower each collective once; returns {op: list of scalar tensors to fetch}."""
    import tensorflow.compat.v1 as tf

    x = impl.LaidOutTensor(slices)
    outs = {
        "alltoall": impl.alltoall(x, 0, 0, 1),
        "allreduce": impl.allreduce(x, [0], "SUM"),
        "allconcat": impl.allconcat(x, 0, 0),
        "shift": impl.shift_by_n_processors(x, 0, 1, True),
    }
    # Fetch one element of every output slice: a data dependency on the whole
    # collective. (A tf.group of the outputs is not enough: Grappler then prunes the
    # computation and the "timing" measures nothing.)
    return {k: [tf.reshape(t, [-1])[0] for t in v.tensor_list] for k, v in outs.items()}


def run_hvd(args):
    import tensorflow.compat.v1 as tf

    tf.disable_eager_execution()
    from mpi4py import MPI

    from flowpm_mtf.backend import install_abort_on_exception, make_mesh_impl, session_config
    from flowpm_mtf.jobs import runner

    install_abort_on_exception()  # a failing rank ends the job, never a hang
    n = MPI.COMM_WORLD.Get_size()
    rows = int(args.mbytes * 2**20 / 4 / args.cols) // n * n
    impl = make_mesh_impl("hvd", [("p", n)], [])
    res = {}
    with tf.Graph().as_default():
        x = tf.Variable(tf.random.normal([rows, args.cols], seed=MPI.COMM_WORLD.Get_rank()))
        ops = _build(impl, [x.read_value()], n)
        with runner.session(session_config("hvd")) as sess:
            for name in OPS:
                MPI.COMM_WORLD.Barrier()
                times = _measure(sess, ops[name], args.warmup, args.repeats)
                # the slowest rank defines the collective's time
                res[name] = np.max(MPI.COMM_WORLD.allgather(times), axis=0).tolist()
    if MPI.COMM_WORLD.Get_rank() == 0:
        _write(args.out, "hvd", n, rows * args.cols * 4, res)


def run_placement(args):
    import tensorflow.compat.v1 as tf

    from flowpm_mtf.backend import make_mesh_impl, session_config
    from flowpm_mtf.jobs import runner

    tf.disable_eager_execution()
    n = args.devices
    rows = int(args.mbytes * 2**20 / 4 / args.cols) // n * n
    devices = ["/cpu:%d" % i for i in range(n)]
    impl = make_mesh_impl("placement", [("p", n)], [], devices)
    res = {}
    with tf.Graph().as_default():
        slices = []
        for i, d in enumerate(devices):
            with tf.device(d):
                slices.append(tf.Variable(tf.random.normal([rows, args.cols], seed=i)).read_value())
        ops = _build(impl, slices, n)
        with runner.session(session_config("placement", n)) as sess:
            for name in OPS:
                res[name] = _measure(sess, ops[name], args.warmup, args.repeats)
    _write(args.out, "placement", n, rows * args.cols * 4, res)


def _write(path, backend, n, slice_bytes, res):
    rec = {"backend": backend, "n": n, "slice_bytes": slice_bytes,
           "ops": {k: {"median_s": statistics.median(v), "min_s": min(v), "runs": v}
                   for k, v in res.items()}}
    write_json(path, rec)


def run_all(args):
    common = ["--mbytes", str(args.mbytes), "--cols", str(args.cols),
              "--warmup", str(args.warmup), "--repeats", str(args.repeats)]
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.sizes:
            for backend in ("hvd", "placement"):
                out = os.path.join(tmp, "%s_%d.json" % (backend, n))
                if backend == "hvd":
                    cmd = mpirun_command(n) + [sys.executable, __file__, "--backend", "hvd"]
                else:
                    cmd = [sys.executable, __file__, "--backend", "placement", "--devices", str(n)]
                print("running:", " ".join(cmd), flush=True)
                subprocess.run(cmd + common + ["--out", out], check=True,
                               env=clean_env(TF_CPP_MIN_LOG_LEVEL="2"))
                records.append(read_json(out))
    meta = {"mbytes_per_slice": args.mbytes, "warmup": args.warmup, "repeats": args.repeats,
            "cores": os.cpu_count(), "note": "N processes/devices share this machine's cores"}
    lines = ["# Collectives: HvdSimdMeshImpl vs PlacementMeshImpl",
             "",
             "Per-slice tensor %.0f MB float32, 1-axis mesh of N; median of %d runs after %d "
             "warm-up, in ms (slowest rank for Horovod). Machine: %d cores shared by all "
             "N processes/devices." % (args.mbytes, args.repeats, args.warmup, os.cpu_count()),
             "",
             "| op | N | HvdSimdMeshImpl [ms] | PlacementMeshImpl [ms] | placement / hvd |",
             "|---|---|---|---|---|"]
    by = {(r["backend"], r["n"]): r for r in records}
    for op in OPS:
        for n in args.sizes:
            h = by[("hvd", n)]["ops"][op]["median_s"] * 1e3
            p = by[("placement", n)]["ops"][op]["median_s"] * 1e3
            lines.append("| %s | %d | %.1f | %.1f | %.2f |" % (op, n, h, p, p / h))
    table = write_result(args.results, "bench_collectives", {"meta": meta, "records": records},
                         "\n".join(lines) + "\n", SCRIPT)
    print(table)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--all", action="store_true", help="run every backend and size, write results")
    ap.add_argument("--backend", choices=("hvd", "placement"))
    ap.add_argument("--devices", type=int, default=2, help="logical devices (placement)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--mbytes", type=float, default=16.0, help="per-slice tensor size [MB]")
    ap.add_argument("--cols", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="bench.json")
    ap.add_argument("--results", default=RESULTS,
                    help="folder of the table (the JSON: results/raw/ for results/)")
    args = ap.parse_args(argv)
    if args.repeats < 5:
        ap.error("--repeats must be at least 5")
    if args.all:
        run_all(args)
    elif args.backend == "hvd":
        run_hvd(args)
    elif args.backend == "placement":
        run_placement(args)
    else:
        ap.error("give --all or --backend")


if __name__ == "__main__":
    main()
