"""`flowpm-mtf reconstruct` survives interruption: a run stopped by SIGTERM (after periodic
checkpoints, --checkpoint-every) and resumed with --resume ends bit-identical to the
uninterrupted run on the same process grid (every output field, the loss/chi2/prior history),
with the N-body forward model on the hvd backend (eulerian on 2 ranks, lagrangian with the
stored gradient on 1), and (1-rank pass) on a placement grid; a resume with another
configuration, or by another job, is refused with one line and exit code 6 before anything
is computed.

The reference of every comparison is the uninterrupted run with the same options; each case's
uninterrupted and stopped runs are made once per module (fixture ``runs``) and the tests
resume copies of the stopped one. The runs are in-process (`flowpm_mtf.cli.main`; on 2
ranks every rank of this pytest runs the same command); the SIGTERM is sent by this process to itself (rank 0 only: the ranks agree
on the stop) when rank 0 logs the iteration it waits for.
"""
import json
import logging
import os
import shutil
import signal
import tempfile

import h5py
import numpy as np
import pytest

from flowpm_mtf.runs import checkpoint
from flowpm_mtf import cli
from flowpm_mtf.gradients import reconstruct as R
from flowpm_mtf.errors import ResumeError

ITERATIONS = 5
# Periodic checkpoints every CHECKPOINT_EVERY iterations; SIGTERM once rank 0 logged
# iteration STOP_AT: the run stops there after a checkpoint (and one at CHECKPOINT_EVERY).
CHECKPOINT_EVERY = 2
STOP_AT = 3
# 16^3 cells, float64, 5 Adam iterations; the N-body forward model with 1 step (what a
# checkpoint holds, the Adam state and the field, does not depend on the steps).
ARGS = ["reconstruct", "--nc", "16", "--box-size", "100", "--halo", "4", "--seed", "7",
        "--dtype", "float64", "--n-steps", "1", "--a-start", "0.1", "--learning-rate", "0.1",
        "--noise", "0.1", "--iterations", str(ITERATIONS), "--log-every", "1", "--no-plot"]
# (backend, grid, decomposition, forward model, gradient) per world size, the N-body forward
# model on both decompositions: 2 ranks, eulerian with the adjoint gradient (each rank its
# part); 1 rank, lagrangian on hvd with the other gradient methods (R.GRADIENTS: the
# checkpoint holds the same variables whichever gradient computes the step), and one
# placement case (one process writes both parts; the LPT forward model: the N-body one
# builds for ~6 s a run there), whose runs the refusal and other-grid tests share. That case
# resumes from the periodic checkpoint as well (the same saving code as the stop's; not the
# 2-rank case too: its resume from the stop's checkpoint runs every rank's part of that code).
PLACEMENT = ("placement", (1, 2), "lagrangian", "lpt", "adjoint")
CASES = {1: [PLACEMENT] + [("hvd", (1, 1), "lagrangian", "nbody", g) for g in R.GRADIENTS
                           if g != "adjoint"],
         # not on 4 ranks: a resume writes and reads one part file per slice, which 2
         # ranks check; cotangents migrating over the 2x2 grid are checked by
         # tests/test_adjoint.py there (this case took 100 s on 4 oversubscribed ranks)
         2: [("hvd", (2, 1), "eulerian", "nbody", "adjoint")]}
PERIODIC = {PLACEMENT}
# A resume on another grid re-slices the saved variables exactly; what follows differs from
# the original grid only in the order of floating-point sums (FFT pencils, reductions): in
# float64 the trajectories agree to ~1e-15 relative (tests/test_reconstruct.py bounds grid
# dependence by 1e-10 as well); a wrongly placed slice would be off at O(1).
OTHER_GRID_RTOL = 1e-10
HISTORY = ("loss", "chi2", "prior")
FIELDS = ("truth", "reconstruction", "observed") + HISTORY


def _world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def _case_args(case):
    backend, grid, decomposition, forward, gradient = case
    return ["--backend", backend, "--grid", "%dx%d" % grid, "--decomposition",
            decomposition, "--forward", forward, "--gradient", gradient]


def _tmpdir(prefix):
    """One temporary directory for every rank (made by rank 0)."""
    comm = _world()
    return comm.bcast(tempfile.mkdtemp(prefix=prefix) if comm.rank == 0 else None)


class _SigtermAt(logging.Handler):
    """Sends SIGTERM to this process once a log record contains ``text`` (in the run)."""

    def __init__(self, text):
        super().__init__()
        self.text = text
        self.sent = False

    def emit(self, record):
        if not self.sent and self.text in record.getMessage():
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)


