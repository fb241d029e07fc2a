"""flowpm_mtf.physics.cosmology against independent references.

References: FlowPM 0.1.1's numpy growth solver (``flowpm.legacy_background``,
float64, fastpm-python's code), its TensorFlow background and power spectrum
(``flowpm.tfbackground``, ``flowpm.tfpower``, float32), astropy distances, and
analytic Einstein-de Sitter / matter-domination limits.

Independent of the world size: every rank runs the same checks.
"""
import pathlib
import shutil
import tempfile
from types import SimpleNamespace

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

from conftest import world
from flowpm_mtf.physics import cosmology as C
from flowpm_mtf.physics import linear_power as LP

# numpy/scipy/FlowPM only, no mesh: the same on every rank count
pytestmark = pytest.mark.rank_independent

# --- named tolerances -------------------------------------------------------------
# legacy_background integrates the same ODEs with odeint (rtol 1.5e-8, atol 0) in
# float64; we integrate with Dormand-Prince 5(4) at rtol 1e-11. Observed differences <= 6e-8.
LEGACY_RTOL = 1e-6
# tfbackground: float32, BDF solver with rtol=1e-4 and linear interpolation on its 1024-point
# table (observed <= 1.6e-5, on D2).
TF_GROWTH_RTOL = 5e-5
# Closed-form float32 expressions (E, dE/da): a few ulp of float32 (6e-8).
TF_CLOSED_FORM_RTOL = 1e-6
# EH98 transfer function in float32: ~30 chained pow/log ops (observed <= 8e-7).
TF_TRANSFER_RTOL = 5e-6
# P(k): transfer squared plus flowpm's float32 Simpson sigma8 integral (observed 1.5e-6).
TF_POWER_RTOL = 1e-5
# astropy integrates the same E(z) with scipy quad (epsrel 1.5e-8); ours is
# Gauss-Legendre to double precision.
ASTROPY_RTOL = 1e-7
# Einstein-de Sitter: D1 = a, D2 = -3/7 a^2 exactly; the numerical solution is
# limited by the ODE tolerance (rtol 1e-11) and the normalisation at a = 1.
EDS_RTOL = 1e-9
# Bouchet et al. (1995) fit D2 = -3/7 Omega_m(a)^{-1/143} D1^2 is accurate to a few 1e-4
# for flat LCDM with Omega_m ~ 0.3 (observed 1.7e-4 at a = 1).
BOUCHET_RTOL = 5e-4
# Deep in matter domination (a = 1e-3, Omega_de(a)/Omega_m(a) ~ 2e-9): D2 = -3/7 D1^2.
MD_RTOL = 1e-7

PLANCK15 = SimpleNamespace(Omega_c=0.2589, Omega_b=0.0486, h=0.6774, n_s=0.9667,
                           sigma8=0.8159, w0=-1.0, wa=0.0, Omega_k=0.0)
EDS = SimpleNamespace(Omega_c=0.95, Omega_b=0.05, h=0.7, n_s=1.0, sigma8=0.8,
                      w0=-1.0, wa=0.0, Omega_k=0.0)
A_TEST = np.array([0.02, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0])


def flowpm_dict(c):
    om = c.Omega_c + c.Omega_b
    return {"w0": c.w0, "wa": c.wa, "H0": 100.0, "h": c.h, "Omega0_b": c.Omega_b,
            "Omega0_c": c.Omega_c, "Omega0_m": om, "Omega0_k": c.Omega_k,
            "Omega0_de": 1.0 - om - c.Omega_k, "n_s": c.n_s, "sigma8": c.sigma8}


