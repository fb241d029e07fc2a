"""`flowpm-mtf lensing` end to end on 2 MPI ranks: outputs well formed, the convergence
power spectrum against the Limber prediction from the run's own P(k); and bad input failing
on every rank of this world with one line, before any compute (in-process, on the ranks of
this pytest: 1 and 2)."""
import json
import os
import tempfile

import h5py
import numpy as np
import pytest

from test_cli import _mpirun

from flowpm_mtf import cli
from flowpm_mtf.errors import ConfigError

# 32^3 in 256 Mpc/h, 2LPT at a = 0.4, lightcone to z_s = 0.5 in 6 shells of 220 Mpc/h,
# 8 deg field on 64^2 rays, plus two n(z) bins: 7 N-body steps (~45 s of CPU per rank on an idle machine).
ARGS = ["lensing", "--nc", "32", "--box-size", "256", "--a-start", "0.4", "--steps", "3",
        "--z-source", "0.5", "--n-planes", "6", "--field-deg", "8", "--field-npix", "64",
        "--halo", "4", "--seed", "42", "--nz-smail", "2,1.5,0.25", "--nz-bins", "0.1,0.3,0.5",
        # the PGD correction's path end to end (test_pgd.py checks its values); alpha given:
        # these cells are coarser than the fits' (pgd.FITS)
        "--pgd", "--pgd-alpha0", "0.55", "--pgd-mu", "-0.9"]
N_MAPS = 3          # z_s = 0.5 and two tomographic bins of a Smail n(z)
NPIX = 64
# Limber test range: from 2 fundamentals of the 8 deg field (the lowest bin has ~20
# modes) to 1400 (above, C_ell has fallen by 1e5 and the prediction rests on the
# interpolation images near the mesh Nyquist frequency).
ELL_RANGE = (150.0, 1400.0)
# Tolerance on the geometric mean of measured / expected over that range. Per bin the ratio
# scatters by ~30 % (40-370 modes per bin, and the six shells share particles of one
# 256 Mpc/h box, so the planes' random shifts leave random cross terms); observed 0.89 with
# the windowed expectation of flowpm_mtf.physics.lensing_theory (per bin 0.64-1.15; the bare Limber
# sum gave 1.18). The ensemble test of the expectation is tests/test_bench_lensing.py. A
# factor 2 in the amplitude (e.g. a missing 1/2 or a wrong Delta r) moves it by 100 %.
LIMBER_TOL = 0.4


