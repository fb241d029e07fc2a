"""The one job runner: build the graph, lower, run, time, measure memory, write.

:func:`run` drives any :class:`flowpm_mtf.jobs.base.Job`; the benchmark
scripts use the same building blocks (:func:`lower`, :func:`session`,
:func:`lowered_group`, :func:`export`, :func:`peak_memory_mb`), so
``mtf.Lowering(``, ``tf.Session(`` and ``copy_masters_to_slices`` appear once
in the code outside the tests: here.

Hook points (for run safety, checkpoints, signals)
--------------------------------------------------
:class:`Hooks` holds lists of callables the runner calls:

``preflight(ctx)``
    Before the job's own preflight and before any graph is built (e.g. a
    writable run directory, a memory estimate). Raise to stop the run.
``after_step(ctx, index, info)``
    After every step of the time loop (``index`` = stage reached, ``info`` a
    dict with at least ``a`` [scale factor] or ``iteration``, and ``total``,
    the number of steps, where known), on every rank.
``after_run(ctx, summary)``
    After the outputs are written (e.g. publish, manifest).

Distributed outputs, checkpoints, SIGTERM
-----------------------------------------
No rank gathers a full-size array: jobs fetch this process's slices
(:func:`local`) and reduced, replicated values (:func:`replicated`), and write
their distributed files in :meth:`Job.write_all`, which the runner calls on
**every** rank (collective; :mod:`flowpm_mtf.runs.h5dist`) before the rank-0
:meth:`Job.write`. SIGTERM is recorded for the whole run
(:class:`flowpm_mtf.runs.checkpoint.StopRequest`, ``ctx.stop``) and acted on at the
first step boundary all ranks agree on:

* a job that checkpoints (``Job.checkpoints``) writes a checkpoint there and
  raises :class:`Stopped` with its path; the runner then returns a summary with
  ``"stopped": True`` (exit 0; the outputs so far are in the checkpoint, the
  run continues with ``--resume``);
* a job without checkpoints (``fft-demo``), or any job run without a run
  directory, is stopped by :meth:`RunContext.after_step` (every rank, the same
  step): nothing is written, no resume is offered, and the runner raises a
  one-line :class:`flowpm_mtf.errors.StoppedError` saying so (exit 8).

``ctx.mark(label)``
records the RSS at phase boundaries (``memory_phases_mb_per_rank`` of the
summary, used by ``scripts/bench_scaling.py``).

The run directory is an object with ``path`` and ``file(name)`` (see
:class:`PlainRunDir`; a run directory with staging and a manifest replaces it
without changes here). Decisions across ranks outside the TF graph go through
``backend.comm`` (mpi4py lower-case API).
"""
import contextlib
import logging
import os
import resource
import statistics
import time

import numpy as np

from .. import allocator
from ..runs import checkpoint, h5dist, io, writers
from ..runs.collective import collective
from ..mesh import domain
from ..physics import sizing
from ..errors import CapacityError, ResumeError, StoppedError
from ..logs import rank0_only

__all__ = ["Hooks", "PlainRunDir", "Outputs", "RunContext", "Stopped", "peak_memory_mb",
           "current_memory_mb", "median_time", "lower", "lowered_group", "local", "replicated",
           "VariableSlices", "session", "run"]

log = rank0_only(logging.getLogger(__name__))


_PEAK_BEFORE_RESET = [0.0]
"""The largest ``VmHWM`` [MB] seen at a reset of the kernel's peak counter."""


def peak_memory_mb():
    """Peak resident memory of this process [MB] since it started.

    ``ru_maxrss`` alone is not enough: resetting the kernel's peak counter
    (:meth:`RunContext.mark`, ``clear_refs 5``) also lowers what ``ru_maxrss``
    reports afterwards (Linux takes the larger of the reset counter and the
    peaks recorded at thread exits), so the peak seen at each reset is kept.
    """
    phase = _phase_peak_mb() or 0.0
    return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, phase,
               _PEAK_BEFORE_RESET[0])


def current_memory_mb():
    """Current resident memory of this process [MB] (``/proc/self/statm``; the peak elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2.0**20
    except (OSError, ValueError, IndexError):
        return peak_memory_mb()


def _phase_peak_mb():
    """Peak RSS [MB] since the last reset (``VmHWM``), or ``None``."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except (OSError, ValueError):
        pass
    return None


