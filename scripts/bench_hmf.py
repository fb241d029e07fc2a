"""The halo mass function of a run against Sheth & Tormen (1999), by colossus (issue 60, item 3).

Runs ``flowpm-mtf simulate --fof`` (``--np`` ranks; or reads an existing run with ``--run``),
bins its FoF halos (b = 0.2, at least ``--min`` members) in mass and compares
``dn/dlnM`` [(Mpc/h)^-3] with colossus's ``sheth99`` FoF mass function for the run's
cosmology (colossus's own Eisenstein & Hu transfer function, normalised to the run's
sigma8) at the run's final redshift::

    python scripts/bench_hmf.py --nc 128 --box 256 --steps 20 --np 2
    python scripts/bench_hmf.py --run out/sim --min 20

Writes ``results/bench_hmf.md`` from ``results/raw/bench_hmf.json`` (one record per
configuration and commit). The errors are Poisson's only (one realisation, no cosmic
variance). A PM code resolves no structure below its mesh cell: halos of few particles
come out fewer than the fit (their cores are softened by the force resolution) and the
FoF groups of a PM run are looser, so the table says where the ratio stays within the
tolerance of the comparison and where it departs.
"""
import argparse
import os
import sys
import tempfile

import numpy as np

from flowpm_bench import RESULTS, launch, provenance
from flowpm_bench.results import json_path, read_json, write_json, write_table

SCRIPT = "scripts/bench_hmf.py"
NAME = "bench_hmf"
#: Ratio to Sheth-Tormen counted as agreement: the fit's own scatter against N-body
#: simulations is ~10-20 % (Sheth & Tormen 1999, Tinker et al. 2008).
AGREE_RTOL = 0.2
#: Bins with fewer halos are not judged (Poisson error above ~30 %).
MIN_HALOS_PER_BIN = 10


def run_simulation(nc, box, steps, n_ranks, min_members, out, seed):
    """``flowpm-mtf simulate --fof`` into ``out`` on ``n_ranks`` ranks; its wall time [s]."""
    cmd = launch.mpirun_command(n_ranks) + [
        sys.executable, "-m", "flowpm_mtf.cli",
        "simulate", "--nc", str(nc), "--box-size", str(box), "--steps", str(steps),
        "--seed", str(seed), "--fof", "--fof-min", str(min_members), "--no-plot",
        "--out", out, "--overwrite"]
    return launch.run(cmd, timeout=7200)


def mass_function(mass, volume, edges):
    """Measured ``dn/dlnM`` [(Mpc/h)^-3] per bin of ``edges`` [M_sun/h], counts, errors."""
    counts = np.histogram(mass, bins=edges)[0]
    dln = np.diff(np.log(edges))
    dn = counts / volume / dln
    return dn, counts, np.sqrt(counts) / volume / dln


def sheth_tormen(config, masses, z):
    """colossus's ``sheth99`` ``dn/dlnM`` [(Mpc/h)^-3] at ``masses`` [M_sun/h] for the run's cosmology."""
    from colossus.cosmology import cosmology
    from colossus.lss import mass_function as mf

    c = config["cosmology"]
    cosmology.setCosmology("flowpm_mtf_run", **{
        "flat": abs(c.get("Omega_k", 0.0)) < 1e-12, "H0": 100.0 * c["h"],
        "Om0": c["Omega_c"] + c["Omega_b"], "Ob0": c["Omega_b"], "sigma8": c["sigma8"],
        "ns": c["n_s"], "persistence": ""})
    return mf.massFunction(masses, z, mdef="fof", model="sheth99", q_out="dndlnM")


