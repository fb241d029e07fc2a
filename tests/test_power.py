"""flowpm_mtf.physics.power: distributed binned power spectrum.

* against an independent numpy estimator (np.fft.fftn of the gathered field,
  np.digitize / np.bincount binning), float64, on every process grid of the world
  size with HvdSimdMeshImpl, with PlacementMeshImpl and (1 rank) on a
  1-processor mesh holding a 2 x 2 grid; cubic and non-cubic meshes and boxes,
  default and custom edges, with and without CIC deconvolution;
* nbodykit-style expectations on known inputs: plane waves put all their power
  in the shell of their wave vector, mode counts of the first shells, the
  expected white-noise level;
* gradients: finite differences of a weighted sum of the binned power;
* every path of the shell sums (the native ``FlowpmShellSumsHalf`` on the half spectrum,
  the native ``FlowpmShellSums`` and the TensorFlow ops) against numpy, the native ops'
  sums independent of the thread count; the half path makes no full spectrum.
"""
import numpy as np
import pytest
import mesh_tensorflow as mtf
import tensorflow.compat.v1 as tf

import fpm_harness as H
from flowpm_mtf.mesh import fft
from flowpm_mtf import native
from flowpm_mtf.physics import power
from flowpm_mtf.config import SimConfig

# Both estimators sum the same |fftn/N|^2 values (float64) in different orders:
# rounding ~ (number of modes per shell) * 1e-16 relative; the FFTs agree to
# ~1e-15 (see test_fft). 1e-10 is a wide margin, while any normalisation,
# binning or counting error is O(1).
PK_RTOL = 1e-10
# float32 field: the FFT is accurate to ~log2(N) * 6e-8 and |delta_k|^2 doubles it.
PK_RTOL_F32 = 1e-5
# Power outside the shell of a plane wave: rounding of the FFT of an O(1) field,
# |delta_k| ~ 1e-16, |delta_k|^2 V ~ 1e-32 * V; relative to the wave's power.
LEAK_RTOL = 1e-20
# White noise of unit variance has <P> = V / N (the cell volume); the estimate
# averages N_modes / 2 independent exponential variables: sd = P sqrt(2 / N_modes).
N_SIGMA = 5.0
# Central finite differences in float64, step 1e-6, of a loss quadratic in the
# field: no truncation error; rounding ~1e-16 / 1e-6 relative to the loss.
FD_EPS = 1e-6
FD_RTOL = 1e-6

CASES = H.cases(single=True, placement=False)
GEOMETRIES = {
    "cubic": ((8, 8, 8), (100.0, 100.0, 100.0)),
    "noncubic": ((6, 10, 4), (60.0, 100.0, 40.0)),   # equal cells, odd factors 3, 5
    "aniso": ((8, 4, 8), (100.0, 40.0, 60.0)),        # unequal cells
}


def conf_for(case, geom, dtype="float64"):
    nc, box = GEOMETRIES[geom]
    return SimConfig(nc=nc, box_size=box, grid=case[1], halo_size=1, dtype=dtype)


# ----------------------------------------------------------------------------- numpy reference
def np_kgrid(conf):
    ks = [2 * np.pi * np.fft.fftfreq(n, d=d) for n, d in zip(conf.nc, conf.cell_size)]
    return np.meshgrid(*ks, indexing="ij")


def np_power(field, conf, edges, deconvolve_cic=False):
    """Independent reference: (k_mean, P, n_modes) from the whole field in numpy."""
    kx, ky, kz = np_kgrid(conf)
    knorm = np.sqrt(kx**2 + ky**2 + kz**2).ravel()
    delta = np.fft.fftn(field.astype(np.float64)) / field.size
    p3 = np.abs(delta)**2 * np.prod(conf.box_size)
    if deconvolve_cic:
        w = np.ones(field.shape)
        for k, d in zip((kx, ky, kz), conf.cell_size):
            x = k * d / 2
            w *= np.where(x == 0, 1.0, np.sin(x) / np.where(x == 0, 1.0, x))**2
        p3 = p3 / w**2
    p3 = p3.ravel()
    nb = len(edges) - 1
    b = np.digitize(knorm, edges) - 1
    keep = (b >= 0) & (b < nb) & (knorm > 0)
    n = np.bincount(b[keep], minlength=nb).astype(float)
    safe = np.maximum(n, 1)
    return (np.bincount(b[keep], knorm[keep], nb) / safe,
            np.bincount(b[keep], p3[keep], nb) / safe, n)


