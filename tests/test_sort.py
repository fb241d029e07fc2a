"""Reordering the particles by column (``slots.sort_by_column``, ``--sort-every``): the native
``FlowpmSortByColumn`` and ``FlowpmPermuteRows`` against numpy (stable order, empty slots and
non-finite positions last, several blocks, every dtype), ``sort_by_column`` on every grid of
the world size against numpy and its TensorFlow path against the native one, the config's
checks, and a job reordered every step against the same job unsorted (the same particles; the
density and P(k) to rounding). Resume and other grids with reordering: tests/test_restart.py."""
import os
import tempfile

import h5py
import mesh_tensorflow as mtf
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import fpm_harness as H
from flowpm_mtf.mesh import slots
from flowpm_mtf import layout, native
from flowpm_mtf.config import SimConfig

tf.disable_eager_execution()


def _order_numpy(pos, ids, h, px, py):
    """The stable column order of one block (invalid last), numpy."""
    ok = (ids >= 0) & np.all(np.isfinite(pos), -1)
    cx = np.clip(np.floor(np.where(ok, pos[:, 0], 0)).astype(np.int64) + h, 0, px - 1)
    cy = np.clip(np.floor(np.where(ok, pos[:, 1], 0)).astype(np.int64) + h, 0, py - 1)
    key = np.where(ok, cx * py + cy, px * py)
    return np.argsort(key, kind="stable")


def _particles(rng, nb, n, sx, sy, nz, dtype):
    pos = np.stack([rng.uniform(-2.5, sx + 1.5, (nb, n)), rng.uniform(-2.5, sy + 1.5, (nb, n)),
                    rng.uniform(0, nz, (nb, n))], -1).astype(dtype)
    ids = rng.permutation(nb * n).reshape(nb, n)
    ids[:, ::5] = -1                       # empty slots (garbage positions)
    pos[:, 3, 0] = np.nan                  # a non-finite position
    pos[:, 4, 1] = 1e12                    # far outside: clipped column, still valid
    return pos, ids


