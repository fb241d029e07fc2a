"""The flowpm-mtf command line under mpirun (2-rank jobs started by the test)."""
import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from flowpm_mtf import cli
from test_mpi_jobs import clean_env

# The demo compares with numpy.fft in float64: a correct FFT is at round-off (~1e-15).
FFT_DEMO_TOL = 1e-12


def _mpirun(np_, *args, timeout=240, env=None):
    cmd = [shutil.which("mpirun"), "--oversubscribe", "-np", str(np_)]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    cmd += [sys.executable, "-m", "flowpm_mtf.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=clean_env() if env is None else env)


@pytest.mark.single_process
def test_fft_demo_on_two_ranks():
    """The demo on 2 ranks, in an environment without TF_CPP_MIN_LOG_LEVEL: TensorFlow's
    start-up lines are hidden by default (shown with --verbose: tests/test_jobs.py)."""
    out = tempfile.mkdtemp(prefix="fftdemo")
    env = {k: v for k, v in clean_env().items() if not k.startswith("TF_CPP")}
    proc = _mpirun(2, "fft-demo", "--nc", "16,8,8", "--halo", "2", "--out", out,
                   "--repeats", "1", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cpu_feature_guard" not in proc.stderr and "oneDNN" not in proc.stderr
    with open(os.path.join(out, "fft_demo.json")) as f:
        res = json.load(f)
    assert res["grid"] == [2, 1] and res["ranks"] == 2 and res["nc"] == [16, 8, 8]
    assert res["max_rel_error_forward_vs_numpy"] < FFT_DEMO_TOL
    assert res["max_rel_error_round_trip"] < FFT_DEMO_TOL


@pytest.mark.single_process
def test_grid_not_matching_rank_count_fails_clearly():
    """One line from rank 0, no traceback, a non-zero exit (the other refusals of the rank
    count: tests/test_preflight_cli.py, in one job)."""
    proc = _mpirun(2, "fft-demo", "--nc", "16", "--halo", "2", "--grid", "2x2", "--out",
                   tempfile.mkdtemp())
    assert proc.returncode != 0
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines()
             if ln.startswith("flowpm-mtf: error: ")]
    assert len(lines) == 1 and "needs 4 ranks but the job has 2" in lines[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr


def test_parsers():
    assert cli.parse_grid("2x1") == (2, 1)
    assert cli.parse_nc("64") == 64 and cli.parse_nc("64,32,16") == (64, 32, 16)
    with pytest.raises(Exception):
        cli.parse_grid("2")
    assert cli.default_grid(4) == (2, 2) and cli.default_grid(2) == (2, 1)
    assert cli.default_grid(6) == (3, 2) and cli.default_grid(1) == (1, 1)


# In a fresh interpreter (not an MPI rank): for every job a wrong option and an invalid value
# of its config (ConfigError), and a process grid for other ranks (RankCountError); the exit
# codes and which of TensorFlow, Mesh TF, Horovod got imported, as JSON.
LIGHT_ERRORS_SCRIPT = """
import json, sys
from flowpm_mtf import cli, jobs

codes = {}
for name in jobs.all_jobs():
    codes[name] = [cli.main([name, "--definitely-not-an-option"]),
                   cli.main([name, "--nc", "0"])]
grid = cli.main(["simulate", "--grid", "2x1"])
heavy = [m for m in ("tensorflow", "mesh_tensorflow", "horovod") if m in sys.modules]
print(json.dumps({"codes": codes, "grid": grid, "heavy": heavy}))
"""


@pytest.mark.rank_independent
def test_option_and_config_errors_come_before_tensorflow_is_imported():
    """A typo or an invalid value fails (exit 2) without importing TensorFlow, Mesh TF or
    Horovod, for every job: the parser and the configs need only the jobs' light declarative
    parts (importing TensorFlow from a cluster's parallel filesystem takes long, on every
    rank)."""
    from flowpm_mtf import jobs

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(clean_env(), PYTHONPATH=os.pathsep.join(
        [repo] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    proc = subprocess.run([sys.executable, "-c", LIGHT_ERRORS_SCRIPT], capture_output=True,
                          text=True, timeout=120, env=env, cwd=repo)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(out["codes"]) == len(jobs.JOB_MODULES), out
    assert all(c == [2, 2] for c in out["codes"].values()) and out["grid"] == 2, out
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("flowpm-mtf: error: ")]
    n = len(out["codes"])   # the parser's error, the config's, the rank count's
    assert sum("unrecognized arguments: --definitely-not-an-option" in ln for ln in lines) == n
    assert sum(ln.startswith("flowpm-mtf: error: nc must be") for ln in lines) == n, lines
    assert "needs 2 ranks but the job has 1" in lines[-1] and len(lines) == 2 * n + 1, lines
    assert out["heavy"] == [], out
