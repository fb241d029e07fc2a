"""scripts/bench_lensing_fullsky.py: the ensemble statistics on synthetic tables (exact).
(The runs themselves are the benchmark's; the job they run is tested by
tests/test_lensing_fullsky_job.py.)"""
import numpy as np
import pytest

from flowpm_bench.scripts import load_script

pytestmark = pytest.mark.rank_independent
B = load_script("bench_lensing_fullsky")


def _table(ell, cl, cont, shot, pw2, modes, lim_cont):
    return {"ell": ell, "modes": modes, "C_ell": cl, "C_ell_shot": shot,
            "C_ell_halofit_cont": cont, "C_ell_halofit": cont * pw2 + shot,
            "C_ell_limber_cont": lim_cont, "C_ell_limber": lim_cont * pw2 + shot,
            "resolved": (ell < 400).astype(float)}


def test_ensemble_statistics_exact():
    """Band ratios: (C - shot) / pw^2 / halofit_cont, mode-weighted per band, mean over runs
    with the error of the mean, against the same sums written out."""
    ell = np.array([60.0, 120, 200, 350, 450])
    modes = 2 * ell + 1
    pw2 = np.array([0.99, 0.97, 0.93, 0.8, 0.7])
    cont = 1e-9 * (ell / 100)**-1.2
    rng = np.random.RandomState(0)
    tabs = [_table(ell, cont * pw2 * rng.uniform(0.8, 1.2, 5) + 1e-11, cont, np.full(5, 1e-11),
                   pw2, modes, cont * 0.9) for _ in range(4)]
    e = B.ensemble(tabs, bands=((50, 150), (150, 500)))
    per = np.array([(t["C_ell"] - 1e-11) / pw2 / cont for t in tabs])
    for b, sel in zip(e["bands"], ([0, 1], [2, 3, 4])):
        w = modes[sel] / modes[sel].sum()
        v = per[:, sel] @ w
        assert b["sky_halofit"] == pytest.approx(v.mean(), rel=1e-12)
        assert b["sky_halofit_error"] == pytest.approx(v.std(ddof=1) / 2, rel=1e-12)
        assert b["sim_halofit"] == pytest.approx(0.9, rel=1e-12)
    assert e["resolved"] == [60.0, 350.0] and e["n"] == 4
    with pytest.raises(ValueError, match="need >= 2 runs"):
        B.ensemble(tabs[:1])
