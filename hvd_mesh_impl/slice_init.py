"""Initial values of variable *slices*, computed without the full-size tensor.

:class:`~hvd_mesh_impl.HvdSimdMeshImpl` keeps no full-size master copy of a Mesh
TF variable: each rank evaluates the variable's initializer on its own slice
(no Horovod import here).

* ``zeros`` / ``ones`` / scalar ``constant`` initializers, and those with a
  ``fill_value`` (:func:`unfolded_zeros_initializer`, the zeros every Mesh TF
  variable of the packages starts from, which TensorFlow cannot constant-fold
  into a full-size constant), are evaluated on the slice shape; a ``constant``
  initializer holding a full-size numpy array is sliced in Python (only the slice
  enters the TF graph).
* Random initializers (``random_uniform``, ``random_normal``,
  ``truncated_normal``, ``variance_scaling`` and its Glorot/He/LeCun forms, and
  TF's default Glorot-uniform for floating variables without an initializer)
  draw each element from a counter-based generator keyed by the initializer's
  seed (or, without one, the variable's name) and the element's **global**
  row-major index. The variable is therefore the same for every process grid
  and layout (a 1x1 mesh included), ranks that hold the same (replicated)
  slice agree without communication, and no element depends on the slice
  boundaries. The numbers follow the initializer's distribution but are not
  the ones TensorFlow's stateful random ops would draw for the full tensor
  (Mesh TF's ``PlacementMeshImpl`` gives those).
* Any other initializer (orthogonal, identity, user functions) is evaluated on
  the full shape and sliced, which is allowed only up to ``max_full_elements``
  (:class:`FullSizeError` above it).
"""
import hashlib

import numpy as np
import tensorflow.compat.v1 as tf

_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_MASK64 = (1 << 64) - 1
# stddev of a standard normal truncated at +-2 (TF's variance_scaling constant)
_TRUNC_STD = 0.87962566103423978


class FullSizeError(ValueError):
    """An operation would hold a full-size tensor on one rank above the allowed size."""


def check_full_size(n_elements, limit, what):
    """Raise :class:`FullSizeError` if a full tensor of ``n_elements`` exceeds ``limit``.

    Parameters
    ----------
    n_elements : int
        Elements of the full (global) tensor.
    limit : int or None
        ``max_full_elements`` of the mesh implementation (None: no limit).
    what : str
        What needs the full tensor, for the message.
    """
    if limit is not None and n_elements > limit:
        raise FullSizeError(
            "%s needs the full tensor of %d elements on one rank, above the limit of %d "
            "(HvdSimdMeshImpl(max_full_elements=...) or FLOWPM_MTF_MAX_FULL_ELEMENTS); "
            "work on this rank's slice instead (hvd_mesh_impl.export_local_slice)"
            % (what, n_elements, limit))


def stable_key(*parts):
    """A 64-bit key from the repr of ``parts`` (SHA-256; unlike ``hash``, not salted)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little")


def global_flat_index(full_shape, begin, slice_shape):
    """Row-major index in the full tensor of every element of a slice (int64 tensor)."""
    strides = [int(np.prod(full_shape[i + 1:])) for i in range(len(full_shape))]
    flat = tf.zeros(slice_shape, tf.int64)
    for axis, (b, n, s) in enumerate(zip(begin, slice_shape, strides)):
        shape = [1] * len(slice_shape)
        shape[axis] = n
        flat = flat + tf.reshape(tf.range(b, b + n, dtype=tf.int64) * s, shape)
    return flat


def _splitmix64(z):
    """SplitMix64 finaliser on a uint64 tensor (wrapping arithmetic)."""
    def u64(c):
        return tf.constant(c, tf.uint64)

    z = tf.bitwise.bitwise_xor(z, tf.bitwise.right_shift(z, u64(30))) * u64(_MIX1)
    z = tf.bitwise.bitwise_xor(z, tf.bitwise.right_shift(z, u64(27))) * u64(_MIX2)
    return tf.bitwise.bitwise_xor(z, tf.bitwise.right_shift(z, u64(31)))


def uniform_from_index(key, flat_index):
    """Uniform float64 numbers in (0, 1), one per global index (SplitMix64 stream ``key``).

    Element ``i`` is ``mix(key + (i + 1) * golden)``: SplitMix64's ``i``-th output.
    """
    state = tf.bitcast(flat_index + 1, tf.uint64) * tf.constant(_GOLDEN, tf.uint64)
    state = state + tf.constant(key & _MASK64, tf.uint64)
    bits = tf.bitwise.right_shift(_splitmix64(state), tf.constant(11, tf.uint64))
    return (tf.cast(bits, tf.float64) + 0.5) * 2.0**-53


def uniform_from_index_np(key, flat_index):
    """Numpy reference of :func:`uniform_from_index` (for tests)."""
    with np.errstate(over="ignore"):
        z = (np.asarray(flat_index, np.uint64) + np.uint64(1)) * np.uint64(_GOLDEN)
        z = z + np.uint64(key & _MASK64)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
        z = z ^ (z >> np.uint64(31))
    return ((z >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53


def _normal(u, truncate):
    """Standard normal (optionally truncated at +-2) by the inverse CDF of ``u``."""
    if truncate:
        lo, hi = 0.022750131948179195, 0.9772498680518208  # Phi(-2), Phi(2)
        u = lo + u * (hi - lo)
    return tf.math.ndtri(u)


def _compute_fans(shape):
    """(fan_in, fan_out) as TensorFlow's initializers compute them."""
    if len(shape) < 1:
        return 1, 1
    if len(shape) == 1:
        return shape[0], shape[0]
    if len(shape) == 2:
        return shape[0], shape[1]
    receptive = int(np.prod(shape[:-2]))
    return shape[-2] * receptive, shape[-1] * receptive


