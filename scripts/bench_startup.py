"""What a rank pays before its job starts: CPU time and memory of the imports.

Every rank of every job (and every process of the test suite) imports TensorFlow, Mesh TF,
Horovod and our packages before it does any work. This script measures, in fresh
interpreters started as users start them (no ``PYTHONPATH``, cwd a temporary directory):

* ``tensorflow``: ``import tensorflow`` alone (TensorFlow's own import, Keras included);
* ``tensorflow + keras``: the job's imports after ``import keras`` (what a job cost
  before our first TensorFlow import skipped Keras and Horovod was patched not to load it);
* ``job imports``: ``import mesh_tensorflow, horovod.tensorflow, flowpm_mtf.api,
  hvd_mesh_impl`` (Mesh TF first: the start-up file's path, as a job's);
* ``simulate 16^3, 2 ranks``: ``mpirun -np 2 flowpm-mtf simulate --nc 16`` end to end,
  CPU time summed over the ranks (the job itself takes about a second of it).

and writes the medians to ``results/bench_startup.md`` (and ``.json``)::

    .venv/bin/python scripts/bench_startup.py            # 5 runs each
    .venv/bin/python scripts/bench_startup.py --runs 3 --no-mpi
"""
import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# The child prints its own CPU time [s] and peak RSS [MB] after the imports.
MEASURE = """
import resource, sys, time
t0 = time.process_time()
{imports}
cpu = time.process_time() - t0
print("RESULT", cpu, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
      "keras" in sys.modules)
"""
CASES = {
    "tensorflow": "import tensorflow",
    "tensorflow + keras": "import keras\nimport mesh_tensorflow, horovod.tensorflow, "
                          "flowpm_mtf.api, hvd_mesh_impl",
    "job imports": "import mesh_tensorflow, horovod.tensorflow, flowpm_mtf.api, hvd_mesh_impl",
}


def clean_env():
    drop = ("PYTHONPATH", "PYTHONSTARTUP")
    env = {k: v for k, v in os.environ.items()
           if k not in drop and not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_imports(code, cwd):
    """(cpu [s], peak RSS [MB], keras loaded) of one fresh interpreter."""
    out = subprocess.run([sys.executable, "-c", MEASURE.format(imports=code)], cwd=cwd,
                         env=clean_env(), capture_output=True, text=True, check=True)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1].split()
    return float(line[1]), float(line[2]), line[3] == "True"


def run_simulate(cwd):
    """(wall [s], CPU [s] summed over mpirun and its ranks) of a 2-rank 16^3 simulate."""
    exe = os.path.join(os.path.dirname(sys.executable), "flowpm-mtf")
    out = os.path.join(cwd, "run")
    shutil.rmtree(out, ignore_errors=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(["mpirun", "--bind-to", "none", "--allow-run-as-root", "--oversubscribe",
                    "-np", "2", exe, "simulate", "--nc", "16", "--out", out, "--no-plot"],
                   cwd=cwd, env=clean_env(), capture_output=True, check=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="runs of each case (median)")
    ap.add_argument("--no-mpi", action="store_true", help="leave out the 2-rank simulate")
    ap.add_argument("--out", default=os.path.join(REPO, "results", "bench_startup.md"))
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error("--runs must be >= 1")
    import ml_dtypes
    import tensorflow as tf

    load0 = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_startup_") as cwd:
        for name, code in CASES.items():
            res = [run_imports(code, cwd) for _ in range(args.runs)]
            rows.append(dict(case=name, cpu_s=statistics.median(r[0] for r in res),
                             rss_mb=statistics.median(r[1] for r in res), keras=res[0][2]))
        if not args.no_mpi:
            res = [run_simulate(cwd) for _ in range(args.runs)]
            rows.append(dict(case="simulate 16^3, 2 ranks", wall_s=statistics.median(r[0] for r in res),
                             cpu_s=statistics.median(r[1] for r in res)))
    load1 = os.getloadavg()
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), host=platform.node(),
                cores=os.cpu_count(), tensorflow=tf.__version__, ml_dtypes=ml_dtypes.__version__,
                runs=args.runs, load_before=load0, load_after=load1)
    lines = ["# Start-up cost of a rank", "",
             "Generated by `scripts/bench_startup.py --runs %d` on %s (%d cores; load average "
             "%.1f before, %.1f after). TensorFlow %s, ml_dtypes %s. Medians of %d fresh "
             "interpreters each; CPU time = user + system." % (
                 args.runs, meta["date"], meta["cores"], load0[0], load1[0], meta["tensorflow"],
                 meta["ml_dtypes"], args.runs), "",
             "| case | CPU [s] | peak RSS [MB] | Keras loaded | wall [s] |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append("| %s | %.2f | %s | %s | %s |" % (
            r["case"], r["cpu_s"], "%.0f" % r["rss_mb"] if "rss_mb" in r else "",
            {True: "yes", False: "no"}.get(r.get("keras"), ""),
            "%.1f" % r["wall_s"] if "wall_s" in r else ""))
    text = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump(dict(meta, rows=rows), f, indent=1)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
