"""flowpm_mtf.physics.ics: the Gaussian linear density field.

* equals single-device FlowPM 0.1.1 ``flowpm.tfpm.linear_field`` fed with the
  same white noise (float32 and float64), on every process grid of the world
  size (HvdSimdMeshImpl), with PlacementMeshImpl, and (1 rank) on a
  1-processor mesh holding a 2 x 2 grid;
* decomposition independence: the same seed gives the same field on all those
  grids, equal to a numpy evaluation of the formula (float64);
* growth scaling with ``a`` and an externally supplied noise field;
* the measured P(k) of a 64^3 field in a 200 Mpc/h box against the input
  spectrum (reduced chi^2 with cosmic-variance errors), zero mean;
* P(k) tables or callables that do not cover the mesh's k range raise ValueError.
"""
import re

import numpy as np
import pytest
import mesh_tensorflow as mtf
import tensorflow.compat.v1 as tf

import fpm_harness as H
from flowpm_mtf.physics import cosmology, ics, linear_power, power
from flowpm_mtf.mesh import fft, noise, radial_filter
from flowpm_mtf.config import SimConfig

# Agreement with FlowPM on the same noise: both evaluate the same float64 P(k)
# and FFTs of a few thousand points; float64 rounding ~1e-15 relative to the
# field's maximum, float32 ~log2(N) * 6e-8 (plus the rounding of the noise to
# float32 in a different order).
FIELD_RTOL = {"float64": 1e-12, "float32": 1e-5}
# Same seed on different grids: the noise is bit-identical, the distributed FFT
# differs only in rounding (float64).
GRID_RTOL = 1e-12
# Reduced chi^2 of the measured P(k) against the mode-averaged input spectrum:
# with ~30 shells its sd is sqrt(2/30) = 0.26; 1.5 is ~2 sd and any error in
# amplitude (a factor N, V, 2pi) or binning gives chi^2 >> 10.
CHI2_MAX = 1.5
CHI2_MIN = 0.5
# Mean of delta: the k = 0 mode is zeroed, so the mean is the FFT's rounding,
# ~1e-16 relative to the field's rms.
MEAN_ATOL = 1e-13
# Radial kernel keyed by the integer n = mx^2 + my^2 + mz^2 against the per-cell
# evaluation: |k| = dk sqrt(n) vs sqrt(kx^2 + ky^2 + kz^2) differ by a few float64
# ulps, which a smooth kernel carries through (float64); in float32 the two round to
# the same value or to neighbours (at most RADIAL_ULPS32 units in the last place).
RADIAL_RTOL64 = 1e-14
RADIAL_ULPS32 = 1

CASES = H.cases(single=True, placement=False)
NC, BOX = (8, 12, 16), (100.0, 150.0, 200.0)   # non-cubic mesh and box, cells differ


def table():
    """Eisenstein-Hu P(k) [(Mpc/h)^3] table on 1e-3 .. 10 h/Mpc (covers every mesh here)."""
    return linear_power.linear_power_table(SimConfig().cosmology, 1e-3, 10.0, n=512)


def conf_for(case, dtype="float64", seed=42, nc=NC, box=BOX):
    return SimConfig(nc=nc, box_size=box, grid=case[1], halo_size=1, dtype=dtype, seed=seed)


def np_linear_field(conf, pk, z=None):
    """The formula of ics in numpy: c2r(r2c(z) * sqrt(N P / V)), k = 0 zeroed."""
    z = noise.white_noise_numpy(conf.seed, conf.nc) if z is None else z
    ks = [2 * np.pi * np.fft.fftfreq(n, d=d) for n, d in zip(conf.nc, conf.cell_size)]
    k = np.sqrt(ks[0][:, None, None]**2 + ks[1][None, :, None]**2 + ks[2]**2)
    amp = np.zeros(k.shape)
    amp[k > 0] = np.sqrt(pk(k[k > 0]) * conf.n_cells / np.prod(conf.box_size))
    return np.fft.ifftn(np.fft.fftn(z) * amp).real


