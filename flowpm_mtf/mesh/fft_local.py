"""Local (per-rank, in-memory) FFTs along one axis of a ``tf.Tensor``, with exact gradients.

Every 1D stage of the distributed 3D FFT (:mod:`flowpm_mtf.mesh.fft`) runs here:
:func:`fft_along` (complex), :func:`fft_of_real_along` / :func:`ifft_real_part_along`
(real input / real output, all ``n`` modes), :func:`rfft_along` / :func:`irfft_along`
(``numpy.fft.rfft`` / ``irfft``), :func:`rfft_packed_along` /
:func:`irfft_packed_along` (the Nyquist mode packed into the zero mode's slot), and
the mirror-pair completion of a rank's 3D block, :func:`pairs_extend` /
:func:`pairs_fold`. The transforms can read and write the pieces of an all-to-all
(``in_blocks`` / ``out_blocks``) and the mirror-pair order of k-space
(``in_pairs`` / ``out_pairs``, :func:`flowpm_mtf.layout.k_order`). This module
imports neither Mesh TF nor :mod:`flowpm_mtf.mesh.fft`.

Native op or TensorFlow
-----------------------
On the CPU the transforms are the FFTW custom ops of ``flowpm_mtf/native/fft_ops.cc``
(built by ``scripts/setup_env.sh``, i.e. ``python -m flowpm_mtf.native.build``):
TensorFlow's CPU FFT (Eigen) is several times slower than FFTW at powers of two and
over an order of magnitude slower at other lengths (e.g. 192). The op transforms along any axis without transposes, runs on TensorFlow's
intra-op thread pool (sized per rank by ``hvd_mesh_impl.runtime.session_config``)
and carries its exact gradient (registered in this module). On a GPU (the device of
the sliced tensor, or no device with a visible GPU, see :func:`uses_native` and
:func:`flowpm_mtf.native.runs_on_cpu`) the path stays ``tf.signal`` (cuFFT); it
builds the same graph as before and is documented but not testable on this CPU-only
machine. ``FLOWPM_MTF_NATIVE=0`` forces the TensorFlow path, ``require`` fails when
the op is not built (the test suite sets it).

Gradients
---------
TensorFlow's convention for a real loss ``L`` and a complex tensor
``z = a + i b`` is ``grad z = dL/da + i dL/db``; for a complex-linear map ``A``
this gives ``grad x = A^H grad y`` (conjugate transpose). The gradients of the
native ops (``FlowpmFftC2c``, ``FlowpmFftR2c``, ``FlowpmFftC2r``, ``FlowpmPairs``)
are registered below, after the functions that call them, with their derivation;
the TensorFlow path has TensorFlow's own. Tested by dot-product and
finite-difference tests in ``tests/test_native_fft.py``.
"""
import numpy as np
import tensorflow.compat.v1 as tf

from .. import layout
from .. import native


# ----------------------------------------------------------------------------- dtypes
def complex_dtype(dtype):
    """The complex dtype of a real or complex ``dtype`` (complex128 for 64-bit parts)."""
    return tf.complex128 if dtype in (tf.float64, tf.complex128) else tf.complex64


def real_dtype(dtype):
    """The real dtype of a real or complex ``dtype`` (float64 for 64-bit parts)."""
    return tf.float64 if dtype in (tf.float64, tf.complex128) else tf.float32


def _along(fn, t, axis):
    """Apply the innermost-axis TF transform ``fn`` along ``axis`` of ``t``."""
    last = t.shape.ndims - 1
    if axis == last:
        return fn(t)
    perm = list(range(last + 1))
    perm[axis], perm[last] = last, axis
    return tf.transpose(fn(tf.transpose(t, perm)), perm)


