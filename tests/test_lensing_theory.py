"""The expected convergence power of a run (flowpm_mtf.physics.lensing_theory): the taper and
ray-sampling expectation against a Monte-Carlo of the estimator, the 3D CIC deconvolution
against a brute-force grid power, the shell power's normalisation and Limber limit, and
the resolved range. numpy only (one process)."""
import numpy as np
import pytest

from flowpm_mtf.physics import lensing as L
from flowpm_mtf.physics import lensing_theory as T
from flowpm_mtf.config import SimConfig

pytestmark = pytest.mark.single_process

# Monte-Carlo of the tapered estimator: 40 x 16 patches of 64^2 pixels; a band of >= 230
# modes per patch has a relative scatter sqrt(2 / (230 * 640)) ~ 0.4 %: 4 sigma (observed
# 0.996, 1.002, 0.999).
MC_BAND_RTOL = 0.015
# ... and the lowest bin alone: 20 modes per patch, and the 16 patches of a realisation share
# its large scales: the mean over the 40 realisations scatters by 2.4 % (their spread); 3.3
# sigma. C at the bin's mean ell instead of the bins' average is off by 15 %.
MC_LOWEST_BIN_RTOL = 0.08
# true_power inverts the angle-averaged CIC window with 8 x 8 directions: the quadrature
# of sinc^4 products is good to ~0.5 %; the grid's own shells (not directions) add ~1 %.
DECONV_RTOL = 0.03
# The padded potential's B power beyond the estimator's own E-B leakage, in units of E.
EB_LEAK = 0.01
# Images +-4 per axis of sinc^4: the neglected tail sum_{|n|>4} (1/(pi n))^4 ~ 1e-4.
PIXEL_WINDOW_RTOL = 1e-3
# shell_power of a constant: its weights sum to 1 up to the tail integral (1e-4).
SHELL_RTOL = 1e-3


def _cl(l):
    """A steep lensing-like spectrum, 0 below ell = 50 (no mode below the box)."""
    l = np.asarray(l, np.float64)
    out = 1e-8 * (np.maximum(l, 1.0) / 100.0)**-1.3 * np.exp(-(l / 3000.0)**2)
    out[l < 50] = 0.0
    return out


MC_N, MC_FOV = 64, 4.0


@pytest.fixture(scope="module")
def monte_carlo():
    """Gaussian fields of power C(ell) on a periodic sky 4x the map's side, cut into 16
    maps per realisation: the mean of kappa_power_spectrum (tapered)."""
    n, fov, big = MC_N, MC_FOV, 4
    nn = big * n
    dth = np.deg2rad(fov) / n
    lk = 2 * np.pi * np.fft.fftfreq(nn, d=dth)
    amp = np.sqrt(_cl(np.sqrt(lk[:, None]**2 + lk[None, :]**2))) / dth * nn / (nn * dth) * dth
    rng = np.random.RandomState(7)
    acc, count = 0.0, 0
    for _ in range(40):
        g = np.fft.ifft2(amp * (rng.randn(nn, nn) + 1j * rng.randn(nn, nn))).real * nn
        for a in range(0, nn, n):
            for b in range(0, nn, n):
                ell, c, modes = L.kappa_power_spectrum(g[a:a + n, b:b + n], fov)
                acc, count = acc + c, count + 1
    return ell, acc / count, modes


def test_expected_pseudo_cl_matches_monte_carlo(monte_carlo):
    """The Monte-Carlo mean of the tapered estimator equals expected_pseudo_cl in ell
    bands, including the taper's mode coupling (+4 % at ell 200-800 on this spectrum)
    that the bare C(ell) misses."""
    n, fov = MC_N, MC_FOV
    ell, mc, modes = monte_carlo
    e2, expect, m2 = T.expected_pseudo_cl(lambda lx, ly: _cl(np.sqrt(lx**2 + ly**2)), n, fov,
                                          images=0)
    np.testing.assert_array_equal(m2, modes)
    np.testing.assert_allclose(e2, ell)
    bare = _cl(ell)
    for lo, hi in ((200, 800), (800, 1600), (1600, 2600)):
        s = (ell >= lo) & (ell < hi) & (modes > 0)
        ratio = mc[s].sum() / expect[s].sum()
        assert abs(ratio - 1) < MC_BAND_RTOL, (lo, hi, ratio)
    s = (ell >= 200) & (ell < 800)
    assert mc[s].sum() / bare[s].sum() > 1.025           # the coupling the model captures


