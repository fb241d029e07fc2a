"""scripts/bench_peers.py: its records (a small run of ``ours`` and of both graph builds)
and the derived columns of its Markdown.

The runs start their own TF process, and the graph builds run in this one on
COMM_WORLD (this process alone in the 1-rank pass), so they run in the 1-rank pass only; the
rendering and memory-accounting tests are pure Python (rank_independent: they run once,
in the 1-rank pass).
"""
import argparse
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from flowpm_bench import REPO
from flowpm_bench.launch import clean_env
from flowpm_bench.measure import private_mb
from flowpm_bench.peers import jaxpm_force
from flowpm_bench.scripts import load_script, script_path

SCRIPT = script_path("bench_peers")
# One process building and running 32^3 (2LPT, 2 steps) or a 16^3-per-device graph:
# well under a minute on a loaded 2-core machine; a hang is cut off here.
RUN_TIMEOUT_S = 600
# The FFT round trip c2r(r2c(rho)) of O(1) densities in float32.
FFT_ROUND_TRIP_TOL = 1e-4
# Touched pages of a fresh array show up in the private memory; the allocator may
# reuse a little memory freed earlier, so at least this fraction of the array.
PRIVATE_FRACTION = 0.9
# The native folder of the baseline revision of the build test: a stand-in op library (no
# TensorFlow header: it compiles in a fraction of a second, where one real op source takes
# ~10 CPU-s; the real sources' build is the set-up's, which every native-op test uses) with
# a header of its own and a declared compiler flag it refuses to compile without.
PROBE_HEADER = """#pragma once
inline int flowpm_probe_value() { return 42; }
"""
PROBE_SOURCE = """// The baseline-build test's stand-in op library (tests/test_bench_peers.py).
// CXXFLAGS: -DFLOWPM_PROBE_DECLARED_FLAG
#include "probe_ops.h"
#ifndef FLOWPM_PROBE_DECLARED_FLAG
#error "the source's declared CXXFLAGS did not reach the compiler"
#endif
extern "C" int flowpm_probe_ops() { return flowpm_probe_value(); }
"""

bp = load_script("bench_peers")


def _run(args, tmp_path, name):
    out = str(tmp_path / (name + ".json"))
    proc = subprocess.run([sys.executable, SCRIPT] + args + ["--json", out], capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S, env=clean_env(REPO))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    with open(out) as f:
        return json.load(f)


@pytest.mark.single_process
def test_ours_record_times_2lpt_alone(tmp_path):
    rec = _run(["ours", "--nc", "32", "--steps", "2"], tmp_path, "ours")
    assert rec["peer"] == "ours" and rec["nc"] == 32 and rec["ranks"] == 1
    for key in ("graph_build_s", "ics_s", "ics_warm_s", "lpt_s", "step_s", "fft_roundtrip_s"):
        assert rec[key] > 0, key
    assert len(rec["steps_s"]) == 2
    assert rec["lpt_cpu_s"] > 0 and rec["ics_cpu_s"] > 0
    assert rec["fft_roundtrip_cpu_s"] > 0 and rec["fft_repeats"] == 5
    assert rec["fft_roundtrip_max_err"] < FFT_ROUND_TRIP_TOL


@pytest.mark.single_process
def test_fft_pairs_runs_both_peers_and_writes_the_tables(tmp_path):
    """``fft-pairs``: separate launches of ours (``--fft-only``) and mpi4py-fft, each a round
    trip that returns its input (one pair; the order of the next pairs:
    test_fft_pairs_alternate_the_order)."""
    out = tmp_path / "res"
    proc = subprocess.run([sys.executable, SCRIPT, "fft-pairs", "--sizes", "16", "--ranks", "1",
                           "--repeat", "1", "--fft-repeats", "3", "--out", str(out)],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                          env=clean_env(REPO))
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out / "fft_pairs.json") as f:
        result = json.load(f)
    pairs = result["pairs"]
    assert [p["iteration"] for p in pairs] == [1]
    assert pairs[0]["order"] == ["ours", "mpi4py-fft"]
    for p in pairs:
        for peer in ("ours", "mpi4py-fft"):
            rec = p[peer]
            assert "error" not in rec, rec
            assert rec["fft_roundtrip_s"] > 0 and rec["fft_roundtrip_cpu_s"] > 0
            assert rec["fft_repeats"] == 3
            assert rec["fft_roundtrip_max_err"] < FFT_ROUND_TRIP_TOL
    # launched as the jobs are (--bind-to none): a lone rank gets every core this
    # process may use, not Open MPI's default of one
    assert pairs[0]["ours"]["cores_per_rank"] == len(os.sched_getaffinity(0))
    md = (out / "fft_pairs.md").read_text()
    assert "| 16³ | 1 | 1 |" in md


