"""Adjoint of the N-body time loop (flowpm_mtf.gradients.adjoint): the reverse-integration gradient
against ``mtf.gradients`` through the unrolled ``nbody.nbody`` (both decompositions, every
grid of the world size), a dot-product test of one step's cotangent bookkeeping, migration
during the reverse pass, and the reverse integration returning the initial state."""
import mesh_tensorflow as mtf
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import fpm_harness as H
import nbody_harness as NH
from flowpm_mtf.gradients import adjoint
from flowpm_mtf.mesh import domain
from flowpm_mtf.physics import gravity, lpt, nbody, painting
from flowpm_mtf.config import SimConfig

tf.disable_eager_execution()

# Adjoint vs stored-graph gradient in float64: the same operations except that the adjoint
# re-creates every state by the reverse integration (x_i = x_{i+1} - D p_h), which returns
# the positions to round-off (see RECOVER_ATOL), and sums the cotangents in another order.
# Measured (16^3, 5 steps, a = 0.1 -> 1, grids 1x1, 2x1, 1x2): <= 4e-15 relative to the
# largest component. 1e-6 is the target; a wrong kick index in the force cotangent
# (K1_i for K1_{i-1}) gives 0.17, omitting the final force's cotangent 1.5e-3.
GRAD_RTOL = 1e-6
# float32 adjoint against the float64 stored-graph reference: measured 2.2e-6 (eulerian,
# 1x1), the level of the float32 stored-graph gradient itself (2.3e-6): float32 round-off
# of 5 steps, the reverse integration re-creating positions to ~1e-5 cells. 2e-5 leaves
# room for other summation orders; a bookkeeping error is > 1e-3.
GRAD_RTOL_FLOAT32 = 2e-5
# Central differences along a random direction in float64 (as tests/test_nbody.py): the
# one-step map is piecewise smooth (CIC), eps 1e-6 cells gives truncation ~1e-12 and
# rounding ~1e-10 relative; a particle whose stencil changes cell within +-eps adds O(eps).
FD_EPS = 1e-6
FD_RTOL = 1e-6
# Positions recovered by the reverse loop vs the stored forward initial state, float64:
# each reverse drift undoes the forward one up to the rounding of x + D p (~1e-15 cells
# at |x| < 16) and of the migration's frame shifts (+- s), amplified by the force's
# sensitivity over 5 steps. Measured 2e-14 cells and 5e-14 relative for the momenta;
# 1e-10 catches any wrong factor (a wrong kick leaves O(1e-2) cells).
RECOVER_ATOL = 1e-10  # [cells]
RECOVER_P_RTOL = 1e-10

NC = 16
BOX = 64.0
N_STEPS = 5
# Steps on a grid of several blocks (2x1, 1x2, 2x2, and 2 x 2 blocks on one processor): what
# a grid adds, migrations during the reverse pass and cotangents crossing blocks, is in
# every step; the unrolled reference costs in proportion to the steps (as GRID_FIELD_STEPS
# of tests/test_model_gradient.py). One block (1x1): N_STEPS.
GRID_STEPS = 3


def steps_for(grid):
    return N_STEPS if max(grid) == 1 else GRID_STEPS


def conf_for(grid=(1, 1), decomposition="eulerian", dtype="float64", n_steps=None):
    n_steps = steps_for(grid) if n_steps is None else n_steps
    # halo 4 covers the largest displacement of the run (~3.6 cells) for the lagrangian
    # decomposition; the eulerian one needs 2 but is given the same.
    return SimConfig(nc=NC, box_size=BOX, grid=grid, halo_size=4, lpt_order=2,
                     a_start=0.1, a_end=1.0, n_steps=n_steps, dtype=dtype,
                     decomposition=decomposition)


@pytest.fixture(scope="module")
def linear():
    return NH.linear_field_numpy(conf_for())


@pytest.fixture(scope="module")
def weight_field():
    return np.random.RandomState(11).randn(NC, NC, NC)


id_field = NH.id_field


