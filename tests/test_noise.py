"""flowpm_mtf.mesh.noise: decomposition-independent white noise.

* numpy reference == TensorFlow slice generator, bit for bit;
* statistics of the deviates (bounds at 5 standard deviations of the estimator);
* the Mesh TF op equals the numpy field exactly: with ``HvdSimdMeshImpl`` on
  every mesh of the world size (1, 2 or 4 ranks), and with ``PlacementMeshImpl``
  on the meshes of every world size (in the 1-rank pass: it runs in one process).
  Layouts leave some dimensions unsplit (replicated) on meshes with fewer axes.
"""
import numpy as np
import pytest
import mesh_tensorflow as mtf
import tensorflow.compat.v1 as tf
from scipy import stats

from conftest import world
from mtf_harness import AXIS_NAMES, MESHES as ALL_MESHES, mesh_id, meshes_for, run_graph
from flowpm_mtf import native
from flowpm_mtf.mesh import noise

RANK, SIZE = world()

# Statistics of N = 64^3 deviates: an estimator with standard deviation sigma is
# accepted within 5 sigma (false-alarm probability 6e-7 for an ideal generator;
# with fixed seeds the test is deterministic anyway).
N_STAT = 64**3
N_SIGMA = 5.0
MEAN_TOL = N_SIGMA / np.sqrt(N_STAT)                 # sd of the mean: 1/sqrt(N)
VAR_TOL = N_SIGMA * np.sqrt(2.0 / N_STAT)            # sd of the variance: sqrt(2/N)
KURT_TOL = N_SIGMA * np.sqrt(96.0 / N_STAT)          # sd of mean(z^4): sqrt((105-9)/N)
CORR_TOL = N_SIGMA / np.sqrt(N_STAT)                 # sd of a correlation coefficient
KS_PVALUE_MIN = 1e-6                                 # ~5 sigma for the KS statistic
# Our ln(u) is within a few ulp of libm's: the atanh series after reduction to
# [sqrt(1/2), sqrt(2)) rounds ~12 operations.
LOG_ULP = 4
# cos(2 pi u): np.cos(2*np.pi*u) itself rounds 2*pi*u (error <= 2^-53 * 2 pi).
COS_ATOL = 1e-15

FIELD = {"nx": 4, "ny": 8, "nz": 12}  # every size divisible by every mesh axis used


def field_shape(batch=False):
    dims = [mtf.Dimension(n, s) for n, s in FIELD.items()]
    return mtf.Shape(([mtf.Dimension("b", 2)] if batch else []) + dims)


LAYOUTS = {
    "xyz": ["nx", "ny", "nz"],   # nx -> m0, ny -> m1, nz -> m2 (as far as the mesh has axes)
    "zxy": ["nz", "nx", "ny"],
    "y": ["ny"],
}


def layout_rules(name, dims):
    return [(t, AXIS_NAMES[i]) for i, t in enumerate(LAYOUTS[name][:len(dims)])]


# ------------------------------------------------------------------------- numpy vs TF
PATHS = ["native", "tf"]   # the native op is required by the test suite (FLOWPM_MTF_NATIVE)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_tf_slices_equal_numpy_bitwise(dtype, path):
    shape = (6, 10, 14)
    ref = noise.white_noise_numpy(7, shape, dtype)
    assert ref.dtype == dtype and ref.shape == shape

    def window(begin, size):
        return ref[tuple(slice(o, o + n) for o, n in zip(begin, size))]

    size = (3, 5, 7)
    with tf.Graph().as_default():
        use = path == "native"
        full = noise.white_noise_slice(7, shape, [0, 0, 0], shape, tf.as_dtype(dtype), use)
        begin_ph = tf.placeholder(tf.int32, [3])
        part = noise.white_noise_slice(7, shape, begin_ph, size, tf.as_dtype(dtype), use)
        with tf.Session() as sess:
            got = sess.run(full)
            parts = {b: sess.run(part, {begin_ph: b}) for b in [(0, 0, 0), (1, 2, 3), (3, 5, 7)]}
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, ref)
    for b, p in parts.items():
        np.testing.assert_array_equal(p, window(b, size), err_msg=str(b))