def run_power(case, conf, field, edges=None, deconvolve_cic=False, variants=None):
    """P(k) of ``field`` on ``case``; ``variants``: several (edges, cic) in one graph."""
    variants = variants or [(edges, deconvolve_cic)]

    def build(mesh):
        f = mtf.import_tf_tensor(mesh, tf.constant(field), fft.real_shape(conf))
        out = {}
        for i, (e, cic) in enumerate(variants):
            k, p, n = power.power_spectrum(f, conf, edges=e, deconvolve_cic=cic,
                                           name="power_%d" % i)
            out.update({"k%d" % i: k, "p%d" % i: p, "n%d" % i: n})
        return out
    res = H.run(case[0], conf, build)
    outs = [{key: res[key + str(i)] for key in "kpn"} for i in range(len(variants))]
    return outs if len(variants) > 1 else outs[0]


HAS_NATIVE = native.load("power_ops") is not None
# The shell sums' paths: the native half-spectrum op where the mesh's blocks are even (else
# the native full one), the native full one with the half path off, the TensorFlow ops.
PATHS = ["native", "full", "tf"] if HAS_NATIVE else ["tf"]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    if request.param in ("full", "tf"):
        monkeypatch.setattr(fft, "half_path_serves", lambda *a: False)
    if request.param == "tf":
        monkeypatch.setattr(power, "_power_ops", lambda t: None)
    return request.param


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("case", CASES, ids=H.case_id)
@pytest.mark.parametrize("geom", sorted(GEOMETRIES))
def test_matches_numpy(case, geom, path):
    conf = conf_for(case, geom)
    rng = np.random.RandomState(5)
    field = rng.randn(*conf.nc)
    custom = np.array([0.0, 0.07, 0.12, 0.2, 0.35, 1.0])  # includes an empty tail
    runs = [(None, False), (None, True), (custom, False)]
    for (edges, cic), out in zip(runs, run_power(case, conf, field, variants=runs)):
        e = power.default_edges(conf) if edges is None else edges
        k_ref, p_ref, n_ref = np_power(field, conf, e, cic)
        assert out["n"].dtype == np.float64 and out["k"].dtype == np.float64
        assert out["p"].dtype == np.float64 and out["p"].shape == (len(e) - 1,)
        np.testing.assert_array_equal(out["n"], n_ref)
        np.testing.assert_allclose(out["k"], k_ref, rtol=PK_RTOL, atol=0)
        np.testing.assert_allclose(out["p"], p_ref, rtol=PK_RTOL, atol=0)
        assert n_ref.sum() > 0


def test_float32_matches_numpy(path):
    case = CASES[0]
    conf = conf_for(case, "cubic", "float32")
    field = np.random.RandomState(6).randn(*conf.nc).astype(np.float32)
    out = run_power(case, conf, field)
    _, p_ref, n_ref = np_power(field, conf, power.default_edges(conf))
    assert out["p"].dtype == np.float32
    np.testing.assert_array_equal(out["n"], n_ref)
    np.testing.assert_allclose(out["p"], p_ref, rtol=PK_RTOL_F32)


def test_default_edges_and_mode_counts():
    """Edges centred on multiples of 2pi/L; first shells of an 8^3 mesh hold the
    lattice vectors with |m|^2 in {1, 2}, {3, 4, 5, 6}, ...: 6 + 12, 8 + 6 + 24 + 24."""
    conf = conf_for(("single", (1, 1)), "cubic")
    dk = 2 * np.pi / 100.0
    edges = power.default_edges(conf)
    np.testing.assert_allclose(edges, (np.arange(5) + 0.5) * dk, rtol=1e-15)
    out = run_power(CASES[0], conf_for(CASES[0], "cubic"), np.zeros(conf.nc))
    assert out["n"][0] == 6 + 12
    assert out["n"][1] == 8 + 6 + 24 + 24
    # total: every non-zero mode with |k| < 4.5 dk, counted with both +k and -k
    m = np.fft.fftfreq(8, 1 / 8)
    m2 = (m[:, None, None]**2 + m[None, :, None]**2 + m[None, None, :]**2).ravel()
    assert out["n"].sum() == np.count_nonzero((m2 > 0) & (m2 < 4.5**2))
    np.testing.assert_array_equal(out["p"], 0.0)


