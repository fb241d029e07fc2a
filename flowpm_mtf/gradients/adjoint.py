r"""Adjoint of the N-body time loop: gradients with memory independent of the step count.

:func:`flowpm_mtf.physics.nbody.nbody` differentiated with ``mtf.gradients`` keeps every
step's activations (~27 MB per rank per step at 64^3). Here the forward pass
keeps only the current state, and the backward pass integrates the
kick-drift-kick steps **in reverse** (leapfrog is time-reversible), re-creating
each step's state while it propagates the cotangents, as the FastPM/pmwd
adjoints do. One lowered forward step and one lowered reverse step serve every
step: their time-integration factors are fed through placeholders, and the state and its
cotangents live in Mesh TF variables (the state, the forward step and its loop are
:class:`flowpm_mtf.physics.stepper.Stepper`'s, as in
:class:`flowpm_mtf.jobs.nbody_run.SimulationGraph`).

The maths
---------
State at stage :math:`j`: :math:`(x_j, p_j, f_j)`, :math:`f_j = F(x_j)` the PM
force (:func:`flowpm_mtf.physics.gravity.pm_forces`). Step :math:`i` (stage :math:`i
\to i + 1`, factors :math:`K0_i, D_i, K1_i` of :func:`flowpm_mtf.physics.nbody.all_step_factors`)::

    forward:  p_h = p_i + K0_i f_i;     x_{i+1} = x_i + D_i p_h;  [migrate]
              f_{i+1} = F(x_{i+1});     p_{i+1} = p_h + K1_i f_{i+1}
    reverse:  p_h = p_{i+1} - K1_i f_{i+1};  x_i = x_{i+1} - D_i p_h;  [migrate]
              f_i = F(x_i);             p_i = p_h - K0_i f_i

The loss :math:`L` depends on the final :math:`(x_N, p_N)`; as
:func:`flowpm_mtf.physics.timeloop.initial_state`, the first force is recomputed from
the positions, :math:`f_0 = F(x_0)`, so the result is the gradient with respect
to :math:`(x_0, p_0)` only. The loop carries, at stage :math:`j`, the total
cotangents :math:`(\bar x_j, \bar p_j)` of the state **including** every use of
:math:`f_j = F(x_j)` (the second kick of step :math:`j - 1` and the first kick
of step :math:`j`). The force :math:`f_j` enters both kicks with the cotangent
of the half-step momentum, and :math:`\bar p_j = \bar p_h^{(j)}` (the kick is
the identity in :math:`p`), so its total cotangent is

.. math::

    \bar f_j = (K1_{j-1} + K0_j)\, \bar p_j, \qquad K1_{-1} = K0_N = 0,

and one force VJP per stage suffices. Reverse step :math:`i` (from the
carried :math:`\bar x_{i+1}, \bar p_{i+1}`)::

    pb_h    = pb_{i+1} + D_i xb_{i+1}          (x_{i+1} = x_i + D_i p_h)
    pb_i    = pb_h                              (p_h = p_i + K0_i f_i)
    xb_i    = xb_{i+1} + J_F(x_i)^T [(K0_i + K1_{i-1}) pb_h]

with :math:`F(x_i)` and :math:`J_F(x_i)^T` computed together in the graph that
re-creates :math:`x_i` (:func:`flowpm_mtf.physics.gravity.pm_forces_vjp`: one readout
of the force field for the force and its VJP, and the density's cotangent by a
real-space divergence and one FFT round trip,
:func:`flowpm_mtf.physics.gravity.density_cotangent`; ``mtf.gradients`` of
:func:`~flowpm_mtf.physics.gravity.pm_forces` with ``native_op=False``). The cotangent of the final force,
:math:`K1_{N-1} \bar p_N`, is folded into :math:`\bar x_N` first by the same
lowered reverse step fed with the factors ``(0, 0, 0, K1_{N-1})`` (no kick, no
drift: the state is unchanged and only the VJP at :math:`x_N` is added). So a
run of :math:`N` steps costs :math:`N` forward forces, :math:`N + 1` reverse
forces and :math:`N + 1` force VJPs, with the memory of one step.

Migration (eulerian decomposition)
----------------------------------
After the reverse drift the particles go back to the blocks that contain them
(:func:`flowpm_mtf.mesh.domain.migrate`, same capacities and checks as the forward
migration) and their half-step momenta, :math:`\bar x` and :math:`\bar p_h`
travel with them as extra fields; the ids follow, so every cotangent stays
attached to its particle. The slot order after the reverse loop is not the
one of the forward initial state: match by ``ids``.

Accuracy (measured, 16^3 particles, 64 Mpc/h, 2LPT at a = 0.1, 5 steps to a = 1)
------------------------------------------------------------------------------
Against ``mtf.gradients`` through the unrolled :func:`flowpm_mtf.physics.nbody.nbody`
(max abs difference / max abs of the reference, per particle by id; see
``tests/test_adjoint.py``):

* float64: 2e-15 .. 4e-15 for :math:`\bar x_0`, 5e-16 .. 1e-15 for
  :math:`\bar p_0` (both decompositions, grids 1x1, 2x1, 1x2): round-off of
  the reverse integration, which re-creates the initial positions to 2e-14
  cells and momenta to 5e-14 relative;
* float32 (against the float64 reference): 2.2e-6 (eulerian) and 2.7e-6
  (lagrangian), the level of the float32 stored-graph gradient itself
  (2.3e-6 / 2.4e-6 against the same reference); the reverse integration
  re-creates the initial positions to 1.2e-5 cells and momenta to 3e-5
  relative. The error grows with the number of steps (not measured beyond 5).

A wrong kick index in the force cotangent (``K1_i`` for ``K1_{i-1}``) gives
0.17, omitting the final force's cotangent 1.5e-3.

Use
---
::

    adj = AdjointGraph(conf, mesh, stages, initial_state=lpt_state, loss_fn=loss)
    ...                                   # lower the mtf graph
    ops = lower_adjoint(adj, lowering)
    with session as sess:                 # variables initialised, masters copied
        run_gradient(sess, adj, ops)      # ICs, forward, loss cotangent, reverse
        # adj.cotangents hold dL/dx_0, dL/dp_0 per slot, adj.variables the
        # re-created state at stages[0] (ids: adj.variables.ids)
"""
import logging
from typing import NamedTuple

