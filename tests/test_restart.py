"""End to end: `flowpm-mtf simulate` snapshots do not depend on the process grid; checkpoint,
SIGTERM and `--resume` (same grid bit-identical, other grid to round-off, torn checkpoints
skipped, bad input refused on every rank)."""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import h5py
import numpy as np
import pytest

from test_cli import _mpirun
from test_mpi_jobs import clean_env

pytestmark = pytest.mark.single_process

STEPS = 100  # steps cost ~10 ms here: a wide window for the SIGTERM
ARGS = ["simulate", "--nc", "16", "--box-size", "100", "--steps", str(STEPS), "--halo", "4",
        "--seed", "7", "--dtype", "float64", "--no-plot"]
BOX = 100.0
# float64 everywhere; another process grid changes only the order of floating-point sums
# (FFT/all-reduce partitioning) and, on resume, re-expresses block-local positions relative
# to another block origin: round-off of positions ~1e2 Mpc/h.
GRID_POS_ATOL = 1e-8      # [Mpc/h]
GRID_VEL_RTOL = 1e-8      # relative to the rms velocity
GRID_DENSITY_ATOL = 1e-10
SIGNAL_AFTER = "step 3/%d" % STEPS


def _run(np_, *args):
    proc = _mpirun(np_, *ARGS, *args, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _snap(d):
    """Snapshot sorted by id, read with plain h5py."""
    with h5py.File(os.path.join(d, "snapshot.h5"), "r") as f:
        order = np.argsort(f["id"][...])
        out = {k: f[k][...][order] for k in ("position", "velocity", "id")}
        out["density"] = f["density"][...]
    return out


def _rank_pid(mpirun_pid, rank, timeout=60):
    """PID of MPI rank ``rank`` among the children of our mpirun."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with open("/proc/%d/task/%d/children" % (mpirun_pid, mpirun_pid)) as f:
                children = [int(c) for c in f.read().split()]
        except OSError:
            children = []
        for c in children:
            try:
                with open("/proc/%d/environ" % c, "rb") as f:
                    env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            except OSError:
                continue
            if env.get(b"OMPI_COMM_WORLD_RANK") == str(rank).encode():
                return c
        time.sleep(0.2)
    raise AssertionError("rank %d of mpirun %d not found" % (rank, mpirun_pid))


def _run_and_sigterm(np_, out, rank):
    """Run on ``np_`` ranks; send SIGTERM to ``rank`` only, once rank 0 logged SIGNAL_AFTER."""
    cmd = [shutil.which("mpirun"), "--oversubscribe", "-np", str(np_)]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    cmd += [sys.executable, "-m", "flowpm_mtf.cli", *ARGS, "--out", out,
            "--checkpoint-every", "20"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=clean_env())
    pid = _rank_pid(proc.pid, rank)
    lines, sent = [], False
    for line in proc.stdout:
        lines.append(line)
        if not sent and SIGNAL_AFTER in line:
            os.kill(pid, signal.SIGTERM)
            sent = True
    rc = proc.wait(timeout=600)
    return rc, sent, "".join(lines)


@pytest.fixture(scope="module")
def runs():
    base = tempfile.mkdtemp(prefix="restart")
    d = {k: os.path.join(base, k) for k in ("r11", "r21", "r22", "sig", "resume22", "bad")}
    proc = subprocess.run([sys.executable, "-m", "flowpm_mtf.cli", *ARGS, "--backend",
                           "placement", "--grid", "1x1", "--out", d["r11"]],
                          capture_output=True, text=True, timeout=600, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    _run(2, "--out", d["r21"], "--checkpoint-every", "20")
    _run(4, "--out", d["r22"])
    rc, sent, log = _run_and_sigterm(2, d["sig"], rank=1)
    shutil.copytree(d["sig"], d["resume22"])
    shutil.copytree(d["sig"], d["bad"])
    yield d, (rc, sent, log)
    shutil.rmtree(base, ignore_errors=True)


def _assert_close(a, b):
    dp = np.abs(a["position"] - b["position"])
    dp = np.minimum(dp, BOX - dp)  # periodic
    assert dp.max() < GRID_POS_ATOL
    vrms = np.sqrt(np.mean(b["velocity"] ** 2))
    assert np.abs(a["velocity"] - b["velocity"]).max() < GRID_VEL_RTOL * vrms
    np.testing.assert_allclose(a["density"], b["density"], atol=GRID_DENSITY_ATOL)
    np.testing.assert_array_equal(a["id"], b["id"])


def test_snapshot_does_not_depend_on_the_grid(runs):
    d, _ = runs
    ref = _snap(d["r11"])
    assert ref["position"].shape == (16**3, 3) and ref["position"].dtype == np.float64
    np.testing.assert_array_equal(ref["id"], np.arange(16**3))
    assert ref["velocity"].std() > 0 and ref["density"].std() > 0.1
    for k in ("r21", "r22"):
        _assert_close(_snap(d[k]), ref)
        assert len(os.listdir(os.path.join(d[k], "snapshot.parts"))) == int(k[1]) * int(k[2])


def test_sigterm_checkpoints_and_exits_zero_on_every_rank(runs):
    d, (rc, sent, log) = runs
    assert sent, "the run ended before %r was logged" % SIGNAL_AFTER
    assert rc == 0, log[-4000:]
    assert "received SIGTERM" in log
    assert "flowpm-mtf simulate --resume %s" % d["sig"] in log
    assert not os.path.exists(os.path.join(d["sig"], "snapshot.h5"))
    steps = sorted(os.listdir(os.path.join(d["sig"], "checkpoint")))
    assert steps and all(s.startswith("step_") for s in steps)
    assert int(steps[-1][5:]) < STEPS


def test_resume_same_grid_is_bit_identical(runs):
    d, _ = runs
    proc = _run(2, "--resume", d["sig"])
    assert "resuming from" in proc.stderr
    a, b = _snap(d["sig"]), _snap(d["r21"])
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert np.array_equal(np.loadtxt(os.path.join(d["sig"], "power.txt")),
                          np.loadtxt(os.path.join(d["r21"], "power.txt")))


def test_resume_on_another_grid_skipping_a_torn_checkpoint(runs):
    d, _ = runs
    root = os.path.join(d["resume22"], "checkpoint")
    newest = sorted(os.listdir(root))[-1]
    torn = os.path.join(root, "step_%06d" % (STEPS - 1))
    shutil.copytree(os.path.join(root, newest), torn)
    os.remove(os.path.join(torn, "rank00001.h5"))
    os.makedirs(os.path.join(root, ".tmp-step_%06d" % (STEPS - 1)), exist_ok=True)
    proc = _run(4, "--resume", d["resume22"])
    assert "ignoring incomplete checkpoint" in proc.stderr
    assert "resuming from %s" % os.path.join(root, newest) in proc.stderr
    _assert_close(_snap(d["resume22"]), _snap(d["r21"]))


def test_resume_without_checkpoint_is_one_clear_error_on_every_rank():
    empty = tempfile.mkdtemp(prefix="noresume")
    proc = _mpirun(2, "simulate", "--resume", empty, timeout=300)
    assert proc.returncode != 0
    lines = [l for l in proc.stderr.splitlines() if l.startswith("flowpm-mtf: error:")]
    assert len(lines) == 1 and "no valid checkpoint" in lines[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr



def test_resume_with_contradicting_config_is_refused(runs, capsys):
    """In this process (placement backend): the check runs before any graph is built."""
    from flowpm_mtf import cli

    d, _ = runs
    from flowpm_mtf.errors import ResumeError

    assert cli.main(["simulate", "--resume", d["bad"], "--steps", "5", "--backend",
                     "placement"]) == ResumeError.exit_code
    err = capsys.readouterr().err
    assert "flowpm-mtf: error: --resume: n_steps=5 contradicts the checkpoint's n_steps=%d" \
        % STEPS in err
    assert not os.path.exists(os.path.join(d["bad"], "snapshot.h5"))