@pytest.mark.parametrize("case", CASES[:2], ids=H.case_id)
def test_plane_waves(case):
    """A cos(k0.x + phi) has |delta_k|^2 = A^2/4 at +-k0: all power in k0's shell,
    P = V * 2 * A^2 / 4 / N_shell, nothing elsewhere (nbodykit-style check)."""
    conf = conf_for(case, "cubic")
    n = conf.nc[0]
    dk = 2 * np.pi / conf.box_size[0]
    idx = np.indices(conf.nc)
    for m, amp in (((3, 0, 0), 2.0), ((1, 2, 2), 0.5), ((0, 1, 0), 1.0)):
        phase = 2 * np.pi * sum(mi * i for mi, i in zip(m, idx)) / n + 0.3
        field = amp * np.cos(phase)
        out = run_power(case, conf, field)
        shell = int(round(np.sqrt(np.dot(m, m)))) - 1
        expect = np.prod(conf.box_size) * 2 * amp**2 / 4 / out["n"][shell]
        np.testing.assert_allclose(out["p"][shell], expect, rtol=PK_RTOL)
        others = np.delete(out["p"], shell)
        assert np.all(np.abs(others) <= LEAK_RTOL * expect), (m, others)
        assert abs(out["k"][shell] / dk - (shell + 1)) < 0.5


def test_white_noise_level():
    """Unit white noise: <P> = V / N = cell volume [(Mpc/h)^3], within 5 sigma per shell."""
    case = CASES[0]
    conf = SimConfig(nc=16, box_size=64.0, grid=case[1], halo_size=1, dtype="float64")
    field = np.random.RandomState(7).randn(*conf.nc)
    out = run_power(case, conf, field)
    cell = np.prod(conf.cell_size)
    sigma = cell * np.sqrt(2.0 / out["n"])
    assert np.all(np.abs(out["p"] - cell) < N_SIGMA * sigma), (out["p"] / cell, out["n"])


@pytest.mark.parametrize("case", CASES, ids=H.case_id)
def test_finite_difference_gradient(case):
    """d/d field of L = sum_b w_b P_b, with CIC deconvolution, at three cells."""
    conf = SimConfig(nc=(4, 4, 4), box_size=(40.0, 40.0, 40.0), grid=case[1], halo_size=1,
                     dtype="float64")
    rng = np.random.RandomState(8)
    x0 = rng.randn(*conf.nc)
    edges = np.array([0.1, 0.2, 0.3, 0.4, 0.6])
    w = rng.rand(len(edges) - 1)
    pts = [(0, 0, 0), (1, 2, 3), (3, 1, 0)]

    def build(mesh):
        phs = {}
        x = H.placeholder_input(mesh, phs, "x", x0, fft.real_shape(conf))
        _, p, _ = power.power_spectrum(x, conf, edges=edges, deconvolve_cic=True)
        ww = mtf.import_tf_tensor(mesh, tf.constant(w), p.shape)
        loss = mtf.reduce_sum(ww * p)
        g, = mtf.gradients([loss], [x])
        return {"loss": loss, "g": g}, phs

    feeds = [{"x": x0}]
    for p in pts:
        for s in (1, -1):
            x = x0.copy()
            x[p] += s * FD_EPS
            feeds.append({"x": x})
    res = H.run(case[0], conf, build, feeds=feeds)
    g = res[0]["g"]
    assert np.max(np.abs(g)) > 0
    for i, p in enumerate(pts):
        fd = (res[1 + 2 * i]["loss"] - res[2 + 2 * i]["loss"]) / (2 * FD_EPS)
        assert abs(fd - g[p]) <= FD_RTOL * np.max(np.abs(g)), (p, fd, g[p])


def test_bad_inputs():
    conf = conf_for(CASES[0], "cubic")
    with tf.Graph().as_default():
        mesh = mtf.Mesh(mtf.Graph(), "mesh")
        wrong = mtf.zeros(mesh, fft.k_shape(conf), tf.float64)
        with pytest.raises(ValueError, match="shape"):
            power.power_spectrum(wrong, conf)
        cplx = mtf.cast(mtf.zeros(mesh, fft.real_shape(conf), tf.float64), tf.complex128)
        with pytest.raises(TypeError, match="real"):
            power.power_spectrum(cplx, conf)
        ok = mtf.zeros(mesh, fft.real_shape(conf), tf.float64)
        for bad in ([0.1], [0.2, 0.1], [-0.1, 0.2], [0.0, np.inf]):
            with pytest.raises(ValueError, match="edges"):
                power.power_spectrum(ok, conf, edges=bad)
        edges = power.default_edges(conf)
        with pytest.raises(ValueError, match="shell_sums: values must have the shape"):
            power.shell_sums(ok, conf, edges)         # real-space dims, not k
        with pytest.raises(TypeError, match="shell_sums: values must be real floating"):
            power.shell_sums(mtf.cast(wrong, tf.int32), conf, edges)


