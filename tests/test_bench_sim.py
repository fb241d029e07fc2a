"""scripts/bench_sim.py in a tiny configuration: ``migration`` (an eulerian then a lagrangian
``run``, 2 ranks each) once per module; its records are complete and the lagrangian one's
communication counts are consistent (a step moves exactly the bytes of its parts)."""
import json
import os
import subprocess
import sys

import pytest

from flowpm_bench.scripts import load_script
from test_mpi_jobs import clean_env

pytestmark = pytest.mark.single_process
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "bench_sim.py")
STEPS = 2
# Box side [Mpc/h] of the tiny runs: 25 Mpc/h cells, so the particles move ~1 cell and the
# lagrangian halo the eulerian run measures (~3-4 cells) stays within half the 8-cell block,
# where the halo's margins fold in place (halo.reduced_to_field) as the byte counts of
# test_step_bytes_are_the_sum_of_its_parts assume.
BOX = 400


@pytest.fixture(scope="module")
def migration(tmp_path_factory):
    """``bench_sim.py migration`` (tiny, on 2 ranks: the script's default grid is 2x2): the
    eulerian run with its automatic halo, then the lagrangian one with the halo the eulerian
    run measured it needs. Returns the output folder and the records."""
    out = tmp_path_factory.mktemp("bench_sim")
    cmd = [sys.executable, SCRIPT, "migration", "--nc", "16", "--box-size", str(BOX), "--steps",
           str(STEPS), "--repeats", "1", "--grid", "2x1", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out / "bench_migration.json") as f:
        return out, json.load(f)["records"]


@pytest.fixture(scope="module")
def record(migration):
    """The lagrangian run's record (``bench_sim.py run --decomposition lagrangian``)."""
    lag = migration[1][-1]
    assert lag["decomposition"] == "lagrangian" and "failed" not in lag, lag
    assert 2 * lag["halo"] <= 16 // 2, "halo %d: take a larger BOX" % lag["halo"]
    return lag


def test_record_complete(record):
    assert record["ranks"] == 2 and record["grid"] == [2, 1] and record["nc"] == 16
    assert len(record["steps_s"]) == STEPS and record["graph_build_s"] > 0
    for phase in ("step", "paint", "fft", "readout", "comm_halo", "comm_fft"):
        assert record["phase_s"][phase] > 0, phase
    assert len(record["peak_memory_mb"]) == 2 and min(record["peak_memory_mb"]) > 100


def test_step_bytes_are_the_sum_of_its_parts(record):
    b = {k: v[0] for k, v in record["received_bytes_per_rank"].items()}
    for k, v in record["received_bytes_per_rank"].items():
        assert len(v) == 2 and v[0] == v[1], (k, v)  # both ranks of a 2x1 grid alike
    # the kick/drift updates communicate nothing
    assert b["step"] == b["paint"] + b["fft"] + b["readout"]
    # the FFT's all-to-alls on grid 2x1: one transpose on the row axis for r2c (half
    # the spectrum, fft.FFT3DOperation._lower_half) and one for the inverse: of the
    # potential, half the spectrum (real-space path, gravity.force_field_of_potential),
    # or of the 3 force components packed into 2 complex fields (k-space path,
    # kernels.packed_inverse); each all-to-all's result is a whole complex64 block
    # (Horovod's accounting, the rank's own half included)
    real_space = record["force_path"] == "real space"
    block = 16 * 16 * 16 // 2 * 8
    assert b["fft"] == b["comm_fft"] == (1 / 2 + (1 / 2 if real_space else 2)) * block
    # halo exchange along x (row axis, 2 ranks; the 1-rank y axis wraps locally):
    # both margins of w cells x ny x nz float32 (halo.field_to_padded fills x before
    # the y margins exist; halo.reduced_to_field folds the y margins before x's);
    # paint = one reduce plus the int32 escape-count allreduce (4 bytes received),
    # readout = one fill (+ 4): of the potential, h + 2 cells (real space), or of the
    # three force components, h cells
    h = record["halo"]

    def slabs(w):
        return 2 * w * 16 * 16 * 4

    assert b["paint"] == slabs(h) + 4
    assert b["readout"] == (slabs(h + 2) if real_space else 3 * slabs(h)) + 4
    # the comm_halo phase reduces the padded form (halo_reduce): its x margins include
    # the y margins, h x (ny + 2h) x nz; its fill is the readout's (real space), or the
    # padded form's too (k-space, halo_fill)
    padded = 2 * h * (16 + 2 * h) * 16 * 4
    assert b["comm_halo"] == padded + (slabs(h + 2) if real_space else 3 * padded)
    # the suite requires the native ops (FLOWPM_MTF_NATIVE=require): the real-space path
    assert real_space or os.environ.get("FLOWPM_MTF_NATIVE") != "require"


def test_markdown_table(record):
    bench_sim = load_script("bench_sim")

    md = bench_sim.markdown({"machine": bench_sim.machine_info(), "command": "test",
                             "date": "now", "records": [record]})
    assert "| 16^3 | HvdSimdMeshImpl | 2 | 2x1 |" in md
    assert md.count("\n| 16^3 |") == 2  # both tables


def test_migration_benchmark_records_both_decompositions(migration):
    """Both records complete; the lagrangian run's halo is the one the eulerian run
    measured it needs (capped at the block side - 1)."""
    out, recs = migration
    assert [r["decomposition"] for r in recs] == ["eulerian", "lagrangian"]
    eul, lag = recs
    assert eul["halo"] == 2 and eul["grid"] == [2, 1] and eul["nc"] == 16
    assert "failed" not in lag, lag
    assert lag["halo"] == min(int(-(-eul["lagrangian_halo_needed_cells"] // 1)), 16 // 2 - 1)
    for r in recs:
        assert len(r["peak_memory_mb"]) == 2 and len(r["steps_s"]) == STEPS
    assert "| eulerian |" in (out / "bench_migration.md").read_text()


def test_migration_halo_is_the_measured_one_capped_below_the_block(tmp_path, monkeypatch):
    """The lagrangian run's --halo (launches recorded, not run): the eulerian run's measured
    need rounded up, capped at the block side - 1 (the tiny run above stays below the cap)."""
    bench_sim = load_script("bench_sim")
    for needed, want in ((3.2, 4), (9.5, 16 // 2 - 1)):
        cmds = []

        def fake_launch(cmd, path, timeout):
            cmds.append(cmd)
            return {"decomposition": cmd[cmd.index("--decomposition") + 1],
                    "lagrangian_halo_needed_cells": needed}

        monkeypatch.setattr(bench_sim, "_launch_record", fake_launch)
        monkeypatch.setattr(bench_sim, "_write_result", lambda out, name, recs, render: recs)
        bench_sim.cmd_migration(bench_sim.argparse.Namespace(
            nc=16, box_size=BOX, steps=STEPS, repeats=1, grid=(2, 1), lagrangian_halo=None,
            timeout=10, out=str(tmp_path)))
        assert [c[c.index("--decomposition") + 1] for c in cmds] == ["eulerian", "lagrangian"]
        assert "--halo" not in cmds[0]
        assert cmds[1][cmds[1].index("--halo") + 1] == str(want)
