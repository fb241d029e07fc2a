"""Checks that fail a run before the compute, and graph-size safety.

Everything here runs before the TF graph is built (or, for the graph helpers,
while it is built) and costs milliseconds. This module is the one name the callers
use: it holds the checks below and re-exports the memory model
(:mod:`flowpm_mtf.runs.preflight_memory`) and the jobs' own memory terms
(:mod:`flowpm_mtf.runs.preflight_jobs`).

* :func:`check_native_ops`: a CPU job whose native ops are not built or stale
  stops (one line, every rank) instead of running the TensorFlow path beyond the
  memory estimate;
* :func:`check_sizes`: tensors of 2^63 elements or more (no TensorFlow shape
  counts them): a :class:`ConfigError` naming the option, before anything else
  computes with them;
* :func:`check_memory`: the estimated peak memory per rank (the measured model
  of ``docs/scaling.md``, plus each job's own terms: :func:`fft_demo_memory`,
  :func:`lensing_memory`, :func:`reconstruct_memory`, run from the jobs'
  preflight by :func:`check_job_memory`; the imaging job's own model,
  :mod:`mri_mtf.memory`, through :func:`check_estimate`) against the memory the node
  has for its ranks. Every size is an exact Python int (the model's constants as exact
  fractions): nothing wraps at 2^31 or 2^63 or rounds at 2^53. The advice is a
  configuration that fits (checked: a rank count and grid, or a value of the
  option whose part does not shrink with more ranks), or says that none does;
* :func:`check_numerics`: inputs the floating-point type cannot represent
  (initial displacements or per-step moves below the resolution of the
  positions), which would otherwise give a silently wrong result; the advised
  ``--a-start``/``--steps`` passes the whole check, or the message says that no
  value of that option does and what does;
* :func:`large_constants`: no full-size array is ever embedded in the graph (the 2 GB
  GraphDef/TensorProto limit; the variables' zeros come from
  :func:`hvd_mesh_impl.slice_init.unfolded_zeros_initializer`).

The writable-OUT check is part of :meth:`flowpm_mtf.runs.rundir.RunDir.open`.
"""
import logging
import math

import numpy as np

from ..errors import ConfigError, MemoryBudgetError
from ..physics.linear_power import trapezoid
from ..logs import rank0_only
from .preflight_memory import (  # noqa: F401  (re-exported: the memory model and check)
    BYTES_PER_PADDED_CELL, BYTES_PER_SLOT, MASTER_COPIES, MAX_RANKS, MAX_TENSOR_ELEMENTS,
    MODEL_FILE, RUNTIME_MB, Term, _grid_fits, check_estimate, check_memory, check_sizes,
    estimate_peak_memory, load_memory_model, memory_available, memory_breakdown, memory_terms,
    node_budget, smallest_rank_count)
from .preflight_jobs import (  # noqa: F401  (re-exported: the jobs' own terms)
    check_job_memory, fft_demo_memory, lensing_memory, lensing_tensors, pgd_terms,
    reconstruct_memory)

__all__ = ["MODEL_FILE", "load_memory_model", "RUNTIME_MB", "BYTES_PER_SLOT",
           "BYTES_PER_PADDED_CELL", "MASTER_COPIES", "MAX_TENSOR_ELEMENTS", "MAX_RANKS", "Term",
           "memory_terms", "memory_breakdown", "check_sizes", "smallest_rank_count",
           "MIN_DISPLACEMENT_ULPS", "MIN_STEP_ULPS", "estimate_peak_memory", "memory_available", "node_budget", "check_memory",
           "check_estimate", "displacement_rms_cells", "check_numerics",
           "large_constants", "fft_demo_memory", "lensing_memory", "lensing_tensors", "pgd_terms",
           "reconstruct_memory", "check_job_memory"]

log = rank0_only(logging.getLogger(__name__))  # every rank computes the same verdict


