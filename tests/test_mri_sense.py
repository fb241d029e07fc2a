"""Multi-coil imaging (:mod:`mri_mtf.sense`, :mod:`mri_mtf.tv_sense`) against numpy and sigpy.

* the birdcage sensitivities equal ``sigpy.mri.birdcage_maps`` (axes transposed) and
  ``sum_c |S_c|^2 = 1``;
* on 1, 2 and 4 ranks (one graph per module): the distributed maps, SENSE forward,
  adjoint, root-sum-of-squares and the noisy measurement equal numpy on the gathered
  arrays, the dot-product test ``<A x, y> = <x, A^H y>``, and TV-SENSE (PDHG, a few
  iterations, unrolled in the graph and stepped in variables as the job runs it) equals
  its numpy reference;
* one process: our TV-SENSE iterates equal those of sigpy's ``TotalVariationRecon``
  (same data, maps, mask, lambda, steps, anisotropic TV) to rounding.
"""
import numpy as np
import pytest
import mesh_tensorflow as mtf
import tensorflow.compat.v1 as tf

import fpm_harness as H
from flowpm_mtf import layout
from flowpm_mtf.jobs import runner
from flowpm_mtf.mesh import complex_ops
from mri_mtf import operators, phantom, sampling, sense, tv_sense
from mri_mtf.config import ImagingConfig
from mri_mtf.recon import TVConfig

# float64 FFTs of ~10^4 points and a few PDHG iterations: rounding ~1e-14.
RTOL = 1e-11
NC = (8, 8, 12)
COILS = 4
ITERS = 4
# sigpy's TotalVariationRecon runs the same PDHG (theta = 1, x = 0 and dual 0 at the start)
# when given our steps: the iterates agree to rounding (measured 3e-16 after 50 iterations);
# the objective within 1e-3 relative is the weaker criterion, checked too.
SIGPY_ITERS = 50
SIGPY_ATOL = 1e-10         # [phantom intensity]; intensities are 0..1
OBJ_RTOL = 1e-3
# The coil dimension split over a third mesh axis of 2 (ImagingConfig.coil_split), one case
# per world size: the placement mesh 2x1 x 2 coil ranks (1-rank pass: the slicing), the coils
# alone over 2 ranks, and x over 2 ranks x the coils over 2 on 4 ranks.
SPLIT_CASES = {1: [("placement", (2, 1, 2))], 2: [("hvd", (1, 1, 2))],
               4: [("hvd", (2, 1, 2))]}
CASES = H.cases(single=True, placement=False) + SPLIT_CASES.get(H.SIZE, [])


def _case_id(case):
    kind, grid = case
    return H.case_id((kind, grid)) + ("-coils%d" % grid[2] if len(grid) == 3 else "")


def _conf(grid):
    return ImagingConfig(nc=NC, grid=grid[:2], coil_split=grid[2] if len(grid) == 3 else 1,
                         coils=COILS, dtype="float64", acceleration=3, noise_sigma=0.02)


@pytest.fixture(scope="module", params=CASES, ids=_case_id)
def run(request):
    kind, grid = request.param
    conf = _conf(grid)
    rng = np.random.RandomState(3)
    x = (rng.randn(*NC) + 1j * rng.randn(*NC))
    yk = (rng.randn(COILS, *NC) + 1j * rng.randn(COILS, *NC))
    tv = TVConfig(lam=0.01, iterations=ITERS, norm="isotropic")
    with tf.Graph().as_default():
        graph = mtf.Graph()
        mesh = mtf.Mesh(graph, "mesh")
        mask = sampling.mask(mesh, conf)
        op = sense.Sense(mesh, conf, COILS, mask)
        ximg = mtf.import_tf_tensor(mesh, tf.constant(x), operators.image_shape(conf))
        yt = mtf.import_tf_tensor(mesh, tf.constant(layout.to_stored(yk, axes=(1, 2, 3))),
                                  op.kspace_shape)
        meas = op.measure(phantom.phantom(mesh, conf))
        stepped = tv_sense.SteppedTVSense(meas, op, tv)
        outs = {"maps_re": op.maps_re, "maps_im": op.maps_im, "ax": op.forward(ximg),
                "ahy": op.adjoint(yt), "rss": op.rss(yt), "meas": meas,
                "dot1": complex_ops.real_vdot(op.forward(ximg), yt),
                "dot2": complex_ops.real_vdot(ximg, op.adjoint(yt)),
                "tv": tv_sense.tv_sense(meas, op, tv), "tv_stepped": stepped.x}
        lowering = mtf.Lowering(graph, {mesh: H.make_impl(kind, conf)})
        init = runner.lowered_group(lowering, stepped.init_ops)
        step = runner.lowered_group(lowering, stepped.step_ops)
        fetch = {k: lowering.export_to_tf_tensor(v) for k, v in outs.items()}
        with runner.session(H.session_config(kind, conf), lowering) as sess:
            sess.run(init)
            for _ in range(tv.iterations):
                sess.run(step)
            out = sess.run(fetch)
    return conf, x, yk, tv, out


def _numpy_op(conf):
    maps = sense.birdcage_numpy(COILS, NC)
    return maps, sense.sense_numpy(maps, sampling.mask_numpy(conf))


