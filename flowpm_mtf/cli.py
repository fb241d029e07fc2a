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
imaging
    3D MRI reconstruction with the image split over the ranks: zero-filled, total
    variation and a trained unrolled network on a Shepp-Logan phantom
    (:mod:`flowpm_mtf.jobs.imaging`).
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

Safety (:mod:`flowpm_mtf.runs.rundir`, :mod:`flowpm_mtf.runs.preflight`): before any graph
is built, the numerics of the inputs, the estimated peak memory per rank and the
run directory ``--out`` are checked (a complete run there is never modified
without ``--overwrite``, a concurrent run on it fails at once); outputs are
staged and published whole with ``manifest.json`` written last. Every failure
prints one line ``flowpm-mtf: error: <message>`` once and exits non-zero on
every rank (:func:`report_error`); ``--verbose`` adds the traceback.
"""
import argparse
import json
import logging
import os
import re
import sys

from .backend import BACKENDS, default_grid, world  # noqa: F401 (re-exported)
from .jobs.options import parse_floats, parse_grid, parse_nc  # noqa: F401 (re-exported)

log = logging.getLogger("flowpm_mtf.cli")  # rank-0 filter added in main()

#: Exit code of a completed run, and of a run stopped by SIGTERM after its checkpoint.
EXIT_OK = 0

TF_QUIET_LEVEL = "1"
"""``TF_CPP_MIN_LOG_LEVEL`` without ``--verbose``: TF's C++ INFO lines are hidden."""


def add_run_arguments(parser, job):
    """The options every job has, besides its config fields."""
    group = parser.add_argument_group("run options")
    group.add_argument("--config", metavar="FILE.json",
                       help="JSON file of config fields (keys = field names, or sections "
                            "%s); flags override it" % ", ".join(s.key for s in job.sections))
    group.add_argument("--out", default=None,
                       help="run directory; refused if it holds a complete run, unless "
                            "--overwrite (default: %s)" % job.default_out)
    group.add_argument("--overwrite", action="store_true",
                       help="replace the complete earlier run in --out (all of its files)")
    group.add_argument("--force", action="store_true",
                       help="run even if the estimated peak memory exceeds what the node has")
    group.add_argument("--backend", choices=BACKENDS, default="hvd",
                       help="hvd: one slice per MPI rank; placement: Mesh TF's "
                            "PlacementMeshImpl in one process, without mpirun "
                            "(default: %(default)s)")
    group.add_argument("--no-plot", action="store_true", help="skip the figure")
    group.add_argument("--verbose", action="store_true",
                       help="tracebacks on errors, TensorFlow's C++ start-up lines, debug "
                            "output")
    if getattr(job, "checkpoints", False):
        unit = getattr(job, "loop_unit", "step")
        group.add_argument("--checkpoint-every", type=int, metavar="K",
                           help="write a checkpoint into OUT/checkpoint every K %ss, K >= 1 "
                                "(SIGTERM to the ranks, not to mpirun, checkpoints at the next "
                                "%s and exits 0; see docs/checkpoints.md)" % (unit, unit))
        group.add_argument("--resume", metavar="DIR",
                           help="continue the run in DIR from its newest valid checkpoint "
                                "(outputs go to DIR; --grid may differ, other settings must "
                                "match the checkpoint)")


class _NumberArgument:
    """The test argparse makes of an argument that starts with ``-``: a number, or a comma list
    of numbers (``-0.5,0.5,1.0``, ``-1e-3``, ``-inf``) or a grid (``-1x2``), is a value, not an
    option.

    argparse's own test (``^-\\d+$|^-\\d*\\.\\d+$``) knows only ``-5`` and ``-0.5``: it
    read ``--nz-bins -0.5,0.5,1.0`` as the option ``-0.5,0.5,1.0`` and failed with
    "expected one argument". The value then gets its option's own checks (a negative
    bin edge: the rule it breaks). No ``flowpm-mtf`` option looks like a number.
    """

    @staticmethod
    def match(text):
        if not text.startswith("-") or text.startswith("--"):
            return False
        if re.fullmatch(r"-\d+x-?\d+", text, re.I):    # a process grid PxQ: --grid -1x2
            return True
        try:
            for part in text.split(","):
                float(part)
        except ValueError:
            return False
        return True


