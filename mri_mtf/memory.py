r"""The imaging job's estimated peak memory per rank, part by part (its preflight's model).

Counted from the arrays the job's code allocates, with three measured constants (the
TensorFlow runtime's ``RUNTIME_MB`` of :mod:`flowpm_mtf.runs.preflight_memory`, the
graph's per block and the backward pass's blocks), for a rank holding
``N = (nx / P)(ny / Q) nz`` voxels of itemsize ``s`` (4 for float32, 8 for float64):

the sampling mask
    :func:`mri_mtf.sampling.mask_numpy` builds the whole ``ny x nz`` phase-encode plane on
    every rank (float64 radii, draws, weights, keys and two argsorts at once, then the
    0/1 plane, its stored-order copy and the graph constant):
    :data:`MASK_BYTES_PER_POSITION` ``+ 2 s`` per position. Does not shrink with more
    ranks.
the data and the images
    The measured k-space variable (2 real channels), the TV state (``x``, ``z``, ``u``:
    7 complex fields as 14 real channels, with ``tv``), the truth and one magnitude per
    method fetched at the end, and their float32/float64 copies for the HDF5 file:
    :data:`DATA_ITEMSIZES` ``+ 14 [tv] + 2 (1 + methods)`` itemsizes per voxel. With
    ``n`` coils (``--coils``): the data ``n`` times, the coil maps (``2 n``), TV-SENSE's
    state (``x``, ``xbar``, 3 duals: 10, the coil k-space dual: ``2 n``) instead of
    ADMM's 14 (counted; at 96^3 with 8 coils the runs of ``scripts/bench_tv_sense.py``
    peaked at 1259 / 965 / 771 MB on 1 / 2 / 4 ranks, the model gives 1246 / 980 / 846;
    the whole job at 32^3 on 2 ranks with 8 coils and 100 training steps peaked at
    823 MB, the model gives 867). With the coils split over ``K`` ranks
    (``--coil-split K``) every coil array counts the rank's ``n / K`` coils; the images
    are whole on each of the ``K`` ranks.
the transforms
    A distributed 3D FFT of a complex field holds the field, its pencil transposes and
    the all-to-all buffers: :data:`FFT_ITEMSIZES` itemsizes per voxel, live during
    every phase (data, zero-filled, an ADMM iteration, a data-consistency step); with
    ``n`` coils one batched transform of the ``n`` coil fields, ``n`` times as much (and the
    data-consistency step's fields and the training sample's noise ``n`` times; not
    measured with coils).
the training's activations
    Per unrolled block, what the gradient keeps: the CNN's three convolutions with
    their blocks, halos (``p = (sx + 2h)(sy + 2h)(nz + 2h) / N`` with ``h = f // 2``),
    biases and ReLUs, ``C (3 + 3 p)`` itemsizes per voxel for the ``C`` hidden
    channels, :data:`CNN_EDGE_ITEMSIZES` ``+ p`` for the two-channel input and
    output; and the data-consistency step's complex fields
    (:data:`DC_ITEMSIZES`). Plus the training sample (fed phantom, its k-space, the
    mixes of the 4 noise fields: :data:`SAMPLE_ITEMSIZES`) and the backward pass's
    gradients, :data:`BACKWARD_BLOCKS` blocks' worth (measured). Without training: the
    evaluation's forward pass, one block at a time.
the graph
    :data:`GRAPH_MB_PER_BLOCK` per unrolled block (measured). Does not shrink.
the network's weights
    Replicated on every rank: ``W = f^3 (2C + C^2 + 2C) + 2C + 2 + K`` values, as the
    float64 numpy initial values, the graph constant's copies, the variable, Adam's two
    moments, the gradient and its allreduce and Adam's temporaries: ``8 +``
    :data:`WEIGHT_ITEMSIZES` ``s`` bytes per value. Does not shrink with more
    ranks (the advice names the ``--channels`` that fits).

``tests/test_imaging_safety.py`` checks the model against the peak RSS of runs (the
numbers are in docs/imaging.md, "Bad input and limits").
"""
import math

