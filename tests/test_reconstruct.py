"""Reconstruction of the initial conditions (flowpm_mtf.gradients.reconstruct): prior normalisation,
Adam against numpy, finite-difference gradient of the loss, convergence and r(k) of a small
reconstruction, the same trajectory on every process grid, bad input, and the CLI job on
2 MPI ranks (the 2-rank pass, in-process)."""
import dataclasses
import json
import os
import tempfile

import h5py
import mesh_tensorflow as mtf
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import fpm_harness as H
import nbody_harness as NH
from flowpm_mtf import cli, jobs
from flowpm_mtf.mesh import fft
from flowpm_mtf.physics import ics, linear_power
from flowpm_mtf.gradients import reconstruct as R
from flowpm_mtf.jobs import runner
from flowpm_mtf.config import SimConfig
from world_share import on_rank0

tf.disable_eager_execution()

# The small fast problem: 16^3 cells of 6.25 Mpc/h, 2LPT forward model to a = 1, noise 0.1
# per cell, 40 Adam iterations with step 0.1, float64 (for a tight grid-independence check).
CONF = SimConfig(nc=16, box_size=100.0, grid=(1, 1), halo_size=4, lpt_order=2, a_start=0.1,
                 a_end=1.0, n_steps=5, dtype="float64", seed=7)
RCONF = R.ReconConfig(iterations=40, learning_rate=0.1, noise=0.1, forward="lpt",
                      log_every=10)
# The same problem through the CLI (the job's defaults supply a_start, n_steps, lpt_order).
CLI_ARGS = ["reconstruct", "--nc", "16", "--box-size", "100", "--halo", "4", "--seed", "7",
            "--dtype", "float64", "--learning-rate", "0.1",
            "--noise", "0.1", "--forward", "lpt", "--a-start", "0.1", "--log-every", "5"]
# The CLI runs the first CLI_ITERATIONS of the same trajectory (the loss before step i does
# not depend on the number of steps that follow).
CLI_ITERATIONS = 10
# The 1-processor reference of the multi-rank passes runs the first REF_ITERATIONS (cost).
REF_ITERATIONS = 10

# The issue asks for at least an order of magnitude; 40 iterations give ~30x here.
LOSS_DECREASE_MIN = 10.0
# r(k) must exceed 0.8 below half the Nyquist frequency, k < pi / (2 cell) = 0.25 h/Mpc here.
# Why there: (1) the data's signal-to-noise per mode is >> 1 (noise power sigma^2 V / N =
# 2.4 (Mpc/h)^3 against P(k) > 1e3 (Mpc/h)^3 of the final field below 0.25 h/Mpc), so the data
# term dominates the prior; (2) the CIC window (> 0.8 per axis there, falling to 0.4 at
# Nyquist) and aliasing barely touch these modes; (3) at k < 0.25 h/Mpc the a = 1 field is
# mildly non-linear (sigma_8 = 0.82), so 2LPT maps the initial modes nearly one to one and the
# loss is close to convex there. Above it r(k) falls (0.7 at 0.38 h/Mpc, 0.35 at Nyquist after
# 40 iterations): the prior takes over where the CIC-smoothed, non-linear data constrain less.
R_MIN = 0.8
K_CUT_FRACTION_OF_NYQUIST = 0.5
# Trajectories in float64 on different grids differ only in the order of the floating-point
# sums (FFT pencils, reductions); measured 6e-16 relative after 40 Adam steps. 1e-10 leaves
# room for the amplification of round-off by Adam's normalisation, but catches any real
# decomposition dependence (a wrong halo, FFT or noise slice changes the loss at O(1e-3+)).
TRAJECTORY_RTOL = 1e-10
# The prior of a true linear field is a chi^2 with N - 1 degrees of freedom: relative
# standard deviation sqrt(2 / (N - 1)) = 2.2 % at 16^3. 5 sigma.
PRIOR_NSIGMA = 5.0
# N-body forward model: a smoke test of that path (its gradient is tested in test_nbody.py).
# After NBODY_ITERATIONS the loss must have fallen below NBODY_LOSS_FRACTION of its start and
# the largest scales (k < 0.15 h/Mpc) must correlate (r > NBODY_R_MIN) with the truth; both
# fail for a wrong sign or a broken gradient path, which leave the loss at ~its start.
NBODY_ITERATIONS = 20
NBODY_LOSS_FRACTION = 0.5
NBODY_R_MIN = 0.5
# numpy and the distributed FFT agree to round-off in float64.
PRIOR_NUMPY_RTOL = 1e-10
# Adam in float64 on the process grid vs numpy: element-wise identical up to round-off.
ADAM_RTOL = 1e-12
# Central finite difference in float64, eps 1e-4 along a unit-variance random direction:
# measured relative error 1e-9 (round-off of a loss of ~160 over 2 eps, and the few
# particles whose CIC stencil changes cell within +-eps: CIC is piecewise linear). A wrong
# or missing term (prior, conjugation, halo adjoint) is off by > 1e-3.
FD_EPS = 1e-4
FD_RTOL = 1e-6


