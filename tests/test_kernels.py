"""flowpm_mtf.physics.kernels: two real fields per complex inverse FFT (packed_inverse).

* the packed gradient, Hessian and 2LPT fields equal the unpacked ones (one
  real-output transform per component, today's reference path, itself tested
  against FlowPM in test_lpt.py) and a numpy evaluation of the kernels;
* the gradient of the packed map (bitcast read-out of the complex result, with
  its own gradient, after a complex inverse FFT) passes a dot-product test and
  equals the unpacked map's gradient.

On the process grids of the current world size, HvdSimdMeshImpl and
PlacementMeshImpl (see ``fpm_harness``; both dtypes, float64 only on the placement grid:
``fpm_harness.case_dtypes``).
"""
import numpy as np
import pytest
import mesh_tensorflow as mtf
import tensorflow.compat.v1 as tf

import fpm_harness as H
from flowpm_mtf.mesh import complex_ops, fft
from flowpm_mtf import layout, native
from flowpm_mtf.physics import kernels
from flowpm_mtf.config import XYZ, SimConfig

# Packed vs unpacked: the same kernels and 1D FFTs in a different grouping; the
# packed result also carries the non-Hermitian rounding residue of its partner
# (relative size epsilon). float64: ~log2(N) * 1e-16 of the largest value;
# float32: ~log2(N) * 6e-8, with margin (as test_fft.FFT_RTOL).
PACKED_RTOL = {"float64": 1e-12, "float32": 1e-5}
# <A x, y> = <x, A^T y> in float64: sums of ~N O(1) products in different orders.
ADJOINT_RTOL = 1e-12

SHAPES = [(8, 8, 8), (6, 10, 4)]
CASES = H.cases(single=True)


def conf_for(case, nc, dtype="float64"):
    return SimConfig(nc=nc, box_size=(100.0, 50.0, 25.0), grid=case[1], halo_size=1,
                     dtype=dtype)


def numpy_fields(conf, x):
    """-grad phi [cells] and the six -d_i d_j phi of nabla^2 phi = x, in numpy (float64)."""
    n = x.size
    dk = np.fft.fftn(x.astype(np.float64)) / n
    k = np.meshgrid(*[2 * np.pi * np.fft.fftfreq(m, c) for m, c in zip(conf.nc, conf.cell_size)],
                    indexing="ij")
    kk = sum(ki**2 for ki in k)
    inv = np.where(kk > 0, 1.0 / np.where(kk > 0, kk, 1.0), 0.0)
    # gradient_kvec is in the stored (mirror-pair) order; numpy's FFT order here
    gk = np.meshgrid(*[g[layout.k_positions(g.size)] for g in kernels.gradient_kvec(conf)],
                     indexing="ij")
    pot = dk * inv
    grad = [n * np.fft.ifftn(1j * gk[d] / c * pot).real for d, c in enumerate(conf.cell_size)]
    hess = [n * np.fft.ifftn(-gk[i] * gk[j] * pot).real for i, j in kernels.HESSIAN_PAIRS]
    return np.stack(grad, -1), hess


# The shape and dtype of the adjoint test (test_packed_gradient_adjoint): its graph is the
# packed-vs-unpacked graph of the same case with the losses and gradients added.
ADJOINT_NC, ADJOINT_DTYPE = (6, 10, 4), "float64"


