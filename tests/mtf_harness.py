"""Build one Mesh TF graph, lower it with HvdSimdMeshImpl and with PlacementMeshImpl,
run both, and return numpy results for comparison.

PlacementMeshImpl runs in this process on N logical CPU devices: it is the
reference implementation of every collective (Mesh TF's own code)."""
import numpy as np
import mesh_tensorflow as mtf
import tensorflow.compat.v1 as tf

from flowpm_mtf.backend import make_mesh_impl, session_config  # the one MeshImpl factory

tf.disable_eager_execution()

# Meshes exercised for each world size (the list plus a 3-axis mesh).
MESHES = {
    1: [(1,), (1, 1, 1)],
    2: [(2,), (2, 1), (1, 2), (2, 1, 1)],
    4: [(4,), (2, 2), (2, 1, 2)],
}
AXIS_NAMES = ("m0", "m1", "m2")


def meshes_for(size):
    return MESHES.get(size, [(size,)])


def mesh_shape(dims):
    return [(AXIS_NAMES[i], n) for i, n in enumerate(dims)]


def mesh_id(dims):
    return "x".join(str(d) for d in dims)


def hvd_impl(dims, layout):
    return make_mesh_impl("hvd", mesh_shape(dims), layout)


def placement_impl(dims, layout):
    return make_mesh_impl("placement", mesh_shape(dims), layout)


def placement_config(n):
    return session_config("placement", n, threads=1)


def hvd_config():
    return session_config("hvd")


def run_graph(kind, dims, layout, build, fetch_extra=None, run_ops=None):
    """Lower ``build(mesh) -> {name: mtf.Tensor}`` with one implementation and run it.

    Parameters
    ----------
    kind : {"hvd", "placement"}
    build : callable(mesh) -> dict of mtf tensors to export (full tensors)
    fetch_extra : callable(lowering, impl, outputs) -> dict of tf tensors, optional
    run_ops : callable(lowering, outputs) -> list of tf ops run (in order) before fetching

    Returns
    -------
    dict of numpy arrays
    """
    with tf.Graph().as_default():
        graph = mtf.Graph()
        mesh = mtf.Mesh(graph, "mesh")
        outs = build(mesh)
        impl = hvd_impl(dims, layout) if kind == "hvd" else placement_impl(dims, layout)
        lowering = mtf.Lowering(graph, {mesh: impl})
        fetch = {k: lowering.export_to_tf_tensor(v) for k, v in outs.items()}
        if fetch_extra is not None:
            fetch.update(fetch_extra(lowering, impl, outs))
        pre = run_ops(lowering, outs) if run_ops is not None else []
        config = hvd_config() if kind == "hvd" else placement_config(int(np.prod(dims)))
        with tf.Session(config=config) as sess:
            sess.run(tf.global_variables_initializer())
            sess.run(lowering.copy_masters_to_slices())
            for op in pre:
                sess.run(op)
            return sess.run(fetch)


def run_both(dims, layout, build, **kw):
    return (run_graph("hvd", dims, layout, build, **kw),
            run_graph("placement", dims, layout, build, **kw))