@pytest.mark.rank_independent
def test_coil_split_config():
    """The coil split is a third mesh axis; it must divide the coils."""
    conf = _conf((2, 1, 2))
    assert conf.n_ranks == 4 and conf.full_grid == (2, 1, 2) and conf.coils_per_rank == 2
    assert conf.mesh_shape[-1] == ("coil_axis", 2) and ("coil", "coil_axis") in conf.layout_rules
    with pytest.raises(ValueError, match="coil_split 3 does not divide coils 4"):
        ImagingConfig(nc=NC, coils=4, coil_split=3)
    # the memory preflight: a rank of a coil split holds the arrays of coils / split coils
    from mri_mtf import memory
    from mri_mtf.unrolled import UnrolledConfig

    def volume_bytes(**kw):
        c = ImagingConfig(nc=(32, 32, 32), grid=(2, 1), **kw)
        return memory.imaging_terms(c, UnrolledConfig(), ("zero-filled", "tv"))[2].nbytes

    assert volume_bytes(coils=8, coil_split=2) == volume_bytes(coils=4)
    assert volume_bytes(coils=8, coil_split=2) < volume_bytes(coils=8)


def test_sense_matches_numpy(run):
    conf, x, yk, _, out = run
    maps, (A, AH) = _numpy_op(conf)
    assert H.rel_err(out["maps_re"] + 1j * out["maps_im"], maps) < RTOL
    assert H.rel_err(layout.to_natural(out["ax"], axes=(1, 2, 3)), A(x)) < RTOL
    assert H.rel_err(out["ahy"], AH(yk)) < RTOL
    m = sampling.mask_numpy(conf)[None, None]
    rss = np.sqrt(np.sum(np.abs(np.fft.ifftn(m * yk, axes=(1, 2, 3), norm="ortho")) ** 2, 0))
    assert H.rel_err(out["rss"], rss) < RTOL
    # measurement: y_c = M (F S_c x + n_c), the noise from the seeds on [coil, kx, ky, kz]
    from flowpm_mtf.mesh import noise

    n = sum(noise.white_noise_numpy(conf.seed + o, (COILS,) + NC) * f for o, f in
            zip(sampling.NOISE_SEED_OFFSETS, (1.0, 1j))) * (conf.noise_sigma / np.sqrt(2.0))
    want = A(phantom.phantom_numpy(conf.nc)) + m * layout.to_natural(n, axes=(1, 2, 3))
    assert H.rel_err(layout.to_natural(out["meas"], axes=(1, 2, 3)), want) < RTOL


def test_sense_adjoint_dot_product(run):
    out = run[4]
    assert abs(out["dot1"] - out["dot2"]) < RTOL * abs(out["dot1"])


def test_tv_sense_matches_numpy(run):
    conf, _, _, tv, out = run
    maps, (A, AH) = _numpy_op(conf)
    y = layout.to_natural(run[4]["meas"], axes=(1, 2, 3))
    want = tv_sense.tv_sense_numpy(y, A, AH, tv.lam, tv.iterations, tv.norm)
    assert H.rel_err(out["tv"], want) < RTOL
    assert H.rel_err(out["tv_stepped"], want) < RTOL


@pytest.mark.rank_independent
def test_birdcage_equals_sigpy():
    sigpy = pytest.importorskip("sigpy.mri")   # not in the tf2.12 stack's requirements

    ours = sense.birdcage_numpy(10, (12, 10, 8))
    theirs = sigpy.birdcage_maps((10, 8, 10, 12)).transpose(0, 3, 2, 1)
    assert np.max(np.abs(ours - theirs)) < 1e-12
    assert np.max(np.abs(np.sum(np.abs(ours) ** 2, 0) - 1.0)) < 1e-12


@pytest.mark.rank_independent
def test_tv_sense_equals_sigpy():
    """Anisotropic TV-SENSE of a 16^3 Shepp-Logan, 4 coils, R = 3: our PDHG (the numpy
    reference of the distributed one, equal to it by test_tv_sense_matches_numpy, here
    started from 0 as sigpy) and sigpy's TotalVariationRecon with the same maps, mask,
    lambda and steps. sigpy's FFT is centred (``fftshift(fftn(ifftshift(x)))``, orthonormal):
    its data are ours with k-space shifted and multiplied by ``(-1)^(kx + ky + kz)``; the
    mask is its ``weights``; its TV is the sum of the moduli of the periodic differences
    (``FiniteDifference`` + ``L1Reg``), our anisotropic norm."""
    app = pytest.importorskip("sigpy.mri.app")   # not in the tf2.12 stack's requirements

    nc = (16, 16, 16)
    conf = ImagingConfig(nc=nc, dtype="float64", acceleration=3, noise_sigma=0.01)
    maps = sense.birdcage_numpy(4, nc)
    mask = sampling.mask_numpy(conf)
    A, AH = sense.sense_numpy(maps, mask)
    rng = np.random.RandomState(0)
    truth = phantom.phantom_numpy(conf.nc)
    y = A(truth) + mask[None, None] * 0.01 * (rng.randn(4, *nc) + 1j * rng.randn(4, *nc))
    lam = 0.005
    ours = tv_sense.tv_sense_numpy(y, A, AH, lam, SIGPY_ITERS, "anisotropic", start="zero")
    k = np.arange(16)
    sign = (-1.0) ** (k[:, None, None] + k[None, :, None] + k[None, None, :])
    y_sp = np.fft.fftshift(y * sign, axes=(1, 2, 3))
    w = np.fft.fftshift(np.broadcast_to(mask[None], nc), axes=(0, 1, 2))
    theirs = np.asarray(app.TotalVariationRecon(
        y_sp, maps, lam, weights=w, max_iter=SIGPY_ITERS, sigma=tv_sense.STEP,
        tau=tv_sense.STEP, show_pbar=False).run())
    assert np.max(np.abs(ours - theirs)) < SIGPY_ATOL
    phi_ours = tv_sense.objective_numpy(ours, y, A, lam, "anisotropic")
    phi_theirs = tv_sense.objective_numpy(theirs, y, A, lam, "anisotropic")
    assert abs(phi_ours - phi_theirs) < OBJ_RTOL * phi_theirs
