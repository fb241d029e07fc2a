"""The default job on the two software stacks, side by side (issue 27).

The main job (``bash scripts/run_demo.sh``: ``flowpm-mtf simulate`` with its defaults, 64^3 on
2 ranks, 10 steps, the overview plot included) launched from each given virtualenv in turn,
the order alternating from one repeat to the next so that a slow spell of the machine falls
on both stacks::

    python scripts/bench_stacks.py run --venv .venv-tf2.12 .venv --repeat 3
    python scripts/bench_stacks.py run --venv .venv-tf2.12 .venv --np 2 -- --nc 128
    python scripts/bench_stacks.py render

Per launch (from the job's ``summary.json`` unless said): the wall time of the whole
``mpirun`` (interpreter start, imports, MPI and Horovod start-up included: what a user
waits for), the graph build, the ICs (white noise, 2LPT, first force), the median step after
the first (wall, and rank 0's CPU time), the job's total (``total_s``: graph to outputs),
the largest peak RSS of a rank, the TensorFlow, Python and numpy versions (from the
summary's ``versions``) and the 1-minute load average at the start. The table gives the
median over the repeats of each stack and the ratio of each stack to the first one given.

Outputs: ``results/bench_stacks.md`` and the raw ``results/raw/bench_stacks.json`` (every
launch, with the commit and the date; a new ``run`` replaces the records of the same
command-line arguments).
"""
import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from flowpm_bench import REPO, RESULTS, provenance
from flowpm_bench.launch import MPI_LAUNCH_PREFIXES, clean_env, mpirun_command
from flowpm_bench.results import json_path as raw_json_path
from flowpm_bench.results import read_json, read_raw, write_json, write_table

SCRIPT = "scripts/bench_stacks.py"
STEM = "bench_stacks"


def paths():
    """(raw JSON, table)."""
    return raw_json_path(RESULTS, STEM), os.path.join(RESULTS, STEM + ".md")


def job_command(venv, np_, out, extra):
    """The main job as ``scripts/run_demo.sh`` runs it, from ``venv``."""
    return mpirun_command(np_) + [os.path.join(venv, "bin", "flowpm-mtf"), "simulate",
                                  "--out", out] + list(extra)


def _median_after_first(values):
    values = list(values)
    return statistics.median(values[1:] if len(values) > 1 else values)


