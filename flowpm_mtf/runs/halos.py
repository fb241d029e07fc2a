"""Halo catalogues: written by every rank (its own halos) as one logical HDF5 file, read back.

The catalogue of :func:`flowpm_mtf.analysis.fof.find_halos` is distributed: each rank
holds the halos whose label it owns. :func:`write_halos_distributed` writes them like a
snapshot (:mod:`flowpm_mtf.runs.h5dist`: per-rank parts in ``<name>.parts/`` plus
virtual datasets), so no rank gathers the catalogue.

Layout (readable with h5py alone)::

    /n          int64 [H]       number of members [particles]
    /mass       float64 [H]     members x particle mass [M_sun/h]
    /position   float64 [H, 3]  periodic centre of mass, in [0, box) [Mpc/h]
    /velocity   float64 [H, 3]  mean velocity of the members [km/s]
    /sigma_v    float64 [H]     1D velocity dispersion [km/s]
    /min_id     int64 [H]       smallest member id (the halo's label)
    /member_id  int64 [M]       with member ids: the members' ids, halo after halo
                                in the rows' order (halo i's: member_id[o_i:o_i + n_i],
                                o = cumsum(n) - n), each halo's sorted
    attrs:  format "flowpm_mtf.halos/1", config (JSON), versions, a (scale factor),
            fof_b, fof_min_members, linking_length [Mpc/h], particle_mass [M_sun/h],
            n_halos

Rows are sorted by ``min_id`` within each rank's part (parts in rank order);
:func:`read_halos` returns the whole catalogue sorted by ``min_id``. Each dataset has
``units`` and ``description`` attributes.
"""
import json
import logging
import os

import numpy as np

from ..analysis.fof import CATALOGUE_FIELDS
from .writers import to_jsonable, versions

__all__ = ["HALOS_FORMAT", "DTYPES", "write_halos_distributed", "read_halos"]

log = logging.getLogger(__name__)

#: Value of the ``format`` attribute of the catalogues written here.
HALOS_FORMAT = "flowpm_mtf.halos/1"
#: The datasets' dtypes and trailing shapes (every part alike, also an empty one).
DTYPES = {"n": (np.int64, ()), "mass": (np.float64, ()), "position": (np.float64, (3,)),
          "velocity": (np.float64, (3,)), "sigma_v": (np.float64, ()),
          "min_id": (np.int64, ()), "member_id": (np.int64, ())}
_MEMBER_UNITS = ("ids of the members, halo after halo (halo i: member_id[o_i:o_i + n_i], "
                 "o = cumsum(n) - n)", "particle id")


def write_halos_distributed(path, comm, catalogue, attrs=None, *, fof=None, stats=None):
    """Write this rank's halos into the logical catalogue ``path`` (collective over ``comm``).

    Parameters
    ----------
    path : str or os.PathLike
    comm : object
        mpi4py-like communicator (``SerialComm`` in one process).
    catalogue : dict of ndarray
        This rank's halos (``FofResult.catalogue``).
    attrs : dict or config object, optional
        The run's configuration, stored as JSON in the ``config`` attribute.
    fof : dict, optional
        More file attributes (``a``, ``fof_b``, ``fof_min_members``,
        ``linking_length``, ``particle_mass``, ``n_halos``).
    stats : dict, optional
        Filled as by :func:`flowpm_mtf.runs.h5dist.write_distributed`.

    Returns
    -------
    str
        ``path`` on every rank.
    """
    from . import h5dist

    rows = {}
    for name, value in catalogue.items():
        dtype, tail = DTYPES[name]
        rows[name] = h5dist.Rows(np.asarray(value, dtype).reshape((-1,) + tail))
    vers = versions()
    file_attrs = {"format": HALOS_FORMAT,
                  "config": json.dumps(to_jsonable(attrs if attrs is not None else {}),
                                       sort_keys=True),
                  "versions": json.dumps(vers, sort_keys=True)}
    file_attrs.update({k: v for k, v in (fof or {}).items()})
    described = dict(CATALOGUE_FIELDS, member_id=_MEMBER_UNITS)
    dattrs = {n: {"description": described[n][0], "units": described[n][1]} for n in rows}
    return h5dist.write_distributed(path, comm, {int(comm.rank): rows}, attrs=file_attrs,
                                    dataset_attrs=dattrs, stats=stats)


def read_halos(path):
    """Read a catalogue of :func:`write_halos_distributed`, sorted by ``min_id``.

    Returns
    -------
    dict
        The datasets (``member_id`` reordered with its halos, when present), ``attrs``
        (the file's attributes) and ``config`` (decoded JSON).
    """
    import h5py

    from . import h5dist

    h5dist.check_sources(path)
    with h5py.File(os.fspath(path), "r") as f:
        out = {name: f[name][()] for name in DTYPES if name in f}
        attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in f.attrs.items()}
    order = np.argsort(out["min_id"], kind="stable")
    if "member_id" in out:
        members = np.split(out["member_id"], np.cumsum(out["n"])[:-1]) if len(out["n"]) else []
        out["member_id"] = (np.concatenate([members[i] for i in order]) if len(order)
                            else out["member_id"])
    for name in CATALOGUE_FIELDS:
        out[name] = out[name][order]
    out["attrs"] = attrs
    out["config"] = json.loads(attrs.get("config", "{}"))
    return out
