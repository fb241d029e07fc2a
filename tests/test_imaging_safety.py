"""`flowpm-mtf imaging` is as safe as the other jobs (issue 61 item 6).

In this process (cheap, no graph): every integer option has bounds and a filter must fit
the volume and the halo (one ``ValueError`` line from the configs, exit 2 through the
command line); the memory model of :mod:`mri_mtf.memory` refuses the issue's runs with a
configuration that fits, and stays within 5 % under and 20 % over the peak RSS measured
on runs of 32^3 to 128^3, 8 blocks, 32 and 1024 channels, a 7^3 filter; ``--train-steps
0`` is labelled untrained.
All in the 1-rank pass. In fresh processes: the memory refusal on 2 ranks (exit 4 on every
rank, one line, nothing created) and SIGTERM to one rank during the TV iterations (both
stop at the next iteration with the checkpoint of the training's step 0, exit 0).
"""
import os
import re
import signal
import time
import types

import pytest

from flowpm_mtf import cli, jobs
from flowpm_mtf.backend import SerialComm
from flowpm_mtf.errors import ConfigError, MemoryBudgetError
from flowpm_mtf.jobs import options
from flowpm_mtf.runs import checkpoint, preflight
from mri_mtf import memory, unrolled
from mri_mtf.config import ImagingConfig
from mri_mtf.recon import TVConfig
from mri_mtf.unrolled import UnrolledConfig
from test_restart import _rank_pid
from test_safety_cli import JOB_DEADLINE_S, assert_one_error_line, flowpm

# The in-process checks need no MPI world and the launches start their own: the 1-rank
# pass only (the other passes would repeat the same checks).
pytestmark = pytest.mark.single_process

ALL = ("zero-filled", "tv", "unrolled")
GB = 2**30

# Peak RSS per rank [MB] of `mpirun -np 2 flowpm-mtf imaging ... --train-steps 2
# --tv-iterations 2 --force` (grid 2x1, float32; summary.json, the larger rank; commit
# ee81daa), and the run's options (docs/imaging.md, "Bad input and limits").
MEASURED_PEAK_MB = [
    ({"nc": 32}, {}, ALL, 789),
    ({"nc": 48}, {}, ALL, 852),
    ({"nc": 64}, {}, ALL, 981),
    ({"nc": 96}, {}, ALL, 1945),
    ({"nc": 128}, {}, ALL, 3444),
    ({"nc": 64}, {"blocks": 8}, ALL, 1092),
    ({"nc": 32}, {"blocks": 8}, ALL, 825),
    ({"nc": 32}, {"channels": 32}, ALL, 868),
    ({"nc": 32}, {"kernel_size": 7}, ALL, 774),
    ({"nc": 8}, {"channels": 1024, "blocks": 1}, ALL, 2430),
    ({"nc": 64}, {}, ("zero-filled", "tv"), 710),
]
# The model counts arrays, not TensorFlow's allocator. Below the peak it would let a run
# be killed: at most 5 % under (it was 1.8 % under at 96^3); above, it refuses runs that
# fit (--force runs them): at most 20 % over (17.6 % at 64^3 with 8 blocks).
MODEL_UNDER_RTOL = 0.05
MODEL_OVER_RTOL = 0.20


def _configs(*argv):
    job = jobs.get("imaging")
    args = cli.build_parser(jobs.all_jobs()).parse_args(["imaging", *argv])
    return options.make_configs(job, args, None, n_ranks=1, backend="placement")


@pytest.mark.parametrize("argv, pattern", [
    (["--train-steps", "99999999999999999999"],
     r"train_steps must be an integer in \[0, 1000000\]"),
    (["--blocks", "1000"], r"blocks must be an integer in \[1, 100\]"),
    (["--tv-iterations", "1000000"], r"iterations must be an integer in \[1, 100000\]"),
    (["--init-seed", str(2**63)], r"init_seed must be an integer in \[0, 9223372036854775807\]"),
    (["--channels", "0"], r"channels must be an integer >= 1"),
])
def test_counts_are_bounded(argv, pattern):
    with pytest.raises(ValueError, match=pattern):
        _configs(*argv)


@pytest.mark.parametrize("nc, grid, f, pattern", [
    (16, (2, 1), 33, r"kernel_size 33 does not fit: wider than the volume 16x16x16; "
                     r"use --kernel-size 15 or less"),
    (16, (4, 1), 11, r"its halo of 5 planes is wider than a rank's block \(4 x 16 voxels.*"
                     r"use --kernel-size 9 or less"),
])
def test_kernel_must_fit_volume_and_halo(nc, grid, f, pattern):
    conf = ImagingConfig(nc=nc, grid=grid)
    with pytest.raises(ValueError, match=pattern):
        unrolled.check_kernel_fits(conf, UnrolledConfig(kernel_size=f))
    unrolled.check_kernel_fits(conf, UnrolledConfig(kernel_size=unrolled.largest_kernel(conf)))


def _check(conf, uconf, available, methods=ALL):
    return preflight.check_estimate(memory.imaging_terms(conf, uconf, methods), SerialComm(),
                                    "test", memory.hint(conf, uconf, methods),
                                    available=available)


