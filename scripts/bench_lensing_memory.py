"""Peak memory per rank of `flowpm-mtf lensing` against the preflight's estimate.

The lensing job's own terms of the memory check (:func:`flowpm_mtf.runs.preflight.
lensing_memory`, :func:`flowpm_mtf.jobs.lensing_fullsky.fullsky_memory`) are set from
these runs; ``tests/test_preflight.py`` checks that the estimate bounds every stored row
(within ``MODEL_RTOL``, as the base model of ``scripts/bench_scaling.py``). Modes::

    python scripts/bench_lensing_memory.py list           # configurations, which are measured
    python scripts/bench_lensing_memory.py run NAME... [--seeds K]  # K seeds each
    python scripts/bench_lensing_memory.py record NAME DIR...   # record finished runs of NAME
    python scripts/bench_lensing_memory.py fit            # the constants the rows need
    python scripts/bench_lensing_memory.py render         # rows + estimates -> results/

A row is a configuration's ``summary.json`` (config, the lensing, sky and PGD sections, the
peak RSS of every rank). The peak differs from seed to seed (the clustering sets how many
particles each exchange moves, and so the sizes the allocator sees): a row may hold runs of
several seeds (``--seeds``, or several DIRs), and its peak per rank is the largest over
them (each run's is kept under ``runs``). Its estimate is recomputed from that config by
the preflight's current terms at ``render`` and by the test (:func:`estimate_mb`). Outputs:
``results/bench_lensing_memory.json`` (the rows, versioned: the test reads them) and
``results/bench_lensing_memory.md``. RSS is not a timing: the machine's load does not change
it (every row carries the load average anyway).
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

from flowpm_bench import RESULTS, provenance
from flowpm_bench.launch import clean_env, mpirun_command
from flowpm_bench.results import write_table

SCRIPT = "scripts/bench_lensing_memory.py"
ROWS = os.path.join(RESULTS, "bench_lensing_memory.json")
TABLE = os.path.join(RESULTS, "bench_lensing_memory.md")
#: name -> (ranks, options of `flowpm-mtf lensing`)
CONFIGS = {
    "flat-64-1": (1, ["--nc", "64", "--no-pgd"]),
    "flat-64-2": (2, ["--nc", "64", "--no-pgd"]),
    "flat-64-1-pgd": (1, ["--nc", "64", "--pgd"]),
    "flat-128-1": (1, ["--nc", "128", "--no-pgd"]),
    "flat-128-2": (2, ["--nc", "128", "--no-pgd"]),
    "flat-128-2-pgd": (2, ["--nc", "128", "--pgd"]),
    "flat-128-2-npix256": (2, ["--nc", "128", "--field-npix", "256", "--no-pgd"]),
    "survey-256-2": (2, ["--nc", "256", "--field-npix", "256"]),   # PGD on (automatic)
    "full-64-1": (1, ["--nc", "64", "--sky", "full", "--no-pgd"]),
    "full-64-2-pgd": (2, ["--nc", "64", "--sky", "full", "--pgd"]),
    "full-64-2-nside256": (2, ["--nc", "64", "--sky", "full", "--nside", "256", "--no-pgd"]),
}


def command(name, out):
    """The mpirun command line of configuration ``name`` writing into ``out``."""
    ranks, opts = CONFIGS[name]
    return mpirun_command(ranks) + [sys.executable, "-m", "flowpm_mtf.cli", "lensing",
                                    "--out", out] + opts


def load_rows(path=ROWS):
    """The stored rows {name: row}; empty if none."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)["rows"]


