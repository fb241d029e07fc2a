"""The main job: Gaussian ICs -> LPT -> FastPM N-body -> snapshot, P(k), plots.

``flowpm-mtf simulate``. The graph is built once
(:class:`~flowpm_mtf.jobs.nbody_run.SimulationGraph`); the ICs and every kick-drift-kick
step run one after the other in the time loop
(:func:`flowpm_mtf.jobs.nbody_run.run_stages`), so progress and timings are logged per
step without rebuilding anything.

Outputs (into the run directory; no rank gathers a full-size array)
--------------------------------------------------------------------
snapshot.h5
    ``position`` [N, 3] [Mpc/h], ``velocity`` [N, 3] [km/s] (peculiar),
    ``id`` [N] (Lagrangian index), ``density`` [NX, NY, NZ] (1 + delta, CIC),
    attributes with the config and versions: one logical file of HDF5 virtual
    datasets over the per-rank parts in ``snapshot.parts/`` (see
    :mod:`flowpm_mtf.runs.h5dist`); particles are grouped by rank, sort by ``id``
    (empty slots of the fixed-capacity buffers are not written).
snapshot_a<a>.h5
    The same at each scale factor of ``--snapshots`` (other than ``a_end``).
halos.h5, halos_a<a>.h5
    With ``--fof``: the friends-of-friends halos of the final state and of every
    ``--snapshots`` state (number of members, mass [M_sun/h], periodic centre of mass
    [Mpc/h], mean velocity and 1D dispersion [km/s], smallest member id; with
    ``--fof-members`` the member ids), every rank its halos
    (:mod:`flowpm_mtf.jobs.halos`, :mod:`flowpm_mtf.runs.halos`).
snapdir_NNN/snapshot_NNN.R.hdf5
    With ``--snapshot-format gadget4``, instead of the two above: Gadget-4 HDF5
    snapshots, one file per rank ``R``, numbered ``NNN`` by scale factor (the
    ``--snapshots`` times, then the final state); positions [kpc/h], velocities
    [km/s] / sqrt(a), ids, no density (:mod:`flowpm_mtf.runs.gadget`).
power.txt
    k [h/Mpc], P(k) [(Mpc/h)^3], number of modes.
power_a<a>.txt
    The same after every step, with ``--power-steps``.
summary.json
    Config, timings per phase and per step [s], peak memory per rank [MB],
    versions, ``output_write`` (bytes, seconds, GB/s of the snapshots).
overview.png
    A density slab (projected per rank; only the 2D slab is gathered) and the
    measured P(k) (binned per rank, bins all-reduced) against the
    growth-scaled linear P(k).
checkpoint/
    With ``--checkpoint-every K`` or on SIGTERM (:mod:`flowpm_mtf.runs.checkpoint`;
    with the snapshots and P(k) files written before it); ``--resume OUT``
    continues from the newest valid one and publishes the same files as an
    uninterrupted run.
"""
import dataclasses
import logging
from typing import Tuple

import numpy as np

from ..physics import cosmology as cosmo_mod
from ..physics import linear_power
from ..physics import linear_power_source
from ..runs import gadget, io
from ..config import SimConfig
from ..logs import rank0_only
from ..analysis.fof import FofConfig
from . import halos, register
from .base import ConfigSection, Job

__all__ = ["SimulateOptions", "SimulateJob", "overview_plot", "write_gadget_snapshot",
           "SNAPSHOT_FORMATS"]

log = rank0_only(logging.getLogger(__name__))

#: Values of ``--snapshot-format``: the package's own layout, Gadget-4 HDF5.
SNAPSHOT_FORMATS = ("flowpm", "gadget4")


