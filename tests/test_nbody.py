"""N-body (FastPM kick-drift-kick with the PM force): against single-device FlowPM 0.1.1
(``flowpm.tfpm.nbody``), layout independence on every grid of the world size and on
PlacementMeshImpl, snapshots, finite-difference gradients, escape detection."""
import os

import mesh_tensorflow as mtf
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import fpm_harness as H
import nbody_harness as NH
from flowpm_mtf.mesh import domain, fft
from flowpm_mtf.physics import gravity, lpt, nbody, painting
from flowpm_mtf.config import SimConfig
from flowpm_mtf.errors import ParticleEscapeError
from world_share import on_rank0

# float32 on both sides. LPT agrees to ~3e-7 (test_lpt.py); three KDK steps
# (a = 0.1 -> 1, displacements up to ~3.6 cells) amplify rounding differences:
# each force is a sum of ~10^4 CIC/FFT terms in different orders, and positions
# feed back into the CIC weights. Observed: positions 4e-6, momenta 1e-5,
# forces 1.7e-5 and density 7e-6 of their largest values. 1e-4 leaves room for
# other BLAS/FFT orders without hiding an O(1/N) or kernel error (those give >1e-3).
NBODY_RTOL = 1e-4
# Same with FlowPM's own float32 growth solver (BDF, rtol 1e-4) instead of our
# growth table: it differs from ours by <= 1.6e-5 (test_cosmology.py), which enters
# the kick/drift factors linearly (observed here: <= 2e-5).
NBODY_OWN_GROWTH_RTOL = 2e-4
# Distributed vs. one block in float64: identical operations except the order of
# the FFT and halo sums: rounding only (~1e-15), amplified by two time steps.
LAYOUT_RTOL = 1e-10
# Central differences in float64: the loss is smooth (piecewise polynomial in the
# CIC weights) and the step 1e-6 of the field amplitude gives truncation ~1e-12 and
# rounding ~1e-10 relative; a CIC cell crossing inside [-eps, eps] would give O(1).
FD_EPS = 1e-6
FD_RTOL = 1e-6

NC = 16
BOX = 64.0


def conf_for(grid=(1, 1), dtype="float32", order=1, **kw):
    kw.setdefault("halo_size", 4)
    kw.setdefault("n_steps", 3)
    kw.setdefault("a_end", 1.0)
    kw.setdefault("a_start", 0.1)
    return SimConfig(nc=kw.pop("nc", NC), box_size=kw.pop("box_size", BOX), grid=grid,
                     lpt_order=order, dtype=dtype, **kw)


@pytest.fixture(scope="module")
def linear():
    return NH.linear_field_numpy(conf_for())


def run_forward(kind, conf, linear, snapshot_a=None):
    def build(mesh):
        lin = NH.import_field(mesh, conf, linear)
        init = lpt.lpt_init(lin, conf)
        out = nbody.nbody(init, conf, snapshot_a=snapshot_a)
        final, snaps = out if snapshot_a is not None else (out, [])
        fetch = NH.export_state(init, conf, "i")
        fetch.update(NH.export_state(final, conf, "n"))
        for i, s in enumerate(snaps):
            fetch.update(NH.export_state(s, conf, "s%d" % i))
        fetch["rho"] = gravity.density(final.positions, conf,
                                       domain.weights(final.ids, conf))
        return fetch

    out = NH.by_id(H.run(kind, conf, build))
    q = np.indices(conf.nc).reshape(3, -1).T
    return {k: (q + NH.disp(v, conf) if k.endswith("x") else v)  # unwrapped, as FlowPM's
            for k, v in out.items()}


def check_against_flowpm(out, ref, conf, rtol):
    q = np.indices(conf.nc).reshape(3, -1).T
    errs = {"x": H.rel_err(out["nx"] - q, ref["nx"] - q),
            "p": H.rel_err(out["np"], ref["np"]),
            "f": H.rel_err(out["nf"], ref["nf"]),
            "rho": H.rel_err(out["rho"], ref["rho"])}
    assert max(errs.values()) < rtol, errs
    return errs


