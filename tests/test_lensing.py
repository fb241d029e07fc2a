"""Lensing (flowpm_mtf.physics.lensing): density planes against a numpy 2D CIC, the Born sum on
an analytic plane, the same convergence map on every process grid, finite-difference
gradient of a convergence loss with respect to the initial field, the flat-sky C_ell
estimator, and bad input."""
import re

import mesh_tensorflow as mtf
import numpy as np
import pytest
import tensorflow.compat.v1 as tf
from scipy.interpolate import RegularGridInterpolator

import fpm_harness as H
import nbody_harness as NH
from flowpm_mtf.physics import cosmology as C
from flowpm_mtf.mesh import fft
from flowpm_mtf.physics import lensing as L, lpt, painting
from flowpm_mtf.config import SimConfig
from world_share import on_rank0

# Painting and interpolation in float64 compared with numpy implementations of the same
# sums: round-off only (~1e-16 per term, a few hundred terms).
NUMPY_RTOL = 1e-12
# Distributed vs one block, float64: the same operations up to the order of the FFT,
# halo and all-reduce sums (round-off ~1e-15), amplified by 2 N-body steps (test_nbody).
LAYOUT_RTOL = 1e-10
# Central differences in float64 (as test_nbody.py): step 1e-6 of the field amplitude,
# truncation ~1e-12, rounding ~1e-10 relative. The shell membership is a step function
# of z: a particle crossing a shell edge within +-eps would give O(1) (probability ~1e-4).
FD_EPS = 1e-6
FD_RTOL = 1e-6
# Distances from astropy (independent integrator) vs ours: both converge to ~1e-10.
ASTROPY_RTOL = 1e-7


# ----------------------------------------------------------------------------- configs
def plane_conf(grid=(1, 1)):
    """Non-cubic mesh and box (x, y, z differ) so that axis mix-ups show."""
    return SimConfig(nc=(16, 8, 16), box_size=(160.0, 80.0, 96.0), grid=grid, halo_size=2,
                     a_start=0.5, a_end=1.0, n_steps=1, dtype="float64")


PLANE_LCONF = L.LensingConfig(z_source=(0.1, 0.05), field_deg=10.0, field_npix=12, n_planes=4)


def forward_conf(grid=(1, 1)):
    return SimConfig(nc=16, box_size=160.0, grid=grid, halo_size=3, a_start=0.7, a_end=1.0,
                     n_steps=1, lpt_order=2, dtype="float64")


# 2 shells of 146 Mpc/h to z = 0.1 (the second one crosses the box replica at 160 Mpc/h);
# a second source at z = 0.07 lies inside the second shell.
FORWARD_LCONF = L.LensingConfig(z_source=(0.1, 0.07), field_deg=12.0, field_npix=12,
                                n_planes=2)


# ----------------------------------------------------------------------------- planes
def numpy_plane(pos, conf, geom, index):
    """2D CIC of the particles of shell ``index`` (global positions [cells], numpy)."""
    nx, ny, nz = conf.nc
    cz = conf.cell_size[2]
    r_lo, width = geom.r_edges[index] / cz, geom.width[index] / cz
    sel = np.mod(pos[:, 2] - r_lo, nz) < width
    out = np.zeros((nx, ny))
    x, y = pos[sel, 0], pos[sel, 1]
    i, j = np.floor(x).astype(int), np.floor(y).astype(int)
    tx, ty = x - i, y - j
    for di, wx in ((0, 1 - tx), (1, tx)):
        for dj, wy in ((0, 1 - ty), (1, ty)):
            np.add.at(out, ((i + di) % nx, (j + dj) % ny), wx * wy)
    return out / width


# Lensing composes the N-body and the planes: on 2 ranks one 1D grid (one_1d), (2, 1); the
# 4-rank pass's 2x2 grid splits both axes (fpm_harness).
@pytest.mark.parametrize("case", [c for c in H.cases(single=True, placement=False, one_1d=True)
                                  if c[0] != "placement"],
                         ids=H.case_id)
