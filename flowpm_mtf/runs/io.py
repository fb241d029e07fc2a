"""Every file format of ``flowpm_mtf``: the one module its users name.

The jobs' tables and maps are written here; the snapshot has its own module
(:mod:`flowpm_mtf.runs.snapshot`), and every format is built on the generic
writers of :mod:`flowpm_mtf.runs.writers` (rank 0 writes, through the one
atomic-write path :func:`atomic_path`); both are re-exported here.

Formats
-------
snapshot.h5 (:func:`write_snapshot`, :func:`write_snapshot_distributed`)
    Particles and density of one simulation state (:mod:`flowpm_mtf.runs.snapshot`).
power.txt (:func:`write_power`)
    Text columns k [h/Mpc], P(k) [(Mpc/h)^3], modes.
kappa.h5, kappa_power.txt (:func:`write_kappa`, :func:`write_kappa_power`)
    Born convergence maps, lens planes, and their angular power spectra.
reconstruction.h5, reconstruction.txt (:func:`write_reconstruction`,
:func:`write_reconstruction_table`)
    Reconstructed and true linear fields, loss history; r(k), T(k).
summary.json, fft_demo.json (:func:`write_summary`, :func:`write_json`)
    JSON documents (the run summary: configs, timings, memory, versions).

A new output format is a new ``write_*`` function here built on
:func:`write_hdf5`, :func:`write_table` or :func:`write_json`.
"""
import json
import logging
import os

import numpy as np

# Re-exported: the one name users of the file formats import (snapshots, building blocks).
from .snapshot import (DEFAULT_UNITS, SNAPSHOT_FORMAT, lagrangian_ids,  # noqa: F401
                       particle_part, read_snapshot, write_snapshot,
                       write_snapshot_distributed)
from .writers import (_is_writer, atomic_path, fsync_path, to_jsonable,  # noqa: F401
                      versions, write_hdf5, write_json, write_markdown_table, write_table)

__all__ = ["SNAPSHOT_FORMAT", "KAPPA_FORMAT", "DEFAULT_UNITS", "versions", "to_jsonable",
           "atomic_path", "write_hdf5", "write_table", "write_json", "write_summary",
           "write_snapshot", "read_snapshot", "write_power", "read_power", "write_kappa",
           "write_kappa_power", "write_reconstruction", "write_reconstruction_table",
           "lagrangian_ids", "particle_part", "write_snapshot_distributed",
           "fsync_path"]

log = logging.getLogger(__name__)

#: Value of the ``format`` attribute of ``kappa.h5``.
KAPPA_FORMAT = "flowpm_mtf.kappa/1"


def write_summary(path, summary, rank=None):
    """Write a run's ``summary.json`` (the one summary writer; see :func:`write_json`).

    Parameters
    ----------
    path : str or os.PathLike
    summary : dict
        Configs, timings [s], peak memory per rank [MB], versions and the
        job's own results (JSON-able; numpy scalars are converted).
    rank : int, optional

    Returns
    -------
    str or None
    """
    return write_json(path, summary, rank=rank)