@pytest.fixture(scope="module")
def flowpm_1lpt(linear):
    conf = conf_for()
    stages = nbody.default_stages(conf)
    # the same numbers on every rank and in every pass: computed once (world_share)
    return on_rank0(lambda: NH.flowpm_run(linear, conf.a_start, 1, stages=stages),
                    key=("test_nbody.flowpm_1lpt", linear, conf.a_start, stages))


# The N-body is an end-to-end composition: on 2 ranks one 1D grid (one_1d), (2, 1); its
# layers (FFT, halo, CIC, migration) run both 1D grids in their own files. Not on 4 ranks:
# there test_layout_independent checks the 2x2 grid's forward model (float64, to 1e-10)
# against the 1-processor mesh with 2 x 2 blocks, whose N-body is checked against FlowPM
# in the 1-rank pass (test_nbody_2lpt_matches_flowpm); the steps do not depend on the LPT
# order or the dtype.
@pytest.mark.parametrize("case", [c for c in H.cases(placement=False, one_1d=True)
                                  if c[0] == "hvd" and H.SIZE < 4], ids=H.case_id)
def test_nbody_1lpt_matches_flowpm(case, linear, flowpm_1lpt):
    """forward (1LPT + 3 KDK steps) against flowpm.tfpm.lpt_init + nbody, float32."""
    conf = conf_for(case[1])
    out = run_forward(case[0], conf, linear)
    check_against_flowpm(out, flowpm_1lpt, conf, NBODY_RTOL)


# The 1-rank pass only, on a 1-processor mesh with 2 x 2 blocks: the N-body of a 2LPT state
# on the MPI grids equals this mesh's to 1e-10 (test_layout_independent: 2LPT + 2 steps,
# float64, on (2, 1) and (2, 2)), and the N-body against FlowPM on those grids is
# test_nbody_1lpt_matches_flowpm (the steps do not depend on the LPT order).
@pytest.mark.rank_independent
def test_nbody_2lpt_matches_flowpm(linear):
    """N-body from our 2LPT state (which differs from FlowPM's by the D2 normalisation,
    see test_lpt.py) against flowpm.tfpm.nbody started from the same state."""
    kind, grid = "single", (2, 2)
    conf = conf_for(grid, order=2)
    out = run_forward(kind, conf, linear)
    init = {k: out["i" + k] for k in "xpf"}
    ref = NH.flowpm_run(linear, conf.a_start, 2, stages=nbody.default_stages(conf), init=init)
    check_against_flowpm(out, ref, conf, NBODY_RTOL)


@pytest.mark.skipif(H.SIZE != 1 or not os.environ.get("FLOWPM_MTF_SLOW_TESTS"),
                    reason="FlowPM's own growth solver (~45 s on a loaded 2-core machine): "
                           "set FLOWPM_MTF_SLOW_TESTS=1, 1-rank pass only")
def test_nbody_matches_flowpm_own_growth(linear):
    conf = conf_for()
    out = run_forward("hvd", conf, linear)
    ref = NH.flowpm_run(linear, conf.a_start, 1, stages=nbody.default_stages(conf),
                        growth="flowpm")
    check_against_flowpm(out, ref, conf, NBODY_OWN_GROWTH_RTOL)


@pytest.fixture(scope="module")
def layout_reference(linear):
    conf = conf_for(order=2, dtype="float64", n_steps=2)
    stages = nbody.default_stages(conf)
    # one process's 1-processor mesh: the same numbers on every rank and in every pass,
    # computed once (world_share)
    return on_rank0(lambda: run_forward("single", conf, linear, snapshot_a=[stages[1]]),
                    key=("test_nbody.layout_reference", linear, conf, stages[1]))


