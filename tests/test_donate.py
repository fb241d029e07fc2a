"""A variable's buffer handed to the op that writes its next value (flowpm_mtf/mesh/donate.py,
``FlowpmTakeVariable`` in flowpm_mtf/native/variable_ops.cc, the donors of
``FlowpmLatticeCombinePotentials``), and the job's ICs that use it."""
import mesh_tensorflow as mtf
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import fpm_harness as H
from flowpm_mtf.physics import lpt
from flowpm_mtf import native

needs_native = pytest.mark.skipif(
    native.mode() != "require" and (native.load("variable_ops") is None
                                    or native.load("lpt_ops") is None),
    reason="native ops not built (python -m flowpm_mtf.native.build)")
single = pytest.mark.skipif(H.SIZE != 1, reason="a single-process TensorFlow test")


@needs_native
@single
def test_take_variable():
    """The take returns the variable's value and leaves it uninitialised (a read raises
    FailedPrecondition) until the next assignment; a second take of it raises too; a dtype
    or shape other than the variable's, one clear error each."""
    lib = native.load("variable_ops")
    value = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    with tf.Graph().as_default(), tf.Session() as sess:
        v = tf.get_variable("v", initializer=tf.constant(value), use_resource=True)
        took = lib.flowpm_take_variable(v.handle, dtype=tf.float32, shape=[2, 3, 4])
        assert took.shape.as_list() == [2, 3, 4]
        read = v.read_value()
        put = v.assign(tf.constant(value + 1.0), read_value=False)
        sess.run(v.initializer)
        np.testing.assert_array_equal(sess.run(took), value)
        with pytest.raises(tf.errors.FailedPreconditionError, match="Could not find variable"):
            sess.run(read)
        with pytest.raises(tf.errors.FailedPreconditionError, match="is not initialised"):
            sess.run(took)
        sess.run(put)
        np.testing.assert_array_equal(sess.run(read), value + 1.0)
        for kw, message in (({"dtype": tf.float64, "shape": [2, 3, 4]}, "holds float, not double"),
                            ({"dtype": tf.float32, "shape": [2, 3, 5]}, "has the shape")):
            with pytest.raises(tf.errors.InvalidArgumentError, match=message):
                sess.run(lib.flowpm_take_variable(v.handle, **kw))
        np.testing.assert_array_equal(sess.run(read), value + 1.0)   # refused: still there


def _combine_inputs(rng, dtype):
    block, tile, margins = (2, 8, 4, 12), [8, 4, 4], [4, 2]
    b, sx, sy, nz = block
    phis = [rng.randn(b, sx + 2 * m, sy + 2 * m, nz).astype(dtype) for m in margins]
    coeffs = np.array([[0.9, -0.3], [1.7, 0.4]], dtype)
    return phis, coeffs, tile, margins, sx * sy * nz