def write_power(path, k, pk, modes=None, *, header=None, rank=None):
    """Write a power spectrum as text columns (on rank 0 only).

    Parameters
    ----------
    path : str or os.PathLike
        Output text file.
    k : array_like
        Wavenumbers [h/Mpc], 1-d.
    pk : array_like
        Power [(Mpc/h)^3], same length as ``k``.
    modes : array_like, optional
        Number of Fourier modes in each bin; the third column is left out if
        omitted.
    header : str or dict, optional
        Extra header text (a dict is written as JSON), e.g. the configuration.
    rank : int, optional
        Rank of this process (default: from the launcher's environment).
    ids : array_like, optional
        Global particle ids (initial lattice index), shape [N]: dataset ``id``.

    Returns
    -------
    str or None
        The path written, on rank 0; ``None`` elsewhere.
    """
    k = np.asarray(k, dtype=np.float64).ravel()
    pk = np.asarray(pk, dtype=np.float64).ravel()
    columns = [k, pk]
    names = "k [h/Mpc]  P(k) [(Mpc/h)^3]"
    if pk.shape != k.shape:
        raise ValueError("k and pk differ in length: %d, %d" % (k.size, pk.size))
    if modes is not None:
        modes = np.asarray(modes, dtype=np.float64).ravel()
        if modes.shape != k.shape:
            raise ValueError("k and modes differ in length: %d, %d" % (k.size, modes.size))
        columns.append(modes)
        names += "  modes"
    if not _is_writer(rank):
        return None
    lines = []
    if header is not None:
        text = header if isinstance(header, str) else json.dumps(to_jsonable(header),
                                                                  sort_keys=True)
        lines.extend(text.splitlines())
    lines.append("versions: " + json.dumps(versions(), sort_keys=True))
    lines.append(names)
    path = write_table(path, columns, "\n".join(lines), fmt="%.17g", rank=0)
    log.info("wrote power spectrum %s (%d bins)", path, k.size)
    return path


def read_power(path):
    """Read a file written by :func:`write_power`.

    Returns
    -------
    tuple
        ``(k [h/Mpc], pk [(Mpc/h)^3], modes or None, header lines)``.
    """
    header = []
    with open(os.fspath(path)) as f:
        for line in f:
            if not line.startswith("#"):
                break
            header.append(line[1:].strip())
    data = np.loadtxt(path, comments="#", ndmin=2)
    modes = data[:, 2] if data.shape[1] > 2 else None
    return data[:, 0], data[:, 1], modes, header


# ----------------------------------------------------------------------------- lensing
def write_kappa(path, comm, kappa, plane_parts, plane_k, plane_pk, conf, lconf, geom,
                gamma=None):
    """Write ``kappa.h5`` (collective over ``comm``: every rank writes its plane blocks).

    Datasets: ``kappa`` [n_source, npix, npix] (``kappa[s, i, j]`` at
    ``theta[i], theta[j]``), ``gamma1``, ``gamma2`` (same shape, the
    Kaiser-Squires shear, if ``gamma`` is given), ``theta`` [npix] [rad],
    ``planes`` [n_planes, NX,
    NY] (1 + delta; a virtual dataset over the per-rank blocks in
    ``kappa.parts/``, see :mod:`flowpm_mtf.runs.h5dist`: no rank gathers a plane),
    ``plane_k`` [n_planes, nbins] [h/Mpc], ``plane_pk`` [n_planes, nbins]
    [(Mpc/h)^3]. Attributes: ``format`` (:data:`KAPPA_FORMAT`), ``config``
    (SimConfig JSON), ``lensing`` (LensingConfig JSON), ``geometry`` (JSON),
    ``z_source``, ``sources`` (JSON list of the map labels: delta-function sources,
    then n(z) bins), ``field_deg``, ``plane_r`` [Mpc/h], ``versions``.

    Parameters
    ----------
    path : str or os.PathLike
    comm : object
        mpi4py-like communicator.
    kappa, plane_k, plane_pk : ndarray
        Small, replicated: written by rank 0.
    plane_parts : dict
        ``pnum -> h5dist.Block`` of the planes ``[n_planes, sx, sy]`` this
        process holds.
    conf : SimConfig
    lconf : lensing.LensingConfig
    geom : lensing.LightconeGeometry
    gamma : (ndarray, ndarray), optional
        Shear maps ``gamma1``, ``gamma2`` (shape of ``kappa``), small, replicated.

    Returns
    -------
    str
        ``path``, on every rank.
    """
    from . import h5dist

    attrs = {"format": KAPPA_FORMAT, "config": conf.to_json(),
             "lensing": json.dumps(lconf.to_dict(), sort_keys=True),
             "geometry": json.dumps(geom.to_dict(), sort_keys=True),
             "z_source": geom.z_source, "sources": json.dumps(list(geom.labels)),
             "field_deg": geom.field_deg, "plane_r": geom.r,
             "versions": json.dumps(versions(), sort_keys=True)}
    units = {"kappa": "dimensionless", "theta": "rad", "planes": "1 + delta (shell average)",
             "plane_k": "h/Mpc", "plane_pk": "(Mpc/h)^3"}
    small = {"kappa": kappa, "theta": geom.theta, "plane_k": plane_k, "plane_pk": plane_pk}
    if gamma is not None:
        small.update(gamma1=gamma[0], gamma2=gamma[1])
        units.update(gamma1="dimensionless", gamma2="dimensionless")
    return h5dist.write_distributed(
        path, comm, {p: {"planes": b} for p, b in plane_parts.items()}, attrs=attrs,
        dataset_attrs={k: {"units": v} for k, v in units.items()},
        small=small)


