"""Fit PGD's alpha(a) = alpha0 a^mu against halofit at the lensing run's plane redshifts.

Usage::

    # the default lensing configuration (64^3 in 256 Mpc/h), 2 seeds, one process
    python scripts/fit_pgd.py --seeds 2
    # the survey's 1 Mpc/h cells, cheaper: a 128 Mpc/h box with the stages of the 256 Mpc/h job
    python scripts/fit_pgd.py --nc 128 --box-size 128 --stages-box 256 --seeds 1 --label 1mpc

What it does
------------
For each seed: the lensing job's N-body (its stages: ``lightcone_stages`` of the default
``LensingConfig``) in one graph, the particles kept at the plane stages of the planes that
lens the source; at each of them the PGD displacement with alpha = 1
(:func:`flowpm_mtf.physics.pgd.pgd_displacement`, the given ``--kl``/``--ks``) and the grid P(k)
of ``x + alpha dx`` for a grid of alpha values (the displacement is linear in alpha; the
P(k) is not). Numpy then deconvolves each P(k) as the lensing job's prediction does
(:func:`flowpm_mtf.physics.lensing_theory.true_power`, :func:`pair_power`: the CIC window with
its images, minus the shot noise) and divides it by halofit (Takahashi et al. 2012,
:mod:`flowpm_mtf.physics.halofit`) over ``--kmin``..``--kmax`` of the mesh's Nyquist frequency.
Per plane, the alpha that minimises the seeds' mean of the mode-weighted mean of
log(ratio)^2 in that range (the grid's minimum refined by a parabola); then alpha0 and mu
by a least-squares line in (log a, log alpha). Writes
``results/fit_pgd[_label].md`` (+ raw JSON): per plane a, the best alpha, the fitted
alpha(a) and the ratio per k band without PGD and at the fitted alpha(a).
"""
import argparse
import logging
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flowpm_bench import RESULTS, provenance  # noqa: E402
from flowpm_bench.results import write_result  # noqa: E402

log = logging.getLogger("fit_pgd")
SCRIPT = "scripts/fit_pgd.py"
ALPHAS = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 1.3)
BANDS = ((0.1, 0.25), (0.25, 0.5), (0.5, 0.75), (0.75, 1.0))   # [k_N]


def measure(conf, pconf, stages, plane_idx, alphas):
    """Grid P(k) of the PGD-corrected particles at the stages ``plane_idx``, per alpha."""
    import mesh_tensorflow as mtf
    import tensorflow.compat.v1 as tf

    from flowpm_mtf import api
    from flowpm_mtf.jobs import runner
    from flowpm_mtf.mesh import slots
    from flowpm_mtf.physics import painting, pgd, power

    with tf.Graph().as_default():
        graph = mtf.Graph()
        mesh = mtf.Mesh(graph, "mesh")
        linear = api.linear_field(conf, mesh)
        state = api.lpt_init(conf, linear, a0=stages[0], forces=False)
        snaps = [float(stages[j]) for j in plane_idx]
        _, states = api.nbody(conf, state, stages=stages, snapshots=snaps)
        out = {}
        for i, s in enumerate(states):
            w = slots.weights(s.ids, conf)
            dx = pgd.pgd_displacement(s.positions, conf, pconf, 1.0, weight=w,
                                      name="pgd_%d" % i)
            for m, al in enumerate(alphas):
                x = pgd.clip_to_blocks(s.positions + dx * float(al), conf)
                rho = painting.paint_field(x, conf, w)
                k, pk, modes = power.power_spectrum(rho - 1.0, conf)
                out["pk_%d_%d" % (i, m)] = pk
            out["k"], out["modes"] = k, modes
        be = api.backend_for(conf)
        lowering = mtf.Lowering(graph, {mesh: be.mesh_impl})
        fetch = runner.replicated(lowering, out)
        with tf.Session(config=be.session_config) as sess:
            return sess.run(fetch), be.rank


def ratios(conf, k, pk, modes, a, kmin, kmax):
    """The fit's loss, the mean of log(pair power / halofit)^2 over the bins in ``kmin..kmax``
    [k_N] (mode-weighted), and the mean ratio per band of :data:`BANDS`."""
    from flowpm_mtf.physics import halofit, lensing_theory as T

    keep = modes > 0
    kk, pp, mm = k[keep], pk[keep], modes[keep]
    pfun = T.pair_power(T.true_power(kk, pp, conf), conf)
    kn = np.pi / max(conf.cell_size)
    hf = halofit.halofit_power(conf.cosmology, kk, a)
    r = pfun(kk) / hf

    def band(lo, hi):
        sel = (kk >= lo * kn) & (kk < hi * kn)
        return float(np.average(r[sel], weights=mm[sel]))

    sel = (kk >= kmin * kn) & (kk < kmax * kn)
    loss = float(np.average(np.log(np.maximum(r[sel], 1e-6))**2, weights=mm[sel]))
    return loss, [band(lo, hi) for lo, hi in BANDS]


