"""Distributed 3D FFT on the (P, Q) pencil decomposition, with exact gradients.

Layout
------
A real-space field has the dimensions ``x, y, z`` (``x`` split over the P
ranks of mesh axis ``row``, ``y`` over the Q ranks of ``col``, ``z`` local).
Its transform has the dimensions ``kx, ky, kz`` (``kx`` local, ``ky`` on
``row``, ``kz`` on ``col``), *in the same tensor positions*: the data are
never transposed, only re-distributed. Along each k axis the modes are in
*mirror-pair order* (:func:`flowpm_mtf.layout.k_order`: ``0, n/2, 1, n-1, 2,
n-2, ..``), the same on every grid; :func:`flowpm_mtf.layout.kvec` carries it,
so kernels built from it need no care. The forward transform runs

1. 1D FFT along ``z`` (local);
2. all-to-all on ``col``: split ``z``, gather ``y``; 1D FFT along ``y``;
3. all-to-all on ``row``: split ``y``, gather ``x``; 1D FFT along ``x``;

and the inverse runs the same steps backwards. The all-to-alls are issued
through ``mesh_impl.alltoall`` inside the operation's lowering, so the code runs
on every Mesh TF ``MeshImpl``. Kernels are built as named mtf tensors on ``kx,
ky, kz`` (see :func:`flowpm_mtf.layout.kvec`); Mesh TF aligns operands by
dimension name.

Half the spectrum through the exchanges
---------------------------------------
The transform of a real field (``r2c``, the gradient of ``c2r``) and the
transform to a real field (``c2r``, the gradient of ``r2c``) move ``nz / 2`` of
the ``nz`` modes through every stage and both all-to-alls, as FFTW-based
distributed FFTs (mpi4py-fft, PFFT) do (``FFT3DOperation._lower_half``; native
path, ``x, y, z`` fields with even sizes and even ``ky``, ``kz`` blocks):

* the FFT along ``z`` keeps the ``nz / 2 + 1`` non-negative modes and packs the
  two real ones, zero and Nyquist, into one slot (``r_0 + i r_{n/2}``,
  :func:`~flowpm_mtf.mesh.fft_local.rfft_packed_along`): ``nz / 2`` values, which
  split evenly into the ``Q`` pieces of the exchange on ``col``;
* the FFTs along ``y`` and ``x`` write their output in mirror-pair order;
* :func:`~flowpm_mtf.mesh.fft_local.pairs_extend` then writes each rank's full ``kz``
  block from its representatives: with every block of an even number of
  positions holding whole pairs, the mirror ``-k`` of every mode is on the same rank, and
  ``F(-k) = conj(F(k))`` is one local pass (the packed slot unpacks with the
  2D Hermitian symmetry of each of its two planes).

The inverse folds the full spectrum to the representatives of its Hermitian
part first (:func:`~flowpm_mtf.mesh.fft_local.pairs_fold`, whose inverse is the real
part sought), then runs the same stages backwards. With a ``MeshImpl`` that
exchanges laid-out pieces (``alltoall_pieces``, e.g. ``HvdSimdMeshImpl``) the FFT
ops write the pieces of the next exchange and read those of the last one
directly (their ``in_blocks`` / ``out_blocks``), so no transpose packs or unpacks
an all-to-all.
Every other transform (complex input and output, e.g.
:func:`c2c_inverse`; odd sizes or blocks; batch dimensions; the TensorFlow
path) moves all ``n`` modes (``FFT3DOperation._lower_full``), writing each k
axis in pair order while it is local (a permutation inside the panel copies of
the native op, a gather on the TensorFlow path). What the exchanges cost:
``results/fft_pairs.md`` and ``results/fft_4rank_experiments.md``.

Local stages
------------
Every 1D transform above, and the mirror-pair completion, is a local FFT of
:mod:`flowpm_mtf.mesh.fft_local`: on the CPU the FFTW op of
``flowpm_mtf/native/fft_ops.cc``, on a GPU ``tf.signal`` (cuFFT), chosen per slice
by :func:`flowpm_mtf.mesh.fft_local.uses_native`; each carries its exact gradient.
Wave vectors on ``kx, ky, kz`` are :func:`flowpm_mtf.layout.kvec`, and products
of k-space fields with kernels :func:`flowpm_mtf.mesh.complex_ops.apply_kernel`.

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
importing this module applies our Mesh TF fixes,
:func:`hvd_mesh_impl.mtf_compat.apply` (complex gradients, lazy master variables;
no Horovod import). Products of complex tensors
with ``*`` lack the complex conjugate in their gradient: multiply k-space fields
by kernels with :func:`flowpm_mtf.mesh.complex_ops.apply_kernel`, whose gradient is
exact.

The local 1D transforms are in :mod:`flowpm_mtf.mesh.fft_local`, the k-vectors
(:func:`flowpm_mtf.layout.kvec`) in :mod:`flowpm_mtf.layout`, and the arithmetic on
complex k-space tensors (:func:`flowpm_mtf.mesh.complex_ops.apply_kernel`, ``abs2``,
``real_vdot``) in :mod:`flowpm_mtf.mesh.complex_ops`. To force the TensorFlow path,
monkeypatch ``uses_native`` on :mod:`flowpm_mtf.mesh.fft_local`: the local FFTs and the
lowering here both call that function.
"""
import mesh_tensorflow as mtf
import numpy as np
import tensorflow.compat.v1 as tf