import mesh_tensorflow as mtf
import numpy as np
import tensorflow.compat.v1 as tf

from ..mesh import domain, slots
from .. import layout
from ..physics import nbody, sizing, timeloop
from . import reverse_kdk
from ..physics.gravity import pm_forces, pm_forces_vjp
from ..physics.kernels import make_kernels
from ..logs import rank0_only
from ..physics.lpt import State
from ..physics.stepper import Stepper, fed_factors, zeros_variable

__all__ = ["AdjointGraph", "Cotangents", "SUMS", "reverse_factors", "reverse_step", "lower_adjoint",
           "run_forward", "run_reverse", "run_gradient"]

log = rank0_only(logging.getLogger(__name__))  # progress: every rank would repeat it


class Cotangents(NamedTuple):
    """Cotangents of a state's positions and momenta, ``[bx, by, npart, xyz]``
    [loss units / cells], in the slots (and with the ids) of that state."""

    positions: mtf.Tensor
    momenta: mtf.Tensor


def reverse_factors(conf, stages):
    """The fed factors of every run of the reverse step, in the order they run.

    Parameters
    ----------
    conf : SimConfig
    stages : array_like
        Increasing scale factors [dimensionless].

    Returns
    -------
    list of numpy.ndarray
        ``n_steps + 1`` rows ``[K0, D, K1, K1_prev]`` (dtype ``conf.dtype``):
        first ``[0, 0, 0, K1_{N-1}]`` (folds the final force's cotangent into
        the positions' at the last stage, state unchanged), then for step
        ``i = N-1 .. 0`` ``[K0_i, D_i, K1_i, K1_{i-1}]`` with ``K1_{-1} = 0``.
    """
    stages = timeloop.check_stages(stages)
    dt = conf.np_dtype
    if stages.size < 2:
        return [np.zeros(4, dt)]
    fac = nbody.all_step_factors(conf, stages)
    n = fac.shape[0]
    rows = [np.array([0.0, 0.0, 0.0, fac[n - 1, 2]], dt)]
    for i in range(n - 1, -1, -1):
        prev = fac[i - 1, 2] if i > 0 else 0.0
        rows.append(np.array([fac[i, 0], fac[i, 1], fac[i, 2], prev], dt))
    return rows


