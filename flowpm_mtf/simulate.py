"""The main job: Gaussian ICs -> LPT -> FastPM N-body -> snapshot, P(k), plots.

The simulation graph is built once. The particle state lives in Mesh TF
variables on the process grid; the ICs and every kick-drift-kick step are
separate assign operations run one after the other, so progress and timings
are logged per step without rebuilding anything.

Outputs (written by rank 0 into ``out_dir``)
--------------------------------------------
snapshot.h5
    ``position`` [N, 3] [Mpc/h], ``velocity`` [N, 3] [km/s] (peculiar),
    ``density`` [NX, NY, NZ] (1 + delta, CIC), attributes with the config and
    versions. Particles are in their initial-lattice order.
power.txt
    k [h/Mpc], P(k) [(Mpc/h)^3], number of modes.
summary.json
    Config, timings per phase and per step [s], peak memory per rank [MB],
    versions.
overview.png
    A density slice and the measured P(k) against the growth-scaled linear P(k).
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
from . import domain, gravity, ics, io, lpt, nbody, painting, power
from .errors import CapacityError
from .logs import rank0_only

log = rank0_only(logging.getLogger(__name__))  # progress: every rank would repeat it


def peak_memory_mb():
    """Peak resident memory of this process [MB] (``ru_maxrss``)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


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
        self.stages = nbody.default_stages(conf) if stages is None else [float(a) for a in stages]
        linear = ics.linear_field(conf, mesh)
        kernels = nbody.make_kernels(conf, mesh)
        init = lpt.lpt_init(linear, conf, a=self.stages[0])
        # As nbody.nbody: the first kick uses the PM force at the LPT positions.
        init = init._replace(forces=gravity.pm_forces(init.positions, conf, kernels,
                                                      domain.weights(init.ids, conf)))
        shape = init.positions.shape
        self.variables = lpt.State(*[
            mtf.get_variable(mesh, name, shape, dtype=conf.tf_dtype, trainable=False,
                             initializer=tf.zeros_initializer())
            for name in ("positions", "momenta", "forces")],
            ids=mtf.get_variable(mesh, "ids", init.ids.shape, dtype=init.ids.dtype,
                                 trainable=False, initializer=tf.zeros_initializer()))
        self.init_ops = [mtf.assign(v, t) for v, t in zip(self.variables[:4], init[:4])]
        self.init_stats = init.stats
        # One step for all steps: the time-integration factors are fed per run
        # (lowering ten copies of the step tripled the graph-build time, and TF
        # paid its first-run graph optimisation once per copy).
        self.factors = tf.placeholder(conf.tf_dtype, [3], name="step_factors")
        fac = mtf.import_tf_tensor(mesh, self.factors, mtf.Shape([mtf.Dimension("factor", 3)]))
        new = nbody.kdk_step(self.variables, conf, kernels=kernels,
                             factors=mtf.unstack(fac, fac.shape.dims[0]))
        self.step_ops = [mtf.assign(v, t) for v, t in zip(self.variables[:4], new[:4])]
        self.step_stats = new.stats     # migration statistics of the step (or None)
        self.step_factors = [nbody.step_factors(conf, a0, a1)
                             for a0, a1 in zip(self.stages[:-1], self.stages[1:])]
        x, p = self.variables.positions, self.variables.momenta
        self.weights = domain.weights(self.variables.ids, conf)
        self.rho = painting.paint_field(x, conf, self.weights)
        self.k, self.pk, self.modes = power.power_spectrum(self.rho - 1.0, conf,
                                                           deconvolve_cic=False)
        # every slot (global position, momentum, id): sorted by id on rank 0
        self.position = painting.to_global(x, conf)
        self.momentum = p
        self.ids = self.variables.ids
        self.cell_size = np.asarray(conf.cell_size)


