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


@pytest.mark.skipif(not HAVE_TCMALLOC, reason="libtcmalloc-minimal4 not installed")
def test_tcmalloc_mode_keeps_freed_pages_unless_the_user_chose():
    assert allocator.environment("tcmalloc", {})[1][allocator.RELEASE_RATE_ENV] == "0"
    new = allocator.environment("tcmalloc", {allocator.RELEASE_RATE_ENV: "2.5"})[1]
    assert new[allocator.RELEASE_RATE_ENV] == "2.5"
    for mode in ("lean", "tf"):
        assert allocator.RELEASE_RATE_ENV not in allocator.environment(mode, {})[1]


@pytest.mark.skipif(not HAVE_TCMALLOC, reason="libtcmalloc-minimal4 not installed")
def test_tcmalloc_mode_puts_numpy_on_its_baseline_paths_unless_the_user_chose():
    mode, new = allocator.environment("tcmalloc", {})
    assert new[allocator.NUMPY_FEATURES_ENV] == allocator.numpy_dispatched_features()
    mode, new = allocator.environment("tcmalloc", {allocator.NUMPY_FEATURES_ENV: "AVX2"})
    assert new[allocator.NUMPY_FEATURES_ENV] == "AVX2"
    for mode in ("lean", "tf"):
        assert allocator.NUMPY_FEATURES_ENV not in allocator.environment(mode, {})[1]


# sin of 4096 float64 values written to an output that starts where the input ends
# (as tcmalloc places two blocks of one size class) and to one that does not: numpy 1.24
# takes its AVX-512 (SVML) loop for the second only (its overlap test counts touching
# arrays); the two differ in the last bit of about half the values.
ADJACENT_PROBE = (
    "from flowpm_mtf import allocator; allocator.ensure(); import numpy as np; "
    "x = np.linspace(0.01, 3.0, 4096); buf = np.empty(2 * x.size); buf[:x.size] = x; "
    "np.sin(buf[:x.size], out=buf[x.size:]); "
    "far = np.empty(x.size + 16)[8:-8]; np.sin(x, out=far); "
    "print(allocator.active(), int(np.sum(buf[x.size:] != far)), "
    "int(np.sum(far != [__import__('math').sin(v) for v in x])))")
# With numpy's fast paths on, at least this many of the 4096 values differ between the two
# outputs (measured here: ~half); fewer would not be the hazard this mode removes.
HAZARD_MIN_DIFFERING = 100


def _adjacent_probe(mode):
    env = {k: v for k, v in clean_env().items()
           if not k.startswith("FLOWPM_MTF_ALLOCATOR") and k != allocator.NUMPY_FEATURES_ENV}
    env.pop("LD_PRELOAD", None)
    env[allocator.ENV] = mode
    proc = subprocess.run([sys.executable, "-W", "error", "-c", ADJACENT_PROBE],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr   # -W error: numpy accepted the feature list
    active, differ, differ_libm = proc.stdout.split()
    return active, int(differ), int(differ_libm)


@pytest.mark.skipif(not HAVE_TCMALLOC, reason="libtcmalloc-minimal4 not installed")
def test_numpy_results_do_not_depend_on_where_tcmalloc_puts_the_output():
    active, differ, differ_libm = _adjacent_probe("tf")
    assert active == "tf"
    if differ == 0:
        pytest.skip("this machine's numpy has no heap-dependent code path for sin")
    assert differ > HAZARD_MIN_DIFFERING   # the hazard, with numpy's fast paths on
    active, differ, differ_libm = _adjacent_probe("tcmalloc")
    assert active == "tcmalloc" and differ == 0 and differ_libm == 0   # one path: the C library


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


def test_errors_are_config_errors_reported_like_the_others(monkeypatch):
    """An unknown mode is the same on every rank (printed once, by rank 0); a library
    missing on a host is that host's (every rank that lacks it prints its line)."""
    from flowpm_mtf.errors import ConfigError

    with pytest.raises(allocator.AllocatorError) as unknown:
        allocator.environment(None, {allocator.ENV: "jemalloc"})
    assert isinstance(unknown.value, ConfigError) and unknown.value.exit_code == 2
    assert unknown.value.same_on_every_rank
    monkeypatch.setattr(allocator, "_tcmalloc_library", lambda: None)
    with pytest.raises(allocator.AllocatorError) as missing:
        allocator.environment("tcmalloc", {})
    assert missing.value.exit_code == 2 and not missing.value.same_on_every_rank