def make_loss(conf, weight_field):
    """``sum(W rho^2) + sum(w_x(id) x) + sum(w_p(id) p)`` of a state (rho: final CIC
    density; w: fixed per-particle weights): depends on positions and momenta, non-linear
    in the positions."""

    def loss(state):
        w = NH.import_field(state.positions.mesh, conf, weight_field)
        rho = gravity.density(state.positions, conf, domain.weights(state.ids, conf))
        return (mtf.reduce_sum(w * rho * rho)
                + mtf.reduce_sum(id_field(state.ids, conf, 1) * state.positions)
                + mtf.reduce_sum(id_field(state.ids, conf, 2) * state.momenta))

    return loss


def export(prefix, x, p, ids, conf):
    """Fetch entries of a state for :func:`nbody_harness.by_id` (global positions)."""
    return {prefix + "x": painting.to_global(x, conf), prefix + "p": p, prefix + "ids": ids}


def reference_gradient(kind, conf, linear, weight_field):
    """``mtf.gradients`` through the unrolled nbody.nbody: d loss / d (x0, p0) by id."""

    def build(mesh):
        s0 = lpt.lpt_init(NH.import_field(mesh, conf, linear), conf, forces=False)
        final = nbody.nbody(s0, conf)
        loss = make_loss(conf, weight_field)(final)
        gx, gp = mtf.gradients([loss], [s0.positions, s0.momenta])
        out = export("i", s0.positions, s0.momenta, s0.ids, conf)
        out.update({"gx": gx, "gp": gp, "gids": s0.ids, "loss": loss})
        return out

    return NH.by_id(H.run(kind, conf, build))


def run_graph_with_session(kind, conf, build, drive):
    """Build ``build(mesh) -> (built, exports)`` and lower it; ``drive(built, lowering)``
    lowers the adjoint's ops (before any session run) and returns ``run(sess, fetch)``,
    which is called with the variables initialised and the lowered exports; returns its
    result."""
    with tf.Graph().as_default():
        graph = mtf.Graph()
        mesh = mtf.Mesh(graph, "mesh")
        state, exports = build(mesh)
        lowering = mtf.Lowering(graph, {mesh: H.make_impl(kind, conf)})
        run = drive(state, lowering)
        fetch = {k: lowering.export_to_tf_tensor(v) for k, v in exports.items()}
        with tf.Session(config=H.session_config(kind, conf)) as sess:
            sess.run(tf.global_variables_initializer())
            sess.run(lowering.copy_masters_to_slices())
            return run(sess, fetch)


def adjoint_gradient(kind, conf, linear, weight_field):
    """The adjoint: forward keeping the final state, reverse loop; by id."""

    def build(mesh):
        s0 = lpt.lpt_init(NH.import_field(mesh, conf, linear), conf, forces=False)
        adj = adjoint.AdjointGraph(conf, mesh, initial_state=s0,
                                   loss_fn=make_loss(conf, weight_field))
        v, (gx, gp) = adj.variables, adj.cotangents
        out = export("i", s0.positions, s0.momenta, s0.ids, conf)
        out.update(export("r", v.positions, v.momenta, v.ids, conf))
        out.update({"gx": gx, "gp": gp, "gids": v.ids})
        return adj, out

    def drive(adj, lowering):
        ops = adjoint.lower_adjoint(adj, lowering)

        def run(sess, fetch):
            initial = sess.run({k: t for k, t in fetch.items() if k.startswith("i")})
            res = adjoint.run_gradient(sess, adj, ops)
            out = sess.run({k: t for k, t in fetch.items() if not k.startswith("i")})
            out.update(initial)
            out["loss"] = res["loss"]
            return NH.by_id(out), res

        return run

    return run_graph_with_session(kind, conf, build, drive)


_CACHE = {}


def compared(kind, grid, decomposition, linear, weight_field):
    """(adjoint by id, adjoint run info, reference by id), computed once per case."""
    key = (kind, grid, decomposition)
    if key not in _CACHE:
        conf = conf_for(grid, decomposition)
        adj, info = adjoint_gradient(kind, conf, linear, weight_field)
        ref = reference_gradient(kind, conf, linear, weight_field)
        _CACHE[key] = (adj, info, ref)
    return _CACHE[key]


