"""End to end (particles reordered by column every 7 steps, `--sort-every`):
`flowpm-mtf simulate` snapshots do not depend on the process grid; checkpoint,
SIGTERM and `--resume` (same grid bit-identical, other grid to round-off, torn checkpoints
skipped, bad input refused on every rank); the outputs written before the checkpoint are
published by the resumed run; a checkpoint of another job, config or stage list, or of an
older flowpm-mtf, is refused. (lensing and reconstruct: tests/test_lensing_resume.py,
tests/test_reconstruct_resume.py.)"""
import json
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

# Steps cost ~15 ms of CPU per rank here: the 48 after the one the SIGTERM waits for are a
# wide window for it. The graph (its build most of a job's cost after the start-up) grows
# with the steps: no more of them than that window needs.
STEPS = 50
# A snapshot at stage 1 (a = 0.11 lies between the regular stages 0.1 and 0.118) and a P(k)
# after every step: outputs of the time loop written before the SIGTERM (after step >= 4).
SNAPSHOT_A = 0.11
ARGS = ["simulate", "--nc", "16", "--box-size", "100", "--steps", str(STEPS), "--halo", "4",
        "--seed", "7", "--dtype", "float64", "--no-plot", "--snapshots", str(SNAPSHOT_A),
        "--power-steps", "--sort-every", "7"]   # particles reordered by column every 7 steps
N_STEPS = STEPS + 1  # the snapshot adds a stage
BOX = 100.0
# float64 everywhere; another process grid changes only the order of floating-point sums
# (FFT/all-reduce partitioning) and, on resume, re-expresses block-local positions relative
# to another block origin: round-off of positions ~1e2 Mpc/h.
GRID_POS_ATOL = 1e-8      # [Mpc/h]
GRID_VEL_RTOL = 1e-8      # relative to the rms velocity
GRID_DENSITY_ATOL = 1e-10
# P(k) of the same particles on another grid: only the order of the sums differs.
GRID_PK_RTOL = 1e-10
SIGNAL_AFTER = "step 3/%d" % N_STEPS


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


def _run_and_sigterm(np_, out, rank, args=None, after=SIGNAL_AFTER, env=None):
    """Run on ``np_`` ranks; send SIGTERM to ``rank`` only (a list: to each of them), once
    rank 0 logged ``after``."""
    cmd = [shutil.which("mpirun"), "--oversubscribe", "-np", str(np_)]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    args = [*ARGS, "--checkpoint-every", "20"] if args is None else args
    cmd += [sys.executable, "-m", "flowpm_mtf.cli", *args, "--out", out]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(clean_env(), **(env or {})))
    pids = [_rank_pid(proc.pid, r) for r in (rank if isinstance(rank, list) else [rank])]
    lines, sent = [], False
    for line in proc.stdout:
        lines.append(line)
        if not sent and after in line:
            for pid in pids:
                os.kill(pid, signal.SIGTERM)
            sent = True
    rc = proc.wait(timeout=600)
    return rc, sent, "".join(lines)


def _in_process(*args):
    """``flowpm-mtf ARGS`` in this process (placement backend: no launch, no TensorFlow
    import of its own); returns its exit code."""
    from flowpm_mtf import cli

    return cli.main(list(args))