def test_density_planes_match_numpy(case):
    """Each shell's plane equals a numpy 2D CIC of the particles whose line-of-sight
    distance z + n Lz (any replica n) is in the shell, normalised to 1 + delta."""
    conf = plane_conf(case[1])
    geom = L.geometry(conf, PLANE_LCONF)
    rng = np.random.RandomState(5)
    disp = np.zeros(conf.nc + (3,))
    disp[..., :2] = rng.uniform(-1.5, 1.5, conf.nc + (2,))     # within the 2-cell halo
    disp[..., 2] = rng.uniform(-40.0, 40.0, conf.nc)           # any replica along z
    q = np.indices(conf.nc).reshape(3, -1).T

    def build(mesh):
        d = mtf.import_tf_tensor(mesh, tf.constant(disp),
                                 fft.real_shape(conf) + mtf.Shape([mtf.Dimension("xyz", 3)]))
        x = painting.lattice(conf, mesh) + lpt.field_to_particles(d, conf)
        return {"p%d" % i: L.density_plane(x, conf, geom, i) for i in range(geom.n_planes)}

    out = H.run(case[0], conf, build)
    pos = q + disp.reshape(-1, 3)
    total = 0.0
    for i in range(geom.n_planes):
        ref = numpy_plane(pos, conf, geom, i)
        assert H.rel_err(out["p%d" % i], ref) < NUMPY_RTOL, i
        assert 0.5 < out["p%d" % i].mean() < 1.5                 # ~1 + delta
        total += out["p%d" % i].sum() * geom.width[i] / conf.cell_size[2]
    # Every particle is in exactly one shell per box depth of lightcone: the shells
    # cover 293 Mpc/h = 3.05 box depths, so the total count is ~3.05 N.
    n = np.prod(conf.nc)
    assert abs(total / n - geom.r_edges[-1] / conf.box_size[2]) < 0.1


def numpy_ray_born(pos, conf, geom):
    """Born maps of point particles painted with 2D CIC on each plane's ray grid (numpy):
    a particle's angle from the field centre (nearest periodic image, flipped,
    transposed) in units of the pixel, nodes at the pixel centres; counts over the
    expected count per pixel minus the shell's count over its expected count."""
    nx, ny, nz = conf.nc
    cell = np.asarray(conf.cell_size)
    box = np.asarray(conf.box_size)
    dth = np.deg2rad(geom.field_deg) / geom.npix
    nbar = np.prod(conf.nc) / np.prod(box)
    coef = L.born_coefficients(conf, geom)
    kappa = np.zeros((geom.n_source, geom.npix, geom.npix))
    for i in range(geom.n_planes):
        sel = np.mod(pos[:, 2] - geom.r_edges[i] / cell[2], nz) < geom.width[i] / cell[2]
        xy = pos[sel, :2] * cell[:2] - (0.5 * box[:2] + geom.shift[i])
        xy -= box[:2] * np.round(xy / box[:2])
        ang = xy / geom.r[i]                                  # [rad] along the box's x, y
        if geom.transpose[i]:
            ang = ang[:, ::-1]
        ang = ang * geom.flip[i]
        u = (ang - geom.theta[0]) / dth
        plane = np.zeros((geom.npix + 2, geom.npix + 2))      # nodes -1 .. npix
        i0 = np.floor(u).astype(int)
        t = u - i0
        for di, wx in ((0, 1 - t[:, 0]), (1, t[:, 0])):
            for dj, wy in ((0, 1 - t[:, 1]), (1, t[:, 1])):
                ix, iy = i0[:, 0] + di + 1, i0[:, 1] + dj + 1
                ok = (ix >= 0) & (ix < geom.npix + 2) & (iy >= 0) & (iy < geom.npix + 2)
                np.add.at(plane, (ix[ok], iy[ok]), (wx * wy)[ok])
        plane = plane[1:-1, 1:-1] / (nbar * geom.width[i] * (geom.r[i] * dth)**2)
        plane -= sel.sum() / (nbar * geom.width[i] * box[0] * box[1])
        kappa += coef[:, i, None, None] * plane[None]
    return kappa


@pytest.mark.parametrize("case", H.cases(single=True, placement=False, one_1d=True), ids=H.case_id)
def test_ray_planes_match_numpy(case):
    """The Born maps of the planes painted at the rays' resolution equal a numpy CIC of the
    particles on each plane's ray grid (a square box, so that planes are transposed too)."""
    conf = SimConfig(nc=(16, 16, 8), box_size=(160.0, 160.0, 96.0), grid=case[1],
                     halo_size=2, a_start=0.5, a_end=1.0, n_steps=1, dtype="float64")
    lconf = L.LensingConfig(z_source=(0.1, 0.05), field_deg=14.0, field_npix=12, n_planes=4)
    geom = L.geometry(conf, lconf)
    assert geom.transpose.any() and not geom.transpose.all()
    rng = np.random.RandomState(6)
    disp = np.zeros(conf.nc + (3,))
    disp[..., :2] = rng.uniform(-1.5, 1.5, conf.nc + (2,))
    disp[..., 2] = rng.uniform(-40.0, 40.0, conf.nc)
    q = np.indices(conf.nc).reshape(3, -1).T

    def build(mesh):
        d = mtf.import_tf_tensor(mesh, tf.constant(disp),
                                 fft.real_shape(conf) + mtf.Shape([mtf.Dimension("xyz", 3)]))
        x = painting.lattice(conf, mesh) + lpt.field_to_particles(d, conf)
        return {"kappa": L.born_from_terms([L.ray_born_terms(x, conf, geom, i)
                                            for i in range(geom.n_planes)])}

    kappa = H.run(case[0], conf, build)["kappa"]
    ref = numpy_ray_born(q + disp.reshape(-1, 3), conf, geom)
    assert np.std(ref[0]) > 0 and np.std(ref[1]) > 0
    assert H.rel_err(kappa, ref) < NUMPY_RTOL


