"""Full-sky lensing (flowpm_mtf.physics.lensing_fullsky): HEALPix pixels against healpy,
shell count maps on every process grid against a numpy + healpy painting of the same
particles (exact counts), and with PGD (the job's corrected particles,
flowpm_mtf.jobs.lensing_pgd) against the painting of the particles moved by test_pgd's numpy
displacement; the Born weights, the gradient with respect to the particle weights, and the
full-sky shear (flowpm_mtf.physics.lensing_fullsky_stats) on a pure-E field
and a known potential."""
import healpy as hp
import mesh_tensorflow as mtf
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import fpm_harness as H
from test_pgd import numpy_pgd
from flowpm_mtf.config import SimConfig
from flowpm_mtf.mesh import fft
from flowpm_mtf.physics import cosmology as C
from flowpm_mtf.physics import lensing_fullsky as F, lensing_fullsky_stats as FS
from flowpm_mtf.physics import lensing_geometry, lpt, painting, pgd
from flowpm_mtf.jobs import lensing_pgd

# Counts are sums of 0/1 weights in float64: exact integers in any order of summation.
COUNT_ATOL = 1e-9
# The Born sum is a few float64 products per pixel: round-off only.
BORN_RTOL = 1e-12
# Central differences of a linear function of the weights in float64: round-off ~1e-12.
FD_RTOL = 1e-7
# B-modes of a pure-E field through map2alm/alm2map_spin at lmax = 2 nside: healpy's
# quadrature error (iter=3), ~1e-4 of E observed; the bound is 1 %.
B_OVER_E = 0.01

# The E power of the shear against kappa's times the spin-2 factor: both from map2alm of
# band-limited maps at lmax = 2 nside (quadrature error ~1e-4 per multipole).
SPIN2_RTOL = 1e-2
# The analytic shear of an axisymmetric convergence against the harmonic shear at nside 16,
# lmax = 2 nside: healpy's quadrature of a band-limited map (3e-4 of the peak observed;
# 1e-2 at lmax = 3 nside - 1). A wrong sign or spin-2 factor is an O(1) error.
KNOWN_SHEAR_ATOL = 2e-3

NSIDE = 8


def sky_conf(grid=(1, 1)):
    """8^3 particles in a 64 Mpc/h box, lightcone to z = 0.05 (146 Mpc/h, 2.3 boxes) in 3
    shells of 49 Mpc/h: the far shell meets dozens of replicas, the near one the 8 around
    the corner."""
    return SimConfig(nc=8, box_size=64.0, grid=grid, halo_size=2, a_start=0.9, a_end=1.0,
                     n_steps=1, dtype="float64")


LCONF = lensing_geometry.LensingConfig(z_source=(0.05, 0.03), n_planes=3)
SCONF = F.FullSkyConfig(sky="full", nside=NSIDE)


@pytest.mark.rank_independent
def test_vec2pix_matches_healpy():
    """Random directions, the poles' neighbourhoods and the belt's edges |z| = 2/3: the
    RING pixel of every vector equals healpy's, for nside 1 to 64."""
    rng = np.random.RandomState(1)
    v = rng.normal(size=(20000, 3))
    z = np.concatenate([rng.uniform(-1, 1, 4000), 2 / 3 + rng.uniform(-1e-3, 1e-3, 2000),
                        -2 / 3 + rng.uniform(-1e-3, 1e-3, 2000), 1 - rng.uniform(0, 1e-4, 2000)])
    phi = rng.uniform(-np.pi, np.pi, z.size)
    s = np.sqrt(1 - z**2)
    v = np.concatenate([v, np.stack([s * np.cos(phi), s * np.sin(phi), z], -1) * 3.0])
    with tf.Graph().as_default(), tf.Session() as sess:
        ph = tf.placeholder(tf.float64, [None, 3])
        outs = {n: F.vec2pix_ring(ph[:, 0], ph[:, 1], ph[:, 2], n) for n in (1, 2, 8, 64)}
        got = sess.run(outs, {ph: v})
    for n, pix in got.items():
        np.testing.assert_array_equal(pix, hp.vec2pix(n, v[:, 0], v[:, 1], v[:, 2]), str(n))