@needs_native
@single
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_combine_capacity_and_donors(dtype):
    """``FlowpmLatticeCombinePotentials`` with a capacity: the outputs without it, then zero
    slots (as ``domain.pad_particles``), also in its TensorFlow twin. With donors: an output
    whose donor nothing else holds is written into the donor's buffer (the trace's addresses),
    a held donor (also fetched) is neither taken nor changed, and a donor of another size
    is not taken; the values are the same bits in every case. The gradient ignores the
    zero slots (to rounding against the twin's TensorFlow gradient)."""
    lib = native.load("lpt_ops")
    rng = np.random.RandomState(3)
    phis, coeffs, tile, margins, cells = _combine_inputs(rng, dtype)
    cap = cells + 40
    g = np.array([0.21, -1.3, 0.6], dtype)
    gifts = [rng.randn(2, cap, 3).astype(dtype) for _ in range(2)]
    with tf.Graph().as_default(), tf.device("/cpu:0"):
        xs = [tf.constant(p) for p in phis]
        kw = dict(tile=tile, margins=margins, M=2, lattice_output=0)
        plain = lib.flowpm_lattice_combine_potentials(xs, g, coeffs, [], **kw)
        padded = lib.flowpm_lattice_combine_potentials(xs, g, coeffs, [], capacity=cap, **kw)
        feeds = {tf.placeholder(dtype, d.shape): d for d in gifts + gifts}
        free0, free1, held0, held1 = (t * 1 for t in feeds)     # computed: four buffers
        donated = lib.flowpm_lattice_combine_potentials(xs, g, coeffs, [free0, free1],
                                                        capacity=cap, **kw)
        kept = lib.flowpm_lattice_combine_potentials(xs, g, coeffs, [held0, held1],
                                                     capacity=cap, **kw)
        small = tf.placeholder(dtype, [2, cells, 3])
        small_c = small * 1                                        # free, of another size
        other = lib.flowpm_lattice_combine_potentials(xs, g, coeffs, [small_c],
                                                      capacity=cap, **kw)
        twin = [tf.pad(o, [[0, 0], [0, cap - cells], [0, 0]]) for o in
                lpt.lattice_combine_potentials_tf(xs, tf.constant(g), tf.constant(coeffs),
                                                  tile, margins, 0)]
        ys = [tf.constant(rng.randn(2, cap, 3).astype(dtype)) for _ in range(2)]
        g_native = tf.gradients(padded, xs, grad_ys=ys)
        g_twin = tf.gradients(twin, xs, grad_ys=ys)
        feeds[small] = np.zeros((2, cells, 3), dtype)
        fetch = {"plain": plain, "padded": padded, "donated": donated, "kept": kept,
                 "other": other, "twin": twin, "held": [held0, held1], "gn": g_native,
                 "gt": g_twin}
        with tf.Session(config=tf.ConfigProto(intra_op_parallelism_threads=2,
                                              inter_op_parallelism_threads=1)) as sess:
            vals, ptr = H.traced_buffers(sess, fetch, feeds)
        names = {k: fetch[k][0].op.name for k in ("donated", "kept", "other")}
    for k, (free, held) in enumerate(((free0, held0), (free1, held1))):
        assert ptr[names["donated"]][k] == ptr[free.op.name][0] != 0
        assert ptr[names["kept"]][k] != ptr[held.op.name][0]
    assert ptr[names["other"]][0] not in (0, ptr[small_c.op.name][0])
    for k in range(2):
        assert vals["padded"][k].shape == (2, cap, 3)
        np.testing.assert_array_equal(vals["padded"][k][:, :cells], vals["plain"][k])
        assert not np.any(vals["padded"][k][:, cells:])
        for key in ("donated", "kept", "other", "twin"):
            np.testing.assert_array_equal(vals[key][k], vals["padded"][k])
        np.testing.assert_array_equal(vals["held"][k], gifts[k])
    eps = 1e-6 if dtype == np.float32 else 1e-14
    for a, b in zip(vals["gn"], vals["gt"]):
        assert np.max(np.abs(b)) > 0.1
        np.testing.assert_allclose(a, b, rtol=0, atol=eps * 10 * np.max(np.abs(b)))


@needs_native
@single
def test_combine_donor_and_capacity_errors():
    """More donors than outputs, a capacity under the block's sites: one clear error each."""
    lib = native.load("lpt_ops")
    phis, coeffs, tile, margins, cells = _combine_inputs(np.random.RandomState(1), np.float32)
    g = np.ones(3, np.float32)
    kw = dict(tile=tile, margins=margins, M=2, lattice_output=0)
    d = np.zeros((2, cells, 3), np.float32)
    cases = [(lambda: lib.flowpm_lattice_combine_potentials(phis, g, coeffs, [d, d, d], **kw),
              "3 donors for 2 outputs"),
             (lambda: lib.flowpm_lattice_combine_potentials(phis, g, coeffs, [],
                                                            capacity=cells - 1, **kw),
              "below the %d lattice sites" % cells)]
    for make, message in cases:
        with tf.Graph().as_default(), tf.Session() as sess:
            with pytest.raises(tf.errors.InvalidArgumentError, match=message):
                sess.run(make())