from flowpm_mtf.runs.preflight_memory import (MAX_RANKS, MAX_TENSOR_ELEMENTS, RUNTIME_MB, Term,
                                              _ceil, _fraction)

__all__ = ["MASK_BYTES_PER_POSITION", "DATA_ITEMSIZES", "FFT_ITEMSIZES", "CNN_EDGE_ITEMSIZES",
           "DC_ITEMSIZES", "SAMPLE_ITEMSIZES", "BACKWARD_BLOCKS", "WEIGHT_ITEMSIZES",
           "GRAPH_MB_PER_BLOCK", "MAX_CONSTANT_BYTES", "weight_count", "imaging_terms",
           "check_sizes", "check_constants", "smallest_grid", "hint"]

#: The mask's numpy arrays live at once per phase-encode position [bytes]: radius, draw,
#: weight, key (float64), two argsort outputs (int64), the chosen flags (bool), then the
#: 0/1 plane and its stored copy (float64); the graph constant adds 2 itemsizes.
MASK_BYTES_PER_POSITION = 8 * 6 + 1 + 8
#: The measured k-space variable (2 real channels) and the complex data read from it.
DATA_ITEMSIZES = 2 + 2
#: A distributed complex 3D FFT: the field (2), the transposed pencils and the all-to-all
#: send and receive buffers (2 each), the result (2).
FFT_ITEMSIZES = 2 * 5
#: Per block and voxel, the CNN's two-channel tensors the gradient keeps: the input, its
#: blocks, the last convolution's output, its bias sum and the residual (2 channels each).
CNN_EDGE_ITEMSIZES = 2 * 5
#: Per block and voxel, the data-consistency step's complex fields the gradient keeps: the
#: image as complex, A x, A x - y, A^H of it, the step (2 itemsizes each), the FFTs' own.
DC_ITEMSIZES = 2 * 5 + FFT_ITEMSIZES
#: The training sample per voxel: the fed phantom (1), its k-space (2), the 4 noise fields
#: (1 each), their mix (2 per field: 8) and the complex noise (2).
SAMPLE_ITEMSIZES = 1 + 2 + 4 + 8 + 2
#: The backward pass's gradients at the training's peak, in blocks' worth of the
#: activations above (measured: the counted arrays of the K = 4 blocks give 427 itemsizes
#: per voxel at 128^3 on 2 ranks where the peak RSS grows by 676; 4 blocks more of them
#: match the runs of 32^3 to 128^3, docs/imaging.md).
BACKWARD_BLOCKS = 4
#: Copies of each weight besides its float64 initial value: at the graph build its cast,
#: the constant's tensor proto in the Python graph, in the C++ graph and in the session's
#: executor graph (4, with the proto's serialisation 6); at the first step the constant's
#: value, the variable, Adam's m and v, the gradient and its allreduce result, and Adam's
#: update temporaries (8).
WEIGHT_ITEMSIZES = 14
#: The graph's own memory per unrolled block [MB]: the evaluated network and the training's
#: forward and backward operations of one block, in Python, in the C++ graph and in the
#: executor (measured, like the runtime's: the RSS after the graph build grows by 27-29 MB
#: from 4 to 8 blocks, at 32^3 and 64^3 alike).
GRAPH_MB_PER_BLOCK = 7
#: Largest TensorFlow constant (a tensor proto is limited to 2 GB): the initial filters
#: are constants of the graph.
MAX_CONSTANT_BYTES = 2**31 - 1


def weight_count(uconf):
    """Values of the network's weights ``W = f^3 (2C + C^2 + 2C) + 2C + 2 + K`` (exact)."""
    c, f = int(uconf.channels), int(uconf.kernel_size)
    return f**3 * (2 * c + c * c + 2 * c) + 2 * c + 2 + int(uconf.blocks)


def _weight_bytes(uconf, itemsize):
    return weight_count(uconf) * (8 + WEIGHT_ITEMSIZES * itemsize)


def _pad_ratio(conf, f):
    """``(sx + 2h)(sy + 2h)(nz + 2h) / N`` as an exact fraction (``h = f // 2``)."""
    sx, sy, nz = (int(n) for n in conf.block_shape)
    h = int(f) // 2
    return _fraction((sx + 2 * h) * (sy + 2 * h) * (nz + 2 * h)) / (sx * sy * nz)


