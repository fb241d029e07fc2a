"""Structural test of issue 11: no rank's TF graph holds a full-size array.

The simulation graph (state variables, Gaussian ICs + LPT, one kick-drift-kick step:
everything the initial-condition and step assignments run, not the output gathers) is
lowered with HvdSimdMeshImpl on the process grids of the world size (2 or 4 ranks), and
every rank checks its own graph:

* **TF tensors** (every output of every op the assignments run, Mesh TF slices and the
  temporaries inside them): at most the rank's padded block of sites,
  ``(nx/P + 2h)(ny/Q + 2h) nz`` (particles: one per site of the unpadded block). A
  tensor's sites are the product of its axes longer than ``COMPONENT_AXIS_MAX`` (12): the
  short axes are vector components, the 8 CIC corners (2x2x2), (re, im) pairs, unit
  block axes and the <= 12 packed migration columns, and every spatial or particle axis
  is longer at this size. A 1-D tensor
  is a flattened ``[particles x 8 corners]`` CIC scatter array: its sites are
  elements / 8 (a flattened full-size 1-D field could hide there; none exists, and the
  2-D+ checks cover every field). Tensors of statically unknown shape (Horovod's
  alltoall/receive outputs, reshaped right after to checked static shapes) are skipped.
  Small tables pass by construction (1-D k tables, the step factors, scalars).
* **Variables**: every ``tf.Variable`` of the graph is a slice of the rank's share.

Both decompositions: the lagrangian one (halo 4; particles: the lattice share) and the
eulerian default (halo 2; particles: the automatic capacity of a block's buffers, see
:func:`share_bound`). A run with full-size particle buffers (``--capacity N``) must fail
the check (``test_a_full_size_particle_buffer_is_caught``).

The sizes are chosen so that a full-size field (nc^3 sites) exceeds the padded block
(ratio 1.4 on 2 ranks, 2.6 on 4), so a master copy, a gathered field or a full-size
initializer fails the test.
"""
import numpy as np
import pytest
import mesh_tensorflow as mtf
import tensorflow.compat.v1 as tf

from conftest import world

tf.disable_eager_execution()

RANK, SIZE = world()
GRIDS = {2: [(2, 1), (1, 2)], 4: [(2, 2), (4, 1)]}.get(SIZE, [])
NC, HALO = 64, 4
# Vector components, CIC corners, (re, im), unit block axes and the packed migration
# columns (position, momenta, forces, id hi/lo, validity: at most 12) are short axes.
COMPONENT_AXIS_MAX = 12
CIC_CORNERS = 8


def _sites(shape):
    """Grid sites or particles a TF tensor covers (see the module docstring)."""
    if len(shape) <= 1:
        return int(np.prod(shape)) / CIC_CORNERS
    return int(np.prod([n for n in shape if n > COMPONENT_AXIS_MAX]))


def make_conf(grid, decomposition, **kw):
    from flowpm_mtf.config import SimConfig

    d = {"nc": NC, "grid": grid, "n_steps": 2, "box_size": 200.0,
         "decomposition": decomposition}
    if decomposition == "lagrangian":
        d["halo_size"] = HALO
    d.update(kw)
    return SimConfig.from_dict(d)


def share_bound(conf):
    """(sites, variable elements) a rank may hold, from the configuration.

    Grid sites: the padded block ``(nx/P + 2w)(ny/Q + 2w) nz`` with the widest halo
    a rank fills: the CIC's ``h``, or the potential's on the real-space paths, ``h + 2``
    for the force field and 4 for the 2LPT source (``gravity.GRADIENT_REACH``,
    ``lpt_source.SOURCE_REACH``). Particles: the
    lattice share (lagrangian), or the automatic capacity of the eulerian buffers
    (:func:`flowpm_mtf.physics.sizing.capacity` of the configuration without a capacity
    override; the send buffers, ``2 send_capacity`` rows, are smaller). Variables:
    3 components per particle slot.
    """
    from flowpm_mtf.physics import sizing

    from flowpm_mtf.physics import gravity, lpt_source

    (P, Q), h = conf.grid, conf.halo_size
    h = max(h + gravity.GRADIENT_REACH, lpt_source.SOURCE_REACH)
    padded = (NC // P + 2 * h) * (NC // Q + 2 * h) * NC
    slots = sizing.capacity(conf.replace(capacity=None, send_capacity=None))
    assert 2 * sizing.send_capacity(conf.replace(capacity=None, send_capacity=None)) <= slots
    return max(padded, slots), 3 * slots


def violations(conf, bound):
    """Tensors/variables of this rank's lowered simulation graph above ``bound``."""
    from flowpm_mtf.jobs.nbody_run import SimulationGraph
    from hvd_mesh_impl import HvdSimdMeshImpl
    from hvd_mesh_impl.training import ancestors

    sites_max, var_max = bound
    assert sites_max < NC**3  # a full-size field or particle buffer would be caught
    impl = HvdSimdMeshImpl(conf.mesh_shape, conf.layout_rules)
    bad = []
    with tf.Graph().as_default():
        graph = mtf.Graph()
        mesh = mtf.Mesh(graph, "mesh")
        sim = SimulationGraph(conf, mesh)
        lowering = mtf.Lowering(graph, {mesh: impl})
        roots = [lowering.lowered_operation(op)
                 for op in sim.init_ops + sim.init_force_ops + sim.step_ops]
        for op in ancestors(roots):
            for t in op.outputs:
                if not t.shape.is_fully_defined():
                    continue
                if _sites(t.shape.as_list()) > sites_max:
                    bad.append("tf %s (%s) %s" % (t.name, op.type, t.shape.as_list()))
        for v in tf.global_variables():
            if v.shape.num_elements() > var_max:
                bad.append("variable %s %s" % (v.name, v.shape.as_list()))
    return bad


@pytest.mark.skipif(SIZE == 1, reason="on one rank the share is the whole array")
@pytest.mark.parametrize("decomposition", ["lagrangian", "eulerian"])
@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: "x".join(map(str, g)))
def test_simulation_graph_holds_only_the_ranks_share(grid, decomposition):
    conf = make_conf(grid, decomposition)
    bad = violations(conf, share_bound(conf))
    assert not bad, "rank %d holds full-size arrays:\n%s" % (RANK, "\n".join(bad[:30]))


@pytest.mark.skipif(SIZE == 1, reason="on one rank the share is the whole array")
def test_a_full_size_particle_buffer_is_caught():
    """The check can fail: eulerian buffers of N slots (--capacity N) on every rank."""
    grid = GRIDS[0]
    conf = make_conf(grid, "eulerian")
    bound = share_bound(conf)
    bad = violations(conf.replace(capacity=NC**3), bound)
    assert any(b.startswith("variable") for b in bad) and any(b.startswith("tf") for b in bad)