def run(conf, mesh_impl, session_config, out_dir, rank=0, gather_stats=None, plot=True,
        max_retries=3):
    """Build, run and write one simulation.

    Parameters
    ----------
    conf : SimConfig
    mesh_impl : mtf.MeshImpl
        Any Mesh TF implementation (HvdSimdMeshImpl, PlacementMeshImpl, ...).
    session_config : tf.ConfigProto
    out_dir : str
    rank : int
        This process's rank; rank 0 writes the outputs.
    gather_stats : callable, optional
        ``f(value) -> list`` of the value on every rank (e.g. an MPI allgather);
        used for the per-rank peak memory. Default: this process only.
    plot : bool
        Write ``overview.png``.
    max_retries : int
        Rebuild and rerun at most this many times with the larger particle
        capacities a :class:`~flowpm_mtf.errors.CapacityError` names.

    Returns
    -------
    dict
        The summary written to ``summary.json``.

    Raises
    ------
    flowpm_mtf.errors.CapacityError
        If the buffers still overflow after ``max_retries`` rebuilds.
    flowpm_mtf.errors.ParticleEscapeError
        If a particle moved more than one block in one step (names a number of
        steps that would work).
    """
    t0 = time.perf_counter()
    for attempt in range(max_retries + 1):
        try:
            sim, res, timings, mig = _run_graph(conf, mesh_impl, session_config, t0)
            break
        except tf.errors.InvalidArgumentError as exc:
            err = domain.error_from_tf(exc, conf)
            if err is None:
                raise
            if isinstance(err, CapacityError) and attempt < max_retries:
                log.warning("%s: rebuilding with capacity %d, send_capacity %d", err,
                            err.capacity, err.send_capacity)
                conf = conf.replace(capacity=err.capacity, send_capacity=err.send_capacity)
                continue
            raise err from None
    a = conf.a_end
    valid = res["ids"].reshape(-1) >= 0
    order = np.argsort(res["ids"].reshape(-1)[valid], kind="stable")
    ids = res["ids"].reshape(-1)[valid][order]
    position = (res["position"].reshape(-1, 3)[valid][order] * sim.cell_size
                ) % np.asarray(conf.box_size)
    # p = a^3 E dx/da in cells with H0 = 1: peculiar velocity v = H0 p / a.
    velocity = res["momentum"].reshape(-1, 3)[valid][order] * sim.cell_size * 100.0 / a
    n = int(ids.size)
    if n != conf.n_particles or np.any(ids != np.arange(n)):
        raise RuntimeError("simulate: the final state holds %d particles with ids that are not "
                           "0..%d" % (n, conf.n_particles - 1))
    mem = peak_memory_mb()
    mem_all = gather_stats(mem) if gather_stats is not None else [mem]
    timings["total_s"] = time.perf_counter() - t0
    summary = {"config": conf.to_dict(), "timings": timings, "peak_memory_mb_per_rank": mem_all,
               "migration": mig,
               "n_particles": n, "versions": io.versions(),
               "bytes_per_particle_peak": max(mem_all) * 2**20 * len(mem_all) / n}
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        io.write_snapshot(os.path.join(out_dir, "snapshot.h5"), position=position,
                          velocity=velocity, density=res["rho"], attrs=conf, rank=0, ids=ids)
        keep = res["modes"] > 0
        io.write_power(os.path.join(out_dir, "power.txt"), res["k"][keep], res["pk"][keep],
                       res["modes"][keep], rank=0)
        with open(os.path.join(out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1, default=float)
        if plot:
            overview_plot(os.path.join(out_dir, "overview.png"), conf, res["rho"],
                          res["k"][keep], res["pk"][keep])
        log.info("wrote %s (total %.1f s, peak memory %.0f MB on rank 0)", out_dir,
                 timings["total_s"], mem)
    return summary


def migration_summary(conf, stats, timings):
    """The ``migration`` entry of summary.json from the per-step statistics.

    Parameters
    ----------
    conf : SimConfig
    stats : list of (str, ndarray or None)
        ``(label, stats)`` of the IC migration and of every step
        (:data:`flowpm_mtf.domain.STATS`).
    timings : dict

    Returns
    -------
    dict
        Decomposition, capacities, bytes sent per rank per step, and per step
        the particles of the fullest block, the mean, their ratio (load
        imbalance), the most particles one block sent and the largest
        displacement [cells].
    """
    out = {"decomposition": conf.decomposition, "halo_size": conf.halo_size,
           "capacity": domain.capacity(conf)}
    if conf.decomposition == "lagrangian":
        return out
    mean = conf.n_particles / conf.n_ranks
    out.update({"send_capacity": domain.send_capacity(conf),
                "bytes_sent_per_rank_per_step": domain.bytes_per_migration(conf, 1),
                "mean_particles_per_rank": mean, "steps": []})
    for label, st in stats:
        d = dict(zip(domain.STATS, (float(v) for v in st)))
        out["steps"].append({"stage": label, "max_particles_per_rank": d["count"],
                             "imbalance": d["count"] / mean, "moved_max": d["moved"],
                             "send_max": d["send"], "displacement_max_cells": d["displacement"]})
    out["imbalance_max"] = max(s["imbalance"] for s in out["steps"])
    return out


def _run_graph(conf, mesh_impl, session_config, t0):
    """Build the graph and run ICs and steps; returns (sim, fetched results, timings,
    migration summary)."""
    timings = {}
    tf.disable_eager_execution()
    with tf.Graph().as_default():
        graph = mtf.Graph()
        mesh = mtf.Mesh(graph, "mesh")
        sim = SimulationGraph(conf, mesh)
        lowering = mtf.Lowering(graph, {mesh: mesh_impl})
        init_op = tf.group([lowering.lowered_operation(op) for op in sim.init_ops])
        step_op = tf.group([lowering.lowered_operation(op) for op in sim.step_ops])
        stats = [lowering.export_to_tf_tensor(t) if t is not None else tf.no_op()
                 for t in (sim.init_stats, sim.step_stats)]
        fetch = {name: lowering.export_to_tf_tensor(getattr(sim, name))
                 for name in ("rho", "k", "pk", "modes", "position", "momentum", "ids")}
        copy_masters = lowering.copy_masters_to_slices()
        timings["graph_build_s"] = time.perf_counter() - t0
        log.info("graph built in %.1f s (%d steps, mesh %s, grid %s, %s decomposition, "
                 "halo %d, capacity %d)", timings["graph_build_s"], conf.n_steps,
                 "x".join(map(str, conf.nc)), "x".join(map(str, conf.grid)),
                 conf.decomposition, conf.halo_size, domain.capacity(conf))
        mig = []
        with tf.Session(config=session_config) as sess:
            t = time.perf_counter()
            sess.run(tf.global_variables_initializer())
            sess.run(copy_masters)
            mig.append(("ics", sess.run([init_op, stats[0]])[1]))
            timings["ics_s"] = time.perf_counter() - t
            log.info("initial conditions (%dLPT at a=%g) in %.2f s", conf.lpt_order,
                     conf.a_start, timings["ics_s"])
            steps = []
            for i, factors in enumerate(sim.step_factors):
                t = time.perf_counter()
                mig.append(("step %d" % (i + 1),
                            sess.run([step_op, stats[1]], {sim.factors: factors})[1]))
                steps.append(time.perf_counter() - t)
                log.info("step %d/%d to a=%.4f in %.2f s (elapsed %.1f s)", i + 1, conf.n_steps,
                         sim.stages[i + 1], steps[-1], time.perf_counter() - t0)
            timings["steps_s"] = steps
            timings["nbody_s"] = float(sum(steps))
            t = time.perf_counter()
            res = sess.run(fetch)
            timings["gather_s"] = time.perf_counter() - t
    mig = migration_summary(conf, [m for m in mig if m[1] is not None], timings)
    return sim, res, timings, mig


def overview_plot(path, conf, rho, k, pk):
    """Density slice and measured P(k) vs the growth-scaled linear P(k)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4.6))
    depth = max(1, conf.nc[2] // 8)
    ax0.imshow(np.log10(rho[:, :, :depth].mean(axis=2).T + 1e-2), origin="lower", cmap="magma",
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