def write_kappa_power(path, ell, measured, pred, n_modes, geom, rank=None, labels=None):
    """Write ``kappa_power.txt`` (rank 0 only).

    Columns: ell, then per source the measured C_ell, the expected C_ell from the run's
    own P(k) through the run's windows (``C_ell_limber``), the Limber C_ell of the
    deconvolved P(k) without windows, averaged over each bin's modes
    (``C_ell_limber_cont``), every further model in
    ``pred`` (e.g. ``C_ell_halofit``), and ``resolved`` (1 in the ell range the run
    resolves, :func:`flowpm_mtf.physics.lensing_theory.resolved_range`), then the number of
    modes per bin. The header gives the resolved range of each source.

    Parameters
    ----------
    ell, n_modes : ndarray
        Bins.
    measured : ndarray
        ``[n_source, n_bins]`` [sr].
    pred : dict
        :func:`flowpm_mtf.physics.lensing_theory.run_prediction` output; optional extra keys
        ``"extra": {name: [n_source, n_bins]}`` [sr].
    geom : lensing.LightconeGeometry
    labels : list of str, optional
        Map names (default ``geom.labels``: ``z_s=<z>``, ``bin<b>:<zlo>-<zhi>``).
    """
    labels = labels or list(geom.labels)
    k_nyquist, pgd = pred["k_nyquist"], pred["pgd"]
    cols, names, ranges = [ell], ["ell"], []
    extra = pred.get("extra", {})
    for s, lab in enumerate(labels):
        cols += [measured[s], pred["expected"][s], pred["continuous"][s]]
        names += ["C_ell(%s)" % lab, "C_ell_limber(%s)" % lab, "C_ell_limber_cont(%s)" % lab]
        for name, v in extra.items():
            cols.append(v[s])
            names.append("%s(%s)" % (name, lab))
        cols.append(pred["resolved"][s].astype(np.float64))
        names.append("resolved(%s)" % lab)
        lo, hi = pred["ell_range"][s]
        ranges.append("%s: %s" % (lab, "none" if np.isnan(lo) else "%.0f-%.0f" % (lo, hi)))
    cols.append(n_modes)
    names.append("modes")
    header = ("flat-sky C_ell [sr] of the Born convergence (field %g deg, %d pixels, %d planes); "
              "C_ell_limber: the expected measurement from the run's own P(k) and shot noise "
              "through the pixel, ray sampling and taper windows; "
              "C_ell_limber_cont: Limber from the deconvolved P(k), no window, averaged over "
              "the bin's modes; "
              "C_ell_halofit(_cont): the same from halofit (Takahashi 2012) P(k); C_ell_shot: "
              "shot noise; C_ell_sky: measured minus shot noise, decoupled (vs the _cont "
              "columns); C_ell_E/B: the shear's; resolved: the windows keep >= half of C_ell "
              "and half of it comes from k <= %g k_N of the PM mesh%s (ell range %s)\n%s"
              % (geom.field_deg, geom.npix, geom.n_planes, k_nyquist,
                 " (PGD with its fitted alpha)" if pgd else "", ", ".join(ranges),
                 "  ".join(names)))
    return write_table(path, cols, header, fmt="%.10g", rank=rank)


