"""Speed at the sizes users run (issue 31): `flowpm-mtf simulate` from 128^3 to 512^3.

One configuration per invocation (each its own ``mpirun``), merged into the results, so the
series can be run piece by piece on a quiet machine and resumed::

    python scripts/bench_size.py list                 # the series, which are measured
    python scripts/bench_size.py run 1r-256           # one configuration -> results JSON
    python scripts/bench_size.py missing              # every configuration not yet measured
    python scripts/bench_size.py render               # JSON -> results/bench_size.md
    python scripts/bench_size.py --quick missing      # smoke test: every mesh / 8

The series: 128^3, 192^3, 256^3, 384^3, 512^3 on 1 rank; 256^3 and 384^3 on 2 (2x1) and
4 (2x2) ranks. Every run is ``flowpm-mtf simulate --nc N --steps S --no-plot`` with the
job's defaults otherwise (200 Mpc/h box, float32, 2LPT at a = 0.1, eulerian
decomposition), as the issue measured it, then (a second ``mpirun``) the **bare step**:
the same simulation graph, its step lowered into one ``tf.group`` and run alone along the
same trajectory (what ``scripts/bench_peers.py ours`` times), without the job's session
calls, observers and bookkeeping.

Columns (from the job's ``summary.json`` unless said):

* **step [s]**: median wall time of the job's steps after the first (``steps_s[1:]``), plus
  the reorderings of the particles by column (``sorts_s``, every ``--sort-every`` steps)
  spread over the steps;
* **ns/particle**: step / N;
* **ICs in steps**: the job's ICs (first run: white noise, 2LPT, the first PM force) / step;
* **write GB/s**: ``output_write`` (the snapshot's part files of all ranks, fsync and
  hashing included) and its size [GB];
* **peak [GB]**: the largest peak RSS of a rank;
* **job / bare**: job step / bare step (median after the first, wall; in parentheses the
  same in rank 0's CPU time, which a loaded machine disturbs less);
* **load**: the 1-minute load average when the run started (timings are noise above ~0.5
  per core).

Outputs: ``results/bench_size.md`` and the raw ``results/raw/bench_size.json`` (``--quick``:
``results/bench_size_quick.md``, ``results/raw/bench_size_quick.json``). Every record
carries the commit, load average and date.
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
from flowpm_bench.launch import MPI_LAUNCH_PREFIXES, clean_env, default_grid, mpirun_command
from flowpm_bench.results import json_path as raw_json_path
from flowpm_bench.results import read_json, read_raw, write_json, write_table

SCRIPT = "scripts/bench_size.py"
GB = 1e9
SERIES = [(128, 1), (192, 1), (256, 1), (384, 1), (512, 1), (256, 2), (384, 2), (256, 4),
          (384, 4)]
CONFIGS = {"%dr-%d" % (r, n): {"nc": n, "ranks": r, "grid": tuple(default_grid(r))}
           for n, r in SERIES}
QUICK_FACTOR = 8  # --quick: every mesh divided by this (16^3 to 64^3)
DEFAULT_STEPS = 5


def config_for(name, quick):
    """The configuration ``name`` (``<ranks>r-<nc>``), its mesh / 8 with ``quick``."""
    if name not in CONFIGS:
        raise SystemExit("unknown configuration %r; see `bench_size.py list`" % name)
    c = dict(CONFIGS[name])
    if quick:
        c["nc"] = max(16, c["nc"] // QUICK_FACTOR)
    return c


def paths(quick):
    """(raw JSON, table): ``results/raw/<stem>.json``, ``results/<stem>.md``."""
    stem = "bench_size_quick" if quick else "bench_size"
    return raw_json_path(RESULTS, stem), os.path.join(RESULTS, stem + ".md")


def _python():
    """The interpreter running this script: its venv is the stack measured (records say
    which: ``stack``)."""
    return sys.executable


def simulate_command(c, out, steps):
    """The job as a user runs it (``--force``: measure what runs, not the estimate)."""
    return mpirun_command(c["ranks"]) + [
        _python(), "-m", "flowpm_mtf.cli", "simulate", "--nc", str(c["nc"]), "--steps",
        str(steps), "--grid", "x".join(map(str, c["grid"])), "--out", out, "--no-plot",
        "--force"]


def bare_command(c, steps, json_out):
    """The bare step of the same configuration (:func:`cmd_bare` under mpirun)."""
    return mpirun_command(c["ranks"]) + [
        _python(), os.path.join(REPO, SCRIPT), "bare", "--nc", str(c["nc"]), "--steps",
        str(steps), "--json", json_out]


def _median_after_first(values):
    values = list(values)
    return statistics.median(values[1:] if len(values) > 1 else values)


def _error(proc):
    lines = [l for l in (proc.stderr or "").splitlines() if l.strip()]
    errors = [l for l in lines if "Error:" in l or "error:" in l or "Killed" in l]
    return ((errors[0] if errors else " | ".join(lines[-5:]))[-1000:]
            or "exit status %d" % proc.returncode)


def run_one(name, c, args):
    """Run the job and the bare step of one configuration; returns its record."""
    out = tempfile.mkdtemp(prefix="bench_size_")
    env = clean_env(REPO, strip=[p for p in MPI_LAUNCH_PREFIXES if p != "HOROVOD_"],
                    TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    env.pop("FLOWPM_MTF_ALLOCATOR_ACTIVE", None)
    n = c["nc"] ** 3
    rec = {"name": name, "nc": c["nc"], "ranks": c["ranks"], "grid": list(c["grid"]),
           "steps": args.steps, "n_particles": n, "quick": args.quick,
           "commit": provenance.git("rev-parse", "--short", "HEAD"),
           "dirty": provenance.code_dirty("flowpm_mtf", "hvd_mesh_impl", untracked=True),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime(
               "%Y-%m-%d %H:%M UTC"),
           "machine": provenance.machine(), "note": args.note, "stack": provenance.stack()}
    cmd = simulate_command(c, os.path.join(out, "run"), args.steps)
    rec["command"] = " ".join(cmd)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                              timeout=args.timeout)
        summary_path = os.path.join(out, "run", "summary.json")
        rec["ok"] = proc.returncode == 0 and os.path.exists(summary_path)
        if not rec["ok"]:
            rec["error"] = _error(proc)
            return rec
        with open(summary_path) as f:
            summary = json.load(f)
        rec.update(job_fields(summary))
        bare_json = os.path.join(out, "bare.json")
        rec["load_bare"] = os.getloadavg()[0]
        proc = subprocess.run(bare_command(c, args.steps, bare_json), capture_output=True,
                              text=True, env=env, timeout=args.timeout)
        if proc.returncode == 0 and os.path.exists(bare_json):
            rec["bare"] = read_json(bare_json)
        else:
            rec["bare_error"] = _error(proc)
    except subprocess.TimeoutExpired:
        rec["ok"], rec["error"] = False, "timeout after %d s" % args.timeout
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return rec


def job_fields(summary):
    """What a record keeps of the job's ``summary.json``."""
    t = summary["timings"]
    write = summary.get("output_write") or {}
    return {"steps_s": t["steps_s"], "steps_cpu_s": t.get("steps_cpu_s"),
            "sorts_s": t.get("sorts_s") or [],
            "ics_s": t.get("ics_s"), "ics_cpu_s": t.get("ics_cpu_s"),
            "graph_build_s": t.get("graph_build_s"), "fetch_s": t.get("fetch_s"),
            "total_s": t.get("total_s"),
            "write_bytes": write.get("bytes"), "write_s": write.get("seconds"),
            "write_gb_per_s": write.get("gb_per_s"),
            "peak_mb_per_rank": summary["peak_memory_mb_per_rank"],
            "allocator": summary.get("allocator"),
            "halo_size": (summary.get("migration") or {}).get("halo_size")}