def _run_packed(case, nc, dtype):
    """The packed and unpacked gradient and Hessian fields (``*_p``, ``*_u``) and
    potential_fields' (``lpt_*``) of a random field ``x`` (returned too); for
    ``ADJOINT_NC`` in ``ADJOINT_DTYPE``, in the same graph, the losses
    ``<y, (grad, six Hessian fields)>`` of the packed (``loss``) and the unpacked path
    and their gradients ``g``, ``g_u`` with respect to ``x``, and ``x_g = <x, g>``."""
    conf = conf_for(case, nc, dtype)
    x0 = np.random.RandomState(4).randn(*nc).astype(dtype)
    adjoint = tuple(nc) == ADJOINT_NC and dtype == ADJOINT_DTYPE
    rng = np.random.RandomState(5)
    y_grad = rng.randn(*nc + (3,))
    y_hess = [rng.randn(*nc) for _ in range(6)]

    def build(mesh):
        real = fft.real_shape(conf)
        x = mtf.import_tf_tensor(mesh, tf.constant(x0), real)
        dk = fft.r2c(x, conf)
        kern = kernels.make_kernels(conf, mesh)
        out = {}
        for packed in (True, False):
            tag = "p" if packed else "u"
            out["grad_" + tag] = kernels.neg_gradient_potential(dk, conf, kern, packed=packed)
            for name, pairs in (("diag", kernels.HESSIAN_PAIRS[:3]),
                                ("off", kernels.HESSIAN_PAIRS[3:])):
                out["%s_%s" % (name, tag)] = kernels.hessian_potential(dk, conf, kern, pairs,
                                                                       packed=packed)
        grad, hess = kernels.potential_fields(dk, conf, kern)
        out["lpt_grad"] = grad
        for i, h in enumerate(hess):
            out["lpt_h%d" % i] = h
        if adjoint:
            yg = mtf.import_tf_tensor(mesh, tf.constant(y_grad), real + [mtf.Dimension(XYZ, 3)])
            yh = [mtf.import_tf_tensor(mesh, tf.constant(v), real) for v in y_hess]
            loss = complex_ops.real_vdot(yg, grad)
            for y, h in zip(yh, hess):
                loss = loss + complex_ops.real_vdot(y, h)
            g, = mtf.gradients([loss], [x])
            # the unpacked path
            hu = kernels.unstack_xyz(out["diag_u"]) + kernels.unstack_xyz(out["off_u"])
            loss_u = complex_ops.real_vdot(yg, out["grad_u"])
            for y, h in zip(yh, hu):
                loss_u = loss_u + complex_ops.real_vdot(y, h)
            g_u, = mtf.gradients([loss_u], [x])
            out.update(loss=loss, x_g=complex_ops.real_vdot(x, g), g=g, g_u=g_u)
        return out

    out = H.run(case[0], conf, build)
    out["x"] = x0
    return out


@pytest.fixture(scope="module")
def packed_runs():
    """``get(case, nc, dtype)``: :func:`_run_packed`, run once per argument set (the
    adjoint test reads the graph of test_packed_equals_unpacked's case)."""
    cache = {}

    def get(case, nc, dtype):
        key = (case[0], tuple(case[1]), tuple(nc), dtype)
        if key not in cache:
            cache[key] = _run_packed(case, nc, dtype)
        return cache[key]

    return get


