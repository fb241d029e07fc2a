"""Buffer sizes of the particle decomposition, estimated from the cosmology.

The particle buffers of :mod:`flowpm_mtf.mesh.domain` have static shapes, so their
sizes are fixed before the graph is built, from the configuration and the linear
theory of its cosmology:

* :func:`capacity`: particle slots per block [particles]: the lattice count
  grown by the linear density contrast of a block-sized top-hat sphere at
  ``a_end``;
* :func:`send_capacity`: rows of one send buffer [particles]: the particles of
  a face layer a few cells deep plus the linear displacement per step;
* :func:`migration_rounds` and :func:`lpt_displacement_cells`: rounds that cover
  the LPT displacement.

All are conservative estimates, not bounds: an overflow is caught by the
migration's check before anything is lost and reported with the values that
would work (:func:`flowpm_mtf.mesh.domain.error_from_tf`), and the jobs retry with
them. A lagrangian run whose particles left the halo gets the halo that would
cover them (:func:`lagrangian_escape_error`).

The migration itself knows no cosmology: the graph builders compute the sizes
here, from the run's own stages, and pass them to it. ``conf.capacity`` /
``conf.send_capacity`` override the estimates.

Everything here is numpy on the (frozen, hashable) :class:`~flowpm_mtf.config.
SimConfig`, cached per configuration; nothing builds a graph.
"""
import functools
import math

import numpy as np

from .. import config as cfg
from . import cosmology as cm
from . import linear_power
from ..errors import ParticleEscapeError
from .linear_power import trapezoid


__all__ = ["CAPACITY_MARGIN", "CAPACITY_SIGMAS", "HALO_HINT_MARGIN_CELLS", "capacity",
           "send_capacity", "step_displacement_cells", "lpt_displacement_cells",
           "migration_rounds", "lagrangian_halo", "lagrangian_escape_error"]

CAPACITY_MARGIN = 1.05
"""Capacity of a block over its lattice count with no density contrast (:func:`capacity`)."""
CAPACITY_SIGMAS = 4.0
"""Largest number of linear density rms a block's capacity covers (:func:`capacity`)."""



@functools.lru_cache(maxsize=64)
def _sigma_psi(conf):
    """1D rms linear displacement at a = 1 [Mpc/h], from the box's modes (k_f .. k_Nyquist)."""
    kmin = 2 * np.pi / max(conf.box_size)
    kmax = np.pi / min(conf.cell_size) * np.sqrt(3.0)
    k = np.logspace(np.log10(kmin), np.log10(kmax), 512)
    pk = linear_power.linear_matter_power(conf.cosmology, k)
    return float(np.sqrt(trapezoid(pk, k) / (6 * np.pi**2)))


@functools.lru_cache(maxsize=64)
def _sigma_block(conf, a):
    """Linear density rms of a top-hat sphere with a block's volume at ``a``."""
    volume = float(np.prod(conf.block_shape) * np.prod(conf.cell_size))
    radius = (3 * volume / (4 * np.pi))**(1.0 / 3.0)
    c = conf.cosmology
    sig = linear_power.sigma_r(c, radius) / linear_power.sigma_r(c, 8.0) * c.sigma8
    return float(sig * cm.D1(c, np.array([a]))[0])