@pytest.mark.rank_independent
def test_fft_pairs_alternate_the_order(tmp_path, monkeypatch):
    """The launches of ``fft-pairs`` (recorded, not run): per iteration one pair per (size,
    ranks), the two peers back to back, ours first in odd iterations."""
    launched = []

    def fake_launch(cmd, path, timeout, pythonpath=None):
        peer = cmd[cmd.index(os.path.abspath(bp.__file__)) + 1]
        launched.append((peer, cmd[cmd.index("--nc") + 1], "--fft-only" in cmd))
        return {"fft_roundtrip_s": 0.01, "fft_roundtrip_cpu_s": 0.01, "fft_repeats": 3}

    monkeypatch.setattr(bp, "_launch", fake_launch)
    result = bp.cmd_fft_pairs(argparse.Namespace(
        out=str(tmp_path), repeat=3, sizes=[16], ranks=[1], fft_repeats=3, timeout=10))
    pairs = result["pairs"]
    assert [p["iteration"] for p in pairs] == [1, 2, 3]
    assert [p["order"] for p in pairs] == [["ours", "mpi4py-fft"], ["mpi4py-fft", "ours"],
                                           ["ours", "mpi4py-fft"]]
    assert launched == [("ours", "16", True), ("mpi4py-fft", "16", False),
                        ("mpi4py-fft", "16", False), ("ours", "16", True),
                        ("ours", "16", True), ("mpi4py-fft", "16", False)]
    assert "| 16³ | 1 | 3 |" in (tmp_path / "fft_pairs.md").read_text()


def _pair(it, ours, theirs, ours_cpu=None, theirs_cpu=None, nc=128, ranks=4):
    return {"iteration": it, "nc": nc, "ranks": ranks,
            "ours": {"fft_roundtrip_s": ours, "fft_roundtrip_cpu_s": ours_cpu, "grid": [2, 2]},
            "mpi4py-fft": {"fft_roundtrip_s": theirs, "fft_roundtrip_cpu_s": theirs_cpu}}


@pytest.mark.rank_independent
def test_fft_pairs_summary_takes_medians_over_the_pairs():
    pairs = [_pair(1, 0.030, 0.015, 0.06, 0.03),   # ratio 2.0, CPU 2.0
             _pair(2, 0.020, 0.016, 0.05, 0.04),   # 1.25, 1.25
             _pair(3, 0.026, 0.020, 0.07, 0.05),   # 1.3, 1.4
             _pair(4, 0.030, 0.020, 0.06, 0.02, ranks=2),  # 1.5, 3.0
             {"iteration": 5, "nc": 128, "ranks": 4,        # a failed launch: not counted
              "ours": {"error": "timeout after 900 s"}, "mpi4py-fft": {"fft_roundtrip_s": 0.01}}]
    rows = {r["ranks"]: r for r in bp.fft_pairs_summary(pairs)}
    four = rows[4]
    assert four["pairs"] == 3
    assert four["ratio_median"] == pytest.approx(1.3)
    assert (four["ratio_min"], four["ratio_max"]) == (pytest.approx(1.25), pytest.approx(2.0))
    assert four["cpu_ratio_median"] == pytest.approx(1.4)
    assert rows[2]["pairs"] == 1 and rows[2]["ratio_median"] == pytest.approx(1.5)
    md = bp.fft_pairs_markdown({"pairs": pairs, "machine": {}, "fft_repeats": 11})
    assert "| 128³ | 4 | 3 | 1.3 | 1.2-2 | 1.4 | yes |" in md    # 1.3 <= 1.5
    assert "| 128³ | 2 | 1 | 1.5 | 1.5-1.5 | 3 | yes |" in md
    assert "timeout after 900 s" in md
    slow = bp.fft_pairs_markdown({"pairs": [_pair(1, 0.04, 0.02)], "machine": {}})
    assert "| 128³ | 4 | 1 | 2 | 2-2 | – | no |" in slow


def _run_here(args, tmp_path, name):
    """``bench_peers.py ARGS --json PATH`` in this process (its ``main``); the record."""
    out = str(tmp_path / (name + ".json"))
    assert bp.main(args + ["--json", out]) == 0
    with open(out) as f:
        return json.load(f)


