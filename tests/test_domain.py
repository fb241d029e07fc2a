"""Particle migration (flowpm_mtf.mesh.domain): exact data movement against a numpy
reference on every grid of the world size and on PlacementMeshImpl, overflow
detected before any loss (on every rank), escape detection, gradients."""
import mesh_tensorflow as mtf
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import fpm_harness as H
from flowpm_mtf import config as cfg
from flowpm_mtf.mesh import domain
from flowpm_mtf.physics import sizing
from flowpm_mtf.config import SimConfig
from flowpm_mtf.errors import CapacityError, ParticleEscapeError

NC = (8, 8, 4)
# Central differences of a bilinear loss in float64: truncation is zero, rounding ~1e-13.
FD_EPS = 1e-4
FD_RTOL = 1e-8



def native_and_tf(build, monkeypatch):
    """``build()`` with the native ops, then again with ``native.load`` patched out (the
    TensorFlow path), in one graph: ``(native tensors, TensorFlow tensors, their values)``."""
    from flowpm_mtf import native

    with tf.Graph().as_default():
        fast = build()
        monkeypatch.setattr(native, "load", lambda name: None)
        slow = build()
        with tf.Session() as sess:
            got, ref = sess.run([fast, slow])
    return fast, slow, got, ref


def conf_for(grid, **kw):
    """float64, 8x8x4 cells; capacity: the lattice count of a block + 24 (the tests fill
    fewer slots than that), 24 send rows."""
    cap = kw.pop("extra", 24)
    kw.setdefault("send_capacity", 24)
    conf = SimConfig(nc=NC, box_size=(80.0, 80.0, 40.0), grid=grid, dtype="float64", **kw)
    return conf.replace(capacity=conf.capacity or conf.particles_per_block + cap)


def make_particles(conf, n_valid, seed=0, reach=1.0):
    """Random block-local particles (quarter-cell positions: exact under +- s), with
    integer payloads and unique ids; the first ``n_valid[b]`` slots of block b are valid."""
    rng = np.random.RandomState(seed)
    (P, Q), (sx, sy, nz) = conf.grid, conf.block_shape
    cap = sizing.capacity(conf)
    x = np.zeros((P, Q, cap, 3))
    pay = np.zeros((P, Q, cap, 3))
    ids = -np.ones((P, Q, cap), np.int32)
    nxt = 0
    for i in range(P):
        for j in range(Q):
            n = n_valid[i, j]
            lo = -reach * np.array([sx, sy, 0])
            hi = np.array([sx, sy, nz]) * (1 + np.array([reach, reach, 0]))
            x[i, j, :n] = np.floor(rng.uniform(lo, hi, (n, 3)) * 4) / 4
            pay[i, j, :n] = np.arange(nxt * 3, (nxt + n) * 3).reshape(n, 3)
            ids[i, j, :n] = 1000 + 7 * np.arange(nxt, nxt + n)
            nxt += n
    return x, pay, ids


def reference(conf, x, pay, ids):
    """{id: (block i, block j, local position, payload)} after migration (numpy)."""
    (P, Q), (sx, sy, _) = conf.grid, conf.block_shape
    out = {}
    for i in range(P):
        for j in range(Q):
            for k in np.nonzero(ids[i, j] >= 0)[0]:
                g = x[i, j, k] + [i * sx, j * sy, 0]
                ti, tj = int(np.floor(g[0] / sx)) % P, int(np.floor(g[1] / sy)) % Q
                gl = g - [ti * sx, tj * sy, 0]
                gl[0] %= P * sx
                gl[1] %= Q * sy
                out[int(ids[i, j, k])] = (ti, tj, gl, pay[i, j, k])
    return out