def row_of(name, run_dirs):
    """The row of finished runs of configuration ``name`` (one or more seeds): their
    sections, the largest peak memory per rank over the runs [MB] and each run's.

    Raises
    ------
    ValueError
        The runs differ in anything but the seed.
    """
    run_dirs = [run_dirs] if isinstance(run_dirs, str) else list(run_dirs)
    runs = []
    for run_dir in run_dirs:
        with open(os.path.join(run_dir, "summary.json")) as f:
            runs.append(json.load(f))
    first = runs[0]
    for s, run_dir in zip(runs[1:], run_dirs[1:]):
        for sec in ("config", "lensing", "sky", "pgd"):
            a = {k: v for k, v in first[sec].items() if sec != "config" or k != "seed"}
            b = {k: v for k, v in s[sec].items() if sec != "config" or k != "seed"}
            if a != b:
                raise ValueError("%s: its %s differs from %s's in more than the seed"
                                 % (run_dir, sec, run_dirs[0]))
    peaks = [s["peak_memory_mb_per_rank"] for s in runs]
    return {"name": name, "ranks": CONFIGS[name][0], "options": CONFIGS[name][1],
            "config": first["config"], "lensing": first["lensing"], "sky": first["sky"],
            "pgd": first["pgd"], "peak_mb_per_rank": [max(p) for p in zip(*peaks)],
            "runs": [{"seed": s["config"]["seed"],
                      "peak_mb_per_rank": s["peak_memory_mb_per_rank"],
                      "steps_rss_mb_per_rank": [p["steps"]["rss"]
                                                for p in s["memory_phases_mb_per_rank"]]}
                     for s in runs],
            "commit": provenance.commit_label(), "load": os.getloadavg()[0],
            "date": datetime.date.today().isoformat()}


def estimate_mb(row):
    """The preflight's estimated peak per process of a row's run [MB] (the hvd backend:
    slice-only variables, no master copies)."""
    from flowpm_mtf.config import SimConfig
    from flowpm_mtf.jobs import lensing_fullsky
    from flowpm_mtf.physics.lensing_geometry import LensingConfig
    from flowpm_mtf.runs import preflight

    conf = SimConfig.from_dict(row["config"])
    lens, sky, pgd = row["lensing"], row["sky"], bool(row["pgd"]["pgd"])
    n_maps = LensingConfig(**{k: tuple(v) if isinstance(v, list) else v
                              for k, v in lens.items()}).n_maps
    if sky["sky"] == "full":
        extra = lensing_fullsky.fullsky_memory(conf, lens["n_planes"], n_maps, sky["nside"],
                                               pgd=pgd)
    else:
        extra = preflight.lensing_memory(conf, lens["n_planes"], n_maps, lens["field_npix"],
                                         pgd=pgd)
    return preflight.estimate_peak_memory(conf, masters=False, extra=extra) / 2**20


def fit(rows):
    """The measured constants of the lensing terms that bound every row [bytes, float32]:
    ``LENSING_STAGE_BYTES_PER_SLOT``, the largest of (peak - the estimate without it) /
    slots over the flat ``--no-pgd`` rows; ``PGD_BYTES_PER_PADDED_CELL``, the largest of
    (peak - the estimate without it) / padded cells over the ``--pgd`` rows (with the
    first constant set). Each row's value is printed."""
    from flowpm_mtf.config import SimConfig
    from flowpm_mtf.runs import preflight, preflight_jobs

    def need(name, r, per):
        c = SimConfig.from_dict(r["config"])
        slots, cells = preflight.memory_terms(c)
        setattr(preflight_jobs, name, 0)
        room = (max(r["peak_mb_per_rank"]) - estimate_mb(r)) * 2**20
        value = room / {"slot": slots, "cell": cells}[per] * 4 / c.np_dtype.itemsize
        print("%-20s %s %8.1f" % (r["name"], name, value))
        return value

    saved = {n: getattr(preflight_jobs, n) for n in ("LENSING_STAGE_BYTES_PER_SLOT",
                                                     "PGD_BYTES_PER_PADDED_CELL")}
    try:
        flat = [r for r in rows.values() if r["sky"]["sky"] == "flat" and not r["pgd"]["pgd"]]
        stage = max(need("LENSING_STAGE_BYTES_PER_SLOT", r, "slot") for r in flat)
        preflight_jobs.LENSING_STAGE_BYTES_PER_SLOT = stage
        pgd = max((need("PGD_BYTES_PER_PADDED_CELL", r, "cell") for r in rows.values()
                   if r["pgd"]["pgd"]), default=0.0)
    finally:
        for n, v in saved.items():
            setattr(preflight_jobs, n, v)
    print("LENSING_STAGE_BYTES_PER_SLOT >= %.1f, PGD_BYTES_PER_PADDED_CELL >= %.1f"
          % (stage, pgd))
    return stage, pgd


