"""Halo catalogues of a simulation's states: the FoF of ``simulate --fof`` and the ``halos`` job.

``simulate --fof`` finds the friends-of-friends halos
(:func:`flowpm_mtf.analysis.fof.find_halos`) of the final state (``halos.h5``) and of
every ``--snapshots`` state (``halos_a<a>.h5``, beside ``snapshot_a<a>.h5``), from each
process's own slices of the state (no rank gathers the particles), on the run's process
grid; the catalogues are written by every rank (:mod:`flowpm_mtf.runs.halos`).

``flowpm-mtf halos --snapshot RUN`` does the same for an existing snapshot (a run
directory's ``snapshot.h5`` or a named snapshot file): each rank reads a contiguous share of
its particles, the finder sends them to their blocks of the process grid (``--grid``,
default the most square grid of the ranks), and ``halos.h5`` is written into ``--out``.
A directory without a snapshot is refused in one line before anything runs. Of the
``SimConfig`` options only ``--grid`` (and ``--backend``) matter to this job: the box, the
particle count and the cosmology are the snapshot's.
"""
import dataclasses
import logging
import os
import re

import numpy as np

from ..analysis import fof
from ..config import SimConfig
from ..errors import ConfigError
from ..logs import rank0_only
from ..runs import halos as halos_io
from . import register
from .base import ConfigSection, Job

__all__ = ["halos_name", "local_particles", "fof_grid", "find", "catalogue_attrs", "record",
           "write_catalogue", "HalosWriter", "HalosOptions", "HalosJob", "snapshot_path",
           "read_share"]

log = rank0_only(logging.getLogger(__name__))


def halos_name(a=None):
    """File name of the catalogue: ``halos.h5`` (final state) or ``halos_a0.5000.h5``."""
    return "halos.h5" if a is None else "halos_a%.4f.h5" % a


def local_particles(conf, state, a):
    """This process's particles in the snapshot's units, float64.

    Parameters
    ----------
    conf : SimConfig
    state : dict
        ``pnum -> (block, positions, momenta, forces, ids)``
        (:func:`flowpm_mtf.jobs.nbody_run.fetch_state`; empty slots have id -1).
    a : float
        Scale factor of the state.

    Returns
    -------
    (ndarray, ndarray, ndarray)
        Positions ``[n, 3]`` [Mpc/h] (not yet wrapped into the box), peculiar
        velocities ``[n, 3]`` [km/s] (``v = H0 p / a``, as the snapshot's), int64 ids.
    """
    cell = np.asarray(conf.cell_size, np.float64)
    sx, sy, _ = conf.block_shape
    pos, vel, ids = [], [], []
    for block, x, p, _, pid in state.values():
        pid = np.asarray(pid).reshape(-1)
        keep = pid >= 0
        origin = np.array([block[0] * sx, block[1] * sy, 0], np.float64)
        pos.append((np.asarray(x).reshape(-1, 3)[keep].astype(np.float64) + origin) * cell)
        vel.append(np.asarray(p).reshape(-1, 3)[keep].astype(np.float64) * (cell * (100.0 / a)))
        ids.append(pid[keep].astype(np.int64))
    if not pos:
        return np.zeros((0, 3)), np.zeros((0, 3)), np.zeros(0, np.int64)
    return np.concatenate(pos), np.concatenate(vel), np.concatenate(ids)


def fof_grid(conf, comm):
    """The FoF's decomposition: the run's grid when each rank holds one block, else 1x1
    (one process holding every block, e.g. ``PlacementMeshImpl``)."""
    grid = tuple(int(g) for g in conf.grid)
    return grid if grid[0] * grid[1] == comm.size else (1, 1)


def find(conf, comm, state, a, opts):
    """FoF halos of a fetched state (collective).

    Parameters
    ----------
    conf : SimConfig
    comm : object
    state : dict
        From :func:`flowpm_mtf.jobs.nbody_run.fetch_state`.
    a : float
    opts : object
        With ``fof_b``, ``fof_min``, ``fof_members`` (``SimulateOptions``).

    Returns
    -------
    FofResult
    """
    pos, vel, ids = local_particles(conf, state, a)
    mass = fof.particle_mass(conf.cosmology.Omega_m, conf.box_size, conf.n_particles)
    return fof.find_halos(pos, vel, ids, conf.box_size, fof_grid(conf, comm), comm,
                          b=opts.fof_b, min_members=opts.fof_min, particle_mass=mass,
                          n_particles=conf.n_particles, member_ids=opts.fof_members)


