"""Halofit (flowpm_mtf.physics.halofit) against CAMB's halofit (Takahashi et al. 2012) from the same
linear power: tests/data/halofit_camb.txt (scripts/make_halofit_reference.py, CAMB 2.0.5,
our default cosmology with massless neutrinos). numpy only."""
import os

import numpy as np
import pytest

from flowpm_mtf.physics import halofit as HF
from flowpm_mtf.config import Cosmology
from flowpm_mtf.physics.linear_power import linear_matter_power

pytestmark = pytest.mark.single_process

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "halofit_camb.txt")
# Same formulas from the same linear power: the differences are CAMB's sigma(R) integral
# and table interpolation, and its background (radiation of massless neutrinos and photons,
# absent from ours: Omega_m(a) differs by ~1e-4 at z = 1): 0.34, 0.21, 0.13 % observed at
# z = 0, 0.5, 1 for 1e-3 < k < 10 h/Mpc.
CAMB_RTOL = 0.01
K_RANGE = (1e-3, 10.0)


def _camb():
    tab = np.loadtxt(DATA)
    return tab[:, 0], {z: (tab[:, 1 + 2 * i], tab[:, 2 + 2 * i])
                       for i, z in enumerate((0.0, 0.5, 1.0))}


def _loglog(k_t, p_t):
    """CAMB's linear table, power laws beyond it (slopes of its end points)."""
    lk, lp = np.log(k_t), np.log(p_t)
    s_lo = (lp[1] - lp[0]) / (lk[1] - lk[0])
    s_hi = (lp[-1] - lp[-2]) / (lk[-1] - lk[-2])

    def f(k):
        x = np.log(np.asarray(k, np.float64))
        out = np.interp(x, lk, lp)
        out = np.where(x < lk[0], lp[0] + s_lo * (x - lk[0]), out)
        out = np.where(x > lk[-1], lp[-1] + s_hi * (x - lk[-1]), out)
        return np.exp(out)
    return f


@pytest.mark.parametrize("z", [0.0, 0.5, 1.0])
def test_halofit_matches_camb(z):
    k, tabs = _camb()
    plin, pnl = tabs[z]
    sel = (k >= K_RANGE[0]) & (k <= K_RANGE[1])
    ours = HF.halofit_power(Cosmology(), k[sel], a=1.0 / (1.0 + z), plin=_loglog(k, plin))
    rel = ours / pnl[sel] - 1
    assert np.max(np.abs(rel)) < CAMB_RTOL, (z, np.max(np.abs(rel)), k[sel][np.argmax(np.abs(rel))])
    # the nonlinear boost is large: the test is not of the linear power
    assert np.max(pnl[sel] / plin[sel]) > (8 if z == 0 else 3)


def test_halofit_nonlinear_scale_and_limits():
    """Our own linear power: k_sigma grows with redshift (sigma(R) = 1 at a smaller R),
    P_NL -> P_L on large scales, and the default linear power is ours."""
    cosmo = Cosmology()
    f0, f1 = HF.halofit_power_function(cosmo, 1.0), HF.halofit_power_function(cosmo, 0.5)
    assert 0.2 < f0.k_sigma < f1.k_sigma < 2.0
    k = np.array([1e-3, 3e-3])
    # halofit's quasi-linear term is P_L exp(-y/4 - y^2/8), y = k/k_sigma: -0.2 % at 3e-3
    np.testing.assert_allclose(f0(k), linear_matter_power(cosmo, k), rtol=5e-3)
    np.testing.assert_allclose(HF.halofit_power(cosmo, k, 1.0), f0(k), rtol=1e-14)
    with pytest.raises(ValueError, match="does not cross 1"):
        HF.nonlinear_scale(lambda kk: 1e-12 * np.ones_like(kk))


def test_planes_share_the_linear_power_bit_for_bit():
    """The lensing predictions' halofit per plane (lensing_theory.halofit_functions, one
    transfer-function evaluation per k grid for all planes) equals each plane's own
    halofit_power_function to the bit, on grids seen again and after older grids are
    dropped (linear_matter_power_functions' max_grids)."""
    from flowpm_mtf.physics import lensing_theory, linear_power

    cosmo = Cosmology()
    a = [1.0, 0.7, 0.4]
    shared = lensing_theory.halofit_functions(cosmo, a)
    # another grid of the same shape, then the first one again
    grids = [np.geomspace(1e-3, 10.0, 50), np.geomspace(1e-3, 10.0, 61),
             np.geomspace(2e-3, 5.0, 50), np.geomspace(1e-3, 10.0, 50)]
    for f, ai in zip(shared, a):
        own = HF.halofit_power_function(cosmo, ai)
        assert (f.k_sigma, f.n_eff, f.curvature) == (own.k_sigma, own.n_eff, own.curvature)
        for k in grids:
            np.testing.assert_array_equal(f(k), own(k))
    lins = linear_power.linear_matter_power_functions(cosmo, a, max_grids=2)
    for k in grids + [np.geomspace(1e-2, 1.0, 7), grids[0]]:  # grids[0] dropped, recomputed
        for f, ai in zip(lins, a):
            np.testing.assert_array_equal(
                f(k), linear_power.linear_matter_power_function(cosmo, ai)(k))
