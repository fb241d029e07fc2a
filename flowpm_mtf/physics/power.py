r"""Distributed, differentiable power spectrum of a real-space field.

Estimator
---------
With the FlowPM-normalised transform :math:`\delta_{\mathbf k} =
\mathrm{r2c}(\delta) = \mathrm{fftn}(\delta)/N` (:mod:`flowpm_mtf.mesh.fft`) and the
box volume :math:`V = L_x L_y L_z` [(Mpc/h)^3],

.. math::

    \hat P(k_b) = \frac{V}{N_b} \sum_{\mathbf k \in b}
                  \frac{|\delta_{\mathbf k}|^2}{W^2(\mathbf k)},
    \qquad
    \hat k_b = \frac{1}{N_b}\sum_{\mathbf k \in b} |\mathbf k|,

[(Mpc/h)^3] and [h/Mpc], where :math:`N_b` is the number of modes in shell
:math:`b` and :math:`W = 1` or, with ``deconvolve_cic=True``, the CIC window
:math:`W(\mathbf k) = \prod_i \mathrm{sinc}^2(k_i \Delta_i / 2)`
(:math:`\mathrm{sinc}\,x = \sin x / x`, :math:`\Delta_i` the cell size). For a
field of :func:`flowpm_mtf.physics.ics.linear_field` with spectrum :math:`P`,
:math:`\langle \hat P(k_b)\rangle` is the average of :math:`P(|\mathbf k|)`
over the modes of the shell. No shot noise is subtracted.

Mode counting
-------------
The sums run over the **full complex spectrum**: all ``nc[0] * nc[1] * nc[2]``
wave vectors of the c2c transform, so both members of each conjugate pair
:math:`\pm\mathbf k` are counted (:math:`N_b` is twice the number of
independent complex modes, plus the self-conjugate modes on the Nyquist planes).
This is the count for which the Gaussian cosmic-variance error is
:math:`\sigma_P = P \sqrt{2 / N_b}`, and it equals nbodykit's ``modes`` (which
counts a half-spectrum with weight 2). The ``k = 0`` mode is never counted.

Binning
-------
Shells are half-open, ``edges[b] <= |k| < edges[b + 1]``; modes outside all
shells are ignored. The default (:func:`default_edges`) uses linear bins of
width :math:`\Delta k = 2\pi / L_{\min}` *centred* on the multiples
:math:`\Delta k, 2\Delta k, \dots` up to the smallest Nyquist frequency
:math:`\min_i \pi / \Delta_i`, i.e. ``edges = (j + 1/2) * dk``: in a cubic box
:math:`|\mathbf k|/\Delta k = \sqrt{\text{integer}}` is never a half-integer,
so no mode sits on an edge and the binning does not depend on rounding.

Distribution
------------
Each processor sorts its own k-space slice into the shells in one pass (the
native ``FlowpmShellSums`` on the CPU, else ``tf.math.unsorted_segment_sum``;
:class:`ShellSumsOperation`) and one all-reduce over the mesh axes of the
k-space tensor sums the partial histograms; the result is a small tensor on the
dimension ``kbin`` (not in any layout rule: replicated on every processor). Its
gradient broadcasts the bin gradients back onto the modes
(:class:`BinBroadcastOperation`), so :math:`\hat P` is differentiable with
respect to the field. :class:`BinnedSumOperation` (:func:`binned_sum`) sums any
tensor into given bins the same way.
"""
import logging

import mesh_tensorflow as mtf
import numpy as np
import tensorflow.compat.v1 as tf

from .. import config as cfg
from .. import layout
from ..mesh import complex_ops
from ..mesh import fft, fft_local
from .. import native

__all__ = ["KBIN", "default_edges", "cic_window", "bin_index", "binned_sum",
           "BinnedSumOperation", "BinBroadcastOperation", "ShellSumsOperation", "shell_sums",
           "PowerShellSumsOperation",
           "power_spectrum"]

log = logging.getLogger(__name__)

KBIN = "kbin"
"""Name of the (replicated, never split) dimension of the binned spectrum."""


