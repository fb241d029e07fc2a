"""Benchmark of the default simulation: time per step split into paint / FFT /
readout / communication, graph-build time, peak memory and bytes per particle,
on 1, 2 and 4 ranks, against single-process FlowPM (``flowpm.tfpm``).

Modes::

    # one measurement under MPI (HvdSimdMeshImpl), one JSON record
    mpirun -np 2 python scripts/bench_sim.py run --nc 64 --json rec.json
    # single-device FlowPM 0.1.1 on the same configuration, one JSON record
    python scripts/bench_sim.py flowpm --nc 64 --json rec.json
    # everything: launches the runs above, merges them into
    # results/bench_sim.md and the raw results/raw/bench_sim.json (unversioned)
    python scripts/bench_sim.py all --sizes 64 128 --ranks 1 2 4
    # rewrite the Markdown from the JSON
    python scripts/bench_sim.py render

What is measured (``run``)
--------------------------
1. The default simulation (``flowpm-mtf simulate``'s graph: 2LPT at a = 0.1,
   10 kick-drift-kick steps to a = 1, 200 Mpc/h box, halo scaled with the
   mesh so that it stays 25 Mpc/h): graph build + lowering [s], ICs [s], every
   step [s], peak resident memory per rank after the run [MB].
2. On the particle state before the last step, each part of that step as its
   own operation, median of ``--repeats`` after one warm-up:

   ``step``      a whole kick-drift-kick step (one PM force);
   ``paint``     CIC paint + halo reduce (the density of the force);
   ``fft``       forward r2c + the inverse Laplacian + the potential's real
                 inverse transform (c2r), all-to-all transposes included; on the
                 k-space path (no native ops, or blocks narrower than the halo + 2)
                 the gradient/Laplace kernels and the inverse of the three force
                 components packed into two complex transforms instead;
   ``readout``   the force field from the potential (its halo fill, 2 cells
                 wider, and the four-point difference) + CIC readout of the three
                 components; k-space path: the components' halo fill + readout;
   ``comm_halo`` the halo exchanges of a step alone (one reduce of the density,
                 one fill of the potential; k-space: of the three components);
   ``comm_fft``  the all-to-all transposes of a step alone (2 for r2c, 2 for
                 c2r; k-space: 2 for the inverse of the 3 force components packed
                 into 2 complex fields) on complex blocks of the same shapes.

   ``other = step - paint - fft - readout`` (kick/drift updates, escape
   checks) and ``comm = comm_halo + comm_fft``; ``compute = step - comm``.
3. Bytes this rank receives per step (``HvdSimdMeshImpl.comm_bytes_received``
   of the lowered step, counted from the collectives' shapes; Horovod's
   accounting: an all-to-all's own piece is included).

Oversubscription: on a machine with fewer cores than ranks the ranks share
cores; times then measure the implementation's total work, not its scaling.
"""
import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from flowpm_bench import RESULTS, provenance
from flowpm_bench.configs import sim_config
from flowpm_bench.launch import mpirun_command, run
from flowpm_bench.measure import peak_mb
from flowpm_bench.results import (json_path, read_json, read_raw, write_json, write_result,
                                  write_table)

log = logging.getLogger("bench_sim")
SCRIPT = "scripts/bench_sim.py"


def median_time(fn, repeats, warmup=1):
    """Median wall time [s] of ``fn()`` over ``repeats`` calls after ``warmup`` calls."""
    from flowpm_mtf.jobs.runner import median_time as median

    return median(fn, repeats, warmup)


