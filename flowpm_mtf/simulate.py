"""The main job: Gaussian ICs -> LPT -> FastPM N-body -> snapshot, P(k), plots.

The simulation graph is built once. The particle state lives in Mesh TF
variables on the process grid; the ICs and every kick-drift-kick step are
separate assign operations run one after the other, so progress and timings
are logged per step without rebuilding anything.

Outputs (into ``out_dir``; no rank gathers a full-size array)
-------------------------------------------------------------
snapshot.h5
    ``position`` [N, 3] [Mpc/h], ``velocity`` [N, 3] [km/s] (peculiar),
    ``id`` [N] (Lagrangian index), ``density`` [NX, NY, NZ] (1 + delta, CIC),
    attributes with the config and versions: one logical file of HDF5
    virtual datasets over the per-rank parts in ``snapshot.parts/`` (see
    :mod:`flowpm_mtf.h5dist`); particles are grouped by rank, sort by ``id``.
power.txt
    k [h/Mpc], P(k) [(Mpc/h)^3], number of modes.
summary.json
    Config, timings per phase and per step [s], peak memory per rank [MB],
    versions.
overview.png
    A density slab (projected per rank, only the 2D slab gathered) and the
    measured P(k) (binned per rank, bins all-reduced) against the
    growth-scaled linear P(k).
checkpoint/
    With ``checkpoint_every`` or on SIGTERM (see :mod:`flowpm_mtf.checkpoint`).
"""
import json
import logging
import os
import resource
import time

import mesh_tensorflow as mtf
import numpy as np
import tensorflow.compat.v1 as tf

from . import cosmology as cosmo_mod
from . import checkpoint, gravity, h5dist, ics, io, lpt, nbody, painting, power
from .logs import rank0_only

log = rank0_only(logging.getLogger(__name__))  # progress: every rank would repeat it


