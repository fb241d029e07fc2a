"""Distributed 3D FFT on the (P, Q) pencil decomposition, with exact gradients.

Layout
------
A real-space field has the dimensions ``x, y, z`` (``x`` split over the P
ranks of mesh axis ``row``, ``y`` over the Q ranks of ``col``, ``z`` local).
Its transform has the dimensions ``kx, ky, kz`` (``kx`` local, ``ky`` on
``row``, ``kz`` on ``col``), *in the same tensor positions*: the data are
never transposed, only re-distributed. The forward transform runs

1. 1D FFT along ``z`` (local);
2. all-to-all on ``col``: split ``z``, gather ``y``; 1D FFT along ``y``;
3. all-to-all on ``row``: split ``y``, gather ``x``; 1D FFT along ``x``;

and the inverse runs the same steps backwards. The all-to-alls are issued
through ``mesh_impl.alltoall`` inside the operation's lowering, so the code runs
on every Mesh TF ``MeshImpl``. With ``kz`` split (Q > 1) on the native path and a
``MeshImpl`` that exchanges laid-out pieces (``alltoall_pieces``, e.g.
``HvdSimdMeshImpl``), the FFT ops write the pieces of the next exchange and read
those of the last one directly (their ``in_blocks`` / ``out_blocks``), so no
transpose packs or unpacks an all-to-all (``FFT3DOperation._lower_blocked``): on
2x2 ranks at 128^3 that removed 6 transposes of the full field per round trip.
Kernels are built as named mtf tensors on ``kx, ky, kz`` (see :func:`kvec`); Mesh
TF aligns operands by dimension name.

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
contract). Inside the operation, on the native path, the transform of a real
field (``r2c``) and to a real field (``c2r``, and the gradients of both) works
on the half spectrum along z (``nz // 2 + 1`` modes) for as many stages as the
Hermitian symmetry ``F[-k] = conj(F[k])`` can be restored on the rank: when
``z``/``kz`` is not split (Q = 1, e.g. 1 or 2 ranks with the default grid) the
middle stage and, on one rank, the last stage transform half the data, and the
native op ``FlowpmHermitian`` (:func:`hermitian_extend` /
:func:`hermitian_fold`, one pass) completes the full spectrum after them (r2c)
or takes the Hermitian part before them (c2r; its inverse transform is the real
part of the full one). With ``kz`` split (Q > 1) the stages stay full complex
after the first: the half axis (``nc[2] // 2 + 1``) is rarely divisible by Q and
``kz``, ``-kz`` sit on different ranks. A half-spectrum k-space contract
would also halve the all-to-all bytes there; two designs, neither done: (a) a
``kz`` dimension padded to a multiple of ``Q`` (zero modes; the k-space shape
then depends on the grid, and every sum over k-space -- power spectra, priors,
``real_vdot``, kernel gradients -- counts the modes ``0 < kz < nc[2] / 2``
twice and the padding zero times); (b) the layout ``kx`` on ``col``, ``ky`` on
``row``, ``kz`` local (half axis), with the padding internal to the operation
and a third, half-size all-to-all (0.75x the bytes); (c) the best found so far:
keep all the modes but order ``kz`` (and ``ky``) so that each rank's block holds
mirror pairs ``(k, n - k)``: for ``kz``, block 0 = ``{0, nz/2}`` and the pairs
``1 .. m/2 - 1`` (``m = nz / Q``), block ``q`` the pairs ``q m/2 .. (q+1) m/2 - 1``,
each block as its ``m/2`` representatives then their mirrors. The half-spectrum
pieces of the exchange on ``col`` are then contiguous ranges of the rfft output
(``m/2 + 1`` modes each, the Nyquist mode riding in block 0), and after the FFT
along ``y`` the Hermitian completion ``G(x, -ky, -kz) = conj(G(x, ky, kz))`` is
local (``ky`` local, ``-kz`` in the same block): one pass, as ``hermitian_extend``
does for Q = 1 (the inverse folds there). Half the bytes of the ``col`` exchange
and half the FFT along ``y``; with ``ky`` pair-ordered as well the completion can
wait until after the ``row`` exchange and the FFT along ``x`` (half the bytes of
both exchanges, as mpi4py-fft). Needs ``nz / Q`` even (else the full path). An order
that does not depend on the grid, e.g. ``0, n/2, 1, n-1, 2, n-2, ...`` (pair ``j`` at
positions ``2j, 2j+1``), has whole pairs in every block of even size, so k-space fields
(checkpoints, outputs) would keep their meaning across grids.
Every design changes the k-space contract of every caller (kernels, power, ics,
lpt, reconstruct, checkpoints of k-space fields, the fft-demo, the tests that
compare with numpy); in (c) only the order, which :func:`kvec` would carry, so
callers that use ``kvec``/``wavenumber`` are unaffected. They belong in one change
with those modules. What the exchanges cost now: ``results/fft_pairs.md`` and
``results/fft_4rank_experiments.md``.

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


def fft_along(t, axis, inverse=False, normalized=None, in_blocks=1, out_blocks=1):
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
        return native.load("fft_ops").flowpm_fft_c2c(t, axis=axis, inverse=inverse,
                                                     normalized=normalized, **blocks)
    y = _along(tf.signal.ifft if inverse else tf.signal.fft, t, axis)
    if normalized != inverse:
        n = tf.compat.dimension_value(t.shape[axis])
        y = y * tf.constant(1.0 / n if normalized else float(n), t.dtype)
    return y


def fft_of_real_along(t, axis, normalized=False, in_blocks=1, out_blocks=1):
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
                                                     full=True, **blocks)
    return fft_along(tf.cast(t, _complex_of(t.dtype)), axis, False, normalized)


def ifft_real_part_along(t, axis, normalized=True, in_blocks=1, out_blocks=1):
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
                                                     full=True, **blocks)
    return tf.math.real(fft_along(t, axis, True, normalized))


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
def _swapped_blocks(op):
    return dict(in_blocks=op.get_attr("out_blocks"), out_blocks=op.get_attr("in_blocks"))


@tf.RegisterGradient("FlowpmFftC2c")
def _c2c_grad(op, dy):
    return native.load("fft_ops").flowpm_fft_c2c(
        dy, axis=op.get_attr("axis"), inverse=not op.get_attr("inverse"),
        normalized=op.get_attr("normalized"), **_swapped_blocks(op))


@tf.RegisterGradient("FlowpmFftR2c")
def _r2c_grad(op, dy):
    axis, x = op.get_attr("axis"), op.inputs[0]
    n = _logical_length(x, axis, op.get_attr("in_blocks"))
    kw = dict(Treal=x.dtype, n=n, axis=axis, normalized=op.get_attr("normalized"))
    if op.get_attr("full"):
        return native.load("fft_ops").flowpm_fft_c2r(dy, full=True, **kw, **_swapped_blocks(op))
    w = _half_weights(n, x.shape.ndims, axis, dy.dtype, 0.5)
    return native.load("fft_ops").flowpm_fft_c2r(dy * w, **kw)


@tf.RegisterGradient("FlowpmFftC2r")
def _c2r_grad(op, dy):
    axis, n = op.get_attr("axis"), op.get_attr("n")
    x = op.inputs[0]
    kw = dict(Tcomplex=x.dtype, axis=axis, normalized=op.get_attr("normalized"))
    if op.get_attr("full"):
        return native.load("fft_ops").flowpm_fft_r2c(dy, full=True, **kw, **_swapped_blocks(op))
    w = _half_weights(n, x.shape.ndims, axis, x.dtype, 2.0)
    return w * native.load("fft_ops").flowpm_fft_r2c(dy, **kw)


def _reflect(t, axes):
    """``t`` at the negated indices (mod the length) along ``axes``."""
    for a in axes:
        size = tf.compat.dimension_value(t.shape[a])
        t = tf.gather(t, (-np.arange(size)) % size, axis=a)
    return t


def _pack(t, blocks, axis):
    """``[.., L, ..] -> [blocks, .., L / blocks, ..]``: block ``j`` of ``axis`` first."""
    shape = t.shape.as_list()
    split = shape[:axis] + [blocks, shape[axis] // blocks] + shape[axis + 1:]
    perm = [axis] + [i for i in range(len(split)) if i != axis]
    return tf.transpose(tf.reshape(t, split), perm)


def _unpack(t, axis):
    """Inverse of :func:`_pack` (``axis`` of the unpacked tensor)."""
    shape = t.shape.as_list()
    perm = list(range(1, axis + 1)) + [0] + list(range(axis + 1, len(shape)))
    merged = shape[1:axis + 1] + [shape[0] * shape[axis + 1]] + shape[axis + 2:]
    return tf.reshape(tf.transpose(t, perm), merged)


def _hermitian(t, n, axis, reflect, fold, blocks, block_axis):
    ndims = t.shape.ndims - (1 if fold and blocks > 1 else 0)  # logical rank
    if not -ndims <= axis < ndims:
        raise ValueError("axis %r out of range for a tensor of rank %d" % (axis, ndims))
    axis %= ndims
    block_axis = -1 if blocks == 1 else block_axis % ndims
    y = native.load("fft_ops").flowpm_hermitian(
        t, n=int(n), axis=axis, reflect=[a % ndims for a in reflect], fold=fold,
        blocks=int(blocks), block_axis=block_axis)
    if blocks > 1:  # the shape function leaves packed shapes unknown
        shape = t.shape.as_list()
        if fold:
            shape = shape[1:]
            shape[block_axis] *= blocks
            shape[axis] = n // 2 + 1
        else:
            shape[axis] = n
            shape[block_axis] //= blocks
            shape = [blocks] + shape
        y.set_shape(shape)
    return y


def hermitian_extend(t, n, axis, reflect, blocks=1, block_axis=None):
    """Full spectrum (``n`` modes along ``axis``) of a real field from its half.

    Parameters
    ----------
    t : tf.Tensor
        complex64 or complex128 with ``n // 2 + 1`` modes along ``axis``: the
        transform of a real field along ``axis`` and the Fourier axes ``reflect``
        (e.g. :func:`rfft_along` then :func:`fft_along`); other axes are positions.
    n : int
    axis : int
    reflect : sequence of int
        The other Fourier axes (their indices are negated in the mirror modes).
    blocks : int
        With ``blocks > 1``, write the result packed for an all-to-all: split
        ``block_axis`` (before ``axis``) into ``blocks`` blocks and put the block
        index first, ``[blocks, .., L / blocks, ..]`` (no extra pass).
    block_axis : int, optional

    Returns
    -------
    tf.Tensor
        ``n`` modes along ``axis``: ``t[k]`` for ``k < n // 2 + 1``, else
        ``conj(t[-reflect, n - k])``. Native op ``FlowpmHermitian`` (one pass);
        CPU only (see :func:`uses_native`).
    """
    return _hermitian(t, n, axis, reflect, False, blocks, block_axis)


def hermitian_fold(t, n, axis, reflect, blocks=1, block_axis=None):
    """Hermitian part of a spectrum, half of it kept (``n // 2 + 1`` modes along ``axis``).

    Parameters
    ----------
    t : tf.Tensor
        complex64 or complex128 with ``n`` modes along ``axis``.
    n : int
    axis : int
    reflect : sequence of int
        The other Fourier axes.
    blocks : int
        With ``blocks > 1``, ``t`` is packed (see :func:`hermitian_extend`; e.g. the
        pieces received from an all-to-all): ``axis``, ``reflect`` and
        ``block_axis`` refer to the unpacked tensor, which is returned.
    block_axis : int, optional

    Returns
    -------
    tf.Tensor
        ``(t[k] + conj(t[-reflect, -k])) / 2`` for ``k < n // 2 + 1``: its inverse
        transform (:func:`fft_along` over ``reflect``, then :func:`irfft_along`
        along ``axis``) is the real part of the inverse transform of ``t``.
        Native op ``FlowpmHermitian``; CPU only.
    """
    return _hermitian(t, n, axis, reflect, True, blocks, block_axis)


# Gradients of FlowpmHermitian (R-linear: conj has the gradient conj(dy) in TF's
# convention). With k' = (n - k) mod n and sigma the reflection of ``reflect``:
#   extend: grad x[k] = dy[k] + [k' >= m] conj(dy[sigma, k']),  k < m;
#   fold:   grad x[k] = (dy0[k] + conj(dy0[sigma, k'])) / 2,  dy0 = dy zero-padded to n;
# packed (blocks > 1) extend: dy unpacked first; packed fold: the gradient packed.
# Built from TF ops (FFT3DOperation never differentiates them: its gradient is another
# FFT3DOperation); tested by dot-product tests in tests/test_native_fft.py.
@tf.RegisterGradient("FlowpmHermitian")
def _hermitian_grad(op, dy):
    n, axis = op.get_attr("n"), op.get_attr("axis")
    blocks, block_axis = op.get_attr("blocks"), op.get_attr("block_axis")
    axes = list(op.get_attr("reflect")) + [axis]
    m = n // 2 + 1
    if op.get_attr("fold"):
        pad = [[0, 0]] * dy.shape.ndims
        pad[axis] = [0, n - m]
        dy0 = tf.pad(dy, pad)
        g = 0.5 * (dy0 + tf.math.conj(_reflect(dy0, axes)))
        return _pack(g, blocks, block_axis) if blocks > 1 else g
    if blocks > 1:
        dy = _unpack(dy, block_axis)
    mask = ((n - np.arange(m)) % n >= m).astype(np.float64)
    mask = tf.constant(mask.reshape((-1,) + (1,) * (dy.shape.ndims - axis - 1)), dy.dtype)
    mirror = tf.math.conj(_reflect(dy, axes))
    return (tf.gather(dy, np.arange(m), axis=axis)
            + mask * tf.gather(mirror, np.arange(m), axis=axis))


# ----------------------------------------------------------------------------- FFT op
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
        cdtype = _complex_of(x.dtype)
        # Per-stage normalisation and the factor left for the end: TF's ifft
        # divides by n at every stage, so y = s * (its result); the native op
        # can scale by 1/n inside each stage at no extra pass, so a factor of
        # 1/N (r2c, grad c2r) or 1 (c2r, grad r2c) relative to the unnormalised
        # transform costs no multiplication at all.
        stage = {}

        def choose(t):
            if not stage:
                unnorm = self._scale / self._n if self._inverse else self._scale
                if not uses_native(t):
                    stage.update(normalized=self._inverse, factor=self._scale)
                elif np.isclose(unnorm, 1.0 / self._n, rtol=1e-12, atol=0):
                    stage.update(normalized=True, factor=1.0)
                else:
                    stage.update(normalized=False, factor=unnorm)
            return stage

        def one_d(t, axis):
            return fft_along(t, axis, self._inverse, normalized=choose(t)["normalized"])

        def trivial(mesh_axis):
            return mesh_axis is None or mesh_impl.shape[mesh_axis].size == 1

        # Half spectrum (native path, real input of the forward / real output of the
        # inverse): the transform along z keeps nz // 2 + 1 modes and the next stages
        # transform only those, as long as the Hermitian symmetry can be completed (or
        # folded) locally, i.e. while every Fourier axis is on this rank: kz is local
        # in the middle stage when mesh axis b is trivial, every axis is when a is too.
        # Forward: rfft along z, FFTs on the half, then hermitian_extend (kz -> nz)
        # after the middle (b trivial) or the last stage (a and b trivial). Inverse:
        # hermitian_fold (the Hermitian part, whose inverse is the real part sought)
        # before the first (a, b trivial) or the middle stage (b trivial), FFTs on the
        # half, irfft along z. Otherwise (b split): the full spectrum throughout.
        t = lowering.tensors[x]
        nz = x.shape.dims[pos[2]].size
        half = None
        native_slice = uses_native(t.to_laid_out_tensor().tensor_list[0])
        if native_slice and trivial(b) and (
                (not self._inverse and not x.dtype.is_complex)
                or (self._inverse and self._real_output)):
            half = "outer" if trivial(a) else "middle"
        # Exchange on a (split ky, concat x, or the reverse) with the pack fused into
        # hermitian_extend (forward) and the unpack into hermitian_fold (inverse):
        # needs a MeshImpl that exchanges laid-out pieces (``alltoall_pieces``, e.g.
        # HvdSimdMeshImpl) and x as the leading axis (the pieces then concatenate
        # along x for free). Saves a transpose of the full field per exchange.
        pieces = getattr(mesh_impl, "alltoall_pieces", None)
        fused = half == "middle" and pieces is not None and pos[0] == 0 and pos[1] < pos[2]
        blocks = mesh_impl.shape[a].size if fused else 1
        packed = dict(blocks=blocks, block_axis=pos[1]) if fused else {}

        def first(t):
            if half and not self._inverse:  # rfft: nz // 2 + 1 modes
                return native.load("fft_ops").flowpm_fft_r2c(
                    t, Tcomplex=cdtype, axis=pos[2], normalized=choose(t)["normalized"])
            axis = pos[2] if not self._inverse else pos[0]
            if not t.dtype.is_complex and not self._inverse:  # r2c: no cast, half the work
                return fft_of_real_along(t, axis, normalized=choose(t)["normalized"])
            t = tf.cast(t, cdtype) if not t.dtype.is_complex else t
            if half == "outer":
                t = hermitian_fold(t, nz, pos[2], [pos[0], pos[1]])
            return one_d(t, axis)

        def middle(t):
            if half == "middle" and self._inverse:
                t = hermitian_fold(t, nz, pos[2], [pos[1]], **packed)
            t = one_d(t, pos[1])
            if half == "middle" and not self._inverse:
                t = hermitian_extend(t, nz, pos[2], [pos[1]], **packed)
            return t

        def last(t):
            axis = pos[0] if not self._inverse else pos[2]
            real_out = self._real_output and self._inverse  # c2r: half the work
            if half and real_out:
                t = native.load("fft_ops").flowpm_fft_c2r(
                    t, Treal=_real_of(t.dtype), n=nz, axis=axis,
                    normalized=choose(t)["normalized"])
            elif real_out:
                t = ifft_real_part_along(t, axis, normalized=choose(t)["normalized"])
            else:
                t = one_d(t, axis)
            factor = choose(t)["factor"]
            t = t * tf.constant(factor, t.dtype) if factor != 1.0 else t
            if half == "outer" and not self._inverse:
                t = hermitian_extend(t, nz, pos[2], [pos[0], pos[1]])
            return tf.math.real(t) if self._real_output and not real_out else t

        def exchange(t, mesh_axis, split, concat):
            if trivial(mesh_axis):
                return t
            if fused and mesh_axis == a:  # pieces laid out by extend / read by fold
                if self._inverse:  # split x, the leading axis: pieces = a reshape
                    t = mesh_impl.slicewise(
                        lambda u: tf.reshape(u, [blocks, -1] + u.shape.as_list()[1:]), t)
                    return pieces(t, mesh_axis)
                t = pieces(t, mesh_axis)  # [blocks, x / blocks, ..]: concatenated along x
                return mesh_impl.slicewise(
                    lambda u: tf.reshape(u, [-1] + u.shape.as_list()[2:]), t)
            return mesh_impl.alltoall(t, mesh_axis, split, concat)

        if native_slice and not trivial(b) and pieces is not None and pos == [0, 1, 2] \
                and len(x.shape.dims) == 3:
            t = self._lower_blocked(mesh_impl, t, a, b, pieces, choose, first, last)
            lowering.set_tensor_lowering(y, t)
            return
        t = mesh_impl.slicewise(first, t)
        if not self._inverse:
            t = exchange(t, b, pos[2], pos[1])
            t = mesh_impl.slicewise(middle, t)
            t = exchange(t, a, pos[1], pos[0])
        else:
            t = exchange(t, a, pos[0], pos[1])
            t = mesh_impl.slicewise(middle, t)
            t = exchange(t, b, pos[1], pos[2])
        t = mesh_impl.slicewise(last, t)
        lowering.set_tensor_lowering(y, t)

    def _lower_blocked(self, mesh_impl, t, a, b, pieces, choose, first, last):
        """The stages with ``kz`` split (mesh axis ``b`` non-trivial), native path: every
        all-to-all exchanges the pieces the FFT ops write and read in place (their
        ``in_blocks`` / ``out_blocks``), so no transpose packs or unpacks them.

        Forward (x, y, z on a, b, -): FFT along z into Q blocks of z; exchange on b
        (piece j: the y block of rank j); FFT along y reading those Q blocks, into P
        blocks of y; exchange on a (piece i: the x block of rank i, i.e. x in order);
        FFT along x (``last``). Inverse (kx, ky, kz on -, a, b): FFT along kx
        (``first``); P blocks of kx (a reshape) exchanged on a (piece i: the ky block
        of rank i); FFT along ky reading the P blocks, into Q blocks of ky; exchange
        on b (piece j: the kz block of rank j); FFT along kz reading the Q blocks.
        """
        P, Q = mesh_impl.shape[a].size if a is not None else 1, mesh_impl.shape[b].size

        def norm(u):
            return choose(u)["normalized"]

        if not self._inverse:
            def along_z(u):
                if not u.dtype.is_complex:
                    return fft_of_real_along(u, 2, normalized=norm(u), out_blocks=Q)
                return fft_along(u, 2, False, norm(u), out_blocks=Q)

            t = pieces(mesh_impl.slicewise(along_z, t), b)
            t = mesh_impl.slicewise(
                lambda u: fft_along(u, 1, False, norm(u), in_blocks=Q, out_blocks=P), t)
            if P > 1:
                t = pieces(t, a)
                t = mesh_impl.slicewise(
                    lambda u: tf.reshape(u, [-1] + u.shape.as_list()[2:]), t)
            return mesh_impl.slicewise(last, t)

        t = mesh_impl.slicewise(first, t)
        if P > 1:
            t = mesh_impl.slicewise(
                lambda u: tf.reshape(u, [P, -1] + u.shape.as_list()[1:]), t)
            t = pieces(t, a)
        t = mesh_impl.slicewise(
            lambda u: fft_along(u, 1, True, norm(u), in_blocks=P, out_blocks=Q), t)
        t = pieces(t, b)

        def along_kz(u):
            if self._real_output:
                v = ifft_real_part_along(u, 2, normalized=norm(u), in_blocks=Q)
            else:
                v = fft_along(u, 2, True, norm(u), in_blocks=Q)
            factor = choose(u)["factor"]
            return v * tf.constant(factor, v.dtype) if factor != 1.0 else v

        return mesh_impl.slicewise(along_kz, t)


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
