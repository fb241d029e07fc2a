"""Imaging configuration: a frozen, validated description of one MRI reconstruction
(:class:`ImagingConfig`) and the settings of its methods (:class:`TVConfig`,
:class:`UnrolledConfig`; numpy only, so the command line parses and checks them without
TensorFlow).

:class:`ImagingConfig` carries the attributes that the grid-level helpers of
:mod:`flowpm_mtf` read (``nc``, ``grid``, ``block_shape``, ``n_cells``,
``mesh_shape``, ``layout_rules``, dtypes), so the distributed FFT, the block
layout of :mod:`flowpm_mtf.mesh.halo` and the test harness take it in place of a
``SimConfig``. The layout is that of ``flowpm_mtf`` (:mod:`flowpm_mtf.layout`):
images ``[x, y, z]`` with ``x`` on mesh axis ``row`` and ``y`` on ``col``,
k-space ``[kx, ky, kz]`` with ``ky`` on ``row`` and ``kz`` on ``col``.

Every invalid value raises one ``ValueError`` whose message names it, before any
graph is built.
"""
import dataclasses
import logging
import math
from typing import Tuple

import numpy as np

from flowpm_mtf.layout import (BX, BY, COL, KY, KZ, ROW, X, Y)

__all__ = ["ImagingConfig", "DTYPES", "COIL", "COIL_AXIS", "TVConfig", "MAX_TV_ITERATIONS",
           "UnrolledConfig", "MAX_TRAIN_STEPS", "MAX_BLOCKS", "MAX_SEED"]

log = logging.getLogger(__name__)

DTYPES = {"float32": "complex64", "float64": "complex128"}
"""Real dtypes of an image and the complex dtypes of its k-space."""

COIL = "coil"
"""Name of the coil dimension of coil images and k-space (:mod:`mri_mtf.sense`)."""

COIL_AXIS = "coil_axis"
"""Name of the mesh axis the coil dimension is split over (``coil_split > 1``)."""


def _is_int(v):
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _is_number(v):
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