def _grid():
    return H.HVD_GRIDS[H.SIZE][0]


def _run(kind, conf, rconf, out, comm=None):
    """The reconstruct job on this process's ``kind`` backend; ``out`` None: no files.
    ``comm``: the ranks that run the job together (default: this process alone)."""
    return runner.run(jobs.get("reconstruct"), {"config": conf, "reconstruction": rconf},
                      H.backend(kind, conf, comm=comm), out, plot=False)


# ----------------------------------------------------------------------------- the small run
@pytest.fixture(scope="module")
def recon():
    """The small reconstruction on this world's process grid (HvdSimdMeshImpl), via the job."""
    from mpi4py import MPI

    conf = CONF.replace(grid=_grid())
    comm = MPI.COMM_WORLD  # the outputs are written collectively (each rank its slices)
    out = comm.bcast(tempfile.mkdtemp(prefix="recon_") if comm.rank == 0 else None)
    summary = _run("hvd", conf, RCONF, out, comm=comm)
    return summary, out


def test_loss_decreases_by_an_order_of_magnitude(recon):
    summary, _ = recon
    loss = np.asarray(summary["loss"])
    assert loss.shape == (RCONF.iterations + 1,)
    assert np.all(np.isfinite(loss))
    assert loss[0] / loss[-1] >= LOSS_DECREASE_MIN, loss[[0, -1]]
    # the prior starts at 0 (s = 0) and grows; chi2 carries the decrease
    assert summary["prior"][0] == 0.0 and summary["prior"][-1] > 0.0


def test_cross_correlation_at_large_scales(recon):
    summary, _ = recon
    k, r = np.asarray(summary["k"]), np.asarray(summary["r"])
    k_cut = K_CUT_FRACTION_OF_NYQUIST * np.pi / CONF.cell_size[0]
    low = k < k_cut
    assert low.sum() >= 3, k
    assert np.all(r[low] > R_MIN), (k[low], r[low])
    assert np.all(np.abs(r) <= 1.0 + 1e-9)  # Cauchy-Schwarz


def test_outputs_of_the_job(recon):
    summary, out = recon
    with h5py.File(os.path.join(out, "reconstruction.h5"), "r") as f:
        assert f["truth"].shape == CONF.nc and f["reconstruction"].shape == CONF.nc
        assert f["observed"].shape == CONF.nc
        np.testing.assert_array_equal(f["loss"][...], summary["loss"])
        truth = f["truth"][...]
        assert json.loads(f.attrs["config"])["seed"] == CONF.seed
    # the truth is the seeded linear field of the ICs module (same on every grid)
    ref = H.run("placement", CONF, lambda mesh: {"t": ics.linear_field(CONF, mesh)})["t"]
    np.testing.assert_allclose(truth, ref, rtol=0, atol=1e-12)
    txt = np.loadtxt(os.path.join(out, "reconstruction.txt"))
    assert txt.shape[1] == 4
    np.testing.assert_allclose(txt[:, 1], summary["r"], atol=1e-6)