@dataclasses.dataclass(frozen=True)
class SimulateOptions:
    """Outputs of ``flowpm-mtf simulate`` beyond the final snapshot.

    Parameters
    ----------
    snapshots : tuple of float
        Scale factors [dimensionless] of additional snapshots
        ``snapshot_a<a>.h5`` within ``[a_start, a_end]``; each becomes a stage
        of the time loop (the final state is always ``snapshot.h5``).
    power_steps : bool
        Measure P(k) after every step and write ``power_a<a>.txt``.
    compression : {"none", "gzip", "lzf"}
        Compression of the snapshots' part files (default none: written at
        disk speed; gzip is several times slower to write, lzf less so).
    fof : bool
        Find the friends-of-friends halos of the final state and of every
        ``--snapshots`` state: ``halos.h5``, ``halos_a<a>.h5``.
    fof_b : float
        FoF linking length in units of the mean particle separation [dimensionless]; > 0.
    fof_min : int
        Smallest FoF halo in the catalogue [particles]; >= 1.
    fof_members : bool
        Also write each halo's member ids (``member_id``) into the catalogues.
    snapshot_format : {"flowpm", "gadget4"}
        Format of the snapshots: ``flowpm`` (``snapshot.h5``: one HDF5 file over
        per-rank parts, with the density) or ``gadget4`` (Gadget-4 HDF5, one
        file per rank, ``snapdir_NNN/snapshot_NNN.R.hdf5``: positions [kpc/h],
        velocities [km/s] / sqrt(a), ids; read by yt and pynbody; a cubic box).
    """

    snapshots: Tuple[float, ...] = ()
    power_steps: bool = False
    compression: str = dataclasses.field(default="none",
                                         metadata={"choices": ("none", "gzip", "lzf")})
    fof: bool = False
    fof_b: float = 0.2
    fof_min: int = 20
    fof_members: bool = False
    snapshot_format: str = dataclasses.field(default="flowpm",
                                             metadata={"choices": SNAPSHOT_FORMATS})

    def __post_init__(self):
        snaps = self.snapshots
        snaps = (snaps,) if np.isscalar(snaps) else tuple(snaps)
        for a in snaps:
            if isinstance(a, bool) or not np.isfinite(float(a)) or float(a) <= 0:
                raise ValueError("snapshots must be positive scale factors, got %r"
                                 % (self.snapshots,))
        object.__setattr__(self, "snapshots", tuple(sorted(float(a) for a in snaps)))
        object.__setattr__(self, "power_steps", bool(self.power_steps))
        if self.compression not in ("none", "gzip", "lzf"):
            raise ValueError("compression must be none, gzip or lzf, got %r" % (self.compression,))
        for flag, kwargs in (("--fof-b", {"b": self.fof_b}),
                             ("--fof-min", {"min_members": self.fof_min})):
            try:
                FofConfig(**kwargs)
            except ValueError as e:
                raise ValueError("%s: %s" % (flag, e)) from None
        object.__setattr__(self, "fof", bool(self.fof))
        object.__setattr__(self, "fof_members", bool(self.fof_members))
        if self.snapshot_format not in SNAPSHOT_FORMATS:
            raise ValueError("snapshot_format must be one of %s, got %r"
                             % (", ".join(SNAPSHOT_FORMATS), self.snapshot_format))

    @property
    def h5_compression(self):
        """The h5py filter of :attr:`compression` (None for none)."""
        return None if self.compression == "none" else self.compression

    def to_dict(self):
        """A JSON-able dict."""
        return {"snapshots": list(self.snapshots), "power_steps": self.power_steps,
                "compression": self.compression, "fof": self.fof, "fof_b": self.fof_b,
                "fof_min": self.fof_min, "fof_members": self.fof_members,
                "snapshot_format": self.snapshot_format}