# An end-to-end composition: on 2 ranks one 1D grid, (2, 1); the 4-rank pass's 2x2 grid
# splits both axes, and the layers below run both 1D grids in their own files (fpm_harness).
HVD_CASES = H.cases(placement=False, one_1d=True)
# Grids where particles cross block boundaries: the hvd grids with more than one block,
# and on one rank a 2x2 grid of blocks on one processor (fpm_harness "single": the
# migration's shifts between blocks, in this process; faster than PlacementMeshImpl on 2 devices).
MIGRATION_CASES = ([c for c in HVD_CASES if max(c[1]) > 1]
                   or [("single", (2, 2))])
# (case, decomposition) of the stored-gradient comparisons: both decompositions on every
# case but the 2x2 grid, eulerian only there. What the lagrangian 2x2 case would add, the
# force VJP's halo sums with both axes split (corners), is checked against mtf.gradients
# by tests/test_force_vjp.py (lagrangian, placement 2x2); the adjoint's loop bookkeeping of
# the lagrangian decomposition does not depend on the grid (hvd 2x1 here), and the 2x2
# adjoint with Horovod's collectives is the eulerian case (with the migrations).
GRADIENT_CASES = [pytest.param(c, d, id="%s-%s" % (H.case_id(c), d))
                  for c in HVD_CASES for d in ("eulerian", "lagrangian")
                  if not (d == "lagrangian" and tuple(c[1]) == (2, 2))]


@pytest.mark.parametrize("case, decomposition", GRADIENT_CASES)
def test_adjoint_matches_stored_gradient(case, decomposition, linear, weight_field):
    """d loss / d (x0, p0) by the reverse loop == mtf.gradients through the unrolled
    nbody (float64; 5 steps on one block, 3 on a grid of several), particle by particle."""
    adj, _, ref = compared(case[0], case[1], decomposition, linear, weight_field)
    assert np.isclose(adj["loss"], ref["loss"], rtol=1e-12, atol=0), (adj["loss"], ref["loss"])
    errs = {k: H.rel_err(adj[k], ref[k]) for k in ("gx", "gp")}
    print("adjoint vs stored gradient %s %s: %s" % (H.case_id(case), decomposition, errs))
    assert max(errs.values()) <= GRAD_RTOL, errs
    assert np.abs(ref["gx"]).max() > 0 and np.abs(ref["gp"]).max() > 0


@pytest.mark.parametrize("case", MIGRATION_CASES, ids=H.case_id)
def test_reverse_pass_migrates(case, linear, weight_field):
    """Eulerian on a grid of several blocks: particles cross block boundaries during the
    reverse integration (the migration statistics count them) and their cotangents
    travel with them: the gradient still matches the stored-graph gradient."""
    adj, info, ref = compared(case[0], case[1], "eulerian", linear, weight_field)
    moved = [dict(zip(domain.STATS, st))["moved"] for st in info["reverse"]]
    n_steps = steps_for(case[1])
    assert len(moved) == n_steps + 1
    assert moved[0] == 0            # the final-force VJP run: no drift, nothing moves
    assert sum(m > 0 for m in moved[1:]) >= n_steps - 1, moved
    errs = {k: H.rel_err(adj[k], ref[k]) for k in ("gx", "gp")}
    assert max(errs.values()) <= GRAD_RTOL, errs


@pytest.mark.parametrize("case, decomposition", GRADIENT_CASES)
def test_reverse_recovers_initial_state(case, decomposition, linear, weight_field):
    """The reverse loop ends at the stored forward initial state (by id), float64."""
    adj, _, _ = compared(case[0], case[1], decomposition, linear, weight_field)
    conf = conf_for(case[1], decomposition)
    n = np.asarray(conf.nc, np.float64)
    dx = (adj["rx"] - adj["ix"] + n / 2) % n - n / 2      # periodic (eulerian wraps)
    print("recovered x0 %s %s: %.3g cells, p0 %.3g" % (
        H.case_id(case), decomposition, np.abs(dx).max(), H.rel_err(adj["rp"], adj["ip"])))
    assert np.abs(dx).max() <= RECOVER_ATOL
    assert H.rel_err(adj["rp"], adj["ip"]) <= RECOVER_P_RTOL
    assert np.abs(adj["ip"]).max() > 0


# float32 accuracy and the one-step dot product are properties of the reverse step, not of
# the grid: the 1-rank pass. What a grid adds, particles and their cotangents migrating
# during the reverse steps, is checked against the stored gradient by the tests above on
# the grids of 2 and 4 ranks.
ONE_RANK = pytest.mark.skipif(H.SIZE > 1, reason="grid-independent check: the 1-rank pass")


