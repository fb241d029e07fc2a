"""The lensing job: N-body on the lightcone, density planes, Born convergence maps.

As :mod:`flowpm_mtf.simulate`, the graph is built once: the particle state and
the lens planes live in Mesh TF variables on the process grid, and the ICs,
every kick-drift-kick step and the painting of the planes of each stage are
assign operations run one after the other (progress and timings per step). The
stages are those of the simulation plus the scale factor of every plane centre
(:func:`flowpm_mtf.lensing.lightcone_stages`), so each plane is painted from
the particles at its own time. After painting the planes of a stage, the job
also measures the 3D P(k) of the particles there: it is the input of the Limber
prediction of the convergence power spectrum.

Outputs (written by rank 0 into ``out_dir``)
--------------------------------------------
kappa.h5
    ``kappa`` [n_source, npix, npix] (``kappa[s, i, j]`` at ``theta[i], theta[j]``),
    ``theta`` [npix] [rad], ``planes`` [n_planes, NX, NY] (1 + delta),
    ``plane_k`` [n_planes, nbins] [h/Mpc], ``plane_pk`` [n_planes, nbins]
    [(Mpc/h)^3] (3D P(k) of the particles at each plane's scale factor, CIC
    window not deconvolved, empty bins dropped to 0); attributes: ``config``
    (SimConfig JSON), ``lensing`` (LensingConfig JSON), ``geometry`` (plane
    distances, widths, scale factors, source distances; JSON), ``z_source``,
    ``field_deg``, ``versions``.
kappa_power.txt
    ell, then per source the measured flat-sky C_ell and the Limber prediction
    from the measured P(k) [sr], then the number of modes per bin.
summary.json
    Configs, timings per phase and per step [s], peak memory per rank [MB].
kappa.png
    The first source's map and the power spectra against the prediction.
"""
import json
import logging
import os
import time

import mesh_tensorflow as mtf
import numpy as np
import tensorflow.compat.v1 as tf

from . import io, lensing
from .logs import rank0_only
from .preflight import unfolded_zeros_initializer
from .simulate import SimulationGraph, peak_memory_mb

log = rank0_only(logging.getLogger(__name__))

LENSING_DEFAULTS = {"nc": 64, "box_size": 256.0, "lpt_order": 2, "a_start": 0.2, "a_end": 1.0,
                    "n_steps": 10, "dtype": "float32"}
"""SimConfig defaults of ``flowpm-mtf lensing`` (a lightcone to z = 1 in a 256 Mpc/h box)."""
LENSING_CONFIG_DEFAULTS = {"z_source": (1.0,), "field_deg": 5.0, "field_npix": 128,
                           "n_planes": 12}
"""LensingConfig defaults of ``flowpm-mtf lensing``: 12 shells of 192 Mpc/h."""


class LensingGraph(SimulationGraph):
    """The mtf graph of a lensing run: the simulation's state and step
    (:class:`flowpm_mtf.simulate.SimulationGraph` on the lightcone's stages),
    plus plane variables, plane assignments and the Born maps.

    Parameters
    ----------
    conf : SimConfig
    geom : lensing.LightconeGeometry
    mesh : mtf.Mesh
    """

    def __init__(self, conf, geom, mesh):
        self.geom = geom
        stages, self.plane_stage = lensing.lightcone_stages(conf, geom)
        super().__init__(conf, mesh, stages)
        x = self.variables.positions
        plane_shape = mtf.Shape([mtf.Dimension(n, s) for n, s in zip(("x", "y"), conf.nc[:2])])
        self.planes = [mtf.get_variable(mesh, "plane_%d" % i, plane_shape, dtype=conf.tf_dtype,
                                        trainable=False, initializer=unfolded_zeros_initializer())
                       for i in range(geom.n_planes)]
        # plane_ops[j]: assignments of the planes painted at stage j
        self.plane_ops = {}
        for i, j in enumerate(self.plane_stage):
            self.plane_ops.setdefault(int(j), []).append(
                mtf.assign(self.planes[i], lensing.density_plane(x, conf, geom, i)))
        self.kappa = lensing.born_convergence(self.planes, conf, geom)


