"""The N-body part of the jobs: the simulation graph and the session side of the time loop.

The graph is built once. The particle state lives in Mesh TF variables on the
process grid; the ICs and one kick-drift-kick step are assign operations, and
the step is run once per stage with that step's time-integration factors fed
through a placeholder (:class:`SimulationGraph`). :func:`run_stages` drives it
with :func:`flowpm_mtf.timeloop.integrate`, so the jobs share the stepping
rule of :func:`flowpm_mtf.nbody.nbody`; observers (:class:`SnapshotWriter`,
:class:`PowerAtStages`, the lensing job's plane painter) act after each step,
then the step is timed, logged and the runner's after-step hook is called.
"""
import logging
import time

import mesh_tensorflow as mtf
import numpy as np
import tensorflow.compat.v1 as tf

from .. import gravity, ics, io, lpt, nbody, painting, power, timeloop
from ..logs import rank0_only
from ..preflight import unfolded_zeros_initializer
from . import runner

__all__ = ["SimulationGraph", "lower_simulation", "run_stages", "snapshot_arrays",
           "SnapshotWriter", "PowerAtStages"]

log = rank0_only(logging.getLogger(__name__))

SNAPSHOT_FIELDS = ("rho", "position", "momentum")
"""Outputs of :class:`SimulationGraph` that make a snapshot."""
POWER_FIELDS = ("k", "pk", "modes")
"""Outputs of :class:`SimulationGraph` that make a P(k)."""


class SimulationGraph:
    """The mtf graph of a simulation: variables, IC and step assignments, outputs.

    Parameters
    ----------
    conf : SimConfig
    mesh : mtf.Mesh
    stages : sequence of float, optional
        Scale factors of the N-body stages (default
        :func:`flowpm_mtf.nbody.default_stages`); the ICs are set up at the first.

    Attributes
    ----------
    variables : lpt.State
        Positions, momenta, forces as mtf variables.
    init_ops, step_ops : list of mtf.Operation
        The IC assignments, and the assignments of one KDK step whose factors
        are fed through the placeholder ``factors``: ``step_factors[i]`` for
        step ``i`` (``stages[i] -> stages[i + 1]``).
    rho, k, pk, modes, position, momentum : mtf.Tensor
        Outputs of the current state.
    """

    def __init__(self, conf, mesh, stages=None):
        self.conf = conf
        self.stages = timeloop.check_stages(nbody.default_stages(conf) if stages is None
                                            else [float(a) for a in stages])
        linear = ics.linear_field(conf, mesh)
        kernels = nbody.make_kernels(conf, mesh)
        init = timeloop.initial_state(lpt.lpt_init(linear, conf, a=self.stages[0]), conf,
                                      kernels)
        shape = init.positions.shape
        self.variables = lpt.State(*[
            mtf.get_variable(mesh, name, shape, dtype=conf.tf_dtype, trainable=False,
                             initializer=unfolded_zeros_initializer())
            for name in ("positions", "momenta", "forces")])
        self.init_ops = [mtf.assign(v, t) for v, t in zip(self.variables, init)]
        # One step for all steps: the time-integration factors are fed per run
        # (lowering ten copies of the step tripled the graph-build time, and TF
        # paid its first-run graph optimisation once per copy).
        self.factors = tf.placeholder(conf.tf_dtype, [3], name="step_factors")
        fac = mtf.import_tf_tensor(mesh, self.factors, mtf.Shape([mtf.Dimension("factor", 3)]))
        new = nbody.kdk_step(self.variables, conf, kernels=kernels,
                             factors=mtf.unstack(fac, fac.shape.dims[0]))
        self.step_ops = [mtf.assign(v, t) for v, t in zip(self.variables, new)]
        self.step_factors = list(nbody.all_step_factors(conf, self.stages))
        x, p, _ = self.variables
        self.rho = painting.paint_field(x, conf)
        self.k, self.pk, self.modes = power.power_spectrum(self.rho - 1.0, conf,
                                                           deconvolve_cic=False)
        self.position = lpt.particles_to_lattice_order(painting.to_global(x, conf), conf)
        self.momentum = lpt.particles_to_lattice_order(p, conf)
        self.cell_size = np.asarray(conf.cell_size)

    @property
    def n_steps(self):
        """Number of steps (stages - 1)."""
        return len(self.stages) - 1


def lower_simulation(sim, lowering, fields=SNAPSHOT_FIELDS + POWER_FIELDS):
    """Lowered ops and fetches of a :class:`SimulationGraph`.

    Returns
    -------
    dict
        ``init`` and ``step`` (TF ops), ``fetch`` (name -> full TF tensor of
        the requested ``fields``).
    """
    return {"init": runner.lowered_group(lowering, sim.init_ops),
            "step": runner.lowered_group(lowering, sim.step_ops),
            "fetch": runner.export(lowering, {n: getattr(sim, n) for n in fields})}


