"""The LPT fields in real space (flowpm_mtf.physics.lpt_source): the native 2LPT source
``FlowpmLpt2Source`` and its TensorFlow twin against numpy (the spectral Hessian of the
four-point difference on a periodic field), its registered gradient
(``FlowpmLpt2SourceGrad``) against the twin's TensorFlow gradient and by central
differences (exact for a quadratic map); and ``lpt.lpt_displacements`` in real space
against the k-space path on every grid of the world size, orders 1 and 2, float32 and
float64 (against FlowPM: tests/test_lpt.py, which takes the real-space path by default)."""
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import fpm_harness as H
import nbody_harness as NH
from flowpm_mtf.physics import lpt, lpt_source
from flowpm_mtf import native
from flowpm_mtf.config import SimConfig

tf.disable_eager_execution()


def _source_numpy(periodic, coeffs):
    """S of a periodic ``[B, nx, ny, nz]`` field from the spectral Hessian: the
    four-point difference along d has the transfer function 2 i c_d (8 sin w - sin 2w)."""
    f = np.fft.fftn(periodic, axes=(1, 2, 3))
    t = []
    for d, n in enumerate(periodic.shape[1:]):
        w = 2 * np.pi * np.fft.fftfreq(n)
        shape = [1, 1, 1, 1]
        shape[d + 1] = n
        t.append((2j * coeffs[d] * (8 * np.sin(w) - np.sin(2 * w))).reshape(shape))

    def h(i, j):
        return np.fft.ifftn(t[i] * t[j] * f, axes=(1, 2, 3)).real

    xx, yy, zz, xy, xz, yz = h(0, 0), h(1, 1), h(2, 2), h(0, 1), h(0, 2), h(1, 2)
    return xx * yy + yy * zz + zz * xx - xy * xy - xz * xz - yz * yz


def _wrap_pad(periodic, m):
    return np.pad(periodic, [(0, 0), (m, m), (m, m), (0, 0)], mode="wrap")


@pytest.mark.skipif(H.SIZE != 1, reason="a single-process TensorFlow test")
@pytest.mark.parametrize("margin,shape", [(4, (2, 6, 7, 5)), (4, (1, 5, 4, 9)),
                                          (5, (1, 4, 6, 3)), (4, (1, 8, 5, 1)),
                                          (0, (2, 6, 7, 5)), (0, (1, 3, 9, 4))])
def test_source_native_tf_numpy(margin, shape):
    """FlowpmLpt2Source and source_tf on a periodic field padded by its own cells (margin
    0: the field itself, read periodically) against the spectral numpy source (axes
    shorter than the stencil's reach of 4 included);
    the registered gradient against the twin's TensorFlow gradient, and against central
    differences, which are exact for a quadratic map: S(p + v) - S(p - v) = 2 dS(p)[v]."""
    lib = native.load("lpt_ops")
    rng = np.random.RandomState(margin + shape[1] + shape[3])
    periodic = rng.randn(*shape)
    coeffs = np.array([-0.3, 1.7, 0.05]) / 12
    want = _source_numpy(periodic, coeffs)
    phi, v = _wrap_pad(periodic, margin), rng.randn(*_wrap_pad(periodic, margin).shape)
    dy = rng.randn(*want.shape)
    with tf.Graph().as_default(), tf.Session() as sess:
        p, c, y = tf.constant(phi), tf.constant(coeffs), tf.constant(dy)
        s_native = lib.flowpm_lpt2_source(p, c, margin=margin)
        s_tf = lpt_source.source_tf(p, c, margin)
        g_native, = tf.gradients(s_native, [p], grad_ys=[y])
        g_tf, = tf.gradients(s_tf, [p], grad_ys=[y])
        plus = lib.flowpm_lpt2_source(p + v, c, margin=margin)
        minus = lib.flowpm_lpt2_source(p - v, c, margin=margin)
        got = sess.run([s_native, s_tf, g_native, g_tf, plus, minus])
    got_native, got_tf, gn, gt, sp, sm = got
    scale = np.max(np.abs(want))
    assert scale > 0.1
    np.testing.assert_allclose(got_native, want, rtol=0, atol=1e-12 * scale)
    np.testing.assert_allclose(got_tf, want, rtol=0, atol=1e-12 * scale)
    assert gn.shape == phi.shape
    np.testing.assert_allclose(gn, gt, rtol=0, atol=1e-12 * np.max(np.abs(gt)))
    lhs, rhs = np.sum((sp - sm) * dy) / 2, np.sum(gn * v)
    assert abs(lhs - rhs) <= 1e-11 * np.sum(np.abs((sp - sm) * dy)), (lhs, rhs)


