"""The host memory allocator of a run, chosen before the process starts.

Why it matters
--------------
TensorFlow's default CPU allocator (with its oneDNN build, the ``mklcpu``
best-fit-with-coalescing allocator) never returns memory and splits its large
regions between tensors of different sizes, so the pages it touches grow well
beyond the tensors alive at any time: the peak RSS of ``simulate`` held
several times the live tensors that TensorFlow's own accounting
(``RunMetadata`` allocation records) saw in the initial conditions, the largest
phase. The distributed runs fragment more (their all-to-all outputs are
allocated by Horovod's background thread, interleaved with the graph's own
tensors).

Modes (environment variable ``FLOWPM_MTF_ALLOCATOR``)
----------------------------------------------------
``tcmalloc`` (default when ``libtcmalloc_minimal.so.4`` is installed; Debian
package ``libtcmalloc-minimal4``, installed by ``scripts/setup_env.sh``)
    gperftools' tcmalloc preloaded, TensorFlow's oneDNN allocator off
    (``TF_ENABLE_ONEDNN_OPTS=0``: TensorFlow then allocates with ``malloc``;
    none of our kernels is a oneDNN one). Same speed as TensorFlow's
    allocator, a lower peak RSS (docs/allocator.md).
    ``TCMALLOC_RELEASE_RATE=0`` (unless the environment sets it): tcmalloc keeps
    the pages of freed tensors for the next ones instead of returning them to
    the system a little at a time. A step allocates the same tensors as the
    last one, so the pages it would have returned are the ones it faults in
    again: with the default rate every large step faults in GBs of pages afresh
    (slow on a VM), with 0 none, and the peak does not grow over the steps
    (docs/allocator.md).
``lean``
    glibc's ``malloc`` with every allocation of 1 MB or more its own
    ``mmap``, returned to the system when freed, on transparent huge pages
    (``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=1048576:
    glibc.malloc.trim_threshold=1048576:glibc.malloc.hugetlb=1``; huge pages
    need glibc >= 2.35 and ``/sys/kernel/mm/transparent_hugepage/enabled`` =
    ``madvise`` or ``always``). RSS then follows the live tensors, for longer
    steps (the kernel zeroes every new page; up to ~2x at large meshes on one
    rank). For a run that does not fit otherwise.
``tf``
    TensorFlow's default, unchanged.

How
---
The dynamic loader reads ``LD_PRELOAD`` and glibc reads ``GLIBC_TUNABLES`` only
when a process starts, so the ``flowpm-mtf`` entry point (:func:`ensure`, from
:func:`flowpm_mtf.cli.entry`) re-executes itself once with the mode's
environment, before MPI, Horovod or TensorFlow are loaded (the process keeps
its PID, so ``mpirun``/``srun`` see the same rank). ``FLOWPM_MTF_ALLOCATOR_ACTIVE``
marks the re-executed process and names the mode in effect (written to
``summary.json``). Library use (``import flowpm_mtf``) and the test suite keep
whatever allocator the process started with. The GPU's device memory is
TensorFlow's own allocator in every mode (untested here: no GPU for TF 2.12).

numpy on its baseline code paths under tcmalloc
-----------------------------------------------
numpy (1.24) evaluates ``sin``, ``cos``, ``exp``, ``log``, ``power``, ``arctan2``
... of float64 (and several of float32) arrays with its AVX-512 loops (SVML)
unless it judges the input and output arrays to overlap, and then falls back
to the C library. Its overlap test also counts an output that starts exactly
where the input ends, which tcmalloc does all the time (blocks of one size
class are packed back to back; glibc puts a header between blocks). The two
code paths differ in the last bit of ~25-65 % of the values, so which one ran
depended on the heap: the k-space gradient kernel, the linear power
spectrum and the step factors, all evaluated in numpy when the graph is
built, differed in the last bit between two launches of the same job, and so
did every result after (a resumed run was not bit-identical to the
uninterrupted one). In the ``tcmalloc`` mode, ``NPY_DISABLE_CPU_FEATURES`` is
therefore set to every dispatched (non-baseline) CPU feature that this
machine's numpy uses: numpy then runs one code path whatever the heap, and
results are reproducible launch to launch. A user's own
``NPY_DISABLE_CPU_FEATURES`` is kept as given. The other modes allocate with
glibc and keep numpy's fast paths; a job's results differ between modes in
the last bits (resume a run in the mode it started with for bit-identical
results).
"""
import ctypes.util
import os
import sys

from .errors import ConfigError

ENV = "FLOWPM_MTF_ALLOCATOR"
ACTIVE_ENV = "FLOWPM_MTF_ALLOCATOR_ACTIVE"
MODES = ("tcmalloc", "lean", "tf")
TCMALLOC = "tcmalloc_minimal"
LEAN_TUNABLES = ("glibc.malloc.mmap_threshold=1048576:glibc.malloc.trim_threshold=1048576:"
                 "glibc.malloc.hugetlb=1")