class _Parser(argparse.ArgumentParser):
    """argparse raising :class:`ConfigError` (printed once) instead of exiting on every rank,
    and taking negative numbers and comma lists of them as values (:class:`_NumberArgument`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = _NumberArgument()   # sub-commands: this class too

    def error(self, message):
        from .errors import ConfigError

        raise ConfigError("%s: %s (see %s --help)" % (self.prog, message, self.prog))


def build_parser(jobs):
    """The ``flowpm-mtf`` argument parser for the registered ``jobs`` (name -> Job)."""
    from .jobs.options import add_job_arguments

    ap = _Parser(prog="flowpm-mtf", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    for name, job in jobs.items():
        p = sub.add_parser(name, help=job.help, description=(job.__doc__ or job.help)
                           .split("\n")[0])
        add_run_arguments(p, job)
        add_job_arguments(p, job)
    return ap


def checked_config(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` (a configuration or its validation) with ``ValueError``
    and ``TypeError`` turned into :class:`ConfigError` (reported once, before the compute)."""
    from .errors import ConfigError

    try:
        return fn(*args, **kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e))


def make_configs(job, args):
    """The job's configs from its defaults, ``--config`` and the flags; checks the rank count.

    Raises
    ------
    ConfigError
        For invalid values.
    RankCountError
        A process grid that does not match the ranks, or the placement backend
        under more than one MPI rank.
    """
    from .errors import RankCountError
    from .jobs.options import make_configs as generated

    n = world()[1]
    if args.backend == "placement" and n > 1:
        raise RankCountError("--backend placement runs the whole mesh in one process but the job "
                             "has %d MPI ranks; launch it without mpirun, or use --backend hvd"
                             % n)
    configs = checked_config(generated, job, args, args.config, n_ranks=n, backend=args.backend)
    conf = configs["config"]
    if args.backend == "hvd" and conf.n_ranks != n:
        raise RankCountError("the process grid %s needs %d ranks but the job has %d; launch with "
                             "-np %d or pass --grid" % (getattr(conf, "full_grid", conf.grid),
                                                        conf.n_ranks, n, conf.n_ranks))
    return configs


#: Jobs without an N-body (no numerics or memory-model check of a ``SimConfig``).
NO_NBODY_JOBS = ("fft-demo", "imaging", "halos")


def safety_hooks(job, args, run_dir):
    """Runner hooks: checks before the compute, then the locked run directory; publish at the end.

    Before any graph is built (collective, every rank raises the same error): the
    native CPU ops the memory model assumes (:func:`flowpm_mtf.runs.preflight.check_native_ops`),
    the job's own preflight, the numerics of the inputs and the estimated peak memory
    per rank (N-body jobs; ``--force`` skips the memory checks), then
    :meth:`RunDir.open`. After the outputs are written: :meth:`RunDir.publish`.
    """
    from .runs import preflight
    from .jobs import runner

    def check(ctx):
        ctx.force = args.force           # the jobs' own memory checks honour --force too
        preflight.check_native_ops(force=args.force)
        checked_config(job.preflight, ctx)
        if job.name not in NO_NBODY_JOBS:
            preflight.check_numerics(ctx.conf)
            preflight.check_memory(
                ctx.conf, ctx.comm, processes=1 if ctx.backend.name == "placement" else None,
                masters=not getattr(ctx.backend.mesh_impl, "slice_only_variables", False),
                force=args.force)
        run_dir.open()

    def publish(ctx, summary):
        run_dir.publish(config={key: cfg.to_dict() for key, cfg in ctx.configs.items()})

    return runner.Hooks(preflight=[check], after_run=[publish])