def _main(args, sigterm_at=None):
    """``flowpm-mtf`` in this process; with ``sigterm_at``, SIGTERM at that log text."""
    handler = _SigtermAt(sigterm_at) if sigterm_at else None
    logger = logging.getLogger("flowpm_mtf")
    if handler is not None:
        logger.addHandler(handler)
    try:
        code = cli.main(list(args))
    finally:
        if handler is not None:
            logger.removeHandler(handler)
    return code, (handler.sent if handler is not None else None)


def _outputs(out):
    """Datasets of reconstruction.h5, the table's bytes and the summary's history."""
    with h5py.File(os.path.join(out, "reconstruction.h5"), "r") as f:
        res = {k: f[k][...] for k in FIELDS}
    with open(os.path.join(out, "reconstruction.txt"), "rb") as f:
        res["table"] = f.read()
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    res["summary"] = {k: summary[k] for k in HISTORY + ("k", "r", "transfer")}
    res["resumed"] = summary.get("resumed", False)
    return res


def _assert_identical(resumed, ref):
    a, b = _outputs(resumed), _outputs(ref)
    assert a["resumed"] and not b["resumed"]
    for k in FIELDS:   # bit for bit: the same grid runs the same operations
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert len(a["loss"]) == ITERATIONS + 1
    assert a["table"] == b["table"]
    assert a["summary"] == b["summary"]
    assert not os.path.exists(os.path.join(resumed, "checkpoint"))   # dropped at publish


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
    """``runs(case)``: (base, uninterrupted run, run stopped by SIGTERM at STOP_AT after a
    periodic checkpoint), each made once per module; the tests resume copies of the stopped
    run, which stays as it was."""
    made = {}

    def get(case):
        if case not in made:
            base = _tmpdir("recon_resume")
            ref, stopped = os.path.join(base, "ref"), os.path.join(base, "stopped")
            opts = ARGS + _case_args(case)
            assert _main(opts + ["--out", ref])[0] == 0
            code, sent = _main(opts + ["--out", stopped, "--checkpoint-every",
                                       str(CHECKPOINT_EVERY)],
                               sigterm_at="iteration %d/%d:" % (STOP_AT, ITERATIONS))
            assert code == 0                        # stopped after its checkpoint: exit 0
            assert sent or _world().rank != 0       # rank 0 sent it; the others agreed
            made[case] = base, ref, stopped
        return made[case]

    yield get
    _world().barrier()
    if _world().rank == 0:
        for base, _, _ in made.values():
            shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("case", CASES.get(_world().size, []),
                         ids=lambda c: "%s-%dx%d-%s-%s-%s" % (c[0], c[1][0], c[1][1], *c[2:]))
