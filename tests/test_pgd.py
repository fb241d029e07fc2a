"""PGD (flowpm_mtf.physics.pgd): the displacement against a numpy reference of the same formula
(CIC density, FFT, the kernel O_l O_h / k^2, the four-point gradient, CIC readout) on every
process grid of this world size and on one block, its finite-difference gradient with
respect to the positions, and the gradient of the lightcone's maps through it."""
import mesh_tensorflow as mtf
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import fpm_harness as H
from flowpm_mtf.config import SimConfig
from flowpm_mtf.mesh import fft
import nbody_harness as NH
from flowpm_mtf.physics import lensing as L, lpt, painting
from flowpm_mtf.physics import pgd as P

# float64, the same sums as numpy in another order (FFT, halo and CIC sums): round-off
# ~1e-15 relative, amplified by the high-pass kernel's dynamic range.
NUMPY_RTOL = 1e-11
# Central differences in float64: step 1e-6 cells, truncation ~1e-12, rounding ~1e-10
# relative; a particle crossing a cell edge within +-eps (CIC's kink) has probability ~1e-5.
FD_EPS = 1e-6
FD_RTOL = 1e-6
# Large kernel scales so that the test's 16^3 mesh sees a nonzero kernel on most modes.
PCONF = P.PGDConfig(pgd=True, pgd_alpha0=0.7, pgd_mu=0.0, pgd_kl=0.2, pgd_ks=0.9)
ALPHA = 0.7


def conf_for(grid):
    return SimConfig(nc=16, box_size=160.0, grid=grid, halo_size=2, a_start=0.5, a_end=1.0,
                     n_steps=1, dtype="float64")


def numpy_pgd(pos, conf, pconf, alpha):
    """The PGD displacement of the particles at global positions ``pos`` [N, 3] (numpy)."""
    n = conf.nc[0]
    cell = conf.cell_size[0]
    i0 = np.floor(pos).astype(int)
    t = pos - i0
    rho = np.zeros((n, n, n))
    corners = [(dx, dy, dz) for dx in (0, 1) for dy in (0, 1) for dz in (0, 1)]

    def w(c):
        return np.prod([t[:, d] if c[d] else 1 - t[:, d] for d in range(3)], axis=0)

    for c in corners:
        np.add.at(rho, tuple((i0[:, d] + c[d]) % n for d in range(3)), w(c))
    kf = 2 * np.pi * np.fft.fftfreq(n, d=cell)
    kz = 2 * np.pi * np.fft.rfftfreq(n, d=cell)
    kk = np.sqrt(kf[:, None, None]**2 + kf[None, :, None]**2 + kz[None, None, :]**2)
    kern = np.zeros_like(kk)
    kern[kk > 0] = P.pgd_kernel_values(kk[kk > 0], conf, pconf)
    # the formula itself, not the module's function, on a few modes
    kn, kl, ks = np.pi / cell, pconf.pgd_kl * np.pi / cell, pconf.pgd_ks * np.pi / cell
    sel = kk > 0
    assert kn == P.nyquist(conf)
    np.testing.assert_allclose(kern[sel], np.exp(-(kl / kk[sel])**2) * np.exp(-(kk[sel] / ks)**4)
                               / kk[sel]**2, rtol=1e-14)
    pot_k = np.fft.rfftn(rho) * kern
    wgrid = 2 * np.pi * np.fft.fftfreq(n)
    wz = 2 * np.pi * np.fft.rfftfreq(n)
    out = np.zeros_like(pos)
    for d, wd in enumerate((wgrid[:, None, None], wgrid[None, :, None], wz[None, None, :])):
        ktil = (8 * np.sin(wd) - np.sin(2 * wd)) / (6 * cell)     # FastPM's gradient kernel
        g = np.fft.irfftn(1j * ktil / cell * pot_k, s=(n, n, n), axes=(0, 1, 2))
        for c in corners:
            out[:, d] += w(c) * g[tuple((i0[:, e] + c[e]) % n for e in range(3))]
    return alpha * out


def _build(conf, disp0):
    def build(mesh):
        phs = {}
        d = H.placeholder_input(mesh, phs, "disp", disp0, fft.real_shape(conf)
                                + mtf.Shape([mtf.Dimension("xyz", 3)]))
        x = painting.lattice(conf, mesh) + lpt.field_to_particles(d, conf)
        dx = P.pgd_displacement(x, conf, PCONF, ALPHA)
        loss = mtf.reduce_sum(dx * dx)
        return {"x": painting.to_global(x, conf), "dx": dx, "loss": loss,
                "grad": mtf.gradients([loss], [d])[0]}, phs
    return build


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.RandomState(7)
    disp = rng.uniform(-1.5, 1.5, (16, 16, 16, 3))          # within the 2-cell halo
    direction = rng.randn(16, 16, 16, 3)
    return disp, direction