def explicit_values(job, args):
    """Section key -> {field: value} set by a flag or ``--config`` (not by defaults)."""
    from .jobs.options import job_values, read_config_file

    given = job_values(job, args, args.config)
    defaults = job_values(job, argparse.Namespace(), None)
    file_keys = set()
    if args.config:
        data = read_config_file(args.config)
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
        No valid checkpoint in the directory (it holds a complete run, or
        nothing to continue), one written by another job, or an option that
        contradicts it.
    """
    from .runs import checkpoint, rundir_manifest
    from .errors import ResumeError

    found = checkpoint.candidates(args.resume)
    if not found:   # a complete run (its checkpoints removed at publish) or none at all
        raise rundir_manifest.nothing_to_resume(args.resume)
    path, manifest = found[0]
    if manifest.get("job") not in (None, job.name):   # before its configs are read as ours
        raise ResumeError(checkpoint.check_identity(
            manifest, {"job": job.name, "state_config": {}, "stages": []}, path))
    overrides = explicit_values(job, args)
    sim = overrides.setdefault("config", {})
    if sim.get("grid") is None:
        # the checkpoint's grid where the ranks fit it (a resume on the same grid is
        # bit-identical), else the default grid of this rank count (re-sliced)
        n, saved = world()[1], tuple(manifest["grid"])
        sim["grid"] = saved if (args.backend != "hvd" or
                                int(saved[0]) * int(saved[1]) == n) else default_grid(n)
    configs = checkpoint.check_resume_config(manifest, overrides,
                                             {sec.key: sec.make for sec in job.sections},
                                             job=job.name)
    n = world()[1]
    conf = configs["config"]
    if args.backend == "hvd" and conf.n_ranks != n:
        raise ResumeError("the process grid %s needs %d ranks but the job has %d; launch with "
                          "-np %d or pass --grid" % (conf.grid, conf.n_ranks, n, conf.n_ranks))
    return configs


def main(argv=None, startup_error=None, until_exit=False):
    """Parse the command line and run one job; returns the exit code (see :func:`report_error`).

    Parameters
    ----------
    argv : list of str, optional
        Default ``sys.argv[1:]``.
    startup_error : FlowpmError, optional
        An error of the entry point before this process could start (the
        allocator, :func:`entry`): reported like any other, nothing runs.
    until_exit : bool
        The process exits after this call (the command, :func:`entry`): from
        the end of the run on, SIGTERM is ignored until it has exited, so a
        signal after the last step cannot end a rank during Horovod's, MPI's
        and Python's shutdown (exit 0 as docs/running.md says, not 143). False
        for a caller that goes on (a test): its handler is restored.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    verbose = "--verbose" in argv
    # Before TensorFlow is imported (by the runner): its C++ start-up lines on every rank.
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0" if verbose else os.environ.get(
        "TF_CPP_MIN_LOG_LEVEL", TF_QUIET_LEVEL)
    from . import backend as backend_mod
    from . import jobs
    from .logs import rank0_only, setup_logging

    setup_logging("DEBUG" if verbose else "INFO")
    rank0_only(log)
    logging.getLogger("tensorflow").setLevel(logging.WARNING)  # Mesh TF's lowering counters
    args = None
    try:
        if startup_error is not None:
            raise startup_error
        registry = jobs.all_jobs()   # their options and configs import no TensorFlow
        args = build_parser(registry).parse_args(argv)
        run_job(registry[args.command], args, backend_mod, until_exit=until_exit)
        return EXIT_OK   # also a run stopped by SIGTERM after its checkpoint
    except Exception as e:  # noqa: BLE001 (every failure becomes one line and an exit code)
        return report_error(e, args, verbose)


def check_run_options(args, job=None):
    """Check the run options that are no config field (``--checkpoint-every``).

    ``job`` (the Job class) names the unit of its loop in the message.

    Raises
    ------
    ConfigError
    """
    from .errors import ConfigError

    every = getattr(args, "checkpoint_every", None)
    if every is not None and every < 1:
        unit = getattr(job, "loop_unit", "step")
        raise ConfigError("--checkpoint-every takes a number of %ss >= 1, got %d" % (unit, every))


