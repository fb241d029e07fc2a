"""The exit race of issue 16, made deterministic: on a 2x2 mesh the last export of a
weight gathers along ``cols`` (process sets {0, 1} and {2, 3}); ranks 2 and 3 are
delayed before that collective (``EXIT_RACE_DELAY_S``), so ranks 0 and 1 reach the end
of the program first. Without the exit barrier rank 0's exit shuts Horovod down and
ranks 2 and 3 fail with "Horovod has been shut down"; with it every rank exits 0."""
import os
import time

import numpy as np

# hvd_mesh_impl before mesh_tensorflow: Mesh TF's TF >= 2.13 shims (hvd_mesh_impl.tf_compat)
from hvd_mesh_impl import HvdSimdMeshImpl, export_local_slice
import mesh_tensorflow as mtf  # noqa: E402
import tensorflow.compat.v1 as tf  # noqa: E402

tf.disable_eager_execution()
delay = float(os.environ.get("EXIT_RACE_DELAY_S", "1.0"))
impl = HvdSimdMeshImpl([("rows", 2), ("cols", 2)], [("a", "rows"), ("b", "cols")])
with tf.Graph().as_default():
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "mesh")
    shape = mtf.Shape([mtf.Dimension("a", 4), mtf.Dimension("b", 4)])
    w = mtf.get_variable(mesh, "w", shape, dtype=tf.float64,
                         initializer=tf.constant_initializer(np.arange(16.0).reshape(4, 4)))
    gathered = mtf.rename_dimension(w, "b", "b_full")  # allconcat along cols
    lowering = mtf.Lowering(graph, {mesh: impl})
    # gather along cols only: the collective of ranks {2, 3} does not involve rank 0
    row_block = export_local_slice(lowering, gathered)
    with tf.Session() as sess:
        sess.run(tf.global_variables_initializer())
        if impl.pnum >= 2:
            time.sleep(delay)  # the test-only delay before the {2, 3} collective
        value = sess.run(row_block)
print("rank %d done %s" % (impl.pnum, value.shape), flush=True)