# ----------------------------------------------------------------------------- binning
def default_edges(conf):
    r"""Default shell edges [h/Mpc]: width ``dk = 2 pi / min(box_size)``, centred on ``j dk``.

    Parameters
    ----------
    conf : SimConfig

    Returns
    -------
    ndarray
        ``(j + 1/2) * dk`` for ``j = 0 .. n_bins`` (float64), with
        ``n_bins = max(1, round(k_nyq / dk))`` and ``k_nyq = min_i pi / cell_i``
        the smallest Nyquist frequency: bin ``j`` (from 0) is centred on
        ``(j + 1) dk`` and the last on ``~k_nyq``.
    """
    dk = 2.0 * np.pi / min(conf.box_size)
    k_nyq = min(np.pi / d for d in conf.cell_size)
    n_bins = max(1, int(np.floor(k_nyq / dk + 0.5)))
    return (np.arange(n_bins + 1) + 0.5) * dk


def _check_edges(edges):
    edges = np.asarray(edges, dtype=np.float64)
    if edges.ndim != 1 or edges.size < 2 or not np.all(np.isfinite(edges)):
        raise ValueError("edges must be a 1-d array of at least 2 finite values [h/Mpc], got %r"
                         % (edges,))
    if np.any(np.diff(edges) <= 0) or edges[0] < 0:
        raise ValueError("edges must be non-negative and strictly increasing, got %r" % (edges,))
    return edges


def _kvec64(conf, mesh, values, name):
    return [mtf.import_tf_tensor(mesh, tf.constant(v, tf.float64),
                                 mtf.Shape([mtf.Dimension(n, s)]), name="%s_%s" % (name, n))
            for v, n, s in zip(values, cfg.K_DIMS, conf.nc)]


def _knorm64(conf, mesh, name="knorm"):
    """``|k|`` [h/Mpc] on ``[kx, ky, kz]`` in float64 (from float64 constants on each axis)."""
    kx, ky, kz = layout.kvec_tensors(conf, mesh, tf.float64, name)
    return mtf.sqrt(mtf.square(kx) + mtf.square(ky) + mtf.square(kz))


def cic_window(conf, mesh, dtype=None, name="cic_window"):
    r"""CIC assignment window :math:`W(\mathbf k) = \prod_i \mathrm{sinc}^2(k_i \Delta_i/2)`.

    Parameters
    ----------
    conf : SimConfig
    mesh : mtf.Mesh
    dtype : tf.DType, optional
        Output dtype (default ``conf.dtype``).

    Returns
    -------
    mtf.Tensor
        Real, ``[kx, ky, kz]`` [dimensionless], 1 at ``k = 0``, down to
        :math:`(2/\pi)^6` at the Nyquist corner.
    """
    dtype = tf.as_dtype(dtype or conf.tf_dtype)
    factors = []
    for k, d in zip(layout.axis_k(conf), conf.cell_size):
        factors.append(np.sinc(k * d / (2.0 * np.pi))**2)       # np.sinc(x) = sin(pi x)/(pi x)
    wx, wy, wz = [mtf.cast(t, dtype) if dtype != tf.float64 else t
                  for t in _kvec64(conf, mesh, factors, name)]
    return wx * wy * wz


def _shells_of(k, edges):
    """Flat ``int32`` shell index of the float64 ``|k|`` values ``k`` (``len(edges) - 1`` for
    none and for ``k = 0``): the TensorFlow ops of :func:`bin_index` on one slice."""
    n_bins = edges.size - 1
    flat = tf.reshape(k, [1, -1])
    idx = tf.searchsorted(tf.constant(edges[None, :], tf.float64), flat, side="right",
                          out_type=tf.int32) - 1
    # Static shapes and a broadcast scalar: tf.shape() is int32 and wraps for
    # slices of 2^31 cells or more (a 2048^3 mesh on one rank).
    idx = tf.where_v2((idx < 0) | (idx >= n_bins) | tf.equal(flat, 0.0),
                      tf.constant(n_bins, tf.int32), idx)
    return tf.reshape(idx, [-1])


def bin_index(conf, mesh, edges, name="bin_index"):
    """Shell index of every mode, ``n_bins`` for modes outside the shells and for ``k = 0``.

    Parameters
    ----------
    conf : SimConfig
    mesh : mtf.Mesh
    edges : array_like
        Increasing shell edges [h/Mpc].

    Returns
    -------
    (mtf.Tensor, mtf.Tensor)
        ``int32`` indices in ``[0, n_bins]`` on ``[kx, ky, kz]`` (shells are
        ``edges[b] <= |k| < edges[b+1]``), and ``|k|`` [h/Mpc] in float64.
    """
    edges = _check_edges(edges)
    knorm = _knorm64(conf, mesh, name=name + "_k")

    def fn(k):
        return tf.reshape(_shells_of(k, edges), k.shape)

    idx = mtf.slicewise(fn, [knorm], output_shape=knorm.shape, output_dtype=tf.int32,
                        splittable_dims=knorm.shape.dims, grad_function=0, name=name)
    return idx, knorm