def _shell_sums_numpy(v, ks, edges):
    k = np.sqrt((ks[0][:, None, None]**2 + ks[1][None, :, None]**2) + ks[2][None, None, :]**2)
    b = np.searchsorted(edges, k.ravel(), side="right") - 1
    nb = len(edges) - 1
    keep = (b >= 0) & (b < nb) & (k.ravel() != 0)
    return (np.bincount(b[keep], minlength=nb).astype(float),
            np.bincount(b[keep], k.ravel()[keep], nb),
            np.bincount(b[keep], v.astype(np.float64).ravel()[keep], nb))


@pytest.mark.skipif(not HAS_NATIVE, reason="native power_ops not built")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_shell_sums_op_threads_and_numpy(dtype):
    """FlowpmShellSums on one slice: the same sums, bit for bit, on 1 and 4 threads (per x
    plane partial sums, added in x order); the counts of numpy's binning exactly, the
    sums to float64 rounding (float32 values: rounded once to float32). k vectors of a
    mesh slice in mirror order, with k = 0, modes on no shell, and an edge hit exactly."""
    rng = np.random.RandomState(11)
    shape = (33, 24, 20)
    ks = [np.fft.fftfreq(n, 1.0 / n).astype(np.float64) for n in shape]
    ks[2][3] = 2.0          # exactly an edge: searchsorted(side="right") puts it above
    edges = np.array([0.5, 1.5, 2.0, 4.0, 7.5, 9.0])
    v = rng.rand(*shape).astype(dtype)
    lib = native.load("power_ops")
    outs = []
    for threads in (1, 4):
        with tf.Graph().as_default():
            op = lib.flowpm_shell_sums(tf.constant(v), *[tf.constant(k) for k in ks],
                                       tf.constant(edges))
            cfg = tf.ConfigProto(intra_op_parallelism_threads=threads,
                                 inter_op_parallelism_threads=1)
            with tf.Session(config=cfg) as sess:
                outs.append(sess.run(op))
    for a, b in zip(*outs):
        np.testing.assert_array_equal(a, b)
    n_ref, k_ref, v_ref = _shell_sums_numpy(v, ks, edges)
    n, k, vs = outs[0]
    assert vs.dtype == dtype and n.dtype == k.dtype == np.float64
    np.testing.assert_array_equal(n, n_ref)
    assert n_ref.min() > 0 and n_ref.sum() < v.size     # every shell used, some modes on none
    np.testing.assert_allclose(k, k_ref, rtol=1e-13)
    np.testing.assert_allclose(vs, v_ref.astype(dtype), rtol=1e-13 if dtype == np.float64 else 1e-7)


@pytest.mark.skipif(not HAS_NATIVE, reason="native power_ops not built")
def test_shell_sums_op_bad_shapes():
    lib = native.load("power_ops")
    with tf.Graph().as_default(), tf.Session() as sess:
        v = tf.zeros([4, 5, 6], tf.float64)
        k = [tf.zeros([n], tf.float64) for n in (4, 5, 6)]
        e = tf.constant([0.1, 0.2], tf.float64)
        with pytest.raises(tf.errors.InvalidArgumentError, match="k vector 1 must be"):
            sess.run(lib.flowpm_shell_sums(v, k[0], tf.placeholder_with_default(
                tf.zeros([7], tf.float64), [None]), k[2], e))
        with pytest.raises(tf.errors.InvalidArgumentError, match="edges must be"):
            sess.run(lib.flowpm_shell_sums(v, *k, tf.placeholder_with_default(
                tf.constant([0.1], tf.float64), [None])))