def _reset_phase_peak():
    """Reset the kernel's peak-RSS counter of this process (Linux >= 4.0: clear_refs 5)."""
    _PEAK_BEFORE_RESET[0] = peak_memory_mb()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


class Stopped(Exception):
    """Raised on every rank by a time loop stopped by a request (SIGTERM) at a step boundary.

    Parameters
    ----------
    step : int
        The last step completed.
    total : int, optional
        The number of steps of the loop.
    checkpoint : str, optional
        The checkpoint written there (None: none, the run cannot continue).
    unit : str
        What a step is called in messages (``"step"``, ``"iteration"``).
    """

    def __init__(self, step, total=None, checkpoint=None, unit="step"):
        self.step = int(step)
        self.total = None if total is None else int(total)
        self.checkpoint = checkpoint
        self.unit = unit
        super().__init__("stopped after %s" % self.where)

    @property
    def where(self):
        """``"step 5/14"`` (or ``"step 5"``)."""
        return "%s %d%s" % (self.unit, self.step, "" if self.total is None else
                            "/%d" % self.total)


def median_time(fn, repeats, warmup=0):
    """Median wall time [s] of ``fn()`` over ``repeats`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class Hooks:
    """Callables the runner calls at its hook points (see the module docstring).

    Parameters
    ----------
    preflight, after_step, after_run : list of callable, optional
    """

    def __init__(self, preflight=None, after_step=None, after_run=None):
        self.preflight = list(preflight or [])
        self.after_step = list(after_step or [])
        self.after_run = list(after_run or [])


class PlainRunDir:
    """A run directory that is a plain directory (created on rank 0 when first used).

    Parameters
    ----------
    path : str
    """

    def __init__(self, path):
        self.path = os.fspath(path)

    def file(self, name):
        """Where the output ``name`` is written (rank 0)."""
        os.makedirs(self.path, exist_ok=True)
        return os.path.join(self.path, name)


class Outputs:
    """The files a job writes into its run directory (their names, in order).

    Parameters
    ----------
    run_dir : object with ``file(name)``, or None (no files are written)
    """

    def __init__(self, run_dir):
        self.run_dir = run_dir
        self.names = []

    def path(self, name):
        """Path of the output ``name``; records it."""
        self.names.append(name)
        return self.run_dir.file(name)


class RunContext:
    """Everything a job sees while it runs.

    Attributes
    ----------
    job : Job
    configs : dict
        Section key -> config instance (``configs["config"]`` is the SimConfig).
    conf : SimConfig
    backend : flowpm_mtf.backend.Backend
    comm : object
        ``backend.comm``.
    rank : int
    run_dir : object or None
    outputs : Outputs or None
        None on ranks other than 0 and without a run directory.
    plot : bool
    timings : dict
        Phase -> seconds, filled by the runner and the job.
    hooks : Hooks
    t0 : float
        ``time.perf_counter()`` at the start of the run.
    checkpoint_every : int or None
        Checkpoint every K steps (``--checkpoint-every``).
    resume : bool
        Continue from the newest valid checkpoint of the run directory.
    stop : checkpoint.StopRequest or None
        SIGTERM recorded on this rank (``stop.agreed()`` is collective).
    memory : dict
        Phase label -> RSS marks [MB] (:meth:`mark`).
    force : bool
        Skip the memory check (``--force``); set by the command line's preflight hook.
    """

    def __init__(self, job, configs, backend, run_dir, plot, hooks, checkpoint_every=None,
                 resume=False, stop=None):
        self.checkpoint_every = checkpoint_every
        self.resume = bool(resume)
        self.stop = stop
        self.memory = {}
        self.job = job
        self.configs = configs
        self.conf = configs["config"]
        self.backend = backend
        self.comm = backend.comm
        self.rank = int(backend.comm.rank)
        self.run_dir = run_dir
        self.outputs = Outputs(run_dir) if (run_dir is not None and self.rank == 0) else None
        self.plot = plot
        self.timings = {}
        self.hooks = hooks
        self.t0 = time.perf_counter()
        self.force = False
        self.writes = []

    def record_write(self, name, stats):
        """Record a collective write of ``stats["bytes"]`` (all ranks) in ``stats["seconds"]``.

        The ``output_write`` of the summary (:func:`output_write`).
        """
        self.writes.append({"file": name, "bytes": int(stats.get("bytes", 0)),
                            "seconds": float(stats.get("seconds", 0.0)),
                            "mode": str(stats.get("mode", "unknown"))})

    def elapsed(self):
        """Seconds since the start of the run."""
        return time.perf_counter() - self.t0

    @contextlib.contextmanager
    def timed(self, name):
        """Time the block into ``timings[name]`` [s]."""
        t = time.perf_counter()
        yield
        self.timings[name] = time.perf_counter() - t

    def mark(self, label):
        """Record the RSS [MB] at a phase boundary: current, the phase's peak, the run's peak.

        ``phase_peak`` is the peak since the previous mark (the kernel's counter
        is reset at every mark; the cumulative peak where that is impossible).
        """
        phase = _phase_peak_mb()
        self.memory[label] = {"rss": current_memory_mb(), "peak": peak_memory_mb(),
                              "phase_peak": phase if phase is not None else peak_memory_mb()}
        _reset_phase_peak()

    def file(self, name):
        """Path of output ``name`` in the run directory, on every rank (recorded on rank 0).

        For collective writers (:meth:`Job.write_all`); ``None`` without a run
        directory.
        """
        if self.run_dir is None:
            return None
        if self.outputs is not None:
            return self.outputs.path(name)
        return self.run_dir.file(name)

    def after_step(self, index, **info):
        """Call the after-step hooks (every rank, after step ``index``); stop if requested.

        For a job that does not checkpoint, the ranks then agree on a stop
        request (collective) and all raise :class:`Stopped` at the same step
        (not after the last one, ``index == info["total"]`` where the loop
        gives its number of steps). A job that checkpoints
        stops in its time loop, after the checkpoint
        (:func:`flowpm_mtf.jobs.nbody_run.run_stages`).

        Raises
        ------
        Stopped
        """
        for hook in self.hooks.after_step:
            hook(self, index, info)
        total = info.get("total")
        if (self.stop is not None and not getattr(self.job, "checkpoints", False)
                and (total is None or index < total) and self.stop.agreed()):
            raise Stopped(index, total, unit="iteration" if "iteration" in info else "step")


# ----------------------------------------------------------------------------- building blocks
def lower(graph, mesh, mesh_impl):
    """Lower the Mesh TF ``graph`` of ``mesh`` on ``mesh_impl`` (one ``mtf.Lowering``)."""
    import mesh_tensorflow as mtf

    return mtf.Lowering(graph, {mesh: mesh_impl})


def lowered_group(lowering, ops):
    """One TF op running the lowered Mesh TF operations ``ops``.

    Assignments run after every read of the same variables in the run
    (:func:`hvd_mesh_impl.ordered_update_op`, no Horovod import): Mesh TF's
    ``PlacementMeshImpl`` does not order them itself.
    """
    from hvd_mesh_impl.training import ordered_update_op

    return ordered_update_op(lowering, ops)


def local(lowering, tensors):
    """This process's slices of a dict of mtf tensors, without communication.

    Returns
    -------
    dict
        name -> list of ``(pnum, tf.Tensor, begin)`` (:func:`flowpm_mtf.runs.h5dist.local_slices`).
    """
    return {name: h5dist.local_slices(lowering, t) for name, t in tensors.items()}


def replicated(lowering, tensors):
    """TF tensors of a dict of fully replicated (reduced) mtf tensors: this process's copy."""
    return {name: h5dist.replicated_value(lowering, t) for name, t in tensors.items()}