# ----------------------------------------------------------------------------- Born
@pytest.mark.rank_independent   # one process ("single"): the 1-rank pass
def test_geometry_against_astropy():
    """Plane scale factors and source distances with astropy's (independent) distances."""
    from astropy.cosmology import FlatLambdaCDM

    conf = forward_conf()
    geom = L.geometry(conf, FORWARD_LCONF)
    cosmo = conf.cosmology
    astro = FlatLambdaCDM(H0=100.0, Om0=cosmo.Omega_m, Tcmb0=0.0)
    chi_s = astro.comoving_distance(np.asarray(FORWARD_LCONF.z_source)).value
    np.testing.assert_allclose(geom.chi_source, chi_s, rtol=ASTROPY_RTOL)
    np.testing.assert_allclose(astro.comoving_distance(1.0 / geom.a - 1.0).value, geom.r,
                               rtol=ASTROPY_RTOL)
    np.testing.assert_allclose(geom.r_edges[-1], chi_s.max(), rtol=1e-12)
    stages, idx = L.lightcone_stages(conf, geom)
    np.testing.assert_allclose(stages[idx], geom.a, rtol=1e-12)
    assert stages[0] == conf.a_start and np.all(np.diff(stages) > 0)


@pytest.mark.parametrize("randomize", [False, True], ids=["plain", "randomized"])
@pytest.mark.parametrize("case", H.cases(single=True, placement=False, one_1d=True), ids=H.case_id)
def test_born_analytic_plane(case, randomize):
    """One plane holding A cos(2 pi m x/Lx + px) cos(2 pi n y/Ly + py), the others a
    constant (removed by the mean subtraction): kappa = coefficient x the bilinear
    interpolation of the plane at r theta (scipy, to round-off), which is the continuous
    sinusoid to within the bilinear interpolation error (kd)^2/8 per axis. Randomized:
    the ray hits the plane at its shift + flipped (and maybe transposed) r theta."""
    conf = forward_conf(case[1])
    lconf = L.LensingConfig(z_source=(0.1, 0.04), field_deg=12.0, field_npix=10, n_planes=2,
                            randomize=randomize)
    geom = L.geometry(conf, lconf)
    k_plane, amp, (m, n), (px, py) = 1, 0.7, (1, 2), (0.3, -1.1)
    lx, ly = conf.box_size[:2]
    xg = np.arange(conf.nc[0]) * conf.cell_size[0]
    yg = np.arange(conf.nc[1]) * conf.cell_size[1]

    def wave(x, y):
        return amp * np.cos(2 * np.pi * m * x / lx + px) * np.cos(2 * np.pi * n * y / ly + py)

    planes = [np.full(conf.nc[:2], 1.0 + 0.25 * i) for i in range(geom.n_planes)]
    planes[k_plane] = planes[k_plane] + wave(xg[:, None], yg[None, :])

    def build(mesh):
        shape = mtf.Shape([mtf.Dimension("x", conf.nc[0]), mtf.Dimension("y", conf.nc[1])])
        ps = [mtf.import_tf_tensor(mesh, tf.constant(p), shape) for p in planes]
        return {"kappa": L.born_convergence(ps, conf, geom)}

    kappa = H.run(case[0], conf, build)["kappa"]
    assert kappa.shape == (2, 10, 10)
    # coefficient from its definition, with distances from the geometry
    r, a, w = geom.r[k_plane], geom.a[k_plane], geom.width[k_plane]
    om = conf.cosmology.Omega_m
    coef = 1.5 * om * (100.0 / C.C_KMS)**2 * w * r / a * (1 - r / geom.chi_source[0])
    assert geom.chi_source[1] < r                        # second source: in front of the plane
    np.testing.assert_array_equal(kappa[1], 0.0)
    # exact bilinear interpolation of the (periodically extended) grid with scipy
    xe = np.append(xg, lx)
    ye = np.append(yg, ly)
    grid_vals = np.pad(wave(xg[:, None], yg[None, :]), ((0, 1), (0, 1)), mode="wrap")
    (sx, sy), (fx, fy) = geom.shift[k_plane], geom.flip[k_plane]
    if randomize:
        assert np.any(geom.shift != 0) and geom.transpose.dtype == bool
    ti, tj = np.meshgrid(geom.theta, geom.theta, indexing="ij")   # ray (i, j) = (theta_x, theta_y)
    if geom.transpose[k_plane]:
        px_, py_ = 0.5 * lx + sx + fy * r * tj, 0.5 * ly + sy + fx * r * ti
    else:
        px_, py_ = 0.5 * lx + sx + fx * r * ti, 0.5 * ly + sy + fy * r * tj
    pts = np.stack([np.mod(px_, lx), np.mod(py_, ly)], -1).reshape(-1, 2)
    interp = RegularGridInterpolator((xe, ye), grid_vals, method="linear")(pts)
    expect = coef * interp.reshape(10, 10)
    assert H.rel_err(kappa[0], expect) < NUMPY_RTOL
    # the continuous sinusoid, to within the interpolation error bound
    exact = coef * wave(px_, py_)
    kd = [2 * np.pi * m * conf.cell_size[0] / lx, 2 * np.pi * n * conf.cell_size[1] / ly]
    bound = abs(coef) * amp * sum(v**2 / 8 for v in kd)
    assert np.max(np.abs(kappa[0] - exact)) <= bound
    assert np.max(np.abs(exact)) > 5 * bound               # the map is mostly signal


