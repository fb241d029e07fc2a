"""Memory benchmark: peak memory per rank of `flowpm-mtf simulate` for weak scaling, strong
scaling and the largest run, with a breakdown by phase and a fitted memory model.

One configuration per invocation (each is its own ``mpirun``), merged into the results, so a
long campaign can be run piece by piece on a quiet machine and resumed::

    python scripts/bench_scaling.py list                  # configurations, which are measured
    python scripts/bench_scaling.py run weak-1            # one configuration -> results JSON
    python scripts/bench_scaling.py run largest --nc 384 --ranks 4
    python scripts/bench_scaling.py missing               # run every configuration not yet measured
    python scripts/bench_scaling.py render                # JSON -> Markdown + docs/scaling.md
    python scripts/bench_scaling.py --quick missing       # smoke test: 1/8 of every size

Configurations (the runs of issue 11; ``--steps`` N-body steps, default 2, float32, 2LPT).
Every run is what a user gets by default: the eulerian decomposition (particles migrate to
the rank that holds their position) with the automatic halo (2 cells) and the automatic
particle capacity; the decomposition, halo and capacity each run used come from its
``summary.json`` and are stored in the record. (The issue's halos 16/32 were those the old
lagrangian decomposition needed; ``--decomposition lagrangian --halo H`` is an expert
option now and is not benchmarked here.)

==========  =====  ==================  ==================  ====================
name        ranks  particles / mesh    box [Mpc/h]         grid
==========  =====  ==================  ==================  ====================
floor-R     R      16^3                25                  R ranks: the runtime floor
weak-1      1      128^3 (2.1M/rank)   200                 1x1
weak-2      2      256x128x128         400x200x200         2x1
weak-4      4      256x256x128         400x400x200         2x2
strong-R    1,2,4  192^3               300                 1x1, 2x1, 2x2
largest     -R     --nc (384)          1.5625 Mpc/h cells  default for R (4)
==========  =====  ==================  ==================  ====================

``run`` without a name runs all of them (the floors, weak, strong and ``largest`` at 384^3 on
4 ranks) and renders; ``missing`` runs those not measured yet.

What each run records (``simulate``'s ``summary.json``): the peak RSS of every rank, and at
the phase boundaries (``flowpm_mtf.simulate._mark``) the current RSS and the peak within the
phase. The breakdown per rank [MB]:

* **runtime**: RSS after imports and backend start-up (TF, Horovod, MPI), before the graph;
* **graph+state**: peak while building/lowering the graph and allocating the variables
  (the particle state slices are allocated here) minus runtime;
* **ICs**: peak during the initial conditions (2LPT temporaries) minus the RSS before;
* **steps**: peak during the N-body steps minus the RSS before (step temporaries);
* **output**: peak while writing snapshot/P(k) minus the RSS before.

TensorFlow's allocator keeps freed memory, so each phase's increment is what it needed
*beyond* what was already held. "Above floor" is the peak minus the peak of the ``floor-R``
run on the same number of ranks (the issue's definition of the runtime floor).

Memory model (for preflight estimates): peak per rank [MB] = M0 + a n_local + b v_local,
with n_local the particles per rank and v_local the padded cells per rank
((nx/P + 2h)(ny/Q + 2h) nz), fitted by least squares over the non-floor runs; the JSON
``model`` holds M0 [MB], a and b [bytes].

Host allocator (:mod:`flowpm_mtf.allocator`): the runs use the jobs' default (tcmalloc)
unless ``--allocator MODE`` is given; such records are stored as ``NAME@MODE`` and rendered
in their own tables (their own floors when ``floor-R@MODE`` was run); the memory model is
fitted on the default allocator's runs only (what the preflight check estimates)::

    python scripts/bench_scaling.py --allocator lean run weak-4

Outputs: ``results/bench_scaling.md`` and the raw ``results/raw/bench_scaling.json``
(unversioned; ``--quick``: ``results/bench_scaling_quick.md`` and
``results/raw/bench_scaling_quick.json``);
``render`` also rewrites the section of docs/scaling.md between the BENCH-SCALING markers.
Measurements on a loaded machine overstate nothing (RSS is not a timing) but the lead's final
numbers come from a quiet machine: every record carries the commit, the load average and the
date.
"""
import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

