"""Where a job's time goes: the ops of its ICs and steps, and their page faults (issue 31).

Runs ``flowpm-mtf simulate`` in this process, one rank, as the command runs it (its launch
environment and memory allocator, :func:`flowpm_mtf.cli.entry`), and traces the job's
session runs with TensorFlow's step statistics (``RunOptions(trace_level=FULL_TRACE)``):

``ICs: 2LPT state`` and ``ICs: first force``
    the two runs of the initial conditions (:func:`flowpm_mtf.jobs.nbody_run.run_init`);
``step N``
    the steps named by ``--trace`` (default the first and the last);

and every other run (e.g. the variables' initialisation, the output's fetches: the final
density and P(k)) that takes at least ``--other-min-s`` (default half a second), also traced
(each runs once). For each run: its wall time, the minor page faults
during it (as GB of 4 KiB pages: memory the process touches for the first time, which a
virtual machine fills several times slower than memory already touched), and per op type the summed op time and count, with the largest ops
by name. Op times are each op's wall time from its start to its end; ops run side by
side on the intra-op threads, so the sums of a run can exceed its wall time. The trace
adds a little overhead per op (negligible at 128^3 and above)::

    python scripts/profile_job.py --nc 512 --steps 5
    python scripts/profile_job.py --nc 128 --steps 5 --trace 1 3 5 -- --sort-every 2
    python scripts/profile_job.py --nc 512 --steps 1 --trace 1 --other-min-s 0

Arguments after ``--`` go to ``flowpm-mtf simulate``. The run's output goes to a temporary
folder (removed after). Writes ``results/profile_job.md`` from
``results/raw/profile_job.json`` (one record per mesh, steps, extra arguments and commit;
a new run replaces its own record). Timings on a loaded machine are noise: run it alone
on a quiet one (the load is in the table).
"""
import argparse
import collections
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flowpm_bench.scripts import split_passthrough  # noqa: E402 (no TensorFlow)

SCRIPT = "scripts/profile_job.py"
NAME = "profile_job"
TOP_TYPES = 12
TOP_NAMES = 8
OTHER_MIN_S = 0.5


