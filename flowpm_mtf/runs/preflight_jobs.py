"""Each job's own terms of the memory check: its large allocations, array by array.

A job's preflight passes one of these as ``extra`` to the memory model
(:func:`flowpm_mtf.runs.preflight_memory.memory_breakdown`) through :func:`check_job_memory`:
:func:`fft_demo_memory` (the FFT demo's fetched slices and full-size numpy reference),
:func:`lensing_memory` (the lens planes, the rays and the painting of a lens stage,
:func:`pgd_terms` with PGD; :func:`lensing_tensors` for the size check),
:func:`reconstruct_memory` (the reconstruction's fields and gradient tape).
Each term is counted from the sizes of the arrays the job's code allocates, with the
copies it makes (the lensing stage's working set and PGD's mesh work are measured:
``scripts/bench_lensing_memory.py``), and comes with the advice of a value of its option
that fits.

Re-exported by :mod:`flowpm_mtf.runs.preflight`, the name the callers use.
"""
import math
from fractions import Fraction

from .preflight_memory import (Term, _ceil, check_memory, check_sizes, estimate_peak_memory,
                               memory_terms)

__all__ = ["FFT_REFERENCE_BYTES_PER_CELL", "FFT_WORKING_ITEMSIZES_PER_CELL",
           "LENSING_BYTES_PER_RAY_MAP", "LENSING_BYTES_PER_RAY_FFT", "LENSING_RAY_TERM_ITEMSIZES",
           "LENSING_RAY_TERM_ITEMSIZES_PER_SOURCE", "LENSING_STAGE_BYTES_PER_SLOT",
           "PGD_BYTES_PER_SLOT", "PGD_BYTES_PER_PADDED_CELL", "pgd_terms", "RECON_VARIABLE_FIELDS",
           "RECON_FETCHED_FIELDS", "RECON_TAPE_VALUES_PER_SLOT", "fft_demo_memory",
           "lensing_memory", "lensing_tensors", "reconstruct_memory", "check_job_memory"]


# ----------------------------------------------------------------------------- job terms
# Each job's own large allocations, counted array by array (sizes of arrays the job's code
# allocates, with the copies it makes; those whose comment says "Measured" are set from peaks):
#: FFT demo: the full-size numpy reference on every rank: the field (itemsize), np.fft.fftn
#: (complex128) and its normalised copy, the stored-order copy, |ref| (float64) [bytes/cell
#: over the itemsize].
FFT_REFERENCE_BYTES_PER_CELL = 16 + 16 + 16 + 8
#: FFT demo: the TensorFlow working set of the distributed round trip beyond the fetched
#: slices [itemsizes per cell of the rank]. The memory model's per-cell constant is 0 (its
#: fit puts the simulation's mesh work into the slots), so it is set from fft-demo's peak
#: memory (summary.json) beyond the counted arrays: 2 itemsizes per cell cover the rest.
FFT_WORKING_ITEMSIZES_PER_CELL = 2
#: Lensing maps [src, npix, npix]: the einsum term, the running sum and its all-reduce in
#: TF (3 itemsize), the fetched copy (itemsize) and its float64 copy; per map the flat-sky
#: power spectrum's FFT (complex128), |.|^2 and the ell and bin arrays (8 + 8 + 8).
LENSING_BYTES_PER_RAY_MAP = 8
LENSING_BYTES_PER_RAY_FFT = 16 + 8 + 8 + 8 + 8
#: Lensing, per plane and block on the ray grid [itemsizes per ray pixel]:
#: :func:`flowpm_mtf.physics.lensing.ray_born_terms`' counts, their normalisation and the
#: mean-subtracted term; per source, its term times the Born coefficient and the running
#: sum it is added to (counted, every plane: an upper bound of a stage's planes).
LENSING_RAY_TERM_ITEMSIZES = 3
LENSING_RAY_TERM_ITEMSIZES_PER_SOURCE = 2
#: Lensing, per particle slot of the block [bytes, float32]: the working set of a lens
#: stage beyond the simulation's (which the base model's slots count): the rays' CIC of
#: every particle (:func:`flowpm_mtf.physics.lensing.ray_born_terms`: the shell mask, the
#: two ray coordinates, four corner weights and int32 corner indices, the stacked
#: ``[n, 4, 4]`` scatter indices: about 240 B counted) and the mesh plane's painting
#: (:func:`flowpm_mtf.physics.lensing.density_plane`). Measured: the largest of (peak -
#: the estimate without it) / slots over the flat ``--no-pgd`` runs of
#: ``scripts/bench_lensing_memory.py`` (``fit``: 64^3 and 128^3 on 1 and 2 ranks, 128 and
#: 256 rays), raised by the spread between the ranks of one run (5 %).
LENSING_STAGE_BYTES_PER_SLOT = 300
#: With PGD (:mod:`flowpm_mtf.jobs.lensing_pgd`), per particle slot [bytes, float32],
#: counted: the corrected positions, their clipped copy and the displacement read out at
#: the particles (3 float32 components each).
PGD_BYTES_PER_SLOT = 3 * 3 * 4
#: With PGD, per padded cell of the block [bytes, float32]: the painted density, its FFT
#: (complex), the filtered potential and its three gradient fields, and the second P(k)
#: (the corrected particles' painted density and FFT). Measured: the largest of (peak -
#: the estimate without it) / padded cells over the ``--pgd`` runs of
#: ``scripts/bench_lensing_memory.py`` (``fit``: 128^3 and the 256^3 survey on 2 ranks),
#: rounded up. The survey's row holds 8 seeds (each run's peak is kept in
#: ``results/bench_lensing_memory.json``): the peak differs from seed to seed (how many
#: particles each exchange moves, so the sizes the allocator sees), and the largest sets
#: this term.
PGD_BYTES_PER_PADDED_CELL = 112


