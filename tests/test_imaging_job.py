"""`flowpm-mtf imaging` (flowpm_mtf/jobs/imaging.py): on the grid of this world's ranks
(hvd backend, every rank runs the command in-process) the metrics of every method equal
those of the same job in one process (a 1x1 placement mesh); its files are there (one
HDF5 file written by every rank, the metrics table, the figure, summary.json); bad input
is one line before anything is computed; a run stopped by SIGTERM and resumed ends
bit-identical to the uninterrupted run.
"""
import json
import logging
import os
import re
import signal
import tempfile

import h5py
import numpy as np
import pytest

import fpm_harness as H
from flowpm_mtf.runs import checkpoint
from flowpm_mtf import cli, jobs
from flowpm_mtf.errors import ConfigError
from flowpm_mtf.jobs import options, runner
from world_share import on_rank0

# float64; the same operations on another grid differ in the order of the sums (FFT
# pencils, reductions, convolution halos): ~1e-14 relative in the metrics.
METRIC_RTOL = 1e-9
TRAIN_STEPS = 3
ARGS = ["imaging", "--nc", "16", "--dtype", "float64", "--tv-iterations", "4",
        "--train-steps", str(TRAIN_STEPS), "--blocks", "2", "--channels", "4",
        "--learning-rate", "0.01", "--log-every", "1", "--seed", "3"]
# the brain with coils: the volume's slabs read by each rank, SENSE, stepped TV-SENSE, the
# network trained on the augmented training part (float64, tiny)
BRAIN_ARGS = ["imaging", "--volume", "mni152", "--coils", "2", "--nc", "16", "--dtype",
              "float64", "--tv-iterations", "3", "--train-steps", "2", "--blocks", "1",
              "--channels", "2", "--log-every", "1"]
FILES = ("imaging.h5", "metrics.md", "imaging.png", "summary.json", "manifest.json")
VOLUMES = ("truth", "zero_filled", "tv", "unrolled")


def _world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def _tmpdir(prefix):
    comm = _world()
    return comm.bcast(tempfile.mkdtemp(prefix=prefix) if comm.rank == 0 else None)


def _grid_args():
    return ["--mesh-shape", "%dx%d" % H.HVD_GRIDS[H.SIZE][-1]]


class _SigtermAt(logging.Handler):
    """Sends SIGTERM to this process once a log record contains ``text``."""

    def __init__(self, text):
        super().__init__()
        self.text, self.sent = text, False

    def emit(self, record):
        if not self.sent and self.text in record.getMessage():
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)


def _main(args, sigterm_at=None):
    handler = _SigtermAt(sigterm_at) if sigterm_at else None
    logger = logging.getLogger("flowpm_mtf")
    if handler is not None:
        logger.addHandler(handler)
    try:
        return cli.main(list(args))
    finally:
        if handler is not None:
            logger.removeHandler(handler)


@pytest.fixture(scope="module")
def uninterrupted():
    out = os.path.join(_tmpdir("imaging_job"), "ref")
    assert _main(ARGS + _grid_args() + ["--out", out]) == 0
    return out


