"""The ICs' slot order (flowpm_mtf.layout.slot_tiles) and the op that fills it,
``FlowpmLatticeCombine`` (flowpm_mtf.lpt.lattice_combine): the native op against its
TensorFlow twin and an independent numpy construction, bit for bit; its registered
gradient (``FlowpmLatticeCombineGrad``) against the twin's TensorFlow gradient and by the
dot-product test of a linear map; bad inputs; and on the mesh (every grid of the world
size) the ICs' ids in the tile order of each block, matching their positions (the LPT
state against FlowPM by id is tests/test_lpt.py and tests/test_ics.py)."""
import mesh_tensorflow as mtf
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import fpm_harness as H
from flowpm_mtf import domain, layout, lpt, native
from flowpm_mtf.config import SimConfig

tf.disable_eager_execution()


def _slot_order_numpy(sx, sy, nz, tile):
    """Lattice index (row-major in the block) of the cell in each slot."""
    tx, ty, tz = tile
    idx = np.arange(sx * sy * nz).reshape(sx // tx, tx, sy // ty, ty, nz // tz, tz)
    return idx.transpose(0, 2, 4, 1, 3, 5).ravel()


def _combine_numpy(inputs, coeffs, tile, lattice):
    """The op's definition in numpy, in the inputs' dtype: ((a0 c0) + (a1 c1)) + ..., the
    lattice site added, rows moved to their slots."""
    out = None
    for a, c in zip(inputs, coeffs):
        term = a * a.dtype.type(c)
        out = term if out is None else out + term
    b, sx, sy, nz, C = out.shape
    if lattice:
        site = np.stack(np.meshgrid(np.arange(sx), np.arange(sy), np.arange(nz),
                                    indexing="ij"), -1).astype(out.dtype)
        out = out + site
    return out.reshape(b, sx * sy * nz, C)[:, _slot_order_numpy(sx, sy, nz, tile)]


CASES = [((1, 16, 16, 32, 3), (16, 16, 16), 2, True),
         ((2, 8, 4, 12, 3), (8, 4, 4), 1, True),
         ((1, 6, 10, 8, 3), (2, 2, 8), 2, False),
         ((3, 4, 4, 4, 2), (1, 1, 1), 2, False),
         ((1, 5, 3, 7, 3), (1, 1, 1), 1, True)]


@pytest.mark.skipif(H.SIZE != 1, reason="a single-process TensorFlow test")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape,tile,n,lattice", CASES)
def test_native_tf_numpy(shape, tile, n, lattice, dtype):
    """Native op, TensorFlow twin and numpy: the same bits (negative zeros and the
    lattice sites included); the gradient equals the twin's and passes the dot-product
    test <J v, dy> = <v, J^T dy> of the linear part."""
    lib = native.load("lpt_ops")
    rng = np.random.RandomState(sum(shape) + n)
    inputs = [rng.randn(*shape).astype(dtype) for _ in range(n)]
    inputs[0][0, 0, 0, 0, :] = -0.0
    coeffs = np.array([0.37, -1.9][:n], dtype)
    want = _combine_numpy(inputs, coeffs, tile, lattice)
    dy = rng.randn(*want.shape).astype(dtype)
    v = [rng.randn(*shape).astype(dtype) for _ in range(n)]
    with tf.Graph().as_default(), tf.Session() as sess:
        xs = [tf.constant(a) for a in inputs]
        cf, y = tf.constant(coeffs), tf.constant(dy)
        got_native = lib.flowpm_lattice_combine(xs, cf, tile=list(tile), lattice=lattice)
        got_tf = lpt.lattice_combine_tf(xs, cf, tile, lattice)
        g_native = tf.gradients(got_native, xs, grad_ys=[y])
        g_tf = tf.gradients(got_tf, xs, grad_ys=[y])
        lin = lib.flowpm_lattice_combine([tf.constant(a) for a in v], cf, tile=list(tile))
        out = sess.run([got_native, got_tf, g_native, g_tf, lin])
    got_n, got_t, gn, gt, jv = out
    np.testing.assert_array_equal(got_n, want)
    np.testing.assert_array_equal(got_t, want)
    assert np.array_equal(np.signbit(got_n), np.signbit(want))
    for a, b in zip(gn, gt):
        assert a.shape == shape
        np.testing.assert_array_equal(a, b)
    lhs = np.sum(jv.astype(np.float64) * dy)
    rhs = sum(np.sum(g.astype(np.float64) * w) for g, w in zip(gn, v))
    tol = (1e-5 if dtype == np.float32 else 1e-12) * np.sum(np.abs(jv.astype(np.float64) * dy))
    assert abs(lhs - rhs) <= tol, (lhs, rhs)


@pytest.mark.skipif(H.SIZE != 1, reason="a single-process TensorFlow test")
def test_native_threads_independent():
    """One and four threads of the intra-op pool write the same bits."""
    lib = native.load("lpt_ops")
    rng = np.random.RandomState(3)
    a, b = rng.randn(2, 32, 16, 64, 3).astype(np.float32), rng.randn(2, 32, 16, 64, 3).astype(
        np.float32)
    outs = []
    for threads in (1, 4):
        cfg = tf.ConfigProto(intra_op_parallelism_threads=threads,
                             inter_op_parallelism_threads=1)
        with tf.Graph().as_default(), tf.Session(config=cfg) as sess:
            op = lib.flowpm_lattice_combine([tf.constant(a), tf.constant(b)],
                                            tf.constant([0.5, 2.0], tf.float32),
                                            tile=[16, 16, 16], lattice=True)
            outs.append(sess.run(op))
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.skipif(H.SIZE != 1, reason="a single-process TensorFlow test")
def test_bad_input():
    """A tile that does not divide the block, inputs of different shapes, the wrong number
    of coefficients, the lattice on vectors of 2 components: one clear error each."""
    lib = native.load("lpt_ops")
    a = np.zeros((1, 4, 4, 6, 3), np.float32)
    cases = [
        (lambda: lib.flowpm_lattice_combine([a], [1.0], tile=[4, 4, 4]), "does not divide"),
        (lambda: lib.flowpm_lattice_combine([a, a[:, :2]], [1.0, 1.0], tile=[1, 1, 1]),
         "input 1 has the shape"),
        (lambda: lib.flowpm_lattice_combine([a], [1.0, 2.0], tile=[1, 1, 1]),
         "coeffs must be"),
        (lambda: lib.flowpm_lattice_combine([a[..., :2]], [1.0], tile=[1, 1, 1],
                                            lattice=True), "lattice needs C = 3"),
        (lambda: lib.flowpm_lattice_combine([a], [1.0], tile=[0, 1, 1]), "positive"),
    ]
    for make, message in cases:
        with tf.Graph().as_default(), tf.Session() as sess:
            with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match=message):
                sess.run(make())
    conf = SimConfig(nc=(8, 8, 8))
    with tf.Graph().as_default():
        mesh = mtf.Mesh(mtf.Graph(), "mesh")
        psi = mtf.zeros(mesh, mtf.Shape(layout.particle_dims(conf) + [mtf.Dimension("xyz", 3)]),
                        tf.float32)
        with pytest.raises(ValueError, match="2 displacements, 1 coefficients"):
            lpt.lattice_combine([psi, psi], [1.0], conf)
        with pytest.raises(ValueError, match="order must be"):
            domain.lattice_ids(conf, mesh, order="tiles")