# The hvd grids only: the reference is the 1-processor mesh with 2 x 2 blocks itself (that
# case compared it with itself), and PlacementMeshImpl's 2x2 lowering adds nothing that
# the 4-rank pass's hvd 2x2 case does not check against the same reference (the placement
# backend runs the physics in test_lagrangian_equals_eulerian and the other files).
@pytest.mark.parametrize("case", H.cases(placement=False, one_1d=True), ids=H.case_id)
def test_layout_independent(case, linear, layout_reference):
    """2LPT + 2 steps in float64 on every grid of this world size (HvdSimdMeshImpl): the
    same particles end at the same positions as on a 1-processor mesh with 2 x 2 blocks."""
    conf = conf_for(case[1], order=2, dtype="float64", n_steps=2)
    stages = nbody.default_stages(conf)
    out = run_forward(case[0], conf, linear, snapshot_a=[stages[1]])
    ref = layout_reference
    q = np.indices(conf.nc).reshape(3, -1).T
    assert H.rel_err(out["nx"] - q, ref["nx"] - q) < LAYOUT_RTOL
    assert H.rel_err(out["s0x"] - q, ref["s0x"] - q) < LAYOUT_RTOL
    for key in ("np", "nf", "rho", "s0p"):
        assert H.rel_err(out[key], ref[key]) < LAYOUT_RTOL, key


@pytest.mark.rank_independent   # one process ("single"): the 1-rank pass
def test_snapshots_are_intermediate_states(linear):
    """A snapshot at stage k equals the final state of a run over stages[:k + 1]."""
    conf = conf_for(dtype="float64", n_steps=2)
    stages = nbody.default_stages(conf)

    def build(mesh):
        lin = NH.import_field(mesh, conf, linear)
        init = lpt.lpt_init(lin, conf)
        final, snaps = nbody.nbody(init, conf, snapshot_a=[stages[1], stages[0], stages[-1]])
        short = nbody.nbody(init, conf, stages=stages[:2])
        out = {}
        for name, s in (("mid", snaps[0]), ("start", snaps[1]), ("end", snaps[2]),
                        ("short", short), ("final", final), ("init", init)):
            out.update(NH.export_state(s, conf, name))
        return out

    out = H.run("single", conf, build)
    for k in "xpf":
        np.testing.assert_allclose(out["mid" + k], out["short" + k], rtol=1e-14, atol=1e-14)
        np.testing.assert_array_equal(out["end" + k], out["final" + k])
    np.testing.assert_array_equal(out["startx"], out["initx"])
    np.testing.assert_array_equal(out["startp"], out["initp"])


# Both decompositions on one block (1 rank), on 2 x 2 blocks of one processor (1 rank:
# migrations across both axes, halo sums across block corners) and on the hvd grid (2, 1)
# (2 ranks: the gradient through Horovod's collectives). Not on the 4-rank pass: what its
# 2x2 grid would add is the Horovod collectives of two sub-communicators under the same
# graph, which tests/test_domain.py (migration gradient), tests/test_painting.py (position
# gradient), tests/test_halo.py (fill/reduce adjoint) and tests/test_adjoint.py (the
# reverse loop) check on hvd 2x2.
FD_CASES = [pytest.param(c, d, id="%s-%s" % (H.case_id(c), d))
            for c in H.cases(single=True, placement=False, one_1d=True, hvd_2x2=False)
            for d in ("eulerian", "lagrangian")]