def _volume_itemsizes(conf, uconf, methods):
    """Itemsizes per voxel of the rank's block at the peak (exact fraction)."""
    n = int(getattr(conf, "coils", 1))
    if n == 1:
        tv = 14
        dc, sample = DC_ITEMSIZES, SAMPLE_ITEMSIZES
    else:   # SENSE: the coil maps; TV-SENSE's x, xbar, 3 duals and the coil k-space dual
        n //= int(getattr(conf, "coil_split", 1))   # the coil arrays: this rank's coils
        tv = 10 + 2 * n
        dc = (DC_ITEMSIZES - FFT_ITEMSIZES) * n + FFT_ITEMSIZES * n
        sample = 1 + (SAMPLE_ITEMSIZES - 1) * n
    data = DATA_ITEMSIZES * n + (2 * n if n > 1 else 0) + (tv if "tv" in methods else 0) \
        + 2 * (1 + len(methods))
    work = FFT_ITEMSIZES * n
    if "unrolled" in methods:
        c, k = int(uconf.channels), int(uconf.blocks)
        p = _pad_ratio(conf, uconf.kernel_size)
        cnn = c * (3 + 3 * p) + CNN_EDGE_ITEMSIZES + p
        if uconf.train_steps:
            work = max(work, (k + BACKWARD_BLOCKS) * (cnn + dc) + sample)
        else:
            work = max(work, 2 * cnn + dc)
    return data + work


def imaging_terms(conf, uconf, methods, advice=True):
    """The estimated peak memory of one rank, part by part (module docstring).

    Parameters
    ----------
    conf : ImagingConfig
    uconf : UnrolledConfig
    methods : sequence of str
        The methods run (``"zero-filled"``, ``"tv"``, ``"unrolled"``).
    advice : bool
        Attach the weights' advice (a ``--channels`` that fits).

    Returns
    -------
    list of flowpm_mtf.runs.preflight_memory.Term
        [bytes per rank, exact ints].
    """
    s = int(conf.np_dtype.itemsize)
    cells = math.prod(int(n) for n in conf.block_shape)
    ny, nz = int(conf.nc[1]), int(conf.nc[2])
    terms = [Term("the TensorFlow/Horovod runtime", _ceil(_fraction(RUNTIME_MB) * 2**20), False),
             Term("the sampling mask (the whole %d x %d phase-encode plane on every rank)"
                  % (ny, nz), ny * nz * (MASK_BYTES_PER_POSITION + 2 * s), False,
                  "a smaller --nc"),
             Term("the volume's arrays (%d voxels per rank: data, images, transforms%s)"
                  % (cells, ", the network's activations" if "unrolled" in methods else ""),
                  _ceil(_volume_itemsizes(conf, uconf, methods) * cells * s), True)]
    if "unrolled" in methods:
        terms.append(Term("the graph of the %d unrolled blocks" % uconf.blocks,
                          GRAPH_MB_PER_BLOCK * 2**20 * int(uconf.blocks), False,
                          "fewer --blocks"))
        terms.append(Term("the network's weights (%d values: %d channels, %d^3 filters) and "
                          "Adam's state, on every rank" % (weight_count(uconf), uconf.channels,
                                                            uconf.kernel_size),
                          _weight_bytes(uconf, s), False, "fewer --channels",
                          _channel_advice(conf, uconf, methods) if advice else None))
    return terms


def _channel_advice(conf, uconf, methods):
    """``advise(room, budget)``: the most channels whose whole estimate (weights and
    activations) fits ``budget`` on this grid."""
    def total(c):
        u = uconf.__class__(**dict(uconf.to_dict(), channels=c))
        return sum(t.nbytes for t in imaging_terms(conf, u, methods, advice=False))

    def advise(room, budget):
        lo, hi = 0, int(uconf.channels)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if total(mid) <= budget:
                lo = mid
            else:
                hi = mid - 1
        return "--channels %d or less" % lo if lo else None

    return advise


