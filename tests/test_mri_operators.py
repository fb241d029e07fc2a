"""The MRI forward operator ``A = M F`` (orthonormal 3D DFT through the distributed
FFT, phase-encode mask) and its adjoint, against numpy.fft on the gathered arrays; the
dot-product test ``<A x, y> = <x, A^H y>``; the measurement ``M (F x + n)``; gradients
through ``A`` by ``mtf.gradients`` equal the adjoint."""
import numpy as np
import pytest
import mesh_tensorflow as mtf
import tensorflow.compat.v1 as tf

import fpm_harness as H
from flowpm_mtf.mesh import complex_ops
from flowpm_mtf import layout
from mri_mtf import operators, sampling
from mri_mtf.config import ImagingConfig

# float64 FFT of ~2000 points: ~log2(N) * 1e-16 relative; float32 ~log2(N) * 6e-8.
RTOL = {"float64": 1e-12, "float32": 1e-5}
NC = (8, 12, 16)
CASES = H.cases(single=True)


def crandn(rng, shape):
    return rng.randn(*shape) + 1j * rng.randn(*shape)


@pytest.mark.parametrize("case", CASES, ids=H.case_id)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_forward_adjoint_match_numpy(case, dtype):
    conf = ImagingConfig(nc=NC, grid=case[1], dtype=dtype, acceleration=4, noise_sigma=0.05)
    cdt = conf.np_complex_dtype
    rng = np.random.RandomState(2)
    xr = rng.randn(*NC).astype(dtype)                 # a real image
    xc = crandn(rng, NC).astype(cdt)                  # a complex image
    yk = crandn(rng, NC).astype(cdt)                  # k-space data (numpy order)
    m = sampling.mask_numpy(conf)
    m3 = np.broadcast_to(m[None], NC)

    def build(mesh):
        mask = sampling.mask(mesh, conf)
        ximg = mtf.import_tf_tensor(mesh, tf.constant(xr), operators.image_shape(conf))
        cimg = mtf.import_tf_tensor(mesh, tf.constant(xc), operators.image_shape(conf))
        kd = mtf.import_tf_tensor(mesh, tf.constant(layout.to_stored(yk)),
                                  operators.kspace_shape(conf))
        ax = operators.forward(ximg, mask, conf)
        acx = operators.forward(cimg, mask, conf)
        ahy = operators.adjoint(kd, mask, conf)
        ahy_real = operators.adjoint(kd, mask, conf, real=True)
        meas = operators.forward(ximg, mask, conf) + complex_ops.apply_kernel(
            sampling.complex_noise(mesh, conf), mask)
        # gradient of 1/2 |A x - y|^2 w.r.t. the real image: Re A^H (A x - y)
        r = ax - complex_ops.apply_kernel(kd, mask)
        loss = mtf.reduce_sum(mtf.square(complex_ops.real_part(r))
                              + mtf.square(complex_ops.imag_part(r))) * 0.5
        g = mtf.gradients([loss], [ximg])[0]
        return {"ax": ax, "acx": acx, "ahy": ahy, "ahy_real": ahy_real, "meas": meas,
                "zf": operators.zero_filled(kd, mask, conf), "g": g,
                "dot1": complex_ops.real_vdot(acx, kd),
                "dot2": complex_ops.real_vdot(cimg, ahy)}

    out = H.run(case[0], conf, build)
    tol = RTOL[dtype]
    F = lambda a: np.fft.fftn(a.astype(np.complex128), norm="ortho")  # noqa: E731
    Fh = lambda a: np.fft.ifftn(a.astype(np.complex128), norm="ortho")  # noqa: E731
    assert out["ax"].dtype == cdt and out["ahy_real"].dtype == np.dtype(dtype)
    assert H.rel_err(layout.to_natural(out["ax"]), m3 * F(xr)) < tol
    assert H.rel_err(layout.to_natural(out["acx"]), m3 * F(xc)) < tol
    ah = Fh(m3 * yk)
    assert H.rel_err(out["ahy"], ah) < tol
    assert H.rel_err(out["ahy_real"], ah.real) < tol
    assert H.rel_err(out["zf"], np.abs(ah)) < tol
    want = m3 * (F(xr) + sampling.complex_noise_numpy(conf))
    assert H.rel_err(layout.to_natural(out["meas"]), want) < tol
    assert H.rel_err(out["g"], (Fh(m3 * (F(xr) - yk))).real) < 10 * tol
    # dot-product test: Re<A x, y> = Re<x, A^H y>
    assert abs(out["dot1"] - out["dot2"]) < 10 * tol * abs(out["dot1"])


@pytest.mark.rank_independent
def test_orthonormal_scale_does_not_depend_on_the_volume():
    """Parseval: |F x| = |x| for the FFT scale used (1 / sqrt(N))."""
    for nc in [(4, 6, 8), (16, 16, 16)]:
        conf = ImagingConfig(nc=nc, dtype="float64")
        x = np.random.RandomState(0).randn(*nc)
        out = H.run("placement", conf, lambda mesh: {"k": operators.fft_ortho(
            mtf.import_tf_tensor(mesh, tf.constant(x), operators.image_shape(conf)), conf)})
        assert np.linalg.norm(out["k"]) == pytest.approx(np.linalg.norm(x), rel=1e-12)
