"""The native CIC ops (``flowpm_mtf/native/cic_ops.cc``) on local slices: equal to
the TensorFlow path of :mod:`flowpm_mtf.physics.painting`, exact gradients (dot-product and
finite-difference tests in float64), independent of the thread count, harmless
for masked (non-finite, zero-weight) particle slots. Also the native-or-TensorFlow
choice of every module (:func:`flowpm_mtf.native.ops_for`) and the build stamps
(a header's edit makes the libraries that include it stale).

The distributed paint/readout (halo exchange, all process grids, against
``flowpm.tfpm``) is tested in ``test_painting.py``, which runs the native path
whenever the library is built (``FLOWPM_MTF_NATIVE=require`` in CI).
"""
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

from flowpm_mtf import native
from flowpm_mtf.physics import kernels, painting  # noqa: F401  (kernels: FlowpmInterleave's gradient)
from flowpm_mtf.config import SimConfig

tf.disable_eager_execution()

pytestmark = [pytest.mark.rank_independent,
              pytest.mark.skipif(native.load("cic_ops") is None,
                                 reason="native cic_ops not built (FLOWPM_MTF_NATIVE=0 or "
                                        "python -m flowpm_mtf.native.build not run)")]

# float32: the paint adds the same products in the same order as
# unsorted_segment_sum (bit-equal); the readout sums 8 products in another order.
READ_RTOL32 = 1e-6
# float64 dot products of ~10^3 terms.
ADJOINT_RTOL = 1e-12
# central differences in float64: CIC is polynomial inside a cell (rounding only).
FD_EPS = 1e-6
FD_RTOL = 1e-6

# 2 x 2 blocks of 6 x 5 x 4 cells, halo 2 -> padded blocks 10 x 9 x 4
CONF = SimConfig(nc=(12, 10, 4), grid=(2, 2), halo_size=2, dtype="float64")
NB = 2 * 2
N = 300


def positions(seed, dtype=np.float64, frac=None):
    """[nbx, nby, n, 3] block-local positions inside the allowed range."""
    rng = np.random.RandomState(seed)
    h = CONF.halo_size
    sx, sy, nz = CONF.block_shape
    lo = np.array([-h, -h, -3.0])
    hi = np.array([sx + h - 1, sy + h - 1, nz + 3.0])
    if frac is None:
        pos = lo + (hi - lo) * rng.rand(2, 2, N, 3)
    else:
        cells = rng.randint(lo.astype(int), hi.astype(int) - 1, size=(2, 2, N, 3))
        pos = cells + frac + (1 - 2 * frac) * rng.rand(2, 2, N, 3)
    return pos.astype(dtype)


def run(fetch, feeds=None, threads=2):
    cfg = tf.ConfigProto(intra_op_parallelism_threads=threads, inter_op_parallelism_threads=1)
    with tf.Session(config=cfg) as sess:
        return sess.run(fetch, feeds)


def tf_path(monkeypatch):
    """Make painting's local functions use the TensorFlow path."""
    monkeypatch.setattr(painting, "_native_ops", lambda *t: None)


def local_paint(pos, w=None):
    return painting._native_paint(painting._native_ops(pos), painting._local_particles(pos),
                                  w, CONF)


def local_readout(m, pos, comps=1):
    return painting._native_readout(painting._native_ops(m, pos), m, pos, CONF, comps)


def tf_paint(pos, w=None):
    idx, kernel = painting._stencil(pos, CONF)
    if w is not None:
        kernel = kernel * w[..., None]
    shape = [2, 2] + list(CONF.padded_block_shape)
    out = tf.math.unsorted_segment_sum(tf.reshape(kernel, [-1]), tf.reshape(idx, [-1]),
                                       int(np.prod(shape)))
    return tf.reshape(out, shape)