def numpy_counts(pos, conf, geom, index):
    """Counts per RING pixel of shell ``index`` (numpy + healpy): every replica in a cube
    of +-(r_hi / L + 1) boxes, independently of ``shell_replicas``."""
    nc, cell = np.asarray(conf.nc, float), np.asarray(conf.cell_size)
    g = np.mod(pos * geom.flip[index] + geom.shift[index], nc) * cell
    lo, hi = geom.r_edges[index], geom.r_edges[index + 1]
    n = int(np.ceil(hi / conf.box_size[0])) + 1
    out = np.zeros(geom.npix)
    for r in np.stack(np.meshgrid(*[np.arange(-n, n + 1)] * 3, indexing="ij"), -1).reshape(-1, 3):
        x = g + r * np.asarray(conf.box_size)
        d = np.sqrt((x**2).sum(-1))
        sel = (d >= lo) & (d < hi)
        out += np.bincount(hp.vec2pix(geom.nside, *x[sel].T), minlength=geom.npix)
    return out


@pytest.fixture(scope="module")
def particles():
    """Displaced lattice (global positions [cells]) and the displacement field."""
    conf = sky_conf()
    rng = np.random.RandomState(5)
    disp = rng.uniform(-1.5, 1.5, conf.nc + (3,))               # within the 2-cell halo
    q = np.indices(conf.nc).reshape(3, -1).T
    return q + disp.reshape(-1, 3), disp


@pytest.mark.parametrize("case", H.cases(single=True, placement=False), ids=H.case_id)
def test_shell_counts_match_healpy(case, particles):
    """Each shell's count map, painted by every rank for its own particles and all-reduced,
    equals numpy + healpy's painting of the same particles (exact counts) on every grid;
    the counts' total is the particle density times the shell volume (within Poisson)."""
    conf = sky_conf(case[1])
    geom = F.fullsky_geometry(conf, LCONF, SCONF)
    pos, disp = particles
    assert len(geom.replicas[-1]) > 20 and np.any(geom.shift != 0)

    def build(mesh):
        d = mtf.import_tf_tensor(mesh, tf.constant(disp),
                                 fft.real_shape(conf) + mtf.Shape([mtf.Dimension("xyz", 3)]))
        x = painting.lattice(conf, mesh) + lpt.field_to_particles(d, conf)
        return {"c%d" % i: F.shell_counts(x, conf, geom, i) for i in range(geom.n_planes)}

    out = H.run(case[0], conf, build)
    for i in range(geom.n_planes):
        ref = numpy_counts(pos, conf, geom, i)
        np.testing.assert_allclose(out["c%d" % i], ref, atol=COUNT_ATOL, rtol=0, err_msg=str(i))
        mean = F.mean_count(conf, geom, i) * geom.npix
        assert abs(ref.sum() - mean) < 5 * np.sqrt(mean) + 0.05 * mean, (i, ref.sum(), mean)


# PGD on the shells: a 16^3 mesh (blocks of 8 on the 2x2 grid, wider than the halo plus the
# gradient's reach) in 128 Mpc/h, 8 Mpc/h cells as sky_conf; test_pgd's kernel scales (large,
# so that 16^3 sees the kernel on most modes) and an alpha(a) that differs per shell.
PGD_CONF = pgd.PGDConfig(pgd=True, pgd_alpha0=0.7, pgd_mu=-0.9, pgd_kl=0.2, pgd_ks=0.9)
# The mtf displacement equals numpy's to ~1e-11 relative (test_pgd.NUMPY_RTOL): a particle
# changes pixel or shell only within ~1e-11 cells of an edge (probability ~1e-9 here), so the
# counts are exact.


