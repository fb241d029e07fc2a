"""HvdSimdMeshImpl == PlacementMeshImpl, collective by collective.

Every test runs on the meshes of the current world size (1, 2 or 4 ranks; see
``mtf_harness.MESHES``). Data movement is compared *exactly* on integer
``arange`` inputs (and on complex ones built from them); reductions with
``allclose``.
"""
import numpy as np
import pytest
import mesh_tensorflow as mtf
import tensorflow.compat.v1 as tf

from conftest import world
from mtf_harness import (AXIS_NAMES, hvd_config, hvd_impl, mesh_id, meshes_for,
                         placement_config, placement_impl, run_both, run_graph)

RANK, SIZE = world()
MESHES = meshes_for(SIZE)
# Reductions sum in a different order (ring vs. MPI): float32 differs by a few ulp.
REDUCE_RTOL = {np.float32: 1e-6, np.float64: 1e-13, np.complex64: 1e-6}

DIMS = {"a": 4, "b": 6, "c": 4}  # tensor dims; divisible by every mesh axis used


def full_layout(dims):
    """a -> m0, b -> m1, c -> m2 (as far as the mesh has axes)."""
    return [(name, AXIS_NAMES[i]) for i, name in enumerate("abc"[:len(dims)])]


def shape_of(*names, rename=None):
    rename = rename or {}
    return mtf.Shape([mtf.Dimension(rename.get(n, n), DIMS[n]) for n in names])


def arange(names, dtype):
    n = int(np.prod([DIMS[k] for k in names]))
    x = np.arange(n).reshape([DIMS[k] for k in names])
    if np.issubdtype(dtype, np.complexfloating):
        return (x + 1j * (1000 + x)).astype(dtype)
    if dtype == np.bool_:
        return (x % 3 == 0)
    return x.astype(dtype)


def ids(meshes):
    return [mesh_id(m) for m in meshes]


DATA_DTYPES = [np.int32, np.int64, np.float32, np.float64, np.complex64, np.complex128, np.bool_]


def dtype_mesh_cases(dtypes):
    """``(dtype, dims)`` parameters (ids ``dtype-mesh``) of a collective's test.

    On one rank every dtype on every mesh. On 2 and 4 ranks every dtype once and every
    mesh at least once: dtype k on mesh k mod (number of meshes). The dtype decides how a
    slice is packed for the collective (complex and bool included), the mesh which ranks
    exchange it, and the backend handles the two separately; the full product repeated
    each collective per dtype on every mesh, the costliest cases of the suite on 4
    oversubscribed ranks.
    """
    if SIZE == 1:
        pairs = [(d, m) for m in MESHES for d in dtypes]
    else:
        n = max(len(dtypes), len(MESHES))
        pairs = [(dtypes[k % len(dtypes)], MESHES[k % len(MESHES)]) for k in range(n)]
    return [pytest.param(d, m, id="%s-%s" % (np.dtype(d).name, mesh_id(m))) for d, m in pairs]


# ------------------------------------------------------------------------- relayouts
@pytest.mark.parametrize("dtype, dims", dtype_mesh_cases(DATA_DTYPES))
def test_import_export_and_relayouts_exact(dims, dtype):
    """import -> {identity, allconcat, allsplit, alltoall} -> export, bit-exact.

    Renaming a split dimension to an unsplit name lowers to allconcat, the reverse
    to allsplit (laid_out_pcoord), and moving the split from one dimension to
    another on the same mesh axis to alltoall.
    """
    layout = full_layout(dims) + [("a2", "m0")]
    x_np = arange("abc", dtype)

    def build(mesh):
        x = mtf.import_tf_tensor(mesh, tf.constant(x_np), shape_of("a", "b", "c"))
        gathered = mtf.rename_dimension(x, "a", "a_full")          # allconcat on m0
        resplit = mtf.rename_dimension(gathered, "a_full", "a2")    # allsplit on m0
        # alltoall: split moves from "a" (m0) to "c_on_m0" (m0)
        y = mtf.reshape(x, shape_of("a", "b", "c", rename={"a": "a_full", "c": "c_on_m0"}))
        return {"x": x, "gathered": gathered, "resplit": resplit, "alltoall": y}

    lay = layout + [("c_on_m0", "m0")] if len(dims) < 3 else layout
    if len(dims) == 3:
        # "c" is on m2 already; move the m0 split from "a" to "b" instead.
        lay = full_layout(dims)[1:] + [("a", "m0"), ("a2", "m0")]

        def build(mesh):  # noqa: F811
            x = mtf.import_tf_tensor(mesh, tf.constant(x_np), shape_of("a", "b", "c"))
            gathered = mtf.rename_dimension(x, "a", "a_full")
            resplit = mtf.rename_dimension(gathered, "a_full", "a2")
            y = mtf.reshape(x, shape_of("a", "b", "c", rename={"a": "a_full", "b": "b_on_m0"}))
            return {"x": x, "gathered": gathered, "resplit": resplit, "alltoall": y}
        lay = [("a", "m0"), ("a2", "m0"), ("b_on_m0", "m0"), ("b", "m1"), ("c", "m2")]

    got, ref = run_both(dims, lay, build)
    for key in ref:
        np.testing.assert_array_equal(got[key], ref[key], err_msg=key)
        np.testing.assert_array_equal(got[key], x_np, err_msg=key)