from hvd_mesh_impl import mtf_compat

from .. import config as cfg
from . import fft_local  # the lowering calls fft_local.uses_native: one switch for both
from .. import layout, native
from .fft_local import (complex_dtype, fft_along, fft_of_real_along, ifft_real_part_along,
                        irfft_packed_along, pairs_extend, pairs_fold, real_dtype,
                        rfft_packed_along)

mtf_compat.apply()  # complex gradients; no full-size master variables in the TF graph

# ----------------------------------------------------------------------------- shapes
real_shape = layout.real_shape
k_shape = layout.k_shape


def _differentiable(dtype):
    return dtype.is_floating or dtype.is_complex


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
        cdtype = complex_dtype(x.dtype)
        self._outputs = [mtf.Tensor(self, out_shape,
                                    real_dtype(cdtype) if real_output else cdtype)]
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
        # Per-stage normalisation and the factor left for the end (stage_normalisation)
        t = lowering.tensors[x]
        native_slice = fft_local.uses_native(t.to_laid_out_tensor().tensor_list[0])
        normalized, factor = stage_normalisation(native_slice, self._inverse, self._scale,
                                                 self._n)
        P, Q = split_size(mesh_impl, a), split_size(mesh_impl, b)
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
        """All ``n`` modes through every stage: :func:`full_stages`."""
        return full_stages(mesh_impl, t, pos, a, b, normalized, factor, self._inverse,
                           self._real_output, complex_dtype(self.inputs[0].dtype))

    def _lower_half(self, mesh_impl, t, a, b, nz, normalized, factor):
        """The transform of a real field (forward) or to a real field (inverse) on half
        the spectrum (native path, ``x, y, z`` fields, even sizes and even ``ky``,
        ``kz`` blocks): every stage and both all-to-alls move ``nz / 2`` of the ``nz``
        modes, as an FFTW-based distributed FFT does: :func:`half_forward` with
        :func:`pairs_extend`, or :func:`pairs_fold` then :func:`half_inverse`."""
        if not self._inverse:
            return half_forward(mesh_impl, t, a, b, normalized, factor, extend=True)
        return half_inverse(mesh_impl, t, a, b, nz, normalized, factor, fold=True)


# ----------------------------------------------------------------------------- stages
def stage_normalisation(native_slice, inverse, scale, n):
    """``(normalized, factor)`` of the stages of ``y = scale * T(x)`` (``T`` the
    unnormalised DFT, or its inverse when ``inverse``; ``n`` its length): TF's ifft
    divides by ``n`` at every stage, so ``y = factor * (its result)``; the native op can
    scale by ``1/n`` inside each stage at no extra pass, so a factor of ``1/n`` (r2c,
    grad c2r) or 1 (c2r, grad r2c) relative to the unnormalised transform costs no
    multiplication at all."""
    unnorm = scale / n if inverse else scale
    if not native_slice:
        return inverse, scale
    if np.isclose(unnorm, 1.0 / n, rtol=1e-12, atol=0):
        return True, 1.0
    return False, unnorm


