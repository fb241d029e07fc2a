r"""Decomposition-independent Gaussian white noise for initial conditions.

The value in a cell depends only on the seed and the cell's *global* index, so
the same seed gives the same field on every process grid, every layout and in a
single process, and each processor generates exactly its own slice, without
communication.

Algorithm
---------
For a field of global shape :math:`(n_0, \dots, n_{d-1})`, cell
:math:`(i_0, \dots, i_{d-1})` has the row-major flat index
:math:`n = ((i_0 n_1 + i_1) n_2 + \dots) + i_{d-1}`.

1. **Counter-based uniforms (SplitMix64).** With
   :math:`\gamma = \mathtt{0x9E3779B97F4A7C15}` and the 64-bit finaliser
   ``mix64`` of SplitMix64 (Steele, Lea & Flood 2014; Stafford's "Mix13"),
   the key is :math:`k = \mathrm{mix64}(s + \gamma)` for the seed :math:`s`
   (taken modulo :math:`2^{64}`), and the :math:`c`-th 64-bit output of the
   stream is :math:`x_c = \mathrm{mix64}(k + (c + 1)\gamma)` (all arithmetic
   modulo :math:`2^{64}`): the :math:`c`-th output of a SplitMix64 generator
   seeded with :math:`k`, a generator that passes BigCrush. Cell :math:`n` uses
   the counters :math:`c = 2n` and :math:`2n + 1`, mapped to uniforms in
   :math:`(0, 1)` by :math:`u = (\lfloor x / 2^{11} \rfloor + \tfrac12)\,2^{-53}`.
2. **Box-Muller.** :math:`z = \sqrt{-2 \ln u_1}\, \cos(2\pi u_2)`, one standard
   normal per cell (the sine partner is discarded).

``ln`` and ``cos`` are evaluated here with +, -, *, / and bit manipulation only
(argument reduction to :math:`[\sqrt{1/2}, \sqrt 2)` and an atanh series for
``ln``; octant reduction and Taylor polynomials for ``cos``), because library
``log``/``cos`` differ in the last bit between numpy and TensorFlow, and even
between TensorFlow's vectorised and scalar code paths, i.e. with the position of
a cell in its slice. IEEE basic operations and ``sqrt`` are correctly rounded,
so the TensorFlow and numpy versions, the same code run on either backend,
agree **bit for bit** on every layout. The expressions avoid the patterns that
Grappler re-associates (chains of floating-point additions become ``AddN``);
integer arithmetic is exact modulo 2^64 in any order. The values are computed
in float64 and rounded once to the requested dtype.

On the CPU (:func:`flowpm_mtf.native.runs_on_cpu`, float32/float64) a slice
is the native op ``FlowpmWhiteNoise`` of ``flowpm_mtf/native/noise_ops.cc``:
the same operations in the same order in C++ (no fused multiply-adds), so the
same bits, an order of magnitude faster than the ~170 elementwise TensorFlow ops (which
remain the path on a GPU, with ``FLOWPM_MTF_NATIVE=0`` or when the op is not
built).

:func:`white_noise_numpy` materialises the whole field (about 50 bytes per cell
of temporaries): it is the reference for tests and small meshes.
"""
import logging
import math

import mesh_tensorflow as mtf
import numpy as np
import tensorflow.compat.v1 as tf

from .. import native

__all__ = ["white_noise_slice", "white_noise_numpy", "white_noise", "WhiteNoiseOperation",
           "seed_key"]

log = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_MIX_M1 = 0xBF58476D1CE4E5B9
_MIX_M2 = 0x94D049BB133111EB

_LN2 = 0.6931471805599453
_SQRT2 = 1.4142135623730951
_TWO_PI = 6.283185307179586
# atanh series ln m = 2 s sum_k s^{2k} / (2k + 1), |s| <= 0.1716: s^{24} < 1e-18.
_LOG_COEFFS = [1.0 / (2 * k + 1) for k in range(12)]
# Taylor series of cos and sin on |x| <= pi/4: x^{20}/20! < 4e-21.
_COS_COEFFS = [(-1.0)**k / float(math.factorial(2 * k)) for k in range(10)]
_SIN_COEFFS = [(-1.0)**k / float(math.factorial(2 * k + 1)) for k in range(10)]


