"""Benchmark of `flowpm-mtf imaging`: memory per rank with the image split, time per step, quality.

Modes::

    # the matrix: results/bench_imaging.md and the raw results/raw/bench_imaging.json
    python scripts/bench_imaging.py all --sizes 128 256 --ranks 1 2 4
    # a tiny check of the script (write elsewhere than results/)
    python scripts/bench_imaging.py all --sizes 16 --ranks 1 2 --train-steps 2 \\
        --tv-iterations 2 --out /tmp/bench_imaging
    # rewrite the Markdown from the JSON
    python scripts/bench_imaging.py render

What is measured
----------------
Each (volume, ranks) pair is one launch of the job itself under ``mpirun`` (the hvd
backend, the default process grid of the rank count; the job's defaults otherwise:
R = 4, noise 0.01, float32, every method), with ``--train-steps`` Adam steps and
``--tv-iterations`` ADMM iterations (few: the time per step and per iteration is
what is measured, not a trained network). From its ``summary.json``:

* peak resident memory per rank [MB] (largest rank; includes TensorFlow's own ~0.4 GB
  and the graph) and the volume held per rank (``N^3 / ranks`` voxels);
* time per training step and per TV iteration [s] (mean over the steps run, slowest
  rank's view: every step ends in collectives);
* PSNR [dB] and SSIM of zero-filled, TV and the (briefly trained) network.

The memory with the image whole on one rank is the 1-rank row; the split rows should
fall ~1/ranks in the image-dependent part. A run that fails (e.g. out of memory) is
recorded as failed, and the table says so.
"""
import argparse
import json
import logging
import os
import shutil
import sys
import tempfile

from flowpm_bench import RESULTS
from flowpm_bench.launch import clean_env, default_grid, mpirun_command, run
from flowpm_bench.results import json_path, read_raw, write_json, write_result, write_table

log = logging.getLogger("bench_imaging")
SCRIPT = "scripts/bench_imaging.py"
NAME = "bench_imaging"
METHODS = ("zero-filled", "tv", "unrolled")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The checkout whose packages the sub-runs import (first on their PYTHONPATH)."""


def job_command(nc, ranks, out, train_steps, tv_iterations):
    """The ``mpirun ... flowpm-mtf imaging`` command of one measurement."""
    grid = default_grid(ranks)
    return mpirun_command(ranks) + [
        sys.executable, "-m", "flowpm_mtf.cli", "imaging", "--nc", str(nc),
        "--mesh-shape", "%dx%d" % grid, "--train-steps", str(train_steps),
        "--tv-iterations", str(tv_iterations), "--log-every", str(max(1, train_steps)),
        "--no-plot", "--out", out]


def record(summary, nc, ranks):
    """The benchmark record of one job's ``summary.json``."""
    t = summary["timings"]
    return {"nc": nc, "ranks": ranks, "grid": summary["config"]["grid"],
            "voxels_per_rank": nc ** 3 // ranks,
            "peak_memory_mb": summary["peak_memory_mb_per_rank"],
            "train_per_step_s": t.get("train_per_step_s"),
            "tv_per_iteration_s": t.get("tv_per_iteration_s"),
            "graph_build_s": t.get("graph_build_s"), "total_s": t.get("total_s"),
            "train_steps": summary["unrolled"]["train_steps"],
            "tv_iterations": summary["tv"]["iterations"],
            "psnr_db": summary["psnr_db"], "ssim": summary["ssim"]}


def cmd_all(args):
    path = json_path(args.out, NAME)
    records = []
    for nc in args.sizes:
        for ranks in args.ranks:
            tmp = tempfile.mkdtemp(prefix="bench_imaging_")
            out = os.path.join(tmp, "run")
            cmd = job_command(nc, ranks, out, args.train_steps, args.tv_iterations)
            log.info("%d^3 on %d rank(s): %s", nc, ranks, " ".join(cmd))
            rec = {"nc": nc, "ranks": ranks}
            try:
                rec["wall_s"] = run(cmd, args.timeout, env=clean_env(pythonpath=ROOT))
                with open(os.path.join(out, "summary.json")) as f:
                    rec.update(record(json.load(f), nc, ranks))
            except Exception as exc:   # a failed run is a result too (e.g. out of memory)
                rec["failed"] = str(exc).splitlines()[0][:300] if str(exc) else repr(exc)
                log.warning("%d^3 on %d rank(s) failed: %s", nc, ranks, rec["failed"])
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            records.append(rec)
            write_json(path, {"records": records, "command": " ".join(sys.argv[1:])})
    data = {"records": records, "command": " ".join(sys.argv[1:]),
            "load_end": os.getloadavg()[0]}
    write_result(args.out, NAME, data, render(data), SCRIPT)


def render(data):
    """The Markdown of the records."""
    lines = ["# Imaging benchmark (`%s`)" % SCRIPT, "",
             "`flowpm-mtf imaging` (R = 4, noise 0.01, float32) on the hvd backend, the image "
             "split over the default grid of the ranks; each row one run of the job. Peak: "
             "resident memory per rank (largest rank, includes TF's ~0.4 GB and the graph). "
             "Times: mean per training step (Adam on the unrolled network) and per TV-ADMM "
             "iteration. Quality after the few steps and iterations named per row (not a "
             "trained network). Command: `%s`; 1-min load at the end %.1f."
             % (data.get("command", ""), data.get("load_end", float("nan"))), "",
             "| volume | ranks | grid | voxels per rank | peak per rank [MB] | peak / 1-rank "
             "peak | train step [s] | TV iteration [s] | steps / iterations | PSNR zf / TV / "
             "net [dB] | SSIM zf / TV / net |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    one = {r["nc"]: max(r["peak_memory_mb"]) for r in data["records"]
           if r["ranks"] == 1 and "peak_memory_mb" in r}
    for r in sorted(data["records"], key=lambda r: (r["nc"], r["ranks"])):
        if "failed" in r:
            lines.append("| %d^3 | %d | - | %d | failed: %s | | | | | | |" % (
                r["nc"], r["ranks"], r["nc"] ** 3 // r["ranks"], r["failed"][:80]))
            continue
        peak = max(r["peak_memory_mb"])
        rel = "%.2f" % (peak / one[r["nc"]]) if r["nc"] in one else "-"
        f = lambda v, fmt="%.3f": "-" if v is None else fmt % v  # noqa: E731
        lines.append("| %d^3 | %d | %s | %d | %.0f | %s | %s | %s | %d / %d | %s | %s |" % (
            r["nc"], r["ranks"], "x".join(map(str, r["grid"])), r["voxels_per_rank"], peak, rel,
            f(r["train_per_step_s"]), f(r["tv_per_iteration_s"]), r["train_steps"],
            r["tv_iterations"],
            " / ".join(f(r["psnr_db"].get(m), "%.2f") for m in METHODS),
            " / ".join(f(r["ssim"].get(m), "%.3f") for m in METHODS)))
    return "\n".join(lines) + "\n"


def cmd_render(args):
    path = json_path(args.out, NAME)
    data = read_raw(path)
    write_table(os.path.join(args.out, NAME + ".md"), render(data), SCRIPT, rendered_from=path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("all")
    p.add_argument("--sizes", type=int, nargs="+", default=[128, 256])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--train-steps", type=int, default=5)
    p.add_argument("--tv-iterations", type=int, default=5)
    p.add_argument("--timeout", type=float, default=7200)
    p.add_argument("--out", default=RESULTS)
    p = sub.add_parser("render")
    p.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s bench_imaging: %(message)s")
    {"all": cmd_all, "render": cmd_render}[args.cmd](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
