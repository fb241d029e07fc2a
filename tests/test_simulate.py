"""The main job, end to end: `flowpm-mtf simulate` on 2 MPI ranks (Horovod backend)
against the same job with Mesh TF's PlacementMeshImpl (run in the test's process)."""
import json
import os
import tempfile

import h5py
import numpy as np
import pytest

from test_cli import _mpirun

pytestmark = pytest.mark.single_process

ARGS = ["simulate", "--nc", "16", "--box-size", "100", "--steps", "2", "--halo", "4",
        "--seed", "7", "--dtype", "float64", "--no-plot"]
# Same graph, same seed, float64: only the order of floating-point sums differs between
# the backends (MPI vs in-process reductions), so positions agree to round-off.
BACKEND_POS_ATOL = 1e-8   # [Mpc/h], positions ~ 1e2
# Particle number is conserved by CIC painting: the mean of 1 + delta is 1 to round-off.
MEAN_DENSITY_TOL = 1e-10


@pytest.fixture(scope="module")
def runs():
    """The job on 2 ranks (hvd) and in this process (placement, the same 2x1 grid)."""
    from flowpm_mtf import cli

    out_h = tempfile.mkdtemp(prefix="sim_hvd")
    out_p = tempfile.mkdtemp(prefix="sim_pl")
    proc = _mpirun(2, *ARGS, "--out", out_h, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert cli.main([*ARGS, "--backend", "placement", "--grid", "2x1", "--out", out_p]) == 0
    return out_h, out_p, proc.stderr


def _snap(d):
    with h5py.File(os.path.join(d, "snapshot.h5"), "r") as f:
        return {k: f[k][...] for k in ("position", "velocity", "density")}, dict(f.attrs)


def test_outputs_well_formed(runs):
    out, _, log = runs
    snap, attrs = _snap(out)
    assert snap["position"].shape == (16**3, 3) and snap["velocity"].shape == (16**3, 3)
    assert snap["density"].shape == (16, 16, 16)
    assert np.all(snap["position"] >= 0) and np.all(snap["position"] < 100)
    assert abs(snap["density"].mean() - 1) < MEAN_DENSITY_TOL
    assert snap["density"].std() > 0.1  # structure formed
    assert json.loads(attrs["config"])["nc"] == [16, 16, 16]
    pk = np.loadtxt(os.path.join(out, "power.txt"))
    assert pk.shape[1] == 3 and np.all(np.diff(pk[:, 0]) > 0) and np.all(pk[:, 1] > 0)
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    assert len(summary["timings"]["steps_s"]) == 2
    # CPU time per step (all threads of the process), comparable on a loaded machine
    assert len(summary["timings"]["steps_cpu_s"]) == 2 and summary["timings"]["ics_cpu_s"] > 0
    assert len(summary["peak_memory_mb_per_rank"]) == 2
    # the snapshot's part files of both ranks (float64 run: 8 + 8 bytes per coordinate, 8 per id)
    write = summary["output_write"]
    assert write["bytes"] > 16**3 * (24 + 24 + 8) and write["seconds"] > 0
    assert write["files"][0]["file"] == "snapshot.h5" and write["gb_per_s"] > 0
    assert write["mode"] in ("direct", "buffered")    # O_DIRECT unless the file system refuses
    assert snap["position"].dtype == np.float64   # --dtype float64
    # progress is logged once (rank 0), per step
    assert log.count("step 1/2") == 1 and log.count("step 2/2") == 1


def test_hvd_equals_placement(runs):
    out_h, out_p, _ = runs
    a, _ = _snap(out_h)
    b, _ = _snap(out_p)
    d = np.abs(a["position"] - b["position"])
    d = np.minimum(d, 100 - d)  # periodic
    assert d.max() < BACKEND_POS_ATOL
    np.testing.assert_allclose(a["density"], b["density"], atol=1e-10)