# ----------------------------------------------------------------------------- n(z) sources
# One delta source and two tomographic bins of a Smail n(z) (z0 = 0.04, so the bins below
# and above the peak hold very different fractions).
NZ_LCONF = L.LensingConfig(z_source=(0.1,), field_deg=12.0, field_npix=10, n_planes=3,
                           nz_smail=(2.0, 1.5, 0.04), nz_bins=(0.01, 0.06, 0.12))
# scipy.integrate.quad vs the midpoint rule on 512 points per bin: the integrand has a kink
# where chi(z) = r (second-order error ~ (dz)^2 at the kink: 1.3e-6 observed).
NZ_QUAD_RTOL = 1e-5


def test_nz_efficiency_against_quad():
    """The n(z)-weighted lensing efficiency of each bin against scipy's adaptive
    quadrature of n(z) (1 - r/chi(z))_+ / int n(z), with chi from astropy."""
    from astropy.cosmology import FlatLambdaCDM
    from scipy.integrate import quad

    conf = forward_conf()
    geom = L.geometry(conf, NZ_LCONF)
    assert geom.labels == ("z_s=0.1", "bin0:0.01-0.06", "bin1:0.06-0.12")
    assert geom.n_source == 3 and geom.efficiency.shape == (3, 3)
    astro = FlatLambdaCDM(H0=100.0, Om0=conf.cosmology.Omega_m, Tcmb0=0.0)
    alpha, beta, z0 = NZ_LCONF.nz_smail

    def nz(z):
        return z**alpha * np.exp(-(z / z0)**beta)

    for b, (lo, hi) in enumerate(zip(NZ_LCONF.nz_bins[:-1], NZ_LCONF.nz_bins[1:])):
        norm = quad(nz, lo, hi, epsabs=0, epsrel=1e-12)[0]
        for i, r in enumerate(geom.r):
            g = quad(lambda z: nz(z) * max(0.0, 1 - r / astro.comoving_distance(z).value),
                     lo, hi, epsabs=0, epsrel=1e-10, limit=200)[0] / norm
            assert abs(geom.efficiency[1 + b, i] - g) <= NZ_QUAD_RTOL * max(g, 1e-3), (b, i)
    # the chi_max covers the last bin edge; the delta source's row is (1 - r/r_s)_+
    assert abs(geom.r_edges[-1] - astro.comoving_distance(0.12).value) < 1e-4
    np.testing.assert_allclose(geom.efficiency[0], np.clip(1 - geom.r / geom.chi_source[0], 0,
                                                           None), rtol=1e-14)


def test_nz_table_file_equals_smail(tmp_path):
    """nz_file with the Smail n(z) tabulated finely gives the same efficiencies."""
    conf = forward_conf()
    z = np.linspace(0.0, 0.2, 4001)
    alpha, beta, z0 = NZ_LCONF.nz_smail
    path = tmp_path / "nz.txt"
    np.savetxt(path, np.column_stack([z, z**alpha * np.exp(-(z / z0)**beta)]))
    tab = L.geometry(conf, L.LensingConfig(z_source=(0.1,), field_deg=12.0, field_npix=10,
                                           n_planes=3, nz_file=str(path),
                                           nz_bins=NZ_LCONF.nz_bins))
    np.testing.assert_allclose(tab.efficiency, L.geometry(conf, NZ_LCONF).efficiency,
                               rtol=1e-5)