def run(conf, lconf, mesh_impl, session_config, out_dir, rank=0, gather_stats=None, plot=True):
    """Build, run and write one lensing simulation.

    Parameters
    ----------
    conf : SimConfig
    lconf : lensing.LensingConfig
    mesh_impl : mtf.MeshImpl
    session_config : tf.ConfigProto
    out_dir : str
    rank : int
        This process's rank; rank 0 writes the outputs.
    gather_stats : callable, optional
        ``f(value) -> list`` over ranks (peak memory).
    plot : bool
        Write ``kappa.png``.

    Returns
    -------
    dict
        The summary written to ``summary.json``.

    Raises
    ------
    ValueError
        Before anything is built, for an impossible lightcone (see
        :func:`flowpm_mtf.lensing.geometry`).
    """
    geom = lensing.geometry(conf, lconf)   # every rank raises the same error here
    timings = {}
    t0 = time.perf_counter()
    tf.disable_eager_execution()
    with tf.Graph().as_default():
        graph = mtf.Graph()
        mesh = mtf.Mesh(graph, "mesh")
        g = LensingGraph(conf, geom, mesh)
        lowering = mtf.Lowering(graph, {mesh: mesh_impl})

        def lowered(ops):
            return tf.group([lowering.lowered_operation(op) for op in ops])

        init_op = lowered(g.init_ops)
        step_op = lowered(g.step_ops)
        n_steps = len(g.step_factors)
        plane_ops = {j: lowered(ops) for j, ops in g.plane_ops.items()}
        fetch_pk = {name: lowering.export_to_tf_tensor(getattr(g, name))
                    for name in ("k", "pk", "modes")}
        fetch = {"kappa": lowering.export_to_tf_tensor(g.kappa),
                 "planes": [lowering.export_to_tf_tensor(p) for p in g.planes]}
        copy_masters = lowering.copy_masters_to_slices()
        timings["graph_build_s"] = time.perf_counter() - t0
        log.info("graph built in %.1f s: %d steps to a=%.4f, %d planes to z=%g, mesh %s, grid %s",
                 timings["graph_build_s"], n_steps, g.stages[-1], geom.n_planes,
                 geom.z_source.max(), "x".join(map(str, conf.nc)), "x".join(map(str, conf.grid)))
        plane_pk = {}
        with tf.Session(config=session_config) as sess:
            t = time.perf_counter()
            sess.run(tf.global_variables_initializer())
            sess.run(copy_masters)
            sess.run(init_op)
            timings["ics_s"] = time.perf_counter() - t
            log.info("initial conditions (%dLPT at a=%g) in %.2f s", conf.lpt_order,
                     g.stages[0], timings["ics_s"])
            steps, planes_s = [], []
            for j in range(len(g.stages)):
                t = time.perf_counter()
                if j > 0:
                    sess.run(step_op, {g.factors: g.step_factors[j - 1]})
                t_step = time.perf_counter() - t
                if j in plane_ops:
                    sess.run(plane_ops[j])
                    res = sess.run(fetch_pk)
                    for i in np.nonzero(g.plane_stage == j)[0]:
                        plane_pk[int(i)] = res
                if j > 0:
                    steps.append(time.perf_counter() - t)
                    names = np.nonzero(g.plane_stage == j)[0]
                    log.info("step %d/%d to a=%.4f in %.2f s%s (elapsed %.1f s)", j,
                             n_steps, g.stages[j], steps[-1],
                             ", plane %s at r=%s Mpc/h" % (",".join(map(str, names)), ",".join(
                                 "%.0f" % geom.r[i] for i in names)) if names.size else "",
                             time.perf_counter() - t0)
                    planes_s.append(steps[-1] - t_step)
            timings["steps_s"] = steps
            timings["planes_s"] = float(sum(planes_s))
            timings["nbody_s"] = float(sum(steps))
            t = time.perf_counter()
            res = sess.run(fetch)
            timings["born_s"] = time.perf_counter() - t
    kappa = np.asarray(res["kappa"], np.float64)
    planes = np.stack(res["planes"]).astype(np.float64)
    keep = plane_pk[0]["modes"] > 0
    plane_k = np.stack([plane_pk[i]["k"][keep] for i in range(geom.n_planes)])
    plane_p = np.stack([plane_pk[i]["pk"][keep] for i in range(geom.n_planes)]).astype(np.float64)
    edges = None
    cls = [lensing.kappa_power_spectrum(m, geom.field_deg, edges) for m in kappa]
    ell, n_modes = cls[0][0], cls[0][2]
    ok = n_modes > 0
    measured = np.stack([c[1] for c in cls])[:, ok]
    limber = np.stack([lensing.limber_cl(ell[ok], conf, geom, list(zip(plane_k, plane_p)), s)
                       for s in range(geom.n_source)])
    ell, n_modes = ell[ok], n_modes[ok]
    mem = peak_memory_mb()
    mem_all = gather_stats(mem) if gather_stats is not None else [mem]
    timings["total_s"] = time.perf_counter() - t0
    summary = {"config": conf.to_dict(), "lensing": lconf.to_dict(), "timings": timings,
               "n_stages": int(len(g.stages)), "stages": list(g.stages),
               "peak_memory_mb_per_rank": mem_all, "versions": io.versions(),
               "kappa_rms": kappa.std(axis=(1, 2)).tolist()}
    if rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        write_kappa(os.path.join(out_dir, "kappa.h5"), kappa, planes, plane_k, plane_p, conf,
                    lconf, geom)
        write_kappa_power(os.path.join(out_dir, "kappa_power.txt"), ell, measured, limber,
                          n_modes, geom)
        with open(os.path.join(out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1, default=float)
        if plot:
            kappa_plot(os.path.join(out_dir, "kappa.png"), kappa[0], geom, ell, measured, limber)
        log.info("wrote %s (kappa rms %s, total %.1f s, peak memory %.0f MB on rank 0)", out_dir,
                 ", ".join("%.3g" % v for v in summary["kappa_rms"]), timings["total_s"], mem)
    return summary


def write_kappa(path, kappa, planes, plane_k, plane_pk, conf, lconf, geom):
    """Write ``kappa.h5`` (see the module docstring); temporary name, then rename."""
    import h5py

    tmp = "%s.tmp-%d" % (path, os.getpid())
    try:
        with h5py.File(tmp, "w") as f:
            f.create_dataset("kappa", data=kappa).attrs["units"] = "dimensionless"
            f.create_dataset("theta", data=geom.theta).attrs["units"] = "rad"
            f.create_dataset("planes", data=planes).attrs["units"] = "1 + delta (shell average)"
            f.create_dataset("plane_k", data=plane_k).attrs["units"] = "h/Mpc"
            f.create_dataset("plane_pk", data=plane_pk).attrs["units"] = "(Mpc/h)^3"
            f.attrs["format"] = "flowpm_mtf.kappa/1"
            f.attrs["config"] = conf.to_json()
            f.attrs["lensing"] = json.dumps(lconf.to_dict(), sort_keys=True)
            f.attrs["geometry"] = json.dumps(geom.to_dict(), sort_keys=True)
            f.attrs["z_source"] = geom.z_source
            f.attrs["field_deg"] = geom.field_deg
            f.attrs["plane_r"] = geom.r
            f.attrs["versions"] = json.dumps(io.versions(), sort_keys=True)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_kappa_power(path, ell, measured, limber, n_modes, geom):
    """Write ``kappa_power.txt``: ell, C_ell measured and Limber per source, modes."""
    cols, names = [ell], ["ell"]
    for s, z in enumerate(geom.z_source):
        cols += [measured[s], limber[s]]
        names += ["C_ell(z_s=%g)" % z, "C_ell_limber(z_s=%g)" % z]
    cols.append(n_modes)
    names.append("modes")
    header = ("flat-sky C_ell [sr] of the Born convergence (field %g deg, %d pixels) and the "
              "Limber prediction from the simulation's P(k) at the %d plane redshifts\n%s"
              % (geom.field_deg, geom.npix, geom.n_planes, "  ".join(names)))
    np.savetxt(path, np.column_stack(cols), header=header, fmt="%.10g")


def kappa_plot(path, kappa, geom, ell, measured, limber):
    """The first source's map and ell(ell+1) C_ell / 2 pi, measured and Limber."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4.6))
    half = 0.5 * geom.field_deg
    im = ax0.imshow(kappa.T, origin="lower", cmap="inferno", extent=[-half, half, -half, half])
    fig.colorbar(im, ax=ax0, label="kappa")
    ax0.set_xlabel("theta_x [deg]")
    ax0.set_ylabel("theta_y [deg]")
    ax0.set_title("Born convergence, z_s = %g" % geom.z_source[0])
    norm = ell * (ell + 1) / (2 * np.pi)
    for s, z in enumerate(geom.z_source):
        line, = ax1.loglog(ell, norm * measured[s], "o-", ms=3, label="measured, z_s=%g" % z)
        ax1.loglog(ell, norm * limber[s], "--", color=line.get_color(),
                   label="Limber from sim P(k), z_s=%g" % z)
    ax1.set_xlabel("ell")
    ax1.set_ylabel("ell (ell+1) C_ell / 2 pi")
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
