"""Run ``flowpm_mtf`` graphs on the process grids of the current world size.

Each test builds one Mesh TF graph with ``build(mesh)`` and lowers it with one
of three implementations:

* ``"hvd"``: :class:`hvd_mesh_impl.HvdSimdMeshImpl`, one block per MPI rank
  (grid = world size);
* ``"placement"``: Mesh TF's ``PlacementMeshImpl`` on P*Q logical CPUs in this
  process (the reference implementation of every collective);
* ``"single"``: ``PlacementMeshImpl`` on a 1-processor mesh while the
  configuration has a 2 x 2 grid: every processor holds several blocks.
"""
import contextlib

import numpy as np
import mesh_tensorflow as mtf
import tensorflow.compat.v1 as tf

from conftest import world
from flowpm_mtf.backend import Backend, SerialComm, make_mesh_impl
from flowpm_mtf.backend import session_config as backend_session_config

tf.disable_eager_execution()

RANK, SIZE = world()

# Process grids run with HvdSimdMeshImpl for each world size.
HVD_GRIDS = {1: [(1, 1)], 2: [(2, 1), (1, 2)], 4: [(2, 2)]}
# Grids run with PlacementMeshImpl, in the 1-rank pass only: a placement mesh lives in
# one process, so its result does not depend on the world size, and in an N-rank job
# every rank would compute the same placement run again (on 4 oversubscribed ranks
# these duplicates were a quarter of the job's time). The 2x2 grid only: it splits both
# axes (the 1D grids (2,1) and (1,2) are run for real by the hvd backend on 2 ranks,
# against the same numpy / FlowPM references); they cost 7 of the 1-rank pass's minutes.
PLACEMENT_GRIDS = {1: [(2, 2)]}


def cases(single=False, placement=True, one_1d=None, hvd_2x2=True):
    """(kind, grid) pairs for this world size; ``single`` adds the 1-processor mesh,
    ``placement=False`` leaves out the placement grid, ``hvd_2x2=False`` the hvd 2x2 grid
    (a composition whose 2x2 layout the 1-processor 2 x 2 blocks check and whose Horovod
    collectives on that grid its layers' 4-rank tests do).

    The files that run on 4 ranks (``FOUR_RANK_TESTS`` of scripts/run_tests.sh) pass
    ``placement=False``: their 4-rank pass runs the same graph on the same 2x2 grid with
    HvdSimdMeshImpl against the same reference, so the 1-rank placement 2x2 case would
    check it twice. The other files keep it: it is their only 2x2 grid, and it splits x and
    y at once, so on 2 ranks they run the hvd grid (2, 1) alone: the x split with Horovod's
    collectives (each collective is checked on both 1D grids by test_backend), the y split
    on the placement grid. ``placement=False`` keeps both 1D grids; ``one_1d`` overrides
    that choice (test_fft keeps both and the placement grid: the FFT's lowering for a
    MeshImpl without laid-out pieces, PlacementMeshImpl's, is its own code path)."""
    grids = HVD_GRIDS.get(SIZE, [])
    if placement if one_1d is None else one_1d:
        grids = grids[:1]
    out = [("hvd", g) for g in grids if hvd_2x2 or tuple(g) != (2, 2)]
    if placement:
        out += [("placement", g) for g in PLACEMENT_GRIDS.get(SIZE, [])]
    if single and SIZE == 1:
        out.append(("single", (2, 2)))
    return out


def case_id(case):
    kind, grid = case
    return "%s-%dx%d" % (kind, grid[0], grid[1])


def case_dtypes(cases, dtypes=("float64", "float32")):
    """``(case, dtype)`` parameters (ids ``dtype-case``): every dtype on every case but the
    placement grid, float64 only there. That grid (1-rank pass) lowers its four blocks in
    one process, the costliest case; what it adds, the slicing of a split grid, does not
    depend on the dtype, and float32 on split grids is run by the 2-rank pass ((2,1),
    (1,2)), on one block by the 1-rank cases."""
    import pytest

    return [pytest.param(c, d, id="%s-%s" % (d, case_id(c))) for c in cases for d in dtypes
            if c[0] != "placement" or d == "float64"]


