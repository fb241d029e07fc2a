"""Distributed FFT: against numpy.fft on the gathered array, adjoint and
finite-difference gradient tests, k-vectors and the kernel op.

Every test runs on the process grids of the current world size with
HvdSimdMeshImpl, and with PlacementMeshImpl (see ``fpm_harness``).
"""
import numpy as np
import pytest
import mesh_tensorflow as mtf
import tensorflow.compat.v1 as tf

import fpm_harness as H
import fresh_imports
from flowpm_mtf.mesh import complex_ops, fft, fft_local
from flowpm_mtf import layout
from flowpm_mtf.config import SimConfig

# float64 FFT of a few hundred points: rounding error ~ log2(N) * 1e-16 relative
# to the largest coefficient; 1e-12 leaves a wide margin while catching any
# normalisation, ordering or layout error (those are O(1)).
FFT_RTOL = {"float64": 1e-12, "float32": 1e-5}  # float32: ~log2(N) * 6e-8, with margin
# Dot-product tests <Ax, y> = <x, A^T y> in float64: both sides are sums of
# ~N products of O(1) numbers computed in different orders: ~N * 1e-16.
ADJOINT_RTOL = 1e-12
# Central finite differences in float64 with step 1e-6 on a quadratic loss:
# truncation error is zero for a quadratic, rounding ~1e-16 / 1e-6 = 1e-10
# relative to the loss; 1e-6 relative to the gradient is a safe bound.
FD_EPS = 1e-6
FD_RTOL = 1e-6

SHAPES = [(8, 8, 8), (6, 10, 4)]  # cubic; non-cubic with odd factors 3 and 5
CASES = H.cases(single=True, one_1d=False)


def conf_for(case, nc, dtype="float64"):
    return SimConfig(nc=nc, box_size=(100.0, 50.0, 25.0), grid=case[1], halo_size=1,
                     dtype=dtype)


def crandn(rng, shape, dtype):
    return (rng.randn(*shape) + 1j * rng.randn(*shape)).astype(dtype)


