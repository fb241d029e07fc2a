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
    group.add_argument("--out", default=None,
                       help="output (run) directory (default: %s)" % job.default_out)
    group.add_argument("--backend", choices=BACKENDS, default="hvd",
                       help="hvd: one slice per MPI rank; placement: Mesh TF's "
                            "PlacementMeshImpl in one process (default: %(default)s)")
    group.add_argument("--no-plot", action="store_true", help="skip the figure")
    group.add_argument("--verbose", action="store_true",
                       help="show TensorFlow's C++ start-up lines (and debug output)")
    if getattr(job, "checkpoints", False):
        group.add_argument("--checkpoint-every", type=int, metavar="K",
                           help="write a checkpoint into OUT/checkpoint every K steps (SIGTERM "
                                "always checkpoints and exits 0)")
        group.add_argument("--resume", metavar="DIR",
                           help="continue the run in DIR from its newest valid checkpoint "
                                "(outputs go to DIR; --grid may differ, other settings must "
                                "match the checkpoint)")


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


def explicit_values(job, args):
    """Section key -> {field: value} set by a flag or ``--config`` (not by defaults)."""
    from .jobs.options import job_values

    given = job_values(job, args, args.config)
    defaults = job_values(job, argparse.Namespace(), None)
    file_keys = set()
    if args.config:
        with open(args.config) as fh:
            data = json.load(fh)
        for key, value in data.items():
            file_keys.update(value if (key in given and isinstance(value, dict)) else [key])
    out = {}
    for key, values in given.items():
        for name, value in values.items():
            if "%s:%s" % (key, name) in vars(args) or name in file_keys or \
                    defaults[key].get(name, object()) != value:
                out.setdefault(key, {})[name] = value
    return out


def resume_configs(job, args):
    """The configs of the checkpointed run in ``args.resume`` (the grid may change).

    Raises
    ------
    ResumeError
        No valid checkpoint in the directory, or an option that contradicts it.
    """
    from . import checkpoint
    from .errors import ResumeError

    found = checkpoint.candidates(args.resume)
    if not found:
        raise ResumeError("--resume %s: no valid checkpoint in %s (run with --checkpoint-every K "
                          "to write checkpoints, or start a new run)"
                          % (args.resume, checkpoint.checkpoint_root(args.resume)))
    manifest = found[0][1]
    overrides = explicit_values(job, args)
    sim = overrides.setdefault("config", {})
    if sim.get("grid") is None:
        n = world()[1]
        sim["grid"] = default_grid(n) if args.backend == "hvd" else tuple(manifest["grid"])
    configs = checkpoint.check_resume_config(manifest, overrides,
                                             {sec.key: sec.make for sec in job.sections})
    n = world()[1]
    conf = configs["config"]
    if args.backend == "hvd" and conf.n_ranks != n:
        raise ResumeError("the process grid %s needs %d ranks but the job has %d; launch with "
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
    from .errors import FlowpmError

    try:
        run_job(job, args, backend_mod, runner)
    except FlowpmError as exc:  # one line, no traceback, non-zero exit on every rank
        if world()[0] == 0:
            sys.stderr.write("flowpm-mtf: error: %s\n" % exc)
        return 1
    return 0


def run_job(job, args, backend_mod, runner):
    """Configs (new run, or ``--resume``), backend, then the runner."""
    from .errors import ConfigError, ResumeError

    every, resume = getattr(args, "checkpoint_every", None), getattr(args, "resume", None)
    if every is not None and every < 1:
        raise ConfigError("--checkpoint-every takes a number of steps >= 1, got %d" % every)
    if resume:
        if args.out not in (None, resume):
            raise ResumeError("--resume %s writes its outputs there; drop --out %s"
                              % (resume, args.out))
        args.out = resume
        configs = resume_configs(job, args)
    else:
        configs = make_configs(job, args)
    out = args.out or job.default_out
    log.info("; ".join("%s: %s" % (key, json.dumps(cfg.to_dict()))
                       for key, cfg in configs.items()))
    backend = backend_mod.make_backend(args.backend, configs["config"])
    return runner.run(job, configs, backend, out, plot=not args.no_plot, checkpoint_every=every,
                      resume=bool(resume))


if __name__ == "__main__":
    sys.exit(main())