def test_memory_refusals_name_what_fits():
    # the runs: a 100000^3 volume (its mask alone: 100000^2 positions on every rank)
    conf = ImagingConfig(nc=100000, grid=(2, 1))
    memory.check_sizes(conf, UnrolledConfig(), ALL)
    with pytest.raises(MemoryBudgetError, match=r"the sampling mask .* alone need .* GB per "
                                                r"rank; use a smaller --nc"):
        _check(conf, UnrolledConfig(), 8 * GB)
    # 10^8 channels: the weights on every rank; the advice is a --channels that fits
    conf = ImagingConfig(nc=16, grid=(2, 1))
    with pytest.raises(MemoryBudgetError, match=r"network's weights .* use --channels (\d+) "
                                                r"or less") as e:
        _check(conf, UnrolledConfig(channels=10**8), 8 * GB)
    fits = int(re.search(r"--channels (\d+) or less", str(e.value)).group(1))
    _check(conf, UnrolledConfig(channels=fits), 8 * GB)
    # a volume that needs more ranks: the advice is a grid, and it fits
    conf = ImagingConfig(nc=128, grid=(1, 1))
    budget = sum(t.nbytes for t in memory.imaging_terms(conf, UnrolledConfig(), ALL)) // 2
    with pytest.raises(MemoryBudgetError, match=r"fits on (\d+) ranks") as e:
        _check(conf, UnrolledConfig(), budget)
    p, q = map(int, re.search(r"--mesh-shape (\d+)x(\d+)", str(e.value)).groups())
    _check(conf.replace(grid=(p, q)), UnrolledConfig(), budget)
    # beyond what a TensorFlow shape counts: a configuration error first
    with pytest.raises(ValueError, match=r"beyond the 2\^63-1"):
        memory.check_sizes(ImagingConfig(nc=16), UnrolledConfig(channels=10**9), ALL)


@pytest.mark.parametrize("conf, net, methods, peak_mb", MEASURED_PEAK_MB)
def test_memory_model_against_measured_peaks(conf, net, methods, peak_mb):
    terms = memory.imaging_terms(ImagingConfig(grid=(2, 1), **conf), UnrolledConfig(**net),
                                 methods)
    model_mb = sum(t.nbytes for t in terms) / 2**20
    assert (1 - MODEL_UNDER_RTOL) * peak_mb <= model_mb <= (1 + MODEL_OVER_RTOL) * peak_mb


def test_zero_training_steps_is_labelled_untrained(tmp_path):
    job = jobs.get("imaging")
    configs = _configs("--train-steps", "0")
    ctx = types.SimpleNamespace(configs=configs, conf=configs["config"])
    res = {"metrics": {"zero-filled": {"psnr_db": 18.0, "ssim": 0.6},
                       "unrolled": {"psnr_db": 18.1, "ssim": 0.61}}, "loss": []}
    summary = job.finish(ctx, res)
    assert summary["untrained"] == ["unrolled"] and summary["psnr_db"]["unrolled"] == 18.1
    out = types.SimpleNamespace(path=lambda name: str(tmp_path / name))
    job.write(ctx, out, res, summary)
    assert "| unrolled (untrained) | 18.10 |" in (tmp_path / "metrics.md").read_text()
    assert job.finish(types.SimpleNamespace(configs=_configs(), conf=None), res)["untrained"] == []


def test_memory_refusal_on_two_ranks_creates_nothing(tmp_path):
    out = tmp_path / "D"
    proc = flowpm("imaging", "--nc", "100000", "--out", out, np_=2)
    assert_one_error_line(proc, r"estimated peak memory .* exceeds .*use a smaller --nc")
    assert proc.returncode == MemoryBudgetError.exit_code, proc.out[-3000:]
    assert not re.search(r"graph built|run directory", proc.out), proc.out[-3000:]
    assert not out.exists()


def test_sigterm_to_one_rank_during_tv_checkpoints_step_zero(tmp_path):
    # rank 1 alone is signalled during the TV iterations: both ranks agree at the next
    # iteration and write the checkpoint of the training's step 0
    out = tmp_path / "D"
    # the smallest network (--blocks 1 --channels 2: a graph of 6425 TF ops per rank
    # instead of the defaults' 8379); the stop path does not depend on its size
    proc = flowpm("imaging", "--nc", "16", "--tv-iterations", "100000", "--train-steps", "5",
                  "--blocks", "1", "--channels", "2", "--no-plot", "--out", out, np_=2,
                  wait=False)
    lines, t_end = [], time.monotonic() + JOB_DEADLINE_S
    try:
        for line in proc.stderr:   # the TV iterations run once zero-filled is logged
            lines.append(line)
            if "zero-filled: PSNR" in line:
                time.sleep(0.5)
                os.kill(_rank_pid(proc.pid, 1), signal.SIGTERM)
                break
            assert time.monotonic() < t_end, "".join(lines)
        _, rest = proc.communicate(timeout=120)   # one TV iteration: well under a second
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "".join(lines) + rest
    assert proc.returncode == 0, text[-3000:]
    assert re.search(r"stopped by signal after TV iteration \d+/100000, before training step "
                     r"1/5; checkpoint in .*step_000000", text), text[-3000:]
    assert os.listdir(checkpoint.checkpoint_root(str(out))) == ["step_000000"]
    assert not (out / "manifest.json").exists()


def test_bounds_reach_the_command_line_as_configuration_errors():
    with pytest.raises(ConfigError, match=r"train_steps must be an integer in"):
        cli.checked_config(_configs, "--train-steps", "99999999999999999999")
    with pytest.raises(ValueError, match=r"iterations must be an integer in"):
        TVConfig(iterations=10**6)