# ----------------------------------------------------------------------------- ops
def _power_ops(t):
    """The native op module (``flowpm_mtf/native/power_ops.cc``) if it serves the local
    tensor ``t`` (on a CPU, float32/float64), else None (the TensorFlow path)."""
    return native.ops_for("power_ops", t)


def _reduced_mesh_axes(mesh_impl, x):
    return [a for a in mesh_impl.tensor_layout(x).tensor_axis_to_mesh_axis if a is not None]


class BinnedSumOperation(mtf.Operation):
    """Histogram ``out[b] = sum of values over the cells with bins == b`` on a replicated dim.

    Parameters
    ----------
    values : mtf.Tensor
        Real floating tensor (any layout).
    bins : mtf.Tensor
        ``int32`` tensor of the same shape, entries in ``[0, n_bins]``; cells with
        ``bins == n_bins`` are dropped.
    n_bins : int
    name : str, optional

    Notes
    -----
    Lowering: ``tf.math.unsorted_segment_sum`` on each slice, then one
    ``mesh_impl.allreduce(SUM)`` over the mesh axes that split ``values``.
    Gradient: ``grad values = dy[bins]`` (0 for dropped cells), see
    :class:`BinBroadcastOperation`.
    """

    def __init__(self, values, bins, n_bins, name=None):
        super().__init__([values, bins], name=name or "binned_sum")
        if values.shape != bins.shape:
            raise ValueError("binned_sum: values %s and bins %s differ in shape"
                             % (values.shape, bins.shape))
        if not values.dtype.is_floating:
            raise TypeError("binned_sum: values must be real floating, got %s" % values.dtype.name)
        if bins.dtype != tf.int32:
            raise TypeError("binned_sum: bins must be int32, got %s" % bins.dtype.name)
        self._n_bins = int(n_bins)
        self._outputs = [mtf.Tensor(self, mtf.Shape([mtf.Dimension(KBIN, self._n_bins)]),
                                    values.dtype)]

    @property
    def has_gradient(self):
        return True

    def gradient(self, grad_ys):
        values, bins = self.inputs
        return [BinBroadcastOperation(grad_ys[0], bins, name=self.name + "_grad").outputs[0],
                None]

    def lower(self, lowering):
        mesh_impl = lowering.mesh_impl(self)
        values, bins = self.inputs
        n = self._n_bins

        def fn(v, b):
            s = tf.math.unsorted_segment_sum(tf.reshape(v, [-1]), tf.reshape(b, [-1]), n + 1)
            return s[:n]

        out = mesh_impl.slicewise(fn, lowering.tensors[values], lowering.tensors[bins])
        axes = _reduced_mesh_axes(mesh_impl, values)
        if axes:
            out = mesh_impl.allreduce(out, axes, "SUM")
        lowering.set_tensor_lowering(self.outputs[0], out)


class BinBroadcastOperation(mtf.Operation):
    """``out[cell] = y[bins[cell]]`` (0 where ``bins == n_bins``): adjoint of :class:`BinnedSumOperation`.

    Parameters
    ----------
    y : mtf.Tensor
        Real tensor of shape ``[kbin]`` (replicated).
    bins : mtf.Tensor
        ``int32`` bin indices in ``[0, n_bins]``; the output has their shape.
    """

    def __init__(self, y, bins, name=None):
        super().__init__([y, bins], name=name or "bin_broadcast")
        if y.shape.dimension_names != [KBIN]:
            raise ValueError("bin_broadcast: y must have the shape [%s], got %s" % (KBIN, y.shape))
        self._n_bins = y.shape.dims[0].size
        self._outputs = [mtf.Tensor(self, bins.shape, y.dtype)]

    @property
    def has_gradient(self):
        return True

    def gradient(self, grad_ys):
        y, bins = self.inputs
        return [BinnedSumOperation(grad_ys[0], bins, self._n_bins,
                                   name=self.name + "_grad").outputs[0], None]

    def lower(self, lowering):
        mesh_impl = lowering.mesh_impl(self)
        y, bins = self.inputs
        if mesh_impl.tensor_layout(y).tensor_axis_to_mesh_axis[0] is not None:
            raise ValueError("bin_broadcast: dimension %r must not be split" % KBIN)

        def fn(t, b):
            padded = tf.concat([t, tf.zeros([1], t.dtype)], 0)
            return tf.gather(padded, b)

        lowering.set_tensor_lowering(
            self.outputs[0],
            mesh_impl.slicewise(fn, lowering.tensors[y], lowering.tensors[bins]))