# ----------------------------------------------------------------------------- native ops
def check_native_ops(force=False):
    """Raise :class:`MemoryBudgetError` if a CPU job would run without its native ops.

    The memory model (and the speed) of a job on the CPU is that of the native ops
    (:mod:`flowpm_mtf.native`). In the default mode (``FLOWPM_MTF_NATIVE`` unset or
    ``auto``) a library that is not built, or is stale (its sources changed since it
    was built, e.g. after an update without re-running the set-up), is replaced by the
    TensorFlow path, which takes more memory than this module estimates (about 1.7
    times the native ops' peak at 128^3, more at larger meshes), so such a run can be
    killed by the kernel instead of failing with a message. So a CPU job stops here
    (the command line's first check, :func:`flowpm_mtf.cli.safety_hooks`), on every
    rank, naming the library and the command that builds it; ``FLOWPM_MTF_NATIVE=0``
    runs the TensorFlow path on purpose (with a warning that the estimate assumes the
    native ops), ``--force`` (``force``) only logs the message. With
    ``FLOWPM_MTF_NATIVE=require`` the same one-line error (not the traceback of the
    first load). Nothing to check where TensorFlow sees a GPU (the native ops serve
    CPU tensors only).
    """
    from .. import native

    if native.gpu_visible():
        return None
    if native.mode() == "0":
        log.warning("FLOWPM_MTF_NATIVE=0: the TensorFlow path instead of the native ops; the "
                    "memory estimate assumes the native ops (the TensorFlow path took 1.7x "
                    "their peak at 128^3, more at larger meshes)")
        return None
    bad = native.unusable()
    if not bad:
        return None
    names = sorted(bad)
    message = ("native CPU ops not usable: %s%s; the TensorFlow path would run instead, "
               "with more memory than estimated here (1.7x at 128^3, over 2.3x at 512^3); "
               "build them with `python -m flowpm_mtf.native.build`, set FLOWPM_MTF_NATIVE=0 "
               "to run the TensorFlow path anyway, or --force skips this check"
               % (bad[names[0]], "" if len(names) == 1 else
                  " (and %s)" % ", ".join(names[1:])))
    if force:
        log.warning("--force: %s", message)
        return None
    raise MemoryBudgetError(message)



# ----------------------------------------------------------------------------- numerics
#: Initial displacements must span this many float spacings of the positions: the
#: rounding of the ICs then changes them by < 0.5 % (float32 at a_start = 1e-10
#: rounds every displacement to 0 and gives a uniform final density).
MIN_DISPLACEMENT_ULPS = 100.0
#: The rms move of a particle in one step must be at least this many float spacings;
#: below about half a spacing a drift does not move a particle at all.
MIN_STEP_ULPS = 1.0


def displacement_rms_cells(conf):
    """RMS linear (Zel'dovich) displacement per axis at a = 1 [cells].

    :math:`\\sigma_\\psi^2 = \\frac{1}{3}\\frac{1}{2\\pi^2}\\int_{k_f}^{k_N} P(k)\\,dk`
    over the modes the mesh holds (fundamental to Nyquist), divided by the
    cell size.
    """
    from ..physics import linear_power

    L = float(np.mean(conf.box_size))
    cell = float(np.mean(conf.cell_size))
    k = np.logspace(np.log10(2 * np.pi / L), np.log10(np.pi / cell), 512)
    pk = linear_power.linear_matter_power(conf.cosmology, k)
    return float(np.sqrt(trapezoid(pk, k) / (2 * np.pi**2) / 3.0)) / cell


def _numerics_failure(conf, stages=None):
    """What the float type cannot resolve in ``conf``, or None.

    Returns
    -------
    tuple or None
        ``("a_start", rms [cells], ulps, spacing [cells])`` if the initial
        displacements span fewer than :data:`MIN_DISPLACEMENT_ULPS` spacings,
        ``("steps", smallest move [spacings], spacing [cells], n_steps)`` if a
        step moves less than :data:`MIN_STEP_ULPS`.
    """
    from ..physics import cosmology as cosmo_mod

    if stages is None:
        stages = np.linspace(conf.a_start, conf.a_end, conf.n_steps + 1)
    stages = np.asarray(stages, np.float64)
    psi = displacement_rms_cells(conf)
    px, py, nz = conf.padded_block_shape
    spacing = float(np.spacing(conf.np_dtype.type(max(px, py, nz))))
    d1 = cosmo_mod.growth(conf.cosmology, stages).D1
    ulps = d1[0] * psi / spacing
    if not ulps >= MIN_DISPLACEMENT_ULPS:
        return ("a_start", d1[0] * psi, ulps, spacing)
    step = np.diff(d1) * psi / spacing
    if step.size and not step.min() >= MIN_STEP_ULPS:
        return ("steps", float(step.min()), spacing, len(step))
    return None


def _round_up(x, digits=2):
    """``x`` rounded up to ``digits`` significant digits (so the printed value is >= x)."""
    e = math.floor(math.log10(x)) - digits + 1
    return math.ceil(x / 10.0**e) * 10.0**e