def reverse_step(state, cot, conf, factors, kernels=None, name="reverse", native_op=True,
                 send_rows=None):
    r"""One reverse kick-drift-kick step with the cotangent propagation (graph of one step).

    Parameters
    ----------
    state : lpt.State
        Positions, momenta and forces at stage ``i + 1`` [cells], with ids.
    cot : Cotangents
        Total cotangents ``(xb, pb)`` at stage ``i + 1`` (including every use
        of the force there; see the module docstring) [loss units / cells].
    conf : SimConfig
    factors : sequence of 4 scalars
        ``K0_i, D_i, K1_i, K1_{i-1}`` (floats or scalar mtf tensors; a row of
        :func:`reverse_factors`).
    kernels : optional
        From :func:`flowpm_mtf.physics.kernels.make_kernels`.
    name : str
    native_op : bool
        Fuse the particle arithmetic into the native ops of
        :mod:`flowpm_mtf.gradients.reverse_kdk` where they serve, and take the force with
        its VJP in one readout (:func:`flowpm_mtf.physics.gravity.pm_forces_vjp`);
        False: Mesh TF expressions and ``mtf.gradients`` of the force (the
        reference).
    send_rows : int, optional
        Rows of the migration's send buffers [particles] (eulerian): those of the
        forward step (:func:`flowpm_mtf.physics.sizing.send_capacity` of the run's
        stages); default: of :func:`flowpm_mtf.config.default_stages`.

    Returns
    -------
    state : lpt.State
        At stage ``i`` (positions migrated, force ``F(x_i)``); ``stats`` holds
        the migration's statistics (eulerian) or None.
    cot : Cotangents
        Total cotangents at stage ``i`` (the force VJP at ``x_i`` included).
    sums : mtf.Tensor
        ``[adjoint_sum(4)]``, replicated: scalars (summed over the valid
        particles of every block, with **one** allreduce for the four) from
        which the gradient with respect to the step's factors and the force's
        :math:`\tfrac32\Omega_m` follows (:data:`SUMS`):
        :math:`\sum \bar p_{i+1} \cdot f_{i+1} = \partial L/\partial K1_i`,
        :math:`\sum \bar x_{i+1} \cdot p_h = \partial L/\partial D_i`,
        :math:`\sum \bar p_h \cdot f_i = \partial L/\partial K0_i` and
        :math:`\sum \bar f_i \cdot f_i`, the cotangent of the force's
        prefactor times the prefactor.
    """
    if len(factors) != 4:
        raise ValueError("reverse_step: factors must be (K0, D, K1, K1_prev), got %d values"
                         % len(factors))
    if kernels is None:
        kernels = make_kernels(conf, state.positions.mesh)
    k0, drift, k1, k1_prev = factors
    x, p, f, ids = state.positions, state.momenta, state.forces, state.ids
    xb, pb = cot
    # the slots' weights (empty slots: 0) come from the ids in the fused ops
    wids = ids if conf.decomposition == "eulerian" else None
    x, dx, p_h, pb_h, dots_in = reverse_kdk.reverse_drift(x, p, f, xb, pb, wids, k1, drift,
                                                          native_op=native_op,
                                                          name=name + "_drift")
    stats = None
    if conf.decomposition == "eulerian":
        if ids is None:
            raise ValueError("reverse_step: the eulerian decomposition needs particle ids")
        if send_rows is None:
            send_rows = sizing.send_capacity(conf)
        x, (p_h, xb, pb_h), ids, stats = domain.migrate(conf, x, [p_h, xb, pb_h], ids,
                                                        send_rows=send_rows, displacement=dx,
                                                        name=name + "_migrate")
        wids = ids
    # the force's cotangent is fb = (K0_i + K1_{i-1}) pb_h; the VJP is linear in it, so
    # it is taken for pb_h and scaled in the kick (no separate product over the particles)
    c = k0 + k1_prev
    weight, checked = slots.weights(ids, conf), stats is not None
    if native_op:  # the force and its VJP with one readout (gravity.pm_forces_vjp)
        f, vjp = pm_forces_vjp(x, pb_h, conf, kernels, weight, escape_checked=checked,
                               name=name + "_force_vjp")
    else:          # the reference: mtf.gradients of the force
        f = pm_forces(x, conf, kernels, weight, escape_checked=checked)
        vjp = mtf.gradients([f], [x], grad_ys=[pb_h])[0]
        if vjp is None:
            vjp = mtf.zeros(x.mesh, x.shape, x.dtype)
    p, xb, dots_out = reverse_kdk.reverse_kick(p_h, f, pb_h, vjp, xb, wids, k0, c,
                                               native_op=native_op, name=name + "_kick")
    # the blocks' partial sums of the four, in one tensor: one collective for all of them
    # (on the process grid a reduction costs its latency, not its 4 numbers)
    sums = mtf.reduce_sum(mtf.concat([dots_in, dots_out], SUM_DIM),
                          output_shape=mtf.Shape([mtf.Dimension(SUM_DIM, len(SUMS))]),
                          name=name + "_sums")
    return State(x, p, f, ids, stats), Cotangents(xb, pb_h), sums


