"""Snapshots: the particles and density of one simulation state, written by rank 0 or by every rank.

:func:`write_snapshot` writes one file on rank 0 from gathered arrays;
:func:`write_snapshot_distributed` writes the same layout from every rank's own
slices (:func:`particle_part`) as one logical file of per-rank parts and HDF5
virtual datasets (:mod:`flowpm_mtf.runs.h5dist`); :func:`read_snapshot` reads
either.

Snapshot layout (readable with h5py alone)::

    /position   float [N, 3]          particle positions [Mpc/h]
    /velocity   float [N, 3]          particle velocities (units in its attribute)
    /id         int [N]               particle ids (initial lattice index; sort by it)
    /density    float [NX, NY, NZ]    density on the mesh (units in its attribute)
    attrs:  config            JSON of the run configuration
            versions          JSON of the package versions (see :func:`versions`)
            version.<package> the same, one attribute per package
            format            "flowpm_mtf.snapshot/1"

Each dataset has a ``units`` attribute.
"""
import json
import logging
import os

import numpy as np

from .writers import _is_writer, to_jsonable, versions, write_hdf5

__all__ = ["SNAPSHOT_FORMAT", "DEFAULT_UNITS", "write_snapshot", "read_snapshot",
           "lagrangian_ids", "particle_part", "write_snapshot_distributed"]

log = logging.getLogger(__name__)

#: Value of the ``format`` attribute of the snapshots written here.
SNAPSHOT_FORMAT = "flowpm_mtf.snapshot/1"
#: Units recorded for each dataset unless the caller overrides them.
DEFAULT_UNITS = {"position": "Mpc/h", "velocity": "km/s",
                 "density": "dimensionless (rho / mean rho)",
                 "id": "Lagrangian index, row-major over the particle grid"}


def write_snapshot(path, position=None, velocity=None, density=None, attrs=None, *,
                   units=None, compression=None, rank=None, ids=None):
    """Write a snapshot to an HDF5 file (on rank 0 only).

    Parameters
    ----------
    path : str or os.PathLike
        Output file; replaced if it exists.
    position : array_like, optional
        Particle positions [Mpc/h], shape [N, 3].
    velocity : array_like, optional
        Particle velocities, shape [N, 3] (same N as ``position``); units per
        ``units["velocity"]`` (default km/s).
    density : array_like, optional
        Density field, shape [NX, NY, NZ].
    attrs : dict or config object, optional
        Run configuration, stored as JSON in the ``config`` attribute (see
        :func:`to_jsonable`).
    units : dict, optional
        Overrides of :data:`DEFAULT_UNITS`.
    compression : str, optional
        h5py compression filter for the datasets (e.g. ``"gzip"``).
    rank : int, optional
        Rank of this process (default: from the launcher's environment).
    ids : array_like, optional
        Global particle ids (initial lattice index), shape [N]: dataset ``id``.

    Returns
    -------
    str or None
        The path written, on rank 0; ``None`` elsewhere.

    Raises
    ------
    ValueError
        On inconsistent shapes (checked on every rank, before writing).
    """
    data = {}
    if position is not None:
        data["position"] = np.asarray(position)
        if data["position"].ndim != 2 or data["position"].shape[1] != 3:
            raise ValueError("position must have shape [N, 3], got %s" % (data["position"].shape,))
    if velocity is not None:
        data["velocity"] = np.asarray(velocity)
        if data["velocity"].ndim != 2 or data["velocity"].shape[1] != 3:
            raise ValueError("velocity must have shape [N, 3], got %s" % (data["velocity"].shape,))
        if position is not None and data["velocity"].shape != data["position"].shape:
            raise ValueError("velocity shape %s differs from position shape %s"
                             % (data["velocity"].shape, data["position"].shape))
    if ids is not None:
        data["id"] = np.asarray(ids)
        if position is not None and data["id"].shape != data["position"].shape[:1]:
            raise ValueError("id shape %s does not match position shape %s"
                             % (data["id"].shape, data["position"].shape))
    if density is not None:
        data["density"] = np.asarray(density)
        if data["density"].ndim != 3:
            raise ValueError("density must be 3-d [NX, NY, NZ], got shape %s"
                             % (data["density"].shape,))
    all_units = dict(DEFAULT_UNITS, **(units or {}))
    config_json = json.dumps(to_jsonable(attrs if attrs is not None else {}), sort_keys=True)
    if not _is_writer(rank):
        return None

    vers = versions()
    attrs = {"format": SNAPSHOT_FORMAT, "config": config_json,
             "versions": json.dumps(vers, sort_keys=True)}
    attrs.update(("version." + key, value) for key, value in vers.items())
    path = write_hdf5(path, [(name, value, {"units": all_units[name]})
                             for name, value in data.items()], attrs, compression=compression,
                      rank=0)
    log.info("wrote snapshot %s (%s)", path,
             ", ".join("%s %s" % (k, v.shape) for k, v in data.items()) or "attributes only")
    return path


