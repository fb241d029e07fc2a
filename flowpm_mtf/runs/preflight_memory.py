"""The memory model of a run: its estimated peak memory per process, part by part, and the
check that it fits the node (with the advice of a configuration that does).

* :func:`memory_breakdown` / :func:`estimate_peak_memory`: the measured model of
  ``docs/scaling.md`` (``M0 + blocks (a slots + b padded cells) itemsize/4``, the
  constants fitted by ``scripts/bench_scaling.py`` and read from :data:`MODEL_FILE`),
  the master copies of a backend that keeps them, and a job's own terms (``extra``:
  :mod:`flowpm_mtf.runs.preflight_jobs`). Every size is an exact Python int (the model's
  constants as exact fractions): nothing wraps at 2^31 or 2^63 or rounds at 2^53.
* :func:`check_sizes`: tensors of 2^63 elements or more (no TensorFlow shape counts
  them): a :class:`~flowpm_mtf.errors.ConfigError` naming the option, before anything
  else computes with them.
* :func:`check_memory`: the estimate against the memory the node has for its ranks
  (:func:`memory_available`, shared by the ranks of a node). The advice is a
  configuration that fits (checked: a rank count and grid, :func:`smallest_rank_count`,
  or a value of the option whose part does not shrink with more ranks), or says that
  none does.

Re-exported by :mod:`flowpm_mtf.runs.preflight`, the name the callers use.
"""
import collections
import json
import logging
import math
import os
import socket
from fractions import Fraction

from ..errors import ConfigError, MemoryBudgetError
from ..logs import rank0_only

__all__ = ["MODEL_FILE", "load_memory_model", "RUNTIME_MB", "BYTES_PER_SLOT",
           "BYTES_PER_PADDED_CELL", "MASTER_COPIES", "MAX_TENSOR_ELEMENTS", "MAX_RANKS", "Term",
           "memory_terms", "memory_breakdown", "check_sizes", "smallest_rank_count",
           "estimate_peak_memory", "memory_available", "node_budget", "check_memory",
           "check_estimate"]

log = rank0_only(logging.getLogger(__name__))  # every rank computes the same verdict

# ----------------------------------------------------------------------------- memory model
# Peak RSS of one rank of `flowpm-mtf simulate` (slice-only variables, no masters):
#     RSS [MB] = M0 + (a * slots + b * padded cells) / 2^20 * itemsize / 4
# slots: the particle slots of the rank's block (flowpm_mtf.physics.sizing.capacity: the lattice
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
    lagrangian decomposition and on one rank, :func:`flowpm_mtf.physics.sizing.capacity`
    otherwise.
    """
    from ..physics import sizing

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
    overflow (and the memory estimate and the grid arithmetic built on such a
    count would be wrong). Every count here is an exact Python int.

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


def node_budget(comm, available=None):
    """The memory each rank may use: the node's available memory shared by its ranks.

    Collective: every rank gathers (host, available memory), so ranks sharing a node
    split its memory; the tightest node counts.

    Parameters
    ----------
    comm : object
        Communicator with ``allgather``.
    available : int, optional
        Memory of this node [bytes] (default :func:`memory_available`; for tests).

    Returns
    -------
    (int, int, int) or None
        Bytes per rank, bytes of that node, ranks on that node; None if no rank
        knows its memory.
    """
    avail = memory_available() if available is None else int(available)
    info = comm.allgather((socket.gethostname(), avail))
    per_rank = []
    for host, node_avail in info:
        if node_avail is not None:
            share = sum(1 for h, _ in info if h == host)
            per_rank.append((node_avail // share, node_avail, share))
    return min(per_rank) if per_rank else None


def check_estimate(terms, comm, subject, hint, force=False, available=None):
    """Fail before the compute if a job's own estimate does not fit the node.

    The check of :func:`check_memory` for a job whose model gives every part itself
    (the imaging job, :mod:`mri_mtf.memory`): collective, the same error on every rank.

    Parameters
    ----------
    terms : list of Term
        The estimated peak memory of one process, part by part [bytes].
    comm : object
        Communicator with ``allgather``.
    subject : str
        What was estimated, for the message (e.g. ``"imaging 64^3 on grid 2x1"``).
    hint : callable
        ``hint(budget)`` -> text: a configuration that fits ``budget`` bytes per rank,
        or why none does.
    force, available
        See :func:`check_memory`.

    Returns
    -------
    dict
        ``estimate`` [bytes per process], ``available_per_rank`` [bytes],
        ``ranks_on_node``.

    Raises
    ------
    MemoryBudgetError
        With the estimate, its largest part, the memory per rank and the hint.
    """
    est = sum(t.nbytes for t in terms)
    result = {"estimate": est, "available_per_rank": None, "ranks_on_node": None}
    node = node_budget(comm, available)
    if node is None:
        log.warning("memory check skipped: available memory unknown on this system")
        return result
    budget, node_avail, share = node
    result.update(available_per_rank=budget, ranks_on_node=share)
    log.info("memory: estimated peak %s per process, %s available per rank",
             _gb(est), _gb(budget))
    if est <= budget:
        return result
    big = max(terms, key=lambda t: t.nbytes)
    message = ("estimated peak memory %s per process (%s; largest part: %s, %s) exceeds the %s "
               "available per rank (%s on the node for %d rank%s); %s; --force skips this "
               "check" % (_gb(est), subject, big.label, _gb(big.nbytes), _gb(budget),
                          _gb(node_avail), share, "s" if share > 1 else "", hint(budget)))
    if force:
        log.warning("--force: %s", message)
        return result
    raise MemoryBudgetError(message)


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
    node = node_budget(comm, available)
    terms = memory_breakdown(conf, processes=processes, masters=masters, extra=extra,
                             particles=particles)
    est = sum(t.nbytes for t in terms)
    result = {"estimate": est, "available_per_rank": None, "ranks_on_node": None}
    if node is None:
        log.warning("memory check skipped: available memory unknown on this system")
        return result
    budget, node_avail, share = node
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

