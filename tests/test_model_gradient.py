"""Gradients of a loss on the final state w.r.t. the initial field and the cosmology
(flowpm_mtf.gradients.model_gradient): the adjoint's field gradient against ``mtf.gradients``
through the unrolled LPT + N-body (the eulerian decomposition on every grid of the world
size, the lagrangian one on the first: 10 steps on one process, 3 on the grids of several
ranks), the cosmology gradient against
central finite differences of the loss, the cotangents' return to lattice order, and bad
input."""
import dataclasses

import mesh_tensorflow as mtf
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import fpm_harness as H
import nbody_harness as NH
from flowpm_mtf.mesh import domain
from flowpm_mtf.physics import gravity, ics, lpt, nbody, sizing
from flowpm_mtf import layout
from flowpm_mtf.gradients import model_gradient
from flowpm_mtf.config import SimConfig

tf.disable_eager_execution()

# Adjoint vs stored-graph field gradient, float64, 10 steps: the target (the
# adjoint of the time loop alone measured <= 4e-15, tests/test_adjoint.py; the chain adds
# the return to lattice order, exact, and one more LPT gradient in another summation order).
FIELD_RTOL = 1e-6
# float32 field gradient against the float64 reference: float32 round-off of the LPT,
# 10 steps and their reverse (the time loop alone: 2.2e-6 for 5 steps, test_adjoint.py).
FIELD_RTOL_FLOAT32 = 5e-5
# Cosmology gradient vs central differences of the loss in float64. The loss is far from
# quadratic in the parameters at this scale (measured for sigma8 with 5 steps: relative steps
# 1e-2, 1e-3, 1e-5 give 2732, 2674, 2663.62397 against the adjoint's 2663.62397), so the step
# is small; float64 keeps its rounding at ~1e-10 relative. The gradient's own background
# derivatives (model_gradient.FD_REL_STEP) agree to ~4e-8 (tests/test_reconstruct.py).
# A wrong sign or a missing term (steps, force prefactor, LPT coefficients or P(k)) is > 1e-2.
COSMO_FD_REL = 1e-5
COSMO_RTOL = 1e-6
# Steps of the cosmology test: 2, a first and a last step (every route, each step's factors
# among them, is there from one step on; the graphs of the adjoint and of the four losses of
# the finite differences grow with the steps; measured agreement 4e-10 for Omega_c).
COSMO_STEPS = 2

NC = 16
BOX = 64.0
# Steps of the field-gradient test: the 10 on one process (1x1); on the grids of 2 and
# 4 ranks, 3 (what a grid adds, cotangents of migrated particles and of halos crossing ranks,
# is in every step; the unrolled reference costs in proportion to the steps).
FIELD_STEPS = 10
GRID_FIELD_STEPS = 3


def conf_for(grid=(1, 1), decomposition="eulerian", dtype="float64", n_steps=10, **kw):
    return SimConfig(nc=NC, box_size=BOX, grid=grid, halo_size=4, lpt_order=2, a_start=0.1,
                     a_end=1.0, n_steps=n_steps, dtype=dtype, decomposition=decomposition,
                     **kw)


@pytest.fixture(scope="module")
def white():
    return np.random.RandomState(5).randn(NC, NC, NC)


@pytest.fixture(scope="module")
def weight_field():
    return np.random.RandomState(13).randn(NC, NC, NC)


id_field = NH.id_field


def make_loss(conf, weight_field):
    """``sum(W rho^2) + sum(w(id) p)``: the final density and momenta (no block-local
    positions: they jump when a particle migrates, which finite differences would see)."""

    def loss(state):
        w = NH.import_field(state.positions.mesh, conf, weight_field)
        rho = gravity.density(state.positions, conf, domain.weights(state.ids, conf))
        return mtf.reduce_sum(w * rho * rho) + mtf.reduce_sum(id_field(state.ids, conf, 2)
                                                              * state.momenta)
    return loss