def run_migrate(kind, conf, x, pay, ids, loss=False, send_rows=None):
    """A graph builder migrating ``x, pay, ids`` with ``send_rows`` send rows (default:
    :func:`flowpm_mtf.physics.sizing.send_capacity` of ``conf``, as the graph builders size them)."""
    (P, Q) = conf.grid
    rows = sizing.send_capacity(conf) if send_rows is None else send_rows
    cap = x.shape[2]
    pshape = mtf.Shape([mtf.Dimension(cfg.BX, P), mtf.Dimension(cfg.BY, Q),
                        mtf.Dimension(cfg.NPART, cap)])
    vshape = pshape + mtf.Shape([mtf.Dimension(cfg.XYZ, 3)])

    def build(mesh):
        phs = {}
        xt = H.placeholder_input(mesh, phs, "x", x, vshape)
        pt = H.placeholder_input(mesh, phs, "pay", pay, vshape)
        it = mtf.import_tf_tensor(mesh, tf.constant(ids), pshape)
        nx, (npay,), nids, stats = domain.migrate(conf, xt, [pt], it, send_rows=rows)
        out = {"x": nx, "pay": npay, "ids": nids, "stats": stats}
        if loss:
            out["loss"] = mtf.reduce_sum(nx * npay * npay)
            out["gx"], out["gp"] = mtf.gradients([out["loss"]], [xt, pt])
        return out, phs

    return build


def check_against_reference(conf, out, ref):
    (P, Q) = conf.grid
    seen = set()
    for i in range(P):
        for j in range(Q):
            for k in range(out["ids"].shape[2]):
                pid = int(out["ids"][i, j, k])
                if pid < 0:     # empty slot: all zero
                    assert not out["x"][i, j, k].any() and not out["pay"][i, j, k].any()
                    continue
                ti, tj, gl, pl = ref[pid]
                assert (i, j) == (ti, tj), pid
                np.testing.assert_array_equal(out["x"][i, j, k], gl)
                np.testing.assert_array_equal(out["pay"][i, j, k], pl)
                assert pid not in seen
                seen.add(pid)
    assert seen == set(ref)


@pytest.mark.parametrize("case", H.cases(single=True, placement=False), ids=H.case_id)
def test_migration_exact(case):
    """Every particle lands on the block that contains it, with its payload and id bit-exact."""
    conf = conf_for(case[1])
    (P, Q) = conf.grid
    n_valid = np.full((P, Q), 20) + np.arange(P * Q).reshape(P, Q)
    x, pay, ids = make_particles(conf, n_valid, seed=P * 10 + Q)
    out = H.run(case[0], conf, run_migrate(case[0], conf, x, pay, ids),
                feeds=[{"x": x, "pay": pay}])[0]
    check_against_reference(conf, out, reference(conf, x, pay, ids))
    st = dict(zip(domain.STATS, out["stats"]))
    assert st["outside"] == 0 and st["count"] <= sizing.capacity(conf)


@pytest.mark.parametrize("case", [c for c in H.cases(placement=False) if c[0] == "hvd" and max(c[1]) > 1],
                         ids=H.case_id)
def test_overflow_detected_on_every_rank(case):
    """A send buffer that is too small: every rank raises before anything is assigned,
    and the error names capacities that work (which then do). (On 1x1 nothing is sent.)"""
    conf = conf_for(case[1], send_capacity=2)
    (P, Q) = conf.grid
    x, pay, ids = make_particles(conf, np.full((P, Q), 30), seed=3)
    build = run_migrate(case[0], conf, x, pay, ids)
    with pytest.raises(tf.errors.InvalidArgumentError, match=domain.CHECK_MESSAGE) as err:
        H.run(case[0], conf, build, feeds=[{"x": x, "pay": pay}])
    exc = domain.error_from_tf(err.value, conf)
    assert isinstance(exc, CapacityError), exc
    conf2 = conf.replace(capacity=exc.capacity, send_capacity=exc.send_capacity)
    x2, pay2, ids2 = make_particles(conf2, np.full((P, Q), 30), seed=3)
    out = H.run(case[0], conf2, run_migrate(case[0], conf2, x2, pay2, ids2),
                feeds=[{"x": x2, "pay": pay2}])[0]
    check_against_reference(conf2, out, reference(conf2, x2, pay2, ids2))


@pytest.mark.parametrize("case", [c for c in H.cases(single=True, placement=False) if max(c[1]) > 1
                                  and c[0] != "placement"], ids=H.case_id)
