"""Whole-job behaviour under mpirun: bad input fails on every rank, and a rank that
dies ends the job instead of leaving the others hanging. These tests start their own
2-rank MPI jobs, so they run in the 1-rank pass only."""
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.single_process

HERE = os.path.dirname(os.path.abspath(__file__))
# A job that hangs instead of failing is caught by this limit (the issue asks for 60 s).
JOB_DEADLINE_S = 60


def clean_env():
    """This environment minus the MPI launcher's variables: a job started from inside
    an MPI rank (e.g. pytest under ``mpirun -np 1``) is refused as a recursive call."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PMI_", "HOROVOD_"))}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    return env


def mpirun(np_, script, *args, timeout=JOB_DEADLINE_S + 30):
    exe = shutil.which("mpirun")
    if exe is None:
        pytest.fail("mpirun not found: run scripts/setup_env.sh")
    cmd = [exe, "--oversubscribe", "--tag-output", "-np", str(np_)]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    cmd += [sys.executable, os.path.join(HERE, "mpi_scripts", script), *map(str, args)]
    env = clean_env()
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    return proc, time.monotonic() - t0


def test_rank_count_mismatch_fails_on_every_rank():
    proc, _ = mpirun(2, "bad_mesh.py", 3)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    for rank in (0, 1):
        # --tag-output prefixes each line with [jobid,rank]<stream>
        pat = r"\[\d+,%d\]<stderr>:.*ValueError: .*3 processors but the job has 2 MPI ranks" % rank
        assert re.search(pat, out), "rank %d did not report the error:\n%s" % (rank, out[-3000:])


@pytest.mark.parametrize("mode", ["exit", "raise"])
def test_dead_rank_ends_the_job(mode):
    proc, elapsed = mpirun(2, "die_midrun.py", mode)
    out = proc.stdout + proc.stderr
    for rank in (0, 1):  # the job really ran: both ranks finished the first collective
        assert re.search(r"\[\d+,%d\]<stdout>:first collective done" % rank, out), out[-3000:]
    assert proc.returncode != 0, out[-3000:]
    assert elapsed < JOB_DEADLINE_S, "job took %.0f s to end" % elapsed