def read_snapshot(path):
    """Read a snapshot written by :func:`write_snapshot` or :func:`write_snapshot_distributed`.

    Parameters
    ----------
    path : str or os.PathLike

    Returns
    -------
    dict
        ``position``, ``velocity``, ``density``, ``id`` (ndarrays, or ``None`` when
        absent),
        ``config`` and ``versions`` (dicts decoded from JSON), ``units`` (dict of
        dataset -> units string) and ``attrs`` (all raw file attributes).
    """
    import h5py

    from . import h5dist

    out = {"position": None, "velocity": None, "density": None, "id": None, "units": {}}
    h5dist.check_sources(path)  # a distributed snapshot with a missing part is an error
    with h5py.File(os.fspath(path), "r") as f:
        for name in ("position", "velocity", "density", "id"):
            if name in f:
                out[name] = f[name][()]
                units = f[name].attrs.get("units")
                out["units"][name] = units.decode() if isinstance(units, bytes) else units
        attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in f.attrs.items()}
    out["attrs"] = attrs
    out["config"] = json.loads(attrs.get("config", "{}"))
    out["versions"] = json.loads(attrs.get("versions", "{}"))
    return out


# ============================================================================= distributed
# Snapshots written by every rank (its own slices) as one logical file; see
# flowpm_mtf.runs.h5dist for the layout (per-rank part files + HDF5 virtual datasets).

def lagrangian_ids(conf, block):
    """Global ids of the lattice particles of one block, in their in-block order.

    The id of a particle is its Lagrangian (initial lattice) index, row-major
    over the particle grid ``conf.nc``.

    Parameters
    ----------
    conf : SimConfig
    block : (int, int)
        Block index ``(bx, by)`` on the process grid.

    Returns
    -------
    ndarray
        int64 ``[sx * sy * nz]``.
    """
    sx, sy, nz = conf.block_shape
    _, ny, _ = conf.nc
    i = np.arange(sx, dtype=np.int64)[:, None, None] + block[0] * sx
    j = np.arange(sy, dtype=np.int64)[None, :, None] + block[1] * sy
    k = np.arange(nz, dtype=np.int64)[None, None, :]
    return ((i * ny + j) * nz + k).reshape(-1)


def particle_part(conf, block, positions, momenta, a, ids=None, valid=None, dtype=None):
    """Snapshot rows (Mpc/h, km/s, id) of one block's particles, in the run's dtype.

    Parameters
    ----------
    conf : SimConfig
    block : (int, int)
        Block index ``(bx, by)``.
    positions, momenta : array_like
        ``[..., 3]`` block-local positions [cells] and canonical momenta
        ``p = a^3 E dx/da`` [cells] (H0 = 1) of the block's particles.
    a : float
        Scale factor of the state.
    ids : array_like, optional
        Particle ids (default: :func:`lagrangian_ids`, the particles in lattice
        order).
    valid : array_like of bool, optional
        Mask of the particles to keep (fixed-capacity buffers).
    dtype : dtype, optional
        Of the positions and velocities written (default ``conf.dtype``: a
        float32 run writes float32, computed in float32 from its float32 state,
        within an ulp of the float64 conversion; a float64 run float64).

    Returns
    -------
    dict
        ``position`` [n, 3] in [0, box) [Mpc/h], ``velocity`` [n, 3] peculiar
        [km/s] (``v = H0 p / a``), ``id`` [n] int64, as :class:`h5dist.Rows`
        converted piece by piece while they are written (no converted or
        masked copy of this rank's whole share).
    """
    from . import h5dist

    dtype = np.dtype(conf.dtype if dtype is None else dtype)
    cell = np.asarray(conf.cell_size, np.float64)
    origin = np.array([block[0] * conf.block_shape[0], block[1] * conf.block_shape[1], 0],
                      np.float64)
    x = np.asarray(positions).reshape(-1, 3)
    p = np.asarray(momenta).reshape(-1, 3)
    ids = lagrangian_ids(conf, block) if ids is None else np.asarray(ids).reshape(-1)
    keep = None if valid is None else np.asarray(valid, bool).reshape(-1)
    box = np.asarray(conf.box_size, np.float64).astype(dtype)
    box_min, box_out = box.min(), _PerAxis(box)
    single = dtype == np.float32
    cell_out, shift_out = _PerAxis(cell.astype(dtype)), _PerAxis((origin * cell).astype(dtype))
    origin64, cell64 = _PerAxis(origin), _PerAxis(cell)
    vel_out, vel64 = _PerAxis((cell * (100.0 / a)).astype(dtype)), _PerAxis(cell * (100.0 / a))

    def position(rows):  # block-local cells -> Mpc/h in [0, box)
        if single and rows.dtype == np.float32:   # in the run's precision (< 1 ulp more)
            out = cell_out.times(rows)
            shift_out.add_to(out)
        else:
            out = rows.astype(np.float64)
            origin64.add_to(out)
            cell64.multiply(out)
            out = out.astype(dtype, copy=False)
        if out.size == 0 or (out.min() >= 0 and out.max() < box_min):
            return out      # every particle in the box: two flat reductions
        box_out.wrap(out)   # particles across the periodic edge
        return out

    def velocity(rows):  # canonical momentum [cells] -> peculiar velocity [km/s]
        if single and rows.dtype == np.float32:
            return vel_out.times(rows)
        return vel64.times(rows.astype(np.float64)).astype(dtype, copy=False)

    return {"position": h5dist.Rows(x, position, dtype, keep=keep),
            "velocity": h5dist.Rows(p, velocity, dtype, keep=keep),
            "id": h5dist.Rows(ids, None, np.int64, keep=keep)}