class VariableSlices:
    """This process's slices of some Mesh TF variables, for checkpoints (no gather).

    Parameters
    ----------
    lowering : mtf.Lowering
    variables : dict
        Name -> Mesh TF variable (an ``mtf.get_variable`` output), e.g. lens
        planes or :attr:`flowpm_mtf.gradients.reconstruct.ReconstructionGraph.checkpoint_variables`.

    Attributes
    ----------
    names : list of str
        The variables' names, sorted.
    slices : dict
        Name -> list of ``(pnum, tf.Tensor, begin)`` (:func:`local`).
    """

    def __init__(self, lowering, variables):
        import mesh_tensorflow as mtf
        import tensorflow.compat.v1 as tf

        self.names = sorted(variables)
        self.slices = {n: h5dist.local_slices(lowering, variables[n]) for n in self.names}
        self._placeholders, assigns = {}, []
        for n in self.names:
            laid_out = lowering.variables[variables[n].operation]
            phs = [tf.placeholder(t.dtype, t.shape) for t in laid_out.laid_out_tensor.tensor_list]
            self._placeholders[n] = phs
            assigns.append(laid_out.assign_to_slices(mtf.assign_slice, phs))
        self._restore = tf.group(assigns)

    def requests(self):
        """Name -> ``[(pnum, shape, begin)]`` of the slices (for :func:`flowpm_mtf.runs.checkpoint.load`)."""
        return {n: [(p, tuple(t.shape.as_list()), b) for p, t, b in sl]
                for n, sl in self.slices.items()}

    def fetch(self, sess):
        """``pnum -> {name: (ndarray, begin)}``: the current slices (for :func:`flowpm_mtf.runs.checkpoint.save`)."""
        vals = sess.run({n: [t for _, t, _ in sl] for n, sl in self.slices.items()})
        out = {}
        for n, sl in self.slices.items():
            for (p, _, begin), v in zip(sl, vals[n]):
                out.setdefault(p, {})[n] = (v, begin)
        return out

    def restore(self, sess, values):
        """Assign ``values`` (``pnum -> {name: ndarray}``, from a checkpoint) to the slices."""
        feed = {}
        for n, sl in self.slices.items():
            for ph, (p, _, _) in zip(self._placeholders[n], sl):
                feed[ph] = np.asarray(values[p][n], ph.dtype.as_numpy_dtype).reshape(
                    ph.shape.as_list())
        sess.run(self._restore, feed)