@pytest.mark.single_process
def test_build_records_have_cpu_time_and_private_memory(tmp_path):
    """``build-hvd`` (one rank) and ``build-placement --n 2``, each run by the script's
    ``main`` in this process: a build runs no session, and a launch would add only
    TensorFlow's start-up (single_process: COMM_WORLD is this process alone)."""
    hvd = _run_here(["build-hvd"], tmp_path, "hvd")
    pl = _run_here(["build-placement", "--n", "2"], tmp_path, "placement")
    assert hvd["backend"] == "HvdSimdMeshImpl" and hvd["ranks"] == 1
    assert pl["backend"] == "PlacementMeshImpl" and pl["ranks"] == 2
    for rec in (hvd, pl):
        assert rec["build_s"] > 0 and rec["build_cpu_s"] > 0
        # private memory is part of the resident memory
        assert 0 < max(rec["private_memory_mb"]) <= max(rec["peak_memory_mb"])


@pytest.mark.rank_independent
def test_private_mb_counts_touched_memory():
    before = private_mb()
    a = np.ones(256 * 2**20 // 8)  # 256 MB, every page touched
    grown = private_mb() - before
    assert grown >= PRIVATE_FRACTION * 256, grown
    del a


@pytest.mark.rank_independent
def test_markdown_derives_the_ratios():
    ours = {"peer": "ours", "code": "current", "nc": 64, "ranks": 1, "step_s": 0.2,
            "step_cpu_s": 0.2, "ics_s": 0.7, "ics_warm_s": 0.6, "ics_cpu_s": 0.6,
            "lpt_s": 0.3, "fft_roundtrip_s": 0.01, "peak_memory_mb": [500.0],
            "graph_build_s": 1.0, "load_avg_1min": 0.5}
    build = [{"peer": "build", "backend": "HvdSimdMeshImpl", "ranks": 64, "build_s": 60.0,
              "build_cpu_s": 2.0, "private_memory_mb": [250.0, 240.0]},
             {"peer": "build", "backend": "PlacementMeshImpl", "ranks": 64, "build_s": 130.0,
              "build_cpu_s": 120.0, "private_memory_mb": [2700.0]}]
    recs = {bp._key(r): r for r in [ours] + build}
    md = bp.markdown({"records": recs, "machine": {}})
    row = [line for line in md.splitlines() if line.startswith("| 64³ | current | 1 |")]
    assert len(row) == 1
    cells = [c.strip() for c in row[0].strip("|").split("|")]
    header = [line for line in md.splitlines() if "| 2LPT / step |" in line][0]
    names = [c.strip() for c in header.strip("|").split("|")]
    assert cells[names.index("2LPT")] == "0.3"
    assert cells[names.index("2LPT / step")] == "1.5"       # 0.3 / 0.2
    assert cells[names.index("ICs / step")] == "3.5"        # 0.7 / 0.2
    build_row = [line for line in md.splitlines() if line.startswith("| 64 |")]
    assert len(build_row) == 1
    cells = [c.strip() for c in build_row[0].strip("|").split("|")]
    assert cells[2] == "2" and cells[4] == "120" and cells[5] == "60"   # 120 / 2
    assert cells[6] == "250" and cells[7] == "2700"                      # the largest rank


@pytest.mark.rank_independent
def test_records_carry_their_stack_in_the_code_column():
    """Our records without a stack were TF 2.12's: normalise labels them "current tf2.12"
    (key and code), next to the default stack's "current" of the same case."""
    old = {"peer": "ours", "code": "current", "nc": 64, "ranks": 1}
    base = {"peer": "ours", "code": "baseline abc", "nc": 64, "ranks": 1}
    new = {"peer": "ours", "code": bp.code_label("current", "tf2.21"), "nc": 64, "ranks": 1,
           "stack": "tf2.21"}
    jax = {"peer": "jaxpm", "nc": 64, "ranks": 1}
    res = bp.normalise({"records": {bp._key(r): dict(r) for r in (old, base, jax)}})
    res["records"][bp._key(new)] = new
    codes = sorted(r.get("code", "-") for r in res["records"].values())
    assert codes == ["-", "baseline abc tf2.12", "current", "current tf2.12"]
    assert set(res["records"]) == {bp._key(r) for r in res["records"].values()}
    assert bp.code_label("baseline x", "tf2.12") == "baseline x tf2.12"
    assert "stack" not in res["records"][bp._key(jax)]   # not ours: no stack of ours


@pytest.mark.single_process
def test_baseline_tree_gets_its_native_ops_built(tmp_path, monkeypatch):
    """A --baseline tree is extracted with ``git archive`` (no built libraries): without
    the build its runs would silently take the TF path.

    The baseline is a commit of a clone of this repository whose native folder holds one
    stand-in source instead of the real ones (PROBE_SOURCE, with its header and a declared
    compiler flag): ``baseline_code`` builds whatever sources a revision has, the same way
    for each, and compiling the real ones would make this test the suite's longest compile
    for no other check."""
    repo = tmp_path / "repo"
    subprocess.run(["git", "clone", "-q", REPO, str(repo)], check=True)
    git = ["git", "-C", str(repo), "-c", "user.name=test", "-c", "user.email=test@localhost"]
    native_dir = os.path.join("flowpm_mtf", "native")
    dropped = sorted(os.path.join(native_dir, f) for f in os.listdir(repo / native_dir)
                     if f.endswith(".cc"))
    subprocess.run(git + ["rm", "-q", "--"] + dropped, check=True)
    (repo / native_dir / "probe_ops.h").write_text(PROBE_HEADER)
    (repo / native_dir / "probe_ops.cc").write_text(PROBE_SOURCE)
    subprocess.run(git + ["add", "--", os.path.join(native_dir, "probe_ops.h"),
                          os.path.join(native_dir, "probe_ops.cc")], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "baseline with a stand-in native source"],
                   check=True)
    monkeypatch.setattr(bp, "REPO", str(repo))
    out = bp.baseline_code("HEAD")
    native = os.path.join(out, "flowpm_mtf", "native")
    sources = sorted(f[:-3] for f in os.listdir(native) if f.endswith(".cc"))
    assert sources == ["probe_ops"]
    from flowpm_mtf.native import tf_version

    lib = os.path.join(native, "libprobe_ops.tf%s.so" % tf_version())
    assert os.path.getsize(lib) > 0
    # The baseline's own package loads every library as up to date (require: else an error;
    # its stamp covers the header), and the library is the one built from the source.
    code = ("import ctypes, flowpm_mtf.native as n; print(n.__file__); "
            "print(all(n.load(s) is not None for s in n.names())); "
            "print(ctypes.CDLL(n.library_path('probe_ops')).flowpm_probe_ops())")
    env = dict(clean_env(out), FLOWPM_MTF_NATIVE="require")
    proc = subprocess.run([sys.executable, "-c", code], cwd=out, capture_output=True, text=True,
                          env=env, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-2000:]
    path, ok, value = proc.stdout.split()
    assert path.startswith(out) and ok == "True" and value == "42"