class ShellSumsOperation(mtf.Operation):
    """Mode count, ``|k|`` sum and ``values`` sum of every shell, in one pass over the modes.

    What :func:`bin_index` and three :func:`binned_sum` compute (the same shells: the same
    float64 ``|k|`` and comparisons), without their full-size ``|k|``, bin and float64
    fields: on the CPU the native ``FlowpmShellSums`` (``flowpm_mtf/native/power_ops.cc``;
    float64 accumulation, the result independent of the thread count), elsewhere the
    TensorFlow ops of those functions on each slice (at large meshes on one rank, most
    of the job's final fetch when done with TensorFlow ops).

    Parameters
    ----------
    values : mtf.Tensor
        Real floating, ``[kx, ky, kz]`` (e.g. the power of each mode).
    conf : SimConfig
    edges : numpy.ndarray
        Increasing shell edges [h/Mpc] (see :func:`bin_index`).
    name : str, optional

    Notes
    -----
    Outputs ``[kbin]``, replicated: the mode count and the ``|k|`` sum (float64, no
    gradient) and the sum of ``values`` (its dtype). Lowering: one slicewise pass per
    processor, then one ``mesh_impl.allreduce(SUM)`` of the three over the mesh axes
    that split ``values``. Gradient of the ``values`` sum: ``dy[bin]`` on every mode
    (:class:`BinBroadcastOperation` of :func:`bin_index`), as for :func:`binned_sum`.
    """

    def __init__(self, values, conf, edges, name=None):
        if values.shape != layout.k_shape(conf):
            raise ValueError("shell_sums: values must have the shape %s, got %s"
                             % (layout.k_shape(conf), values.shape))
        if values.dtype.is_complex or not values.dtype.is_floating:
            raise TypeError("shell_sums: values must be real floating, got %s"
                            % values.dtype.name)
        kvec = layout.kvec_tensors(conf, values.mesh, tf.float64, (name or "shell_sums") + "_k")
        super().__init__([values] + kvec, name=name or "shell_sums")
        self._conf = conf
        self._edges = _check_edges(edges)
        self._outputs = _shell_outputs(self, self._edges, values.dtype)

    @property
    def has_gradient(self):
        return True

    def gradient(self, grad_ys):
        dy = grad_ys[2]
        if dy is None:
            return [None] * len(self.inputs)
        values = self.inputs[0]
        bins, _ = bin_index(self._conf, values.mesh, self._edges, name=self.name + "_grad_bins")
        return [BinBroadcastOperation(dy, bins, name=self.name + "_grad").outputs[0]] + [
            None] * (len(self.inputs) - 1)

    def lower(self, lowering):
        mesh_impl = lowering.mesh_impl(self)
        edges = self._edges
        n = edges.size - 1

        outs = mesh_impl.slicewise(lambda v, kx, ky, kz: _slice_shell_sums(v, kx, ky, kz, edges),
                                   *[lowering.tensors[t] for t in self.inputs])
        _set_reduced(lowering, mesh_impl, self.outputs, outs, self.inputs[0])


def _slice_shell_sums(v, kx, ky, kz, edges):
    """``(modes, ksum, vsum)`` of one k-space slice of real values (:class:`ShellSumsOperation`):
    the native ``FlowpmShellSums``, or the TensorFlow ops of :func:`bin_index` and
    :func:`binned_sum`."""
    e = tf.constant(edges, tf.float64)
    lib = _power_ops(v)
    if lib is not None:
        return lib.flowpm_shell_sums(v, kx, ky, kz, e)
    n = edges.size - 1
    k = tf.sqrt(tf.square(kx)[:, None, None] + tf.square(ky)[None, :, None]
                + tf.square(kz)[None, None, :])
    b = _shells_of(k, edges)
    return tuple(tf.math.unsorted_segment_sum(tf.reshape(t, [-1]), b, n + 1)[:n]
                 for t in (tf.ones_like(k), k, v))