def run_stages(ctx, sess, sim, ops, observers=(), note=None):
    """The ICs, then the time loop over ``sim.stages`` in the session.

    Parameters
    ----------
    ctx : runner.RunContext
        ``ctx.timings`` gets ``ics_s``, ``steps_s`` (per step, including the
        observers at the stage reached) and ``nbody_s``.
    sess : tf.Session
    sim : SimulationGraph
    ops : dict
        From :func:`lower_simulation`.
    observers : sequence of callable
        ``observer(j, a_j, None)`` at the first stage and after every step
        (:func:`flowpm_mtf.timeloop.integrate`).
    note : callable, optional
        ``note(j) -> str`` appended to the log line of step ``j``.
    """
    conf, timings = ctx.conf, ctx.timings
    t = time.perf_counter()
    sess.run(ops["init"])
    timings["ics_s"] = time.perf_counter() - t
    log.info("initial conditions (%dLPT at a=%g) in %.2f s", conf.lpt_order, sim.stages[0],
             timings["ics_s"])
    steps = []
    clock = [None]

    def step(state, i, a0, a1):
        sess.run(ops["step"], {sim.factors: sim.step_factors[i]})
        return state

    def timed(j, a, state):
        now = time.perf_counter()
        if j > 0:
            steps.append(now - clock[0])
            log.info("step %d/%d to a=%.4f in %.2f s%s (elapsed %.1f s)", j, sim.n_steps, a,
                     steps[-1], note(j) if note is not None else "", ctx.elapsed())
            ctx.after_step(j, a=a)
        clock[0] = time.perf_counter()

    timeloop.integrate(None, sim.stages, step, list(observers) + [timed])
    timings["steps_s"] = steps
    timings["nbody_s"] = float(sum(steps))


def snapshot_arrays(sim, res, a):
    """Positions [Mpc/h], peculiar velocities [km/s] and density from fetched outputs.

    Parameters
    ----------
    sim : SimulationGraph
    res : dict
        Fetched ``position``, ``momentum`` [cells] and ``rho``.
    a : float
        Scale factor of the state.

    Returns
    -------
    dict
        ``position`` [N, 3] in the box, ``velocity`` [N, 3] (peculiar:
        ``p = a^3 E dx/da`` in cells with H0 = 1 gives ``v = H0 p / a``),
        ``density`` [NX, NY, NZ] (1 + delta): the arguments of
        :func:`flowpm_mtf.io.write_snapshot`.
    """
    conf = sim.conf
    n = conf.n_cells
    position = (res["position"].reshape(n, 3) * sim.cell_size) % np.asarray(conf.box_size)
    velocity = res["momentum"].reshape(n, 3) * sim.cell_size * 100.0 / a
    return {"position": position, "velocity": velocity, "density": res["rho"]}


class SnapshotWriter:
    """Observer writing ``snapshot_a<a>.h5`` at requested stages (rank 0 writes).

    Parameters
    ----------
    ctx : runner.RunContext
    sess : tf.Session
    sim : SimulationGraph
    fetch : dict
        Full TF tensors ``rho``, ``position``, ``momentum``.
    scale_factors : sequence of float
        Scale factors of the snapshots (each a stage of ``sim``).
    """

    def __init__(self, ctx, sess, sim, fetch, scale_factors):
        self.ctx, self.sess, self.sim = ctx, sess, sim
        self.fetch = {n: fetch[n] for n in SNAPSHOT_FIELDS}
        idx = timeloop.stage_indices(scale_factors, sim.stages)
        self.at = dict(zip(idx, (float(a) for a in scale_factors)))
        self.written = []

    def __call__(self, j, a, state):
        if j not in self.at:
            return
        res = self.sess.run(self.fetch)
        name = snapshot_name(self.at[j])
        if self.ctx.outputs is not None:
            io.write_snapshot(self.ctx.outputs.path(name), **snapshot_arrays(self.sim, res, a),
                              attrs=self.sim.conf, rank=0)
        self.written.append(name)


def snapshot_name(a):
    """File name of the snapshot at scale factor ``a``: ``snapshot_a0.5000.h5``."""
    return "snapshot_a%.4f.h5" % a


class PowerAtStages:
    """Observer measuring the P(k) of the particles at some stages.

    Parameters
    ----------
    sess : tf.Session
    fetch : dict
        Full TF tensors ``k``, ``pk``, ``modes``.
    stages : iterable of int or None
        Stage indices to measure at (None: every stage).
    before : callable, optional
        ``before(j)`` run first at each of those stages (e.g. paint lens planes).

    Attributes
    ----------
    results : dict
        Stage index -> ``{"k", "pk", "modes"}`` (numpy).
    seconds : float
        Time spent at stages after the first [s].
    """

    def __init__(self, sess, fetch, stages=None, before=None):
        self.sess = sess
        self.fetch = {n: fetch[n] for n in POWER_FIELDS}
        self.stages = None if stages is None else set(int(j) for j in stages)
        self.before = before
        self.results = {}
        self.seconds = 0.0

    def __call__(self, j, a, state):
        if self.stages is not None and j not in self.stages:
            return
        t = time.perf_counter()
        if self.before is not None:
            self.before(j)
        self.results[j] = self.sess.run(self.fetch)
        if j > 0:
            self.seconds += time.perf_counter() - t
