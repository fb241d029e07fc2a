"""Single-device references shared by the tests and the benchmark scripts.

They live here, beside the benchmarks, not in :mod:`flowpm_mtf`: the library does not
ship what only checks it. The tests (``tests/nbody_harness.py``) and the scripts
(``scripts/bench_sim.py``, ``scripts/bench_gradient.py``) import them from this module.

A numpy Gaussian linear field (:func:`linear_field_numpy`) and FlowPM 0.1.1's
cosmology dict with a growth table usable across TF graphs
(:func:`flowpm_cosmo`), for comparisons with ``flowpm.tfpm`` (imported
lazily: FlowPM is needed only when these are called with it).
"""
import functools

import numpy as np

from flowpm_mtf.physics import cosmology as C
from flowpm_mtf import layout
from flowpm_mtf.physics import linear_power
from flowpm_mtf.mesh.noise import white_noise_numpy

__all__ = ["linear_field_numpy", "flowpm_cosmo"]


def linear_field_numpy(conf, seed=7, amplitude=1.0):
    """Gaussian linear field at a = 1 with the EH98 spectrum of ``conf.cosmology`` (float64).

    ``delta_k = fftn(white) * sqrt(P(k) / V_cell)``, times ``amplitude``
    [dimensionless density contrast], shape ``conf.nc``.
    """
    white = white_noise_numpy(seed, conf.nc)
    kvec = layout.axis_k(conf, natural=True)  # numpy FFT order, as fftn below
    kk = np.sqrt(kvec[0][:, None, None]**2 + kvec[1][None, :, None]**2
                 + kvec[2][None, None, :]**2)
    pk = np.zeros_like(kk)
    pk[kk > 0] = linear_power.linear_matter_power(conf.cosmology, kk[kk > 0])
    cell_volume = float(np.prod(conf.cell_size))
    field = np.fft.ifftn(np.fft.fftn(white) * np.sqrt(pk / cell_volume)).real
    return amplitude * field


@functools.lru_cache(maxsize=None)
def _flowpm_ode_cache(which):
    """A growth table for FlowPM 0.1.1 (numpy), on the grid of its ``maybe_compute_ODE``.

    FlowPM caches its growth ODE solution as TF tensors in the *module-global*
    ``flowpm.tfbackground.cosmo`` dict, which ``flowpm.tfpm.lpt_init``, ``kick``
    and ``drift`` use regardless of their ``cosmology`` argument (a FlowPM 0.1.1
    quirk); a tensor cached in one tf.Graph cannot be used in another, so the
    table is stored as numpy arrays.

    ``which="flowpm"``: FlowPM's own float32 BDF solution (rtol 1e-4, ~20 s; agrees
    with ours to <= 1.6e-5, see tests/test_cosmology.py). ``which="ours"``:
    :func:`flowpm_mtf.physics.cosmology.growth` in FlowPM's normalisation (D2(1) = 1),
    rounded to float32: the comparison then isolates LPT, PM force and time
    stepping from the growth solver.
    """
    import flowpm.tfbackground as bg
    import tensorflow.compat.v1 as tf

    from flowpm_mtf.config import Cosmology

    a32 = np.logspace(-2, 0.0, 1024).astype(np.float32)
    if which == "flowpm":
        with tf.Graph().as_default():
            ode = bg.odesolve_func(bg.cosmo, tf.constant(a32))
            with tf.Session() as sess:
                return sess.run(ode)
    a = a32.astype(np.float64)
    g = C.growth(Cosmology(), a)
    n2 = C.D2(Cosmology(), 1.0)
    table = {"a": a, "D1": g.D1, "D1f": g.gp, "F1p": (g.d2D1 - g.dD1) / a**2,
             "D2": g.D2 / n2, "D2f": g.gp2 / n2, "F2p": (g.d2D2 - g.dD2) / a**2 / n2}
    return {k: v.astype(np.float32) for k, v in table.items()}


def flowpm_cosmo(which="ours"):
    """FlowPM's global Planck15 dict with the growth table ``which`` cached in it."""
    import flowpm.tfbackground as bg

    from flowpm_mtf.config import Cosmology

    ours = Cosmology().to_flowpm_dict()
    for k, v in ours.items():
        assert abs(bg.cosmo[k] - v) <= 1e-12 * abs(v), k
    bg.cosmo["cache_ODE"] = _flowpm_ode_cache(which)
    return bg.cosmo