def _summary(out):
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def test_metrics_equal_one_process_and_files(uninterrupted):
    job = jobs.get("imaging")
    args = cli.build_parser(jobs.all_jobs()).parse_args(ARGS + ["--backend", "placement"])
    configs = options.make_configs(job, args, None, n_ranks=1, backend="placement")
    # one process's run: the same numbers on every rank and in every pass, computed once
    # (world_share)
    ref = on_rank0(lambda: runner.run(job, configs, H.backend("single", configs["config"]),
                                      run_dir=None, plot=False),
                   key=("test_imaging_job.one_process", ARGS))
    got = _summary(uninterrupted)
    assert got["config"]["grid"] == list(H.HVD_GRIDS[H.SIZE][-1])
    assert set(got["psnr_db"]) == {"zero-filled", "tv", "unrolled"}
    for key in ("psnr_db", "ssim"):
        for m, v in ref[key].items():
            assert got[key][m] == pytest.approx(v, rel=METRIC_RTOL), (key, m)
    np.testing.assert_allclose(got["train_loss"], ref["train_loss"], rtol=METRIC_RTOL)
    assert len(got["train_loss"]) == TRAIN_STEPS
    assert len(got["peak_memory_mb_per_rank"]) == H.SIZE
    for name in FILES:
        assert os.path.exists(os.path.join(uninterrupted, name)), name
    with h5py.File(os.path.join(uninterrupted, "imaging.h5"), "r") as f:
        for n in VOLUMES:
            assert f[n].shape == (16, 16, 16) and np.all(np.isfinite(f[n][...])), n
        truth = f["truth"][...]
    from mri_mtf import phantom

    np.testing.assert_array_equal(truth, phantom.phantom_numpy(16))
    with open(os.path.join(uninterrupted, "metrics.md")) as f:
        table = f.read()
    for m in ("zero-filled", "tv", "unrolled"):
        assert "| %s | %.2f |" % (m, got["psnr_db"][m]) in table


# the brain's grid: on 2 ranks the coils over both (--coil-split: the coil sums all-reduced,
# the network trained through them; x or y split are the phantom's grids above); on 4 ranks
# (not in the suite's 4-rank pass: run by hand) x over 2 ranks and the coils over 2; on 1
# rank the world's grid
BRAIN_GRID = {2: ["--mesh-shape", "1x1", "--coil-split", "2"],
              4: ["--mesh-shape", "2x1", "--coil-split", "2"]}