def compare(run_dir, min_members, bins_per_decade=4):
    """The record of one run: bins, measured and fitted dn/dlnM, the agreeing range."""
    from flowpm_mtf.runs import halos as halos_io

    cat = halos_io.read_halos(os.path.join(run_dir, "halos.h5"))
    config, attrs = cat["config"], cat["attrs"]
    box = np.broadcast_to(np.asarray(config["box_size"], np.float64), (3,))
    volume = float(np.prod(box))
    mp = float(attrs["particle_mass"])
    low = min_members * mp       # the first edge exactly: the smallest halos are in
    top = cat["mass"].max() if len(cat["mass"]) else 10 * low
    n_bins = max(1, int(np.ceil(np.log10(top / low) * bins_per_decade)))
    edges = low * 10 ** (np.arange(n_bins + 1) / bins_per_decade)
    if edges[-1] < top:          # rounding of the last edge: one more bin
        edges = low * 10 ** (np.arange(n_bins + 2) / bins_per_decade)
    dn, counts, err = mass_function(cat["mass"], volume, edges)
    centres = np.sqrt(edges[1:] * edges[:-1])
    z = 1.0 / float(attrs["a"]) - 1.0
    fit = sheth_tormen(config, centres, z)
    ratio = np.where(fit > 0, dn / fit, np.nan)
    judged = counts >= MIN_HALOS_PER_BIN
    agree = judged & (np.abs(ratio - 1) <= AGREE_RTOL)
    return {"nc": config["nc"], "box": list(box), "n_steps": config.get("n_steps"), "z": z,
            "particle_mass": mp,
            "min_members": min_members, "n_halos": int(len(cat["n"])),
            "edges": edges.tolist(), "counts": counts.tolist(), "dndlnM": dn.tolist(),
            "error": err.tolist(), "sheth_tormen": np.asarray(fit).tolist(),
            "ratio": ratio.tolist(), "agree": agree.tolist(), "judged": judged.tolist()}


def table(records):
    lines = ["# Halo mass function against Sheth-Tormen (colossus `sheth99`, FoF b = 0.2)", ""]
    for key, r in sorted(records.items()):
        nc = r["nc"] if isinstance(r["nc"], list) else [r["nc"]] * 3
        lines += ["## %s particles in %g Mpc/h, %s steps, z = %.2f, m_p = %.3g M_sun/h, %d "
                  "halos (>= %d members), load %.1f, commit %s"
                  % ("%d^3" % nc[0] if len(set(nc)) == 1 else "x".join(map(str, nc)),
                     r["box"][0], r.get("steps", "?"), r["z"], r["particle_mass"], r["n_halos"],
                     r["min_members"], (r.get("machine") or {}).get("loadavg", [float("nan")])[0],
                     r.get("commit", "?")),
                  "", "| M [M_sun/h] | halos | dn/dlnM [(Mpc/h)^-3] | Sheth-Tormen | ratio | |",
                  "|---|---|---|---|---|---|"]
        for i, n in enumerate(r["counts"]):
            verdict = ("within %d %%" % (100 * AGREE_RTOL) if r["agree"][i] else
                       ("departs" if r["judged"][i] else "too few halos"))
            lines.append("| %.3g - %.3g | %d | %.3g +- %.2g | %.3g | %.2f | %s |"
                         % (r["edges"][i], r["edges"][i + 1], n, r["dndlnM"][i], r["error"][i],
                            r["sheth_tormen"][i], r["ratio"][i], verdict))
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nc", type=int, default=128, help="particles (and mesh cells) per side")
    ap.add_argument("--box", type=float, default=256.0, help="box side [Mpc/h]")
    ap.add_argument("--steps", type=int, default=20, help="N-body steps")
    ap.add_argument("--np", type=int, default=2, dest="n_ranks", help="MPI ranks")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--min", type=int, default=20, dest="min_members",
                    help="smallest halo [particles]")
    ap.add_argument("--run", default=None, help="an existing run directory with halos.h5")
    ap.add_argument("--out", default=RESULTS, help="folder of the table (default results/)")
    args = ap.parse_args(argv)
    run_dir, wall = args.run, None
    if run_dir is None:
        run_dir = tempfile.mkdtemp(prefix="bench_hmf")
        wall = run_simulation(args.nc, args.box, args.steps, args.n_ranks, args.min_members,
                              run_dir, args.seed)
    rec = compare(run_dir, args.min_members)
    rec["steps"] = rec.pop("n_steps", None)
    rec.update(wall_s=wall, ranks=args.n_ranks if args.run is None else None,
               commit=provenance.commit_label(), machine=provenance.machine())
    path = json_path(args.out, NAME)
    records = read_json(path, {}) or {}
    key = "%s_%g_%s_%d" % (rec["nc"], rec["box"][0], rec["steps"], args.min_members)
    records[key] = rec
    write_json(path, records)
    doc = write_table(os.path.join(args.out, NAME + ".md"), table(records), SCRIPT)
    print(doc)
    return rec


if __name__ == "__main__":
    main()
