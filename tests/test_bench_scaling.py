"""scripts/bench_scaling.py without running MPI: the memory-model fit recovers known
coefficients, the breakdown and the Markdown/doc rendering work on synthetic records."""
import os
import tempfile

import numpy as np
import pytest

from flowpm_bench.scripts import load_script

bs = load_script("bench_scaling")

pytestmark = pytest.mark.rank_independent

TRUE = {"M0_mb": 480.0, "bytes_per_slot": 150.0, "bytes_per_padded_cell": 40.0}
FIT_RTOL = 1e-6  # exact synthetic data: the fit must recover the coefficients
MB = 2.0**20


def _record(name, quick=False):
    c = dict(bs.CONFIGS[name])
    n = int(np.prod(c["nc"]))
    plan = bs.planned(c)
    v, slots = plan["padded_cells_local"], plan["slots_local"]
    peak = TRUE["M0_mb"] + (TRUE["bytes_per_slot"] * slots
                            + TRUE["bytes_per_padded_cell"] * v) / bs.MB
    phases = {"start": {"rss": 440.0, "peak": 440.0, "phase_peak": 440.0},
              "graph": {"rss": 470.0, "peak": 475.0, "phase_peak": 475.0},
              "ics": {"rss": peak - 20, "peak": peak, "phase_peak": peak},
              "steps": {"rss": peak - 10, "peak": peak, "phase_peak": peak - 5},
              "output": {"rss": peak - 8, "peak": peak, "phase_peak": peak - 6}}
    return {"name": name, "kind": c["kind"], "nc": list(c["nc"]), "box": list(c["box"]),
            "ranks": c["ranks"], "grid": list(c["grid"]), "steps": 2, **plan,
            "n_particles": n, "n_local": n // c["ranks"], "ok": True,
            "peak_mb_per_rank": [peak] * c["ranks"], "phases_mb_per_rank": [phases] * c["ranks"],
            "commit": "abc", "dirty": False, "date": "2026-01-01 00:00 UTC",
            "machine": {"loadavg": [1.0, 1.0, 1.0]}, "quick": quick}


def test_fit_recovers_the_model_and_renders():
    records = {n: _record(n) for n in bs.CONFIGS}
    records["largest-384-np4"] = dict(_record("strong-4"), name="largest-384-np4",
                                      kind="largest", ok=False, error="Killed")
    model = bs.fit_model(records)
    for k, v in TRUE.items():
        assert model[k] == pytest.approx(v, rel=FIT_RTOL)
    data = {"records": records, "model": model}
    md = bs.render(data, quick=False)
    assert "#### Weak scaling" in md and "#### Strong scaling" in md and "**no**: Killed" in md
    assert "M0 = 480 MB, 150 bytes per particle slot, 40.0 bytes per padded cell" in md
    assert "| eulerian, 2, %d |" % records["weak-4"]["slots_local"] in md
    assert "| 2048^3 | 64 | 8x8 |" in md
    assert bs.model_spans(model)
    weak = {n: r for n, r in records.items() if n.startswith("weak")}
    assert not bs.model_spans(bs.fit_model(weak))  # 3 runs of one size: not for the preflight
    b = bs.breakdown(records["weak-1"])[0]
    assert b["runtime"] == 440.0 and b["graph_state"] == 35.0 and b["steps"] == 15.0


def test_fit_bounds_every_run():
    """With peaks off the model by a few per cent, the fit's M0 is raised by the largest
    shortfall: the model is at or above every measured peak (the preflight refuses by it),
    and touches the run it fell furthest short of."""
    records = {n: _record(n) for n in bs.CONFIGS}
    rng = np.random.RandomState(5)
    for r in records.values():
        if r["kind"] != "floor":
            r["peak_mb_per_rank"] = [p * (1 + rng.uniform(-0.05, 0.05))
                                     for p in r["peak_mb_per_rank"]]
    model = bs.fit_model(records)
    assert model["M0_shift_mb"] > 0
    gaps = []
    for row in model["rows"]:
        pred = model["M0_mb"] + (model["bytes_per_slot"] * row["slots_local"]
                                 + model["bytes_per_padded_cell"] * row["padded_cells_local"]) / MB
        gaps.append(pred - row["peak_mb"])
    assert min(gaps) == pytest.approx(0.0, abs=1e-6) and max(gaps) > 1.0


def test_update_doc_replaces_only_its_section():
    doc = os.path.join(tempfile.mkdtemp(), "scaling.md")
    with open(doc, "w") as f:
        f.write("# Title\n\nintro\n")
    bs.update_doc("first\n", doc)
    bs.update_doc("second\n", doc)
    text = open(doc).read()
    assert text.startswith("# Title\n\nintro\n") and "second" in text and "first" not in text
    assert text.count(bs.DOC_BEGIN) == 1 and text.count(bs.DOC_END) == 1


def test_runs_measure_the_default_decomposition():
    """Every configuration runs `simulate` with the default (eulerian) decomposition and
    automatic halo: no --halo/--decomposition on the command line."""
    for name in bs.CONFIGS:
        cmd = bs.simulate_command(bs.CONFIGS[name], "/tmp/x", 2)
        assert "--halo" not in cmd and "--decomposition" not in cmd
        plan = bs.planned(bs.CONFIGS[name])
        assert plan["decomposition"] == "eulerian" and plan["halo_size"] == 2


