"""Write tests/data/halofit_camb.txt: CAMB's linear and halofit (Takahashi 2012) matter
power for our default cosmology (flowpm_mtf.config.Cosmology: Planck 2015, massless
neutrinos, w = -1), the independent reference of tests/test_halofit.py.

Run in a scratch environment with CAMB (not a dependency of the package)::

    python -m venv /tmp/venv-lens && /tmp/venv-lens/bin/pip install camb numpy
    /tmp/venv-lens/bin/python scripts/make_halofit_reference.py

Columns: k [h/Mpc], then for z = 0, 0.5, 1: P_lin, P_halofit [(Mpc/h)^3].
"""
import os

import camb
import numpy as np

# flowpm_mtf.config.Cosmology defaults (written out: this runs without the package)
OMEGA_C, OMEGA_B, H, N_S, SIGMA8 = 0.2589, 0.04860, 0.6774, 0.9667, 0.8159
REDSHIFTS = (0.0, 0.5, 1.0)
K_MIN, K_MAX, N_K = 1e-4, 30.0, 400
OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                   "tests", "data", "halofit_camb.txt")


def params(a_s):
    p = camb.CAMBparams()
    p.set_cosmology(H0=100 * H, ombh2=OMEGA_B * H**2, omch2=OMEGA_C * H**2, mnu=0.0,
                    num_massive_neutrinos=0, omk=0.0, TCMB=2.7255)
    p.InitPower.set_params(As=a_s, ns=N_S)
    p.set_matter_power(redshifts=sorted(REDSHIFTS, reverse=True), kmax=2 * K_MAX)
    p.NonLinearModel.set_params(halofit_version="takahashi")
    return p


def main():
    a_s = 2.1e-9
    s8 = camb.get_results(params(a_s)).get_sigma8_0()
    a_s *= (SIGMA8 / s8)**2
    p = params(a_s)
    p.NonLinear = camb.model.NonLinear_none
    res = camb.get_results(p)
    assert abs(res.get_sigma8_0() / SIGMA8 - 1) < 1e-4
    k, z, plin = res.get_matter_power_spectrum(minkh=K_MIN, maxkh=K_MAX, npoints=N_K)
    p.NonLinear = camb.model.NonLinear_pk
    res = camb.get_results(p)
    k2, z2, pnl = res.get_matter_power_spectrum(minkh=K_MIN, maxkh=K_MAX, npoints=N_K)
    assert np.allclose(k, k2) and np.allclose(z, z2)
    cols, names = [k], ["k[h/Mpc]"]
    for zz in REDSHIFTS:
        i = int(np.argmin(np.abs(np.asarray(z) - zz)))
        cols += [plin[i], pnl[i]]
        names += ["P_lin(z=%g)" % zz, "P_halofit(z=%g)" % zz]
    np.savetxt(OUT, np.column_stack(cols), fmt="%.8e",
               header="CAMB %s, halofit_version=takahashi, Omega_c=%g Omega_b=%g h=%g n_s=%g "
               "sigma8=%g, massless neutrinos\n%s" % (camb.__version__, OMEGA_C, OMEGA_B, H,
                                                       N_S, SIGMA8, "  ".join(names)))
    print("wrote", OUT)


if __name__ == "__main__":
    main()