def flowpm_linear_field(conf, pk):
    """``flowpm.tfpm.linear_field`` (FlowPM 0.1.1) on the noise of ``conf.seed``.

    FlowPM draws ``tf.random.normal(stddev=sqrt(N))`` in ``flowpm.utils.white_noise``;
    it is replaced by our deviates times sqrt(N) (in the complex dtype matching
    ``conf.dtype``), the rest of FlowPM's code runs unchanged.
    """
    import flowpm.tfpm as tfpm
    import flowpm.utils as futils

    dtype, cdtype = conf.tf_dtype, conf.tf_complex_dtype
    z = noise.white_noise_numpy(conf.seed, conf.nc)

    def white_noise(nc, batch_size=1, seed=None, type="complex", name="WhiteNoise"):
        assert type == "complex" and list(nc) == list(conf.nc)
        white = tf.constant((z * np.sqrt(conf.n_cells))[None].astype(conf.np_dtype))
        return futils.r2c3d(white, norm=conf.n_cells, dtype=cdtype)

    original = tfpm.white_noise
    tfpm.white_noise = white_noise
    try:
        with tf.Graph().as_default():
            lin = tfpm.linear_field(list(conf.nc), list(conf.box_size), pk, dtype=dtype)
            with tf.Session() as sess:
                return sess.run(lin)[0]
    finally:
        tfpm.white_noise = original


# ----------------------------------------------------------------------------- FlowPM
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_matches_flowpm(dtype):
    pk = table()
    ref = flowpm_linear_field(conf_for(CASES[0], dtype), pk)
    for case in CASES:
        conf = conf_for(case, dtype)
        out = H.run(case[0], conf, lambda mesh: {"d": ics.linear_field(conf, mesh, pk)})
        assert out["d"].dtype == conf.np_dtype and out["d"].shape == conf.nc
        err = H.rel_err(out["d"], ref)
        assert err < FIELD_RTOL[dtype], (H.case_id(case), err)


# ----------------------------------------------------------------------------- grids
@pytest.mark.parametrize("case", CASES, ids=H.case_id)
def test_decomposition_independent(case):
    """Same seed -> the numpy field on every grid; growth scaling; external noise;
    another seed gives another field."""
    conf = conf_for(case)
    pk = ics.power_function(conf)               # Eisenstein-Hu of conf.cosmology
    z = noise.white_noise_numpy(conf.seed, conf.nc)

    def build(mesh):
        zt = mtf.import_tf_tensor(mesh, tf.constant(z), fft.real_shape(conf))
        other = SimConfig(**{**conf.to_dict(), "seed": 43})
        return {"d": ics.linear_field(conf, mesh, name="lf1"),
                "half": ics.linear_field(conf, mesh, a=0.5, name="lf05"),
                "ext": ics.linear_field(conf, mesh, noise=zt, name="lfz"),
                "other": ics.linear_field(other, mesh, name="lf43")}

    out = H.run(case[0], conf, build)
    ref = np_linear_field(conf, pk)
    assert H.rel_err(out["d"], ref) < GRID_RTOL
    d1 = float(cosmology.D1(conf.cosmology, 0.5))
    assert 0.5 < d1 < 0.7
    assert H.rel_err(out["half"], d1 * ref) < GRID_RTOL
    assert H.rel_err(out["ext"], ref) < GRID_RTOL
    assert H.rel_err(out["other"], ref) > 0.5