def _mix64_int(z):
    """SplitMix64 finaliser on a python int (reference for the key)."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * _MIX_M1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX_M2) & _MASK64
    return z ^ (z >> 31)


def seed_key(seed):
    """64-bit stream key of an integer seed: ``mix64(seed + gamma)`` [uint64 as int].

    Parameters
    ----------
    seed : int
        Any integer (reduced modulo 2^64); not a float, not ``None``.
    """
    if isinstance(seed, (bool, float)) or not isinstance(seed, (int, np.integer)):
        raise TypeError("seed must be an integer, got %r" % (seed,))
    return _mix64_int((int(seed) + _GAMMA) & _MASK64)


# ----------------------------------------------------------------------- backends
class _NumpyOps:
    """The few primitives the algorithm needs, on numpy arrays."""

    @staticmethod
    def u64(c):
        return np.uint64(c)

    shr = staticmethod(np.right_shift)
    xor = staticmethod(np.bitwise_xor)
    band = staticmethod(np.bitwise_and)
    bor = staticmethod(np.bitwise_or)
    where = staticmethod(np.where)
    sqrt = staticmethod(np.sqrt)

    @staticmethod
    def u64_to_f64(x):
        return x.astype(np.float64)

    @staticmethod
    def f64_bits(x):
        return np.asarray(x, np.float64).view(np.uint64)

    @staticmethod
    def bits_f64(x):
        return np.asarray(x, np.uint64).view(np.float64)


class _TFOps:
    """The same primitives on TensorFlow tensors."""

    @staticmethod
    def u64(c):
        return tf.constant(c, tf.uint64)

    shr = staticmethod(tf.bitwise.right_shift)
    xor = staticmethod(tf.bitwise.bitwise_xor)
    band = staticmethod(tf.bitwise.bitwise_and)
    bor = staticmethod(tf.bitwise.bitwise_or)
    sqrt = staticmethod(tf.math.sqrt)

    @staticmethod
    def where(cond, x, y):
        return tf.where(cond, x, y)

    @staticmethod
    def u64_to_f64(x):
        return tf.cast(x, tf.float64)

    @staticmethod
    def f64_bits(x):
        return tf.bitcast(x, tf.uint64)

    @staticmethod
    def bits_f64(x):
        return tf.bitcast(x, tf.float64)


def _mix64(z, xp):
    z = xp.xor(z, xp.shr(z, xp.u64(30))) * xp.u64(_MIX_M1)
    z = xp.xor(z, xp.shr(z, xp.u64(27))) * xp.u64(_MIX_M2)
    return xp.xor(z, xp.shr(z, xp.u64(31)))


def _uniform(counter, key, xp):
    """Uniform in (0, 1) from the SplitMix64 output number ``counter`` of stream ``key``."""
    x = _mix64(xp.u64(key) + (counter + xp.u64(1)) * xp.u64(_GAMMA), xp)
    return (xp.u64_to_f64(xp.shr(x, xp.u64(11))) + 0.5) * (2.0**-53)


def _horner(x, coeffs):
    acc = coeffs[-1]
    for c in coeffs[-2::-1]:
        acc = acc * x + c
    return acc


def _log(u, xp):
    """Natural log of positive normal float64 ``u`` with basic operations only."""
    bits = xp.f64_bits(u)
    e = xp.u64_to_f64(xp.shr(bits, xp.u64(52))) - 1023.0
    m = xp.bits_f64(xp.bor(xp.band(bits, xp.u64(0x000FFFFFFFFFFFFF)), xp.u64(0x3FF0000000000000)))
    big = m > _SQRT2
    m = xp.where(big, m * 0.5, m)
    e = xp.where(big, e + 1.0, e)
    s = (m - 1.0) / (m + 1.0)
    log_m = 2.0 * s * _horner(s * s, _LOG_COEFFS)
    # A single addition: Grappler's arithmetic optimizer turns chains of Adds into
    # AddN, whose summation order differs from the written one.
    return e * _LN2 + log_m


def _cos_2pi(u, xp):
    """cos(2 pi u) for u in (0, 1) with basic operations only."""
    t = xp.where(u > 0.5, 1.0 - u, u)        # cos(2pi(1-u)) = cos(2pi u); t in (0, 1/2]
    neg = t > 0.25
    t = xp.where(neg, 0.5 - t, t)            # cos(2pi(1/2-t)) = -cos(2pi t); t in [0, 1/4]
    use_sin = t > 0.125
    r = xp.where(use_sin, 0.25 - t, t)       # cos(2pi t) = sin(2pi(1/4-t)); r in [0, 1/8]
    x = _TWO_PI * r
    x2 = x * x
    c = xp.where(use_sin, x * _horner(x2, _SIN_COEFFS), _horner(x2, _COS_COEFFS))
    return xp.where(neg, -c, c)


def _normal_from_index(n, key, xp):
    """Standard normal for the global flat cell index ``n`` (uint64 array/tensor)."""
    c1 = n * xp.u64(2)
    u1 = _uniform(c1, key, xp)
    u2 = _uniform(c1 + xp.u64(1), key, xp)
    return xp.sqrt(-2.0 * _log(u1, xp)) * _cos_2pi(u2, xp)


def _global_flat_index(begin, global_shape, slice_shape):
    """Row-major global flat index (uint64) of the cells of a slice starting at ``begin``."""
    ndim = len(global_shape)
    flat = tf.zeros([1] * ndim, tf.uint64)
    for axis in range(ndim):
        idx = tf.cast(begin[axis] + tf.range(slice_shape[axis], dtype=tf.int64), tf.uint64)
        shape = [1] * ndim
        shape[axis] = slice_shape[axis]
        flat = flat * tf.constant(global_shape[axis], tf.uint64) + tf.reshape(idx, shape)
    return flat


@tf.function(autograph=False)
def _slice_normals_tf(begin, global_shape, slice_shape, key):
    """The float64 deviates of a slice, as one TF function.

    Traced once per (shapes, key) and graph: building its ~170 ops in Python
    costs ~0.5 s, which would otherwise be paid for every slice of a
    PlacementMeshImpl lowering. ``begin`` is an int64 tensor; the other
    arguments are python values.
    """
    return _normal_from_index(_global_flat_index(begin, global_shape, slice_shape), key, _TFOps)


def _check_shape(global_shape):
    global_shape = [int(n) for n in global_shape]
    if not global_shape or any(n < 1 for n in global_shape):
        raise ValueError("global_shape must be a non-empty list of positive sizes, got %s"
                         % (global_shape,))
    if int(np.prod(global_shape, dtype=object)) >= 2**62:
        raise ValueError("global_shape %s has 2^62 cells or more" % (global_shape,))
    return global_shape


# ----------------------------------------------------------------------- public API
def white_noise_numpy(seed, global_shape, dtype=np.float64):
    """The full white-noise field, in numpy (reference implementation).

    Parameters
    ----------
    seed : int
        Seed (any integer, modulo 2^64).
    global_shape : sequence of int
        Shape of the whole field [cells].
    dtype : numpy dtype, optional
        Output dtype; values are computed in float64 and rounded once.

    Returns
    -------
    ndarray
        Standard normal deviates [dimensionless] of shape ``global_shape``,
        bit-identical to :func:`white_noise_slice` and :func:`white_noise`.
    """
    global_shape = _check_shape(global_shape)
    n = np.arange(int(np.prod(global_shape)), dtype=np.uint64).reshape(global_shape)
    return _normal_from_index(n, seed_key(seed), _NumpyOps).astype(dtype)


def white_noise_slice(seed, global_shape, begin, slice_shape, dtype=tf.float32, use_native=None):
    """One slice of the white-noise field, in TensorFlow (usable inside a slicewise op).

    Parameters
    ----------
    seed : int
        Seed (python integer, modulo 2^64).
    global_shape : sequence of int
        Shape of the whole field [cells].
    begin : sequence of int or 1-d integer tf.Tensor
        Global index of the slice's first cell along each axis.
    slice_shape : sequence of int
        Static shape of the slice [cells].
    dtype : tf.DType, optional
        Output dtype (float32 or float64); computed in float64, rounded once.
    use_native : bool, optional
        False: the TensorFlow ops even where the native op would serve (tests);
        default: the native op on the CPU when it is built.

    Returns
    -------
    tf.Tensor
        ``slice_shape`` standard normal deviates equal, bit for bit, to
        ``white_noise_numpy(seed, global_shape)[begin[0]:begin[0]+slice_shape[0], ...]``.
    """
    global_shape = _check_shape(global_shape)
    slice_shape = [int(n) for n in slice_shape]
    ndim = len(global_shape)
    if len(slice_shape) != ndim:
        raise ValueError("slice_shape %s and global_shape %s differ in rank"
                         % (slice_shape, global_shape))
    dtype = tf.as_dtype(dtype)
    if dtype not in (tf.float32, tf.float64, tf.bfloat16, tf.float16):
        raise ValueError("white noise dtype must be floating, got %s" % dtype)
    key = seed_key(seed)
    with tf.name_scope("white_noise_slice"):
        if isinstance(begin, (list, tuple)) and all(isinstance(b, (int, np.integer)) for b in begin):
            begin = tf.constant([int(b) for b in begin], tf.int64)
        begin = tf.cast(tf.reshape(tf.convert_to_tensor(begin), [ndim]), tf.int64)
        # the op's float type is that of its output, not of begin (int64): checked here
        lib = (native.ops_for("noise_ops", begin, dtypes=None)
               if use_native is not False and dtype in (tf.float32, tf.float64) else None)
        if lib is not None:
            return lib.flowpm_white_noise(begin, T=dtype, global_shape=global_shape,
                                          slice_shape=slice_shape,
                                          key=key - (1 << 64) if key >= 1 << 63 else key)
        z = _slice_normals_tf(begin, tuple(global_shape), tuple(slice_shape), key)
        return tf.cast(z, dtype)


class WhiteNoiseOperation(mtf.Operation):
    """Mesh TF operation producing decomposition-independent white noise.

    Lowering builds, on each processor, :func:`white_noise_slice` at that
    processor's slice begin, looked up in a constant table (one row per
    processor number, from ``mesh_impl.slice_begin``) with
    ``mesh_impl.laid_out_pnum()``: the same code lowers on any MeshImpl
    (``PlacementMeshImpl``, SIMD implementations with one slice per process).

    Parameters
    ----------
    mesh : mtf.Mesh
    shape : mtf.Shape or list of mtf.Dimension
    seed : int
    dtype : tf.DType
    name : str, optional
    """

    def __init__(self, mesh, shape, seed, dtype=tf.float32, name=None):
        super().__init__([], mesh=mesh, name=name or "white_noise")
        self._shape = mtf.convert_to_shape(shape)
        self._seed = int(seed)
        seed_key(self._seed)  # validate early
        self._outputs = [mtf.Tensor(self, self._shape, tf.as_dtype(dtype))]

    def gradient(self, grad_ys):
        return []

    def lower(self, lowering):
        mesh_impl = lowering.mesh_impl(self)
        shape = self._shape
        slice_shape = mesh_impl.slice_shape(shape)
        begins = np.array([mesh_impl.slice_begin(shape, p) for p in range(mesh_impl.size)],
                          dtype=np.int64).reshape(mesh_impl.size, shape.ndims)
        global_shape = shape.to_integer_list
        dtype = self.outputs[0].dtype
        seed = self._seed

        def fn(pnum):
            table = tf.constant(begins, tf.int64)
            begin = tf.gather(table, tf.cast(pnum, tf.int32))
            return white_noise_slice(seed, global_shape, begin, slice_shape, dtype)

        laid_out = mesh_impl.slicewise(fn, mesh_impl.laid_out_pnum())
        lowering.set_tensor_lowering(self.outputs[0], laid_out)


def white_noise(mesh, shape, seed, dtype=tf.float32, name=None):
    """Gaussian white noise on ``shape``, identical for every layout and processor grid.

    Parameters
    ----------
    mesh : mtf.Mesh
    shape : mtf.Shape or list of mtf.Dimension
        Shape of the field (e.g. ``[nx, ny, nz]`` dimensions [cells]).
    seed : int
        Seed (any integer, modulo 2^64).
    dtype : tf.DType, optional
        Output dtype.
    name : str, optional

    Returns
    -------
    mtf.Tensor
        Standard normal deviates [dimensionless] equal, bit for bit, to
        ``white_noise_numpy(seed, shape.to_integer_list)``.
    """
    return WhiteNoiseOperation(mesh, shape, seed, dtype, name).outputs[0]
