"""Checks before the compute (flowpm_mtf.preflight) and graphs that scale past 2^31 cells."""
import os

import numpy as np
import pytest

from flowpm_mtf import cosmology as cosmo_mod
from flowpm_mtf import nbody, preflight
from flowpm_mtf.config import SimConfig
from flowpm_mtf.errors import ConfigError, MemoryBudgetError

pytestmark = pytest.mark.rank_independent

HERE = os.path.dirname(os.path.abspath(__file__))
GB = 2**30
# Largest serialised constant a graph may embed: O(nc) 1-d tables only (a 4096-entry
# float64 k-vector is 32 KB); anything full-size would be GBs.
MAX_CONST_BYTES = 1 << 20
# The whole GraphDef of a 4096^3 simulation stays far below the 2 GB protobuf limit.
MAX_GRAPH_BYTES = 64 << 20
# Relative agreement of the module's memory constants with the fit of the benchmark data.
FIT_RTOL = 0.02
# The fitted model against each measured peak it was fitted on (issue: within ~20 %).
MODEL_RTOL = 0.20


class FakeComm:
    """``size`` ranks on one host: allgather repeats this rank's value."""

    def __init__(self, size=1):
        self.rank, self.size = 0, size

    def allgather(self, obj):
        return [obj] * self.size


# ----------------------------------------------------------------------------- memory
def test_memory_constants_fit_the_measured_runs():
    """The constants (MODEL_FILE, written by `scripts/bench_scaling.py render`) are the fit of
    the measured peaks stored with them, and the estimate is within MODEL_RTOL of each."""
    from flowpm_bench.scripts import load_script

    bench_scaling = load_script("bench_scaling")
    model = preflight.load_memory_model()
    rows = model["rows"]
    assert len(rows) >= 3
    records = {r["name"]: dict(r, ok=True, kind="measured", peak_mb_per_rank=[r["peak_mb"]])
               for r in rows}
    fit = bench_scaling.fit_model(records)
    for key, value in (("M0_mb", preflight.RUNTIME_MB), ("bytes_per_slot", preflight.BYTES_PER_SLOT),
                       ("bytes_per_padded_cell", preflight.BYTES_PER_PADDED_CELL)):
        assert value == pytest.approx(fit[key], rel=FIT_RTOL, abs=1e-6)
    for r in rows:
        est = preflight.RUNTIME_MB + (preflight.BYTES_PER_SLOT * r["slots_local"]
                                      + preflight.BYTES_PER_PADDED_CELL
                                      * r["padded_cells_local"]) / 2**20
        assert est == pytest.approx(r["peak_mb"], rel=MODEL_RTOL), r


def test_memory_terms_are_the_rank_buffers():
    """Slots: the lattice share on one rank or lagrangian, the eulerian capacity otherwise."""
    from flowpm_mtf import sizing

    c1 = SimConfig(nc=64, grid=(1, 1))
    assert preflight.memory_terms(c1) == (64.0**3, 68.0 * 68 * 64)
    c2 = SimConfig(nc=64, grid=(2, 1))
    assert preflight.memory_terms(c2) == (sizing.capacity(c2), 36.0 * 68 * 64)
    assert 64**3 / 2 < sizing.capacity(c2) < 64**3
    cl = SimConfig(nc=64, grid=(2, 1), decomposition="lagrangian", halo_size=4)
    assert preflight.memory_terms(cl) == (64.0**3 / 2, 40.0 * 72 * 64)


def test_memory_estimate_scales_with_ranks_and_dtype():
    c1 = SimConfig(nc=256, grid=(1, 1))
    c4 = SimConfig(nc=256, grid=(2, 2))

    def work(c, **kw):
        return preflight.estimate_peak_memory(c, masters=False, **kw) - preflight.RUNTIME_MB * 2**20

    slots, cells = preflight.memory_terms(c4)
    assert work(c4) == pytest.approx(preflight.BYTES_PER_SLOT * slots
                                     + preflight.BYTES_PER_PADDED_CELL * cells)
    assert work(c1) == pytest.approx(work(c1.replace(grid=(2, 2)), n_ranks=1))
    assert work(c4) < work(c1) / 2
    c64 = SimConfig(nc=256, grid=(1, 1), dtype="float64")
    assert work(c64) == pytest.approx(2 * work(c1))
    # Placement: every block in one process.
    assert preflight.estimate_peak_memory(c4, processes=1, masters=False) == pytest.approx(
        preflight.RUNTIME_MB * 2**20 + 4 * work(c4))


