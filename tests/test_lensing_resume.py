"""`flowpm-mtf lensing` survives interruption: a run stopped by SIGTERM (after periodic
checkpoints, --checkpoint-every) and resumed with --resume ends bit-identical to the
uninterrupted run on the same process grid (convergence maps, every lens plane, the P(k) at
the planes, the C_ell table), on the hvd backend of 2 ranks under mpirun with the signal to
one rank only, and on a placement grid (1-rank pass); the checkpoint holds the
planes as per-rank blocks; the full sky (--sky full, placement grid) likewise (the HEALPix
maps, the shells' counts and P(k), the C_ell table), its checkpoint holding the shell maps
painted so far; a resume with other lensing settings or by another job is
refused with one line (exit 6); and a new run on an OUT holding a checkpoint is told what
is true for that checkpoint (--resume for its own job's, the other job's command, or
--overwrite only).

The reference of every comparison is the uninterrupted run with the same options; each case's
uninterrupted and stopped runs are made once per module (fixture ``runs``) and the tests
resume copies of the stopped one. The in-process runs send SIGTERM from rank 0 to itself
when it logs the step waited for (the ranks agree on the stop at the step boundary).
"""
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile

import h5py
import numpy as np
import pytest

from test_reconstruct_resume import _main, _refused, _tmpdir, _tree, _world

from flowpm_mtf.runs import checkpoint
from flowpm_mtf import cli
from flowpm_mtf.errors import OutputDirError

# 16^3 particles in 256 Mpc/h from a = 0.4, 3 regular steps, 3 planes to z_s = 0.25 on 32^2
# rays: 4 N-body stages (planes at stages 2, 3, 4: painted before the first checkpoint, at
# the stop and after it). The cost of a run is the graph build and the Limber prediction at
# the end (per plane), not the steps.
ARGS = ["lensing", "--nc", "16", "--box-size", "256", "--a-start", "0.4", "--steps", "3",
        "--z-source", "0.25", "--n-planes", "3", "--field-npix", "32", "--field-deg", "5",
        "--dtype", "float64", "--seed", "42", "--no-plot"]
N_STAGES = 4
N_PLANES = 3
CHECKPOINT_EVERY = 2
STOP_AT = 3   # SIGTERM when rank 0 logs step 3: checkpoints after steps 2 and 3
# 1 rank: one placement case (the backend's checkpoint path: one process writes both slices'
# parts; lagrangian, split along y), whose runs the refusal and other-grid tests share; it
# resumes from the periodic checkpoint as well (the same saving code as the stop's). The hvd
# backend's (each rank its part, eulerian, split along x) is the mpirun test's (2 ranks,
# SIGTERM to rank 1; its checkpoint checked as the placement case's): it was also a 2-rank
# case of this test, the same grid, decomposition and comparison in the pytest ranks. Not on
# 4 ranks (~60 s a case there): the per-slice checkpoint files and the re-slicing by id are
# the same code on 2 ranks; lensing on the 2x2 grid is checked by tests/test_lensing.py.
PLACEMENT = ("placement", (1, 2), "lagrangian")
CASES = {1: [PLACEMENT]}
PERIODIC = {PLACEMENT}
KAPPA = ("kappa", "planes", "plane_k", "plane_pk", "theta")
# The full sky (1-rank pass, the placement case's grid and stops): 16^3 in 256 Mpc/h from
# a = 0.4 to z_s = 0.3 in 4 HEALPix shells (nside 16, 3072 pixels), painted at stages 2, 3, 4
# and 5 of 5 (shell 3 before the periodic checkpoint, shell 2 at the stop, 1 and 0 after it).
FULL_ARGS = ["lensing", "--sky", "full", "--nside", "16", "--nc", "16", "--box-size", "256",
             "--a-start", "0.4", "--steps", "3", "--z-source", "0.3", "--n-planes", "4",
             "--halo", "2", "--dtype", "float64", "--seed", "42", "--no-plot"]
FULL_PLANES, NPIX = 4, 12 * 16**2
# per sky: its arguments, N-body stages, kappa.h5's datasets compared, and which of them
# holds the planes (shells), of what shape
Sky = collections.namedtuple("Sky", "name args n_stages datasets planes shape")
FLAT = Sky("flat", ARGS, N_STAGES, KAPPA, "planes", (N_PLANES, 16, 16))
FULL = Sky("full", FULL_ARGS, 5, ("kappa", "gamma1", "gamma2", "shell_counts", "plane_k",
                                  "plane_pk"), "shell_counts", (FULL_PLANES, NPIX))
# Resumed on another grid: the particles are re-sliced by id (positions re-expressed relative
# to the new block origins) and the planes by their index ranges; the rest differs from the
# original grid in the order of float64 sums only (~1e-15 relative). A misplaced block or
# plane would be off at O(1).
OTHER_GRID_RTOL = 1e-10