def half_path_serves(conf, mesh_impl, field_slice, library):
    """Whether an operation on a real ``[x, y, z]`` field of ``conf`` that runs
    :func:`half_forward` (and :func:`half_inverse`) around a native op of ``library`` serves
    this slice (e.g. :class:`flowpm_mtf.mesh.radial_filter.RadialFilterOperation`).

    Parameters
    ----------
    conf : SimConfig
    mesh_impl : mtf.MeshImpl
    field_slice : tf.Tensor
        One laid-out slice of the field.
    library : str
        The stem of the native op library of the middle op (``kspace_ops``, ``power_ops``).

    Returns
    -------
    bool
        The native FFT op and ``library`` serve the slice (a CPU), and the mesh and its
        ``ky``, ``kz`` blocks are even (:func:`half_spectrum_fits` on the ranks of the mesh
        axes of ``x`` and ``y``).
    """
    if not fft_local.uses_native(field_slice):
        return False
    if native.ops_for(library, field_slice, dtypes=None) is None:
        return False
    grid = tuple(split_size(mesh_impl, mesh_impl.tensor_dimension_to_mesh_axis(d))
                 for d in real_shape(conf).dims[:2])
    return half_spectrum_fits(conf.nc, grid)


def _scaler(factor):
    """``u -> factor * u`` (nothing for a factor of 1)."""
    return lambda u: u * tf.constant(factor, u.dtype) if factor != 1.0 else u


def split_size(mesh_impl, mesh_axis):
    """Ranks along ``mesh_axis`` (1 for None or a trivial axis)."""
    if mesh_axis is None or mesh_impl.shape[mesh_axis].size == 1:
        return 1
    return mesh_impl.shape[mesh_axis].size


def full_stages(mesh_impl, t, pos, a, b, normalized, factor, inverse, real_output, cdtype):
    """All ``n`` modes through every stage (any input, any ``MeshImpl``, any batch
    dimensions): complex 1D FFTs (real-to-complex first for a real input, the real
    part last for a real output) that write (forward) or read (inverse) each k axis
    in mirror-pair order while it is local, around the two all-to-alls.

    ``pos``: the tensor positions of the three transformed axes; ``a``, ``b``: ``(mesh
    axis, size)`` of the first two (forward) or last two (inverse); ``cdtype``: the
    complex dtype of the stages.
    """
    (a, P), (b, Q) = a, b
    inv = inverse
    scaled = _scaler(factor)

    def exchange(u, mesh_axis, size, split, concat):
        return u if size == 1 else mesh_impl.alltoall(u, mesh_axis, split, concat)

    if not inv:
        def first(u):
            if not u.dtype.is_complex:  # r2c: no cast, half the work
                return fft_of_real_along(u, pos[2], normalized=normalized, out_pairs=True)
            return fft_along(u, pos[2], False, normalized, out_pairs=True)

        def last(u):
            u = scaled(fft_along(u, pos[0], False, normalized, out_pairs=True))
            return tf.math.real(u) if real_output else u

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
        if real_output:  # c2r: half the work
            return scaled(ifft_real_part_along(u, pos[2], normalized=normalized,
                                               in_pairs=True))
        return scaled(fft_along(u, pos[2], True, normalized, in_pairs=True))

    t = mesh_impl.slicewise(first, t)
    t = exchange(t, a, P, pos[0], pos[1])
    t = mesh_impl.slicewise(
        lambda u: fft_along(u, pos[1], True, normalized, in_pairs=True), t)
    t = exchange(t, b, Q, pos[1], pos[2])
    return mesh_impl.slicewise(last, t)


# ----------------------------------------------------------------------------- half stages
def _first_blocks(mesh_impl, a, b):
    """The laid-out coordinates of the mesh axes ``a``, ``b`` (``(axis, size)`` pairs) that
    are split, and the function of their slices giving :func:`pairs_extend`'s ``firsts``."""
    (a, P), (b, Q) = a, b
    pcoords = [mesh_impl.laid_out_pcoord(m) for m, size in ((a, P), (b, Q)) if size > 1]

    def firsts(*pc):
        pc = list(pc)
        flags = [tf.equal(pc.pop(0), 0) if size > 1 else tf.constant(True) for size in (P, Q)]
        return tf.cast(tf.stack(flags), tf.int32)
    return pcoords, firsts