@dataclasses.dataclass(frozen=True)
class ImagingConfig:
    """One 3D MRI reconstruction problem on a process grid.

    Parameters
    ----------
    nc : int or 3-tuple of int
        Voxels along x, y, z [voxels]; an int means a cube ``N^3``.
    grid : 2-tuple of int
        Process grid ``(P, Q)``: x split over P ranks (mesh axis ``row``), y over Q
        ranks (``col``); z is never split. In k-space ``ky`` is on ``row`` and
        ``kz`` on ``col``, so P must divide ``nc[0]`` and ``nc[1]``, and Q must
        divide ``nc[1]`` and ``nc[2]``.
    acceleration : float
        Undersampling factor R >= 1 of the phase-encode plane ``(ky, kz)``:
        ``round(ny * nz / R)`` of its ``ny * nz`` positions are sampled (every
        readout ``kx`` of a sampled position) [dimensionless].
    centre_fraction : float
        Share of the samples spent on the fully sampled centre of the
        phase-encode plane (the positions nearest ``k = 0``), in (0, 1]
        [dimensionless].
    density_power : float
        Exponent ``d`` of the variable sampling density outside the centre,
        ``(1 - r / sqrt 2)^d + 1e-3`` with ``r`` the phase-encode radius in units
        of the Nyquist frequency (>= 0; 0 is uniform random) [dimensionless].
    noise_sigma : float
        Standard deviation of the complex Gaussian k-space noise, ``E|n|^2 =
        sigma^2`` per sample, in image intensity units (the transform is
        orthonormal, so it is also the noise per voxel of a fully sampled
        reconstruction) (>= 0) [phantom intensity].
    seed : int
        Seed of the sampling mask and the noise (the same on every grid), in
        ``[0, 2**63)``.
    dtype : {"float32", "float64"}
        Real dtype of images (k-space uses the matching complex dtype).
    volume : str
        The imaged object: ``"phantom"`` (Shepp-Logan), ``"mni152"`` (the MNI152 brain
        template of nilearn's wheel) or the path of a 3D NIfTI file
        (:mod:`mri_mtf.volume`; the file is checked by the job's preflight).
    coils : int
        Receive coils (>= 1): 1 is the single-coil ``A = M F``; more are birdcage
        coils and the SENSE operator (:mod:`mri_mtf.sense`).
    coil_split : int
        Ranks the coil dimension is split over (>= 1, dividing ``coils``): a third mesh
        axis, so the job runs on ``P * Q * coil_split`` ranks; 1 keeps the coils unsplit.

    Raises
    ------
    ValueError
        Naming the offending value (a grid that does not divide the volume, an
        impossible R, ...).
    """

    nc: Tuple[int, int, int] = (32, 32, 32)
    grid: Tuple[int, int] = dataclasses.field(default=(1, 1),
                                              metadata={"flags": ("--mesh-shape",)})
    acceleration: float = 4.0
    centre_fraction: float = 0.25
    density_power: float = 2.0
    noise_sigma: float = dataclasses.field(default=0.01, metadata={"flags": ("--noise",)})
    seed: int = 0
    dtype: str = "float32"
    volume: str = "phantom"
    coils: int = 1
    coil_split: int = 1

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen)
        nc = (self.nc,) * 3 if _is_int(self.nc) else self.nc
        if (not isinstance(nc, (tuple, list, np.ndarray)) or len(nc) != 3
                or not all(_is_int(n) for n in nc)):
            raise ValueError("nc must be an integer or 3 integers [voxels], got %r" % (self.nc,))
        nc = tuple(int(n) for n in nc)
        if min(nc) < 2:
            raise ValueError("nc must be >= 2 voxels per axis, got %r" % (nc,))
        set_("nc", nc)
        grid = self.grid
        if (not isinstance(grid, (tuple, list, np.ndarray)) or len(grid) != 2
                or not all(_is_int(g) for g in grid) or min(grid) < 1):
            raise ValueError("grid must be a pair of positive integers (P, Q), got %r" % (grid,))
        P, Q = (int(g) for g in grid)
        set_("grid", (P, Q))
        for n, p, what in ((nc[0], P, "nc[0] (x, split over P on 'row')"),
                           (nc[1], Q, "nc[1] (y, split over Q on 'col')"),
                           (nc[1], P, "nc[1] (ky, split over P on 'row' in k-space)"),
                           (nc[2], Q, "nc[2] (kz, split over Q on 'col' in k-space)")):
            if n % p:
                raise ValueError("grid %r does not divide the volume nc=%r: %s = %d is not a "
                                 "multiple of %d" % ((P, Q), nc, what, n, p))
        if self.dtype not in DTYPES:
            raise ValueError("dtype must be one of %s, got %r" % (", ".join(DTYPES), self.dtype))
        for name in ("acceleration", "centre_fraction", "density_power", "noise_sigma"):
            v = getattr(self, name)
            if not _is_number(v) or not np.isfinite(v):
                raise ValueError("%s must be a finite number, got %r" % (name, v))
            set_(name, float(v))
        if not _is_int(self.seed) or not 0 <= self.seed < 2**63:
            raise ValueError("seed must be an integer in [0, 2**63), got %r" % (self.seed,))
        set_("seed", int(self.seed))
        if not isinstance(self.volume, str) or not self.volume.strip():
            raise ValueError("volume must be phantom, mni152 or a NIfTI path, got %r"
                             % (self.volume,))
        if not _is_int(self.coils) or self.coils < 1:
            raise ValueError("coils must be an integer >= 1, got %r" % (self.coils,))
        set_("coils", int(self.coils))
        if not _is_int(self.coil_split) or self.coil_split < 1:
            raise ValueError("coil_split must be an integer >= 1, got %r" % (self.coil_split,))
        set_("coil_split", int(self.coil_split))
        if self.coils % self.coil_split:
            raise ValueError("coil_split %d does not divide coils %d: each rank of the coil "
                             "axis holds coils / coil_split coils" % (self.coil_split, self.coils))
        if not 0.0 < self.centre_fraction <= 1.0:
            raise ValueError("centre_fraction must be in (0, 1], got %r" % self.centre_fraction)
        if self.density_power < 0:
            raise ValueError("density_power must be >= 0, got %r" % self.density_power)
        if self.noise_sigma < 0:
            raise ValueError("noise_sigma must be >= 0, got %r" % self.noise_sigma)
        n_pe = nc[1] * nc[2]
        if not 1.0 <= self.acceleration <= n_pe:
            raise ValueError("acceleration R=%r must be in [1, %d] (the %d x %d phase-encode "
                             "positions of nc=%r)" % (self.acceleration, n_pe, nc[1], nc[2], nc))
        if self.n_centre < 1:
            raise ValueError("acceleration R=%r with centre_fraction=%r samples no centre "
                             "position of the %d x %d phase-encode plane: lower R or raise "
                             "centre_fraction" % (self.acceleration, self.centre_fraction,
                                                  nc[1], nc[2]))

    # ------------------------------------------------------------------ sampling
    @property
    def n_phase_encodes(self):
        """Positions of the phase-encode plane, ``ny * nz``."""
        return self.nc[1] * self.nc[2]

    @property
    def n_samples(self):
        """Sampled phase-encode positions, ``round(ny * nz / R)`` (>= 1)."""
        return max(1, int(round(self.n_phase_encodes / self.acceleration)))

    @property
    def n_centre(self):
        """Sampled positions of the fully sampled centre, ``round(fraction * n_samples)``."""
        return min(self.n_samples, int(round(self.centre_fraction * self.n_samples)))

    # ------------------------------------------------------------------ grid (as SimConfig)
    @property
    def n_cells(self):
        """Voxels of the volume, ``nx * ny * nz``."""
        return math.prod(self.nc)

    @property
    def n_ranks(self):
        """Processors, ``P * Q * coil_split``."""
        return self.grid[0] * self.grid[1] * self.coil_split

    @property
    def full_grid(self):
        """The process grid as named in messages: ``(P, Q)``, or ``(P, Q, coil_split)``."""
        return self.grid if self.coil_split == 1 else self.grid + (self.coil_split,)

    @property
    def coils_per_rank(self):
        """Coils held by one rank, ``coils / coil_split``."""
        return self.coils // self.coil_split

    @property
    def block_shape(self):
        """Voxels of one rank's block along x, y, z [voxels]."""
        return (self.nc[0] // self.grid[0], self.nc[1] // self.grid[1], self.nc[2])

    @property
    def mesh_shape(self):
        """Processor mesh for Mesh TF: ``[("row", P), ("col", Q)]``, and
        ``("coil_axis", coil_split)`` when the coils are split."""
        shape = [(ROW, self.grid[0]), (COL, self.grid[1])]
        return shape + ([(COIL_AXIS, self.coil_split)] if self.coil_split > 1 else [])

    @property
    def layout_rules(self):
        """Tensor dimension -> mesh axis (those of ``flowpm_mtf``; ``coil`` on
        ``coil_axis`` when the coils are split)."""
        rules = [(X, ROW), (Y, COL), (KY, ROW), (KZ, COL), (BX, ROW), (BY, COL)]
        return rules + ([(COIL, COIL_AXIS)] if self.coil_split > 1 else [])

    @property
    def np_dtype(self):
        """Real numpy dtype of images."""
        return np.dtype(self.dtype)

    @property
    def np_complex_dtype(self):
        """Complex numpy dtype of k-space."""
        return np.dtype(DTYPES[self.dtype])

    @property
    def tf_dtype(self):
        """Real TensorFlow dtype of images."""
        import tensorflow.compat.v1 as tf
        return tf.as_dtype(self.dtype)

    @property
    def tf_complex_dtype(self):
        """Complex TensorFlow dtype of k-space."""
        import tensorflow.compat.v1 as tf
        return tf.as_dtype(DTYPES[self.dtype])

    def replace(self, **kw):
        """A copy with some fields replaced (validated again)."""
        return dataclasses.replace(self, **kw)

    def to_dict(self):
        """A JSON-able dict of the fields."""
        return {k: list(v) if isinstance(v, tuple) else v
                for k, v in dataclasses.asdict(self).items()}


# ----------------------------------------------------------------------------- methods
# The settings of the reconstructions (TV: mri_mtf.recon, mri_mtf.tv_sense; the network:
# mri_mtf.unrolled), here with the volume's: decided before any graph.
MAX_TV_ITERATIONS = 100000
"""Most ADMM iterations of one TV reconstruction: it converges in tens to hundreds; 10^5
iterations of a 16^3 volume already take over an hour."""


@dataclasses.dataclass(frozen=True)
class TVConfig:
    """Settings of the TV reconstruction.

    Parameters
    ----------
    lam : float
        Weight ``lambda`` of the TV term (> 0) [phantom intensity].
    rho : float
        ADMM penalty ``rho`` (> 0) [dimensionless].
    iterations : int
        ADMM iterations, in ``[1, MAX_TV_ITERATIONS]``; with coils, PDHG iterations
        (:mod:`mri_mtf.tv_sense`).
    norm : {"isotropic", "anisotropic"}
        TV of the multi-coil reconstruction (:mod:`mri_mtf.tv_sense`): the norm over the
        three directions per voxel, or the sum of each direction's modulus (sigpy's).
        The single-coil ADMM is isotropic.
    """

    lam: float = dataclasses.field(default=0.005, metadata={"flags": ("--tv-lambda",)})
    rho: float = dataclasses.field(default=0.02, metadata={"flags": ("--tv-rho",)})
    iterations: int = dataclasses.field(default=20, metadata={"flags": ("--tv-iterations",)})
    norm: str = dataclasses.field(default="isotropic", metadata={"flags": ("--tv-norm",)})

    def __post_init__(self):
        for name in ("lam", "rho"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.number)) \
                    or not np.isfinite(v) or v <= 0:
                raise ValueError("TVConfig.%s must be a positive number, got %r" % (name, v))
            object.__setattr__(self, name, float(v))
        it = self.iterations
        if isinstance(it, bool) or not isinstance(it, (int, np.integer)) or it < 1:
            raise ValueError("TVConfig.iterations must be an integer >= 1, got %r" % (it,))
        if it > MAX_TV_ITERATIONS:
            raise ValueError("TVConfig.iterations must be an integer in [1, %d], got %d"
                             % (MAX_TV_ITERATIONS, it))
        object.__setattr__(self, "iterations", int(it))
        if self.norm not in ("isotropic", "anisotropic"):
            raise ValueError("TVConfig.norm must be isotropic or anisotropic, got %r"
                             % (self.norm,))

    def to_dict(self):
        """A JSON-able dict of the fields."""
        return dataclasses.asdict(self)