@pytest.mark.parametrize("dims", MESHES, ids=ids(MESHES))
def test_local_slice_matches_placement_slice(dims):
    """Each rank's slice equals PlacementMeshImpl's slice for the same pnum."""
    from hvd_mesh_impl import export_local_slice

    layout = full_layout(dims)
    x_np = arange("abc", np.int64)

    def build(mesh):
        return {"x": mtf.import_tf_tensor(mesh, tf.constant(x_np), shape_of("a", "b", "c"))}

    def local(lowering, impl, outs):
        if hasattr(impl, "pnum"):
            return {"local": export_local_slice(lowering, outs["x"]),
                    "begin": tf.constant(impl.local_slice_begin(outs["x"].shape))}
        return {"slice%d" % p: s for p, s in
                enumerate(lowering.tensors[outs["x"]].to_laid_out_tensor().all_slices)}

    got, ref = run_both(dims, layout, build, fetch_extra=local)
    np.testing.assert_array_equal(got["local"], ref["slice%d" % RANK])
    b = got["begin"]
    np.testing.assert_array_equal(
        got["local"], x_np[tuple(slice(s, s + n) for s, n in zip(b, got["local"].shape))])


# ------------------------------------------------------------------------- reductions
@pytest.mark.parametrize("dtype, dims",
                         dtype_mesh_cases([np.int32, np.float32, np.float64, np.complex64]))
def test_allreduce_sum_max_min(dims, dtype):
    layout = full_layout(dims)
    rng = np.random.RandomState(7)
    x_np = (rng.standard_normal([DIMS[k] for k in "abc"]) * 100).astype(dtype)
    if np.issubdtype(dtype, np.complexfloating):
        x_np = x_np + 1j * x_np[::-1]

    def build(mesh):
        x = mtf.import_tf_tensor(mesh, tf.constant(x_np), shape_of("a", "b", "c"))
        out = {"sum_a": mtf.reduce_sum(x, reduced_dim=x.shape.dims[0]),
               "sum_all": mtf.reduce_sum(x),
               "sum_bc": mtf.reduce_sum(x, output_shape=mtf.Shape(x.shape.dims[:1]))}
        if not np.issubdtype(dtype, np.complexfloating):
            out["max_ab"] = mtf.reduce_max(x, output_shape=mtf.Shape(x.shape.dims[2:]))
            out["min_all"] = mtf.reduce_min(x)
        return out

    got, ref = run_both(dims, layout, build)
    rtol = REDUCE_RTOL.get(dtype, 0)
    expect = {"sum_a": x_np.sum(0), "sum_all": x_np.sum(), "sum_bc": x_np.sum((1, 2)),
              "max_ab": x_np.max((0, 1)), "min_all": x_np.min()}
    for key in ref:
        np.testing.assert_allclose(got[key], ref[key], rtol=rtol, atol=0, err_msg=key)
        np.testing.assert_allclose(got[key], expect[key], rtol=max(rtol, 1e-5), err_msg=key)