def initialize_variables(sess, variables=None):
    """Run the variables' initializers one after the other, in the order of the graph.

    One ``session.run`` per variable, instead of one for all (as
    ``tf.global_variables_initializer()``), whose initial values TensorFlow computes
    concurrently, allocating them in an order that differs from run to run. Under
    tcmalloc (:mod:`flowpm_mtf.allocator`, release rate 0) that order decides which
    spans the ICs, the first force and the steps reuse, so the same job's first step could
    map several GB of new memory and its peak vary by GB from run to run. Initialised one by
    one, the state's zeros are laid out the same way every time: the first step maps no new
    memory and the peak is the lower of those patterns, in every run.

    Parameters
    ----------
    sess : tf.Session
    variables : list of tf.Variable, optional
        Default ``tf.global_variables()``.
    """
    import tensorflow.compat.v1 as tf

    for v in tf.global_variables() if variables is None else variables:
        sess.run(v.initializer)


@contextlib.contextmanager
def session(session_config=None, lowering=None, target=""):
    """A TF session with the variables initialised (and the masters copied to the slices).

    The variables are initialised one by one (:func:`initialize_variables`).

    Parameters
    ----------
    session_config : tf.ConfigProto, optional
    lowering : mtf.Lowering, optional
        If given, its ``copy_masters_to_slices`` runs after the initialiser.
    target : str
        Session target ("" = in process; a gRPC address for a TF cluster).

    Yields
    ------
    tf.Session
    """
    import tensorflow.compat.v1 as tf

    variables = tf.global_variables()
    copy = lowering.copy_masters_to_slices() if lowering is not None else None
    with tf.Session(target, config=session_config) as sess:
        initialize_variables(sess, variables)
        if copy is not None:
            sess.run(copy)
        yield sess


