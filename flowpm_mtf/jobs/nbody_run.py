"""The N-body part of the jobs: the simulation graph and the session side of the time loop.

The graph is built once. The particle state lives in Mesh TF variables on the
process grid; the ICs and one kick-drift-kick step are assign operations, and
the step is run once per stage with that step's time-integration factors fed
through a placeholder (:class:`SimulationGraph`; the state variables, the step
and its loop are :class:`flowpm_mtf.physics.stepper.Stepper`'s, shared with the adjoint).
:func:`run_stages` drives it with :meth:`flowpm_mtf.physics.stepper.Stepper.run`
(:func:`flowpm_mtf.physics.timeloop.integrate`), so the jobs share the stepping rule of
:func:`flowpm_mtf.physics.nbody.nbody`; observers (:class:`SnapshotWriter`,
:class:`PowerAtStages`, the lensing job's plane painter) act after each step,
then the step is timed, logged and the runner's after-step hook is called;
then, for a job that checkpoints (``Job.checkpoints``), every
``ctx.checkpoint_every`` steps or when the ranks agree on a stop request
(SIGTERM), the state is checkpointed (:mod:`flowpm_mtf.runs.checkpoint`, with the
outputs staged so far and the per-step records of the summary) and, after a
stop, :class:`flowpm_mtf.jobs.runner.Stopped` ends the job (a job that does not
checkpoint is stopped by the runner's after-step check, without a checkpoint).
With ``ctx.resume`` the state, the outputs written before the checkpoint and
those records come from the newest valid checkpoint instead of the ICs, after
:func:`check_resume` verified, before any graph was built, that the checkpoint
belongs to this job, config and stage list.

Observers write their files during the loop (:class:`SnapshotWriter`,
:class:`PowerWriter`), so that a checkpoint holds every output of the stages
before it; a resumed loop does not call them again at the restored stage
(they ran there before the checkpoint).

No rank gathers the state: snapshots are written by every rank from its own
slices (:func:`snapshot_parts`, :func:`write_snapshot`).
"""
import logging
import os
import time

import mesh_tensorflow as mtf
import numpy as np
import tensorflow.compat.v1 as tf

from ..runs import checkpoint, h5dist, io, snapshot
from ..runs.collective import collective
from ..mesh import domain, donate, slots
from ..physics import ics, lpt, nbody, painting, power, sizing, stepper, timeloop
from ..logs import rank0_only
from . import runner

__all__ = ["SimulationGraph", "lower_simulation", "run_init", "run_stages", "check_resume", "run_identity",
           "LoopState",
           "fetch_state", "snapshot_parts", "write_snapshot", "migration_summary",
           "SnapshotWriter", "PowerAtStages", "PowerWriter", "power_name"]

log = rank0_only(logging.getLogger(__name__))

