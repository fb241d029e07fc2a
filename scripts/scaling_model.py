"""Scaling model of flowpm_mtf: communication, memory and time per rank.

Reads ``results/raw/bench/bench_compare.json`` (from ``scripts/bench_compare.py``;
unversioned: run the benchmark first on a fresh clone),
checks the model against the measurements, and writes the generated tables into
``docs/scaling.md`` between the markers ``<!-- BEGIN GENERATED -->`` and
``<!-- END GENERATED -->`` (the prose around them is kept).

Notation (one rank of a P x Q process grid, N = P Q, cubic mesh of nc^3 cells,
one particle per cell, halo h, b bytes per real, 2 b per complex):

* local complex field  C = 2 b nc^3 / N
* padded block         px = nc/P + 2h, py = nc/Q + 2h, nz = nc
* a_P = 1 if P > 1 else 0 (likewise a_Q): a trivial mesh axis moves nothing.

Communication per rank (bytes *received*; "recv" counts as
``HvdSimdMeshImpl.comm_bytes_received``, i.e. an alltoall's own piece included;
"wire" only what arrives from other ranks):

* one 3D FFT of F fields: one alltoall per non-trivial axis, each of F C bytes;
  wire: F C ((P-1)/P + (Q-1)/Q); a transform of or to a real field counts 1/2 on the
  CPU's native path (half the spectrum through the exchanges, see
  :func:`fft_fields`);
* one halo fill or reduce: 2 shifts per non-trivial axis of an h-cell slab:
  2 h nz b (py a_P + px a_Q);
* one N-body step (one PM force): FFT of 1 field + inverse FFT of 3 real fields
  packed into 2 complex ones (:func:`flowpm_mtf.physics.kernels.packed_inverse`), 1 halo
  reduce (painting) + halo fills of the 3 force components (in 1 or 3 readout
  calls, see :func:`readout_calls_per_force`), one scalar int32 allreduce per
  painting/readout call (escape checks);
* 2LPT initial conditions (with the linear field): 10 FFT-fields (3 of them real:
  8.5 on the half-spectrum path), no halo.

Usage::

    python scripts/scaling_model.py [--json results/raw/bench/bench_compare.json]
                                    [--doc docs/scaling.md] [--gpus 1,8]
"""
import argparse
import math
import os
import sys

import numpy as np

from flowpm_bench import RESULTS, REPO
from flowpm_bench.configs import readout_calls_per_force
from flowpm_bench.launch import default_grid
from flowpm_bench.results import json_path, read_raw

BEGIN, END = "<!-- BEGIN GENERATED -->", "<!-- END GENERATED -->"

# FFT-fields (complex fields passing through one 3D transform) per workload, on the
# k-space path. Real fields from Hermitian spectra go two per complex inverse transform
# (flowpm_mtf.physics.kernels.packed_inverse): the force's 3 components are 2 fields, 2LPT's
# psi1 + six second derivatives 5 and psi2 2. LPT: noise r2c 1 + linear c2r 1 + 5 +
# source r2c 1 + 2 = 10 (2LPT reuses the Fourier modes of the linear field,
# ics.modes_of, instead of transforming it back; counted at lowering: 10 x the bytes
# of one). Step: r2c 1 + 2 = 3.
FFT_FIELDS = {"fft": 2, "halo": 0, "lpt": 10, "nbody_step": 3}
# Of those, the transforms of a real field (r2c) or to one (c2r) without batch
# dimensions: fft 2 (r2c, c2r), lpt 3 (noise r2c, linear c2r, source r2c), step 1
# (the density's r2c). On the CPU's native path they move half the spectrum
# (flowpm_mtf.mesh.fft, FFT3DOperation._lower_half) when nc and the blocks nc / P, nc / Q
# are even. The GPU model (TensorFlow path) moves all the modes.
REAL_FFT_FIELDS = {"fft": 2, "halo": 0, "lpt": 3, "nbody_step": 1}
# The real-space path (flowpm_mtf.physics.gravity.force_field_of_potential, flowpm_mtf.physics.lpt_source):
# every field comes from a potential by one real inverse transform and differences, so
# every transform is real. LPT: the linear field's noise r2c and c2r (lowered with it,
# though the potentials do not use them), and two radial filters of a forward and an
# inverse transform each (flowpm_mtf.mesh.radial_filter: the noise to phi1, the 2LPT source to
# phi2) = 6; step r2c + c2r = 2.
REAL_SPACE_FFT_FIELDS = {"fft": 2, "halo": 0, "lpt": 6, "nbody_step": 2}