@pytest.mark.parametrize("case, dtype", H.case_dtypes(CASES))
@pytest.mark.parametrize("nc", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_packed_equals_unpacked(case, nc, dtype, packed_runs):
    out = packed_runs(case, nc, dtype)
    tol = PACKED_RTOL[dtype]
    ref_grad, ref_hess = numpy_fields(conf_for(case, nc, dtype), out["x"])
    assert out["grad_p"].dtype == np.dtype(dtype) and out["grad_p"].shape == nc + (3,)
    for key in ("grad_p", "grad_u", "lpt_grad"):
        assert H.rel_err(out[key], ref_grad) < tol, key
    assert H.rel_err(out["grad_p"], out["grad_u"]) < tol
    hess_u = np.concatenate([out["diag_u"], out["off_u"]], -1)
    hess_p = np.concatenate([out["diag_p"], out["off_p"]], -1)
    hess_lpt = np.stack([out["lpt_h%d" % i] for i in range(6)], -1)
    ref = np.stack(ref_hess, -1)
    for h in (hess_u, hess_p, hess_lpt):
        assert H.rel_err(h, ref) < tol
    assert H.rel_err(hess_p, hess_u) < tol and H.rel_err(hess_lpt, hess_u) < tol


@pytest.mark.parametrize("case", CASES, ids=H.case_id)
def test_packed_gradient_adjoint(case, packed_runs):
    """The linear map x -> (grad, six Hessian fields) with x real: <A x, y> = <x, A^T y>,
    and A^T y (mtf.gradients through the packed path) equals the unpacked path's."""
    out = packed_runs(case, ADJOINT_NC, ADJOINT_DTYPE)
    np.testing.assert_allclose(out["x_g"], out["loss"], rtol=ADJOINT_RTOL)
    assert H.rel_err(out["g"], out["g_u"]) < PACKED_RTOL["float64"]


@pytest.mark.parametrize("case, dtype", H.case_dtypes(CASES))
@pytest.mark.parametrize("use_native", [True, False], ids=["native", "tf"])
def test_sequential_equals_batched(case, dtype, use_native, monkeypatch):
    """neg_gradient_potential(sequential=True): the two packed transforms one after the
    other (ordering.after), assembled by xyz_from_packed (the native FlowpmInterleave,
    or tf.stack as with FLOWPM_MTF_NATIVE=0), give the batched values exactly, and the
    same gradient."""
    if not use_native:
        monkeypatch.setattr(native, "load", lambda name: None)
    elif native.load("cic_ops") is None:
        pytest.skip("native cic_ops not built")
    nc = (6, 10, 4)
    conf = conf_for(case, nc, dtype)
    rng = np.random.RandomState(6)
    x0 = rng.randn(*nc).astype(dtype)
    y0 = rng.randn(*nc + (3,)).astype(dtype)

    def build(mesh):
        real = fft.real_shape(conf)
        x = mtf.import_tf_tensor(mesh, tf.constant(x0), real)
        y = mtf.import_tf_tensor(mesh, tf.constant(y0), real + [mtf.Dimension(XYZ, 3)])
        kern = kernels.make_kernels(conf, mesh)
        dk = fft.r2c(x, conf)
        out = {}
        for tag, seq in (("b", False), ("s", True)):
            grad = kernels.neg_gradient_potential(dk, conf, kern, sequential=seq)
            out[tag] = grad
            out["g_" + tag], = mtf.gradients([complex_ops.real_vdot(y, grad)], [x])
        return out

    out = H.run(case[0], conf, build)
    assert out["s"].shape == nc + (3,)
    np.testing.assert_array_equal(out["s"], out["b"])
    np.testing.assert_array_equal(out["g_s"], out["g_b"])


@pytest.mark.parametrize("case", CASES, ids=H.case_id)
@pytest.mark.parametrize("use_native", [True, False], ids=["native", "tf"])
def test_interleave_xyz_is_stack_xyz_with_its_adjoint(case, use_native, monkeypatch):
    """interleave_xyz (the native FlowpmInterleave of three real fields, or tf.stack as with
    FLOWPM_MTF_NATIVE=0) gives stack_xyz's values exactly; its gradient is stack_xyz's and
    passes the dot-product test <A x, y> = <x, A^T y>."""
    if not use_native:
        monkeypatch.setattr(native, "load", lambda name: None)
    elif native.load("cic_ops") is None:
        pytest.skip("native cic_ops not built")
    nc = (6, 10, 4)
    conf = conf_for(case, nc)
    rng = np.random.RandomState(7)
    xs0 = [rng.randn(*nc) for _ in range(3)]
    y0 = rng.randn(*nc + (3,))

    def build(mesh):
        real = fft.real_shape(conf)
        xs = [mtf.import_tf_tensor(mesh, tf.constant(v), real) for v in xs0]
        y = mtf.import_tf_tensor(mesh, tf.constant(y0), real + [mtf.Dimension(XYZ, 3)])
        fast = kernels.interleave_xyz(xs, "fast")
        ref = kernels.stack_xyz(xs, "ref")
        loss = complex_ops.real_vdot(y, fast)
        gs = mtf.gradients([loss], xs)
        gr = mtf.gradients([complex_ops.real_vdot(y, ref)], xs)
        x_g = complex_ops.real_vdot(xs[0], gs[0])
        for x, g in zip(xs[1:], gs[1:]):
            x_g = x_g + complex_ops.real_vdot(x, g)
        return {"fast": fast, "ref": ref, "loss": loss, "x_g": x_g,
                "g": mtf.stack(gs, XYZ, axis=3), "g_ref": mtf.stack(gr, XYZ, axis=3)}

    out = H.run(case[0], conf, build)
    np.testing.assert_array_equal(out["fast"], out["ref"])
    np.testing.assert_array_equal(out["fast"], np.stack(xs0, -1))
    np.testing.assert_array_equal(out["g"], out["g_ref"])
    np.testing.assert_allclose(out["x_g"], out["loss"], rtol=ADJOINT_RTOL)


def test_inverse_after_rejects_three_fields():
    conf = conf_for(("placement", (1, 1)), (4, 4, 4))
    with tf.Graph().as_default():
        mesh = mtf.Mesh(mtf.Graph(), "mesh")
        pot = mtf.zeros(mesh, fft.k_shape(conf), tf.complex128)
        kern = kernels.make_kernels(conf, mesh)
        with pytest.raises(ValueError, match="one or two fields"):
            kernels.inverse_after(pot, [kernels.gradient_spec(kern, d) for d in range(3)], conf)


def test_packed_inverse_rejects_bad_groups():
    conf = conf_for(("placement", (1, 1)), (4, 4, 4))
    with tf.Graph().as_default():
        mesh = mtf.Mesh(mtf.Graph(), "mesh")
        k = mtf.zeros(mesh, fft.k_shape(conf), tf.complex128)
        one = mtf.ones(mesh, fft.k_shape(conf), tf.float64)
        with pytest.raises(ValueError, match="do not cover"):
            kernels.packed_inverse([(k, one, 1.0)] * 3, conf, [("xyz", 2)])


def test_xyz_from_packed_rejects_bad_inputs():
    conf = conf_for(("placement", (1, 1)), (4, 4, 4))
    with tf.Graph().as_default():
        mesh = mtf.Mesh(mtf.Graph(), "mesh")
        pair = mtf.Dimension("pair", 1)
        z = mtf.zeros(mesh, fft.real_shape(conf) + [pair], tf.complex128)
        two = mtf.zeros(mesh, fft.real_shape(conf) + [mtf.Dimension("pair", 2)], tf.complex128)
        real = mtf.zeros(mesh, fft.real_shape(conf) + [pair], tf.float64)
        with pytest.raises(ValueError, match="pair\\(1\\)"):
            kernels.xyz_from_packed(z, two)
        with pytest.raises(ValueError, match="pair\\(1\\)"):
            kernels.xyz_from_packed(real, z)


ONE_BLOCK = [c for c in CASES if tuple(c[1]) == (1, 1)]


@pytest.mark.skipif(not ONE_BLOCK, reason="one block: one rank")
@pytest.mark.parametrize("case", ONE_BLOCK, ids=H.case_id)
@pytest.mark.parametrize("use_native", [True, False], ids=["native", "tf"])
def test_padded_gradient_field_on_one_block(case, use_native, monkeypatch):
    """neg_gradient_potential(padded=True) on one block: the padded block with periodic
    margins, equal to field_to_padded of the field exactly (native FlowpmInterleave with
    wrap, or the TensorFlow path), with the same gradient."""
    from flowpm_mtf.mesh import halo
    if not use_native:
        monkeypatch.setattr(native, "load", lambda name: None)
    elif native.load("cic_ops") is None:
        pytest.skip("native cic_ops not built")
    nc = (6, 10, 4)
    conf = SimConfig(nc=nc, box_size=(100.0, 50.0, 25.0), grid=(1, 1), halo_size=2)
    rng = np.random.RandomState(7)
    x0 = rng.randn(*nc)
    y0 = rng.randn(*(conf.grid + conf.padded_block_shape + (3,)))

    def build(mesh):
        x = mtf.import_tf_tensor(mesh, tf.constant(x0), fft.real_shape(conf))
        y = mtf.import_tf_tensor(mesh, tf.constant(y0), halo.padded_shape(conf)
                                 + [mtf.Dimension(XYZ, 3)])
        kern = kernels.make_kernels(conf, mesh)
        dk = fft.r2c(x, conf)
        out = {"p": kernels.neg_gradient_potential(dk, conf, kern, sequential=True, padded=True),
               "f": halo.field_to_padded(kernels.neg_gradient_potential(dk, conf, kern,
                                                                        sequential=True), conf)}
        for tag in ("p", "f"):
            out["g_" + tag], = mtf.gradients([complex_ops.real_vdot(y, out[tag])], [x])
        return out

    out = H.run(case[0], conf, build)
    np.testing.assert_array_equal(out["p"], out["f"])
    np.testing.assert_allclose(out["g_p"], out["g_f"], rtol=1e-12, atol=1e-14)


def test_padded_gradient_field_needs_one_block():
    conf = conf_for(("placement", (2, 1)), (8, 4, 4))
    with tf.Graph().as_default():
        mesh = mtf.Mesh(mtf.Graph(), "mesh")
        dk = mtf.zeros(mesh, fft.k_shape(conf), tf.complex128)
        kern = kernels.make_kernels(conf, mesh)
        with pytest.raises(ValueError, match="one block"):
            kernels.neg_gradient_potential(dk, conf, kern, sequential=True, padded=True)
        with pytest.raises(ValueError, match="packed and sequential"):
            kernels.neg_gradient_potential(dk, conf, kern, padded=True)


@pytest.mark.parametrize("dtype", [tf.float64, tf.complex128])
def test_real_vdot_of_a_tensor_with_itself(dtype):
    """d/du 0.5 <u, u> = u (the same tensor on both sides: Mesh TF's generic slicewise
    gradient counted it twice, giving 2u), and <u, v> still differentiates in both."""
    conf = SimConfig(nc=8, box_size=8.0, grid=H.HVD_GRIDS[H.SIZE][0])   # this world's grid
    rng = np.random.RandomState(3)
    u0 = rng.randn(8, 8, 8) + (1j * rng.randn(8, 8, 8) if dtype.is_complex else 0)
    v0 = rng.randn(8, 8, 8)

    def build(mesh):
        shape = fft.real_shape(conf)
        u = mtf.import_tf_tensor(mesh, tf.constant(u0, dtype), shape)
        v = mtf.import_tf_tensor(mesh, tf.constant(v0, dtype), shape)
        gu, = mtf.gradients([complex_ops.real_vdot(u, u) * 0.5], [u])
        gv, = mtf.gradients([complex_ops.real_vdot(u, v)], [v])
        return {"gu": gu, "gv": gv}

    out = H.run("hvd", conf, build)
    np.testing.assert_allclose(out["gu"], u0, rtol=1e-14)
    np.testing.assert_allclose(out["gv"], u0, rtol=1e-14)