# On the 4-rank list: the 2x2 grid there, no placement 2x2 here; PGD composes the FFT,
# the radial filter, the gradient stencil and the readout, which run both 1D grids in their
# own files, so on 2 ranks one 1D grid (fpm_harness).
@pytest.mark.parametrize("case", H.cases(single=True, placement=False, one_1d=True),
                         ids=H.case_id)
def test_displacement_matches_numpy(case, inputs):
    """The displacement equals numpy's on every process grid (hence one rank's)."""
    disp, _ = inputs
    conf = conf_for(case[1])
    out = H.run(case[0], conf, _build(conf, disp), feeds=[{"disp": disp}])[0]
    pos = np.asarray(out["x"]).reshape(-1, 3)
    dx = np.asarray(out["dx"]).reshape(-1, 3)
    ref = numpy_pgd(np.mod(pos, 16), conf, PCONF, ALPHA)
    assert np.std(ref) > 1e-3                                     # a real displacement
    assert H.rel_err(dx, ref) < NUMPY_RTOL


@pytest.mark.skipif(H.SIZE != 1, reason="one rank's check (the grids compare the values)")
def test_gradient_finite_differences(inputs):
    """d(sum |dx|^2)/d(positions) against central differences along a random direction."""
    disp, direction = inputs
    conf = conf_for((1, 1))
    r0, rp, rm = H.run("single", conf, _build(conf, disp),
                       feeds=[{"disp": disp}, {"disp": disp + FD_EPS * direction},
                              {"disp": disp - FD_EPS * direction}])
    fd = (rp["loss"] - rm["loss"]) / (2 * FD_EPS)
    an = float(np.sum(r0["grad"] * direction))
    assert abs(fd - an) <= FD_RTOL * abs(an), (fd, an)


@pytest.mark.skipif(H.SIZE != 1, reason="one rank's check")
def test_lightcone_gradient_with_pgd():
    """d(sum kappa^2)/d(linear field) through LPT, the N-body, PGD at each plane stage, the
    planes and the Born sum (lensing.lightcone_forward), against central differences."""
    conf = SimConfig(nc=16, box_size=160.0, grid=(1, 1), halo_size=3, a_start=0.7,
                     a_end=1.0, n_steps=1, dtype="float64")
    geom = L.geometry(conf, L.LensingConfig(z_source=(0.1, 0.07), field_deg=12.0,
                                            field_npix=12, n_planes=2))
    lin0 = NH.linear_field_numpy(conf, seed=11)
    d = np.random.RandomState(1).randn(*conf.nc) * np.std(lin0)

    def build(mesh):
        phs = {}
        lin = H.placeholder_input(mesh, phs, "lin", lin0, fft.real_shape(conf))
        kappa, _, _ = L.lightcone_forward(lin, conf, geom,
                                          pgd=P.PGDConfig(pgd=True, pgd_alpha0=1.0,
                                                          pgd_mu=-0.9))
        loss = mtf.reduce_sum(kappa * kappa)
        return {"loss": loss, "grad": mtf.gradients([loss], [lin])[0]}, phs

    r0, rp, rm = H.run("single", conf, build, feeds=[
        {"lin": lin0}, {"lin": lin0 + FD_EPS * d}, {"lin": lin0 - FD_EPS * d}])
    fd = (rp["loss"] - rm["loss"]) / (2 * FD_EPS)
    an = float(np.sum(r0["grad"] * d))
    assert abs(fd - an) <= FD_RTOL * abs(an), (fd, an)


def test_config_rules():
    """Bad settings are refused with the value named."""
    with pytest.raises(ValueError, match="pgd_kl"):
        P.PGDConfig(pgd_kl=0.0)
    with pytest.raises(ValueError, match="pgd_alpha0"):
        P.PGDConfig(pgd_alpha0=-1.0)
    with pytest.raises(ValueError, match="pgd_mu"):
        P.PGDConfig(pgd_mu=float("nan"))
    assert P.PGDConfig(pgd_alpha0=0.2, pgd_mu=-1.0).alpha(0.5) == pytest.approx(0.4)
    with pytest.raises(ValueError, match="resolve"):
        P.PGDConfig(pgd=True).alpha(0.5)