def half_forward(mesh_impl, t, a, b, normalized, factor, extend=True):
    """The forward half-spectrum stages of a real ``x, y, z`` field (laid out on mesh axes
    ``a = (axis, P)``, ``b = (axis, Q)``, z local), native path.

    Packed rfft along z (``nz / 2`` values, the Nyquist mode in the zero mode's slot), in
    Q blocks; exchange on b; FFT along y (mirror-pair order out), in P blocks; exchange on
    a; FFT along x (pair order out), times ``factor``. With ``extend``, :func:`pairs_extend`
    then completes each kz block from its representatives (whose mirrors are on the rank):
    the full ``[kx, ky, kz]`` slices of :class:`FFT3DOperation`. Without it, each slice is
    ``[nx, ny / P, nz / 2Q]``: the representatives of the rank's kz block, the first block's
    slot 0 packing the zero and Nyquist planes (:func:`pairs_extend`'s input). With a
    ``MeshImpl`` that exchanges laid-out pieces (``alltoall_pieces``, e.g.
    ``HvdSimdMeshImpl``) the FFT ops write the pieces of the next exchange and read those
    of the last one (``in_blocks`` / ``out_blocks``): no transposes.
    """
    (a, P), (b, Q) = a, b
    pieces = getattr(mesh_impl, "alltoall_pieces", None)
    bp = P if pieces is not None else 1  # blocked layouts on a / on b
    bq = Q if pieces is not None else 1
    scaled = _scaler(factor)
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
    if not extend:
        return mesh_impl.slicewise(
            lambda u: scaled(fft_along(u, 0, False, normalized, out_pairs=True)), t)
    pcoords, firsts = _first_blocks(mesh_impl, (a, P), (b, Q))
    return mesh_impl.slicewise(
        lambda u, *pc: pairs_extend(
            scaled(fft_along(u, 0, False, normalized, out_pairs=True)), firsts(*pc)),
        t, *pcoords)


def half_inverse(mesh_impl, t, a, b, nz, normalized, factor, fold=True):
    """The inverse half-spectrum stages to a real ``x, y, z`` field, native path: the
    mirror of :func:`half_forward` (``t`` its output for the same ``fold`` as ``extend``).

    With ``fold``, :func:`pairs_fold` first takes each full kz block to the representatives
    of its Hermitian part; then the FFTs along kx and ky (pair order in), the exchanges,
    the packed irfft along z, times ``factor``.
    """
    (a, P), (b, Q) = a, b
    pieces = getattr(mesh_impl, "alltoall_pieces", None)
    bp = P if pieces is not None else 1
    bq = Q if pieces is not None else 1
    scaled = _scaler(factor)
    if fold:
        pcoords, firsts = _first_blocks(mesh_impl, (a, P), (b, Q))
        t = mesh_impl.slicewise(
            lambda u, *pc: fft_along(pairs_fold(u, firsts(*pc)), 0, True, normalized,
                                     out_blocks=bp, in_pairs=True), t, *pcoords)
    else:
        t = mesh_impl.slicewise(
            lambda u: fft_along(u, 0, True, normalized, out_blocks=bp, in_pairs=True), t)
    if P > 1:
        t = pieces(t, a) if pieces is not None else mesh_impl.alltoall(t, a, 0, 1)
    t = mesh_impl.slicewise(
        lambda u: fft_along(u, 1, True, normalized, in_blocks=bp, out_blocks=bq,
                            in_pairs=True), t)
    if Q > 1:
        t = pieces(t, b) if pieces is not None else mesh_impl.alltoall(t, b, 1, 2)
    return mesh_impl.slicewise(
        lambda u: scaled(irfft_packed_along(u, nz, 2, normalized=normalized, in_blocks=bq)),
        t)


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
        :func:`flowpm_mtf.physics.kernels.packed_inverse`).
    """
    return _inverse(kfield, conf, name, real_output=False)