def _minor_faults():
    """This process's minor page faults so far (``/proc/self/stat``; 0 where absent)."""
    try:
        with open("/proc/self/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[7])
    except (OSError, IndexError, ValueError):
        return 0


def op_times(run_metadata):
    """``(by type, by name)`` of a traced run: ``{key: [seconds, count]}``."""
    by_type, by_name = collections.defaultdict(lambda: [0.0, 0]), collections.defaultdict(
        lambda: [0.0, 0])
    for dev in run_metadata.step_stats.dev_stats:
        for ns in dev.node_stats:
            label = ns.timeline_label
            kind = label.split(" = ", 1)[1].split("(", 1)[0] if " = " in label else "(other)"
            if kind in ("NoOp", "Const", "_SOURCE") or ns.node_name == "_SOURCE":
                continue
            t = ns.all_end_rel_micros / 1e6
            for table, key in ((by_type, kind), (by_name, ns.node_name)):
                table[key][0] += t
                table[key][1] += 1
    return dict(by_type), dict(by_name)


class Tracer:
    """Patches ``tf.Session.run`` to time (and trace) the job's runs; ``records`` in order."""

    def __init__(self, trace_steps, other_min_s=OTHER_MIN_S):
        self.trace_steps = set(trace_steps)
        self.other_min_s = other_min_s
        self.records = []
        self.step = 0
        self.ics_labels = []

    def install(self):
        import tensorflow.compat.v1 as tf
        from tensorflow.core.protobuf import config_pb2

        from flowpm_mtf.jobs import nbody_run

        original_run = tf.Session.run
        original_init = nbody_run.run_init
        tracer = self

        def run_init(*args, **kwargs):
            tracer.ics_labels = ["ICs: 2LPT state", "ICs: first force"]
            try:
                return original_init(*args, **kwargs)
            finally:
                tracer.ics_labels = []

        def run(sess, fetches, feed_dict=None, options=None, run_metadata=None):
            label, traced = None, False
            if tracer.ics_labels:
                label, traced = tracer.ics_labels.pop(0), True
            elif feed_dict and any(getattr(k, "name", "").startswith("step_factors")
                                   for k in feed_dict):
                tracer.step += 1
                label, traced = "step %d" % tracer.step, tracer.step in tracer.trace_steps
            else:
                traced = True          # an "other" run: kept if it takes other_min_s
            md = None
            if traced and options is None and run_metadata is None:
                options = config_pb2.RunOptions(trace_level=config_pb2.RunOptions.FULL_TRACE)
                run_metadata = md = config_pb2.RunMetadata()
            f0, t0 = _minor_faults(), time.perf_counter()
            out = original_run(sess, fetches, feed_dict, options, run_metadata)
            wall, faults = time.perf_counter() - t0, _minor_faults() - f0
            if label is None and wall < tracer.other_min_s:
                return out
            rec = {"run": label or "other", "wall_s": wall, "faults_gb": faults * 4096 / 1e9}
            if md is not None:
                by_type, by_name = op_times(md)
                rec["ops"] = sorted(([k, v[0], v[1]] for k, v in by_type.items()),
                                    key=lambda r: -r[1])
                rec["top"] = sorted(([k, v[0]] for k, v in by_name.items()),
                                    key=lambda r: -r[1])[:TOP_NAMES]
            tracer.records.append(rec)
            return out

        tf.Session.run = run
        nbody_run.run_init = run_init


def profile(nc, steps, trace, extra, other_min_s=OTHER_MIN_S):
    """Run the job with a :class:`Tracer`; returns ``(records, summary.json)``."""
    import json

    from flowpm_mtf import cli

    tracer = Tracer(trace, other_min_s)
    tracer.install()
    out = tempfile.mkdtemp(prefix="profile_job_")
    try:
        argv = ["simulate", "--nc", str(nc), "--steps", str(steps), "--no-plot",
                "--out", os.path.join(out, "run")] + list(extra)
        rc = cli.main(argv)
        if rc:
            raise SystemExit("profile_job: flowpm-mtf %s failed (exit %s)" % (" ".join(argv), rc))
        with open(os.path.join(out, "run", "summary.json")) as f:
            summary = json.load(f)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return tracer.records, summary


def render(records):
    """The Markdown document of all records."""
    lines = ["# Where a job's time goes (issue 31)", "",
             "Generated by `%s`; see its docstring. One rank, both cores. Per run of the job: "
             "wall time, first-touched memory (minor page faults x 4 KiB), and for the traced "
             "runs the summed op time per op type (count), largest first; ops overlap on the "
             "intra-op threads." % SCRIPT, ""]
    for r in records:
        lines += ["## %d^3, %d steps%s (commit %s, %s, load %.2f, allocator %s)" % (
            r["nc"], r["steps"], (" " + " ".join(r["extra"])) if r["extra"] else "",
            r["commit"], r["date"], r["machine"]["loadavg"][0], r["allocator"]), "",
            "| run | wall [s] | first touch [GB] | summed op time [s] | op types: summed time [s] "
            "(count) | largest ops [s] |", "|---|---|---|---|---|---|"]
        for x in r["runs"]:
            ops = x.get("ops")
            if ops is None:
                lines.append("| %s | %.3g | %.2f | | | |" % (x["run"], x["wall_s"], x["faults_gb"]))
                continue
            kinds = ", ".join("%s %.3g (%d)" % (k, t, n) for k, t, n in ops[:TOP_TYPES])
            top = ", ".join("`%s` %.3g" % (k, t) for k, t in x["top"][:4])
            lines.append("| %s | %.3g | %.2f | %.3g | %s | %s |" % (
                x["run"], x["wall_s"], x["faults_gb"], sum(t for _, t, _ in ops), kinds, top))
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    argv, extra = split_passthrough(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nc", type=int, default=128, help="mesh per side (default 128)")
    parser.add_argument("--steps", type=int, default=5, help="N-body steps (default 5)")
    parser.add_argument("--trace", type=int, nargs="+",
                        help="steps to trace, 1-based (default the first and the last)")
    parser.add_argument("--other-min-s", type=float, default=OTHER_MIN_S,
                        help="keep the other runs (not the ICs' nor a step) that take at "
                             "least this [s] (default %g)" % OTHER_MIN_S)
    parser.add_argument("--out", default=None, help="results folder (default results/)")
    args = parser.parse_args(argv)
    if args.nc < 8 or args.steps < 1 or not args.other_min_s >= 0:
        parser.error("--nc must be >= 8, --steps >= 1 and --other-min-s >= 0")
    trace = args.trace or sorted({1, args.steps})
    if any(not 1 <= s <= args.steps for s in trace):
        parser.error("--trace: steps between 1 and %d" % args.steps)

    from flowpm_mtf import allocator, launch_env

    launch_env.apply()
    allocator.ensure()     # re-executes this script under the job's allocator (once)

    from flowpm_bench import RESULTS, provenance
    from flowpm_bench.results import json_path, read_json, write_json, write_table

    machine = provenance.machine()    # the load before the run
    runs, summary = profile(args.nc, args.steps, trace, extra, args.other_min_s)
    record = {"nc": args.nc, "steps": args.steps, "extra": extra, "trace": trace,
              "commit": provenance.commit_label(), "machine": machine,
              "allocator": summary.get("allocator", allocator.active()),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": runs,
              "peak_mb": summary.get("peak_memory_mb_per_rank")}
    out = args.out or RESULTS
    path = json_path(out, NAME)
    key = lambda r: (r["nc"], r["steps"], r["extra"], r["commit"])  # noqa: E731
    records = [r for r in read_json(path, []) if key(r) != key(record)] + [record]
    write_json(path, records)
    write_table(os.path.join(out, NAME + ".md"), render(records), SCRIPT)
    for x in runs:
        print("%-18s wall %6.2f s, first touch %5.2f GB%s" % (
            x["run"], x["wall_s"], x["faults_gb"], "" if "ops" not in x else "; " + ", ".join(
                "%s %.2f" % (k, t) for k, t, _ in x["ops"][:6])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
