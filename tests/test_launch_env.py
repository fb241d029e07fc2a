"""MPI's waiting policy of a rank (flowpm_mtf.launch_env): set where unset, a user's
own value kept, and applied by the ``flowpm-mtf`` entry point before the allocator's
re-execution (so before MPI loads), without importing TensorFlow there (its start-up
lines are hidden only once the command line is parsed)."""
import pytest

from flowpm_mtf import allocator, cli, launch_env

pytestmark = pytest.mark.single_process

YIELD = "OMPI_MCA_mpi_yield_when_idle"


def test_apply_sets_the_defaults_and_keeps_a_users_value():
    env = {}
    assert launch_env.apply(env) == {YIELD: "1"}
    assert env == {YIELD: "1"}
    mine = {YIELD: "0"}
    assert launch_env.apply(mine) == {}
    assert mine == {YIELD: "0"}


def test_launch_env_imports_nothing_heavy():
    """The entry point imports it before MPI and TensorFlow: it must not import them."""
    import subprocess
    import sys

    code = ("import sys; from flowpm_mtf import launch_env; "
            "print(sorted(m for m in ('tensorflow', 'mpi4py', 'horovod') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]


def test_entry_applies_them_before_the_allocator(monkeypatch):
    monkeypatch.delenv(YIELD, raising=False)
    seen = []

    def ensure():  # stands in for the re-execution: record the environment, stop there
        import os

        seen.append(os.environ.get(YIELD))
        raise allocator.AllocatorError("stop")

    monkeypatch.setattr(allocator, "ensure", ensure)
    assert cli.start() == 2
    assert seen == ["1"]


def test_entry_prints_every_threads_python_stack_on_a_native_crash(monkeypatch):
    """A segmentation fault in a rank (TensorFlow, Horovod, MPI) leaves the Python stack of
    each thread in the job log (faulthandler, enabled by the entry point before MPI)."""
    import faulthandler

    seen = []

    def ensure():
        seen.append(faulthandler.is_enabled())
        raise allocator.AllocatorError("stop")

    monkeypatch.setattr(allocator, "ensure", ensure)
    faulthandler.disable()
    try:
        assert cli.start() == 2
    finally:
        faulthandler.enable()
    assert seen == [True]


EXIT_SCRIPT = r"""
import atexit, os, sys, threading, time
from flowpm_mtf import launch_env
if sys.argv[1] == "mpi":
    from mpi4py import MPI   # initializes MPI; its own finalization is a C-level exit hook
    rank = MPI.COMM_WORLD.Get_rank()
else:
    rank = 0
out = sys.argv[2]

def late():                  # a thread that is no daemon: the exit waits for it
    time.sleep(0.5)
    open(os.path.join(out, "thread%d" % rank), "w").close()

threading.Thread(target=late).start()
atexit.register(lambda: open(os.path.join(out, "atexit%d" % rank), "w").close())
sys.stdout.write("no newline from rank %d" % rank)   # still in the buffer (not a tty)
launch_env.exit_process(int(sys.argv[3]))
"""


@pytest.mark.parametrize("mpi", [False, True], ids=["one_process", "mpirun_2"])
def test_exit_process_keeps_what_a_normal_exit_does(mpi, tmp_path):
    """The command's fast exit (flowpm_mtf.cli.entry): the exit status, the threads that
    are no daemons, the atexit handlers and the buffered output as at a normal exit, and
    under mpirun MPI_Finalize (else mpirun fails the job: a rank exited without it)."""
    import os
    import shutil
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PMI_")) and k != "PYTHONUNBUFFERED"}
    cmd = [sys.executable, "-c", EXIT_SCRIPT, "mpi" if mpi else "plain", str(tmp_path)]
    if mpi:   # exit status 0: mpirun reports a non-zero one as the job's failure itself
        cmd = [shutil.which("mpirun"), "--allow-run-as-root", "--oversubscribe", "-np", "2",
               *cmd, "0"]
    else:
        cmd += ["3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    ranks = (0, 1) if mpi else (0,)
    assert proc.returncode == (0 if mpi else 3), proc.stdout + proc.stderr
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["atexit%d" % r for r in ranks] + ["thread%d" % r for r in ranks])
    for r in ranks:
        assert "no newline from rank %d" % r in proc.stdout
    assert "exited" not in proc.stderr and "finalize" not in proc.stderr.lower(), proc.stderr
