"""CIC paint and readout against the order of the particles (issue 31: where 512^3 loses time).

Times the native CIC ops of a PM step on one rank, as the step runs them:
``FlowpmCicPaint`` of the density (one component) and ``FlowpmCicReadout`` of a
three-component force field, on the same particles in two orders:

``slot``
    the order the job keeps them in: their slots, i.e. the Lagrangian lattice order
    (the particles of a one-rank run never migrate);
``column``
    ordered by the column of cells they are in (``FlowpmSortByColumn``, the order of
    ``simulate --sort-every K``), so that the ops walk the field column by column;
``lattice``
    ordered by id: the row-major order of their lattice sites (the job's slot order
    before the ICs put the slots in tiles);
``tiles``
    the ids in the tile order of ``layout.slot_tiles`` (16^3 tiles of the lattice: the
    job's slot order since then; the file's order for a snapshot of such a job),

and the cost of getting the second order: ``order`` (``FlowpmSortByColumn`` alone: the
counting sort's keys, counts and offsets) and ``permute`` (``FlowpmPermuteRows`` of the
positions alone; the job permutes positions, momenta, forces and ids). All are
nanoseconds per particle, the median of ``--repeat`` runs after one untimed run,
wall time, both cores (TensorFlow's intra-op pool).

The particles are those of a snapshot of a one-rank ``flowpm-mtf simulate`` run
(``--snapshot``: positions [Mpc/h] converted to cells), or a synthetic lattice displaced
by a smooth Gaussian random field (``--synthetic NC --displacement RMS`` [cells]; for
small meshes and the test). It also checks what the comparison assumes: the readout in
column order gives every particle its slot-order values bit for bit (a particle's sum
does not depend on the others), and the paint in column order equals the slot-order
paint to rounding (each cell's terms come in another order)::

    flowpm-mtf simulate --nc 512 --steps 5 --no-plot --out out/sim512
    python scripts/bench_cic_order.py --snapshot out/sim512/snapshot.h5 --repeat 3
    python scripts/bench_cic_order.py --synthetic 128 --displacement 4

Writes ``results/bench_cic_order.md`` from ``results/raw/bench_cic_order.json`` (one record
per source, mesh and commit; a new run replaces its own record). Timings on a loaded
machine are noise: run it alone on a quiet one (the load is in the table).
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flowpm_bench import RESULTS, provenance  # noqa: E402
from flowpm_bench.results import json_path, read_json, write_json, write_table  # noqa: E402

SCRIPT = "scripts/bench_cic_order.py"
NAME = "bench_cic_order"
HALO = 2
COLUMNS = ("paint_slot", "readout3_slot", "paint_column", "readout3_column", "order", "permute",
           "paint_lattice", "readout3_lattice", "paint_tiles", "readout3_tiles")


def snapshot_cells(path):
    """Positions [cells] ``[n, 3]`` float32 (slot order) and the mesh of a one-rank snapshot."""
    import json

    import h5py

    with h5py.File(path, "r") as f:
        conf = json.loads(f.attrs["config"])
        if tuple(conf["grid"]) != (1, 1):
            raise SystemExit("bench_cic_order: %s is a %dx%d run; a one-rank snapshot is needed"
                             % (path, *conf["grid"]))
        nc, box = conf["nc"], conf["box_size"]
        pos = f["position"][...]
    cells = np.asarray(nc, np.float32) / np.asarray(box, np.float32)
    pos = np.mod(pos.astype(np.float32) * cells, np.asarray(nc, np.float32))
    pos[pos >= np.asarray(nc, np.float32)] = 0   # a coordinate rounded up to nc wraps to 0
    return pos, tuple(nc)


def snapshot_ids(path):
    """The particle ids of a snapshot (slot order), or ``arange`` if it has none."""
    import h5py

    with h5py.File(path, "r") as f:
        return f["id"][...] if "id" in f else np.arange(f["position"].shape[0])


def lagrangian_orders(pos, ids, nc):
    """The positions in the ``lattice`` (by id) and ``tiles`` orders (module docstring)."""
    from flowpm_mtf import layout
    from flowpm_mtf.config import SimConfig

    n = pos.shape[0]
    ids = np.asarray(ids, np.int64)
    if ids.shape != (n,) or not np.array_equal(np.sort(ids), np.arange(n)):
        raise SystemExit("bench_cic_order: the ids are not 0 .. N-1 (a one-rank snapshot of "
                         "a whole run is needed)")
    lattice = np.empty_like(pos)
    lattice[ids] = pos
    tx, ty, tz = layout.slot_tiles(SimConfig(nc=tuple(nc)))
    sx, sy, sz = nc
    slots = np.arange(n).reshape(sx // tx, tx, sy // ty, ty, sz // tz, tz)
    return {"lattice": lattice, "tiles": lattice[slots.transpose(0, 2, 4, 1, 3, 5).ravel()]}


def synthetic_cells(nc, rms, seed=0):
    """A lattice of ``nc^3`` particles (slot order) displaced by a smooth random field of ``rms`` cells."""
    rng = np.random.default_rng(seed)
    k = [np.fft.fftfreq(nc), np.fft.fftfreq(nc), np.fft.rfftfreq(nc)]
    k2 = k[0][:, None, None] ** 2 + k[1][None, :, None] ** 2 + k[2][None, None, :] ** 2
    smooth = np.exp(-k2 / (2 * 0.05 ** 2))     # coherence over ~1 / (2 pi 0.05) ~ 3 cells
    q = np.indices((nc, nc, nc), np.float32).reshape(3, -1).T
    for axis in range(3):
        field = np.fft.irfftn(np.fft.rfftn(rng.standard_normal((nc, nc, nc))) * smooth, (nc,) * 3,
                              axes=(0, 1, 2))
        q[:, axis] += (field / field.std() * rms).astype(np.float32).reshape(-1)
    return np.mod(q, np.float32(nc)), (nc, nc, nc)


def _median_ns(fn, n, repeat):
    fn()                                   # untimed: first touch, thread start
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times)) / n * 1e9


def measure(pos, nc, repeat, ids=None):
    """Nanoseconds per particle of each column of ``COLUMNS`` and the two checks
    (``ids``: the particles' ids, default their slots).

    A graph and session of its own (the caller may run eagerly or not); every input is
    a variable, so no op has a constant input to fold or a feed to copy, and each timed
    run fetches one element of the op's output.
    """
    import tensorflow.compat.v1 as tf

    from flowpm_mtf import native

    cic, parts = native.load("cic_ops"), native.load("particle_ops")
    if cic is None or parts is None:
        raise SystemExit("bench_cic_order: the native ops are not built "
                         "(python -m flowpm_mtf.native.build)")
    n = pos.shape[0]
    px, py, nz = nc[0] + 2 * HALO, nc[1] + 2 * HALO, nc[2]
    with tf.Graph().as_default(), tf.Session() as sess:
        def kept(value, feed=None):   # the value of a tensor, in a variable
            v = tf.Variable(value, trainable=False, use_resource=True)
            sess.run(v.initializer, feed)
            return v.read_value()

        def paint(p):
            return cic.flowpm_cic_paint(p, tf.zeros([1, 0, 1], tf.float32), halo=HALO, px=px,
                                        py=py, nz=nz, components=1)

        def one(t):   # the op runs, one element comes back
            return tf.reshape(t, [-1])[:1]

        feed = tf.placeholder(tf.float32, [1, n, 3])
        slot = kept(feed, {feed: pos.reshape(1, n, 3)})
        order_op = parts.flowpm_sort_by_column(slot, tf.zeros([1, n], tf.int64), halo=HALO,
                                               px=px, py=py)
        order = kept(order_op)
        permute_op = parts.flowpm_permute_rows(order, [slot])[0]
        column = kept(permute_op)
        rho = kept(paint(slot))
        field = kept(tf.concat([rho, rho * 0.5, rho * 0.25], axis=-1))  # 3 components
        ops = {"order": one(order_op), "permute": one(permute_op)}
        more = lagrangian_orders(pos, np.arange(n) if ids is None else ids, nc)
        kept_orders = [("slot", slot), ("column", column)]
        for name, value in more.items():
            kept_orders.append((name, kept(feed, {feed: value.reshape(1, n, 3)})))
        del more
        for name, p in kept_orders:
            ops["paint_" + name] = one(paint(p))
            ops["readout3_" + name] = one(cic.flowpm_cic_readout(field, p, halo=HALO))
        out = {k: _median_ns(lambda op=op: sess.run(op), n, repeat) for k, op in ops.items()}
        o, v_slot, v_col, r_slot, r_col = sess.run(
            [order, cic.flowpm_cic_readout(field, slot, halo=HALO),
             cic.flowpm_cic_readout(field, column, halo=HALO), rho, paint(column)])
    o, v_slot, v_col = o[0], v_slot[0], v_col[0]
    checks = {"readout_bitwise": bool(np.array_equal(v_slot[o], v_col)),
              "paint_max_rel_diff": float(np.max(np.abs(r_col - r_slot))
                                          / max(float(np.max(np.abs(r_slot))), 1e-30)),
              "mass": [float(r_slot.sum(dtype=np.float64)), float(r_col.sum(dtype=np.float64))]}
    return out, checks


def render(records):
    """The Markdown document of all records."""
    lines = ["# CIC paint and readout against the order of the particles (issue 31)", "",
             "Generated by `%s`; see its docstring. Nanoseconds per particle (median after one "
             "untimed run), one rank, both cores. `slot`: the job's order (Lagrangian); `column`: "
             "ordered by the column of cells (`FlowpmSortByColumn`); `order`: computing that order; "
             "`permute`: applying it to the positions alone; `lattice`: by id (row-major lattice "
             "sites); `tiles`: the ids in 16^3 tiles of the lattice (the job's slots since the "
             "ICs tile them; `-`: not measured then). `readout bitwise`: the column-order "
             "readout gives every particle its slot-order values bit for bit; `paint rel diff`: "
             "max |difference| / max of the two paints (rounding only)." % SCRIPT, "",
             "| source | mesh | paint slot | readout3 slot | paint column | readout3 column "
             "| order | permute | paint lattice | readout3 lattice | paint tiles | readout3 tiles "
             "| readout bitwise | paint rel diff | load | commit |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        t, c = r["ns_per_particle"], r["checks"]
        cells = ["%.1f" % t[k] if k in t else "-" for k in COLUMNS]
        lines.append("| %s | %d^3 | %s | %s | %.2g | %.2f | %s |" % (
            r["source"], r["nc"][0], " | ".join(cells),
            "yes" if c["readout_bitwise"] else "NO", c["paint_max_rel_diff"],
            r["machine"]["loadavg"][0], r["commit"]))
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--snapshot", help="snapshot.h5 of a one-rank simulate run")
    src.add_argument("--synthetic", type=int, metavar="NC", help="a displaced lattice of NC^3")
    parser.add_argument("--displacement", type=float, default=4.0,
                        help="rms displacement of --synthetic [cells] (default 4)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default=RESULTS, help="results folder (default results/)")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    if args.synthetic is not None and args.synthetic < 4:
        parser.error("--synthetic must be >= 4")
    ids = None
    if args.snapshot:
        pos, nc = snapshot_cells(args.snapshot)
        ids = snapshot_ids(args.snapshot)
        source = "snapshot a=1 (%s)" % os.path.basename(os.path.dirname(
            os.path.abspath(args.snapshot)))
    else:
        pos, nc = synthetic_cells(args.synthetic, args.displacement)
        source = "synthetic rms %g cells" % args.displacement
    machine = provenance.machine()    # the load before the run
    times, checks = measure(pos, nc, args.repeat, ids)
    record = {"source": source, "nc": list(nc), "n": int(pos.shape[0]),
              "commit": provenance.commit_label(), "machine": machine,
              "ns_per_particle": times, "checks": checks, "repeat": args.repeat,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    path = json_path(args.out, NAME)
    records = [r for r in read_json(path, []) if (r["source"], r["nc"], r["commit"])
               != (source, list(nc), record["commit"])] + [record]
    write_json(path, records)
    write_table(os.path.join(args.out, NAME + ".md"), render(records), SCRIPT)
    print("%s %d^3: %s; readout bitwise %s, paint rel diff %.2g" % (
        source, nc[0], ", ".join("%s %.1f ns" % (k, times[k]) for k in COLUMNS),
        checks["readout_bitwise"], checks["paint_max_rel_diff"]))
    return 0 if checks["readout_bitwise"] else 1


if __name__ == "__main__":
    sys.exit(main())
