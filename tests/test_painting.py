"""CIC paint/readout on padded blocks: against single-device FlowPM
(``flowpm.utils.cic_paint`` / ``cic_readout``, used by ``flowpm.tfpm``), adjoint
and finite-difference gradient tests, lattice identities, escape detection.
"""
import numpy as np
import pytest
import mesh_tensorflow as mtf
import tensorflow.compat.v1 as tf

import fpm_harness as H
from flowpm_mtf import config as cfg
from flowpm_mtf.mesh import complex_ops, fft
from flowpm_mtf.physics import painting
from flowpm_mtf.config import SimConfig

# FlowPM's reference runs in float32 only; both sides sum <= 8 * (particles per
# cell) float32 terms of size <= 1 in different orders: ~1e-6 relative, so
# 1e-5 relative to the largest value is a tight yet safe bound.
FLOWPM_RTOL = 1e-5
# <paint w, m> vs <w, readout m> in float64: sums of ~10^3 products, ~1e-13.
ADJOINT_RTOL = 1e-12
# Central differences, float64, step 1e-6: the CIC loss is polynomial (degree
# <= 2 in each coordinate) inside a cell, so only rounding (~1e-10) remains.
FD_EPS = 1e-6
FD_RTOL = 1e-6

NC = (8, 12, 4)
HALO = 2
NPB = 24  # particles per block
CASES = H.cases(single=True, placement=False)


def conf_for(case, dtype="float64", **kw):
    return SimConfig(nc=NC, grid=case[1], halo_size=HALO, dtype=dtype, **kw)


def random_positions(conf, seed, frac=None):
    """Block-local positions, within the allowed range [-h, s+h-1) along x and y.

    ``frac``: keep fractional parts in [frac, 1 - frac] (away from cell faces).
    """
    rng = np.random.RandomState(seed)
    (P, Q), (sx, sy, nz) = conf.grid, conf.block_shape
    h = conf.halo_size
    lo = np.array([-h, -h, -3])
    hi = np.array([sx + h - 1, sy + h - 1, nz + 3])
    if frac is None:
        pos = lo + (hi - lo) * rng.rand(P, Q, NPB, 3)
    else:
        cells = rng.randint(lo, hi - 1, size=(P, Q, NPB, 3))
        pos = cells + frac + (1 - 2 * frac) * rng.rand(P, Q, NPB, 3)
    return pos.astype(conf.np_dtype)


def particle_shape(conf, n=NPB):
    return mtf.Shape([mtf.Dimension(cfg.BX, conf.grid[0]), mtf.Dimension(cfg.BY, conf.grid[1]),
                      mtf.Dimension(cfg.NPART, n), mtf.Dimension(cfg.XYZ, 3)])


def global_positions(pos, conf):
    sx, sy, _ = conf.block_shape
    g = pos.copy()
    g[..., 0] += (np.arange(conf.grid[0]) * sx)[:, None, None]
    g[..., 1] += (np.arange(conf.grid[1]) * sy)[None, :, None]
    return g


def flowpm_reference(field, gpos, weight=None):
    """Single-device FlowPM paint (of ``weight``) and readout (of ``field``), float32."""
    from flowpm.utils import cic_paint, cic_readout
    with tf.Graph().as_default():
        part = tf.constant(gpos.reshape(1, -1, 3).astype(np.float32))
        w = None if weight is None else tf.constant(weight.reshape(1, -1).astype(np.float32))
        painted = cic_paint(tf.zeros((1,) + field.shape, tf.float32), part, w)
        read = cic_readout(tf.constant(field[None].astype(np.float32)), part)
        with tf.Session() as sess:
            p, r = sess.run([painted, read])
    return p[0], r[0]


@pytest.mark.parametrize("case", CASES, ids=H.case_id)
def test_matches_flowpm(case):
    conf = conf_for(case, dtype="float32")
    pos = random_positions(conf, 10)
    rng = np.random.RandomState(11)
    field = rng.randn(*NC).astype(np.float32)
    weight = rng.rand(*pos.shape[:-1]).astype(np.float32)

    def build(mesh):
        p = mtf.import_tf_tensor(mesh, tf.constant(pos), particle_shape(conf))
        w = mtf.import_tf_tensor(mesh, tf.constant(weight), particle_shape(conf).dims[:-1])
        f = mtf.import_tf_tensor(mesh, tf.constant(field), fft.real_shape(conf))
        return {"paint": painting.paint_field(p, conf, weight=w),
                "paint1": painting.paint_field(p, conf),
                "read": painting.readout_field(f, p, conf),
                "global": painting.to_global(p, conf)}

    out = H.run(case[0], conf, build)
    gpos = global_positions(pos, conf)
    np.testing.assert_allclose(out["global"], gpos, rtol=1e-6)
    ref_paint, ref_read = flowpm_reference(field, gpos, weight)
    ref_paint1, _ = flowpm_reference(field, gpos)
    assert H.rel_err(out["paint"], ref_paint) < FLOWPM_RTOL
    assert H.rel_err(out["paint1"], ref_paint1) < FLOWPM_RTOL
    assert H.rel_err(out["read"].ravel(), ref_read) < FLOWPM_RTOL
    # mass conservation
    np.testing.assert_allclose(out["paint1"].sum(), pos[..., 0].size, rtol=1e-6)


