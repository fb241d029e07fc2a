"""The PM force with its VJP in one readout (``gravity.pm_forces_vjp``: native
``FlowpmCicPaintPair`` and ``FlowpmCicReadoutScaledGrad``, or ``painting.readout_vjp``
and native ``FlowpmCicReadoutVjp``) and the native gradient of
``FlowpmInterleave``: against ``pm_forces`` and its ``mtf.gradients`` (the force bit for
bit, the VJP to rounding) on every grid of the world size, both decompositions, float32
and float64 (float64 only on the placement grid: ``fpm_harness.case_dtypes``); the VJP by
a dot-product test against central differences of the force; the interleave gradient
against numpy and by a dot-product test; the real-space divergence of the density's
cotangent (native ``FlowpmNegDivergence`` and its TensorFlow twin) against numpy; the
force field from the potential in real space (native ``FlowpmGradient``, its TensorFlow
twin and its registered gradient) against numpy, by a dot-product test, and against the
k-space gradient kernel on every grid; and the TensorFlow fold of one block's margins
against the native one."""
import mesh_tensorflow as mtf
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import fpm_harness as H
import nbody_harness as NH
from flowpm_mtf.mesh import domain
from flowpm_mtf.physics import gravity, lpt, painting, painting_vjp
from flowpm_mtf import native
from flowpm_mtf.config import SimConfig

tf.disable_eager_execution()

NC = 16
BOX = 64.0
# The VJP's two position terms (through the readout, through the paint) are summed in
# the other order than mtf.gradients sums them, and the readout's term is one fused
# pass: float64 rounding of sums of O(10) terms of size ~1 (measured <= 1e-15 relative
# to the largest component); float32 the same in its epsilon. A wrong scale or weight
# is O(1), a missing term O(0.1).
VJP_RTOL = {"float64": 1e-12, "float32": 2e-6}
FD_EPS = 1e-6        # [cells]; CIC is piecewise linear: truncation ~0, rounding ~1e-10
FD_RTOL = 1e-7


def conf_for(grid, decomposition, dtype="float64"):
    # 2LPT at a = 0.3: displacements up to ~2 cells; halo 4 covers them (lagrangian)
    return SimConfig(nc=NC, box_size=BOX, grid=grid, halo_size=4, lpt_order=2, a_start=0.3,
                     dtype=dtype, decomposition=decomposition)


@pytest.fixture(scope="module")
def linear():
    return NH.linear_field_numpy(conf_for((1, 1), "eulerian"))


def state(mesh, conf, linear):
    s0 = lpt.lpt_init(NH.import_field(mesh, conf, linear), conf, a=conf.a_start, forces=False)
    return s0, domain.weights(s0.ids, conf)


CASES = H.cases(single=True)


def _vjp_and_reference(kind, conf, linear, fields=False):
    """pm_forces_vjp (f1, v1) and pm_forces with its mtf.gradients (f0, v0) at the 2LPT
    state, for the cotangents id_field(ids, 7); with the ids. ``fields``: in the same
    graph, the force field of the state's density in real space and from the k-space
    gradient kernel ("real", "kspace": test_force_field_real_space_equals_kspace)."""

    def build(mesh):
        s0, w = state(mesh, conf, linear)
        ct = NH.id_field(s0.ids, conf, 7)
        f1, v1 = gravity.pm_forces_vjp(s0.positions, ct, conf, weight=w)
        f0 = gravity.pm_forces(s0.positions, conf, weight=w)
        v0 = mtf.gradients([f0], [s0.positions], grad_ys=[ct])[0]
        out = {"f1": f1, "v1": v1, "f0": f0, "v0": v0, "ids": s0.ids}
        if fields:
            rho = gravity.density(s0.positions, conf, w)
            kern = gravity.make_kernels(conf, mesh)
            real, padded = gravity._field_of_density(rho, conf, kern, stencil=True)
            kspace, kpadded = gravity._field_of_density(rho, conf, kern, stencil=False)
            assert padded
            if not kpadded:
                kspace = gravity.field_to_padded(kspace, conf)
            out.update(real=real, kspace=kspace)
        return out

    return H.run(kind, conf, build)