def test_master_decoupling_recovers_bare_power(monte_carlo):
    """The MASTER coupling matrix of the tapered estimator (coupling_matrix, the spectrum's
    shape within a bin) inverted on the Monte-Carlo mean gives the bare C(ell) averaged over
    each bin's modes (bin_average, the continuum columns' definition), in ell bands (the raw
    estimator: 1.6 % high at ell 200-800) and in the lowest bin, where C at the bin's mean
    ell would be 15 % short of it."""
    ell, mc, modes = monte_carlo
    e2, m = T.coupling_matrix(MC_N, MC_FOV, shape=_cl)
    np.testing.assert_allclose(e2, ell)
    bare = T.bin_average(_cl, MC_N, MC_FOV)
    sky = T.decouple(mc, m)
    for lo, hi in ((200, 800), (800, 1600), (1600, 2600)):
        s = (ell >= lo) & (ell < hi) & (modes > 0)
        assert abs(sky[s].sum() / bare[s].sum() - 1) < MC_BAND_RTOL, (lo, hi)
    s = (ell >= 200) & (ell < 800)
    assert mc[s].sum() / bare[s].sum() > 1.012
    # the lowest bin: 20 modes x 640 maps, ~1.3 % scatter
    assert abs(sky[0] / bare[0] - 1) < MC_LOWEST_BIN_RTOL, sky[0] / bare[0]
    assert bare[0] / _cl(ell[:1])[0] > 1.1


def test_bin_average_is_the_mean_over_each_bins_modes():
    """bin_average of a power law against the mode sums written out: the lowest bin of
    kappa_power_spectrum holds |n| = 1, sqrt 2, 2 (4 modes each) and sqrt 5 (8), in units of
    the fundamental; every bin against a loop over the FFT grid's modes."""
    n, fov, s = 16, 5.0, -1.4
    lf = 2 * np.pi / np.deg2rad(fov)
    got = T.bin_average(lambda l: l**s, n, fov)
    lowest = (4 + 4 * 2**(s / 2) + 4 * 2**s + 8 * 5**(s / 2)) / 20 * lf**s
    assert got[0] == pytest.approx(lowest, rel=1e-12)
    edges = np.arange(0.5, n / 2 + 1e-9, 2.0) * lf
    sums, counts = np.zeros(edges.size - 1), np.zeros(edges.size - 1)
    for i in range(n):
        for j in range(n):
            ell = lf * np.hypot(min(i, n - i), min(j, n - j))
            b = np.searchsorted(edges, ell, side="right") - 1
            if ell > 0 and 0 <= b < edges.size - 1:
                sums[b] += ell**s
                counts[b] += 1
    np.testing.assert_allclose(got, sums / counts, rtol=1e-12)


def test_run_prediction_continuum_is_averaged_over_each_bins_modes():
    """run_prediction's continuum columns (C_ell_limber_cont, C_ell_halofit_cont) are the
    Limber sum without windows averaged over the FFT modes of each bin, as the measurement
    (continuous_cl at every mode of the 2-d grid, binned here): not its value at the bin's
    mean ell, 10 % or more below in the lowest bin of this steep spectrum."""
    conf = SimConfig(nc=16, box_size=160.0, a_start=0.7, a_end=1.0, n_steps=1,
                     dtype="float64")
    geom = L.geometry(conf, L.LensingConfig(z_source=(0.1,), field_deg=5.0, field_npix=16,
                                            n_planes=3))
    k = np.geomspace(0.04, 3.0, 16)   # pairs' power above the particles' 1/nbar = 1e3 to k ~ 3
    tables = np.stack([k] * geom.n_planes), np.stack([2e5 * (k / 0.1)**-1.5] * geom.n_planes)
    pred = T.run_prediction(conf, geom, *tables, [0])
    w = L.born_coefficients(conf, geom)[0]
    pfuns = [T.pair_power(T.true_power(tables[0][i], tables[1][i], conf), conf)
             for i in range(geom.n_planes)]
    hfuns = [T.halofit_mod.halofit_power_function(conf.cosmology, a) for a in geom.a]
    dth = np.deg2rad(geom.field_deg) / geom.npix
    lk = 2 * np.pi * np.fft.fftfreq(geom.npix, d=dth)
    edges = np.arange(0.5, geom.npix / 2 + 1e-9, 2.0) * (2 * np.pi / (geom.npix * dth))
    lx, ly = np.meshgrid(lk, lk, indexing="ij")
    b = np.digitize(np.hypot(lx, ly), edges) - 1
    inside = (b >= 0) & (b < edges.size - 1) & (np.hypot(lx, ly) > 0)
    for got, funs in ((pred["continuous"][0], pfuns),
                      (pred["extra"]["C_ell_halofit_cont"][0], hfuns)):
        c2 = T.continuous_cl(lx[inside], ly[inside], conf, geom, funs, w, windows=False)
        expect = np.bincount(b[inside], c2) / np.bincount(b[inside])
        np.testing.assert_allclose(got, expect, rtol=1e-10)
        at_mean = T.continuous_cl(pred["ell"][:1], 0.0, conf, geom, funs, w, windows=False)
        assert at_mean[0] / got[0] < 0.9


