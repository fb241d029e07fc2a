"""Launching benchmark sub-runs: ``mpirun`` command lines and their environment.

Every benchmark launches its MPI sub-runs the way ``scripts/run_mpirun.sh``
launches the jobs, so that a benchmark measures what a job gets.
"""
import logging
import math
import os
import shutil
import subprocess
import time

log = logging.getLogger(__name__)

#: Variables an MPI launcher (Open MPI, PMIx, PMI, horovodrun) sets for its ranks: a
#: driver that runs inside an MPI job drops them, or its nested ``mpirun`` is refused.
MPI_LAUNCH_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "HOROVOD_")


def mpirun_command(n=None):
    """The ``mpirun`` command line of a benchmark sub-run on this host.

    ``--bind-to none`` as ``scripts/run_mpirun.sh`` launches the jobs: Open MPI's
    default binds each rank to one core when there are at most 2 ranks, so a 1-rank
    run would use one core of the machine (and a benchmark would not measure what a
    job gets). ``--oversubscribe``: more ranks than cores are allowed (the times then
    add up the ranks' work). ``--allow-run-as-root`` when run as root.

    Parameters
    ----------
    n : int, optional
        Number of ranks (``-np n``); without it the caller appends ``-np``.

    Returns
    -------
    list of str

    Raises
    ------
    RuntimeError
        If ``mpirun`` is not on ``PATH``.
    """
    exe = shutil.which("mpirun")
    if exe is None:
        raise RuntimeError("mpirun not found: run scripts/setup_env.sh")
    cmd = [exe, "--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    if n is not None:
        cmd += ["-np", str(n)]
    return cmd


def clean_env(pythonpath=None, strip=MPI_LAUNCH_PREFIXES, **overrides):
    """The environment of a sub-run: this one without an enclosing MPI job's variables.

    Defaults (a value already set is kept): ``TF_CPP_MIN_LOG_LEVEL=2``,
    ``PYTHONUNBUFFERED=1``, ``OMP_NUM_THREADS=1`` (as ``scripts/run_mpirun.sh``).

    Parameters
    ----------
    pythonpath : str, optional
        Put first on ``PYTHONPATH`` (e.g. a checkout whose packages the sub-run
        must import instead of the installed ones).
    strip : tuple of str
        Prefixes of the variables dropped (default :data:`MPI_LAUNCH_PREFIXES`).
    **overrides : str
        Variables set, replacing any value.

    Returns
    -------
    dict
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(tuple(strip))}
    for key, value in (("TF_CPP_MIN_LOG_LEVEL", "2"), ("PYTHONUNBUFFERED", "1"),
                       ("OMP_NUM_THREADS", "1")):
        env.setdefault(key, value)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(
            [pythonpath] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(overrides)
    return env


def run(cmd, timeout, env=None):
    """Run a sub-run to completion; its wall time [s].

    Parameters
    ----------
    cmd : list of str
    timeout : float
        [s]; a longer run is killed (``subprocess.TimeoutExpired``).
    env : dict, optional
        Default :func:`clean_env`.

    Returns
    -------
    float

    Raises
    ------
    RuntimeError
        If the sub-run fails; the message holds the end of its standard error.
    """
    log.info("running: %s", " ".join(cmd))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=clean_env() if env is None else env, capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError("sub-run failed (%d): %s\n%s" % (proc.returncode, " ".join(cmd),
                                                            proc.stderr[-4000:]))
    wall = time.perf_counter() - t0
    log.info("  done in %.1f s", wall)
    return wall


def default_grid(n):
    """The most square process grid ``(P, Q)`` with ``P * Q = n`` and ``P >= Q``.

    The grid of ``flowpm_mtf.backend.default_grid`` (``flowpm-mtf``'s default), here
    without importing ``flowpm_mtf``: a ``--baseline`` tree may predate it.

    Parameters
    ----------
    n : int

    Returns
    -------
    tuple of int
    """
    q = math.isqrt(n)
    while n % q:
        q -= 1
    return (n // q, q)