def real_space_paths(nc, grid, halo):
    """(force, lpt): whether the installed code takes the real-space force field
    (``gravity._native_stencil``) and LPT fields (``lpt_source.available``) at these sizes."""
    import tensorflow.compat.v1 as tf

    from flowpm_mtf.physics import gravity, lpt_source
    from flowpm_mtf.config import SimConfig

    conf = SimConfig(nc=nc, grid=tuple(grid), halo_size=halo)
    return (gravity._native_stencil(conf, tf.float32),
            lpt_source.available(conf, tf.float32, lpt_source.SOURCE_REACH))


def _real_space(workload, nc, grid, halo):
    """Whether ``workload`` takes the real-space path (the halo and fft workloads have none)."""
    if workload not in ("lpt", "nbody_step"):
        return False
    force, lpt = real_space_paths(nc, grid, halo)
    return lpt if workload == "lpt" else force


def fft_fields(workload, nc, grid, half_spectrum=True, halo=0):
    """Complex-field equivalents a workload moves through each all-to-all.

    Parameters
    ----------
    workload : str
    nc : int
    grid : (int, int)
    half_spectrum : bool
        Model the CPU's native path (real transforms on half the spectrum when the
        sizes allow it); False: all modes.
    halo : int
        Halo size [cells]: with ``nc`` and ``grid`` it decides the path (real space or
        k-space) of the force.

    Returns
    -------
    float
    """
    from flowpm_mtf.mesh import fft

    if _real_space(workload, nc, grid, halo):
        f = real = REAL_SPACE_FFT_FIELDS[workload]
    else:
        f, real = FFT_FIELDS[workload], REAL_FFT_FIELDS[workload]
    if half_spectrum and fft.half_spectrum_fits((nc,) * 3, grid):
        f -= real / 2
    return f


READOUTS = readout_calls_per_force()
# Halo field-ops (fill or reduce of one real field) per workload, as (fields, width):
# the step paints once (reduce) and fills the 3 force components (in 1 or 3 calls, same
# bytes); on the real-space path it fills the potential 2 cells wider instead, and the
# LPT fills its potentials (4 cells for the 2LPT source, 2 for the second displacement).
def halo_ops(workload, nc, grid, halo):
    """``[(fields, width [cells])]`` of the halo fills and reduces of one run of a workload."""
    if workload == "halo":
        return [(2, halo)]
    if not _real_space(workload, nc, grid, halo):
        return [(4, halo)] if workload == "nbody_step" else []
    from flowpm_mtf.physics import gravity, lpt_source

    if workload == "lpt":
        return [(1, lpt_source.SOURCE_REACH), (1, gravity.GRADIENT_REACH)]
    return [(1, halo), (1, halo + gravity.GRADIENT_REACH)]


# Scalar int32 allreduces (particle escape checks: painting + each readout).
SCALAR_REDUCES = {"fft": 0, "halo": 0, "lpt": 0, "nbody_step": 1 + READOUTS}