def test_slot_overflow_is_a_capacity_error(case):
    """Full blocks exchanging particles: a block that would need more slots than it has is
    reported as a CapacityError naming a capacity that works (not as an escape)."""
    conf = conf_for(case[1], extra=2, send_capacity=200)
    (P, Q) = conf.grid
    cap = sizing.capacity(conf)
    x, pay, ids = make_particles(conf, np.full((P, Q), cap), seed=4)
    with pytest.raises(tf.errors.InvalidArgumentError, match=domain.CHECK_MESSAGE) as err:
        H.run(case[0], conf, run_migrate(case[0], conf, x, pay, ids), feeds=[{"x": x, "pay": pay}])
    exc = domain.error_from_tf(err.value, conf)
    assert isinstance(exc, CapacityError) and exc.capacity > cap, exc


@pytest.mark.parametrize("grid", [(1, 1), (2, 1), (1, 2), (2, 2)],
                         ids=lambda g: "x".join(map(str, g)))
def test_exchange_only_along_split_axes(grid):
    """Only axes split into several blocks get send buffers and shifts (a single block
    wraps its positions); a 1x1 grid has capacity N and no buffers at all."""
    conf = conf_for(grid)
    x, pay, ids = make_particles(conf, np.full(grid, 5))
    with tf.Graph().as_default():
        graph = mtf.Graph()
        mesh = mtf.Mesh(graph, "mesh")
        run_migrate("single", conf, x, pay, ids)(mesh)
        names = [op.name for op in graph.operations]
    for axis in (0, 1):
        sends = [n for n in names if n.endswith("_%s_send" % "xy"[axis])]
        assert bool(sends) == (grid[axis] > 1), (axis, sends)
    if grid == (1, 1):
        assert sizing.capacity(conf.replace(capacity=None)) == conf.particles_per_block
        assert not [n for n in names if "shift" in n.lower() or "merge" in n], names


@pytest.mark.rank_independent   # one process ("single"): the 1-rank pass
def test_too_few_send_rows_given_are_a_capacity_error():
    """The send rows are the caller's number (domain knows no sizing): too few of them
    fail the same check, on the rows given, and the error names a number that works."""
    conf = conf_for((2, 2))          # conf.send_capacity 24: not what the migration uses
    x, pay, ids = make_particles(conf, np.full((2, 2), 30), seed=3)
    with pytest.raises(tf.errors.InvalidArgumentError, match=domain.CHECK_MESSAGE) as err:
        H.run("single", conf, run_migrate("single", conf, x, pay, ids, send_rows=2),
              feeds=[{"x": x, "pay": pay}])
    assert "send_capacity 2)" in str(err.value)
    exc = domain.error_from_tf(err.value, conf)
    assert isinstance(exc, CapacityError) and exc.send_capacity > 2, exc
    out = H.run("single", conf, run_migrate("single", conf, x, pay, ids,
                                            send_rows=exc.send_capacity),
                feeds=[{"x": x, "pay": pay}])[0]
    check_against_reference(conf, out, reference(conf, x, pay, ids))


def _send_rows_of(graph, skip="migrate_lpt"):
    """The send rows of every migration of an mtf graph (but the ICs'), from its send ops."""
    return {d.size // 2 for op in graph.operations            # both directions in one buffer
            if op.name.endswith("_send") and not op.name.startswith(skip)
            for t in op.outputs for d in t.shape.dims if d.name == domain.SEND_DIM}


@pytest.mark.rank_independent
def test_send_rows_follow_the_run_stages():
    """The graph builders size the steps' send buffers from the stages they run (not from
    the default ones): fewer, later stages get sizing's number for those stages, forward
    and reverse; the default stages keep the number they always had."""
    from flowpm_mtf.gradients import adjoint
    from flowpm_mtf.physics import nbody
    from flowpm_mtf.jobs.nbody_run import SimulationGraph

    conf = SimConfig(nc=16, box_size=100.0, grid=(2, 1), n_steps=4, dtype="float64")
    late = [0.5, 0.75, 1.0]
    want, default = sizing.send_capacity(conf, stages=late), sizing.send_capacity(conf)
    assert want != default
    assert default == sizing.send_capacity(conf, stages=nbody.default_stages(conf))
    d = sizing.step_displacement_cells(conf, tuple(late))
    assert want == sizing.send_capacity(conf, d)
    for stages, rows in ((late, want), (None, default)):
        with tf.Graph().as_default():
            graph = mtf.Graph()
            mesh = mtf.Mesh(graph, "mesh")
            sim = SimulationGraph(conf, mesh, stages=stages)
            assert sim.send_rows == rows and _send_rows_of(graph) == {rows}
        with tf.Graph().as_default():
            graph = mtf.Graph()
            mesh = mtf.Mesh(graph, "mesh")
            adj = adjoint.AdjointGraph(conf, mesh, stages=stages)
            assert adj.send_rows == rows and _send_rows_of(graph) == {rows}


