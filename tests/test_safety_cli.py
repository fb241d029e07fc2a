"""Issue 10 through the command line: a run never destroys or mixes results, and fails
before the compute when it has to fail, with one error line.

The refusals and runs that need no process of their own run the command line in the test's
process (:func:`here`, the placement backend on one block); a real ``flowpm-mtf`` process
is started where the behaviour is the process's: a run killed while
it writes, two jobs racing for one OUT, one launch per kind of refusal. They run in the
1-rank pass only. Meshes are 16^3. More refusals on 2 ranks: tests/test_preflight_cli.py."""
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import types

import pytest

from flowpm_mtf.runs import digest, rundir
from test_mpi_jobs import clean_env

pytestmark = pytest.mark.single_process

SMALL = ["--nc", "16", "--halo", "2", "--steps", "2", "--no-plot"]
# A run in the test's process: the placement backend, one block (no MPI job of its own).
IN_PROCESS = ["--backend", "placement", "--grid", "1x1"]
ERROR_RE = re.compile(r"flowpm-mtf: error: ")
# Limit per flowpm-mtf process: catches a hang. Generous: on the shared 2-core machine a
# 16^3 run that takes 15 s alone has taken 100 s under load (imports alone 60 s).
JOB_DEADLINE_S = 600


def flowpm(*args, np_=None, timeout=JOB_DEADLINE_S, wait=True):
    """Run ``flowpm-mtf ARGS`` in one process, or under ``mpirun -np np_``."""
    cmd = [sys.executable, "-m", "flowpm_mtf.cli", *map(str, args)]
    if np_ is not None:
        pre = [shutil.which("mpirun"), "--oversubscribe", "-np", str(np_)]
        if os.geteuid() == 0:
            pre.insert(1, "--allow-run-as-root")
        cmd = pre + cmd
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=clean_env())
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=clean_env())
    proc.out = proc.stdout + proc.stderr
    return proc


def here(capsys, *args):
    """``flowpm-mtf ARGS`` in this process (:func:`flowpm_mtf.cli.main`, what the command
    runs after its start-up); its exit code and output like :func:`flowpm`'s."""
    from flowpm_mtf import cli

    capsys.readouterr()
    code = cli.main([str(a) for a in args])
    cap = capsys.readouterr()
    return types.SimpleNamespace(returncode=code, out=cap.out + cap.err)


def tree(d):
    out = {}
    for root, _, names in os.walk(d):
        for n in names:
            p = os.path.join(root, n)
            out[os.path.relpath(p, d)] = digest.file_digest(p)
    return out


def assert_one_error_line(proc, pattern):
    lines = [ln for ln in proc.out.splitlines() if ERROR_RE.search(ln)]
    assert len(lines) == 1, "expected one error line:\n%s" % proc.out[-4000:]
    assert re.search(pattern, lines[0]), lines[0]
    assert "Traceback" not in proc.out, proc.out[-4000:]
    assert proc.returncode != 0


def assert_only_manifest_files(out):
    m = rundir.read_manifest(out)
    assert m is not None and rundir.verify_manifest(out) == []
    # every file under OUT (sub-directories too) is the run's: no staging, temporary,
    # lock or stale file
    assert sorted(tree(out)) == sorted([f["path"] for f in m["files"]] + ["manifest.json"])


def assert_no_step_ran(proc):
    assert not re.search(r"graph built|step \d+/\d+", proc.out), proc.out[-3000:]


@pytest.fixture(scope="module")
def complete_run(tmp_path_factory):
    """A complete run (in this process); tests copy it before changing it."""
    from flowpm_mtf import cli

    out = tmp_path_factory.mktemp("complete") / "D"
    assert cli.main(["simulate", *SMALL, *IN_PROCESS, "--out", str(out)]) == 0
    return out


def test_existing_run_untouched_then_overwritten(tmp_path, complete_run, capsys):
    out = tmp_path / "D"
    shutil.copytree(complete_run, out)
    assert_only_manifest_files(out)
    assert "overview.png" not in os.listdir(out)  # --no-plot
    before = tree(out)
    second = flowpm("simulate", *SMALL, "--seed", "7", "--out", out)   # its own process
    assert_one_error_line(second, r"holds a complete run.*--overwrite")
    assert_no_step_ran(second)
    assert tree(out) == before  # byte-identical
    third = here(capsys, "simulate", "--nc", "16", "--halo", "2", "--steps", "1", "--seed", "7",
                 *IN_PROCESS, "--out", out, "--overwrite")
    assert third.returncode == 0, third.out[-3000:]
    assert re.search(r"step 1/1", third.out)   # the log is seen here (assert_no_step_ran)
    assert_only_manifest_files(out)
    m = rundir.read_manifest(out)
    assert m["config"]["config"]["seed"] == 7 and m["config"]["config"]["n_steps"] == 1
    assert "overview.png" in os.listdir(out)