@functools.lru_cache(maxsize=64)
def capacity(conf):
    """Particle slots per block [particles].

    ``conf.capacity`` if set; the lattice count ``sx sy nz`` for the lagrangian
    decomposition or a single block; otherwise the lattice count times
    ``1.05 + k sigma``, with ``sigma`` the linear density rms of a sphere with a
    block's volume at ``conf.a_end`` and ``k = min(4, sqrt(2 ln B))`` for ``B``
    blocks (about the expected largest of B Gaussian draws), bounded by the total
    particle count, rounded up to a multiple of 64. The fullest block at a = 1 stays
    below this capacity with a margin: the block counts fluctuate less than the linear
    sphere's (the blocks tile the box: their counts sum to the total), and an overflow
    is detected and retried with a larger capacity.
    An underestimate is caught before any loss and retried with a larger one.
    """
    # exact Python ints (SimConfig's counts are numpy products, which wrap beyond 2^63)
    npb = math.prod(int(n) for n in conf.block_shape)
    if conf.capacity is not None:
        return conf.capacity
    if conf.decomposition == "lagrangian" or conf.n_ranks == 1:
        return npb
    k = min(CAPACITY_SIGMAS, math.sqrt(2.0 * math.log(max(2, conf.n_ranks))))
    factor = CAPACITY_MARGIN + k * _sigma_block(conf, conf.a_end)
    return int(min(math.prod(int(n) for n in conf.nc), 64 * math.ceil(npb * factor / 64)))


def send_capacity(conf, displacement=None, lattice=False, stages=None):
    """Rows of one send buffer (one neighbour, one migration round) [particles].

    ``conf.send_capacity`` if set; otherwise the particles of a face layer
    ``0.25 + 2 d`` cells deep (``d`` [cells]: ``displacement``, or the largest
    linear displacement of one step of the run's ``stages``; ``0.75 + 2 d`` with
    ``lattice``, for particles leaving the lattice: those on a block's lower
    face cross it when displaced downwards) plus 64, bounded by
    :func:`capacity`. A step uses a small fraction of it, the ICs more (their
    displacement from the lattice is the largest); an overflow is detected and retried.

    The migration (:func:`flowpm_mtf.mesh.domain.migrate`) takes this number as an
    argument: the graph builders compute it once, from the stages they run.

    Parameters
    ----------
    conf : SimConfig
    displacement : float, optional
        Largest displacement the buffer serves [cells]; default: that of the
        longest step of ``stages`` (the linear rms displacement times the step's
        growth ``D1(a_{i+1}) - D1(a_i)``).
    lattice : bool
        The particles leave their lattice sites (the ICs' migration).
    stages : array_like, optional
        The run's stages [scale factor], increasing; default
        :func:`flowpm_mtf.config.default_stages`. Ignored with ``displacement``.

    Returns
    -------
    int
        Rows of one send buffer [particles].
    """
    if conf.send_capacity is not None:
        return conf.send_capacity
    if displacement is None:
        stages = cfg.default_stages(conf) if stages is None else stages
        displacement = step_displacement_cells(conf, tuple(float(a) for a in np.ravel(stages)))
    return _send_capacity(conf, float(displacement), bool(lattice))


@functools.lru_cache(maxsize=64)
def step_displacement_cells(conf, stages):
    """Estimated largest linear displacement of one step of ``stages`` [cells].

    Parameters
    ----------
    conf : SimConfig
    stages : tuple of float
        Increasing scale factors [dimensionless]; one stage (no step): 0.

    Returns
    -------
    float
        The 1D rms linear displacement at a = 1 times the largest growth
        ``D1(a_{i+1}) - D1(a_i)`` of a step, over the smaller cell side in
        x, y [cells].
    """
    if len(stages) < 2:
        return 0.0
    d1 = cm.D1(conf.cosmology, np.asarray(stages, dtype=np.float64))
    step = float(np.max(np.diff(d1)))
    return step * _sigma_psi(conf) / min(conf.cell_size[:2])


@functools.lru_cache(maxsize=64)
def _send_capacity(conf, displacement, lattice):
    sx, sy, nz = conf.block_shape
    face = max(sx, sy) * nz
    depth = (0.75 if lattice else 0.25) + 2.0 * displacement
    return int(min(capacity(conf), 64 + math.ceil(face * depth)))


@functools.lru_cache(maxsize=64)
def lpt_displacement_cells(conf, a):
    """Estimated largest LPT displacement at ``a`` [cells]: 6 linear rms."""
    d1 = float(cm.D1(conf.cosmology, np.array([a]))[0])
    return 6.0 * d1 * _sigma_psi(conf) / min(conf.cell_size[:2])


