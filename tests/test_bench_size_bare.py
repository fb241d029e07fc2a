"""scripts/bench_size.py's bare step on a tiny mesh, under mpirun: the step as one
``tf.group`` and the job's own lowered ops (``--ops job``) run the same simulation."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from test_mpi_jobs import clean_env

pytestmark = pytest.mark.single_process
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "bench_size.py")


def _bare(tmp_path, ops, ranks=2):
    out = tmp_path / ("%s.json" % ops)
    cmd = [shutil.which("mpirun"), "--oversubscribe", "-np", str(ranks), sys.executable, SCRIPT,
           "bare", "--nc", "16", "--steps", "3", "--ops", ops, "--json", str(out)]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out) as f:
        return json.load(f)


def test_job_ops_and_bare_step_reach_the_same_state(tmp_path):
    bare, job = _bare(tmp_path, "bare"), _bare(tmp_path, "job")
    assert bare["ops"] == "bare" and job["ops"] == "job"
    for rec in (bare, job):
        assert len(rec["steps_s"]) == 3 and min(rec["steps_s"]) > 0
        assert rec["step_s"] > 0 and rec["step_cpu_s"] > 0
    # the same ops in the same order: the same bits (16^3 particles in a 200 Mpc/h box)
    assert bare["positions_sum"] == job["positions_sum"]
    assert bare["positions_sum"] > 16 ** 3        # moved particles, not empty slots