def catalogue_attrs(conf, res, a, opts):
    """The catalogue file's FoF attributes (and the summary's record)."""
    return {"a": float(a), "fof_b": float(opts.fof_b), "fof_min_members": int(opts.fof_min),
            "linking_length": float(res.linking_length),
            "particle_mass": fof.particle_mass(conf.cosmology.Omega_m, conf.box_size,
                                               conf.n_particles),
            "n_halos": int(res.n_halos)}


def record(conf, name, res, a, opts):
    """The summary's record of a catalogue: its file, attributes and label rounds."""
    return dict(catalogue_attrs(conf, res, a, opts), file=name,
                label_rounds=int(res.iterations))


def write_catalogue(ctx, name, res, a, opts):
    """Write one catalogue ``name`` into the run directory (collective; every rank its halos).

    Returns
    -------
    dict
        The summary's record of it (file, a, halos, linking length, label rounds).
    """
    attrs = catalogue_attrs(ctx.conf, res, a, opts)
    path = ctx.file(name)
    if path is not None:
        stats = {}
        halos_io.write_halos_distributed(path, ctx.comm, res.catalogue, attrs=ctx.conf,
                                         fof=attrs, stats=stats)
        ctx.record_write(name, stats)
    return record(ctx.conf, name, res, a, opts)


class HalosWriter:
    """Observer writing ``halos_a<a>.h5`` at requested stages (every rank its halos).

    Parameters
    ----------
    ctx : runner.RunContext
    sess : tf.Session
    sim : SimulationGraph
    ops : dict
        From :func:`flowpm_mtf.jobs.nbody_run.lower_simulation`.
    scale_factors : sequence of float
        Scale factors of the catalogues (each a stage of ``sim``).
    opts : SimulateOptions

    Attributes
    ----------
    records : list of dict
        :func:`write_catalogue`'s records of the catalogues written.
    """

    def __init__(self, ctx, sess, sim, ops, scale_factors, opts):
        from ..physics import timeloop

        self.ctx, self.sess, self.sim, self.ops, self.opts = ctx, sess, sim, ops, opts
        idx = timeloop.stage_indices(scale_factors, sim.stages)
        self.at = dict(zip(idx, (float(a) for a in scale_factors)))
        self.records = []

    def __call__(self, j, a, state):
        from . import nbody_run

        if j not in self.at:
            return
        st = nbody_run.fetch_state(self.sess, self.ops, forces=False)
        res = find(self.sim.conf, self.ctx.comm, st, a, self.opts)
        self.records.append(write_catalogue(self.ctx, halos_name(self.at[j]), res, a,
                                            self.opts))


# ============================================================================= the halos job
@dataclasses.dataclass(frozen=True)
class HalosOptions:
    """Settings of ``flowpm-mtf halos`` (the FoF halos of an existing snapshot).

    Parameters
    ----------
    snapshot : str
        The snapshot (required): a run directory of ``simulate`` (its ``snapshot.h5``)
        or a snapshot file (e.g. ``RUN/snapshot_a0.5000.h5``); each rank reads a share
        of its particles.
    fof_b : float
        FoF linking length in units of the mean particle separation [dimensionless]; > 0.
    fof_min : int
        Smallest FoF halo in the catalogue [particles]; >= 1.
    fof_members : bool
        Also write each halo's member ids (``member_id``).
    """

    snapshot: str = ""
    fof_b: float = 0.2
    fof_min: int = 20
    fof_members: bool = False

    def __post_init__(self):
        if not isinstance(self.snapshot, str):
            raise ValueError("snapshot must be a path, got %r" % (self.snapshot,))
        for flag, kwargs in (("--fof-b", {"b": self.fof_b}),
                             ("--fof-min", {"min_members": self.fof_min})):
            try:
                fof.FofConfig(**kwargs)
            except ValueError as e:
                raise ValueError("%s: %s" % (flag, e)) from None
        object.__setattr__(self, "fof_members", bool(self.fof_members))

    def to_dict(self):
        """A JSON-able dict."""
        return dataclasses.asdict(self)