def best_alpha(alphas, losses):
    """The alpha minimising the loss: the grid's minimum refined by the parabola through it
    and its neighbours (the grid's end if the minimum is there)."""
    m = int(np.argmin(losses))
    if m == 0 or m == len(alphas) - 1:
        return float(alphas[m])
    x, y = np.asarray(alphas[m - 1:m + 2]), np.asarray(losses[m - 1:m + 2])
    c = np.polyfit(x, y, 2)
    return float(np.clip(-c[1] / (2 * c[0]), x[0], x[2])) if c[0] > 0 else float(x[1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nc", type=int, default=64)
    p.add_argument("--box-size", type=float, default=256.0)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--kl", type=float, default=0.5, help="k_l [k_N]")
    p.add_argument("--ks", type=float, default=2.0, help="k_s [k_N]")
    p.add_argument("--kmin", type=float, default=0.25, help="fit range [k_N]")
    p.add_argument("--kmax", type=float, default=0.75, help="fit range [k_N]")
    p.add_argument("--alphas", default=",".join("%g" % a for a in ALPHAS),
                   help="the grid of alpha values (increasing, from 0)")
    p.add_argument("--stages-box", type=float, default=None,
                   help="take the lensing job's stages of this box size [Mpc/h] (default "
                        "--box-size): e.g. a 128 Mpc/h box at the survey's cells, 256")
    p.add_argument("--halo", type=int, default=None)
    p.add_argument("--label", default="")
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    from flowpm_mtf import api
    from flowpm_mtf.config import SimConfig
    from flowpm_mtf.physics import lensing_geometry as G
    from flowpm_mtf.physics.pgd import PGDConfig

    alphas = [float(v) for v in args.alphas.split(",")]
    grid = api.process_grid()
    extra = {} if args.halo is None else {"halo_size": args.halo}
    pconf = PGDConfig(pgd=True, pgd_kl=args.kl, pgd_ks=args.ks)
    per_seed = []
    for seed in range(1, args.seeds + 1):
        conf = SimConfig(nc=args.nc, box_size=args.box_size, a_start=0.2, grid=grid, seed=seed,
                         **extra)
        # the stages (and planes) of the lensing job in --stages-box Mpc/h (a smaller box
        # at the same cell size has the same force resolution, the same time steps)
        ref = SimConfig(nc=args.nc, box_size=args.stages_box or args.box_size, a_start=0.2,
                        grid=grid, seed=seed, **extra)
        geom = G.geometry(ref, G.LensingConfig())
        stages, plane_stage = G.lightcone_stages(ref, geom)
        coef = G.born_coefficients(ref, geom)
        lensing = [i for i in range(geom.n_planes) if coef[0, i] > 0]
        # every other lensing plane (the fit's a range without all twelve)
        planes = lensing[::2]
        res, rank = measure(conf, pconf, stages, [int(plane_stage[i]) for i in planes], alphas)
        rows = []
        for n, i in enumerate(planes):
            a = float(stages[plane_stage[i]])
            fit = [ratios(conf, res["k"], res["pk_%d_%d" % (n, m)], res["modes"], a, args.kmin,
                          args.kmax) for m in range(len(alphas))]
            rows.append({"plane": int(i), "a": a, "loss": [f[0] for f in fit],
                         "bands": [f[1] for f in fit]})
        per_seed.append(rows)
        log.info("seed %d: %s", seed, ", ".join("a=%.3f %s" % (r["a"], np.round(r["loss"], 4))
                                                 for r in rows))
    if rank != 0:
        return
    planes = []
    for n, row in enumerate(per_seed[0]):
        mean = np.mean([s[n]["loss"] for s in per_seed], axis=0)
        bands = np.mean([s[n]["bands"] for s in per_seed], axis=0)
        planes.append({"a": row["a"], "loss": mean.tolist(), "bands": bands.tolist(),
                       "alpha": best_alpha(alphas, mean)})
    ok = [q for q in planes if q["alpha"] > 0]
    if len(ok) >= 2:
        mu, lna0 = np.polyfit(np.log([q["a"] for q in ok]), np.log([q["alpha"] for q in ok]), 1)
        alpha0 = float(np.exp(lna0))
    else:
        mu, alpha0 = 0.0, float(np.mean([q["alpha"] for q in ok])) if ok else float("nan")
    # the band ratios at the fitted alpha(a), interpolated on the alpha grid
    for q in planes:
        al = alpha0 * q["a"]**mu
        q["alpha_fit"] = al
        q["bands_fit"] = [float(np.interp(al, alphas, np.asarray(q["bands"])[:, b]))
                          for b in range(len(BANDS))]
    data = {"nc": args.nc, "box_size": args.box_size, "seeds": args.seeds, "kl": args.kl,
            "ks": args.ks, "kmin": args.kmin, "kmax": args.kmax, "alphas": alphas,
            "alpha0": alpha0, "mu": float(mu), "planes": planes,
            "commit": provenance.commit_label(), "load": os.getloadavg()[0]}
    name = "fit_pgd" + ("_" + args.label if args.label else "")
    write_result(args.out, name, data, render(data), SCRIPT)
    log.info("alpha0 = %.4f, mu = %.3f", alpha0, mu)


def render(d):
    head = "| a | best alpha | alpha(a) fitted | " + " | ".join(
        "k %.2f-%.2f k_N: none / fit" % b for b in BANDS) + " |"
    lines = ["# PGD fit against halofit: %d^3 in %.0f Mpc/h, %d seed(s)" % (d["nc"], d["box_size"],
                                                                         d["seeds"]),
             "",
             "k_l = %.2f k_N, k_s = %.2f k_N; the fit range %.2f-%.2f k_N; pair P(k) (CIC "
             "deconvolved, shot noise removed) / halofit, mean over the seeds (mode-weighted "
             "per band). Fit: alpha0 = "
             "%.4f, mu = %.3f (commit %s, load %.1f)." % (d["kl"], d["ks"], d["kmin"], d["kmax"],
                                                          d["alpha0"], d["mu"], d["commit"],
                                                          d["load"]),
             "", head, "|" + "---|" * (3 + len(BANDS))]
    for q in d["planes"]:
        lines.append("| %.3f | %.3f | %.3f | %s |" % (
            q["a"], q["alpha"], q["alpha_fit"], " | ".join(
                "%.2f / %.2f" % (v0, v) for v0, v in zip(q["bands"][0], q["bands_fit"]))))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