def test_unsupported_reductions_raise():
    dims = MESHES[0]
    with tf.Graph().as_default():
        impl = hvd_impl(dims, full_layout(dims))
        x = impl.LaidOutTensor([tf.ones([2], tf.float32)])
        with pytest.raises(NotImplementedError, match="PROD"):
            impl.allreduce(x, [0], "PROD")
        z = impl.LaidOutTensor([tf.ones([2], tf.complex64)])
        with pytest.raises(NotImplementedError, match="complex"):
            impl.allreduce(z, [0], "MAX")


# ------------------------------------------------------------------------- direct collectives
def _slices(n, shape, dtype):
    """Distinct integer-valued slices for n processors: slice p = arange + 1000 p."""
    base = np.arange(int(np.prod(shape))).reshape(shape)
    out = []
    for p in range(n):
        v = base + 1000 * p
        if np.issubdtype(dtype, np.complexfloating):
            v = v + 1j * (v + 500)
        out.append(v.astype(dtype))
    return out


def _run_direct(dims, fn_hvd, fn_ref, slices):
    """fn(impl, laid_out) -> list of LaidOutTensors; compare this rank's slice of each."""
    n = int(np.prod(dims))
    layout = full_layout(dims)
    with tf.Graph().as_default():
        impl = hvd_impl(dims, layout)
        outs = fn_hvd(impl, impl.LaidOutTensor([tf.constant(slices[RANK])]))
        with tf.Session(config=hvd_config()) as sess:
            got = sess.run([o.one_slice for o in outs])
    with tf.Graph().as_default():
        impl = placement_impl(dims, layout)
        tl = []
        for p in range(n):
            with tf.device("/cpu:%d" % p):
                tl.append(tf.constant(slices[p]))
        outs = fn_ref(impl, impl.LaidOutTensor(tl))
        with tf.Session(config=placement_config(n)) as sess:
            ref = sess.run([o.tensor_list[RANK] for o in outs])
    return got, ref


@pytest.mark.parametrize("dtype, dims", dtype_mesh_cases([np.int32, np.float64, np.complex64]))
def test_allconcat_alltoall_direct(dims, dtype):
    """allconcat (concat and stack) and alltoall for every axis pair of a rank-3 slice."""
    shape = [4, 4, 8]
    slices = _slices(int(np.prod(dims)), shape, dtype)
    cases = []
    for ma in range(len(dims)):
        for ca in range(3):
            cases.append(("concat", ma, ca, None))
            cases.append(("stack", ma, ca, None))
            for sa in range(3):
                cases.append(("a2a", ma, sa, ca))

    def fn(stack_via_concat):
        def run(impl, x):
            outs = []
            for kind, ma, a1, a2 in cases:
                if kind == "concat":
                    outs.append(impl.allconcat(x, ma, a1))
                elif kind == "stack":
                    if stack_via_concat:  # PlacementMeshImpl has no stack=: expand, then concat
                        ex = impl.slicewise(lambda t, a=a1: tf.expand_dims(t, a), x)
                        outs.append(impl.allconcat(ex, ma, a1))
                    else:
                        outs.append(impl.allconcat(x, ma, a1, stack=True))
                else:
                    outs.append(impl.alltoall(x, ma, a1, a2))
            return outs
        return run

    got, ref = _run_direct(dims, fn(False), fn(True), slices)
    for case, g, r in zip(cases, got, ref):
        assert g.shape == r.shape, case
        np.testing.assert_array_equal(g, r, err_msg=str(case))


def _source_patterns(n):
    pats = [[(i - 1) % n for i in range(n)], [(i + 1) % n for i in range(n)],
            [None] + list(range(n - 1)), list(range(1, n)) + [None],
            [0] * n, [None] * n, list(reversed(range(n)))]
    return pats


@pytest.mark.parametrize("dtype, dims",
                         dtype_mesh_cases([np.int64, np.float32, np.complex128, np.bool_]))
