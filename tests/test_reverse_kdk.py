"""The fused particle arithmetic of the adjoint's reverse step (flowpm_mtf.gradients.reverse_kdk,
native/adjoint_ops.cc): the native ops against the Mesh TF expressions they replace (bit
for bit for the elementwise outputs, to rounding for the block sums) and against numpy, on
every grid of the world size, float32 and float64, with and without empty slots; the
result independent of the thread count; the gradient by central differences."""
import mesh_tensorflow as mtf
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import fpm_harness as H
from flowpm_mtf import layout, native
from flowpm_mtf.gradients import reverse_kdk
from flowpm_mtf.config import SimConfig

tf.disable_eager_execution()

NPART = 300          # slots per block (not a multiple of the ops' chunk of 4096: one chunk)
# block sums: the native op sums in double, Mesh TF in the dtype: relative to the sum of
# the absolute terms, float32 ~ n eps, float64 ~ n eps (n = 300 per block)
DOT_RTOL = {"float32": 1e-5, "float64": 1e-13}
FD_EPS = 1e-6
FD_RTOL = 1e-8       # the maps are polynomial (degree 2): central differences are exact
                     # up to rounding, ~1e-10 relative in float64


def conf_for(grid, dtype):
    return SimConfig(nc=8, box_size=8.0, grid=grid, halo_size=1, dtype=dtype,
                     decomposition="eulerian")


def particle_shape(conf):
    bx, by, _ = layout.particle_dims(conf)
    return mtf.Shape([bx, by, mtf.Dimension("npart", NPART), mtf.Dimension(layout.XYZ, 3)])


def inputs(conf, seed=0, empty=True):
    """Random fields ``[gx, gy, NPART, 3]`` (5 of them), ids with ~1/4 empty slots and the
    four factors."""
    rng = np.random.RandomState(seed)
    gx, gy = conf.grid
    fields = [rng.randn(gx, gy, NPART, 3).astype(conf.np_dtype) for _ in range(5)]
    ids = np.arange(gx * gy * NPART, dtype=np.int32).reshape(gx, gy, NPART)
    if empty:
        ids[rng.rand(*ids.shape) < 0.25] = -1
    factors = rng.uniform(0.2, 1.5, 4).astype(conf.np_dtype)
    return fields, ids, factors


def build_both(conf, fields, ids, factors, use_ids):
    """(native outputs, Mesh TF outputs) of both ops, as export dicts."""

    def build(mesh):
        shape = particle_shape(conf)
        ts = [mtf.import_tf_tensor(mesh, tf.constant(f), shape) for f in fields]
        ti = (mtf.import_tf_tensor(mesh, tf.constant(ids), mtf.Shape(shape.dims[:3]))
              if use_ids else None)
        k0, drift, k1, c = (mtf.import_tf_tensor(mesh, tf.constant(v), mtf.Shape([]))
                            for v in factors)
        out = {}
        for tag, nat in (("n", True), ("t", False)):
            x, p, f, xb, pb = ts
            d = reverse_kdk.reverse_drift(x, p, f, xb, pb, ti, k1, drift, native_op=nat)
            # the kick on the drift's outputs (p_h, pb_h) and two of the fields
            k = reverse_kdk.reverse_kick(d[2], f, d[3], xb, pb, ti, k0, c, native_op=nat)
            for name, t in zip(("x", "dx", "ph", "pbh", "dd", "p", "xbn", "dk"), d + k):
                out[tag + name] = t
        return out

    return build


def numpy_reference(fields, ids, factors, use_ids):
    x, p, f, xb, pb = (a.astype(np.float64) for a in fields)
    k0, drift, k1, c = factors.astype(np.float64)
    w = (ids >= 0).astype(np.float64) if use_ids else np.ones(ids.shape)
    ph = p - k1 * f
    pbh = pb + drift * xb
    dot = lambda u, v: np.sum(w * np.sum(u * v, -1), -1)   # noqa: E731
    return {"x": x - drift * ph, "ph": ph, "pbh": pbh, "p": ph - k0 * f, "xbn": pb + c * xb,
            "dd": np.stack([dot(pb, f), dot(xb, ph)], -1),
            "dk": np.stack([dot(pbh, f), c * dot(pbh, f)], -1)}


CASES = H.cases(single=True)