from flowpm_bench import REPO, RESULTS, provenance
from flowpm_bench.launch import MPI_LAUNCH_PREFIXES, clean_env, default_grid, mpirun_command
from flowpm_bench.results import json_path as raw_json_path
from flowpm_bench.results import read_json, read_raw, write_json, write_table

SCRIPT = "scripts/bench_scaling.py"
MB = 2.0 ** 20
STATE_BYTES_PER_SLOT = 40  # positions, momenta, forces: 3 x 3 float32; id: int32

CONFIGS = {
    "floor-1": dict(nc=(16, 16, 16), box=(25.0,) * 3, ranks=1, grid=(1, 1), kind="floor"),
    "floor-2": dict(nc=(16, 16, 16), box=(25.0,) * 3, ranks=2, grid=(2, 1), kind="floor"),
    "floor-4": dict(nc=(16, 16, 16), box=(25.0,) * 3, ranks=4, grid=(2, 2), kind="floor"),
    "weak-1": dict(nc=(128, 128, 128), box=(200.0,) * 3, ranks=1, grid=(1, 1),
                   kind="weak"),
    "weak-2": dict(nc=(256, 128, 128), box=(400.0, 200.0, 200.0), ranks=2,
                   grid=(2, 1), kind="weak"),
    "weak-4": dict(nc=(256, 256, 128), box=(400.0, 400.0, 200.0), ranks=4,
                   grid=(2, 2), kind="weak"),
    "strong-1": dict(nc=(192,) * 3, box=(300.0,) * 3, ranks=1, grid=(1, 1),
                     kind="strong"),
    "strong-2": dict(nc=(192,) * 3, box=(300.0,) * 3, ranks=2, grid=(2, 1),
                     kind="strong"),
    "strong-4": dict(nc=(192,) * 3, box=(300.0,) * 3, ranks=4, grid=(2, 2),
                     kind="strong"),
}
QUICK_FACTOR = 8  # --quick: every mesh divided by this (floors unchanged)
# Extrapolation in the Markdown: (nc, GPUs) of the issue and the floor of a GPU rank.
EXTRAPOLATE = [(2048, 64), (2048, 256), (4096, 512), (4096, 4096)]
GPU_FLOOR_MB = 1536.0  # assumed CUDA context + TF runtime per GPU rank (untested here)


def largest_config(nc, ranks):
    cell = 200.0 / 128  # the weak-scaling runs' cell size [Mpc/h]
    return dict(nc=(nc,) * 3, box=(nc * cell,) * 3, ranks=ranks,
                grid=default_grid(ranks), kind="largest")