# ----------------------------------------------------------------------------- statistics
def test_power_spectrum_of_initial_conditions():
    """64^3 mesh, 200 Mpc/h box: measured P(k) vs the input spectrum.

    All default shells are used, from the fundamental 2pi/L = 0.031 h/Mpc to
    the Nyquist frequency pi/cell = 1.0 h/Mpc: the field is exactly Gaussian
    with <|delta_k|^2> = P/V at every mode (no window, no shot noise, no
    aliasing), so every shell is usable. The theory in each shell is the average
    of P(|k|) over the shell's modes (computed in numpy), so the shells'
    width introduces no bias. Errors: sigma_P = P sqrt(2 / N_modes), N_modes
    counting both members of each conjugate pair (= twice the independent modes).
    """
    case = CASES[0]
    conf = SimConfig(nc=64, box_size=200.0, grid=case[1], halo_size=2, dtype="float64",
                     seed=1234)
    pk = ics.power_function(conf)

    def build(mesh):
        d = ics.linear_field(conf, mesh)
        k, p, n = power.power_spectrum(d, conf)
        return {"mean": mtf.reduce_mean(d), "rms": mtf.sqrt(mtf.reduce_mean(mtf.square(d))),
                "k": k, "p": p, "n": n}

    out = H.run(case[0], conf, build)
    edges = power.default_edges(conf)
    ks = [2 * np.pi * np.fft.fftfreq(n, d=d) for n, d in zip(conf.nc, conf.cell_size)]
    kk = np.sqrt(ks[0][:, None, None]**2 + ks[1][None, :, None]**2 + ks[2]**2).ravel()
    b = np.digitize(kk, edges) - 1
    keep = (b >= 0) & (b < len(edges) - 1) & (kk > 0)
    n_ref = np.bincount(b[keep], minlength=len(edges) - 1)
    p_theory = np.bincount(b[keep], pk(kk[keep]), len(edges) - 1) / n_ref
    np.testing.assert_array_equal(out["n"], n_ref)
    sigma = p_theory * np.sqrt(2.0 / out["n"])
    chi2 = np.sum(((out["p"] - p_theory) / sigma)**2) / len(sigma)
    print("IC P(k): %d shells, k in [%.4f, %.4f] h/Mpc, reduced chi2 = %.3f, mean = %.2e, "
          "rms = %.4f" % (len(sigma), out["k"][0], out["k"][-1], chi2, out["mean"], out["rms"]))
    assert CHI2_MIN < chi2 < CHI2_MAX, chi2
    assert abs(out["mean"]) < MEAN_ATOL * out["rms"]
    # rms of the field: sqrt(sum_k P / V) over the non-zero modes
    np.testing.assert_allclose(out["rms"]**2, np.sum(pk(kk[kk > 0])) / 200.0**3, rtol=0.05)


# ----------------------------------------------------------------------------- bad input
def test_k_range():
    conf = SimConfig(nc=(64, 64, 32), box_size=(200.0, 200.0, 400.0), halo_size=2)
    k_min, k_max = ics.k_range(conf)
    np.testing.assert_allclose(k_min, 2 * np.pi / 400.0, rtol=1e-14)
    np.testing.assert_allclose(k_max, np.sqrt(2 * (np.pi * 64 / 200)**2 + (np.pi * 32 / 400)**2),
                               rtol=1e-14)


@pytest.mark.parametrize("k_lo, k_hi", [(1e-2, 1.0), (0.05, 10.0)])
def test_table_not_covering_k_range(k_lo, k_hi):
    """64^3 in 200 Mpc/h needs 0.0314 .. 1.741 h/Mpc: raise at graph build, naming
    both ranges (every rank runs this and raises on its own)."""
    conf = SimConfig(nc=64, box_size=200.0, grid=CASES[0][1], halo_size=2)
    bad = linear_power.linear_power_table(conf.cosmology, k_lo, k_hi, n=64)
    with tf.Graph().as_default():
        mesh = mtf.Mesh(mtf.Graph(), "mesh")
        with pytest.raises(ValueError) as err:
            ics.linear_field(conf, mesh, bad)
    msg = str(err.value)
    assert re.search(r"\[%.4g.*, %.4g.*\] h/Mpc" % (k_lo, k_hi), msg), msg
    assert "0.0314159" in msg and "1.74" in msg, msg
    # a table that covers the range is accepted
    good = linear_power.linear_power_table(conf.cosmology, 0.0314, 1.75, n=64)
    with tf.Graph().as_default():
        ics.linear_field(conf, mtf.Mesh(mtf.Graph(), "mesh"), good)


def test_bad_callable_and_arguments():
    conf = SimConfig(nc=8, box_size=100.0, halo_size=1)
    with tf.Graph().as_default():
        mesh = mtf.Mesh(mtf.Graph(), "mesh")
        with pytest.raises(ValueError, match="finite, non-negative"):
            ics.linear_field(conf, mesh, lambda k: np.where(k > 0.3, np.nan, 1.0))
        with pytest.raises(ValueError, match="finite, non-negative"):
            ics.linear_field(conf, mesh, lambda k: -k)
        with pytest.raises(ValueError, match="callable"):
            ics.linear_field(conf, mesh, 3.0)
        with pytest.raises(ValueError, match="positive"):
            ics.linear_field(conf, mesh, a=-1.0)
        wrong = mtf.zeros(mesh, fft.k_shape(conf), tf.float32)
        with pytest.raises(ValueError, match="shape"):
            ics.linear_field(conf, mesh, noise=wrong)


