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


def mpirun(np_, script, *args, timeout=JOB_DEADLINE_S + 30, env=None):
    exe = shutil.which("mpirun")
    if exe is None:
        pytest.fail("mpirun not found: run scripts/setup_env.sh")
    cmd = [exe, "--oversubscribe", "--tag-output", "-np", str(np_)]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    cmd += [sys.executable, os.path.join(HERE, "mpi_scripts", script), *map(str, args)]
    env = dict(clean_env(), **(env or {}))
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    return proc, time.monotonic() - t0


# mpirun's own log lines, e.g. "[vm:01630] [[27296,0],0] ORTE_ERROR_LOG: Data unpack
# would read past end of buffer in file ../../../orte/util/show_help.c at line 501"
# (Open MPI 4 when two ranks call MPI_Abort at once). They are untagged, so one written
# between a rank's tagged chunks would land inside that rank's text.
ORTE_LOG_LINE = re.compile(r"\[[^\[\]\s]+:\d+\] \[\[\d+,\d+\],\d+\] [^\n]*(?:\n|$)")


def rank_text(out, rank, stream="stderr"):
    """What ``rank`` wrote to ``stream``: the chunks mpirun's --tag-output labels
    ``[job,rank]<stream>:`` joined (a loaded machine splits one line into chunks),
    without mpirun's own log lines."""
    parts = re.split(r"(\[\d+,\d+\]<std(?:out|err)>:)", ORTE_LOG_LINE.sub("", out))
    tag = re.compile(r"\[\d+,%d\]<%s>:" % (rank, stream))
    return "".join(parts[i + 1] for i in range(1, len(parts) - 1, 2) if tag.fullmatch(parts[i]))


def test_rank_count_mismatch_fails_on_every_rank():
    proc, _ = mpirun(2, "bad_mesh.py", 3)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    for rank in (0, 1):
        pat = r"ValueError: .*3 processors but the job has 2 MPI ranks"
        assert re.search(pat, rank_text(out, rank)), \
            "rank %d did not report the error:\n%s" % (rank, out[-3000:])


def test_rank_text_drops_mpirun_log_lines():
    """The interleaving CI met (2026-11-23): mpirun's ORTE_ERROR_LOG line written
    between two chunks of rank 0's error message."""
    out = ("[1,0]<stderr>:ValueError[1,0]<stderr>:: [vm:01630] [[27296,0],0] ORTE_ERROR_LOG:"
           " Data unpack would read past end of buffer in file ../../../orte/util/show_help.c"
           " at line 501\n[1,1]<stderr>:ValueError: B has 3 processors\n"
           "[1,0]<stderr>:A has 3 processors\n")
    assert rank_text(out, 0) == "ValueError: A has 3 processors\n"
    assert rank_text(out, 1) == "ValueError: B has 3 processors\n"
    assert rank_text(out, 0, "stdout") == ""


@pytest.mark.parametrize("mode", ["exit", "raise"])
def test_dead_rank_ends_the_job(mode):
    proc, elapsed = mpirun(2, "die_midrun.py", mode)
    out = proc.stdout + proc.stderr
    for rank in (0, 1):  # the job really ran: both ranks finished the first collective
        assert re.search(r"\[\d+,%d\]<stdout>:first collective done" % rank, out), out[-3000:]
    assert proc.returncode != 0, out[-3000:]
    assert elapsed < JOB_DEADLINE_S, "job took %.0f s to end" % elapsed


# The exit race of issue 16 (tests/mpi_scripts/exit_race.py): ranks 2 and 3 are delayed
# before their last collective on the process set {2, 3} while ranks 0 and 1 exit.
EXIT_RACE_DELAY_S = 1.0
# Repetitions of the exit test in one run (EXIT_RACE_REPEATS=20 for the acceptance check).
EXIT_RACE_REPEATS = int(os.environ.get("EXIT_RACE_REPEATS", "1"))


def _exit_race(barrier):
    proc, elapsed = mpirun(4, "exit_race.py", timeout=5 * JOB_DEADLINE_S,  # a loaded machine
                           env={"EXIT_RACE_DELAY_S": str(EXIT_RACE_DELAY_S),
                                "FLOWPM_MTF_EXIT_BARRIER": "1" if barrier else "0"})
    return proc, proc.stdout + proc.stderr


@pytest.mark.parametrize("repeat", range(EXIT_RACE_REPEATS))
def test_exit_waits_for_every_rank(repeat):
    proc, out = _exit_race(barrier=True)
    assert proc.returncode == 0, out[-3000:]
    for rank in range(4):
        assert re.search(r"\[\d+,%d\]<stdout>:rank %d done" % (rank, rank), out), out[-3000:]
    assert "shut down" not in out, out[-3000:]


def test_exit_race_reproduced_without_barrier():
    """The control: with the barrier disabled the same job fails as in the issue."""
    proc, out = _exit_race(barrier=False)
    assert proc.returncode != 0, out[-3000:]
    # The shut-down under a rank's collective shows either way, depending on how far
    # rank 0's shutdown got: the set's members were told it is gone, or Horovod is.
    symptoms = ("Horovod has been shut down", "Process set provided does not exist")
    assert any(sym in rank_text(out, r) for r in (2, 3) for sym in symptoms), out[-3000:]
    for rank in (0, 1):
        assert re.search(r"\[\d+,%d\]<stdout>:rank %d done" % (rank, rank), out), out[-3000:]