@pytest.fixture(scope="module")
def flowpm_tf():
    """FlowPM's float32 background, growth and EH98 spectrum, evaluated once (~15 s).

    flowpm caches its growth ODE solution in the cosmology dict; in graph mode
    that cache must hold numpy arrays, so the ODE is solved first, on exactly
    the grid of ``flowpm.tfbackground.maybe_compute_ODE`` (1024 points in
    a = 0.01..1: its BDF accuracy on D2 degrades to 4e-3 on coarser output grids).
    """
    if world()[0] != 0:
        pytest.skip("rank-independent 15 s reference computation: done on rank 0 only")
    import flowpm.tfbackground as bg
    import flowpm.tfpower as pw

    a = np.array([0.02, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0])
    k = np.logspace(-3, 1, 41)
    d = flowpm_dict(PLANCK15)
    with tf.Graph().as_default():
        ode = bg.odesolve_func(d, tf.constant(np.logspace(-2, 0.0, 1024), tf.float32))
        with tf.Session() as sess:
            d["cache_ODE"] = sess.run(ode)
    with tf.Graph().as_default():
        a32, k32 = tf.constant(a, tf.float32), tf.constant(k, tf.float32)
        out = {n: getattr(bg, n)(d, a32) for n in
               ("D1", "D2", "f1", "f2", "D1f", "Gf", "gf", "Gf2", "gf2", "E", "dEa")}
        for kind in ("eisenhu_osc", "eisenhu"):
            out["T_" + kind] = pw.Eisenstein_Hu(d, k32, type=kind)
            out["P_" + kind] = pw.linear_matter_power(d, k32, type=kind)
        out["P_a05"] = pw.linear_matter_power(d, k32, a=0.5)
        with tf.Session() as sess:
            res = sess.run(out)
    res["a"], res["k"] = a, k
    return res


# --- growth ---------------------------------------------------------------------
def test_growth_vs_flowpm_legacy_float64():
    from flowpm.legacy_background import MatterDominated

    ref = MatterDominated(C.Omega_m0(PLANCK15), a=A_TEST)
    g = C.growth(PLANCK15, A_TEST)
    d2_1 = C.D2(PLANCK15, 1.0)  # flowpm normalises D2(1) = 1
    mine = {"D1": g.D1, "f1": g.f1, "gp": g.gp, "Gf": g.Gf, "gf": g.gf,
            "D2": g.D2 / d2_1, "f2": g.f2, "Gf2": g.Gf2 / d2_1, "gf2": g.gf2 / d2_1,
            "E": g.E}
    for name, value in mine.items():
        np.testing.assert_allclose(value, getattr(ref, name)(A_TEST), rtol=LEGACY_RTOL,
                                   err_msg=name)


def test_growth_vs_flowpm_tfbackground(flowpm_tf):
    a = flowpm_tf["a"]
    g = C.growth(PLANCK15, a)
    d2_1 = C.D2(PLANCK15, 1.0)
    mine = {"D1": g.D1, "D2": g.D2 / d2_1, "f1": g.f1, "f2": g.f2, "D1f": g.gp, "Gf": g.Gf,
            "gf": g.gf, "Gf2": g.Gf2 / d2_1, "gf2": g.gf2 / d2_1}
    for name, value in mine.items():
        np.testing.assert_allclose(value, flowpm_tf[name], rtol=TF_GROWTH_RTOL, err_msg=name)
    np.testing.assert_allclose(C.E(PLANCK15, a), flowpm_tf["E"], rtol=TF_CLOSED_FORM_RTOL)
    np.testing.assert_allclose(C.dE_da(PLANCK15, a), flowpm_tf["dEa"], rtol=TF_CLOSED_FORM_RTOL)


def test_growth_normalisation_and_analytic_limits():
    assert C.D1(PLANCK15, 1.0) == pytest.approx(1.0, abs=1e-15)
    # Einstein-de Sitter: D1 = a, D2 = -3/7 a^2, f1 = 1, f2 = 2.
    g = C.growth(EDS, A_TEST)
    np.testing.assert_allclose(g.D1, A_TEST, rtol=EDS_RTOL)
    np.testing.assert_allclose(g.D2, -3.0 / 7.0 * A_TEST**2, rtol=EDS_RTOL)
    np.testing.assert_allclose(g.f1, 1.0, rtol=EDS_RTOL)
    np.testing.assert_allclose(g.f2, 2.0, rtol=EDS_RTOL)
    # LCDM: the 3/7 is in D2 exactly once (fastpm-python issue #17).
    g = C.growth(PLANCK15, [1e-3, 1.0])
    assert g.D2[0] / (-3.0 / 7.0 * g.D1[0]**2) == pytest.approx(1.0, rel=MD_RTOL)
    bouchet = -3.0 / 7.0 * C.Omega_m0(PLANCK15)**(-1.0 / 143.0)
    assert g.D2[1] == pytest.approx(bouchet, rel=BOUCHET_RTOL)