def test_escape_reported_with_steps():
    """A particle two blocks away is reported as a too-long time step."""
    conf = conf_for((2, 2), n_steps=5)
    x, pay, ids = make_particles(conf, np.full((2, 2), 5), seed=5)
    x[0, 0, 0, 0] = 2.5 * conf.block_shape[0]
    with pytest.raises(tf.errors.InvalidArgumentError, match=domain.CHECK_MESSAGE) as err:
        H.run("single", conf, run_migrate("single", conf, x, pay, ids),
              feeds=[{"x": x, "pay": pay}])
    exc = domain.error_from_tf(err.value, conf)
    assert isinstance(exc, ParticleEscapeError) and "time step" in str(exc), exc


@pytest.mark.parametrize("case", [c for c in H.cases(single=True, placement=False) if c[0] != "placement"],
                         ids=H.case_id)
def test_migration_gradient(case):
    """mtf.gradients through the migration (a permutation) against central differences."""
    conf = conf_for(case[1])
    (P, Q) = conf.grid
    x, pay, ids = make_particles(conf, np.full((P, Q), 20), seed=11)
    x = x + 0.125 * (ids[..., None] >= 0)        # away from block edges (FD steps stay inside)
    rng = np.random.RandomState(2)
    dx, dp = rng.randn(*x.shape), rng.randn(*pay.shape)
    valid = (ids >= 0)[..., None]
    dx, dp = dx * valid, dp * valid
    feeds = [{"x": x, "pay": pay}, {"x": x + FD_EPS * dx, "pay": pay + FD_EPS * dp},
             {"x": x - FD_EPS * dx, "pay": pay - FD_EPS * dp}]
    r0, rp, rm = H.run(case[0], conf, run_migrate(case[0], conf, x, pay, ids, loss=True),
                       feeds=feeds)
    fd = (rp["loss"] - rm["loss"]) / (2 * FD_EPS)
    an = float(np.sum(r0["gx"] * dx) + np.sum(r0["gp"] * dp))
    assert abs(fd - an) <= FD_RTOL * abs(an), (fd, an)


@pytest.mark.skipif(H.SIZE != 1, reason="in-process PlacementMeshImpl; 1-rank pass only")
def test_simulation_retries_with_larger_capacity(tmp_path):
    """The simulate job with a send buffer too small for the ICs: the overflow is caught,
    the job rebuilds with the capacities the error names and completes; the snapshot
    holds every particle once, sorted by id, and summary.json the load imbalance."""
    import json

    import h5py
    from flowpm_mtf import jobs
    from flowpm_mtf.jobs import runner
    from flowpm_mtf.jobs.simulate import SimulateOptions

    conf = SimConfig(nc=16, box_size=100.0, grid=(2, 1), n_steps=2, dtype="float64",
                     send_capacity=4)
    runner.run(jobs.get("simulate"), {"config": conf, "simulate": SimulateOptions()},
               H.backend("placement", conf), str(tmp_path), plot=False)
    with h5py.File(tmp_path / "snapshot.h5", "r") as f:
        # rows grouped by rank (empty slots dropped): every id exactly once
        np.testing.assert_array_equal(np.sort(f["id"][...]), np.arange(16**3))
        assert f["position"].shape == (16**3, 3)
    with open(tmp_path / "summary.json") as f:
        mig = json.load(f)["migration"]
    assert mig["send_capacity"] > 4 and mig["decomposition"] == "eulerian"
    assert len(mig["steps"]) == 3 and 1.0 <= mig["imbalance_max"] < 2.0