def migration_rounds(conf, displacement):
    """Migration rounds (one block each) for a displacement [cells]: ``1 + d // block``."""
    sx, sy, _ = conf.block_shape
    return 1 + int(displacement // min(sx, sy))


#: Cells a lagrangian halo hint adds to the estimated largest displacement (6 linear rms at
#: ``a_end``, :func:`lpt_displacement_cells`; the largest of 10^6-10^9
#: Gaussian draws is 4.9-6.1 rms): the CIC stencil's cell and one of margin.
HALO_HINT_MARGIN_CELLS = 2


def lagrangian_halo(conf):
    """The halo a lagrangian run of ``conf`` needs [cells], and the displacement it covers.

    A particle may move ``halo_size - 1`` cells away from its block (its CIC
    stencil then still fits, :mod:`flowpm_mtf.physics.painting`): the halo covers the
    estimated largest displacement of the run, ``d =``
    :func:`lpt_displacement_cells` at ``a_end`` (6 linear rms),
    plus :data:`HALO_HINT_MARGIN_CELLS`.

    Returns
    -------
    (int, float)
        Halo [cells], largest displacement [cells].
    """
    d = float(lpt_displacement_cells(conf, conf.a_end))
    return int(math.floor(d)) + HALO_HINT_MARGIN_CELLS, d


def lagrangian_escape_error(exc, conf):
    """The :class:`~flowpm_mtf.errors.ParticleEscapeError` of a lagrangian run whose
    particles left the halo, with a halo that covers the run's displacement (not merely a
    larger one); None for another error or decomposition.

    Parameters
    ----------
    exc : Exception
        Typically ``tf.errors.InvalidArgumentError`` from a session run (the paint's
        ``particles escaped`` check, :mod:`flowpm_mtf.physics.painting`).
    conf : SimConfig

    Returns
    -------
    ParticleEscapeError or None
        With the halo of :func:`lagrangian_halo` (or, if no halo of this grid holds
        it, the eulerian decomposition and a grid of fewer ranks that would).
    """
    if conf.decomposition != "lagrangian" or "particles escaped" not in str(
            getattr(exc, "message", exc)):
        return None
    h = conf.halo_size
    need, d = lagrangian_halo(conf)
    if need <= h:
        # the estimate was already covered: this run moved farther than linear theory says
        need = max(need, 2 * h + 1)
    limit = min(conf.block_shape[:2]) - 1
    what = ("particles moved beyond the %d-cell halo of their block during the N-body (their "
            "CIC stencil left the padded block; the largest displacement of this run is "
            "estimated at %.1f cells)" % (h, d))
    if need <= limit:
        hint = ("rerun with --halo %d (at most %d on this grid), or --decomposition eulerian "
                "(no limit on the displacement)" % (need, limit))
    else:
        fewer = _grid_with_room(conf, need)
        hint = ("no --halo surely suffices on this grid (the estimate needs %d; the blocks allow "
                "--halo %d at most, which may fall short): rerun with --decomposition eulerian "
                "(no limit on the displacement)%s" % (
                    need, limit, "" if fewer is None else
                    ", or on %d rank%s with --grid %dx%d --halo %d" % (
                        fewer[0] * fewer[1], "s" if fewer[0] * fewer[1] > 1 else "",
                        fewer[0], fewer[1], need)))
    return ParticleEscapeError("%s; %s" % (what, hint))


def _grid_with_room(conf, halo):
    """The grid of the most ranks (fewer than ``conf``'s) whose blocks hold ``halo``, or None."""
    for n in range(conf.n_ranks - 1, 0, -1):
        q = math.isqrt(n)
        while n % q:
            q -= 1
        try:
            conf.replace(grid=(n // q, q), halo_size=halo, capacity=None, send_capacity=None)
        except ValueError:
            continue
        return (n // q, q)
    return None