MAX_TRAIN_STEPS = 10**6
"""Most Adam steps of one run: 10^6 steps of the smallest volume (16^3, ~0.16 s per step on
2 ranks) already take ~2 days; more is a typo, not a training."""

MAX_BLOCKS = 100
"""Most unrolled blocks: the graph holds every block (and its gradient), so its build time
and the training's activations grow with K; MoDL-type networks use ~10."""

MAX_SEED = 2**63
"""Seeds are integers in ``[0, MAX_SEED)``, as :attr:`ImagingConfig.seed`."""


def _positive(v):
    return not isinstance(v, bool) and isinstance(v, (int, float, np.integer, np.floating)) \
        and np.isfinite(v) and v > 0


@dataclasses.dataclass(frozen=True)
class UnrolledConfig:
    """Settings of the unrolled network and its training.

    Parameters
    ----------
    blocks : int
        Unrolled blocks K (CNN + data-consistency step), in ``[1, MAX_BLOCKS]``.
    channels : int
        Hidden channels C of the CNN (2 -> C -> C -> 2), >= 1.
    kernel_size : int
        Filter side f (odd, >= 1; at most :func:`largest_kernel` of the volume and grid,
        :func:`check_kernel_fits`) [voxels].
    eta_init : float
        Initial data-consistency step of every block (> 0) [dimensionless].
    init_scale : float
        Standard deviation of the initial filters relative to He's
        ``sqrt(2 / fan_in)`` (> 0; the last layer gets a tenth of it, so the network
        starts close to K data-consistency steps) [dimensionless].
    init_seed : int
        Seed of the initial weights (numpy), in ``[0, 2**63)``.
    train_steps : int
        Adam steps, one training phantom each, in ``[0, MAX_TRAIN_STEPS]`` (0 evaluates
        the initial network, reported as untrained).
    learning_rate : float
        Adam step size (> 0) [weight units per step].
    perturbation : float
        Scale of the random ellipsoid perturbations of the training phantoms
        (``phantom.perturbed_table``), >= 0 [dimensionless].
    data_seed : int
        Seed of the training phantoms and noise mixes, in ``[0, 2**63)``.
    beta1, beta2, epsilon : float
        Adam's moment decay rates and regulariser.
    log_every : int
        Log the training loss every this many steps (>= 1).
    """

    blocks: int = 4
    channels: int = 8
    kernel_size: int = 3
    eta_init: float = 1.0
    init_scale: float = 0.5
    init_seed: int = 0
    train_steps: int = 100
    learning_rate: float = 5e-3
    perturbation: float = 0.05
    data_seed: int = 1
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-8
    log_every: int = 10

    def __post_init__(self):
        # (the network's size against the volume and the memory: check_kernel_fits and the
        # job's memory check, which know the volume and the machine)
        for name, low, high in (("blocks", 1, MAX_BLOCKS), ("channels", 1, None),
                                ("kernel_size", 1, None), ("train_steps", 0, MAX_TRAIN_STEPS),
                                ("init_seed", 0, MAX_SEED - 1), ("data_seed", 0, MAX_SEED - 1),
                                ("log_every", 1, None)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low:
                raise ValueError("%s must be an integer >= %d, got %r" % (name, low, v))
            if high is not None and v > high:
                raise ValueError("%s must be an integer in [%d, %d], got %d"
                                 % (name, low, high, v))
            object.__setattr__(self, name, int(v))
        if self.kernel_size % 2 == 0:
            raise ValueError("kernel_size must be odd, got %d" % self.kernel_size)
        for name in ("eta_init", "init_scale", "learning_rate", "epsilon"):
            if not _positive(getattr(self, name)):
                raise ValueError("%s must be a positive number, got %r"
                                 % (name, getattr(self, name)))
            object.__setattr__(self, name, float(getattr(self, name)))
        p = self.perturbation
        if isinstance(p, bool) or not isinstance(p, (int, float, np.integer, np.floating)) \
                or not np.isfinite(p) or p < 0:
            raise ValueError("perturbation must be a finite number >= 0, got %r" % (p,))
        object.__setattr__(self, "perturbation", float(p))
        for name in ("beta1", "beta2"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
                raise ValueError("%s must be in [0, 1), got %r" % (name, v))
            object.__setattr__(self, name, float(v))

    def to_dict(self):
        """A JSON-able dict of the fields."""
        return dataclasses.asdict(self)