@pytest.fixture(scope="module")
def eulerian_runs(linear):
    """``get(case, dtype)``: the eulerian :func:`_vjp_and_reference` with the force fields
    of ``case`` and ``dtype``, one graph per case run once for the two tests that read it
    (test_force_vjp_equals_mtf_gradients, test_force_field_real_space_equals_kspace)."""
    cache = {}

    def get(case, dtype):
        key = (case[0], tuple(case[1]), dtype)
        if key not in cache:
            cache[key] = _vjp_and_reference(case[0], conf_for(case[1], "eulerian", dtype),
                                            linear, fields=True)
        return cache[key]

    return get


@pytest.mark.parametrize("case, dtype", H.case_dtypes(CASES))
@pytest.mark.parametrize("decomposition", ["eulerian", "lagrangian"])
def test_force_vjp_equals_mtf_gradients(case, decomposition, dtype, linear, eulerian_runs):
    kind, grid = case
    conf = conf_for(grid, decomposition, dtype)
    out = (eulerian_runs(case, dtype) if decomposition == "eulerian"
           else _vjp_and_reference(kind, conf, linear))
    np.testing.assert_array_equal(out["f1"], out["f0"])
    err = H.rel_err(out["v1"], out["v0"])
    print("force VJP vs mtf.gradients %s %s %s: %.3g" % (H.case_id(case), decomposition,
                                                          dtype, err))
    assert err <= VJP_RTOL[dtype], err
    assert np.max(np.abs(out["v0"])) > 0.1            # the check is not vacuous
    empty = out["ids"] < 0
    assert not np.any(out["v1"][empty]) and not np.any(out["f1"][empty])


@pytest.mark.parametrize("case", [c for c in CASES if c[0] == "hvd"][:1], ids=H.case_id)
@pytest.mark.parametrize("path", ["readout_vjp", "tf_local", "kspace"])
def test_force_vjp_other_paths(case, path, linear, monkeypatch):
    """pm_forces_vjp's other paths against pm_forces and mtf.gradients: without the
    native divergence (readout_vjp and mtf.gradients through the field); with the
    paint pair, the scaled readout gradient and the force field's four-point difference
    as TensorFlow ops in their slices (as on a GPU; the reference then on TensorFlow
    ops too); and with the force field from the k-space gradient kernel (blocks
    narrower than the halo plus two cells)."""
    kind, grid = case
    conf = conf_for(grid, "eulerian")
    if path == "readout_vjp":
        monkeypatch.setattr(gravity, "_native_cotangent", lambda *a: False)
    elif path == "kspace":
        monkeypatch.setattr(gravity, "_native_stencil", lambda *a: False)
    else:
        monkeypatch.setattr(painting, "_native_ops", lambda *t: None)
        monkeypatch.setattr(gravity, "_stencil_ops", lambda t: None)

    out = _vjp_and_reference(kind, conf, linear)
    np.testing.assert_array_equal(out["f1"], out["f0"])
    err = H.rel_err(out["v1"], out["v0"])
    print("force VJP (%s) vs mtf.gradients %s: %.3g" % (path, H.case_id(case), err))
    assert err <= VJP_RTOL["float64"], err
    assert np.max(np.abs(out["v0"])) > 0.1


@pytest.mark.parametrize("case", [c for c in CASES if c[0] == "hvd"], ids=H.case_id)
@pytest.mark.parametrize("decomposition", ["eulerian", "lagrangian"])
def test_force_vjp_dot_product(case, decomposition, linear):
    """<J v, u> by central differences of pm_forces against <v, J^T u> (float64)."""
    kind, grid = case
    conf = conf_for(grid, decomposition)

    def build(mesh):
        s0, w = state(mesh, conf, linear)
        eps_ph = tf.placeholder(tf.float64, [], name="eps")
        eps = mtf.import_tf_tensor(mesh, eps_ph, mtf.Shape([]))
        v = NH.id_field(s0.ids, conf, 3)
        u = NH.id_field(s0.ids, conf, 4)
        moved = gravity.pm_forces(s0.positions + v * eps, conf, weight=w)
        _, vjp = gravity.pm_forces_vjp(s0.positions, u, conf, weight=w)
        return {"phi": mtf.reduce_sum(moved * u), "vjt": mtf.reduce_sum(vjp * v)}, \
            {"eps": eps_ph}

    outs = H.run(kind, conf, build, feeds=[{"eps": FD_EPS}, {"eps": -FD_EPS}])
    jv_u = (outs[0]["phi"] - outs[1]["phi"]) / (2 * FD_EPS)
    v_jtu = outs[0]["vjt"]
    print("force VJP dot product %s %s: <Jv,u> %.15g <v,J^T u> %.15g"
          % (H.case_id(case), decomposition, jv_u, v_jtu))
    assert abs(jv_u - v_jtu) <= FD_RTOL * abs(v_jtu), (jv_u, v_jtu)