def test_brain_with_coils_equals_one_process():
    """--volume mni152 --coils 2 with the coils split over the ranks (BRAIN_GRID): every
    metric (brain mask and held-out part) and the training losses equal the
    one-process run; the truth is the resampled, normalised template."""
    pytest.importorskip("nibabel")   # nibabel and nilearn: not in the tf2.12 stack
    pytest.importorskip("nilearn")
    out = os.path.join(_tmpdir("imaging_brain"), "run")
    assert _main(BRAIN_ARGS + BRAIN_GRID.get(H.SIZE, _grid_args()) + ["--out", out]) == 0
    job = jobs.get("imaging")
    args = cli.build_parser(jobs.all_jobs()).parse_args(BRAIN_ARGS + ["--backend", "placement"])
    configs = options.make_configs(job, args, None, n_ranks=1, backend="placement")
    # one process's run: the same numbers on every rank and in every pass, computed once
    # (world_share)
    ref = on_rank0(lambda: runner.run(job, configs, H.backend("single", configs["config"]),
                                      run_dir=None, plot=False),
                   key=("test_imaging_job.one_process", BRAIN_ARGS))
    got = _summary(out)
    for key in ("psnr_db", "ssim", "psnr_db_heldout", "ssim_heldout"):
        assert set(got[key]) == {"zero-filled", "tv", "unrolled"}
        for m, v in ref[key].items():
            assert got[key][m] == pytest.approx(v, rel=METRIC_RTOL), (key, m)
    np.testing.assert_allclose(got["train_loss"], ref["train_loss"], rtol=METRIC_RTOL)
    from mri_mtf import volume

    with h5py.File(os.path.join(out, "imaging.h5"), "r") as f:
        np.testing.assert_allclose(f["truth"][...], volume.resample_numpy("mni152", (16,) * 3),
                                   rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("argv, pattern", [
    (["--nc", "18", "--mesh-shape", "4x1"], r"grid \(4, 1\) does not divide the volume"),
    (["--nc", "16", "--acceleration", "1000"], r"acceleration R=1000.0 must be in \[1, 256\]"),
    (["--nc", "16", "--method", "tv,wavelet"], r"unknown method 'wavelet'"),
    (["--nc", "6"], r"SSIM needs at least 7 voxels per axis"),
    (["--nc", "16", "--kernel-size", "4"], r"kernel_size must be odd"),
    (["--nc", "16", "--coils", "0"], r"coils must be an integer >= 1, got 0"),
    (["--nc", "16", "--tv-norm", "anisotropic"], r"--tv-norm anisotropic needs --coils >= 2"),
    (["--nc", "16", "--coils", "4", "--coil-split", "3"], r"coil_split 3 does not divide coils 4"),
    (["--nc", "16", "--coils", "2", "--coil-split", "2", "{grid}"],
     r"the process grid \(\d, \d, 2\) needs \d ranks but the job has \d; launch with -np"),
    (["--nc", "16", "--volume", "{out}/missing.nii.gz"],
     r"volume file .*missing.nii.gz does not exist"),
    (["--nc", "16", "--volume", "{out}/plane.nii"], r"must be a 3D NIfTI, got shape \(20, 20\)"),
    (["--nc", "16", "--volume", "{out}/small.nii"], r"smaller than --nc 16x16x16"),
    (["--nc", "160", "--volume", "mni152"],
     r"\(145x181x155 voxels in the brain's box\) is smaller"),
])
def test_bad_input_is_one_line_before_any_compute(argv, pattern, capsys, tmp_path):
    out = _world().bcast(str(tmp_path) if _world().rank == 0 else None)
    if any("{out}/" in a and a.endswith(".nii") for a in argv) or "mni152" in argv:
        pytest.importorskip("nibabel")   # nibabel and nilearn: not in the tf2.12 stack
        pytest.importorskip("nilearn")
    if _world().rank == 0 and any(a.endswith(".nii") for a in argv):
        import nibabel as nib

        nib.save(nib.Nifti1Image(np.zeros((20, 20), np.float32), np.eye(4)),
                 os.path.join(out, "plane.nii"))
        nib.save(nib.Nifti1Image(np.zeros((20, 20, 12), np.float32), np.eye(4)),
                 os.path.join(out, "small.nii"))
    _world().barrier()
    grid = [] if "{grid}" in argv or "--mesh-shape" in argv else _grid_args()
    argv = [b for a in argv for b in ([a.format(out=out)] if a != "{grid}" else _grid_args())]
    code = _main(["imaging"] + argv + grid + ["--out", os.path.join(out, "o")])
    err = capsys.readouterr().err.splitlines()
    assert code == ConfigError.exit_code
    if _world().rank == 0:
        lines = [ln for ln in err if ln.startswith("flowpm-mtf: error: ")]
        assert len(lines) == 1, err
        assert re.search(pattern, lines[0]), lines[0]
    assert not os.path.exists(os.path.join(out, "o", "imaging.h5"))


# on 2 ranks only: a checkpoint part per slice, written and read by each rank (on 1 rank the
# same code with one part; 50 s on 4 ranks); the 2x2 split of the image is checked by
# test_metrics_equal_one_process_and_files
@pytest.mark.skipif(H.SIZE != 2, reason="per-slice checkpoints: checked on 2 ranks")
def test_interrupted_then_resumed_equals_uninterrupted(uninterrupted):
    comm = _world()
    run = os.path.join(_tmpdir("imaging_resume"), "run")
    opts = ARGS + _grid_args()
    code = _main(opts + ["--out", run, "--checkpoint-every", "1"],
                 sigterm_at="training step 2/%d:" % TRAIN_STEPS)
    assert code == 0
    root = checkpoint.checkpoint_root(run)
    assert sorted(os.listdir(root)) == ["step_%06d" % 1, "step_%06d" % 2]
    assert not os.path.exists(os.path.join(run, "manifest.json"))   # nothing published
    assert _main(["imaging", "--resume", run]) == 0
    comm.Barrier()
    a, b = _summary(run), _summary(uninterrupted)
    assert a.get("resumed") and not b.get("resumed")
    for key in ("psnr_db", "ssim", "train_loss"):
        assert a[key] == b[key], key
    with h5py.File(os.path.join(run, "imaging.h5"), "r") as fa, \
            h5py.File(os.path.join(uninterrupted, "imaging.h5"), "r") as fb:
        for n in VOLUMES + ("train_loss",):
            np.testing.assert_array_equal(fa[n][...], fb[n][...], err_msg=n)
