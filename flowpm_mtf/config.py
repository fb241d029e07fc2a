"""Simulation configuration: a frozen, validated description of one run.

Every ``flowpm_mtf`` operation takes the configuration explicitly
(``op(field_or_state, conf)``); nothing is cached in module state.

Dimension names and layout
--------------------------
The Mesh TensorFlow dimension names, shape builders and k-vectors are defined
once, in :mod:`flowpm_mtf.layout` (the names are re-exported here); the layout
rules (dimension -> mesh axis) are :attr:`SimConfig.layout_rules`.
"""
import dataclasses
import json
import logging
import math
from typing import Optional, Tuple

import numpy as np

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- names
# The dimension names live in flowpm_mtf.layout (re-exported here: cfg.X etc.).
from .layout import (BX, BY, COL, K_DIMS, KX, KY, KZ, NPART, PX, PY, REAL_DIMS,  # noqa: E402,F401
                     ROW, SX, SY, XYZ, X, Y, Z)

_DTYPES = {"float32": "complex64", "float64": "complex128"}

#: Integers of a configuration lie within 64 bits, ``[-2**63, 2**63)`` (numpy's and
#: TensorFlow's int64).
INT64_LIMIT = 2**63

DECOMPOSITIONS = ("eulerian", "lagrangian")
"""Values of :attr:`SimConfig.decomposition` (see :mod:`flowpm_mtf.mesh.domain`)."""


# ----------------------------------------------------------------------------- helpers
def did_you_mean(key, names):
    """``" (did you mean 'x'?)"`` for the name of ``names`` closest to ``key``, or ``""``.

    Parameters
    ----------
    key : str
    names : iterable of str

    Returns
    -------
    str
    """
    import difflib

    names = list(names)
    by_lower = {n.lower(): n for n in names}
    hit = difflib.get_close_matches(str(key).lower(), list(by_lower), n=1, cutoff=0.6)
    return " (did you mean %r?)" % by_lower[hit[0]] if hit else ""


def _is_number(v):
    """A real number: int or float (numpy too), not a bool, a string or None."""
    return not isinstance(v, bool) and isinstance(v, (int, float, np.integer, np.floating))


def _triple(value, name, kind):
    """Expand a scalar to a 3-tuple and convert the elements with ``kind``.

    Raises
    ------
    ValueError
        Naming ``name``, the value and what is expected: one number or three,
        integers for ``kind=int``.
    """
    what = ("an integer or 3 integers" if kind is int else "a number or 3 numbers")
    if _is_number(value):
        value = (value,) * 3
    elif isinstance(value, (list, tuple, np.ndarray)):
        value = tuple(value)
    else:
        raise ValueError("%s must be %s, got %r" % (name, what, value))
    if len(value) != 3 or not all(_is_number(v) for v in value):
        raise ValueError("%s must be a scalar or have 3 entries (%s), got %r"
                         % (name, what, value))
    if kind is int:
        for v in value:
            # a Python int of any size is an integer (np.isfinite cannot take one beyond
            # 64 bits); a float must be finite and whole
            if not (isinstance(v, (int, np.integer)) or (np.isfinite(v) and
                                                          float(v).is_integer())):
                raise ValueError("%s must hold integers, got %r" % (name, value))
            if not -INT64_LIMIT <= v < INT64_LIMIT:
                raise ValueError("%s must hold 64-bit integers (-2**63 to 2**63 - 1), got %r"
                                 % (name, value))
    try:
        return tuple(kind(v) for v in value)
    except OverflowError:   # an int beyond the float range
        raise ValueError("%s must hold finite numbers, got %r" % (name, value)) from None


