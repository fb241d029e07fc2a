"""Local 1D FFTs (``flowpm_mtf.mesh.fft_local.fft_along``/``rfft_along``/``irfft_along``, their
blocked, mirror-pair-ordered and packed variants) and the mirror-pair completion op
(``pairs_extend``/``pairs_fold``): the native FFTW op against numpy.fft, its gradients
by dot-product and finite differences, the TensorFlow fallback, and concurrent planning.

No mesh: these run in the 1-rank pass. With ``FLOWPM_MTF_NATIVE=require`` (set by
``scripts/run_tests.sh``) the native op must be built; without it the tests
that need it are skipped and the others test the TensorFlow path.
"""
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import fpm_harness as H
from flowpm_mtf.mesh import fft_local
from flowpm_mtf import layout, native

tf.disable_eager_execution()
pytestmark = pytest.mark.rank_independent

# 1D FFT of length <= 192: rounding ~ log2(n) eps relative to the largest value.
RTOL = {"float64": 1e-12, "float32": 2e-6}
# <A x, y> = <x, A^T y>: sums of ~1e4 products in different orders (float64).
ADJOINT_RTOL = 1e-12
# Central differences on a quadratic loss in float64: exact up to rounding
# ~1e-16 / FD_EPS relative to the loss.
FD_EPS = 1e-6
FD_RTOL = 1e-6

LENGTHS = [192, 96, 30, 7]  # non-powers of two with factors 2, 3, 5, 7
COMPLEX = {"float32": np.complex64, "float64": np.complex128}
NAMES = ["fft", "ifft", "rfft", "irfft", "fft_of_real", "ifft_real"]


def have_native():
    return native.load("fft_ops") is not None


needs_native = pytest.mark.skipif(
    not have_native() and native.mode() != "require",
    reason="native FFT op not built (python -m flowpm_mtf.native.build)")


def run(fetches, threads=2):
    config = tf.ConfigProto(intra_op_parallelism_threads=threads,
                            inter_op_parallelism_threads=threads)
    with tf.Session(config=config) as sess:
        return sess.run(fetches)


def shape_for(n, axis):
    """A 3D shape with length n on ``axis``; big enough (> 32k values) for the
    threaded path, with panels that do not divide the other axes evenly."""
    shape = [5, 3, 70]
    shape[axis] = n
    if n < 30:
        shape[(axis + 1) % 3] *= 40
    return tuple(shape)


def rel_err(a, b):
    return np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300)


def test_require_means_native_is_used():
    """With FLOWPM_MTF_NATIVE=require (CI) the op is loaded and chosen on the CPU."""
    if native.mode() != "require":
        pytest.skip("FLOWPM_MTF_NATIVE is not 'require'")
    with tf.Graph().as_default(), tf.device("/cpu:0"):
        x = tf.zeros([4, 8], tf.complex64)
        assert fft_local.uses_native(x)
        assert fft_local.fft_along(x, 1).op.type == "FlowpmFftC2c"


def test_gpu_device_keeps_tensorflow_ops():
    """A tensor placed on a GPU takes tf.signal (cuFFT); only the graph is built here
    (no GPU on this machine: the GPU path itself is not run by the tests)."""
    with tf.Graph().as_default():
        with tf.device("/gpu:0"):
            x = tf.zeros([4, 8], tf.complex64)
            assert not fft_local.uses_native(x)
            assert fft_local.fft_along(x, 0).op.type != "FlowpmFftC2c"
            assert fft_local.rfft_along(tf.zeros([4, 8]), 1).op.type != "FlowpmFftR2c"


