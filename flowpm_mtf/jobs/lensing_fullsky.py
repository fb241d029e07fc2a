"""The full-sky branch of the lensing job (``flowpm-mtf lensing --sky full --nside N``).

:class:`flowpm_mtf.jobs.lensing.LensingJob` calls these functions when its ``sky``
section says ``full``: the same N-body on the lightcone's stages, but each shell is
a HEALPix count map painted by every rank for its own particles and all-reduced
(:mod:`flowpm_mtf.physics.lensing_fullsky`), and the Born convergence is a HEALPix
map per source. The maps are small (``12 nside^2`` pixels) and replicated. With ``--pgd``
the shells and their P(k) are of the PGD-corrected particles at each shell's stage
(:mod:`flowpm_mtf.jobs.lensing_pgd`, as the flat sky's planes).

Outputs (rank 0)
----------------
kappa.h5
    ``kappa``, ``gamma1``, ``gamma2`` ``[n_maps, 12 nside^2]`` (RING), the shells'
    count maps, the P(k) at each shell, config/geometry/versions attributes.
kappa_<i>.fits
    Each convergence map as a HEALPix FITS file (``healpy.read_map`` opens it).
kappa_power.txt
    ell, per source the measured C_ell (``healpy.anafast``), the Limber predictions
    (run's P(k) and halofit, with and without the pixel window, plus shot noise), the
    shot noise, the shear's E and B power, ``resolved``; the modes per bin.
kappa.png
    Mollweide view of the first map and the power spectra.
"""
import json
import logging

import mesh_tensorflow as mtf
import numpy as np

from hvd_mesh_impl.slice_init import unfolded_zeros_initializer

from ..errors import ConfigError
from ..logs import rank0_only
from ..physics import lensing_fullsky as F, lensing_fullsky_stats as FS, lensing_geometry
from ..runs import h5dist, io, preflight
from . import lensing_pgd, nbody_run, runner
from .nbody_run import SimulationGraph

__all__ = ["FullSkyGraph", "FLAT_ONLY", "BYTES_PER_SLOT_REPLICA", "HEALPY_IMPORT_BYTES",
           "is_full", "check_options", "fullsky_memory", "preflight_full", "lower_full",
           "execute_full", "finish_full", "write_all_full", "write_full", "plot_full",
           "shell_names"]

log = rank0_only(logging.getLogger(__name__))
Term = preflight.Term

#: The options of the flat sky only (field of view and rays): refused with ``--sky full``.
FLAT_ONLY = (("field_deg", "--field-deg"), ("field_npix", "--field-npix"))
#: Bytes per particle slot and replica of one vectorised pass of the shell painting
#: (float64 positions and distances, int64 pixels and segment ids, weights).
BYTES_PER_SLOT_REPLICA = 112
#: The harmonic analysis of the maps at the end (``finish_full``) imports healpy on every
#: rank: its libraries (and astropy's) are resident from then on [bytes]. Measured: the RSS
#: of ``python -c "import numpy; import healpy"`` beyond numpy's, 67 MB, rounded up
#: (the full-sky runs of ``scripts/bench_lensing_memory.py`` grow 35 MB in that phase, at
#: nside 128 and 256 alike).
HEALPY_IMPORT_BYTES = 68 << 20


def is_full(ctx):
    """Whether the run is on the full sky."""
    return ctx.configs["sky"].sky == "full"


def shell_names(n):
    return ["shell_%d" % i for i in range(n)]


def check_options(ctx, sections):
    """One line per misuse: flat-sky options with ``--sky full``, ``--nside`` with the flat
    sky (an option differs from the job's default, ``sections``: the job's config sections).

    Raises
    ------
    ConfigError
    """
    by_key = {s.key: s for s in sections}
    lensing_section, sky_section = by_key["lensing"], by_key["sky"]
    lconf, sconf = ctx.configs["lensing"], ctx.configs["sky"]
    if sconf.sky == "full":
        for field, flag in FLAT_ONLY:
            if getattr(lconf, field) != lensing_section.default(field):
                raise ConfigError("%s is an option of the flat sky (--sky flat); the full sky "
                                  "maps the whole sphere at --nside" % flag)
    elif sconf.nside != sky_section.default("nside"):
        raise ConfigError("--nside is an option of the full sky (--sky full)")