def tf_readout(m, pos, comps=1):
    idx, kernel = painting._stencil(pos, CONF)
    rows = tf.gather(tf.reshape(m, [-1, comps]), idx)
    return tf.reduce_sum(rows * kernel[..., None], axis=-2)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_native_equals_tensorflow_path(dtype):
    pos = positions(1, dtype)
    rng = np.random.RandomState(2)
    w = rng.rand(2, 2, N).astype(dtype)
    field = rng.randn(2, 2, *CONF.padded_block_shape, 3).astype(dtype)
    with tf.Graph().as_default():
        p, wt, f = tf.constant(pos), tf.constant(w), tf.constant(field)
        out = run({"paint": local_paint(p), "paint_w": local_paint(p, wt),
                   "ref_paint": tf_paint(p), "ref_paint_w": tf_paint(p, wt),
                   "read": local_readout(f, p, 3), "ref_read": tf_readout(f, p, 3)})
    # same products added in the same order as unsorted_segment_sum: bit-equal
    np.testing.assert_array_equal(out["paint"], out["ref_paint"])
    np.testing.assert_array_equal(out["paint_w"], out["ref_paint_w"])
    rtol = READ_RTOL32 if dtype == np.float32 else 1e-14
    np.testing.assert_allclose(out["read"], out["ref_read"], rtol=rtol, atol=rtol)


