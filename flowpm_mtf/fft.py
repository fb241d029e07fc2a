"""Distributed 3D FFT on the (P, Q) pencil decomposition, with exact gradients.

Layout
------
A real-space field has the dimensions ``x, y, z`` (``x`` split over the P
ranks of mesh axis ``row``, ``y`` over the Q ranks of ``col``, ``z`` local).
Its transform has the dimensions ``kx, ky, kz`` (``kx`` local, ``ky`` on
``row``, ``kz`` on ``col``), *in the same tensor positions*: the data are
never transposed, only re-distributed. Along each k axis the modes are in
*mirror-pair order* (:func:`flowpm_mtf.layout.k_order`: ``0, n/2, 1, n-1, 2,
n-2, ..``), the same on every grid; :func:`kvec` carries it, so kernels built
from it need no care. The forward transform runs

1. 1D FFT along ``z`` (local);
2. all-to-all on ``col``: split ``z``, gather ``y``; 1D FFT along ``y``;
3. all-to-all on ``row``: split ``y``, gather ``x``; 1D FFT along ``x``;

and the inverse runs the same steps backwards. The all-to-alls are issued
through ``mesh_impl.alltoall`` inside the operation's lowering, so the code runs
on every Mesh TF ``MeshImpl``. Kernels are built as named mtf tensors on ``kx,
ky, kz`` (see :func:`kvec`); Mesh TF aligns operands by dimension name.

Half the spectrum through the exchanges
---------------------------------------
The transform of a real field (``r2c``, the gradient of ``c2r``) and the
transform to a real field (``c2r``, the gradient of ``r2c``) move ``nz / 2`` of
the ``nz`` modes through every stage and both all-to-alls, as FFTW-based
distributed FFTs (mpi4py-fft, PFFT) do (``FFT3DOperation._lower_half``; native
path, ``x, y, z`` fields with even sizes and even ``ky``, ``kz`` blocks):

* the FFT along ``z`` keeps the ``nz / 2 + 1`` non-negative modes and packs the
  two real ones, zero and Nyquist, into one slot (``r_0 + i r_{n/2}``,
  :func:`rfft_packed_along`): ``nz / 2`` values, which split evenly into the
  ``Q`` pieces of the exchange on ``col``;
* the FFTs along ``y`` and ``x`` write their output in mirror-pair order;
* :func:`pairs_extend` then writes each rank's full ``kz`` block from its
  representatives: with every block of an even number of positions holding
  whole pairs, the mirror ``-k`` of every mode is on the same rank, and
  ``F(-k) = conj(F(k))`` is one local pass (the packed slot unpacks with the
  2D Hermitian symmetry of each of its two planes).

The inverse folds the full spectrum to the representatives of its Hermitian
part first (:func:`pairs_fold`, whose inverse is the real part sought), then
runs the same stages backwards. With a ``MeshImpl`` that exchanges laid-out
pieces (``alltoall_pieces``, e.g. ``HvdSimdMeshImpl``) the FFT ops write the
pieces of the next exchange and read those of the last one directly (their
``in_blocks`` / ``out_blocks``), so no transpose packs or unpacks an all-to-all.
Every other transform (complex input and output, e.g.
:func:`c2c_inverse`; odd sizes or blocks; batch dimensions; the TensorFlow
path) moves all ``n`` modes (``FFT3DOperation._lower_full``), writing each k
axis in pair order while it is local (a permutation inside the panel copies of
the native op, a gather on the TensorFlow path). What the exchanges cost:
``results/fft_pairs.md`` and ``results/fft_4rank_experiments.md``.

Local 1D FFTs
-------------
Every 1D transform above goes through :func:`fft_along` (and
:func:`rfft_along` / :func:`irfft_along`). On the CPU they are the FFTW custom
ops of ``flowpm_mtf/native/fft_ops.cc`` (built by ``scripts/setup_env.sh``,
i.e. ``python -m flowpm_mtf.native.build``): TensorFlow's CPU FFT (Eigen) is
~3-5x slower than FFTW at powers of two and 20-50x slower at other lengths
(192: 650 ms vs 9-26 ms for one axis of 192^3 complex64 here). The op
transforms along any axis without transposes, runs on TensorFlow's intra-op
thread pool (sized per rank by ``hvd_mesh_impl.runtime.session_config``) and
carries its exact gradient (registered in this module). On a GPU (the device of
the sliced tensor, or no device with a visible GPU, see :func:`uses_native`)
the path stays ``tf.signal`` (cuFFT); it builds the same graph as before and is
documented but not testable on this CPU-only machine.
``FLOWPM_MTF_NATIVE=0`` forces the TensorFlow path, ``require`` fails when the
op is not built (the test suite sets it).

The k-space tensor holds all ``nc[0] * nc[1] * nc[2]`` modes (no half-spectrum
contract): every sum over k-space (power spectra, priors, ``real_vdot``, kernel
gradients) counts each mode once, whatever the grid.

Normalisation (as single-device FlowPM ``flowpm.utils.r2c3d`` / ``c2r3d``)
---------------------------------------------------------------------------
With ``N = nc[0] * nc[1] * nc[2]``::

    r2c(f)[k] = (1 / N) * sum_x f[x] exp(-i k.x)        = numpy.fft.fftn(f) / N
    c2r(F)[x] = Re( sum_k F[k] exp(+i k.x) )             = N * Re(numpy.fft.ifftn(F))

so ``c2r(r2c(f)) == f``.

Gradients
---------
TensorFlow's convention for a real loss ``L`` and a complex tensor
``z = a + i b`` is ``grad z = dL/da + i dL/db``; for a complex-linear map ``A``
this gives ``grad x = A^H grad y`` (conjugate transpose). With ``F`` the
unnormalised DFT (``F^H = N F^{-1}``)::

    y = s F x          ->  grad x = s N ifft(grad y)
    y = s F^{-1} x     ->  grad x = s fft(grad y) / N

A real input is embedded as ``x + 0i`` (adjoint: real part of the gradient);
a real output takes the real part (adjoint: ``grad + 0i``). Hence
``grad r2c = Re(ifftn(dy))`` and ``grad c2r = fftn(dy)``, each exact on its own
(tested in ``tests/test_fft.py`` by dot-product and finite-difference tests).

Stock Mesh TF skips operations with complex tensors in ``mtf.gradients``;
importing this module applies
:func:`hvd_mesh_impl.mtf_compat.enable_complex_gradients` (no Horovod import).
Products of complex tensors with ``*`` get Mesh TF's gradient ``dy * other``,
which lacks the complex conjugate: multiply k-space fields by kernels with
:func:`apply_kernel` (real kernel times a constant complex phase, e.g. ``1j``
for the gradient kernel ``i k``), whose gradient is exact.
"""
import functools
import logging