def run_job(job, args, backend_mod, until_exit=False):
    """Configs (new run, or ``--resume``), backend, run directory, then the runner
    (``until_exit``: see :func:`main`).

    The configs are made and checked before TensorFlow, Mesh TF or Horovod is imported (by
    the abort hook and the runner), so that a wrong value costs no TensorFlow start-up.
    """
    from .errors import ResumeError
    from .runs.rundir import RunDir

    check_run_options(args, job)
    every, resume = getattr(args, "checkpoint_every", None), getattr(args, "resume", None)
    if resume:
        if args.out not in (None, resume):
            raise ResumeError("--resume %s writes its outputs there; drop --out %s"
                              % (resume, args.out))
        args.out = resume
        configs = resume_configs(job, args)
    else:
        configs = make_configs(job, args)
    args.conf = configs["config"]  # for the error messages
    if args.backend == "hvd" and world()[1] > 1:
        backend_mod.install_abort_on_exception()  # uncaught errors (none expected) end the job
    # imported here, after the start-up error, the options and the configs: the runner imports
    # TensorFlow, whose start-up lines on TF 2.21 ignore TF_CPP_MIN_LOG_LEVEL while oneDNN is
    # on (FLOWPM_MTF_ALLOCATOR=tf or a bad mode: no re-execution)
    from .jobs import runner

    out = args.out or job.default_out
    log.info("; ".join("%s: %s" % (key, json.dumps(cfg.to_dict()))
                       for key, cfg in configs.items()))
    backend = backend_mod.make_backend(args.backend, configs["config"])
    run_dir = RunDir(out, job.name, comm=backend.comm, overwrite=args.overwrite,
                     resume=bool(resume))
    try:
        summary = runner.run(job, configs, backend, run_dir, plot=not args.no_plot,
                             hooks=safety_hooks(job, args, run_dir), checkpoint_every=every,
                             resume=bool(resume), until_exit=until_exit)
        _test_pause()
        return summary
    finally:
        run_dir.close()


#: Test hook: seconds every rank waits after its run returned (the outputs published), so
#: that a test's signal lands there (tests/test_restart.py); unset in a normal run.
PAUSE_ENV = "FLOWPM_MTF_TEST_PAUSE_AFTER_RUN"


def _test_pause():
    """Wait ``$FLOWPM_MTF_TEST_PAUSE_AFTER_RUN`` seconds, if set (a test hook)."""
    import time

    try:
        seconds = float(os.environ.get(PAUSE_ENV, "0"))
    except ValueError:
        seconds = 0.0
    if seconds > 0:
        log.info("%s: pausing %g s after the run", PAUSE_ENV, seconds)
        time.sleep(seconds)


def _as_user_error(exc, args):
    """The :class:`FlowpmError` a known failure stands for, or ``None`` (an internal error)."""
    from .errors import FlowpmError, ParticleEscapeError

    if isinstance(exc, FlowpmError):
        return exc
    if type(exc).__name__ == "InvalidArgumentError" and "particles escaped" in str(exc):
        conf = getattr(args, "conf", None)
        if conf is not None:
            from .physics import sizing

            err = sizing.lagrangian_escape_error(exc, conf)   # the hint from the run's displacement
            if err is not None:
                return err
        hint = "more --steps or a larger --halo"
        if conf is not None:
            limit = min(conf.block_shape[:2]) - 1
            if conf.halo_size < limit:
                hint = "--halo %d (at most %d on this grid) or more --steps" % (
                    min(2 * conf.halo_size + 1, limit), limit)
            else:
                hint = "more --steps, or fewer ranks so the blocks can hold a larger --halo"
        return ParticleEscapeError(
            "particles moved beyond the %s-cell halo of their block during the N-body (their "
            "CIC stencil left the padded block); rerun with %s"
            % (getattr(conf, "halo_size", "?"), hint))
    return None


#: Longest wait [s] of a failing rank for the others before it exits (see _meet_before_exit).
EXIT_MEETING_S = 30.0