SNAPSHOT_FIELDS = ("rho",)
"""Outputs of :class:`SimulationGraph` (besides the state) that make a snapshot."""
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
        :func:`flowpm_mtf.config.default_stages`); the ICs are set up at the first.
    plin : PowerTable or callable, optional
        The linear P(k) at a = 1 of the ICs (:func:`flowpm_mtf.physics.ics.linear_field`;
        e.g. :attr:`flowpm_mtf.physics.linear_power_source.LinearPower.table`); default
        the Eisenstein & Hu fit of ``conf.cosmology``.

    Attributes
    ----------
    stepper : flowpm_mtf.physics.stepper.Stepper
        The state variables, the fed factors, the step and its run
        (:func:`run_stages`).
    variables : lpt.State
        Positions, momenta, forces as mtf variables.
    lpt_state : lpt.State
        The 2LPT state at the first stage, before the first PM force (its
        ``forces`` is None): what ``init_ops`` assigns, less that force. Run it
        only through ``init_ops``: its positions and momenta are written into
        the variables' buffers (:func:`flowpm_mtf.mesh.donate.take`), and a run that
        does not assign them back leaves the variables uninitialised (the next
        read raises ``FailedPrecondition``).
    init_ops, init_force_ops, step_ops : list of mtf.Operation
        The IC assignments in two session runs, one after the other
        (:func:`run_init`): ``init_ops`` the 2LPT positions, momenta and ids,
        ``init_force_ops`` the first PM force computed from those variables (so
        the LPT's fields are released before the force's fields exist: the ICs'
        peak memory); and the assignments of one KDK step whose factors
        are fed through the placeholder ``factors``: ``step_factors[i]`` for
        step ``i`` (``stages[i] -> stages[i + 1]``). The ICs and the step take
        the positions, momenta (and the step the forces) out of their variables
        and write the new values into those buffers where they can
        (:mod:`flowpm_mtf.mesh.donate`); each runs only as a whole.
    rho, k, pk, modes : mtf.Tensor
        Outputs of the current state (density; its P(k), reduced and replicated).
    """

    def __init__(self, conf, mesh, stages=None, plin=None):
        self.conf = conf
        linear = ics.linear_field(conf, mesh, power=plin)
        kernels = nbody.make_kernels(conf, mesh)
        shape = lpt.state_shape(conf)
        # The state's variables, its fed factors and its one step: the stepper's. The zeros
        # are the state's buffers: the ICs write the positions and momenta into them and
        # every step updates the state in them where it can (donate.take: no fresh pages,
        # no second copy of the state: flowpm_mtf/mesh/donate.py).
        self.stepper = st = stepper.Stepper(conf, mesh, stages, shape)
        self.stages = st.stages
        self.lpt_state = lpt.lpt_init(linear, conf, a=self.stages[0], forces=False,
                                      kernels=kernels,
                                      donors=[donate.take(t, name="take_" + n)
                                              for t, n in zip(st.vectors[:2], stepper.VECTORS)])
        init = self.lpt_state
        if init.positions.shape != shape:
            raise AssertionError("SimulationGraph: the LPT state has the shape %s, its "
                                 "variables %s" % (init.positions.shape, shape))
        self.variables = v = st.add_ids(init.ids.shape, init.ids.dtype)
        # Two runs: the LPT state first (each assignment takes over its value's buffer: the
        # variable's own for the positions and momenta), then the first PM force from the
        # variables
        # (timeloop.initial_state): the force's density, spectra and fields never coexist
        # with a second copy of the positions, momenta and ids.
        self.init_ops = [mtf.assign(v.positions, init.positions),
                         mtf.assign(v.momenta, init.momenta), mtf.assign(v.ids, init.ids)]
        # The positions were assigned by init_ops in the run before, after the eulerian
        # ICs' migration gate checked every particle into its padded block: no second
        # escape check (a pass over every particle). Lagrangian: the first paint checks.
        # The force is read out into the forces variable's zeros (donate.take): no fresh
        # output (1.6 GB at 512^3 on one rank), one copy of the forces.
        first = timeloop.initial_state(v._replace(forces=None), conf, kernels,
                                       escape_checked=conf.decomposition == "eulerian",
                                       donor=donate.take(v.forces, name="take_forces"))
        self.init_force_ops = [mtf.assign(v.forces, first.forces)]
        self.init_stats = init.stats     # migration statistics of the ICs (or None)
        # One step for all steps, its factors fed per run through ``factors``; it takes the
        # positions, momenta and forces out of the variables (the kicks and the drift
        # forward their buffers): no second copy of the state. The migration's send
        # buffers are sized once for the longest of these stages' steps.
        self.step_ops = st.build_step(kernels, take=True)
        self.factors, self.step_factors = st.factors, st.step_factors
        self.step_stats = st.step_stats  # migration statistics of the step (or None)
        self.send_rows = st.send_rows
        # Every conf.sort_every steps: the particles reordered by column (the CIC ops'
        # cache locality, slots.sort_by_column); the variables' values permuted
        self.sort_interval = conf.sort_every
        self.sort_ops = []
        if self.sort_interval:
            fields, ids = slots.sort_by_column(conf, list(self.variables[:3]),
                                               self.variables.ids)
            self.sort_ops = [mtf.assign(v, t) for v, t in
                             zip(self.variables[:4], fields + [ids])]
        x = self.variables.positions
        self.weights = slots.weights(self.variables.ids, conf)   # 0 for empty slots
        self.rho = painting.paint_field(x, conf, self.weights)
        self.k, self.pk, self.modes = power.power_spectrum(self.rho - 1.0, conf,
                                                           deconvolve_cic=False)
        self.migration = []              # (stage label, stats) filled by run_stages
        self.cell_size = np.asarray(conf.cell_size)

    @property
    def n_steps(self):
        """Number of steps (stages - 1)."""
        return self.stepper.n_steps


def sort_due(sim, j):
    """Whether the particles are reordered by column after step ``j`` (1-based; not after the
    last: the snapshot does not need it). The same steps on a resumed run."""
    k = sim.sort_interval
    return bool(k) and j % k == 0 and j < sim.n_steps


def lower_simulation(sim, lowering):
    """Lowered ops and fetches of a :class:`SimulationGraph` (no full-size gather).

    Returns
    -------
    dict
        ``init`` and ``step`` (TF ops); ``state`` (this process's slices of
        positions, momenta, forces, ids: lists of ``(pnum, tf.Tensor, begin)``),
        ``blocks`` (pnum -> (bx, by)), ``rho`` (slices of the density),
        ``fetch`` (the replicated ``k``, ``pk``, ``modes``), ``restore``
        (placeholders per variable and the op assigning them to the slices).
    """
    import tensorflow.compat.v1 as tf

    state = [h5dist.local_slices(lowering, v) for v in sim.variables[:4]]
    restore_ph, restore = [], []
    for v in sim.variables[:4]:
        laid_out = lowering.variables[v.operation]
        phs = [tf.placeholder(t.dtype, t.shape) for t in laid_out.laid_out_tensor.tensor_list]
        restore_ph.append(phs)
        restore.append(laid_out.assign_to_slices(mtf.assign_slice, phs))
    # The migration statistics are reduced over blocks (replicated): no gather.
    stats = {k: h5dist.replicated_value(lowering, t) if t is not None else tf.no_op()
             for k, t in (("init", sim.init_stats), ("step", sim.step_stats))}
    return {"init": runner.lowered_group(lowering, sim.init_ops),
            "init_force": runner.lowered_group(lowering, sim.init_force_ops),
            "step": runner.lowered_group(lowering, sim.step_ops), "stats": stats,
            "sort": runner.lowered_group(lowering, sim.sort_ops) if sim.sort_ops else None,
            "state": state, "blocks": {p: (b[0], b[1]) for p, _, b in state[0]},
            "rho": h5dist.local_slices(lowering, sim.rho),
            "fetch": runner.replicated(lowering, {n: getattr(sim, n) for n in POWER_FIELDS}),
            "restore": (restore_ph, tf.group(restore))}


def run_init(sess, init, init_force, fetch=None):
    """Run the ICs of a :class:`SimulationGraph`: its two lowered init groups in order.

    Parameters
    ----------
    sess : tf.Session
    init, init_force : tf.Operation
        The lowered ``init_ops`` and ``init_force_ops``.
    fetch : tf.Tensor or op, optional
        Fetched with ``init`` (e.g. the ICs' migration statistics).

    Returns
    -------
    object
        The value of ``fetch`` (None without).
    """
    out = sess.run([init, fetch])[1] if fetch is not None else sess.run(init)
    sess.run(init_force)
    return out if fetch is not None else None


def fetch_state(sess, ops, forces=True, extra=None):
    """This process's state slices: ``pnum -> (block, positions, momenta, forces, ids)``.

    Every slot of the fixed-capacity buffers (id -1: an empty slot).

    Parameters
    ----------
    sess : tf.Session
    ops : dict
        From :func:`lower_simulation`.
    forces : bool
        Also fetch the forces (a checkpoint needs them, a snapshot does not:
        ``None`` in their place then).
    extra : object, optional
        More fetches run in the same ``session.run`` (e.g. the density and
        its P(k): one paint of the state for all of them).

    Returns
    -------
    dict, or (dict, object) with ``extra``
        The state slices (and the values of ``extra``).
    """
    which = [0, 1, 2, 3] if forces else [0, 1, 3]
    fetches = [[t for _, t, _ in ops["state"][v]] for v in which]
    vals, more = (sess.run([fetches, extra]) if extra is not None
                  else (sess.run(fetches), None))
    vals = dict(zip(which, vals))
    state = {p: (ops["blocks"][p],) + tuple(vals[v][i] if v in vals else None
                                            for v in range(4))
             for i, (p, _, _) in enumerate(ops["state"][0])}
    return state if extra is None else (state, more)


def _checkpoint_parts(conf, state):
    parts = {}
    for pnum, (block, pos, mom, force, ids) in state.items():
        parts[pnum] = {"block": block, "id": ids,
                       "origin": [block[0] * conf.block_shape[0], block[1] * conf.block_shape[1],
                                  0],
                       "positions": pos, "momenta": mom, "forces": force}
    return parts


def run_identity(ctx, stages, fields=()):
    """:func:`flowpm_mtf.runs.checkpoint.identity` of this run (job, state config, stages).

    The job's ``state_sections`` are part of the state config; ``fields`` names
    the distributed fields its checkpoints hold besides the particles.
    """
    return checkpoint.identity(ctx.job.name, ctx.configs, stages,
                               sections=getattr(ctx.job, "state_sections", None), fields=fields)


class LoopState:
    """What a job's time loop holds besides the particles, for its checkpoints.

    Parameters
    ----------
    variables : runner.VariableSlices, optional
        Mesh TF variables of the job (e.g. lens planes): every rank saves and
        restores its own slices.
    records : callable, optional
        ``records() -> dict`` (JSON-able): the job's loop records (e.g. the
        P(k) measured at the stages so far), saved in the manifest.
    restore : callable, optional
        ``restore(records)``: puts those records back on a resume.
    """

    def __init__(self, variables=None, records=None, restore=None):
        self.variables = variables
        self.records = records
        self.restore_records = restore

    @property
    def fields(self):
        """Names of the variables (the checkpoint's fields)."""
        return tuple(self.variables.names) if self.variables is not None else ()


def check_resume(ctx, stages, fields=()):
    """Refuse, on every rank and before any graph is built, a checkpoint of another run.

    Call from :meth:`Job.preflight` of a job that checkpoints, with the stages
    its graph will have, when ``ctx.resume``.

    Raises
    ------
    ResumeError
        The newest checkpoint of the run directory was written by another job,
        with another state config or stage list, or by an older flowpm-mtf
        (:func:`flowpm_mtf.runs.checkpoint.check_identity`).
    """
    from ..errors import ResumeError

    if ctx.run_dir is None:
        raise ResumeError("--resume needs a run directory")
    checkpoint.verify_resume(ctx.run_dir.path, ctx.comm, run_identity(ctx, stages, fields))


def _staging(ctx):
    """The run directory's staging area (None for a plain directory, written in place)."""
    return getattr(ctx.run_dir, "staging", None)


def _loop_records(sim, state=None):
    """The per-step records of the summary (migration statistics) and of the job, JSON-able."""
    out = {"migration": [[label, None if st is None else np.asarray(st).tolist()]
                         for label, st in sim.migration]}
    if state is not None and state.records is not None:
        out["job"] = state.records()
    return out


def _restore(ctx, sess, sim, ops, state=None):
    """Assign the newest valid checkpoint to the state variables; returns its step.

    Also puts the checkpoint's outputs back into the staging area, its
    per-step records into ``sim.migration`` and, with ``state``
    (:class:`LoopState`), the job's variables and records.
    """
    state = state or LoopState()
    ident = run_identity(ctx, sim.stages, state.fields)
    manifest, parts, values = checkpoint.load(
        ctx.run_dir.path, ctx.comm, ctx.conf, ops["blocks"], ident=ident,
        fields=state.variables.requests() if state.variables is not None else {})
    path = checkpoint.step_dir(ctx.run_dir.path, manifest["step"])
    staging = _staging(ctx)
    if staging is not None:
        names = checkpoint.restore_outputs(path, manifest, staging, ctx.comm)
        if ctx.outputs is not None:
            ctx.outputs.names.extend(n for n in names if os.sep not in n)
    sim.migration[:] = [(label, None if st is None else np.asarray(st))
                        for label, st in manifest.get("loop", {}).get("migration", [])]
    placeholders, op = ops["restore"]
    feed = {}
    for v, (phs, slices) in enumerate(zip(placeholders, ops["state"])):
        for ph, (p, _, _) in zip(phs, slices):
            key = checkpoint.STATE_NAMES[v] if v < 3 else "id"
            feed[ph] = np.asarray(parts[p][key], ph.dtype.as_numpy_dtype).reshape(
                ph.shape.as_list())
    sess.run(op, feed)
    if state.variables is not None:
        state.variables.restore(sess, values)
    if state.restore_records is not None:
        state.restore_records(manifest.get("loop", {}).get("job", {}))
    return int(manifest["step"])


def _configs_dict(ctx):
    return {key: cfg.to_dict() for key, cfg in ctx.configs.items()}


def run_stages(ctx, sess, sim, ops, observers=(), note=None, loop_state=None):
    """The ICs (or the restored checkpoint), then the time loop over ``sim.stages``.

    Parameters
    ----------
    ctx : runner.RunContext
        ``ctx.timings`` gets ``ics_s`` and ``ics_cpu_s`` (or ``restore_s``),
        ``steps_s`` (per step, including the observers at the stage reached,
        not the reordering of the particles), ``steps_cpu_s`` (the same in
        this process's CPU time, all threads: comparable on a loaded machine;
        reorderings included), ``sorts_s`` (each reordering by column,
        :func:`sort_due`) and ``nbody_s``;
        ``ctx.checkpoint_every``, ``ctx.resume`` and ``ctx.stop`` drive
        checkpoints, restart and SIGTERM.
    sess : tf.Session
    sim : SimulationGraph
    ops : dict
        From :func:`lower_simulation`.
    observers : sequence of callable
        ``observer(j, a_j, None)`` at the first stage and after every step
        (:func:`flowpm_mtf.physics.timeloop.integrate`); not at the restored stage of
        a resumed run (they ran there before the checkpoint, whose outputs are
        restored).
    note : callable, optional
        ``note(j) -> str`` appended to the log line of step ``j``.
    loop_state : LoopState, optional
        The job's state besides the particles (variables, records): saved in
        every checkpoint and restored on a resume.

    Returns
    -------
    int
        The stage the loop started from (0, or the checkpoint's step).

    Raises
    ------
    runner.Stopped
        On every rank, after the checkpoint, when the ranks agreed on a stop
        request before the last step.
    """
    conf, timings = ctx.conf, ctx.timings
    t, t_cpu = time.perf_counter(), time.process_time()
    first = 0
    if ctx.resume:
        first = _restore(ctx, sess, sim, ops, loop_state)
        timings["restore_s"] = time.perf_counter() - t
        log.info("restored step %d/%d (a=%.4f) in %.2f s", first, sim.n_steps,
                 sim.stages[first], timings["restore_s"])
    else:
        sim.migration.append(("ics", run_init(sess, ops["init"], ops["init_force"],
                                              ops["stats"]["init"])))
        timings["ics_s"] = time.perf_counter() - t
        timings["ics_cpu_s"] = time.process_time() - t_cpu
        log.info("initial conditions (%dLPT at a=%g) in %.2f s", conf.lpt_order, sim.stages[0],
                 timings["ics_s"])
    ctx.mark("ics")
    steps, cpu = [], []
    clock = [None, None]

    sorts, sorting = [], [0.0]

    def after_step(i, stats):
        sim.migration.append(("step %d" % (i + 1), stats))
        if sort_due(sim, i + 1):   # timed on its own: not in the step's time
            t0 = time.perf_counter()
            sess.run(ops["sort"])
            sorts.append(time.perf_counter() - t0)
            sorting[0] = sorts[-1]

    def timed(j, a, state):
        now, now_cpu = time.perf_counter(), time.process_time()
        if j > first:
            steps.append(now - clock[0] - sorting[0])
            sorting[0] = 0.0
            cpu.append(now_cpu - clock[1])
            log.info("step %d/%d to a=%.4f in %.2f s%s (elapsed %.1f s)", j, sim.n_steps, a,
                     steps[-1], note(j) if note is not None else "", ctx.elapsed())
            ctx.after_step(j, a=a, total=sim.n_steps)
            _checkpoint_or_stop(ctx, sess, sim, ops, j, loop_state)
        clock[0], clock[1] = time.perf_counter(), time.process_time()

    if first > 0:  # the observers ran at the restored stage before the checkpoint
        observers = [_after(first, obs) for obs in observers]
    sim.stepper.run(sess, ops["step"], ops["stats"]["step"], list(observers) + [timed],
                    first=first, after_step=after_step)
    timings["steps_s"] = steps
    timings["steps_cpu_s"] = cpu
    timings["sorts_s"] = sorts
    timings["nbody_s"] = float(sum(steps))
    return first


def _after(first, obs):
    """``obs`` called at every stage but ``first``."""
    def call(j, a, state):
        if j != first:
            obs(j, a, state)
    return call


def _checkpoint_or_stop(ctx, sess, sim, ops, j, state=None):
    """After step ``j``: checkpoint every K steps or on an agreed stop request, then stop.

    Only for a job that checkpoints (``Job.checkpoints``); the runner's
    after-step check stops the others (:meth:`runner.RunContext.after_step`).
    """
    if not getattr(ctx.job, "checkpoints", False):
        return
    stop = ctx.stop is not None and ctx.stop.agreed() and j < sim.n_steps  # collective
    every = ctx.checkpoint_every
    path = None
    if j < sim.n_steps and ctx.run_dir is not None and (stop or (every and j % every == 0)):
        t = time.perf_counter()
        state = state or LoopState()
        path = checkpoint.save(ctx.run_dir.path, ctx.comm, j, sim.stages[j], _configs_dict(ctx),
                               _checkpoint_parts(ctx.conf, fetch_state(sess, ops)),
                               grid=ctx.conf.grid,
                               ident=run_identity(ctx, sim.stages, state.fields),
                               outputs_dir=_staging(ctx),
                               extra={"loop": _loop_records(sim, state)},
                               fields=(state.variables.fetch(sess)
                                       if state.variables is not None else None))
        ctx.timings.setdefault("checkpoint_s", []).append(time.perf_counter() - t)
    if stop:
        if path is None:  # no run directory: nothing to continue from
            raise runner.Stopped(j, sim.n_steps)
        log.warning("stopped by signal after step %d/%d; checkpoint in %s; continue with: %s",
                    j, sim.n_steps, path,
                    checkpoint.resume_command(ctx.run_dir.path, ctx.job.name))
        raise runner.Stopped(j, sim.n_steps, checkpoint=path)


def snapshot_parts(conf, state, rho_slices, rho_vals, a):
    """Snapshot parts (``h5dist``) of this process's slices, in the run's dtype.

    Parameters
    ----------
    conf : SimConfig
    state : dict
        From :func:`fetch_state`.
    rho_slices : list
        ``ops["rho"]`` (pnum, tensor, begin) of :func:`lower_simulation`.
    rho_vals : list of ndarray
        The fetched density slices.
    a : float
        Scale factor of the state.

    Returns
    -------
    dict
        ``pnum -> {"position", "velocity", "id", "density"}``: positions
        [Mpc/h] in the box, peculiar velocities [km/s] (``p = a^3 E dx/da`` in
        cells with H0 = 1 gives ``v = H0 p / a``), Lagrangian ids, the density
        block (1 + delta): the arguments of :func:`write_snapshot`.
    """
    parts = {}
    for (p, _, begin), rho in zip(rho_slices, rho_vals):
        block, pos, mom, _, ids = state[p]
        parts[p] = snapshot.particle_part(conf, block, pos, mom, a, ids=ids, valid=ids >= 0)
        parts[p]["density"] = h5dist.Block(rho, begin, conf.nc)
    return parts


def write_snapshot(ctx, name, parts, compression=None):
    """Write one distributed snapshot ``name`` (collective; every rank its parts).

    Its bytes and seconds go to ``ctx`` (:meth:`runner.RunContext.record_write`:
    the ``output_write`` of summary.json).

    Parameters
    ----------
    ctx : runner.RunContext
    name : str
    parts : dict
        From :func:`snapshot_parts`.
    compression : {None, "gzip", "lzf"}
        Of the part files (default none).
    """
    path = ctx.file(name)
    if path is not None:
        stats = {}
        snapshot.write_snapshot_distributed(path, ctx.comm, parts, attrs=ctx.conf,
                                            compression=compression, stats=stats)
        ctx.record_write(name, stats)


def density_slab(conf, rho_slices, rho_vals, comm):
    """The ``[NX, NY]`` mean of 1 + delta over the first ``nc[2] // 8`` cells along z.

    Projected on every rank from its own blocks; only this 2D slab is gathered.

    Returns
    -------
    (ndarray, int)
        The slab and its depth [cells].
    """
    depth = max(1, conf.nc[2] // 8)
    return h5dist.gather_slab(comm, [(r[:, :, :depth].mean(axis=2), b[:2])
                                     for (_, _, b), r in zip(rho_slices, rho_vals)],
                              conf.nc[:2]), depth


def migration_summary(conf, stats, send_rows=None):
    """The ``migration`` entry of summary.json from the per-stage statistics.

    Parameters
    ----------
    conf : SimConfig
    stats : list of (str, ndarray or None)
        ``(label, stats)`` of the IC migration and of every step
        (:data:`flowpm_mtf.mesh.domain.STATS`).
    send_rows : int, optional
        Rows of the steps' send buffers [particles] (``SimulationGraph.send_rows``);
        default: :func:`flowpm_mtf.physics.sizing.send_capacity` of the default stages.

    Returns
    -------
    dict
        Decomposition, halo, capacities, bytes sent per rank per step, and per
        stage the particles of the fullest rank, its ratio to the mean (load
        imbalance), the most particles one rank sent and the largest
        displacement [cells].
    """
    out = {"decomposition": conf.decomposition, "halo_size": conf.halo_size,
           "capacity": sizing.capacity(conf)}
    if conf.decomposition == "lagrangian":
        return out
    mean = conf.n_particles / conf.n_ranks
    rows = sizing.send_capacity(conf) if send_rows is None else int(send_rows)
    out.update({"send_capacity": rows,
                "bytes_sent_per_rank_per_step": domain.bytes_per_migration(conf, 1, rows),
                "mean_particles_per_rank": mean, "steps": []})
    for label, st in stats:
        if st is None:
            continue
        d = dict(zip(domain.STATS, (float(v) for v in st)))
        out["steps"].append({"stage": label, "max_particles_per_rank": d["count"],
                             "imbalance": d["count"] / mean, "moved_max": d["moved"],
                             "send_max": d["send"], "displacement_max_cells": d["displacement"]})
    if out["steps"]:
        out["imbalance_max"] = max(s["imbalance"] for s in out["steps"])
    return out


class SnapshotWriter:
    """Observer writing ``snapshot_a<a>.h5`` at requested stages (every rank its slices).

    Parameters
    ----------
    ctx : runner.RunContext
    sess : tf.Session
    sim : SimulationGraph
    ops : dict
        From :func:`lower_simulation`.
    scale_factors : sequence of float
        Scale factors of the snapshots (each a stage of ``sim``).
    compression : {None, "gzip", "lzf"}
        Of the snapshots' part files (default none).
    write : callable, optional
        ``write(a_requested, a, parts) -> name``: writes the snapshot in another
        format (collective; e.g. Gadget-4 files, :mod:`flowpm_mtf.jobs.simulate`);
        default :func:`write_snapshot` to ``snapshot_a<a>.h5``.
    """

    def __init__(self, ctx, sess, sim, ops, scale_factors, compression=None, write=None):
        self.ctx, self.sess, self.sim, self.ops = ctx, sess, sim, ops
        self.compression = compression
        self.write = write
        idx = timeloop.stage_indices(scale_factors, sim.stages)
        self.at = dict(zip(idx, (float(a) for a in scale_factors)))
        self.written = []

    def __call__(self, j, a, state):
        if j not in self.at:
            return
        st, rho = fetch_state(self.sess, self.ops, forces=False,
                              extra=[t for _, t, _ in self.ops["rho"]])
        parts = snapshot_parts(self.sim.conf, st, self.ops["rho"], rho, a)
        if self.write is not None:
            name = self.write(self.at[j], a, parts)
        else:
            name = snapshot_name(self.at[j])
            write_snapshot(self.ctx, name, parts, self.compression)
        self.written.append(name)


def snapshot_name(a):
    """File name of the snapshot at scale factor ``a``: ``snapshot_a0.5000.h5``."""
    return "snapshot_a%.4f.h5" % a


def power_name(a):
    """File name of the P(k) at scale factor ``a``: ``power_a0.5000.txt``."""
    return "power_a%.4f.txt" % a


class PowerWriter:
    """Observer writing ``power_a<a>.txt`` (k, P(k), modes) at some stages, as they are reached.

    Written during the loop (rank 0), so that a checkpoint holds those of the
    stages before it.

    Parameters
    ----------
    ctx : runner.RunContext
    sess : tf.Session
    fetch : dict
        Replicated TF tensors ``k``, ``pk``, ``modes``.
    stages : iterable of int
        Stage indices to measure at.

    Attributes
    ----------
    written : list of str
        The files written by this process's loop (rank 0).
    """

    def __init__(self, ctx, sess, fetch, stages):
        self.ctx = ctx
        self.measure = PowerAtStages(sess, fetch, stages)
        self.written = []

    def __call__(self, j, a, state):
        self.measure(j, a, state)
        res = self.measure.results.pop(j, None)   # replicated: the same on every rank
        if res is None or self.ctx.run_dir is None:
            return
        keep = res["modes"] > 0
        name = power_name(a)

        def write_rank0(_):
            io.write_power(self.ctx.outputs.path(name), res["k"][keep], res["pk"][keep],
                           res["modes"][keep], rank=0)
            self.written.append(name)

        # rank 0 writes; an error there (e.g. a full disk: exit 5) reaches every rank, no hang
        collective(self.ctx.comm, dict, write_rank0, "writing %s" % name)


class PowerAtStages:
    """Observer measuring the P(k) of the particles at some stages.

    Parameters
    ----------
    sess : tf.Session
    fetch : dict
        Replicated TF tensors ``k``, ``pk``, ``modes``.
    stages : iterable of int or None
        Stage indices to measure at (None: every stage).
    before : callable, optional
        ``before(j)`` run first at each of those stages (e.g. paint lens planes).
    feed : callable, optional
        ``feed(j)``: the feed dict of the P(k) run at stage ``j`` (or None).

    Attributes
    ----------
    results : dict
        Stage index -> ``{"k", "pk", "modes"}`` (numpy).
    seconds : float
        Time spent at stages after the first [s].
    """

    def __init__(self, sess, fetch, stages=None, before=None, feed=None):
        self.sess = sess
        self.feed = feed
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
        self.results[j] = self.sess.run(self.fetch,
                                        None if self.feed is None else self.feed(j))
        if j > 0:
            self.seconds += time.perf_counter() - t