def test_interrupted_then_resumed_equals_uninterrupted(case, runs):
    base, ref, stopped = runs(case)
    root = checkpoint.checkpoint_root(stopped)
    assert sorted(os.listdir(root)) == ["step_%06d" % CHECKPOINT_EVERY, "step_%06d" % STOP_AT]
    assert not os.path.exists(os.path.join(stopped, "manifest.json"))   # nothing published
    with open(os.path.join(root, "step_%06d" % STOP_AT, "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["job"] == "reconstruct" and manifest["step"] == STOP_AT
    assert sorted(manifest["fields"]) == ["adam_m", "adam_step", "adam_v", "linear"]
    assert [len(manifest["loop"]["history"][k]) for k in HISTORY] == [STOP_AT] * 3
    # one part file per slice: every rank wrote its own, no file holds a whole field
    n_slices = case[1][0] * case[1][1]
    assert sorted(manifest["files"]) == ["rank%05d.h5" % p for p in range(n_slices)]
    for info in manifest["files"].values():
        assert info["fields"]["linear"]["shape"] == [16 // case[1][0], 16 // case[1][1], 16]
    run = _copy(stopped, os.path.join(base, "run"))
    assert _main(["reconstruct", "--resume", run, "--no-plot", "--backend", case[0]])[0] == 0
    _assert_identical(run, ref)
    if case in PERIODIC:   # from the periodic checkpoint as well (the newest removed)
        periodic = _copy(stopped, os.path.join(base, "periodic"), drop_step=STOP_AT)
        assert _main(["reconstruct", "--resume", periodic, "--no-plot", "--backend",
                      case[0]])[0] == 0
        _assert_identical(periodic, ref)


# ----------------------------------------------------------------------------- refusals
@pytest.fixture(scope="module")
def stopped(runs):
    """The placement case's run (1x2, lagrangian, LPT forward model), stopped by SIGTERM
    after iteration 3 with a periodic checkpoint after iteration 2."""
    return runs(PLACEMENT)[2]


def _tree(out):
    return sorted((os.path.relpath(os.path.join(r, n), out), os.path.getsize(os.path.join(r, n)))
                  for r, _, names in os.walk(out) for n in names)


def _refused(args, capsys):
    code = cli.main(args)
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.startswith("flowpm-mtf: error:")]
    assert code == ResumeError.exit_code == 6, err[-3000:]
    assert len(lines) == 1, err[-3000:]
    assert "graph built" not in err and "Traceback" not in err
    return lines[0]


@pytest.mark.rank_independent   # the CLI prints the error on rank 0 only
@pytest.mark.parametrize("option, value", [("--learning-rate", "0.2"), ("--noise", "0.2"),
                                           ("--forward", "nbody"), ("--iterations", "6"),
                                           ("--seed", "8"), ("--nc", "32")])
def test_resume_with_another_setting_is_refused(stopped, capsys, option, value):
    before = _tree(stopped)
    line = _refused(["reconstruct", "--resume", stopped, "--backend", "placement",
                     option, value], capsys)
    name = option[2:].replace("-", "_")
    assert "--resume: %s=" % name in line and "contradicts the checkpoint" in line, line
    assert _tree(stopped) == before


@pytest.mark.rank_independent
def test_checkpoint_with_another_recorded_config_is_refused(stopped, capsys, tmp_path):
    """The checkpoint's hash check (before any graph): its state config records another
    learning rate than the configuration the run resumes with."""
    out = str(tmp_path / "run")
    shutil.copytree(stopped, out)
    root = checkpoint.checkpoint_root(out)
    for step in os.listdir(root):
        path = os.path.join(root, step, "manifest.json")
        with open(path) as f:
            manifest = json.load(f)
        manifest["state_config"]["reconstruction"]["learning_rate"] = 0.05
        manifest["config_hash"] = checkpoint.config_hash(manifest["state_config"],
                                                         manifest["stages"])
        with open(path, "w") as f:
            json.dump(manifest, f)
    before = _tree(out)
    line = _refused(["reconstruct", "--resume", out, "--backend", "placement"], capsys)
    assert "config differs: reconstruction.learning_rate 0.05 (checkpoint) != 0.1 (this run)" \
        in line, line
    assert _tree(out) == before


@pytest.mark.rank_independent
@pytest.mark.parametrize("job", ["simulate", "lensing"])
def test_resume_by_another_job_is_refused(stopped, capsys, job):
    before = _tree(stopped)
    line = _refused([job, "--resume", stopped, "--backend", "placement"], capsys)
    assert "'reconstruct'" in line and job in line, line
    assert _tree(stopped) == before


@pytest.mark.skipif(_world().size > 1, reason="placement grids: in the 1-rank pass")
def test_resume_on_another_grid_matches_to_round_off(runs, tmp_path):
    """Written on 1x2, resumed on 2x1 (placement): every rank reads the parts overlapping its
    slices; the result equals the uninterrupted 1x2 run to float64 round-off."""
    _, ref, stopped = runs(PLACEMENT)
    out = str(tmp_path / "run")
    shutil.copytree(stopped, out)
    assert cli.main(["reconstruct", "--resume", out, "--backend", "placement", "--grid", "2x1",
                     "--no-plot"]) == 0
    a, b = _outputs(out), _outputs(ref)
    for k in FIELDS:
        scale = float(np.abs(b[k]).max())
        assert scale > 0, k
        np.testing.assert_allclose(a[k], b[k], rtol=0, atol=OTHER_GRID_RTOL * scale, err_msg=k)
    with open(os.path.join(out, "summary.json")) as f:
        assert json.load(f)["config"]["grid"] == [2, 1]


@pytest.mark.rank_independent
def test_checkpoint_every_counts_iterations(capsys):
    from flowpm_mtf.errors import ConfigError

    assert cli.main(ARGS + _case_args(PLACEMENT) + ["--checkpoint-every", "0", "--out",
                                                    tempfile.mkdtemp()]) == ConfigError.exit_code
    assert "--checkpoint-every takes a number of iterations >= 1" in capsys.readouterr().err


@pytest.mark.skipif(_world().size != 2, reason="every rank of a 2-rank job: the 2-rank pass")
def test_mismatched_resume_on_two_ranks_is_one_line_exit_6(runs, capsys):
    """On 2 ranks (this pass's, in-process): every rank exits 6, one line (rank 0's), nothing
    computed."""
    comm = _world()
    stopped = runs(CASES[2][0])[2]
    before = _tree(stopped)
    code = cli.main(["reconstruct", "--resume", stopped, "--grid", "2x1", "--noise", "0.3"])
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.startswith("flowpm-mtf: error:")]
    assert comm.allgather(code) == [6, 6], err[-3000:]
    assert comm.allgather(len(lines)) == [1, 0], err[-3000:]
    if comm.rank == 0:
        assert "noise=0.3 contradicts the checkpoint's noise=0.1" in lines[0], err[-3000:]
    assert "graph built" not in err and "Traceback" not in err
    assert _tree(stopped) == before
