"""P(k) cross-check: a run's ``power.txt`` against an independent numpy estimator (issue 60, item 5).

Runs ``flowpm-mtf simulate`` (``--np`` ranks, float32 as by default), reads its final
snapshot (``snapshot.h5``: every particle, in this process) and measures the P(k) of
those particles with ``flowpm_bench/pk_reference.py`` (its own CIC, ``numpy.fft``, the
same shells, float64), then compares bin by bin with the run's own estimator
(``flowpm_mtf.physics.power``, reduced over the ranks, written to ``power.txt``). The
criterion of the issue is 1 % per bin. Writes ``results/bench_pk_check.md`` (the table)
and ``results/raw/bench_pk_check.json``::

    python scripts/bench_pk_check.py --nc 128 --np 2
    python scripts/bench_pk_check.py --run-dir out/sim   # an existing run, nothing launched

Neither estimator deconvolves the CIC window here (``power.txt`` does not); the
reference's window deconvolution (``deconvolve_cic``) is reported beside it, as the
ratio it applies per bin.
"""
import argparse
import os
import sys
import tempfile
import time

import numpy as np

from flowpm_bench import RESULTS
from flowpm_bench import pk_reference
from flowpm_bench.launch import clean_env, mpirun_command, run
from flowpm_bench.results import write_result

SCRIPT = "scripts/bench_pk_check.py"
#: The issue's criterion: the run's P(k) within 1 % of the independent estimate in every bin.
CRITERION = 0.01


def compare(run_dir):
    """Bin by bin: the run's ``power.txt`` against the reference on its ``snapshot.h5``.

    Returns
    -------
    dict
        ``rows`` (per bin: k [h/Mpc], modes, P_run, P_ref [(Mpc/h)^3], their relative
        difference, the CIC window's correction factor), ``max_rel``, ``n_particles``,
        ``nc``, ``box_size``, ``seconds`` (the reference's time [s]).
    """
    import json

    from flowpm_mtf.runs import io

    with open(os.path.join(run_dir, "summary.json")) as f:
        conf = json.load(f)["config"]
    nc, box = conf["nc"], conf["box_size"]
    snap = io.read_snapshot(os.path.join(run_dir, "snapshot.h5"))
    t0 = time.perf_counter()
    rho = pk_reference.cic_density(snap["position"], nc, box)
    k, pk, modes = pk_reference.power_spectrum(rho - 1.0, box)
    _, pk_deconv, _ = pk_reference.power_spectrum(rho - 1.0, box, deconvolve_cic=True)
    seconds = time.perf_counter() - t0
    k_run, pk_run, modes_run, _ = io.read_power(os.path.join(run_dir, "power.txt"))
    keep = modes > 0
    if not np.array_equal(modes[keep], modes_run):
        raise ValueError("%s: the shells differ from the reference's (modes %s vs %s)"
                         % (run_dir, modes_run, modes[keep]))
    rel = pk_run / pk[keep] - 1.0
    rows = [{"k": float(a), "modes": int(m), "pk_run": float(p), "pk_ref": float(q),
             "rel": float(r), "window": float(w / q)}
            for a, m, p, q, r, w in zip(k_run, modes_run, pk_run, pk[keep], rel,
                                        pk_deconv[keep])]
    return {"rows": rows, "max_rel": float(np.abs(rel).max()), "nc": nc, "box_size": box,
            "n_particles": int(snap["position"].shape[0]), "seconds": seconds}


def markdown(res, command):
    rows = res["rows"]
    lines = ["# P(k) of a run against an independent numpy estimator",
             "",
             "`%s`: the run's `power.txt` (CIC, distributed FFT, shells reduced over the "
             "ranks; float32) against `flowpm_bench/pk_reference.py` on the particles of its "
             "`snapshot.h5` (own CIC, numpy FFT, float64), %s^3 particles in %s Mpc/h. "
             "Criterion: 1 %% per bin. Largest |P_run / P_ref - 1| over %d bins: **%.2e**."
             % (command, "x".join(map(str, res["nc"])) if len(set(res["nc"])) > 1
                else res["nc"][0], "x".join("%g" % b for b in res["box_size"])
                if len(set(res["box_size"])) > 1 else "%g" % res["box_size"][0], len(rows),
                res["max_rel"]),
             "",
             "| k [h/Mpc] | modes | P_run [(Mpc/h)^3] | P_ref [(Mpc/h)^3] | P_run / P_ref - 1 "
             "| CIC window correction |",
             "|---|---|---|---|---|---|"]
    step = max(1, len(rows) // 16)
    shown = rows[::step] + ([rows[-1]] if (len(rows) - 1) % step else [])
    for r in shown:
        lines.append("| %.4f | %d | %.5g | %.5g | %+.2e | %.4f |" % (
            r["k"], r["modes"], r["pk_run"], r["pk_ref"], r["rel"], r["window"]))
    lines += ["", "Every %d-th bin shown (all in the raw JSON); the window column is the "
              "reference's deconvolved over raw P(k), the factor the CIC window takes out."
              % step]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nc", type=int, default=128)
    ap.add_argument("--box-size", type=float, default=256.0)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--np", type=int, default=2, help="ranks of the run")
    ap.add_argument("--run-dir", help="compare this existing run (nothing is launched)")
    ap.add_argument("--results", default=RESULTS)
    ap.add_argument("--timeout", type=float, default=3600)
    args = ap.parse_args(argv)
    run_dir = args.run_dir
    command = "python %s %s" % (SCRIPT, " ".join(argv if argv is not None else []))
    if run_dir is None:
        run_dir = os.path.join(tempfile.mkdtemp(prefix="bench_pk"), "run")
        cmd = mpirun_command(args.np) + [sys.executable, "-m", "flowpm_mtf.cli", "simulate", "--nc",
                                         str(args.nc), "--box-size", str(args.box_size),
                                         "--steps", str(args.steps), "--no-plot", "--out",
                                         run_dir]
        run(cmd, args.timeout, clean_env())
        command = "python %s --nc %d --box-size %g --steps %d --np %d" % (
            SCRIPT, args.nc, args.box_size, args.steps, args.np)
    res = compare(run_dir)
    res["command"] = command
    table = write_result(args.results, "bench_pk_check", res, markdown(res, command), SCRIPT)
    print(table)
    if res["max_rel"] > CRITERION:
        raise SystemExit("P(k) differs by %.2e > %g" % (res["max_rel"], CRITERION))
    return res


if __name__ == "__main__":
    main()