import mesh_tensorflow as mtf
import numpy as np
import tensorflow.compat.v1 as tf

from hvd_mesh_impl.mtf_compat import enable_complex_gradients, enable_lazy_masters

from . import config as cfg
from . import layout
from . import native

log = logging.getLogger(__name__)

enable_complex_gradients()
enable_lazy_masters()  # no full-size master variables in the TF graph (see mtf_compat)

# ----------------------------------------------------------------------------- shapes
real_shape = layout.real_shape
k_shape = layout.k_shape


def _complex_of(dtype):
    return tf.complex128 if dtype in (tf.float64, tf.complex128) else tf.complex64


def _real_of(dtype):
    return tf.float64 if dtype in (tf.float64, tf.complex128) else tf.float32


def _differentiable(dtype):
    return dtype.is_floating or dtype.is_complex


def _along(fn, t, axis):
    """Apply the innermost-axis TF transform ``fn`` along ``axis`` of ``t``."""
    last = t.shape.ndims - 1
    if axis == last:
        return fn(t)
    perm = list(range(last + 1))
    perm[axis], perm[last] = last, axis
    return tf.transpose(fn(tf.transpose(t, perm)), perm)


# ----------------------------------------------------------------------------- local 1D FFTs
@functools.lru_cache(maxsize=None)
def _gpu_visible():
    return bool(tf.config.list_physical_devices("GPU"))