@pytest.mark.parametrize("case", CASES, ids=H.case_id)
def test_vector_readout_equals_components(case):
    """A mesh with a trailing component dimension (the PM force's xyz) is read out in
    one pass: equal to reading each component, against FlowPM, values and gradients."""
    conf = conf_for(case)
    pos = random_positions(conf, 12)
    rng = np.random.RandomState(13)
    field = rng.randn(*NC, 3)
    cot = rng.randn(*pos.shape)  # cotangent of the [bx, by, npart, xyz] output

    def build(mesh):
        p = mtf.import_tf_tensor(mesh, tf.constant(pos), particle_shape(conf))
        comp = mtf.Dimension("comp", 3)
        f = mtf.import_tf_tensor(mesh, tf.constant(field),
                                 mtf.Shape(fft.real_shape(conf).dims + [comp]))
        w = mtf.import_tf_tensor(mesh, tf.constant(cot),
                                 mtf.Shape(particle_shape(conf).dims[:-1] + [comp]))
        vec = painting.readout_field(f, p, conf)
        parts = mtf.stack([painting.readout_field(c, p, conf) for c in mtf.unstack(f, comp)],
                          "comp", axis=3)
        loss_v, loss_p = mtf.reduce_sum(vec * w), mtf.reduce_sum(parts * w)
        gv = mtf.gradients([loss_v], [p, f])
        gp = mtf.gradients([loss_p], [p, f])
        return {"vec": vec, "parts": parts, "gv_pos": gv[0], "gp_pos": gp[0],
                "gv_field": gv[1], "gp_field": gp[1]}

    out = H.run(case[0], conf, build)
    assert out["vec"].shape == pos.shape
    # same stencil, same products, same order of the 8-term sums: equal to round-off
    for a, b in (("vec", "parts"), ("gv_pos", "gp_pos"), ("gv_field", "gp_field")):
        assert H.rel_err(out[a], out[b]) < ADJOINT_RTOL, a
    gpos = global_positions(pos, conf)
    for d in range(3):
        _, ref = flowpm_reference(field[..., d], gpos)
        assert H.rel_err(out["vec"][..., d].ravel(), ref) < FLOWPM_RTOL


@pytest.mark.parametrize("case", CASES, ids=H.case_id)
def test_paint_readout_adjoint(case):
    """<paint(w), m> = <w, readout(m)>; grad_w of the left side is readout(m),
    grad_m of the right side is paint(w) (mtf.gradients through halo exchange)."""
    conf = conf_for(case)
    pos = random_positions(conf, 12)
    rng = np.random.RandomState(13)
    m0 = rng.randn(*NC)
    w0 = rng.randn(*pos.shape[:-1])

    def build(mesh):
        p = mtf.import_tf_tensor(mesh, tf.constant(pos), particle_shape(conf))
        w = mtf.import_tf_tensor(mesh, tf.constant(w0), particle_shape(conf).dims[:-1])
        m = mtf.import_tf_tensor(mesh, tf.constant(m0), fft.real_shape(conf))
        painted = painting.paint_field(p, conf, weight=w)
        read = painting.readout_field(m, p, conf)
        l_paint = complex_ops.real_vdot(m, painted)
        l_read = complex_ops.real_vdot(w, read)
        g_w, = mtf.gradients([l_paint], [w])
        g_m, = mtf.gradients([l_read], [m])
        return {"l_paint": l_paint, "l_read": l_read, "painted": painted, "read": read,
                "g_w": g_w, "g_m": g_m}

    out = H.run(case[0], conf, build)
    np.testing.assert_allclose(out["l_paint"], out["l_read"], rtol=ADJOINT_RTOL)
    assert H.rel_err(out["g_w"], out["read"]) < ADJOINT_RTOL
    assert H.rel_err(out["g_m"], out["painted"]) < ADJOINT_RTOL


@pytest.mark.parametrize("case", CASES, ids=H.case_id)
def test_position_gradients_finite_difference(case):
    """L(pos) = <m, paint(pos)> + sum c * readout(m2, pos)^2, float64."""
    conf = conf_for(case)
    pos0 = random_positions(conf, 14, frac=0.1).astype(np.float64)
    rng = np.random.RandomState(15)
    m0, m2 = rng.randn(*NC), rng.randn(*NC)
    c0 = rng.rand(*pos0.shape[:-1])

    def build(mesh):
        phs = {}
        p = H.placeholder_input(mesh, phs, "pos", pos0, particle_shape(conf))
        m = mtf.import_tf_tensor(mesh, tf.constant(m0), fft.real_shape(conf))
        mm = mtf.import_tf_tensor(mesh, tf.constant(m2), fft.real_shape(conf))
        c = mtf.import_tf_tensor(mesh, tf.constant(c0), particle_shape(conf).dims[:-1])
        loss = (complex_ops.real_vdot(m, painting.paint_field(p, conf))
                + mtf.reduce_sum(c * mtf.square(painting.readout_field(mm, p, conf))))
        g, = mtf.gradients([loss], [p])
        return {"loss": loss, "g": g}, phs

    P, Q = conf.grid
    pts = [(0, 0, 0, 0), (P - 1, Q - 1, 5, 1), (0, Q - 1, 7, 2), (P - 1, 0, NPB - 1, 0)]
    feeds = [{"pos": pos0}]
    for idx in pts:
        for sign in (1, -1):
            p = pos0.copy()
            p[idx] += sign * FD_EPS
            feeds.append({"pos": p})
    res = H.run(case[0], conf, build, feeds=feeds)
    g = res[0]["g"]
    scale = max(1.0, np.max(np.abs(g)))
    for idx, plus, minus in zip(pts, res[1::2], res[2::2]):
        fd = (plus["loss"] - minus["loss"]) / (2 * FD_EPS)
        assert abs(fd - g[idx]) <= FD_RTOL * scale, (idx, fd, g[idx])