@pytest.mark.skipif(H.SIZE == 1, reason="1 rank: the CLI test compares with 2 ranks")
def test_trajectory_independent_of_the_grid(recon):
    """This world's grid (2x1 on 2 ranks, 2x2 on 4) against one processor (computed on
    rank 0; the others wait asleep, not in a busy collective: world_share)."""
    conf = CONF.replace(grid=(1, 1))
    rconf = dataclasses.replace(RCONF, iterations=REF_ITERATIONS)
    ref = on_rank0(lambda: _run("placement", conf, rconf, None))  # no files
    got = np.asarray(recon[0]["loss"][:REF_ITERATIONS + 1])
    np.testing.assert_allclose(got, ref["loss"], rtol=TRAJECTORY_RTOL, atol=0)


@pytest.mark.skipif(H.SIZE > 1, reason="the N-body path is grid-independent code; 1 rank")
def test_nbody_forward_model_reduces_the_loss():
    """The N-body forward model (one FastPM step from a = 0.1 to 1) in the same job."""
    conf = CONF.replace(n_steps=1, dtype="float32")
    rconf = R.ReconConfig(iterations=NBODY_ITERATIONS, learning_rate=0.1, noise=0.1,
                          forward="nbody")
    summary = _run("hvd", conf, rconf, None)
    loss = np.asarray(summary["loss"])
    assert np.all(np.isfinite(loss)) and loss[-1] < NBODY_LOSS_FRACTION * loss[0], loss
    k, r = np.asarray(summary["k"]), np.asarray(summary["r"])
    assert r[k < 0.15].min() > NBODY_R_MIN, (k, r)


# Adjoint vs stored gradient in the same job (float64, 2 steps, 3 Adam iterations): the two
# gradients agree to ~1e-15 (tests/test_model_gradient.py); Adam's normalisation m / sqrt(v)
# amplifies the relative error of small components, measured 2e-14 on the loss history.
# Any error of the adjoint path (a missing prior gradient, a wrong sign) is > 1e-3.
ADJOINT_HISTORY_RTOL = 1e-10
# d loss / d cosmology at a fixed field vs central differences (float64; relative step 1e-5
# as in tests/test_model_gradient.py, where the loss is far from quadratic at 1e-4).
COSMO_FD_REL = 1e-5
COSMO_RTOL = 1e-6


# One decomposition per world size: the lagrangian one on 1 rank, the eulerian one (its
# cotangents migrate) on 2 (on 1x1 it runs the same code without migrating); not on 4: the
# job's gradient is the adjoint's, which tests/test_adjoint.py and tests/test_model_gradient.py
# check on every grid (both decompositions on 1 and 2 ranks, eulerian on 2x2; ~64 s here on
# 4 ranks)
@pytest.mark.skipif(H.SIZE > 2, reason="the adjoint on 2x2: test_adjoint, test_model_gradient")
@pytest.mark.parametrize("decomposition", ["lagrangian"] if H.SIZE == 1 else ["eulerian"])
def test_adjoint_reconstruction_matches_stored(decomposition):
    """--gradient adjoint and --gradient stored follow the same trajectory (N-body forward
    model, this world's process grid)."""
    conf = CONF.replace(grid=_grid(), n_steps=2, decomposition=decomposition)
    runs = {g: _run("hvd", conf, R.ReconConfig(iterations=3, learning_rate=0.1, noise=0.1,
                                               forward="nbody", gradient=g), None)
            for g in R.GRADIENTS}
    a, s = runs["adjoint"], runs["stored"]
    for n in ("loss", "chi2", "prior"):
        err = H.rel_err(a[n], s[n])
        print("%s history adjoint vs stored (%s): %.3g" % (n, decomposition, err))
        assert err <= ADJOINT_HISTORY_RTOL, (n, a[n], s[n])
    assert a["loss"][-1] < a["loss"][0]
    assert set(a["cosmology_gradient"]) == set(R.COSMOLOGY_PARAMETERS)
    assert "cosmology_gradient" not in s


