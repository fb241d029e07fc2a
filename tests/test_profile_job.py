"""scripts/profile_job.py at 16^3 in a subprocess (it re-executes itself under the job's
allocator and patches ``tf.Session.run``): the job's two IC runs and the traced steps are
recorded with their ops (the CIC paint and readout, the 2LPT source), untraced steps
without, the other runs (kept from 0 s) with theirs (the final P(k)'s shell sums), a run
replaces the record of the same mesh, steps and commit, and a bad ``--trace`` or
``--other-min-s`` is refused."""
import json
import os
import subprocess
import sys

import pytest

from flowpm_bench import provenance
from flowpm_bench.results import json_path, write_json

pytestmark = pytest.mark.rank_independent

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "profile_job.py")


def _run(*args):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI_", "PMIX_", "FLOWPM_MTF_ALLOCATOR_ACTIVE"))}
    return subprocess.run([sys.executable, SCRIPT] + list(args), cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_profile_records_ics_and_traced_steps(tmp_path):
    out = str(tmp_path)
    # the record of an earlier run of this mesh, steps and commit: the run replaces it
    write_json(json_path(out, "profile_job"), [{
        "nc": 16, "steps": 3, "extra": [], "commit": provenance.commit_label(), "trace": [1],
        "date": "earlier", "machine": {"loadavg": [0.0]}, "allocator": "tf", "runs": []}])
    p = _run("--nc", "16", "--steps", "3", "--trace", "2", "3", "--other-min-s", "0",
             "--out", out)
    assert p.returncode == 0, p.stderr[-2000:]
    with open(json_path(out, "profile_job")) as f:    # out/ itself outside results/
        records = json.load(f)
    assert len(records) == 1
    rec = records[0]
    assert rec["date"] != "earlier"
    assert (rec["nc"], rec["steps"], rec["trace"], rec["extra"]) == (16, 3, [2, 3], [])
    runs = {r["run"]: r for r in rec["runs"]}
    assert [r["run"] for r in rec["runs"] if r["run"] != "other"] == [
        "ICs: 2LPT state", "ICs: first force", "step 1", "step 2", "step 3"]
    assert "ops" not in runs["step 1"]                      # not traced
    kinds = {name: {k for k, _, _ in runs[name]["ops"]} for name in
             ("ICs: 2LPT state", "ICs: first force", "step 2", "step 3")}
    assert "FlowpmLpt2Source" in kinds["ICs: 2LPT state"]
    # the first force is read out into the forces variable's zeros (FlowpmCicReadoutInto)
    assert {"FlowpmCicPaint", "FlowpmCicReadoutInto"} <= kinds["ICs: first force"]
    for name in ("step 2", "step 3"):
        assert {"FlowpmCicPaint", "FlowpmCicReadout"} <= kinds[name]
    for name in kinds:
        r = runs[name]
        assert r["wall_s"] > 0 and r["faults_gb"] >= 0
        assert all(t >= 0 and n >= 1 for _, t, n in r["ops"])
        assert sum(t for _, t, _ in r["ops"]) > 0
        assert len(r["top"]) >= 1
    # the other runs, kept from 0 s, traced: the final fetch's P(k) shell sums among them
    # (on the half spectrum of the density: FlowpmShellSumsHalf)
    others = [r for r in rec["runs"] if r["run"] == "other"]
    assert others and all("ops" in r for r in others)
    assert any(k == "FlowpmShellSumsHalf" for r in others for k, _, _ in r["ops"])
    assert rec["allocator"] in ("tcmalloc", "tf", "lean")
    with open(os.path.join(out, "profile_job.md")) as f:
        md = f.read()
    assert md.count("## 16^3, 3 steps") == 1 and "| ICs: first force |" in md


def test_bad_trace_is_refused(tmp_path):
    p = _run("--nc", "16", "--steps", "2", "--trace", "3", "--out", str(tmp_path))
    assert p.returncode == 2
    assert "--trace: steps between 1 and 2" in p.stderr
    p = _run("--nc", "16", "--steps", "2", "--other-min-s", "-1", "--out", str(tmp_path))
    assert p.returncode == 2 and "--other-min-s >= 0" in p.stderr


def test_split_passthrough():
    """The arguments after the first ``--`` are the command's (profile_job, bench_lensing)."""
    from flowpm_bench.scripts import split_passthrough

    assert split_passthrough(["--nc", "16"]) == (["--nc", "16"], [])
    assert split_passthrough(["--nc", "16", "--", "--sort-every", "2", "--", "x"]) == (
        ["--nc", "16"], ["--sort-every", "2", "--", "x"])
    assert split_passthrough(("--",)) == ([], [])