def output_write(writes, comm):
    """The ``output_write`` of summary.json: bytes, seconds, GB/s of the distributed files.

    Parameters
    ----------
    writes : list of dict
        :attr:`RunContext.writes` (the same files on every rank).
    comm : object
        mpi4py-like communicator (collective: the slowest rank's seconds count).

    Returns
    -------
    dict
        ``bytes`` (all part files of all ranks), ``seconds`` [s] (the slowest
        rank's wall time of the writes, fsync and hashing included),
        ``gb_per_s`` (1e9 bytes per second), ``mode`` (how the data were
        written: ``"direct"``, ``"buffered"``, ``"hdf5"``, see
        :func:`flowpm_mtf.runs.h5dist.write_distributed`; ``+``-joined if the files
        differ) and ``files`` (per file the same).
    """
    slowest = np.max(np.asarray(comm.allgather([w["seconds"] for w in writes]), np.float64),
                     axis=0)
    files = [{"file": w["file"], "bytes": w["bytes"], "seconds": float(s),
              "gb_per_s": w["bytes"] / 1e9 / max(float(s), 1e-9),
              "mode": w.get("mode", "unknown")}
             for w, s in zip(writes, slowest)]
    nbytes, seconds = sum(f["bytes"] for f in files), float(slowest.sum())
    modes = sorted({m for f in files for m in f["mode"].split("+")})
    return {"bytes": nbytes, "seconds": seconds, "gb_per_s": nbytes / 1e9 / max(seconds, 1e-9),
            "mode": "+".join(modes) or "none", "files": files}


def _not_resumable(job, stopped):
    """The one-line error of a job stopped by a signal without a checkpoint."""
    why = ("%s cannot resume yet (it writes no checkpoint)" % job.name
           if not getattr(job, "checkpoints", False) else "no run directory to checkpoint into")
    return StoppedError("stopped by a signal after %s; %s: nothing was written, rerun the same "
                        "command to start over" % (stopped.where, why))


# ----------------------------------------------------------------------------- the runner
MAX_CAPACITY_RETRIES = 3
"""Rebuilds with larger particle capacities after a :class:`CapacityError`."""


def run(job, configs, backend, run_dir=None, plot=True, hooks=None, checkpoint_every=None,
        resume=False, until_exit=False):
    """Run one job: preflight, build, lower, execute, summarise, write.

    Parameters
    ----------
    job : Job
    configs : dict
        Section key -> config instance (see :attr:`Job.sections`).
    backend : flowpm_mtf.backend.Backend
        MeshImpl, session config and comm.
    run_dir : object, optional
        Where the outputs go (``str`` or an object with ``path`` and
        ``file(name)``); None writes nothing (the summary is still returned).
    plot : bool
        Write the job's figure.
    hooks : Hooks, optional
    checkpoint_every : int, optional
        Checkpoint every K steps (jobs with a time loop).
    resume : bool
        Continue from the newest valid checkpoint in ``run_dir``.
    until_exit : bool
        The process exits after the run (the ``flowpm-mtf`` command): a run
        that returns leaves SIGTERM ignored until then, so a signal after the
        last step never kills a rank (:class:`flowpm_mtf.runs.checkpoint.StopRequest`);
        default: the previous handler is restored.

    Returns
    -------
    dict
        The summary (also written to ``summary.json``): configs, timings [s],
        peak memory per rank [MB], versions, and the job's own fields;
        ``{"stopped": True, "step": k, "checkpoint": path}`` if SIGTERM stopped
        a job that checkpoints (the outputs so far are in the checkpoint).

    Raises
    ------
    FlowpmError
        SIGTERM stopped a job that does not checkpoint (nothing written).
    ResumeError
        ``resume`` for a job that does not checkpoint.
    """
    # SIGTERM is recorded from here on (graph build, ICs, steps) and acted on by the
    # time loop at the first step boundary all ranks agree on.
    with checkpoint.StopRequest(backend.comm, until_exit=until_exit) as stop:
        return _run(job, configs, backend, run_dir, plot, hooks, checkpoint_every, resume, stop)