def _random_vjp_case(conf, n, seed):
    """Random inputs of the readout VJP ops: a padded 3-component field
    ``[gx, gy, px, py, nz, 3]``, ``n`` positions per block inside the padded blocks along x
    and y (around the block along z), cotangents ``[gx, gy, n, 3]`` and 0/1 slot weights;
    and the generator, for more draws."""
    rng = np.random.RandomState(seed)
    gx, gy = conf.grid
    sx, sy, nz = conf.block_shape
    px, py, _ = conf.padded_block_shape
    field = rng.randn(gx, gy, px, py, nz, 3)
    pos = np.stack([rng.uniform(-1.5, sx + 0.9, (gx, gy, n)), rng.uniform(-1.5, sy + 0.9, (gx, gy, n)),
                    rng.uniform(-2.0, nz + 2.0, (gx, gy, n))], -1)
    ct = rng.randn(gx, gy, n, 3)
    w = (rng.rand(gx, gy, n) > 0.3).astype(np.float64)
    return rng, field, pos, ct, w


@pytest.mark.parametrize("case", [c for c in CASES if c[0] == "hvd"][:1], ids=H.case_id)
def test_readout_vjp_native_equals_mtf(case):
    """painting.readout_vjp with the native op against its Mesh TF path, bit for bit
    (random field, positions inside the padded blocks, empty slots)."""
    kind, grid = case
    conf = SimConfig(nc=8, box_size=8.0, grid=grid, halo_size=2, dtype="float64")
    n = 200
    _, field, pos, ct, w = _random_vjp_case(conf, n, seed=4)

    def build(mesh):
        from flowpm_mtf import layout

        shape = mtf.Shape(layout.padded_shape(conf).dims + [mtf.Dimension(layout.XYZ, 3)])
        bx, by, _ = layout.particle_dims(conf)
        pshape = mtf.Shape([bx, by, mtf.Dimension("npart", n), mtf.Dimension(layout.XYZ, 3)])
        m = mtf.import_tf_tensor(mesh, tf.constant(field), shape)
        x = mtf.import_tf_tensor(mesh, tf.constant(pos), pshape)
        c = mtf.import_tf_tensor(mesh, tf.constant(ct), pshape)
        wt = mtf.import_tf_tensor(mesh, tf.constant(w), mtf.Shape(pshape.dims[:3]))
        a = painting_vjp.readout_vjp(m, x, c, conf, 0.45, wt)
        b = painting_vjp._readout_vjp_mtf(m, x, c, conf, 0.45, wt, "reference")
        return {"%s%d" % (t, i): v for t, o in (("n", a), ("t", b)) for i, v in enumerate(o)}

    out = H.run(kind, conf, build)
    for i in range(3):
        np.testing.assert_array_equal(out["n%d" % i], out["t%d" % i], err_msg=str(i))
    assert np.max(np.abs(out["n2"])) > 0.1