@pytest.mark.parametrize("comps", [2, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_multicomponent_paint_equals_one_component_paints(dtype, comps):
    """The paint of C weighted components (C = 3: the kernel specialised for the readout's
    gradient with respect to the force mesh; C = 2: the generic kernel) equals C
    one-component paints (the density kernel), bit for bit: per cell the same terms in
    the same order."""
    pos = positions(4, dtype)
    w = np.random.RandomState(5).randn(2, 2, N, comps).astype(dtype)
    px, py, nz = CONF.padded_block_shape
    lib = native.load("cic_ops")
    if lib is None:
        pytest.skip("native ops not built")
    with tf.Graph().as_default():
        p = tf.reshape(tf.constant(pos), [NB, N, 3])
        wt = tf.reshape(tf.constant(w), [NB, N, comps])
        args = dict(halo=CONF.halo_size, px=px, py=py, nz=nz)
        many = lib.flowpm_cic_paint(p, wt, components=comps, **args)
        ones = [lib.flowpm_cic_paint(p, wt[..., c:c + 1], components=1, **args)
                for c in range(comps)]
        got, ref = run([many, tf.concat(ones, axis=-1)])
    assert got.shape[-1] == comps and np.abs(got).max() > 0
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("comps", [1, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fused_readout_gradient_equals_paint_and_position_gradient(dtype, comps):
    """``FlowpmCicReadoutGrad`` (the readout's registered gradient) equals the paint of
    the upstream gradient and ``FlowpmCicReadoutGradPos``, bit for bit, with 1 and 4
    threads (several slabs: each particle's position gradient from exactly one), and
    with non-finite particles (zero gradient, nothing painted)."""
    lib = native.load("cic_ops")
    if lib is None:
        pytest.skip("native ops not built")
    pos = np.concatenate([positions(6, dtype)] * 60, axis=2)  # 18000 per block: slabs
    pos[0, 1, 7] = [np.nan, 1.0, 1.0]
    pos[1, 0, 11] = [1.0, np.inf, 1.0]
    n = pos.shape[2]
    px, py, nz = CONF.padded_block_shape
    rng = np.random.RandomState(8)
    field = rng.randn(NB, px, py, nz, comps).astype(dtype)
    dv = rng.randn(NB, n, comps).astype(dtype)
    with tf.Graph().as_default():
        p = tf.reshape(tf.constant(pos), [NB, n, 3])
        f, d = tf.constant(field), tf.constant(dv)
        fused = lib.flowpm_cic_readout_grad(f, p, d, halo=CONF.halo_size)
        ref = [lib.flowpm_cic_paint(p, d, halo=CONF.halo_size, px=px, py=py, nz=nz,
                                    components=comps),
               lib.flowpm_cic_readout_grad_pos(f, p, d, halo=CONF.halo_size)]
        # the registered gradient of the readout is the fused op
        read = lib.flowpm_cic_readout(f, p, halo=CONF.halo_size)
        grads = tf.gradients(read, [f, p], grad_ys=[d])
        assert {g.op.type for g in grads} == {"FlowpmCicReadoutGrad"}
        got = {t: run(list(fused), threads=t) for t in (1, 4)}
        want = run(ref, threads=1)
    for t in (1, 4):
        for a, b in zip(got[t], want):
            np.testing.assert_array_equal(a, b)
    assert np.abs(want[1]).max() > 0 and np.abs(want[0]).max() > 0
    # blocks (0, 1) and (1, 0) are blocks 1 and 2 of the flat [B, n, 3]
    assert np.all(want[1][1, 7] == 0) and np.all(want[1][2, 11] == 0)


def test_paint_independent_of_threads():
    pos = positions(3, np.float32)
    pos = np.concatenate([pos] * 40, axis=2)  # enough particles for several slabs
    with tf.Graph().as_default():
        p = tf.constant(pos)
        one = run(local_paint(p), threads=1)
        many = run(local_paint(p), threads=4)
    np.testing.assert_array_equal(one, many)


def test_escaped_count_equals_tensorflow_path(monkeypatch):
    import mesh_tensorflow as mtf
    pos = positions(4)
    h = CONF.halo_size
    sx, sy, _ = CONF.block_shape
    pos[0, 0, 0] = [-h, -h, 0.5]                        # lowest allowed
    pos[1, 1, 1] = [sx + h - 1 - 1e-9, sy + h - 1 - 1e-9, 0.0]
    pos[0, 0, 2, 0] = sx + h - 1                         # first beyond x
    pos[1, 0, 3, 1] = -h - 1e-9                          # beyond y
    pos[0, 1, 4, 2] = np.nan
    pos[0, 1, 5, 0] = np.inf

    def count():
        with tf.Graph().as_default():
            graph = mtf.Graph()
            mesh = mtf.Mesh(graph, "m")
            shape = mtf.Shape([mtf.Dimension("bx", 2), mtf.Dimension("by", 2),
                               mtf.Dimension("npart", N), mtf.Dimension("xyz", 3)])
            p = mtf.import_tf_tensor(mesh, tf.constant(pos), shape)
            c = painting.escaped_count(p, CONF)
            impl = mtf.placement_mesh_impl.PlacementMeshImpl([("row", 1), ("col", 1)],
                                                             CONF.layout_rules, ["/cpu:0"])
            lowering = mtf.Lowering(graph, {mesh: impl})
            return run(lowering.export_to_tf_tensor(c))

    native_count = count()
    tf_path(monkeypatch)
    assert native_count == count() == 4


@pytest.mark.parametrize("comps", [1, 3])
def test_dot_products(comps):
    """<paint(w), g> = <w, readout(g)> (vector weights), and the registered
    gradients are the adjoints: grad_w <paint(w), g> = readout(g),
    grad_m <readout(m), v> = paint(v)."""
    lib = native.load("cic_ops")
    px, py, nz = CONF.padded_block_shape
    pos = positions(5).reshape(NB, N, 3)
    rng = np.random.RandomState(6)
    w0 = rng.randn(NB, N, comps)
    g0 = rng.randn(NB, px, py, nz, comps)
    with tf.Graph().as_default():
        p, w, g = tf.constant(pos), tf.constant(w0), tf.constant(g0)
        painted = lib.flowpm_cic_paint(p, w, halo=CONF.halo_size, px=px, py=py, nz=nz,
                                       components=comps)
        read = lib.flowpm_cic_readout(g, p, halo=CONF.halo_size)
        lhs, rhs = tf.reduce_sum(painted * g), tf.reduce_sum(w * read)
        gw, = tf.gradients(lhs, [w])
        gm, = tf.gradients(rhs, [g])
        out = run({"lhs": lhs, "rhs": rhs, "gw": gw, "read": read, "gm": gm,
                   "painted": painted})
    np.testing.assert_allclose(out["lhs"], out["rhs"], rtol=ADJOINT_RTOL)
    np.testing.assert_allclose(out["gw"], out["read"], rtol=ADJOINT_RTOL, atol=1e-14)
    np.testing.assert_allclose(out["gm"], out["painted"], rtol=ADJOINT_RTOL, atol=1e-14)


@pytest.mark.parametrize("weighted", [False, True])
def test_finite_differences(weighted):
    """d/dpos of L = <m, paint(pos, w)> + <c, readout(m2, pos)^2> (3 components), and
    d/dw, against central differences in float64."""
    lib = native.load("cic_ops")
    px, py, nz = CONF.padded_block_shape
    h = CONF.halo_size
    pos0 = positions(7, frac=0.1).reshape(NB, N, 3)
    rng = np.random.RandomState(8)
    m0 = rng.randn(NB, px, py, nz, 1)
    m2 = rng.randn(NB, px, py, nz, 3)
    c0 = rng.rand(NB, N, 3)
    w0 = rng.rand(NB, N, 1) + 0.5
    with tf.Graph().as_default():
        p = tf.placeholder(tf.float64, pos0.shape)
        w = tf.placeholder(tf.float64, w0.shape)
        wt = w if weighted else tf.zeros([0], tf.float64)
        paint = lib.flowpm_cic_paint(p, wt, halo=h, px=px, py=py, nz=nz)
        read = lib.flowpm_cic_readout(tf.constant(m2), p, halo=h)
        loss = tf.reduce_sum(paint * m0) + tf.reduce_sum(c0 * read**2)
        gp, gw = tf.gradients(loss, [p, w])
        cfg = tf.ConfigProto(intra_op_parallelism_threads=2)
        with tf.Session(config=cfg) as sess:
            def f(pp, ww):
                return sess.run(loss, {p: pp, w: ww})
            g_pos, g_w = sess.run([gp, gw if weighted else gp], {p: pos0, w: w0})
            scale = max(1.0, np.max(np.abs(g_pos)))
            for idx in [(0, 0, 0), (1, 5, 1), (2, 7, 2), (3, N - 1, 0), (3, 11, 2)]:
                a, b = pos0.copy(), pos0.copy()
                a[idx] += FD_EPS
                b[idx] -= FD_EPS
                fd = (f(a, w0) - f(b, w0)) / (2 * FD_EPS)
                assert abs(fd - g_pos[idx]) <= FD_RTOL * scale, (idx, fd, g_pos[idx])
            if weighted:
                for idx in [(0, 0, 0), (2, 9, 0), (3, N - 1, 0)]:
                    a, b = w0.copy(), w0.copy()
                    a[idx] += FD_EPS
                    b[idx] -= FD_EPS
                    fd = (f(pos0, a) - f(pos0, b)) / (2 * FD_EPS)
                    assert abs(fd - g_w[idx]) <= FD_RTOL * max(1.0, np.max(np.abs(g_w)))


def test_masked_slots_are_harmless():
    """Slots with weight 0 and non-finite positions paint nothing, read 0 and get
    zero gradients; the other particles are unaffected."""
    lib = native.load("cic_ops")
    px, py, nz = CONF.padded_block_shape
    h = CONF.halo_size
    pos = positions(9).reshape(NB, N, 3)
    rng = np.random.RandomState(10)
    w = rng.rand(NB, N, 1)
    mask = np.zeros((NB, N), bool)
    mask[:, ::7] = True
    bad = pos.copy()
    bad[mask] = np.nan
    bad[0, 14] = [np.inf, 0, 0]
    mask[0, 14] = True
    wm = np.where(mask[..., None], 0.0, w)
    m = rng.randn(NB, px, py, nz, 3)
    with tf.Graph().as_default():
        pb, pw = tf.constant(bad), tf.constant(wm)
        painted = lib.flowpm_cic_paint(pb, pw, halo=h, px=px, py=py, nz=nz)
        ref = lib.flowpm_cic_paint(tf.constant(pos), pw, halo=h, px=px, py=py, nz=nz)
        read = lib.flowpm_cic_readout(tf.constant(m), pb, halo=h)
        loss = tf.reduce_sum(painted) + tf.reduce_sum(read)
        gp, = tf.gradients(loss, [pb])
        out = run({"painted": painted, "ref": ref, "read": read, "gp": gp})
    np.testing.assert_array_equal(out["painted"], out["ref"])
    assert np.all(np.isfinite(out["painted"]))
    assert np.all(out["read"][mask] == 0) and np.all(np.isfinite(out["read"]))
    assert np.all(out["gp"][mask] == 0) and np.all(np.isfinite(out["gp"]))


def test_device_and_dtype_choice():
    """The native op serves float32/float64 CPU tensors; GPU-placed tensors and
    half precision take the TensorFlow path."""
    with tf.Graph().as_default():
        cpu = tf.constant(np.zeros(3, np.float32))
        with tf.device("/cpu:0"):
            pinned = tf.constant(np.zeros(3, np.float64))
        with tf.device("/gpu:0"):
            gpu = tf.constant(np.zeros(3, np.float32))
        half = tf.constant(np.zeros(3, np.float16))
        assert painting._native_ops(cpu) is not None
        assert painting._native_ops(cpu, pinned) is not None
        assert painting._native_ops(cpu, gpu) is None
        assert painting._native_ops(half) is None


def test_ops_for_follows_load_runs_on_cpu_and_dtypes(monkeypatch):
    """native.ops_for, the one native-or-TensorFlow choice: the loaded module for served
    dtypes on a CPU; None for an unserved dtype (unless dtypes=None), for a tensor on a
    GPU, and with FLOWPM_MTF_NATIVE=0 (where load gives None)."""
    lib = native.load("cic_ops")
    with tf.Graph().as_default():
        with tf.device("/cpu:0"):
            f32, f64 = tf.zeros([2, 3], tf.float32), tf.zeros([2, 3], tf.float64)
            i32 = tf.zeros([2, 3], tf.int32)
        with tf.device("/gpu:0"):
            gpu = tf.zeros([2, 3], tf.float32)
        assert native.runs_on_cpu(f64) and not native.runs_on_cpu(gpu)
        assert native.ops_for("cic_ops", f32) is lib
        assert native.ops_for("cic_ops", f32, f64) is lib
        assert native.ops_for("cic_ops", i32) is None
        assert native.ops_for("cic_ops", f64, i32) is None
        assert native.ops_for("cic_ops", i32, dtypes=None) is lib
        assert native.ops_for("cic_ops", i32, dtypes=[tf.int32]) is lib
        assert native.ops_for("cic_ops", f32, gpu) is None
        assert native.ops_for("cic_ops", gpu, dtypes=None) is None
        monkeypatch.setenv("FLOWPM_MTF_NATIVE", "0")
        monkeypatch.setattr(native, "_cache", {})
        assert native.load("cic_ops") is None
        assert native.ops_for("cic_ops", f64) is None
        assert native.ops_for("cic_ops", i32, dtypes=None) is None


def test_stamp_covers_the_included_headers(tmp_path, monkeypatch):
    """A library's stamp hashes its source and the headers of the folder it includes,
    directly or through another header: editing tf_op.h or cic_block.h makes cic_ops
    (and a source including cic_block.h only) stale, so set-up and native.build
    rebuild them; a header they do not include changes no stamp."""
    import os
    import shutil

    for f in ("cic_ops.cc", "cic_block.h", "tf_op.h"):
        shutil.copy(os.path.join(native.HERE, f), tmp_path / f)
    (tmp_path / "probe.cc").write_text('#include "cic_block.h"\n')
    (tmp_path / "other.h").write_text("// included by nothing\n")
    monkeypatch.setattr(native, "HERE", str(tmp_path))
    assert native.names() == ["cic_ops", "probe"]
    for name in native.names():
        assert sorted(native.local_headers(native.source_path(name))) == [
            str(tmp_path / "cic_block.h"), str(tmp_path / "tf_op.h")]
    stamps = {name: native.expected_stamp(name) for name in native.names()}
    for header in ("tf_op.h", "cic_block.h", "other.h"):
        path = tmp_path / header
        text = path.read_text()
        path.write_text(text + "// edited\n")
        for name in native.names():
            assert (native.expected_stamp(name) != stamps[name]) == (header != "other.h")
        path.write_text(text)
        assert {name: native.expected_stamp(name) for name in native.names()} == stamps


def test_escaped_count_per_block_independent_of_threads():
    """The parallel count (shards cross block boundaries) equals a numpy count per block
    on 1 and 4 threads."""
    from flowpm_mtf import native

    lib = native.load("cic_ops")
    rng = np.random.RandomState(7)
    h, (sx, sy, _) = CONF.halo_size, CONF.block_shape
    pos = rng.uniform(-h - 1.5, max(sx, sy) + h + 0.5, (NB, 20011, 3))
    pos[1, ::97, 2] = np.nan
    ok = ((pos[..., 0] >= -h) & (pos[..., 0] < sx + h - 1) & (pos[..., 1] >= -h)
          & (pos[..., 1] < sy + h - 1) & np.isfinite(pos[..., 2]))
    with tf.Graph().as_default():
        c = lib.flowpm_cic_escaped(tf.constant(pos), halo=h, sx=sx, sy=sy)
        one, many = run(c, threads=1), run(c, threads=4)
    np.testing.assert_array_equal(one, (~ok).sum(axis=1))
    np.testing.assert_array_equal(many, one)
    assert one.min() > 0


def test_escaped_count_of_no_particles():
    """Blocks without particles (n = 0) count 0 escapes, on 1 and 4 threads."""
    lib = native.load("cic_ops")
    with tf.Graph().as_default():
        c = lib.flowpm_cic_escaped(tf.zeros([3, 0, 3], tf.float32), halo=2, sx=4, sy=4)
        for threads in (1, 4):
            np.testing.assert_array_equal(run(c, threads=threads), [0, 0, 0])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_interleave_equals_numpy(dtype):
    """FlowpmInterleave picks columns of several inputs (any order, repeats) as numpy,
    on 1 and 3 threads (rows split between threads)."""
    lib = native.load("cic_ops")
    rng = np.random.RandomState(11)
    a = rng.randn(5, 7, 3, 2).astype(dtype)
    b = rng.randn(5, 7, 3, 1).astype(dtype)
    picks = [(0, 0), (0, 1), (1, 0), (0, 0)]
    ref = np.stack([(a, b)[i][..., c] for i, c in picks], axis=-1)
    with tf.Graph().as_default():
        out = lib.flowpm_interleave([tf.constant(a), tf.constant(b)],
                                    picks=[v for p in picks for v in p])
        assert out.shape.as_list() == [5, 7, 3, 4]
        for threads in (1, 3):
            np.testing.assert_array_equal(run(out, threads=threads), ref)


def test_interleave_wrap_equals_numpy():
    """FlowpmInterleave with wrap = h: the first two axes padded periodically (np.pad
    mode 'wrap'), h up to the axis length."""
    lib = native.load("cic_ops")
    rng = np.random.RandomState(13)
    a = rng.randn(3, 4, 5, 2).astype(np.float32)
    b = rng.randn(3, 4, 5, 1).astype(np.float32)
    ref = np.concatenate([a, b], axis=-1)
    with tf.Graph().as_default():
        outs = {h: lib.flowpm_interleave([tf.constant(a), tf.constant(b)],
                                         picks=[0, 0, 0, 1, 1, 0], wrap=h) for h in (1, 3)}
        for h, out in outs.items():
            assert out.shape.as_list() == [3 + 2 * h, 4 + 2 * h, 5, 3]
        res = run(outs, threads=3)
    for h in (1, 3):
        np.testing.assert_array_equal(res[h], np.pad(ref, [(h, h), (h, h), (0, 0), (0, 0)],
                                                     mode="wrap"))


@pytest.mark.parametrize("wrap", [0, 2])
def test_interleave_gradient_dot_product(wrap):
    """The registered gradient of FlowpmInterleave is its adjoint (repeated picks and
    periodic margins add): <interleave(a, b), y> = <a, ga> + <b, gb>."""
    lib = native.load("cic_ops")
    rng = np.random.RandomState(12)
    a0, b0 = rng.randn(4, 6, 3, 2), rng.randn(4, 6, 3, 3)
    y0 = rng.randn(4 + 2 * wrap, 6 + 2 * wrap, 3, 4)
    with tf.Graph().as_default():
        a, b, y = tf.constant(a0), tf.constant(b0), tf.constant(y0)
        out = lib.flowpm_interleave([a, b], picks=[1, 2, 0, 0, 1, 2, 0, 1], wrap=wrap)
        lhs = tf.reduce_sum(out * y)
        ga, gb = tf.gradients(lhs, [a, b])
        rhs = tf.reduce_sum(a * ga) + tf.reduce_sum(b * gb)
        res = run({"lhs": lhs, "rhs": rhs, "gb": gb})
    np.testing.assert_allclose(res["lhs"], res["rhs"], rtol=ADJOINT_RTOL)
    np.testing.assert_array_equal(res["gb"][..., 1], 0.0)  # column never picked
    if not wrap:
        np.testing.assert_allclose(res["gb"][..., 2], y0[..., 0] + y0[..., 2],
                                   rtol=ADJOINT_RTOL)


def test_interleave_rejects_bad_picks_and_shapes():
    lib = native.load("cic_ops")
    with tf.Graph().as_default():
        a = tf.constant(np.zeros((3, 2), np.float32))
        b = tf.constant(np.zeros((4, 1), np.float32))
        with pytest.raises(tf.errors.InvalidArgumentError, match="out of range"):
            run(lib.flowpm_interleave([a], picks=[0, 2]))
        with pytest.raises(tf.errors.InvalidArgumentError, match="differ"):
            run(lib.flowpm_interleave([a, tf.placeholder_with_default(b, [None, 1])],
                                      picks=[0, 0, 1, 0]))


def test_arch_flags_and_stamps(monkeypatch):
    """The instruction-set flags: -msse4.1 on x86-64 by default, -march=<value> or none
    from FLOWPM_MTF_NATIVE_ARCH; a build's stamp carries them (other flags rebuild),
    and load's staleness check ignores them (a library built with any flags loads)."""
    import platform

    from flowpm_mtf import native

    monkeypatch.delenv("FLOWPM_MTF_NATIVE_ARCH", raising=False)
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    off = "-ffp-contract=off"
    assert native.arch_flags() == (["-msse4.1"] if x86 else []) + [off]
    default = native.build_stamp("cic_ops")
    assert default.startswith(native.expected_stamp("cic_ops") + native.ARCH_TAG)
    monkeypatch.setenv("FLOWPM_MTF_NATIVE_ARCH", "x86-64-v3")
    assert native.arch_flags() == ["-march=x86-64-v3", off]
    assert native.build_stamp("cic_ops") != default
    assert native.build_stamp("cic_ops").split(native.ARCH_TAG)[0] == \
        default.split(native.ARCH_TAG)[0]
    monkeypatch.setenv("FLOWPM_MTF_NATIVE_ARCH", "none")
    assert native.arch_flags() == [off]
    assert native.build_stamp("cic_ops").endswith(native.ARCH_TAG + off)


_FMA_PROBE = """
void axpy(float* __restrict y, const float* __restrict x, float a, long n) {
  for (long i = 0; i < n; ++i) y[i] += a * x[i];
}
__attribute__((target_clones("avx2", "default"))) void axpy_clone(float* __restrict y,
    const float* __restrict x, float a, long n) {
  for (long i = 0; i < n; ++i) y[i] += a * x[i];
}
"""


def test_arch_flags_never_fuse_multiply_add(monkeypatch, tmp_path):
    """Built with the native ops' flags at an instruction-set level that has fused
    multiply-adds (x86-64-v3), a multiply and add stays two instructions (the results
    are the default build's bit for bit), and so does the AVX2 clone of a function the
    sources clone (tf_op.h, lpt_ops.cc); the same source built without
    -ffp-contract=off does fuse them (g++'s C++ default), so the check can fail."""
    import platform
    import shutil
    import subprocess

    from flowpm_mtf import native
    from flowpm_mtf.native import build

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("x86-64 instruction sets")
    if shutil.which("g++") is None or shutil.which("objdump") is None:
        pytest.skip("needs g++ and objdump")
    src = tmp_path / "probe.cc"
    src.write_text(_FMA_PROBE)
    monkeypatch.setenv("FLOWPM_MTF_NATIVE_ARCH", "x86-64-v3")

    def fused(flags):
        out = tmp_path / "probe.so"
        subprocess.run(["g++"] + flags + [str(src), "-o", str(out)], check=True)
        dis = subprocess.run(["objdump", "-d", str(out)], check=True, capture_output=True,
                             text=True).stdout
        return sum(dis.count(op) for op in ("vfmadd", "vfmsub", "vfnmadd", "vfnmsub"))

    flags = build.CXXFLAGS + native.arch_flags()
    assert fused(flags) == 0
    assert fused([f for f in flags if f != native.NO_CONTRACTION]) > 0