@pytest.mark.parametrize("grid", H.HVD_GRIDS.get(H.SIZE, []), ids=lambda g: "%dx%d" % g)
def test_job_ics_write_into_the_variables(grid):
    """The job's ICs (``SimulationGraph``, hvd backend, 1, 2 and 4 ranks) write the positions
    and momenta into the buffers the variables held (on one block, where no migration
    moves them: the traced addresses of the take and of the state assigned), and give the
    state of the same ICs without donors, bit for bit. The ICs run twice (the second take
    finds the variables initialised by the first run's assignments) to the same state."""
    from flowpm_mtf.physics import ics, nbody
    from flowpm_mtf.jobs import runner
    from hvd_mesh_impl.training import ancestors
    with H.job_graph(grid) as (conf, impl, graph, mesh, sim):
        # the same ICs without donors (the linear field is the seed's, the same values)
        ref = lpt.lpt_init(ics.linear_field(conf, mesh, name="ref_linear"), conf,
                           a=sim.stages[0], forces=False,
                           kernels=nbody.make_kernels(conf, mesh))
        lowering = mtf.Lowering(graph, {mesh: impl})
        init = runner.lowered_group(lowering, sim.init_ops)
        state = [lowering.export_to_tf_tensor(t) for t in sim.variables[:2]]
        want = [lowering.export_to_tf_tensor(t) for t in (ref.positions, ref.momenta)]
        takes = [op for op in ancestors([init]) if op.type == "FlowpmTakeVariable"]
        combine = [op for op in ancestors([init])
                   if op.type == "FlowpmLatticeCombinePotentials"]
        assert len(takes) == 2 and len(combine) == 1
        with tf.Session(config=H.session_config("hvd", conf)) as sess:
            runner.initialize_variables(sess)
            _, ptr = H.traced_buffers(sess, init)
            got = sess.run(state)
            sess.run(init)
            again, ref_vals = sess.run([state, want])
    took = {("momenta" if "momenta" in op.name else "positions"): ptr[op.name][0]
            for op in takes}
    assert len(set(took.values())) == 2 and 0 not in took.values()
    out = ptr[combine[0].name]
    assert (out[0], out[1]) == (took["positions"], took["momenta"])
    for g, a, w in zip(got, again, ref_vals):
        assert np.max(np.abs(w)) > 0.01
        np.testing.assert_array_equal(g, w)
        np.testing.assert_array_equal(a, w)


@pytest.mark.parametrize("grid", H.HVD_GRIDS.get(H.SIZE, []), ids=lambda g: "%dx%d" % g)
def test_job_step_updates_in_place(grid):
    """The job's step (hvd backend, 1, 2 and 4 ranks) takes the positions, momenta and forces
    out of their variables and gives the state of the same step computed from the
    variables' values (a ``kdk_step`` of the snapshot reads, no take) bit for bit, two steps
    in a row. On one block the new positions and momenta are assigned in the buffers the
    variables held (traced addresses): the step makes no second copy of them."""
    from flowpm_mtf.physics import nbody
    from flowpm_mtf.jobs import nbody_run, runner
    from hvd_mesh_impl.training import ancestors
    with H.job_graph(grid) as (conf, impl, graph, mesh, sim):
        fac = mtf.import_tf_tensor(mesh, sim.factors, mtf.Shape([mtf.Dimension("factor", 3)]))
        ref = nbody.kdk_step(sim.variables, conf, kernels=nbody.make_kernels(conf, mesh),
                             factors=mtf.unstack(fac, fac.shape.dims[0]))
        lowering = mtf.Lowering(graph, {mesh: impl})
        ops = nbody_run.lower_simulation(sim, lowering)
        state = [lowering.export_to_tf_tensor(t) for t in sim.variables[:3]]
        want = [lowering.export_to_tf_tensor(t) for t in ref[:3]]
        step_ops = ancestors([ops["step"]])
        takes = {op.name: op for op in step_ops if op.type == "FlowpmTakeVariable"}
        assert len(takes) == 3
        assigned = {}
        for op in step_ops:
            if op.type == "AssignVariableOp":
                for n in ("positions", "momenta"):
                    if op.inputs[0].op.name.startswith(n + "_slice"):
                        assigned[n] = op.inputs[1]
        with tf.Session(config=H.session_config("hvd", conf)) as sess:
            runner.initialize_variables(sess)
            nbody_run.run_init(sess, ops["init"], ops["init_force"])
            for i in range(2):
                feed = {sim.factors: sim.step_factors[i]}
                expect = sess.run(want, feed)
                _, ptr = H.traced_buffers(sess, ops["step"], feed)
                got = sess.run(state)
                for g, w in zip(got, expect):
                    assert np.max(np.abs(w)) > 0.01
                    np.testing.assert_array_equal(g, w)
                if conf.n_ranks == 1:
                    for n, t in assigned.items():
                        took = [ptr[k][0] for k in takes if "step_take_" + n in k]
                        assert took and ptr[t.op.name][t.value_index] == took[0] != 0, n