def make_impl(kind, conf):
    """The MeshImpl of ``kind`` for ``conf`` (through the package's one backend factory)."""
    if kind in ("hvd", "placement"):
        return make_mesh_impl(kind, conf.mesh_shape, conf.layout_rules)
    if kind == "single":
        return make_mesh_impl("placement", [("row", 1), ("col", 1)], conf.layout_rules)
    raise ValueError(kind)


@contextlib.contextmanager
def job_graph(grid, **overrides):
    """``(conf, impl, graph, mesh, sim)``: the job's ``SimulationGraph`` of a small config
    (16^3, 2 steps; ``overrides`` replace its fields) on the hvd backend, in a new TF graph."""
    from flowpm_mtf.config import SimConfig
    from flowpm_mtf.jobs import nbody_run
    kw = dict(nc=(16, 16, 16), box_size=(64.0, 64.0, 64.0), grid=grid, halo_size=4,
              a_start=0.1, a_end=1.0, n_steps=2, seed=7)
    conf = SimConfig(**dict(kw, **overrides))
    with tf.Graph().as_default():
        graph = mtf.Graph()
        mesh = mtf.Mesh(graph, "mesh")
        yield conf, make_impl("hvd", conf), graph, mesh, nbody_run.SimulationGraph(conf, mesh)


def session_config(kind, conf):
    return backend_session_config("hvd" if kind == "hvd" else "placement",
                                  conf.n_ranks if kind == "placement" else 1, threads=1)


def backend(kind, conf, comm=None):
    """A :class:`flowpm_mtf.backend.Backend` of ``kind`` (comm: this process only)."""
    return Backend(kind, make_impl(kind, conf), session_config(kind, conf),
                   SerialComm() if comm is None else comm)


def run(kind, conf, build, feeds=None, extra=None):
    """Build, lower and run a graph.

    Parameters
    ----------
    kind : {"hvd", "placement", "single"}
    conf : SimConfig
    build : callable(mesh) -> dict of mtf.Tensor, or (dict, dict of tf.placeholder)
        The tensors to export (full tensors), optionally with named placeholders.
    feeds : list of dict, optional
        One run per dict (placeholder name -> numpy value).
    extra : callable(lowering, impl) -> dict of tf.Tensor, optional
        More tensors to fetch.

    Returns
    -------
    dict of numpy arrays, or a list of them (one per feed dict).
    """
    with tf.Graph().as_default():
        graph = mtf.Graph()
        mesh = mtf.Mesh(graph, "mesh")
        built = build(mesh)
        outs, phs = built if isinstance(built, tuple) else (built, {})
        impl = make_impl(kind, conf)
        lowering = mtf.Lowering(graph, {mesh: impl})
        fetch = {k: lowering.export_to_tf_tensor(v) for k, v in outs.items()}
        if extra is not None:
            fetch.update(extra(lowering, impl))
        with tf.Session(config=session_config(kind, conf)) as sess:
            if feeds is None:
                return sess.run(fetch)
            return [sess.run(fetch, {phs[k]: v for k, v in fd.items()}) for fd in feeds]


def placeholder_input(mesh, phs, name, value, shape):
    """An mtf tensor imported from a new placeholder ``phs[name]`` shaped like ``value``."""
    ph = tf.placeholder(tf.as_dtype(np.asarray(value).dtype), np.shape(value), name=name)
    phs[name] = ph
    return mtf.import_tf_tensor(mesh, ph, shape)


def rel_err(a, b):
    """max |a - b| / max |b|."""
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


def traced_buffers(sess, fetches, feed_dict=None):
    """Run ``fetches`` (fed ``feed_dict``) with a full trace: the values, and the buffer
    address of every output of every op that ran, ``{op name: {slot: address}}`` (an
    output that took over an input's buffer has that input's address)."""
    meta = tf.RunMetadata()
    values = sess.run(fetches, feed_dict, run_metadata=meta,
                      options=tf.RunOptions(trace_level=tf.RunOptions.FULL_TRACE))
    ptr = {}
    for dev in meta.step_stats.dev_stats:
        for ns in dev.node_stats:
            for out in ns.output:
                ptr.setdefault(ns.node_name, {})[out.slot] = (
                    out.tensor_description.allocation_description.ptr)
    return values, ptr
