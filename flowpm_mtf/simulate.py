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
from . import gravity, ics, io, lpt, nbody, painting, power
from .logs import rank0_only
from .preflight import unfolded_zeros_initializer

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
        init = lpt.State(init.positions, init.momenta,
                         gravity.pm_forces(init.positions, conf, kernels))
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


def run(conf, mesh_impl, session_config, out_dir, rank=0, gather_stats=None, plot=True):
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

    Returns
    -------
    dict
        The summary written to ``summary.json``.
    """
    timings = {}
    t0 = time.perf_counter()
    tf.disable_eager_execution()
    with tf.Graph().as_default():
        graph = mtf.Graph()
        mesh = mtf.Mesh(graph, "mesh")
        sim = SimulationGraph(conf, mesh)
        lowering = mtf.Lowering(graph, {mesh: mesh_impl})
        init_op = tf.group([lowering.lowered_operation(op) for op in sim.init_ops])
        step_op = tf.group([lowering.lowered_operation(op) for op in sim.step_ops])
        fetch = {name: lowering.export_to_tf_tensor(getattr(sim, name))
                 for name in ("rho", "k", "pk", "modes", "position", "momentum")}
        copy_masters = lowering.copy_masters_to_slices()
        timings["graph_build_s"] = time.perf_counter() - t0
        log.info("graph built in %.1f s (%d steps, mesh %s, grid %s)", timings["graph_build_s"],
                 conf.n_steps, "x".join(map(str, conf.nc)), "x".join(map(str, conf.grid)))
        with tf.Session(config=session_config) as sess:
            t = time.perf_counter()
            sess.run(tf.global_variables_initializer())
            sess.run(copy_masters)
            sess.run(init_op)
            timings["ics_s"] = time.perf_counter() - t
            log.info("initial conditions (%dLPT at a=%g) in %.2f s", conf.lpt_order,
                     conf.a_start, timings["ics_s"])
            steps = []
            for i, factors in enumerate(sim.step_factors):
                t = time.perf_counter()
                sess.run(step_op, {sim.factors: factors})
                steps.append(time.perf_counter() - t)
                log.info("step %d/%d to a=%.4f in %.2f s (elapsed %.1f s)", i + 1, conf.n_steps,
                         sim.stages[i + 1], steps[-1], time.perf_counter() - t0)
            timings["steps_s"] = steps
            timings["nbody_s"] = float(sum(steps))
            t = time.perf_counter()
            res = sess.run(fetch)
            timings["gather_s"] = time.perf_counter() - t
    a = conf.a_end
    n = int(np.prod(conf.nc))
    position = (res["position"].reshape(n, 3) * sim.cell_size) % np.asarray(conf.box_size)
    # p = a^3 E dx/da in cells with H0 = 1: peculiar velocity v = H0 p / a.
    velocity = res["momentum"].reshape(n, 3) * sim.cell_size * 100.0 / a
    mem = peak_memory_mb()
    mem_all = gather_stats(mem) if gather_stats is not None else [mem]
    timings["total_s"] = time.perf_counter() - t0
    summary = {"config": conf.to_dict(), "timings": timings, "peak_memory_mb_per_rank": mem_all,
               "n_particles": n, "versions": io.versions(),
               "bytes_per_particle_peak": max(mem_all) * 2**20 * len(mem_all) / n}
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        io.write_snapshot(os.path.join(out_dir, "snapshot.h5"), position=position,
                          velocity=velocity, density=res["rho"], attrs=conf, rank=0)
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