def STEP_COLLECTIVES(P, Q):  # noqa: N802 (a table, like the constants above)
    """Collective calls per N-body step (latency term): 2 alltoalls per split axis
    (forward, batched inverse), 2 shifts per split axis for each halo call (1 reduce
    + READOUTS fills), one allreduce per escape check."""
    axes = (P > 1) + (Q > 1)
    return 2 * axes + (1 + READOUTS) * 2 * axes + SCALAR_REDUCES["nbody_step"] * (P * Q > 1)


# ------------------------------------------------------------------ GPU assumptions
# None of these is measured here (no GPU on this machine): they are stated inputs.
GPU = {
    "A100-40GB": {"mem_gb": 40.0, "hbm_gbs": 1555.0},
    "A100-80GB": {"mem_gb": 80.0, "hbm_gbs": 2039.0},
}
GPU_FFT_FLOPS = 2.0e12        # effective cuFFT rate on large 3D c2c, fp32 [flop/s] (assumed)
GPU_PART_BYTES = 600.0        # HBM bytes touched per particle per step (assumed: CIC
#                               paint 8 scatter-adds + 3x8 gathers, state r/w, index math)
GPU_HBM_EFFICIENCY = 0.3      # fraction of peak HBM bandwidth reached by scatter/gather
NVLINK_GBS = 25.0             # per-GPU all-to-all bandwidth inside a node [GB/s] (stated)
IB_GBS = 12.5                 # per-GPU InfiniBand HDR bandwidth between nodes [GB/s]
GPUS_PER_NODE = 8
LATENCY_S = 30e-6             # per collective call (NCCL/MPI small-message latency)
TF_OVERHEAD_GB = 1.5          # CUDA context + TF runtime per GPU (assumed)
# Multiplicative headroom for TF's allocator fragmentation when sizing the largest run.
GPU_HEADROOM = 0.8