@pytest.mark.parametrize("case", H.cases(single=True, placement=False), ids=H.case_id)
def test_pgd_shells_match_healpy(case):
    """The shells painted from the job's PGD-corrected particles (lensing_pgd.PGDParticles,
    alpha(a) of each shell's stage fed) equal numpy + healpy's painting of the particles moved
    by test_pgd's numpy displacement, on every grid; the correction moves counts."""
    from types import SimpleNamespace

    conf = SimConfig(nc=16, box_size=128.0, grid=case[1], halo_size=2, a_start=0.9,
                     a_end=1.0, n_steps=1, dtype="float64")
    geom = F.fullsky_geometry(conf, LCONF, SCONF)
    rng = np.random.RandomState(8)
    disp = rng.uniform(-1.5, 1.5, conf.nc + (3,))                # within the 2-cell halo
    pos = np.indices(conf.nc).reshape(3, -1).T + disp.reshape(-1, 3)
    made = {}

    def build(mesh):
        d = mtf.import_tf_tensor(mesh, tf.constant(disp),
                                 fft.real_shape(conf) + mtf.Shape([mtf.Dimension("xyz", 3)]))
        x = painting.lattice(conf, mesh) + lpt.field_to_particles(d, conf)
        # the graph's parts PGDParticles reads; stage i is shell i's scale factor
        graph = SimpleNamespace(conf=conf, stages=np.asarray(geom.a),
                                variables=SimpleNamespace(positions=x), weights=None)
        made["pgd"] = c = lensing_pgd.PGDParticles(graph, mesh, PGD_CONF)
        return ({"c%d" % i: F.shell_counts(c.positions, conf, geom, i)
                 for i in range(geom.n_planes)}, {"alpha": c.alpha})

    alphas = [PGD_CONF.pgd_alpha0 * a**PGD_CONF.pgd_mu for a in geom.a]
    outs = H.run(case[0], conf, build, feeds=[{"alpha": [al]} for al in alphas])
    for i, al in enumerate(alphas):
        np.testing.assert_allclose(made["pgd"].feed(i)[made["pgd"].alpha], [al], rtol=1e-15)
        moved = pos + numpy_pgd(np.mod(pos, 16), conf, PGD_CONF, al)
        ref = numpy_counts(moved, conf, geom, i)
        np.testing.assert_allclose(outs[i]["c%d" % i], ref, atol=COUNT_ATOL, rtol=0,
                                   err_msg=str(i))
        assert np.abs(ref - numpy_counts(pos, conf, geom, i)).sum() > 10, i   # PGD moved some


def test_born_weights_and_weight_gradient():
    """kappa from given count maps equals the Born sum written out from its definition
    (distances from the geometry); and the gradient of a loss of kappa with respect to
    the particle weights equals central differences (the map is linear in them)."""
    conf = sky_conf(H.HVD_GRIDS[H.SIZE][0])     # one block per rank of this world
    geom = F.fullsky_geometry(conf, LCONF, SCONF)
    rng = np.random.RandomState(3)
    counts = [F.mean_count(conf, geom, i) * (1 + 0.3 * rng.normal(size=geom.npix))
              for i in range(geom.n_planes)]

    def build(mesh):
        hp_dim = mtf.Dimension(F.HPIX, geom.npix)
        cs = [mtf.import_tf_tensor(mesh, tf.constant(c), mtf.Shape([hp_dim])) for c in counts]
        return {"kappa": F.born_convergence_fullsky(cs, conf, geom)}

    kappa = H.run("hvd", conf, build)["kappa"]
    om = conf.cosmology.Omega_m
    expect = np.zeros((2, geom.npix))
    for s in range(2):
        for i in range(geom.n_planes):
            r, a, w = geom.r[i], geom.a[i], geom.width[i]
            g = max(0.0, 1 - r / geom.chi_source[s])
            delta = counts[i] / F.mean_count(conf, geom, i) - 1
            expect[s] += 1.5 * om * (100.0 / C.C_KMS)**2 * w * r / a * g * delta
    assert H.rel_err(kappa, expect) < BORN_RTOL
    nbar_v = conf.n_particles / 64.0**3 * 4 * np.pi / 3 * np.diff(geom.r_edges**3)
    np.testing.assert_allclose([F.mean_count(conf, geom, i) * geom.npix for i in range(3)],
                               nbar_v, rtol=1e-12)

    # gradient with respect to the slot weights
    wt0 = rng.uniform(0.5, 1.5, conf.nc)
    probe = rng.normal(size=(2, geom.npix))

    def build_grad(mesh):
        ph = tf.placeholder(tf.float64, conf.nc)
        w3 = mtf.import_tf_tensor(mesh, ph, fft.real_shape(conf))
        wt = lpt.field_to_particles(w3, conf)
        x = painting.lattice(conf, mesh)
        k = F.born_convergence_fullsky([F.shell_counts(x, conf, geom, i, weight=wt)
                                        for i in range(geom.n_planes)], conf, geom)
        p = mtf.import_tf_tensor(mesh, tf.constant(probe), k.shape)
        loss = mtf.reduce_sum(k * p)
        g = mtf.gradients([loss], [w3])[0]
        return {"loss": loss, "grad": g}, {"w": ph}

    eps = 1e-3
    idx = [(0, 0, 0), (3, 5, 7), (7, 2, 4)]
    feeds = [{"w": wt0}]
    for i in idx:
        for sgn in (1, -1):
            w = wt0.copy()
            w[i] += sgn * eps
            feeds.append({"w": w})
    outs = H.run("hvd", conf, build_grad, feeds=feeds)
    grad = outs[0]["grad"]
    assert np.any(grad != 0)
    for j, i in enumerate(idx):
        fd = (outs[1 + 2 * j]["loss"] - outs[2 + 2 * j]["loss"]) / (2 * eps)
        assert abs(fd - grad[i]) <= FD_RTOL * max(abs(fd), 1e-30) + 1e-15, (i, fd, grad[i])