def test_memory_model_file_written_for_preflight(tmp_path):
    records = {n: _record(n) for n in bs.CONFIGS}
    model = bs.fit_model(records)
    path = str(tmp_path / "memory_model.json")
    bs.write_memory_model(model, bs.paths(False)[0], path)
    from flowpm_mtf.runs import preflight

    loaded = preflight.load_memory_model(path)
    assert loaded["bytes_per_slot"] == pytest.approx(TRUE["bytes_per_slot"], rel=FIT_RTOL)
    assert len(loaded["rows"]) == len([n for n in bs.CONFIGS if not n.startswith("floor")])


def test_quick_configs_are_small():
    import argparse

    for name in bs.CONFIGS:
        _, c = bs.config_for(name, argparse.Namespace(quick=True, nc=None, ranks=None))
        assert np.prod(c["nc"]) <= 32 ** 3
    name, c = bs.config_for("largest", argparse.Namespace(quick=False, nc=512, ranks=2))
    assert name == "largest-512-np2" and c["grid"] == (2, 1) and c["nc"] == (512,) * 3


def test_other_allocator_records_get_their_own_tables_and_stay_out_of_the_fit():
    records = {n: _record(n) for n in bs.CONFIGS}
    lean = {n + "@lean": dict(_record(n), peak_mb_per_rank=[1.0e4] * bs.CONFIGS[n]["ranks"])
            for n in ("weak-1", "weak-4")}
    data = {"records": dict(records, **lean)}
    data["model"] = bs.fit_model(bs.allocator_groups(data["records"]).get(None, {}))
    for k, v in TRUE.items():   # the lean records (10 GB) did not enter the fit
        assert data["model"][k] == pytest.approx(v, rel=FIT_RTOL)
    md = bs.render(data, quick=False)
    head, lean_part = md.split("### Host allocator `FLOWPM_MTF_ALLOCATOR=lean`")
    assert "#### Weak scaling" in head and "#### Weak scaling" in lean_part
    assert "| weak-4 | 4 | 2x2 |" in lean_part.split("#### Breakdown")[0]
    assert "| 10000 |" in lean_part.split("#### Breakdown")[0]   # the lean peaks
    assert "| weak-4@lean |" in md                      # breakdown rows keep the key
    assert bs.split_key("weak-4@lean") == ("weak-4", "lean")
    assert bs.record_key("weak-4", bs.default_allocator()) == "weak-4"


def test_stacks_get_their_own_tables_and_a_side_by_side_table():
    """Records without a stack were TF 2.12's: normalise re-keys them NAME@tf2.12 (and
    NAME@lean+tf2.12); the default stack's records keep the bare names, alone enter the
    fit, and the side-by-side table divides the new stack's numbers by the old one's."""
    old = {n: dict(_record(n), timings={"ics_s": 2.0, "nbody_s": 4.0}) for n in bs.CONFIGS}
    old["weak-1@lean"] = dict(_record("weak-1"), peak_mb_per_rank=[1.0e4])
    data = bs.normalise({"records": old})
    assert set(data["records"]) == {n + "@tf2.12" for n in bs.CONFIGS} | {"weak-1@lean+tf2.12"}
    assert all(r["stack"] == "tf2.12" for r in data["records"].values())
    new = {n: dict(_record(n), stack="tf2.21", timings={"ics_s": 1.0, "nbody_s": 6.0})
           for n in ("weak-1", "strong-2")}
    new["weak-1"]["peak_mb_per_rank"] = [2 * new["weak-1"]["peak_mb_per_rank"][0]]
    data["records"].update(bs.normalise({"records": new})["records"])
    assert bs.record_key("weak-1", bs.default_allocator(), "tf2.21") == "weak-1"
    assert bs.record_key("weak-1", "lean", "tf2.12") == "weak-1@lean+tf2.12"
    groups = bs.allocator_groups(data["records"])
    assert set(groups[None]) == {"weak-1", "strong-2"}
    md = bs.render(data, quick=False)
    assert "### Stack `FLOWPM_MTF_STACK=tf2.12` (records `NAME@tf2.12`)" in md
    assert ("### Stack `FLOWPM_MTF_STACK=tf2.12`, host allocator `FLOWPM_MTF_ALLOCATOR=lean` "
            "(records `NAME@lean+tf2.12`)") in md
    side = md.split("### The two stacks side by side")[1].split("####")[0]
    peak = old["weak-1"]["peak_mb_per_rank"][0]
    assert ("| weak-1 | %.0f | %.0f | 2.00 | 2 | 1 | 0.50 | 4 | 6 | 1.50 |" % (peak, 2 * peak)
            in side)
    assert "| strong-2 |" in side and "| weak-4 |" not in side


def test_records_before_slots_local_still_render():
    """Records written before ``slots_local`` was stored (the lagrangian decomposition, one
    slot per particle: results/raw/bench_scaling_quick.json) fit and render with their
    particles per rank as the slots (``--quick render`` raised KeyError 'slots_local')."""
    records = {n: _record(n) for n in bs.CONFIGS}
    for r in records.values():
        del r["slots_local"], r["capacity"]
    model = bs.fit_model(records)
    assert [row["slots_local"] for row in model["rows"]] == [
        r["n_local"] for r in records.values() if r["kind"] != "floor"]
    md = bs.render({"records": records, "model": model}, quick=True)
    assert "| eulerian, 2, %d |" % records["weak-4"]["n_local"] in md