@ONE_RANK
def test_float32_adjoint(linear, weight_field):
    """The float32 adjoint against the float64 stored-graph gradient (eulerian)."""
    kind, grid = HVD_CASES[0]
    _, _, ref = compared(kind, grid, "eulerian", linear, weight_field)
    adj, _ = adjoint_gradient(kind, conf_for(grid, "eulerian", dtype="float32"), linear,
                              weight_field)
    errs = {k: H.rel_err(adj[k], ref[k]) for k in ("gx", "gp")}
    print("float32 adjoint vs float64 stored gradient %s: %s" % (H.case_id((kind, grid)), errs))
    assert max(errs.values()) <= GRAD_RTOL_FLOAT32, errs


@ONE_RANK
@pytest.mark.parametrize("decomposition", ["eulerian", "lagrangian"])
def test_one_step_dot_product(decomposition, linear):
    """<J v, u> == <v, J^T u> for one step (x0, p0) -> (x1, p1) with f0 = F(x0): J v by
    central differences of the forward step, J^T u by the adjoint (the final-force run
    and one reverse step) with the loss <state, u>; u, v random per particle."""
    kind, grid = HVD_CASES[0]
    conf = conf_for(grid, decomposition, n_steps=3)
    stages = nbody.default_stages(conf)[:2]

    def build(mesh):
        s0 = lpt.lpt_init(NH.import_field(mesh, conf, linear), conf, forces=False)
        eps_ph = tf.placeholder(conf.tf_dtype, [], name="eps")
        eps = mtf.import_tf_tensor(mesh, eps_ph, mtf.Shape([]))
        moved = s0._replace(positions=s0.positions + id_field(s0.ids, conf, 3) * eps,
                            momenta=s0.momenta + id_field(s0.ids, conf, 4) * eps)
        final = nbody.nbody(moved, conf, stages=stages)

        def dot_u(state):
            return (mtf.reduce_sum(id_field(state.ids, conf, 5) * state.positions)
                    + mtf.reduce_sum(id_field(state.ids, conf, 6) * state.momenta))

        adj = adjoint.AdjointGraph(conf, mesh, stages=stages, initial_state=s0, loss_fn=dot_u)
        xb, pb = adj.cotangents
        ids = adj.variables.ids
        vjt = (mtf.reduce_sum(id_field(ids, conf, 3) * xb)
               + mtf.reduce_sum(id_field(ids, conf, 4) * pb))
        return (adj, eps_ph), {"phi": dot_u(final), "vjt": vjt}

    def drive(built, lowering):
        adj, eps_ph = built
        ops = adjoint.lower_adjoint(adj, lowering)

        def run(sess, fetch):
            phi = [sess.run(fetch["phi"], {eps_ph: e}) for e in (FD_EPS, -FD_EPS)]
            adjoint.run_gradient(sess, adj, ops)
            return (phi[0] - phi[1]) / (2 * FD_EPS), sess.run(fetch["vjt"])

        return run

    jv_u, v_jtu = run_graph_with_session(kind, conf, build, drive)
    print("dot product %s: <Jv,u> %.15g <v,J^T u> %.15g" % (decomposition, jv_u, v_jtu))
    assert abs(jv_u - v_jtu) <= FD_RTOL * abs(v_jtu), (jv_u, v_jtu)


def test_reverse_factors_bookkeeping():
    """The fed rows: the final-force run (0, 0, 0, K1_{N-1}), then per step i = N-1..0
    (K0_i, D_i, K1_i, K1_{i-1}) with K1_{-1} = 0."""
    conf = conf_for(n_steps=3)
    stages = nbody.default_stages(conf)
    fac = nbody.all_step_factors(conf, stages)
    rows = adjoint.reverse_factors(conf, stages)
    assert len(rows) == 4
    np.testing.assert_array_equal(rows[0], [0, 0, 0, fac[2, 2]])
    np.testing.assert_array_equal(rows[1], [fac[2, 0], fac[2, 1], fac[2, 2], fac[1, 2]])
    np.testing.assert_array_equal(rows[3], [fac[0, 0], fac[0, 1], fac[0, 2], 0.0])