def amortized_step(rec):
    """Median step after the first plus the reorderings by column spread over the steps."""
    steps, sorts = rec.get("steps_s"), rec.get("sorts_s") or []
    if not steps:    # a bare record of before the steps were kept
        return rec["step_s"]
    return _median_after_first(steps) + sum(sorts) / len(steps)


def row(rec):
    """The derived columns of one record (None where not measured)."""
    if not rec.get("ok"):
        return None
    step = amortized_step(rec)
    out = {"step_s": step, "ns_per_particle": step / rec["n_particles"] * 1e9,
           "ics_in_steps": rec["ics_s"] / step if rec.get("ics_s") else None,
           "write_gb_per_s": rec.get("write_gb_per_s"),
           "write_gb": (rec["write_bytes"] / GB) if rec.get("write_bytes") else None,
           "peak_gb": max(rec["peak_mb_per_rank"]) * 2**20 / GB,
           "load": rec["machine"]["loadavg"][0], "job_over_bare": None,
           "job_over_bare_cpu": None}
    bare = rec.get("bare")
    if bare:
        out["job_over_bare"] = step / amortized_step(bare)
        if rec.get("steps_cpu_s") and bare.get("step_cpu_s"):
            out["job_over_bare_cpu"] = (_median_after_first(rec["steps_cpu_s"])
                                        / bare["step_cpu_s"])
    return out