@pytest.mark.parametrize("case", CASES, ids=H.case_id)
def test_lattice_identities(case):
    """One particle per cell at the lattice: paint gives exactly 1 everywhere,
    readout returns the field values exactly, to_global gives the cell indices."""
    conf = conf_for(case)
    field = np.arange(np.prod(NC), dtype=np.float64).reshape(NC)

    def build(mesh):
        lat = painting.lattice(conf, mesh)
        f = mtf.import_tf_tensor(mesh, tf.constant(field), fft.real_shape(conf))
        return {"paint": painting.paint_field(lat, conf),
                "read": painting.readout_field(f, lat, conf),
                "global": painting.to_global(lat, conf),
                "count": painting.escaped_count(lat, conf)}

    out = H.run(case[0], conf, build)
    np.testing.assert_array_equal(out["paint"], np.ones(NC))
    g = out["global"].astype(int)
    np.testing.assert_array_equal(out["read"], field[g[..., 0], g[..., 1], g[..., 2]])
    assert out["count"] == 0
    nz = NC[2]
    np.testing.assert_array_equal(g[0, 0, :nz + 1], [[0, 0, k] for k in range(nz)] + [[0, 1, 0]])
    cells = np.sort(g.reshape(-1, 3) @ np.array([NC[1] * NC[2], NC[2], 1]))
    np.testing.assert_array_equal(cells, np.arange(np.prod(NC)))


@pytest.mark.parametrize("case", H.cases(placement=False), ids=H.case_id)
def test_escaped_particles_raise(case):
    """Particles beyond the halo (or NaN) are counted and make paint and readout
    fail on every rank with a clear message; the edges of the allowed range pass."""
    conf = conf_for(case)
    (P, Q), (sx, sy, _) = conf.grid, conf.block_shape
    h = conf.halo_size
    ok = random_positions(conf, 16)
    ok[0, 0, 0] = [-h, -h, 0.5]                                # lowest allowed
    ok[P - 1, Q - 1, 1] = [sx + h - 1.001, sy + h - 1.001, 0]  # highest allowed
    bad = ok.copy()
    bad[0, 0, 2, 0] = sx + h - 1 + 0.25      # beyond the right halo in x
    bad[P - 1, 0, 3, 1] = -h - 0.5            # beyond the left halo in y
    bad[0, Q - 1, 4, 2] = np.nan              # not finite
    field = np.ones(NC)

    def builder(pos, what):
        def build(mesh):
            p = mtf.import_tf_tensor(mesh, tf.constant(pos), particle_shape(conf))
            if what == "count":
                return {"count": painting.escaped_count(p, conf)}
            if what == "paint":
                return {"paint": painting.paint_field(p, conf)}
            f = mtf.import_tf_tensor(mesh, tf.constant(field), fft.real_shape(conf))
            return {"read": painting.readout_field(f, p, conf)}
        return build

    assert H.run(case[0], conf, builder(ok, "count"))["count"] == 0
    assert H.run(case[0], conf, builder(bad, "count"))["count"] == 3
    H.run(case[0], conf, builder(ok, "paint"))
    for what in ("paint", "read"):
        with pytest.raises(tf.errors.InvalidArgumentError, match=painting.ESCAPE_MESSAGE):
            H.run(case[0], conf, builder(bad, what))


def test_graph_time_errors():
    conf = SimConfig(nc=NC, grid=(2, 2), halo_size=1)
    object.__setattr__(conf, "halo_size", 0)  # SimConfig refuses 0; the painter's own check stays
    with tf.Graph().as_default():
        mesh = mtf.Mesh(mtf.Graph(), "m")
        p = mtf.zeros(mesh, particle_shape(conf))
        with pytest.raises(ValueError, match="halo_size >= 1"):
            painting.cic_paint(None, p, conf)
        conf1 = conf.replace(halo_size=1)
        with pytest.raises(ValueError, match=r"\[bx, by, <particle dims>, xyz\(3\)\]"):
            painting.cic_readout(mtf.zeros(mesh, fft.real_shape(conf1)),
                                 mtf.zeros(mesh, fft.real_shape(conf1)), conf1)