WRAP_EDGES = [0.0, -0.0, 1e-9, -1e-9, 5.999999, 6.0, -6.0, 12.0, 13.25, -13.25, 1e6 + 0.5,
              -1e6 - 0.5, 3.0, 1e-40, 3.9999998]


@pytest.mark.rank_independent
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_native_wrap_matches_the_tensorflow_path_bit_for_bit(dtype, monkeypatch):
    """FlowpmWrap (particle_ops.cc) gives the TF path's floats exactly, axis by axis (x and y
    wrapped into [0, 6) and [0, 4), z untouched), and its gradient is the identity."""
    from flowpm_mtf import native

    lib = native.load("particle_ops")
    if lib is None:
        pytest.skip("native ops not built")
    rng = np.random.RandomState(3)
    x = rng.uniform(-20, 20, (2, 1, 600, 3)).astype(dtype)
    x[0, 0, :len(WRAP_EDGES), :] = np.asarray(
        WRAP_EDGES, dtype)[:, None]
    sizes = (6, 4)
    with tf.Graph().as_default():
        xt = tf.constant(x)
        fast = domain._wrap_fn([0, 1], sizes)(xt)
        w = tf.constant(rng.normal(size=x.shape).astype(dtype))
        grad = tf.gradients(tf.reduce_sum(w * fast), xt)[0]
        monkeypatch.setattr(native, "load", lambda name: None)
        slow = domain._wrap_fn([0, 1], sizes)(xt)
        with tf.Session() as sess:
            got, ref, g, wv = sess.run([fast, slow, grad, w])
    assert "FlowpmWrap" in fast.op.type
    np.testing.assert_array_equal(got, ref)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(ref))     # -0 becomes +0
    assert (got[..., 0] >= 0).all() and (got[..., 0] < 6).all()
    assert (got[..., 1] >= 0).all() and (got[..., 1] < 4).all()
    np.testing.assert_array_equal(got[..., 2], x[..., 2])
    np.testing.assert_array_equal(g, wv)


@pytest.mark.rank_independent
@pytest.mark.parametrize("dtype,id_dtype", [(np.float32, np.int32), (np.float64, np.int64)])
def test_native_particle_stats_match_the_tensorflow_path(dtype, id_dtype, monkeypatch):
    """FlowpmParticleStats (particle_ops.cc) gives the TF path's per-block migration
    statistics exactly: 2x3 blocks of 4000 slots, a quarter empty, positions around the
    padded block's edges (floor(x) = -h - 1, -h, s + h - 2, s + h - 1 are hit), non-finite
    coordinates in valid and empty slots; with and without a displacement."""
    from flowpm_mtf import native

    if native.load("particle_ops") is None:
        pytest.skip("native ops not built")
    sx, sy, h = 6, 5, 2
    rng = np.random.RandomState(7)
    shape = (2, 3, 4000)
    x = rng.uniform(-h - 1.5, max(sx, sy) + h + 0.5, shape + (3,)).astype(dtype)
    ids = np.where(rng.uniform(size=shape) < 0.25, -1, np.arange(np.prod(shape)).reshape(shape))
    ids = ids.astype(id_dtype)
    for k, bad in enumerate([np.nan, np.inf, -np.inf]):     # in each coordinate, valid or not
        x[0, k, 10 + k, k] = bad
        x[1, k, 20 + k, (k + 1) % 3] = bad
    ids[1, 0, 20] = -1
    disp = rng.normal(0, 3, shape + (3,)).astype(dtype)
    fn = domain._particle_stats_fn((sx, sy, h))
    def build():
        args = [tf.constant(x), tf.constant(ids)]
        return [fn(*args, tf.constant(disp)), fn(*args)]

    fast, slow, got, ref = native_and_tf(build, monkeypatch)
    assert fast[0].op.type == "Reshape" and "FlowpmParticleStats" in fast[0].op.inputs[0].op.type
    for g, r in zip(got, ref):
        np.testing.assert_array_equal(g, r)
    # and against numpy: outside = valid with a non-finite coordinate or floor(x) out of
    # [-h, s + h - 2] along x or y
    with np.errstate(invalid="ignore"):
        fl = np.floor(x)
        bad = (~np.isfinite(x).all(-1) | (fl[..., 0] < -h) | (fl[..., 0] > sx + h - 2)
               | (fl[..., 1] < -h) | (fl[..., 1] > sy + h - 2))
    np.testing.assert_array_equal(got[0][..., 0], ((ids >= 0) & bad).sum(-1))
    np.testing.assert_array_equal(got[0][..., 1], (ids >= 0).sum(-1))
    np.testing.assert_array_equal(got[0][..., 2], np.abs(disp[..., :2]).max((-2, -1)))
    np.testing.assert_array_equal(got[1][..., 2], 0)
    assert 0 < got[0][..., 0].min() and got[0][..., 0].max() < got[0][..., 1].min()