def test_receive_and_shift_direct(dims, dtype):
    shape = [3, 2, 5]
    slices = _slices(int(np.prod(dims)), shape, dtype if dtype != np.bool_ else np.int64)
    if dtype == np.bool_:
        slices = [(s % 3 == 0) for s in slices]
    cases = []
    for ma, n in enumerate(dims):
        for pat in _source_patterns(n):
            cases.append(("recv", ma, pat))
        for off in (-2, -1, 1, 2, n):
            for wrap in (True, False):
                cases.append(("shift", ma, (off, wrap)))

    def run(impl, x):
        outs = []
        for kind, ma, arg in cases:
            if kind == "recv":
                outs.append(impl.receive(x, ma, arg))
            else:
                outs.append(impl.shift_by_n_processors(x, ma, arg[0], arg[1]))
        return outs

    got, ref = _run_direct(dims, run, run, slices)
    for case, g, r in zip(cases, got, ref):
        np.testing.assert_array_equal(g, r, err_msg=str(case))


@pytest.mark.parametrize("dims", MESHES, ids=ids(MESHES))
def test_shift_moves_only_the_neighbour_slice(dims):
    """Bytes received by each rank in a shift == exactly one slice (never an allgather)."""
    shape = [6, 10]
    x_np = np.arange(60, dtype=np.float64).reshape(shape) + 100 * RANK
    for ma, n in enumerate(dims):
        with tf.Graph().as_default():
            impl = hvd_impl(dims, full_layout(dims))
            x = impl.LaidOutTensor([tf.constant(x_np)])
            y = impl.shift_by_n_processors(x, ma, 1, wrap=True)
            nbytes = impl.comm_bytes_received("receive")
            allbytes = impl.comm_bytes_received()
            with tf.Session(config=hvd_config()) as sess:
                out, nb, ab = sess.run([y.one_slice, nbytes, allbytes])
        expected = x_np.nbytes if n > 1 else 0
        assert nb == expected, (ma, nb, expected)
        assert ab == expected, (ma, ab, expected)
        if n > 1:
            src = impl.pcoord
            src[ma] = (src[ma] - 1) % n
            src_rank = int(np.ravel_multi_index(src, dims))
            np.testing.assert_array_equal(out, x_np - 100 * RANK + 100 * src_rank)


@pytest.mark.parametrize("dims", MESHES, ids=ids(MESHES))
@pytest.mark.parametrize("wrap", [True, False])
def test_mtf_shift_exact(dims, wrap):
    """mtf.shift along split dimensions (crossing slice boundaries) == reference."""
    layout = full_layout(dims)
    x_np = arange("abc", np.int32)

    def build(mesh):
        x = mtf.import_tf_tensor(mesh, tf.constant(x_np), shape_of("a", "b", "c"))
        out = {}
        for d in x.shape.dims:
            for off in (-1, 1, 3):
                out["%s%+d" % (d.name, off)] = mtf.shift(x, off, d, wrap=wrap)
        return out

    got, ref = run_both(dims, layout, build)
    for key in ref:
        np.testing.assert_array_equal(got[key], ref[key], err_msg=key)
        axis = "abc".index(key[0])
        off = int(key[1:])
        if wrap:
            np.testing.assert_array_equal(got[key], np.roll(x_np, off, axis), err_msg=key)


# ------------------------------------------------------------------------- pnum / pcoord / random
@pytest.mark.parametrize("dims", MESHES, ids=ids(MESHES))
def test_pnum_pcoord_and_slice_num(dims):
    layout = full_layout(dims)
    shape = shape_of("a", "b", "c")
    with tf.Graph().as_default():
        impl = hvd_impl(dims, layout)
        ts = [impl.laid_out_pnum().one_slice] + [
            impl.laid_out_pcoord(a).one_slice for a in range(len(dims))] + [
            impl.laid_out_slice_num(shape).one_slice]
        with tf.Session(config=hvd_config()) as sess:
            got = sess.run(ts)
    with tf.Graph().as_default():
        impl = placement_impl(dims, layout)
        ts = [tf.convert_to_tensor(impl.laid_out_pnum().tensor_list[RANK])] + [
            impl.laid_out_pcoord(a).tensor_list[RANK] for a in range(len(dims))] + [
            impl.laid_out_slice_num(shape).tensor_list[RANK]]
        with tf.Session(config=placement_config(int(np.prod(dims)))) as sess:
            ref = sess.run(ts)
    assert [int(v) for v in got] == [int(v) for v in ref]