@pytest.mark.skipif(H.SIZE != 1, reason="a single-process TensorFlow test")
@pytest.mark.parametrize("dtype,id_dtype", [(np.float32, np.int32), (np.float64, np.int64)])
def test_sort_and_permute_native_against_numpy(dtype, id_dtype):
    lib = native.load("particle_ops")
    rng = np.random.RandomState(3)
    nb, n, h, sx, sy, nz = 3, 70000, 2, 9, 7, 5     # > 2^16 per block: two chunks
    px, py = sx + 2 * h, sy + 2 * h
    pos, ids = _particles(rng, nb, n, sx, sy, nz, dtype)
    ids = ids.astype(id_dtype)
    extra = rng.randint(-9, 9, (nb, n, 2)).astype(np.int64)
    odd = rng.rand(nb, n, 5).astype(np.float32)     # 20-byte rows: the generic copy
    with tf.Graph().as_default(), tf.Session() as sess:
        order = lib.flowpm_sort_by_column(tf.constant(pos), tf.constant(ids), halo=h, px=px,
                                          py=py)
        out = sess.run([order] + lib.flowpm_permute_rows(order, [tf.constant(pos),
                                                                tf.constant(ids),
                                                                tf.constant(extra),
                                                                tf.constant(odd)]))
    got, ppos, pids, pextra, podd = out
    for b in range(nb):
        want = _order_numpy(pos[b], ids[b], h, px, py)
        np.testing.assert_array_equal(got[b], want)
        np.testing.assert_array_equal(ppos[b], pos[b][want])
        np.testing.assert_array_equal(pids[b], ids[b][want])
        np.testing.assert_array_equal(pextra[b], extra[b][want])
        np.testing.assert_array_equal(podd[b], odd[b][want])
    assert np.all(pids[:, -n // 5 - 2:] < 0) or np.isnan(ppos[:, -n // 5 - 2:]).any()
    assert not np.array_equal(got[0], np.arange(n))   # the order is not vacuous


@pytest.mark.skipif(H.SIZE != 1, reason="a single-process TensorFlow test")
def test_permute_rows_refuses_an_index_out_of_range():
    lib = native.load("particle_ops")
    with tf.Graph().as_default(), tf.Session() as sess:
        bad = lib.flowpm_permute_rows(tf.constant([[0, 3]], tf.int32),
                                      [tf.constant([[1.0, 2.0]])])
        with pytest.raises(tf.errors.InvalidArgumentError, match="outside"):
            sess.run(bad)


@pytest.mark.parametrize("case", H.cases(single=True), ids=H.case_id)
@pytest.mark.parametrize("native_local", [True, False])
def test_sort_by_column_on_every_grid(case, native_local, monkeypatch):
    """Each block's particles in the numpy order, every field and the ids moved with them; the
    TensorFlow path (as on a GPU) gives the same order."""
    kind, grid = case
    if not native_local:
        monkeypatch.setattr(slots, "_particle_ops", lambda *a, **k: None)
    conf = SimConfig(nc=16, grid=grid, halo_size=2, dtype="float64")
    gx, gy = conf.grid
    sx, sy, nz = conf.block_shape
    px, py, _ = conf.padded_block_shape
    n = 300
    rng = np.random.RandomState(8)
    pos, ids = _particles(rng, gx * gy, n, sx, sy, nz, np.float64)
    mom = rng.randn(gx * gy, n, 3)

    def build(mesh):
        bx, by, _ = layout.particle_dims(conf)
        npart = mtf.Dimension("npart", n)
        shape = mtf.Shape([bx, by, npart, mtf.Dimension(layout.XYZ, 3)])
        x = mtf.import_tf_tensor(mesh, tf.constant(pos.reshape(gx, gy, n, 3)), shape)
        p = mtf.import_tf_tensor(mesh, tf.constant(mom.reshape(gx, gy, n, 3)), shape)
        i = mtf.import_tf_tensor(mesh, tf.constant(ids.reshape(gx, gy, n).astype(np.int32)),
                                 mtf.Shape([bx, by, npart]))
        (x2, p2), i2 = slots.sort_by_column(conf, [x, p], i)
        return {"x": x2, "p": p2, "i": i2}

    out = H.run(kind, conf, build)
    for b in range(gx * gy):
        want = _order_numpy(pos[b], ids[b], conf.halo_size, px, py)
        r, c = divmod(b, gy)
        np.testing.assert_array_equal(out["i"][r, c], ids[b][want])
        np.testing.assert_array_equal(out["x"][r, c], pos[b][want])
        np.testing.assert_array_equal(out["p"][r, c], mom[b][want])


def test_sort_every_is_checked():
    assert SimConfig(nc=16).sort_every == 0
    assert SimConfig(nc=16, sort_every=3).sort_every == 3
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="sort_every"):
            SimConfig(nc=16, sort_every=bad)
    with pytest.raises(ValueError, match="lagrangian"):
        SimConfig(nc=16, decomposition="lagrangian", sort_every=2)


@pytest.mark.single_process   # the whole job in this process: once, in the 1-rank pass
def test_job_reordered_every_step_has_the_same_particles():
    """`simulate --sort-every 1` against `--sort-every 0` (float64, 6 steps): the same ids,
    positions and velocities to rounding (the paint sums in another order), the same density
    and P(k) to rounding; the snapshot of the reordered run is not in lattice order."""
    from flowpm_mtf import cli

    base = tempfile.mkdtemp(prefix="sort_job")
    snaps, pks = [], []
    for k in (0, 1):   # in this process: no launch (placement backend, one block)
        out = os.path.join(base, "s%d" % k)
        assert cli.main(["simulate", "--nc", "16", "--box-size", "100", "--steps", "6",
                         "--dtype", "float64", "--no-plot", "--sort-every", str(k), "--backend",
                         "placement", "--grid", "1x1", "--out", out]) == 0
        with h5py.File(os.path.join(out, "snapshot.h5"), "r") as f:
            snaps.append({k_: f[k_][...] for k_ in ("id", "position", "velocity", "density")})
        pks.append(np.loadtxt(os.path.join(out, "power.txt")))
    a, b = snaps
    assert not np.array_equal(a["id"], b["id"])
    oa, ob = np.argsort(a["id"]), np.argsort(b["id"])
    np.testing.assert_array_equal(a["id"][oa], b["id"][ob])
    dp = np.abs(a["position"][oa] - b["position"][ob])
    assert np.minimum(dp, 100.0 - dp).max() < 1e-9
    np.testing.assert_allclose(a["velocity"][oa], b["velocity"][ob], rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(a["density"], b["density"], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(pks[0][:, 1], pks[1][:, 1], rtol=1e-9)