@pytest.mark.parametrize("case", [c for c in CASES if c[0] == "hvd"][:1], ids=H.case_id)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("native_local", [True, False])
def test_paint_pair_scaled_grad_equal_their_ops(case, dtype, native_local, monkeypatch):
    """painting.paint_pair and readout_scaled_grad (native FlowpmCicPaintPair and
    FlowpmCicReadoutScaledGrad) against the ops they replace: cic_paint, readout_vjp and
    the paint's mtf.gradients, bit for bit (random field and cotangents, positions inside
    the padded blocks, empty and non-finite slots); their TensorFlow paths in the slices
    (native_local False, as on a GPU) against the same ops on TensorFlow, to rounding."""
    kind, grid = case
    if not native_local:
        monkeypatch.setattr(painting, "_native_ops", lambda *t: None)
    conf = SimConfig(nc=8, box_size=8.0, grid=grid, halo_size=2, dtype=dtype)
    n = 300
    rng, field, pos, ct, w = _random_vjp_case(conf, n, seed=5)
    rbar = rng.randn(*field.shape[:-1])
    if native_local:  # masked slots may hold anything: the native ops skip them
        pos[..., :5, 1] = np.nan
        w[..., :5] = 0.0
    tdt = conf.tf_dtype

    def build(mesh):
        from flowpm_mtf import layout

        shape = layout.padded_shape(conf)
        fshape = mtf.Shape(shape.dims + [mtf.Dimension(layout.XYZ, 3)])
        bx, by, _ = layout.particle_dims(conf)
        pshape = mtf.Shape([bx, by, mtf.Dimension("npart", n), mtf.Dimension(layout.XYZ, 3)])

        def imp(a, s):
            return mtf.import_tf_tensor(mesh, tf.constant(a, tdt), s)

        m, rb = imp(field, fshape), imp(rbar, shape)
        x, c, wt = imp(pos, pshape), imp(ct, pshape), imp(w, mtf.Shape(pshape.dims[:3]))
        painted, dmesh = painting_vjp.paint_pair(x, c, conf, 0.45, wt, escape_checked=True)
        vals, dpos = painting_vjp.readout_scaled_grad(m, x, c, conf, 0.45, wt, density_bar=rb)
        ref_painted = painting.cic_paint(None, x, conf, wt, _unreduced=True, escape_checked=True)
        ref_vals, ref_dmesh, ref_dpos = painting_vjp.readout_vjp(m, x, c, conf, 0.45, wt)
        ref_dpaint = mtf.gradients([ref_painted], [x], grad_ys=[rb])[0]
        return {"painted": painted, "dmesh": dmesh, "vals": vals, "dpos": dpos,
                "ref_painted": ref_painted, "ref_dmesh": ref_dmesh, "ref_vals": ref_vals,
                "ref_dpos": ref_dpos + ref_dpaint}

    out = H.run(kind, conf, build)
    for k in ("painted", "dmesh", "vals", "dpos"):
        if native_local:
            np.testing.assert_array_equal(out[k], out["ref_" + k], err_msg=k)
        else:
            rtol = 1e-12 if dtype == "float64" else 2e-6
            assert H.rel_err(out[k], out["ref_" + k]) <= rtol, k
        assert np.max(np.abs(out[k])) > 0.1, k


def _interleave_numpy(inputs, picks, wrap):
    a, b = inputs[0].shape[:2]
    cols = [inputs[i][..., c] for i, c in picks]
    out = np.stack(cols, -1)
    if wrap:
        out = out[np.arange(-wrap, a + wrap) % a][:, np.arange(-wrap, b + wrap) % b]
    return out


def _interleave_grad_numpy(dy, shapes, picks, wrap):
    grads = [np.zeros(s) for s in shapes]
    a, b = shapes[0][:2]
    ia = np.arange(-wrap, a + wrap) % a if wrap else np.arange(a)
    ib = np.arange(-wrap, b + wrap) % b if wrap else np.arange(b)
    for k, (i, c) in enumerate(picks):
        for p, s in enumerate(ia):
            for q, t in enumerate(ib):
                grads[i][s, t, ..., c] += dy[p, q, ..., k]
    return grads


@pytest.mark.skipif(H.SIZE != 1, reason="a single-process TensorFlow test")
@pytest.mark.parametrize("wrap,shape", [(0, (4, 5, 3)), (2, (6, 5, 3)), (4, (3, 2, 2))])
def test_interleave_gradient(wrap, shape):
    """FlowpmInterleaveGrad against numpy (margins wider than the axis included) and by
    <interleave(x), dy> == sum_i <x_i, grad_i(dy)>, float64."""
    lib = native.load("cic_ops")
    rng = np.random.RandomState(wrap)
    shapes = [shape + (2,), shape + (1,)]
    picks = [(0, 0), (1, 0), (0, 1), (1, 0)]       # input 1's column picked twice
    xs = [rng.randn(*s) for s in shapes]
    flat = [v for p in picks for v in p]
    fwd = _interleave_numpy(xs, picks, wrap)
    dy = rng.randn(*fwd.shape)
    with tf.Graph().as_default():
        ins = [tf.constant(v) for v in xs]
        y = lib.flowpm_interleave(ins, picks=flat, wrap=wrap)
        g = tf.gradients(y, ins, grad_ys=tf.constant(dy))
        with tf.Session() as sess:
            y_v, g_v = sess.run([y, g])
    np.testing.assert_array_equal(y_v, fwd)
    ref = _interleave_grad_numpy(dy, shapes, picks, wrap)
    for a, b in zip(g_v, ref):
        np.testing.assert_allclose(a, b, rtol=1e-14, atol=1e-14)
    lhs = np.sum(fwd * dy)
    rhs = sum(np.sum(x * gi) for x, gi in zip(xs, g_v))
    assert abs(lhs - rhs) <= 1e-12 * abs(lhs)