SUMS = ("K1", "drift", "K0", "force")
"""The scalars of :func:`reverse_step` (``sums``), in order."""


SUM_DIM = reverse_kdk.DOT_DIM
"""The dimension of :func:`reverse_step`'s ``sums``."""


def _particle_shape(conf):
    """``[bx, by, npart, xyz]`` with :func:`flowpm_mtf.physics.sizing.capacity` slots (eulerian)."""
    bx, by, npart = layout.particle_dims(conf)
    if conf.decomposition == "eulerian":
        npart = mtf.Dimension(npart.name, sizing.capacity(conf))
    return mtf.Shape([bx, by, npart, mtf.Dimension(layout.XYZ, 3)])


class AdjointGraph:
    """The mtf graph of the adjoint time loop: variables, forward and reverse steps.

    Parameters
    ----------
    conf : SimConfig
    mesh : mtf.Mesh
    stages : sequence of float, optional
        Scale factors of the N-body stages (default
        :func:`flowpm_mtf.config.default_stages`).
    initial_state : lpt.State, optional
        Positions, momenta and ids at ``stages[0]`` (e.g. from
        :func:`flowpm_mtf.physics.lpt.lpt_init` with ``forces=False``); ``init_ops``
        assign them with the PM force recomputed there
        (:func:`flowpm_mtf.physics.timeloop.initial_state`). Without it the caller
        assigns ``variables`` itself (e.g. a final state from a checkpoint).
    loss_fn : callable, optional
        ``loss_fn(state) -> scalar mtf.Tensor`` of the final state (an
        ``lpt.State`` of the variables); ``loss_ops`` assign its gradient with
        respect to the positions and momenta to ``cotangents`` (a graph of
        the size of the loss, not of the run). Without it the caller assigns
        ``cotangents`` itself.
    kernels : optional
        From :func:`flowpm_mtf.physics.kernels.make_kernels` (built here if None).

    Attributes
    ----------
    stepper : flowpm_mtf.physics.stepper.Stepper
        The state variables, the fed factors and the forward step (its run:
        :func:`run_forward`).
    variables : lpt.State
        Positions, momenta, forces [cells] and ids as mtf variables.
    cotangents : Cotangents
        mtf variables ``xb, pb`` [loss / cells]: the loss cotangent at the
        final stage, then, after the reverse loop, ``dL/dx_0`` and ``dL/dp_0``.
    init_ops, loss_ops, step_ops, reverse_ops : list of mtf.Operation
        Assignments: the initial state; the loss cotangent; one forward step
        fed with ``step_factors[i]`` through ``factors``; one reverse step fed
        with ``reverse_factors[k]`` through ``reverse_factors_ph``.
    loss : mtf.Tensor or None
        The loss of the current state (from ``loss_fn``).
    step_stats, reverse_stats : mtf.Tensor or None
        Migration statistics of the forward and reverse steps
        (:data:`flowpm_mtf.mesh.domain.STATS`; eulerian only).
    reverse_sums : mtf.Tensor
        ``[adjoint_sum]`` (:data:`SUMS`): the reverse step's scalars for the
        gradient with respect to the time-integration factors and the force
        prefactor (:func:`reverse_step`).
    """

    def __init__(self, conf, mesh, stages=None, initial_state=None, loss_fn=None, kernels=None):
        self.conf = conf
        kernels = make_kernels(conf, mesh) if kernels is None else kernels
        shape = (_particle_shape(conf) if initial_state is None
                 else initial_state.positions.shape)
        # the state's variables, its fed factors and its one forward step: the stepper's (as
        # SimulationGraph's; the migration's send buffers sized for the longest of these
        # stages' steps, both ways)
        self.stepper = st = Stepper(conf, mesh, stages, shape, prefix="adjoint_")
        self.stages, self.send_rows = st.stages, st.send_rows
        self.variables = st.add_ids(mtf.Shape(shape.dims[:3]), slots.id_dtype(conf))
        dt = conf.tf_dtype
        self.cotangents = Cotangents(*[zeros_variable(mesh, "adjoint_" + n, shape, dt)
                                       for n in ("xbar", "pbar")])
        self.init_ops = []
        if initial_state is not None:
            init = timeloop.initial_state(initial_state, conf, kernels)
            self.init_ops = [mtf.assign(v, t) for v, t in zip(self.variables[:4], init[:4])]
        self.loss, self.loss_ops = None, []
        if loss_fn is not None:
            self.loss = loss_fn(self.variables)
            grads = mtf.gradients([self.loss], list(self.variables[:2]))
            # empty slots (eulerian) carry no particle: their cotangents are zero whatever
            # the loss does with them
            valid = slots.weights(self.variables.ids, conf)
            grads = [mtf.zeros(mesh, shape, dt) if g is None else g if valid is None
                     else g * valid for g in grads]
            self.loss_ops = [mtf.assign(v, g) for v, g in zip(self.cotangents, grads)]
        # forward: one step for all steps, factors fed
        self.step_ops = st.build_step(kernels)
        self.factors, self.step_factors, self.step_stats = (st.factors, st.step_factors,
                                                            st.step_stats)
        # reverse: one step for all steps
        self.reverse_factors_ph, rfac = fed_factors(mesh, dt, 4, "adjoint_reverse_factors")
        back, cot, self.reverse_sums = reverse_step(self.variables, self.cotangents, conf, rfac,
                                                    kernels, send_rows=self.send_rows)
        self.reverse_ops = ([mtf.assign(v, t) for v, t in zip(self.variables[:4], back[:4])]
                            + [mtf.assign(v, t) for v, t in zip(self.cotangents, cot)])
        self.reverse_stats = back.stats
        self.reverse_factors = reverse_factors(conf, self.stages)

    def assign_initial_state(self, state, kernels=None):
        """Assignments of the variables from another initial state (e.g. a truth's ICs).

        Parameters
        ----------
        state : lpt.State
            Positions, momenta and ids at ``stages[0]`` in the variables' slot shape;
            the PM force is recomputed there (:func:`flowpm_mtf.physics.timeloop.initial_state`).
        kernels : optional
            From :func:`flowpm_mtf.physics.kernels.make_kernels` (built here if None).

        Returns
        -------
        list of mtf.Operation
        """
        if state.positions.shape != self.variables.positions.shape:
            raise ValueError("assign_initial_state: positions of shape %s, the variables have %s"
                             % (state.positions.shape, self.variables.positions.shape))
        kernels = make_kernels(self.conf, state.positions.mesh) if kernels is None else kernels
        init = timeloop.initial_state(state, self.conf, kernels)
        return [mtf.assign(v, t) for v, t in zip(self.variables[:4], init[:4])]

    @property
    def n_steps(self):
        """Number of steps (stages - 1)."""
        return self.stepper.n_steps