# ============================================================================ communication
def comm_bytes(workload, nc, grid, halo, itemsize=4, readouts=None, half_spectrum=True):
    """Bytes one rank receives in one run of a workload.

    Parameters
    ----------
    workload : str
        ``fft``, ``halo``, ``lpt`` or ``nbody_step``.
    nc : int
        Mesh cells per side [cells].
    grid : (int, int)
        Process grid (P, Q).
    halo : int
        Halo size [cells].
    itemsize : int
        Bytes per real value (4 for float32).
    readouts : int, optional
        CIC readout calls per PM force (default: as in the installed code,
        :data:`READOUTS`); each adds one escape-check allreduce.
    half_spectrum : bool
        See :func:`fft_fields` (True: the CPU's native path).

    Returns
    -------
    dict
        ``recv`` (Horovod accounting, as ``comm_bytes_received``), ``wire`` (from
        other ranks only), and ``by_kind`` (recv bytes per collective kind) [bytes].
    """
    P, Q = grid
    n = P * Q
    aP, aQ = int(P > 1), int(Q > 1)
    c = 2 * itemsize * nc**3 // n
    f = fft_fields(workload, nc, grid, half_spectrum, halo)
    sred = SCALAR_REDUCES[workload]
    if workload == "nbody_step" and readouts is not None:
        sred = 1 + readouts
    alltoall = int(f * c) * (aP + aQ)
    alltoall_wire = f * c * ((P - 1) / P + (Q - 1) / Q)
    receive = sum(k * 2 * w * nc * itemsize * ((nc // Q + 2 * w) * aP + (nc // P + 2 * w) * aQ)
                  for k, w in halo_ops(workload, nc, grid, halo))
    allreduce = sred * 4 if n > 1 else 0
    allreduce_wire = sred * 2.0 * (n - 1) / n * 4 if n > 1 else 0.0
    return {"recv": alltoall + receive + allreduce,
            "wire": alltoall_wire + receive + allreduce_wire,
            "by_kind": {"alltoall": alltoall, "allconcat": 0, "allreduce": allreduce,
                        "receive": receive}}


def internode_bytes(workload, nc, grid, halo, itemsize=4, half_spectrum=True):
    """Bytes one rank receives over the first mesh axis (P) in one run of a workload.

    When each row of the P x Q grid runs on a node of its own (ranks ``p Q .. p Q + Q - 1``
    on node p, as Open MPI fills a hostfile's slots with ``ppr:Q:node``), this is what
    crosses the network into the rank: the P-axis part of :func:`comm_bytes`' wire bytes
    (the all-to-all pieces from the other rows, the halo margins along x), without the
    4-byte scalar reductions.

    Returns
    -------
    float
        [bytes]
    """
    P, Q = grid
    if P == 1:
        return 0.0
    c = 2 * itemsize * nc**3 // (P * Q)
    f = fft_fields(workload, nc, grid, half_spectrum, halo)
    halo_p = sum(k * 2 * w * nc * itemsize * (nc // Q + 2 * w)
                 for k, w in halo_ops(workload, nc, grid, halo))
    return f * c * (P - 1) / P + halo_p


def record_readouts(rec):
    """Readouts per force of the code a benchmark record measured (None: unknown)."""
    return rec.get("code", {}).get("readouts_per_force")


def measured_vs_predicted_hvd(rec):
    """(measured, predicted) recv bytes of an hvd record, largest rank.

    ``comm_bytes_received`` covers every collective of the graph: for the
    N-body step that includes the 2LPT initialisation of the state variables
    (and their master copies, which use allconcat/broadcast and are left out).
    """
    kinds = ("alltoall", "receive", "allreduce")
    meas = max(sum(m[k] for k in kinds) for m in rec["hvd_comm_bytes_received_per_rank"])
    pred = comm_bytes(rec["workload"], rec["nc"], rec["grid"], rec["halo"],
                      readouts=record_readouts(rec))
    total = sum(pred["by_kind"][k] for k in kinds)
    if rec["workload"] == "nbody_step":
        lpt = comm_bytes("lpt", rec["nc"], rec["grid"], rec["halo"])
        total += sum(lpt["by_kind"][k] for k in kinds)
    return meas, total


# ============================================================================ memory
#: Cell size [Mpc/h] of the extrapolated runs (2048^3 in 1 Gpc/h): it sets the particle
#: capacity of a block (the overdensity a block can reach, see flowpm_mtf.physics.sizing.capacity).
GPU_CELL_MPC_H = 0.5
GPU_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
"""GPU counts of the extrapolation tables (``--gpus``: a subset, e.g. for a quick check)."""


def gpu_memory_per_rank(nc, n, cell=GPU_CELL_MPC_H):
    """Predicted device memory of one GPU rank [bytes] of the default (eulerian) run.

    The measured CPU memory model of ``flowpm_mtf/runs/memory_model.json`` (fitted by
    ``scripts/bench_scaling.py render``, used by the preflight check): bytes per
    particle slot and per padded cell of the rank's block, with the TF/CUDA overhead
    ``TF_OVERHEAD_GB`` (assumed, untested) instead of the CPU runtime floor. Slices
    only: no rank holds a full-size array (the variables have no master copies).
    """
    from flowpm_mtf.runs import preflight
    from flowpm_mtf.config import SimConfig

    conf = SimConfig(nc=nc, box_size=cell * nc, grid=_grid(n))
    slots, cells = preflight.memory_terms(conf)
    return TF_OVERHEAD_GB * 2**30 + (preflight.BYTES_PER_SLOT * slots
                                     + preflight.BYTES_PER_PADDED_CELL * cells)


def largest_nc(n, mem_gb, step=64):
    """Largest nc (multiple of ``step`` divisible by the grid) that fits on n GPUs."""
    P, Q = _grid(n)
    best = None
    nc = step
    while nc <= 16384:
        if nc % P == 0 and nc % Q == 0 and nc // max(P, Q) > 2:
            if gpu_memory_per_rank(nc, n) <= GPU_HEADROOM * mem_gb * 2**30:
                best = nc
            else:
                break
        nc += step
    return best


_grid = default_grid  # the most square (P, Q), P >= Q, P Q = n


# ============================================================================ time
def fft_flops(nc, fields=1):
    """Flops of ``fields`` complex 3D FFTs of nc^3 points (5 N log2 N)."""
    npts = nc**3
    return fields * 5.0 * npts * math.log2(npts)


def cpu_features(nc, grid, halo):
    """Features of the CPU step-time model for one rank: (collective calls, FFT flops,
    particles, wire bytes) of one N-body step."""
    P, Q = grid
    n = P * Q
    flops = fft_flops(nc, fft_fields("nbody_step", nc, grid, False, halo))
    return np.array([STEP_COLLECTIVES(P, Q), flops / n, nc**3 / n,
                     comm_bytes("nbody_step", nc, grid, halo)["wire"]], float)


def fit_cpu_time(records, train_sizes):
    """Non-negative fit of the hvd N-body step time on this CPU.

    ``t = latency * calls + flops / R_fft + particles * c_part + wire / bandwidth``,
    fitted on the hvd ``nbody_step`` records with ``nc`` in ``train_sizes``.

    Returns
    -------
    dict or None
        ``coef`` (s per call, s per flop, s per particle, s per byte) and ``rows``
        (nc, grid, measured [s], predicted [s], in training set); None with fewer
        than 4 training records.
    """
    from scipy.optimize import nnls

    rows = [r for r in records if r["backend"] == "hvd" and r["workload"] == "nbody_step"]
    train = [r for r in rows if r["nc"] in train_sizes]
    if len(train) < 4:
        return None
    X = np.array([cpu_features(r["nc"], r["grid"], r["halo"]) for r in train])
    scale = X.max(axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls(X / scale, np.array([r["median_s"] for r in train]))
    coef = coef / scale
    out = [(r["nc"], tuple(r["grid"]), r["median_s"],
            float(cpu_features(r["nc"], r["grid"], r["halo"]) @ coef), r["nc"] in train_sizes)
           for r in rows]
    return {"coef": coef.tolist(), "rows": out}


def gpu_step_time(nc, n, halo, gpu):
    """Predicted time of one N-body step on n GPUs [s] and its parts."""
    P, Q = _grid(n)
    npart = nc**3 / n
    bw = (NVLINK_GBS if n <= GPUS_PER_NODE else IB_GBS) * 1e9
    wire = comm_bytes("nbody_step", nc, (P, Q), halo, half_spectrum=False)["wire"]
    t_comm = wire / bw + STEP_COLLECTIVES(P, Q) * LATENCY_S
    t_fft = fft_flops(nc, fft_fields("nbody_step", nc, (P, Q), False, halo)) / n / GPU_FFT_FLOPS
    t_part = npart * GPU_PART_BYTES / (GPU[gpu]["hbm_gbs"] * 1e9 * GPU_HBM_EFFICIENCY)
    return {"total": t_comm + t_fft + t_part, "comm": t_comm, "fft": t_fft, "particles": t_part}


# ============================================================================ report
def _fmt_bytes(b):
    return "%.3f" % (b / 2**20)


def tables(data, gpus=GPU_COUNTS):
    """The generated Markdown (str); the GPU tables have the rows of the counts ``gpus``."""
    records = data["records"]
    meta = data.get("meta", {})
    out = ["_Generated by `python scripts/scaling_model.py` from "
           "`results/raw/bench/bench_compare.json` (%s; %s)._"
           % (meta.get("machine", "?"), meta.get("date", "?")), ""]
    # ---- communication
    out += ["### Communication per rank: predicted vs measured", "",
            "Bytes received by the largest rank in one run. *measured*: "
            "`HvdSimdMeshImpl.comm_bytes_received` (run-time sizes, Horovod accounting: an "
            "alltoall's own piece included) for hvd rows; *counted* for the placement "
            "backends (lowering-time count of the same collectives). *wire* excludes the "
            "rank's own piece.", "",
            "| workload | nc | grid | halo | backend | predicted recv [MB] | measured/counted "
            "recv [MB] | predicted wire [MB] | counted wire [MB] |", "|---|---|---|---|---|---|---|---|---|"]
    worst = 0.0
    for r in sorted(records, key=lambda r: (r["workload"], r["nc"], r["grid"], r["backend"])):
        if r["backend"] == "mpi4py-fft" or "bytes" not in r:
            continue
        p = comm_bytes(r["workload"], r["nc"], r["grid"], r["halo"], readouts=record_readouts(r))
        label = r["backend"]
        if r["backend"] == "hvd":
            meas, pred = measured_vs_predicted_hvd(r)
            p = dict(p, recv=pred)
            label = "hvd (measured)" + (" *" if r["workload"] == "nbody_step" else "")
        else:
            meas = r["bytes"]["recv_max"]
        worst = max(worst, abs(meas - p["recv"]) / max(p["recv"], 1))
        out.append("| %s | %d | %s | %d | %s | %s | %s | %s | %s |" % (
            r["workload"], r["nc"], "x".join(map(str, r["grid"])), r["halo"], label,
            _fmt_bytes(p["recv"]), _fmt_bytes(meas), _fmt_bytes(p["wire"]),
            _fmt_bytes(r["bytes"]["wire_max"])))
    out += ["", "\\* nbody_step on hvd: `comm_bytes_received` covers the whole graph, i.e. the "
            "step plus the 2LPT initialisation of its variables (alltoall, receive and "
            "allreduce kinds; the variables' master/slice copies excluded); predicted = "
            "step + lpt.", "",
            "Largest relative difference predicted vs measured/counted: %.2e." % worst, ""]
    # ---- memory: measured by scripts/bench_scaling.py (section BENCH-SCALING below)
    # ---- CPU time
    sizes = sorted({r["nc"] for r in records if r["backend"] == "hvd"
                    and r["workload"] == "nbody_step"})
    train = sizes[:-1] if len(sizes) >= 3 else sizes
    cfit = fit_cpu_time(records, train) if len(sizes) >= 2 else None
    if cfit:
        lat, per_flop, per_part, per_byte = cfit["coef"]
        out += ["### Time per N-body step on this CPU: predicted vs measured (hvd)", "",
                "Model t = latency x collective calls + FFT flops / R + particles x c + wire "
                "bytes / bandwidth, fitted (non-negative least squares) on the hvd steps with "
                "nc in %s; rows with other nc are predictions. Fitted: latency %.2f ms per "
                "call, R = %s, c = %.2f us per particle, bandwidth %s. On this loaded "
                "machine the run-to-run noise is large (see the benchmark table)." % (
                    train, 1e3 * lat,
                    "%.2f GFLOP/s" % (1e-9 / per_flop) if per_flop > 0 else "inf (no FFT term)",
                    1e6 * per_part,
                    "%.2f GB/s" % (1e-9 / per_byte) if per_byte > 0 else "inf (no byte term)"),
                "", "| nc | grid | measured [ms] | model [ms] | rel. diff | fitted on |",
                "|---|---|---|---|---|---|"]
        for nc, g, m, p, tr in sorted(cfit["rows"]):
            out.append("| %d | %dx%d | %.1f | %.1f | %+.0f%% | %s |" % (
                nc, g[0], g[1], 1e3 * m, 1e3 * p, 100 * (p - m) / m,
                "yes" if tr else "**no (prediction)**"))
        out.append("")
    # ---- GPU extrapolation
    halo = 2
    out += ["### Largest mesh (nc^3 particles and cells) on N GPUs", "",
            "Default eulerian run (halo %d, automatic particle capacity for %.1f Mpc/h "
            "cells), float32, %.0f%% of device memory usable; memory model of "
            "`flowpm_mtf/runs/memory_model.json` (measured on the CPU, section *Memory "
            "benchmark* below) with a TF/CUDA overhead of %.1f GB assumed instead of the "
            "CPU runtime floor. Untested on GPUs." % (halo, GPU_CELL_MPC_H,
                                                     100 * GPU_HEADROOM, TF_OVERHEAD_GB), "",
            "| N GPUs | grid | 40 GB | 80 GB |", "|---|---|---|---|"]
    for n in gpus:
        row = [str(n), "%dx%d" % _grid(n)]
        for gb in (40.0, 80.0):
            nc = largest_nc(n, gb)
            row.append("%d^3" % nc if nc else "-")
        out.append("| " + " | ".join(row) + " |")
    out += ["", "### Expected time per N-body step on A100-80GB", "",
            "Assumed (untested here): cuFFT %.1f TFLOP/s effective on 3D c2c; particle work "
            "%.0f HBM bytes per particle at %.0f%% of peak HBM bandwidth; %.1f GB/s per GPU "
            "all-to-all inside a node of %d GPUs (NVLink), %.1f GB/s per GPU between nodes "
            "(InfiniBand HDR); %.0f us per collective." % (
                GPU_FFT_FLOPS / 1e12, GPU_PART_BYTES, 100 * GPU_HBM_EFFICIENCY, NVLINK_GBS,
                GPUS_PER_NODE, IB_GBS, LATENCY_S * 1e6), "",
            "Rows marked *largest*: the largest mesh of the table above (80 GB); "
            "the others: a fixed 1024^3 mesh on more GPUs (strong scaling).", "",
            "| N GPUs | nc | case | wire MB/rank/step | comm [ms] | FFT [ms] | particles [ms] | "
            "total [ms] |", "|---|---|---|---|---|---|---|---|"]
    cases = [(n, largest_nc(n, 80.0), "largest")
             for n in (1, 8, 64, 512, 1024) if n in gpus]
    cases += [(n, 1024, "1024^3") for n in (8, 64, 512) if n in gpus]
    for n, nc, case in cases:
        if nc is None:
            continue
        P, Q = _grid(n)
        t = gpu_step_time(nc, n, halo, "A100-80GB")
        wire = comm_bytes("nbody_step", nc, (P, Q), halo, half_spectrum=False)["wire"]
        out.append("| %d | %d | %s | %.0f | %.1f | %.1f | %.1f | %.1f |" % (
            n, nc, case, wire / 2**20, 1e3 * t["comm"], 1e3 * t["fft"], 1e3 * t["particles"],
            1e3 * t["total"]))
    out.append("")
    return "\n".join(out)


def write_doc(doc, text):
    """Replace the generated block of ``doc`` (appended if the markers are missing)."""
    old = open(doc).read() if os.path.exists(doc) else ""
    block = "%s\n%s\n%s" % (BEGIN, text, END)
    if BEGIN in old and END in old:
        head, rest = old.split(BEGIN, 1)
        new = head + block + rest.split(END, 1)[1]
    else:
        new = old + ("\n" if old else "") + block + "\n"
    with open(doc, "w") as f:
        f.write(new)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=json_path(os.path.join(RESULTS, "bench"), "bench_compare"))
    ap.add_argument("--doc", default=os.path.join(REPO, "docs", "scaling.md"))
    ap.add_argument("--print", action="store_true", help="print instead of writing the doc")
    ap.add_argument("--gpus", type=lambda v: tuple(int(n) for n in v.split(",")),
                    default=GPU_COUNTS, help="GPU counts of the extrapolation tables, "
                    "comma-separated (default %s)" % ",".join(map(str, GPU_COUNTS)))
    args = ap.parse_args(argv)
    data = read_raw(args.json)
    text = tables(data, args.gpus)
    if args.print:
        print(text)
    else:
        write_doc(args.doc, text)
        print("wrote the generated tables of %s" % args.doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