@pytest.mark.skipif(H.SIZE != 1, reason="a single-process TensorFlow test")
@pytest.mark.parametrize("ctype", [np.complex64, np.complex128])
def test_shell_sums_half_op_against_full(ctype):
    """``FlowpmShellSumsHalf`` of a half spectrum equals ``FlowpmShellSums`` of |F|^2 of its
    extension (``pairs_extend``), for every combination of first blocks, on one and four
    threads."""
    from flowpm_mtf.mesh import fft_local
    lib = native.load("power_ops")
    rng = np.random.RandomState(8)
    lx, ly, h = 6, 4, 3

    def mirrored(n, first):
        """|k| along an axis in mirror-pair order: equal at a position and its mirror."""
        k = rng.rand(n) * 0.3
        for p in range(n):
            m = p if (first and p < 2) else p ^ 1
            k[p] = k[min(p, m)]
        return k

    edges = np.linspace(0.0, 0.7, 8)
    rtype = np.float32 if ctype == np.complex64 else np.float64
    for first_y in (0, 1):
        for first_z in (0, 1):
            kx, ky = mirrored(lx, True), mirrored(ly, first_y)
            kz = np.repeat(rng.rand(h) * 0.3, 2)     # a representative and its mirror
            kx[0] = 0.0
            if first_y:
                ky[0] = 0.0
            if first_z:
                kz[0], kz[1] = 0.0, 0.31             # the packed zero and Nyquist planes
            f = (rng.randn(lx, ly, h) + 1j * rng.randn(lx, ly, h)).astype(ctype)
            firsts = np.array([first_y, first_z], np.int32)
            outs = []
            for threads in (1, 4):
                cfg = tf.ConfigProto(intra_op_parallelism_threads=threads,
                                     inter_op_parallelism_threads=1)
                with tf.Graph().as_default(), tf.Session(config=cfg) as sess:
                    full = fft_local.pairs_extend(tf.constant(f), tf.constant(firsts))
                    v = tf.math.real(full * tf.math.conj(full))
                    outs.append(sess.run({
                        "half": lib.flowpm_shell_sums_half(f, kx, ky, kz, edges, firsts,
                                                           T=rtype),
                        "full": lib.flowpm_shell_sums(v, kx, ky, kz, edges)}))
            for key in ("half", "full"):
                for a, b in zip(outs[0][key], outs[1][key]):
                    np.testing.assert_array_equal(a, b)
            half, full = outs[0]["half"], outs[0]["full"]
            np.testing.assert_array_equal(half[0], full[0])
            assert half[0].sum() == lx * ly * 2 * h - (1 if first_y and first_z else 0)   # k = 0
            np.testing.assert_allclose(half[1], full[1], rtol=1e-12)
            np.testing.assert_allclose(half[2], full[2], rtol=1e-5 if rtype == np.float32
                                       else 1e-12)


@pytest.mark.skipif(H.SIZE != 1, reason="a single-process TensorFlow test")
def test_shell_sums_half_op_bad_shapes():
    """k vectors of the wrong length, odd extents, a missing first flag: one error each."""
    lib = native.load("power_ops")
    f = np.zeros((4, 2, 3), np.complex64)
    k = [np.zeros(n) for n in (4, 2, 6)]
    e = np.array([0.0, 1.0])
    fs = np.array([1, 1], np.int32)
    cases = [
        (lambda: lib.flowpm_shell_sums_half(f, k[0], k[1], k[0], e, fs, T=np.float32),
         "k vector 2 must be \\[6\\]"),
        (lambda: lib.flowpm_shell_sums_half(f[:3], k[0][:3], k[1], k[2], e, fs, T=np.float32),
         "extents must be even"),
        (lambda: lib.flowpm_shell_sums_half(f, k[0], k[1], k[2], e, fs[:1], T=np.float32),
         "firsts must hold 2 values"),
    ]
    for make, message in cases:
        with tf.Graph().as_default(), tf.Session() as sess:
            with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match=message):
                sess.run(make())


@pytest.mark.skipif(H.SIZE != 1, reason="a graph inspection on one rank")
def test_half_path_makes_no_full_spectrum():
    """On an even mesh the power spectrum runs ``FlowpmShellSumsHalf`` and no
    ``FlowpmPairs`` (no full spectrum, no |F|^2 field); its gradient (the composition's)
    still flows."""
    conf = conf_for(("hvd", (1, 1)), "cubic")
    field = np.random.RandomState(9).randn(*conf.nc)
    seen = {}

    def build(mesh):
        f = mtf.import_tf_tensor(mesh, tf.constant(field), fft.real_shape(conf))
        k, p, n = power.power_spectrum(f, conf)
        seen["p"] = p
        g, = mtf.gradients([mtf.reduce_sum(p)], [f])
        return {"p": p, "g": g}

    def extra(lowering, impl):
        ops, stack, names = set(), [t.op for t in lowering.tensors[seen["p"]]
                                    .to_laid_out_tensor().tensor_list], set()
        while stack:
            op = stack.pop()
            if op.name in names:
                continue
            names.add(op.name)
            ops.add(op.type)
            stack.extend(i.op for i in op.inputs)
        seen["ops"] = ops
        return {}

    out = H.run("hvd", conf, build, extra=extra)
    assert "FlowpmShellSumsHalf" in seen["ops"] and "FlowpmPairs" not in seen["ops"]
    assert np.max(np.abs(out["g"])) > 0