@pytest.mark.rank_independent
def test_jaxpm_program_compiles_and_has_a_cli():
    """The JaxPM peer (run by path in JaxPM's own virtualenv) is valid Python with a CLI,
    and imports neither TensorFlow nor our packages (it cannot, in that venv)."""
    path = bp.JAXPM_PROGRAM
    assert os.path.isfile(path)
    proc = subprocess.run([sys.executable, "-m", "py_compile", path], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run([sys.executable, path, "--help"], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    assert "nc" in proc.stdout and "out" in proc.stdout
    code = ("import importlib.util as u, sys; s = u.spec_from_file_location('j', %r); "
            "s.loader.exec_module(u.module_from_spec(s)); "
            "print(sorted({k.split('.')[0] for k in sys.modules} & "
            "{'tensorflow', 'flowpm_mtf', 'flowpm_bench', 'hvd_mesh_impl', 'jax'}))" % path)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.rank_independent
def test_jaxpm_lattice_is_a_perturbed_periodic_lattice():
    nc = 8
    pos = jaxpm_force.perturbed_lattice(nc)
    assert pos.shape == (nc**3, 3) and pos.dtype == np.float32
    assert pos.min() >= 0 and pos.max() < nc
    q = np.stack(np.meshgrid(*[np.arange(nc)] * 3, indexing="ij"), -1).reshape(-1, 3)
    d = (pos - q + nc / 2) % nc - nc / 2   # periodic offset from the lattice site
    assert 0.5 < d.std() < 1.5               # N(0, 1) offsets
    np.testing.assert_array_equal(pos, jaxpm_force.perturbed_lattice(nc))  # seeded