def test_kick_drift_factors():
    # EdS: Gf = a^{3/2}, gf = 3/2 a^{1/2}, dD1/da = 1, E = a^{-3/2}.
    ai, ac, af = 0.1, 0.12, 0.15
    assert C.kick_factor(EDS, ai, ac, af) == pytest.approx(
        (af**1.5 - ai**1.5) / (1.5 * ac), rel=EDS_RTOL)
    assert C.drift_factor(EDS, ai, ac, af) == pytest.approx((af - ai) / ac**1.5, rel=EDS_RTOL)
    # LCDM: same expressions as flowpm.tfpm.kick/drift on fastpm-python's growth.
    from flowpm.legacy_background import MatterDominated

    ref = MatterDominated(C.Omega_m0(PLANCK15), a=[ai, ac, af])
    kick = (ref.Gf(af) - ref.Gf(ai)) / (ac**2 * ref.E(ac) * ref.gf(ac))
    drift = (ref.D1(af) - ref.D1(ai)) / (ac**3 * ref.E(ac) * ref.gp(ac))
    assert C.kick_factor(PLANCK15, ai, ac, af) == pytest.approx(kick, rel=LEGACY_RTOL)
    assert C.drift_factor(PLANCK15, ai, ac, af) == pytest.approx(drift, rel=LEGACY_RTOL)


# --- distances ------------------------------------------------------------------
@pytest.mark.parametrize("params", [
    dict(),
    dict(Omega_k=0.05),
    dict(Omega_k=-0.05),
    dict(w0=-0.9, wa=0.2),
], ids=["flat", "open", "closed", "w0wa"])
def test_distances_vs_astropy(params):
    from astropy.cosmology import w0waCDM

    c = SimpleNamespace(**{**vars(PLANCK15), **params})
    om = C.Omega_m0(c)
    ref = w0waCDM(H0=100 * c.h, Om0=om, Ode0=C.Omega_de0(c), w0=c.w0, wa=c.wa, Tcmb0=0)
    a = np.array([0.05, 0.2, 0.5, 0.9, 1.0])
    z = 1.0 / a - 1.0
    np.testing.assert_allclose(C.E(c, a), ref.efunc(z), rtol=ASTROPY_RTOL)
    chi = C.comoving_distance(c, a)
    np.testing.assert_allclose(chi, ref.comoving_distance(z).value * c.h, rtol=ASTROPY_RTOL,
                               atol=1e-9)
    np.testing.assert_allclose(C.transverse_comoving_distance(c, a),
                               ref.comoving_transverse_distance(z).value * c.h,
                               rtol=ASTROPY_RTOL, atol=1e-9)
    np.testing.assert_allclose(C.angular_diameter_distance(c, a),
                               ref.angular_diameter_distance(z).value * c.h,
                               rtol=ASTROPY_RTOL, atol=1e-9)
    np.testing.assert_allclose(C.a_of_chi(c, chi), a, rtol=1e-12)


def test_a_of_chi_range():
    with pytest.raises(ValueError, match="Mpc/h"):
        C.a_of_chi(PLANCK15, -1.0)
    with pytest.raises(ValueError):
        C.E(PLANCK15, 0.0)


# --- power spectrum ----------------------------------------------------------------
@pytest.mark.parametrize("kind", ["eisenhu_osc", "eisenhu"])
def test_power_vs_flowpm(flowpm_tf, kind):
    k = flowpm_tf["k"]
    np.testing.assert_allclose(LP.transfer_eisenstein_hu(PLANCK15, k, kind), flowpm_tf["T_" + kind],
                               rtol=TF_TRANSFER_RTOL)
    # flowpm 0.1.1 integrates sigma8 over k in (e^-4, e^3) (log10 bounds used as ln).
    pk = LP.linear_matter_power(PLANCK15, k, kind=kind, sigma8_k_range=(np.exp(-4), np.exp(3)))
    np.testing.assert_allclose(pk, flowpm_tf["P_" + kind], rtol=TF_POWER_RTOL)
    if kind == "eisenhu_osc":
        pk = LP.linear_matter_power(PLANCK15, k, a=0.5, sigma8_k_range=(np.exp(-4), np.exp(3)))
        np.testing.assert_allclose(pk, flowpm_tf["P_a05"], rtol=2 * TF_GROWTH_RTOL)