def _shell_outputs(op, edges, dtype):
    """The outputs of a shell-sum operation: modes and |k| sums (float64) and the values'
    sums (``dtype``), each ``[kbin]``."""
    kbin = mtf.Shape([mtf.Dimension(KBIN, edges.size - 1)])
    return [mtf.Tensor(op, kbin, tf.float64), mtf.Tensor(op, kbin, tf.float64),
            mtf.Tensor(op, kbin, dtype)]


def _set_reduced(lowering, mesh_impl, outputs, outs, x):
    """The per-slice sums ``outs`` summed over the mesh axes that split ``x``, as ``outputs``."""
    axes = _reduced_mesh_axes(mesh_impl, x)
    for t, out in zip(outputs, outs):
        lowering.set_tensor_lowering(t, mesh_impl.allreduce(out, axes, "SUM") if axes else out)


class PowerShellSumsOperation(mtf.Operation):
    r"""The shell sums of :math:`|\mathrm{r2c}(f)|^2` of a real ``[x, y, z]`` field ``f``:
    ``shell_sums(abs2(fft.r2c(field)))`` without the full spectrum.

    Parameters
    ----------
    field : mtf.Tensor
        Real ``[x, y, z]``.
    conf : SimConfig
    edges : ndarray
        Checked shell edges [h/Mpc].
    name : str

    Notes
    -----
    Outputs as :class:`ShellSumsOperation`'s (``[kbin]``, replicated). Lowering, where the
    half-spectrum stages serve (:func:`flowpm_mtf.mesh.fft.half_path_serves`): the forward
    stages without the extend (:func:`flowpm_mtf.mesh.fft.half_forward`) and the native
    ``FlowpmShellSumsHalf`` on each rank's representatives, each standing for its mirror
    too (power_ops.cc): no full spectrum and no :math:`|F|^2` field (at 512^3 on one rank
    1.07 GB and 0.54 GB of new memory, and three passes over them). Elsewhere the full
    forward stages, :math:`|F|^2` and :class:`ShellSumsOperation`'s sums. Gradient of the
    sum of :math:`|F|^2`: that of the composition it replaces (``mtf.gradients`` through
    r2c, abs2 and the shell sums).
    """

    def __init__(self, field, conf, edges, name):
        kvec = layout.kvec_tensors(conf, field.mesh, tf.float64, name + "_k")
        super().__init__([field] + kvec, name=name)
        self._conf = conf
        self._edges = edges
        self._outputs = _shell_outputs(self, edges, field.dtype)

    @property
    def has_gradient(self):
        return True

    def gradient(self, grad_ys):
        dy = grad_ys[2]
        if dy is None:
            return [None] * len(self.inputs)
        field = self.inputs[0]
        graph = field.mesh.graph
        start = len(graph.operations)
        p3d = complex_ops.abs2(fft.r2c(field, self._conf, name=self.name + "_grad_r2c"),
                               name=self.name + "_grad_abs2")
        vsum = shell_sums(p3d, self._conf, self._edges, name=self.name + "_grad_shells")[2]
        g, = mtf.gradients([vsum], [field], [dy], operations=graph.operations[start:])
        return [g] + [None] * (len(self.inputs) - 1)

    def lower(self, lowering):
        mesh_impl = lowering.mesh_impl(self)
        conf, x, edges = self._conf, self.inputs[0], self._edges
        a, b = (mesh_impl.tensor_dimension_to_mesh_axis(d) for d in x.shape.dims[:2])
        P, Q = fft.split_size(mesh_impl, a), fft.split_size(mesh_impl, b)
        t = lowering.tensors[x]
        ks = [lowering.tensors[k] for k in self.inputs[1:]]
        first = t.to_laid_out_tensor().tensor_list[0]
        n = conf.n_cells
        if fft.half_path_serves(conf, mesh_impl, first, "power_ops"):
            pcoords, firsts = fft._first_blocks(mesh_impl, (a, P), (b, Q))
            normalized, factor = fft.stage_normalisation(True, False, 1.0 / n, n)
            u = fft.half_forward(mesh_impl, t, (a, P), (b, Q), normalized, factor, extend=False)

            def sums(f, kx, ky, kz, *pc):
                return native.load("power_ops").flowpm_shell_sums_half(
                    f, kx, ky, kz, tf.constant(edges, tf.float64), firsts(*pc),
                    T=f.dtype.real_dtype)

            outs = mesh_impl.slicewise(sums, u, *ks, *pcoords)
        else:
            native_fft = fft_local.uses_native(first)
            normalized, factor = fft.stage_normalisation(native_fft, False, 1.0 / n, n)
            u = fft.full_stages(mesh_impl, t, [0, 1, 2], (a, P), (b, Q), normalized, factor,
                                False, False, fft_local.complex_dtype(x.dtype))
            outs = mesh_impl.slicewise(
                lambda f, kx, ky, kz: _slice_shell_sums(tf.math.real(f * tf.math.conj(f)),
                                                        kx, ky, kz, edges), u, *ks)
        _set_reduced(lowering, mesh_impl, self.outputs, outs, x)