@dataclasses.dataclass(frozen=True)
class Cosmology:
    """Cosmological parameters (Planck 2015 defaults).

    The values are those of single-device FlowPM (``flowpm.tfbackground.cosmo``
    in FlowPM 0.1.1, ``flowpm.cosmology.Planck15`` in later versions).

    Parameters
    ----------
    Omega_c : float
        Cold dark matter density today [dimensionless].
    Omega_b : float
        Baryon density today [dimensionless].
    h : float
        Hubble parameter, H0 / (100 km/s/Mpc) [dimensionless].
    n_s : float
        Primordial spectral index [dimensionless].
    sigma8 : float
        RMS linear density fluctuation in spheres of 8 Mpc/h today [dimensionless].
    w0, wa : float
        Dark-energy equation of state w(a) = w0 + wa (1 - a) [dimensionless].
    Omega_k : float
        Curvature density today [dimensionless].
    """

    Omega_c: float = 0.2589
    Omega_b: float = 0.04860
    h: float = 0.6774
    n_s: float = 0.9667
    sigma8: float = 0.8159
    w0: float = -1.0
    wa: float = 0.0
    Omega_k: float = 0.0

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)):
                raise ValueError("Cosmology.%s must be a number, got %r" % (f.name, v))
            if not np.isfinite(v):
                raise ValueError("Cosmology.%s must be finite, got %r" % (f.name, v))
            object.__setattr__(self, f.name, float(v))
        for name in ("Omega_c", "h", "sigma8"):
            if getattr(self, name) <= 0:
                raise ValueError("Cosmology.%s must be positive, got %r"
                                 % (name, getattr(self, name)))
        if self.Omega_b < 0:
            raise ValueError("Cosmology.Omega_b must be >= 0, got %r" % self.Omega_b)

    @property
    def Omega_m(self):
        """Total matter density today, Omega_c + Omega_b [dimensionless]."""
        return self.Omega_c + self.Omega_b

    @property
    def Omega_de(self):
        """Dark-energy density today, 1 - Omega_m - Omega_k [dimensionless]."""
        return 1.0 - self.Omega_m - self.Omega_k

    def to_dict(self):
        """The parameters as a JSON-able dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d):
        """Inverse of :meth:`to_dict`; a key that is no field raises ``ValueError``
        naming it and the closest field."""
        if not isinstance(d, dict):
            raise ValueError("cosmology must be a dict of Cosmology fields (%s), got %r"
                             % (", ".join(f.name for f in dataclasses.fields(cls)), d))
        names = [f.name for f in dataclasses.fields(cls)]
        for key in d:
            if key not in names:
                raise ValueError("unknown cosmology key %r%s; the keys are %s"
                                 % (key, did_you_mean(key, names), ", ".join(names)))
        return cls(**d)

    def to_flowpm_dict(self):
        """The parameters in the dict format of ``flowpm.tfbackground`` (FlowPM 0.1.1)."""
        return {"w0": self.w0, "wa": self.wa, "H0": 100.0, "h": self.h,
                "Omega0_b": self.Omega_b, "Omega0_c": self.Omega_c,
                "Omega0_m": self.Omega_m, "Omega0_k": self.Omega_k,
                "Omega0_de": self.Omega_de, "n_s": self.n_s, "sigma8": self.sigma8}


@dataclasses.dataclass(frozen=True)
class SimConfig:
    """Frozen description of a distributed particle-mesh simulation.

    Parameters
    ----------
    nc : int or 3-tuple of int
        Mesh cells along x, y, z [cells]; an int means a cubic mesh.
    box_size : float or 3-tuple of float
        Box side lengths along x, y, z [Mpc/h].
    grid : 2-tuple of int
        Process grid (P, Q): x is split over P ranks (mesh axis ``row``), y over
        Q ranks (mesh axis ``col``); z is never split.
    halo_size : int or None
        Halo width around each block in x and y [cells]; None (default) chooses
        it from the decomposition: 2 (the CIC stencil and a 1-cell margin) for
        ``"eulerian"``, where particles are migrated into their block before
        every painting, and
        ``min(8, block - 1)`` for ``"lagrangian"``, where particles may move up
        to about ``halo_size - 1`` cells away from their block for the whole run
        (see :mod:`flowpm_mtf.physics.painting`). An expert override otherwise.
    a_start, a_end : float
        First and last scale factor [dimensionless].
    n_steps : int
        Number of N-body time steps.
    lpt_order : {1, 2}
        Order of Lagrangian perturbation theory for the initial conditions.
    dtype : {"float32", "float64"}
        Real floating-point type of fields and particles.
    seed : int
        Seed of the initial conditions (independent of the process grid).
    cosmology : Cosmology
        Cosmological parameters.
    decomposition : {"eulerian", "lagrangian"}
        ``"eulerian"`` (default, FastPM's): after every drift each particle
        moves to the block that contains its current position
        (:mod:`flowpm_mtf.mesh.domain`); ``"lagrangian"``: particles stay on the
        block of their initial lattice site and the halo must cover their whole
        displacement.
    capacity : int or None
        Particle slots per block (``"eulerian"`` only) [particles]; None chooses
        it from the linear density contrast of a block at ``a_end``
        (:func:`flowpm_mtf.physics.sizing.capacity`).
    send_capacity : int or None
        Particles a block can send to one neighbour per migration round
        [particles]; None chooses it from the linear displacement per step
        (:func:`flowpm_mtf.physics.sizing.send_capacity`).
    sort_every : int
        A job's N-body run reorders every block's particles by column every
        ``sort_every`` steps (eulerian; :func:`flowpm_mtf.mesh.slots.sort_by_column`:
        the CIC ops' cache locality; default 0: never). The results differ from
        an unsorted run in the last bits (the paint's summation order).
        The reordering costs about what the faster steps after it save (the
        gain fades within a few steps), so it is off by default
        (docs/benchmarks.md, "Speed at size").

    Raises
    ------
    ValueError
        On any impossible combination (message names the offending value).

    Notes
    -----
    Divisibility: the real-space pencils need ``nc[0] % P == 0`` and
    ``nc[1] % Q == 0``; the k-space pencils (``ky`` on ``row``, ``kz`` on
    ``col``) need ``nc[1] % P == 0`` and ``nc[2] % Q == 0``.
    """

    nc: Tuple[int, int, int] = (64, 64, 64)
    box_size: Tuple[float, float, float] = (200.0, 200.0, 200.0)
    grid: Tuple[int, int] = (1, 1)
    halo_size: Optional[int] = dataclasses.field(default=None, metadata={"flags": ("--halo",)})
    a_start: float = 0.1
    a_end: float = 1.0
    n_steps: int = dataclasses.field(default=10, metadata={"flags": ("--steps",)})
    lpt_order: int = dataclasses.field(default=2, metadata={"choices": (1, 2)})
    dtype: str = dataclasses.field(default="float32", metadata={"choices": tuple(_DTYPES)})
    seed: int = 42
    cosmology: Cosmology = dataclasses.field(default_factory=Cosmology)
    decomposition: str = dataclasses.field(default="eulerian",
                                           metadata={"choices": DECOMPOSITIONS})
    capacity: Optional[int] = None
    send_capacity: Optional[int] = None
    sort_every: int = dataclasses.field(default=0, metadata={"flags": ("--sort-every",)})

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen)
        set_("nc", _triple(self.nc, "nc", int))
        set_("box_size", _triple(self.box_size, "box_size", float))
        grid = tuple(self.grid) if isinstance(self.grid, (list, tuple, np.ndarray)) else None
        if grid is None or len(grid) != 2 or any(
                not _is_number(g) or not np.isfinite(g) or not float(g).is_integer()
                for g in grid):
            raise ValueError("grid must be a pair of integers (P, Q), got %r" % (self.grid,))
        set_("grid", tuple(int(g) for g in grid))
        if not isinstance(self.cosmology, Cosmology):
            set_("cosmology", Cosmology.from_dict(self.cosmology))
        for name, allowed in (("dtype", tuple(_DTYPES)), ("decomposition", DECOMPOSITIONS)):
            if getattr(self, name) not in allowed or not isinstance(getattr(self, name), str):
                raise ValueError("%s must be one of %s, got %r"
                                 % (name, ", ".join(allowed), getattr(self, name)))

        if any(n <= 0 for n in self.nc):
            raise ValueError("nc must be positive, got %r" % (self.nc,))
        if any(not (b > 0 and np.isfinite(b)) for b in self.box_size):
            raise ValueError("box_size must be positive and finite, got %r" % (self.box_size,))
        P, Q = self.grid
        if P < 1 or Q < 1:
            raise ValueError("grid entries must be >= 1, got %r" % (self.grid,))
        checks = [(self.nc[0], P, "nc[0] (x, split over P on 'row')"),
                  (self.nc[1], Q, "nc[1] (y, split over Q on 'col')"),
                  (self.nc[1], P, "nc[1] (ky, split over P on 'row' in k-space)"),
                  (self.nc[2], Q, "nc[2] (kz, split over Q on 'col' in k-space)")]
        for n, p, what in checks:
            if n % p:
                raise ValueError("grid %r does not divide nc=%r: %s = %d is not a multiple of %d"
                                 % (self.grid, self.nc, what, n, p))
        sx, sy = self.nc[0] // P, self.nc[1] // Q
        if self.halo_size is None:
            if min(sx, sy) < 2:
                raise ValueError("nc=%r on grid %r gives blocks of (%d, %d) cells in x and y; "
                                 "painting needs a halo of >= 1 cell, hence blocks of >= 2 "
                                 "cells: use a larger nc or fewer ranks"
                                 % (self.nc, self.grid, sx, sy))
            set_("halo_size", max(0, min(2, sx - 1, sy - 1)) if self.decomposition == "eulerian"
                 else max(0, min(8, sx - 1, sy - 1)))
        v = self.sort_every
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError("sort_every must be an int >= 0 (0: never), got %r" % (v,))
        if v and self.decomposition != "eulerian":
            raise ValueError("sort_every=%d: the lagrangian decomposition keeps its particles "
                             "in lattice order (use 0)" % v)
        set_("sort_every", int(v))
        for name in ("capacity", "send_capacity"):
            v = getattr(self, name)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError("%s must be a positive int or None (automatic), got %r"
                                 % (name, v))
            set_(name, int(v))
        npb = sx * sy * self.nc[2]
        if self.capacity is not None:
            if self.decomposition == "lagrangian" and self.capacity != npb:
                raise ValueError("capacity=%d: the lagrangian decomposition holds exactly the "
                                 "%d particles of a block (leave capacity unset)"
                                 % (self.capacity, npb))
            if self.capacity < npb:
                raise ValueError("capacity=%d is smaller than the %d particles a block starts "
                                 "with" % (self.capacity, npb))
        for v, name in ((self.halo_size, "halo_size"), (self.n_steps, "n_steps"),
                        (self.lpt_order, "lpt_order"), (self.seed, "seed")):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise ValueError("%s must be an int, got %r" % (name, v))
            if not -INT64_LIMIT <= v < INT64_LIMIT:
                raise ValueError("%s must be a 64-bit integer (-2**63 to 2**63 - 1), got %r"
                                 % (name, v))
        set_("halo_size", int(self.halo_size))
        set_("n_steps", int(self.n_steps))
        set_("lpt_order", int(self.lpt_order))
        set_("seed", int(self.seed))
        if self.halo_size < 1:
            raise ValueError("halo_size (--halo) must be >= 1 cell (CIC painting deposits "
                             "into the next block), or unset for automatic, got %d"
                             % self.halo_size)
        if self.halo_size >= min(sx, sy):
            raise ValueError("halo_size=%d must be smaller than the block size (%d, %d) "
                             "[cells] of nc=%r on grid %r"
                             % (self.halo_size, sx, sy, self.nc, self.grid))
        for name in ("a_start", "a_end"):
            v = getattr(self, name)
            if not _is_number(v) or not np.isfinite(v):
                raise ValueError("%s must be a finite number, got %r" % (name, v))
            set_(name, float(v))
        if not 0.0 < self.a_start < self.a_end:
            raise ValueError("need 0 < a_start < a_end, got a_start=%r, a_end=%r"
                             % (self.a_start, self.a_end))
        if self.n_steps < 1:
            raise ValueError("n_steps must be >= 1, got %d" % self.n_steps)
        if self.lpt_order not in (1, 2):
            raise ValueError("lpt_order must be 1 or 2, got %d" % self.lpt_order)
        if not 0 <= self.seed < 2**63:
            raise ValueError("seed must be in [0, 2**63), got %d" % self.seed)

    # ------------------------------------------------------------------ derived
    @property
    def cell_size(self):
        """Cell side lengths along x, y, z [Mpc/h]."""
        return tuple(b / n for b, n in zip(self.box_size, self.nc))

    @property
    def n_cells(self):
        """Total number of mesh cells."""
        return math.prod(int(n) for n in self.nc)       # exact: no int64 wrap

    @property
    def block_shape(self):
        """Cells of one (unpadded) block along x, y, z [cells]."""
        return (self.nc[0] // self.grid[0], self.nc[1] // self.grid[1], self.nc[2])

    @property
    def padded_block_shape(self):
        """Cells of one padded block along x, y, z [cells] (z is not padded)."""
        sx, sy, nz = self.block_shape
        return (sx + 2 * self.halo_size, sy + 2 * self.halo_size, nz)

    @property
    def particles_per_block(self):
        """Particles of one block's initial lattice, ``sx * sy * nz``."""
        return math.prod(int(n) for n in self.block_shape)

    @property
    def n_particles(self):
        """Total number of particles (one per cell)."""
        return self.n_cells

    @property
    def n_ranks(self):
        """Number of processors, P * Q."""
        return self.grid[0] * self.grid[1]

    @property
    def mesh_shape(self):
        """Processor mesh for Mesh TF: ``[("row", P), ("col", Q)]``."""
        return [(ROW, self.grid[0]), (COL, self.grid[1])]

    @property
    def layout_rules(self):
        """Every (tensor dimension, mesh axis) rule used by ``flowpm_mtf``."""
        return [(X, ROW), (Y, COL), (KY, ROW), (KZ, COL), (BX, ROW), (BY, COL)]

    @property
    def np_dtype(self):
        """Real numpy dtype."""
        return np.dtype(self.dtype)

    @property
    def np_complex_dtype(self):
        """Complex numpy dtype matching :attr:`dtype`."""
        return np.dtype(_DTYPES[self.dtype])

    @property
    def tf_dtype(self):
        """Real TensorFlow dtype."""
        import tensorflow.compat.v1 as tf
        return tf.as_dtype(self.dtype)

    @property
    def tf_complex_dtype(self):
        """Complex TensorFlow dtype matching :attr:`dtype`."""
        import tensorflow.compat.v1 as tf
        return tf.as_dtype(_DTYPES[self.dtype])

    # ------------------------------------------------------------------ (de)serialise
    def to_dict(self):
        """A JSON-able dict (tuples become lists, the cosmology a nested dict)."""
        d = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Cosmology):
                v = v.to_dict()
            elif isinstance(v, tuple):
                v = list(v)
            d[f.name] = v
        return d

    @classmethod
    def from_dict(cls, d):
        """Inverse of :meth:`to_dict`; unknown keys raise ``ValueError``."""
        d = dict(d)
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError("unknown SimConfig fields: %s" % sorted(unknown))
        if "cosmology" in d and isinstance(d["cosmology"], dict):
            d["cosmology"] = Cosmology.from_dict(d["cosmology"])
        return cls(**d)

    def to_json(self):
        """:meth:`to_dict` as a JSON string (sorted keys)."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, s):
        """Inverse of :meth:`to_json`."""
        return cls.from_dict(json.loads(s))

    def replace(self, **kw):
        """A copy with some fields replaced (validated again)."""
        return dataclasses.replace(self, **kw)


def default_stages(conf):
    """Scale factors of the time loop's stages: ``linspace(a_start, a_end, n_steps + 1)``.

    Parameters
    ----------
    conf : SimConfig

    Returns
    -------
    ndarray
        float64, ``conf.n_steps + 1`` increasing scale factors [dimensionless].
    """
    return np.linspace(conf.a_start, conf.a_end, conf.n_steps + 1)