@pytest.mark.skipif(H.SIZE != 1, reason="a single-process TensorFlow test")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_source_periodic_equals_padded(dtype):
    """Margin 0 (one block, read periodically) is margin 4 on the field padded by its own
    cells, bit for bit; its gradient is the padded gradient with its margins folded back
    onto the cells they copy (the transpose of the padding), to rounding."""
    lib = native.load("lpt_ops")
    rng = np.random.RandomState(7)
    periodic = rng.randn(2, 12, 10, 8).astype(dtype)
    coeffs = (np.array([0.4, -1.1, 0.7]) / 12).astype(dtype)
    dy = rng.randn(*periodic.shape).astype(dtype)
    with tf.Graph().as_default(), tf.Session() as sess:
        p, padded = tf.constant(periodic), tf.constant(_wrap_pad(periodic, 4))
        c, y = tf.constant(coeffs), tf.constant(dy)
        s0, s4 = lib.flowpm_lpt2_source(p, c, margin=0), lib.flowpm_lpt2_source(padded, c,
                                                                                margin=4)
        g0, = tf.gradients(s0, [p], grad_ys=[y])
        g4, = tf.gradients(s4, [padded], grad_ys=[y])
        got0, got4, gr0, gr4 = sess.run([s0, s4, g0, g4])
    np.testing.assert_array_equal(got0, got4)
    assert np.max(np.abs(got0)) > 0.1
    folded = np.zeros(periodic.shape, np.float64)
    nx, ny = periodic.shape[1:3]
    for i in range(nx + 8):
        for j in range(ny + 8):
            folded[:, (i - 4) % nx, (j - 4) % ny] += gr4[:, i, j]
    tol = (1e-5 if dtype == np.float32 else 1e-13) * np.max(np.abs(folded))
    np.testing.assert_allclose(gr0, folded, rtol=0, atol=tol)


@pytest.mark.skipif(H.SIZE != 1, reason="a single-process TensorFlow test")
def test_source_rejects_bad_input():
    """A margin below the reach of 4 (other than 0), a potential not larger than its
    margins and a wrong weight shape are refused with one clear line each."""
    lib = native.load("lpt_ops")
    with tf.Graph().as_default():
        c = tf.constant(np.ones(3))
        with pytest.raises((ValueError, TypeError), match="margin"):
            lib.flowpm_lpt2_source(tf.zeros([1, 12, 12, 4], tf.float64), c, margin=3)
    with tf.Graph().as_default(), tf.Session() as sess:
        c = tf.constant(np.ones(3))
        with pytest.raises(tf.errors.InvalidArgumentError, match="not larger than its margins"):
            sess.run(lib.flowpm_lpt2_source(tf.zeros([1, 8, 12, 4], tf.float64), c, margin=4))
        with pytest.raises(tf.errors.InvalidArgumentError, match="sbar must be"):
            sess.run(lib.flowpm_lpt2_source_grad(tf.zeros([1, 12, 12, 4], tf.float64),
                                                 tf.zeros([1, 4, 3, 4], tf.float64), c,
                                                 margin=4))


NC = 16
BOX = 64.0
CASES = H.cases(single=True)
# The same linear maps (and, for psi2, the same quadratic source) rounded differently:
# float64 measured <= 2e-15 relative to the largest component at 16^3, float32 <= 1e-6.
# A wrong coefficient, axis or sign is O(1).
FIELD_RTOL = {"float64": 1e-12, "float32": 1e-5}


@pytest.fixture(scope="module")
def linear():
    return NH.linear_field_numpy(SimConfig(nc=NC, box_size=BOX))


@pytest.mark.parametrize("case", CASES, ids=H.case_id)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("order", [1, 2])
def test_displacements_real_space_equal_kspace(case, dtype, order, linear):
    """lpt_displacements through the potential in real space (one real inverse FFT per
    potential, the native source and difference ops) against the packed k-space
    transforms, every grid; anisotropic cells, so that a wrong axis shows."""
    kind, grid = case
    conf = SimConfig(nc=NC, box_size=(BOX, 48.0, 80.0), grid=grid, halo_size=2,
                     lpt_order=order, dtype=dtype)
    if not lpt_source.available(conf, conf.tf_dtype):
        pytest.skip("blocks %s narrower than the source's reach" % (conf.block_shape,))

    def build(mesh):
        lin = NH.import_field(mesh, conf, linear.astype(conf.np_dtype))
        out = {}
        for real in (True, False):
            psis = lpt.lpt_displacements(lin, conf, order, real_space=real)
            for i, psi in enumerate(psis):
                out["%s%d" % ("real" if real else "k", i + 1)] = \
                    lpt.particles_to_lattice_order(psi, conf)
        return out

    out = H.run(kind, conf, build)
    for i in range(1, order + 1):
        err = H.rel_err(out["real%d" % i], out["k%d" % i])
        print("psi%d real space vs k-space %s %s: %.3g" % (i, H.case_id(case), dtype, err))
        assert err <= FIELD_RTOL[dtype], (i, err)
        assert np.max(np.abs(out["k%d" % i])) > 0.01