# ----------------------------------------------------------------------------- local 1D FFTs
def uses_native(t):
    """Whether the local FFTs of ``t`` run on the native FFTW op.

    The native op (``flowpm_mtf/native/fft_ops.cc``) is a CPU kernel. It is used
    when it is built (see :func:`flowpm_mtf.native.load`; ``FLOWPM_MTF_NATIVE``)
    and the computation is on the CPU (:func:`flowpm_mtf.native.runs_on_cpu`: the
    device of ``t`` is a CPU, or ``t`` is unplaced and TensorFlow sees no GPU; an
    unplaced op goes to the GPU when there is one). On a GPU the TensorFlow ops
    (cuFFT) are the path.

    Parameters
    ----------
    t : tf.Tensor

    Returns
    -------
    bool
    """
    return native.ops_for("fft_ops", t, dtypes=None) is not None


def _axis(t, axis):
    ndims = t.shape.ndims
    if ndims is None or not -ndims <= axis < ndims:
        raise ValueError("axis %r out of range for a tensor of shape %s" % (axis, t.shape))
    return axis % ndims


def _pair_gather(t, axis, to_stored):
    """TensorFlow path of the mirror-pair orders: ``t`` permuted along ``axis``,
    numpy order -> stored order (``to_stored``) or back."""
    n = tf.compat.dimension_value(t.shape[axis])
    return tf.gather(t, (layout.k_order if to_stored else layout.k_positions)(n), axis=axis)


def _blocked_kwargs(t, axis, in_blocks, out_blocks):
    """(logical axis, op attrs) of a transform with blocked layouts (native only)."""
    in_blocks, out_blocks = int(in_blocks), int(out_blocks)
    if in_blocks == 1 and out_blocks == 1:
        return _axis(t, axis), {}
    if not uses_native(t):
        raise ValueError("blocked layouts (in_blocks=%d, out_blocks=%d) need the native FFT op"
                         % (in_blocks, out_blocks))
    ndims = t.shape.ndims - (1 if in_blocks > 1 else 0)
    if not -ndims <= axis < ndims:
        raise ValueError("axis %r out of range for the logical rank %d of %s"
                         % (axis, ndims, t.shape))
    return axis % ndims, dict(in_blocks=in_blocks, out_blocks=out_blocks)


def _logical_length(t, axis, in_blocks):
    """Length of logical ``axis`` of ``t`` stored with ``in_blocks`` blocks."""
    if in_blocks == 1:
        return tf.compat.dimension_value(t.shape[axis])
    return tf.compat.dimension_value(t.shape[axis + 1]) * in_blocks


def fft_along(t, axis, inverse=False, normalized=None, in_blocks=1, out_blocks=1,
              in_pairs=False, out_pairs=False):
    """1D complex FFT along one axis: ``numpy.fft.fft`` / ``numpy.fft.ifft``.

    Parameters
    ----------
    t : tf.Tensor
        complex64 or complex128.
    axis : int
    inverse : bool
        False: ``sum_k t[k] exp(-2 pi i j k / n)``; True: the sum with
        ``exp(+2 pi i j k / n)``.
    normalized : bool, optional
        Multiply by ``1 / n``; default: ``inverse`` (numpy's convention).
    in_blocks, out_blocks : int
        Native op only: ``t`` / the result stored as the pieces of an all-to-all,
        ``[blocks, .., len / blocks along axis, ..]`` (``axis`` counts the axes of
        the unblocked array). The copies in and out of the op's panels read and
        write that layout, so the exchange needs no transpose.
    in_pairs, out_pairs : bool
        ``t`` / the result in the mirror-pair order of :func:`flowpm_mtf.layout.k_order`
        along ``axis`` instead of numpy's order (native: the panel copies permute the
        rows; TensorFlow: a gather).

    Returns
    -------
    tf.Tensor
        Same shape (up to the blocked layouts) and dtype as ``t``.

    Notes
    -----
    On the CPU (see :func:`uses_native`) this is the FFTW op
    ``FlowpmFftC2c``, whose gradient (registered below) is the adjoint: the
    transform of the opposite sign with the same normalisation. Elsewhere it is
    ``tf.signal.fft`` / ``ifft`` (moving ``axis`` last), times ``n`` or ``1 / n``
    when ``normalized`` is not numpy's convention.
    """
    axis, blocks = _blocked_kwargs(t, axis, in_blocks, out_blocks)
    inverse = bool(inverse)
    normalized = inverse if normalized is None else bool(normalized)
    if uses_native(t):
        return native.load("fft_ops").flowpm_fft_c2c(
            t, axis=axis, inverse=inverse, normalized=normalized, in_pairs=bool(in_pairs),
            out_pairs=bool(out_pairs), **blocks)
    if in_pairs:
        t = _pair_gather(t, axis, to_stored=False)
    y = _along(tf.signal.ifft if inverse else tf.signal.fft, t, axis)
    if normalized != inverse:
        n = tf.compat.dimension_value(t.shape[axis])
        y = y * tf.constant(1.0 / n if normalized else float(n), t.dtype)
    return _pair_gather(y, axis, to_stored=True) if out_pairs else y