def _group(lowering, ops):
    from hvd_mesh_impl.training import ordered_update_op  # Horovod-free (floor 0)

    return ordered_update_op(lowering, ops) if ops else tf.no_op()


def _replicated(lowering, t):
    if t is None:
        return tf.no_op()
    return lowering.tensors[t].to_laid_out_tensor().tensor_list[0]


def lower_adjoint(adj, lowering):
    """The lowered ops of an :class:`AdjointGraph` (call before the first session run).

    Returns
    -------
    dict
        TF ops ``init``, ``loss``, ``step``, ``reverse``; ``stats``:
        ``{"step", "reverse"}`` replicated migration statistics (or no-ops);
        ``loss_value``: this process's copy of the loss (or None).
    """
    return {"init": _group(lowering, adj.init_ops), "loss": _group(lowering, adj.loss_ops),
            "step": _group(lowering, adj.step_ops), "reverse": _group(lowering, adj.reverse_ops),
            "stats": {"step": _replicated(lowering, adj.step_stats),
                      "reverse": _replicated(lowering, adj.reverse_stats)},
            "sums": _replicated(lowering, adj.reverse_sums),
            "loss_value": _replicated(lowering, adj.loss) if adj.loss is not None else None}


def run_forward(sess, adj, ops, observers=()):
    """The forward time loop from ``stages[0]`` (state already in the variables).

    Parameters
    ----------
    sess : tf.Session
    adj : AdjointGraph
    ops : dict
        From :func:`lower_adjoint`.
    observers : sequence of callable
        ``observer(j, a_j, None)`` (:func:`flowpm_mtf.physics.timeloop.integrate`).

    Returns
    -------
    list
        Migration statistics of every step (None entries: lagrangian).
    """
    stats = adj.stepper.run(sess, ops["step"], ops["stats"]["step"], observers)
    log.info("adjoint: forward %d steps to a=%g", adj.n_steps, adj.stages[-1])
    return stats