@pytest.mark.parametrize("case", H.cases(single=True, placement=False, one_1d=True), ids=H.case_id)
def test_nz_born_matches_numpy(case):
    """Born maps of a delta source and two n(z) bins from random planes, on every process
    grid: coef[s] . (W_x plane W_y^T) with the bins' n(z)-weighted coefficients."""
    conf = forward_conf(case[1])
    geom = L.geometry(conf, NZ_LCONF)
    rng = np.random.RandomState(21)
    planes = [1.0 + 0.3 * rng.randn(*conf.nc[:2]) for _ in range(geom.n_planes)]

    def build(mesh):
        shape = mtf.Shape([mtf.Dimension("x", conf.nc[0]), mtf.Dimension("y", conf.nc[1])])
        ps = [mtf.import_tf_tensor(mesh, tf.constant(p), shape) for p in planes]
        return {"kappa": L.born_convergence(ps, conf, geom)}

    kappa = H.run(case[0], conf, build)["kappa"]
    coef = L.born_coefficients(conf, geom)
    ref = np.zeros((3, 10, 10))
    for i, p in enumerate(planes):
        wx, wy, axes = L.interpolation_weights(conf, geom, i)
        d = p - p.mean()
        d = d.T if axes[0] == 1 else d
        ref += coef[:, i, None, None] * (wx @ d @ wy.T)[None]
    assert H.rel_err(kappa, ref) < NUMPY_RTOL
    assert np.all(np.std(kappa, axis=(1, 2)) > 0)


def test_nz_bad_input(tmp_path):
    """One clear line before any compute: a bin beyond the lightcone, an empty bin, an
    unreadable or malformed table, inconsistent options."""
    conf = forward_conf()                        # a_start = 0.7: the lightcone ends at z 0.43
    with pytest.raises(ValueError, match="nz_bins reach z=0.6, beyond the simulated lightcone"):
        L.geometry(conf, L.LensingConfig(z_source=0.1, n_planes=8, nz_smail=(2, 1.5, 0.2),
                                         nz_bins=(0.1, 0.6)))
    with pytest.raises(ValueError, match=r"bin 1 \(z 0.1-0.12\) holds no sources"):
        L.geometry(conf, L.LensingConfig(z_source=0.1, n_planes=3, nz_smail=(2, 4, 0.01),
                                         nz_bins=(0.0, 0.1, 0.12)))
    with pytest.raises(ValueError, match="nz_file=.*missing.txt: cannot read"):
        L.geometry(conf, L.LensingConfig(z_source=0.1, n_planes=3,
                                         nz_file=str(tmp_path / "missing.txt"),
                                         nz_bins=(0.0, 0.1)))
    bad = tmp_path / "bad.txt"
    np.savetxt(bad, [[0.1, 1.0], [0.05, 2.0]])
    with pytest.raises(ValueError, match="z must increase"):
        L.geometry(conf, L.LensingConfig(z_source=0.1, n_planes=3, nz_file=str(bad),
                                         nz_bins=(0.0, 0.1)))
    with pytest.raises(ValueError, match="need nz_bins with at least two"):
        L.LensingConfig(nz_smail=(2, 1.5, 0.3))
    with pytest.raises(ValueError, match="without an n\\(z\\)"):
        L.LensingConfig(nz_bins=(0.1, 0.5))
    with pytest.raises(ValueError, match="not both"):
        L.LensingConfig(nz_smail=(2, 1.5, 0.3), nz_file="x", nz_bins=(0.1, 0.5))
    with pytest.raises(ValueError, match="alpha,beta,z0"):
        L.LensingConfig(nz_smail=(2, 0, 0.3), nz_bins=(0.1, 0.5))
    with pytest.raises(ValueError, match="increasing redshifts, got 0.1 after 0.5"):
        L.LensingConfig(nz_smail=(2, 1, 0.3), nz_bins=(0.5, 0.1))
    with pytest.raises(ValueError, match="redshifts are >= 0, got the edge -0.5"):
        L.LensingConfig(nz_smail=(2, 1, 0.3), nz_bins=(-0.5, 0.5, 1.0))


# Each broken rule of an n(z) table gets its own line, with the file and the line of the row
# (one generic "expected two columns, z increasing and n(z) >= 0" line before; a ragged row
# passed on numpy's advice to "use `usecols`"; a negative z was accepted).
NZ_TABLE_CASES = [
    ("0.0 1\n0.1 -2\n0.2 1\n", r"line 2: n\(z\) = -2 is negative"),
    ("0.0 1\n0.2 2\n0.1 1\n", r"line 3: z = 0.1 after z = 0.2 on line 2; z must increase"),
    ("0.0 1\n0.1 2\n0.1 1\n", r"line 3: z = 0.1 after z = 0.1 on line 2; z must increase"),
    ("0.0 1\n0.1 nan\n0.2 1\n", r"line 2: n\(z\) = nan; z and n\(z\) must be finite"),
    ("0.0 1\ninf 2\n", r"line 2: z = inf; z and n\(z\) must be finite"),
    ("0.0 1\n0.1 2 3\n0.2 1\n", r"line 2 has 3 columns, expected 2 \(z and n\(z\)\)"),
    ("0.0\n0.1 2\n", r"line 1 has 1 columns, expected 2"),
    ("-0.1 1\n0.1 2\n0.2 1\n", r"line 1: z = -0.1 is negative; redshifts are >= 0"),
    ("# z n(z)\n\n0.0 1\n0.1 abc\n", r"line 4: 'abc' is not a number"),
    ("# z n(z)\n0.1 1\n", r"1 row of z, n\(z\); the table needs at least two"),
    ("", r"0 rows of z, n\(z\)"),
    ("0 0\n0.1 0\n", r"n\(z\) is zero on every row"),
]