@register
class SimulateJob(Job):
    """LPT + FastPM N-body simulation (see the module docstring)."""

    name = "simulate"
    help = "LPT + FastPM N-body simulation (the main job)"
    sections = (ConfigSection("config", SimConfig),
                ConfigSection("simulate", SimulateOptions),
                ConfigSection("linear_power", linear_power_source.LinearPowerOptions))
    default_out = "out/sim"
    checkpoints = True
    # the ICs' P(k): a resume with another table (its digest) is refused
    state_sections = {"linear_power": ()}

    def _stages(self, ctx):
        from ..physics import nbody, timeloop

        conf, opts = ctx.conf, ctx.configs["simulate"]
        return timeloop.merge_stages(nbody.default_stages(conf), opts.snapshots)

    def preflight(self, ctx):
        stages = self._stages(ctx)  # every rank raises the same error for a snapshot outside
        if ctx.configs["simulate"].snapshot_format == "gadget4":
            gadget.check_box(ctx.conf)   # Gadget's box is one number
        # the ICs' P(k) table (--linear-power, --boltzmann): read once on rank 0, broadcast,
        # checked on every rank; its digest recorded in the config (the checkpoint identity)
        # (a caller's configs without the section: the default, the Eisenstein & Hu fit)
        # (the command line's checks run this preflight before the runner does: read once)
        lp = ctx.configs.setdefault("linear_power", linear_power_source.LinearPowerOptions())
        if not hasattr(ctx, "linear_power"):
            ctx.linear_power = linear_power_source.resolve(lp, ctx.conf, ctx.comm,
                                                           resume=ctx.resume)
        if ctx.linear_power is not None and not lp.linear_power_digest:
            ctx.configs["linear_power"] = dataclasses.replace(
                lp, linear_power_digest=ctx.linear_power.digest)
        if ctx.resume:              # the run; a checkpoint of another run is refused
            from . import nbody_run

            nbody_run.check_resume(ctx, stages)

    def build(self, ctx, mesh):
        from .nbody_run import SimulationGraph

        lp = getattr(ctx, "linear_power", None)
        return SimulationGraph(ctx.conf, mesh, self._stages(ctx),
                               plin=None if lp is None else lp.table)

    def describe(self, ctx, sim):
        conf = ctx.conf
        return "%d steps, mesh %s, grid %s" % (sim.n_steps, "x".join(map(str, conf.nc)),
                                               "x".join(map(str, conf.grid)))

    def lower(self, ctx, sim, lowering):
        from . import nbody_run

        return nbody_run.lower_simulation(sim, lowering)

    def execute(self, ctx, sess, sim, ops):
        from ..physics import timeloop
        from . import nbody_run

        opts = ctx.configs["simulate"]
        conf = ctx.conf
        observers, res = [], {}
        extra = [a for a in opts.snapshots if abs(a - conf.a_end) > timeloop.STAGE_RTOL * a]
        if extra:
            write = None
            if opts.snapshot_format == "gadget4":   # numbered by scale factor, final last
                def write(a_req, a, parts):
                    return write_gadget_snapshot(ctx, extra.index(a_req), a, parts,
                                                 opts.h5_compression)
            observers.append(nbody_run.SnapshotWriter(ctx, sess, sim, ops, extra,
                                                        opts.h5_compression, write=write))
        res["n_extra"] = len(extra)
        halo_writer = None
        if extra and opts.fof:   # after the snapshot's writer: halos_a<a>.h5 beside it
            halo_writer = halos.HalosWriter(ctx, sess, sim, ops, extra, opts)
            observers.append(halo_writer)
        if opts.power_steps:   # written as the loop goes: a checkpoint holds the earlier ones
            observers.append(nbody_run.PowerWriter(ctx, sess, ops["fetch"],
                                                   range(1, len(sim.stages))))
        nbody_run.run_stages(ctx, sess, sim, ops, observers)
        with ctx.timed("fetch_s"):   # this process's slices and the reduced P(k) only,
            # in one session call (the density is painted once for itself and its P(k));
            # the forces are not part of a snapshot
            res["state"], (fetched, res["rho"]) = nbody_run.fetch_state(
                sess, ops, forces=False, extra=(ops["fetch"], [t for _, t, _ in ops["rho"]]))
            res.update(fetched)
        res["ops"], res["sim"] = ops, sim
        res["halo_records"] = halo_writer.records if halo_writer is not None else []
        return res

    def finish(self, ctx, res):
        from . import nbody_run

        conf = ctx.conf
        res["parts"] = nbody_run.snapshot_parts(conf, res["state"], res["ops"]["rho"],
                                                res["rho"], conf.a_end)
        res["slab"], res["depth"] = nbody_run.density_slab(conf, res["ops"]["rho"], res["rho"],
                                                           ctx.comm)
        res["keep"] = res["modes"] > 0
        extra = {"n_particles": conf.n_cells,
                 "migration": nbody_run.migration_summary(conf, res["sim"].migration,
                                                              res["sim"].send_rows)}
        lp = getattr(ctx, "linear_power", None)
        if lp is not None:          # where the ICs' P(k) came from (summary.json)
            extra["linear_power_table"] = lp.record
        opts = ctx.configs["simulate"]
        if opts.fof:   # collective: every rank its particles, no gather
            with ctx.timed("fof_s"):
                res["fof"] = halos.find(conf, ctx.comm, res["state"], conf.a_end, opts)
            extra["halos"] = res["halo_records"] + [halos.record(
                conf, halos.halos_name(), res["fof"], conf.a_end, opts)]
        return extra

    def write_all(self, ctx, res):
        opts = ctx.configs["simulate"]
        if opts.snapshot_format == "gadget4":
            write_gadget_snapshot(ctx, res["n_extra"], ctx.conf.a_end, res["parts"],
                                  opts.h5_compression)
        else:
            from . import nbody_run

            nbody_run.write_snapshot(ctx, "snapshot.h5", res["parts"], opts.h5_compression)
        if "fof" in res:
            halos.write_catalogue(ctx, halos.halos_name(), res["fof"], ctx.conf.a_end,
                                  ctx.configs["simulate"])

    def write(self, ctx, out, res, summary):
        keep = res["keep"]
        io.write_power(out.path("power.txt"), res["k"][keep], res["pk"][keep],
                       res["modes"][keep], rank=0)

    def plot(self, ctx, out, res, summary):
        keep = res["keep"]
        lp = getattr(ctx, "linear_power", None)
        overview_plot(out.path("overview.png"), ctx.conf, res["slab"], res["k"][keep],
                      res["pk"][keep], res["depth"], power=None if lp is None else lp.table)