def fft_of_real_along(t, axis, normalized=False, in_blocks=1, out_blocks=1, out_pairs=False):
    """All ``n`` modes of the FFT of a real tensor along one axis: ``numpy.fft.fft(t)``.

    Parameters
    ----------
    t : tf.Tensor
        float32 or float64.
    axis : int
    normalized : bool
        Multiply by ``1 / n``.
    in_blocks, out_blocks : int
        Blocked layouts (native only), as in :func:`fft_along`.
    out_pairs : bool
        The result in mirror-pair order, as in :func:`fft_along`.

    Returns
    -------
    tf.Tensor
        complex64 or complex128, same shape as ``t`` (up to the blocked layouts).

    Notes
    -----
    Native: one real-to-complex FFT (half the work of a complex one) whose
    upper half is written as the complex conjugates of the lower, with no
    cast of the input to complex. TensorFlow path: cast, then :func:`fft_along`.
    """
    axis, blocks = _blocked_kwargs(t, axis, in_blocks, out_blocks)
    if uses_native(t):
        return native.load("fft_ops").flowpm_fft_r2c(t, Tcomplex=complex_dtype(t.dtype),
                                                     axis=axis, normalized=bool(normalized),
                                                     full=True, out_pairs=bool(out_pairs),
                                                     **blocks)
    return fft_along(tf.cast(t, complex_dtype(t.dtype)), axis, False, normalized,
                     out_pairs=out_pairs)


def ifft_real_part_along(t, axis, normalized=True, in_blocks=1, out_blocks=1, in_pairs=False):
    """Real part of the inverse FFT along one axis: ``numpy.fft.ifft(t).real``.

    Parameters
    ----------
    t : tf.Tensor
        complex64 or complex128 (any, not necessarily Hermitian).
    axis : int
    normalized : bool
        Multiply by ``1 / n`` (numpy's convention); False: the unnormalised sum.
    in_blocks, out_blocks : int
        Blocked layouts (native only), as in :func:`fft_along`.
    in_pairs : bool
        ``t`` in mirror-pair order, as in :func:`fft_along`.

    Returns
    -------
    tf.Tensor
        float32 or float64, same shape as ``t`` (up to the blocked layouts).

    Notes
    -----
    Native: one complex-to-real FFT of the Hermitian part
    ``(t_k + conj(t_{n-k})) / 2`` (half the work, no complex output buffer).
    TensorFlow path: :func:`fft_along` then the real part.
    """
    axis, blocks = _blocked_kwargs(t, axis, in_blocks, out_blocks)
    if uses_native(t):
        n = _logical_length(t, axis, int(in_blocks))
        return native.load("fft_ops").flowpm_fft_c2r(t, Treal=real_dtype(t.dtype), n=n,
                                                     axis=axis, normalized=bool(normalized),
                                                     full=True, in_pairs=bool(in_pairs),
                                                     **blocks)
    return tf.math.real(fft_along(t, axis, True, normalized, in_pairs=in_pairs))