def _recon_eval(conf, data, field, cosmology=False):
    """ReconstructionGraph.evaluate at a given field with fixed data (adjoint path)."""
    rconf = R.ReconConfig(iterations=1, noise=0.1, forward="nbody", gradient="adjoint")
    kind = "hvd"
    with tf.Graph().as_default():
        graph = mtf.Graph()
        mesh = mtf.Mesh(graph, "mesh")
        rg = R.ReconstructionGraph(conf, rconf, mesh, observed=data)
        assign = mtf.assign(rg.linear, NH.import_field(mesh, conf, field))
        lowering = mtf.Lowering(graph, {mesh: H.make_impl(kind, conf)})
        ops = rg.lower_iteration(lowering)
        set_field = lowering.lowered_operation(assign)
        with tf.Session(config=H.session_config(kind, conf)) as sess:
            sess.run(tf.global_variables_initializer())
            sess.run(lowering.copy_masters_to_slices())
            sess.run(set_field)
            return rg.evaluate(sess, ops, cosmology=cosmology)


@pytest.mark.skipif(H.SIZE != 1, reason="the data term on more ranks is tested in "
                    "test_model_gradient.py; the prior term is a per-slice kernel")
def test_reconstruction_cosmology_gradient_finite_differences():
    """The job's d loss / d Omega_c, d sigma8 at a fixed field (data term through the
    N-body, prior through P(k)) == central differences of the loss (float64)."""
    conf = CONF.replace(grid=_grid(), n_steps=1)   # the steps' routes: test_model_gradient
    field = NH.linear_field_numpy(conf)
    data = 1.0 + np.random.RandomState(3).randn(*conf.nc) * 0.5
    got = _recon_eval(conf, data, field, cosmology=True)
    for p in R.COSMOLOGY_PARAMETERS:
        v = getattr(conf.cosmology, p)
        h = COSMO_FD_REL * v
        vals = [_recon_eval(conf.replace(cosmology=dataclasses.replace(
            conf.cosmology, **{p: v + sgn * h})), data, field)["loss"] for sgn in (1, -1)]
        fd = (vals[0] - vals[1]) / (2 * h)
        print("reconstruction d loss / d %s: adjoint %.10g, finite differences %.10g"
              % (p, got["d_loss_d_" + p], fd))
        assert abs(got["d_loss_d_" + p] - fd) <= COSMO_RTOL * abs(fd), (p, got, fd)


# ----------------------------------------------------------------------------- building blocks
def test_prior_of_a_true_linear_field():
    """prior(s) ~ N - 1 for s from ics.linear_field, and equals the numpy evaluation."""
    conf = CONF.replace(grid=_grid())

    def build(mesh):
        s = ics.linear_field(conf, mesh)
        return {"s": s, "prior": R.prior_chi2(s, conf)}

    res = H.run("hvd", conf, build)
    n = conf.n_cells
    dof = n - 1
    assert abs(res["prior"] / dof - 1.0) < PRIOR_NSIGMA * np.sqrt(2.0 / dof), res["prior"]
    # numpy: sum over the full spectrum of |fftn(s) / N|^2 V / P(|k|), k != 0
    kk = [2 * np.pi * np.fft.fftfreq(m, d=d) for m, d in zip(conf.nc, conf.cell_size)]
    kn = np.sqrt(kk[0][:, None, None]**2 + kk[1][None, :, None]**2 + kk[2][None, None, :]**2)
    sk = np.fft.fftn(res["s"]) / n
    pos = kn > 0
    p = linear_power.linear_matter_power(conf.cosmology, kn[pos])
    ref = np.sum(np.abs(sk[pos])**2 * np.prod(conf.box_size) / p)
    assert abs(res["prior"] - ref) < PRIOR_NUMPY_RTOL * ref


def _numpy_adam(x, grad_fn, lr, steps, b1=0.9, b2=0.999, eps=1e-8):
    m = np.zeros_like(x)
    v = np.zeros_like(x)
    for t in range(1, steps + 1):
        g = grad_fn(x)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        x = x - lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    return x