def _attr(init, *names, default=None):
    for n in names:
        if hasattr(init, n):
            return getattr(init, n)
    return default


def _random_spec(init, full_shape):
    """(distribution, params) of a known random initializer, or None."""
    name = type(init).__name__
    if name == "RandomUniform":
        return "uniform", (_attr(init, "minval", default=0.0), _attr(init, "maxval", default=1.0))
    if name == "RandomNormal":
        return "normal", (_attr(init, "mean", default=0.0), _attr(init, "stddev", default=1.0))
    if name == "TruncatedNormal":
        return "truncated", (_attr(init, "mean", default=0.0), _attr(init, "stddev", default=1.0))
    if hasattr(init, "scale") and hasattr(init, "mode") and hasattr(init, "distribution"):
        fan_in, fan_out = _compute_fans(list(full_shape))
        scale = float(init.scale) / max(1.0, {"fan_in": fan_in, "fan_out": fan_out,
                                              "fan_avg": (fan_in + fan_out) / 2.0}[init.mode])
        dist = init.distribution
        if dist in ("normal", "truncated_normal"):
            return "truncated", (0.0, np.sqrt(scale) / _TRUNC_STD)
        if dist == "untruncated_normal":
            return "normal", (0.0, np.sqrt(scale))
        if dist == "uniform":
            limit = np.sqrt(3.0 * scale)
            return "uniform", (-limit, limit)
    return None


def _default_initializer(dtype):
    """TensorFlow's default for ``tf.get_variable`` without an initializer."""
    if dtype.is_floating:
        return tf.glorot_uniform_initializer()
    return tf.zeros_initializer()


def unfolded_zeros_initializer():
    """A zeros initializer TensorFlow cannot constant-fold into a full-size constant.

    ``tf.zeros_initializer()`` gives a ``Fill`` of constants, which Grappler's
    constant folding turns into one ``Const`` of the full variable at the first
    run; beyond 2 GB it cannot be serialised (``Cannot parse tensor from proto
    ... Initializer/zeros``, seen at 1024^3 on one rank). Filling with a
    ``placeholder_with_default`` keeps it a ``Fill`` computed at run time.

    Every Mesh TF variable of the packages that starts at zero uses it (the graph
    builders of ``flowpm_mtf``, the optimiser, the imaging reconstructions), on any
    backend; :func:`initial_slice` reads its ``fill_value`` and fills a slice.

    Returns
    -------
    callable
        A TensorFlow initializer ``init(shape, dtype, partition_info=None)`` with the
        attribute ``fill_value = 0``.
    """
    def init(shape, dtype=tf.float32, partition_info=None):
        zero = tf.placeholder_with_default(tf.zeros([], dtype), [], name="unfoldable_zero")
        return tf.fill(shape, zero)

    # Backends that initialise each slice on its own (initial_slice) read this instead
    # of evaluating the initializer on the full shape.
    init.fill_value = 0
    return init


def initial_slice(initializer, full_shape, begin, slice_shape, dtype, name, max_full_elements):
    """The initial value of one slice of a variable.

    Parameters
    ----------
    initializer : callable or None
        The initializer given to ``mtf.get_variable`` (None: TF's default).
    full_shape, begin, slice_shape : list of int
        The variable's global shape, and this slice's start and shape in it.
    dtype : tf.DType
        The variable's (master) dtype.
    name : str
        The variable's name (seed of random initializers without a seed).
    max_full_elements : int or None
        Largest full tensor an unknown initializer may be evaluated on.

    Returns
    -------
    tf.Tensor
        Of shape ``slice_shape`` and type ``dtype``.

    Raises
    ------
    FullSizeError
        If only a full-size evaluation is possible and it exceeds the limit.
    """
    full_shape, begin, slice_shape = list(full_shape), list(begin), list(slice_shape)
    if initializer is None:
        initializer = _default_initializer(dtype)
    kind = type(initializer).__name__
    fill_value = {"Zeros": 0, "Ones": 1}.get(kind, getattr(initializer, "fill_value", None))
    if fill_value is not None:
        # A Fill of a placeholder_with_default: TF's constant folding would turn
        # tf.zeros(slice_shape) into a Const of the whole slice in the GraphDef
        # (beyond 2 GB it cannot be serialised).
        value = tf.placeholder_with_default(tf.constant(fill_value, dtype), [],
                                            name="unfoldable_fill")
        return tf.fill(slice_shape, value)
    if kind == "Constant":
        value = np.asarray(initializer.value)
        if value.size == 1:
            return tf.fill(slice_shape, tf.constant(value.reshape(()), dtype))
        if value.size == int(np.prod(full_shape)):
            index = tuple(slice(b, b + n) for b, n in zip(begin, slice_shape))
            return tf.constant(value.reshape(full_shape)[index], dtype)
    spec = _random_spec(initializer, full_shape) if dtype.is_floating else None
    if spec is not None:
        seed = _attr(initializer, "seed")
        key = stable_key("seed", seed) if seed is not None else stable_key("name", name)
        u = uniform_from_index(key, global_flat_index(full_shape, begin, slice_shape))
        dist, (a, b) = spec
        if dist == "uniform":
            x = a + (b - a) * u
        else:
            x = a + b * _normal(u, truncate=dist == "truncated")
        return tf.cast(x, dtype)
    check_full_size(int(np.prod(full_shape)), max_full_elements,
                    "the initializer %s of variable %r" % (kind, name))
    full = tf.convert_to_tensor(initializer(full_shape, dtype=dtype), dtype=dtype)
    if list(slice_shape) == list(full_shape):
        return full
    return tf.slice(full, begin, slice_shape)