def test_over_memory_refused_with_estimate_available_and_rank_count():
    conf = SimConfig(nc=512, grid=(2, 1))
    avail = 24 * GB
    with pytest.raises(MemoryBudgetError) as e:
        preflight.check_memory(conf, FakeComm(2), available=avail)
    msg = str(e.value)
    assert "12.0 GB available per rank (24.0 GB on the node for 2 ranks)" in msg
    n = int(msg.split("smallest rank count that fits at 12.0 GB per rank is ")[1].split()[0])
    best_grid = preflight._grid_fits(conf, n)
    assert preflight.estimate_peak_memory(conf, n_ranks=n) <= 12 * GB
    for m in range(1, n):  # no smaller valid rank count fits
        if preflight._grid_fits(conf, m):
            assert preflight.estimate_peak_memory(conf, n_ranks=m) > 12 * GB
    assert best_grid is not None and "--force" in msg
    # --force: only logged.
    res = preflight.check_memory(conf, FakeComm(2), available=avail, force=True)
    assert res["estimate"] > res["available_per_rank"]


def test_small_config_fits():
    res = preflight.check_memory(SimConfig(nc=32), FakeComm(1), available=4 * GB)
    assert res["estimate"] < 1 * GB and res["ranks_on_node"] == 1


def test_masters_alone_too_big():
    conf = SimConfig(nc=4096, grid=(1, 1))
    with pytest.raises(MemoryBudgetError, match="no rank count fits.*master copies alone"):
        preflight.check_memory(conf, FakeComm(1), available=64 * GB)


def test_memory_available_is_positive():
    avail = preflight.memory_available()
    assert avail is None or avail > 0


# ----------------------------------------------------------------------------- numerics
def test_a_start_below_float32_resolution_rejected():
    with pytest.raises(ConfigError, match=r"a_start=1e-10 is below what float32 resolves"):
        preflight.check_numerics(SimConfig(nc=64, a_start=1e-10))
    preflight.check_numerics(SimConfig(nc=64, a_start=1e-10, dtype="float64"))
    preflight.check_numerics(SimConfig(nc=64))


def test_suggested_a_start_is_accepted():
    conf = SimConfig(nc=64, a_start=1e-6)
    with pytest.raises(ConfigError) as e:
        preflight.check_numerics(conf)
    a_min = float(str(e.value).split("--a-start >= ")[1].split()[0])
    preflight.check_numerics(SimConfig(nc=64, a_start=a_min * 1.05))


def test_too_many_steps_for_float32_rejected():
    with pytest.raises(ConfigError, match=r"100000 steps are too many for float32.*--steps <="):
        preflight.check_numerics(SimConfig(nc=64, n_steps=100000))
    preflight.check_numerics(SimConfig(nc=64, n_steps=100000, dtype="float64"))


def test_uniform_density_criterion_is_real():
    """At a_start=1e-10 float32 rounds every initial displacement away (what the check
    prevents): q + D1 psi == q for the positions of a 64^3 mesh."""
    conf = SimConfig(nc=64, a_start=1e-10)
    d1 = cosmo_mod.growth(conf.cosmology, [conf.a_start]).D1[0]
    psi = preflight.displacement_rms_cells(conf)
    q = np.arange(1, 65, dtype=np.float32)  # lattice positions [cells]
    assert np.all(q + np.float32(3 * d1 * psi) == q)
    assert not np.all(q.astype(np.float64) + 3 * d1 * psi == q)


