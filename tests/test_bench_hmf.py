"""scripts/bench_hmf.py on a constructed catalogue (no simulation): the measured dn/dlnM is
the histogram per volume and log-mass interval, and the Sheth-Tormen column is colossus's."""
import os

import numpy as np
import pytest

from flowpm_bench.scripts import load_script
from flowpm_mtf.backend import SerialComm
from flowpm_mtf.runs import halos as halos_io

pytest.importorskip("colossus", reason="colossus (requirements.txt) gives the fit")
bh = load_script("bench_hmf")

pytestmark = pytest.mark.rank_independent

COSMO = {"Omega_c": 0.2589, "Omega_b": 0.0486, "h": 0.6774, "n_s": 0.9667, "sigma8": 0.8159,
         "Omega_k": 0.0}


def test_mass_function_of_a_constructed_catalogue(tmp_path):
    rng = np.random.default_rng(0)
    mp, box, n_min = 1e11, 100.0, 20
    n = np.concatenate([rng.integers(n_min, 40, 300), rng.integers(40, 400, 60)])
    cat = {"n": n, "mass": n * mp, "position": rng.uniform(0, box, (len(n), 3)),
           "velocity": np.zeros((len(n), 3)), "sigma_v": np.zeros(len(n)),
           "min_id": np.arange(len(n)) * 10}
    halos_io.write_halos_distributed(
        os.path.join(tmp_path, "halos.h5"), SerialComm(), cat,
        attrs={"box_size": [box] * 3, "nc": [64] * 3, "cosmology": COSMO},
        fof={"a": 1.0, "particle_mass": mp, "n_halos": len(n)})
    rec = bh.compare(str(tmp_path), n_min)
    edges = np.asarray(rec["edges"])
    assert edges[0] == pytest.approx(n_min * mp)
    counts = np.histogram(n * mp, bins=edges)[0]
    assert rec["counts"] == counts.tolist() and sum(counts) == len(n)
    np.testing.assert_allclose(rec["dndlnM"], counts / box**3 / np.diff(np.log(edges)))
    from colossus.lss import mass_function

    centres = np.sqrt(edges[1:] * edges[:-1])
    np.testing.assert_allclose(rec["sheth_tormen"], mass_function.massFunction(
        centres, 0.0, mdef="fof", model="sheth99", q_out="dndlnM"), rtol=1e-10)
    assert "| M [M_sun/h] |" in bh.table({"k": rec})