def stored(kind, conf, field, weight_field, mode):
    """Loss and d loss / d field by mtf.gradients through the unrolled model; with the
    eulerian decomposition also ``moved``, the particles not in their lattice slot at the end
    (they migrated)."""

    def build(mesh):
        f = NH.import_field(mesh, conf, field)
        s = f if mode == "linear" else ics.linear_field(conf, mesh, noise=f)
        s0 = lpt.lpt_init(s, conf, forces=False)
        final = nbody.nbody(s0, conf)
        loss = make_loss(conf, weight_field)(final)
        out = {"loss": loss, "grad": mtf.gradients([loss], [f])[0]}
        if conf.decomposition == "eulerian":
            lattice = domain.pad_particles(domain.lattice_ids(conf, mesh),
                                           sizing.capacity(conf), -1)
            out["moved"] = mtf.reduce_sum(mtf.cast(mtf.not_equal(final.ids, lattice),
                                                   tf.float64))
        return out

    return H.run(kind, conf, build)


def adjoint(kind, conf, field, weight_field, mode, params=("Omega_c", "sigma8")):
    """(run info of ModelGradient.run, field gradient) for ``field`` (linear or noise)."""
    with tf.Graph().as_default():
        graph = mtf.Graph()
        mesh = mtf.Mesh(graph, "mesh")
        f = NH.import_field(mesh, conf, field)
        mg = model_gradient.ModelGradient(conf, mesh, make_loss(conf, weight_field),
                                          params=params, **{mode: f})
        lowering = mtf.Lowering(graph, {mesh: H.make_impl(kind, conf)})
        ops = mg.lower(lowering)
        grad = lowering.export_to_tf_tensor(mg.field_gradient)
        with tf.Session(config=H.session_config(kind, conf)) as sess:
            sess.run(tf.global_variables_initializer())
            sess.run(lowering.copy_masters_to_slices())
            out = mg.run(sess, ops, extra=grad)
    return out, out["extra"]


CASES = [("hvd", g) for g in H.HVD_GRIDS.get(H.SIZE, [])]


# The eulerian decomposition on every grid (its cotangents migrate across the ranks); the
# lagrangian one on the first grid of 1 and 2 ranks (1x1, 2x1): without migrations, what a
# split y axis adds to it is the halo sums of the force VJP and of the painting, which the
# eulerian 1x2 case runs too (and tests/test_force_vjp.py checks for both decompositions on
# the placement 2x2 grid); not on 4 ranks (~30 s a case there).
FIELD_CASES = [pytest.param(c, d, id="%s-%s" % (H.case_id(c), d))
               for i, c in enumerate(CASES) for d in ("eulerian", "lagrangian")
               if d == "eulerian" or (i == 0 and H.SIZE < 4)]


@pytest.mark.parametrize("case, decomposition", FIELD_CASES)
def test_field_gradient_matches_stored(case, decomposition, white, weight_field):
    """d loss / d linear field by the adjoint == mtf.gradients through LPT + N-body."""
    kind, grid = case
    conf = conf_for(grid, decomposition,
                    n_steps=FIELD_STEPS if max(grid) == 1 else GRID_FIELD_STEPS)
    linear = NH.linear_field_numpy(conf)
    ref = stored(kind, conf, linear, weight_field, "linear")
    out, grad = adjoint(kind, conf, linear, weight_field, "linear", params=())
    err = H.rel_err(grad, ref["grad"])
    print("field gradient %s %s: loss %.15g vs %.15g, rel err %.3g"
          % (H.case_id(case), decomposition, out["loss"], ref["loss"], err))
    assert np.isclose(out["loss"], ref["loss"], rtol=1e-12, atol=0)
    assert np.abs(ref["grad"]).max() > 0
    if decomposition == "eulerian" and max(grid) > 1:
        assert ref["moved"] > 0   # particles crossed ranks: their cotangents come back
    assert err <= FIELD_RTOL, err


@pytest.mark.skipif(H.SIZE != 1, reason="a dtype check: the process grids are covered by the "
                    "float64 tests")