@pytest.fixture(scope="module")
def run():
    """The 2-rank job (mpirun), once per module."""
    out = tempfile.mkdtemp(prefix="lensing")
    proc = _mpirun(2, *ARGS, "--out", out, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, proc.stderr


@pytest.mark.single_process
def test_outputs_well_formed(run):
    out, log = run
    with h5py.File(os.path.join(out, "kappa.h5"), "r") as f:
        kappa = f["kappa"][...]
        gamma1, gamma2 = f["gamma1"][...], f["gamma2"][...]
        planes = f["planes"][...]
        theta = f["theta"][...]
        attrs = dict(f.attrs)
        assert f["plane_pk"].shape[0] == 6 and f["plane_k"].shape == f["plane_pk"].shape
    assert kappa.shape == (N_MAPS, NPIX, NPIX) and np.all(np.isfinite(kappa))
    assert 1e-4 < kappa[0].std() < 0.05                    # weak lensing at z_s = 0.5
    # the low bin lenses less than the high one, which lenses less than z_s = 0.5
    assert 0 < kappa[1].std() < kappa[2].std() < kappa[0].std()
    # shear from the potential on the zero-padded field beside kappa: exactly that of the
    # written kappa (float32 FFTs: 1e-5 of the map's scale), and of the same power as kappa
    # away from the edges (the periodic Kaiser-Squires inversion gave 1.32 here: the
    # wrap-around jump)
    from flowpm_mtf.physics.lensing import kaiser_squires_kernels
    assert gamma1.shape == gamma2.shape == kappa.shape
    m1, m2 = kaiser_squires_kernels(2 * NPIX)
    k0 = kappa.astype(np.float64) - kappa.mean(axis=(1, 2), keepdims=True)
    kh = np.fft.fft2(np.pad(k0, ((0, 0), (0, NPIX), (0, NPIX))))
    scale = np.abs(kappa).max()
    assert np.abs(gamma1 - np.fft.ifft2(kh * m1).real[:, :NPIX, :NPIX]).max() < 1e-5 * scale
    assert np.abs(gamma2 - np.fft.ifft2(kh * m2).real[:, :NPIX, :NPIX]).max() < 1e-5 * scale
    inner = (slice(None), slice(16, 48), slice(16, 48))
    dk = kappa - kappa.mean(axis=(1, 2), keepdims=True)
    ratio = (gamma1[inner]**2 + gamma2[inner]**2).mean() / (dk[inner]**2).mean()
    assert 0.7 < ratio < 1.2, ratio
    assert json.loads(attrs["sources"]) == ["z_s=0.5", "bin0:0.1-0.3", "bin1:0.3-0.5"]
    assert planes.shape == (6, 32, 32)
    np.testing.assert_allclose(planes.mean(axis=(1, 2)), 1.0, atol=0.2)   # 1 + delta
    assert abs(np.ptp(theta) - np.deg2rad(8.0) * (NPIX - 1) / NPIX) < 1e-12
    assert json.loads(attrs["config"])["nc"] == [32, 32, 32]
    assert json.loads(attrs["lensing"])["z_source"] == [0.5]
    geom = json.loads(attrs["geometry"])
    assert len(geom["r"]) == 6 and abs(geom["r_edges"][-1] - 1318.6) < 1.0   # chi(z=0.5)
    cl = np.loadtxt(os.path.join(out, "kappa_power.txt"))
    # ell, per map: C_ell, expected, continuous Limber, halofit (windows), halofit
    # (continuous), shot noise, sky C_ell, shear E and B, resolved; modes
    with open(os.path.join(out, "kappa_power.txt")) as f:
        header = f.readline()
        names = f.readline()[1:].split()
    col = {n: i for i, n in enumerate(names)}
    assert cl.shape[1] == 2 + 10 * N_MAPS == len(names) and np.all(np.diff(cl[:, 0]) > 0)
    assert np.all(cl[:, 1] > 0)
    res = cl[:, col["resolved(z_s=0.5)"]]
    # 32^3 cells of 8 Mpc/h: the PM resolves k <= 0.1 h/Mpc (a quarter of the mesh Nyquist),
    # below this map's lowest ell: nothing resolved, as the header says
    assert set(np.unique(res)) == {0.0}
    exp, cont = cl[:, col["C_ell_limber(z_s=0.5)"]], cl[:, col["C_ell_limber_cont(z_s=0.5)"]]
    shot = cl[:, col["C_ell_shot(z_s=0.5)"]]
    assert np.all(shot > 0) and np.all(shot < exp)
    # the windows only suppress (and alias; the taper leaks a little from low ell where the
    # pairs' continuous power has fallen to 0: P(k) below shot noise beyond the mesh)
    big = cont > 0.1 * cont.max()
    assert big.sum() >= 2 and np.all((exp - shot)[big] <= cont[big] * 1.5)
    # the sky C_ell (shot noise removed, decoupled): near the pseudo-C_ell minus shot noise
    # in the lowest bin, where the signal dominates (32^3: the shot noise is 25 % there and
    # most of C_ell above, so the sky C_ell scatters around 0 beyond)
    sky = cl[:, col["C_ell_sky(z_s=0.5)"]]
    assert np.all(np.isfinite(sky)) and abs(np.log(sky[0] / (cl[0, 1] - shot[0]))) < 0.5
    # the shear's E power is the convergence's; its B power (the taper's E-B leakage:
    # the shear is E by construction) is far below it
    e, b = cl[:, col["C_ell_E(z_s=0.5)"]], cl[:, col["C_ell_B(z_s=0.5)"]]
    mid = (cl[:, 0] > 300) & (cl[:, 0] < 1400)
    assert np.all(np.abs(e[mid] / cl[mid, 1] - 1) < 0.3) and np.all(b[mid] < 0.1 * e[mid])
    # halofit has more small-scale power than a 32^3 PM run: above it where resolved
    hf = cl[:, col["C_ell_halofit_cont(z_s=0.5)"]]
    assert np.all(hf[res > 0] > 0.8 * cont[res > 0]) and np.all(hf > 0)
    assert np.all(cl[:, col["C_ell_halofit(bin1:0.3-0.5)"]] > 0)
    assert "ell range z_s=0.5: none" in header
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    n_steps = len(summary["timings"]["steps_s"])
    assert summary["pgd"]["pgd"] is True                    # recorded with its parameters
    assert n_steps == summary["n_stages"] - 1 and len(summary["peak_memory_mb_per_rank"]) == 2
    assert log.count("step 1/%d" % n_steps) == 1            # logged once, on rank 0
    assert log.count("plane ") >= 6


@pytest.mark.single_process
def test_kappa_power_matches_limber(run):
    """Measured flat-sky C_ell vs the expected one from the run's own P(k) at each plane's
    scale factor, through the run's windows (flowpm_mtf.physics.lensing_theory)."""
    out, _ = run
    table = np.loadtxt(os.path.join(out, "kappa_power.txt"))
    ell, measured, limber = table[:, 0], table[:, 1], table[:, 2]
    sel = (ell >= ELL_RANGE[0]) & (ell <= ELL_RANGE[1])
    assert sel.sum() >= 8 and np.all(limber[sel] > 0)
    ratio = measured[sel] / limber[sel]
    gmean = float(np.exp(np.mean(np.log(ratio))))
    assert abs(gmean - 1) < LIMBER_TOL, (gmean, ratio)


def _fails_on_every_rank(args, capsys):
    """``flowpm-mtf lensing ARGS`` on every rank of this world (in-process): the
    configuration error's exit code everywhere, one line (rank 0's), no step run."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    out = comm.bcast(tempfile.mkdtemp() if comm.rank == 0 else None)
    code = cli.main(["lensing", "--nc", "16", "--box-size", "128", "--halo", "2"] + args
                    + ["--out", os.path.join(out, "o")])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("flowpm-mtf: error: ")]
    assert comm.allgather(code) == [ConfigError.exit_code] * comm.size, err[-3000:]
    assert comm.allgather(len(lines)) == [1] + [0] * (comm.size - 1), err[-3000:]
    assert "step 1/" not in err and "graph built" not in err   # before any compute
    return comm.bcast(lines[0] if comm.rank == 0 else None)


def test_source_beyond_lightcone_fails_on_every_rank(capsys):
    line = _fails_on_every_rank(["--a-start", "0.5", "--z-source", "2", "--n-planes", "30"],
                                capsys)
    assert "z_source=2 is beyond the simulated lightcone" in line, line


def test_empty_nz_bin_fails_on_every_rank(capsys):
    line = _fails_on_every_rank(["--a-start", "0.5", "--z-source", "0.3", "--n-planes", "8",
                                 "--nz-smail", "2,4,0.01", "--nz-bins", "0,0.1,0.2"], capsys)
    assert "bin 1 (z 0.1-0.2) holds no sources" in line, line