@pytest.mark.parametrize("dims", MESHES, ids=ids(MESHES))
def test_random_deterministic_and_layout_consistent(dims):
    """Same numbers on every run; replicated slices agree across ranks; split slices differ."""
    # "b" is replicated (not in the layout) so ranks along m1 hold identical slices.
    layout = [("a", "m0")]

    def build(mesh):
        s = shape_of("a", "b", "c")
        return {"u": mtf.random_uniform(mesh, s, dtype=tf.float64),
                "n": mtf.random_normal(mesh, s, dtype=tf.float64, seed=123)}

    def local(lowering, impl, outs):
        return {k + "_local": lowering.tensors[v].to_laid_out_tensor().one_slice
                for k, v in outs.items()}

    r1 = run_graph("hvd", dims, layout, build, fetch_extra=local)
    r2 = run_graph("hvd", dims, layout, build, fetch_extra=local)
    for k in r1:
        np.testing.assert_array_equal(r1[k], r2[k], err_msg="run-to-run: " + k)
    # export gathers along m0 only: the full tensor must equal the local slices where
    # this rank holds them, and differ between the m0-slices.
    from mpi4py import MPI

    allu = MPI.COMM_WORLD.allgather(r1["u_local"])
    a_len = DIMS["a"] // dims[0]
    for p, sl in enumerate(allu):
        c0 = np.unravel_index(p, dims)[0]
        np.testing.assert_array_equal(sl, r1["u"][c0 * a_len:(c0 + 1) * a_len])
    if dims[0] > 1:
        assert not np.array_equal(r1["u"][:a_len], r1["u"][a_len:2 * a_len])
    assert 0 <= r1["u"].min() and r1["u"].max() < 1
    assert abs(r1["n"].mean()) < 0.5 and 0.5 < r1["n"].std() < 1.5