def test_noise_gradient_float32(white, weight_field):
    """Noise mode in float32 (eulerian): d loss / d white noise against the float64
    stored-graph reference."""
    kind, grid = CASES[0]
    ref = stored(kind, conf_for(grid), white, weight_field, "noise")
    _, grad = adjoint(kind, conf_for(grid, dtype="float32"), white, weight_field, "noise",
                      params=())
    err = H.rel_err(grad, ref["grad"])
    print("float32 noise gradient %s: rel err %.3g" % (H.case_id(CASES[0]), err))
    assert err <= FIELD_RTOL_FLOAT32, err


def _loss_at(kind, conf, white, weight_field):
    def build(mesh):
        s = ics.linear_field(conf, mesh, noise=NH.import_field(mesh, conf, white))
        s0 = lpt.lpt_init(s, conf, forces=False)
        return {"loss": make_loss(conf, weight_field)(nbody.nbody(s0, conf))}
    return float(H.run(kind, conf, build)["loss"])


# One decomposition per world size: lagrangian on 1 rank, eulerian on 2 (its cotangents
# migrate across the ranks; the cosmology terms themselves do not depend on the
# decomposition, whose particle handling test_field_gradient_matches_stored checks on
# every grid); not on 4 ranks: what the 2x2 grid adds (cotangents crossing both axes) is
# checked there by test_field_gradient_matches_stored, and the cross-rank sums of the
# cosmology terms already on 2 ranks (80 s a case on 4 oversubscribed ranks).
@pytest.mark.skipif(H.SIZE > 2, reason="cross-rank sums checked on 2 ranks; the 2x2 grid by "
                    "test_field_gradient_matches_stored")
@pytest.mark.parametrize("decomposition", ["lagrangian"] if H.SIZE == 1 else ["eulerian"])
def test_cosmology_gradient_matches_finite_differences(decomposition, white, weight_field):
    """d loss / d Omega_c and d sigma8 (noise fixed: through P(k), the LPT growth, every
    step's factors and the force) == central differences of the loss, float64."""
    kind, grid = CASES[0]
    conf = conf_for(grid, decomposition, n_steps=COSMO_STEPS)
    out, _ = adjoint(kind, conf, white, weight_field, "noise")
    for p in ("Omega_c", "sigma8"):
        v = getattr(conf.cosmology, p)
        h = COSMO_FD_REL * v
        vals = [_loss_at(kind, dataclasses.replace(
            conf, cosmology=dataclasses.replace(conf.cosmology, **{p: v + s * h})),
            white, weight_field) for s in (1, -1)]
        fd = (vals[0] - vals[1]) / (2 * h)
        print("d loss / d %s %s: adjoint %.10g (%s), finite differences %.10g"
              % (p, decomposition, out["cosmology"][p], out["terms"][p], fd))
        assert abs(out["cosmology"][p] - fd) <= COSMO_RTOL * abs(fd), (p, out["terms"][p], fd)
    # every route matters here (a test that a dropped term would fail)
    terms = out["terms"]["Omega_c"]
    total = abs(out["cosmology"]["Omega_c"])
    for route in ("steps", "force", "lpt", "power"):
        assert abs(terms[route]) > 10 * COSMO_RTOL * total, (route, terms)


@pytest.mark.parametrize("case", [c for c in CASES if max(c[1]) > 1]
                         or [("single", (2, 2))], ids=H.case_id)
