"""Buffer sizes of the particle decomposition, estimated from the cosmology.

The particle buffers of :mod:`flowpm_mtf.domain` have static shapes, so their
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
would work (:func:`flowpm_mtf.domain.error_from_tf`), and the jobs retry with
them. ``conf.capacity`` / ``conf.send_capacity`` override the estimates.

Everything here is numpy on the (frozen, hashable) :class:`~flowpm_mtf.config.
SimConfig`, cached per configuration; nothing builds a graph.
"""
import functools
import math

import numpy as np

from . import config as cfg
from . import cosmology as cm
from . import linear_power
from .linear_power import trapezoid


__all__ = ["CAPACITY_MARGIN", "CAPACITY_SIGMAS", "capacity", "send_capacity",
           "lpt_displacement_cells", "migration_rounds"]

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
    particle count, rounded up to a multiple of 64. Measured fullest blocks at
    a = 1 against this capacity: 1.07x the mean for 1.13x (200 Mpc/h, 64^3 on
    2x1), 1.04x for 1.13x (400x400x200 Mpc/h, 256x256x128 on 2x2), 1.26x for
    1.59x (64 Mpc/h, 128^3 on 2x2); the block counts fluctuate less than the
    linear sphere's (the blocks tile the box: their counts sum to the total).
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


@functools.lru_cache(maxsize=64)
def send_capacity(conf, displacement=None, lattice=False):
    """Rows of one send buffer (one neighbour, one migration round) [particles].

    ``conf.send_capacity`` if set; otherwise the particles of a face layer
    ``0.25 + 2 d`` cells deep (``d`` [cells]: ``displacement``, or the largest
    linear displacement of one step of ``conf``; ``0.75 + 2 d`` with
    ``lattice``, for particles leaving the lattice: those on a block's lower
    face cross it when displaced downwards) plus 64, bounded by
    :func:`capacity`. Measured at 200 Mpc/h / 32^3 on 2x2: about 1/40 of it
    used per step and 1/3 at the ICs.
    """
    if conf.send_capacity is not None:
        return conf.send_capacity
    sx, sy, nz = conf.block_shape
    if displacement is None:
        d1 = cm.D1(conf.cosmology, cfg.default_stages(conf))
        step = float(np.max(np.diff(d1)))
        displacement = step * _sigma_psi(conf) / min(conf.cell_size[:2])
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
