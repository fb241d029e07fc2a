"""The host allocator modes (flowpm_mtf.allocator): the environment each mode starts a
process with, the re-execution of the entry point, and the one-line error."""
import os
import subprocess
import sys

import pytest

from flowpm_mtf import allocator

from test_mpi_jobs import clean_env

pytestmark = pytest.mark.single_process

HAVE_TCMALLOC = allocator._tcmalloc_library() is not None
PROBE = ("from flowpm_mtf import allocator; allocator.ensure(); import os; "
         "maps = open('/proc/self/maps').read(); "
         "print(allocator.active(), 'libtcmalloc' in maps, os.environ.get('GLIBC_TUNABLES', ''), "
         "os.environ.get('TF_ENABLE_ONEDNN_OPTS', ''), os.environ.get('LD_PRELOAD', ''), sep='|')")


def _probe(mode, **extra):
    env = {k: v for k, v in clean_env().items() if not k.startswith("FLOWPM_MTF_ALLOCATOR")}
    env.pop("LD_PRELOAD", None)
    env.pop("GLIBC_TUNABLES", None)
    if mode is not None:
        env[allocator.ENV] = mode
    env.update(extra)
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split("|")


def test_tf_mode_changes_nothing_but_the_marker():
    env = {"PATH": "/bin", "LD_PRELOAD": "/x.so"}
    mode, new = allocator.environment("tf", env)
    assert mode == "tf" and new.pop(allocator.ACTIVE_ENV) == "tf" and new == env


def test_lean_mode_appends_its_tunables():
    mode, new = allocator.environment("lean", {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"})
    assert mode == "lean" and new["TF_ENABLE_ONEDNN_OPTS"] == "0"
    assert new["GLIBC_TUNABLES"] == "glibc.malloc.tcache_count=0:" + allocator.LEAN_TUNABLES


@pytest.mark.skipif(not HAVE_TCMALLOC, reason="libtcmalloc-minimal4 not installed")
def test_tcmalloc_mode_preloads_once_before_the_users_libraries():
    lib = allocator._tcmalloc_library()
    mode, new = allocator.environment(None, {"LD_PRELOAD": "/x.so"})
    assert mode == "tcmalloc" and new["LD_PRELOAD"] == lib + ":/x.so"
    assert allocator.environment(None, new)[1]["LD_PRELOAD"] == lib + ":/x.so"


def test_unknown_mode_and_missing_library_are_errors(monkeypatch):
    with pytest.raises(allocator.AllocatorError, match="choose one of tcmalloc, lean, tf"):
        allocator.environment(None, {allocator.ENV: "jemalloc"})
    monkeypatch.setattr(allocator, "_tcmalloc_library", lambda: None)
    with pytest.raises(allocator.AllocatorError, match="libtcmalloc-minimal4"):
        allocator.environment("tcmalloc", {})
    assert allocator.environment(None, {})[0] == "tf"  # the default falls back


@pytest.mark.skipif(not HAVE_TCMALLOC, reason="libtcmalloc-minimal4 not installed")
def test_ensure_reexecutes_under_tcmalloc_by_default():
    active, mapped, _, onednn, _ = _probe(None)
    assert (active, mapped, onednn) == ("tcmalloc", "True", "0")


def test_ensure_reexecutes_under_each_mode():
    active, mapped, tunables, onednn, _ = _probe("lean")
    assert (active, mapped, onednn) == ("lean", "False", "0")
    assert tunables.endswith(allocator.LEAN_TUNABLES)
    active, mapped, tunables, onednn, _ = _probe("tf")
    assert (active, mapped, tunables, onednn) == ("tf", "False", "", "")


def test_cli_names_a_bad_mode_in_one_line():
    env = dict(clean_env(), **{allocator.ENV: "bogus"})
    proc = subprocess.run([sys.executable, "-m", "flowpm_mtf.cli", "simulate", "--nc", "16"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "flowpm-mtf: error: FLOWPM_MTF_ALLOCATOR='bogus': choose one of tcmalloc, lean, tf"]