@pytest.mark.parametrize("text, match", NZ_TABLE_CASES)
def test_nz_table_rules(tmp_path, text, match):
    path = tmp_path / "nz.txt"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        L.source_nz(L.LensingConfig(z_source=0.1, nz_file=str(path), nz_bins=(0.0, 0.1)))
    msg = str(err.value)
    assert msg.startswith("nz_file=%s: " % path) and "\n" not in msg and \
        re.search(match, msg), msg


def test_nz_table_comments_blank_lines_and_savetxt(tmp_path):
    path = tmp_path / "nz.txt"
    path.write_text("# z n(z)\n\n0.0 0.0  # first row\n0.1\t2.5\n0.3 1e0\n")
    z, n = L.read_nz_table(str(path))
    np.testing.assert_array_equal(z, [0.0, 0.1, 0.3])
    np.testing.assert_array_equal(n, [0.0, 2.5, 1.0])
    np.savetxt(path, np.column_stack([[0.0, 0.5], [1.0, 2.0]]))
    assert L.read_nz_table(str(path))[1].tolist() == [1.0, 2.0]


# ----------------------------------------------------------------------------- shear
# Kaiser-Squires of a Gaussian convergence on a periodic map: the periodic images and the
# removed mean (mass 2 pi s^2 A over the map's area: 0.6 % of A for s = 4 pixels in 128)
# bias the shear by ~1e-2 A at most inside 20 pixels of the centre.
GAUSS_SHEAR_ATOL = 1.5e-2


def _shear_build(conf, maps, fn=None):
    fn = fn or L.shear_maps

    def build(mesh):
        shape = mtf.Shape([mtf.Dimension(L.SRC, maps.shape[0]),
                           mtf.Dimension(L.THX, maps.shape[1]),
                           mtf.Dimension(L.THY, maps.shape[2])])
        k = mtf.import_tf_tensor(mesh, tf.constant(maps), shape)
        g1, g2 = fn(k)
        w = mtf.import_tf_tensor(mesh, tf.constant(maps[::-1].copy()), shape)
        grad = mtf.gradients([mtf.reduce_sum(w * g1 + 2.0 * w * g2)], [k])[0]
        return {"g1": g1, "g2": g2, "grad": grad}
    return build


@pytest.mark.parametrize("case", H.cases(single=True, placement=False, one_1d=True), ids=H.case_id)
def test_shear_single_modes(case):
    """kappa = A cos(2 pi (m i + n j)/N + p) (periodic on the map): gamma1 = (m^2 - n^2)/
    (m^2 + n^2) kappa, gamma2 = 2 m n/(m^2 + n^2) kappa, on every process grid; the
    gradient of sum(w (g1 + 2 g2)) is KS1(w) + 2 KS2(w) (the multipliers are real and
    even: the operator is symmetric)."""
    conf = forward_conf(case[1])
    npix = 16
    i, j = np.meshgrid(np.arange(npix), np.arange(npix), indexing="ij")
    modes = [(1, 2, 0.3, 0.01), (3, -1, -1.0, 0.02), (0, 4, 0.5, 0.005)]
    maps = np.stack([a * np.cos(2 * np.pi * (m * i + n * j) / npix + p) for m, n, p, a in modes])
    out = H.run(case[0], conf, _shear_build(conf, maps))
    for s, (m, n, _, _) in enumerate(modes):
        l2 = m * m + n * n
        np.testing.assert_allclose(out["g1"][s], (m * m - n * n) / l2 * maps[s], atol=1e-15)
        np.testing.assert_allclose(out["g2"][s], 2 * m * n / l2 * maps[s], atol=1e-15)
    m1, m2 = L.kaiser_squires_kernels(npix)
    w = maps[::-1]
    ref = np.real(np.fft.ifft2(np.fft.fft2(w) * (m1 + 2 * m2)))
    np.testing.assert_allclose(out["grad"], ref, atol=1e-14)


@pytest.mark.rank_independent   # one process ("single"): the 1-rank pass
@pytest.mark.parametrize("fn", [L.shear_maps, L.shear_from_potential],
                         ids=["kaiser_squires", "potential"])