def save(rows):
    with open(ROWS, "w") as f:
        json.dump({"source": "%s record/run" % SCRIPT, "rows": rows}, f, indent=1,
                  sort_keys=True)
        f.write("\n")


def _seeds(seeds):
    """``[1, 2, 3, 5]`` -> ``"1-3, 5"``."""
    seeds, parts = sorted(seeds), []
    for s in seeds:
        if parts and s == parts[-1][1] + 1:
            parts[-1][1] = s
        else:
            parts.append([s, s])
    return ", ".join("%d" % a if a == b else "%d-%d" % (a, b) for a, b in parts)


def render(rows):
    lines = ["# Lensing job: measured peak memory per rank and the preflight estimate", "",
             "`python %s run NAME [--seeds K]` per row, then `render`. Peak: the largest "
             "rank's peak RSS (`summary.json`; of several seeds, the largest per rank); "
             "estimate: the preflight's for the same options "
             "(`flowpm_mtf/runs/preflight_jobs.py` `lensing_memory`, the full sky's "
             "`fullsky_memory`); `tests/test_preflight.py` requires peak <= estimate <= peak x "
             "(1 + LENSING_MODEL_RTOL)." % SCRIPT,
             "", "| run | ranks | options | seeds | peak per rank [MB] | estimate [MB] | "
             "estimate / peak |", "|---|---|---|---|---|---|---|"]
    for name in CONFIGS:
        if name not in rows:
            continue
        r = rows[name]
        peak = max(r["peak_mb_per_rank"])
        est = estimate_mb(r)
        seeds = [run["seed"] for run in r.get("runs", [])] or [r["config"]["seed"]]
        lines.append("| %s | %d | `%s` | %s | %s | %.0f | %.3f |" % (
            name, r["ranks"], " ".join(r["options"]), _seeds(seeds),
            ", ".join("%.0f" % p for p in r["peak_mb_per_rank"]), est, est / peak))
    lines.append("")
    lines.append("Machine load (1-min average) when the rows were recorded: %s (other jobs; "
                 "RSS does not depend on it)." % ", ".join(sorted(
                     {"%.0f" % rows[n]["load"] for n in rows})))
    return write_table(TABLE, "\n".join(lines) + "\n", SCRIPT)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    sub.add_parser("list")
    r = sub.add_parser("run")
    r.add_argument("names", nargs="+", choices=sorted(CONFIGS))
    r.add_argument("--timeout", type=float, default=3600.0)
    r.add_argument("--seeds", type=int, default=1, metavar="K",
                   help="run seeds 1..K of each configuration (default: one run, its seed)")
    rec = sub.add_parser("record")
    rec.add_argument("name", choices=sorted(CONFIGS))
    rec.add_argument("run_dirs", nargs="+", metavar="run_dir")
    sub.add_parser("render")
    sub.add_parser("fit")
    args = ap.parse_args(argv)
    rows = load_rows()
    if args.mode == "list":
        for name, (ranks, opts) in CONFIGS.items():
            print("%-20s %d rank(s)  %-40s %s" % (name, ranks, " ".join(opts),
                                                  "measured" if name in rows else "-"))
        return 0
    if args.mode == "fit":
        fit(rows)
        return 0
    if args.mode == "run":
        for name in args.names:
            with tempfile.TemporaryDirectory(prefix="bench_lensing_memory_") as tmp:
                outs = []
                for seed in range(1, args.seeds + 1):
                    out = os.path.join(tmp, "out%d" % seed)
                    seed_opts = ["--seed", str(seed)] if args.seeds > 1 else []
                    subprocess.run(command(name, out) + seed_opts, env=clean_env(), check=True,
                                   timeout=args.timeout)
                    outs.append(out)
                rows[name] = row_of(name, outs)
            save(rows)
    elif args.mode == "record":
        try:
            rows[args.name] = row_of(args.name, args.run_dirs)
        except (OSError, ValueError, KeyError) as e:
            ap.exit(2, "%s: error: %s\n" % (SCRIPT, e))
        save(rows)
    print(render(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
