"""FFT round trip: ours (native FFTW op / TensorFlow's FFT) vs mpi4py-fft (FFTW + MPI).

For each mesh size and rank count, one ``mpirun`` per path of ours runs, on the
same ranks and the same pencil grid:

ours-native
    ``fft.c2r(fft.r2c(field))`` on ``HvdSimdMeshImpl``, local FFTs on the native
    FFTW op (``FLOWPM_MTF_NATIVE=require``);
ours-tf
    the same with TensorFlow's FFT (``FLOWPM_MTF_NATIVE=0``; with ``--no-tf`` skipped);
mpi4py-fft c2c / r2c
    ``mpi4py_fft.PFFT`` (FFTW) round trip of the field as complex64 (c2c, like our
    transform) and as float32 (r2c, half spectrum), in the ours-native job.

ours-native and the two mpi4py-fft transforms run in turns in one job (A B C A B
C ...), so that on a loaded machine they see the same load. Times are the median
(and minimum) of ``--repeats`` runs of the slowest rank (after ``--warmup`` runs). Writes
``results/bench_fft.md`` and the raw ``results/raw/bench_fft.json`` (unversioned; with
``--out DIR`` outside ``results/`` both go to ``DIR``). Usage::

    python scripts/bench_fft.py                          # 128, 192 on 1, 2, 4 ranks
    python scripts/bench_fft.py --sizes 64 --ranks 1 2 --repeats 3 --out /tmp/fft
"""
import argparse
import contextlib
import datetime
import os
import subprocess
import sys
import tempfile

from flowpm_bench import REPO, RESULTS, provenance
from flowpm_bench.launch import clean_env, mpirun_command
from flowpm_bench.results import read_json, write_json, write_result

SCRIPT = "scripts/bench_fft.py"

GRIDS = {1: (1, 1), 2: (2, 1), 4: (2, 2)}
TARGET = 1.5  # issue 14: round trip <= 1.5x mpi4py-fft on the same ranks


def make_conf(nc, grid):
    from flowpm_mtf.config import SimConfig

    return SimConfig(nc=nc, box_size=nc * 200.0 / 64, grid=tuple(grid), halo_size=1,
                     dtype="float32")


def worker(args):
    """One rank of one measurement (under mpirun)."""
    os.environ["FLOWPM_MTF_NATIVE"] = "0" if args.path == "tf" else "require"
    import tensorflow.compat.v1 as tf

    tf.disable_eager_execution()
    from mpi4py import MPI

    from flowpm_bench import fft_timing
    from hvd_mesh_impl import HvdSimdMeshImpl, runtime

    runtime.install_abort_on_exception()
    comm = MPI.COMM_WORLD
    conf = make_conf(args.size, args.grid)
    impl = HvdSimdMeshImpl(conf.mesh_shape, conf.layout_rules)
    with contextlib.ExitStack() as stack:
        runners = {"ours-" + args.path: stack.enter_context(fft_timing.mtf_roundtrip_runner(
            conf, impl, session_config=runtime.session_config()))}
        if args.path == "native":
            for real in (False, True):
                runners["mpi4py-fft " + ("r2c" if real else "c2c")] = stack.enter_context(
                    fft_timing.mpi4py_fft_roundtrip_runner(comm, conf.nc, conf.grid, real=real))
        rec = fft_timing.interleaved(runners, args.warmup, args.repeats, comm.Barrier,
                                     lambda dt: max(comm.allgather(dt)))
    if comm.Get_rank() == 0:
        write_json(args.record, rec)


def drive(args, save=None):
    env = clean_env(REPO, TF_CPP_MIN_LOG_LEVEL="2")
    rows = []
    paths = ["native"] + ([] if args.no_tf else ["tf"])
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            for n in args.ranks:
                grid = GRIDS[n]
                row = {"nc": size, "ranks": n, "grid": list(grid)}
                for path in paths:
                    rec = os.path.join(tmp, "rec.json")
                    cmd = mpirun_command(n) + [sys.executable, os.path.abspath(__file__),
                                               "--worker", "--path", path, "--size", str(size), "--grid",
                                       "%dx%d" % grid, "--record", rec,
                                       "--warmup", str(args.warmup),
                                       "--repeats", str(args.repeats)]
                    print("[bench_fft] %d^3 on %d rank(s), %s" % (size, n, path), flush=True)
                    subprocess.run(cmd, env=env, check=True, timeout=1800)
                    row.update(read_json(rec))
                    os.remove(rec)
                rows.append(row)
                print("[bench_fft]   " + summary_line(row), flush=True)
                if save is not None:  # after every row: a killed run keeps what it measured
                    save(rows)
    return rows