def test_shear_gaussian_profile(fn):
    """A Gaussian convergence A exp(-t^2/2s^2): tangential shear kbar(<t) - k(t) =
    A (2 s^2/t^2 (1 - exp(-t^2/2s^2)) - exp(-t^2/2s^2)), gamma1 = -gt cos 2phi, gamma2 =
    -gt sin 2phi, within 20 pixels of the centre (periodic Kaiser-Squires and the
    potential on the zero-padded field)."""
    npix, sig, amp = 128, 4.0, 0.05
    c = np.arange(npix) - npix / 2
    x, y = np.meshgrid(c, c, indexing="ij")
    t2 = x**2 + y**2
    kappa = amp * np.exp(-t2 / (2 * sig**2))
    conf = forward_conf()
    out = H.run("single", conf, _shear_build(conf, kappa[None], fn))
    safe = np.where(t2 > 0, t2, 1.0)
    gt = np.where(t2 > 0, amp * (2 * sig**2 / safe * (1 - np.exp(-t2 / (2 * sig**2)))
                                 - np.exp(-t2 / (2 * sig**2))), 0.0)
    phi = np.arctan2(y, x)
    inner = (t2 < 20**2) & (t2 > 0)
    assert np.max(np.abs(out["g1"][0] + gt * np.cos(2 * phi))[inner]) < GAUSS_SHEAR_ATOL * amp
    assert np.max(np.abs(out["g2"][0] + gt * np.sin(2 * phi))[inner]) < GAUSS_SHEAR_ATOL * amp
    assert np.max(np.abs(gt[inner])) > 0.25 * amp                # max 0.30 A at 1.9 s


# ----------------------------------------------------------------------------- forward model
def _forward_build(conf, lin0, weight):
    geom = L.geometry(conf, FORWARD_LCONF)

    def build(mesh):
        phs = {}
        lin = H.placeholder_input(mesh, phs, "lin", lin0, fft.real_shape(conf))
        kappa, planes, final = L.lightcone_forward(lin, conf, geom)
        w = mtf.import_tf_tensor(mesh, tf.constant(weight), kappa.shape)
        loss = mtf.reduce_sum(w * kappa)
        grad = mtf.gradients([loss], [lin])[0]
        out = {"kappa": kappa, "loss": loss, "grad": grad}
        out.update(NH.export_state(final, conf, "final_"))
        return out, phs

    return build


@pytest.fixture(scope="module")
def forward_inputs():
    conf = forward_conf()
    lin0 = NH.linear_field_numpy(conf, seed=11)
    rng = np.random.RandomState(12)
    weight = rng.randn(2, 12, 12)
    direction = rng.randn(*conf.nc) * np.std(lin0)
    return lin0, weight, direction


@pytest.fixture(scope="module")
def forward_reference(forward_inputs):
    """One block on a 1-processor mesh: kappa and its gradient, plus the FD losses."""
    lin0, weight, direction = forward_inputs
    conf = forward_conf()
    feeds = [{"lin": lin0}, {"lin": lin0 + FD_EPS * direction},
             {"lin": lin0 - FD_EPS * direction}]
    # one process's 1-processor mesh: the same numbers on every rank and in every pass,
    # computed once (world_share)
    return on_rank0(lambda: H.run("single", conf, _forward_build(conf, lin0, weight),
                                  feeds=feeds),
                    key=("test_lensing.forward_reference", conf, lin0, weight, direction))


@pytest.mark.rank_independent   # checks the 1-processor reference only: the 1-rank pass
def test_gradient_finite_differences(forward_inputs, forward_reference):
    """d(sum w kappa)/d(linear field) through LPT, 2 KDK steps, the planes and the Born
    sum, float64, against central differences along a random direction."""
    _, _, direction = forward_inputs
    r0, rp, rm = forward_reference
    conf = forward_conf()
    disp = np.abs(NH.disp(NH.by_id(r0)["final_x"], conf)).max()
    assert 0.1 < disp < min(conf.block_shape[:2]) - 1         # moved, none escaped
    assert np.std(r0["kappa"][0]) > 0 and np.std(r0["kappa"][1]) > 0
    fd = (rp["loss"] - rm["loss"]) / (2 * FD_EPS)
    an = float(np.sum(r0["grad"] * direction))
    assert abs(fd - an) <= FD_RTOL * abs(an), (fd, an)


# Not hvd 2x2 (4-rank pass): the planes' reductions over both axes with Horovod are the
# plane tests' above on that grid (density, rays, Born, shear), the 2x2 layout of the whole
# forward model and its gradient the 2 x 2 blocks on one processor here (1 rank).
LAYOUT_CASES = H.cases(single=True, placement=False, one_1d=True, hvd_2x2=False)


@pytest.mark.parametrize("case", LAYOUT_CASES, ids=H.case_id)
def test_layout_independent(case, forward_inputs, forward_reference):
    """The same kappa maps and gradient on the process grid of this world size
    (HvdSimdMeshImpl: 1x1; 2x1) and with 2 x 2 blocks on one processor, as one block
    (float64)."""
    lin0, weight, _ = forward_inputs
    conf = forward_conf(case[1])
    out = H.run(case[0], conf, _forward_build(conf, lin0, weight), feeds=[{"lin": lin0}])[0]
    ref = forward_reference[0]
    assert H.rel_err(out["kappa"], ref["kappa"]) < LAYOUT_RTOL
    assert H.rel_err(out["grad"], ref["grad"]) < LAYOUT_RTOL