def _conf(cell):
    return SimConfig(nc=16, box_size=16 * cell, grid=(1, 1), halo_size=3)


@pytest.mark.rank_independent
def test_alpha_by_the_cell_size():
    """None: alpha0 and mu of the fit at the run's cell size (FITS), log alpha0 and mu
    linear in log cell size between them; given values kept; nothing fitted outside."""
    for cell, alpha0, mu, _ in P.FITS:
        r = P.PGDConfig(pgd=True).resolve(_conf(cell))
        assert (r.pgd_alpha0, r.pgd_mu) == pytest.approx((alpha0, mu), rel=1e-12)
    (c0, a0, m0, _), (c1, a1, m1, _) = P.FITS[:2]
    mid = np.sqrt(c0 * c1)                                  # halfway in log cell size
    r = P.PGDConfig(pgd=True, pgd_mu=0.5).resolve(_conf(mid))
    assert r.pgd_alpha0 == pytest.approx(np.sqrt(a0 * a1), rel=1e-12) and r.pgd_mu == 0.5
    assert r.alpha(0.5) == pytest.approx(r.pgd_alpha0 * 0.5**0.5)
    given = P.PGDConfig(pgd=True, pgd_alpha0=0.3, pgd_mu=-1.0)
    assert given.resolve(_conf(100.0)) is given              # nothing to choose
    off = P.PGDConfig(pgd=False)
    assert off.resolve(_conf(100.0)) is off                  # PGD off: nothing to choose
    with pytest.raises(ValueError, match=r"fitted for cells of .*this run's are 100 Mpc/h"):
        P.PGDConfig(pgd=True).resolve(_conf(100.0))
    with pytest.raises(ValueError, match="fitted alpha is for --pgd-kl 0.5 --pgd-ks 2"):
        P.PGDConfig(pgd=True, pgd_kl=0.3).resolve(_conf(P.FITS[0][0]))


@pytest.mark.rank_independent
def test_automatic_where_alpha_is_fitted():
    """pgd None (the default): on at fitted cells with the fitted alpha, off elsewhere and
    where the blocks are too narrow; a PGD setting given turns it on."""
    cell, alpha0, mu, _ = P.FITS[-1]
    auto = P.PGDConfig()
    on = auto.resolve(_conf(cell))
    assert on.pgd is True and (on.pgd_alpha0, on.pgd_mu) == (alpha0, mu)
    assert auto.resolve(_conf(16.0)).pgd is False
    narrow = SimConfig(nc=16, box_size=16 * cell, grid=(4, 1), halo_size=3)   # 4-cell blocks
    assert auto.resolve(narrow).pgd is False
    given = P.PGDConfig(pgd_alpha0=0.3, pgd_mu=-1.0).resolve(_conf(16.0))
    assert given.pgd is True and given.pgd_alpha0 == 0.3
    with pytest.raises(ValueError, match="fitted alpha is for --pgd-kl"):
        P.PGDConfig(pgd_kl=0.3).resolve(_conf(cell))          # on, alpha not fitted there
    assert P.PGDConfig(pgd=False).resolve(_conf(cell)).pgd is False


@pytest.mark.rank_independent
def test_is_fitted_only_with_the_fits_alpha():
    """The lensing job's `resolved` trusts PGD's P(k) to 0.75 k_N only at the fitted alpha."""
    cell, alpha0, mu, _ = P.FITS[-1]
    conf = _conf(cell)
    assert P.is_fitted(P.PGDConfig(pgd=True), conf)
    assert P.is_fitted(P.PGDConfig(pgd=True).resolve(conf), conf)
    assert P.is_fitted(P.PGDConfig(pgd=True, pgd_alpha0=alpha0, pgd_mu=mu), conf)
    assert not P.is_fitted(P.PGDConfig(pgd=False), conf)                         # off
    assert not P.is_fitted(P.PGDConfig(pgd=True, pgd_alpha0=2 * alpha0), conf)   # other alpha
    assert not P.is_fitted(P.PGDConfig(pgd=True, pgd_ks=1.0, pgd_alpha0=alpha0,
                                       pgd_mu=mu), conf)                         # other k_s
    assert not P.is_fitted(P.PGDConfig(pgd=True, pgd_alpha0=alpha0, pgd_mu=mu),
                           _conf(8.0))                                           # no fit there