def fullsky_memory(conf, n_planes, n_source, nside, pgd=False):
    """``extra`` for :func:`flowpm_mtf.runs.preflight.check_memory`: the shell and
    convergence maps (replicated), the per-block count maps and one vectorised pass of
    the painting, the fetched float64 maps and their harmonic transforms (and healpy's
    import, :data:`HEALPY_IMPORT_BYTES`); with ``pgd``, the
    PGD correction (:func:`flowpm_mtf.runs.preflight.pgd_terms`)."""
    isz = conf.np_dtype.itemsize
    npix = 12 * int(nside)**2

    def maps(ns, blocks=1):
        n = 12 * int(ns)**2
        return n * ((n_planes + 2 * n_source) * isz + 2 * blocks * isz
                    + n_source * 3 * 8 + 4 * 8)

    def extra(c, blocks, masters):
        slots, _ = preflight.memory_terms(c)
        passes = min(F._REPLICA_CHUNK, max(1, F.CHUNK_ELEMENTS // max(1, slots * blocks)))

        def advise(room, budget):
            n = 1
            while n * 2 <= nside and maps(n * 2, blocks) <= room:
                n *= 2
            return "--nside %d or less" % n if maps(n, blocks) <= room else None

        terms = [Term("the full-sky maps (%d shells, %d source map%s of 12 x %d^2 pixels)"
                      % (n_planes, n_source, "s" if n_source > 1 else "", nside),
                      maps(nside, blocks), False, "a smaller --nside", advise),
                 Term("a pass of the shell painting (%d replicas at once)" % passes,
                      passes * slots * blocks * BYTES_PER_SLOT_REPLICA, True),
                 Term("healpy (imported for the harmonic analysis)", HEALPY_IMPORT_BYTES,
                      False)]
        if pgd:
            terms += preflight.pgd_terms(c, blocks)
        if masters:
            terms.append(Term("the master copies of the shell maps", n_planes * npix * isz,
                              False, "the hvd backend"))
        return terms

    return extra



def preflight_full(ctx):
    """Memory and the geometry of a full-sky run (sets ``ctx.geom``)."""
    lconf, sconf = ctx.configs["lensing"], ctx.configs["sky"]
    npix = sconf.npix
    preflight.check_job_memory(
        ctx, fullsky_memory(ctx.conf, lconf.n_planes, lconf.n_maps, sconf.nside,
                            pgd=ctx.configs["pgd"].pgd),
        tensors=[("the HEALPix maps (%d x 12 x %d^2 pixels)" % (lconf.n_maps, sconf.nside),
                  int(lconf.n_maps) * npix, "--nside")])
    ctx.geom = F.fullsky_geometry(ctx.conf, lconf, sconf)
    if ctx.resume:
        stages, _ = lensing_geometry.lightcone_stages(ctx.conf, ctx.geom.base)
        nbody_run.check_resume(ctx, stages, shell_names(ctx.geom.n_planes))


class FullSkyGraph(SimulationGraph):
    """The simulation on the lightcone's stages, the shells' count maps (variables
    ``[hpix]``, replicated) painted at their stages, and the Born convergence.

    Parameters
    ----------
    conf : SimConfig
    geom : lensing_fullsky.FullSkyGeometry
    mesh : mtf.Mesh
    pconf : flowpm_mtf.physics.pgd.PGDConfig, optional
        With ``pconf.pgd``, the shells are painted from the particles moved by the PGD
        correction at each shell's stage, and their P(k) is of those particles (``pgd``:
        :class:`flowpm_mtf.jobs.lensing_pgd.PGDParticles`, as the flat sky's planes); the time
        loop goes on from the uncorrected particles.
    """

    def __init__(self, conf, geom, mesh, pconf=None):
        self.geom = geom
        stages, self.plane_stage = lensing_geometry.lightcone_stages(conf, geom.base)
        super().__init__(conf, mesh, stages)
        # the shells place every particle by its global position: the unclipped x + dx
        self.pgd = lensing_pgd.pgd_particles(self, mesh, pconf)
        x = self.variables.positions if self.pgd is None else self.pgd.positions
        shape = mtf.Shape([mtf.Dimension(F.HPIX, geom.npix)])
        self.planes = [mtf.get_variable(mesh, name, shape, dtype=conf.tf_dtype, trainable=False,
                                        initializer=unfolded_zeros_initializer())
                       for name in shell_names(geom.n_planes)]
        self.plane_ops = {}
        for i, j in enumerate(self.plane_stage):
            self.plane_ops.setdefault(int(j), []).append(
                mtf.assign(self.planes[i], F.shell_counts(x, conf, geom, i,
                                                          weight=self.weights)))
        self.kappa = F.born_convergence_fullsky(self.planes, conf, geom)


def describe_full(ctx, g):
    conf, geom = ctx.conf, ctx.geom
    return ("%d steps to a=%.4f, %d HEALPix shells (nside %d, %d replicas) to %.0f Mpc/h (%s), "
            "mesh %s, grid %s" % (g.n_steps, g.stages[-1], geom.n_planes, geom.nside,
                                  sum(len(r) for r in geom.replicas), geom.r_edges[-1],
                                  ", ".join(geom.labels), "x".join(map(str, conf.nc)),
                                  "x".join(map(str, conf.grid))))


def lower_full(ctx, g, lowering):
    ops = nbody_run.lower_simulation(g, lowering)
    ops["planes"] = {j: runner.lowered_group(lowering, o) for j, o in g.plane_ops.items()}
    ops["maps"] = {"kappa": h5dist.replicated_value(lowering, g.kappa),
                   "shells": [h5dist.replicated_value(lowering, p) for p in g.planes]}
    lensing_pgd.lower_pgd(lowering, g.pgd, ops)   # with PGD: the corrected P(k)
    ops["plane_vars"] = runner.VariableSlices(
        lowering, dict(zip(shell_names(len(g.planes)), g.planes)))
    return ops


def execute_full(ctx, sess, g, ops):
    geom = ctx.geom
    # with PGD, the shells and their P(k) are of the corrected particles (alpha fed)
    pk = lensing_pgd.power_at_stages(sess, g.pgd, ops)

    def note(j):
        names = np.nonzero(g.plane_stage == j)[0]
        if not names.size:
            return ""
        return ", shell %s at r=%s Mpc/h" % (",".join(map(str, names)), ",".join(
            "%.0f" % geom.r[i] for i in names))

    def records():
        return {"plane_pk": [[int(j), {n: np.asarray(v).tolist() for n, v in r.items()}]
                             for j, r in sorted(pk.results.items())]}

    def restore(saved):
        for j, r in saved.get("plane_pk", []):
            pk.results[int(j)] = {n: np.asarray(v, pk.fetch[n].dtype.as_numpy_dtype)
                                  for n, v in r.items()}

    nbody_run.run_stages(ctx, sess, g, ops, [pk], note,
                         loop_state=nbody_run.LoopState(ops["plane_vars"], records, restore))
    ctx.timings["planes_s"] = float(pk.seconds)
    with ctx.timed("born_s"):
        res = sess.run(ops["maps"])
    res["plane_pk"] = {int(i): pk.results[int(j)] for i, j in enumerate(g.plane_stage)}
    res["stages"] = g.stages
    return res


def finish_full(ctx, res):
    conf, geom = ctx.conf, ctx.geom
    kappa = np.asarray(res["kappa"], np.float64)
    plane_pk = res["plane_pk"]
    keep = plane_pk[0]["modes"] > 0
    plane_k = np.stack([plane_pk[i]["k"][keep] for i in range(geom.n_planes)])
    plane_p = np.stack([plane_pk[i]["pk"][keep]
                        for i in range(geom.n_planes)]).astype(np.float64)
    edges = FS.bin_edges(geom.nside)
    with ctx.timed("harmonics_s"):
        cls = [FS.kappa_cl_fullsky(m, edges) for m in kappa]
        shear = [FS.shear_fullsky(m) for m in kappa]
        eb = [FS.shear_eb(g1, g2) for g1, g2 in shear]
    ell, modes = cls[0][0], cls[0][2]
    binned = [[FS.bin_cl(c, edges)[1] for c in pair] for pair in eb]
    with ctx.timed("theory_s"):
        pred = FS.fullsky_prediction(conf, geom, plane_k, plane_p, ell, edges)
    res.update(kappa=kappa, gamma1=np.stack([s[0] for s in shear]),
               gamma2=np.stack([s[1] for s in shear]), plane_k=plane_k, plane_p=plane_p,
               ell=ell, n_modes=modes, measured=np.stack([c[1] for c in cls]), pred=pred,
               cl_e=np.stack([b[0] for b in binned]), cl_b=np.stack([b[1] for b in binned]),
               shells=np.stack([np.asarray(s, np.float64) for s in res["shells"]]))
    rng = []
    for r in pred["resolved"]:
        rng.append([float(ell[r].min()), float(ell[r].max())] if r.any() else [None, None])
    return {"n_stages": int(len(res["stages"])), "stages": list(res["stages"]),
            "kappa_rms": kappa.std(axis=1).tolist(), "resolved_ell": rng,
            "nside": int(geom.nside)}


def write_all_full(ctx, res):
    """``kappa.h5`` and one HEALPix FITS file per map (rank 0 writes them)."""
    conf, geom = ctx.conf, ctx.geom
    attrs = {"config": conf.to_json(), "lensing": json.dumps(ctx.configs["lensing"].to_dict()),
             "sky": json.dumps(ctx.configs["sky"].to_dict()),
             "sources": json.dumps(list(geom.labels)), "nside": int(geom.nside),
             "ordering": "RING", "observer": "box corner (global position 0)",
             "geometry": json.dumps({"r_edges": geom.r_edges.tolist(), "r": geom.r.tolist(),
                                     "a": geom.a.tolist(), "width": geom.width.tolist(),
                                     "shift_cells": geom.shift.tolist(),
                                     "flip": geom.flip.tolist(),
                                     "replicas": [len(r) for r in geom.replicas]}),
             "versions": json.dumps(io.versions())}
    dsets = [("kappa", res["kappa"], {"units": "dimensionless", "ordering": "RING"}),
             ("gamma1", res["gamma1"], {"basis": "healpy (e_theta, e_phi)"}),
             ("gamma2", res["gamma2"], {"basis": "healpy (e_theta, e_phi)"}),
             ("shell_counts", res["shells"], {"units": "particles per pixel"}),
             ("plane_k", res["plane_k"], {"units": "h/Mpc"}),
             ("plane_pk", res["plane_p"], {"units": "(Mpc/h)^3"})]
    path = ctx.file("kappa.h5")
    if ctx.comm.rank == 0 and path is not None:
        io.write_hdf5(path, dsets, attrs, rank=0)
        import healpy
        for s, lab in enumerate(geom.labels):
            fits = ctx.file("kappa_%d.fits" % s)
            healpy.write_map(fits, res["kappa"][s], nest=False, coord="C", overwrite=True,
                             dtype=np.float64, extra_header=[("SOURCE", lab)])


def write_full(ctx, out, res, summary):
    geom, pred = ctx.geom, res["pred"]
    cols, names, ranges = [res["ell"]], ["ell"], []
    for s, lab in enumerate(geom.labels):
        cols += [res["measured"][s], pred["limber"][s], pred["limber_cont"][s],
                 pred["halofit"][s], pred["halofit_cont"][s], pred["shot"][s],
                 res["cl_e"][s], res["cl_b"][s], pred["resolved"][s].astype(np.float64)]
        names += ["%s(%s)" % (n, lab) for n in (
            "C_ell", "C_ell_limber", "C_ell_limber_cont", "C_ell_halofit", "C_ell_halofit_cont",
            "C_ell_shot", "C_ell_E", "C_ell_B", "resolved")]
        r = summary["resolved_ell"][s]
        ranges.append("%s: %s" % (lab, "none" if r[0] is None else "%.0f-%.0f" % tuple(r)))
    cols.append(res["n_modes"])
    names.append("modes")
    header = ("full-sky C_ell [sr] of the Born convergence (HEALPix nside %d, %d shells, "
              "anafast); C_ell_limber: Limber of the run's own P(k) x pixel window^2 + shot "
              "noise; _cont: no window, no noise; each the (2l+1)-weighted mean over the bin's "
              "multipoles, as C_ell; C_ell_halofit(_cont): the same from halofit "
              "(Takahashi 2012); C_ell_shot: the particles' Poisson noise; C_ell_E/B: the "
              "shear's E and B power; resolved: pixel window^2 >= 1/2, shot noise <= half "
              "of C_ell_limber_cont and ell <= 2 nside (ell range %s)\n%s"
              % (geom.nside, geom.n_planes, ", ".join(ranges), "  ".join(names)))
    io.write_table(out.path("kappa_power.txt"), cols, header, fmt="%.10g", rank=0)


def plot_full(ctx, out, res, summary):
    import matplotlib

    matplotlib.use("Agg")
    import healpy
    import matplotlib.pyplot as plt

    geom, pred = ctx.geom, res["pred"]
    fig = plt.figure(figsize=(12, 4.6))
    healpy.mollview(res["kappa"][0], fig=fig.number, sub=(1, 2, 1),
                    title="Born convergence, %s" % geom.labels[0], unit="kappa")
    ax = fig.add_subplot(1, 2, 2)
    ell = res["ell"]
    norm = ell * (ell + 1) / (2 * np.pi)
    for s, lab in enumerate(geom.labels):
        line, = ax.loglog(ell, norm * res["measured"][s], "o-", ms=3, label="measured, %s" % lab)
        ax.loglog(ell, norm * pred["halofit"][s], "--", color=line.get_color(),
                  label="halofit x pixel window + shot noise, %s" % lab)
    ax.set_xlabel("ell")
    ax.set_ylabel("ell (ell+1) C_ell / 2 pi")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.path("kappa.png"), dpi=100)
    plt.close(fig)
