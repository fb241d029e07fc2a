"""Ensemble validation of the full-sky lensing maps: C_ell / halofit over N seeds.

Modes::

    # N seeds of `flowpm-mtf lensing --sky full --nside 256` (64^3, 256 Mpc/h, z_s = 1,
    # 12 shells), 2 ranks each, nice'd: results/bench_lensing_fullsky.md (+ .json)
    python scripts/bench_lensing_fullsky.py run --seeds 3 --ranks 2
    # another configuration (any `flowpm-mtf lensing` option after --)
    python scripts/bench_lensing_fullsky.py run --seeds 3 --label nside128 -- --nside 128
    # rewrite the Markdown from the raw JSON
    python scripts/bench_lensing_fullsky.py render

What is measured
----------------
Each seed is one `flowpm-mtf lensing --sky full --seed s` run; its ``kappa_power.txt``
holds the measured C_ell (``healpy.anafast`` of the HEALPix Born convergence), the
particles' shot noise, and the Limber sums of the shells from halofit and from the
run's own P(k), with (``C_ell_halofit``, ``C_ell_limber``: pixel window^2 x C + shot
noise) and without (``_cont``) the windows. Per band of ell, mode-weighted, the mean over
the seeds of:

* ``sky / halofit``: (C_ell - shot) / pixel window^2 over ``C_ell_halofit_cont``, the
  measured sky's power against the continuum theory (the issue-59 target: within 10 %
  over ell 50-500); the shot noise subtracted is Poisson's, an upper bound for particles
  from a displaced lattice (sub-Poisson where the flow is still laminar), so the truth
  lies between this and the same ratio without the subtraction (``sky+noise / halofit``);
* ``C_ell / limber``: the self-check against the run's own P(k) (PM force resolution
  and the simulated cosmic variance cancel);

with the error of the mean over the seeds. The load average is recorded: the result is
a correctness number, not a timing.
"""
import argparse
import logging
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

from flowpm_bench import RESULTS, provenance
from flowpm_bench.launch import clean_env, mpirun_command
from flowpm_bench.results import json_path, read_json, write_result
from flowpm_bench.scripts import split_passthrough

log = logging.getLogger("bench_lensing_fullsky")
SCRIPT = "scripts/bench_lensing_fullsky.py"
NAME = "bench_lensing_fullsky"
BANDS = ((50.0, 150.0), (150.0, 300.0), (300.0, 500.0))
DEFAULT_OPTIONS = ["--sky", "full", "--nside", "256"]
# The issue-59 target for the full sky: every band within this of 1 (sky / halofit).
TARGET = 0.10


def read_power(path, source=0):
    """Columns of one full-sky ``kappa_power.txt`` for source ``source``."""
    with open(path) as f:
        names = [line for line in f if line.startswith("#")][-1][1:].split()
    data = np.loadtxt(path)
    idx = {n: i for i, n in enumerate(names)}
    out = {"ell": data[:, 0], "modes": data[:, idx["modes"]]}
    for key in ("C_ell", "C_ell_limber", "C_ell_limber_cont", "C_ell_halofit",
                "C_ell_halofit_cont", "C_ell_shot", "resolved"):
        cols = [i for n, i in idx.items() if n.startswith(key + "(")]
        out[key] = data[:, cols[source]]
    return out


def ensemble(tables, bands=BANDS):
    """Per band: mean over runs of the mode-weighted ``sky / halofit`` and ``C_ell /
    limber`` ratios (module docstring), with the errors of the mean."""
    n = len(tables)
    if n < 2:
        raise ValueError("ensemble: need >= 2 runs for an error, got %d" % n)
    ell, modes = tables[0]["ell"], tables[0]["modes"]
    ratios = {}
    for t in tables:
        pw2 = (t["C_ell_halofit"] - t["C_ell_shot"]) / t["C_ell_halofit_cont"]
        ratios.setdefault("sky_halofit", []).append(
            (t["C_ell"] - t["C_ell_shot"]) / pw2 / t["C_ell_halofit_cont"])
        ratios.setdefault("sky_halofit_noisy", []).append(
            t["C_ell"] / pw2 / t["C_ell_halofit_cont"])
        ratios.setdefault("limber", []).append(t["C_ell"] / t["C_ell_limber"])
        ratios.setdefault("sim_halofit", []).append(t["C_ell_limber_cont"]
                                                    / t["C_ell_halofit_cont"])
    out = {"n": n, "bands": []}
    for lo, hi in bands:
        sel = (ell >= lo) & (ell < hi)
        if not sel.any():
            continue
        w = modes[sel] / modes[sel].sum()
        rec = {"lo": lo, "hi": hi}
        for key, vals in ratios.items():
            b = np.array(vals)[:, sel] @ w
            rec[key] = float(b.mean())
            rec[key + "_error"] = float(b.std(ddof=1) / np.sqrt(n))
        out["bands"].append(rec)
    res = np.array([t["resolved"] for t in tables]).min(0) > 0
    out["resolved"] = [float(ell[res][0]), float(ell[res][-1])] if res.any() else [None, None]
    out["per_bin"] = {"ell": ell.tolist(),
                      "sky_halofit": np.mean(ratios["sky_halofit"], 0).tolist()}
    return out