def check_sizes(conf, uconf, methods):
    """Raise ``ValueError`` for a tensor no TensorFlow shape can count (before the memory
    check computes with its size): the volume and the network's hidden activations count
    their elements in int64 (at most ``2^63 - 1``)."""
    n = math.prod(int(x) for x in conf.nc)
    checks = [("the volume %s" % "x".join(map(str, conf.nc)), 2 * n, "--nc")]
    if "unrolled" in methods:
        c, f = int(uconf.channels), int(uconf.kernel_size)
        checks += [("the hidden activations (%d channels)" % c, n * c, "--channels"),
                   ("the filters (%d channels)" % c, f**3 * c * c, "--channels")]
    for what, count, opt in checks:
        if count > MAX_TENSOR_ELEMENTS:
            raise ValueError("%s would hold %.3g elements, beyond the 2^63-1 a TensorFlow "
                             "shape can count; use a smaller %s" % (what, float(count), opt))


def check_constants(conf, uconf, methods):
    """Raise ``ValueError`` if the initial filters exceed a graph constant's 2 GB (after
    the memory check: on a node with the memory for them)."""
    if "unrolled" not in methods:
        return
    c, f, s = int(uconf.channels), int(uconf.kernel_size), int(conf.np_dtype.itemsize)
    nbytes = f**3 * c * c * s
    if nbytes > MAX_CONSTANT_BYTES:
        raise ValueError("the initial filters of %d channels (%d^3 x %d x %d values, %.3g GB) "
                         "exceed the 2 GB a TensorFlow graph constant holds; use fewer "
                         "--channels" % (c, f, c, c, nbytes / 2**30))


def _divisors(n):
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def smallest_grid(conf, uconf, methods, budget, fits_kernel=None):
    """The smallest rank count and grid whose estimate fits ``budget`` bytes per rank.

    The grids ``(P, Q)`` that divide the volume (P divides nx and ny, Q divides ny and
    nz; at most ``MAX_RANKS`` ranks) and, where ``fits_kernel(conf)`` is given, fit the
    filter; the most square of the smallest rank count.

    Returns
    -------
    (int, (int, int)) or None
    """
    terms = imaging_terms(conf, uconf, methods)
    if sum(t.nbytes for t in terms if not t.shrinks) >= budget:
        return None
    nx, ny, nz = (int(n) for n in conf.nc)
    found = []
    for p in _divisors(math.gcd(nx, ny)):
        for q in _divisors(math.gcd(ny, nz)):
            if p * q > MAX_RANKS:
                break
            try:
                c = conf.replace(grid=(p, q))
            except ValueError:
                continue
            if fits_kernel is not None and not fits_kernel(c):
                continue
            if sum(t.nbytes for t in imaging_terms(c, uconf, methods)) <= budget:
                found.append((c.n_ranks, abs(p - q), (p, q)))
                break   # a larger q on this p only adds ranks
    if not found:
        return None
    n, _, grid = min(found)
    return n, grid


def hint(conf, uconf, methods, fits_kernel=None):
    """``hint(budget)`` for :func:`flowpm_mtf.runs.preflight_memory.check_estimate`."""
    def text(budget):
        terms = imaging_terms(conf, uconf, methods)
        best = smallest_grid(conf, uconf, methods, budget, fits_kernel)
        if best is not None:
            n, (p, q) = best
            split = int(getattr(conf, "coil_split", 1))
            return "it fits on %d ranks (-np %d --mesh-shape %dx%d%s)" % (
                n, n, p, q, " --coil-split %d" % split if split > 1 else "")
        fixed = [t for t in terms if not t.shrinks]
        worst = max(fixed, key=lambda t: t.nbytes)
        room = budget - (sum(t.nbytes for t in terms) - worst.nbytes)
        advice = worst.advise(room, budget) if worst.advise is not None else None
        if advice:
            return "no rank count fits: %s alone need %.1f GB per rank; use %s" % (
                worst.label, worst.nbytes / 2**30, advice)
        if worst.remedy and sum(t.nbytes for t in fixed) >= budget:
            return "no rank count fits: %s alone need %.1f GB per rank; use %s" % (
                worst.label, worst.nbytes / 2**30, worst.remedy)
        return "no process grid of the volume fits; use a smaller --nc"

    return text