@needs_native
@single
def test_readout_into_donor():
    """``FlowpmCicReadoutInto`` gives ``FlowpmCicReadout``'s values bit for bit, written into a
    donor nothing else holds (the traced addresses), not into a held one (left unchanged);
    its gradient is the readout's (none for the donor); a donor of another shape is
    refused with one clear error."""
    lib = native.load("cic_ops")
    rng = np.random.RandomState(4)
    b, px, py, nz, c, n, halo = 2, 8, 8, 6, 3, 50, 1
    field = rng.randn(b, px, py, nz, c).astype(np.float32)
    pos = (rng.rand(b, n, 3) * [px - 2 * halo - 1, py - 2 * halo - 1, nz]).astype(np.float32)
    gift = rng.randn(b, n, c).astype(np.float32)
    with tf.Graph().as_default(), tf.device("/cpu:0"):
        f, p = tf.constant(field), tf.constant(pos)
        ph = tf.placeholder(tf.float32, gift.shape)
        free, held = ph * 1, ph * 2
        plain = lib.flowpm_cic_readout(f, p, halo=halo)
        into = lib.flowpm_cic_readout_into(f, p, free, halo=halo)
        kept = lib.flowpm_cic_readout_into(f, p, held, halo=halo)
        dy = tf.constant(rng.randn(b, n, c).astype(np.float32))
        g_plain = tf.gradients(plain, [f, p], grad_ys=dy)
        g_into = tf.gradients(into, [f, p, free], grad_ys=dy)
        fetch = {"plain": plain, "into": into, "kept": kept, "held": held,
                 "gp": g_plain, "gi": g_into[:2]}
        with tf.Session() as sess:
            vals, ptr = H.traced_buffers(sess, fetch, {ph: gift})
            with pytest.raises(tf.errors.InvalidArgumentError, match="the donor must be"):
                sess.run(lib.flowpm_cic_readout_into(f, p, ph[:, :-1], halo=halo), {ph: gift})
    assert g_into[2] is None
    assert ptr[into.op.name][0] == ptr[free.op.name][0] != 0
    assert ptr[kept.op.name][0] != ptr[held.op.name][0]
    assert np.max(np.abs(vals["plain"])) > 0.1
    for key in ("into", "kept"):
        np.testing.assert_array_equal(vals[key], vals["plain"])
    np.testing.assert_array_equal(vals["held"], 2 * gift)
    for a, w in zip(vals["gi"], vals["gp"]):
        np.testing.assert_array_equal(a, w)


@pytest.mark.parametrize("grid", H.HVD_GRIDS.get(H.SIZE, []), ids=lambda g: "%dx%d" % g)
def test_job_first_force_into_the_forces_variable(grid):
    """The job's first force (hvd backend, 1, 2 and 4 ranks) is the PM force of the ICs'
    positions computed without a donor, bit for bit, and on one block it is read out into
    the buffer the forces variable held (its zeros, taken): no fresh output."""
    from flowpm_mtf.physics import nbody, timeloop
    from flowpm_mtf.jobs import nbody_run, runner
    from hvd_mesh_impl.training import ancestors
    with H.job_graph(grid) as (conf, impl, graph, mesh, sim):
        ref = timeloop.initial_state(sim.variables._replace(forces=None), conf,
                                     nbody.make_kernels(conf, mesh), escape_checked=True)
        lowering = mtf.Lowering(graph, {mesh: impl})
        ops = nbody_run.lower_simulation(sim, lowering)
        got_t = lowering.export_to_tf_tensor(sim.variables.forces)
        want_t = lowering.export_to_tf_tensor(ref.forces)
        force_ops = ancestors([ops["init_force"]])
        takes = [op for op in force_ops if op.type == "FlowpmTakeVariable"]
        reads = [op for op in force_ops if op.type == "FlowpmCicReadoutInto"]
        assert len(takes) == 1 and "take_forces" in takes[0].name and len(reads) == 1
        with tf.Session(config=H.session_config("hvd", conf)) as sess:
            runner.initialize_variables(sess)
            sess.run(ops["init"])
            want = sess.run(want_t)
            _, ptr = H.traced_buffers(sess, ops["init_force"])
            got = sess.run(got_t)
    assert np.max(np.abs(want)) > 1e-3
    np.testing.assert_array_equal(got, want)
    if conf.n_ranks == 1:
        assert ptr[reads[0].name][0] == ptr[takes[0].name][0] != 0
