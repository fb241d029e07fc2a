"""scripts/bench_stacks.py without running MPI: the job's command, the medians and ratios
per stack and the Markdown from synthetic records."""
import pytest

from flowpm_bench.scripts import load_script

bst = load_script("bench_stacks")

pytestmark = pytest.mark.rank_independent


def _rec(tf, step, peak, order, wall=10.0, ok=True, args=()):
    return {"ok": ok, "np": 2, "args": list(args), "order": order, "load": 0.2,
            "commit": "abc", "dirty": False, "command": "mpirun ...",
            "versions": {"tensorflow": tf, "python": "3.13.0" if tf == "2.21.0" else "3.11.7",
                         "numpy": "2.4.6" if tf == "2.21.0" else "1.24.3"},
            "wall_s": wall, "graph_build_s": 1.0, "ics_s": 0.2, "step_s": step,
            "step_cpu_s": 2 * step, "total_s": 3.0, "peak_mb": peak}


def test_command_is_the_main_job_from_the_venv():
    cmd = bst.job_command("/v", 2, "/o", ["--nc", "32"])
    assert cmd[-6:] == ["/v/bin/flowpm-mtf", "simulate", "--out", "/o", "--nc", "32"]
    assert "-np" in cmd and cmd[cmd.index("-np") + 1] == "2"


def test_medians_and_ratios_per_stack_in_the_order_given():
    recs = [_rec("2.12.1", 0.05, 500.0, 0), _rec("2.21.0", 0.04, 700.0, 1),
            _rec("2.21.0", 0.06, 760.0, 1), _rec("2.12.1", 0.07, 520.0, 0),
            _rec("2.21.0", 0.05, 740.0, 1), _rec("2.12.1", 0.06, 510.0, 0),
            _rec("2.21.0", 1.0, 1.0, 1, ok=False)]
    rows = bst.summarise(recs)
    assert [r["stack"] for r in rows] == ["TF 2.12.1, Python 3.11.7, numpy 1.24.3",
                                          "TF 2.21.0, Python 3.13.0, numpy 2.4.6"]
    old, new = rows
    assert old["n"] == 3 and new["n"] == 3       # the failed launch is left out
    assert old["median"]["step_s"] == pytest.approx(0.06)
    assert new["median"]["peak_mb"] == pytest.approx(740.0)
    assert new["ratio"]["peak_mb"] == pytest.approx(740.0 / 510.0)
    assert new["ratio"]["step_s"] == pytest.approx(0.05 / 0.06)
    assert old["ratio"]["step_s"] == pytest.approx(1.0)
    md = bst.render({"records": recs})
    assert "| defaults | 2 | TF 2.21.0, Python 3.13.0, numpy 2.4.6 | 3 |" in md
    assert "740 (1.45)" in md and "0.05 (0.83)" in md
    assert md.count("Failed:") == 1


def test_cases_with_other_arguments_are_their_own_rows():
    recs = [_rec("2.12.1", 0.05, 500.0, 0), _rec("2.21.0", 0.05, 700.0, 1),
            _rec("2.21.0", 0.5, 900.0, 1, args=("--nc", "128"))]
    rows = bst.summarise(recs)
    assert [(r["args"], r["n"]) for r in rows] == [("defaults", 1), ("defaults", 1),
                                                   ("--nc 128", 1)]
    assert rows[2]["ratio"]["peak_mb"] == pytest.approx(1.0)   # alone in its case
