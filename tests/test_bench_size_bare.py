"""scripts/bench_size.py's bare step on a tiny mesh, under mpirun (2 ranks): the step as one
``tf.group`` and the job's own lowered ops (``--ops job``) run the same simulation."""
import json
import os

import pytest

from test_mpi_jobs import mpirun

pytestmark = pytest.mark.single_process
SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts",
                      "bench_size.py")


def test_job_ops_and_bare_step_reach_the_same_state(tmp_path):
    """Both in one launch (``--ops bare job``: each its own graph and session, in turn)."""
    out = tmp_path / "bare.json"
    proc, _ = mpirun(2, SCRIPT, "bare", "--nc", 16, "--steps", 3, "--ops", "bare", "job",
                     "--json", out, timeout=600)     # an absolute path: not in mpi_scripts/
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out) as f:
        bare, job = json.load(f)
    assert bare["ops"] == "bare" and job["ops"] == "job"
    for rec in (bare, job):
        assert len(rec["steps_s"]) == 3 and min(rec["steps_s"]) > 0
        assert rec["step_s"] > 0 and rec["step_cpu_s"] > 0
    # the same ops in the same order: the same bits (16^3 particles in a 200 Mpc/h box)
    assert bare["positions_sum"] == job["positions_sum"]
    assert bare["positions_sum"] > 16 ** 3        # moved particles, not empty slots