def uses_native(t):
    """Whether the local FFTs of ``t`` run on the native FFTW op.

    The native op (``flowpm_mtf/native/fft_ops.cc``) is a CPU kernel. It is used
    when it is built (see :func:`flowpm_mtf.native.load`; ``FLOWPM_MTF_NATIVE``)
    and the computation is on the CPU: the device of ``t`` is a CPU, or ``t``
    is unplaced and TensorFlow sees no GPU (an unplaced op goes to the GPU when
    there is one). On a GPU the TensorFlow ops (cuFFT) are the path.

    Parameters
    ----------
    t : tf.Tensor

    Returns
    -------
    bool
    """
    if native.load("fft_ops") is None:
        return False
    kind = tf.DeviceSpec.from_string(t.device or "").device_type
    if kind:
        return kind.upper() == "CPU"
    return not _gpu_visible()


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
        return native.load("fft_ops").flowpm_fft_r2c(t, Tcomplex=_complex_of(t.dtype),
                                                     axis=axis, normalized=bool(normalized),
                                                     full=True, out_pairs=bool(out_pairs),
                                                     **blocks)
    return fft_along(tf.cast(t, _complex_of(t.dtype)), axis, False, normalized,
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
        return native.load("fft_ops").flowpm_fft_c2r(t, Treal=_real_of(t.dtype), n=n,
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
        return native.load("fft_ops").flowpm_fft_r2c(t, Tcomplex=_complex_of(t.dtype),
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
        return native.load("fft_ops").flowpm_fft_c2r(t, Treal=_real_of(t.dtype), n=int(n),
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
            t, Tcomplex=_complex_of(t.dtype), axis=axis, normalized=bool(normalized),
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
            t, Treal=_real_of(t.dtype), n=int(n), axis=axis, normalized=bool(normalized),
            packed=True, in_blocks=in_blocks)
    if in_blocks != 1:
        raise ValueError("irfft_packed_along: in_blocks needs the native FFT op")
    zero = tf.complex(tf.math.real(t[..., :1]), tf.zeros_like(tf.math.real(t[..., :1])))
    nyq = tf.complex(tf.math.imag(t[..., :1]), tf.zeros_like(tf.math.real(t[..., :1])))
    y = irfft_along(tf.concat([zero, t[..., 1:], nyq], axis=-1), n, axis)
    return y if normalized else y * tf.constant(float(n), y.dtype)


def _half_weights(n, ndims, axis, dtype, interior):
    """Weights along the half spectrum (``n // 2 + 1`` modes), broadcastable on ``axis``:
    1 for the zero mode and the Nyquist mode of an even ``n``, ``interior`` for the others."""
    w = np.full(n // 2 + 1, interior)
    w[0] = 1.0
    if n % 2 == 0:
        w[-1] = 1.0
    return tf.constant(w.reshape((-1,) + (1,) * (ndims - axis - 1)), dtype)


# Exact gradients of the native ops (TF convention grad z = dL/dRe z + i dL/dIm z,
# so a complex-linear map A has the gradient A^H dy; see the module docstring).
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


# ----------------------------------------------------------------------------- FFT op
def half_spectrum_fits(nc, grid):
    """Whether the mesh and grid allow the half-spectrum path of real transforms.

    Parameters
    ----------
    nc : sequence of 3 int
        Cells per axis.
    grid : (int, int)
        Ranks ``(P, Q)`` over ``ky`` (and ``x``) and ``kz`` (and ``y``).

    Returns
    -------
    bool
        Every size even and the ``ky``, ``kz`` blocks (``nc[1] / P``, ``nc[2] / Q``)
        even, so that each block holds whole mirror pairs. Then, on the native path,
        r2c and c2r of ``[x, y, z]`` fields move half the spectrum
        (``FFT3DOperation._lower_half``).
    """
    (P, Q), (_, ny, nz) = grid, nc
    return all(n % 2 == 0 for n in nc) and (ny // P) % 2 == 0 and (nz // Q) % 2 == 0


class FFT3DOperation(mtf.Operation):
    """``y = s * T(x)`` with ``T`` the unnormalised 3D DFT or the inverse DFT.

    Parameters
    ----------
    x : mtf.Tensor
        Real or complex; holds the three ``in_dims`` (other dimensions are batch
        dimensions, transformed independently).
    in_dims, out_dims : sequence of 3 str
        Dimension names of the transformed axes before and after (x, y, z order).
    inverse : bool
        False: ``T = F`` (``numpy.fft.fftn``); True: ``T = F^{-1}`` (``ifftn``).
    scale : float
        Real factor ``s``.
    real_output : bool
        Return the real part of the result.
    name : str, optional

    Notes
    -----
    Forward (``inverse=False``) needs ``in_dims[2]`` unsplit and returns
    ``out_dims[0]`` unsplit, ``out_dims[1]`` on the mesh axis of ``in_dims[0]``,
    ``out_dims[2]`` on that of ``in_dims[1]``; the inverse needs and returns
    the mirror layout. :attr:`flowpm_mtf.config.SimConfig.layout_rules` satisfies
    both.
    """

    def __init__(self, x, in_dims, out_dims, inverse, scale=1.0, real_output=False,
                 name=None):
        super().__init__([x], name=name or ("IFFT3D" if inverse else "FFT3D"))
        names = x.shape.dimension_names
        for d in in_dims:
            if d not in names:
                raise ValueError("FFT3D: dimension %r is not in the input shape %s"
                                 % (d, x.shape))
        self._in_dims = tuple(in_dims)
        self._out_dims = tuple(out_dims)
        self._inverse = bool(inverse)
        self._scale = float(scale)
        self._real_output = bool(real_output)
        rename = dict(zip(in_dims, out_dims))
        out_shape = mtf.Shape([mtf.Dimension(rename.get(d.name, d.name), d.size)
                               for d in x.shape.dims])
        cdtype = _complex_of(x.dtype)
        self._outputs = [mtf.Tensor(self, out_shape,
                                    _real_of(cdtype) if real_output else cdtype)]
        self._n = int(np.prod([x.shape.get_dim_by_name(d).size for d in in_dims]))

    @property
    def has_gradient(self):
        return _differentiable(self.inputs[0].dtype)

    def gradient(self, grad_ys):
        dy = grad_ys[0]
        x = self.inputs[0]
        # adjoint of s*F is s*N*F^{-1}; adjoint of s*F^{-1} is (s/N)*F
        scale = self._scale * (self._n if not self._inverse else 1.0 / self._n)
        op = FFT3DOperation(dy, self._out_dims, self._in_dims, not self._inverse, scale,
                            real_output=not x.dtype.is_complex,
                            name=self.name + "_grad")
        return [op.outputs[0]]

    def lower(self, lowering):
        mesh_impl = lowering.mesh_impl(self)
        x = self.inputs[0]
        y = self.outputs[0]
        pos = [x.shape.dims.index(x.shape.get_dim_by_name(d)) for d in self._in_dims]
        in_axes = [mesh_impl.tensor_dimension_to_mesh_axis(x.shape.get_dim_by_name(d))
                   for d in self._in_dims]
        out_axes = [mesh_impl.tensor_dimension_to_mesh_axis(y.shape.get_dim_by_name(d))
                    for d in self._out_dims]
        # forward: (a, b, None) -> (None, a, b); inverse: (None, a, b) -> (a, b, None)
        if not self._inverse:
            a, b = in_axes[0], in_axes[1]
            ok = in_axes[2] is None and out_axes == [None, a, b]
        else:
            a, b = in_axes[1], in_axes[2]
            ok = in_axes[0] is None and out_axes == [a, b, None]
        if not ok:
            raise ValueError(
                "%s: unsupported layout: %s on mesh axes %s -> %s on %s; the layout rules "
                "must put (x, ky, bx) on one mesh axis, (y, kz, by) on another and leave "
                "z and kx unsplit (see SimConfig.layout_rules)"
                % (self.name, self._in_dims, in_axes, self._out_dims, out_axes))
        # Per-stage normalisation and the factor left for the end: TF's ifft
        # divides by n at every stage, so y = s * (its result); the native op
        # can scale by 1/n inside each stage at no extra pass, so a factor of
        # 1/N (r2c, grad c2r) or 1 (c2r, grad r2c) relative to the unnormalised
        # transform costs no multiplication at all.
        t = lowering.tensors[x]
        native_slice = uses_native(t.to_laid_out_tensor().tensor_list[0])
        unnorm = self._scale / self._n if self._inverse else self._scale
        if not native_slice:
            normalized, factor = self._inverse, self._scale
        elif np.isclose(unnorm, 1.0 / self._n, rtol=1e-12, atol=0):
            normalized, factor = True, 1.0
        else:
            normalized, factor = False, unnorm

        def trivial(mesh_axis):
            return mesh_axis is None or mesh_impl.shape[mesh_axis].size == 1

        P = 1 if trivial(a) else mesh_impl.shape[a].size
        Q = 1 if trivial(b) else mesh_impl.shape[b].size
        sizes = [x.shape.dims[i].size for i in pos]
        real_in = not self._inverse and not x.dtype.is_complex
        real_out = self._inverse and self._real_output
        if (native_slice and (real_in or real_out) and pos == [0, 1, 2]
                and len(x.shape.dims) == 3 and half_spectrum_fits(sizes, (P, Q))):
            t = self._lower_half(mesh_impl, t, (a, P), (b, Q), sizes[2], normalized, factor)
        else:
            t = self._lower_full(mesh_impl, t, pos, (a, P), (b, Q), normalized, factor)
        lowering.set_tensor_lowering(y, t)

    def _lower_full(self, mesh_impl, t, pos, a, b, normalized, factor):
        """All ``n`` modes through every stage (any input, any ``MeshImpl``, any batch
        dimensions): complex 1D FFTs (real-to-complex first for a real input, the real
        part last for a real output) that write (forward) or read (inverse) each k axis
        in mirror-pair order while it is local, around the two all-to-alls."""
        (a, P), (b, Q) = a, b
        inv = self._inverse
        cdtype = _complex_of(self.inputs[0].dtype)

        def scaled(u):
            return u * tf.constant(factor, u.dtype) if factor != 1.0 else u

        def exchange(u, mesh_axis, size, split, concat):
            return u if size == 1 else mesh_impl.alltoall(u, mesh_axis, split, concat)

        if not inv:
            def first(u):
                if not u.dtype.is_complex:  # r2c: no cast, half the work
                    return fft_of_real_along(u, pos[2], normalized=normalized, out_pairs=True)
                return fft_along(u, pos[2], False, normalized, out_pairs=True)

            def last(u):
                u = scaled(fft_along(u, pos[0], False, normalized, out_pairs=True))
                return tf.math.real(u) if self._real_output else u

            t = mesh_impl.slicewise(first, t)
            t = exchange(t, b, Q, pos[2], pos[1])
            t = mesh_impl.slicewise(
                lambda u: fft_along(u, pos[1], False, normalized, out_pairs=True), t)
            t = exchange(t, a, P, pos[1], pos[0])
            return mesh_impl.slicewise(last, t)

        def first(u):
            u = tf.cast(u, cdtype) if not u.dtype.is_complex else u
            return fft_along(u, pos[0], True, normalized, in_pairs=True)

        def last(u):
            if self._real_output:  # c2r: half the work
                return scaled(ifft_real_part_along(u, pos[2], normalized=normalized,
                                                   in_pairs=True))
            return scaled(fft_along(u, pos[2], True, normalized, in_pairs=True))

        t = mesh_impl.slicewise(first, t)
        t = exchange(t, a, P, pos[0], pos[1])
        t = mesh_impl.slicewise(
            lambda u: fft_along(u, pos[1], True, normalized, in_pairs=True), t)
        t = exchange(t, b, Q, pos[1], pos[2])
        return mesh_impl.slicewise(last, t)

    def _lower_half(self, mesh_impl, t, a, b, nz, normalized, factor):
        """The transform of a real field (forward) or to a real field (inverse) on half
        the spectrum (native path, ``x, y, z`` fields, even sizes and even ``ky``,
        ``kz`` blocks): every stage and both all-to-alls move ``nz / 2`` of the ``nz``
        modes, as an FFTW-based distributed FFT does.

        Forward (x, y, z on a, b, -): packed rfft along z (``nz / 2`` values, the
        Nyquist mode in the zero mode's slot), in Q blocks; exchange on b; FFT along y
        (mirror-pair order out), in P blocks; exchange on a; FFT along x (pair order
        out); :func:`pairs_extend` completes each kz block from its representatives,
        whose mirrors are on the rank (pair order). Inverse: :func:`pairs_fold`, the
        FFTs along kx and ky (pair order in), the exchanges, the packed irfft along z.
        With a ``MeshImpl`` that exchanges laid-out pieces (``alltoall_pieces``, e.g.
        ``HvdSimdMeshImpl``) the FFT ops write the pieces of the next exchange and read
        those of the last one (``in_blocks`` / ``out_blocks``): no transposes.
        """
        (a, P), (b, Q) = a, b
        pieces = getattr(mesh_impl, "alltoall_pieces", None)
        bp = P if pieces is not None else 1  # blocked layouts on a / on b
        bq = Q if pieces is not None else 1
        pcoords = [mesh_impl.laid_out_pcoord(m) for m, size in ((a, P), (b, Q)) if size > 1]

        def firsts(*pc):
            pc = list(pc)
            flags = [tf.equal(pc.pop(0), 0) if size > 1 else tf.constant(True)
                     for size in (P, Q)]
            return tf.cast(tf.stack(flags), tf.int32)

        def scaled(u):
            return u * tf.constant(factor, u.dtype) if factor != 1.0 else u

        if not self._inverse:
            t = mesh_impl.slicewise(
                lambda u: rfft_packed_along(u, 2, normalized=normalized, out_blocks=bq), t)
            if Q > 1:
                t = pieces(t, b) if pieces is not None else mesh_impl.alltoall(t, b, 2, 1)
            t = mesh_impl.slicewise(
                lambda u: fft_along(u, 1, False, normalized, in_blocks=bq, out_blocks=bp,
                                    out_pairs=True), t)
            if P > 1:
                if pieces is not None:  # [P, x / P, ..]: the x blocks in order
                    t = mesh_impl.slicewise(
                        lambda u: tf.reshape(u, [-1] + u.shape.as_list()[2:]), pieces(t, a))
                else:
                    t = mesh_impl.alltoall(t, a, 1, 0)
            return mesh_impl.slicewise(
                lambda u, *pc: pairs_extend(
                    scaled(fft_along(u, 0, False, normalized, out_pairs=True)), firsts(*pc)),
                t, *pcoords)

        t = mesh_impl.slicewise(
            lambda u, *pc: fft_along(pairs_fold(u, firsts(*pc)), 0, True, normalized,
                                     out_blocks=bp, in_pairs=True), t, *pcoords)
        if P > 1:
            t = pieces(t, a) if pieces is not None else mesh_impl.alltoall(t, a, 0, 1)
        t = mesh_impl.slicewise(
            lambda u: fft_along(u, 1, True, normalized, in_blocks=bp, out_blocks=bq,
                                in_pairs=True), t)
        if Q > 1:
            t = pieces(t, b) if pieces is not None else mesh_impl.alltoall(t, b, 1, 2)
        return mesh_impl.slicewise(
            lambda u: scaled(irfft_packed_along(u, nz, 2, normalized=normalized,
                                                in_blocks=bq)), t)


def r2c(field, conf, name="r2c"):
    """Forward FFT of a real field, normalised like FlowPM's ``r2c3d``.

    Parameters
    ----------
    field : mtf.Tensor
        Real field on the dimensions ``x, y, z`` (plus optional unsplit batch
        dimensions).
    conf : SimConfig
    name : str, optional

    Returns
    -------
    mtf.Tensor
        Complex field on ``kx, ky, kz`` (same positions as ``x, y, z``):
        ``numpy.fft.fftn(field) / N``, ``N = prod(conf.nc)``.
    """
    if field.dtype.is_complex:
        raise TypeError("r2c expects a real field, got %s" % field.dtype.name)
    n = conf.n_cells
    return FFT3DOperation(field, cfg.REAL_DIMS, cfg.K_DIMS, inverse=False, scale=1.0 / n,
                          name=name).outputs[0]


def c2r(kfield, conf, name="c2r"):
    """Inverse FFT to a real field, normalised like FlowPM's ``c2r3d``.

    Parameters
    ----------
    kfield : mtf.Tensor
        Complex field on the dimensions ``kx, ky, kz``.
    conf : SimConfig
    name : str, optional

    Returns
    -------
    mtf.Tensor
        Real field on ``x, y, z``: ``N * Re(numpy.fft.ifftn(kfield))``. The
        imaginary part (zero for a Hermitian ``kfield``) is discarded.
    """
    return _inverse(kfield, conf, name, real_output=True)


def _inverse(kfield, conf, name, real_output):
    if not kfield.dtype.is_complex:
        raise TypeError("%s expects a complex field, got %s"
                        % ("c2r" if real_output else "c2c_inverse", kfield.dtype.name))
    return FFT3DOperation(kfield, cfg.K_DIMS, cfg.REAL_DIMS, inverse=True,
                          scale=float(conf.n_cells), real_output=real_output,
                          name=name).outputs[0]


def c2c_inverse(kfield, conf, name="c2c_inverse"):
    """Inverse FFT of a complex field to a complex field, normalised like :func:`c2r`.

    Parameters
    ----------
    kfield : mtf.Tensor
        Complex field on the dimensions ``kx, ky, kz``.
    conf : SimConfig
    name : str, optional

    Returns
    -------
    mtf.Tensor
        Complex field on ``x, y, z``: ``N * numpy.fft.ifftn(kfield)`` (no part
        discarded; e.g. two real fields packed as ``a + i b``, see
        :func:`flowpm_mtf.kernels.packed_inverse`).
    """
    return _inverse(kfield, conf, name, real_output=False)


# ----------------------------------------------------------------------------- k-vectors
def kvec(conf, mesh, units="h/Mpc"):
    """Wave vectors along each axis as mtf tensors on ``kx``, ``ky``, ``kz``.

    Parameters
    ----------
    conf : SimConfig
    mesh : mtf.Mesh
    units : {"h/Mpc", "grid"}
        ``"h/Mpc"``: ``2 pi fftfreq(n, d=cell_size)`` [h/Mpc];
        ``"grid"``: ``2 pi fftfreq(n)`` [rad / cell] (FlowPM's ``fftk``
        convention, which assumes cubic cells).

    Returns
    -------
    list of 3 mtf.Tensor
        Real tensors of shape ``[kx]``, ``[ky]``, ``[kz]`` (dtype ``conf.dtype``)
        in numpy FFT order (zero first, negative frequencies in the upper half).
    """
    return layout.kvec_tensors(conf, mesh, conf.np_dtype, "kvec", units)


def wavenumber(conf, mesh, units="h/Mpc"):
    """Norm of the wave vector, ``|k|``, on ``[kx, ky, kz]``.

    Parameters
    ----------
    conf : SimConfig
    mesh : mtf.Mesh
    units : {"h/Mpc", "grid"}
        See :func:`kvec`.

    Returns
    -------
    mtf.Tensor
        Real, shape ``[kx, ky, kz]`` [h/Mpc or rad / cell].
    """
    kx, ky, kz = kvec(conf, mesh, units)
    return mtf.sqrt(mtf.square(kx) + mtf.square(ky) + mtf.square(kz))


# ----------------------------------------------------------------------------- kernels
class KernelMultiplyOperation(mtf.Operation):
    """``y = phase * kernel * field`` for a complex field and a real kernel.

    Parameters
    ----------
    field : mtf.Tensor
        Complex tensor.
    kernel : mtf.Tensor
        Real tensor whose dimensions are a subset of ``field``'s (broadcast by
        name).
    phase : complex
        Constant factor, e.g. ``1j`` for the gradient kernel ``i k``.

    Notes
    -----
    Gradients (TF convention, see the module docstring)::

        grad field  = conj(phase) * kernel * grad y
        grad kernel = sum over the broadcast dims of Re(conj(phase * field) * grad y)
    """

    def __init__(self, field, kernel, phase=1.0, name=None):
        super().__init__([field, kernel], name=name or "apply_kernel")
        if not field.dtype.is_complex:
            raise TypeError("apply_kernel: the field must be complex, got %s" % field.dtype.name)
        if kernel.dtype.is_complex or not kernel.dtype.is_floating:
            raise TypeError("apply_kernel: the kernel must be real floating, got %s"
                            % kernel.dtype.name)
        missing = [d for d in kernel.shape.dims if d not in field.shape.dims]
        if missing:
            raise ValueError("apply_kernel: kernel dimensions %s are not in the field shape %s"
                             % (missing, field.shape))
        self._phase = complex(phase)
        self._outputs = [mtf.Tensor(self, field.shape, field.dtype)]

    @property
    def has_gradient(self):
        return True

    def gradient(self, grad_ys):
        dy = grad_ys[0]
        field, kernel = self.inputs
        d_field = apply_kernel(dy, kernel, np.conj(self._phase))
        phase = self._phase
        prod = mtf.slicewise(
            lambda f, g: tf.math.real(tf.math.conj(f * tf.constant(phase, f.dtype)) * g),
            [field, dy], output_shape=field.shape, output_dtype=kernel.dtype,
            splittable_dims=field.shape.dims, name="apply_kernel_grad")
        d_kernel = mtf.reduce_sum(prod, output_shape=kernel.shape)
        return [d_field, d_kernel]

    def lower(self, lowering):
        mesh_impl = lowering.mesh_impl(self)
        field, kernel = self.inputs
        phase = self._phase

        def fn(f, k):
            # The phase is folded into the kernel (a [k_d] kernel stays small):
            # one pass over the field instead of two; x * (i k) = i (x k)
            # exactly. Cast when the field is ready: a kernel is
            # data-independent, and its full-size complex copy would otherwise
            # be made at the start of the run and held until this product (16
            # MB per 2M cells in complex64).
            with tf.control_dependencies([f.op]):
                k = tf.cast(mtf.ops._expand_dims(k, kernel.shape, field.shape), f.dtype)
                if phase != 1:
                    k = k * tf.constant(phase, f.dtype)
            return f * k

        lowering.set_tensor_lowering(
            self.outputs[0],
            mesh_impl.slicewise(fn, lowering.tensors[field], lowering.tensors[kernel]))


def apply_kernel(kfield, kernel, phase=1.0, name=None):
    """Multiply a complex field by ``phase * kernel`` with an exact gradient.

    Parameters
    ----------
    kfield : mtf.Tensor
        Complex field (typically on ``kx, ky, kz``).
    kernel : mtf.Tensor
        Real kernel on a subset of ``kfield``'s dimensions (e.g. ``[kx]`` from
        :func:`kvec`, or ``[kx, ky, kz]``).
    phase : complex, optional
        Constant factor; ``1j`` with ``kernel = k_x`` gives the derivative
        kernel ``i k_x``.
    name : str, optional

    Returns
    -------
    mtf.Tensor
        ``phase * kernel * kfield``, shape and dtype of ``kfield``.
    """
    return KernelMultiplyOperation(kfield, kernel, phase, name=name).outputs[0]


def real_part(z, name="real_part"):
    """Real part of a complex tensor (gradient ``dy + 0i``)."""
    return mtf.cwise(tf.math.real, [z], output_dtype=_real_of(z.dtype), name=name)


def imag_part(z, name="imag_part"):
    """Imaginary part of a complex tensor (gradient ``0 + i dy``)."""
    return mtf.cwise(tf.math.imag, [z], output_dtype=_real_of(z.dtype), name=name)


def abs2(z, name="abs2"):
    """``|z|^2`` of a complex tensor, as a real tensor (e.g. for power spectra)."""
    return mtf.cwise(lambda t: tf.math.real(t * tf.math.conj(t)), [z],
                     output_dtype=_real_of(z.dtype), name=name)


def real_vdot(u, v, name="real_vdot"):
    """Real inner product ``Re(sum(conj(u) * v))`` of two tensors of equal shape.

    Parameters
    ----------
    u, v : mtf.Tensor
        Real or complex tensors of the same shape.

    Returns
    -------
    mtf.Tensor
        Real scalar, summed over the whole (distributed) tensor.
    """
    if u.shape != v.shape:
        raise ValueError("real_vdot: shapes differ: %s vs %s" % (u.shape, v.shape))
    out = _real_of(u.dtype)

    def fn(a, b):
        if a.dtype.is_complex or b.dtype.is_complex:
            c = _complex_of(a.dtype)
            return tf.math.real(tf.math.conj(tf.cast(a, c)) * tf.cast(b, c))
        return a * b

    prod = mtf.slicewise(fn, [u, v], output_shape=u.shape, output_dtype=out,
                         splittable_dims=u.shape.dims, name=name)
    return mtf.reduce_sum(prod)