@pytest.mark.parametrize("case, decomposition", FD_CASES)
def test_gradient_finite_differences(case, decomposition):
    """d loss / d linear field through LPT, 2 KDK steps (with the migrations of the
    eulerian decomposition) and the final painting, float64, against central
    differences along a random direction."""
    conf = SimConfig(nc=8, box_size=64.0, grid=case[1], halo_size=2, a_start=0.1, a_end=0.5,
                     n_steps=2, lpt_order=2, dtype="float64", decomposition=decomposition)
    lin0 = NH.linear_field_numpy(conf, seed=3)
    rng = np.random.RandomState(4)
    direction = rng.randn(*conf.nc) * np.std(lin0)
    weight = rng.randn(*conf.nc)

    def build(mesh):
        phs = {}
        lin = H.placeholder_input(mesh, phs, "lin", lin0, fft.real_shape(conf))
        final, rho = nbody.forward(lin, conf)
        w = NH.import_field(mesh, conf, weight)
        loss = mtf.reduce_sum(w * rho * rho)
        grad = mtf.gradients([loss], [lin])[0]
        out = {"loss": loss, "grad": grad}
        out.update(NH.export_state(final, conf))
        return out, phs

    feeds = [{"lin": lin0}, {"lin": lin0 + FD_EPS * direction},
             {"lin": lin0 - FD_EPS * direction}]
    r0, rp, rm = H.run(case[0], conf, build, feeds=feeds)
    disp = np.abs(NH.disp(NH.by_id(r0)["x"], conf)).max()
    assert 0.1 < disp < min(conf.block_shape[:2]) - 1  # particles moved, none escaped
    fd = (rp["loss"] - rm["loss"]) / (2 * FD_EPS)
    an = float(np.sum(r0["grad"] * direction))
    assert abs(fd - an) <= FD_RTOL * abs(an), (fd, an)


@pytest.mark.parametrize("case", [c for c in H.cases(placement=False, one_1d=True)
                                  if c[0] == "hvd"],
                         ids=H.case_id)
def test_escape_raises(case, linear):
    """Particles moving beyond the halo make the run fail with a clear message on
    every rank (the escape count is global), not silently drop mass."""
    conf = conf_for(case[1], halo_size=1, n_steps=1, decomposition="lagrangian")

    def build(mesh):
        final, rho = nbody.forward(NH.import_field(mesh, conf, 30.0 * linear), conf)
        return {"rho": rho}

    with pytest.raises(tf.errors.InvalidArgumentError, match=painting.ESCAPE_MESSAGE):
        H.run(case[0], conf, build)


@pytest.mark.parametrize("case", [c for c in H.cases(placement=False, one_1d=True)
                                  if c[0] == "hvd" and max(c[1]) > 1], ids=H.case_id)
def test_eulerian_escape_names_steps(case, linear):
    """Eulerian: a particle moving more than a block in one step fails the migration
    check on every rank; the error names a number of steps. (Along an axis of one
    block, e.g. on 1x1, positions wrap into the periodic box exactly and nothing can
    escape: domain.exchange_axes.)"""
    conf = conf_for(case[1], halo_size=1, n_steps=1, a_start=0.5)

    def build(mesh):
        lin = NH.import_field(mesh, conf, linear)
        state = lpt.lpt_init(lin, conf)
        # an absurd momentum: every particle drifts ~2 blocks in the step
        state = state._replace(momenta=state.momenta * 0.0 + 50.0)
        final = nbody.kdk_step(state, conf, conf.a_start, conf.a_end)
        return {"x": final.positions}

    with pytest.raises(tf.errors.InvalidArgumentError, match=domain.CHECK_MESSAGE) as err:
        H.run(case[0], conf, build)
    exc = domain.error_from_tf(err.value, conf)
    assert isinstance(exc, ParticleEscapeError) and exc.steps_needed > 1, exc