@pytest.fixture(scope="module")
def runs():
    """Every job of the module, run once; the tests inspect them.

    r11: the reference in this process (placement, grid 1x1); r21: the same job on the grid
    2x1 with a checkpoint every 20 steps, the command in one process on the placement
    backend (no MPI job: with two slices every cross-slice sum has the same two terms
    whichever backend adds them, so it equals the 2-rank hvd run bit for bit; a command, not
    this process: the command's allocator settings change TensorFlow's kernels); sig: that
    job on 2 ranks (hvd) stopped by SIGTERM to rank 1 after step 3; resume21: sig with a torn
    newer checkpoint resumed on 2 ranks, every rank held after the publish and sent SIGTERM
    there (cli.PAUSE_ENV); resume12 (resumed by its test, in this process), bad, foreign,
    old, moved: copies of sig.
    """
    from flowpm_mtf import cli

    base = tempfile.mkdtemp(prefix="restart")
    d = {k: os.path.join(base, k) for k in ("r11", "r21", "sig", "resume21", "resume12",
                                              "bad", "foreign", "old", "moved")}
    assert _in_process(*ARGS, "--backend", "placement", "--grid", "1x1", "--out",
                       d["r11"]) == 0
    proc = subprocess.run([sys.executable, "-m", "flowpm_mtf.cli", *ARGS, "--backend",
                           "placement", "--grid", "2x1", "--out", d["r21"], "--checkpoint-every",
                           "20"], capture_output=True, text=True, timeout=600, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    sig = _run_and_sigterm(2, d["sig"], rank=1)
    for k in ("resume21", "resume12", "bad", "foreign", "old", "moved"):
        shutil.copytree(d["sig"], d[k])
    # resume on the same grid past a torn newer checkpoint (every rank finds it torn);
    # SIGTERM to every rank while they wait after the publish
    newest = _tear_newer_checkpoint(d["resume21"])
    resume21 = _run_and_sigterm(2, d["resume21"], [0, 1], args=[*ARGS, "--resume",
                                                                 d["resume21"]],
                                after="pausing", env={cli.PAUSE_ENV: "5"})
    yield d, {"sig": sig, "resume21": (*resume21, newest)}
    shutil.rmtree(base, ignore_errors=True)


def _tear_newer_checkpoint(out):
    """Add a torn checkpoint (rank 1's file missing) newer than the newest of ``out``, and
    a staging directory; returns the newest complete one's name."""
    root = os.path.join(out, "checkpoint")
    newest = sorted(os.listdir(root))[-1]
    torn = os.path.join(root, "step_%06d" % (STEPS - 1))
    shutil.copytree(os.path.join(root, newest), torn)
    os.remove(os.path.join(torn, "rank00001.h5"))
    os.makedirs(os.path.join(root, ".tmp-step_%06d" % (STEPS - 1)), exist_ok=True)
    return newest


def _assert_close(a, b):
    dp = np.abs(a["position"] - b["position"])
    dp = np.minimum(dp, BOX - dp)  # periodic
    assert dp.max() < GRID_POS_ATOL
    vrms = np.sqrt(np.mean(b["velocity"] ** 2))
    assert np.abs(a["velocity"] - b["velocity"]).max() < GRID_VEL_RTOL * vrms
    np.testing.assert_allclose(a["density"], b["density"], atol=GRID_DENSITY_ATOL)
    np.testing.assert_array_equal(a["id"], b["id"])


def test_snapshot_does_not_depend_on_the_grid(runs):
    """The grid 2x1, on 2 ranks (hvd: the resumed run, bit-identical to the uninterrupted one
    by test_resume_same_grid_is_bit_identical) and on the placement backend, against one
    block (grid 1x1); the grid 1x2: the resume on it,
    test_resume_on_another_grid_skipping_a_torn_checkpoint."""
    d, _ = runs
    ref = _snap(d["r11"])
    assert ref["position"].shape == (16**3, 3) and ref["position"].dtype == np.float64
    np.testing.assert_array_equal(ref["id"], np.arange(16**3))
    assert ref["velocity"].std() > 0 and ref["density"].std() > 0.1
    for run in ("resume21", "r21"):
        _assert_close(_snap(d[run]), ref)
        assert len(os.listdir(os.path.join(d[run], "snapshot.parts"))) == 2


def test_sigterm_checkpoints_and_exits_zero_on_every_rank(runs):
    d, jobs = runs
    rc, sent, log = jobs["sig"]
    assert sent, "the run ended before %r was logged" % SIGNAL_AFTER
    assert rc == 0, log[-4000:]
    assert "received SIGTERM" in log
    assert "flowpm-mtf simulate --resume %s" % d["sig"] in log
    assert not os.path.exists(os.path.join(d["sig"], "snapshot.h5"))
    steps = sorted(os.listdir(os.path.join(d["sig"], "checkpoint")))
    assert steps and all(s.startswith("step_") for s in steps)
    assert int(steps[-1][5:]) < STEPS
    # the outputs of the stages before it are in the checkpoint (staging is gone)
    newest = os.path.join(d["sig"], "checkpoint", steps[-1])
    with open(os.path.join(newest, "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["job"] == "simulate" and len(manifest["stages"]) == N_STEPS + 1
    outputs = set(manifest["outputs"])
    assert _snapshot_name(SNAPSHOT_A) in outputs
    assert len([o for o in outputs if o.startswith("power_a")]) == manifest["step"]
    assert not os.path.exists(os.path.join(d["sig"], ".staging"))


def test_sigterm_after_the_publish_exits_zero_on_every_rank(runs):
    """The issue's case: SIGTERM to every rank after the last step and the publish, while
    the ranks are on their way out (held there by the test hook; here the resumed run of
    test_resume_same_grid_is_bit_identical): the complete run stays and every rank exits 0
    (it was "rank 1 exited on signal 15", mpirun exit 143: the handler was restored to the
    default action when the run returned)."""
    from flowpm_mtf.runs import rundir

    d, jobs = runs
    rc, sent, log, _ = jobs["resume21"]
    assert sent, log[-4000:]
    assert rc == 0 and "signal 15" not in log, log[-4000:]
    out = d["resume21"]
    assert rundir.verify_manifest(out) == [] and not os.path.exists(
        os.path.join(out, "checkpoint"))


def _snapshot_name(a):
    return "snapshot_a%.4f.h5" % a


def _published(d):
    """Path -> digest of the files of the complete run in ``d`` (its manifest)."""
    from flowpm_mtf.runs import rundir

    assert rundir.verify_manifest(d) == []
    return {f["path"]: f["blake3"] for f in rundir.read_manifest(d)["files"]}


def _datasets(path):
    with h5py.File(path, "r") as f:
        return {k: f[k][...] for k in f}


# Files that differ between any two runs: timings; HDF5 files hold a few bytes that change
# from one write to the next (compared by their datasets instead).
RUN_SPECIFIC = ("summary.json",)


def _assert_same_outputs(resumed, ref, exact_upto=None):
    """``resumed`` published the same files as ``ref``; text outputs byte-identical (up to
    stage ``exact_upto`` when resumed on another grid, later ones to GRID_PK_RTOL), HDF5
    datasets of the snapshot written before the checkpoint equal.

    On another grid the distributed files written after the resume have as many parts as
    that grid has ranks: only the logical files (outside ``*.parts/``) are compared then.
    """
    a, b = _published(resumed), _published(ref)
    if exact_upto is None:
        assert sorted(a) == sorted(b)
    else:
        assert sorted(p for p in a if os.sep not in p) == sorted(p for p in b if os.sep not in p)
        parts = _snapshot_name(SNAPSHOT_A)[:-3] + ".parts" + os.sep
        assert sorted(p for p in a if p.startswith(parts)) == \
            sorted(p for p in b if p.startswith(parts))   # restored as written
    for path in sorted(a):
        if path in RUN_SPECIFIC or path.startswith("snapshot") or os.sep in path:
            continue
        if exact_upto is None or (path.startswith("power_a") and
                                  float(path[7:13]) <= exact_upto * (1 + 1e-9)):
            assert a[path] == b[path], path
        else:
            np.testing.assert_allclose(np.loadtxt(os.path.join(resumed, path)),
                                       np.loadtxt(os.path.join(ref, path)), rtol=GRID_PK_RTOL)
    x, y = _datasets(os.path.join(resumed, _snapshot_name(SNAPSHOT_A))), \
        _datasets(os.path.join(ref, _snapshot_name(SNAPSHOT_A)))
    assert sorted(x) == sorted(y)
    for k in x:   # written before the checkpoint on the reference's grid: identical
        np.testing.assert_array_equal(x[k], y[k])


def test_resume_same_grid_is_bit_identical(runs):
    """On 2 ranks, past a torn newer checkpoint: equal to the uninterrupted run on the grid
    2x1 (r21) bit for bit."""
    d, jobs = runs
    log, newest = jobs["resume21"][2:]
    root = os.path.join(d["resume21"], "checkpoint")
    assert "ignoring incomplete checkpoint" in log, log[-4000:]
    assert "resuming from %s" % os.path.join(root, newest) in log, log[-4000:]
    a, b = _snap(d["resume21"]), _snap(d["r21"])
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert np.array_equal(np.loadtxt(os.path.join(d["resume21"], "power.txt")),
                          np.loadtxt(os.path.join(d["r21"], "power.txt")))
    # every output of the uninterrupted run, those written before the checkpoint included
    _assert_same_outputs(d["resume21"], d["r21"])
    assert len([p for p in _published(d["resume21"]) if p.startswith("power_a")]) == N_STEPS
    with open(os.path.join(d["resume21"], "summary.json")) as f:
        resumed = json.load(f)
    with open(os.path.join(d["r21"], "summary.json")) as f:
        ref = json.load(f)
    assert resumed["resumed"] and resumed["migration"] == ref["migration"]


def test_resume_on_another_grid_skipping_a_torn_checkpoint(runs, capsys):
    """Resumed on the grid 1x2 (every new block takes half of each old one) in this process
    (placement backend: no third MPI job). The re-slicing by id of a checkpoint written by
    other ranks under MPI: tests/test_checkpoint.py (4 ranks, another grid) and the killed
    node's resume in tests/test_sim_cluster.py (2x2 -> 2x1); skipping a torn checkpoint
    under MPI: test_resume_same_grid_is_bit_identical."""
    from flowpm_mtf import cli

    d, _ = runs
    newest = _tear_newer_checkpoint(d["resume12"])
    root = os.path.join(d["resume12"], "checkpoint")
    with open(os.path.join(root, newest, "manifest.json")) as f:
        a_saved = json.load(f)["a"]
    capsys.readouterr()
    assert cli.main([*ARGS, "--resume", d["resume12"], "--grid", "1x2", "--backend",
                     "placement"]) == 0
    err = capsys.readouterr().err
    assert "ignoring incomplete checkpoint" in err
    assert "resuming from %s" % os.path.join(root, newest) in err
    _assert_close(_snap(d["resume12"]), _snap(d["r21"]))
    _assert_same_outputs(d["resume12"], d["r21"], exact_upto=a_saved)
    # the snapshot written after the resume: on the grid 1x2, one part per block
    with h5py.File(os.path.join(d["resume12"], "snapshot.h5"), "r") as f:
        assert json.loads(f.attrs["config"])["grid"] == [1, 2]
    assert len(os.listdir(os.path.join(d["resume12"], "snapshot.parts"))) == 2


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


def _edit_manifests(out, edit):
    for step in os.listdir(os.path.join(out, "checkpoint")):
        path = os.path.join(out, "checkpoint", step, "manifest.json")
        with open(path) as f:
            manifest = json.load(f)
        edit(manifest)
        with open(path, "w") as f:
            json.dump(manifest, f)


def _tree_state(out):
    return sorted((os.path.relpath(os.path.join(r, n), out), os.path.getsize(os.path.join(r, n)))
                  for r, _, names in os.walk(out) for n in names)


def test_resume_of_another_jobs_checkpoint_is_refused_on_every_rank(runs):
    """The issue's case: a lensing checkpoint resumed by simulate. Refused before any graph."""
    d, _ = runs
    _edit_manifests(d["foreign"], lambda m: m.update(job="lensing"))
    before = _tree_state(d["foreign"])
    proc = _mpirun(2, "simulate", "--resume", d["foreign"], timeout=300)
    assert proc.returncode == 6, proc.stderr[-3000:]   # ResumeError
    lines = [l for l in proc.stderr.splitlines() if l.startswith("flowpm-mtf: error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "was written by job 'lensing', not 'simulate'" in lines[0]
    assert lines[0].startswith("flowpm-mtf: error: %s" % os.path.join(d["foreign"],
                                                                      "checkpoint", "step_"))
    assert "graph built" not in proc.stderr and "Traceback" not in proc.stderr
    assert _tree_state(d["foreign"]) == before   # nothing touched


@pytest.mark.parametrize("case", ["old", "moved"])
def test_old_checkpoint_and_moved_stage_are_refused(runs, capsys, case):
    """In this process (placement backend): a checkpoint of format 1 (no job, hash or outputs
    recorded) and one whose saved scale factor is not this run's stage at its step."""
    from flowpm_mtf import cli
    from flowpm_mtf.errors import ResumeError

    d, _ = runs
    if case == "old":
        _edit_manifests(d[case], lambda m: [m.pop(k) for k in ("job", "config_hash",
                                                               "state_config", "stages")]
                        and m.update(format="flowpm_mtf.runs.checkpoint/1"))
        want = "was written by an older flowpm-mtf (flowpm_mtf.runs.checkpoint/1)"
    else:
        _edit_manifests(d[case], lambda m: m.update(a=m["a"] * 1.25))
        want = "; the stage lists differ"
    before = _tree_state(d[case])
    assert cli.main(["simulate", "--resume", d[case], "--backend", "placement"]) == \
        ResumeError.exit_code
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.startswith("flowpm-mtf: error:")]
    assert len(lines) == 1 and want in lines[0], err[-3000:]
    assert "graph built" not in err
    assert _tree_state(d[case]) == before