# ------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("dims", MESHES, ids=ids(MESHES))
def test_gradients_through_collectives(dims):
    """mtf.gradients through allconcat, allsplit, alltoall, shift and allreduce."""
    layout = [("a", "m0"), ("c2", "m0")] + ([("b", "m1")] if len(dims) > 1 else [])
    rng = np.random.RandomState(3)
    x_np = rng.standard_normal([DIMS[k] for k in "abc"])
    w_np = rng.standard_normal([DIMS[k] for k in "abc"])

    def build(mesh):
        s = shape_of("a", "b", "c")
        x = mtf.get_variable(mesh, "x", s, dtype=tf.float64,
                             initializer=tf.constant_initializer(x_np))
        w = mtf.import_tf_tensor(mesh, tf.constant(w_np), s)
        y = mtf.shift(x * x, 1, s.dims[0], wrap=True)
        y = mtf.reshape(y, shape_of("a", "b", "c", rename={"a": "a_full", "c": "c2"}))
        y = mtf.rename_dimension(y, "c2", "c")               # allconcat of c2 on m0
        y = mtf.reshape(y, s)                                # allsplit of a on m0
        loss = mtf.reduce_sum(y * w) + mtf.reduce_max(x)
        grad = mtf.gradients([loss], [x])[0]
        return {"loss": loss, "grad": grad}

    got, ref = run_both(dims, layout, build)
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-12)
    np.testing.assert_allclose(got["grad"], ref["grad"], rtol=1e-12, atol=1e-12)
    # analytic: d/dx sum(roll(x^2, 1, a) * w) = 2 x roll(w, -1, a); plus one-hot at argmax
    expect = 2 * x_np * np.roll(w_np, -1, 0)
    expect.flat[np.argmax(x_np)] += 1.0
    np.testing.assert_allclose(got["grad"], expect, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dims", MESHES, ids=ids(MESHES))
def test_complex_gradients_flow(dims):
    """Stock Mesh TF drops complex ops from mtf.gradients; with hvd_mesh_impl imported
    the gradient through complex relayouts and shifts is the analytic one."""
    import hvd_mesh_impl  # noqa: F401  (applies the patch)
    from hvd_mesh_impl.mtf_compat import complex_gradients_enabled

    assert complex_gradients_enabled()
    layout = [("a", "m0"), ("c2", "m0")] + ([("b", "m1")] if len(dims) > 1 else [])
    rng = np.random.RandomState(5)
    x_np = rng.standard_normal([DIMS[k] for k in "abc"])
    w_np = rng.standard_normal([DIMS[k] for k in "abc"])

    def build(mesh):
        s = shape_of("a", "b", "c")
        x = mtf.import_tf_tensor(mesh, tf.constant(x_np), s)
        w = mtf.import_tf_tensor(mesh, tf.constant(w_np), s)
        z = mtf.cast(x, tf.complex128) * 3.0
        z = mtf.reshape(z, shape_of("a", "b", "c", rename={"a": "a_full", "c": "c2"}))
        z = mtf.shift(z, -1, z.shape.dims[2], wrap=True)
        z = mtf.reshape(z, s)
        y = mtf.cast(z, tf.float64)
        grad = mtf.gradients([mtf.reduce_sum(y * w)], [x])[0]
        return {"grad": grad}

    got, ref = run_both(dims, layout, build)
    # y = 3 roll(x, -1, c): dL/dx = 3 roll(w, +1, c)
    np.testing.assert_allclose(got["grad"], 3 * np.roll(w_np, 1, 2), rtol=1e-12)
    np.testing.assert_allclose(got["grad"], ref["grad"], rtol=1e-12)


# ------------------------------------------------------------------------- variables
@pytest.mark.parametrize("dims", MESHES, ids=ids(MESHES))
def test_variables_optimizer_steps(dims):
    """Three Adam steps on a distributed variable: the same values as PlacementMeshImpl
    (with hvd_mesh_impl.ordered_update_op); HvdSimdMeshImpl creates no master variable
    and its copy_masters_to_slices / copy_slices_to_masters are no-ops."""
    from hvd_mesh_impl import ordered_update_op

    layout = full_layout(dims)
    rng = np.random.RandomState(11)
    t_np = rng.standard_normal([DIMS[k] for k in "abc"])
    v0_np = rng.standard_normal([DIMS[k] for k in "abc"])
    steps = 3

    def build(mesh):
        s = shape_of("a", "b", "c")
        v = mtf.get_variable(mesh, "v", s, dtype=tf.float64,
                             initializer=tf.constant_initializer(v0_np))
        target = mtf.import_tf_tensor(mesh, tf.constant(t_np), s)
        loss = mtf.reduce_sum(mtf.square(v - target) * mtf.cos(v))
        grads = mtf.gradients([loss], [v])
        opt = mtf.optimize.AdamWeightDecayOptimizer(learning_rate=0.1)
        build.updates = opt.apply_grads(grads, [v.operation])
        return {"v": v}

    def run_ops(lowering, outs):
        step = ordered_update_op(lowering, build.updates)
        return [step] * steps + [lowering.copy_slices_to_masters()]

    def variables(lowering, impl, outs):
        build.names = sorted(v.op.name for v in tf.global_variables())
        return {}

    got = run_graph("hvd", dims, layout, build, run_ops=run_ops, fetch_extra=variables)
    hvd_names = build.names
    ref = run_graph("placement", dims, layout, build, run_ops=run_ops)
    np.testing.assert_allclose(got["v"], ref["v"], rtol=1e-6, atol=1e-9)  # Adam in float32
    assert not np.allclose(got["v"], v0_np)  # the steps did something
    # slices only: v and Adam's two moments (possibly autostacked), no master "v"
    assert all(n.endswith("_slice") for n in hvd_names), hvd_names
    assert "v" not in hvd_names


INITIALIZERS = {
    "zeros": (tf.zeros_initializer(), lambda x: np.all(x == 0)),
    "ones": (tf.ones_initializer(), lambda x: np.all(x == 1)),
    "constant": (tf.constant_initializer(2.5), lambda x: np.all(x == 2.5)),
    "uniform": (tf.random_uniform_initializer(-2.0, 3.0, seed=7),
                lambda x: x.min() >= -2 and x.max() < 3 and abs(x.mean() - 0.5) < 0.3),
    "normal": (tf.random_normal_initializer(1.0, 2.0, seed=7),
               lambda x: abs(x.mean() - 1) < 0.5 and 1.5 < x.std() < 2.5),
    "truncated": (tf.truncated_normal_initializer(0.0, 1.0, seed=7),
                  lambda x: np.abs(x).max() <= 2 and 0.6 < x.std() < 1.0),
    "glorot": (tf.glorot_uniform_initializer(seed=7),
               # TF's fans of [a, b, c]: in = a b, out = a c; limit sqrt(6 / (in + out))
               lambda x: np.abs(x).max() <= np.sqrt(6.0 / (DIMS["a"] * (DIMS["b"] + DIMS["c"])))
               and x.std() > 0.1),
    "default": (None, lambda x: np.abs(x).max() > 0),
}


# The random initializers first: on 2 and 4 ranks each initializer runs once, and every
# mesh gets a random one (initializer k on mesh k mod the number of meshes, as
# dtype_mesh_cases). The initializer decides what a slice's values are made of, the mesh
# (with the layouts below) which part of the tensor a rank holds: the random ones draw
# from the global index of each element (slice_init.global_flat_index), the constant
# fills are a Fill of the slice's shape (test_fill_initializers_stay_slice_local_and_unfolded).
INIT_ORDER = ["default", "glorot", "normal", "truncated", "uniform", "constant", "ones",
              "zeros"]
assert sorted(INIT_ORDER) == sorted(INITIALIZERS)
if SIZE == 1:
    INIT_CASES = [(i, m) for m in MESHES for i in INIT_ORDER]
else:
    INIT_CASES = [(INIT_ORDER[k % len(INIT_ORDER)], MESHES[k % len(MESHES)])
                  for k in range(max(len(INIT_ORDER), len(MESHES)))]


@pytest.mark.parametrize("init, dims", [pytest.param(i, m, id="%s-%s" % (i, mesh_id(m)))
                                        for i, m in INIT_CASES])
def test_slice_initializers_independent_of_layout(dims, init):
    """Each rank initialises its slice alone; the variable is the same for every layout
    (split on a, on b, fully replicated = what one processor computes) and follows
    the initializer's distribution; random ones equal the numpy reference of the
    counter-based generator at the global indices."""
    from hvd_mesh_impl import slice_init

    initializer, check = INITIALIZERS[init]
    s = shape_of("a", "b", "c")

    def build(mesh):
        return {"v": mtf.get_variable(mesh, "w_" + init, s, dtype=tf.float64,
                                      initializer=initializer)}

    # split on a, on b (where b divides over m0), fully replicated
    layouts = [full_layout(dims)] + ([[("b", "m0")]] if DIMS["b"] % dims[0] == 0 else []) + [[]]
    vals = [run_graph("hvd", dims, lay, build)["v"] for lay in layouts]
    for v in vals[1:]:
        np.testing.assert_array_equal(v, vals[0])
    assert check(vals[0]), vals[0]
    if init == "uniform":
        key = slice_init.stable_key("seed", 7)
        u = slice_init.uniform_from_index_np(key, np.arange(s.size)).reshape(s.to_integer_list)
        np.testing.assert_allclose(vals[0], -2.0 + 5.0 * u, rtol=1e-15)


@pytest.mark.parametrize("dims", MESHES, ids=ids(MESHES))
def test_constant_array_initializer_is_sliced(dims):
    """A full-size numpy constant initializer enters each rank's graph as its slice only."""
    x_np = arange("abc", np.float64)

    def build(mesh):
        return {"v": mtf.get_variable(mesh, "v", shape_of("a", "b", "c"), dtype=tf.float64,
                                      initializer=tf.constant_initializer(x_np))}

    def consts(lowering, impl, outs):
        sizes = [op.outputs[0].shape.num_elements() for op in tf.get_default_graph()
                 .get_operations() if op.type == "Const"]
        return {"largest_const": tf.constant(max(sizes))}

    got = run_graph("hvd", dims, full_layout(dims), build, fetch_extra=consts)
    np.testing.assert_array_equal(got["v"], x_np)
    assert got["largest_const"] == x_np.size // int(np.prod(dims))


@pytest.mark.rank_independent
@pytest.mark.parametrize("kind", ["zeros", "ones", "fill_value"])
def test_fill_initializers_stay_slice_local_and_unfolded(kind):
    """zeros/ones and initializers with a ``fill_value`` (flowpm_mtf's unfoldable zeros)
    give the slice from a Fill of a placeholder_with_default: never a full-size
    evaluation (the limit of 1 element would raise) and nothing TF's constant folding
    turns into a slice-size Const; the values equal the fill value."""
    from hvd_mesh_impl import slice_init
    from hvd_mesh_impl.slice_init import unfolded_zeros_initializer

    init, value = {"zeros": (tf.zeros_initializer(), 0.0), "ones": (tf.ones_initializer(), 1.0),
                   "fill_value": (unfolded_zeros_initializer(), 0.0)}[kind]
    with tf.Graph().as_default():
        t = slice_init.initial_slice(init, [4, 6, 4], [2, 0, 0], [2, 6, 4], tf.float64,
                                     "v", max_full_elements=1)
        assert t.op.type == "Fill" and t.shape.as_list() == [2, 6, 4]
        assert t.op.inputs[1].op.type == "PlaceholderWithDefault"
        with tf.Session() as sess:
            np.testing.assert_array_equal(sess.run(t), np.full([2, 6, 4], value))


@pytest.mark.parametrize("dims", [m for m in MESHES if max(m) > 1] or [None])
def test_full_size_limit(dims):
    """export / import of a split tensor above max_full_elements raise FullSizeError at
    graph construction; replicated tensors and tensors at the limit pass."""
    if dims is None:
        pytest.skip("a 1-rank mesh never gathers")
    from hvd_mesh_impl import FullSizeError

    s = shape_of("a", "b", "c")
    for limit, fails in ((s.size - 1, True), (s.size, False)):
        with tf.Graph().as_default():
            graph = mtf.Graph()
            mesh = mtf.Mesh(graph, "mesh")
            x = mtf.import_tf_tensor(mesh, tf.zeros(s.to_integer_list, tf.float64), s)
            impl = hvd_impl(dims, full_layout(dims))
            impl.max_full_elements = limit
            if fails:
                with pytest.raises(FullSizeError, match="%d elements.*limit of %d"
                                   % (s.size, limit)):
                    mtf.Lowering(graph, {mesh: impl})
            else:
                lowering = mtf.Lowering(graph, {mesh: impl})
                lowering.export_to_tf_tensor(x)
            impl.max_full_elements = 1
            replicated = hvd_impl(dims, [])
            replicated.max_full_elements = 1
            with tf.Graph().as_default():
                graph = mtf.Graph()
                mesh = mtf.Mesh(graph, "mesh")
                y = mtf.import_tf_tensor(mesh, tf.zeros(s.to_integer_list, tf.float64), s)
                mtf.Lowering(graph, {mesh: replicated}).export_to_tf_tensor(y)


# ------------------------------------------------------------------------- bad input
def test_rank_count_mismatch_names_both_numbers():
    with tf.Graph().as_default():
        with pytest.raises(ValueError, match=r"%d processors.*%d MPI ranks" % (SIZE + 1, SIZE)):
            hvd_impl((SIZE + 1,), [])


def test_layout_with_unknown_mesh_axis():
    with tf.Graph().as_default():
        with pytest.raises(ValueError, match="'nope'"):
            hvd_impl(MESHES[0], [("a", "nope")])


@pytest.mark.parametrize("dims", [m for m in MESHES if max(m) > 1] or [None])
def test_dimension_not_divisible(dims):
    if dims is None:
        pytest.skip("every dimension divides a 1-rank mesh")
    layout = full_layout(dims)
    axis = int(np.argmax(dims))
    name = "abc"[axis]
    with tf.Graph().as_default():
        graph = mtf.Graph()
        mesh = mtf.Mesh(graph, "mesh")
        bad = mtf.Shape([mtf.Dimension(name, dims[axis] * 2 + 1)])
        mtf.import_tf_tensor(mesh, tf.zeros([dims[axis] * 2 + 1]), bad)
        impl = hvd_impl(dims, layout)
        with pytest.raises(ValueError, match="not divisible"):
            mtf.Lowering(graph, {mesh: impl})