def record_key(name, stack):
    """``name`` on the default stack, ``name@stack`` on another."""
    return name if stack == provenance.DEFAULT_STACK else "%s@%s" % (name, stack)


def normalise(data):
    """Records written before they carried their stack were TF 2.12's: re-key them."""
    data["records"] = {record_key(rec["name"], provenance.stack_of(rec)): dict(
        rec, stack=provenance.stack_of(rec)) for rec in data["records"].values()}
    return data


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def render(data, quick):
    """The Markdown of the series (1 rank first, then 2 and 4 ranks)."""
    lines = ["# `flowpm-mtf simulate` at size (issue 31)%s" % (" (quick: meshes / 8)"
                                                              if quick else ""), "",
             "Generated by `%s render` from `results/raw/%s.json`; see the script's docstring "
             "for what each column is. `step`: median wall time of the job's steps after the "
             "first; `ICs in steps`: the job's ICs (first run) / step; `write`: the "
             "snapshot's part files (all ranks, fsync and hashing included); `job / bare`: "
             "the job's step / the bare lowered step along the same trajectory (wall; CPU in "
             "parentheses); `load`: 1-minute load average at the start (2 cores); `commit`: "
             "with the stack when it is not the default (TF 2.21); records without one were "
             "measured on TF 2.12."
             % (SCRIPT, "bench_size_quick" if quick else "bench_size"), "",
             "| mesh | ranks | grid | step [s] | ns/particle | ICs in steps | write [GB/s] "
             "(GB) | peak [GB] | job / bare | load | commit |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    recs = sorted(data["records"].values(),
                  key=lambda r: (r["ranks"], r["nc"], provenance.stack_of(r)))
    for rec in recs:
        r = row(rec)
        head = "| %d^3 | %d | %s |" % (rec["nc"], rec["ranks"], "x".join(map(str, rec["grid"])))
        if r is None:
            lines.append(head + " **failed**: %s | | | | | | %.1f | %s |" % (
                rec.get("error", "?")[:120], rec["machine"]["loadavg"][0], rec["commit"]))
            continue
        ratio = _fmt(r["job_over_bare"], ".2f")
        if r["job_over_bare_cpu"] is not None:
            ratio += " (%.2f)" % r["job_over_bare_cpu"]
        lines.append(head + " %s | %s | %s | %s (%s) | %s | %s | %.1f | %s |" % (
            _fmt(r["step_s"], ".3g"), _fmt(r["ns_per_particle"], ".0f"),
            _fmt(r["ics_in_steps"], ".2f"), _fmt(r["write_gb_per_s"], ".2f"),
            _fmt(r["write_gb"], ".3g"), _fmt(r["peak_gb"], ".2f"), ratio, r["load"],
            provenance.with_stack(rec["commit"] + ("+" if rec.get("dirty") else ""),
                                  provenance.stack_of(rec))))
    default = [rec for rec in recs if provenance.stack_of(rec) == provenance.DEFAULT_STACK]
    one = {rec["nc"]: row(rec) for rec in (default or recs) if rec["ranks"] == 1 and row(rec)}
    if one:
        base = one[min(one)]
        lines += ["", "ns/particle relative to %d^3 on 1 rank (target <= 1.25 at 512^3): %s"
                  % (min(one), ", ".join("%d^3 %.2f" % (n, one[n]["ns_per_particle"]
                                                        / base["ns_per_particle"])
                                         for n in sorted(one)))]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- bare step