def config_for(name, args):
    if name == "largest" or name.startswith("largest-"):
        nc = args.nc or (int(name.split("-")[1]) if "-" in name else 384)
        c = largest_config(nc, args.ranks or 4)
        name = "largest-%d-np%d" % (nc, c["ranks"])
    elif name in CONFIGS:
        c = dict(CONFIGS[name])
    else:
        raise SystemExit("unknown configuration %r; see `bench_scaling.py list`" % name)
    if args.quick and c["kind"] != "floor":
        c["nc"] = tuple(max(8, n // QUICK_FACTOR) for n in c["nc"])
    return name, c


def paths(quick):
    """(raw JSON, table) of the results: ``results/raw/<stem>.json``, ``results/<stem>.md``."""
    stem = "bench_scaling_quick" if quick else "bench_scaling"
    return raw_json_path(RESULTS, stem), os.path.join(RESULTS, stem + ".md")


def load(path):
    return normalise(read_json(path, {"records": {}}))


def save(path, data):
    write_json(path, data, sort_keys=True)


# ----------------------------------------------------------------------------- allocators
def default_allocator():
    """The host allocator mode ``flowpm-mtf`` runs with when none is asked for."""
    from flowpm_mtf import allocator

    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWPM_MTF_ALLOCATOR")}
    return allocator.environment(None, env)[0]


def record_key(name, mode, stack=provenance.DEFAULT_STACK):
    """``name`` for the default allocator on the default stack, else ``name@suffix`` with the
    allocator mode and/or the stack (``floor-1@lean``, ``floor-1@tf2.12``,
    ``floor-1@lean+tf2.12``)."""
    parts = [mode] if mode and mode != default_allocator() else []
    if stack != provenance.DEFAULT_STACK:
        parts.append(stack)
    return "%s@%s" % (name, "+".join(parts)) if parts else name


def split_key(key):
    """(configuration name, suffix or None) of a record key."""
    name, _, mode = key.partition("@")
    return name, (mode or None)


def normalise(data):
    """Records written before they carried their stack were TF 2.12's: re-key them."""
    records = {}
    for key, rec in data["records"].items():
        if "stack" not in rec:
            rec["stack"] = provenance.PREVIOUS_STACK
            name, mode = split_key(key)
            key = record_key(name, mode or default_allocator(), rec["stack"])
        records[key] = rec
    data["records"] = records
    return data


def group_title(suffix):
    """The heading of the records of one key suffix (None: the default's)."""
    parts = suffix.split("+")
    stacks = [p for p in parts if p.startswith("tf")]
    modes = [p for p in parts if not p.startswith("tf")]
    what = []
    if stacks:
        what.append("stack `FLOWPM_MTF_STACK=%s`" % stacks[0])
    if modes:
        what.append("host allocator `FLOWPM_MTF_ALLOCATOR=%s`" % modes[0])
    title = ", ".join(what)
    return "\n### %s%s (records `NAME@%s`)" % (title[:1].upper(), title[1:], suffix)


def allocator_groups(records):
    """Records by key suffix (None: the default allocator's on the default stack), keyed by
    configuration name."""
    groups = {}
    for key, rec in records.items():
        name, mode = split_key(key)
        groups.setdefault(mode, {})[name] = rec
    return groups


def stacks_side_by_side(groups):
    """Markdown lines: every configuration measured on both stacks (default allocator)."""
    new, old = groups.get(None, {}), groups.get(provenance.PREVIOUS_STACK, {})
    names = [n for n in CONFIGS if new.get(n, {}).get("ok") and old.get(n, {}).get("ok")]
    if not names:
        return []
    lines = ["\n### The two stacks side by side (default allocator)\n",
             "Peak per rank [MB] (the largest rank), the ICs and the N-body steps [s] (wall, "
             "the job's timings), TF 2.12 (`FLOWPM_MTF_STACK=tf2.12`) and TF 2.21 (default); "
             "ratio = TF 2.21 / TF 2.12. Commits and loads: the records above.\n",
             "| run | peak 2.12 | peak 2.21 | ratio | ICs 2.12 | ICs 2.21 | ratio | steps 2.12 "
             "| steps 2.21 | ratio |", "|---|---|---|---|---|---|---|---|---|---|"]
    for n in names:
        a, b = old[n], new[n]
        pa, pb = max(a["peak_mb_per_rank"]), max(b["peak_mb_per_rank"])
        ia, ib = a["timings"].get("ics_s"), b["timings"].get("ics_s")
        sa, sb = a["timings"].get("nbody_s"), b["timings"].get("nbody_s")
        ratio = lambda x, y: "%.2f" % (y / x) if x and y else "-"  # noqa: E731
        lines.append("| %s | %.0f | %.0f | %s | %s | %s | %s | %s | %s | %s |" % (
            n, pa, pb, ratio(pa, pb), _fmt_s(ia), _fmt_s(ib), ratio(ia, ib), _fmt_s(sa),
            _fmt_s(sb), ratio(sa, sb)))
    return lines


def _fmt_s(v):
    return "-" if v is None else "%.3g" % v


# ----------------------------------------------------------------------------- run
def simulate_command(c, out, steps):
    # the interpreter running this script: its venv is the stack measured (the records say
    # which, provenance.stack)
    cmd = mpirun_command(c["ranks"])
    cmd += [sys.executable, "-m", "flowpm_mtf.cli", "simulate", "--nc", ",".join(map(str, c["nc"])),
            "--steps", str(steps), "--grid",
            "x".join(map(str, c["grid"])), "--out", out, "--no-plot", "--dtype", "float32",
            "--force"]  # measure what runs, not what the preflight estimate expects
    return cmd  # the (possibly non-cubic) box goes through a --config file


def sim_config(c):
    """The SimConfig a configuration runs (defaults of ``simulate`` otherwise)."""
    from flowpm_mtf.config import SimConfig

    return SimConfig(nc=tuple(c["nc"]), box_size=tuple(c["box"]), grid=tuple(c["grid"]),
                     n_steps=2, dtype="float32")


def padded_cells(c, halo):
    """Padded cells of one rank's block, ``(nx/P + 2h)(ny/Q + 2h) nz``."""
    (nx, ny, nz), (P, Q) = c["nc"], c["grid"]
    return (nx // P + 2 * halo) * (ny // Q + 2 * halo) * nz


def planned(c):
    """Decomposition, halo, particle slots and padded cells per rank the run is set up with
    (:func:`flowpm_mtf.runs.preflight.memory_terms`), and the preflight estimate [MB]."""
    from flowpm_mtf.runs import preflight

    conf = sim_config(c)
    slots, cells = preflight.memory_terms(conf)
    return {"decomposition": conf.decomposition, "halo_size": conf.halo_size,
            "capacity": int(slots), "slots_local": int(slots), "padded_cells_local": int(cells),
            "preflight_mb": preflight.estimate_peak_memory(conf, masters=False) / MB}


def run_one(name, c, args):
    """Run one configuration under mpirun; returns its record."""
    out = tempfile.mkdtemp(prefix="bench_scaling_")
    cfg_file = os.path.join(out, "config.json")
    with open(cfg_file, "w") as f:
        json.dump({"box_size": list(c["box"])}, f)
    cmd = simulate_command(c, os.path.join(out, "run"), args.steps) + ["--config", cfg_file]
    # HOROVOD_ tuning variables of the caller reach the runs (only Open MPI's are dropped)
    env = clean_env(REPO, strip=[p for p in MPI_LAUNCH_PREFIXES if p != "HOROVOD_"],
                    TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    if args.allocator:
        env["FLOWPM_MTF_ALLOCATOR"] = args.allocator
    env.pop("FLOWPM_MTF_ALLOCATOR_ACTIVE", None)
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    mach = provenance.machine()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    n = int(np.prod(c["nc"]))
    rec = {"name": name, "kind": c["kind"], "nc": list(c["nc"]), "box": list(c["box"]),
           "ranks": c["ranks"], "grid": list(c["grid"]), "steps": args.steps,
           "n_particles": n, "n_local": n // c["ranks"],
           "ok": proc.returncode == 0, "returncode": proc.returncode,
           "commit": provenance.git("rev-parse", "--short", "HEAD"),
           "dirty": provenance.code_dirty("flowpm_mtf", "hvd_mesh_impl", untracked=True),
           "date": started, "machine": mach, "note": args.note, "quick": args.quick,
           "stack": provenance.stack(),
           "command": " ".join(cmd)}
    rec.update(planned(c))
    summary_path = os.path.join(out, "run", "summary.json")
    if rec["ok"] and os.path.exists(summary_path):
        with open(summary_path) as f:
            summary = json.load(f)
        rec["peak_mb_per_rank"] = summary["peak_memory_mb_per_rank"]
        rec["phases_mb_per_rank"] = summary.get("memory_phases_mb_per_rank")
        rec["timings"] = {k: v for k, v in summary["timings"].items() if k != "steps_s"}
        rec["allocator"] = summary.get("allocator", "tf")
        mig = summary.get("migration") or {}
        # what the run used (a capacity retry may have enlarged the buffers)
        rec.update({k: mig[k] for k in ("decomposition", "halo_size", "capacity") if k in mig})
        rec["slots_local"] = rec["capacity"]
        rec["padded_cells_local"] = padded_cells(c, rec["halo_size"])
        if "imbalance_max" in mig:
            rec["imbalance_max"] = mig["imbalance_max"]
    else:
        rec["ok"] = False
        lines = [l for l in proc.stderr.splitlines() if l.strip()]
        errors = [l for l in lines if "Error:" in l or "error:" in l or "Killed" in l]
        rec["error"] = (errors[0] if errors else " | ".join(lines[-5:]))[-1000:] or \
            "exit status %d" % proc.returncode
    shutil.rmtree(out, ignore_errors=True)
    return rec


def breakdown(rec):
    """Per-rank breakdown [MB] of one record (see the module docstring)."""
    rows = []
    for r, ph in enumerate(rec.get("phases_mb_per_rank") or []):
        start, graph, ics, steps, output = (ph[k] for k in ("start", "graph", "ics", "steps",
                                                            "output"))
        rows.append({"rank": r, "runtime": start["rss"],
                     "graph_state": graph["phase_peak"] - start["rss"],
                     "ics": max(0.0, ics["phase_peak"] - graph["rss"]),
                     "steps": max(0.0, steps["phase_peak"] - ics["rss"]),
                     "output": max(0.0, output["phase_peak"] - steps["rss"]),
                     "peak": rec["peak_mb_per_rank"][r]})
    return rows


# ----------------------------------------------------------------------------- model
def slots_of(rec):
    """Particle slots per rank of a record: ``slots_local``, else (records written before
    it was stored: the lagrangian decomposition, one slot per particle) ``capacity`` or
    the particles per rank."""
    for key in ("slots_local", "capacity", "n_local"):   # in order; not all records have all
        if key in rec:
            return rec[key]
    raise KeyError("record %r has none of slots_local, capacity, n_local" % rec.get("name"))


def fit_model(records):
    """Non-negative least-squares fit peak_rank [MB] = M0 + (a slots + b cells) / 2^20.

    Over the successful non-floor runs: ``slots`` the particle slots of a rank's block
    (the eulerian capacity), ``cells`` its padded cells; ``a`` [bytes per slot], ``b``
    [bytes per padded cell] and M0 [MB] are constrained to be >= 0. M0 is then raised by
    the largest amount the fit falls short of a run (``M0_shift_mb``): the preflight check
    refuses runs by this model, so it must bound every measured peak, not pass through
    them. The same model and constants serve the preflight estimate
    (:mod:`flowpm_mtf.runs.preflight`, MODEL_FILE, rewritten by ``render``).
    """
    from scipy.optimize import nnls

    rows = [r for r in records.values() if r["ok"] and r["kind"] != "floor"]
    if len(rows) < 3:
        return None
    A = np.array([[1.0, slots_of(r) / MB, r["padded_cells_local"] / MB] for r in rows])
    y = np.array([max(r["peak_mb_per_rank"]) for r in rows])
    coef, _ = nnls(A, y)
    shift = max(0.0, float(np.max(y - A @ coef)))     # an upper bound of every run
    coef[0] += shift
    pred = A @ coef
    return {"M0_mb": float(coef[0]), "M0_shift_mb": shift, "bytes_per_slot": float(coef[1]),
            "bytes_per_padded_cell": float(coef[2]),
            "max_rel_residual": float(np.max(np.abs(pred - y) / y)),
            "fitted_on": sorted(r["name"] for r in rows),
            "rows": [{"name": r["name"], "ranks": r["ranks"], "slots_local": slots_of(r),
                      "padded_cells_local": r["padded_cells_local"], "peak_mb": float(v)}
                     for r, v in zip(rows, y)],
            "formula": "peak per rank [MB] = M0_mb + (bytes_per_slot * slots + "
                       "bytes_per_padded_cell * (nx/P + 2h)(ny/Q + 2h) nz) / 2^20"}


def predict_mb(model, nc, n, floor_mb, box=None):
    """Per-rank memory [MB] of nc^3 particles on n ranks (most square grid), with the GPU
    floor instead of M0; box default: the 0.49 Mpc/h cells of 2048^3 in 1 Gpc/h."""
    c = {"nc": (nc,) * 3, "box": (box or nc * 1000.0 / 2048,) * 3, "grid": default_grid(n)}
    from flowpm_mtf.runs import preflight

    slots, cells = preflight.memory_terms(sim_config(c))
    return floor_mb + (model["bytes_per_slot"] * slots
                       + model["bytes_per_padded_cell"] * cells) / MB


MODEL_MIN_RUNS = 5          # a fit for the preflight needs this many measured runs,
MODEL_MIN_SPAN = 2.0        # slots per rank spanning this factor (else M0 and a are degenerate)
MODEL_MAX_RESIDUAL = 0.20   # and no run further than this from it


def model_spans(model):
    """Whether a fit is constrained enough to replace the preflight constants."""
    slots = [r["slots_local"] for r in model["rows"]]
    return (len(slots) >= MODEL_MIN_RUNS and max(slots) >= MODEL_MIN_SPAN * min(slots)
            and model["max_rel_residual"] <= MODEL_MAX_RESIDUAL)


def write_memory_model(model, json_path, path=None):
    """Write the fitted constants (and the rows they fit) for :mod:`flowpm_mtf.runs.preflight`."""
    from flowpm_mtf.runs import preflight

    out = dict(model, source="scripts/bench_scaling.py render of %s"
               % os.path.relpath(json_path, REPO))
    path = path or preflight.MODEL_FILE
    with open(path + ".tmp", "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(path + ".tmp", path)


# ----------------------------------------------------------------------------- render
def _fmt_range(values):
    lo, hi = min(values), max(values)
    return "%.0f" % lo if abs(hi - lo) < 0.5 else "%.0f-%.0f" % (lo, hi)


def _section(lines, recs, floors):
    """The floor line and the weak, strong and largest tables of one allocator's records."""
    lines.append("\nRuntime floor (peak of a 16^3 run) per rank count: %s." % (
        ", ".join("%d rank%s %.0f MB" % (n, "s" if n > 1 else "", v)
                  for n, v in sorted(floors.items())) or "not measured"))

    def above(r):
        f = floors.get(r["ranks"])
        return None if f is None else max(r["peak_mb_per_rank"]) - f

    def table(kind, title, ref_name, target_text, above_floor):
        rows = [r for r in recs.values() if r["kind"] == kind]
        if not rows:
            return
        lines.append("\n#### %s\n" % title)
        lines.append("| run | ranks | grid | mesh | particles/rank | peak per rank [MB] | "
                     "above floor [MB] | ratio to 1 rank | B/particle above floor |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        ref = recs.get(ref_name)
        for r in sorted(rows, key=lambda r: r["ranks"]):
            if not r["ok"]:
                lines.append("| %s | %d | %s | %s | %.3gM | failed: %s | | | |" % (
                    r["name"], r["ranks"], "x".join(map(str, r["grid"])),
                    "x".join(map(str, r["nc"])), r["n_local"] / 1e6, r["error"][:80]))
                continue
            a = above(r)
            ratio = ""
            if ref and ref["ok"]:
                if above_floor and a is not None and above(ref):
                    ratio = "%.2f" % (a / above(ref))
                elif not above_floor:
                    ratio = "%.2f" % (max(r["peak_mb_per_rank"]) / max(ref["peak_mb_per_rank"]))
            lines.append("| %s | %d | %s | %s | %.3gM | %s | %s | %s | %s |" % (
                r["name"], r["ranks"], "x".join(map(str, r["grid"])),
                "x".join(map(str, r["nc"])), r["n_local"] / 1e6,
                _fmt_range(r["peak_mb_per_rank"]), "-" if a is None else "%.0f" % a, ratio,
                "-" if a is None else "%.0f" % (a * MB / r["n_local"])))
        lines.append("\nTarget: %s." % target_text)

    table("weak", "Weak scaling (2.1M particles per rank)", "weak-1",
          "peak per rank on 4 ranks <= 1.10x that on 1 rank (ratio column: peak / peak)", False)
    table("strong", "Strong scaling (192^3)", "strong-1",
          "memory above the floor on 4 ranks <= 0.30x that on 1 rank (ratio column: above "
          "floor / above floor)", True)
    largest = [r for r in recs.values() if r["kind"] == "largest"]
    if largest:
        lines.append("\n#### Largest runs (2 steps)\n")
        lines.append("| run | ranks | particles | ok | peak per rank [MB] | total [GB] | "
                     "B/particle above floor |")
        lines.append("|---|---|---|---|---|---|---|")
        for r in sorted(largest, key=lambda r: (r["n_particles"], r["ranks"])):
            if r["ok"]:
                a = above(r)
                lines.append("| %s | %d | %d^3 | yes | %s | %.1f | %s |" % (
                    r["name"], r["ranks"], r["nc"][0], _fmt_range(r["peak_mb_per_rank"]),
                    sum(r["peak_mb_per_rank"]) / 1024.0,
                    "-" if a is None else "%.0f" % (a * MB / r["n_local"])))
            else:
                lines.append("| %s | %d | %d^3 | **no**: %s | | | |" % (
                    r["name"], r["ranks"], r["nc"][0], r["error"][:80]))
        lines.append("\nTarget: >= 384^3 particles on this 24 GB machine, aim 512^3.")


def render(data, quick):
    recs = data["records"]
    ok = {k: r for k, r in recs.items() if r["ok"]}
    lines = []
    dates = sorted({r["date"] for r in recs.values()})
    loads = [r["machine"]["loadavg"][0] for r in recs.values() if r.get("machine")]
    lines.append("_Generated by `python scripts/bench_scaling.py render` from `%s` (%d runs, "
                 "%s; 1-min load average at the start of the runs %s; commits %s)._" % (
                     os.path.relpath(paths(quick)[0], REPO), len(recs),
                     " to ".join([dates[0], dates[-1]]) if dates else "-",
                     "%.1f-%.1f" % (min(loads), max(loads)) if loads else "-",
                     ", ".join(sorted({r["commit"] + ("+dirty" if r["dirty"] else "")
                                       for r in recs.values()}))))
    if quick:
        lines.append("\n**Quick mode (smoke test): every mesh 1/%d of the real size; not a "
                     "measurement of the targets.**" % QUICK_FACTOR)
    groups = allocator_groups(data["records"])

    def floors_of(group):
        return {r["ranks"]: max(r["peak_mb_per_rank"]) for r in group.values()
                if r["ok"] and r["kind"] == "floor"}

    default_floors = floors_of(groups.get(None, {}))
    for mode in [None] + sorted(m for m in groups if m is not None):
        group = groups.get(mode, {})
        if mode is not None:
            lines.append(group_title(mode))
        _section(lines, group, floors_of(group) or default_floors)
    lines += stacks_side_by_side(groups)
    lines.append("\n#### Breakdown per rank [MB] (rank with the highest peak)\n")
    lines.append("| run | decomposition, halo, slots/rank | runtime | graph + state | ICs | "
                 "steps | output | peak | state slots (%d B/slot) | preflight estimate |"
                 % STATE_BYTES_PER_SLOT)
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for name in sorted(ok, key=lambda k: (ok[k]["kind"], ok[k]["ranks"], k)):
        rows = breakdown(ok[name])
        if not rows:
            continue
        b = max(rows, key=lambda x: x["peak"])
        r = ok[name]
        lines.append("| %s | %s, %s, %s | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f | %s |"
                     % (name, r.get("decomposition", "?"), r.get("halo_size", "?"),
                        slots_of(r), b["runtime"], b["graph_state"], b["ics"],
                        b["steps"], b["output"], b["peak"],
                        STATE_BYTES_PER_SLOT * slots_of(r) / MB,
                        "%.0f" % r["preflight_mb"] if "preflight_mb" in r else "-"))
    model = data.get("model")
    if model:
        lines.append("\n#### Memory model (for the preflight estimate)\n")
        lines.append("Fitted on %s: **M0 = %.0f MB, %.0f bytes per particle slot, %.1f bytes "
                     "per padded cell** (largest relative residual %.1f%%): %s. `render` "
                     "writes these constants to `flowpm_mtf/runs/memory_model.json`, which the "
                     "preflight memory check (`flowpm_mtf/runs/preflight.py`) reads." % (
                         ", ".join(model["fitted_on"]), model["M0_mb"],
                         model["bytes_per_slot"], model["bytes_per_padded_cell"],
                         100 * model["max_rel_residual"], model["formula"]))
        lines.append("\nExtrapolated per-rank memory (eulerian, automatic halo and capacity, "
                     "0.49 Mpc/h cells, float32, grid the most square P x Q; GPU floor %.1f GB "
                     "assumed instead of the CPU M0, untested):\n" % (GPU_FLOOR_MB / 1024))
        lines.append("| particles | GPUs | grid | per rank [GB] | fits 80 GB |")
        lines.append("|---|---|---|---|---|")
        for nc, n in EXTRAPOLATE:
            gb = predict_mb(model, nc, n, GPU_FLOOR_MB) / 1024.0
            lines.append("| %d^3 | %d | %s | %.1f | %s |" % (
                nc, n, "x".join(map(str, default_grid(n))), gb, "yes" if gb < 0.8 * 80 else
                "no"))
    return "\n".join(lines) + "\n"


DOC_BEGIN = "<!-- BEGIN BENCH-SCALING -->"
DOC_END = "<!-- END BENCH-SCALING -->"


def update_doc(md, doc=os.path.join(REPO, "docs", "scaling.md")):
    """Replace the BENCH-SCALING section of ``doc`` (appended if absent) by ``md``."""
    with open(doc) as f:
        text = f.read()
    block = "%s\n%s%s" % (DOC_BEGIN, md, DOC_END)
    if DOC_BEGIN in text:
        head, rest = text.split(DOC_BEGIN, 1)
        text = head + block + rest.split(DOC_END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n## Measured memory per rank (`scripts/bench_scaling.py`)" \
            "\n\n" + block + "\n"
    with open(doc, "w") as f:
        f.write(text)


def write_outputs(data, quick, rendered=False):
    json_path, md_path = paths(quick)
    data["model"] = fit_model(allocator_groups(data["records"]).get(None, {}))
    save(json_path, data)
    md = render(data, quick)
    # the table first: its provenance line records whether the code differs from the
    # commit, and the memory model below is a tracked file this writes
    write_table(md_path, "# Memory benchmark (`scripts/bench_scaling.py`)\n\n" + md, SCRIPT,
                rendered_from=json_path if rendered else None)
    if data["model"] and not quick:
        if model_spans(data["model"]):
            write_memory_model(data["model"], json_path)
        else:
            print("memory model not written to flowpm_mtf/runs/memory_model.json: the fit needs >= %d "
                  "runs whose slots per rank span a factor >= %g, with residuals <= %g"
                  % (MODEL_MIN_RUNS, MODEL_MIN_SPAN, MODEL_MAX_RESIDUAL), flush=True)
    if not quick:
        update_doc(md)
    return md


# ----------------------------------------------------------------------------- main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke test: meshes / %d, separate "
                    "results file, docs untouched" % QUICK_FACTOR)
    ap.add_argument("--steps", type=int, default=2, help="N-body steps per run")
    ap.add_argument("--timeout", type=float, default=3600, help="per run [s]")
    ap.add_argument("--note", default="", help="stored with the record (e.g. 'quiet machine')")
    ap.add_argument("--allocator", choices=("tcmalloc", "lean", "tf"),
                    help="host allocator of the runs (FLOWPM_MTF_ALLOCATOR; default: the "
                    "jobs' default); records of another than the default are NAME@MODE")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run", help="run one configuration and merge it into the results")
    p.add_argument("name", nargs="?", help="a configuration of `list`, or largest[-NC]; "
                   "none: every configuration and largest (384^3 on 4 ranks)")
    p.add_argument("--nc", type=int, help="largest: particles per side")
    p.add_argument("--ranks", type=int, help="largest: MPI ranks (default 4)")
    sub.add_parser("missing", help="run every listed configuration not measured yet")
    sub.add_parser("list", help="configurations and their state")
    sub.add_parser("render", help="JSON -> Markdown (+ docs/scaling.md)")
    args = ap.parse_args(argv)
    json_path, _ = paths(args.quick)
    data = normalise(read_raw(json_path)) if args.cmd == "render" else load(json_path)
    if args.cmd == "list":
        for name in CONFIGS:
            _, c = config_for(name, argparse.Namespace(quick=args.quick, nc=None, ranks=None))
            r = data["records"].get(name)
            print("%-10s np %d  %-14s %s" % (name, c["ranks"], "x".join(map(str, c["nc"])),
                                              "-" if r is None else
                                              ("ok %s" % _fmt_range(r["peak_mb_per_rank"])
                                               if r["ok"] else "failed")))
        return 0
    if args.cmd in ("run", "missing"):
        if args.cmd == "run":
            todo = [args.name] if args.name else list(CONFIGS) + ["largest"]
        else:
            todo = [n for n in CONFIGS
                    if not data["records"].get(record_key(n, args.allocator,
                                                          provenance.stack()), {}).get("ok")]
            args.nc = args.ranks = None
        for name in todo:
            name, c = config_for(name, args)
            print("running %s: %d ranks, mesh %s ..." % (
                name, c["ranks"], "x".join(map(str, c["nc"]))), flush=True)
            rec = run_one(name, c, args)
            data = load(json_path)  # merge with what other invocations wrote meanwhile
            data["records"][record_key(name, args.allocator, rec["stack"])] = rec
            write_outputs(data, args.quick)
            print("  %s" % ("peak per rank %s MB" % _fmt_range(rec["peak_mb_per_rank"])
                            if rec["ok"] else "FAILED: " + rec["error"]), flush=True)
    md = write_outputs(data, args.quick, rendered=args.cmd == "render")
    if args.cmd == "render":
        print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