def _neg_divergence_numpy(g, coeffs, m):
    """Sum over d of coeffs[d] (8 (g(+1) - g(-1)) - (g(+2) - g(-2))) along axis d of g_d."""
    _, ax, ay, nz, _ = g.shape
    sx, sy = ax - 2 * m, ay - 2 * m
    out = np.zeros(g.shape[:1] + (sx, sy, nz))
    for i in range(sx):
        for j in range(sy):
            for k in range(nz):
                def v(d, o):
                    x, y, z = i, j, (k + (o if d == 2 else 0)) % nz
                    if d == 0:
                        x = (i + o) % sx if m == 0 else i + o
                    if d == 1:
                        y = (j + o) % sy if m == 0 else j + o
                    if m < 0 and not (0 <= x + m < ax and 0 <= y + m < ay):
                        return np.zeros(g.shape[:1])   # extended by zeros
                    return g[:, x + m, y + m, z, d]
                terms = [8 * (v(d, 1) - v(d, -1)) - (v(d, 2) - v(d, -2)) for d in range(3)]
                out[:, i, j, k] = (coeffs[0] * terms[0] + coeffs[1] * terms[1]) + coeffs[2] * terms[2]
    return out


@pytest.mark.skipif(H.SIZE != 1, reason="a single-process TensorFlow test")
@pytest.mark.parametrize("margin,shape", [(0, (2, 5, 4, 6)), (0, (1, 3, 2, 5)), (2, (2, 8, 9, 5)),
                                          (3, (1, 10, 9, 4)), (-2, (2, 6, 5, 4)),
                                          (-2, (1, 1, 3, 5))])
