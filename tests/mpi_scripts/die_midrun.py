"""Rank 1 dies (os._exit) between two collectives while rank 0 waits in the second one.
The launcher must end the whole job with a non-zero exit instead of hanging."""
import os
import sys

import numpy as np
import tensorflow.compat.v1 as tf

from hvd_mesh_impl import HvdSimdMeshImpl, runtime

tf.disable_eager_execution()
mode = sys.argv[1]  # "exit": os._exit(3) on rank 1; "raise": uncaught exception on rank 1
runtime.install_abort_on_exception()
impl = HvdSimdMeshImpl([("x", 2)], [])
with tf.Graph().as_default():
    x = impl.LaidOutTensor([tf.constant(np.ones(4))])
    first = impl.allreduce(x, [0], "SUM").one_slice
    second = impl.allreduce(impl.LaidOutTensor([first]), [0], "SUM").one_slice
    with tf.Session(config=runtime.session_config()) as sess:
        sess.run(first)
        print("first collective done", flush=True)
        if impl.pnum == 1:
            if mode == "exit":
                os._exit(3)
            raise RuntimeError("rank 1 fails on purpose")
        sess.run(second)  # rank 0 blocks here until the job is torn down