def launch(venv, np_, extra, timeout):
    """One launch of the job from ``venv``; returns its record."""
    out = tempfile.mkdtemp(prefix="bench_stacks_")
    env = clean_env(REPO, strip=MPI_LAUNCH_PREFIXES, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("FLOWPM_MTF_ALLOCATOR_ACTIVE", None)
    cmd = job_command(venv, np_, os.path.join(out, "sim"), extra)
    rec = {"venv": os.path.relpath(os.path.abspath(venv), REPO), "np": np_,
           "args": list(extra), "command": " ".join(cmd), "load": os.getloadavg()[0],
           "date": datetime.datetime.now(datetime.timezone.utc).strftime(
               "%Y-%m-%d %H:%M:%S UTC"),
           "commit": provenance.git("rev-parse", "--short", "HEAD"),
           "dirty": provenance.code_dirty("flowpm_mtf", "hvd_mesh_impl", untracked=True)}
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        rec["wall_s"] = time.perf_counter() - t
        path = os.path.join(out, "sim", "summary.json")
        rec["ok"] = proc.returncode == 0 and os.path.exists(path)
        if not rec["ok"]:
            lines = [l for l in proc.stderr.splitlines() if l.strip()]
            rec["error"] = (" | ".join(lines[-3:]) or "exit %d" % proc.returncode)[-800:]
            return rec
        with open(path) as f:
            s = json.load(f)
        t_ = s["timings"]
        rec.update({"versions": s.get("versions", {}), "allocator": s.get("allocator"),
                    "graph_build_s": t_.get("graph_build_s"), "ics_s": t_.get("ics_s"),
                    "step_s": _median_after_first(t_["steps_s"]),
                    "step_cpu_s": (_median_after_first(t_["steps_cpu_s"])
                                   if t_.get("steps_cpu_s") else None),
                    "total_s": t_.get("total_s"),
                    "peak_mb": max(s["peak_memory_mb_per_rank"])})
    except subprocess.TimeoutExpired:
        rec["ok"], rec["error"] = False, "timeout after %d s" % timeout
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return rec


def stack_label(rec):
    """``TF 2.21.0, Python 3.13.0, numpy 2.4.6`` of a record (its job's versions)."""
    v = rec.get("versions") or {}
    return "TF %s, Python %s, numpy %s" % (v.get("tensorflow", "?"), v.get("python", "?"),
                                           v.get("numpy", "?"))


COLUMNS = (("wall_s", "job wall [s]"), ("graph_build_s", "graph build [s]"),
           ("ics_s", "ICs [s]"), ("step_s", "step [s]"), ("step_cpu_s", "step CPU [s]"),
           ("total_s", "total [s]"), ("peak_mb", "peak MB/rank"))


def summarise(records):
    """Rows per (arguments, ranks, stack), in the order the stacks were given: the median
    of each column over the launches, and the ratio to the first stack of the case."""
    cases = {}
    for rec in records:
        if rec.get("ok"):
            case = (" ".join(rec["args"]) or "defaults", rec["np"])
            cases.setdefault(case, {}).setdefault(stack_label(rec), []).append(rec)
    rows = []
    for (args, np_), stacks in cases.items():
        first = None
        for label in sorted(stacks, key=lambda l: min(r["order"] for r in stacks[l])):
            recs = stacks[label]
            med = {k: statistics.median(r[k] for r in recs) if all(
                r.get(k) is not None for r in recs) else None for k, _ in COLUMNS}
            first = first or med
            ratio = {k: (med[k] / first[k] if med[k] and first[k] else None)
                     for k, _ in COLUMNS}
            rows.append({"args": args, "np": np_, "stack": label, "n": len(recs),
                         "median": med, "ratio": ratio,
                         "load": (min(r["load"] for r in recs), max(r["load"] for r in recs)),
                         "commits": sorted({r["commit"] + ("+" if r["dirty"] else "")
                                            for r in recs})})
    return rows


def render(data):
    rows = summarise(data["records"])
    lines = ["# The default job on both stacks (`%s`)" % SCRIPT, "",
             "`flowpm-mtf simulate` as `bash scripts/run_demo.sh` runs it, launched from each "
             "stack's virtualenv in turn, the order alternating; median over the launches "
             "(`n`), and in parentheses the ratio to the first stack of the case. `job wall`: "
             "the whole `mpirun` (start-up and imports included); `step`: median after the "
             "first step; `peak`: the largest rank's peak RSS. See the script's docstring.",
             "", "| job | ranks | stack | n | " + " | ".join(t for _, t in COLUMNS)
             + " | load | commit |",
             "|---|---|---|---|" + "---|" * len(COLUMNS) + "---|---|"]
    for r in rows:
        cells = []
        for k, _ in COLUMNS:
            v = r["median"][k]
            cell = "-" if v is None else ("%.0f" % v if k == "peak_mb" else "%.3g" % v)
            if r["ratio"][k] is not None and v is not None:
                cell += " (%.2f)" % r["ratio"][k]
            cells.append(cell)
        lines.append("| %s | %d | %s | %d | %s | %.1f-%.1f | %s |" % (
            r["args"], r["np"], r["stack"], r["n"], " | ".join(cells), r["load"][0],
            r["load"][1], ", ".join(r["commits"])))
    failed = [r for r in data["records"] if not r.get("ok")]
    for r in failed:
        lines.append("\nFailed: `%s`: %s" % (r["command"], r.get("error", "?")))
    return "\n".join(lines) + "\n"


def cmd_run(args):
    raw, table = paths()
    data = read_json(raw, {"records": []})
    key = (args.np, list(args.extra))
    data["records"] = [r for r in data["records"] if (r["np"], r["args"]) != key]
    for i in range(args.repeat):
        venvs = args.venv if i % 2 == 0 else list(reversed(args.venv))
        for venv in venvs:
            print("repeat %d: %s ..." % (i + 1, venv), flush=True)
            rec = launch(venv, args.np, args.extra, args.timeout)
            rec["order"] = args.venv.index(venv)   # the stacks' order as given
            data["records"].append(rec)
            write_json(raw, data)
            print("  %s" % (", ".join("%s %.3g" % (k, rec[k]) for k, _ in COLUMNS
                                      if rec.get(k) is not None) if rec["ok"]
                            else "failed: " + rec["error"]), flush=True)
    write_table(table, render(data), script=SCRIPT)
    return 0 if all(r.get("ok") for r in data["records"]) else 1


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="launch the job from each venv, --repeat times")
    r.add_argument("--venv", nargs="+", required=True,
                   help="virtualenvs (the first is the reference of the ratios)")
    r.add_argument("--repeat", type=int, default=3)
    r.add_argument("--np", type=int, default=2, help="ranks (run_demo.sh's default: 2)")
    r.add_argument("--timeout", type=int, default=1800, help="per launch [s]")
    r.add_argument("extra", nargs="*", help="arguments of `simulate` (after --)")
    sub.add_parser("render", help="rewrite the Markdown from the JSON")
    args = ap.parse_args(argv)
    if args.cmd == "render":
        raw, table = paths()
        write_table(table, render(read_raw(raw)), script=SCRIPT, rendered_from=raw)
        return 0
    for venv in args.venv:
        if not os.path.exists(os.path.join(venv, "bin", "flowpm-mtf")):
            raise SystemExit("bench_stacks: %s has no bin/flowpm-mtf: run scripts/setup_env.sh "
                             "for its stack first" % venv)
    return cmd_run(args)


if __name__ == "__main__":
    sys.exit(main())