def snapshot_path(name):
    """The snapshot file of ``name`` (a run directory or a file).

    Raises
    ------
    ConfigError
        One line, when there is no snapshot there.
    """
    if not name:
        raise ConfigError("halos: --snapshot names no snapshot: give a simulate run directory "
                          "or a snapshot file")
    path = os.path.join(name, "snapshot.h5") if os.path.isdir(name) else name
    if not os.path.isfile(path):
        raise ConfigError("halos: %s holds no snapshot (%s not found); run simulate first "
                          "or name a snapshot file" % (name, path))
    return path


def read_share(path, comm):
    """This rank's share of a snapshot's particles (contiguous rows; no rank reads them all).

    Returns
    -------
    (ndarray, ndarray, ndarray, dict, int)
        Positions [Mpc/h], velocities [km/s], ids, the run's configuration (dict)
        and the number of particles in the snapshot.
    """
    import json

    import h5py

    from ..runs import h5dist

    h5dist.check_sources(path)
    with h5py.File(path, "r") as f:
        for name in ("position", "velocity", "id"):
            if name not in f:
                raise ConfigError("halos: %s has no %s dataset (not a particle snapshot)"
                                  % (path, name))
        n = int(f["id"].shape[0])
        lo, hi = n * comm.rank // comm.size, n * (comm.rank + 1) // comm.size
        pos = f["position"][lo:hi].astype(np.float64)
        vel = f["velocity"][lo:hi].astype(np.float64)
        ids = f["id"][lo:hi].astype(np.int64)
        config = json.loads(f.attrs.get("config", "{}"))
    return pos, vel, ids, config, n


def snapshot_a(path, config):
    """The scale factor of a snapshot: from its name ``snapshot_a<a>.h5``, else ``a_end``."""
    m = re.search(r"_a(\d+\.\d+)\.h5$", os.path.basename(path))
    return float(m.group(1)) if m else float(config.get("a_end", 1.0))


@register
class HalosJob(Job):
    """FoF halos of an existing snapshot (see :class:`HalosOptions`)."""

    name = "halos"
    help = "friends-of-friends halos of an existing snapshot (halos.h5)"
    sections = (ConfigSection("config", SimConfig), ConfigSection("halos", HalosOptions))
    default_out = "out/halos"

    def preflight(self, ctx):
        snapshot_path(ctx.configs["halos"].snapshot)   # every rank alike: one line

    def build(self, ctx, mesh):
        return None

    def lower(self, ctx, graph, lowering):
        return None

    def execute(self, ctx, sess, graph, plan):
        opts = ctx.configs["halos"]
        path = snapshot_path(opts.snapshot)
        with ctx.timed("read_s"):
            pos, vel, ids, config, n = read_share(path, ctx.comm)
        box = config.get("box_size")
        cosmo = config.get("cosmology", {})
        if box is None or "Omega_c" not in cosmo:
            raise ConfigError("halos: %s records no run configuration (box_size, cosmology)"
                              % path)
        a = snapshot_a(path, config)
        mass = fof.particle_mass(cosmo["Omega_c"] + cosmo.get("Omega_b", 0.0), box, n)
        grid = fof_grid(ctx.conf, ctx.comm)
        with ctx.timed("fof_s"):
            res = fof.find_halos(pos, vel, ids, box, grid, ctx.comm, b=opts.fof_b,
                                 min_members=opts.fof_min, particle_mass=mass, n_particles=n,
                                 member_ids=opts.fof_members)
        attrs = {"a": a, "fof_b": opts.fof_b, "fof_min_members": opts.fof_min,
                 "linking_length": float(res.linking_length), "particle_mass": mass,
                 "n_halos": int(res.n_halos), "snapshot": os.path.abspath(path)}
        return {"fof": res, "attrs": attrs, "config": config}

    def finish(self, ctx, res):
        return {"halos": [dict(res["attrs"], file=halos_name(),
                               label_rounds=int(res["fof"].iterations))]}

    def write_all(self, ctx, res):
        path = ctx.file(halos_name())
        if path is not None:
            stats = {}
            halos_io.write_halos_distributed(path, ctx.comm, res["fof"].catalogue,
                                             attrs=res["config"], fof=res["attrs"],
                                             stats=stats)
            ctx.record_write(halos_name(), stats)