def test_adam_matches_numpy():
    """5 Adam steps on L = sum w (x - c)^4 over a distributed field, against numpy."""
    conf = CONF.replace(grid=_grid())
    rng = np.random.RandomState(3)
    c = rng.standard_normal(conf.nc)
    w = rng.uniform(0.1, 2.0, conf.nc)
    lr, steps = 0.05, 5
    with tf.Graph().as_default():
        graph = mtf.Graph()
        mesh = mtf.Mesh(graph, "mesh")
        shape = fft.real_shape(conf)
        x = mtf.get_variable(mesh, "x", shape, dtype=tf.float64,
                             initializer=tf.zeros_initializer())
        ct = mtf.import_tf_tensor(mesh, tf.constant(c), shape)
        wt = mtf.import_tf_tensor(mesh, tf.constant(w), shape)
        loss = mtf.reduce_sum(wt * mtf.square(mtf.square(x - ct)))
        grad = mtf.gradients([loss], [x])[0]
        ops, state = R.adam_update(x, grad, lr)
        lowering = runner.lower(graph, mesh, H.make_impl("hvd", conf))
        step = runner.lowered_group(lowering, ops)
        x_out = lowering.export_to_tf_tensor(x)
        t_out = lowering.export_to_tf_tensor(state.step)
        with runner.session(H.session_config("hvd", conf), lowering) as sess:
            for _ in range(steps):
                sess.run(step)
            x_val, t_val = sess.run([x_out, t_out])
    ref = _numpy_adam(np.zeros(conf.nc), lambda xx: 4 * w * (xx - c)**3, lr, steps)
    assert t_val == steps
    np.testing.assert_allclose(x_val, ref, rtol=ADAM_RTOL, atol=ADAM_RTOL)


@pytest.mark.skipif(H.SIZE > 1, reason="1 rank; equal trajectories on the other grids imply "
                                        "equal gradients there")
def test_loss_gradient_finite_differences():
    """d loss / d s along a random direction: mtf.gradients vs a central difference."""
    conf = CONF
    rng = np.random.RandomState(11)
    direction = rng.standard_normal(conf.nc)

    def build(mesh):
        phs = {}
        shape = fft.real_shape(conf)
        truth = ics.linear_field(conf, mesh)
        observed = R.forward_model(truth, conf, "lpt")
        # a trial field away from the truth: another realisation, scaled down
        base = ics.linear_field(conf.replace(seed=conf.seed + 1), mesh) * 0.5
        delta = H.placeholder_input(mesh, phs, "delta", direction, shape)
        s = base + delta
        loss, _, _ = R.loss_terms(s, observed, conf, RCONF)
        grad = mtf.gradients([loss], [s])[0]
        return {"loss": loss, "grad": grad}, phs

    r0, rp, rm = H.run("hvd", conf, build, feeds=[{"delta": 0 * direction},
                                                   {"delta": FD_EPS * direction},
                                                   {"delta": -FD_EPS * direction}])
    fd = (rp["loss"] - rm["loss"]) / (2 * FD_EPS)
    an = float(np.sum(r0["grad"] * direction))
    assert abs(fd - an) < FD_RTOL * abs(an), (fd, an)


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kw, word", [
    ({"learning_rate": 0.0}, "learning_rate"), ({"learning_rate": -0.1}, "learning_rate"),
    ({"learning_rate": float("nan")}, "learning_rate"), ({"iterations": 0}, "iterations"),
    ({"iterations": 2.5}, "iterations"), ({"forward": "pm"}, "forward"),
    ({"noise": -1.0}, "noise"), ({"sigma": 0.0}, "sigma"), ({"log_every": 0}, "log_every"),
    ({"beta1": 1.0}, "beta1")])
def test_bad_settings(kw, word):
    with pytest.raises(ValueError, match=word):
        R.ReconConfig(**kw)


def test_likelihood_sigma():
    assert R.ReconConfig(noise=0.3).likelihood_sigma == 0.3
    assert R.ReconConfig(noise=0.0).likelihood_sigma == R.NOISELESS_SIGMA
    assert R.ReconConfig(noise=0.0, sigma=0.2).likelihood_sigma == 0.2


