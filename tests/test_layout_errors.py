"""HvdSimdMeshImpl's errors at graph construction (issue 57), on 1, 2 and 4 ranks.

A layout rule naming an unknown mesh axis, a mesh whose size is not the number of
ranks, and a tensor dimension not divisible by the mesh axis it is split over each
give one ``ValueError`` naming the dimension and the axis (or the mesh and the rank
count), with the same message on every rank (gathered with mpi4py, outside Horovod),
and before any collective of the graph runs: a valid graph lowered and run after the
errors on the same ranks gives the right result (a collective issued by some ranks
only would leave the next ones waiting or mismatched).
"""
import re

import numpy as np
import pytest
import mesh_tensorflow as mtf
import tensorflow.compat.v1 as tf

from conftest import world
from mtf_harness import hvd_config, mesh_shape, meshes_for

tf.disable_eager_execution()

RANK, SIZE = world()


def error_on_every_rank(build):
    """The message (first line) of the ``ValueError`` of ``build()``, the same on every rank.

    Every rank gathers its message (None: no error) with mpi4py, so a rank that does
    not fail cannot leave the others waiting.
    """
    from mpi4py import MPI

    try:
        build()
        msg = None
    except ValueError as e:
        msg = str(e).splitlines()[0]  # gin appends "In call to configurable ... <address>"
    msgs = MPI.COMM_WORLD.allgather(msg)
    assert msgs[0] is not None, "no ValueError"
    assert all(m == msgs[0] for m in msgs), "different errors on the ranks: %s" % msgs
    return msgs[0]


def impl(dims, layout):
    from hvd_mesh_impl import HvdSimdMeshImpl

    return HvdSimdMeshImpl(mesh_shape(dims), layout)


def run_sum(dims, layout, size):
    """Sum of ``range(size)`` on dimension ``a`` split by ``layout``, lowered and run."""
    with tf.Graph().as_default():
        graph = mtf.Graph()
        mesh = mtf.Mesh(graph, "mesh")
        x = mtf.import_tf_tensor(mesh, tf.constant(np.arange(size, dtype=np.float64)),
                                 mtf.Shape([mtf.Dimension("a", size)]))
        y = mtf.reduce_sum(x * 2.0)
        lowering = mtf.Lowering(graph, {mesh: impl(dims, layout)})
        y_tf = lowering.export_to_tf_tensor(y)
        with tf.Session(config=hvd_config()) as sess:
            return sess.run(y_tf)


@pytest.mark.parametrize("dims", meshes_for(SIZE), ids=lambda d: "x".join(map(str, d)))
def test_layout_rule_with_an_unknown_mesh_axis(dims):
    msg = error_on_every_rank(lambda: impl(dims, [("a", "m0"), ("b", "row")]))
    assert "layout rule ('b', 'row') names mesh axis 'row'" in msg
    assert "not in the mesh" in msg


@pytest.mark.parametrize("dims", [(SIZE + 1,), (SIZE, 2)], ids=["one_more", "twice"])
def test_mesh_size_is_not_the_number_of_ranks(dims):
    msg = error_on_every_rank(lambda: impl(dims, [("a", "m0")]))
    n = int(np.prod(dims))
    assert "has %d processors but the job has %d MPI ranks" % (n, SIZE) in msg
    assert "-np %d" % n in msg


def split_meshes():
    """(dims, mesh axis index) of every mesh of this world size with an axis > 1."""
    return [(d, i) for d in meshes_for(SIZE) for i, n in enumerate(d) if n > 1]


@pytest.mark.skipif(SIZE == 1, reason="every mesh axis has size 1 on one rank")
@pytest.mark.parametrize("how", ["import", "range", "variable"])
@pytest.mark.parametrize("dims,axis", split_meshes(),
                         ids=["%s_m%d" % ("x".join(map(str, d)), i) for d, i in split_meshes()])
def test_dimension_not_divisible_by_its_mesh_axis(dims, axis, how):
    name, n = "m%d" % axis, dims[axis]
    size = 2 * n + 1
    layout = [("a", name)]

    def build():
        with tf.Graph().as_default():
            graph = mtf.Graph()
            mesh = mtf.Mesh(graph, "mesh")
            a = mtf.Dimension("a", size)
            if how == "import":
                x = mtf.import_tf_tensor(mesh, tf.zeros([size, 3], tf.float64),
                                         mtf.Shape([a, mtf.Dimension("b", 3)]))
            elif how == "range":
                x = mtf.range(mesh, a, tf.float64)
            else:
                x = mtf.get_variable(mesh, "v", mtf.Shape([a]), dtype=tf.float64)
            y = mtf.reduce_sum(x)
            lowering = mtf.Lowering(graph, {mesh: impl(dims, layout)})
            lowering.export_to_tf_tensor(y)

    msg = error_on_every_rank(build)
    assert re.search(r"tensor dimension 'a' \(size %d\) is split over mesh axis '%s' \(size %d\)"
                     % (size, name, n), msg), msg
    assert "make 'a' a multiple of %d" % n in msg
    # no collective of the failed graphs was issued: the next ones match on every rank
    assert run_sum(dims, layout, 2 * n) == 2 * n * (2 * n - 1)


def test_valid_graph_after_the_errors():
    """Whatever failed before on these ranks, a valid graph runs (no collective pending)."""
    dims = meshes_for(SIZE)[0]
    assert run_sum(dims, [("a", "m0")], 4 * SIZE) == 4 * SIZE * (4 * SIZE - 1)