def _args(case, sky=FLAT):
    backend, grid, decomposition = case
    return sky.args + ["--backend", backend, "--grid", "%dx%d" % grid,
                       "--decomposition", decomposition]


def _outputs(out, sky=FLAT):
    with h5py.File(os.path.join(out, "kappa.h5"), "r") as f:
        res = {k: f[k][...] for k in sky.datasets}
    with open(os.path.join(out, "kappa_power.txt"), "rb") as f:
        res["table"] = f.read()
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    res["summary"] = {k: summary[k] for k in ("stages", "n_stages", "kappa_rms")}
    res["resumed"] = summary.get("resumed", False)
    return res


def _assert_identical(resumed, ref, sky=FLAT):
    a, b = _outputs(resumed, sky), _outputs(ref, sky)
    assert a["resumed"] and not b["resumed"]
    for k in sky.datasets:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert a["kappa"].std() > 0 and a[sky.planes].shape == sky.shape
    assert a["table"] == b["table"] and a["summary"] == b["summary"]
    assert not os.path.exists(os.path.join(resumed, "checkpoint"))


def _copy(src, dst, drop_step=None):
    """Rank 0 copies run directory ``src`` to ``dst`` (without checkpoint ``drop_step``)."""
    comm = _world()
    comm.barrier()
    if comm.rank == 0:
        shutil.copytree(src, dst)
        if drop_step is not None:
            shutil.rmtree(os.path.join(checkpoint.checkpoint_root(dst), "step_%06d" % drop_step))
    comm.barrier()
    return dst


@pytest.fixture(scope="module")
def runs():
    """``runs(case, sky)``: (base, uninterrupted run, run stopped by SIGTERM at STOP_AT after
    a periodic checkpoint), each made once per module; the tests resume copies of the stopped
    run, which stays as it was."""
    made = {}

    def get(case, sky=FLAT):
        if (case, sky.name) not in made:
            base = _tmpdir("lens_resume")
            ref, stopped = os.path.join(base, "ref"), os.path.join(base, "stopped")
            assert _main(_args(case, sky) + ["--out", ref])[0] == 0
            code, sent = _main(_args(case, sky) + ["--out", stopped, "--checkpoint-every",
                                                   str(CHECKPOINT_EVERY)],
                               sigterm_at="step %d/%d " % (STOP_AT, sky.n_stages))
            assert code == 0 and (sent or _world().rank != 0)
            made[case, sky.name] = base, ref, stopped
        return made[case, sky.name]

    yield get
    _world().barrier()
    if _world().rank == 0:
        for base, _, _ in made.values():
            shutil.rmtree(base, ignore_errors=True)