def cmd_bare(args):
    """The bare step under mpirun: ICs, then the step as one ``tf.group`` along the
    trajectory; rank 0 writes ``step_s``/``step_cpu_s`` (median after the first: the
    slowest rank's wall time, rank 0's CPU time as the job's ``steps_cpu_s``) and
    ``steps_s``, and ``positions_sum`` (the sum of the final positions' slots, reduced
    on the mesh).

    With ``--ops job`` the steps run the job's own lowered ops instead
    (:func:`flowpm_mtf.jobs.nbody_run.lower_simulation`: the updates ordered after
    every read, and the migration statistics fetched with each step), in the same
    process structure: an A/B of the job's graph against the bare one, without the
    job's Python between the steps. The record says which (``ops``). With several
    ``--ops``, one after the other in this process (each its own graph and session), and
    the JSON is the list of their records."""
    from flowpm_mtf import allocator, launch_env

    launch_env.apply()
    allocator.ensure()   # as the job starts (may re-execute this process)
    import tensorflow.compat.v1 as tf
    from mpi4py import MPI

    tf.disable_eager_execution()
    comm = MPI.COMM_WORLD
    recs = []
    for ops in args.ops:
        with tf.Graph().as_default():
            recs.append(_bare_run(args.nc, args.steps, ops, comm))
    if comm.Get_rank() == 0:
        write_json(args.json, recs[0] if len(recs) == 1 else recs)
    return 0


def _bare_run(nc, steps, ops_kind, comm):
    """One :func:`cmd_bare` run in the default graph; its record."""
    import mesh_tensorflow as mtf
    import tensorflow.compat.v1 as tf

    from flowpm_mtf.backend import session_config
    from flowpm_mtf.config import SimConfig
    from flowpm_mtf.jobs import nbody_run, runner
    from flowpm_mtf.jobs.nbody_run import SimulationGraph, sort_due
    from hvd_mesh_impl import HvdSimdMeshImpl

    conf = SimConfig(nc=nc, grid=tuple(default_grid(comm.Get_size())), n_steps=steps)
    impl = HvdSimdMeshImpl(conf.mesh_shape, conf.layout_rules)
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "mesh")
    sim = SimulationGraph(conf, mesh)
    # a replicated scalar of the final state (no gather, no float64 copy of the positions):
    # both --ops reach the same state
    checksum = mtf.reduce_sum(sim.variables[0], output_shape=[])
    lowering = mtf.Lowering(graph, {mesh: impl})
    checksum = lowering.export_to_tf_tensor(checksum)
    if ops_kind == "job":
        ops = nbody_run.lower_simulation(sim, lowering)
        init, init_force, sort = ops["init"], ops["init_force"], ops["sort"]
        step = [ops["step"], ops["stats"]["step"]]        # the job's session call
    else:
        init = tf.group([lowering.lowered_operation(op) for op in sim.init_ops])
        init_force = tf.group([lowering.lowered_operation(op) for op in sim.init_force_ops])
        step = tf.group([lowering.lowered_operation(op) for op in sim.step_ops])
        sort = tf.group([lowering.lowered_operation(op) for op in sim.sort_ops])
    with tf.Session(config=session_config("hvd")) as sess:
        runner.initialize_variables(sess)          # as the job
        sess.run(lowering.copy_masters_to_slices())
        sess.run(init)
        sess.run(init_force)      # the ICs' two runs (nbody_run.run_init)
        wall, cpu, sorts = [], [], []
        for i, factors in enumerate(sim.step_factors):
            comm.Barrier()
            t, c = time.perf_counter(), time.process_time()
            sess.run(step, {sim.factors: factors})
            cpu.append(time.process_time() - c)   # this rank's, as the job's steps_cpu_s
            wall.append(max(comm.allgather(time.perf_counter() - t)))
            if sort_due(sim, i + 1):              # as the job: timed on its own
                t = time.perf_counter()
                sess.run(sort)
                sorts.append(max(comm.allgather(time.perf_counter() - t)))
        positions_sum = float(sess.run(checksum))
    return {"ops": ops_kind, "steps_s": wall, "steps_cpu_s": cpu, "sorts_s": sorts,
            "positions_sum": positions_sum, "step_s": _median_after_first(wall),
            "step_cpu_s": _median_after_first(cpu)}


