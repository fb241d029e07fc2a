"""Training through the plain Mesh TF API: a model-parallel 2-layer network trained with
``mtf.optimize`` (SGD, Adam) and with flowpm_mtf's Adam equals an independent numpy
implementation, step by step, on the process grids of the world size (1x1, 2x1, 1x2,
2x2), with one and with several TF threads (issue 16: every read of a variable in a
step must see its value before the step's assignments).

Batch is split over mesh axis ``rows``, the hidden layer over ``cols``; float64."""
import numpy as np
import pytest
import mesh_tensorflow as mtf
import tensorflow.compat.v1 as tf

from conftest import world

tf.disable_eager_execution()

RANK, SIZE = world()
GRIDS = {1: [(1, 1)], 2: [(2, 1), (1, 2)], 4: [(2, 2)]}.get(SIZE, [])
THREADS = [1, 4]  # TF intra- and inter-op threads
STEPS = 5
RTOL = {"sgd": 1e-10, "flowpm_adam": 1e-10,  # float64, another summation order
        "mtf_adam": 1e-6}  # mtf.optimize.AdamWeightDecayOptimizer computes in float32
B, D, H, O = 8, 6, 8, 4  # batch, input, hidden, output sizes
LR = {"sgd": 0.1, "mtf_adam": 0.05, "flowpm_adam": 0.05}
ADAM_EPS_MTF = 1e-6  # AdamWeightDecayOptimizer's default
ADAM_EPS_FLOWPM = 1e-8  # flowpm_mtf.mesh.optim.adam_update's default

rng = np.random.RandomState(16)
X = rng.standard_normal([B, D])
T = rng.standard_normal([B, O])
W1 = rng.standard_normal([D, H]) * 0.5
W2 = rng.standard_normal([H, O]) * 0.5


# ------------------------------------------------------------------------- numpy
def np_loss_grads(w1, w2):
    h = np.tanh(X @ w1)
    y = h @ w2
    loss = np.sum((y - T) ** 2) / B
    dy = 2.0 * (y - T) / B
    dz = (dy @ w2.T) * (1.0 - h**2)
    return loss, [X.T @ dz, h.T @ dy]


def np_train(opt):
    """Losses (before each step) and final weights of ``STEPS`` steps of ``opt``."""
    ws = [W1.copy(), W2.copy()]
    f32 = np.float32
    state = [dict(m=np.zeros_like(w, dtype=f32 if opt == "mtf_adam" else float),
                  v=np.zeros_like(w, dtype=f32 if opt == "mtf_adam" else float)) for w in ws]
    losses = []
    for step in range(1, STEPS + 1):
        loss, grads = np_loss_grads(*ws)
        losses.append(loss)
        for w, g, s in zip(ws, grads, state):
            if opt == "sgd":
                w -= g * LR[opt]
            elif opt == "mtf_adam":
                # mtf.optimize.AdamWeightDecayOptimizer computes in float32 (mtf.to_float)
                g = g.astype(f32)
                s["m"] = f32(0.9) * s["m"] + f32(1.0 - 0.9) * g
                s["v"] = f32(0.999) * s["v"] + f32(1.0 - 0.999) * np.square(g)
                update = s["m"] / (np.sqrt(s["v"]) + f32(ADAM_EPS_MTF))
                w -= (f32(LR[opt]) * update).astype(np.float64)
            else:  # flowpm_mtf.mesh.optim.adam_update, float64 with bias correction
                s["m"] = s["m"] * 0.9 + g * (1.0 - 0.9)
                s["v"] = s["v"] * 0.999 + np.square(g) * (1.0 - 0.999)
                m_hat = s["m"] / (1.0 - np.exp(step * np.log(0.9)))
                v_hat = s["v"] / (1.0 - np.exp(step * np.log(0.999)))
                w -= m_hat / (np.sqrt(v_hat) + ADAM_EPS_FLOWPM) * LR[opt]
    return np.array(losses), ws


