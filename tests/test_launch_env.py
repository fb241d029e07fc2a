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
    assert cli.entry() == 2
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
        assert cli.entry() == 2
    finally:
        faulthandler.enable()
    assert seen == [True]
