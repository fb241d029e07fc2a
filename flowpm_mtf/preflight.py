"""Checks that fail a run before the compute, and graph-size safety.

Everything here runs before the TF graph is built (or, for the graph helpers,
while it is built) and costs milliseconds:

* :func:`check_sizes`: tensors of 2^63 elements or more (no TensorFlow shape
  counts them): a :class:`ConfigError` naming the option, before anything else
  computes with them;
* :func:`check_memory`: the estimated peak memory per rank (the measured model
  of ``docs/scaling.md``, plus each job's own terms: :func:`fft_demo_memory`,
  :func:`lensing_memory`, :func:`reconstruct_memory`, run from the jobs'
  preflight by :func:`check_job_memory`) against the memory the node has for
  its ranks. Every size is an exact Python int (the model's constants as exact
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

The writable-OUT check is part of :meth:`flowpm_mtf.rundir.RunDir.open`.
"""
import collections
import json
import logging
import math
import os
import socket
from fractions import Fraction

import numpy as np

from .errors import ConfigError, MemoryBudgetError
from .linear_power import trapezoid
from .logs import rank0_only


__all__ = ["MODEL_FILE", "load_memory_model", "RUNTIME_MB", "BYTES_PER_SLOT",
           "BYTES_PER_PADDED_CELL", "MASTER_COPIES", "MAX_TENSOR_ELEMENTS", "MAX_RANKS", "Term",
           "memory_terms", "memory_breakdown", "check_sizes", "smallest_rank_count", "MIN_DISPLACEMENT_ULPS",
           "MIN_STEP_ULPS", "estimate_peak_memory", "memory_available", "check_memory",
           "displacement_rms_cells", "check_numerics",
           "large_constants", "fft_demo_memory", "lensing_memory", "lensing_tensors",
           "reconstruct_memory", "check_job_memory"]

log = rank0_only(logging.getLogger(__name__))  # every rank computes the same verdict

# ----------------------------------------------------------------------------- memory model
# Peak RSS of one rank of `flowpm-mtf simulate` (slice-only variables, no masters):
#     RSS [MB] = M0 + (a * slots + b * padded cells) / 2^20 * itemsize / 4
# slots: the particle slots of the rank's block (flowpm_mtf.sizing.capacity: the lattice
# share for the lagrangian decomposition and on one rank, the eulerian buffers otherwise);
# padded cells: (nx/P + 2h)(ny/Q + 2h) nz. The constants are the least-squares fit of
# `scripts/bench_scaling.py` (its `render` rewrites MODEL_FILE from the measured runs, so
# the benchmark and this estimate share one set of constants); the file also keeps the
# measured rows the fit was made on (tests/test_preflight.py checks the fit against them).
MODEL_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "memory_model.json")


def load_memory_model(path=MODEL_FILE):
    """The fitted memory model: ``M0_mb`` [MB], ``bytes_per_slot``, ``bytes_per_padded_cell``
    [bytes, float32], ``rows`` (the measured runs of the fit) and their provenance."""
    with open(path) as f:
        return json.load(f)


_MODEL = load_memory_model()
#: M0: TensorFlow/Horovod runtime per rank [MB] (see MODEL_FILE for the fit).
RUNTIME_MB = float(_MODEL["M0_mb"])
#: a: bytes per particle slot of the rank's buffers (state, migration, CIC temporaries), float32.
BYTES_PER_SLOT = float(_MODEL["bytes_per_slot"])
#: b: bytes per padded mesh cell of the rank (FFT/painting working set), float32.
BYTES_PER_PADDED_CELL = float(_MODEL["bytes_per_padded_cell"])
#: Full-size master copies of the state variables per process, for a backend that keeps them
#: (stock Mesh TF variables; ``HvdSimdMeshImpl`` has slice-only variables): 36 B per particle.
MASTER_COPIES = 1.0
#: Largest element count of one TensorFlow tensor (its shape is counted in int64).
MAX_TENSOR_ELEMENTS = 2**63 - 1
#: Largest rank count the advice of the memory check searches.
MAX_RANKS = 1 << 16


def _fraction(x):
    """``x`` as an exact fraction (a float converts exactly: no rounding in the products)."""
    return Fraction(x)


