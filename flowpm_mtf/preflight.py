"""Checks that fail a run before the compute, and graph-size safety.

Everything here runs before the TF graph is built (or, for the graph helpers,
while it is built) and costs milliseconds:

* :func:`check_memory`: the estimated peak memory per rank (the measured model
  of ``docs/scaling.md``) against the memory the node has for its ranks;
* :func:`check_numerics`: inputs the floating-point type cannot represent
  (initial displacements or per-step moves below the resolution of the
  positions), which would otherwise give a silently wrong result;
* :func:`unfolded_zeros_initializer` and :func:`large_constants`: no full-size
  array is ever embedded in the graph (the 2 GB GraphDef/TensorProto limit).

The writable-OUT check is part of :meth:`flowpm_mtf.rundir.RunDir.open`.
"""
import json
import logging
import os
import socket

import numpy as np

from .errors import ConfigError, MemoryBudgetError
from .logs import rank0_only

__all__ = ["MODEL_FILE", "load_memory_model", "RUNTIME_MB", "BYTES_PER_SLOT",
           "BYTES_PER_PADDED_CELL", "MASTER_COPIES", "memory_terms", "MIN_DISPLACEMENT_ULPS",
           "MIN_STEP_ULPS", "estimate_peak_memory", "memory_available", "check_memory",
           "displacement_rms_cells", "check_numerics", "unfolded_zeros_initializer",
           "large_constants"]

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


def memory_terms(conf):
    """(particle slots, padded cells) of one block of ``conf`` [counts]."""
    from . import sizing

    return float(sizing.capacity(conf)), float(np.prod(conf.padded_block_shape))


def _grid_conf(conf, n):
    """``conf`` on ``n`` ranks (the most square grid), or None if none fits its mesh."""
    if n == conf.n_ranks:
        return conf
    grid = _grid_fits(conf, n)
    return None if grid is None else conf.replace(grid=grid, capacity=None, send_capacity=None)


def estimate_peak_memory(conf, n_ranks=None, processes=None, masters=True):
    """Estimated peak resident memory of one process [bytes].

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

    Returns
    -------
    float
        Bytes per process: ``M0 + blocks (a slots + b padded cells) itemsize/4
        [+ 36 N itemsize/4 masters]`` with the constants of this module.
    """
    n = conf.n_ranks if n_ranks is None else int(n_ranks)
    c = _grid_conf(conf, n)
    if c is None:
        raise ValueError("no process grid of %d ranks fits the mesh %s" % (n, conf.nc))
    per_process = n if processes is None else int(processes)
    slots, cells = memory_terms(c)
    scale = conf.np_dtype.itemsize / 4.0
    work = (BYTES_PER_SLOT * slots + BYTES_PER_PADDED_CELL * cells) * scale * n / per_process
    state = 36.0 * scale * float(np.prod(conf.nc))
    return RUNTIME_MB * 2**20 + work + (MASTER_COPIES * state if masters else 0.0)


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