# ------------------------------------------------------------------------- Mesh TF
def build(mesh, opt):
    """The network, its loss and the optimizer's update operations."""
    batch, d_in = mtf.Dimension("batch", B), mtf.Dimension("d_in", D)
    hidden, d_out = mtf.Dimension("hidden", H), mtf.Dimension("d_out", O)
    x = mtf.import_tf_tensor(mesh, tf.constant(X), mtf.Shape([batch, d_in]))
    t = mtf.import_tf_tensor(mesh, tf.constant(T), mtf.Shape([batch, d_out]))
    w1 = mtf.get_variable(mesh, "w1", mtf.Shape([d_in, hidden]), dtype=tf.float64,
                          initializer=tf.constant_initializer(W1))
    w2 = mtf.get_variable(mesh, "w2", mtf.Shape([hidden, d_out]), dtype=tf.float64,
                          initializer=tf.constant_initializer(W2))
    h = mtf.tanh(mtf.einsum([x, w1], output_shape=mtf.Shape([batch, hidden])))
    y = mtf.einsum([h, w2], output_shape=mtf.Shape([batch, d_out]))
    loss = mtf.reduce_sum(mtf.square(y - t)) * (1.0 / B)
    grads = mtf.gradients([loss], [w1, w2])
    if opt == "sgd":
        updates = mtf.optimize.SgdOptimizer(LR[opt]).apply_grads(
            grads, [w1.operation, w2.operation])
    elif opt == "mtf_adam":
        updates = mtf.optimize.AdamWeightDecayOptimizer(LR[opt]).apply_grads(
            grads, [w1.operation, w2.operation])
    else:
        from flowpm_mtf.mesh.optim import adam_update

        updates = []
        for w, g in zip((w1, w2), grads):
            updates += adam_update(w, g, LR[opt], name=w.operation.name + "_adam")[0]
    return loss, [w1, w2], updates


def train(impl, opt, threads, ordered_helper=False, devices=1):
    with tf.Graph().as_default():
        graph = mtf.Graph()
        mesh = mtf.Mesh(graph, "mesh")
        loss, ws, updates = build(mesh, opt)
        lowering = mtf.Lowering(graph, {mesh: impl})
        if ordered_helper:
            from hvd_mesh_impl import ordered_update_op

            step = ordered_update_op(lowering, updates)
        else:  # the way Mesh TF's examples build the train op
            step = tf.group([lowering.lowered_operation(op) for op in updates])
        loss_tf = lowering.export_to_tf_tensor(loss)
        ws_tf = [lowering.export_to_tf_tensor(w) for w in ws]
        config = tf.ConfigProto(intra_op_parallelism_threads=threads,
                                inter_op_parallelism_threads=threads,
                                device_count={"CPU": devices})
        losses = []
        with tf.Session(config=config) as sess:
            sess.run(tf.global_variables_initializer())
            sess.run(lowering.copy_masters_to_slices())
            if getattr(impl, "slice_only_variables", False):  # HvdSimdMeshImpl: no masters
                names = [v.op.name for v in tf.global_variables()]
                assert all(n.endswith("_slice") for n in names), names
            for _ in range(STEPS):
                losses.append(sess.run([loss_tf, step])[0])
            return np.array(losses), sess.run(ws_tf)


def layout():
    return [("batch", "rows"), ("hidden", "cols")]


def check(losses, ws, opt):
    ref_losses, ref_ws = np_train(opt)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL[opt], err_msg="losses")
    for w, r in zip(ws, ref_ws):
        np.testing.assert_allclose(w, r, rtol=RTOL[opt], atol=RTOL[opt], err_msg="weights")
    assert ref_losses[-1] < 0.9 * ref_losses[0]  # the network learns


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("opt", ["sgd", "mtf_adam", "flowpm_adam"])
@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: "x".join(map(str, g)))
def test_hvd_training_equals_numpy(grid, opt, threads):
    from hvd_mesh_impl import HvdSimdMeshImpl

    impl = HvdSimdMeshImpl([("rows", grid[0]), ("cols", grid[1])], layout())
    losses, ws = train(impl, opt, threads)
    check(losses, ws, opt)


@pytest.mark.rank_independent
@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("opt", ["sgd", "mtf_adam"])
def test_placement_with_ordered_update_op_equals_numpy(opt, threads):
    """Mesh TF's PlacementMeshImpl (2x2 on 4 logical CPUs) with the ordering helper."""
    impl = mtf.placement_mesh_impl.PlacementMeshImpl(
        [("rows", 2), ("cols", 2)], layout(), ["/cpu:%d" % i for i in range(4)])
    losses, ws = train(impl, opt, threads, ordered_helper=True, devices=4)
    check(losses, ws, opt)
