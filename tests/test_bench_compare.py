"""scripts/bench_compare.py (smoke run of every backend) and scripts/scaling_model.py.

The smoke run starts its own MPI jobs and TF cluster, so it runs in the 1-rank pass
only; the scaling-model unit tests are pure Python and the placement-mesh counter lives in
one process (rank_independent: the 1-rank pass runs them; on N ranks every rank would count
the same placement graph again).
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from flowpm_bench.launch import clean_env
from flowpm_bench.scripts import load_script, script_path

# The smoke run: 4 backends x 4 workloads at 16^3 on a 1x2 grid, one timed run each;
# about 100 s on a loaded 2-core machine. A hang is cut off here.
SMOKE_TIMEOUT_S = 600
# mpi4py-fft round trip in complex64 on O(1) values: float32 round-off (~1e-7 x log N).
FFT_ROUND_TRIP_TOL = 1e-5


sm = load_script("scaling_model")
bc = load_script("bench_compare")


# ============================================================================ smoke run
@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("bench"))
    proc = subprocess.run([sys.executable, script_path("bench_compare"),
                           "--backend", "all", "--smoke", "--out", out],
                          capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S,
                          env=clean_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    with open(os.path.join(out, "bench_compare.json")) as f:
        data = json.load(f)
    return out, data


@pytest.mark.single_process
def test_smoke_json_schema(smoke):
    out, data = smoke
    recs = data["records"]
    assert {"machine", "date", "command", "versions"} <= set(data["meta"])
    got = {(r["backend"], r["workload"]) for r in recs}
    want = {(b, w) for b in bc.MESH_BACKENDS for w in bc.WORKLOADS} | {("mpi4py-fft", "fft")}
    assert got == want
    for r in recs:
        assert r["nc"] == 16 and r["grid"] == [1, 2] and r["n"] == 2
        assert len(r["times_s"]) == 1 and r["median_s"] > 0 and r["first_run_s"] > 0
        assert r["build_s"] > 0
        assert r["rss_max_mb"] > 0 and len(r["rss_mb"]) == len(r["rss_roles"])
        assert r["bytes"]["wire_max"] > 0  # every workload communicates on a 1x2 grid
    cluster = [r for r in recs if r["backend"] == "cluster"]
    for r in cluster:  # master + 2 workers, each with its own peak memory
        assert r["rss_roles"] == ["master", "worker 0", "worker 1"]
    for r in recs:
        if r["backend"] == "hvd":
            assert len(r["rss_mb"]) == 2
    ref = [r for r in recs if r["backend"] == "mpi4py-fft"][0]
    assert ref["round_trip_max_abs_error"] < FFT_ROUND_TRIP_TOL
    md = open(os.path.join(out, "bench_compare.md")).read()
    assert md.count("\n| ") == len(recs) + 1  # header + one row per record
    for png in ("bench_time.png", "bench_memory.png"):
        assert os.path.getsize(os.path.join(out, png)) > 1000


@pytest.mark.single_process
def test_smoke_counted_bytes_equal_horovod_measurement(smoke):
    """The lowering-time count equals HvdSimdMeshImpl.comm_bytes_received on every rank."""
    _, data = smoke
    for r in data["records"]:
        if r["backend"] == "hvd":
            assert r["hvd_comm_bytes_received_per_rank"] == r["counted_all_per_rank"], r["workload"]


@pytest.mark.single_process
def test_smoke_bytes_match_the_model(smoke):
    """Model = measured (hvd) = counted (placement, cluster) exactly, per workload."""
    _, data = smoke
    for r in data["records"]:
        if r["backend"] == "mpi4py-fft":
            continue
        assert r["code"]["readouts_per_force"] == sm.READOUTS
        pred = sm.comm_bytes(r["workload"], r["nc"], r["grid"], r["halo"])
        assert r["bytes"]["recv_max"] == pred["recv"], (r["backend"], r["workload"])
        assert r["bytes"]["by_kind"] == pred["by_kind"], (r["backend"], r["workload"])
        assert r["bytes"]["wire_max"] == pytest.approx(pred["wire"], rel=1e-12)
        if r["backend"] == "hvd":
            meas, pred_total = sm.measured_vs_predicted_hvd(r)
            assert meas == pred_total, r["workload"]


@pytest.mark.single_process
def test_scaling_model_runs_on_smoke_json(smoke, tmp_path):
    out, _ = smoke
    doc = tmp_path / "scaling.md"
    doc.write_text("# prose kept\n")
    # the GPU tables for 1 and 8 GPUs (all counts: a growth integral per tried mesh, ~1200)
    assert sm.main(["--json", os.path.join(out, "bench_compare.json"), "--doc", str(doc),
                    "--gpus", "1,8"]) == 0
    text = doc.read_text()
    assert text.startswith("# prose kept\n") and sm.BEGIN in text and sm.END in text
    assert "Largest relative difference predicted vs measured/counted: 0.00e+00" in text
    assert "| 8 | 4x2 | " in text and "| 8 | 1024 | 1024^3 | " in text    # both GPU tables


# ============================================================================ model units
@pytest.mark.rank_independent
def test_fft_bytes_by_hand():
    # 16^3 on 1x2: one alltoall per FFT on 'col', each moving half (the half spectrum
    # of r2c / c2r) of the local complex64 slice of 16*8*16 values (8 bytes); forward
    # + inverse = 2 alltoalls.
    p = sm.comm_bytes("fft", 16, (1, 2), 2)
    assert p["recv"] == 2 * 16 * 8 * 16 * 8 // 2 and p["wire"] == p["recv"] / 2
    # the TensorFlow (GPU) path moves all the modes
    p = sm.comm_bytes("fft", 16, (1, 2), 2, half_spectrum=False)
    assert p["recv"] == 2 * 16 * 8 * 16 * 8
    # 2x2: two axes, each alltoall keeps 1/2 of the data local.
    p = sm.comm_bytes("fft", 32, (2, 2), 8)
    assert p["recv"] == 2 * 2 * (32**3 // 4) * 8 // 2 and p["wire"] == p["recv"] / 2
    # odd blocks (nc / Q = 5): the full spectrum
    p = sm.comm_bytes("fft", 10, (1, 2), 1)
    assert p["recv"] == 2 * 10 * 5 * 10 * 8
    assert sm.comm_bytes("nbody_step", 64, (1, 1), 8)["recv"] == 0  # one rank: no traffic


@pytest.mark.rank_independent
def test_halo_bytes_by_hand():
    # 2x1, nc 32, h 4: fill along x moves 2 slabs of h x (py = 32 + 8) x nz=32 floats; the
    # y axis is not split. fill + reduce = 2 ops.
    p = sm.comm_bytes("halo", 32, (2, 1), 4)
    assert p["by_kind"]["receive"] == 2 * 2 * 4 * 40 * 32 * 4 and p["by_kind"]["alltoall"] == 0
    # 2x2: x slabs h x py x nz plus y slabs px x h x nz, px = py = 16 + 8.
    p = sm.comm_bytes("halo", 32, (2, 2), 4)
    assert p["recv"] == 2 * 2 * 4 * 32 * 4 * (24 + 24)


@pytest.mark.rank_independent
def test_step_bytes_scale_with_ranks():
    """FFT volume per rank falls as 1/N; the halo volume falls only as 1/sqrt(N)."""
    f = [sm.comm_bytes("fft", 512, g, 8)["wire"] for g in ((2, 2), (8, 8))]
    h = [sm.comm_bytes("halo", 512, g, 8)["wire"] for g in ((2, 2), (8, 8))]
    assert f[1] / f[0] == pytest.approx((1 / 16) * (7 / 8 * 2) / (1 / 2 * 2))
    assert 0.2 < h[1] / h[0] < 0.3  # (64 + 16) / (256 + 16) ~ 0.29


@pytest.mark.rank_independent
def test_gpu_memory_is_the_preflight_model_of_the_rank_buffers():
    """Device memory per rank = overhead + bytes per slot x capacity + bytes per padded cell
    x padded block, with the one memory model (flowpm_mtf/runs/memory_model.json)."""
    from flowpm_mtf.runs import preflight
    from flowpm_mtf.physics import sizing
    from flowpm_mtf.config import SimConfig

    conf = SimConfig(nc=1024, box_size=512.0, grid=(8, 8))
    want = (sm.TF_OVERHEAD_GB * 2**30 + preflight.BYTES_PER_SLOT * sizing.capacity(conf)
            + preflight.BYTES_PER_PADDED_CELL * (128 + 4) * (128 + 4) * 1024)
    assert sm.gpu_memory_per_rank(1024, 64) == pytest.approx(want, rel=1e-12)
    assert sizing.capacity(conf) >= 1024**3 / 64  # a block holds at least its lattice share


@pytest.mark.rank_independent
def test_largest_mesh_grows_with_memory_and_ranks():
    small = sm.largest_nc(8, 40.0)
    assert sm.largest_nc(8, 80.0) > small
    assert sm.largest_nc(64, 40.0) > small
    nc = sm.largest_nc(64, 40.0)
    assert sm.gpu_memory_per_rank(nc, 64) <= sm.GPU_HEADROOM * 40 * 2**30
    assert sm.gpu_memory_per_rank(nc + 64, 64) > sm.GPU_HEADROOM * 40 * 2**30


@pytest.mark.rank_independent
def test_gpu_step_time_parts():
    t1 = sm.gpu_step_time(512, 8, 8, "A100-80GB")
    t2 = sm.gpu_step_time(1024, 64, 8, "A100-80GB")
    assert t1["total"] == pytest.approx(t1["comm"] + t1["fft"] + t1["particles"])
    assert t2["comm"] > t1["comm"]  # inter-node bandwidth is lower than NVLink
    assert t2["particles"] == pytest.approx(t1["particles"])  # same particles per rank


@pytest.mark.rank_independent
def test_write_doc_replaces_only_the_generated_block(tmp_path):
    doc = tmp_path / "d.md"
    doc.write_text("intro\n%s\nold\n%s\noutro\n" % (sm.BEGIN, sm.END))
    sm.write_doc(str(doc), "new table")
    assert doc.read_text() == "intro\n%s\nnew table\n%s\noutro\n" % (sm.BEGIN, sm.END)


@pytest.mark.rank_independent
def test_driver_rejects_bad_configuration(tmp_path):
    with pytest.raises(ValueError, match="does not divide"):
        bc.main(["--sizes", "30", "--grids", "4x4", "--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        bc.main(["--repeats", "3", "--out", str(tmp_path)])
    assert not os.listdir(tmp_path)  # nothing ran


@pytest.mark.rank_independent
def test_counter_on_a_placement_mesh():
    """CommCounter on PlacementMeshImpl: a 2x2 FFT round trip, per device."""
    import tensorflow.compat.v1 as tf

    tf.disable_eager_execution()
    import mesh_tensorflow as mtf

    conf = bc.make_conf(16, (2, 2), 2)
    with tf.Graph().as_default():
        impl = mtf.placement_mesh_impl.PlacementMeshImpl(conf.mesh_shape, conf.layout_rules,
                                                         [""] * 4)
        counter = bc.CommCounter(impl)
        bc.build_workload("fft", conf, impl, [""] * 4)
    recv, wire = counter.totals(timed_only=True)
    pred = sm.comm_bytes("fft", 16, (2, 2), 2)
    assert np.all(recv == pred["recv"]) and np.allclose(wire, pred["wire"])