def test_each_subcommand_has_its_own_default_out(capsys):
    from flowpm_mtf import cli, jobs

    outs = {name: job.default_out for name, job in jobs.all_jobs().items()}
    assert outs == {"simulate": "out/sim", "lensing": "out/lensing", "reconstruct": "out/recon",
                    "imaging": "out/imaging", "fft-demo": "out/fft-demo", "halos": "out/halos"}
    with pytest.raises(SystemExit) as done:
        cli.main(["fft-demo", "--help"])
    assert done.value.code == 0 and "out/fft-demo" in capsys.readouterr().out


def test_concurrent_runs_exactly_one_succeeds(tmp_path):
    """Two ``flowpm-mtf`` processes (one rank each: the lock is rank 0's, and a refusal on
    every rank of a job is tests/test_preflight_cli.py's) racing for one OUT."""
    out = tmp_path / "D"
    jobs = [flowpm("simulate", *SMALL, "--seed", seed, "--out", out, wait=False)
            for seed in (1, 2)]
    results = [j.communicate(timeout=JOB_DEADLINE_S) for j in jobs]
    codes = [j.returncode for j in jobs]
    assert sorted(c == 0 for c in codes) == [False, True], results
    loser = results[codes.index(next(c for c in codes if c != 0))]
    assert re.search(r"in use by another run|holds a complete run", loser[1]), loser[1][-3000:]
    assert_only_manifest_files(out)
    seed = rundir.read_manifest(out)["config"]["config"]["seed"]
    import json

    with open(out / "summary.json") as f:
        assert json.load(f)["config"]["seed"] == seed  # no mixing


def test_kill_during_writing_leaves_old_run_or_nothing(tmp_path, complete_run, capsys):
    out = tmp_path / "D"
    shutil.copytree(complete_run, out)
    old = tree(out)
    job = flowpm("simulate", *SMALL, "--seed", "5", "--out", out, "--overwrite", wait=False)
    staging = out / ".staging"
    deadline = time.monotonic() + JOB_DEADLINE_S
    while time.monotonic() < deadline and job.poll() is None:
        if os.path.isdir(staging) and [n for n in os.listdir(staging) if not n.startswith(".")]:
            break
        time.sleep(0.01)
    job.send_signal(signal.SIGKILL)
    job.communicate()
    # Either the old complete run, intact, or no complete run at all.
    if rundir.read_manifest(out) is not None:
        assert rundir.verify_manifest(out) == []
        m_files = {f["path"] for f in rundir.read_manifest(out)["files"]}
        assert {k: v for k, v in tree(out).items() if k in m_files} == {
            k: v for k, v in old.items() if k in m_files}
    nxt = here(capsys, "simulate", *SMALL, *IN_PROCESS, "--out", out, "--overwrite")
    assert nxt.returncode == 0, nxt.out[-3000:]
    assert_only_manifest_files(out)  # no staging, temporary or lock file left


@pytest.mark.parametrize("case", ["file", "under_file", "immutable"])
def test_unwritable_out_fails_before_the_compute(tmp_path, capsys, case):
    f = tmp_path / "afile"
    f.write_text("x")
    out = {"file": f, "under_file": f / "sub", "immutable": tmp_path / "ro"}[case]
    if case == "immutable":
        out.mkdir()
        if os.geteuid() == 0:
            if subprocess.run(["chattr", "+i", str(out)], capture_output=True).returncode:
                pytest.skip("chattr +i not permitted here")
        else:
            os.chmod(out, 0o555)
    try:
        proc = here(capsys, "simulate", *SMALL, *IN_PROCESS, "--out", out)
    finally:
        if case == "immutable":
            subprocess.run(["chattr", "-i", str(out)], capture_output=True)
            os.chmod(out, 0o755)
    assert_one_error_line(proc, r"--out")
    assert_no_step_ran(proc)
    assert f.read_text() == "x"


def test_over_memory_config_fails_before_the_compute(tmp_path):
    proc = flowpm("simulate", "--nc", "1024", "--out", tmp_path / "D")
    assert_one_error_line(proc, r"estimated peak memory .* per process .* available per rank "
                                r".*smallest rank count that fits .* --force")
    assert_no_step_ran(proc)
    assert not os.path.exists(tmp_path / "D")