def shell_sums(values, conf, edges, name=None):
    """``(n_modes, k_sum, values_sum)`` per shell (see :class:`ShellSumsOperation`).

    Returns
    -------
    tuple of 3 mtf.Tensor
        Shape ``[kbin]``, replicated: float64, float64, dtype of ``values``.
    """
    return tuple(ShellSumsOperation(values, conf, edges, name=name).outputs)


def binned_sum(values, bins, n_bins, name=None):
    """Sum ``values`` into ``n_bins`` bins (see :class:`BinnedSumOperation`).

    Returns
    -------
    mtf.Tensor
        Shape ``[kbin]`` (size ``n_bins``), replicated, dtype of ``values``.
    """
    return BinnedSumOperation(values, bins, n_bins, name=name).outputs[0]


# ----------------------------------------------------------------------------- estimator
def power_spectrum(field, conf, edges=None, deconvolve_cic=False, name="power_spectrum"):
    r"""Shell-averaged power spectrum of a real field (distributed, differentiable).

    Parameters
    ----------
    field : mtf.Tensor
        Real field on ``[x, y, z]`` [dimensionless, e.g. a density contrast].
    conf : SimConfig
        Mesh shape and box size.
    edges : array_like, optional
        Increasing shell edges [h/Mpc]; default :func:`default_edges` (width
        ``2 pi / min(box_size)``, centred on its multiples, up to Nyquist).
    deconvolve_cic : bool, optional
        Divide :math:`|\delta_k|^2` by :math:`W^2` of :func:`cic_window` (for a
        field painted with cloud-in-cell).
    name : str, optional

    Returns
    -------
    k_mean : mtf.Tensor
        Mean ``|k|`` of the modes of each shell [h/Mpc], float64, ``[kbin]``.
    power : mtf.Tensor
        :math:`\hat P(k)` [(Mpc/h)^3], dtype of ``field``, ``[kbin]``;
        differentiable with respect to ``field``.
    n_modes : mtf.Tensor
        Number of modes of each shell, counting both members of each conjugate
        pair (full complex spectrum, ``k = 0`` excluded), float64, ``[kbin]``.

    Notes
    -----
    Empty shells have ``n_modes = 0`` and ``k_mean = power = 0``. All three
    tensors are replicated (the dimension ``kbin`` is in no layout rule), so
    ``lowering.export_to_tf_tensor`` gives them on every processor.
    """
    if field.dtype.is_complex or not field.dtype.is_floating:
        raise TypeError("power_spectrum expects a real floating field, got %s"
                        % field.dtype.name)
    if field.shape != fft.real_shape(conf):
        raise ValueError("power_spectrum: field must have the shape %s, got %s"
                         % (fft.real_shape(conf), field.shape))
    edges = default_edges(conf) if edges is None else _check_edges(edges)
    n_bins = edges.size - 1
    mesh = field.mesh
    volume = float(np.prod(conf.box_size))

    if deconvolve_cic:
        p3d = complex_ops.abs2(fft.r2c(field, conf, name=name + "_r2c"), name=name + "_abs2")
        w = cic_window(conf, mesh, dtype=field.dtype, name=name + "_window")
        p3d = p3d / mtf.square(w)
        n_modes, k_sum, p_sum = shell_sums(p3d, conf, edges, name=name + "_shells")
    else:   # no full spectrum where the half-spectrum stages serve
        n_modes, k_sum, p_sum = PowerShellSumsOperation(field, conf, edges,
                                                        name=name + "_shells").outputs
    safe = mtf.maximum(n_modes, 1.0)
    k_mean = k_sum / safe
    power = p_sum * mtf.cast(volume / safe, field.dtype)
    log.debug("power spectrum: %d shells in [%.4g, %.4g] h/Mpc, CIC deconvolution %s",
              n_bins, edges[0], edges[-1], deconvolve_cic)
    return k_mean, power, n_modes