def _run(job, configs, backend, run_dir, plot, hooks, checkpoint_every, resume, stop):
    import mesh_tensorflow as mtf
    import tensorflow.compat.v1 as tf

    if isinstance(run_dir, (str, os.PathLike)):
        run_dir = PlainRunDir(run_dir)
    hooks = hooks or Hooks()
    if resume and not getattr(job, "checkpoints", False):
        raise ResumeError("%s cannot resume: it writes no checkpoints" % job.name)
    ctx = RunContext(job, configs, backend, run_dir, plot, hooks, checkpoint_every, resume, stop)
    ctx.mark("start")
    for hook in hooks.preflight:
        hook(ctx)
    job.preflight(ctx)
    timings = ctx.timings
    tf.disable_eager_execution()
    for attempt in range(MAX_CAPACITY_RETRIES + 1):
        try:
            with tf.Graph().as_default():
                graph = mtf.Graph()
                mesh = mtf.Mesh(graph, "mesh")
                g = job.build(ctx, mesh)
                lowering = lower(graph, mesh, backend.mesh_impl)
                plan = job.lower(ctx, g, lowering)
                timings["graph_build_s"] = ctx.elapsed()
                text = job.describe(ctx, g)
                log.info("graph built in %.1f s%s", timings["graph_build_s"],
                         (" (%s)" % text) if text else "")
                with session(backend.session_config, lowering) as sess:
                    ctx.mark("graph")
                    try:
                        results = job.execute(ctx, sess, g, plan)
                    except Stopped as stopped:
                        if stopped.checkpoint is None:
                            raise _not_resumable(job, stopped) from None
                        return {"stopped": True, "step": stopped.step,
                                "checkpoint": stopped.checkpoint, "timings": timings}
                    stop.finished = True   # a signal from now on lets the run finish
                    ctx.mark("steps")
            break
        except tf.errors.InvalidArgumentError as exc:
            # A particle buffer would overflow (flowpm_mtf.mesh.domain; every rank fails at
            # the same check, before any variable is updated): rebuild with the
            # capacities the error names (a resumed run re-slices its checkpoint into
            # the larger buffers). A too-long time step: a one-line error.
            err = (domain.error_from_tf(exc, ctx.conf)
                   or sizing.lagrangian_escape_error(exc, ctx.conf))
            if err is None:
                raise
            if not isinstance(err, CapacityError) or attempt == MAX_CAPACITY_RETRIES:
                raise err from None
            log.warning("%s: rebuilding with capacity %d, send_capacity %d", err,
                        err.capacity, err.send_capacity)
            configs = dict(configs, config=ctx.conf.replace(
                capacity=err.capacity, send_capacity=err.send_capacity))
            ctx.configs, ctx.conf = configs, configs["config"]
    extra = job.finish(ctx, results)
    if run_dir is not None:
        job.write_all(ctx, results)   # collective: every rank writes its slices
    ctx.mark("output")
    mem = peak_memory_mb()
    mem_all = ctx.comm.allgather(mem)
    timings["total_s"] = ctx.elapsed()
    summary = {key: cfg.to_dict() for key, cfg in configs.items()}
    summary.update(timings=timings, peak_memory_mb_per_rank=mem_all,
                   versions=writers.versions(),
                   allocator=allocator.active(),
                   memory_phases_mb_per_rank=ctx.comm.allgather(ctx.memory))
    # where each rank ran: host, ranks on its node, thread pools (docs/output.md)
    summary["ranks"] = ctx.comm.allgather(backend.placement())
    summary["hosts"] = sorted({r["host"] for r in summary["ranks"]})
    if resume:
        summary["resumed"] = True
    if ctx.writes:
        summary["output_write"] = output_write(ctx.writes, ctx.comm)
    summary.update(extra)
    if "n_particles" in summary:
        summary["bytes_per_particle_peak"] = (max(mem_all) * 2**20 * len(mem_all)
                                              / summary["n_particles"])

    def write_rank0(_):
        job.write(ctx, ctx.outputs, results, summary)
        io.write_summary(ctx.outputs.path("summary.json"), summary, rank=0)
        if plot:
            job.plot(ctx, ctx.outputs, results, summary)
        log.info("wrote %s (%stotal %.1f s, peak memory %.0f MB on rank 0)", run_dir.path,
                 job.report(ctx, summary), timings["total_s"], mem)

    if run_dir is not None:
        # rank 0 writes; an error there (e.g. a full disk: exit 5) reaches every rank, no hang
        collective(ctx.comm, dict, write_rank0, "writing the outputs in %s" % run_dir.path)
    job.check(ctx, summary)
    for hook in hooks.after_run:
        hook(ctx, summary)
    return summary