@pytest.mark.rank_independent
def test_shear_of_pure_e_field():
    """A Gaussian random convergence: the shear from the potential's harmonics has the E
    power of kappa (times the spin-2 factor (l+2)(l-1)/(l(l+1))) and B < 1 % of E."""
    nside = 16
    lmax = 2 * nside
    ell = np.arange(lmax + 1)
    cl = np.where(ell >= 2, 1e-9 * (ell + 1.0)**-1.5, 0.0)
    np.random.seed(11)
    kappa = hp.synfast(cl, nside, lmax=lmax)
    g1, g2 = FS.shear_fullsky(kappa, lmax=lmax)
    cl_e, cl_b = FS.shear_eb(g1, g2, lmax=lmax)
    sel = ell >= 2
    assert np.all(cl_b[sel] < B_OVER_E * cl_e[sel]), (cl_b[sel] / cl_e[sel]).max()
    f2 = (ell + 2.0) * (ell - 1) / np.maximum(ell * (ell + 1.0), 1)
    ck = hp.anafast(kappa, lmax=lmax)
    np.testing.assert_allclose(cl_e[sel], f2[sel] * ck[sel], rtol=SPIN2_RTOL)


@pytest.mark.rank_independent
def test_shear_of_known_potential():
    """An axisymmetric convergence around the north pole (a Gaussian beam's Legendre
    series): gamma_1 = kappa - 2 cos(theta) / (1 + cos(theta)) * mean kappa inside theta
    (the exact spherical form of kappa - kappa_bar, from gamma = 1/2 eth eth psi), gamma_2 = 0;
    the mean inside theta from int_x^1 P_l = (P_{l-1}(x) - P_{l+1}(x)) / (2l + 1)."""
    from scipy.special import eval_legendre
    nside, sigma = 16, 0.2
    lmax = 2 * nside
    ell = np.arange(lmax + 2)
    b = np.exp(-0.5 * ell * (ell + 1) * sigma**2) * (2 * ell + 1) / (4 * np.pi)
    b[:2] = 0.0        # no monopole (no potential has one) and no dipole (spin 2 starts at 2)
    theta, _ = hp.pix2ang(nside, np.arange(hp.nside2npix(nside)))
    x = np.cos(theta)
    kappa = sum(b[l] * eval_legendre(l, x) for l in range(lmax + 1))
    # int_0^theta kappa sin = sum b_l (P_{l-1}(x) - P_{l+1}(x)) / (2l+1)
    inner = sum(b[l] * (eval_legendre(l - 1, x) - eval_legendre(l + 1, x))
                                 / (2 * l + 1) for l in range(1, lmax + 1))
    kbar = inner / np.maximum(1 - x, 1e-300)
    expect = kappa - 2 * x / (1 + x) * kbar
    g1, g2 = FS.shear_fullsky(kappa, lmax=lmax)
    north = theta < 2.5     # near the south pole the formula is 0/0 (no mass left outside)
    scale = np.abs(expect[north]).max()
    err = np.abs(g1 - expect)[north].max() / scale
    assert err < KNOWN_SHEAR_ATOL, err
    assert np.abs(g2).max() < KNOWN_SHEAR_ATOL * scale
    assert g1[np.argmax(np.abs(expect) * north)] < 0     # tangential: -gamma_1 > 0 around a mass


# The pixel window from NESTED sub-pixel centres against a Monte Carlo of the defining
# double integral (random points in each pixel by healpy.vec2pix): the sub-pixel midpoint
# rule (~0.3 % in w^2 at ell = 2 nside) and the Monte Carlo's noise (~0.1 %).
PIXWIN_RTOL = 1e-2