def test_all_step_factors_vectorised(monkeypatch):
    conf = SimConfig(dtype="float64")
    stages = nbody.default_stages(conf)
    ref = np.array([[cosmo_mod.kick_factor(conf.cosmology, a0, a0, np.sqrt(a0 * a1)),
                     cosmo_mod.drift_factor(conf.cosmology, a0, np.sqrt(a0 * a1), a1),
                     cosmo_mod.kick_factor(conf.cosmology, np.sqrt(a0 * a1), a1, a1)]
                    for a0, a1 in zip(stages[:-1], stages[1:])])
    np.testing.assert_allclose(nbody.all_step_factors(conf, stages), ref, rtol=1e-12)
    np.testing.assert_allclose(nbody.step_factors(conf, stages[0], stages[1]), ref[0],
                               rtol=1e-12)
    calls = []
    growth = cosmo_mod.growth
    monkeypatch.setattr(cosmo_mod, "growth", lambda *a, **k: calls.append(1) or growth(*a, **k))
    out = nbody.all_step_factors(conf, np.linspace(0.1, 1.0, 100001))
    assert out.shape == (100000, 3) and np.all(np.isfinite(out)) and len(calls) == 1


# ----------------------------------------------------------------------------- graph size
def _lower_simulation(nc, decomposition="lagrangian"):
    import mesh_tensorflow as mtf
    import tensorflow.compat.v1 as tf
    from mpi4py import MPI

    from flowpm_mtf.jobs import nbody_run
    from hvd_mesh_impl import HvdSimdMeshImpl

    conf = SimConfig(nc=nc, grid=(1, 1), n_steps=2, decomposition=decomposition)
    with tf.Graph().as_default() as g:
        graph = mtf.Graph()
        mesh = mtf.Mesh(graph, "mesh")
        sim = nbody_run.SimulationGraph(conf, mesh)
        impl = HvdSimdMeshImpl(conf.mesh_shape, conf.layout_rules, comm=MPI.COMM_SELF)
        lowering = mtf.Lowering(graph, {mesh: impl})
        # Every operation is lowered (density, P(k), particles in lattice order, the
        # step); only the small P(k) outputs are gathered (the backend refuses to
        # gather full-size tensors).
        outs = [lowering.export_to_tf_tensor(getattr(sim, n)) for n in ("k", "pk", "modes")]
        outs += [lowering.tensors[t].to_laid_out_tensor().tensor_list[0]
                 for t in (sim.rho, sim.variables.positions)]
        return g.as_graph_def(), outs


@pytest.mark.parametrize("nc", [2048, 4096])
def test_huge_simulation_graph_lowers_on_one_processor(nc):
    """No int32 overflow where a global count exceeds 2^31, no full-size constant."""
    gd, outs = _lower_simulation(nc)
    assert outs[3].shape.as_list() == [nc, nc, nc]  # one processor: the whole density
    assert int(np.prod(outs[4].shape.as_list())) == 3 * nc**3
    assert preflight.large_constants(gd, MAX_CONST_BYTES) == []
    assert gd.ByteSize() < MAX_GRAPH_BYTES


def test_eulerian_slot_limit_is_a_clear_error():
    """The migration's row bookkeeping is int32: a rank with 2^31 / 3 slots or more is
    refused with the remedy instead of overflowing (2048^3 on one processor)."""
    from flowpm_mtf.errors import ConfigError

    with pytest.raises(ConfigError, match="at most .* particle slots per rank.*lagrangian"):
        _lower_simulation(2048, decomposition="eulerian")


def _initializer_constants(initializer, n):
    """Shapes of the Const nodes TF actually runs when initialising a [n] variable."""
    import tensorflow.compat.v1 as tf

    with tf.Graph().as_default():
        v = tf.get_variable("momenta", [n], initializer=initializer)
        with tf.Session() as sess:
            md = tf.RunMetadata()
            sess.run(v.initializer, options=tf.RunOptions(output_partition_graphs=True),
                     run_metadata=md)
    return [[d.size for d in node.attr["value"].tensor.tensor_shape.dim]
            for g in md.partition_graphs for node in g.node if node.op == "Const"]


def test_variable_initializer_is_not_folded_into_a_full_size_constant():
    import tensorflow.compat.v1 as tf

    # Above Grappler's 10 MB limit for materialising computed constants; a zeros
    # Fill is folded (as a compressed splat) at any size.
    n = 4 * 2**20
    assert [n] in _initializer_constants(tf.zeros_initializer(), n)  # what Grappler does
    assert [n] not in _initializer_constants(preflight.unfolded_zeros_initializer(), n)
