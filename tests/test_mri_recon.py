"""Distributed reconstructions of ``mri_mtf.recon`` and the metrics of
``mri_mtf.metrics``: TV-ADMM equals its numpy reference on every grid, PSNR and SSIM
(reductions) equal their whole-array references, and at R = 4 on a 16^3 phantom TV
beats zero-filled by >= 3 dB PSNR."""
import numpy as np
import pytest
import mesh_tensorflow as mtf
import tensorflow.compat.v1 as tf

import fpm_harness as H
from flowpm_mtf.jobs import runner
from flowpm_mtf.mesh import complex_ops
from mri_mtf import metrics, operators, phantom, recon, sampling
from mri_mtf.config import ImagingConfig

CASES = H.cases(single=True)
# The ADMM iterations amplify rounding little (each is a contraction-like update):
# float64 results agree with numpy to ~1e-13 after a few iterations.
RTOL = 1e-10


def problem(mesh, conf):
    """Truth, mask and measured k-space, all generated slice by slice."""
    truth = phantom.phantom(mesh, conf)
    mask = sampling.mask(mesh, conf)
    kdata = operators.forward(truth, mask, conf) + complex_ops.apply_kernel(
        sampling.complex_noise(mesh, conf), mask)
    return truth, mask, kdata


def numpy_problem(conf):
    truth = phantom.phantom_numpy(conf.nc)
    m = sampling.mask_numpy(conf)
    k = np.broadcast_to(m[None], conf.nc) * (np.fft.fftn(truth, norm="ortho")
                                             + sampling.complex_noise_numpy(conf))
    return truth, m, k


@pytest.mark.parametrize("case", CASES, ids=H.case_id)
def test_tv_and_metrics_match_numpy(case):
    conf = ImagingConfig(nc=(8, 12, 16), grid=case[1], dtype="float64", acceleration=4,
                         noise_sigma=0.02)
    # two iterations: the second reads the first one's z and u (what more iterations repeat)
    tv = recon.TVConfig(iterations=2)

    def build(mesh):
        truth, mask, kdata = problem(mesh, conf)
        zf = recon.zero_filled(kdata, mask, conf)
        x = recon.tv_admm(kdata, mask, conf, tv)
        mag = operators.magnitude(x)
        return {"zf": zf, "tv": x, "psnr": metrics.psnr(mag, truth),
                "ssim": metrics.ssim(zf, truth), "psnr1": metrics.psnr(zf, truth, 2.0)}

    out = H.run(case[0], conf, build)
    truth, m, k = numpy_problem(conf)
    zf = np.abs(np.fft.ifftn(k, norm="ortho"))
    x = recon.tv_admm_numpy(k, m, tv)
    assert H.rel_err(out["zf"], zf) < RTOL
    assert H.rel_err(out["tv"], x) < RTOL
    assert out["psnr"] == pytest.approx(metrics.psnr_numpy(np.abs(x), truth), rel=1e-10)
    assert out["psnr1"] == pytest.approx(metrics.psnr_numpy(zf, truth, 2.0), rel=1e-10)
    assert out["ssim"] == pytest.approx(metrics.ssim_numpy(zf, truth), rel=1e-10)


# The equality test above covers every grid; this one runs on the hvd grids and the
# 1-processor mesh of 2 x 2 blocks (a placement mesh of 4 CPUs costs 13 s here).
QUALITY_CASES = [c for c in CASES if c[0] != "placement"]


@pytest.mark.parametrize("case", QUALITY_CASES, ids=H.case_id)
def test_tv_beats_zero_filled_by_3db(case):
    """R = 4, 16^3, float32: TV (20 ADMM iterations) >= zero-filled + 3 dB PSNR.

    The iterations run as the imaging job runs them, one lowered iteration 20 times
    (``recon.SteppedTV``, equal to ``recon.tv_admm``: tests/test_mri_unrolled.py): the
    graph holds one iteration instead of 20."""
    conf = ImagingConfig(nc=16, grid=case[1], acceleration=4, noise_sigma=0.01)
    tv_conf = recon.TVConfig(iterations=20)
    with tf.Graph().as_default():
        graph = mtf.Graph()
        mesh = mtf.Mesh(graph, "mesh")
        truth, mask, kdata = problem(mesh, conf)
        zf = recon.zero_filled(kdata, mask, conf)
        stepped = recon.SteppedTV(kdata, mask, conf, tv_conf)
        tv = operators.magnitude(stepped.x)
        outs = {"psnr_zf": metrics.psnr(zf, truth), "psnr_tv": metrics.psnr(tv, truth),
                "ssim_zf": metrics.ssim(zf, truth), "ssim_tv": metrics.ssim(tv, truth)}
        lowering = mtf.Lowering(graph, {mesh: H.make_impl(case[0], conf)})
        init = runner.lowered_group(lowering, stepped.init_ops)
        step = runner.lowered_group(lowering, stepped.step_ops)
        fetch = {k: lowering.export_to_tf_tensor(v) for k, v in outs.items()}
        with runner.session(H.session_config(case[0], conf), lowering) as sess:
            sess.run(init)
            for _ in range(tv_conf.iterations):
                sess.run(step)
            out = sess.run(fetch)
    print("R=4 16^3 %s: %s" % (H.case_id(case), out))
    assert out["psnr_tv"] >= out["psnr_zf"] + 3.0, out
    assert out["ssim_tv"] > out["ssim_zf"], out


@pytest.mark.rank_independent
def test_ssim_and_psnr_references():
    """The numpy references: identical images give SSIM 1 and infinite PSNR; SSIM falls
    with noise; PSNR of a constant offset is 20 log10(L / offset)."""
    t = phantom.phantom_numpy(16)
    assert metrics.ssim_numpy(t, t) == pytest.approx(1.0)
    noisy = t + 0.1 * np.random.RandomState(0).randn(*t.shape)
    assert metrics.ssim_numpy(noisy, t) < 0.9
    assert metrics.psnr_numpy(t + 0.01, t) == pytest.approx(40.0)


@pytest.mark.rank_independent
def test_tv_config_rejects_bad_values():
    for kw in (dict(lam=0), dict(rho=-1), dict(iterations=0), dict(lam=float("inf"))):
        with pytest.raises(ValueError, match="TVConfig"):
            recon.TVConfig(**kw)


@pytest.mark.parametrize("case", CASES, ids=H.case_id)
def test_difference_operators_are_adjoint(case):
    """<D x, g> = <x, D^T g> for the periodic differences on the split volume, and D x
    equals numpy's np.roll differences."""
    conf = ImagingConfig(nc=(8, 12, 16), grid=case[1], dtype="float64")
    rng = np.random.RandomState(4)
    x = rng.randn(*conf.nc)
    g = [rng.randn(*conf.nc) for _ in range(3)]

    def build(mesh):
        shape = operators.image_shape(conf)
        xm = mtf.import_tf_tensor(mesh, tf.constant(x), shape)
        gm = [mtf.import_tf_tensor(mesh, tf.constant(a), shape) for a in g]
        dx = recon.gradient(xm)
        return {"dx0": dx[0], "dx2": dx[2],
                "lhs": mtf.add_n([mtf.reduce_sum(a * b) for a, b in zip(dx, gm)]),
                "rhs": mtf.reduce_sum(xm * recon.gradient_adjoint(gm))}

    out = H.run(case[0], conf, build)
    assert H.rel_err(out["dx0"], np.roll(x, -1, 0) - x) < 1e-14
    assert H.rel_err(out["dx2"], np.roll(x, -1, 2) - x) < 1e-14
    assert out["lhs"] == pytest.approx(out["rhs"], rel=1e-12)