@pytest.mark.rank_independent
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_radial_kernel_values_once_per_distinct_k(dtype):
    """radial_table_numpy calls ``values`` once, on each distinct |k| only, and its folded
    grid expands to the per-cell evaluation bit for bit (a non-cubic box, a slice of
    k with both signs and the Nyquist mode), 0 at k = 0."""
    from flowpm_mtf.physics import ics

    kx = 2 * np.pi / 100.0 * np.fft.fftfreq(12, 1 / 12.0)
    ky = 2 * np.pi / 80.0 * np.fft.fftfreq(10, 1 / 10.0)[2:9]
    kz = 2 * np.pi / 100.0 * np.fft.fftfreq(8, 1 / 8.0)
    calls = []

    def values(k):
        calls.append(np.array(k))
        return np.exp(-k) * np.log1p(k) / k

    small, ix, iy, iz = radial_filter.radial_table_numpy(kx, ky, kz, values, dtype)
    k = np.sqrt(kx[:, None, None]**2 + ky[None, :, None]**2 + kz[None, None, :]**2)
    want = np.zeros(k.shape)
    want[k > 0] = values(k[k > 0])
    got = small[ix][:, iy][:, :, iz]
    assert got.dtype == dtype and got.shape == k.shape
    np.testing.assert_array_equal(got, want.astype(dtype))
    assert len(calls) == 2                       # ours, then the reference's
    ux, uy, uz = (np.unique(np.abs(v)) for v in (kx, ky, kz))    # the folded grid's k^2
    k2 = ux[:, None, None]**2 + uy[None, :, None]**2 + uz[None, None, :]**2
    assert len(calls[0]) == len(np.unique(k2[k2 > 0])) < np.count_nonzero(k2)   # once each


@pytest.mark.rank_independent
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_radial_kernel_cubic_box_integer_modes(dtype):
    """In a cubic box (``dk`` given) radial_table_numpy keys the modes by the integer
    ``n = mx^2 + my^2 + mz^2``: ``values`` is called once, on ``dk sqrt(n)`` for each
    ``n`` of ``1 .. max n`` of the folded grid, and the expanded kernel equals the per-cell
    evaluation to rounding (float64: 1e-14 relative; float32: the same as the float64
    values rounded, up to one unit in the last place), 0 at k = 0; slices of k with both
    signs, the Nyquist mode and meshes that differ per axis."""
    from flowpm_mtf.physics import ics

    box = 100.0
    dk = 2 * np.pi / box
    kx = 2 * np.pi * np.fft.fftfreq(12, d=box / 12)
    ky = 2 * np.pi * np.fft.fftfreq(10, d=box / 10)[:7]     # 0 .. 4, -5 (Nyquist), -4
    kz = 2 * np.pi * np.fft.fftfreq(16, d=box / 16)
    calls = []

    def values(k):
        calls.append(np.array(k))
        return np.exp(-k) * np.log1p(k) / k

    small, ix, iy, iz = radial_filter.radial_table_numpy(kx, ky, kz, values, dtype, dk)
    k = np.sqrt(kx[:, None, None]**2 + ky[None, :, None]**2 + kz[None, None, :]**2)
    want = np.zeros(k.shape)
    want[k > 0] = values(k[k > 0])
    got = small[ix][:, iy][:, :, iz]
    assert got.dtype == dtype and got.shape == k.shape
    assert got[0, 0, 0] == 0 and np.count_nonzero(got == 0) == 1
    if dtype == np.float64:
        np.testing.assert_allclose(got, want, rtol=RADIAL_RTOL64, atol=0)
    else:
        ulp = np.spacing(np.abs(want).astype(np.float32))
        assert np.all(np.abs(got - want.astype(np.float32)) <= RADIAL_ULPS32 * ulp)
    m = [np.unique(np.rint(np.abs(v) / dk)).astype(int) for v in (kx, ky, kz)]
    n = m[0][:, None, None]**2 + m[1][None, :, None]**2 + m[2][None, None, :]**2
    assert len(calls) == 2                       # ours, then the reference's
    # once per integer n = 1 .. the largest (a 1-d table)
    np.testing.assert_array_equal(calls[0], dk * np.sqrt(np.arange(1, n.max() + 1.0)))
    # not on the lattice of dk (a wrong spacing): the float64 k^2 path, bit for bit
    calls.clear()
    small, ix, iy, iz = radial_filter.radial_table_numpy(kx, ky, kz, values, dtype, dk * 1.5)
    np.testing.assert_array_equal(small[ix][:, iy][:, :, iz], want.astype(dtype))