def run_seeds(seeds, options, work, ranks=2, nice=10, timeout=3600):
    """Run ``flowpm-mtf lensing --seed s OPTIONS`` per seed; the ``kappa_power.txt`` paths."""
    paths = []
    for s in seeds:
        out = os.path.join(work, "seed%d" % s)
        cmd = [sys.executable, "-m", "flowpm_mtf.cli", "lensing", "--seed", str(s), "--out",
               out, "--no-plot"] + list(options)
        if ranks > 1:
            cmd = mpirun_command(ranks) + cmd
        if nice:
            cmd = ["nice", "-n", str(nice)] + cmd
        log.info("seed %d: %s", s, " ".join(cmd))
        proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True,
                              timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError("seed %d failed (%d):\n%s" % (s, proc.returncode,
                                                             proc.stderr[-3000:]))
        paths.append(os.path.join(out, "kappa_power.txt"))
    return paths


def render(data):
    """The Markdown table from the raw records."""
    lines = ["# Full-sky lensing ensemble: C_ell against halofit (issue 59)", "",
             "N seeds of `flowpm-mtf lensing --sky full`; per band, mode-weighted, the mean "
             "over the seeds of (C_ell - shot noise) / pixel window^2 / `C_ell_halofit_cont` "
             "(sky / halofit; target within %d %%; Poisson's shot noise is an upper bound of the "
             "particles' noise, so the truth lies between that and sky+noise / halofit), of the "
             "run's own Limber over halofit "
             "(sim P / halofit: the PM force's deficit), and of C_ell / `C_ell_limber` (the "
             "self-check), +- the error of the mean. Load: the load average when the runs "
             "started and ended (2 cores shared with other jobs)." % (100 * TARGET), "",
             "| configuration | seeds | band | sky / halofit | sky+noise / halofit | "
             "sim P / halofit | C_ell / limber | resolved ell | load | commit |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for label, rec in sorted(data.items()):
        e = rec["ensemble"]
        rng = e["resolved"]
        for b in e["bands"]:
            lines.append("| %s (`%s`) | %s | %d-%d | %.3f +- %.3f | %.3f +- %.3f | "
                         "%.3f +- %.3f | %.3f +- %.3f | %s | %.1f-%.1f | %s |" % (
                             label, " ".join(rec["options"]), ",".join(map(str, rec["seeds"])),
                             b["lo"], b["hi"], b["sky_halofit"], b["sky_halofit_error"],
                             b["sky_halofit_noisy"], b["sky_halofit_noisy_error"],
                             b["sim_halofit"], b["sim_halofit_error"], b["limber"],
                             b["limber_error"],
                             "%.0f-%.0f" % tuple(rng) if rng[0] is not None else "none",
                             rec["load"][0], rec["load"][1], rec.get("commit", "unknown")))
    return "\n".join(lines)


def main(argv=None):
    argv, extra = split_passthrough(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=("run", "render"))
    p.add_argument("--seeds", type=int, default=3, help="number of seeds (1..N)")
    p.add_argument("--first-seed", type=int, default=1)
    p.add_argument("--label", default="64^3 nside 256")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--nice", type=int, default=10)
    p.add_argument("--out", default=RESULTS, help="folder of the table")
    p.add_argument("--work", default=None, help="folder of the runs (default: temporary)")
    p.add_argument("--bands", default=",".join("%g-%g" % b for b in BANDS),
                   help="ell bands lo-hi, comma-separated")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    raw = json_path(args.out, NAME)
    data = read_json(raw, default={}) or {}
    if args.mode == "run":
        options = DEFAULT_OPTIONS + list(extra)
        work = args.work or tempfile.mkdtemp(prefix="bench_lensing_fullsky")
        load0 = os.getloadavg()[0]
        seeds = list(range(args.first_seed, args.first_seed + args.seeds))
        paths = run_seeds(seeds, options, work, args.ranks, args.nice)
        load1 = os.getloadavg()[0]
        bands = [tuple(float(v) for v in b.split("-")) for b in args.bands.split(",")]
        data[args.label] = {"options": options, "seeds": seeds, "ranks": args.ranks,
                            "commit": provenance.commit_label(), "load": [load0, load1],
                            "ensemble": ensemble([read_power(q) for q in paths], bands)}
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    if not data:
        raise SystemExit("no record in %s: run first" % raw)
    write_result(args.out, NAME, data, render(data), SCRIPT)
    for rec in data.values():
        for b in rec["ensemble"]["bands"]:
            log.info("ell %g-%g: sky/halofit %.3f +- %.3f, C/limber %.3f +- %.3f", b["lo"],
                     b["hi"], b["sky_halofit"], b["sky_halofit_error"], b["limber"],
                     b["limber_error"])
    return data


if __name__ == "__main__":
    main()
