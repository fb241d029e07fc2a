"""JaxPM's PM force and a kick-drift-kick step around it, timed (one process).

Run by ``scripts/bench_peers.py`` (peer ``jaxpm``) with the python of JaxPM's own
virtualenv (``results/tmp/venv-jaxpm``: ``pip install jaxpm==0.1.6 packaging``)::

    results/tmp/venv-jaxpm/bin/python flowpm_bench/peers/jaxpm_force.py 64 rec.json

Times the jitted ``jaxpm.pm.pm_forces`` on a perturbed lattice of ``nc^3``
particles (one PM force: paint, FFTs, gradient kernels, readout) and a jitted
kick-drift-kick step built from it with constant factors (the same work as our
step): the median of 5 calls after a warm-up, wall and process CPU time. Writes
one JSON record. JaxPM's ``lpt`` needs an unreleased jax_cosmo, so its initial
conditions are not timed.

This file runs in JaxPM's environment: it imports only the standard library,
numpy and (in :func:`main`) jax and jaxpm -- neither ``flowpm_mtf`` nor TensorFlow.
"""
import argparse
import json
import resource
import statistics
import time

import numpy as np

#: Calls timed (median) after one warm-up call.
REPEATS = 5
#: Constant factors of the step: force 1.5 Omega_m, kick and drift 0.01.
FORCE_FACTOR = 1.5 * 0.3
STEP_FACTOR = 0.01


def perturbed_lattice(nc, seed=0):
    """``nc^3`` particle positions [cells]: the lattice plus N(0, 1) offsets, periodic.

    Parameters
    ----------
    nc : int
    seed : int

    Returns
    -------
    numpy.ndarray
        Shape ``(nc^3, 3)``, float32, in ``[0, nc)``.
    """
    rng = np.random.RandomState(seed)
    q = np.stack(np.meshgrid(*[np.arange(nc, dtype=np.float32)] * 3, indexing="ij"), -1)
    return (q.reshape(-1, 3) + rng.randn(nc**3, 3).astype(np.float32)) % nc


def timed(fn, n=REPEATS):
    """Median wall and process CPU time [s] of ``fn()`` over ``n`` calls after one.

    Parameters
    ----------
    fn : callable
    n : int

    Returns
    -------
    tuple of float
    """
    fn()
    ts, cs = [], []
    for _ in range(n):
        t, c = time.perf_counter(), time.process_time()
        fn()
        ts.append(time.perf_counter() - t)
        cs.append(time.process_time() - c)
    return statistics.median(ts), statistics.median(cs)


def measure(nc):
    """The record of ``nc^3`` particles (needs jax and jaxpm).

    Parameters
    ----------
    nc : int

    Returns
    -------
    dict
        ``peer``, ``nc``, ``ranks``, ``jax``, ``devices``, ``force_s``,
        ``force_cpu_s``, ``step_s``, ``step_cpu_s`` [s], ``peak_memory_mb``,
        ``jaxpm`` (its version, when known).
    """
    import jax
    import jax.numpy as jnp
    from jaxpm.pm import pm_forces

    shape = [nc, nc, nc]
    pos = jnp.asarray(perturbed_lattice(nc))
    vel = jnp.zeros_like(pos)
    force = jax.jit(lambda x: pm_forces(x, shape) * FORCE_FACTOR)

    @jax.jit
    def step(x, p, f):
        # kick-drift-kick with constant factors: one PM force, as our step
        p = p + f * STEP_FACTOR
        x = (x + p * STEP_FACTOR) % nc
        f = pm_forces(x, shape) * FORCE_FACTOR
        return x, p + f * STEP_FACTOR, f

    f0 = force(pos).block_until_ready()
    rec = {"peer": "jaxpm", "nc": nc, "ranks": 1, "jax": jax.__version__,
           "devices": str(jax.devices())}
    rec["force_s"], rec["force_cpu_s"] = timed(lambda: force(pos).block_until_ready())
    state = [pos, vel, f0]

    def one():
        state[:] = step(*state)
        state[2].block_until_ready()

    rec["step_s"], rec["step_cpu_s"] = timed(one)
    rec["peak_memory_mb"] = [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0]
    try:
        import importlib.metadata as md

        rec["jaxpm"] = md.version("jaxpm")
    except Exception:  # the version is informative only
        pass
    return rec


def main(argv=None):
    """Command line: ``jaxpm_force.py NC OUT``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("nc", type=int, help="particles (and mesh cells) per side")
    ap.add_argument("out", help="the JSON record written here")
    args = ap.parse_args(argv)
    rec = measure(args.nc)
    with open(args.out, "w") as f:
        json.dump(rec, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
