"""The lensing job: N-body on the lightcone, density planes, Born convergence maps.

``flowpm-mtf lensing``. As the simulate job, the graph is built once: the
particle state and the lens planes live in Mesh TF variables on the process
grid, and the ICs, every kick-drift-kick step and the painting of the planes
of each stage are assign operations run one after the other in the time loop
(progress and timings per step). The stages are those of the simulation plus
the scale factor of every plane centre
(:func:`flowpm_mtf.physics.lensing_geometry.lightcone_stages`), so each plane is painted from
the particles at its own time. After painting the planes of a stage, the job
also measures the 3D P(k) of the particles there: it is the input of the
Limber prediction of the convergence power spectrum.

Interruption
------------
The job checkpoints like ``simulate`` (``--checkpoint-every K``, ``--resume
OUT``, SIGTERM: :mod:`flowpm_mtf.runs.checkpoint`): a checkpoint holds the particle
state, every lens plane (each rank its own (x, y) block of each plane: the
planes painted so far, zero for the later ones) and the P(k) measured at the
plane stages so far; the Born maps are computed from the planes at the end.
The lensing settings are part of the checkpoint's config hash (they set the
stages and the planes), so a resume with other settings is refused. A resumed
run on the same process grid ends bit-identical to an uninterrupted one.

Outputs (written by rank 0 into the run directory)
---------------------------------------------------
kappa.h5
    Maps, planes (a virtual dataset over the per-rank blocks in ``kappa.parts/``)
    and the P(k) at each plane (:func:`flowpm_mtf.runs.io.write_kappa`).
kappa_power.txt
    ell, then per source the measured flat-sky C_ell and the Limber prediction
    from the measured P(k) [sr], then the number of modes per bin.
summary.json
    Configs, timings per phase and per step [s], peak memory per rank [MB].
kappa.png
    The first source's map and the power spectra against the prediction.
"""
import logging

import numpy as np

from ..runs import h5dist, io, preflight
from ..physics import lensing_geometry, lensing_stats, lensing_theory, pgd
from ..physics.lensing_geometry import FullSkyConfig
from ..config import SimConfig
from ..errors import ConfigError
from ..logs import rank0_only
from . import register
from .base import ConfigSection, Job

__all__ = ["LensingGraph", "LensingJob", "plane_names", "kappa_plot"]

log = rank0_only(logging.getLogger(__name__))


def __getattr__(name):
    """``LensingGraph``, loaded on first use: it lives in :mod:`flowpm_mtf.jobs.lensing_graph`
    (Mesh TF), so that the job's options and configs import no TensorFlow."""
    if name == "LensingGraph":
        from .lensing_graph import LensingGraph

        return LensingGraph
    raise AttributeError("module %r has no attribute %r" % (__name__, name))