@pytest.mark.rank_independent
@pytest.mark.parametrize("grid", [(1, 1), (2, 2)])
@pytest.mark.parametrize("decomposition", ["eulerian", "lagrangian"])
def test_step_checks_escapes_once(decomposition, grid, linear):
    """Eulerian: the step's paint and readout skip their escape counts, the migration's
    gate checks the same condition (its escape tests: test_eulerian_escape_names_steps
    and tests/test_domain.py); lagrangian: no migration, both counts stay."""
    conf = conf_for(grid, halo_size=1, n_steps=1, decomposition=decomposition)
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "mesh")

    def count(prefix):
        return sum(op.name.startswith(prefix) for op in graph.operations)

    state = lpt.lpt_init(NH.import_field(mesh, conf, linear), conf)
    before = {p: count(p) for p in ("escaped_count", "migrate_check")}
    nbody.kdk_step(state, conf, conf.a_start, conf.a_end)
    added = {p: count(p) - before[p] for p in before}
    if decomposition == "eulerian":
        assert added["escaped_count"] == 0 and added["migrate_check"] > 0, added
    else:
        assert added == {"escaped_count": 2, "migrate_check": 0}, added


# Lagrangian vs eulerian in float64: the same operations except the order of the CIC
# sums (particles in other slots) and the block-local frame: rounding only.
DECOMPOSITION_ATOL = 1e-10  # [fraction of the box]


@pytest.mark.parametrize("case", H.cases(single=True), ids=H.case_id)
def test_lagrangian_equals_eulerian(case, linear, layout_reference):
    """With a halo large enough for the lagrangian decomposition, its final positions
    (by id, periodic) agree with the eulerian reference."""
    conf = conf_for(case[1], order=2, dtype="float64", n_steps=2, decomposition="lagrangian")
    stages = nbody.default_stages(conf)
    out = run_forward(case[0], conf, linear, snapshot_a=[stages[1]])
    for key in ("nx", "s0x"):
        d = NH.disp(out[key], conf) - NH.disp(layout_reference[key], conf)
        assert np.abs(d).max() < DECOMPOSITION_ATOL * max(conf.nc), key
    for key in ("np", "nf", "rho"):
        assert H.rel_err(out[key], layout_reference[key]) < LAYOUT_RTOL, key


def test_invalid_stages_and_snapshots():
    conf = conf_for()
    with tf.Graph().as_default():
        mesh = mtf.Mesh(mtf.Graph(), "mesh")
        zeros = mtf.zeros(mesh, painting.lattice(conf, mesh).shape)
        state = lpt.State(zeros, zeros, zeros)
        with pytest.raises(ValueError, match="not one of the stages"):
            nbody.nbody(state, conf, snapshot_a=[0.55])
        with pytest.raises(ValueError, match="strictly increasing"):
            nbody.nbody(state, conf, stages=[0.1, 0.5, 0.3])
        with pytest.raises(ValueError, match="at least one"):
            nbody.nbody(state, conf, stages=[])


# The job lowers one step and feeds each step's factors; nbody() unrolls the steps
# with the factors as constants. Same float64 operations in the same order: only
# the rounding of the factors' route through a placeholder could differ (none).
JOB_VS_UNROLLED_ATOL = 1e-9  # [cells]
# A requested snapshot between two default stages (made a stage of the time loop).
JOB_SNAPSHOT_A = 0.42


@pytest.fixture(scope="module")
def simulate_job(tmp_path_factory):
    """One ``simulate`` job (``--snapshots 0.42 --power-steps``, 2LPT, 2 steps, float64,
    in-process PlacementMeshImpl on (2, 1)) and ``nbody.nbody`` unrolled on the same
    stages: ``(conf, stages, run_dir, summary, ref)``, ``ref`` the positions [cells]
    by id of the final state (``"nx"``) and of the snapshot (``"sx"``)."""
    from flowpm_mtf.physics import ics, timeloop
    from flowpm_mtf import jobs
    from flowpm_mtf.jobs import runner
    from flowpm_mtf.jobs.simulate import SimulateOptions

    conf = conf_for((2, 1), dtype="float64", order=2, n_steps=2)
    stages = timeloop.merge_stages(nbody.default_stages(conf), [JOB_SNAPSHOT_A])

    def build(mesh):
        init = lpt.lpt_init(ics.linear_field(conf, mesh), conf, conf.a_start)
        final, (snap,) = nbody.nbody(init, conf, stages=stages, snapshot_a=[JOB_SNAPSHOT_A])
        out = NH.export_state(final, conf, "n")
        out.update(NH.export_state(snap, conf, "s"))
        return out

    ref = NH.by_id(H.run("placement", conf, build))
    run_dir = tmp_path_factory.mktemp("simulate")
    summary = runner.run(jobs.get("simulate"),
                         {"config": conf, "simulate": SimulateOptions((JOB_SNAPSHOT_A,), True)},
                         H.backend("placement", conf), str(run_dir), plot=False)
    return conf, stages, run_dir, summary, {"nx": ref["nx"], "sx": ref["sx"]}