# seeds whose key has the top bit set and clear (the op takes the key's int64 bit pattern)
NATIVE_SEEDS = [0, 7, -3, 2**63 + 5]


@pytest.mark.skipif(native.load("noise_ops") is None,
                    reason="native noise_ops not built (FLOWPM_MTF_NATIVE=0 or "
                           "python -m flowpm_mtf.native.build not run)")
@pytest.mark.parametrize("seed", NATIVE_SEEDS)
def test_native_op_equals_numpy_bitwise(seed):
    """The native op, on a larger odd-sized field (all branches of ln and cos many
    times, several threads' row ranges), equals the numpy reference bit for bit."""
    shape = (17, 30, 45)
    begin, size = (3, 4, 5), (11, 23, 37)
    with tf.Graph().as_default():
        z = [noise.white_noise_slice(seed, shape, begin, size, dt, True)
             for dt in (tf.float64, tf.float32)]
        assert all(t.op.type == "FlowpmWhiteNoise" for t in z)
        with tf.Session() as sess:
            got64, got32 = sess.run(z)
    ref = noise.white_noise_numpy(seed, shape)[3:14, 4:27, 5:42]
    np.testing.assert_array_equal(got64, ref)
    np.testing.assert_array_equal(got32, ref.astype(np.float32))


@pytest.mark.skipif(native.load("noise_ops") is None,
                    reason="native noise_ops not built (FLOWPM_MTF_NATIVE=0 or "
                           "python -m flowpm_mtf.native.build not run)")
def test_native_op_long_rows_bitwise():
    """Rows longer than the op's chunk of 256 cells (two full chunks and a partial one
    of odd length, the vector loop and its remainder) equal the numpy reference."""
    shape = (3, 4, 700)
    with tf.Graph().as_default():
        z = noise.white_noise_slice(11, shape, (1, 1, 89), (2, 3, 611), tf.float64, True)
        assert z.op.type == "FlowpmWhiteNoise"
        with tf.Session() as sess:
            got = sess.run(z)
    np.testing.assert_array_equal(got, noise.white_noise_numpy(11, shape)[1:3, 1:4, 89:700])


def test_native_key_signs():
    assert any(noise.seed_key(s) >= 2**63 for s in NATIVE_SEEDS)
    assert any(noise.seed_key(s) < 2**63 for s in NATIVE_SEEDS)


@pytest.mark.parametrize("grappler", ["default", "no_constant_folding", "off"])
def test_tf_bitwise_under_graph_rewrites(grappler):
    """Grappler rewrites (AddN for Add chains, reordering of Mul chains) must not change
    a bit. With constant folding on, a constant-input graph is evaluated at rewrite
    time; turning it off executes every kernel at run time."""
    from tensorflow.core.protobuf import rewriter_config_pb2 as rc

    shape = (6, 10, 14)
    config = tf.ConfigProto()
    if grappler == "no_constant_folding":
        config.graph_options.rewrite_options.constant_folding = rc.RewriterConfig.OFF
    elif grappler == "off":
        config.graph_options.rewrite_options.disable_meta_optimizer = True
    with tf.Graph().as_default():
        z = noise.white_noise_slice(7, shape, [0, 0, 0], shape, tf.float64)
        with tf.Session(config=config) as sess:
            got = sess.run(z)
    np.testing.assert_array_equal(got, noise.white_noise_numpy(7, shape))


def test_elementary_functions_accuracy():
    u = np.random.default_rng(3).random(200_000)
    u = np.concatenate([u, [2.0**-54, 0.5, 0.125, 0.25, 0.75, 1 - 2.0**-53]])
    ln = noise._log(u, noise._NumpyOps)
    assert np.max(np.abs(ln - np.log(u)) / np.spacing(np.abs(np.log(u)) + 1e-300)) <= LOG_ULP
    np.testing.assert_allclose(noise._cos_2pi(u, noise._NumpyOps), np.cos(2 * np.pi * u),
                               rtol=0, atol=COS_ATOL)