@pytest.mark.rank_independent
def test_native_select_rows_match_the_tensorflow_path(monkeypatch):
    """FlowpmSelectRows (particle_ops.cc) gives _rows_of's rows and counts exactly (the
    migration's leavers and free slots): 3 blocks (one all false, one all true) of 5000
    slots, m from 0 to beyond the counts; and the rows against numpy."""
    from flowpm_mtf import native

    if native.load("particle_ops") is None:
        pytest.skip("native ops not built")
    rng = np.random.RandomState(11)
    nb, n = 3, 5000
    sel = rng.uniform(size=(nb, n)) < 0.05
    sel[1] = False
    sel[2] = True
    ms = [0, 1, 17, 300, 6000]
    fast, slow, got, ref = native_and_tf(
        lambda: [domain._rows_of(tf.constant(sel), m, nb) for m in ms], monkeypatch)
    assert fast[0][0].op.type == "FlowpmSelectRows"
    for m, (rows, count), (rrows, rcount) in zip(ms, got, ref):
        np.testing.assert_array_equal(rows, rrows)
        np.testing.assert_array_equal(count, rcount)
        for b in range(nb):
            want = b * n + np.nonzero(sel[b])[0][:m]
            np.testing.assert_array_equal(rows[b, :len(want)], want)
            assert (rows[b, len(want):] == -1).all()
            assert count[b] == sel[b].sum()


@pytest.mark.rank_independent
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_native_merge_matches_the_tensorflow_path(dtype, monkeypatch):
    """The merge of one field with FlowpmMaskRows (particle_ops.cc) gives the TF path's
    values and gradients (field and received rows) exactly; the plan's counts too."""
    from flowpm_mtf import native

    if native.load("particle_ops") is None:
        pytest.skip("native ops not built")
    rng = np.random.RandomState(5)
    c, rows, s = 3000, 40, 6
    x = rng.uniform(-1.5, s + 1.5, (1, 2, c, 3)).astype(dtype)
    ids = np.where(rng.uniform(size=(1, 2, c)) < 0.1, -1, 1).astype(np.int32)
    field = rng.normal(size=(1, 2, c, 3)).astype(dtype)
    recv = rng.normal(size=(1, 2, rows, 10)).astype(dtype)
    recv[..., -1] = rng.uniform(size=(1, 2, rows)) < 0.7
    dy = rng.normal(size=field.shape).astype(dtype)

    def build():
        xt, ft, rt = tf.constant(x), tf.constant(field), tf.constant(recv)
        keep, target, stats = domain._plan_fn(0, s)(xt, rt, tf.constant(ids))
        out = domain._merge_fn(3)(ft, rt, keep, target)
        return [out, stats, target] + tf.gradients(out, [ft, rt], grad_ys=tf.constant(dy))

    fast, slow, got, ref = native_and_tf(build, monkeypatch)
    types = {op.type for op in fast[0].graph.get_operations()}
    assert {"FlowpmMaskRows", "FlowpmScatterAddRows"} <= types, types
    for g, r in zip(got, ref):
        np.testing.assert_array_equal(g, r)
    valid = ids >= 0
    lo, hi = valid & (x[..., 0] < 0), valid & (x[..., 0] >= s)
    np.testing.assert_array_equal(got[1][..., 0], np.maximum(lo.sum(-1), hi.sum(-1)))
    np.testing.assert_array_equal(got[1][..., 2], (lo | hi).sum(-1))
    np.testing.assert_array_equal(got[1][..., 1], (valid & ~lo & ~hi).sum(-1)
                                  + (recv[..., -1] > 0.5).sum(-1))
    np.testing.assert_array_equal(got[3][~(valid & ~lo & ~hi)], 0)     # d field of leavers