def _a_start_advice(conf):
    """The smallest printed ``--a-start`` (2 significant digits) with which ``conf`` passes
    :func:`check_numerics`, or None if none below ``a_end`` does."""
    from ..physics import cosmology as cosmo_mod

    psi = displacement_rms_cells(conf)
    px, py, nz = conf.padded_block_shape
    spacing = float(np.spacing(conf.np_dtype.type(max(px, py, nz))))
    need = MIN_DISPLACEMENT_ULPS * spacing / psi          # D1 the first stage needs
    if cosmo_mod.growth(conf.cosmology, [conf.a_end]).D1[0] < need:
        return None
    lo, hi = conf.a_start, conf.a_end                     # D1 grows with a: bisect
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if cosmo_mod.growth(conf.cosmology, [mid]).D1[0] >= need:
            hi = mid
        else:
            lo = mid
    a = _round_up(hi * 1.001)
    for _ in range(5):   # the value printed must pass the whole check (steps too)
        if a >= conf.a_end:
            return None
        try:
            if _numerics_failure(conf.replace(a_start=a)) is None:
                return a
        except ValueError:
            return None
        a = _round_up(a * 1.1)
    return None


def _steps_advice(conf, n_max):
    """The largest ``--steps`` (at most ``n_max``) with which ``conf`` passes, or None."""
    n = int(n_max)
    while n >= 1:
        if _numerics_failure(conf.replace(n_steps=n)) is None:
            return n
        n = min(n - 1, int(n * 0.9))
    return None


def _other_remedy(conf):
    """``--dtype float64`` if it resolves ``conf``, else what the user must change."""
    if conf.dtype != "float64" and _numerics_failure(conf.replace(dtype="float64")) is None:
        return "use --dtype float64"
    return "no --dtype resolves it either: use a smaller --box-size"


def _or_float64(conf):
    """``" or --dtype float64"`` if float64 resolves ``conf``, else ``""``."""
    return " or --dtype float64" if _other_remedy(conf) == "use --dtype float64" else ""


def check_numerics(conf, stages=None):
    """Reject inputs the floating-point type cannot resolve (no silent wrong result).

    Positions are stored in cells relative to their block (x, y) or the box (z),
    so their float spacing is that of the largest coordinate. The initial
    displacement :math:`D_1(a_{start})\\sigma_\\psi` must exceed
    :data:`MIN_DISPLACEMENT_ULPS` spacings, and the smallest per-step move
    :math:`\\Delta D_1 \\sigma_\\psi` :data:`MIN_STEP_ULPS` spacings. Sizes no
    TensorFlow shape can count are refused first (:func:`check_sizes`).

    Parameters
    ----------
    conf : SimConfig
    stages : array_like, optional
        Scale factors of the steps (default: ``conf.a_start .. conf.a_end``
        linearly in ``conf.n_steps`` steps).

    Raises
    ------
    ConfigError
        Naming a value that passes this check (verified), or saying that no
        value of that option does and what does.
    """
    check_sizes(conf)
    failure = _numerics_failure(conf, stages)
    if failure is None:
        return
    if failure[0] == "a_start":
        _, rms, ulps, spacing = failure
        a = _a_start_advice(conf)
        if a is not None:
            fix = "use --a-start >= %g%s" % (a, _or_float64(conf))
        else:
            fix = ("no --a-start below a_end=%g resolves them (the displacements stay below %d "
                   "spacings even at a_end); %s" % (conf.a_end, MIN_DISPLACEMENT_ULPS,
                                                    _other_remedy(conf)))
        raise ConfigError(
            "a_start=%g is below what %s resolves: the initial displacements (rms %.2g cells) are "
            "%.2g of the %.2g-cell spacing of the positions and would be rounded away; %s"
            % (conf.a_start, conf.dtype, rms, ulps, spacing, fix))
    _, smallest, spacing, n_steps = failure
    n = _steps_advice(conf, n_steps * smallest / MIN_STEP_ULPS)
    fix = ("use --steps <= %d%s" % (n, _or_float64(conf))
           if n is not None else "no --steps resolves it; %s" % _other_remedy(conf))
    raise ConfigError(
        "%d steps are too many for %s: a particle moves %.2g of the %.2g-cell position "
        "spacing per step (rms) and the drift would be lost to rounding; %s"
        % (n_steps, conf.dtype, smallest, spacing, fix))


# ----------------------------------------------------------------------------- graph size
def large_constants(graph_def, limit_bytes=1 << 20):
    """Constants of a GraphDef above ``limit_bytes`` serialised (a graph must embed none).

    Returns
    -------
    list of (str, int)
        Node name and serialised size [bytes], largest first.
    """
    big = [(n.name, n.ByteSize()) for n in graph_def.node
           if n.op == "Const" and n.ByteSize() > limit_bytes]
    return sorted(big, key=lambda t: -t[1])