@needs_native
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("n", LENGTHS)
def test_native_matches_numpy(n, dtype):
    """c2c forward/inverse, r2c, c2r (half and full spectrum) along every axis
    against numpy.fft."""
    rng = np.random.RandomState(n)
    fetches, refs = [], []
    with tf.Graph().as_default(), tf.device("/cpu:0"):
        for axis in range(3):
            shape = shape_for(n, axis)
            x = (rng.randn(*shape) + 1j * rng.randn(*shape)).astype(COMPLEX[dtype])
            r = rng.randn(*shape).astype(dtype)
            h = np.take(x, range(n // 2 + 1), axis=axis)  # not Hermitian
            xt, rt, ht = tf.constant(x), tf.constant(r), tf.constant(h)
            fetches += [fft_local.fft_along(xt, axis), fft_local.fft_along(xt, axis, inverse=True),
                        fft_local.rfft_along(rt, axis), fft_local.irfft_along(ht, n, axis),
                        fft_local.fft_of_real_along(rt, axis),
                        fft_local.ifft_real_part_along(xt, axis)]
            x64, h64, r64 = x.astype(np.complex128), h.astype(np.complex128), r.astype(np.float64)
            refs += [np.fft.fft(x64, axis=axis), np.fft.ifft(x64, axis=axis),
                     np.fft.rfft(r64, axis=axis), np.fft.irfft(h64, n, axis=axis),
                     np.fft.fft(r64, axis=axis), np.fft.ifft(x64, axis=axis).real]
            assert all(f.op.type.startswith("FlowpmFft") for f in fetches[-len(NAMES):])
        out = run(fetches)
    for i, (o, ref) in enumerate(zip(out, refs)):
        name = NAMES[i % len(NAMES)]
        assert o.dtype == (dtype if name in ("irfft", "ifft_real") else COMPLEX[dtype])
        assert o.shape == ref.shape
        assert rel_err(o, ref) < RTOL[dtype], (i // len(NAMES), name)


def _assert_native_equals_tensorflow(build, monkeypatch):
    """The tensors of ``build()`` on the native op, then on the TF fallback (no native op
    in its graph), agree to RTOL (float64)."""
    with tf.Graph().as_default(), tf.device("/cpu:0"):
        nat = run(build())
    monkeypatch.setattr(fft_local, "uses_native", lambda t: False)
    with tf.Graph().as_default(), tf.device("/cpu:0"):
        ops = build()
        assert not any(o.op.type.startswith("FlowpmFft") for o in ops)
        ref = run(ops)
    for i, (a, b) in enumerate(zip(nat, ref)):
        assert rel_err(a, b) < RTOL["float64"], i


@needs_native
def test_native_equals_tensorflow_path(monkeypatch):
    """The native op and the TF fallback agree (float64, odd and even lengths, both
    normalisations in both directions)."""
    rng = np.random.RandomState(7)
    x = rng.randn(6, 30, 7) + 1j * rng.randn(6, 30, 7)
    r = rng.randn(6, 30, 7)

    def build():
        out = []
        for axis in (1, 2):
            n = x.shape[axis]
            h = tf.constant(np.take(x, range(n // 2 + 1), axis=axis))
            out += [fft_local.fft_along(tf.constant(x), axis),
                    fft_local.rfft_along(tf.constant(r), axis),
                    fft_local.irfft_along(h, n, axis),
                    fft_local.fft_along(tf.constant(x), axis, inverse=False, normalized=True),
                    fft_local.fft_along(tf.constant(x), axis, inverse=True, normalized=False),
                    fft_local.fft_of_real_along(tf.constant(r), axis, normalized=True),
                    fft_local.ifft_real_part_along(tf.constant(x), axis, normalized=False)]
        return out

    _assert_native_equals_tensorflow(build, monkeypatch)


def _real_dot(a, b):
    return np.sum(np.real(np.conj(a) * b))


def _assert_adjoint(specs):
    """<A x, y> = <x, A^T y> for each (name, A, x, y), A^T y from tf.gradients (float64)."""
    cases = []
    with tf.Graph().as_default(), tf.device("/cpu:0"):
        for name, fn, x, y in specs:
            xt, yt = tf.constant(x), tf.constant(y)
            ax = fn(xt)
            # loss = <A x, y> (real inner product): its gradient is A^T y
            loss = tf.reduce_sum(tf.math.real(tf.math.conj(tf.cast(ax, tf.complex128))
                                              * tf.cast(yt, tf.complex128)))
            g, = tf.gradients(loss, [xt])
            cases.append((name, x, y, ax, g))
        out = run([(c[3], c[4]) for c in cases])
    for (name, x, y, _, _), (ax, aty) in zip(cases, out):
        lhs, rhs = _real_dot(ax, y), _real_dot(x, aty)
        assert abs(lhs - rhs) <= ADJOINT_RTOL * max(abs(lhs), 1.0), (name, lhs, rhs)
        assert aty.dtype == x.dtype, name


@needs_native
@pytest.mark.parametrize("n", [30, 7, 96])
def test_native_gradients_adjoint(n):
    """<A x, y> = <x, A^T y> for every op (A^T y from tf.gradients), float64."""
    rng = np.random.RandomState(n + 1)
    shape = (4, n, 3)
    m = n // 2 + 1
    x_c = rng.randn(*shape) + 1j * rng.randn(*shape)
    y_c = rng.randn(*shape) + 1j * rng.randn(*shape)
    x_r, y_r = rng.randn(*shape), rng.randn(*shape)
    x_h = rng.randn(4, m, 3) + 1j * rng.randn(4, m, 3)
    y_h = rng.randn(4, m, 3) + 1j * rng.randn(4, m, 3)
    _assert_adjoint([
        ("fft", lambda t: fft_local.fft_along(t, 1), x_c, y_c),
        ("ifft", lambda t: fft_local.fft_along(t, 1, inverse=True), x_c, y_c),
        ("rfft", lambda t: fft_local.rfft_along(t, 1), x_r, y_h),
        ("irfft", lambda t: fft_local.irfft_along(t, n, 1), x_h, y_r),
        ("fft_of_real", lambda t: fft_local.fft_of_real_along(t, 1), x_r, y_c),
        ("ifft_real", lambda t: fft_local.ifft_real_part_along(t, 1), x_c, y_r)])


@needs_native
@pytest.mark.parametrize("op", NAMES)
def test_native_gradients_finite_difference(op):
    """Quadratic losses sum(w |A x|^2) (a real weight w): tf.gradients against central
    differences at a few elements, real and imaginary parts separately (float64)."""
    n = 6
    rng = np.random.RandomState(11)
    m = n // 2 + 1
    if op in ("fft", "ifft", "ifft_real"):
        x0 = rng.randn(3, n) + 1j * rng.randn(3, n)
    elif op in ("rfft", "fft_of_real"):
        x0 = rng.randn(3, n)
    else:  # including the imaginary parts of the zero and Nyquist modes (ignored)
        x0 = rng.randn(3, m) + 1j * rng.randn(3, m)
    fn = {"fft": lambda t: fft_local.fft_along(t, 1),
          "ifft": lambda t: fft_local.fft_along(t, 1, inverse=True),
          "rfft": lambda t: fft_local.rfft_along(t, 1),
          "irfft": lambda t: fft_local.irfft_along(t, n, 1),
          "fft_of_real": lambda t: fft_local.fft_of_real_along(t, 1),
          "ifft_real": lambda t: fft_local.ifft_real_part_along(t, 1)}[op]
    with tf.Graph().as_default(), tf.device("/cpu:0"):
        xp = tf.placeholder(tf.as_dtype(x0.dtype), x0.shape)
        y = fn(xp)
        w = tf.constant(rng.rand(*y.shape.as_list()) + 0.5)
        if y.dtype.is_complex:
            loss = tf.reduce_sum(w * tf.math.real(y * tf.math.conj(y)))
        else:
            loss = tf.reduce_sum(w * y * y)
        g, = tf.gradients(loss, [xp])
        with tf.Session() as sess:
            grad = sess.run(g, {xp: x0})
            parts = ["re", "im"] if np.iscomplexobj(x0) else ["re"]
            for idx in [(0, 0), (1, x0.shape[1] - 1), (2, 1)]:
                for part in parts:
                    d = np.zeros_like(x0)
                    d[idx] = FD_EPS if part == "re" else 1j * FD_EPS
                    fd = (sess.run(loss, {xp: x0 + d}) - sess.run(loss, {xp: x0 - d})) / (2 * FD_EPS)
                    gv = grad[idx].real if part == "re" else grad[idx].imag
                    assert abs(fd - gv) <= FD_RTOL * max(1.0, np.max(np.abs(grad))), (idx, part)


def _np_pack(a, blocks, axis):
    shape = a.shape[:axis] + (blocks, a.shape[axis] // blocks) + a.shape[axis + 1:]
    return np.moveaxis(a.reshape(shape), axis, 0)


def _np_unpack(a, axis):
    b = np.moveaxis(a, 0, axis)
    return b.reshape(b.shape[:axis] + (b.shape[axis] * b.shape[axis + 1],) + b.shape[axis + 2:])


# Blocked layouts of the transforms (the pieces of an all-to-all, fft.FFT3DOperation):
# (shape, axis, in_blocks, out_blocks). Along the last axis the rows path runs (panels
# of rows gathered / scattered), along the others the strided panel path; the second
# shape is above the threaded size (kMinParallel).
BLOCKED_CASES = [((5, 12, 60), 2, 1, 2), ((5, 12, 60), 2, 3, 1), ((5, 12, 60), 2, 4, 6),
                 ((5, 12, 60), 1, 2, 3), ((5, 12, 60), 1, 4, 1), ((5, 12, 60), 0, 1, 5),
                 ((8, 24, 180), 1, 2, 2), ((8, 24, 180), 2, 2, 4), ((8, 24, 180), 2, 4, 1)]


def _pack(a, blocks, axis):
    return a if blocks == 1 else _np_pack(a, blocks, axis)


def _unpack(a, blocks, axis):
    return a if blocks == 1 else _np_unpack(a, axis)


def _blocked_ops(axis, bi, bo, normalized, pairs=False):
    """The transforms with blocked layouts; with ``pairs``, the k side (output of the
    forward ones, input of the inverse ones) in mirror-pair order."""
    return {
        "fft": lambda t: fft_local.fft_along(t, axis, False, normalized, in_blocks=bi,
                                             out_blocks=bo, out_pairs=pairs),
        "ifft": lambda t: fft_local.fft_along(t, axis, True, normalized, in_blocks=bi,
                                              out_blocks=bo, in_pairs=pairs),
        "fft_of_real": lambda t: fft_local.fft_of_real_along(t, axis, normalized, in_blocks=bi,
                                                             out_blocks=bo, out_pairs=pairs),
        "ifft_real": lambda t: fft_local.ifft_real_part_along(t, axis, normalized, in_blocks=bi,
                                                              out_blocks=bo, in_pairs=pairs)}


@needs_native
@pytest.mark.parametrize("pairs", [False, True], ids=["numpy_order", "pair_order"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("shape,axis,bi,bo", BLOCKED_CASES)
def test_blocked_layouts_match_numpy(shape, axis, bi, bo, dtype, pairs):
    """Every transform reading in_blocks and writing out_blocks pieces equals numpy's
    transform of the unpacked input, packed; with ``pairs`` the k side is in the
    mirror-pair order of ``layout.k_order`` (odd and even lengths)."""
    rng = np.random.RandomState(sum(shape) + axis + 10 * bi + bo)
    n = shape[axis]
    x_c = (rng.randn(*shape) + 1j * rng.randn(*shape)).astype(COMPLEX[dtype])
    x_r = rng.randn(*shape).astype(dtype)
    order = layout.k_order(n) if pairs else np.arange(n)
    x_nat = np.take(x_c, np.argsort(order), axis=axis)  # x_c read in the stored order
    ref = {"fft": np.take(np.fft.fft(x_c, axis=axis) / n, order, axis=axis),
           "ifft": np.fft.ifft(x_nat, axis=axis),
           "fft_of_real": np.take(np.fft.fft(x_r, axis=axis) / n, order, axis=axis),
           "ifft_real": np.fft.ifft(x_nat, axis=axis).real}
    inputs = {"fft": x_c, "ifft": x_c, "fft_of_real": x_r, "ifft_real": x_c}
    with tf.Graph().as_default(), tf.device("/cpu:0"):
        ops = _blocked_ops(axis, bi, bo, True, pairs)
        fetches = {k: ops[k](tf.constant(_pack(inputs[k], bi, axis))) for k in ops}
        out = run(fetches)
    for k in ops:
        assert out[k].shape == _pack(ref[k], bo, axis).shape, k
        assert rel_err(_unpack(out[k], bo, axis), ref[k]) < RTOL[dtype], k


@needs_native
@pytest.mark.parametrize("pairs", [False, True], ids=["numpy_order", "pair_order"])
@pytest.mark.parametrize("shape,axis,bi,bo", BLOCKED_CASES[:6])
def test_blocked_layouts_gradients_adjoint(shape, axis, bi, bo, pairs):
    """<A x, y> = <x, A^T y> with the blocked layouts on both sides (float64; the
    gradient reads the output's blocks and writes the input's, and swaps the orders)."""
    rng = np.random.RandomState(7 + axis + bi + bo)
    packed_in = _pack(np.zeros(shape), bi, axis).shape
    packed_out = _pack(np.zeros(shape), bo, axis).shape
    x_c = rng.randn(*packed_in) + 1j * rng.randn(*packed_in)
    y_c = rng.randn(*packed_out) + 1j * rng.randn(*packed_out)
    x_r, y_r = rng.randn(*packed_in), rng.randn(*packed_out)
    ops = _blocked_ops(axis, bi, bo, False, pairs)
    _assert_adjoint([("fft", ops["fft"], x_c, y_c), ("ifft", ops["ifft"], x_c, y_c),
                     ("fft_of_real", ops["fft_of_real"], x_r, y_c),
                     ("ifft_real", ops["ifft_real"], x_c, y_r)])


# Packed real transforms (rfft_packed_along / irfft_packed_along): (shape, blocks).
PACKED_CASES = [((5, 3, 8), 1), ((5, 3, 8), 2), ((4, 7, 60), 3), ((8, 24, 180), 6), ((5, 3, 2), 1),
                ((5, 3, 4), 2), ((3, 2, 6), 1)]  # n = 2, 4, 6: h = 1, 2 and odd 3


def _np_packed(r, n):
    """numpy reference of the packed layout: rfft with the Nyquist mode in slot 0."""
    out = r[..., :n // 2].copy()
    out[..., 0] = r[..., 0].real + 1j * r[..., n // 2].real
    return out


@needs_native
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("shape,blocks", PACKED_CASES)
def test_packed_real_transforms(shape, blocks, dtype):
    """rfft_packed_along = numpy's rfft with r[0] + i r[n/2] in slot 0 (written in
    ``blocks`` pieces); irfft_packed_along inverts it (read from the pieces); the TF
    fallback gives the same (unblocked); both ops are adjoint to their gradients."""
    rng = np.random.RandomState(sum(shape) + blocks)
    n = shape[-1]
    x = rng.randn(*shape).astype(dtype)
    want = _np_packed(np.fft.rfft(x.astype(np.float64), axis=-1), n) / n
    with tf.Graph().as_default(), tf.device("/cpu:0"):
        fwd = fft_local.rfft_packed_along(tf.constant(x), 2, normalized=True, out_blocks=blocks)
        back = fft_local.irfft_packed_along(
            tf.constant(_pack(want.astype(COMPLEX[dtype]), blocks, 2)), n, 2,
            normalized=False, in_blocks=blocks)
        assert fwd.op.type == "FlowpmFftR2c" and back.op.type == "FlowpmFftC2r"
        fwd, back = run([fwd, back])
    assert rel_err(_unpack(fwd, blocks, 2), want) < RTOL[dtype]
    assert rel_err(back, x) < RTOL[dtype]
    x64, y64 = rng.randn(*shape), rng.randn(*shape[:-1], n // 2) + 1j * rng.randn(
        *shape[:-1], n // 2)
    _assert_adjoint([
        ("rfft_packed", lambda t: fft_local.rfft_packed_along(t, 2, out_blocks=blocks), x64,
         _pack(y64, blocks, 2)),
        ("irfft_packed", lambda t: fft_local.irfft_packed_along(t, n, 2, in_blocks=blocks),
         _pack(y64, blocks, 2), x64)])


def _output_buffers(sess, fetches, op_types, feed_dict=None):
    """Run ``fetches`` (fed ``feed_dict``) traced; the buffer address of the output of each op whose type
    is in ``op_types`` and of each op feeding it: ``{op name: (own ptr, [input ptrs])}``."""
    values, ptrs = H.traced_buffers(sess, fetches, feed_dict)
    ptr = {name: slots.get(0) for name, slots in ptrs.items()}
    graph = sess.graph
    found = {op.name: (ptr.get(op.name), [ptr.get(t.op.name) for t in op.inputs])
             for op in graph.get_operations() if op.type in op_types}
    return values, found


@needs_native
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("shape", [(16, 12, 64), (3, 2, 6)])
def test_packed_in_place(shape, dtype):
    """A packed r2c / c2r whose input nothing else holds runs in place in the input's
    buffer (same address, checked from the trace) with the bits of the allocating run;
    an input that is held elsewhere (fetched) is neither taken nor overwritten."""
    rng = np.random.RandomState(7 + len(dtype))
    n = shape[-1]
    x = rng.randn(*shape).astype(dtype)
    h = (rng.randn(*shape[:-1], n // 2) + 1j * rng.randn(*shape[:-1], n // 2)).astype(
        COMPLEX[dtype])
    with tf.Graph().as_default(), tf.device("/cpu:0"):
        feeds = {tf.placeholder(v.dtype, v.shape): v for v in (x, h, x, h)}
        xs, hs, xh, hh = (t * 1 for t in feeds)   # computed (not merged: four feeds)
        # xs, hs: forwardable; xh, hh: fetched too, so held
        out = {"r2c_free": fft_local.rfft_packed_along(xs, 2, normalized=True),
               "c2r_free": fft_local.irfft_packed_along(hs, n, 2, normalized=True),
               "r2c_held": fft_local.rfft_packed_along(xh, 2, normalized=True),
               "c2r_held": fft_local.irfft_packed_along(hh, n, 2, normalized=True),
               "xh": xh, "hh": hh}
        names = {k: out[k].op.name for k in ("r2c_free", "c2r_free", "r2c_held", "c2r_held")}
        with tf.Session(config=tf.ConfigProto(intra_op_parallelism_threads=2,
                                              inter_op_parallelism_threads=1)) as sess:
            vals, bufs = _output_buffers(sess, out, {"FlowpmFftR2c", "FlowpmFftC2r"}, feeds)
    for kind in ("r2c", "c2r"):
        own, (src,) = bufs[names[kind + "_free"]]
        assert own == src != 0, (kind, own, src)            # in place
        own, (src,) = bufs[names[kind + "_held"]]
        assert own != src, (kind, own, src)                 # a new buffer
        np.testing.assert_array_equal(vals[kind + "_free"], vals[kind + "_held"])
    np.testing.assert_array_equal(vals["xh"], x)            # held inputs intact
    np.testing.assert_array_equal(vals["hh"], h)
    want = _np_packed(np.fft.rfft(x.astype(np.float64), axis=-1), n) / n
    assert rel_err(vals["r2c_free"], want) < RTOL[dtype]
    assert rel_err(vals["c2r_free"], np.fft.irfft(_np_unpacked(h.astype(np.complex128), n),
                                                   n, axis=-1)) < RTOL[dtype]


def _np_unpacked(p, n):
    """The inverse of :func:`_np_packed`: n // 2 + 1 modes, slot 0 split into the zero
    and Nyquist modes (their imaginary parts zero)."""
    out = np.zeros(p.shape[:-1] + (n // 2 + 1,), p.dtype)
    out[..., :n // 2] = p
    out[..., 0] = p[..., 0].real
    out[..., n // 2] = p[..., 0].imag
    return out


@needs_native
def test_packed_and_pairs_equal_tensorflow_path(monkeypatch):
    """The packed transforms and the mirror-pair orders: native op == TF fallback."""
    rng = np.random.RandomState(11)
    x = rng.randn(6, 10, 8) + 1j * rng.randn(6, 10, 8)
    r = rng.randn(6, 10, 8)
    h = rng.randn(6, 10, 4) + 1j * rng.randn(6, 10, 4)

    def build():
        out = [fft_local.rfft_packed_along(tf.constant(r), 2, normalized=True),
               fft_local.irfft_packed_along(tf.constant(h), 8, 2, normalized=False)]
        for axis in (0, 1, 2):
            out += [fft_local.fft_along(tf.constant(x), axis, out_pairs=True),
                    fft_local.fft_along(tf.constant(x), axis, inverse=True, in_pairs=True),
                    fft_local.fft_of_real_along(tf.constant(r), axis, out_pairs=True),
                    fft_local.ifft_real_part_along(tf.constant(x), axis, in_pairs=True)]
        return out

    _assert_native_equals_tensorflow(build, monkeypatch)


def _half_reps(f):
    """numpy: the representatives of a real field's 3D transform as the half path of
    fft.FFT3DOperation holds them: kz modes 0 .. n/2 - 1, slot 0 packing the 2D
    transforms of the kz = 0 and kz = n/2 planes as A + i B; kx, ky in pair order."""
    nz = f.shape[2]
    fz = np.fft.fft(f, axis=2)
    h = np.fft.fft2(fz[:, :, :nz // 2], axes=(0, 1))
    h[:, :, 0] = np.fft.fft2(fz[:, :, 0]) + 1j * np.fft.fft2(fz[:, :, nz // 2])
    return layout.to_stored(h, axes=(0, 1))


# (shape of the real field, P blocks of ky, Q blocks of kz)
PAIRS_CASES = [((8, 6, 8), 1, 1), ((8, 6, 8), 3, 2), ((4, 8, 12), 2, 3), ((6, 4, 4), 2, 2)]


@needs_native
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("shape,P,Q", PAIRS_CASES)
def test_pairs_extend_and_fold(shape, P, Q, dtype):
    """On every (ky, kz) block: pairs_extend of the representatives is the block of
    the full transform in pair order (layout.to_stored(fftn)); pairs_fold of any
    spectrum, transformed back (ifft2 over kx, ky; packed irfft along z), is the
    real part of its inverse transform."""
    rng = np.random.RandomState(sum(shape) + P + Q)
    nx, ny, nz = shape
    ly, h = ny // P, nz // (2 * Q)
    f = rng.randn(*shape)
    full = layout.to_stored(np.fft.fftn(f))
    reps = _half_reps(f)
    z = rng.randn(*shape) + 1j * rng.randn(*shape)
    c = COMPLEX[dtype]
    blocks = [(i, q) for i in range(P) for q in range(Q)]
    with tf.Graph().as_default(), tf.device("/cpu:0"):
        fetches = []
        for i, q in blocks:
            firsts = tf.constant([int(i == 0), int(q == 0)], tf.int32)
            rep_blk = reps[:, i * ly:(i + 1) * ly, q * h:(q + 1) * h].astype(c)
            z_blk = z[:, i * ly:(i + 1) * ly, 2 * q * h:2 * (q + 1) * h].astype(c)
            fetches.append((fft_local.pairs_extend(tf.constant(rep_blk), firsts),
                            fft_local.pairs_fold(tf.constant(z_blk), firsts)))
        out = run(fetches)
    fold = np.zeros((nx, ny, nz // 2), np.complex128)
    for (i, q), (ext, fo) in zip(blocks, out):
        assert ext.dtype == c and fo.dtype == c
        want = full[:, i * ly:(i + 1) * ly, 2 * q * h:2 * (q + 1) * h]
        assert rel_err(ext, want) < RTOL[dtype], (i, q)
        fold[:, i * ly:(i + 1) * ly, q * h:(q + 1) * h] = fo
    back = np.fft.ifft2(layout.to_natural(fold, axes=(0, 1)), axes=(0, 1))
    planes = np.concatenate([back[:, :, :1].real, back[:, :, 1:],
                             back[:, :, :1].imag], axis=2)
    back = np.fft.irfft(planes, n=nz, axis=2)
    assert rel_err(back, np.fft.ifftn(layout.to_natural(z)).real) < RTOL[dtype] * 10


@needs_native
@pytest.mark.parametrize("first_y,first_z", [(1, 1), (0, 1), (1, 0), (0, 0)])
def test_pairs_gradients_adjoint(first_y, first_z):
    """<A x, y> = <x, A^T y> for pairs_extend and pairs_fold on first and other blocks
    (A^T y from tf.gradients), float64."""
    rng = np.random.RandomState(first_y + 2 * first_z)

    def cplx(*s):
        return rng.randn(*s) + 1j * rng.randn(*s)

    firsts = np.array([first_y, first_z], np.int32)
    _assert_adjoint([
        ("extend", lambda t: fft_local.pairs_extend(t, tf.constant(firsts)), cplx(6, 4, 3),
         cplx(6, 4, 6)),
        ("fold", lambda t: fft_local.pairs_fold(t, tf.constant(firsts)), cplx(6, 4, 6),
         cplx(6, 4, 3))])


@needs_native
@pytest.mark.parametrize("axis", [0, 1, 2])
def test_pair_orders_in_place(axis):
    """A transform with a pair order may run in place in its input's buffer (a computed
    tensor TensorFlow forwards): every panel reads all its rows before writing them."""
    rng = np.random.RandomState(20 + axis)
    shape = (12, 10, 300) if axis < 2 else (40, 30, 16)  # above the threaded size
    x = rng.randn(*shape) + 1j * rng.randn(*shape)
    n = shape[axis]
    with tf.Graph().as_default(), tf.device("/cpu:0"):
        fwd = fft_local.fft_along(tf.constant(x) * 1, axis, out_pairs=True)
        inv = fft_local.fft_along(tf.constant(x) * 1, axis, inverse=True, in_pairs=True)
        fwd, inv = run([fwd, inv])
    assert rel_err(fwd, np.take(np.fft.fft(x, axis=axis), layout.k_order(n), axis=axis)) \
        < RTOL["float64"]
    x_nat = np.take(x, layout.k_positions(n), axis=axis)
    assert rel_err(inv, np.fft.ifft(x_nat, axis=axis)) < RTOL["float64"]


@needs_native
def test_blocked_layouts_bad_input_raise():
    with tf.Graph().as_default(), tf.device("/cpu:0"):
        with pytest.raises(ValueError, match="does not split into 4 blocks"):
            fft_local.fft_along(tf.zeros([4, 6, 10], tf.complex64), 1, out_blocks=4)
        with pytest.raises(ValueError, match="leading axis of 3 blocks"):
            fft_local.fft_along(tf.zeros([2, 6, 10], tf.complex64), 1, in_blocks=3)
        with pytest.raises(ValueError, match="out of range"):
            fft_local.fft_along(tf.zeros([2, 6, 10], tf.complex64), 2, in_blocks=2)


@needs_native
def test_native_concurrent_planning():
    """Many first-time plans of different shapes in one run, on 2 inter-op threads:
    the plan cache is shared and the FFTW planner is serialised (no crash, right values)."""
    rng = np.random.RandomState(5)
    arrays = [rng.randn(4, n, 9) + 1j * rng.randn(4, n, 9) for n in (11, 13, 17, 19, 23, 29)]
    with tf.Graph().as_default(), tf.device("/cpu:0"):
        outs = [fft_local.fft_along(tf.constant(a), axis) for a in arrays for axis in (0, 1, 2)]
        res = run(outs)
    refs = [np.fft.fft(a, axis=axis) for a in arrays for axis in (0, 1, 2)]
    for o, ref in zip(res, refs):
        assert rel_err(o, ref) < RTOL["float64"]


def test_bad_lengths_raise():
    with tf.Graph().as_default(), tf.device("/cpu:0"):
        with pytest.raises(ValueError, match="n // 2 \\+ 1"):
            fft_local.irfft_along(tf.zeros([4, 5], tf.complex64), 12, 1)
        with pytest.raises(ValueError, match="out of range"):
            fft_local.fft_along(tf.zeros([4, 5], tf.complex64), 2)

