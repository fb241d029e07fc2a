"""The MPI environment of a rank, set by the job's entry point before MPI loads.

Every rank of an ``HvdSimdMeshImpl`` job runs more busy threads than the core it
is given: TensorFlow's compute threads and Horovod's background thread, which
issues every collective and runs a coordination cycle every millisecond. Open
MPI's default waiting policy is to busy-poll without yielding unless it knows
the node is oversubscribed; a rank's waiting thread then holds the core its own
compute thread needs, and the scheduler hands the core back only at the end of
a time slice (milliseconds). ``mpi_yield_when_idle`` makes Open MPI's wait loops
call ``sched_yield``. On a 2-core machine (the FFT round trip of a 128^3 float32
field, the slowest rank's time per call):

* 2 ranks (one per core, Open MPI does not yield by default): the median call is
  about a fifth faster with it;
* 4 ranks (two per core): about ten times slower with ``mpi_yield_when_idle=0``
  forced than with it on, which is what Open MPI chooses itself for an
  oversubscribed node.

:func:`apply` sets :data:`DEFAULTS` with ``os.environ.setdefault`` (a user's own
setting is kept); Open MPI reads ``OMPI_MCA_*`` variables in ``MPI_Init``, so the
entry point (``flowpm_mtf.cli.entry``) calls it before ``mpi4py`` or Horovod is
imported. Other MPI libraries ignore the variable. This module imports nothing
but ``os`` (it lives in ``flowpm_mtf``, whose package import is light: the
``hvd_mesh_impl`` package imports TensorFlow, whose start-up lines the entry
point hides only after parsing the command line).
"""
import os

DEFAULTS = {"OMPI_MCA_mpi_yield_when_idle": "1"}


def apply(environ=None):
    """Set :data:`DEFAULTS` in ``environ`` (default ``os.environ``) where unset.

    Parameters
    ----------
    environ : MutableMapping, optional

    Returns
    -------
    dict
        The variables that were set.
    """
    environ = os.environ if environ is None else environ
    done = {}
    for key, value in DEFAULTS.items():
        if key not in environ:
            environ[key] = value
            done[key] = value
    return done


def exit_process(code):
    """End this rank's process with exit status ``code``, skipping the interpreter's teardown.

    A normal exit of a rank that imported TensorFlow spends about a second of CPU after
    the program's last line: Python frees its millions of objects module by module and
    the C++ libraries run their destructors, none of which leaves anything behind. This
    does what a normal exit does that matters, in its order, then ``os._exit``:

    1. waits for the threads that are not daemons (as the interpreter does);
    2. runs the ``atexit`` handlers: the exit barrier and ``hvd.shutdown``
       (:mod:`hvd_mesh_impl.runtime`), ``logging.shutdown`` (flushes every handler), the
       handlers of h5py and of user code;
    3. finalizes MPI if ``mpi4py`` initialized it (its own finalization is a C-level
       exit hook, which ``os._exit`` skips: the launcher would report a rank that exited
       without ``MPI_Finalize``);
    4. flushes ``sys.stdout`` and ``sys.stderr``.

    Files still open and only reachable from the garbage collector are not closed:
    every output of a job is written, closed and published before its runner returns
    (:mod:`flowpm_mtf.runs.rundir`). Used by the ``flowpm-mtf`` command
    (:func:`flowpm_mtf.cli.entry`); never returns.

    Parameters
    ----------
    code : int
        The exit status.
    """
    import atexit
    import sys
    import threading

    try:
        main = threading.main_thread()
        for t in threading.enumerate():
            if t is not main and not t.daemon:
                t.join()
        atexit._run_exitfuncs()   # noqa: SLF001 (CPython's exit sequence, public in effect)
        mpi = sys.modules.get("mpi4py.MPI")
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            mpi.Finalize()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):
                pass
        os._exit(code)