# ----------------------------------------------------------------------------- commands
def cmd_run(args, names):
    raw, table = paths(args.quick)
    data = normalise(read_json(raw, {"records": {}}))
    for name in names:
        c = config_for(name, args.quick)
        print("%s: %d^3 on %d ranks ..." % (name, c["nc"], c["ranks"]), flush=True)
        rec = run_one(name, c, args)
        data["records"][record_key(name, rec["stack"])] = rec
        write_json(raw, data, sort_keys=True)
        r = row(rec)
        print("  %s" % ("failed: %s" % rec.get("error") if r is None else
                        ", ".join("%s %s" % (k, _fmt(v, ".3g")) for k, v in r.items())),
              flush=True)
    write_table(table, render(data, args.quick), script=SCRIPT)
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="every mesh / %d" % QUICK_FACTOR)
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="N-body steps per run")
    ap.add_argument("--timeout", type=int, default=7200, help="per mpirun [s]")
    ap.add_argument("--note", default="", help="stored with the records")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the configurations and which are measured")
    r = sub.add_parser("run", help="run configurations (default: all)")
    r.add_argument("names", nargs="*")
    sub.add_parser("missing", help="run the configurations not measured yet")
    sub.add_parser("render", help="rewrite the Markdown from the JSON")
    b = sub.add_parser("bare", help="the bare step under mpirun (internal)")
    b.add_argument("--nc", type=int, required=True)
    b.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    b.add_argument("--json", required=True)
    b.add_argument("--ops", nargs="+", choices=("bare", "job"), default=["bare"],
                   help="the step as one tf.group (default) or the job's lowered ops; "
                        "several: run each in turn in this process (tests: one launch), "
                        "the JSON is then the list of their records")
    args = ap.parse_args(argv)
    if args.cmd == "bare":
        return cmd_bare(args)
    raw, table = paths(args.quick)
    if args.cmd == "list":
        done = normalise(read_json(raw, {"records": {}}))["records"]
        done = {k: v for k, v in done.items()
                if k == record_key(v["name"], provenance.stack())}   # this stack's
        done = {v["name"]: v for v in done.values()}
        for name in CONFIGS:
            c = config_for(name, args.quick)
            print("%-8s %4d^3 %d ranks  %s" % (name, c["nc"], c["ranks"],
                                               "measured" if name in done else "-"))
        return 0
    if args.cmd == "render":
        write_table(table, render(normalise(read_raw(raw)), args.quick), script=SCRIPT,
                    rendered_from=raw)
        return 0
    if args.cmd == "missing":
        done = normalise(read_json(raw, {"records": {}}))["records"]
        names = [n for n in CONFIGS
                 if not done.get(record_key(n, provenance.stack()), {}).get("ok")]
    else:
        names = args.names or list(CONFIGS)
    return cmd_run(args, names)


if __name__ == "__main__":
    sys.exit(main())
