"""Snapshot write throughput, direct I/O against buffered, back to back (issue 31, item 4).

Writes a float32 snapshot of ``nc^3`` particles (position, velocity float32, id int64:
32 bytes per particle, 0.54 GB at 256^3) with :func:`flowpm_mtf.runs.snapshot.write_snapshot_distributed`
from every rank's share, alternating the two modes of the part-file writer
(:mod:`flowpm_mtf.runs.h5dist_part`: ``O_DIRECT`` from aligned staging buffers, or the
same buffers through the page cache), ``--repeat`` times each after one untimed round, and prints the write's GB/s (all part files of all ranks,
fsync and hashing included; the slowest rank's wall time) and CPU seconds of rank 0::

    python scripts/bench_write.py --nc 256 --repeat 3 --dir /path/on/the/disk
    mpirun -np 2 python scripts/bench_write.py --nc 256

The data are random (incompressible); the files go to ``--dir`` (default: a temporary
directory next to the results) and are removed after each write. ``--json`` writes the
measurements to a file. Timings on a loaded machine are noise: run it on a quiet one.
"""
import argparse
import json
import os
import shutil
import tempfile
import time

import numpy as np


def _comm():
    if int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE", "1"))) > 1:
        from mpi4py import MPI

        return MPI.COMM_WORLD
    from flowpm_mtf.backend import SerialComm

    return SerialComm()


def snapshot_parts(nc, comm, seed=0):
    """This rank's parts of a float32 ``nc^3`` snapshot split over ``comm.size`` x-blocks."""
    from flowpm_mtf.runs import snapshot
    from flowpm_mtf.config import SimConfig

    conf = SimConfig(nc=(nc, nc, nc), box_size=200.0, grid=(comm.size, 1), dtype="float32")
    rng = np.random.default_rng(seed + comm.rank)
    n = nc ** 3 // comm.size
    bs = conf.block_shape
    pos = (rng.random((n, 3), np.float32) * np.asarray(bs, np.float32)).astype(np.float32)
    mom = rng.standard_normal((n, 3), np.float32)
    return conf, {comm.rank: snapshot.particle_part(conf, (comm.rank, 0), pos, mom, a=1.0)}


def measure(nc, repeat, directory, comm):
    """``{"direct": [...], "buffered": [...]}`` of ``{"gb_per_s", "seconds", "cpu_s", "mode"}``."""
    from flowpm_mtf.runs import h5dist_part, snapshot

    conf, parts = snapshot_parts(nc, comm)
    out = {"direct": [], "buffered": []}
    for i in range(repeat + 1):          # the first round warms up (imports, threads): untimed
        for mode in ("direct", "buffered"):
            h5dist_part.DIRECT_IO = mode == "direct"
            d = tempfile.mkdtemp(prefix="bench_write", dir=directory) if comm.rank == 0 else None
            d = comm.bcast(d, root=0)
            stats = {}
            comm.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            snapshot.write_snapshot_distributed(os.path.join(d, "snapshot.h5"), comm, parts,
                                                conf, stats=stats)
            seconds = max(comm.allgather(time.perf_counter() - t0))
            cpu = time.process_time() - c0
            comm.barrier()
            if comm.rank == 0:
                shutil.rmtree(d)
            if i == 0:
                continue
            out[mode].append({"gb_per_s": stats["bytes"] / 1e9 / seconds, "seconds": seconds,
                              "cpu_s": cpu, "bytes": stats["bytes"], "mode": stats.get("mode", "?")})
    h5dist_part.DIRECT_IO = True
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nc", type=int, default=256, help="particles per side (default 256)")
    ap.add_argument("--repeat", type=int, default=3, help="writes per mode (default 3)")
    ap.add_argument("--dir", default=None, help="where the files go (default: the temp dir)")
    ap.add_argument("--json", default=None, help="write the measurements here")
    args = ap.parse_args(argv)
    comm = _comm()
    res = measure(args.nc, args.repeat, args.dir, comm)
    if comm.rank == 0:
        for mode, runs in res.items():
            rates = [r["gb_per_s"] for r in runs]
            print("%-8s %d^3 on %d rank(s): %.3g GB, GB/s %s (median %.2f), CPU s rank 0 %s "
                  "[written: %s]" % (mode, args.nc, comm.size, runs[0]["bytes"] / 1e9,
                                     " ".join("%.2f" % r for r in rates), np.median(rates),
                                     " ".join("%.2f" % r["cpu_s"] for r in runs),
                                     runs[0]["mode"]))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"nc": args.nc, "ranks": comm.size, "runs": res}, f, indent=1)
    return res


if __name__ == "__main__":
    main()