def test_shear_from_padded_potential_adds_no_b_modes():
    """A pure-E shear: Gaussian convergence on a periodic sky 4x the map's side, the true
    shear of each cut map (periodic Kaiser-Squires on the whole sky) against the shear of
    the cut map's potential on a 2x zero-padded field (lensing.shear_from_potential, in
    numpy): the method's B power exceeds the estimator's own E-B leakage (the taper's, the
    true shear's B) by less than 1 % of E at every ell, and their E powers agree to 10 %
    above the lowest bins."""
    n, fov, big = 64, 4.0, 4
    nn = big * n
    dth = np.deg2rad(fov) / n
    lk = 2 * np.pi * np.fft.fftfreq(nn, d=dth)
    amp = np.sqrt(_cl(np.sqrt(lk[:, None]**2 + lk[None, :]**2)))
    m1, m2 = L.kaiser_squires_kernels(nn)
    p1, p2 = L.kaiser_squires_kernels(2 * n)
    rng = np.random.RandomState(9)
    acc = 0.0
    for _ in range(2):
        kh = np.fft.fft2(np.fft.ifft2(amp * (rng.randn(nn, nn) + 1j * rng.randn(nn, nn))).real)
        g1, g2 = np.fft.ifft2(kh * m1).real, np.fft.ifft2(kh * m2).real
        k = np.fft.ifft2(kh).real
        for a in range(0, nn, n):
            for b in range(0, nn, n):
                cut = k[a:a + n, b:b + n]
                ph = np.fft.fft2(np.pad(cut - cut.mean(), ((0, n), (0, n))))
                ell, te, tb, _ = L.shear_eb_power(g1[a:a + n, b:b + n], g2[a:a + n, b:b + n], fov)
                _, pe, pb, _ = L.shear_eb_power(np.fft.ifft2(ph * p1).real[:n, :n],
                                                np.fft.ifft2(ph * p2).real[:n, :n], fov)
                acc += np.array([te, tb, pe, pb])
    te, tb, pe, pb = acc
    assert np.all(pb - tb < EB_LEAK * te), (pb - tb) / te
    assert np.all(np.abs(pe[2:] / te[2:] - 1) < 0.1), pe / te
    assert np.all(tb[4:] < 0.05 * te[4:])                      # the taper's own leakage


def test_pixel_window_of_painted_points():
    """Points painted with CIC on the ray grid: their white self-power through
    pixel_window and its aliases (expected_pseudo_cl, no taper) is the closed form of
    Hockney & Eastwood, prod_axes (1 - 2/3 sin^2(ell dtheta / 2)), at every ell (a
    periodic map: pad 1, no taper)."""
    n, fov = 32, 3.0
    dth = np.deg2rad(fov) / n
    e, c, m = T.expected_pseudo_cl(lambda lx, ly: T.pixel_window(lx, ly, dth), n, fov,
                                   taper=0.0, pad=1, images=4)
    lk = 2 * np.pi * np.fft.fftfreq(n, d=dth)
    hw = ((1 - 2 / 3 * np.sin(lk[:, None] * dth / 2)**2)
          * (1 - 2 / 3 * np.sin(lk[None, :] * dth / 2)**2)).ravel()
    l2 = np.sqrt(lk[:, None]**2 + lk[None, :]**2).ravel()
    edges = np.arange(0.5, n / 2 + 1e-9, 2.0) * (2 * np.pi / (n * dth))
    b = np.digitize(l2, edges) - 1
    ok = (b >= 0) & (b < edges.size - 1) & (l2 > 0)
    ref = np.bincount(b[ok], hw[ok], edges.size - 1) / np.maximum(m, 1)
    np.testing.assert_allclose(c[m > 0], ref[m > 0], rtol=PIXEL_WINDOW_RTOL)


def test_ray_sampling_aliasing():
    """A white continuous spectrum sampled at the pixels: the aliases make the expected
    power (2 images + the principal per axis: 9 copies) 9 x the bare one at every ell."""
    e, c, m = T.expected_pseudo_cl(lambda lx, ly: np.full(np.broadcast(lx, ly).shape, 2e-9),
                                   32, 3.0, taper=0.1, images=1)
    ok = m > 0
    np.testing.assert_allclose(c[ok], 9 * 2e-9, rtol=1e-10)