def pgd_terms(c, blocks):
    """The :class:`Term` of the PGD correction of a lensing stage (either sky) on the blocks
    of ``c`` [bytes]: :data:`PGD_BYTES_PER_SLOT` and :data:`PGD_BYTES_PER_PADDED_CELL`."""
    slots, cells = memory_terms(c)
    nbytes = ((PGD_BYTES_PER_SLOT * slots + PGD_BYTES_PER_PADDED_CELL * cells)
              * Fraction(c.np_dtype.itemsize, 4) * blocks)
    return [Term("the PGD correction (%d slots, %d padded cells per block)" % (slots, cells),
                 _ceil(Fraction(nbytes)), True)]


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


def lensing_memory(conf, n_planes, n_source, npix, pgd=False):
    """``extra`` for :func:`check_memory` of the lensing job: the lens planes (variables,
    fetched float64 copies), the rays (the ``[src, npix, npix]`` maps, replicated on every
    rank, and every plane's per-block term on the ray grid,
    :func:`flowpm_mtf.physics.lensing.ray_born_terms`) and the painting of a lens stage
    (:data:`LENSING_STAGE_BYTES_PER_SLOT`; with ``pgd``, the PGD correction,
    :func:`pgd_terms`)."""
    isz = conf.np_dtype.itemsize
    nx, ny = int(conf.nc[0]), int(conf.nc[1])

    def rays(npix_, blocks=1):
        maps = npix_ * npix_ * (n_source * (4 * isz * blocks + LENSING_BYTES_PER_RAY_MAP)
                                + LENSING_BYTES_PER_RAY_FFT)
        terms = (n_planes * npix_ * npix_ * isz * blocks
                 * (LENSING_RAY_TERM_ITEMSIZES + LENSING_RAY_TERM_ITEMSIZES_PER_SOURCE * n_source))
        return maps + terms

    def extra(c, blocks, masters):
        sx, sy = int(c.block_shape[0]), int(c.block_shape[1])
        slots, _ = memory_terms(c)
        scale = Fraction(isz, 4)

        def advise(room, budget):
            n = _largest(lambda k: rays(k, blocks) <= room, npix)
            return "--field-npix %d or less" % n if n else None

        terms = [Term("the lensing rays (%d source map%s of %d^2 pixels and the ray-grid "
                      "terms of %d planes)" % (n_source, "s" if n_source > 1 else "", npix,
                                               n_planes), rays(npix, blocks),
                      False, "a smaller --field-npix", advise),
                 Term("the %d lens planes" % n_planes, n_planes * sx * sy * (isz + 8) * blocks,
                      True),
                 Term("the painting of a lens stage (%d slots per block)" % slots,
                      _ceil(Fraction(LENSING_STAGE_BYTES_PER_SLOT) * slots * scale * blocks),
                      True)]
        if pgd:
            terms += pgd_terms(c, blocks)
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