def test_observed_field_of_the_wrong_shape():
    with tf.Graph().as_default():
        mesh = mtf.Mesh(mtf.Graph(), "mesh")
        with pytest.raises(ValueError, match=r"observed field must have the shape nc=\(16, 16, "
                                             r"16\), got \(16, 16, 8\)"):
            R.ReconstructionGraph(CONF, RCONF, mesh, observed=np.ones((16, 16, 8)))
        wrong = mtf.zeros(mesh, fft.real_shape(CONF.replace(nc=(16, 16, 8))), tf.float64)
        with pytest.raises(ValueError, match="observed field must have the shape"):
            R.ReconstructionGraph(CONF, RCONF, mesh, observed=wrong)
        with pytest.raises(ValueError, match="non-finite"):
            R.ReconstructionGraph(CONF, RCONF, mesh, observed=np.full(CONF.nc, np.nan))


@pytest.mark.rank_independent  # the CLI prints the error on rank 0 only
@pytest.mark.parametrize("extra, word", [(["--learning-rate", "0"], "learning_rate"),
                                         (["--iterations", "0"], "iterations"),
                                         (["--noise", "-1"], "noise")])
def test_cli_bad_input(extra, word, capsys):
    """Rejected before any graph or collective is built (identically on every rank)."""
    from flowpm_mtf.errors import ConfigError

    args = ["reconstruct", "--nc", "16", "--backend", "placement", "--out",
            tempfile.mkdtemp()] + extra
    assert cli.main(args) == ConfigError.exit_code
    err = capsys.readouterr().err
    assert err.count("flowpm-mtf: error: ") == 1 and word in err


@pytest.mark.rank_independent
def test_cli_unknown_forward_model(capsys):
    assert cli.main(["reconstruct", "--forward", "pm", "--backend", "placement"]) == 2
    assert "invalid choice: 'pm'" in capsys.readouterr().err


# ----------------------------------------------------------------------------- CLI, 2 ranks
@pytest.mark.skipif(H.SIZE != 2, reason="the command on 2 ranks: the 2-rank pass")
def test_cli_on_two_ranks_matches_the_job(recon, capsys):
    """`flowpm-mtf reconstruct` on 2 ranks (this pass's, in-process; grid 2x1): outputs well
    formed, progress logged once (by rank 0) per reported iteration, and the loss trajectory
    equal to the job's on this grid, which test_trajectory_independent_of_the_grid holds
    equal to one processor's."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    out = comm.bcast(tempfile.mkdtemp(prefix="recon_cli") if comm.rank == 0 else None)
    assert cli.main(CLI_ARGS + ["--iterations", str(CLI_ITERATIONS), "--out", out]) == 0
    err = capsys.readouterr().err
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    cfg = dict(summary["config"])
    assert cfg.pop("grid") == [2, 1]
    ref_cfg = CONF.to_dict()
    ref_cfg.pop("grid")
    assert cfg == ref_cfg
    assert summary["reconstruction"] == {**RCONF.to_dict(), "iterations": CLI_ITERATIONS,
                                         "log_every": 5}
    np.testing.assert_allclose(summary["loss"], recon[0]["loss"][:CLI_ITERATIONS + 1],
                               rtol=TRAJECTORY_RTOL, atol=0)
    assert set(summary["timings"]) >= {"graph_build_s", "optimise_s", "per_iteration_s"}
    assert len(summary["peak_memory_mb_per_rank"]) == 2
    with h5py.File(os.path.join(out, "reconstruction.h5"), "r") as f:
        assert f["reconstruction"].shape == (16, 16, 16)
        assert f["loss"].shape == (CLI_ITERATIONS + 1,)
    txt = np.loadtxt(os.path.join(out, "reconstruction.txt"))
    assert txt.ndim == 2 and txt.shape[1] == 4 and np.all(np.diff(txt[:, 0]) > 0)
    assert os.path.getsize(os.path.join(out, "reconstruction.png")) > 10000
    for i in (1, 5, 10):  # rank 0 only: each reported iteration appears once
        assert comm.allgather(err.count("iteration %d/%d:" % (i, CLI_ITERATIONS))) == [1, 0], \
            err[-3000:]
    assert err.count("iteration 2/%d:" % CLI_ITERATIONS) == 0  # --log-every 5