def rfft_along(t, axis):
    """Real-to-complex 1D FFT along one axis: ``numpy.fft.rfft``.

    Parameters
    ----------
    t : tf.Tensor
        float32 or float64, length ``n`` along ``axis``.
    axis : int

    Returns
    -------
    tf.Tensor
        complex64 or complex128, length ``n // 2 + 1`` along ``axis``.
    """
    axis = _axis(t, axis)
    if uses_native(t):
        return native.load("fft_ops").flowpm_fft_r2c(t, Tcomplex=complex_dtype(t.dtype),
                                                     axis=axis, normalized=False)
    n = tf.compat.dimension_value(t.shape[axis])
    return _along(lambda u: tf.signal.rfft(u, fft_length=[n]), t, axis)


def irfft_along(t, n, axis):
    """Complex-to-real inverse 1D FFT along one axis: ``numpy.fft.irfft``.

    Parameters
    ----------
    t : tf.Tensor
        complex64 or complex128, length ``n // 2 + 1`` along ``axis`` (the
        non-negative frequencies; the imaginary parts of the zero and, for even
        ``n``, Nyquist modes are ignored).
    n : int
        Output length along ``axis``.
    axis : int

    Returns
    -------
    tf.Tensor
        float32 or float64, length ``n`` along ``axis``, with the factor ``1 / n``.
    """
    axis = _axis(t, axis)
    m = tf.compat.dimension_value(t.shape[axis])
    if m is not None and m != n // 2 + 1:
        raise ValueError("irfft_along: axis %d has length %d, expected n // 2 + 1 = %d"
                         % (axis, m, n // 2 + 1))
    if uses_native(t):
        return native.load("fft_ops").flowpm_fft_c2r(t, Treal=real_dtype(t.dtype), n=int(n),
                                                     axis=axis, normalized=True)
    return _along(lambda u: tf.signal.irfft(u, fft_length=[n]), t, axis)


def rfft_packed_along(t, axis, normalized=False, out_blocks=1):
    """``numpy.fft.rfft`` along the last axis, the Nyquist mode packed into the zero mode.

    Parameters
    ----------
    t : tf.Tensor
        float32 or float64, even length ``n`` along ``axis`` (the last axis).
    axis : int
    normalized : bool
        Multiply by ``1 / n``.
    out_blocks : int
        Native only: the result stored as the pieces of an all-to-all (see
        :func:`fft_along`).

    Returns
    -------
    tf.Tensor
        complex64 or complex128, ``n // 2`` values along ``axis``: ``r[k]`` for
        ``0 < k < n/2`` and ``r[0] + i r[n/2]`` in slot 0 (both real for a real
        input), with ``r = numpy.fft.rfft(t)``.
    """
    axis = _axis(t, axis)
    if axis != t.shape.ndims - 1:
        raise ValueError("rfft_packed_along: axis %d is not the last axis of %s" % (axis, t.shape))
    if uses_native(t):
        return native.load("fft_ops").flowpm_fft_r2c(
            t, Tcomplex=complex_dtype(t.dtype), axis=axis, normalized=bool(normalized),
            packed=True, out_blocks=int(out_blocks))
    if int(out_blocks) != 1:
        raise ValueError("rfft_packed_along: out_blocks needs the native FFT op")
    n = tf.compat.dimension_value(t.shape[axis])
    r = rfft_along(t, axis)
    if normalized:
        r = r * tf.constant(1.0 / n, r.dtype)
    slot0 = tf.complex(tf.math.real(r[..., :1]), tf.math.real(r[..., n // 2:]))
    return tf.concat([slot0, r[..., 1:n // 2]], axis=-1)


def irfft_packed_along(t, n, axis, normalized=True, in_blocks=1):
    """Inverse of :func:`rfft_packed_along`: ``numpy.fft.irfft`` of the unpacked modes.

    Parameters
    ----------
    t : tf.Tensor
        complex64 or complex128, ``n // 2`` values along ``axis`` (the last axis):
        slot 0 holds the zero mode (real part) and the Nyquist mode (imaginary part).
    n : int
        Even output length.
    axis : int
    normalized : bool
        Multiply by ``1 / n`` (numpy's ``irfft``); False: the unnormalised sum.
    in_blocks : int
        Native only: ``t`` stored as the pieces of an all-to-all.

    Returns
    -------
    tf.Tensor
        float32 or float64, ``n`` values along ``axis``.
    """
    in_blocks = int(in_blocks)
    ndims = t.shape.ndims - (1 if in_blocks > 1 else 0)
    axis = axis % ndims
    if axis != ndims - 1:
        raise ValueError("irfft_packed_along: axis %d is not the last axis" % axis)
    if uses_native(t):
        return native.load("fft_ops").flowpm_fft_c2r(
            t, Treal=real_dtype(t.dtype), n=int(n), axis=axis, normalized=bool(normalized),
            packed=True, in_blocks=in_blocks)
    if in_blocks != 1:
        raise ValueError("irfft_packed_along: in_blocks needs the native FFT op")
    zero = tf.complex(tf.math.real(t[..., :1]), tf.zeros_like(tf.math.real(t[..., :1])))
    nyq = tf.complex(tf.math.imag(t[..., :1]), tf.zeros_like(tf.math.real(t[..., :1])))
    y = irfft_along(tf.concat([zero, t[..., 1:], nyq], axis=-1), n, axis)
    return y if normalized else y * tf.constant(float(n), y.dtype)


# ----------------------------------------------------------------------------- gradients
def _half_weights(n, ndims, axis, dtype, interior):
    """Weights along the half spectrum (``n // 2 + 1`` modes), broadcastable on ``axis``:
    1 for the zero mode and the Nyquist mode of an even ``n``, ``interior`` for the others."""
    w = np.full(n // 2 + 1, interior)
    w[0] = 1.0
    if n % 2 == 0:
        w[-1] = 1.0
    return tf.constant(w.reshape((-1,) + (1,) * (ndims - axis - 1)), dtype)


# Exact gradients of the native ops (TF convention grad z = dL/dRe z + i dL/dIm z,
# so a complex-linear map A has the gradient A^H dy).
# y = c D x with D the unnormalised DFT of sign -+ and c = 1/n if normalized else 1:
#   c2c: grad x = c D^H dy = the opposite-sign transform with the same c;
#   r2c: y_k = c sum_j x_j e^(-2 pi i jk/n), k < n//2+1, x real:
#        grad x_j = c Re sum_k dy_k e^(+2 pi i jk/n) = c2r(w dy), w = 1 at k = 0 and
#        k = n/2, 1/2 elsewhere (c2r counts the other modes twice);
#   c2r: y_j = c (Re x_0 + 2 Re sum_{0<k<n/2} x_k e^(+...) + Re x_{n/2} (-1)^j):
#        grad x = w' r2c(dy), w' = 1 at k = 0 and k = n/2, 2 elsewhere;
#   full r2c (all n modes of a real input) and full c2r (y = c Re sum_k x_k e^(+...)):
#        each other's adjoint, grad x_j = c Re sum_k dy_k e^(+...) = c2r_full(dy) and
#        grad x_k = c sum_j dy_j e^(-...) = r2c_full(dy).
# Blocked layouts are permutations of the elements: the gradient reads dy in the
# output's layout and writes the input's (in_blocks and out_blocks swapped).
# Tested by dot-product and finite-difference tests in tests/test_native_fft.py.
# Mirror-pair orders (in_pairs / out_pairs) are permutations too: swapped likewise.
# Packed (n // 2 values, slot 0 = r_0 + i r_{n/2}): y_0 = c (sum_j x_j + i sum_j (-1)^j x_j),
# so grad x_j = c (Re dy_0 + (-1)^j Im dy_0 + Re sum_{0<k<n/2} dy_k e^(+...)), the packed
# c2r of w dy with w = 1 in slot 0 and 1/2 elsewhere; for the packed c2r, w' = 1 and 2.
def _swapped_blocks(op):
    return dict(in_blocks=op.get_attr("out_blocks"), out_blocks=op.get_attr("in_blocks"))


def _packed_weights(h, ndims, blocks, dtype, interior):
    """Weights over the ``h`` packed slots of the last axis (1 in slot 0, ``interior``
    elsewhere), broadcastable on a tensor of logical rank ``ndims`` stored in
    ``blocks`` blocks of that axis."""
    w = np.full(h, interior)
    w[0] = 1.0
    if blocks > 1:
        return tf.constant(w.reshape((blocks,) + (1,) * (ndims - 1) + (h // blocks,)), dtype)
    return tf.constant(w, dtype)


@tf.RegisterGradient("FlowpmFftC2c")
def _c2c_grad(op, dy):
    return native.load("fft_ops").flowpm_fft_c2c(
        dy, axis=op.get_attr("axis"), inverse=not op.get_attr("inverse"),
        normalized=op.get_attr("normalized"), in_pairs=op.get_attr("out_pairs"),
        out_pairs=op.get_attr("in_pairs"), **_swapped_blocks(op))


@tf.RegisterGradient("FlowpmFftR2c")
def _r2c_grad(op, dy):
    axis, x = op.get_attr("axis"), op.inputs[0]
    n = _logical_length(x, axis, op.get_attr("in_blocks"))
    kw = dict(Treal=x.dtype, n=n, axis=axis, normalized=op.get_attr("normalized"))
    if op.get_attr("full"):
        return native.load("fft_ops").flowpm_fft_c2r(
            dy, full=True, in_pairs=op.get_attr("out_pairs"), **kw, **_swapped_blocks(op))
    if op.get_attr("packed"):
        blocks = op.get_attr("out_blocks")
        w = _packed_weights(n // 2, axis + 1, blocks, dy.dtype, 0.5)
        return native.load("fft_ops").flowpm_fft_c2r(dy * w, packed=True, **kw,
                                                     **_swapped_blocks(op))
    w = _half_weights(n, x.shape.ndims, axis, dy.dtype, 0.5)
    return native.load("fft_ops").flowpm_fft_c2r(dy * w, **kw)


@tf.RegisterGradient("FlowpmFftC2r")
def _c2r_grad(op, dy):
    axis, n = op.get_attr("axis"), op.get_attr("n")
    x = op.inputs[0]
    kw = dict(Tcomplex=x.dtype, axis=axis, normalized=op.get_attr("normalized"))
    if op.get_attr("full"):
        return native.load("fft_ops").flowpm_fft_r2c(
            dy, full=True, out_pairs=op.get_attr("in_pairs"), **kw, **_swapped_blocks(op))
    if op.get_attr("packed"):
        blocks = op.get_attr("in_blocks")
        w = _packed_weights(n // 2, axis + 1, blocks, x.dtype, 2.0)
        return w * native.load("fft_ops").flowpm_fft_r2c(dy, packed=True, **kw,
                                                         **_swapped_blocks(op))
    w = _half_weights(n, x.shape.ndims, axis, x.dtype, 2.0)
    return w * native.load("fft_ops").flowpm_fft_r2c(dy, **kw)


# ----------------------------------------------------------------------------- mirror pairs
def pairs_extend(t, firsts):
    """Full spectrum of a real field's 3D transform from its mirror-pair representatives.

    Parameters
    ----------
    t : tf.Tensor
        complex64 or complex128 ``[nx, ly, h]``: ``kx`` (all ``nx`` modes) and a
        block of ``ly`` ``ky`` positions in mirror-pair order
        (:func:`flowpm_mtf.layout.k_order`; ``nx``, ``ly`` even), and the
        representatives ``j`` of the ``h`` pairs of a ``kz`` block; in the first
        ``kz`` block, slot 0 holds the zero and Nyquist modes as ``A + i B``
        (:func:`rfft_packed_along` then FFTs along ``y`` and ``x``).
    firsts : tf.Tensor
        int32 ``[2]``: whether the ``ky`` and the ``kz`` block are the first (0/1).

    Returns
    -------
    tf.Tensor
        ``[nx, ly, 2 h]``, the ``kz`` block in mirror-pair order: position ``2 j``
        the representative, ``2 j + 1`` its mirror ``conj(t[-kx, -ky, j])``; in
        the first block, ``A`` and ``B`` unpacked with the Hermitian symmetry of each
        (``A = (P + conj(P(-k))) / 2``, ``B = (P - conj(P(-k))) / 2i``). Native op
        ``FlowpmPairs`` (one pass); CPU only.
    """
    return native.load("fft_ops").flowpm_pairs(t, firsts, fold=False)


def pairs_fold(t, firsts):
    """Hermitian part of a 3D spectrum in mirror-pair order, the representatives kept.

    Parameters
    ----------
    t : tf.Tensor
        complex64 or complex128 ``[nx, ly, 2 h]`` (see :func:`pairs_extend`).
    firsts : tf.Tensor
        int32 ``[2]``, as in :func:`pairs_extend`.

    Returns
    -------
    tf.Tensor
        ``[nx, ly, h]``: ``(t[k] + conj(t[-k])) / 2`` at the representative of each
        ``kz`` pair; in the first ``kz`` block, slot 0 packs the Hermitian parts of
        the zero and Nyquist modes as ``A + i B``. Its inverse transform (FFTs over
        ``x``, ``y``, then :func:`irfft_packed_along`) is the real part of the inverse
        transform of ``t``. Native op ``FlowpmPairs``; CPU only.
    """
    return native.load("fft_ops").flowpm_pairs(t, firsts, fold=True)


# Gradients of FlowpmPairs (R-linear; conj has the gradient conj(dy) in TF's convention):
# extend writes y[2j] = x[j], y[2j+1] = conj(x[-k, j]), so grad x[j] = dy[2j] +
# conj(dy[-k, 2j+1]) = 2 fold(dy)[j]; in the packed slot the gradient of
# (P + conj(P')) / 2, (P - conj(P')) / 2i is exactly fold's A + i B of dy. Likewise
# grad fold = extend(dy) / 2, and extend(dy) in the packed slots. Tested by dot-product
# tests in tests/test_native_fft.py.
def _pairs_slot_weights(firsts, length, dtype, packed_slots, packed, interior):
    """Weights over the ``length`` kz positions: ``packed`` on the first ``packed_slots``
    of the first kz block, ``interior`` elsewhere."""
    first = tf.cast(firsts[1], tf.bool)
    slot = tf.range(length) < packed_slots
    w = tf.where(tf.logical_and(first, slot), tf.fill([length], packed),
                 tf.fill([length], interior))
    return tf.cast(w, dtype)


@tf.RegisterGradient("FlowpmPairs")
def _pairs_grad(op, dy):
    firsts = op.inputs[1]
    ops = native.load("fft_ops")
    if op.get_attr("fold"):
        g = ops.flowpm_pairs(dy, firsts, fold=False)
        w = _pairs_slot_weights(firsts, tf.shape(g)[2], g.dtype, 2, 1.0, 0.5)
    else:
        g = ops.flowpm_pairs(dy, firsts, fold=True)
        w = _pairs_slot_weights(firsts, tf.shape(g)[2], g.dtype, 1, 1.0, 2.0)
    return [g * w, None]
