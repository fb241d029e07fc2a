"""``flowpm-mtf`` command line: runs under ``mpirun``/``horovodrun``/``srun``.

Sub-commands (one per registered job, :mod:`flowpm_mtf.jobs`)
--------------------------------------------------------------
simulate
    The main job: Gaussian initial conditions, 1LPT/2LPT, FastPM N-body, then
    ``snapshot.h5``, ``power.txt``, ``summary.json`` and ``overview.png``
    (:mod:`flowpm_mtf.jobs.simulate`).
reconstruct
    Reconstruction of the initial linear field from the observed final density
    of a truth simulation, by Adam on a distributed Mesh TF variable
    (:mod:`flowpm_mtf.jobs.reconstruct`).
lensing
    Lightcone N-body with density planes and Born convergence maps
    (:mod:`flowpm_mtf.jobs.lensing`).
fft-demo
    Distributed 3D FFT round trip on the process grid, checked against
    ``numpy.fft`` (:mod:`flowpm_mtf.jobs.fft_demo`).

Every field of a job's configuration is an option (``flowpm-mtf JOB --help``
lists them with their defaults) and a key of ``--config FILE.json``
(:mod:`flowpm_mtf.jobs.options`).

The backend is :class:`hvd_mesh_impl.HvdSimdMeshImpl` (one slice per MPI rank),
or with ``--backend placement`` Mesh TF's ``PlacementMeshImpl`` in one process on
``grid`` logical CPU devices (:mod:`flowpm_mtf.backend`, the only module that
imports the Horovod backend).

TensorFlow's C++ start-up lines (CPU features, oneDNN) are hidden by setting
``TF_CPP_MIN_LOG_LEVEL=1`` before TensorFlow is imported, unless ``--verbose``.
"""
import argparse
import json
import logging
import os
import sys

from .backend import BACKENDS, default_grid, world  # noqa: F401 (re-exported)
from .jobs.options import parse_floats, parse_grid, parse_nc  # noqa: F401 (re-exported)

log = logging.getLogger("flowpm_mtf.cli")  # rank-0 filter added in main()

TF_QUIET_LEVEL = "1"
"""``TF_CPP_MIN_LOG_LEVEL`` without ``--verbose``: TF's C++ INFO lines are hidden."""


def add_run_arguments(parser, job):
    """The options every job has, besides its config fields."""
    group = parser.add_argument_group("run options")
    group.add_argument("--config", metavar="FILE.json",
                       help="JSON file of config fields (keys = field names, or sections "
                            "%s); flags override it" % ", ".join(s.key for s in job.sections))
    group.add_argument("--out", default=job.default_out,
                       help="output (run) directory (default: %(default)s)")
    group.add_argument("--backend", choices=BACKENDS, default="hvd",
                       help="hvd: one slice per MPI rank; placement: Mesh TF's "
                            "PlacementMeshImpl in one process (default: %(default)s)")
    group.add_argument("--no-plot", action="store_true", help="skip the figure")
    group.add_argument("--verbose", action="store_true",
                       help="show TensorFlow's C++ start-up lines (and debug output)")


def build_parser(jobs):
    """The ``flowpm-mtf`` argument parser for the registered ``jobs`` (name -> Job)."""
    from .jobs.options import add_job_arguments

    ap = argparse.ArgumentParser(prog="flowpm-mtf", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    for name, job in jobs.items():
        p = sub.add_parser(name, help=job.help, description=(job.__doc__ or job.help)
                           .split("\n")[0])
        add_run_arguments(p, job)
        add_job_arguments(p, job)
    return ap


def make_configs(job, args):
    """The job's configs from its defaults, ``--config`` and the flags; checks the rank count.

    Raises
    ------
    ValueError
        For invalid values, or a process grid that does not match the ranks.
    """
    from .jobs.options import make_configs as generated

    n = world()[1]
    configs = generated(job, args, args.config, n_ranks=n, backend=args.backend)
    conf = configs["config"]
    if args.backend == "hvd" and conf.n_ranks != n:
        raise ValueError("the process grid %s needs %d ranks but the job has %d; launch with "
                         "-np %d or pass --grid" % (conf.grid, conf.n_ranks, n, conf.n_ranks))
    return configs


def main(argv=None):
    """Parse the command line and run one job; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # Before TensorFlow is imported (by the jobs): its C++ start-up lines on every rank.
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0" if "--verbose" in argv else os.environ.get(
        "TF_CPP_MIN_LOG_LEVEL", TF_QUIET_LEVEL)
    from . import backend as backend_mod
    from . import jobs
    from .jobs import runner
    from .logs import rank0_only, setup_logging

    registry = jobs.all_jobs()
    args = build_parser(registry).parse_args(argv)
    setup_logging("DEBUG" if args.verbose else "INFO")
    rank0_only(log)
    logging.getLogger("tensorflow").setLevel(logging.WARNING)  # Mesh TF's lowering counters
    if args.backend == "hvd":
        backend_mod.install_abort_on_exception()  # one failing rank ends the job
    job = registry[args.command]
    configs = make_configs(job, args)
    log.info("; ".join("%s: %s" % (key, json.dumps(cfg.to_dict()))
                       for key, cfg in configs.items()))
    backend = backend_mod.make_backend(args.backend, configs["config"])
    runner.run(job, configs, backend, args.out, plot=not args.no_plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