@pytest.mark.rank_independent
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64])
def test_native_scatter_add_rows_matches_tensorflow(dtype, monkeypatch):
    """FlowpmScatterAddRows (particle_ops.cc) gives tf.tensor_scatter_nd_add's bits, with
    repeated rows (most updates into row 0, as the merge's unused rows), both when it
    runs in place and when its input is still read elsewhere (a copy); its gradient is
    TensorFlow's; the ids' merge (int32) agrees too; a row outside [0, N) is refused."""
    from flowpm_mtf import native

    if native.load("particle_ops") is None:
        pytest.skip("native ops not built")
    rng = np.random.RandomState(8)
    n, r, c = 5000, 700, 3
    rows = np.where(rng.uniform(size=r) < 0.6, 0, rng.randint(0, n, r)).astype(np.int32)
    x = (rng.normal(size=(n, c)) * 1e3).astype(dtype)
    upd = (rng.normal(size=(r, c)) * 1e3).astype(dtype)

    def build():
        xt, ut, it = tf.constant(x), tf.constant(upd), tf.constant(rows)
        fresh = xt * tf.ones([], xt.dtype)                 # only the op reads it: in place
        shared = xt + tf.zeros([], xt.dtype)               # read again below: a copy
        outs = [domain._scatter_add_rows(fresh, it, ut), domain._scatter_add_rows(shared, it, ut)]
        return outs + [shared]

    fast, slow, got, ref = native_and_tf(build, monkeypatch)
    assert fast[0].op.type == "FlowpmScatterAddRows" and slow[0].op.type == "TensorScatterAdd"
    for g, rr in zip(got, ref):
        np.testing.assert_array_equal(g, rr)
    np.testing.assert_array_equal(got[2], x)                # the shared input is unchanged
    want = x.copy()
    for k in range(r):
        want[rows[k]] = want[rows[k]] + upd[k]
    np.testing.assert_array_equal(got[0], want)
    monkeypatch.undo()
    with tf.Graph().as_default():
        bad = domain._scatter_add_rows(tf.constant(x), tf.constant(np.array([0, n], np.int32)),
                                       tf.constant(upd[:2]))
        with tf.Session() as sess, pytest.raises(tf.errors.InvalidArgumentError,
                                                 match="outside \\[0, %d\\)" % n):
            sess.run(bad)


@pytest.mark.rank_independent
def test_native_scatter_add_rows_gradient_dot_product():
    """<dy, J (dx, du)> = <J^T dy, (dx, du)> for FlowpmScatterAddRows (linear in x and the
    updates), float64, with repeated rows."""
    from flowpm_mtf import native

    if native.load("particle_ops") is None:
        pytest.skip("native ops not built")
    rng = np.random.RandomState(9)
    n, r = 400, 90
    rows = rng.randint(0, n // 4, r).astype(np.int32)
    x, u = rng.normal(size=(n, 3)), rng.normal(size=(r, 3))
    dx, du, dy = rng.normal(size=(n, 3)), rng.normal(size=(r, 3)), rng.normal(size=(n, 3))
    with tf.Graph().as_default():
        xt, ut = tf.constant(x), tf.constant(u)
        y = domain._scatter_add_rows(xt, tf.constant(rows), ut)
        assert y.op.type == "FlowpmScatterAddRows"
        gx, gu = tf.gradients(y, [xt, ut], grad_ys=tf.constant(dy))
        jvp = domain._scatter_add_rows(tf.constant(dx), tf.constant(rows), tf.constant(du))
        with tf.Session() as sess:
            gx, gu, jvp = sess.run([gx, gu, jvp])
    lhs = float(np.sum(dy * jvp))
    rhs = float(np.sum(gx * dx) + np.sum(gu * du))
    assert abs(lhs - rhs) <= 1e-12 * (abs(lhs) + 1.0), (lhs, rhs)
