"""Benchmark of multi-coil TV (TV-SENSE, PDHG) on the brain: ours split over ranks vs sigpy.

Modes::

    # the matrix: results/bench_tv_sense.md and the raw results/raw/bench_tv_sense.json
    python scripts/bench_tv_sense.py all --sizes 32 64 96 --ranks 1 2 4 --coils 8
    # a tiny check of the script (write elsewhere than results/)
    python scripts/bench_tv_sense.py all --sizes 16 --ranks 1 --iterations 2 --out /tmp/b
    # rewrite the Markdown from the JSON
    python scripts/bench_tv_sense.py render

What is measured
----------------
Ours: one launch of the job per (volume, ranks) under ``mpirun``, ``flowpm-mtf imaging
--volume mni152 --coils C --method tv --tv-iterations K`` (float32, R = 4, noise 0.01, the
default grid of the rank count); from its ``summary.json`` the mean time per PDHG
iteration [s] (one lowered iteration per ``session.run``, the slowest rank's view) and the
peak resident memory per rank [MB] (the largest rank; TensorFlow's ~0.4 GB included).

sigpy: ``sigpy.mri.app.TotalVariationRecon`` (0.1.27, numpy on the CPU, one process) on
the same problem in one sub-process: the brain resampled to ``N^3`` whole
(:func:`mri_mtf.volume.resample_numpy`), our birdcage maps, mask, noise level, lambda and
PDHG steps (``sigma = tau``: no power iteration), complex64 as ours; the time of
``K`` iterations after one warm-up iteration (numba's compilation), per iteration, and the
sub-process's peak resident memory. sigpy's solver is the same PDHG (tests/test_mri_sense.py:
iterates equal to rounding), so the times compare the same arithmetic.
"""
import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile

from flowpm_bench import RESULTS
from flowpm_bench.launch import clean_env, default_grid, mpirun_command, run
from flowpm_bench.results import json_path, read_raw, write_json, write_result, write_table