@register
class LensingJob(Job):
    """Lightcone density planes and Born convergence maps (see the module docstring).

    Raises
    ------
    ValueError
        Before anything is built, for an impossible lightcone (see
        :func:`flowpm_mtf.physics.lensing_geometry.geometry`).
    """

    name = "lensing"
    help = "lightcone density planes and Born convergence maps"
    sections = (ConfigSection("config", SimConfig, {"box_size": 256.0, "a_start": 0.2}),
                ConfigSection("lensing", lensing_geometry.LensingConfig),
                ConfigSection("sky", FullSkyConfig),
                ConfigSection("pgd", pgd.PGDConfig))
    default_out = "out/lensing"
    checkpoints = True   # particles, planes and the P(k) at the planes so far
    state_sections = {"lensing": (), "sky": (), "pgd": ()}   # every setting shapes the maps

    def preflight(self, ctx):
        from . import lensing_fullsky, nbody_run

        # Sizes and memory first (from the options alone: the geometry allocates the rays),
        # then the lightcone's consistency; the same error on every rank.
        lensing_fullsky.check_options(ctx, self.sections)
        # PGD decided (automatic: where alpha is fitted for the cells) and alpha0, mu by the
        # cell size where not given: before the checkpoint's identity and summary.json
        # take them; either sky
        asked = ctx.configs["pgd"]
        try:
            pconf = ctx.configs["pgd"] = asked.resolve(ctx.conf)
            if pconf.pgd:
                pgd.check_blocks(ctx.conf)
        except ValueError as e:
            raise ConfigError(str(e))
        if asked.pgd is None:
            log.info("PGD %s (automatic; --pgd or --no-pgd to choose)",
                     "on: alpha0 %.4g, mu %.4g, the fit for %.3g Mpc/h cells"
                     % (pconf.pgd_alpha0, pconf.pgd_mu, max(ctx.conf.cell_size)) if pconf.pgd
                     else "off: no fitted alpha for %.3g Mpc/h cells (%g-%g fitted) or blocks "
                          "too narrow" % (max(ctx.conf.cell_size), pgd.FITS[0][0], pgd.FITS[-1][0]))
        if lensing_fullsky.is_full(ctx):   # --sky full: HEALPix shells (jobs/lensing_fullsky.py)
            return lensing_fullsky.preflight_full(ctx)
        lconf = ctx.configs["lensing"]
        n_source = lconf.n_maps
        preflight.check_job_memory(
            ctx, preflight.lensing_memory(ctx.conf, lconf.n_planes, n_source, lconf.field_npix,
                                          pgd=pconf.pgd),
            tensors=preflight.lensing_tensors(n_source, lconf.field_npix))
        ctx.geom = lensing_geometry.geometry(ctx.conf, lconf)
        if ctx.resume:   # a checkpoint of another run is refused before any graph
            stages, _ = lensing_geometry.lightcone_stages(ctx.conf, ctx.geom)
            nbody_run.check_resume(ctx, stages, plane_names(ctx.geom.n_planes))

    def build(self, ctx, mesh):
        from . import lensing_fullsky
        from .lensing_graph import LensingGraph

        if lensing_fullsky.is_full(ctx):
            return lensing_fullsky.FullSkyGraph(ctx.conf, ctx.geom, mesh, ctx.configs["pgd"])
        return LensingGraph(ctx.conf, ctx.geom, mesh, ctx.configs["pgd"])

    def describe(self, ctx, g):
        from . import lensing_fullsky

        if lensing_fullsky.is_full(ctx):
            return lensing_fullsky.describe_full(ctx, g)
        conf, geom = ctx.conf, ctx.geom
        return "%d steps to a=%.4f, %d planes to %.0f Mpc/h (%s), mesh %s, grid %s" % (
            g.n_steps, g.stages[-1], geom.n_planes, geom.r_edges[-1], ", ".join(geom.labels),
            "x".join(map(str, conf.nc)), "x".join(map(str, conf.grid)))

    def lower(self, ctx, g, lowering):
        from . import lensing_fullsky, lensing_pgd, nbody_run, runner

        if lensing_fullsky.is_full(ctx):
            return lensing_fullsky.lower_full(ctx, g, lowering)
        ops = nbody_run.lower_simulation(g, lowering)
        ops["planes"] = {j: runner.lowered_group(lowering, o) for j, o in g.plane_ops.items()}
        # kappa is small and replicated; the planes: this process's blocks only
        ops["plane_slices"] = [h5dist.local_slices(lowering, p) for p in g.planes]
        ops["maps"] = {"kappa": h5dist.replicated_value(lowering, g.kappa),
                       "gamma1": h5dist.replicated_value(lowering, g.gamma1),
                       "gamma2": h5dist.replicated_value(lowering, g.gamma2),
                       "planes": [[t for _, t, _ in s] for s in ops["plane_slices"]]}
        lensing_pgd.lower_pgd(lowering, g.pgd, ops)   # with PGD: the corrected P(k)
        ops["plane_vars"] = runner.VariableSlices(
            lowering, dict(zip(plane_names(len(g.planes)), g.planes), born_kappa=g.born_kappa))
        return ops

    def execute(self, ctx, sess, g, ops):
        from . import lensing_fullsky, lensing_pgd, nbody_run

        if lensing_fullsky.is_full(ctx):
            return lensing_fullsky.execute_full(ctx, sess, g, ops)
        geom = ctx.geom
        # with PGD, the planes and their P(k) are of the corrected particles (alpha fed)
        pk = lensing_pgd.power_at_stages(sess, g.pgd, ops)

        def note(j):
            names = np.nonzero(g.plane_stage == j)[0]
            if not names.size:
                return ""
            return ", plane %s at r=%s Mpc/h" % (",".join(map(str, names)), ",".join(
                "%.0f" % geom.r[i] for i in names))

        def records():   # the P(k) of the planes painted so far (replicated), exact in JSON
            return {"plane_pk": [[int(j), {n: np.asarray(v).tolist() for n, v in r.items()}]
                                 for j, r in sorted(pk.results.items())]}

        def restore(saved):
            for j, r in saved.get("plane_pk", []):
                pk.results[int(j)] = {n: np.asarray(v, pk.fetch[n].dtype.as_numpy_dtype)
                                      for n, v in r.items()}

        nbody_run.run_stages(ctx, sess, g, ops, [pk], note,
                             loop_state=nbody_run.LoopState(ops["plane_vars"], records,
                                                            restore))
        ctx.timings["planes_s"] = float(pk.seconds)
        with ctx.timed("born_s"):
            res = sess.run(ops["maps"])
        res["plane_pk"] = {int(i): pk.results[int(j)] for i, j in enumerate(g.plane_stage)}
        res["stages"] = g.stages
        res["plane_slices"] = ops["plane_slices"]
        return res

    def finish(self, ctx, res):
        from . import lensing_fullsky

        if lensing_fullsky.is_full(ctx):
            return lensing_fullsky.finish_full(ctx, res)
        conf, geom = ctx.conf, ctx.geom
        kappa = np.asarray(res["kappa"], np.float64)
        # per held slice: the planes [n_planes, sx, sy] of its (x, y) block
        plane_parts = {p: h5dist.Block(np.stack([res["planes"][i][j]
                                                 for i in range(geom.n_planes)]
                                                ).astype(np.float64),
                                       (0,) + tuple(begin), (geom.n_planes,) + tuple(conf.nc[:2]))
                       for j, (p, _, begin) in enumerate(res["plane_slices"][0])}
        plane_pk = res["plane_pk"]
        keep = plane_pk[0]["modes"] > 0
        plane_k = np.stack([plane_pk[i]["k"][keep] for i in range(geom.n_planes)])
        plane_p = np.stack([plane_pk[i]["pk"][keep]
                            for i in range(geom.n_planes)]).astype(np.float64)
        cls = [lensing_stats.kappa_power_spectrum(m, geom.field_deg, None) for m in kappa]
        ell, n_modes = cls[0][0], cls[0][2]
        ok = n_modes > 0
        measured = np.stack([c[1] for c in cls])[:, ok]
        with ctx.timed("theory_s"):
            pred = lensing_theory.run_prediction(conf, geom, plane_k, plane_p,
                                                 list(range(geom.n_source)),
                                                 pgd=pgd.is_fitted(ctx.configs["pgd"], conf))
            sky = lensing_theory.sky_cl([c[1] for c in cls], conf, geom, pred)
        pred.setdefault("extra", {})
        pred["extra"]["C_ell_shot"] = pred["shot"]
        pred["extra"]["C_ell_sky"] = list(sky)
        eb = [lensing_stats.shear_eb_power(g1, g2, geom.field_deg)
              for g1, g2 in zip(np.asarray(res["gamma1"], np.float64),
                                np.asarray(res["gamma2"], np.float64))]
        pred["extra"]["C_ell_E"] = [e[1] for e in eb]
        pred["extra"]["C_ell_B"] = [e[2] for e in eb]
        for key in ("expected", "continuous", "window", "resolved"):
            pred[key] = [v[ok] for v in pred[key]]
        pred["extra"] = {n: [v[ok] for v in vals] for n, vals in pred.get("extra", {}).items()}
        res.update(kappa=kappa, plane_parts=plane_parts, plane_k=plane_k, plane_p=plane_p,
                   ell=ell[ok], n_modes=n_modes[ok], measured=measured, pred=pred,
                   limber=np.stack(pred["expected"]))
        return {"n_stages": int(len(res["stages"])), "stages": list(res["stages"]),
                "kappa_rms": kappa.std(axis=(1, 2)).tolist(),
                "resolved_ell": [list(r) for r in pred["ell_range"]]}

    def write_all(self, ctx, res):
        from . import lensing_fullsky

        if lensing_fullsky.is_full(ctx):
            return lensing_fullsky.write_all_full(ctx, res)
        io.write_kappa(ctx.file("kappa.h5"), ctx.comm, res["kappa"], res["plane_parts"],
                       res["plane_k"], res["plane_p"], ctx.conf, ctx.configs["lensing"],
                       ctx.geom, gamma=(np.asarray(res["gamma1"], np.float64),
                                        np.asarray(res["gamma2"], np.float64)))

    def write(self, ctx, out, res, summary):
        from . import lensing_fullsky

        if lensing_fullsky.is_full(ctx):
            return lensing_fullsky.write_full(ctx, out, res, summary)
        geom = ctx.geom
        io.write_kappa_power(out.path("kappa_power.txt"), res["ell"], res["measured"],
                             res["pred"], res["n_modes"], geom, rank=0)

    def plot(self, ctx, out, res, summary):
        from . import lensing_fullsky

        if lensing_fullsky.is_full(ctx):
            return lensing_fullsky.plot_full(ctx, out, res, summary)
        kappa_plot(out.path("kappa.png"), res["kappa"][0], ctx.geom, res["ell"],
                   res["measured"], res["limber"])

    def report(self, ctx, summary):
        return "kappa rms %s, " % ", ".join("%.3g" % v for v in summary["kappa_rms"])


def plane_names(n_planes):
    """Names of the lens planes in a checkpoint: ``plane_0``, ``plane_1``, ..."""
    return ["plane_%d" % i for i in range(int(n_planes))]


def kappa_plot(path, kappa, geom, ell, measured, limber):
    """The first source's map and ell(ell+1) C_ell / 2 pi, measured and expected."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4.6))
    half = 0.5 * geom.field_deg
    im = ax0.imshow(kappa.T, origin="lower", cmap="inferno", extent=[-half, half, -half, half])
    fig.colorbar(im, ax=ax0, label="kappa")
    ax0.set_xlabel("theta_x [deg]")
    ax0.set_ylabel("theta_y [deg]")
    ax0.set_title("Born convergence, %s" % geom.labels[0])
    norm = ell * (ell + 1) / (2 * np.pi)
    for s, lab in enumerate(geom.labels):
        line, = ax1.loglog(ell, norm * measured[s], "o-", ms=3, label="measured, %s" % lab)
        ax1.loglog(ell, norm * limber[s], "--", color=line.get_color(),
                   label="expected from sim P(k) (windows), %s" % lab)
    ax1.set_xlabel("ell")
    ax1.set_ylabel("ell (ell+1) C_ell / 2 pi")
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