def test_power_normalisation_and_growth():
    k = np.logspace(-3, 1, 20)
    pk1 = LP.linear_matter_power(PLANCK15, k)
    # sigma(8 Mpc/h) of the normalised spectrum is sigma8 (integral converged to 1e-12).
    amp = pk1[0] / (k[0]**PLANCK15.n_s * LP.transfer_eisenstein_hu(PLANCK15, k[0])**2)
    assert LP.sigma_r(PLANCK15, 8.0, amplitude=amp) == pytest.approx(PLANCK15.sigma8, rel=1e-10)
    pk_half = LP.linear_matter_power(PLANCK15, k, a=0.5)
    np.testing.assert_allclose(pk_half, pk1 * C.D1(PLANCK15, 0.5)**2, rtol=1e-14)
    with pytest.raises(ValueError, match="transfer"):
        LP.linear_matter_power(PLANCK15, k, kind="bbks")


def test_power_function_normalises_once(monkeypatch):
    """linear_matter_power_function integrates sigma_8 once, when made, and gives
    linear_matter_power's values bit for bit at every later call (a = 1 and 0.5)."""
    k = np.logspace(-3, 1, 20)
    want = [LP.linear_matter_power(PLANCK15, k), LP.linear_matter_power(PLANCK15, k, a=0.5)]
    calls = []
    real_sigma_r = LP.sigma_r
    monkeypatch.setattr(LP, "sigma_r", lambda *a, **kw: calls.append(a) or real_sigma_r(*a, **kw))
    fns = [LP.linear_matter_power_function(PLANCK15),
           LP.linear_matter_power_function(PLANCK15, a=0.5)]
    assert len(calls) == 2
    for fn, w in zip(fns, want):
        for _ in range(3):
            np.testing.assert_array_equal(fn(k), w)
    assert len(calls) == 2
    with pytest.raises(ValueError, match="k must be finite and positive"):
        fns[0](np.array([0.1, np.nan]))


def test_power_table_roundtrip_and_range():
    tmp = tempfile.mkdtemp(prefix="flowpm_mtf_cosmo_")  # private per rank (unlike tmp_path)
    try:
        _power_table_roundtrip(pathlib.Path(tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _power_table_roundtrip(tmp_path):
    table = LP.linear_power_table(PLANCK15, 1e-3, 10.0, 256)
    path = tmp_path / "pk.txt"
    table.save(path)
    loaded = LP.load_power_table(path)
    # savetxt writes 18 significant digits: the round trip is exact to 1 ulp.
    np.testing.assert_allclose(loaded.k, table.k, rtol=1e-15)
    np.testing.assert_allclose(loaded(table.k), table.pk, rtol=1e-14)
    # log-log interpolation reproduces a power law exactly.
    law = LP.PowerTable([0.01, 0.1, 1.0], [1e4, 1e3, 1e2])
    np.testing.assert_allclose(law([0.02, 0.3, 0.7]), 100.0 / np.array([0.02, 0.3, 0.7]),
                               rtol=1e-13)
    np.testing.assert_allclose(law(np.array([0.0, 0.01])), [0.0, 1e4], rtol=1e-15)
    with pytest.raises(ValueError, match=r"\[0.01, 1\] h/Mpc"):
        law([0.5, 2.0])
    with pytest.raises(ValueError, match="outside"):
        law(0.0, zero_at_k0=False)
    with pytest.raises(ValueError):
        LP.PowerTable([0.1, 0.05], [1.0, 2.0])
    bad = tmp_path / "bad.txt"
    bad.write_text("# one column\n1\n2\n")
    with pytest.raises(ValueError, match="2 columns"):
        LP.load_power_table(bad)


def test_duck_typed_cosmologies_agree():
    """SimConfig's Cosmology dataclass, a namespace and a plain dict give the same numbers."""
    from flowpm_mtf.config import Cosmology

    a = np.array([0.1, 0.5, 1.0])
    ref = C.growth(PLANCK15, a)
    for cosmo in (Cosmology(), vars(PLANCK15)):
        g = C.growth(cosmo, a)
        np.testing.assert_array_equal(g.D1, ref.D1)
        np.testing.assert_array_equal(g.D2, ref.D2)
        np.testing.assert_array_equal(C.comoving_distance(cosmo, a), C.comoving_distance(PLANCK15, a))
    minimal = SimpleNamespace(Omega_c=0.2589, Omega_b=0.0486, h=0.6774)  # w0, wa, Omega_k default
    np.testing.assert_array_equal(C.E(minimal, a), C.E(PLANCK15, a))
    with pytest.raises(AttributeError, match="Omega_b"):
        C.E(SimpleNamespace(Omega_c=0.3, h=0.7), a)