class _PerAxis:
    """A constant per axis of ``[n, 3]`` rows, applied over the flat rows.

    ``rows * v`` with ``v`` of shape ``[3]`` makes numpy's inner loop three
    elements long (an order of magnitude below memory speed); the same products
    over the flat rows with ``v`` tiled (or a scalar when the three are equal)
    run at memory speed. Equal values element by element.
    """

    def __init__(self, v):
        self.v = np.asarray(v)
        self.zero = not self.v.any()
        self.scalar = self.v.dtype.type(self.v[0]) if np.all(self.v == self.v[0]) else None
        self._tile = self.v[:0]

    def _flat(self, n):
        if self.scalar is not None:
            return self.scalar
        if self._tile.size < n:
            self._tile = np.tile(self.v, -(-n // 3))
        return self._tile[:n]

    def times(self, rows):
        """``rows * v`` (new array)."""
        rows = np.ascontiguousarray(rows)
        return np.multiply(rows.reshape(-1), self._flat(rows.size)).reshape(rows.shape)

    def multiply(self, out):
        """``out *= v`` (``out`` contiguous)."""
        np.multiply(out.reshape(-1), self._flat(out.size), out=out.reshape(-1))

    def add_to(self, out):
        """``out += v`` (``out`` contiguous; nothing for a zero ``v``)."""
        if not self.zero:
            np.add(out.reshape(-1), self._flat(out.size), out=out.reshape(-1))

    def wrap(self, out):
        """``out`` into ``[0, v)`` periodically, in place (``out`` contiguous, ``v`` > 0).

        The values of ``np.mod(out, v)`` (in range: unchanged; one rounding for the
        others), computed as ``out - v floor(out / v)`` over the flat rows: four
        unmasked passes, several times faster than numpy's ``mod`` or its
        masked loops. Where ``out / v`` rounds up to the next integer, or a value
        just below 0 rounds up to ``v`` when shifted (its image is 0), a masked
        pass puts it back, only in the pieces that have one.
        """
        flat = out.reshape(-1)
        v = self._flat(flat.size)
        turns = np.divide(flat, v)
        np.floor(turns, out=turns)
        np.multiply(turns, v, out=turns)
        np.subtract(flat, turns, out=flat)
        if flat.size and flat.min() < 0:
            np.add(flat, v, out=flat, where=flat < 0)
        if flat.size and (flat >= v).any():
            np.subtract(flat, v, out=flat, where=flat >= v)


def write_snapshot_distributed(path, comm, parts, attrs=None, *, units=None, compression=None,
                               stats=None):
    """Write a snapshot from every rank's slices (collective over ``comm``).

    The result opens with plain h5py exactly as a :func:`write_snapshot` file
    (plus the ``id`` dataset); see :mod:`flowpm_mtf.runs.h5dist`.

    Parameters
    ----------
    path : str or os.PathLike
    comm : object
        mpi4py-like communicator (``flowpm_mtf.backend.SerialComm`` in one process).
    parts : dict
        ``pnum -> {"position", "velocity", "id": h5dist.Rows, "density": h5dist.Block}``
        for the slices this process holds (see :func:`particle_part`).
    attrs : dict or config object, optional
        Stored as JSON in the ``config`` attribute.
    units : dict, optional
        Overrides of :data:`DEFAULT_UNITS`.
    compression : {None, "gzip", "lzf"}
        Of the part files (:func:`flowpm_mtf.runs.h5dist.write_distributed`; default none).
    stats : dict, optional
        Filled with the bytes, files and seconds of the write
        (:func:`flowpm_mtf.runs.h5dist.write_distributed`).

    Returns
    -------
    str
        ``path`` on every rank.
    """
    from . import h5dist

    all_units = dict(DEFAULT_UNITS, **(units or {}))
    vers = versions()
    file_attrs = {"format": SNAPSHOT_FORMAT,
                  "config": json.dumps(to_jsonable(attrs if attrs is not None else {}),
                                       sort_keys=True),
                  "versions": json.dumps(vers, sort_keys=True)}
    file_attrs.update({"version." + k: v for k, v in vers.items()})
    names = set()
    for items in parts.values():
        names.update(items)
    return h5dist.write_distributed(path, comm, parts, attrs=file_attrs,
                                    dataset_attrs={n: {"units": all_units[n]} for n in names
                                                   if n in all_units},
                                    compression=compression, stats=stats)