def _grid_fits(conf, n):
    """The most square grid of n ranks if it divides the mesh with room for the halo."""
    q = int(n ** 0.5)
    while n % q:
        q -= 1
    p = n // q
    nx, ny, nz = conf.nc
    if nx % p or ny % q or ny % p or nz % q:
        return None
    if conf.halo_size >= min(nx // p, ny // q):
        return None
    return (p, q)


def smallest_rank_count(conf, budget, masters=True, limit=1 << 16):
    """Smallest rank count (with a valid grid) whose estimate fits ``budget`` bytes per rank.

    Returns
    -------
    (int, tuple) or None
        Rank count and its grid, or None if none up to ``limit`` fits.
    """
    for n in range(1, limit + 1):
        grid = _grid_fits(conf, n)
        if grid and estimate_peak_memory(conf, n_ranks=n, masters=masters) <= budget:
            return n, grid
    return None


def _gb(x):
    return "%.1f GB" % (x / 2**30)


def check_memory(conf, comm, processes=None, masters=True, force=False, available=None):
    """Fail before the compute if the estimated peak memory does not fit the node.

    Collective: every rank gathers (host, available memory) so ranks sharing a
    node split its memory; every rank raises the same error.

    Parameters
    ----------
    conf : SimConfig
    comm : object
        Communicator with ``allgather`` (see :class:`flowpm_mtf.backend.SerialComm`).
    processes, masters
        See :func:`estimate_peak_memory`.
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
    MemoryBudgetError
        With the estimate, the memory per rank and the smallest rank count that fits.
    """
    avail = memory_available() if available is None else int(available)
    info = comm.allgather((socket.gethostname(), avail))
    est = estimate_peak_memory(conf, processes=processes, masters=masters)
    per_rank = []
    for host, node_avail in info:
        if node_avail is not None:
            share = sum(1 for h, _ in info if h == host)
            per_rank.append((node_avail / share, node_avail, share))
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
    what = ("estimated peak memory %s per process (model of docs/scaling.md for %s^3, %s) exceeds "
            "the %s available per rank (%s on the node for %d rank%s)"
            % (_gb(est), "x".join(map(str, conf.nc)) if len(set(conf.nc)) > 1 else conf.nc[0],
               conf.dtype, _gb(budget), _gb(node_avail), share, "s" if share > 1 else ""))
    if processes == 1:
        hint = ("the placement backend holds every slice in this one process; use the hvd "
                "backend on more ranks/nodes or a smaller --nc")
    else:
        best = smallest_rank_count(conf, budget, masters=masters)
        hint = ("the smallest rank count that fits at %s per rank is %d (grid %dx%d, on more "
                "nodes)" % (_gb(budget), best[0], *best[1]) if best else
                "no rank count fits%s; use a smaller --nc" % (
                    " (the full-size master copies alone need %s per rank)"
                    % _gb(estimate_peak_memory(conf, n_ranks=1, masters=True)
                          - estimate_peak_memory(conf, n_ranks=1, masters=False))
                    if masters else ""))
    message = "%s; %s; --force skips this check" % (what, hint)
    if force:
        log.warning("--force: %s", message)
        return result
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
    from . import linear_power

    L = float(np.mean(conf.box_size))
    cell = float(np.mean(conf.cell_size))
    k = np.logspace(np.log10(2 * np.pi / L), np.log10(np.pi / cell), 512)
    pk = linear_power.linear_matter_power(conf.cosmology, k)
    return float(np.sqrt(np.trapz(pk, k) / (2 * np.pi**2) / 3.0)) / cell


def check_numerics(conf, stages=None):
    """Reject inputs the floating-point type cannot resolve (no silent wrong result).

    Positions are stored in cells relative to their block (x, y) or the box (z),
    so their float spacing is that of the largest coordinate. The initial
    displacement :math:`D_1(a_{start})\\sigma_\\psi` must exceed
    :data:`MIN_DISPLACEMENT_ULPS` spacings, and the smallest per-step move
    :math:`\\Delta D_1 \\sigma_\\psi` :data:`MIN_STEP_ULPS` spacings.

    Parameters
    ----------
    conf : SimConfig
    stages : array_like, optional
        Scale factors of the steps (default: ``conf.a_start .. conf.a_end``
        linearly in ``conf.n_steps`` steps).

    Raises
    ------
    ConfigError
        Naming the value that would work.
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
    if ulps < MIN_DISPLACEMENT_ULPS:
        # D1 ~ a early on: the a_start that gives MIN_DISPLACEMENT_ULPS.
        a_min = stages[0] * MIN_DISPLACEMENT_ULPS / ulps
        raise ConfigError(
            "a_start=%g is below what %s resolves: the initial displacements (rms %.2g cells) are "
            "%.2g of the %.2g-cell spacing of the positions and would be rounded away; use "
            "--a-start >= %.2g or --dtype float64" % (stages[0], conf.dtype, d1[0] * psi,
                                                     ulps, spacing, a_min))
    step = np.diff(d1) * psi / spacing
    if step.size and step.min() < MIN_STEP_ULPS:
        n_max = int(conf.n_steps * step.min() / MIN_STEP_ULPS)
        raise ConfigError(
            "%d steps are too many for %s: a particle moves %.2g of the %.2g-cell position "
            "spacing per step (rms) and the drift would be lost to rounding; use --steps <= %d "
            "or --dtype float64" % (len(step), conf.dtype, step.min(), spacing, max(n_max, 1)))


# ----------------------------------------------------------------------------- graph size
def unfolded_zeros_initializer():
    """A zeros initializer TensorFlow cannot constant-fold into a full-size constant.

    ``tf.zeros_initializer()`` gives a ``Fill`` of constants, which Grappler's
    constant folding turns into one ``Const`` of the full variable at the first
    run; beyond 2 GB it cannot be serialised (``Cannot parse tensor from proto
    ... Initializer/zeros``, seen at 1024^3 on one rank). Filling with a
    ``placeholder_with_default`` keeps it a ``Fill`` computed at run time.
    """
    import tensorflow.compat.v1 as tf

    def init(shape, dtype=tf.float32, partition_info=None):
        zero = tf.placeholder_with_default(tf.zeros([], dtype), [], name="unfoldable_zero")
        return tf.fill(shape, zero)

    # Backends that initialise each slice on its own (hvd_mesh_impl.slice_init)
    # read this instead of evaluating the initializer on the full shape.
    init.fill_value = 0
    return init


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