def test_splitmix64_reference_values():
    """The uniforms are SplitMix64's outputs: first outputs for state 0 (published values)."""
    # SplitMix64 seeded with 0 yields 0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, ...
    # (Vigna's splitmix64.c); with key 0 our counters 0, 1 are exactly these.
    x = noise._mix64(np.array([1, 2], np.uint64) * np.uint64(noise._GAMMA), noise._NumpyOps)
    assert [int(v) for v in x] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4]
    assert noise.seed_key(-1) == noise.seed_key(2**64 - 1)
    with pytest.raises(TypeError):
        noise.seed_key(1.5)


# ------------------------------------------------------------------------- statistics
def test_statistics():
    z = noise.white_noise_numpy(2024, (64, 64, 64))
    assert abs(z.mean()) < MEAN_TOL
    assert abs(z.var() - 1.0) < VAR_TOL
    assert abs(np.mean(z**4) - 3.0) < KURT_TOL
    for axis in range(3):  # nearest neighbours, periodic
        r = np.mean(z * np.roll(z, 1, axis=axis)) / z.var()
        assert abs(r) < CORR_TOL, (axis, r)
    # consecutive flat indices (the two halves of a counter pair are never reused)
    flat = z.ravel()
    assert abs(np.corrcoef(flat[:-1], flat[1:])[0, 1]) < CORR_TOL
    assert stats.kstest(flat, "norm").pvalue > KS_PVALUE_MIN


def test_seeds_differ_and_reproduce():
    shape = (64, 64, 64)
    a = noise.white_noise_numpy(1, shape)
    np.testing.assert_array_equal(a, noise.white_noise_numpy(1, shape))
    for other in (2, 2**32 + 1, 2**63):
        b = noise.white_noise_numpy(other, shape)
        assert np.mean(a == b) < 1e-4
        assert abs(np.corrcoef(a.ravel(), b.ravel())[0, 1]) < CORR_TOL


def test_argument_errors():
    with pytest.raises(ValueError):
        noise.white_noise_numpy(0, (4, 0, 4))
    with pytest.raises(ValueError):
        noise.white_noise_slice(0, (4, 4), [0, 0], (4, 4, 1))
    with pytest.raises(ValueError):
        noise.white_noise_slice(0, (4, 4), [0, 0], (4, 4), tf.int32)
    with pytest.raises(TypeError):
        noise.white_noise_numpy(None, (4, 4))


# ------------------------------------------------------------------------- mesh TF
SEED = 12345


def _build(mesh):
    """A float64 field and a float32 field with an extra (unsplit) batch dimension."""
    return {"f64": noise.white_noise(mesh, field_shape(), SEED, tf.float64),
            "f32_batch": noise.white_noise(mesh, field_shape(batch=True), SEED, tf.float32)}


def _check(got, what):
    expect = {"f64": noise.white_noise_numpy(SEED, field_shape().to_integer_list),
              "f32_batch": noise.white_noise_numpy(SEED, field_shape(True).to_integer_list,
                                                   np.float32)}
    for name, value in expect.items():
        assert got[name].dtype == value.dtype
        np.testing.assert_array_equal(got[name], value, err_msg="%s %s" % (what, name))


@pytest.mark.parametrize("dims", meshes_for(SIZE), ids=[mesh_id(m) for m in meshes_for(SIZE)])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mtf_white_noise_hvd(dims, layout):
    """HvdSimdMeshImpl on the meshes of the world size: one slice per rank."""
    _check(run_graph("hvd", dims, layout_rules(layout, dims), _build), "hvd")


# Meshes of 2 and 4 processors (on one processor the placement and hvd lowerings coincide).
PLACEMENT_MESHES = [m for size in sorted(ALL_MESHES) if size > 1 for m in ALL_MESHES[size]]


@pytest.mark.skipif(SIZE != 1, reason="rank-independent: runs in the 1-rank pass")
@pytest.mark.parametrize("dims", PLACEMENT_MESHES, ids=[mesh_id(m) for m in PLACEMENT_MESHES])
@pytest.mark.parametrize("layout", ["xyz", "zxy"])
def test_mtf_white_noise_placement(dims, layout):
    """PlacementMeshImpl (Mesh TF's reference implementation, N logical CPUs in one
    process) on the meshes of every world size: it does not depend on the ranks, so it
    runs once, in the 1-rank pass."""
    _check(run_graph("placement", dims, layout_rules(layout, dims), _build), "placement")
