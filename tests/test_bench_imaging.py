"""scripts/bench_imaging.py without running MPI: the job command line, the record read
from a job's summary.json and the Markdown rendering (ratios to the 1-rank peak, failed
runs) on synthetic summaries."""
import pytest

from flowpm_bench.scripts import load_script

bi = load_script("bench_imaging")

pytestmark = pytest.mark.rank_independent


def _summary(nc, ranks, peak):
    grid = {1: [1, 1], 2: [2, 1], 4: [2, 2]}[ranks]
    return {"config": {"nc": [nc] * 3, "grid": grid}, "peak_memory_mb_per_rank": [peak] * ranks,
            "timings": {"train_per_step_s": 1.5, "tv_per_iteration_s": 0.02,
                        "graph_build_s": 9.0, "total_s": 30.0},
            "unrolled": {"train_steps": 5}, "tv": {"iterations": 5},
            "psnr_db": {"zero-filled": 18.4, "tv": 24.0, "unrolled": 20.1},
            "ssim": {"zero-filled": 0.54, "tv": 0.91, "unrolled": 0.6}}


def test_command_runs_the_job_on_the_default_grid():
    cmd = bi.job_command(128, 4, "/tmp/x", 5, 7)
    i = cmd.index("imaging")
    assert cmd[i - 2:i] == ["-m", "flowpm_mtf.cli"]
    args = cmd[i:]
    assert args[args.index("--nc") + 1] == "128" and args[args.index("--mesh-shape") + 1] == "2x2"
    assert args[args.index("--train-steps") + 1] == "5"
    assert args[args.index("--tv-iterations") + 1] == "7"
    assert "-np" in cmd and cmd[cmd.index("-np") + 1] == "4"


def test_records_and_render():
    recs = [bi.record(_summary(128, r, p), 128, r) for r, p in ((1, 2000.0), (2, 1200.0),
                                                                   (4, 800.0))]
    recs.append({"nc": 256, "ranks": 1, "failed": "killed (out of memory)"})
    assert recs[2]["voxels_per_rank"] == 128 ** 3 // 4 and recs[1]["grid"] == [2, 1]
    text = bi.render({"records": recs, "command": "all", "load_end": 0.5})
    rows = [ln for ln in text.splitlines() if ln.startswith("| 128^3") or
            ln.startswith("| 256^3")]
    assert len(rows) == 4
    assert "| 1200 | 0.60 |" in rows[1] and "| 800 | 0.40 |" in rows[2]
    assert "18.40 / 24.00 / 20.10" in rows[0] and "5 / 5" in rows[0]
    assert "failed: killed (out of memory)" in rows[3]
