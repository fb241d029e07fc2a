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
    each bin's modes, in ell bands (the raw estimator: 1.6 % high at ell 200-800)."""
    ell, mc, modes = monte_carlo
    e2, m = T.coupling_matrix(MC_N, MC_FOV, shape=_cl)
    np.testing.assert_allclose(e2, ell)
    lk = 2 * np.pi * np.fft.fftfreq(MC_N, d=np.deg2rad(MC_FOV) / MC_N)
    l2 = np.sqrt(lk[:, None]**2 + lk[None, :]**2).ravel()
    edges = np.arange(0.5, MC_N / 2 + 1e-9, 2.0) * (2 * np.pi / np.deg2rad(MC_FOV))
    b = np.digitize(l2, edges) - 1
    ok = (b >= 0) & (b < edges.size - 1) & (l2 > 0)
    bare = np.bincount(b[ok], _cl(l2[ok]), edges.size - 1) / np.maximum(modes, 1)
    sky = T.decouple(mc, m)
    for lo, hi in ((200, 800), (800, 1600), (1600, 2600)):
        s = (ell >= lo) & (ell < hi) & (modes > 0)
        assert abs(sky[s].sum() / bare[s].sum() - 1) < MC_BAND_RTOL, (lo, hi)
    s = (ell >= 200) & (ell < 800)
    assert mc[s].sum() / bare[s].sum() > 1.012


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