NUMPY_FEATURES_ENV = "NPY_DISABLE_CPU_FEATURES"
RELEASE_RATE_ENV = "TCMALLOC_RELEASE_RATE"

__all__ = ["ENV", "MODES", "AllocatorError", "environment", "ensure", "active"]


class AllocatorError(ConfigError):
    """``FLOWPM_MTF_ALLOCATOR`` names an unknown mode or a library that is not installed.

    A :class:`~flowpm_mtf.errors.ConfigError` (exit code 2). An unknown mode
    is the same on every rank (one environment): the command line reports it
    once, from rank 0, like every other configuration error. A library missing
    on a host is that host's: every rank that lacks it reports it with its rank
    (``same_on_every_rank=False``).

    Parameters
    ----------
    message : str
    same_on_every_rank : bool
    """

    def __init__(self, message, same_on_every_rank=True):
        super().__init__(message)
        self.same_on_every_rank = same_on_every_rank


def _tcmalloc_library():
    """The soname of gperftools' tcmalloc (minimal), or None."""
    return ctypes.util.find_library(TCMALLOC)


def numpy_dispatched_features():
    """The non-baseline CPU features numpy dispatches to on this machine (space-separated).

    Naming a feature numpy does not dispatch to, or this machine lacks, in
    ``NPY_DISABLE_CPU_FEATURES`` makes every numpy import warn: the list is
    numpy's own (imports numpy; no MPI, Horovod or TensorFlow).
    """
    try:   # numpy >= 2 (numpy.core is a deprecated alias there)
        from numpy._core import _multiarray_umath as umath
    except ImportError:   # numpy 1.x
        from numpy.core import _multiarray_umath as umath

    return " ".join(f for f in umath.__cpu_dispatch__ if umath.__cpu_features__.get(f))


def environment(mode=None, env=None):
    """The environment a process of allocator ``mode`` must start with.

    Parameters
    ----------
    mode : str, optional
        One of :data:`MODES`; default: ``env[FLOWPM_MTF_ALLOCATOR]``, else
        ``tcmalloc`` if installed, else ``tf``.
    env : mapping, optional
        The current environment (default ``os.environ``).

    Returns
    -------
    (str, dict)
        The mode and the new environment (a copy of ``env`` with the mode's
        variables and ``FLOWPM_MTF_ALLOCATOR_ACTIVE`` set; ``tcmalloc`` also
        sets ``NPY_DISABLE_CPU_FEATURES`` and ``TCMALLOC_RELEASE_RATE`` where the
        environment does not, see the module docstring).

    Raises
    ------
    AllocatorError
        Unknown mode, or ``tcmalloc`` asked for and not installed.
    """
    env = dict(os.environ if env is None else env)
    explicit = mode is not None or bool(env.get(ENV))
    mode = (mode or env.get(ENV) or "tcmalloc").strip().lower()
    if mode not in MODES:
        raise AllocatorError("%s=%r: choose one of %s" % (ENV, mode, ", ".join(MODES)))
    if mode == "tcmalloc":
        lib = _tcmalloc_library()
        if lib is None:
            if explicit:
                raise AllocatorError(
                    "%s=tcmalloc: lib%s.so is not installed (Debian: apt-get install "
                    "libtcmalloc-minimal4; or %s=lean / tf)" % (ENV, TCMALLOC, ENV),
                    same_on_every_rank=False)
            mode = "tf"
        else:
            preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p]
            if lib not in preload:
                env["LD_PRELOAD"] = ":".join([lib] + preload)
            if NUMPY_FEATURES_ENV not in env:   # see "numpy on its baseline code paths"
                env[NUMPY_FEATURES_ENV] = numpy_dispatched_features()
            env.setdefault(RELEASE_RATE_ENV, "0")   # keep freed pages (module docstring)
    if mode == "lean":
        tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]
        env["GLIBC_TUNABLES"] = ":".join(tunables + [LEAN_TUNABLES])
    if mode != "tf":
        env["TF_ENABLE_ONEDNN_OPTS"] = "0"   # TensorFlow allocates with malloc
    env[ACTIVE_ENV] = mode
    return mode, env


def ensure(argv=None):
    """Re-execute this process once with the allocator's environment (the entry point).

    Does nothing if the process already runs under it (``FLOWPM_MTF_ALLOCATOR_ACTIVE``
    set) or the mode is ``tf``. Must run before MPI, Horovod or TensorFlow is
    loaded.

    Parameters
    ----------
    argv : list of str, optional
        The command line to re-execute (default ``sys.orig_argv``: the same
        interpreter options, script or ``-m`` module and arguments).

    Raises
    ------
    AllocatorError
        See :func:`environment`.
    """
    if os.environ.get(ACTIVE_ENV):
        return
    mode, env = environment()
    if mode == "tf":
        os.environ[ACTIVE_ENV] = mode
        return
    argv = list(sys.orig_argv if argv is None else argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, env)


def active():
    """The allocator mode this process started with (``tf`` unless set by :func:`ensure`)."""
    return os.environ.get(ACTIVE_ENV, "tf")
