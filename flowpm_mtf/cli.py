"""``flowpm-mtf`` command line: runs under ``mpirun``/``horovodrun``/``srun``.

Sub-commands
------------
simulate
    The main job: Gaussian initial conditions, 1LPT/2LPT, FastPM N-body, then
    ``snapshot.h5``, ``power.txt``, ``summary.json`` and ``overview.png`` in
    ``--out`` (see :mod:`flowpm_mtf.simulate`). Default: 64^3 particles and
    mesh, 200 Mpc/h, 2LPT, a = 0.1 -> 1.0 in 10 steps.
reconstruct
    Reconstruction of the initial linear field from the observed final density
    of a truth simulation, by Adam on a distributed Mesh TF variable
    (``reconstruction.h5``, ``reconstruction.txt``, ``summary.json``,
    ``reconstruction.png``; see :mod:`flowpm_mtf.reconstruct`). Default: 32^3,
    200 Mpc/h, 2LPT forward model to a = 1, 200 iterations.
lensing
    Lightcone N-body with density planes and Born convergence maps
    (``kappa.h5``, ``kappa_power.txt``, ``summary.json``, ``kappa.png``; see
    :mod:`flowpm_mtf.lensing_job`). Default: 64^3, 256 Mpc/h, 2LPT at a = 0.2,
    z_s = 1, 12 planes, 5 deg field, 128^2 pixels.
fft-demo
    Distributed 3D FFT round trip on the process grid, checked against
    ``numpy.fft`` on the gathered field; prints the error and the timing.

The backend is :class:`hvd_mesh_impl.HvdSimdMeshImpl` (one slice per MPI rank),
or with ``--backend placement`` Mesh TF's ``PlacementMeshImpl`` in one process on
``grid`` logical CPU devices. This module imports Horovod only through the
backend factory, so the rest of ``flowpm_mtf`` stays backend-independent.
"""
import argparse
import json
import logging
import os
import statistics
import sys
import time

log = logging.getLogger("flowpm_mtf.cli")  # rank-0 filter added in main()


# ----------------------------------------------------------------------------- helpers
def world():
    """(rank, size) from the MPI launcher's environment, without initialising MPI."""
    for r, s in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"),
                 ("PMIX_RANK", "PMIX_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")):
        if r in os.environ and s in os.environ:
            return int(os.environ[r]), int(os.environ[s])
    return 0, 1