def test_true_power_inverts_cic_grid_power():
    """A continuous P(k) painted with 3D CIC on a 32^3 grid of 4 Mpc/h: the expected grid
    power of each mode (sum over 3^3 images of W^2 P) averaged in the run's shells is the
    table true_power inverts; it recovers P at the shells' mean k."""
    conf = SimConfig(nc=32, box_size=128.0, a_start=0.5, a_end=1.0, n_steps=1)
    d = conf.cell_size[0]
    kn = np.pi / d

    def ptrue(k):
        return 2e4 * (k / 0.05)**-1.6 / (1 + (k / 0.05)**-2) * np.exp(-(k / 2.0)**2)

    k1 = 2 * np.pi * np.fft.fftfreq(32, d=d)
    kx, ky, kz = np.meshgrid(k1, k1, k1, indexing="ij")
    grid = 0.0
    for a in (-1, 0, 1):
        for b in (-1, 0, 1):
            for c in (-1, 0, 1):
                qx, qy, qz = kx + 2 * kn * a, ky + 2 * kn * b, kz + 2 * kn * c
                w = (np.sinc(qx * d / 2 / np.pi) * np.sinc(qy * d / 2 / np.pi)
                     * np.sinc(qz * d / 2 / np.pi))**4
                grid = grid + w * ptrue(np.sqrt(qx**2 + qy**2 + qz**2))
    kk = np.sqrt(kx**2 + ky**2 + kz**2).ravel()
    dk = 2 * np.pi / 128.0
    edges = (np.arange(17) + 0.5) * dk
    b = np.digitize(kk, edges) - 1
    ok = (b >= 0) & (b < 16)
    cnt = np.bincount(b[ok], minlength=16)
    k_tab = np.bincount(b[ok], kk[ok], 16) / cnt
    p_tab = np.bincount(b[ok], grid.ravel()[ok], 16) / cnt
    assert p_tab[-1] / ptrue(k_tab[-1]) < 0.6             # the window is strong at Nyquist
    got = T.true_power(k_tab, p_tab, conf)(k_tab)
    np.testing.assert_allclose(got, ptrue(k_tab), rtol=DECONV_RTOL)


def test_shell_power_normalisation_and_limber():
    """Constant P: the shell weights sum to 1. A power law: P_s -> P(k) when k dr >> 1
    and below it at k dr ~ 10 (Limber overestimates a thick shell's power there)."""
    const = T.shell_power(lambda k: np.full(np.shape(k), 5.0), 192.0, 256.0)
    np.testing.assert_allclose(const(np.array([0.01, 0.1, 1.0])), 5.0, rtol=SHELL_RTOL)
    ps = T.shell_power(lambda k: k**-2.0, 192.0, 256.0)
    k = np.array([0.05, 0.1, 3.0])
    r = ps(k) / k**-2.0
    assert abs(r[2] - 1) < 0.01 and 0.85 < r[0] < r[1] < 1.0, r


def test_resolved_range():
    ell = np.array([100.0, 200, 300, 400])
    assert T.resolved_range(ell, np.array([0.9, 0.6, 0.4, 0.7])) == (100.0, 200.0)
    assert T.resolved_range(ell, np.array([0.9, 0.9, 0.9, 0.9])) == (100.0, 400.0)
    assert np.isnan(T.resolved_range(ell, np.array([0.1, 0.9, 0.9, 0.9]))[0])


def test_mesh_share_reaches_further_with_pgd():
    """The share of C_ell from k <= f k_N: 1 at low ell, falling with ell, and with PGD's
    fraction (RESOLVED_K_NYQUIST_PGD) never below the PM's, reaching 3x further in ell."""
    conf = SimConfig(nc=64, box_size=256.0, a_start=0.2)
    geom = L.geometry(conf, L.LensingConfig())
    pfuns = [lambda k: k**-1.5] * geom.n_planes
    ell = np.geomspace(10.0, 5000.0, 60)
    pm = T.mesh_share(ell, conf, geom, pfuns)
    pgd = T.mesh_share(ell, conf, geom, pfuns, k_nyquist=T.RESOLVED_K_NYQUIST_PGD)
    assert pm[0] == 1.0 and pgd[0] == 1.0 and pm[-1] < 0.5
    assert np.all(np.diff(pm) <= 1e-12) and np.all(pgd >= pm)
    # a power law: k = ell / r scales with ell, so the PGD share at 3 ell is the PM's at ell
    ratio = T.RESOLVED_K_NYQUIST_PGD / T.RESOLVED_K_NYQUIST
    np.testing.assert_allclose(T.mesh_share(ratio * ell, conf, geom, pfuns,
                                            k_nyquist=T.RESOLVED_K_NYQUIST_PGD), pm, rtol=1e-12)
