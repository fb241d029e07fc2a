"""The ICs' slot order (flowpm_mtf.layout.slot_tiles) and the op that fills it,
``FlowpmLatticeCombine`` (flowpm_mtf.physics.lpt.lattice_combine): the native op against its
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
from flowpm_mtf.mesh import domain
from flowpm_mtf import layout, native
from flowpm_mtf.physics import lpt
from flowpm_mtf.config import SimConfig

tf.disable_eager_execution()


def _slot_order_numpy(sx, sy, nz, tile):
    """Lattice index (row-major in the block) of the cell in each slot."""
    tx, ty, tz = tile
    idx = np.arange(sx * sy * nz).reshape(sx // tx, tx, sy // ty, ty, nz // tz, tz)
    return idx.transpose(0, 2, 4, 1, 3, 5).ravel()


def _combine_numpy(inputs, coeffs, tile, lattice_output):
    """The op's definition in numpy, in the inputs' dtype: output m = ((a0 c[m, 0]) +
    (a1 c[m, 1])) + ..., the lattice site added to output ``lattice_output``, rows moved
    to their slots."""
    outs = []
    for m, row in enumerate(coeffs):
        out = None
        for a, c in zip(inputs, row):
            term = a * a.dtype.type(c)
            out = term if out is None else out + term
        b, sx, sy, nz, C = out.shape
        if m == lattice_output:
            site = np.stack(np.meshgrid(np.arange(sx), np.arange(sy), np.arange(nz),
                                        indexing="ij"), -1).astype(out.dtype)
            out = out + site
        outs.append(out.reshape(b, sx * sy * nz, C)[:, _slot_order_numpy(sx, sy, nz, tile)])
    return outs


# (shape, tile, N inputs, M outputs, lattice_output)
CASES = [((1, 16, 16, 32, 3), (16, 16, 16), 2, 2, 0),
         ((2, 8, 4, 12, 3), (8, 4, 4), 2, 3, 0),
         ((1, 6, 10, 8, 3), (2, 2, 8), 2, 1, -1),
         ((3, 4, 4, 4, 2), (1, 1, 1), 2, 2, -1),
         ((1, 5, 3, 7, 3), (1, 1, 1), 1, 2, 1)]
COEFFS = np.array([[0.37, -1.9], [2.5, 0.125], [-0.7, 3.3]])


@pytest.mark.skipif(H.SIZE != 1, reason="a single-process TensorFlow test")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape,tile,n,m,lat", CASES)
def test_native_tf_numpy(shape, tile, n, m, lat, dtype):
    """Native op (its inputs held elsewhere, and not: each output then takes the memory
    of its input), TensorFlow twin and numpy: the same bits (negative zeros and the
    lattice sites included); the gradient equals the twin's to rounding and passes the
    dot-product test <J v, dy> = <v, J^T dy> of the linear part."""
    lib = native.load("lpt_ops")
    rng = np.random.RandomState(sum(shape) + n + m)
    inputs = [rng.randn(*shape).astype(dtype) for _ in range(n)]
    inputs[0][0, 0, 0, 0, :] = -0.0
    coeffs = COEFFS[:m, :n].astype(dtype)
    want = _combine_numpy(inputs, coeffs, tile, lat)
    dys = [rng.randn(*want[0].shape).astype(dtype) for _ in range(m)]
    v = [rng.randn(*shape).astype(dtype) for _ in range(n)]
    with tf.Graph().as_default(), tf.Session() as sess:
        xs = [tf.constant(a) for a in inputs]
        cf = tf.constant(coeffs)
        ys = [tf.constant(d) for d in dys]
        held = lib.flowpm_lattice_combine(xs, cf, tile=list(tile), M=m, lattice_output=lat)
        fresh = [x * dtype(1) for x in xs]           # consumed by the op alone: forwarded
        free = lib.flowpm_lattice_combine(fresh, cf, tile=list(tile), M=m, lattice_output=lat)
        got_tf = lpt.lattice_combine_tf(xs, cf, tile, lat)
        g_native = tf.gradients(held, xs, grad_ys=ys)
        g_tf = tf.gradients(got_tf, xs, grad_ys=ys)
        lin = lib.flowpm_lattice_combine([tf.constant(a) for a in v], cf, tile=list(tile), M=m)
        g_twin = lpt.lattice_combine_grad_tf(ys, cf, tile, list(shape[1:4]))
        g_op = lib.flowpm_lattice_combine_grad(ys, cf, tile=list(tile), block=list(shape[1:4]),
                                               N=n)
        out = sess.run([held, free, got_tf, g_native, g_tf, lin, g_twin, g_op])
    got_held, got_free, got_t, gn, gt, jv, gtw, gop = out
    for a, b in zip(gop, gtw):       # the grad op and its twin: the same sums, same bits
        np.testing.assert_array_equal(a, b)
    for k in range(m):
        np.testing.assert_array_equal(got_held[k], want[k])
        np.testing.assert_array_equal(got_free[k], want[k])
        np.testing.assert_array_equal(got_t[k], want[k])
        assert np.array_equal(np.signbit(got_held[k]), np.signbit(want[k]))
    eps = 1e-6 if dtype == np.float32 else 1e-14
    for a, b in zip(gn, gt):
        assert a.shape == shape
        np.testing.assert_allclose(a, b, rtol=0, atol=eps * 10 * np.max(np.abs(b)))
    lhs = sum(np.sum(j.astype(np.float64) * d) for j, d in zip(jv, dys))
    rhs = sum(np.sum(g.astype(np.float64) * w) for g, w in zip(gn, v))
    scale = sum(np.sum(np.abs(j.astype(np.float64) * d)) for j, d in zip(jv, dys))
    assert abs(lhs - rhs) <= (1e-5 if dtype == np.float32 else 1e-12) * scale, (lhs, rhs)


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
            op = lib.flowpm_lattice_combine([tf.constant(a) * 1.0, tf.constant(b) * 1.0],
                                            tf.constant([[0.5, 2.0], [1.5, -1.0]], tf.float32),
                                            tile=[16, 16, 16], M=2, lattice_output=0)
            outs.append(sess.run(op))
    for x, y in zip(*outs):
        np.testing.assert_array_equal(x, y)


@pytest.mark.skipif(H.SIZE != 1, reason="a single-process TensorFlow test")
def test_bad_input():
    """A tile that does not divide the block, inputs of different shapes, the wrong number
    of coefficients, the lattice on vectors of 2 components: one clear error each."""
    lib = native.load("lpt_ops")
    a = np.zeros((1, 4, 4, 6, 3), np.float32)
    cases = [
        (lambda: lib.flowpm_lattice_combine([a], [[1.0]], tile=[4, 4, 4], M=1),
         "does not divide"),
        (lambda: lib.flowpm_lattice_combine([a, a[:, :2]], [[1.0, 1.0]], tile=[1, 1, 1], M=1),
         "input 1 has the shape"),
        (lambda: lib.flowpm_lattice_combine([a], [[1.0, 2.0]], tile=[1, 1, 1], M=1),
         "coeffs must be"),
        (lambda: lib.flowpm_lattice_combine([a[..., :2]], [[1.0]], tile=[1, 1, 1], M=1,
                                            lattice_output=0), "lattice needs C = 3"),
        (lambda: lib.flowpm_lattice_combine([a], [[1.0]], tile=[0, 1, 1], M=1), "positive"),
        (lambda: lib.flowpm_lattice_combine([a], [[1.0]], tile=[1, 1, 1], M=1,
                                            lattice_output=1), "is not an output"),
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
        with pytest.raises(ValueError, match="rows of 2"):
            lpt.lattice_combine([psi, psi], [[1.0]], conf)
        with pytest.raises(ValueError, match="not one of the 1 outputs"):
            lpt.lattice_combine([psi], [[1.0]], conf, lattice_output=1)
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


# FlowpmLatticeCombinePotentials: (block (B, sx, sy, nz), tile, margins, M outputs, lattice)
POT_CASES = [((1, 16, 16, 32), (16, 16, 16), (4, 2), 2, 0),
             ((2, 8, 4, 12), (8, 4, 4), (4, 2), 3, 0),
             ((1, 6, 10, 4), (2, 2, 4), (2, 3), 1, -1),
             ((3, 4, 4, 7), (1, 1, 1), (2,), 2, 1),
             ((1, 16, 8, 32), (16, 8, 16), (0, 0), 2, 0),      # one block, read periodically
             ((2, 3, 6, 4), (1, 2, 4), (0,), 1, 0)]
GRAD_COEFFS = np.array([0.21, -1.3, 0.6])


def _potentials(block, margins, dtype, rng):
    b, sx, sy, nz = block
    return [rng.randn(b, sx + 2 * m, sy + 2 * m, nz).astype(dtype) for m in margins]


@pytest.mark.skipif(H.SIZE != 1, reason="a single-process TensorFlow test")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("block,tile,margins,m,lat", POT_CASES)
def test_potentials_native_composed_tf(block, tile, margins, m, lat, dtype):
    """``FlowpmLatticeCombinePotentials`` against the ops it fuses (``FlowpmGradient`` of
    each potential, then ``FlowpmLatticeCombine``, then ``FlowpmWrap`` of the positions along
    x and z when there is a lattice output) and against its TensorFlow twin: the same bits;
    its registered gradient against the twin's TensorFlow gradient to rounding, and by the
    dot-product test <J v, dy> = <v, J^T dy> (the map is linear without the lattice)."""
    from flowpm_mtf.physics import gravity
    lpt_lib, cic_lib = native.load("lpt_ops"), native.load("cic_ops")
    particle_lib = native.load("particle_ops")
    wrap = [float(block[1]), 0.0, float(block[3])] if lat >= 0 else [0.0, 0.0, 0.0]
    rng = np.random.RandomState(sum(block) + m + len(margins))
    phis = _potentials(block, margins, dtype, rng)
    v = _potentials(block, margins, dtype, rng)
    n = len(margins)
    coeffs = COEFFS[:m, :n].astype(dtype)
    gc = GRAD_COEFFS.astype(dtype)
    npart = int(np.prod(block[1:]))
    dys = [rng.randn(block[0], npart, 3).astype(dtype) for _ in range(m)]
    with tf.Graph().as_default(), tf.Session() as sess:
        xs = [tf.constant(p) for p in phis]
        cf, g = tf.constant(coeffs), tf.constant(gc)
        fused = lpt_lib.flowpm_lattice_combine_potentials(xs, g, cf, [], tile=list(tile),
                                                          margins=list(margins), M=m,
                                                          lattice_output=lat, wrap=wrap)
        psis = [cic_lib.flowpm_gradient(x, g, margin=mg) for x, mg in zip(xs, margins)]
        composed = list(lpt_lib.flowpm_lattice_combine(psis, cf, tile=list(tile), M=m,
                                                       lattice_output=lat))
        if lat >= 0:
            composed[lat] = particle_lib.flowpm_wrap(composed[lat], sizes=wrap)
        twin = lpt.lattice_combine_potentials_tf(xs, g, cf, tile, margins, lat, wrap)
        ys = [tf.constant(d) for d in dys]
        g_native = tf.gradients(fused, xs, grad_ys=ys)
        g_twin = tf.gradients(twin, xs, grad_ys=ys)
        lin = lpt_lib.flowpm_lattice_combine_potentials([tf.constant(a) for a in v], g, cf, [],
                                                        tile=list(tile), margins=list(margins),
                                                        M=m)
        got, want, got_twin, gn, gt, jv = sess.run([fused, composed, twin, g_native, g_twin,
                                                    lin])
    assert max(np.max(np.abs(w)) for w in want) > 0.1
    if lat >= 0:       # wrapped along x and z, not y: positions out of [0, s) remain along y
        pos = got[lat]
        assert np.all((pos[..., 0] >= 0) & (pos[..., 0] < block[1]))
        assert np.all((pos[..., 2] >= 0) & (pos[..., 2] < block[3]))
        assert np.any(pos[..., 1] < 0) or np.any(pos[..., 1] >= block[2])
    for k in range(m):
        assert got[k].shape == (block[0], npart, 3)
        np.testing.assert_array_equal(got[k], want[k])
        np.testing.assert_array_equal(got_twin[k], want[k])
        assert np.array_equal(np.signbit(got[k]), np.signbit(want[k]))
    eps = 1e-6 if dtype == np.float32 else 1e-14
    for a, b, p in zip(gn, gt, phis):
        assert a.shape == p.shape
        np.testing.assert_allclose(a, b, rtol=0, atol=eps * 10 * np.max(np.abs(b)))
    lhs = sum(np.sum(j.astype(np.float64) * d) for j, d in zip(jv, dys))
    rhs = sum(np.sum(gr.astype(np.float64) * w) for gr, w in zip(gn, v))
    scale = sum(np.sum(np.abs(j.astype(np.float64) * d)) for j, d in zip(jv, dys))
    assert abs(lhs - rhs) <= (1e-5 if dtype == np.float32 else 1e-12) * scale, (lhs, rhs)
    assert gravity.GRADIENT_REACH == 2


@pytest.mark.skipif(H.SIZE != 1, reason="a single-process TensorFlow test")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_potentials_periodic_equals_padded(dtype):
    """Margins 0 (one block holding the whole mesh, read periodically) give the bits of
    margins (4, 2) on the same potentials padded by their own cells."""
    lib = native.load("lpt_ops")
    rng = np.random.RandomState(11)
    phis = _potentials((2, 8, 16, 16), (0, 0), dtype, rng)
    kw = dict(tile=[8, 8, 4], M=2, lattice_output=0, wrap=[8.0, 16.0, 16.0])
    g, cf = GRAD_COEFFS.astype(dtype), COEFFS[:2, :2].astype(dtype)
    pads = [np.pad(p, [(0, 0), (m, m), (m, m), (0, 0)], mode="wrap") for p, m in
            zip(phis, (4, 2))]
    with tf.Graph().as_default(), tf.Session() as sess:
        periodic = lib.flowpm_lattice_combine_potentials(phis, g, cf, [], margins=[0, 0], **kw)
        padded = lib.flowpm_lattice_combine_potentials(pads, g, cf, [], margins=[4, 2], **kw)
        got, want = sess.run([periodic, padded])
    for a, b in zip(got, want):
        assert np.max(np.abs(b)) > 0.1
        np.testing.assert_array_equal(a, b)


@pytest.mark.skipif(H.SIZE != 1, reason="a single-process TensorFlow test")
def test_potentials_threads_independent():
    """One and four threads of the intra-op pool write the same bits."""
    lib = native.load("lpt_ops")
    rng = np.random.RandomState(5)
    phis = _potentials((2, 32, 16, 64), (4, 2), np.float32, rng)
    outs = []
    for threads in (1, 4):
        cfg = tf.ConfigProto(intra_op_parallelism_threads=threads,
                             inter_op_parallelism_threads=1)
        with tf.Graph().as_default(), tf.Session(config=cfg) as sess:
            op = lib.flowpm_lattice_combine_potentials(
                [tf.constant(p) for p in phis], tf.constant(GRAD_COEFFS, tf.float32),
                tf.constant([[0.5, 2.0], [1.5, -1.0]], tf.float32), [], tile=[16, 16, 16],
                margins=[4, 2], M=2, lattice_output=0)
            outs.append(sess.run(op))
    for x, y in zip(*outs):
        np.testing.assert_array_equal(x, y)


@pytest.mark.skipif(H.SIZE != 1, reason="a single-process TensorFlow test")
def test_potentials_bad_input():
    """A margin under 2, margins that do not match the potentials, a potential of another
    block, a tile that does not divide the block: one clear error each."""
    lib = native.load("lpt_ops")
    a, b = np.zeros((1, 12, 12, 6), np.float32), np.zeros((1, 8, 8, 6), np.float32)
    g = np.ones(3, np.float32)

    def op(phis, margins, tile=(4, 4, 2), coeffs=((1.0, 1.0),)):
        return lib.flowpm_lattice_combine_potentials(phis, g, np.float32(coeffs), [],
                                                     tile=list(tile),
                                                     margins=list(margins), M=len(coeffs))

    cases = [(lambda: op([a, b], [4, 1]), "margins must be >= 2"),
             (lambda: op([a, b], [4]), "1 margins for 2 potentials"),
             (lambda: op([a, a], [4, 2]), "potential 1 has the shape"),
             (lambda: op([a, b], [4, 2], tile=(3, 4, 2)), "does not divide"),
             (lambda: op([a, b], [4, 2], coeffs=((1.0,),)), "coeffs must be"),
             (lambda: lib.flowpm_lattice_combine_potentials(
                 [a, b], g, np.float32([[1.0, 1.0]]), [], tile=[4, 4, 2], margins=[4, 2], M=1,
                 wrap=[4.0, 0.0, 0.0]), "wrap needs a lattice_output"),
             (lambda: lib.flowpm_lattice_combine_potentials(
                 [a, b], g, np.float32([[1.0, 1.0]]), [], tile=[4, 4, 2], margins=[4, 2], M=1,
                 lattice_output=1), "is not an output")]
    for make, message in cases:
        with tf.Graph().as_default(), tf.Session() as sess:
            with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match=message):
                sess.run(make())
    # the mesh-level function says the same before any op runs
    from flowpm_mtf.physics import lpt_source
    import nbody_harness as NH
    conf = SimConfig(nc=(16, 16, 8))
    with tf.Graph().as_default():
        mesh = mtf.Mesh(mtf.Graph(), "mesh")
        phi = NH.import_field(mesh, conf, np.zeros(conf.nc))
        pots = [(lpt_source.padded_potential(phi, conf, 4), 4)]
        with pytest.raises(ValueError, match="rows of 1"):
            lpt.lattice_combine_potentials(pots, [[1.0, 2.0]], conf)
        with pytest.raises(ValueError, match="not one of the 1 outputs"):
            lpt.lattice_combine_potentials(pots, [[1.0]], conf, lattice_output=1)
        with pytest.raises(ValueError, match="with margin 2"):
            lpt.lattice_combine_potentials([(pots[0][0], 2)], [[1.0]], conf)
        with pytest.raises(ValueError, match="needs a lattice_output"):
            lpt.lattice_combine_potentials(pots, [[1.0]], conf, wrap=[16.0, 0.0, 0.0])


@pytest.mark.parametrize("case", H.cases(single=True), ids=H.case_id)
def test_potentials_on_the_mesh(case):
    """``lpt.lattice_combine_potentials`` against ``lpt.lattice_combine`` of
    ``lpt_source.displacement`` of the same padded potentials (margins 4 and 2, as the
    2LPT's), every grid of the world size: the same bits; ``mtf.gradients`` of a quadratic
    loss with respect to both potentials through either path (the fused op's gradient
    function against the displacement's and the combine's) agree to rounding, and are not
    zero. Anisotropic cells, so that a wrong axis shows."""
    import mesh_tensorflow as mtf
    import nbody_harness as NH
    from flowpm_mtf.physics import lpt_source
    kind, grid = case
    conf = SimConfig(nc=(16, 16, 8), box_size=(32.0, 24.0, 20.0), grid=grid, halo_size=2,
                     dtype="float64")
    rng = np.random.RandomState(11)
    fields = [rng.randn(*conf.nc) for _ in range(2)]
    coeffs = [[0.9, -0.3], [1.7, 0.4], [0.2, 2.1]]

    def build(mesh):
        phis = [NH.import_field(mesh, conf, f) for f in fields]
        pots = [(lpt_source.padded_potential(p, conf, m), m) for p, m in zip(phis, (4, 2))]
        fused = lpt.lattice_combine_potentials(pots, coeffs, conf, lattice_output=0)
        psis = [lpt_source.displacement(b, conf, m) for b, m in pots]
        composed = lpt.lattice_combine(psis, coeffs, conf, lattice_output=0)
        out = {}
        for tag, vecs in (("fused", fused), ("composed", composed)):
            loss = mtf.add_n([mtf.reduce_sum(mtf.square(v)) for v in vecs])
            for i, g in enumerate(mtf.gradients([loss], phis)):
                out["%s_grad%d" % (tag, i)] = g
            for i, v in enumerate(vecs):
                out["%s%d" % (tag, i)] = v
        return out

    out = H.run(kind, conf, build)
    for i in range(3):
        np.testing.assert_array_equal(out["fused%d" % i], out["composed%d" % i])
    for i in range(2):
        g, want = out["fused_grad%d" % i], out["composed_grad%d" % i]
        assert np.max(np.abs(want)) > 0.1
        assert H.rel_err(g, want) <= 1e-12, (i, H.rel_err(g, want))
