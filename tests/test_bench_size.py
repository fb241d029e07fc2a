"""scripts/bench_size.py without running MPI: the series of issue 31, its quick sizes, the
derived columns and the Markdown from synthetic records."""
import pytest

from flowpm_bench.scripts import load_script

bsz = load_script("bench_size")

pytestmark = pytest.mark.rank_independent


def _summary(n_steps=4, step=0.2, write_gb=0.3):
    return {"timings": {"steps_s": [step * 1.5] + [step] * (n_steps - 1),
                        "steps_cpu_s": [step * 2] * n_steps, "ics_s": 3 * step,
                        "ics_cpu_s": 6 * step, "graph_build_s": 1.0, "fetch_s": 0.1,
                        "total_s": 9.0},
            "output_write": {"bytes": write_gb * 1e9, "seconds": 0.5,
                             "gb_per_s": write_gb / 0.5},
            "peak_memory_mb_per_rank": [700.0, 800.0], "allocator": "tcmalloc",
            "migration": {"halo_size": 2}}


def _record(name, step=0.2, bare_step=0.19, ok=True):
    c = bsz.config_for(name, quick=False)
    rec = {"name": name, "nc": c["nc"], "ranks": c["ranks"], "grid": list(c["grid"]),
           "steps": 4, "n_particles": c["nc"] ** 3, "ok": ok, "commit": "abc", "dirty": False,
           "machine": {"loadavg": [0.3, 0.2, 0.1]}, "stack": "tf2.21"}
    if ok:
        rec.update(bsz.job_fields(_summary(step=step)))
        rec["bare"] = {"step_s": bare_step, "step_cpu_s": 2 * bare_step}
    else:
        rec["error"] = "Killed"
    return rec


def test_series_of_the_issue_and_quick_sizes_are_tiny():
    assert [(c["nc"], c["ranks"]) for c in bsz.CONFIGS.values()] == [
        (128, 1), (192, 1), (256, 1), (384, 1), (512, 1), (256, 2), (384, 2), (256, 4),
        (384, 4)]
    assert bsz.CONFIGS["4r-384"]["grid"] == (2, 2)
    quick = [bsz.config_for(n, quick=True)["nc"] for n in bsz.CONFIGS]
    assert max(quick) == 64 and min(quick) == 16
    with pytest.raises(SystemExit):
        bsz.config_for("1r-1024", quick=False)


def test_columns_and_markdown():
    recs = {"1r-128": _record("1r-128", step=0.2, bare_step=0.19),
            "1r-512": _record("1r-512", step=0.2 * 64 * 1.2, bare_step=15.0),
            "2r-256": _record("2r-256", ok=False)}
    r = bsz.row(recs["1r-128"])
    assert r["step_s"] == pytest.approx(0.2)          # the first step is left out
    assert r["ns_per_particle"] == pytest.approx(0.2 / 128**3 * 1e9)
    assert r["ics_in_steps"] == pytest.approx(3.0)
    assert r["write_gb_per_s"] == pytest.approx(0.6) and r["write_gb"] == pytest.approx(0.3)
    assert r["peak_gb"] == pytest.approx(800 * 2**20 / 1e9)
    assert r["job_over_bare"] == pytest.approx(0.2 / 0.19)
    assert r["job_over_bare_cpu"] == pytest.approx(0.4 / 0.38)
    assert bsz.row(recs["2r-256"]) is None
    md = bsz.render({"records": recs}, quick=False)
    assert "| 128^3 | 1 | 1x1 | 0.2 | 95 | 3.00 | 0.60 (0.3) | 0.84 | 1.05 (1.05) | 0.3 | abc |" in md
    assert "| 256^3 | 2 | 2x1 | **failed**: Killed" in md
    assert "128^3 1.00, 512^3 1.20" in md
    assert md.index("512^3 | 1 |") < md.index("256^3 | 2 |")   # 1 rank first


def test_stacks_are_keyed_and_labelled():
    """A record without a stack was TF 2.12's: keyed NAME@tf2.12 and labelled so in the
    commit column; the default stack's keeps its name, and the ns/particle ratio line
    uses the default stack's records only."""
    old = _record("1r-128", step=0.4)
    del old["stack"]
    data = bsz.normalise({"records": {"1r-128": old, "1r-512": _record("1r-512", step=12.8)}})
    assert set(data["records"]) == {"1r-128@tf2.12", "1r-512"}
    assert bsz.record_key("1r-128", "tf2.21") == "1r-128"
    data["records"]["1r-128"] = _record("1r-128", step=0.2)
    md = bsz.render(data, quick=False)
    assert "| 0.3 | abc tf2.12 |" in md and "| 0.3 | abc |" in md
    assert "128^3 1.00, 512^3 1.00" in md


def test_reorderings_are_spread_over_the_steps():
    """The step column with --sort-every: the median step after the first plus the
    reorderings' total over the steps, for the job and for the bare step alike."""
    rec = _record("1r-128", step=0.2, bare_step=0.19)
    rec["sorts_s"] = [0.4]                                    # 4 steps, one reordering
    rec["bare"] = {"steps_s": [0.3, 0.19, 0.19, 0.19], "sorts_s": [0.4], "step_s": 0.19,
                   "step_cpu_s": 0.38}
    out = bsz.row(rec)
    assert out["step_s"] == pytest.approx(0.2 + 0.1)
    assert out["job_over_bare"] == pytest.approx(0.3 / (0.19 + 0.1))
    assert bsz.job_fields(_summary())["sorts_s"] == []