def lagrangian_halo_needed(conf, positions, ids):
    """Largest x/y displacement from the initial lattice site of this rank's particles
    [cells], from local slices of global positions ``[.., 3]`` and ids (periodic)."""
    ids = np.asarray(ids).reshape(-1)
    valid = ids >= 0
    x = np.asarray(positions, np.float64).reshape(-1, 3)[valid]
    nx, ny, nz = conf.nc
    i = ids[valid].astype(np.int64)
    q = np.stack([i // (ny * nz), (i // nz) % ny], axis=-1)
    n = np.array([nx, ny], np.float64)
    d = (x[:, :2] - q + n / 2) % n - n / 2
    return float(np.abs(d).max()) if d.size else 0.0


# ----------------------------------------------------------------------------- run (MPI)
def _fetchable(tensors):
    """One scalar per tensor: a data dependency that makes TF compute it (a
    ``tf.group`` would be pruned by Grappler)."""
    import tensorflow.compat.v1 as tf

    return [tf.reshape(t, [-1])[0] for t in tensors]


def _phase_graphs(conf, impl, slices, particle_shape, real_space):
    """Lower each part of one step on the given local slices, on the force's path
    (``real_space``: ``gravity._native_stencil``, else k-space); returns
    ``{phase: (fetches, received_bytes_tensor)}``."""
    import mesh_tensorflow as mtf
    import tensorflow.compat.v1 as tf

    from hvd_mesh_impl import export_local_slice
    from flowpm_mtf import config as cfg
    import dataclasses

    from flowpm_mtf.mesh import fft, halo, slots
    from flowpm_mtf.physics import gravity, lpt, nbody, painting
    from flowpm_mtf.jobs import runner
    from flowpm_mtf.physics.kernels import neg_gradient_potential

    variables = {k: tf.Variable(v, trainable=False, name="bench_" + k) for k, v in slices.items()}
    shapes = {}
    a0, a1 = nbody.default_stages(conf)[-2:]

    def lowered(build):
        graph = mtf.Graph()
        mesh = mtf.Mesh(graph, "mesh")
        inputs = {k: mtf.import_laid_out_tensor(mesh, impl.LaidOutTensor([v]), shapes[k])
                  for k, v in variables.items()}
        outs = build(mesh, inputs)
        before = impl.comm_bytes_received()
        lowering = runner.lower(graph, mesh, impl)
        nbytes = impl.comm_bytes_received() - before
        return _fetchable([export_local_slice(lowering, t) for t in outs]), nbytes

    pshape = mtf.Shape([mtf.Dimension(d.name, d.size) for d in particle_shape.dims])
    for k in ("positions", "momenta", "forces"):
        shapes[k] = pshape
    shapes["ids"] = mtf.Shape(pshape.dims[:3])
    shapes["rho"] = fft.real_shape(conf)

    def step(mesh, t):
        kernels = nbody.make_kernels(conf, mesh)
        new = nbody.kdk_step(lpt.State(t["positions"], t["momenta"], t["forces"], t["ids"]),
                             conf, a0, a1, kernels)
        return [x for x in new[:4]]

    def paint(mesh, t):
        return [gravity.density(t["positions"], conf, slots.weights(t["ids"], conf))]

    def fft_phase(mesh, t):
        kernels = nbody.make_kernels(conf, mesh)
        delta_k = fft.r2c(t["rho"], conf)
        if real_space:
            return [fft.c2r(kernels.inverse_laplace(delta_k), conf)]
        return [neg_gradient_potential(delta_k, conf, kernels)]

    def three(field):  # a [x, y, z, xyz] field, as the force's gradient
        return mtf.stack([field * float(d + 1) for d in range(3)], cfg.XYZ, axis=3)

    def readout(mesh, t):
        if real_space:   # rho stands for the potential
            return [painting.readout_padded(gravity.force_field_of_potential(t["rho"], conf),
                                            t["positions"], conf)]
        return [painting.readout_field(three(t["rho"]), t["positions"], conf)]

    def comm_halo(mesh, t):
        out = [halo.halo_reduce(halo.pad_blocks(halo.to_blocks(t["rho"], conf), conf), conf)]
        if real_space:
            wider = dataclasses.replace(conf, halo_size=conf.halo_size + gravity.GRADIENT_REACH)
            out += [halo.field_to_padded(t["rho"], wider)]
        else:
            out += [halo.halo_fill(halo.pad_blocks(halo.to_blocks(three(t["rho"]), conf), conf),
                                   conf)]
        return out

    phases = {"step": lowered(step), "paint": lowered(paint), "fft": lowered(fft_phase),
              "readout": lowered(readout), "comm_halo": lowered(comm_halo)}
    phases["comm_fft"] = _alltoall_graph(conf, impl, real_space)
    return phases


def _alltoall_graph(conf, impl, real_space):
    """The four all-to-alls of a step's FFTs on complex blocks of the same shapes:
    r2c (col: split z, gather y; row: split y, gather x) on one field, with the
    ``nz / 2`` modes of the half-spectrum path when it applies
    (``fft.FFT3DOperation._lower_half``: even sizes and blocks), and the inverse: of
    the potential (``real_space``: the same two backwards on the same block), or of
    the three force components packed into two complex fields
    (``kernels.packed_inverse``; the same two, backwards, all ``nz`` modes)."""
    import tensorflow.compat.v1 as tf

    from flowpm_mtf.mesh import fft

    (p, q), (nx, ny, nz) = conf.grid, conf.nc
    cdt = tf.complex64 if conf.dtype == "float32" else tf.complex128
    half = fft.half_spectrum_fits(conf.nc, conf.grid)

    def cblock(shape, name):
        v = tf.Variable(tf.complex(tf.ones(shape, conf.tf_dtype), tf.zeros(shape, conf.tf_dtype)),
                        trainable=False, name=name)
        assert v.dtype.base_dtype == cdt
        return v

    # the forward's block: nz / 2 modes on the half-spectrum path
    block = cblock([nx // p, ny // q, nz // 2 if half else nz], "bench_cblock")
    kblock = (cblock([nx, ny // p, nz // q], "bench_kblock") if half and not real_space
              else None)
    before = impl.comm_bytes_received()
    lo = impl.LaidOutTensor([block])
    fwd = impl.alltoall(impl.alltoall(lo, 1, 2, 1), 0, 1, 0)     # [nx, ny/P, nz/Q (/ 2)]
    if real_space:   # the potential's c2r: the forward's two, backwards
        back = impl.alltoall(impl.alltoall(fwd, 0, 0, 1), 1, 1, 2)
        nbytes = impl.comm_bytes_received() - before
        return _fetchable(back.tensor_list), nbytes
    if half:  # the full k-space block [nx, ny/P, nz/Q], once the forward is done
        with tf.control_dependencies(fwd.tensor_list):
            kblock = tf.identity(kblock)
    else:
        kblock = fwd.tensor_list[0]
    batched = tf.stack([kblock] * 2)                              # [2, nx, ny/P, nz/Q]
    back = impl.alltoall(impl.alltoall(impl.LaidOutTensor([batched]), 0, 1, 2), 1, 2, 3)
    nbytes = impl.comm_bytes_received() - before
    return _fetchable(back.tensor_list), nbytes


def cmd_run(args):
    import mesh_tensorflow as mtf
    import tensorflow.compat.v1 as tf
    from mpi4py import MPI

    from hvd_mesh_impl import export_local_slice
    from flowpm_mtf.backend import default_grid, make_mesh_impl, session_config
    from flowpm_mtf.jobs import runner
    from flowpm_mtf.jobs.nbody_run import SimulationGraph, run_init

    tf.disable_eager_execution()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    grid = args.grid or default_grid(size)
    from flowpm_mtf.mesh import domain
    from flowpm_mtf.physics import painting, sizing

    conf = sim_config(args.nc, grid, args.steps, args.box_size, args.decomposition, args.halo)
    if conf.n_ranks != size:
        raise ValueError("grid %s needs %d ranks, the job has %d" % (grid, conf.n_ranks, size))
    rec = {"nc": args.nc, "ranks": size, "grid": list(grid), "halo": conf.halo_size,
           "n_steps": conf.n_steps, "dtype": conf.dtype, "box_size": conf.box_size[0],
           "backend": "HvdSimdMeshImpl", "decomposition": conf.decomposition,
           "capacity": sizing.capacity(conf), "cell_mpc_h": conf.cell_size[0]}
    if conf.decomposition == "eulerian":
        rec["send_capacity"] = sizing.send_capacity(conf)
        rec["migration_bytes_sent_per_rank_per_step"] = domain.bytes_per_migration(
            conf, 1, rec["send_capacity"])
    impl = make_mesh_impl("hvd", conf.mesh_shape, conf.layout_rules)
    # 1. The simulation, as the main job runs it.
    with tf.Graph().as_default():
        comm.Barrier()
        t0 = time.perf_counter()
        graph = mtf.Graph()
        mesh = mtf.Mesh(graph, "mesh")
        sim = SimulationGraph(conf, mesh)
        position = painting.to_global(sim.variables.positions, conf)   # global [cells]
        lowering = runner.lower(graph, mesh, impl)
        init_op = runner.lowered_group(lowering, sim.init_ops)
        init_force = runner.lowered_group(lowering, sim.init_force_ops)
        step_op = runner.lowered_group(lowering, sim.step_ops)
        local = {k: export_local_slice(lowering, v)
                 for k, v in zip(("positions", "momenta", "forces", "ids"), sim.variables[:4])}
        local["rho"] = export_local_slice(lowering, sim.rho)
        global_x = export_local_slice(lowering, position)
        stats = (lowering.export_to_tf_tensor(sim.step_stats) if sim.step_stats is not None
                 else tf.no_op())
        particle_shape = sim.variables.positions.shape
        rec["graph_build_s"] = time.perf_counter() - t0
        with runner.session(session_config("hvd"), lowering) as sess:
            comm.Barrier()
            t = time.perf_counter()
            run_init(sess, init_op, init_force)
            rec["ics_s"] = time.perf_counter() - t
            steps, mig = [], []
            for i, factors in enumerate(sim.step_factors):
                if i == conf.n_steps - 1:  # the state the parts of the last step start from
                    slices = sess.run(local)
                t = time.perf_counter()
                mig.append(sess.run([step_op, stats], {sim.factors: factors})[1])
                steps.append(time.perf_counter() - t)
            rec["steps_s"] = steps
            fin = sess.run({"x": global_x, "ids": local["ids"]})
    rec["lagrangian_halo_needed_cells"] = max(comm.allgather(
        lagrangian_halo_needed(conf, fin["x"], fin["ids"]))) + 2   # + CIC stencil + margin
    if conf.decomposition == "eulerian":
        mean = conf.n_particles / conf.n_ranks
        st = [dict(zip(domain.STATS, (float(v) for v in m))) for m in mig]
        rec["migration"] = {"imbalance_per_step": [d["count"] / mean for d in st],
                            "moved_max_per_step": [d["moved"] for d in st],
                            "send_max_per_step": [d["send"] for d in st],
                            "displacement_max_cells_per_step": [d["displacement"] for d in st]}
    rec["peak_memory_mb_sim"] = comm.allgather(peak_mb())
    log.info("%d^3 on %d rank(s): build %.1f s, ICs %.2f s, median step %.2f s",
             args.nc, size, rec["graph_build_s"], rec["ics_s"], statistics.median(steps))
    # 2. The parts of the last step, from the state before it.
    with tf.Graph().as_default():
        # A new MeshImpl: its byte counters belong to the previous tf.Graph.
        impl = make_mesh_impl("hvd", conf.mesh_shape, conf.layout_rules)
        # the force's path in the step (gravity._field_of_density): the phases follow it
        from flowpm_mtf.physics import gravity
        real_space = gravity._native_stencil(conf, conf.tf_dtype)
        rec["force_path"] = "real space" if real_space else "k-space"
        phases = _phase_graphs(conf, impl, slices, particle_shape, real_space)
        with runner.session(session_config("hvd")) as sess:
            times, nbytes = {}, {}
            for name, (fetch, nb) in phases.items():
                comm.Barrier()
                times[name] = median_time(lambda: sess.run(fetch), args.repeats)
                nbytes[name] = int(sess.run(nb))
    rec["phase_s"] = {k: max(comm.allgather(v)) for k, v in times.items()}  # slowest rank
    rec["received_bytes_per_rank"] = {k: comm.allgather(v) for k, v in nbytes.items()}
    rec["peak_memory_mb"] = comm.allgather(peak_mb())
    n = int(np.prod(conf.nc))
    rec["n_particles"] = n
    rec["bytes_per_particle"] = sum(rec["peak_memory_mb_sim"]) * 2**20 / n
    rec["repeats"] = args.repeats
    if rank == 0:
        _write(args.json, rec)
    return rec


# ----------------------------------------------------------------------------- flowpm (reference)
def cmd_flowpm(args):
    """FlowPM 0.1.1 ``flowpm.tfpm``: the same ICs/steps in one process, one device."""
    import tensorflow.compat.v1 as tf

    import flowpm.tfpm as tfpm
    from flowpm_bench import reference  # FlowPM 0.1.1's growth-table quirk (see its docstring)
    from flowpm_mtf.jobs import runner
    from flowpm_mtf.physics.nbody import default_stages

    tf.disable_eager_execution()
    conf = sim_config(args.nc, (1, 1), args.steps)
    cosmo = reference.flowpm_cosmo("ours")
    linear = reference.linear_field_numpy(conf).astype(np.float32)[None]
    stages = np.asarray(default_stages(conf), np.float32)
    threads = os.cpu_count()
    cfg = tf.ConfigProto(intra_op_parallelism_threads=threads, inter_op_parallelism_threads=2)
    rec = {"nc": args.nc, "ranks": 1, "grid": [1, 1], "n_steps": conf.n_steps,
           "dtype": "float32", "box_size": conf.box_size[0], "backend": "flowpm.tfpm 0.1.1"}
    with tf.Graph().as_default():
        t0 = time.perf_counter()
        lin = tf.constant(linear)
        state = tfpm.lpt_init(lin, float(stages[0]), order=conf.lpt_order, cosmology=cosmo)
        state_in = tf.placeholder(tf.float32, [3, 1, conf.nc[0] * conf.nc[1] * conf.nc[2], 3])
        # tfpm.nbody over k + 1 stages = one force at the start + k KDK steps; the
        # cost of one step is the difference between 2 and 1 steps.
        one, two = (tf.reshape(tfpm.nbody(state_in, stages[-k - 1:], list(conf.nc),
                                          cosmology=cosmo), [-1])[0] for k in (1, 2))
        full = tfpm.nbody(state, stages, list(conf.nc), cosmology=cosmo)
        rec["graph_build_s"] = time.perf_counter() - t0
        with runner.session(cfg) as sess:
            t = time.perf_counter()
            st = sess.run(state)
            rec["ics_s"] = time.perf_counter() - t
            t = time.perf_counter()
            fin = sess.run(full)
            rec["nbody_total_s"] = time.perf_counter() - t
            t1 = median_time(lambda: sess.run(one, {state_in: fin}), args.repeats)
            t2 = median_time(lambda: sess.run(two, {state_in: fin}), args.repeats)
    rec["steps_s"] = [rec["nbody_total_s"] / conf.n_steps] * conf.n_steps
    rec["phase_s"] = {"step": t2 - t1}
    rec["peak_memory_mb"] = [peak_mb()]
    rec["peak_memory_mb_sim"] = [peak_mb()]
    rec["n_particles"] = int(np.prod(conf.nc))
    rec["bytes_per_particle"] = peak_mb() * 2**20 / rec["n_particles"]
    rec["repeats"] = args.repeats
    del st
    _write(args.json, rec)
    return rec


def _write(path, rec):
    if path:
        write_json(path, rec)
    else:
        json.dump(rec, sys.stdout, indent=1)


# ----------------------------------------------------------------------------- all (driver)
def cmd_all(args):
    mpirun = mpirun_command()
    records = []
    tmp = tempfile.mkdtemp(prefix="bench_sim")
    for nc in args.sizes:
        jobs = [("flowpm", None)] if not args.no_flowpm else []
        jobs += [("run", n) for n in args.ranks]
        for kind, n in jobs:
            path = os.path.join(tmp, "%s_%d_%s.json" % (kind, nc, n))
            common = ["--nc", str(nc), "--steps", str(args.steps), "--repeats",
                      str(args.repeats), "--json", path]
            if kind == "flowpm":
                cmd = [sys.executable, __file__, "flowpm"] + common
            else:
                cmd = mpirun + ["-np", str(n), sys.executable, __file__, "run"] + common
            records.append(_launch_record(cmd, path, args.timeout))
    return _write_result(args.out, "bench_sim", records, markdown)


def _launch_record(cmd, path, timeout):
    """Run ``cmd`` (which writes the JSON record ``path``); the record with its wall time."""
    wall = run(cmd, timeout)
    rec = read_json(path)
    rec["wall_s"] = wall
    log.info("%s", summary_line(rec))
    return rec


def _write_result(out, name, records, render):
    """Write the raw ``name.json`` (records + machine) and the table ``out/name.md``."""
    result = {"machine": machine_info(), "command": " ".join(sys.argv), "records": records,
              "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    write_result(out, name, result, render(result), SCRIPT)
    return result


def cmd_migration(args):
    """The eulerian decomposition (migration, automatic halo) against the lagrangian one
    with the halo it needs, same configuration, on the process grid ``--grid`` (default
    2x2, 4 ranks)."""
    tmp = tempfile.mkdtemp(prefix="bench_migration")
    records = []
    ranks = args.grid[0] * args.grid[1]
    common = ["--nc", str(args.nc), "--box-size", str(args.box_size), "--steps",
              str(args.steps), "--repeats", str(args.repeats),
              "--grid", "%dx%d" % tuple(args.grid)]
    halo = args.lagrangian_halo
    for decomposition in ("eulerian", "lagrangian"):
        path = os.path.join(tmp, decomposition + ".json")
        extra = ["--decomposition", decomposition]
        if decomposition == "lagrangian":
            if halo is None:
                halo = int(np.ceil(records[0]["lagrangian_halo_needed_cells"]))
            halo = min(halo, args.nc // max(args.grid) - 1)   # < the block's side
            extra += ["--halo", str(halo)]
        cmd = (mpirun_command() + ["-np", str(ranks), sys.executable, __file__, "run"] + common
               + extra + ["--json", path])
        try:
            records.append(_launch_record(cmd, path, args.timeout))
        except RuntimeError as exc:  # e.g. the lagrangian halo is too small: record it
            lines = str(exc).splitlines()
            why = next((ln for ln in reversed(lines) if "Error" in ln and "mpirun" not in ln),
                       lines[-1])
            records.append({"decomposition": decomposition, "halo": halo, "failed": why[:300]})
            if decomposition == "eulerian":
                raise
    return _write_result(args.out, "bench_migration", records, migration_markdown)


def migration_markdown(result):
    """The Markdown table of :func:`cmd_migration`'s result."""
    rows = ["# Particle migration vs. the lagrangian halo (`scripts/bench_sim.py migration`)",
            "", "Machine: %(cpus)d cores, %(memory_gb)s GB; 1-min load average at the end "
            "%(load_avg_1min_at_end).1f." % result["machine"],
            "Date: %s. Command: `%s`." % (result["date"], result["command"]), "",
            "| decomposition | mesh, box | cell [Mpc/h] | halo [cells] | padded block / block | "
            "capacity / lattice | step in the job [s] | warm step [s] | peak mem/rank [MB] | "
            "imbalance max | migration sent/rank/step [MB] | most moved/rank/step | "
            "received/rank/step [MB] |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["records"]:
        if "failed" in r:
            rows.append("| %s | | | %s | | | failed: %s | | | | | | |"
                        % (r["decomposition"], r["halo"], r["failed"].replace("|", "/")))
            continue
        sx = r["nc"] // r["grid"][0]
        pad = (sx + 2 * r["halo"])**2 / sx**2
        mig = r.get("migration")
        recv = r.get("received_bytes_per_rank", {}).get("step")
        lattice = r["nc"]**3 // (r["grid"][0] * r["grid"][1])
        rows.append("| %s | %d^3, %g Mpc/h | %.2f | %d | %.2f | %.2f | %.2f | %.2f | %.0f | %s | "
                    "%s | %s | %s |" % (
                        r["decomposition"], r["nc"], r["box_size"], r["cell_mpc_h"], r["halo"],
                        pad, r["capacity"] / lattice, step_median(r), r["phase_s"]["step"],
                        max(r["peak_memory_mb_sim"]),
                        "%.3f" % max(mig["imbalance_per_step"]) if mig else "1 (fixed)",
                        "%.2f" % (r["migration_bytes_sent_per_rank_per_step"] / 2**20)
                        if mig else "-",
                        "%d" % max(mig["moved_max_per_step"]) if mig else "-",
                        "%.1f" % (max(recv) / 2**20) if recv else "-"))
    rows += ["", "halo: the eulerian run's is automatic (the CIC stencil); the lagrangian "
             "run's is the largest x/y displacement from the initial lattice the eulerian run "
             "measured at a=1, + 2 (capped at block - 1). 'migration sent' is the fixed size "
             "of the four send buffers of a step; 'most moved' the most particles one rank "
             "actually sent in one step; 'received' counts every collective of the lowered "
             "step (halo, FFT, migration). Times on a shared, loaded 2-core machine: compare "
             "rows of one invocation only.", ""]
    return "\n".join(rows) + "\n"


def cmd_render(args):
    path = json_path(args.out, "bench_sim")
    write_table(os.path.join(args.out, "bench_sim.md"), markdown(read_raw(path)), SCRIPT,
                rendered_from=path)


def machine_info():
    """:func:`flowpm_bench.provenance.machine`, with the 1-minute load at the end of the run."""
    m = provenance.machine()
    m["load_avg_1min_at_end"] = m.pop("loadavg")[0]
    return m


def step_median(rec):
    return statistics.median(rec["steps_s"])


def summary_line(rec):
    return "%s %d^3 on %d: step %.3f s, build %.1f s, peak %.0f MB/rank" % (
        rec["backend"], rec["nc"], rec["ranks"], step_median(rec), rec["graph_build_s"],
        max(rec["peak_memory_mb_sim"]))


def markdown(result):
    """The Markdown tables of a merged result."""
    rows = ["# Simulation benchmark (`scripts/bench_sim.py`)", "",
            "Machine: %(cpus)d cores, %(memory_gb)s GB, %(platform)s, Python %(python)s; "
            "1-min load average at the end %(load_avg_1min_at_end).1f." % result["machine"],
            "Date: %s. Command: `%s`." % (result["date"], result["command"]), "",
            "Default simulation: 2LPT at a=0.1, 10 KDK steps to a=1, 200 Mpc/h, float32, "
            "halo 25 Mpc/h. More ranks than cores means oversubscription: the ranks share the "
            "cores, so times add up the work of all ranks instead of showing speed-up.", "",
            "## Per step, and totals", "",
            "| mesh | backend | ranks | grid | step in the job [s] | warm step [s] | "
            "warm step / flowpm.tfpm | graph build [s] | ICs [s] | peak mem/rank [MB] | "
            "bytes/particle | received/rank/step [MB] |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ref = {r["nc"]: r["phase_s"]["step"] for r in result["records"]
           if r["backend"].startswith("flowpm")}
    for r in result["records"]:
        recv = r.get("received_bytes_per_rank", {}).get("step")
        warm = r["phase_s"]["step"]
        rows.append("| %d^3 | %s | %d | %s | %.3f | %.3f | %s | %.1f | %.2f | %.0f | %.0f | %s |"
                    % (r["nc"], r["backend"], r["ranks"], "x".join(map(str, r["grid"])),
                       step_median(r), warm,
                       "%.2f" % (warm / ref[r["nc"]]) if r["nc"] in ref else "-",
                       r["graph_build_s"], r["ics_s"], max(r["peak_memory_mb_sim"]),
                       r["bytes_per_particle"], "%.1f" % (max(recv) / 2**20) if recv else "-"))
    rows += ["", "'step in the job': median of the simulation's own steps (the first one "
             "includes TF's one-time graph optimisation). 'warm step': median of repeated "
             "runs of the last step (FlowPM: nbody over 2 steps minus over 1 "
             "step). flowpm.tfpm's 'step in the job' is its whole N-body run / steps; its "
             "graph build excludes the growth table (precomputed). bytes/particle = sum over "
             "ranks of peak resident memory / particles (includes TF's ~0.4 GB per process).",
             "",
             "## One step, split (HvdSimdMeshImpl; median of repeated runs of each part of the "
             "last step; slowest rank)", "",
             "| mesh | ranks | grid | step [ms] | paint [ms] | FFT [ms] | readout [ms] | "
             "other [ms] | comm: halo [ms] | comm: all-to-all [ms] | comm share |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["records"]:
        ph = r["phase_s"]
        if "paint" not in ph:
            continue
        other = ph["step"] - ph["paint"] - ph["fft"] - ph["readout"]
        comm = ph["comm_halo"] + ph["comm_fft"]
        rows.append("| %d^3 | %d | %s | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f%% |"
                    % (r["nc"], r["ranks"], "x".join(map(str, r["grid"])), 1e3 * ph["step"],
                       1e3 * ph["paint"], 1e3 * ph["fft"], 1e3 * ph["readout"], 1e3 * other,
                       1e3 * ph["comm_halo"], 1e3 * ph["comm_fft"],
                       100 * comm / ph["step"]))
    rows += ["", "paint includes its halo reduce, readout its halo fills, FFT its all-to-alls; "
             "the comm columns time those exchanges alone. 'other' = step - paint - FFT - "
             "readout: kick/drift updates minus what the parts share inside a step (TF merges "
             "the identical CIC stencil and escape-check subgraphs of paint and readout, which "
             "the parts alone each compute), hence negative.", ""]
    return "\n".join(rows) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    for name in ("run", "flowpm"):
        p = sub.add_parser(name)
        p.add_argument("--nc", type=int, default=64)
        p.add_argument("--steps", type=int, default=10)
        p.add_argument("--repeats", type=int, default=5)
        p.add_argument("--json", help="output record (default: stdout)")
        if name == "run":
            p.add_argument("--grid", type=lambda s: tuple(int(v) for v in s.split("x")))
            p.add_argument("--box-size", type=float, help="box side [Mpc/h] (default 200)")
            p.add_argument("--decomposition", choices=("eulerian", "lagrangian"),
                           default="eulerian")
            p.add_argument("--halo", type=int, help="halo [cells] (default: see sim_config)")
    p = sub.add_parser("migration", help="eulerian (migration) vs lagrangian decomposition "
                       "at high resolution on 2x2: results/bench_migration.md (+ raw JSON)")
    p.add_argument("--nc", type=int, default=128)
    p.add_argument("--box-size", type=float, default=64.0)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--grid", type=lambda s: tuple(int(v) for v in s.split("x")), default=(2, 2),
                   help="process grid PxQ of both runs (default 2x2: 4 ranks)")
    p.add_argument("--lagrangian-halo", type=int,
                   help="halo of the lagrangian run [cells] (default: what the eulerian run "
                        "measured it needs, capped at the block size - 1)")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--out", default=RESULTS)
    p = sub.add_parser("render", help="rewrite bench_sim.md from bench_sim.json")
    p.add_argument("--out", default=RESULTS)
    p = sub.add_parser("all")
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 128])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--no-flowpm", action="store_true")
    p.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s bench_sim: %(message)s")
    # Mesh TF's lowering counters (INFO), FlowPM's complex-cast warnings
    logging.getLogger("tensorflow").setLevel(logging.ERROR)
    if args.mode == "run":
        from flowpm_mtf.backend import install_abort_on_exception

        install_abort_on_exception()
    {"run": cmd_run, "flowpm": cmd_flowpm, "all": cmd_all, "render": cmd_render,
     "migration": cmd_migration}[args.mode](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