def peak_memory_mb():
    """Peak resident memory of this process [MB] (``ru_maxrss``)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def current_memory_mb():
    """Current resident memory of this process [MB] (``/proc/self/statm``; the peak elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2.0**20
    except (OSError, ValueError, IndexError):
        return peak_memory_mb()


def _phase_peak_mb():
    """Peak RSS [MB] since the last :func:`_reset_phase_peak` (``VmHWM``), or ``None``."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError):
        pass
    return None


def _reset_phase_peak():
    """Reset the kernel's peak-RSS counter of this process (Linux >= 4.0: clear_refs 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _mark(marks, label):
    """Record the RSS [MB] at a phase boundary: current, the phase's peak, the run's peak.

    ``phase_peak`` is the peak since the previous mark (the kernel's counter is
    reset at every mark); it falls back to the cumulative peak where that is
    not possible.
    """
    phase = _phase_peak_mb()
    marks[label] = {"rss": current_memory_mb(), "peak": peak_memory_mb(),
                    "phase_peak": phase if phase is not None else peak_memory_mb()}
    _reset_phase_peak()


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
    rho, k, pk, modes : mtf.Tensor
        Outputs of the current state (density, its binned power spectrum).
    """

    def __init__(self, conf, mesh, stages=None):
        self.conf = conf
        self.stages = nbody.default_stages(conf) if stages is None else [float(a) for a in stages]
        linear = ics.linear_field(conf, mesh)
        kernels = nbody.make_kernels(conf, mesh)
        init = lpt.lpt_init(linear, conf, a=self.stages[0])
        # As nbody.nbody: the first kick uses the PM force at the LPT positions.
        init = lpt.State(init.positions, init.momenta,
                         gravity.pm_forces(init.positions, conf, kernels))
        shape = init.positions.shape
        self.variables = lpt.State(*[
            mtf.get_variable(mesh, name, shape, dtype=conf.tf_dtype, trainable=False,
                             initializer=tf.zeros_initializer())
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
        self.step_factors = [nbody.step_factors(conf, a0, a1)
                             for a0, a1 in zip(self.stages[:-1], self.stages[1:])]
        x = self.variables.positions
        self.rho = painting.paint_field(x, conf)
        self.k, self.pk, self.modes = power.power_spectrum(self.rho - 1.0, conf,
                                                           deconvolve_cic=False)
        self.cell_size = np.asarray(conf.cell_size)


def _state_parts(conf, arrays):
    """``pnum -> checkpoint part`` from fetched local slices of the state."""
    parts = {}
    for pnum, (block, pos, mom, force) in arrays.items():
        origin = [block[0] * conf.block_shape[0], block[1] * conf.block_shape[1], 0]
        parts[pnum] = {"block": block, "origin": origin, "id": io.lagrangian_ids(conf, block),
                       "positions": pos, "momenta": mom, "forces": force}
    return parts


def run(conf, mesh_impl, session_config, out_dir, rank=0, gather_stats=None, plot=True, *,
        comm=None, checkpoint_every=None, resume=False, keep_checkpoints=2):
    """Build, run and write one simulation; no rank gathers a full-size array.

    Parameters
    ----------
    conf : SimConfig
    mesh_impl : mtf.MeshImpl
        Any Mesh TF implementation (HvdSimdMeshImpl, PlacementMeshImpl, ...).
    session_config : tf.ConfigProto
    out_dir : str
    rank : int
        This process's rank (``comm.rank`` when ``comm`` is given).
    gather_stats : callable, optional
        Deprecated: ``f(value) -> list`` over ranks; ``comm.allgather`` is used
        when ``comm`` is given.
    plot : bool
        Write ``overview.png``.
    comm : object, optional
        mpi4py-like communicator over the job's processes (default: this
        process alone, :class:`flowpm_mtf.h5dist.SelfComm`).
    checkpoint_every : int, optional
        Write a checkpoint into ``out_dir/checkpoint`` every K steps.
    resume : bool
        Continue from the newest valid checkpoint in ``out_dir``.
    keep_checkpoints : int
        Complete checkpoints kept.

    Returns
    -------
    dict
        The summary written to ``summary.json`` (``"stopped": True`` and no
        outputs if SIGTERM ended the run early after a checkpoint).
        ``memory_phases_mb_per_rank``: per rank, the current and peak RSS [MB]
        at the phase boundaries ``start`` (imports done), ``graph`` (graph
        built and lowered, variables initialised), ``ics`` (initial conditions
        or restored state), ``steps`` and ``output``.
    """
    if comm is None:
        comm = h5dist.SelfComm()
        if gather_stats is None:
            gather_stats = comm.allgather
    else:
        gather_stats = comm.allgather
        rank = comm.rank
    # SIGTERM is recorded from here on (also during graph build and ICs) and acted on at
    # the first step boundary all ranks agree on.
    with checkpoint.StopRequest(comm) as stop:
        return _run(conf, mesh_impl, session_config, out_dir, rank, gather_stats, plot, comm,
                    checkpoint_every, resume, keep_checkpoints, stop)


def _run(conf, mesh_impl, session_config, out_dir, rank, gather_stats, plot, comm,
         checkpoint_every, resume, keep_checkpoints, stop):
    timings, marks = {}, {}
    _mark(marks, "start")
    t0 = time.perf_counter()
    tf.disable_eager_execution()
    with tf.Graph().as_default():
        graph = mtf.Graph()
        mesh = mtf.Mesh(graph, "mesh")
        sim = SimulationGraph(conf, mesh)
        lowering = mtf.Lowering(graph, {mesh: mesh_impl})
        init_op = tf.group([lowering.lowered_operation(op) for op in sim.init_ops])
        step_op = tf.group([lowering.lowered_operation(op) for op in sim.step_ops])
        # This process's slices only: no gather of a full-size array.
        state_slices = [h5dist.local_slices(lowering, v) for v in sim.variables]
        rho_slices = h5dist.local_slices(lowering, sim.rho)
        spectrum = {name: h5dist.replicated_value(lowering, getattr(sim, name))
                    for name in ("k", "pk", "modes")}
        restore_ph, restore_op = [], []
        for v in sim.variables:
            laid_out = lowering.variables[v.operation]
            phs = [tf.placeholder(t.dtype, t.shape) for t in laid_out.laid_out_tensor.tensor_list]
            restore_ph.append(phs)
            restore_op.append(laid_out.assign_to_slices(mtf.assign_slice, phs))
        restore_op = tf.group(restore_op)
        copy_masters = lowering.copy_masters_to_slices()
        blocks = {p: (b[0], b[1]) for p, _, b in state_slices[0]}
        timings["graph_build_s"] = time.perf_counter() - t0
        log.info("graph built in %.1f s (%d steps, mesh %s, grid %s)", timings["graph_build_s"],
                 conf.n_steps, "x".join(map(str, conf.nc)), "x".join(map(str, conf.grid)))

        def fetch_state(sess):
            vals = sess.run([[t for _, t, _ in s] for s in state_slices])
            return {p: (blocks[p],) + tuple(vals[v][i] for v in range(3))
                    for i, (p, _, _) in enumerate(state_slices[0])}

        with tf.Session(config=session_config) as sess:
            t = time.perf_counter()
            sess.run(tf.global_variables_initializer())
            sess.run(copy_masters)
            _mark(marks, "graph")
            start = 0
            if resume:
                manifest, parts = checkpoint.load(out_dir, comm, conf, blocks)
                feed = {}
                for v, (phs, slices) in enumerate(zip(restore_ph, state_slices)):
                    for ph, (p, _, _) in zip(phs, slices):
                        feed[ph] = parts[p][checkpoint.STATE_NAMES[v]].reshape(
                            ph.shape.as_list())
                sess.run(restore_op, feed)
                start = int(manifest["step"])
                timings["restore_s"] = time.perf_counter() - t
                log.info("restored step %d/%d (a=%.4f) in %.2f s", start, conf.n_steps,
                         sim.stages[start], timings["restore_s"])
            else:
                sess.run(init_op)
                timings["ics_s"] = time.perf_counter() - t
                log.info("initial conditions (%dLPT at a=%g) in %.2f s", conf.lpt_order,
                         conf.a_start, timings["ics_s"])
            _mark(marks, "ics")
            steps, stopped = [], False
            for i in range(start, len(sim.step_factors)):
                t = time.perf_counter()
                sess.run(step_op, {sim.factors: sim.step_factors[i]})
                steps.append(time.perf_counter() - t)
                log.info("step %d/%d to a=%.4f in %.2f s (elapsed %.1f s)", i + 1,
                         conf.n_steps, sim.stages[i + 1], steps[-1], time.perf_counter() - t0)
                done = i + 1
                stopped = stop.agreed() and done < conf.n_steps
                if done < conf.n_steps and (stopped or (
                        checkpoint_every and done % int(checkpoint_every) == 0)):
                    t = time.perf_counter()
                    checkpoint.save(out_dir, comm, done, sim.stages[done], conf.to_dict(),
                                    _state_parts(conf, fetch_state(sess)), grid=conf.grid,
                                    keep=keep_checkpoints)
                    timings.setdefault("checkpoint_s", []).append(time.perf_counter() - t)
                if stopped:
                    log.warning("stopped by signal after step %d/%d; checkpoint in %s; "
                                "continue with: %s", done, conf.n_steps,
                                checkpoint.step_dir(out_dir, done),
                                checkpoint.resume_command(out_dir))
                    break
            timings["steps_s"] = steps
            timings["nbody_s"] = float(sum(steps))
            _mark(marks, "steps")
            if stopped:
                return {"config": conf.to_dict(), "timings": timings, "stopped": True,
                        "step": done}
            t = time.perf_counter()
            state = fetch_state(sess)
            rho, spec = sess.run([[t for _, t, _ in rho_slices], spectrum])
            timings["fetch_s"] = time.perf_counter() - t
    t = time.perf_counter()
    a = conf.a_end
    n = int(np.prod(conf.nc))
    parts = {}
    for (p, _, begin), rho_p in zip(rho_slices, rho):
        block, pos, mom, _ = state[p]
        parts[p] = io.particle_part(conf, block, pos, mom, a)
        parts[p]["density"] = h5dist.Block(rho_p, begin, conf.nc)
    os.makedirs(out_dir, exist_ok=True)
    io.write_snapshot_distributed(os.path.join(out_dir, "snapshot.h5"), comm, parts, attrs=conf)
    depth = max(1, conf.nc[2] // 8)
    slab = h5dist.gather_slab(comm, [(r[:, :, :depth].mean(axis=2), b[:2])
                                     for (_, _, b), r in zip(rho_slices, rho)], conf.nc[:2])
    timings["write_s"] = time.perf_counter() - t
    _mark(marks, "output")
    mem = peak_memory_mb()
    mem_all = gather_stats(mem)
    timings["total_s"] = time.perf_counter() - t0
    summary = {"config": conf.to_dict(), "timings": timings, "peak_memory_mb_per_rank": mem_all,
               "memory_phases_mb_per_rank": gather_stats(marks),
               "n_particles": n, "versions": io.versions(),
               "bytes_per_particle_peak": max(mem_all) * 2**20 * len(mem_all) / n}
    if resume:
        summary["resumed_from_step"] = start
    if rank == 0:
        keep = spec["modes"] > 0
        io.write_power(os.path.join(out_dir, "power.txt"), spec["k"][keep], spec["pk"][keep],
                       spec["modes"][keep], rank=0)
        with open(os.path.join(out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1, default=float)
        if plot:
            overview_plot(os.path.join(out_dir, "overview.png"), conf, slab,
                          spec["k"][keep], spec["pk"][keep], depth)
        log.info("wrote %s (total %.1f s, peak memory %.0f MB on rank 0)", out_dir,
                 timings["total_s"], mem)
    return summary


def overview_plot(path, conf, slab, k, pk, depth):
    """Density slab and measured P(k) vs the growth-scaled linear P(k).

    Parameters
    ----------
    slab : ndarray
        ``[NX, NY]`` mean of 1 + delta over the first ``depth`` cells along z
        (from :func:`flowpm_mtf.h5dist.gather_slab`: only this 2D array is
        gathered).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4.6))
    ax0.imshow(np.log10(slab.T + 1e-2), origin="lower", cmap="magma",
               extent=[0, conf.box_size[0], 0, conf.box_size[1]])
    ax0.set_xlabel("x [Mpc/h]")
    ax0.set_ylabel("y [Mpc/h]")
    ax0.set_title("log10(1+delta), slab of %d cells, a=%.2f" % (depth, conf.a_end))
    kk = np.logspace(np.log10(k.min()), np.log10(k.max()), 200)
    d1 = cosmo_mod.growth(conf.cosmology, np.array([conf.a_end])).D1[0]
    ax1.loglog(k, pk, "o-", ms=3, label="measured (CIC, not deconvolved)")
    ax1.loglog(kk, d1**2 * cosmo_mod.linear_matter_power(conf.cosmology, kk), "k--",
               label="linear, D1(a)^2 P_lin")
    ax1.set_xlabel("k [h/Mpc]")
    ax1.set_ylabel("P(k) [(Mpc/h)^3]")
    ax1.legend()
    ax1.set_title("power spectrum at a=%.2f" % conf.a_end)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