def job_positions_error(path, ref, conf):
    """Largest periodic distance [cells] between a job snapshot's positions and ``ref``."""
    import h5py
    with h5py.File(path, "r") as f:
        # particles are grouped by rank in the distributed snapshot: lattice order by id
        pos = f["position"][...][np.argsort(f["id"][...])] / np.asarray(conf.cell_size)
    d = np.abs(pos - ref % np.asarray(conf.nc))
    return np.minimum(d, np.asarray(conf.nc) - d).max()  # periodic wrap


@pytest.mark.skipif(H.SIZE != 1, reason="in-process PlacementMeshImpl; 1-rank pass only")
def test_simulation_job_equals_unrolled_nbody(simulate_job):
    """The simulate job (one lowered step fed with per-step factors): its final snapshot
    == the final state of nbody.nbody unrolled on the same stages."""
    conf, _, run_dir, _, ref = simulate_job
    err = job_positions_error(run_dir / "snapshot.h5", ref["nx"], conf)
    assert err < JOB_VS_UNROLLED_ATOL, err


@pytest.mark.skipif(H.SIZE != 1, reason="in-process PlacementMeshImpl; 1-rank pass only")
def test_simulation_job_snapshots_equal_unrolled_nbody(simulate_job):
    """`--snapshots`: the job's snapshot at a requested scale factor (made a stage of the
    time loop) == nbody.nbody's state there on the same stages; P(k) after every step."""
    conf, stages, run_dir, summary, ref = simulate_job
    assert len(summary["timings"]["steps_s"]) == stages.size - 1
    err = job_positions_error(run_dir / ("snapshot_a%.4f.h5" % JOB_SNAPSHOT_A), ref["sx"], conf)
    assert err < JOB_VS_UNROLLED_ATOL, err
    for a in stages[1:]:
        assert (run_dir / ("power_a%.4f.txt" % a)).exists()


@pytest.mark.skipif(H.SIZE != 1, reason="graph structure, one process")
@pytest.mark.parametrize("decomposition", ["eulerian", "lagrangian"])
def test_first_force_escape_check_only_where_unchecked(decomposition):
    """The job's first force (``SimulationGraph.init_force_ops``) and ``nbody.forward``'s skip
    the escape count (``FlowpmCicEscaped``) where the eulerian ICs' migration gate has
    checked every particle into its block, and keep it in the lagrangian decomposition,
    where nothing has checked them; the step has one where it has none before (lagrangian)."""
    from flowpm_mtf.physics import ics
    from flowpm_mtf.jobs import nbody_run
    from hvd_mesh_impl.training import ancestors
    with H.job_graph((1, 1), decomposition=decomposition) as (conf, impl, graph, mesh, sim):
        final, _ = nbody.forward(ics.linear_field(conf, mesh, name="forward_linear"), conf)
        lowering = mtf.Lowering(graph, {mesh: impl})
        ops = nbody_run.lower_simulation(sim, lowering)
        ops["forward"] = lowering.export_to_tf_tensor(final.positions).op

        def escapes(group):
            return [op for op in ancestors([ops[group]]) if op.type == "FlowpmCicEscaped"]

        checked = decomposition == "eulerian"
        for group in ("init_force", "step", "forward"):
            assert (len(escapes(group)) == 0) == checked, group