def write_gadget_snapshot(ctx, number, a, parts, compression=None):
    """Write Gadget-4 snapshot ``number`` into ``snapdir_NNN`` (collective; every rank its files).

    Parameters
    ----------
    ctx : runner.RunContext
    number : int
        ``NNN``.
    a : float
        Scale factor of the state.
    parts : dict
        :func:`flowpm_mtf.jobs.nbody_run.snapshot_parts`.
    compression : {None, "gzip", "lzf"}

    Returns
    -------
    str
        The directory's name.
    """
    name = gadget.snapshot_dir(number)
    path = ctx.file(name)
    if path is not None:
        stats = {}
        gadget.write_gadget4(path, ctx.comm, parts, ctx.conf, a, number,
                             compression=compression, stats=stats)
        ctx.record_write(name, stats)
    return name


def overview_plot(path, conf, slab, k, pk, depth, power=None):
    """Density slab and measured P(k) vs the growth-scaled linear P(k).

    Parameters
    ----------
    slab : ndarray
        ``[NX, NY]`` mean of 1 + delta over the first ``depth`` cells along z
        (:func:`flowpm_mtf.jobs.nbody_run.density_slab`).
    power : callable, optional
        The linear P(k) at a = 1 of the ICs (a table); default the Eisenstein & Hu fit.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4.6))
    ax0.imshow(np.log10(slab.T + 1e-2), origin="lower", cmap="magma",
               extent=[0, conf.box_size[0], 0, conf.box_size[1]])
    ax0.set_xlabel("x [Mpc/h]")
    ax0.set_ylabel("y [Mpc/h]")
    ax0.set_title("log10(1+delta), slab of %d cells, a=%.2f" % (depth, conf.a_end))
    kk = np.logspace(np.log10(k.min()), np.log10(k.max()), 200)
    d1 = cosmo_mod.growth(conf.cosmology, np.array([conf.a_end])).D1[0]
    ax1.loglog(k, pk, "o-", ms=3, label="measured (CIC, not deconvolved)")
    plin = (linear_power.linear_matter_power(conf.cosmology, kk) if power is None
            else power(kk))
    ax1.loglog(kk, d1**2 * plin, "k--",
               label="linear, D1(a)^2 P_lin")
    ax1.set_xlabel("k [h/Mpc]")
    ax1.set_ylabel("P(k) [(Mpc/h)^3]")
    ax1.legend()
    ax1.set_title("power spectrum at a=%.2f" % conf.a_end)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