def default_grid(n):
    """The most square (P, Q) with P * Q = n and P >= Q."""
    q = int(n ** 0.5)
    while n % q:
        q -= 1
    return (n // q, q)


def parse_grid(text):
    """``"2x2"`` -> (2, 2)."""
    try:
        p, q = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError("--grid takes PxQ, e.g. 2x1, got %r" % text)
    return (p, q)


def parse_nc(text):
    """``"64"`` -> 64, ``"64,32,32"`` -> (64, 32, 32)."""
    parts = [int(v) for v in text.split(",")]
    if len(parts) not in (1, 3):
        raise argparse.ArgumentTypeError("--nc takes N or NX,NY,NZ, got %r" % text)
    return parts[0] if len(parts) == 1 else tuple(parts)


#: Default run directory of each sub-command (see flowpm_mtf.rundir).
DEFAULT_OUT = {"simulate": "out/sim", "lensing": "out/lensing", "reconstruct": "out/recon",
               "fft-demo": "out/fft-demo"}


class _Parser(argparse.ArgumentParser):
    """argparse raising :class:`ConfigError` (printed once) instead of exiting on every rank."""

    def error(self, message):
        from .errors import ConfigError

        raise ConfigError("%s: %s (see %s --help)" % (self.prog, message, self.prog))


def positive_int(text):
    """``"3"`` -> 3; zero or negative values are rejected."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError("expected a positive integer, got %r" % text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1, got %d" % value)
    return value


def add_config_arguments(ap, command="simulate"):
    """The configuration overrides and run-directory flags shared by the sub-commands."""
    ap.add_argument("--config", help="JSON file with SimConfig fields (overridden by flags)")
    ap.add_argument("--nc", type=parse_nc, help="mesh cells per side: N or NX,NY,NZ")
    ap.add_argument("--box-size", type=float, help="box side [Mpc/h]")
    ap.add_argument("--steps", type=int, dest="n_steps", help="number of N-body steps")
    ap.add_argument("--a-start", type=float, help="initial scale factor")
    ap.add_argument("--lpt-order", type=int, choices=(1, 2),
                    help="order of Lagrangian perturbation theory of the initial conditions")
    ap.add_argument("--grid", type=parse_grid, help="process grid PxQ (default: from rank count)")
    ap.add_argument("--halo", type=int, dest="halo_size", help="halo size [cells]")
    ap.add_argument("--seed", type=int, help="seed of the initial conditions")
    ap.add_argument("--dtype", choices=("float32", "float64"),
                    help="floating-point type of fields and particles")
    ap.add_argument("--out", default=DEFAULT_OUT[command],
                    help="run directory; refused if it holds a complete run, unless --overwrite")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace the complete earlier run in --out (all of its files)")
    ap.add_argument("--force", action="store_true",
                    help="run even if the estimated peak memory exceeds what the node has")
    ap.add_argument("--verbose", action="store_true",
                    help="tracebacks on errors and TensorFlow's C++ start-up messages")
    ap.add_argument("--backend", choices=("hvd", "placement"), default="hvd",
                    help="hvd: one mesh slice per MPI rank (HvdSimdMeshImpl); placement: the "
                         "whole mesh in one process (Mesh TF's PlacementMeshImpl, no mpirun)")


def build_config(args, defaults=None):
    """SimConfig from defaults, then ``--config`` file, then command-line flags.

    Raises
    ------
    ConfigError
        Unreadable ``--config`` or an invalid configuration.
    RankCountError
        The grid does not match the MPI ranks, or the placement backend runs under
        more than one rank.
    """
    from .config import SimConfig
    from .errors import ConfigError, RankCountError

    n = world()[1]
    if args.backend == "placement" and n > 1:
        raise RankCountError("--backend placement runs the whole mesh in one process but the job "
                             "has %d MPI ranks; launch it without mpirun, or use --backend hvd"
                             % n)
    fields = dict(defaults or {})
    if args.config:
        try:
            with open(args.config) as f:
                fields.update(json.load(f))
        except (OSError, ValueError) as e:
            raise ConfigError("--config %s: %s" % (args.config, e))
    for key in ("nc", "box_size", "n_steps", "a_start", "lpt_order", "grid", "halo_size",
                "seed", "dtype"):
        val = getattr(args, key, None)
        if val is not None:
            fields[key] = val
    if "grid" not in fields or fields["grid"] is None:
        fields["grid"] = default_grid(n) if args.backend == "hvd" else (1, 1)
    conf = checked_config(SimConfig.from_dict, fields)
    if args.backend == "hvd" and conf.n_ranks != n:
        raise RankCountError("the process grid %s needs %d ranks but the job has %d; launch with "
                             "-np %d or pass --grid" % (conf.grid, conf.n_ranks, n, conf.n_ranks))
    args.conf = conf  # for the error messages of main()
    return conf


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


def make_comm(backend):
    """The communicator of the job (see :mod:`flowpm_mtf.comm`)."""
    if backend == "hvd":
        from mpi4py import MPI

        return MPI.COMM_WORLD
    from .comm import SingleProcessComm

    return SingleProcessComm()


def open_run(args, conf, job, nbody=True):
    """Every check before the compute, then the locked run directory (collective).

    Numerics of the inputs (N-body jobs), the memory estimate per rank
    (``--force`` skips it) and the run directory ``--out``, in this order.

    Returns
    -------
    flowpm_mtf.rundir.RunDir
        Opened; write into ``.staging``, then ``publish``, then ``close`` (or use
        it as a context manager).
    """
    from . import preflight
    from .rundir import RunDir

    comm = make_comm(args.backend)
    if nbody:
        preflight.check_numerics(conf)
        preflight.check_memory(conf, comm, processes=1 if args.backend == "placement" else None,
                               masters=_backend_keeps_masters(args.backend), force=args.force)
    return RunDir(args.out, job, comm=comm, overwrite=args.overwrite).open()


def run_job(args, conf, job, run, config, nbody=True):
    """Checks, run directory, ``run(mesh_impl, session_config, out_dir, rank=, gather_stats=,
    plot=)`` writing into the staging directory, then publish (see :func:`open_run`)."""
    with open_run(args, conf, job, nbody=nbody) as rd:
        impl = make_mesh_impl(conf, args.backend)
        summary = run(impl, session_config(conf, args.backend), rd.staging, rank=world()[0],
                      gather_stats=_allgather_fn(args.backend), plot=not args.no_plot)
        rd.publish(config=config)
    return summary


def _backend_keeps_masters(backend):
    """Whether the backend holds a full-size master copy of every variable per process."""
    if backend != "hvd":
        return True  # Mesh TF's PlacementMeshImpl
    from hvd_mesh_impl import HvdSimdMeshImpl

    return bool(getattr(HvdSimdMeshImpl, "keeps_full_size_masters", True))


def make_mesh_impl(conf, backend):
    """The MeshImpl for ``conf``: HvdSimdMeshImpl or PlacementMeshImpl."""
    if backend == "hvd":
        from hvd_mesh_impl import HvdSimdMeshImpl  # the only place the CLI touches Horovod

        return HvdSimdMeshImpl(conf.mesh_shape, conf.layout_rules)
    import mesh_tensorflow as mtf

    return mtf.placement_mesh_impl.PlacementMeshImpl(
        conf.mesh_shape, conf.layout_rules, ["/cpu:%d" % i for i in range(conf.n_ranks)])


def session_config(conf, backend):
    import tensorflow.compat.v1 as tf

    if backend == "hvd":
        from hvd_mesh_impl import runtime

        return runtime.session_config()
    return tf.ConfigProto(device_count={"CPU": conf.n_ranks})


def _median_time(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ----------------------------------------------------------------------------- fft-demo
def cmd_fft_demo(args):
    """Distributed r2c/c2r round trip vs numpy.fft; writes ``fft_demo.json``."""
    import mesh_tensorflow as mtf
    import numpy as np
    import tensorflow.compat.v1 as tf

    from . import fft

    tf.disable_eager_execution()
    conf = build_config(args, {"nc": 64, "dtype": "float64"})
    with open_run(args, conf, "fft-demo", nbody=False) as rd:
        result = _fft_demo(args, conf, rd.staging)
        rd.publish(config=conf, extra={"fft_demo": result})
    return result


def _fft_demo(args, conf, out_dir):
    import mesh_tensorflow as mtf
    import numpy as np
    import tensorflow.compat.v1 as tf

    from . import fft

    rank = world()[0]
    rng = np.random.RandomState(conf.seed)
    field_np = rng.standard_normal(conf.nc).astype(conf.np_dtype)
    t_build = time.perf_counter()
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "mesh")
    x = mtf.import_tf_tensor(mesh, tf.constant(field_np), fft.real_shape(conf))
    k = fft.r2c(x, conf)
    back = fft.c2r(k, conf)
    impl = make_mesh_impl(conf, args.backend)
    lowering = mtf.Lowering(graph, {mesh: impl})
    k_full = lowering.export_to_tf_tensor(k)
    back_full = lowering.export_to_tf_tensor(back)
    # Timed op: the round trip without the gathers (each rank keeps its slice).
    round_trip = tf.group(lowering.tensors[back].to_laid_out_tensor().tensor_list)
    t_build = time.perf_counter() - t_build
    with tf.Session(config=session_config(conf, args.backend)) as sess:
        k_val, back_val = sess.run([k_full, back_full])
        sess.run(round_trip)  # warm-up
        t_rt = _median_time(lambda: sess.run(round_trip), args.repeats)
    ref = np.fft.fftn(field_np) / field_np.size  # FlowPM's r2c normalisation
    err_fwd = float(np.max(np.abs(k_val - ref)) / np.max(np.abs(ref)))
    err_rt = float(np.max(np.abs(back_val - field_np)) / np.max(np.abs(field_np)))
    tol = 1e-10 if conf.dtype == "float64" else 1e-4
    result = {"nc": list(conf.nc), "grid": list(conf.grid), "backend": args.backend,
              "dtype": conf.dtype, "ranks": world()[1],
              "max_rel_error_forward_vs_numpy": err_fwd, "max_rel_error_round_trip": err_rt,
              "graph_build_s": t_build, "round_trip_median_s": t_rt, "repeats": args.repeats}
    if rank == 0:
        with open(os.path.join(out_dir, "fft_demo.json"), "w") as f:
            json.dump(result, f, indent=1)
        log.info("FFT %s on grid %s (%s, %s): forward vs numpy max rel. error %.2e, round trip "
                 "%.2e; round trip %.1f ms (median of %d); graph build %.2f s",
                 "x".join(map(str, conf.nc)), "x".join(map(str, conf.grid)), args.backend,
                 conf.dtype, err_fwd, err_rt, 1e3 * t_rt, args.repeats, t_build)
    if max(err_fwd, err_rt) > tol:
        raise RuntimeError("FFT error %.2e exceeds %.0e" % (max(err_fwd, err_rt), tol))
    return result


# ----------------------------------------------------------------------------- simulate
SIMULATE_DEFAULTS = {"nc": 64, "box_size": 200.0, "lpt_order": 2, "a_start": 0.1, "a_end": 1.0,
                     "n_steps": 10, "dtype": "float32"}


def _allgather_fn(backend):
    if backend != "hvd":
        return None
    from mpi4py import MPI

    return MPI.COMM_WORLD.allgather


def cmd_simulate(args):
    """Run the simulation main job (see :mod:`flowpm_mtf.simulate`)."""
    from . import simulate

    conf = build_config(args, SIMULATE_DEFAULTS)
    log.info("config: %s", json.dumps(conf.to_dict()))
    return run_job(args, conf, "simulate", lambda *a, **k: simulate.run(conf, *a, **k),
                   conf.to_dict())


# ----------------------------------------------------------------------------- reconstruct
RECONSTRUCT_DEFAULTS = {"nc": 32, "box_size": 200.0, "lpt_order": 2, "a_start": 0.1,
                        "a_end": 1.0, "n_steps": 5, "halo_size": 8, "dtype": "float32"}


def cmd_reconstruct(args):
    """Run the reconstruction job (see :mod:`flowpm_mtf.reconstruct`)."""
    from . import reconstruct

    conf = build_config(args, RECONSTRUCT_DEFAULTS)
    rconf = checked_config(reconstruct.ReconConfig, iterations=args.iterations,
                           learning_rate=args.learning_rate, noise=args.noise,
                           forward=args.forward, log_every=args.log_every)
    log.info("config: %s; reconstruction: %s", json.dumps(conf.to_dict()),
             json.dumps(rconf.to_dict()))
    return run_job(args, conf, "reconstruct",
                   lambda *a, **k: reconstruct.run(conf, rconf, *a, **k),
                   {"sim": conf.to_dict(), "reconstruction": rconf.to_dict()},
                   nbody=args.forward == "nbody")


# ----------------------------------------------------------------------------- lensing
def parse_floats(text):
    """``"0.5,1.0"`` -> (0.5, 1.0)."""
    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError("expected comma-separated numbers, got %r" % text)


def cmd_lensing(args):
    """Run the lensing job (see :mod:`flowpm_mtf.lensing_job`)."""
    from . import lensing, lensing_job

    conf = build_config(args, lensing_job.LENSING_DEFAULTS)
    fields = dict(lensing_job.LENSING_CONFIG_DEFAULTS)
    for key in ("z_source", "field_deg", "field_npix", "n_planes"):
        if getattr(args, key) is not None:
            fields[key] = getattr(args, key)
    lconf = checked_config(lensing.LensingConfig, **fields)
    checked_config(lensing.geometry, conf, lconf)  # e.g. a source beyond the lightcone
    log.info("config: %s; lensing: %s", json.dumps(conf.to_dict()), json.dumps(lconf.to_dict()))
    return run_job(args, conf, "lensing", lambda *a, **k: lensing_job.run(conf, lconf, *a, **k),
                   {"sim": conf.to_dict(), "lensing": lconf.to_dict()})


# ----------------------------------------------------------------------------- main
def main(argv=None):
    from .logs import setup_logging

    ap = _Parser(prog="flowpm-mtf", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("simulate", formatter_class=argparse.ArgumentDefaultsHelpFormatter, help="LPT + FastPM N-body simulation (the main job)")
    add_config_arguments(p, "simulate")
    p.add_argument("--no-plot", action="store_true", help="skip overview.png")
    p.set_defaults(func=cmd_simulate)
    p = sub.add_parser("reconstruct", formatter_class=argparse.ArgumentDefaultsHelpFormatter, help="reconstruct the initial field by gradient descent")
    add_config_arguments(p, "reconstruct")
    p.add_argument("--iterations", type=int, default=200, help="Adam iterations")
    p.add_argument("--learning-rate", type=float, default=0.1, help="Adam step size")
    p.add_argument("--noise", type=float, default=0.1,
                   help="std. dev. of the Gaussian noise added to the observed 1+delta per cell")
    p.add_argument("--forward", choices=("lpt", "nbody"), default="lpt",
                   help="forward model: LPT to a_end, or LPT + FastPM N-body")
    p.add_argument("--log-every", type=int, default=10, help="log the loss every K iterations")
    p.add_argument("--no-plot", action="store_true", help="skip reconstruction.png")
    p.set_defaults(func=cmd_reconstruct)
    p = sub.add_parser("lensing", formatter_class=argparse.ArgumentDefaultsHelpFormatter, help="lightcone density planes and Born convergence maps")
    add_config_arguments(p, "lensing")
    p.add_argument("--z-source", type=parse_floats, help="source redshift(s), e.g. 1.0 or 0.5,1")
    p.add_argument("--field-deg", type=float, help="side of the field of view [deg]")
    p.add_argument("--field-npix", type=int, help="pixels per side of the convergence map")
    p.add_argument("--n-planes", type=int, help="number of lens planes (shells)")
    p.add_argument("--no-plot", action="store_true", help="skip kappa.png")
    p.set_defaults(func=cmd_lensing)
    p = sub.add_parser("fft-demo", formatter_class=argparse.ArgumentDefaultsHelpFormatter, help="distributed FFT round trip checked against numpy")
    add_config_arguments(p, "fft-demo")
    p.add_argument("--repeats", type=positive_int, default=5,
                   help="timed round trips (the median is reported)")
    p.set_defaults(func=cmd_fft_demo)
    verbose = "--verbose" in (sys.argv[1:] if argv is None else argv)
    if not verbose:  # before TensorFlow is imported: no C++ start-up lines
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    setup_logging()
    from .logs import rank0_only

    rank0_only(log)
    logging.getLogger("tensorflow").setLevel(logging.WARNING)  # Mesh TF's lowering counters
    args = None
    try:
        args = ap.parse_args(argv)
        if args.backend == "hvd" and world()[1] > 1:
            from hvd_mesh_impl import runtime

            runtime.install_abort_on_exception()  # uncaught errors (none expected) end the job
        args.func(args)
        return 0
    except Exception as e:  # noqa: BLE001 (every failure becomes one line and an exit code)
        return report_error(e, args, verbose)


def _as_user_error(exc, args):
    """The :class:`FlowpmError` a known failure stands for, or ``None`` (an internal error)."""
    from .errors import FlowpmError, ParticleEscapeError

    if isinstance(exc, FlowpmError):
        return exc
    if type(exc).__name__ == "InvalidArgumentError" and "particles escaped" in str(exc):
        conf = getattr(args, "conf", None)
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


def report_error(exc, args, verbose):
    """Print ``flowpm-mtf: error: <message>`` once and return the exit code.

    Errors of :mod:`flowpm_mtf.errors` are raised identically on every rank (the
    checks are collective): rank 0 prints them. Anything else is unexpected and
    may have hit one rank only: that rank prints it with its rank and ends the
    whole MPI job (``MPI_Abort``) so that no rank waits forever.
    """
    rank, size = world()
    err = _as_user_error(exc, args)
    if verbose:
        log_all = logging.getLogger("flowpm_mtf.cli.error")  # every rank
        log_all.error("traceback", exc_info=exc)
    if err is not None:
        if rank == 0 or not getattr(err, "same_on_every_rank", True):
            prefix = "" if rank == 0 else "[rank %d] " % rank
            sys.stderr.write("flowpm-mtf: error: %s%s\n" % (prefix, err))
            sys.stderr.flush()
        return err.exit_code
    first = (str(exc).strip().splitlines() or [""])[0]
    sys.stderr.write("flowpm-mtf: error: [rank %d] internal error %s: %s%s\n"
                     % (rank, type(exc).__name__, first,
                        "" if verbose else " (--verbose shows the traceback)"))
    sys.stderr.flush()
    if size > 1 and getattr(args, "backend", "hvd") == "hvd":
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)
    return 1


if __name__ == "__main__":
    sys.exit(main())
