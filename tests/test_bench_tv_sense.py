"""scripts/bench_tv_sense.py without running MPI: the job command line, the record read from
a job's summary.json and the Markdown rendering (ours and sigpy, a failed run)."""
import pytest

from flowpm_bench.scripts import load_script

bt = load_script("bench_tv_sense")

pytestmark = pytest.mark.rank_independent


def test_command_runs_tv_sense_on_the_brain():
    cmd = bt.job_command(64, 4, 8, 10, "/tmp/x")
    args = cmd[cmd.index("imaging"):]
    for flag, value in (("--volume", "mni152"), ("--coils", "8"), ("--nc", "64"),
                        ("--mesh-shape", "2x2"), ("--method", "tv"), ("--tv-iterations", "10")):
        assert args[args.index(flag) + 1] == value, flag
    assert cmd[cmd.index("-np") + 1] == "4"


def test_records_and_render():
    summary = {"config": {"grid": [2, 1], "coils": 8}, "peak_memory_mb_per_rank": [900, 950],
               "timings": {"tv_per_iteration_s": 0.05}, "tv": {"iterations": 10},
               "psnr_db": {"tv": 25.0}}
    recs = [bt.record(summary, 64, 2),
            {"who": "sigpy", "nc": 64, "ranks": 1, "grid": [1, 1], "coils": 8,
             "voxels_per_rank": 64 ** 3, "iterations": 10, "per_iteration_s": 0.2,
             "peak_memory_mb": 400.0},
            {"who": "ours", "nc": 96, "ranks": 1, "failed": "killed"}]
    text = bt.render({"records": recs, "command": "all", "load_start": 3.0, "load_end": 4.0})
    rows = [ln for ln in text.splitlines() if ln.startswith("| 64^3") or ln.startswith("| 96^3")]
    assert rows[0] == "| 64^3 | 8 | ours | 2 | 2x1 | 131072 | 950 | 0.0500 | 10 |"
    assert rows[1].startswith("| 64^3 | 8 | sigpy | 1 | 1x1 | 262144 | 400 | 0.2000 |")
    assert "failed: killed" in rows[2]