@pytest.mark.parametrize("case", CASES, ids=H.case_id)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("use_ids", [True, False])
def test_native_equals_mtf_expressions(case, dtype, use_ids):
    kind, grid = case
    conf = conf_for(grid, dtype)
    fields, ids, factors = inputs(conf, seed=1)
    out = H.run(kind, conf, build_both(conf, fields, ids, factors, use_ids))
    for name in ("x", "dx", "ph", "pbh", "p", "xbn"):
        np.testing.assert_array_equal(out["n" + name], out["t" + name], err_msg=name)
    ref = numpy_reference(fields, ids, factors, use_ids)
    eps = np.finfo(conf.np_dtype).eps
    for name in ("x", "ph", "pbh", "p", "xbn"):
        assert H.rel_err(out["n" + name], ref[name]) <= 8 * eps, name
    for name in ("dd", "dk"):
        scale = np.max(np.abs(ref[name])) + 1.0
        for tag in "nt":
            err = np.max(np.abs(out[tag + name] - ref[name])) / scale
            assert err <= DOT_RTOL[dtype], (name, tag, err)
    if use_ids:   # the empty slots are left out of the sums
        full = numpy_reference(fields, ids, factors, False)
        assert np.max(np.abs(full["dd"] - ref["dd"])) > 1.0


@pytest.mark.skipif(H.SIZE != 1, reason="a single-process TensorFlow test")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_thread_count_does_not_change_the_result(dtype):
    """Several chunks of particles over 1 and 2 threads: the same bits."""
    lib = native.load("adjoint_ops")
    rng = np.random.RandomState(3)
    n = 3 * 4096 + 17
    fields = [rng.randn(2, n, 3).astype(dtype) for _ in range(5)]
    ids = np.where(rng.rand(2, n) < 0.2, -1, 1).astype(np.int64)
    sc = [dtype(0.7), dtype(1.3)]
    results = []
    for threads in (1, 2):
        with tf.Graph().as_default():
            d = lib.flowpm_adjoint_drift(*fields, ids, *sc)
            k = lib.flowpm_adjoint_kick(*fields, ids, *sc)
            cfg = tf.ConfigProto(intra_op_parallelism_threads=threads,
                                 inter_op_parallelism_threads=1)
            with tf.Session(config=cfg) as sess:
                results.append(sess.run(list(d) + list(k)))
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)
    w = (ids >= 0)
    ref = np.sum(w * np.sum(fields[4].astype(np.float64) * fields[2], -1), -1)
    np.testing.assert_allclose(results[0][4][:, 0], ref, rtol=1e-5 if dtype == np.float32
                               else 1e-13)


@pytest.mark.parametrize("case", [c for c in CASES if c[0] == "hvd"], ids=H.case_id)
def test_gradient_central_differences(case):
    """d/deps of a random linear functional of every output along a random direction of
    every input (fields and factors), against <gradient, direction>, float64."""
    kind, grid = case
    conf = conf_for(grid, "float64")
    fields, ids, factors = inputs(conf, seed=2)
    rng = np.random.RandomState(5)
    dirs = [rng.randn(*f.shape) for f in fields]
    dfac = rng.randn(4)

    def build(mesh):
        shape = particle_shape(conf)
        eps_ph = tf.placeholder(tf.float64, [], name="eps")
        eps = mtf.import_tf_tensor(mesh, eps_ph, mtf.Shape([]))
        ts = [mtf.import_tf_tensor(mesh, tf.constant(f), shape) for f in fields]
        vs = [mtf.import_tf_tensor(mesh, tf.constant(v), shape) for v in dirs]
        moved = [t + v * eps for t, v in zip(ts, vs)]
        fac = [mtf.import_tf_tensor(mesh, tf.constant(v), mtf.Shape([])) for v in factors]
        mfac = [a + eps * float(b) for a, b in zip(fac, dfac)]
        ti = mtf.import_tf_tensor(mesh, tf.constant(ids), mtf.Shape(shape.dims[:3]))

        def functional(fl, fa):
            x, p, f, xb, pb = fl
            k0, drift, k1, c = fa
            d = reverse_kdk.reverse_drift(x, p, f, xb, pb, ti, k1, drift)
            k = reverse_kdk.reverse_kick(d[2], f, d[3], xb, pb, ti, k0, c)
            total = 0
            for j, t in enumerate(d + k):
                r = np.random.RandomState(10 + j).randn(*[dd.size for dd in t.shape.dims])
                total += mtf.reduce_sum(t * mtf.import_tf_tensor(mesh, tf.constant(r), t.shape))
            return total

        phi = functional(moved, mfac)
        phi0 = functional(ts, fac)
        grads = mtf.gradients([phi0], ts + fac)
        jv = 0
        for g, v in zip(grads[:5], vs):
            jv += mtf.reduce_sum(g * v)
        for g, b in zip(grads[5:], dfac):
            jv += g * float(b)
        return {"phi": phi, "jv": jv}, {"eps": eps_ph}

    outs = H.run(kind, conf, build, feeds=[{"eps": FD_EPS}, {"eps": -FD_EPS}])
    fd = (outs[0]["phi"] - outs[1]["phi"]) / (2 * FD_EPS)
    jv = outs[0]["jv"]
    print("reverse_kdk gradient %s: fd %.15g <g, v> %.15g" % (H.case_id(case), fd, jv))
    assert abs(fd - jv) <= FD_RTOL * abs(jv)