# ----------------------------------------------------------------------------- statistics
def test_kappa_power_white_noise():
    """White noise of variance s^2 on pixels of solid angle dOmega has C_ell = s^2 dOmega,
    with and without the edge taper (normalised by the mean squared window)."""
    rng = np.random.RandomState(3)
    n, fov, sigma = 64, 4.0, 0.02
    n_maps = 20
    cl = 0.0
    for _ in range(n_maps):
        ell, c, modes = L.kappa_power_spectrum(sigma * rng.randn(n, n), fov,
                                               taper=0.1 if _ % 2 else 0.0)
        cl = cl + c / n_maps
    expect = sigma**2 * (np.deg2rad(fov) / n)**2
    ok = modes > 0
    # Gaussian scatter of a bin average over modes/2 independent complex modes per map
    sigma_rel = np.sqrt(2.0 / (modes[ok] * n_maps))
    assert np.all(np.abs(cl[ok] / expect - 1) < 5 * sigma_rel), (cl[ok] / expect, sigma_rel)
    assert abs(np.sum(cl[ok] * modes[ok]) / np.sum(modes[ok]) / expect - 1) < 0.01
    lf = 2 * np.pi / np.deg2rad(fov)
    assert np.all(np.diff(ell[ok]) > 0) and 0.5 < ell[ok][0] / lf < 2.5   # first bin


def test_limber_single_plane_power():
    """limber_cl for a power-law P(k): the sum of coef_i^2 P(ell/r_i) / (width r_i^2)."""
    conf = forward_conf()
    geom = L.geometry(conf, FORWARD_LCONF)
    k = np.logspace(-3, 2, 200)
    tables = [(k, 1e3 * k**-1.5)] * geom.n_planes
    ell = np.array([100.0, 300.0])
    got = L.limber_cl(ell, conf, geom, tables, source=0, interpolation=False)
    pref = 1.5 * conf.cosmology.Omega_m / C.RH**2
    exp = sum(pref**2 * geom.width[i] * (1 - geom.r[i] / geom.chi_source[0])**2 / geom.a[i]**2
              * 1e3 * (ell / geom.r[i])**-1.5 for i in range(geom.n_planes))
    np.testing.assert_allclose(got, exp, rtol=1e-12)
    # through the interpolation: P itself at k << Nyquist, suppressed (with images) near it
    low = L.interpolated_power(np.array([0.01]), conf, tables[0])
    np.testing.assert_allclose(low, 1e3 * 0.01**-1.5, rtol=5e-3)   # window 1 - (k d)^2/6
    knyq = np.pi / conf.cell_size[0]
    ratio = L.interpolated_power(np.array([knyq]), conf, tables[0]) / (1e3 * knyq**-1.5)
    assert 0.1 < ratio[0] < 0.6                             # ~ (2/pi)^4 along an axis


# ----------------------------------------------------------------------------- bad input
def test_bad_input():
    conf = forward_conf()
    with pytest.raises(ValueError, match="n_planes must be a positive integer, got 0"):
        L.LensingConfig(n_planes=0)
    with pytest.raises(ValueError, match="z_source"):
        L.LensingConfig(z_source=(1.0, -0.5))
    with pytest.raises(ValueError, match="field_deg must be positive"):
        L.LensingConfig(field_deg=0.0)
    with pytest.raises(ValueError, match="z_source=2 is beyond the simulated lightcone"):
        L.geometry(conf, L.LensingConfig(z_source=2.0, n_planes=40))
    with pytest.raises(ValueError, match="field_deg=60 is wider than the box allows"):
        L.geometry(conf, L.LensingConfig(z_source=0.1, field_deg=60.0, n_planes=2))
    with pytest.raises(ValueError, match="thicker than the box.*use n_planes >= 2"):
        L.geometry(conf, L.LensingConfig(z_source=0.1, field_deg=5.0, n_planes=1))
    with pytest.raises(ValueError, match="later than a_end"):
        L.geometry(conf.replace(a_end=0.9), L.LensingConfig(z_source=0.1, n_planes=2))
    geom = L.geometry(conf, FORWARD_LCONF)
    with tf.Graph().as_default():
        mesh = mtf.Mesh(mtf.Graph(), "mesh")
        shape = mtf.Shape([mtf.Dimension("x", 16), mtf.Dimension("y", 16)])
        with pytest.raises(ValueError, match="expected 2 planes, got 1"):
            L.born_convergence([mtf.zeros(mesh, shape)], conf, geom)