def run_reverse(sess, adj, ops):
    """The reverse loop: the final state and its cotangents -> the first stage's.

    The variables must hold the state at ``stages[-1]`` (with its forces) and
    ``cotangents`` the loss cotangent ``(dL/dx_N, dL/dp_N)`` there.

    Returns
    -------
    stats : list
        Migration statistics of every run of the reverse step (the first, the
        final force's cotangent, then steps ``N-1 .. 0``; None: lagrangian).
    sums : numpy.ndarray
        ``[n_steps + 1, 4]`` float64: the :data:`SUMS` of every run, same order.
    """
    stats, sums = [], []
    for row in adj.reverse_factors:
        out = sess.run([ops["reverse"], ops["stats"]["reverse"], ops["sums"]],
                       {adj.reverse_factors_ph: row})
        stats.append(out[1])
        sums.append(out[2])
    log.info("adjoint: reverse %d steps to a=%g", adj.n_steps, adj.stages[0])
    return stats, np.asarray(sums, np.float64)


def run_gradient(sess, adj, ops, init=True):
    """ICs (optional), forward loop, loss cotangent, reverse loop.

    Parameters
    ----------
    sess : tf.Session
    adj : AdjointGraph
        Built with ``loss_fn`` (and ``initial_state`` when ``init``).
    ops : dict
        From :func:`lower_adjoint`.
    init : bool
        Run ``init`` first (else the variables already hold the first stage).

    Returns
    -------
    dict
        ``loss`` (value at the final state), ``forward`` and ``reverse``
        migration statistics per run, ``sums`` (:func:`run_reverse`). Afterwards ``adj.cotangents`` hold
        ``dL/dx_0, dL/dp_0`` and ``adj.variables`` the re-created first state.
    """
    if adj.loss is None:
        raise ValueError("run_gradient: the AdjointGraph was built without loss_fn")
    if init:
        if not adj.init_ops:
            raise ValueError("run_gradient: the AdjointGraph was built without initial_state")
        sess.run(ops["init"])
    fwd = run_forward(sess, adj, ops)
    loss = sess.run(ops["loss_value"])
    sess.run(ops["loss"])
    rev, sums = run_reverse(sess, adj, ops)
    return {"loss": loss, "forward": fwd, "reverse": rev, "sums": sums}