def test_lattice_cotangents_return_every_particle(case):
    """Eulerian: per-slot vectors of migrated particles come back to their lattice slots
    (a value made from the id lands where that id started), every one of them."""
    kind, grid = case
    conf = conf_for(grid, "eulerian")
    linear = NH.linear_field_numpy(conf) * 3.0   # large displacements: many migrate

    def build(mesh):
        s0 = lpt.lpt_init(NH.import_field(mesh, conf, linear), conf, forces=False)
        vec = id_field(s0.ids, conf, 7)
        back, = model_gradient.lattice_cotangents(conf, [vec], s0.ids, conf.a_start)
        want = id_field(domain.lattice_ids(conf, mesh, order="lattice"), conf, 7)
        lattice = domain.pad_particles(domain.lattice_ids(conf, mesh), sizing.capacity(conf), -1)
        moved = mtf.reduce_sum(mtf.cast(mtf.not_equal(s0.ids, lattice), tf.float64))
        return {"back": back, "want": want, "moved": moved}

    out = H.run(kind, conf, build)
    assert out["moved"] > 0
    np.testing.assert_array_equal(out["back"], out["want"])


def test_bad_input():
    """One clear error at graph construction."""
    conf = conf_for()
    with tf.Graph().as_default():
        mesh = mtf.Mesh(mtf.Graph(), "mesh")
        f = mtf.zeros(mesh, mtf.Shape(list(layout.particle_dims(conf))), conf.tf_dtype)
        with pytest.raises(ValueError, match="exactly one of linear"):
            model_gradient.ModelGradient(conf, mesh, lambda s: None)
        with pytest.raises(ValueError, match="must have the shape"):
            model_gradient.ModelGradient(conf, mesh, lambda s: None, linear=f)
    with pytest.raises(ValueError, match="unknown cosmological parameter 'Omega_m'"):
        model_gradient.background_derivatives(conf, [0.1, 1.0], ["Omega_m"])


@pytest.mark.skipif(H.SIZE != 1, reason="a single-process TensorFlow test")
@pytest.mark.parametrize("dtype,id_dtype", [(np.float32, np.int32), (np.float64, np.int64)])
def test_lattice_scatter_native_equals_segment_sum(dtype, id_dtype):
    """FlowpmLatticeScatter (lattice_cotangents' return to lattice order) against
    tf.math.unsorted_segment_sum of the same rows, bit for bit: two blocks, shuffled
    slots, empty slots (id -1) carrying garbage; a site outside the block is an error."""
    from flowpm_mtf import native

    lib = native.load("particle_ops")
    rng = np.random.RandomState(3)
    sy, nz, nlat, cap, nb = 3, 4, 2 * 3 * 4, 30, 2
    home = np.zeros((nb, cap, 3), dtype)
    ids = np.full((nb, cap), -1, id_dtype)
    for b in range(nb):
        rows = rng.permutation(cap)[:nlat]            # every site once, in shuffled slots
        sites = rng.permutation(nlat)
        home[b, rows] = np.stack([sites // (sy * nz), sites // nz % sy, sites % nz], -1)
        home[b, rows] += rng.uniform(-0.45, 0.45, (nlat, 3))   # rounded to the site
        ids[b, rows] = sites + 1000 * b
    empty = ids < 0
    home[empty] = rng.uniform(-50, 50, (empty.sum(), 3))  # ignored: not a site
    fields = [rng.randn(nb, cap, 3).astype(dtype) for _ in range(2)]
    slot = np.rint(home).astype(np.int64)
    seg = np.where(empty, -1, (slot[..., 0] * sy + slot[..., 1]) * nz + slot[..., 2]
                   + nlat * np.arange(nb)[:, None])
    with tf.Graph().as_default(), tf.Session() as sess:
        got = sess.run(lib.flowpm_lattice_scatter(home, ids, fields, sy=sy, nz=nz, lattice=nlat))
        want = sess.run([tf.reshape(tf.math.unsorted_segment_sum(f.reshape(-1, 3), seg.reshape(-1),
                                                                 nb * nlat), [nb, nlat, 3])
                         for f in fields])
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
        assert np.all(np.abs(got[0]) > 0)                 # every site received its row
        bad = home.copy()
        bad[0, np.argmax(ids[0] >= 0), 2] = nz            # one valid particle off its block
        with pytest.raises(tf.errors.InvalidArgumentError, match="no lattice site"):
            sess.run(lib.flowpm_lattice_scatter(bad, ids, fields[:1], sy=sy, nz=nz, lattice=nlat))