log = logging.getLogger("bench_tv_sense")
SCRIPT = "scripts/bench_tv_sense.py"
NAME = "bench_tv_sense"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The checkout whose packages the sub-runs import (first on their PYTHONPATH)."""
LAMBDA = 0.005
"""TV weight of both (the job's default ``--tv-lambda``)."""


def job_command(nc, ranks, coils, iterations, out):
    """The ``mpirun ... flowpm-mtf imaging`` command of one measurement of ours."""
    grid = default_grid(ranks)
    return mpirun_command(ranks) + [
        sys.executable, "-m", "flowpm_mtf.cli", "imaging", "--volume", "mni152",
        "--coils", str(coils), "--nc", str(nc), "--mesh-shape", "%dx%d" % grid,
        "--method", "tv", "--tv-iterations", str(iterations), "--tv-lambda", str(LAMBDA),
        "--no-plot", "--out", out]


def record(summary, nc, ranks):
    """The benchmark record of one job's ``summary.json``."""
    t = summary["timings"]
    return {"who": "ours", "nc": nc, "ranks": ranks, "grid": summary["config"]["grid"],
            "coils": summary["config"]["coils"], "voxels_per_rank": nc ** 3 // ranks,
            "peak_memory_mb": max(summary["peak_memory_mb_per_rank"]),
            "per_iteration_s": t.get("tv_per_iteration_s"),
            "iterations": summary["tv"]["iterations"],
            "psnr_db": summary["psnr_db"].get("tv")}


_SIGPY = r"""
import json, resource, sys, time
import numpy as np
import sigpy.mri.app
from mri_mtf import sampling, sense, tv_sense, volume
from mri_mtf.config import ImagingConfig
nc, coils, iters, lam = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
conf = ImagingConfig(nc=nc, acceleration=4, noise_sigma=0.01)
shape = (nc,) * 3
x = volume.resample_numpy("mni152", shape)
maps = sense.birdcage_numpy(coils, shape)
mask = sampling.mask_numpy(conf)
A, _ = sense.sense_numpy(maps, mask)
rng = np.random.default_rng(0)
y = A(x) + mask[None, None] * 0.01 / np.sqrt(2) * (rng.standard_normal((coils,) + shape)
                                                  + 1j * rng.standard_normal((coils,) + shape))
k = np.arange(nc)
sign = (-1.0) ** (k[:, None, None] + k[None, :, None] + k[None, None, :])
y_sp = np.fft.fftshift(y * sign, axes=(1, 2, 3)).astype(np.complex64)
w = np.fft.fftshift(np.broadcast_to(mask[None], shape), axes=(0, 1, 2)).astype(np.float32)
maps = maps.astype(np.complex64)
kw = dict(weights=w, sigma=tv_sense.STEP, tau=tv_sense.STEP, show_pbar=False)
sigpy.mri.app.TotalVariationRecon(y_sp, maps, lam, max_iter=1, **kw).run()   # numba warm-up
t = time.perf_counter()
sigpy.mri.app.TotalVariationRecon(y_sp, maps, lam, max_iter=iters, **kw).run()
dt = time.perf_counter() - t
print(json.dumps({"per_iteration_s": dt / iters,
                  "peak_memory_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}))
"""


def sigpy_record(nc, coils, iterations, timeout):
    """Time sigpy's TotalVariationRecon in a sub-process (module docstring)."""
    env = clean_env(pythonpath=ROOT)
    env.setdefault("OMP_NUM_THREADS", "1")
    res = subprocess.run([sys.executable, "-c", _SIGPY, str(nc), str(coils), str(iterations),
                          str(LAMBDA)], capture_output=True, text=True, timeout=timeout, env=env)
    if res.returncode != 0:
        raise RuntimeError((res.stderr.strip().splitlines() or ["exit %d" % res.returncode])[-1])
    out = json.loads(res.stdout.strip().splitlines()[-1])
    return dict(out, who="sigpy", nc=nc, ranks=1, grid=[1, 1], coils=coils,
                voxels_per_rank=nc ** 3, iterations=iterations)


def cmd_all(args):
    path = json_path(args.out, NAME)
    records = []
    load_start = os.getloadavg()[0]
    for nc in args.sizes:
        for ranks in args.ranks:
            tmp = tempfile.mkdtemp(prefix="bench_tv_sense_")
            cmd = job_command(nc, ranks, args.coils, args.iterations, os.path.join(tmp, "run"))
            log.info("%d^3 on %d rank(s): %s", nc, ranks, " ".join(cmd))
            rec = {"who": "ours", "nc": nc, "ranks": ranks}
            try:
                run(cmd, args.timeout, env=clean_env(pythonpath=ROOT))
                with open(os.path.join(tmp, "run", "summary.json")) as f:
                    rec.update(record(json.load(f), nc, ranks))
            except Exception as exc:   # a failed run is a result too (e.g. out of memory)
                rec["failed"] = str(exc).splitlines()[0][:300] if str(exc) else repr(exc)
                log.warning("%d^3 on %d rank(s) failed: %s", nc, ranks, rec["failed"])
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            records.append(rec)
            write_json(path, {"records": records, "command": " ".join(sys.argv[1:])})
        log.info("%d^3 sigpy", nc)
        try:
            records.append(sigpy_record(nc, args.coils, args.iterations, args.timeout))
        except Exception as exc:
            records.append({"who": "sigpy", "nc": nc, "ranks": 1,
                            "failed": str(exc)[:300] or repr(exc)})
        write_json(path, {"records": records, "command": " ".join(sys.argv[1:])})
    data = {"records": records, "command": " ".join(sys.argv[1:]), "load_start": load_start,
            "load_end": os.getloadavg()[0]}
    write_result(args.out, NAME, data, render(data), SCRIPT)


def render(data):
    """The Markdown of the records."""
    lines = ["# TV-SENSE benchmark (`%s`)" % SCRIPT, "",
             "PDHG iterations of TV-SENSE on the MNI152 brain resampled to N^3 (float32 / "
             "complex64, R = 4): ours (`flowpm-mtf imaging --method tv`, the volume split over "
             "the default grid of the ranks) and sigpy's TotalVariationRecon in one process "
             "with the same maps, mask, lambda and steps. Peak: resident memory per rank "
             "(largest rank). Command: `%s`; 1-min load %.1f at the start, %.1f at the end "
             "(a 2-core machine shared with other jobs)."
             % (data.get("command", ""), data.get("load_start", float("nan")),
                data.get("load_end", float("nan"))), "",
             "| volume | coils | code | ranks | grid | voxels per rank | peak per rank [MB] "
             "| iteration [s] | iterations |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(data["records"], key=lambda r: (r["nc"], r["who"] != "ours", r["ranks"])):
        if "failed" in r:
            lines.append("| %d^3 | - | %s | %d | - | - | failed: %s | | |" % (
                r["nc"], r["who"], r["ranks"], r["failed"][:80]))
            continue
        lines.append("| %d^3 | %d | %s | %d | %s | %d | %.0f | %.4f | %d |" % (
            r["nc"], r["coils"], r["who"], r["ranks"], "x".join(map(str, r["grid"])),
            r["voxels_per_rank"], r["peak_memory_mb"], r["per_iteration_s"], r["iterations"]))
    return "\n".join(lines) + "\n"


def cmd_render(args):
    path = json_path(args.out, NAME)
    data = read_raw(path)
    write_table(os.path.join(args.out, NAME + ".md"), render(data), SCRIPT, rendered_from=path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("all")
    p.add_argument("--sizes", type=int, nargs="+", default=[32, 64, 96])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--coils", type=int, default=8)
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--out", default=RESULTS)
    p = sub.add_parser("render")
    p.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s bench_tv_sense: %(message)s")
    {"all": cmd_all, "render": cmd_render}[args.cmd](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