def _ms(row, key, stat="median_s"):
    r = row.get(key)
    return None if r is None or r.get(stat) is None else 1e3 * r[stat]


def summary_line(row):
    return ", ".join("%s %.1f ms" % (k, _ms(row, k)) for k in
                     ("ours-native", "ours-tf", "mpi4py-fft c2c", "mpi4py-fft r2c") if k in row)


def markdown(rows, meta):
    def pair(med, low, fmt):
        if med is None:
            return "-"
        return fmt % med + ("" if low is None else " / " + fmt % low)

    def cell(r, key):
        return pair(_ms(r, key), _ms(r, key, "min_s"), "%.1f")

    def ratio(r, a, b, fmt="%.2fx"):
        def q(stat):
            x, y = _ms(r, a, stat), _ms(r, b, stat)
            return None if x is None or y is None else x / y
        return pair(q("median_s"), q("min_s"), fmt)

    lines = ["# FFT round trip: ours vs mpi4py-fft (FFTW)", "",
             "Generated by `scripts/bench_fft.py` on %s (%d cores; %s; load average %s). "
             "Median / minimum of %d runs of the slowest rank after %d warm-up runs, float32 / "
             "complex64. `ours`: `fft.c2r(fft.r2c(x))` on `HvdSimdMeshImpl` (full complex "
             "spectrum in k-space; inside the transform the first stage is real-to-complex, "
             "the last complex-to-real, the middle ones on the half spectrum when z is not "
             "split, else complex); `native`: local FFTs on the FFTW op, `TF`: TensorFlow's FFT (separate "
             "job). mpi4py-fft on the same ranks and pencil grid, c2c (the work of ours) and "
             "r2c (half spectrum), timed in turns with ours-native in one job. Target (issue 14): "
             "ours-native <= %.1fx mpi4py-fft."
             % (meta["date"], meta["cores"], meta["load_note"],
                ", ".join("%.0f" % v for v in meta["load_average"]), meta["repeats"],
                meta["warmup"], TARGET), "",
             "| mesh | ranks | grid | ours native [ms] | ours TF [ms] | mpi4py-fft c2c [ms] "
             "| mpi4py-fft r2c [ms] | native / mpi4py c2c | native / mpi4py r2c "
             "| TF / native |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append("| %d^3 | %d | %dx%d | %s | %s | %s | %s | %s | %s | %s |" % (
            r["nc"], r["ranks"], r["grid"][0], r["grid"][1], cell(r, "ours-native"),
            cell(r, "ours-tf"), cell(r, "mpi4py-fft c2c"), cell(r, "mpi4py-fft r2c"),
            ratio(r, "ours-native", "mpi4py-fft c2c"), ratio(r, "ours-native", "mpi4py-fft r2c"),
            ratio(r, "ours-tf", "ours-native", "%.1fx")))
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[128, 192])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], choices=sorted(GRIDS))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-tf", action="store_true", help="skip the TensorFlow-FFT path")
    p.add_argument("--out", default=RESULTS,
                   help="the table (the JSON: results/raw/ for results/, see "
                        "flowpm_bench.results.raw_dir)")
    p.add_argument("--load-note", default="shared machine, other jobs running",
                   help="how loaded the machine was (goes into the Markdown)")
    # worker mode (what the driver launches under mpirun)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--path", choices=["native", "tf"], help=argparse.SUPPRESS)
    p.add_argument("--size", type=int, help=argparse.SUPPRESS)
    p.add_argument("--grid", help=argparse.SUPPRESS)
    p.add_argument("--record", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        args.grid = tuple(int(v) for v in args.grid.split("x"))
        worker(args)
        return 0
    def save(rows):
        m = provenance.machine()
        meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime(
                    "%Y-%m-%d %H:%M UTC"),
                "cores": m["cpus"], "warmup": args.warmup,
                "repeats": args.repeats, "load_note": args.load_note,
                "load_average": m["loadavg"]}
        return write_result(args.out, "bench_fft", {"meta": meta, "rows": rows},
                            markdown(rows, meta), SCRIPT)

    print(save(drive(args, save)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