def test_slot_tiles():
    """The largest power of two up to 16 dividing each side; lagrangian: the lattice."""
    assert layout.slot_tiles(SimConfig(nc=(64, 48, 40), grid=(2, 1))) == (16, 16, 8)
    assert layout.slot_tiles(SimConfig(nc=(12, 12, 10))) == (4, 4, 2)
    assert layout.slot_tiles(SimConfig(nc=(32, 32, 32), decomposition="lagrangian")) == (1, 1, 1)


@pytest.mark.parametrize("case", H.cases(), ids=H.case_id)
def test_ids_in_tile_order(case):
    """On every grid of the world size, each block's ids (``lattice_ids``) are its lattice
    sites in the tile order of ``slot_tiles`` ("slots") and in row-major order
    ("lattice"), against the numpy construction. (That the ICs' vectors sit in the slots
    of their ids: tests/test_lpt.py and tests/test_ics.py compare them by id against
    FlowPM on the same grids.)"""
    kind, grid = case
    conf = SimConfig(nc=(32, 16, 8), grid=grid, halo_size=2)
    out = H.run(kind, conf, lambda mesh: {
        "slots": domain.lattice_ids(conf, mesh),
        "lattice": domain.lattice_ids(conf, mesh, order="lattice")})
    P, Q = grid
    sx, sy, nz = conf.block_shape
    tile = layout.slot_tiles(conf)
    assert tile == (min(16, 32 // P), 16 // Q, 8)
    for name, t in (("slots", tile), ("lattice", (1, 1, 1))):
        got = np.asarray(out[name]).reshape(P, Q, -1)
        gi, gj, gk = np.unravel_index(_slot_order_numpy(sx, sy, nz, t), (sx, sy, nz))
        for bi in range(P):
            for bj in range(Q):
                want = ((gi + bi * sx) * conf.nc[1] + (gj + bj * sy)) * nz + gk
                np.testing.assert_array_equal(got[bi, bj], want)