def _meet_before_exit():
    """Wait (bounded) until every rank has reported the collective error.

    The first rank to exit non-zero makes ``mpirun`` kill the others, possibly
    before rank 0 printed the message: the ranks meet in a non-blocking barrier
    first, given up after :data:`EXIT_MEETING_S` (an error that hit some ranks
    only must not hang them).
    """
    import time

    try:
        from mpi4py import MPI
    except ImportError:
        return
    req = MPI.COMM_WORLD.Ibarrier()
    t_end = time.monotonic() + EXIT_MEETING_S
    while not req.Test() and time.monotonic() < t_end:
        time.sleep(0.01)


def report_error(exc, args, verbose):
    """Print ``flowpm-mtf: error: <message>`` once and return the exit code.

    Errors of :mod:`flowpm_mtf.errors` are raised identically on every rank (the
    checks are collective): rank 0 prints them, every rank exits with their
    ``exit_code`` (the launcher then ends the job). Anything else is unexpected
    and may have hit one rank only: that rank prints it with its rank and ends
    the whole MPI job (``MPI_Abort``) so that no rank waits forever.
    """
    rank, size = world()
    err = _as_user_error(exc, args)
    if verbose:
        logging.getLogger("flowpm_mtf.cli.error").error("traceback", exc_info=exc)  # every rank
    if err is not None:
        if rank == 0 or not getattr(err, "same_on_every_rank", True):
            prefix = "" if rank == 0 else "[rank %d] " % rank
            sys.stderr.write("flowpm-mtf: error: %s%s\n" % (prefix, err))
            sys.stderr.flush()
        if size > 1 and getattr(err, "same_on_every_rank", True):
            _meet_before_exit()  # else the launcher may kill rank 0 before it prints
        return err.exit_code
    first = (str(exc).strip().splitlines() or [""])[0]
    from .errors import EXIT_INTERNAL

    sys.stderr.write("flowpm-mtf: error: [rank %d] internal error %s: %s%s\n"
                     % (rank, type(exc).__name__, first,
                        "" if verbose else " (--verbose shows the traceback)"))
    sys.stderr.flush()
    if size > 1 and getattr(args, "backend", "hvd") == "hvd":
        try:
            from mpi4py import MPI
        except ImportError:  # a broken installation: nothing to abort with
            return EXIT_INTERNAL
        MPI.COMM_WORLD.Abort(EXIT_INTERNAL)
    return EXIT_INTERNAL


def start():
    """Start the ``flowpm-mtf`` command under the chosen memory allocator, run :func:`main`.

    Returns its exit code (:func:`entry` exits with it).

    :func:`flowpm_mtf.launch_env.apply` sets MPI's waiting policy (Open MPI
    yields while it waits: the rank's threads outnumber its core) and
    :func:`flowpm_mtf.allocator.ensure` re-executes the process once with the
    environment of ``FLOWPM_MTF_ALLOCATOR``, both before MPI, Horovod or
    TensorFlow are loaded. An unknown mode (or ``tcmalloc`` not installed) is
    an :class:`~flowpm_mtf.allocator.AllocatorError`, a configuration error:
    :func:`main` reports it like every other one (one line, from rank 0, exit 2
    on every rank) and runs nothing.

    A crash in native code (a segmentation fault in TensorFlow, Horovod, MPI
    or a custom op) prints the Python stack of every thread of the rank to
    stderr (:mod:`faulthandler`) before the process dies, so that the job log
    says where it happened; MPI's own handler, installed later, keeps it.
    """
    import faulthandler

    from . import allocator, launch_env

    faulthandler.enable(all_threads=True)
    launch_env.apply()

    try:
        allocator.ensure()
    except allocator.AllocatorError as e:
        return main(startup_error=e)
    return main(until_exit=True)


def entry():
    """The ``flowpm-mtf`` command: :func:`start`, then the process exits with its code.

    The exit skips the interpreter's teardown of TensorFlow's objects (about a second of
    CPU per rank, :func:`flowpm_mtf.launch_env.exit_process`); never returns.
    """
    from . import launch_env

    code = start()
    launch_env.exit_process(code if isinstance(code, int) else 1)


if __name__ == "__main__":
    entry()