@pytest.mark.rank_independent
def test_pixel_window_against_monte_carlo():
    """w_ell^2 = mean over pixels of the mean of P_ell(n.n') over pairs of points in the
    pixel, with 64 uniform random points per pixel, at nside 8 up to ell = 2 nside."""
    from scipy.special import eval_legendre
    nside, per = 8, 64
    npix = hp.nside2npix(nside)
    rng = np.random.RandomState(2)
    v = rng.normal(size=(npix * per * 3, 3))
    v /= np.linalg.norm(v, axis=1)[:, None]
    pix = hp.vec2pix(nside, *v.T)
    order = np.argsort(pix, kind="stable")
    counts = np.bincount(pix, minlength=npix)
    assert counts.min() >= per
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    pts = np.stack([v[order[s:s + per]] for s in starts])           # [npix, per, 3]
    c = np.einsum("pid,pjd->pij", pts, pts).ravel()
    lmax = 2 * nside
    mc = np.array([eval_legendre(ell, c).mean() for ell in range(lmax + 1)])
    w = FS.pixel_window(nside, lmax)
    np.testing.assert_allclose(w**2, mc, rtol=PIXWIN_RTOL)
    assert w[0] == 1.0 and np.all(np.diff(w) < 0)


@pytest.mark.rank_independent
def test_limber_of_the_shells_for_a_power_law():
    """P(k) = A k^-2 makes P((l+1/2)/r) / r^2 constant across a shell, so the shell integral is
    exact: C_ell = sum_i c_i^2 A / ((l+1/2)^2 Delta r_i); and the shot noise is
    sum_i c_i^2 4 pi / N_i with N_i = nbar V_i."""
    conf = sky_conf()
    geom = F.fullsky_geometry(conf, LCONF, SCONF)
    amp = 3.0
    ell = np.array([5.0, 20.0, 100.0])
    got = FS.limber_shells(ell, conf, geom, [lambda k: amp / k**2] * geom.n_planes)
    coef = lensing_geometry.born_coefficients(conf, geom.base)[0]
    expect = sum(c**2 * amp / ((ell + 0.5)**2 * w) for c, w in zip(coef, geom.width))
    np.testing.assert_allclose(got, expect, rtol=BORN_RTOL)
    nbar = conf.n_particles / 64.0**3
    n_i = nbar * 4 * np.pi / 3 * np.diff(geom.r_edges**3)
    assert FS.shot_noise(conf, geom) == pytest.approx(np.sum(coef**2 * 4 * np.pi / n_i),
                                                      rel=1e-12)


@pytest.mark.rank_independent
def test_prediction_is_averaged_over_each_bin_like_the_measurement(monkeypatch):
    """With the bins' edges, fullsky_prediction's columns are the (2l + 1)-weighted means over
    each bin of the per-multipole predictions, as kappa_cl_fullsky bins the measured C_l (here
    P(k) = A k^-2, whose C_l is exact, for the run's and halofit's power); at the bin's mean
    multipole instead, the lowest bin [2, 4) would be 8 % low."""
    conf = sky_conf()
    geom = F.fullsky_geometry(conf, LCONF, SCONF)
    amp = 3.0
    power_law = lambda k: amp / k**2   # noqa: E731
    monkeypatch.setattr(FS.lensing_theory, "true_power", lambda k, p, conf: power_law)
    monkeypatch.setattr(FS.lensing_theory, "halofit_functions",
                        lambda cosmo, a: [power_law] * len(a))
    coef = lensing_geometry.born_coefficients(conf, geom.base)[0]
    edges = FS.bin_edges(geom.nside)
    l_all = np.arange(edges[-1], dtype=np.float64)
    c_l = sum(c**2 * amp / ((l_all + 0.5)**2 * w) for c, w in zip(coef, geom.width))
    ell, expect, _ = FS.bin_cl(c_l, edges)
    table = np.ones((geom.n_planes, 3))
    pred = FS.fullsky_prediction(conf, geom, table, table, ell, edges)
    pw2 = FS.pixel_window(geom.nside, edges[-1] - 1)**2
    shot = FS.shot_noise(conf, geom)
    for cont, windowed in (("limber_cont", "limber"), ("halofit_cont", "halofit")):
        np.testing.assert_allclose(pred[cont][0], expect, rtol=BORN_RTOL)
        np.testing.assert_allclose(pred[windowed][0], FS.bin_cl(c_l * pw2, edges)[1] + shot,
                                   rtol=BORN_RTOL)
    at_centre = sum(c**2 * amp / ((ell[0] + 0.5)**2 * w) for c, w in zip(coef, geom.width))
    assert at_centre / expect[0] < 0.93