# ----------------------------------------------------------------------------- reconstruction
def write_reconstruction(path, comm, conf, rconf, parts, history):
    """Write ``reconstruction.h5`` (collective over ``comm``: every rank writes its blocks).

    Parameters
    ----------
    path : str or os.PathLike
    comm : object
        mpi4py-like communicator.
    conf : SimConfig
    rconf : reconstruct.ReconConfig
    parts : dict
        ``pnum -> {"truth", "reconstruction", "observed": h5dist.Block}`` held by
        this process: linear density contrast at a = 1, and 1 + delta at
        ``a_end`` with noise; virtual datasets [NX, NY, NZ] over the per-rank
        blocks in ``reconstruction.parts/`` (:mod:`flowpm_mtf.runs.h5dist`).
    history : dict
        ``loss``, ``chi2``, ``prior``: one value per iteration (before each
        step) plus the final value (written by rank 0).

    Returns
    -------
    str
        ``path``, on every rank.
    """
    from . import h5dist

    units = {"truth": "linear density contrast at a=1",
             "reconstruction": "linear density contrast at a=1",
             "observed": "1 + delta at a_end (CIC), with noise"}
    dattrs = {n: {"units": u} for n, u in units.items()}
    dattrs["loss"] = {"description": "(chi2 + prior) / N before each iteration, then the "
                                     "final value"}
    return h5dist.write_distributed(
        path, comm, parts, dataset_attrs=dattrs,
        small={n: np.asarray(v, np.float64) for n, v in history.items()},
        attrs={"config": conf.to_json(), "reconstruction": json.dumps(rconf.to_dict()),
               "versions": json.dumps(versions())})


def write_reconstruction_table(path, conf, rconf, k, r, tk, modes, rank=None):
    """Write ``reconstruction.txt``: k [h/Mpc], r(k), T(k), modes (rank 0 only)."""
    header = ("flowpm-mtf reconstruct: cross-correlation r(k) = P_tr / sqrt(P_t P_r) and "
              "transfer function T(k) = sqrt(P_r / P_t) of the reconstructed (r) vs true "
              "(t) linear field\ncolumns: k [h/Mpc], r, T, modes\nconfig: %s\nsettings: %s"
              % (conf.to_json(), json.dumps(rconf.to_dict())))
    return write_table(path, [k, r, tk, modes], header, fmt=["%.6e", "%.6f", "%.6f", "%d"],
                       rank=rank)


def write_imaging(path, comm, configs, parts, loss):
    """Write ``imaging.h5`` of ``flowpm-mtf imaging`` (collective: every rank its blocks).

    Parameters
    ----------
    path : str or os.PathLike
    comm : object
        mpi4py-like communicator.
    configs : dict
        Section key -> config (``to_dict``), written as JSON attributes.
    parts : dict
        ``pnum -> {"truth", "zero_filled", "tv", "unrolled": h5dist.Block}`` held by
        this process (the methods run): magnitude images ``[NX, NY, NZ]``
        [phantom intensity], virtual datasets over the per-rank blocks in
        ``imaging.parts/`` (:mod:`flowpm_mtf.runs.h5dist`).
    loss : sequence of float
        The training loss per step (written by rank 0; may be empty).

    Returns
    -------
    str
        ``path``, on every rank.
    """
    from . import h5dist

    units = {"truth": "phantom intensity (the ground truth)",
             "zero_filled": "phantom intensity, |A^H y|",
             "tv": "phantom intensity, |x| of TV-ADMM",
             "unrolled": "phantom intensity, |x| of the trained unrolled network"}
    dattrs = {n: {"units": u} for n, u in units.items()}
    dattrs["train_loss"] = {"description": "mean |x - truth|^2 per training step, before it"}
    return h5dist.write_distributed(
        path, comm, parts, dataset_attrs=dattrs,
        small={"train_loss": np.asarray(loss, np.float64)},
        attrs={**{k: json.dumps(c.to_dict()) for k, c in configs.items()},
               "versions": json.dumps(versions())})