def _ceil(x):
    """Smallest int >= ``x`` (a Fraction or int) [same unit]."""
    return -((-x.numerator) // x.denominator) if isinstance(x, Fraction) else int(x)


class Term(collections.namedtuple("Term", "label nbytes shrinks remedy advise")):
    """One part of the estimated peak memory of a process.

    Attributes
    ----------
    label : str
        What it is, for the error message (e.g. ``"the lensing maps"``).
    nbytes : int
        Its size [bytes per process], exact (Python int).
    shrinks : bool
        Whether it shrinks when the same run is spread over more ranks.
    remedy : str or None
        The option that makes it smaller, for the message when it alone does not fit.
    advise : callable or None
        ``advise(room, budget)`` -> text naming a value of that option with which the
        run fits: its term fits in ``room`` [bytes] (the budget less the other terms),
        or the whole estimate in ``budget`` [bytes per rank]; None if no value does.
    """

    def __new__(cls, label, nbytes, shrinks, remedy=None, advise=None):
        return super().__new__(cls, label, int(nbytes), bool(shrinks), remedy, advise)


def memory_terms(conf):
    """(particle slots, padded cells) of one block of ``conf`` [counts, exact ints].

    The slots are ``conf.capacity`` if set, the block's lattice count for the
    lagrangian decomposition and on one rank, :func:`flowpm_mtf.sizing.capacity`
    otherwise.
    """
    from . import sizing

    sx, sy, nz = (int(n) for n in conf.block_shape)
    px, py, _ = (int(n) for n in conf.padded_block_shape)
    if conf.capacity is not None:
        slots = int(conf.capacity)
    elif conf.decomposition == "lagrangian" or conf.n_ranks == 1:
        slots = sx * sy * nz
    else:
        slots = int(sizing.capacity(conf))
    return slots, px * py * nz


def _most_square_grid(n):
    """The most square grid (P, Q), P >= Q, of ``n`` ranks."""
    q = math.isqrt(n)
    while n % q:
        q -= 1
    return (n // q, q)


def _grid_conf(conf, n):
    """``conf`` on ``n`` ranks (its most square grid, the same halo and explicit
    capacities), or None if that grid does not fit the mesh."""
    if n == conf.n_ranks:
        return conf
    grid = _most_square_grid(n)
    capacity = None if conf.decomposition == "lagrangian" else conf.capacity
    try:
        return conf.replace(grid=grid, capacity=capacity)
    except ValueError:
        return None


def _grid_fits(conf, n):
    """The most square grid of n ranks if it divides the mesh with room for the halo."""
    c = _grid_conf(conf, n)
    return None if c is None else c.grid


def _numbers(conf):
    """``nc`` as text for messages: ``64`` or ``64x64x32``."""
    return "x".join(map(str, conf.nc)) if len(set(conf.nc)) > 1 else str(conf.nc[0])


def check_sizes(conf, tensors=()):
    """Refuse sizes no TensorFlow shape can count (before any other check computes with them).

    TensorFlow counts the elements of a tensor in int64: a global mesh,
    padded-block or particle tensor of ``2^63`` elements or more would
    overflow (seen as a 0.5 GB estimate and a division by zero at
    ``--nc 4194304``). Every count here is an exact Python int.

    Parameters
    ----------
    conf : SimConfig
    tensors : iterable of (str, int, str)
        A job's own large global tensors: what, element count, the option that
        makes it smaller.

    Raises
    ------
    ConfigError
        Naming the tensor, its element count and the option to change.
    """
    P, Q = conf.grid
    nx, ny, nz = (int(n) for n in conf.nc)
    sx, sy, _ = (int(n) for n in conf.block_shape)
    px, py, _ = (int(n) for n in conf.padded_block_shape)
    slots = int(conf.capacity) if conf.capacity is not None else sx * sy * nz
    option = "--capacity" if conf.capacity is not None else "--nc"
    checks = [("the mesh of %s cells" % (_numbers(conf) if len(set(conf.nc)) > 1
                                          else "%d^3" % nx), nx * ny * nz, "--nc"),
              ("the padded blocks", P * Q * px * py * nz, "--nc"),
              ("the particle positions (%d slots per block)" % slots, P * Q * slots * 3, option)]
    for what, count, opt in list(checks) + list(tensors):
        if int(count) > MAX_TENSOR_ELEMENTS:
            raise ConfigError(
                "%s would hold %.3g elements, beyond the 2^63-1 a TensorFlow shape can count "
                "(and far more memory than any machine has); use a smaller %s"
                % (what, float(count), opt))


def memory_breakdown(conf, n_ranks=None, processes=None, masters=True, extra=None,
                     particles=True):
    """The estimated peak memory of one process, part by part.

    Parameters
    ----------
    conf : SimConfig
    n_ranks : int, optional
        Mesh processors sharing the work (default ``conf.n_ranks``; another
        count uses its most square grid).
    processes : int, optional
        Processes the mesh runs in: ``n_ranks`` (one block per MPI rank, the
        default) or 1 (``PlacementMeshImpl``: every block in one process).
    masters : bool
        Whether the backend keeps a full-size master copy of every state
        variable on each process (stock Mesh TF; not ``HvdSimdMeshImpl``).
    extra : callable, optional
        ``extra(conf_on_grid, blocks, masters)`` -> list of :class:`Term`: a
        job's own allocations (lensing rays and planes, reconstruction
        variables, the FFT demo's reference), for ``blocks`` blocks per process.
    particles : bool
        Whether the job has particle buffers (not the FFT demo).

    Returns
    -------
    list of Term
        ``M0``, ``a slots`` and ``b padded cells`` per block (times the blocks
        of the process, times ``itemsize / 4``), the master copies
        (``36 N itemsize / 4``) and the job's terms [bytes, exact ints].

    Raises
    ------
    ValueError
        If no process grid of ``n_ranks`` ranks fits the mesh.
    """
    n = conf.n_ranks if n_ranks is None else int(n_ranks)
    c = _grid_conf(conf, n)
    if c is None:
        raise ValueError("no process grid of %d ranks fits the mesh %s" % (n, conf.nc))
    blocks = n // (n if processes is None else int(processes))
    slots, cells = memory_terms(c)
    scale = Fraction(conf.np_dtype.itemsize, 4)
    terms = [Term("the TensorFlow/Horovod runtime", _ceil(_fraction(RUNTIME_MB) * 2**20), False)]
    if particles:
        explicit = c.capacity is not None and c.decomposition != "lagrangian"
        terms.append(Term(
            "the particle buffers (%d slots per block)" % slots,
            _ceil(_fraction(BYTES_PER_SLOT) * slots * scale * blocks), not explicit,
            "a smaller --capacity" if explicit else None,
            _capacity_advice(c, blocks) if explicit else None))
    terms.append(Term("the mesh working set (%d padded cells per block)" % cells,
                      _ceil(_fraction(BYTES_PER_PADDED_CELL) * cells * scale * blocks), True))
    if masters and particles:
        n_cells = math.prod(int(x) for x in conf.nc)
        terms.append(Term("the full-size master copies of the particle state",
                          _ceil(_fraction(MASTER_COPIES) * 36 * scale * n_cells), False,
                          "the hvd backend (slice-only variables) or a smaller --nc"))
    if extra is not None:
        terms.extend(extra(c, blocks, masters))
    return terms


def _capacity_advice(conf, blocks):
    """``advise(room)`` for an explicit ``--capacity``: the largest that fits in ``room``."""
    scale = Fraction(conf.np_dtype.itemsize, 4)
    per_slot = _fraction(BYTES_PER_SLOT) * scale * blocks
    npb = math.prod(int(x) for x in conf.block_shape)

    def advise(room, budget):
        best = int(Fraction(room) / per_slot) if room > 0 else 0
        while best >= npb and _ceil(per_slot * best) > room:
            best -= 1
        if best < npb:
            return None
        return "--capacity %d or less (a block starts with %d particles)" % (best, npb)

    return advise


def estimate_peak_memory(conf, n_ranks=None, processes=None, masters=True, extra=None,
                         particles=True):
    """Estimated peak resident memory of one process [bytes, exact int].

    The sum of :func:`memory_breakdown` (same parameters): ``M0 + blocks (a
    slots + b padded cells) itemsize/4 [+ 36 N itemsize/4 masters] [+ the job's
    terms]`` with the constants of this module.
    """
    return sum(t.nbytes for t in memory_breakdown(conf, n_ranks, processes, masters, extra,
                                                  particles))


def _read_int(path):
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def memory_available():
    """Memory available to this node's processes now [bytes].

    The smaller of ``MemAvailable`` (``/proc/meminfo``) and the room left under
    the cgroup's limit (v2 ``memory.max - memory.current``, v1
    ``memory.limit_in_bytes - memory.usage_in_bytes``; Slurm and containers
    set these). ``None`` if nothing is readable (not Linux).
    """
    candidates = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    candidates.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                          "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        lim, use = _read_int(limit), _read_int(usage)
        if lim is not None and use is not None and lim < 2**60:
            candidates.append(max(lim - use, 0))
    return min(candidates) if candidates else None


def smallest_rank_count(conf, budget, masters=True, limit=MAX_RANKS, extra=None,
                        particles=True):
    """Smallest rank count (with a valid grid) whose estimate fits ``budget`` bytes per rank.

    The search starts at a lower bound (the parts that do not shrink with
    more ranks, plus the lattice and mesh cells shared out), so it is cheap
    even for absurd sizes.

    Returns
    -------
    (int, tuple) or None
        Rank count and its grid, or None if none up to ``limit`` fits.
    """
    terms = memory_breakdown(conf, masters=masters, extra=extra, particles=particles)
    fixed = sum(t.nbytes for t in terms if not t.shrinks)
    if fixed >= budget:
        return None
    n_cells = math.prod(int(x) for x in conf.nc)
    scale = Fraction(conf.np_dtype.itemsize, 4)
    per_cell = _fraction(BYTES_PER_PADDED_CELL)
    if particles and any(t.shrinks and t.label.startswith("the particle") for t in terms):
        per_cell += _fraction(BYTES_PER_SLOT)
    # est(n) >= fixed + per_cell N / n: no count below n_lo fits
    n_lo = max(1, int(per_cell * scale * n_cells / (budget - fixed)))
    if n_lo > limit:
        return None
    for n in range(n_lo, limit + 1):
        c = _grid_conf(conf, n)
        if c is not None and estimate_peak_memory(c, masters=masters, extra=extra,
                                                  particles=particles) <= budget:
            return n, c.grid
    return None


def _gb(x):
    return "%.1f GB" % (x / 2**30)


def _memory_hint(conf, terms, budget, node_avail, share, processes, masters, extra, particles):
    """The advice of a failed memory check: a configuration that fits, or why none does."""
    if processes == 1:
        return ("the placement backend holds every slice in this one process; use the hvd "
                "backend on more ranks/nodes or a smaller --nc")
    best = smallest_rank_count(conf, budget, masters=masters, extra=extra, particles=particles)
    if best is not None:
        n, grid = best
        nodes, per_node = -(-n // share), min(share, n)
        return ("the smallest rank count that fits at %s per rank is %d (-np %d --grid %dx%d), "
                "i.e. %d node%s like this one with %d rank%s each" % (
                    _gb(budget), n, n, grid[0], grid[1], nodes, "s" if nodes > 1 else "",
                    per_node, "s" if per_node > 1 else ""))
    total = sum(t.nbytes for t in terms)
    fixed = [t for t in terms if not t.shrinks]
    worst = max(fixed, key=lambda t: t.nbytes)
    fixed_sum = sum(t.nbytes for t in fixed)
    if fixed_sum < budget:   # the shared-out parts need more than MAX_RANKS ranks
        return ("no rank count up to %d fits (the mesh would need more ranks); use a smaller "
                "--nc" % MAX_RANKS)
    what = "no rank count fits: %s alone would take %s per rank (more ranks do not shrink it)" % (
        worst.label, _gb(worst.nbytes))
    # what is left for that part on this grid: a value whose part fits there makes the run fit
    room = budget - (total - worst.nbytes)
    advice = worst.advise(room, budget) if worst.advise is not None else None
    if advice:
        return "%s; use %s" % (what, advice)
    if worst.remedy:
        return "%s; use %s" % (what, worst.remedy)
    return "%s; no option of this run makes it fit on this machine" % what


def check_memory(conf, comm, processes=None, masters=True, force=False, available=None,
                 extra=None, particles=True):
    """Fail before the compute if the estimated peak memory does not fit the node.

    Collective: every rank gathers (host, available memory) so ranks sharing a
    node split its memory; every rank raises the same error. Sizes that no
    TensorFlow shape can count are refused first (:func:`check_sizes`).

    Parameters
    ----------
    conf : SimConfig
    comm : object
        Communicator with ``allgather`` (see :class:`flowpm_mtf.backend.SerialComm`).
    processes, masters, extra, particles
        See :func:`memory_breakdown`.
    force : bool
        Only log the estimate (``--force``).
    available : int, optional
        Memory of this node [bytes] (default :func:`memory_available`; for tests).

    Returns
    -------
    dict
        ``estimate`` [bytes per process], ``available_per_rank`` [bytes],
        ``ranks_on_node``.

    Raises
    ------
    ConfigError
        A tensor too large for any TensorFlow shape (:func:`check_sizes`).
    MemoryBudgetError
        With the estimate, the memory per rank and a configuration that fits
        (a rank count and grid, or a smaller value of the option that sets the
        part that does not shrink with more ranks), or why none does.
    """
    check_sizes(conf)
    avail = memory_available() if available is None else int(available)
    info = comm.allgather((socket.gethostname(), avail))
    terms = memory_breakdown(conf, processes=processes, masters=masters, extra=extra,
                             particles=particles)
    est = sum(t.nbytes for t in terms)
    per_rank = []
    for host, node_avail in info:
        if node_avail is not None:
            share = sum(1 for h, _ in info if h == host)
            per_rank.append((node_avail // share, node_avail, share))
    result = {"estimate": est, "available_per_rank": None, "ranks_on_node": None}
    if not per_rank:
        log.warning("memory check skipped: available memory unknown on this system")
        return result
    budget, node_avail, share = min(per_rank)
    result.update(available_per_rank=budget, ranks_on_node=share)
    log.info("memory: estimated peak %s per process, %s available per rank",
             _gb(est), _gb(budget))
    if est <= budget:
        return result
    big = max(terms, key=lambda t: t.nbytes)
    what = ("estimated peak memory %s per process (model of docs/scaling.md for %s^3, %s; "
            "largest part: %s, %s) exceeds the %s available per rank (%s on the node for %d "
            "rank%s)" % (_gb(est), _numbers(conf), conf.dtype, big.label, _gb(big.nbytes),
                         _gb(budget), _gb(node_avail), share, "s" if share > 1 else ""))
    hint = _memory_hint(conf, terms, budget, node_avail, share, processes, masters, extra,
                        particles)
    message = "%s; %s; --force skips this check" % (what, hint)
    if force:
        log.warning("--force: %s", message)
        return result
    raise MemoryBudgetError(message)


# ----------------------------------------------------------------------------- job terms
# Each job's own large allocations, counted array by array (no measured constant: sizes of
# arrays the job's code allocates, with the copies it makes):
#: FFT demo: the full-size numpy reference on every rank: the field (itemsize), np.fft.fftn
#: (complex128) and its normalised copy, the stored-order copy, |ref| (float64) [bytes/cell
#: over the itemsize].
FFT_REFERENCE_BYTES_PER_CELL = 16 + 16 + 16 + 8
#: FFT demo: the TensorFlow working set of the distributed round trip beyond the fetched
#: slices [itemsizes per cell of the rank]. The memory model's per-cell constant is 0 (its
#: fit puts the simulation's mesh work into the slots), so it is measured here: fft-demo on
#: 1 rank, float64, peaks of 1228 and 2230 MB at 192^3 and 256^3 (summary.json) are M0 + 98
#: and 101 B per cell, of which the counted arrays give 88; 2 itemsizes (16 B) cover the rest.
FFT_WORKING_ITEMSIZES_PER_CELL = 2
#: Lensing maps [src, npix, npix]: the einsum term, the running sum and its all-reduce in
#: TF (3 itemsize), the fetched copy (itemsize) and its float64 copy; per map the flat-sky
#: power spectrum's FFT (complex128), |.|^2 and the ell and bin arrays (8 + 8 + 8).
LENSING_BYTES_PER_RAY_MAP = 8
LENSING_BYTES_PER_RAY_FFT = 16 + 8 + 8 + 8 + 8


def _largest(fits, hi):
    """Largest int ``n`` in ``[1, hi]`` with ``fits(n)`` (monotone), or 0."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def fft_demo_memory(conf):
    """``extra`` for :func:`check_memory` of the FFT demo: its fetched slices and the
    full-size numpy reference every rank holds (:mod:`flowpm_mtf.jobs.fft_demo`)."""
    isz = conf.np_dtype.itemsize
    P, Q = conf.grid
    step = math.lcm(2, P, Q)   # the grid divides the mesh; even sides

    def reference(nc):
        return math.prod(int(x) for x in nc) * (isz + FFT_REFERENCE_BYTES_PER_CELL)

    def extra(c, blocks, masters):
        cells = math.prod(int(x) for x in c.block_shape)
        cube = len(set(conf.nc)) == 1

        def advise(room, budget):
            def fits(k, valid_only=False):   # the whole estimate of a k^3 mesh, same grid
                try:
                    small = conf.replace(nc=k, capacity=None, send_capacity=None)
                except ValueError:   # too small for the grid and halo: only small k
                    return not valid_only
                return estimate_peak_memory(
                    small, processes=c.n_ranks // blocks, masters=masters,
                    extra=fft_demo_memory(small), particles=False) <= budget

            n = _largest(lambda k: fits(k * step), conf.nc[0] // step) if cube else 0
            n = n if n and fits(n * step, valid_only=True) else 0
            return "--nc %d or less" % (n * step) if n else None

        return [Term("the distributed FFT (working set, fetched k and round trip)",
                     (3 + FFT_WORKING_ITEMSIZES_PER_CELL) * isz * cells * blocks, True),
                Term("the full-size numpy reference of every rank", reference(conf.nc), False,
                     "a smaller --nc", advise)]

    return extra


def lensing_memory(conf, n_planes, n_source, npix):
    """``extra`` for :func:`check_memory` of the lensing job: the lens planes (variables,
    fetched float64 copies) and the rays (the ``[src, npix, npix]`` maps and the
    ``[npix, n]`` interpolation weights of every plane, :func:`flowpm_mtf.lensing.
    born_convergence`), replicated on every rank."""
    isz = conf.np_dtype.itemsize
    nx, ny = int(conf.nc[0]), int(conf.nc[1])

    def rays(npix_, blocks=1):
        maps = npix_ * npix_ * (n_source * (4 * isz * blocks + LENSING_BYTES_PER_RAY_MAP)
                                + LENSING_BYTES_PER_RAY_FFT)
        weights = n_planes * npix_ * (nx + ny) * (8 + 2 * isz)
        return maps + weights

    def extra(c, blocks, masters):
        sx, sy = int(c.block_shape[0]), int(c.block_shape[1])

        def advise(room, budget):
            n = _largest(lambda k: rays(k, blocks) <= room, npix)
            return "--field-npix %d or less" % n if n else None

        terms = [Term("the lensing rays (%d source map%s of %d^2 pixels and the interpolation "
                      "weights of %d planes)" % (n_source, "s" if n_source > 1 else "", npix,
                                                 n_planes), rays(npix, blocks),
                      False, "a smaller --field-npix", advise),
                 Term("the %d lens planes" % n_planes, n_planes * sx * sy * (isz + 8) * blocks,
                      True)]
        if masters:
            terms.append(Term("the full-size master copies of the lens planes",
                              n_planes * nx * ny * isz, False, "the hvd backend"))
        return terms

    return extra


def lensing_tensors(n_source, npix):
    """The lensing job's tensors for :func:`check_sizes`: the maps ``[src, npix, npix]``."""
    return [("the convergence maps (%d x %d^2 pixels)" % (n_source, npix),
             int(n_source) * int(npix)**2, "--field-npix")]


#: Reconstruction: field variables per rank (the linear field, Adam's two moments, the
#: observed data) and fetched copies (truth, reconstruction, observed).
RECON_VARIABLE_FIELDS = 4
RECON_FETCHED_FIELDS = 3
#: Per particle slot and kept stage of the gradient tape: positions, momenta, forces (3 each).
RECON_TAPE_VALUES_PER_SLOT = 9


def reconstruct_memory(conf, forward, gradient="stored"):
    """``extra`` for :func:`check_memory` of the reconstruction: its field variables (the
    linear field, Adam's moments, the observed data), the fetched fields, and the particle
    state the gradient keeps (one stage for ``"lpt"``; for ``"nbody"`` every step with the
    ``"stored"`` gradient, two with the ``"adjoint"``: the state and its cotangents)."""
    isz = conf.np_dtype.itemsize
    if forward == "lpt":
        stages = 1
    else:
        stages = 2 if gradient == "adjoint" else conf.n_steps + 1

    def extra(c, blocks, masters):
        cells = math.prod(int(x) for x in c.block_shape)
        slots, _ = memory_terms(c)
        terms = [Term("the reconstruction fields (linear field, Adam moments, observed data; "
                      "fetched copies)", (RECON_VARIABLE_FIELDS + RECON_FETCHED_FIELDS)
                      * cells * isz * blocks, True),
                 Term("the gradient tape (%d stage%s of the particle state)"
                      % (stages, "s" if stages > 1 else ""),
                      stages * slots * RECON_TAPE_VALUES_PER_SLOT * isz * blocks, True)]
        if masters:
            terms.append(Term("the full-size master copies of the reconstruction fields",
                              RECON_VARIABLE_FIELDS * math.prod(int(x) for x in conf.nc) * isz,
                              False, "the hvd backend"))
        return terms

    return extra


def check_native_ops(force=False):
    """Raise :class:`MemoryBudgetError` if a CPU job would run without its native ops.

    The memory model (and the speed) of a job on the CPU is that of the native ops
    (:mod:`flowpm_mtf.native`). In the default mode (``FLOWPM_MTF_NATIVE`` unset or
    ``auto``) a library that is not built, or is stale (its sources changed since it
    was built, e.g. after an update without re-running the set-up), is replaced by the
    TensorFlow path, which takes more memory than this module estimates: 1272 against
    762 MB at 128^3 on one rank, and a 512^3 run on one rank (10.3 GB with the native
    ops, estimated 9.7) was killed by the kernel at 24 GB instead of failing with a
    message. So a CPU job stops here (the command line's first check,
    :func:`flowpm_mtf.cli.safety_hooks`), on every rank, naming the library and the
    command that builds it; ``FLOWPM_MTF_NATIVE=0`` runs the TensorFlow path on
    purpose (with a warning that the estimate assumes the native ops), ``--force``
    (``force``) only logs the message. With ``FLOWPM_MTF_NATIVE=require`` the same
    one-line error (not the traceback of the first load). Nothing to check where
    TensorFlow sees a GPU (the native ops serve CPU tensors only).
    """
    from . import native

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


def check_job_memory(ctx, extra=None, particles=True, tensors=()):
    """The memory check of a job with its own terms, from its :meth:`Job.preflight`.

    Runs once per run (the runner calls the job's preflight again after the hooks).
    ``ctx.force`` (``--force``) skips it.

    Parameters
    ----------
    ctx : flowpm_mtf.jobs.runner.RunContext
    extra, particles
        See :func:`memory_breakdown`.
    tensors
        See :func:`check_sizes`.
    """
    if getattr(ctx, "_job_memory_checked", False):
        return None
    check_sizes(ctx.conf, tensors)
    force = getattr(ctx, "force", False)
    masters = particles and not getattr(ctx.backend.mesh_impl, "slice_only_variables", False)
    result = check_memory(ctx.conf, ctx.comm,
                          processes=1 if ctx.backend.name == "placement" else None,
                          masters=masters, force=force, extra=extra, particles=particles)
    ctx._job_memory_checked = True
    return result


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
    from . import linear_power

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
    from . import cosmology as cosmo_mod

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
    from . import cosmology as cosmo_mod

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
