"""The unrolled network of ``mri_mtf.unrolled``: the fed phantom equals the numpy one, the
network equals its whole-volume numpy reference, one Adam training step (loss and updated
weights) on every grid of this world size equals the one-process computation (a 1x1
placement mesh), and the loss falls over a few steps.

The stepped TV (``recon.SteppedTV``) equals the unrolled ``recon.tv_admm``."""
import numpy as np
import pytest
import mesh_tensorflow as mtf
import tensorflow.compat.v1 as tf

import fpm_harness as H
from flowpm_mtf.jobs import runner
from mri_mtf import operators, phantom, recon, sampling, unrolled
from mri_mtf.config import ImagingConfig
from world_share import on_rank0

CASES = H.cases(single=True)
# float64: the network is FFTs, convolutions and sums taken in another order on another
# grid (and by scipy/numpy in the reference): ~1e-14 relative.
RTOL = 1e-10
# Adam's first step moves each weight by ~lr * sign(g): float64 gradients fix the sign
# (a weight whose gradient is within rounding of 0 would differ by 2 lr: none here).
STEP_RTOL = 1e-9
NC = (8, 8, 8)
UCONF = unrolled.UnrolledConfig(blocks=2, channels=3, train_steps=1, learning_rate=1e-2)


def conf_for(grid, dtype="float64", nc=NC):
    return ImagingConfig(nc=nc, grid=grid, dtype=dtype, acceleration=4, noise_sigma=0.02)


def test_phantom_fed_matches_numpy():
    conf = ImagingConfig(nc=(12, 10, 8), grid=(1, 1), dtype="float64")
    table = phantom.perturbed_table(5, 0.08)

    def build(mesh):
        ph = tf.placeholder(tf.float64, (10, phantom.TABLE_ROW_WIDTH))
        return {"p": phantom.phantom_fed(mesh, conf, ph)}, {"rows": ph}

    out = H.run("hvd" if H.SIZE == 1 else "single", conf, build,
                feeds=[{"rows": phantom.table_rows(table)}])[0]
    ref = phantom.phantom_numpy(conf.nc, table)
    margin = phantom.boundary_margin(conf.nc, table)
    ok = margin > 1e-12
    assert ok.mean() > 0.99
    np.testing.assert_array_equal(out["p"][ok], ref[ok])
    assert not np.array_equal(ref, phantom.phantom_numpy(conf.nc))   # perturbed


@pytest.mark.parametrize("case", CASES, ids=H.case_id)
def test_network_matches_numpy(case):
    conf = conf_for(case[1])

    def build(mesh):
        truth = phantom.phantom(mesh, conf)
        mask = sampling.mask(mesh, conf)
        kdata = operators.forward(truth, mask, conf)
        shapes = unrolled.weight_shapes(UCONF)
        w = {n: mtf.import_tf_tensor(mesh, tf.constant(v), shapes[n])
             for n, v in unrolled.init_weights(UCONF).items()}
        x2 = unrolled.network(kdata, mask, w, conf, UCONF)
        return {"x": operators.to_complex(x2), "mag": unrolled.channel_magnitude(x2)}

    out = H.run(case[0], conf, build)
    m = sampling.mask_numpy(conf)
    k = np.broadcast_to(m[None], conf.nc) * np.fft.fftn(phantom.phantom_numpy(conf.nc),
                                                        norm="ortho")
    ref = unrolled.network_numpy(k, m, unrolled.init_weights(UCONF), UCONF)
    assert H.rel_err(out["x"], ref) < RTOL
    assert H.rel_err(out["mag"], np.abs(ref)) < RTOL


def train(kind, conf, uconf, steps, eval_step=0):
    """``steps`` Adam steps; the losses, the loss of sample ``eval_step`` after them, and
    the weights."""
    with tf.Graph().as_default():
        graph = mtf.Graph()
        mesh = mtf.Mesh(graph, "mesh")
        mask = sampling.mask(mesh, conf)
        w = unrolled.make_weights(mesh, conf, uconf)
        tr = unrolled.UnrolledTraining(mesh, conf, uconf, mask, w)
        lowering = mtf.Lowering(graph, {mesh: H.make_impl(kind, conf)})
        ops = tr.lower(lowering)
        wts = {n: lowering.export_to_tf_tensor(v) for n, v in w.items()}
        with runner.session(H.session_config(kind, conf), lowering) as sess:
            losses = [tr.step(sess, ops, i) for i in range(steps)]
            final = float(sess.run(ops["loss"], tr.feed(eval_step)))
            return losses, final, sess.run(wts)


# the hvd grids (a placement mesh of several CPUs takes 15-30 s to build and run this here)
@pytest.mark.parametrize("case", [c for c in CASES if c[0] == "hvd"], ids=H.case_id)
def test_training_step_matches_one_process(case):
    conf = conf_for(case[1])
    losses, after, w = train(case[0], conf, UCONF, 1)
    # one process's mesh: the same numbers on every rank, computed once (world_share)
    ref_losses, ref_after, ref_w = on_rank0(lambda: train("single", conf, UCONF, 1))
    assert losses[0] == pytest.approx(ref_losses[0], rel=RTOL)
    assert after == pytest.approx(ref_after, rel=STEP_RTOL)
    init = unrolled.init_weights(UCONF)
    for n in ref_w:
        scale = max(np.abs(ref_w[n]).max(), UCONF.learning_rate)
        assert np.abs(w[n] - ref_w[n]).max() < STEP_RTOL * scale, n
        if n != "b3":   # a constant image is k = 0, which every mask samples: the last
            # data-consistency step (eta = 1) removes it, and b3's gradient is ~0
            assert np.abs(ref_w[n] - init[n]).max() > 0.5 * UCONF.learning_rate, n


@pytest.mark.skipif(H.SIZE == 4, reason="the 1- and 2-rank grids cover it")
def test_loss_decreases():
    """float32, 12^3: the loss of a fixed sample falls over 6 steps."""
    conf = conf_for(H.HVD_GRIDS[H.SIZE][0], "float32", (12, 12, 12))
    uconf = unrolled.UnrolledConfig(blocks=2, channels=4, learning_rate=1e-2)
    losses, after, _ = train("hvd", conf, uconf, 6)
    assert after < 0.9 * losses[0], (losses, after)


@pytest.mark.parametrize("case", CASES, ids=H.case_id)
def test_stepped_tv_equals_unrolled(case):
    conf = conf_for(case[1], nc=(8, 12, 8))
    # two steps: the second reads the state (z, u) the first one assigned
    tv = recon.TVConfig(iterations=2)
    with tf.Graph().as_default():
        graph = mtf.Graph()
        mesh = mtf.Mesh(graph, "mesh")
        mask = sampling.mask(mesh, conf)
        kdata = operators.forward(phantom.phantom(mesh, conf), mask, conf)
        stepped = recon.SteppedTV(kdata, mask, conf, tv)
        ref = recon.tv_admm(kdata, mask, conf, tv)
        lowering = mtf.Lowering(graph, {mesh: H.make_impl(case[0], conf)})
        init = runner.lowered_group(lowering, stepped.init_ops)
        step = runner.lowered_group(lowering, stepped.step_ops)
        x, xr = (lowering.export_to_tf_tensor(t) for t in (stepped.x, ref))
        with runner.session(H.session_config(case[0], conf), lowering) as sess:
            sess.run(init)
            for _ in range(tv.iterations):
                sess.run(step)
            got, want = sess.run([x, xr])
    assert H.rel_err(got, want) < RTOL