def test_neg_divergence_native_tf_numpy(margin, shape):
    """FlowpmNegDivergence and its TensorFlow twin (gravity.neg_divergence_tf) against numpy:
    periodic (margin 0, axes shorter than the stencil included), inside margins, and
    extended by zeros (margin -2, axes shorter than the stencil included)."""
    from flowpm_mtf import native

    lib = native.load("cic_ops")
    rng = np.random.RandomState(margin + 2 + shape[1])
    g = rng.randn(*(shape + (3,)))
    coeffs = np.array([-0.3, 1.7, 0.05])
    want = _neg_divergence_numpy(g, coeffs, margin)
    with tf.Graph().as_default(), tf.Session() as sess:
        got_native, got_tf = sess.run([
            lib.flowpm_neg_divergence(tf.constant(g), tf.constant(coeffs), margin=margin),
            gravity.neg_divergence_tf(tf.constant(g), tf.constant(coeffs), margin)])
    np.testing.assert_allclose(got_native, want, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(got_tf, want, rtol=1e-13, atol=1e-13)
    assert np.max(np.abs(want)) > 1.0


def _gradient_numpy(phi, coeffs, m):
    """coeffs[d] (8 (phi(+1) - phi(-1)) - (phi(+2) - phi(-2))) along axis d, z periodic;
    x and y inside the margins (m >= 2) or periodic with output margins -m (m <= 0)."""
    if m <= 0:
        w = 2 - m
        phi = np.take(np.take(phi, np.arange(-w, phi.shape[1] + w), axis=1, mode="wrap"),
                      np.arange(-w, phi.shape[2] + w), axis=2, mode="wrap")
        m = 2
    _, ax, ay, nz = phi.shape
    sx, sy = ax - 2 * m, ay - 2 * m
    inner = phi[:, m:m + sx, m:m + sy]
    out = np.zeros(phi.shape[:1] + (sx, sy, nz, 3))
    for d in range(3):
        def at(o):
            if d == 0:
                return phi[:, m + o:m + o + sx, m:m + sy]
            if d == 1:
                return phi[:, m:m + sx, m + o:m + o + sy]
            return np.roll(inner, -o, axis=3)
        out[..., d] = coeffs[d] * (8 * (at(1) - at(-1)) - (at(2) - at(-2)))
    return out


@pytest.mark.skipif(H.SIZE != 1, reason="a single-process TensorFlow test")
@pytest.mark.parametrize("margin,shape", [(2, (2, 8, 9, 6)), (3, (1, 10, 9, 4)),
                                          (2, (1, 5, 6, 1)), (4, (2, 9, 12, 7)),
                                          (0, (1, 6, 5, 7)), (-3, (1, 8, 7, 5)),
                                          (-4, (2, 3, 2, 6))])
def test_gradient_native_tf_numpy(margin, shape):
    """FlowpmGradient (the force field from the potential) and its TensorFlow twin
    (gravity.gradient_tf) against numpy: inside the margins, and periodic with output
    margins (one block; axes shorter than the stencil and the margins included), z
    shorter than the stencil included; its
    registered gradient (FlowpmNegDivergence, margins padded back) against the twin's
    TensorFlow gradient, and by a dot-product test <G phi, y> = <phi, G^T y>."""
    lib = native.load("cic_ops")
    rng = np.random.RandomState(margin + shape[1] + shape[3])
    phi = rng.randn(*shape)
    coeffs = np.array([-0.3, 1.7, 0.05])
    want = _gradient_numpy(phi, coeffs, margin)
    dy = rng.randn(*want.shape)
    with tf.Graph().as_default(), tf.Session() as sess:
        p, c, y = tf.constant(phi), tf.constant(coeffs), tf.constant(dy)
        g_native = lib.flowpm_gradient(p, c, margin=margin)
        g_tf = gravity.gradient_tf(p, c, margin)
        t_native, = tf.gradients(g_native, [p], grad_ys=[y])
        t_tf, = tf.gradients(g_tf, [p], grad_ys=[y])
        got_native, got_tf, tn, tt = sess.run([g_native, g_tf, t_native, t_tf])
    np.testing.assert_allclose(got_native, want, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(got_tf, want, rtol=1e-13, atol=1e-13)
    assert np.max(np.abs(want)) > 1.0
    assert tn.shape == phi.shape
    np.testing.assert_allclose(tn, tt, rtol=1e-13, atol=1e-13)
    lhs, rhs = np.sum(want * dy), np.sum(phi * tn)
    assert abs(lhs - rhs) <= 1e-12 * np.sum(np.abs(want * dy)), (lhs, rhs)


# The force field from the potential in real space against the k-space products: the
# same linear map, rounded differently (measured at 16^3 in 64 Mpc/h: float64 <= 8.7e-16,
# float32 <= 3.9e-7 relative to the largest component; the difference of the potential
# grows with its range over the force's, i.e. with the box in cells). A wrong coefficient
# or axis is O(1).
FIELD_RTOL = {"float64": 1e-12, "float32": 4e-6}


@pytest.mark.parametrize("case, dtype", H.case_dtypes(CASES))
def test_force_field_real_space_equals_kspace(case, dtype, eulerian_runs):
    """The force field of the 2LPT state's density through the potential and the native
    four-point difference (gravity.force_field_of_potential) against the k-space gradient
    kernel's packed inverse FFTs, on the padded blocks with their margins, every grid."""
    out = eulerian_runs(case, dtype)
    err = H.rel_err(out["real"], out["kspace"])
    print("force field real space vs k-space %s %s: %.3g" % (H.case_id(case), dtype, err))
    assert err <= FIELD_RTOL[dtype], err
    assert np.max(np.abs(out["kspace"])) > 0.1


@pytest.mark.skipif(H.SIZE != 1, reason="a single-process TensorFlow test")
def test_fold_tf_equals_native():
    """The TensorFlow fold of one padded block's periodic margins (the GPU path of
    gravity.density_cotangent) equals FlowpmInterleaveGrad's, margins wider than the block
    included."""
    from flowpm_mtf import native

    lib = native.load("cic_ops")
    for h, sx, sy, nc in [(2, 6, 5, 3), (3, 2, 4, 3), (4, 6, 5, 1), (6, 3, 4, 1)]:
        t = np.random.RandomState(h).randn(sx + 2 * h, sy + 2 * h, 4, nc)
        picks = [v for c in range(nc) for v in (0, c)]
        with tf.Graph().as_default(), tf.Session() as sess:
            a = sess.run(gravity._fold_tf(tf.constant(t), h, sx, sy))
            b, = sess.run(lib.flowpm_interleave_grad(tf.constant(t), picks=picks,
                                                     wrap=h, widths=[nc], N=1))
        np.testing.assert_allclose(a, b, rtol=1e-14, atol=1e-14)