@pytest.mark.parametrize("case", CASES, ids=H.case_id)
@pytest.mark.parametrize("nc", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_fft_matches_numpy(case, nc, dtype):
    """r2c = fftn/N, c2r = N Re(ifftn), round trip, on the gathered arrays (k-space
    in the mirror-pair order of ``layout.k_order``)."""
    conf = conf_for(case, nc, dtype)
    rng = np.random.RandomState(1)
    x = rng.randn(*nc).astype(dtype)
    kin = crandn(rng, nc, conf.np_complex_dtype)  # not Hermitian: tests the real part

    def build(mesh):
        f = mtf.import_tf_tensor(mesh, tf.constant(x), fft.real_shape(conf))
        k = mtf.import_tf_tensor(mesh, tf.constant(kin), fft.k_shape(conf))
        fk = fft.r2c(f, conf)
        assert fk.shape.dimension_names == ["kx", "ky", "kz"]
        return {"fk": fk, "back": fft.c2r(fk, conf), "ck": fft.c2r(k, conf)}

    out = H.run(case[0], conf, build)
    n = x.size
    tol = FFT_RTOL[dtype]
    assert out["fk"].dtype == conf.np_complex_dtype
    assert H.rel_err(out["fk"], layout.to_stored(np.fft.fftn(x.astype(np.float64)) / n)) < tol
    assert H.rel_err(out["back"], x) < tol
    want = n * np.fft.ifftn(layout.to_natural(kin.astype(np.complex128))).real
    assert H.rel_err(out["ck"], want) < tol


def _half_path_expected(kind, conf, native_path):
    """Whether FFT3DOperation takes the half-spectrum path (``_lower_half``) for r2c/c2r
    (``kind`` "single" runs on a 1x1 mesh whatever ``conf.grid``)."""
    (P, Q), (_, ny, nz) = (1, 1) if kind == "single" else conf.grid, conf.nc
    return native_path and all(n % 2 == 0 for n in conf.nc) and (ny // P) % 2 == 0 \
        and (nz // Q) % 2 == 0


@pytest.mark.parametrize("nc,grid,fits", [
    ((8, 8, 8), (2, 2), True), ((6, 10, 4), (2, 2), False), ((6, 10, 4), (1, 2), True),
    ((4, 8, 12), (2, 3), True), ((4, 12, 8), (4, 2), False), ((7, 8, 8), (1, 1), False),
    ((8, 8, 6), (1, 3), True), ((8, 8, 6), (1, 6), False)])
def test_half_spectrum_fits(nc, grid, fits):
    """Even sizes and even ky (nc[1] / P) and kz (nc[2] / Q) blocks, nothing else."""
    assert fft.half_spectrum_fits(nc, grid) is fits


@pytest.mark.parametrize("case", CASES, ids=H.case_id)
@pytest.mark.parametrize("nc", SHAPES + [(4, 8, 12)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("path", ["native", "tensorflow"])
def test_every_lowering_matches_numpy(case, nc, path, monkeypatch):
    """r2c, c2r, c2c_inverse and a batched (``[x, y, z, b]``) r2c / c2r against numpy,
    on the native op and on the TensorFlow path (the GPU's, with gathers for the
    mirror-pair order), so that both lowerings (half spectrum, full) are checked on
    every grid; the half-spectrum path is taken exactly when its conditions hold."""
    if path == "tensorflow":
        monkeypatch.setattr(fft_local, "uses_native", lambda t: False)
    conf = conf_for(case, nc)
    rng = np.random.RandomState(5)
    x = rng.randn(*nc)
    xb = rng.randn(*nc, 2)
    kin = crandn(rng, nc, np.complex128)
    kb = crandn(rng, nc + (2,), np.complex128)

    def build(mesh):
        bdim = mtf.Dimension("b", 2)
        f = mtf.import_tf_tensor(mesh, tf.constant(x), fft.real_shape(conf))
        k = mtf.import_tf_tensor(mesh, tf.constant(kin), fft.k_shape(conf))
        fb = mtf.import_tf_tensor(mesh, tf.constant(xb), fft.real_shape(conf) + [bdim])
        kbt = mtf.import_tf_tensor(mesh, tf.constant(kb), fft.k_shape(conf) + [bdim])
        return {"fk": fft.r2c(f, conf), "ck": fft.c2r(k, conf),
                "zk": fft.c2c_inverse(k, conf), "fbk": fft.r2c(fb, conf),
                "cbk": fft.c2r(kbt, conf)}

    def ops_used(lowering, impl):
        types = {op.type for op in tf.get_default_graph().get_operations()}
        return {"pairs": tf.constant("FlowpmPairs" in types)}

    out = H.run(case[0], conf, build, extra=ops_used)
    n = x.size
    tol = FFT_RTOL["float64"]
    kin_nat, kb_nat = layout.to_natural(kin), layout.to_natural(kb)
    assert H.rel_err(out["fk"], layout.to_stored(np.fft.fftn(x) / n)) < tol
    assert H.rel_err(out["ck"], n * np.fft.ifftn(kin_nat).real) < tol
    assert H.rel_err(out["zk"], n * np.fft.ifftn(kin_nat)) < tol
    assert H.rel_err(out["fbk"], layout.to_stored(np.fft.fftn(xb, axes=(0, 1, 2)) / n)) < tol
    assert H.rel_err(out["cbk"], n * np.fft.ifftn(kb_nat, axes=(0, 1, 2)).real) < tol
    assert bool(out["pairs"]) == _half_path_expected(case[0], conf, path == "native")


@pytest.mark.parametrize("case", CASES, ids=H.case_id)
def test_adjoint_and_explicit_gradients(case):
    """<A x, y> = <x, A^T y> with A^T y from mtf.gradients, for r2c and c2r separately.

    Also compares A^T y with the closed forms grad r2c = Re(ifftn(y)) and
    grad c2r = fftn(y).
    """
    nc = (6, 10, 4)
    conf = conf_for(case, nc)
    rng = np.random.RandomState(2)
    x_r = rng.randn(*nc)
    x_c = crandn(rng, nc, np.complex128)
    y_c = crandn(rng, nc, np.complex128)
    y_r = rng.randn(*nc)

    def build(mesh):
        xr = mtf.import_tf_tensor(mesh, tf.constant(x_r), fft.real_shape(conf))
        xc = mtf.import_tf_tensor(mesh, tf.constant(x_c), fft.k_shape(conf))
        yc = mtf.import_tf_tensor(mesh, tf.constant(y_c), fft.k_shape(conf))
        yr = mtf.import_tf_tensor(mesh, tf.constant(y_r), fft.real_shape(conf))
        l_r2c = complex_ops.real_vdot(yc, fft.r2c(xr, conf))          # <A x, y>
        l_c2r = complex_ops.real_vdot(yr, fft.c2r(xc, conf))
        g_r2c, = mtf.gradients([l_r2c], [xr])                  # A^T y
        g_c2r, = mtf.gradients([l_c2r], [xc])
        return {"l_r2c": l_r2c, "l_c2r": l_c2r, "g_r2c": g_r2c, "g_c2r": g_c2r,
                "x_g_r2c": complex_ops.real_vdot(xr, g_r2c),
                "x_g_c2r": complex_ops.real_vdot(xc, g_c2r)}

    out = H.run(case[0], conf, build)
    assert out["g_r2c"].dtype == np.float64 and out["g_c2r"].dtype == np.complex128
    np.testing.assert_allclose(out["x_g_r2c"], out["l_r2c"], rtol=ADJOINT_RTOL)
    np.testing.assert_allclose(out["x_g_c2r"], out["l_c2r"], rtol=ADJOINT_RTOL)
    assert H.rel_err(out["g_r2c"], np.fft.ifftn(layout.to_natural(y_c)).real) \
        < FFT_RTOL["float64"]
    assert H.rel_err(out["g_c2r"], layout.to_stored(np.fft.fftn(y_r))) < FFT_RTOL["float64"]


def _fd_check(results, grad, eps, points):
    """Compare central differences (results of +eps/-eps runs) with ``grad`` at ``points``."""
    for (idx, part), (plus, minus) in zip(points, zip(results[1::2], results[2::2])):
        fd = (plus["loss"] - minus["loss"]) / (2 * eps)
        g = grad[idx].real if part == "re" else grad[idx].imag
        assert abs(fd - g) <= FD_RTOL * max(1.0, np.max(np.abs(grad))), (idx, part, fd, g)


@pytest.mark.parametrize("case", CASES, ids=H.case_id)
def test_finite_difference_gradients(case):
    """float64, 4x4x4 mesh: losses quadratic in Fourier space and in real space.

    L1(x) = sum w |r2c(x)|^2 (x real); L2(z) = sum v c2r(z)^2 (z complex,
    real and imaginary parts perturbed separately).
    """
    nc = (4, 4, 4)
    conf = conf_for(case, nc)
    rng = np.random.RandomState(3)
    x0 = rng.randn(*nc)
    z0 = crandn(rng, nc, np.complex128)
    w = rng.rand(*nc)
    v = rng.rand(*nc)
    pts_x = [((0, 0, 0), "re"), ((3, 1, 2), "re"), ((1, 2, 3), "re")]
    pts_z = [((0, 0, 0), "re"), ((2, 3, 1), "im"), ((1, 0, 3), "re"), ((3, 3, 2), "im")]

    def build_x(mesh):
        phs = {}
        x = H.placeholder_input(mesh, phs, "x", x0, fft.real_shape(conf))
        ww = mtf.import_tf_tensor(mesh, tf.constant(w), fft.k_shape(conf))
        loss = mtf.reduce_sum(ww * complex_ops.abs2(fft.r2c(x, conf)))
        g, = mtf.gradients([loss], [x])
        return {"loss": loss, "g": g}, phs

    def build_z(mesh):
        phs = {}
        z = H.placeholder_input(mesh, phs, "z", z0, fft.k_shape(conf))
        vv = mtf.import_tf_tensor(mesh, tf.constant(v), fft.real_shape(conf))
        loss = mtf.reduce_sum(vv * mtf.square(fft.c2r(z, conf)))
        g, = mtf.gradients([loss], [z])
        return {"loss": loss, "g": g}, phs

    for build, x_init, pts, key in ((build_x, x0, pts_x, "x"), (build_z, z0, pts_z, "z")):
        feeds = [{key: x_init}]
        for idx, part in pts:
            for sign in (1, -1):
                xp = x_init.copy()
                xp[idx] += sign * FD_EPS * (1 if part == "re" else 1j)
                feeds.append({key: xp})
        res = H.run(case[0], conf, build, feeds=feeds)
        _fd_check(res, res[0]["g"], FD_EPS, pts)


@pytest.mark.parametrize("case", CASES, ids=H.case_id)
def test_kvec_and_derivative_kernel(case):
    """kvec in both units; c2r(i k_x r2c(f)) is the spectral x-derivative; the
    kernel op's gradients (field and kernel) pass finite differences."""
    nc = (6, 10, 4)
    conf = conf_for(case, nc)
    rng = np.random.RandomState(4)
    f0 = rng.randn(*nc)
    kern0 = rng.rand(*nc) + 0.5
    w = rng.rand(*nc)

    def build(mesh):
        phs = {}
        f = H.placeholder_input(mesh, phs, "f", f0, fft.real_shape(conf))
        kern = H.placeholder_input(mesh, phs, "kern", kern0, fft.k_shape(conf))
        kx, ky, kz = layout.kvec(conf, mesh)
        gx, gy, gz = layout.kvec(conf, mesh, units="grid")
        fk = fft.r2c(f, conf)
        dfdx = fft.c2r(complex_ops.apply_kernel(fk, kx, 1j), conf)       # d f / dx [h/Mpc]
        dfdz = fft.c2r(complex_ops.apply_kernel(fk, gz, 1j), conf)       # d f / dz [1/cell]
        ww = mtf.import_tf_tensor(mesh, tf.constant(w), fft.real_shape(conf))
        loss = mtf.reduce_sum(
            ww * mtf.square(fft.c2r(complex_ops.apply_kernel(fk, kern, -1j), conf)))
        g_f, g_k = mtf.gradients([loss], [f, kern])
        return {"kx": kx, "ky": ky, "gz": gz, "knorm": layout.wavenumber(conf, mesh),
                "dfdx": dfdx, "dfdz": dfdz, "loss": loss, "g_f": g_f, "g_k": g_k}, phs

    pts = [("f", (1, 2, 3)), ("f", (5, 9, 0)), ("kern", (0, 1, 2)), ("kern", (3, 7, 1))]
    feeds = [{"f": f0, "kern": kern0}]
    for name, idx in pts:
        for sign in (1, -1):
            fd = {"f": f0.copy(), "kern": kern0.copy()}
            fd[name][idx] += sign * FD_EPS
            feeds.append(fd)
    res = H.run(case[0], conf, build, feeds=feeds)
    out = res[0]
    kx_ref = 2 * np.pi * np.fft.fftfreq(nc[0], d=conf.cell_size[0])
    ky_ref = 2 * np.pi * np.fft.fftfreq(nc[1], d=conf.cell_size[1])
    kz_grid = 2 * np.pi * np.fft.fftfreq(nc[2])
    # kvec holds numpy's wave numbers in the stored (mirror-pair) order
    np.testing.assert_allclose(out["kx"], kx_ref[layout.k_order(nc[0])], rtol=1e-15)
    np.testing.assert_allclose(out["ky"], ky_ref[layout.k_order(nc[1])], rtol=1e-15)
    np.testing.assert_allclose(out["gz"], kz_grid[layout.k_order(nc[2])], rtol=1e-15)
    kz_ref = 2 * np.pi * np.fft.fftfreq(nc[2], d=conf.cell_size[2])
    knorm = np.sqrt(kx_ref[:, None, None]**2 + ky_ref[None, :, None]**2 + kz_ref**2)
    np.testing.assert_allclose(out["knorm"], layout.to_stored(knorm), rtol=1e-14)
    fk = np.fft.fftn(f0)
    ref_dx = np.fft.ifftn(1j * kx_ref[:, None, None] * fk).real
    ref_dz = np.fft.ifftn(1j * kz_grid[None, None, :] * fk).real
    assert H.rel_err(out["dfdx"], ref_dx) < FFT_RTOL["float64"]
    assert H.rel_err(out["dfdz"], ref_dz) < FFT_RTOL["float64"]
    scale = max(np.max(np.abs(out["g_f"])), np.max(np.abs(out["g_k"])), 1.0)
    for (name, idx), plus, minus in zip(pts, res[1::2], res[2::2]):
        fd = (plus["loss"] - minus["loss"]) / (2 * FD_EPS)
        g = out["g_f" if name == "f" else "g_k"][idx]
        assert abs(fd - g) <= FD_RTOL * scale, (name, idx, fd, g)


def test_wrong_inputs_raise():
    conf = SimConfig(nc=4, halo_size=1)
    with tf.Graph().as_default():
        mesh = mtf.Mesh(mtf.Graph(), "m")
        f = mtf.zeros(mesh, fft.real_shape(conf))
        with pytest.raises(TypeError, match="complex"):
            fft.c2r(f, conf)
        with pytest.raises(ValueError, match="dimension 'x' is not in the input"):
            fft.r2c(mtf.zeros(mesh, fft.k_shape(conf)), conf)
        with pytest.raises(ValueError, match="units"):
            layout.kvec(conf, mesh, units="Mpc")


@pytest.mark.rank_independent
def test_local_transforms_and_layout_stay_light():
    """The local FFTs (fft_local) import neither Mesh TF nor the distributed fft module,
    and layout imports no TensorFlow (the k-vectors import it when called): a fresh
    interpreter, ``fresh_imports.ours_first()``. (That importing flowpm_mtf pulls in no
    Horovod is tests/test_design_map.py's, over every module.)"""
    facts = fresh_imports.ours_first()
    assert facts["layout"] == {"tensorflow": False}, "layout imported tensorflow"
    assert facts["fft_local"] == {"mesh_tensorflow": False, "flowpm_mtf.mesh.fft": False}, \
        facts["fft_local"]