def _check_stopped(stopped, step, grid):
    """Nothing published in ``stopped``; its checkpoint after ``step`` holds the planes as
    one block per slice of ``grid`` and the P(k) of the planes painted so far."""
    assert not os.path.exists(os.path.join(stopped, "manifest.json"))
    root = checkpoint.checkpoint_root(stopped)
    with open(os.path.join(root, "step_%06d" % step, "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["job"] == "lensing" and manifest["step"] == step
    assert manifest["state_config"]["lensing"]["n_planes"] == N_PLANES
    assert manifest["fields"] == sorted(["born_kappa"] + ["plane_%d" % i
                                                         for i in range(N_PLANES)])
    for info in manifest["files"].values():   # each part: its own (x, y) block of a plane
        assert info["fields"]["plane_0"]["shape"] == [16 // grid[0], 16 // grid[1]]
    assert len(manifest["files"]) == grid[0] * grid[1]
    # the P(k) of the planes painted so far (at stages <= step), and only those
    painted = [j for j, _ in manifest["loop"]["job"]["plane_pk"]]
    assert painted and max(painted) <= step


@pytest.mark.parametrize("case", CASES.get(_world().size, []),
                         ids=lambda c: "%s-%dx%d-%s" % (c[0], c[1][0], c[1][1], c[2]))
def test_interrupted_then_resumed_equals_uninterrupted(case, runs):
    base, ref, stopped = runs(case)
    root = checkpoint.checkpoint_root(stopped)
    assert sorted(os.listdir(root)) == ["step_%06d" % CHECKPOINT_EVERY, "step_%06d" % STOP_AT]
    _check_stopped(stopped, STOP_AT, case[1])
    run = _copy(stopped, os.path.join(base, "run"))
    assert _main(["lensing", "--resume", run, "--no-plot", "--backend", case[0]])[0] == 0
    _assert_identical(run, ref)
    if case in PERIODIC:   # from the periodic checkpoint as well (the newest removed)
        periodic = _copy(stopped, os.path.join(base, "periodic"), drop_step=STOP_AT)
        assert _main(["lensing", "--resume", periodic, "--no-plot", "--backend",
                      case[0]])[0] == 0
        _assert_identical(periodic, ref)


@pytest.mark.skipif(_world().size > 1, reason="placement grids: in the 1-rank pass")
def test_full_sky_interrupted_then_resumed_equals_uninterrupted(runs):
    """--sky full: the stop's checkpoint holds the 4 shell maps (replicated: each part the
    whole map), those painted so far equal to the uninterrupted run's and the others empty,
    and the P(k) of those shells; resumed from it, and from the periodic one (the newest
    removed), the run ends bit-identical to the uninterrupted one."""
    base, ref, stopped = runs(PLACEMENT, FULL)
    assert not os.path.exists(os.path.join(stopped, "manifest.json"))
    root = checkpoint.checkpoint_root(stopped)
    assert sorted(os.listdir(root)) == ["step_%06d" % CHECKPOINT_EVERY, "step_%06d" % STOP_AT]
    step = os.path.join(root, "step_%06d" % STOP_AT)
    with open(os.path.join(step, "manifest.json")) as f:
        manifest = json.load(f)
    shells = ["shell_%d" % i for i in range(FULL_PLANES)]
    assert manifest["job"] == "lensing" and manifest["fields"] == shells
    assert [j for j, _ in manifest["loop"]["job"]["plane_pk"]] == [2, 3]
    with h5py.File(os.path.join(ref, "kappa.h5"), "r") as f:
        counts = f["shell_counts"][...]
    assert len(manifest["files"]) == 2
    for name, info in manifest["files"].items():
        assert all(info["fields"][s]["shape"] == [NPIX] for s in shells)
        with h5py.File(os.path.join(step, name), "r") as f:
            saved = np.stack([f["fields"][s][...] for s in shells])
        np.testing.assert_array_equal(saved[2:], counts[2:])   # shells 3, 2: stages 2, 3
        assert counts[:2].sum() > 0 and not saved[:2].any()
    for drop in (None, STOP_AT):
        run = _copy(stopped, os.path.join(base, "run_%s" % drop), drop_step=drop)
        assert _main(["lensing", "--resume", run, "--no-plot", "--backend",
                      "placement"])[0] == 0
        _assert_identical(run, ref, FULL)


# ----------------------------------------------------------------------------- refusals
@pytest.fixture(scope="module")
def stopped(runs):
    """The placement case's run (1x2, lagrangian), stopped by SIGTERM after step 3 with a
    periodic checkpoint after step 2."""
    return runs(PLACEMENT)[2]


@pytest.mark.rank_independent   # the CLI prints the error on rank 0 only
@pytest.mark.parametrize("option, value", [("--n-planes", "4"), ("--field-npix", "16"),
                                           ("--z-source", "0.2"), ("--steps", "4"),
                                           # 16 Mpc/h cells: no fitted alpha, give it
                                           ("--pgd", ("--pgd-alpha0", "0.5", "--pgd-mu", "-0.9"))])
def test_resume_with_other_settings_is_refused(stopped, capsys, option, value):
    before = _tree(stopped)
    line = _refused(["lensing", "--resume", stopped, "--backend", "placement", option]
                    + (list(value) if isinstance(value, tuple) else [value]), capsys)
    assert "contradicts the checkpoint" in line, line
    assert _tree(stopped) == before


@pytest.mark.rank_independent
def test_checkpoint_with_other_recorded_lensing_settings_is_refused(stopped, capsys, tmp_path):
    """The hash check before any graph: the state config records another map size."""
    out = str(tmp_path / "run")
    shutil.copytree(stopped, out)
    root = checkpoint.checkpoint_root(out)
    for step in os.listdir(root):
        path = os.path.join(root, step, "manifest.json")
        with open(path) as f:
            manifest = json.load(f)
        manifest["state_config"]["lensing"]["field_npix"] = 64
        manifest["config_hash"] = checkpoint.config_hash(manifest["state_config"],
                                                         manifest["stages"])
        with open(path, "w") as f:
            json.dump(manifest, f)
    line = _refused(["lensing", "--resume", out, "--backend", "placement"], capsys)
    assert "config differs: lensing.field_npix 64 (checkpoint) != 32 (this run)" in line, line


@pytest.mark.rank_independent
def test_resume_by_simulate_is_refused(stopped, capsys):
    """The issue's case: a lensing checkpoint resumed by simulate."""
    before = _tree(stopped)
    line = _refused(["simulate", "--resume", stopped, "--backend", "placement"], capsys)
    assert line.startswith("flowpm-mtf: error: %s" % os.path.join(stopped, "checkpoint",
                                                                  "step_"))
    assert "was written by job 'lensing', not 'simulate'" in line
    assert _tree(stopped) == before


@pytest.mark.skipif(_world().size > 1, reason="placement grids: in the 1-rank pass")
def test_resume_on_another_grid_matches_to_round_off(runs, tmp_path):
    """Written on 1x2, resumed on 2x1 (placement): equal to the uninterrupted 1x2 run to
    float64 round-off."""
    _, ref, stopped = runs(PLACEMENT)
    out = str(tmp_path / "run")
    shutil.copytree(stopped, out)
    assert cli.main(["lensing", "--resume", out, "--backend", "placement", "--grid", "2x1",
                     "--no-plot"]) == 0
    a, b = _outputs(out), _outputs(ref)
    for k in KAPPA:
        scale = float(np.abs(b[k]).max())
        assert scale > 0, k
        np.testing.assert_allclose(a[k], b[k], rtol=0, atol=OTHER_GRID_RTOL * scale, err_msg=k)
    assert a["table"] != b"" and a["summary"]["stages"] == b["summary"]["stages"]
    with open(os.path.join(out, "summary.json")) as f:
        assert json.load(f)["config"]["grid"] == [2, 1]


def _new_run_refused(job, out, capsys):
    args = ARGS if job == "lensing" else [job, "--nc", "16", "--no-plot"]
    assert cli.main(args[:1] + ["--out", out, "--backend", "placement", "--grid", "1x1"]
                    + args[1:]) == OutputDirError.exit_code
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.startswith("flowpm-mtf: error:")]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


@pytest.mark.rank_independent
def test_new_run_on_a_checkpointed_out_is_told_what_is_true(stopped, capsys, tmp_path):
    """A new run on OUT holding a checkpoint: lensing may resume its own (that the command it
    is told resumes this checkpoint is test_interrupted_then_resumed_equals_uninterrupted's
    placement case); simulate is told lensing's command; an old checkpoint (format 1, e.g. of
    a lensing run of an older flowpm-mtf, which could not resume) gets --overwrite only."""
    line = _new_run_refused("lensing", stopped, capsys)
    assert "pass --resume %s to continue it or --overwrite" % stopped in line, line
    line = _new_run_refused("simulate", stopped, capsys)
    assert "'lensing' run: continue it with 'flowpm-mtf lensing --resume %s'" % stopped in line
    assert "pass --resume" not in line
    old = str(tmp_path / "old")
    shutil.copytree(stopped, old)
    root = checkpoint.checkpoint_root(old)
    for step in os.listdir(root):
        path = os.path.join(root, step, "manifest.json")
        with open(path) as f:
            manifest = json.load(f)
        for k in ("job", "config_hash", "state_config", "stages", "fields"):
            manifest.pop(k)
        manifest["format"] = "flowpm_mtf.runs.checkpoint/1"
        with open(path, "w") as f:
            json.dump(manifest, f)
    line = _new_run_refused("lensing", old, capsys)
    assert "older flowpm-mtf and cannot be resumed; pass --overwrite" in line, line
    assert "--resume" not in line


@pytest.mark.single_process
def test_sigterm_to_one_rank_under_mpirun_then_resume():
    """mpirun -np 2, SIGTERM to rank 1 only: both ranks checkpoint and exit 0 with the resume
    command; `--resume` ends bit-identical to the uninterrupted run on the same grid (2x1,
    eulerian: the defaults on 2 ranks). That run is the command in one process on the
    placement backend (no second MPI job): with two slices every cross-slice sum has the same
    two terms whichever backend adds them, so it equals the hvd run bit for bit (a command,
    not this process: the command's allocator settings change TensorFlow's kernels)."""
    from test_cli import _mpirun
    from test_mpi_jobs import clean_env
    from test_restart import _run_and_sigterm

    base = tempfile.mkdtemp(prefix="lens_mpirun")
    ref, run = os.path.join(base, "ref"), os.path.join(base, "run")
    rc, sent, log = _run_and_sigterm(2, run, rank=1, args=ARGS, after="step 2/")
    assert sent and rc == 0, log[-3000:]
    assert "continue with: flowpm-mtf lensing --resume %s" % run in log
    assert "flowpm-mtf: error" not in log
    steps = sorted(os.listdir(checkpoint.checkpoint_root(run)))
    assert len(steps) == 1, steps   # no --checkpoint-every: the stop's only
    _check_stopped(run, int(steps[0][5:]), (2, 1))
    proc = _mpirun(2, "lensing", "--resume", run, "--no-plot", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from" in proc.stderr
    with open(os.path.join(run, "summary.json")) as f:
        config = json.load(f)["config"]
    assert config["grid"] == [2, 1] and config["decomposition"] == "eulerian"
    proc = subprocess.run([sys.executable, "-m", "flowpm_mtf.cli", *ARGS, "--backend",
                           "placement", "--grid", "2x1", "--decomposition", "eulerian",
                           "--out", ref], capture_output=True, text=True, timeout=600,
                          env=clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_identical(run, ref)
    shutil.rmtree(base, ignore_errors=True)
