r"""Radial filters of real fields, :math:`f \mapsto \mathrm{c2r}[K(|\mathbf k|)\,\mathrm{r2c}(f)]`,
as one operation on half the spectrum.

The initial conditions' potentials are such filters of real fields: the first-order
potential :math:`\phi^{(1)} = \mathrm{c2r}[\delta_k / k^2]` with :math:`\delta_k =
\mathrm{r2c}(z)\sqrt{N P / V}` is the filter :math:`K = \sqrt{N P / V} / k^2` of the white
noise :math:`z`, and the second-order one the filter :math:`1 / k^2` of the 2LPT source;
the PM force's potential is the filter :math:`1 / k^2` of the density
(:mod:`flowpm_mtf.physics.gravity`). Composed of :func:`flowpm_mtf.mesh.fft.r2c`, a kernel and :func:`flowpm_mtf.mesh.fft.c2r`, each
filter writes the full spectrum of a real field (``pairs_extend``, one complex field of
``N`` modes: 1.07 GB of fresh pages at 512^3 in float32), multiplies all ``N`` modes, and
folds it back (``pairs_fold``) before the inverse transform. :class:`RadialFilterOperation`
lowers the same map without the full spectrum (:func:`flowpm_mtf.mesh.fft.half_forward` without
the extend, the native ``FlowpmRadialScaleHalf`` on the representatives, then
:func:`flowpm_mtf.mesh.fft.half_inverse` without the fold): ``N / 2`` modes, in the real field's
buffer where TensorFlow lets the ops take it over. Where that path does not serve (odd
sizes or blocks, no native op, a GPU), it lowers the composition.

The kernel is a function of :math:`|\mathbf k|` alone, evaluated in numpy (float64) at run
time (:func:`radial_tables`, here with the rest of the radial kernels' tables, which
:func:`flowpm_mtf.physics.ics.apply_radial_kernel` and :func:`flowpm_mtf.physics.ics.radial_kernel` use too):
in a cubic box once per integer :math:`n = m_x^2 + m_y^2 + m_z^2` up to the rank's largest,
as a 1-d table the native ops index by the squared mode numbers; otherwise once per distinct
:math:`|\mathbf k|` of the rank's slice. The same values on every process grid, no k-space
constant in the graph.

Gradient: for real, even :math:`K` the filter is a real symmetric operator (a convolution
with an even kernel), so its gradient is the same filter of the cotangent. Tested by a
dot-product test and against numpy in ``tests/test_radial_filter.py``.
"""
import mesh_tensorflow as mtf
import numpy as np
import tensorflow.compat.v1 as tf

from . import fft, fft_local
from .. import layout, native

__all__ = ["RadialFilterOperation", "radial_filter", "radial_scale_half", "radial_table_numpy",
           "radial_tables", "gather_radial", "radial_scale_tf",
           "inverse_laplace_values"]


def _fold_axis(k):
    """Distinct ``|k|`` of a 1-d k slice and the index of each entry among them."""
    return np.unique(np.abs(k), return_inverse=True)


def _mode_numbers(k, dk):
    """``|k| / dk`` as integers (int64), or None if ``k`` is not on that lattice."""
    m = np.rint(np.abs(k) / dk)
    if not np.allclose(m * dk, np.abs(k), rtol=1e-9, atol=0):
        return None
    return m.astype(np.int64)


def radial_table_numpy(kx, ky, kz, values, dtype, dk=None, summed=False):
    """``values(|k|)`` on the distinct ``(|kx|, |ky|, |kz|)`` of 1-d k slices.

    Returns the kernel on the grid of distinct values (about 1/8 of the cells of a
    full-spectrum slice: ``+k`` and ``-k`` give the same ``|k|``), 0 at ``k = 0``,
    and per axis the index of each entry of the slice among them (int32), to be
    gathered along the three axes (:func:`flowpm_mtf.physics.ics.radial_kernel`). ``values`` is
    called once per integer ``n`` up to the largest (``dk``: 49152 times at 256^3 on one
    rank) or per distinct ``|k|`` (86145 times without ``dk``), instead of 2146689 times
    per cell.

    Parameters
    ----------
    kx, ky, kz : ndarray
        1-d float64 wave numbers of the slice [h/Mpc].
    values : callable
        float64 ``|k|`` [h/Mpc] (positive) -> float64 values.
    dtype : numpy dtype
        Of the returned kernel.
    dk : float, optional
        The common spacing ``2 pi / L`` of the three axes [h/Mpc] (a cubic box).
        Then ``k^2 = dk^2 n`` with the integer ``n = mx^2 + my^2 + mz^2``: ``values``
        on every ``n`` of ``1 .. max n`` (a 1-d table), gathered one ``(y, z)`` plane
        at a time, instead of a sort of the float ``k^2`` or a table of the ``n`` present
        with a 3-d index array (both several times slower to build); ``values`` gets
        ``|k| = dk sqrt(n)``, which may differ from ``sqrt(kx^2 + ky^2 + kz^2)`` in the
        last bit. Without ``dk`` (or if the slices are not on its lattice),
        the distinct float64 ``k^2 = kx^2 + ky^2 + kz^2`` (``np.unique``), and the
        result equals a per-cell evaluation bit for bit. Either way the kernel is a
        function of the mode alone, the same on every process grid.
    summed : bool, optional
        On the lattice of ``dk``, return the 1-d table over ``n`` itself and per axis
        the squared mode number of each entry (int32): the kernel at ``(i, j, k)`` is
        ``table[ix[i] + iy[j] + iz[k]]`` (the native radial ops read both forms,
        kspace_ops.cc), the same values as the grid's without building it. Off that
        lattice, the grid form all the same.
    """
    (ux, ix), (uy, iy), (uz, iz) = _fold_axis(kx), _fold_axis(ky), _fold_axis(kz)
    ms = None if dk is None else [_mode_numbers(u, dk) for u in (ux, uy, uz)]
    if ms is not None and all(m is not None for m in ms):
        sq = [m * m for m in ms]
        top = int(sum(q.max() for q in sq))
        itype = np.int32 if top < 2**31 else np.int64
        sqx, sqy, sqz = (q.astype(itype) for q in sq)
        table = np.zeros(top + 1, np.float64)
        table[1:] = values(dk * np.sqrt(np.arange(1, top + 1, dtype=np.float64)))
        table = table.astype(dtype)
        if summed and itype == np.int32:
            return table, sqx[ix], sqy[iy], sqz[iz]
        small = np.empty((sqx.size, sqy.size, sqz.size), dtype)
        plane = sqy[:, None] + sqz[None, :]
        for a in range(sqx.size):         # one (y, z) plane at a time: no 3-d index array
            np.take(table, plane + sqx[a], out=small[a])
    else:
        k2 = ux[:, None, None]**2 + uy[None, :, None]**2 + uz[None, None, :]**2
        u, inv = np.unique(k2, return_inverse=True)
        k = np.sqrt(u)
        per_k2 = np.zeros(k.shape, np.float64)
        pos = k > 0
        per_k2[pos] = values(k[pos])
        small = per_k2.astype(dtype)[inv].reshape(k2.shape)
    return small, ix.astype(np.int32), iy.astype(np.int32), iz.astype(np.int32)


def radial_tables(conf, values, name, kx, ky, kz, summed=False):
    """The kernel table of one slice and its gather indices (:func:`radial_table_numpy`), at run
    time (``tf.numpy_function``: no k-space constant in the graph). ``summed``: the 1-d
    table where the box allows it (for the native ops only; the TensorFlow gathers of
    :func:`gather_radial` need the grid)."""
    np_dtype = conf.np_dtype
    box = np.asarray(conf.box_size, np.float64)
    dk = 2 * np.pi / box[0] if np.all(box == box[0]) else None   # a cubic box
    summed = bool(summed) and dk is not None
    small, ix, iy, iz = tf.numpy_function(
        lambda x, y, z: radial_table_numpy(x, y, z, values, np_dtype, dk, summed),
        [kx, ky, kz], [conf.tf_dtype, tf.int32, tf.int32, tf.int32], name=name + "_values")
    if not summed:
        small.set_shape([None, None, None])
    return (small, tf.reshape(ix, [kx.shape[0]]), tf.reshape(iy, [ky.shape[0]]),
            tf.reshape(iz, [kz.shape[0]]))


def gather_radial(small, ix, iy, iz):
    """The full kernel of a slice from its table: gathers along z (1/4 of the cells), y
    (1/2), then x, which copies whole (y, z) planes."""
    out = tf.gather(small, iz, axis=2)
    out = tf.gather(out, iy, axis=1)
    out = tf.gather(out, ix, axis=0)
    out.set_shape([ix.shape[0], iy.shape[0], iz.shape[0]])
    return out


def radial_scale_tf(field, small, ix, iy, iz):
    """The TensorFlow twin of the native ``FlowpmRadialScale`` (one slice):
    ``field * small[ix, iy, iz]`` by the gathers of :func:`flowpm_mtf.physics.ics.radial_kernel`,
    the cast to complex and the product of :func:`flowpm_mtf.mesh.complex_ops.apply_kernel`."""
    with tf.control_dependencies([field.op]):     # no full-size kernel before it is needed
        k = tf.cast(gather_radial(small, ix, iy, iz), field.dtype)
    return field * k


def radial_scale_half(field, table, ix, iy, iz, firsts):
    """The native ``FlowpmRadialScaleHalf`` (kspace_ops.cc): ``field`` times a radial kernel
    on the representatives of a real field's spectrum.

    Parameters
    ----------
    field : tf.Tensor
        Complex ``[nx, ly, h]``: :func:`flowpm_mtf.mesh.fft.half_forward`'s slice without the
        extend (the first kz block's slot 0 packs the zero and Nyquist planes).
    table, ix, iy : tf.Tensor
        The kernel's table and the indices along ``kx`` and the ``ky`` block
        (:func:`radial_tables`): the grid of distinct ``|k|``, or the 1-d
        table over ``n = mx^2 + my^2 + mz^2`` with the squared mode numbers (summed).
    iz : tf.Tensor
        int32 ``[2 h]``: the indices (or squared mode numbers) of the rank's full ``kz``
        block (mirror-pair order: slot ``j`` is position ``2 j``; the Nyquist plane of the
        packed slot is position 1).
    firsts : tf.Tensor
        int32 ``[2]``: whether the ``ky`` and the ``kz`` block are the first.

    Returns
    -------
    tf.Tensor
        Of ``field``'s shape and dtype: what ``pairs_extend``, ``FlowpmRadialScale`` and
        ``pairs_fold`` give, to the last bit, in one pass and in ``field``'s buffer when
        nothing else holds it. CPU only.
    """
    return native.load("kspace_ops").flowpm_radial_scale_half(field, table, ix, iy, iz, firsts)


class RadialFilterOperation(mtf.Operation):
    """``c2r(K(|k|) r2c(field))`` of a real ``[x, y, z]`` field (:func:`radial_filter`).

    Parameters
    ----------
    field : mtf.Tensor
        Real ``[x, y, z]`` of ``conf.dtype``.
    kvecs : list of 3 mtf.Tensor
        float64 ``[kx]``, ``[ky]``, ``[kz]`` [h/Mpc] (:func:`flowpm_mtf.layout.kvec_tensors`).
    values : callable
        float64 ``|k|`` [h/Mpc] (positive) -> float64 kernel values (numpy); the kernel is
        0 at ``k = 0``.
    conf : SimConfig
    name : str
    """

    def __init__(self, field, kvecs, values, conf, name):
        super().__init__([field] + list(kvecs), name=name)
        self._values = values
        self._conf = conf
        self._outputs = [mtf.Tensor(self, field.shape, field.dtype)]

    def gradient(self, grad_ys):
        # a real even kernel: the filter is symmetric, its adjoint is itself
        return [radial_filter(grad_ys[0], self._conf, self._values, name=self.name + "_grad"),
                None, None, None]

    def lower(self, lowering):
        mesh_impl = lowering.mesh_impl(self)
        conf, x = self._conf, self.inputs[0]
        axes = [mesh_impl.tensor_dimension_to_mesh_axis(d) for d in x.shape.dims]
        kaxes = [mesh_impl.tensor_dimension_to_mesh_axis(k.shape.dims[0])
                 for k in self.inputs[1:]]
        a, b = axes[0], axes[1]
        if axes[2] is not None or kaxes != [None, a, b]:
            raise ValueError(
                "%s: unsupported layout: x, y, z on mesh axes %s and kx, ky, kz on %s; the "
                "layout rules must put (x, ky) on one mesh axis, (y, kz) on another and leave "
                "z and kx unsplit (see SimConfig.layout_rules)" % (self.name, axes, kaxes))
        P, Q = fft.split_size(mesh_impl, a), fft.split_size(mesh_impl, b)
        t = lowering.tensors[x]
        ks = [lowering.tensors[k] for k in self.inputs[1:]]
        first = t.to_laid_out_tensor().tensor_list[0]
        n, nz = conf.n_cells, x.shape.dims[2].size
        values, name = self._values, self.name
        cdtype = fft_local.complex_dtype(x.dtype)
        if fft.half_path_serves(conf, mesh_impl, first, "kspace_ops"):
            pcoords, firsts = fft._first_blocks(mesh_impl, (a, P), (b, Q))

            def scale(f, kx, ky, kz, *pc):
                small, ix, iy, iz = radial_tables(conf, values, name, kx, ky, kz,
                                                       summed=True)
                return radial_scale_half(f, small, ix, iy, iz, firsts(*pc))

            normalized, factor = fft.stage_normalisation(True, False, 1.0 / n, n)
            u = fft.half_forward(mesh_impl, t, (a, P), (b, Q), normalized, factor,
                                 extend=False)
            u = mesh_impl.slicewise(scale, u, *ks, *pcoords)
            normalized, factor = fft.stage_normalisation(True, True, float(n), n)
            y = fft.half_inverse(mesh_impl, u, (a, P), (b, Q), nz, normalized, factor,
                                 fold=False)
        else:
            native_fft = fft_local.uses_native(first)

            def scale(f, kx, ky, kz):
                lib = native.ops_for("kspace_ops", f, dtypes=None)
                tables = radial_tables(conf, values, name, kx, ky, kz,
                                            summed=lib is not None)
                if lib is None:
                    return radial_scale_tf(f, *tables)
                return lib.flowpm_radial_scale(f, *tables)

            pos = [0, 1, 2]
            normalized, factor = fft.stage_normalisation(native_fft, False, 1.0 / n, n)
            u = fft.full_stages(mesh_impl, t, pos, (a, P), (b, Q), normalized, factor,
                                False, False, cdtype)
            u = mesh_impl.slicewise(scale, u, *ks)
            normalized, factor = fft.stage_normalisation(native_fft, True, float(n), n)
            y = fft.full_stages(mesh_impl, u, pos, (a, P), (b, Q), normalized, factor,
                                True, True, cdtype)
        lowering.set_tensor_lowering(self.outputs[0], y)


def radial_filter(field, conf, values, name="radial_filter"):
    r"""``c2r(K(|k|) r2c(field))``: a real field filtered by a radial kernel.

    Equal, to rounding, to ``fft.c2r(ics.apply_radial_kernel(fft.r2c(field, conf), conf,
    values), conf)``, without the full spectrum where the half-spectrum path serves (see
    the module docstring).

    Parameters
    ----------
    field : mtf.Tensor
        Real ``[x, y, z]`` field of ``conf.dtype``.
    conf : SimConfig
    values : callable
        float64 ``|k|`` [h/Mpc] (positive) -> float64 kernel values (numpy), e.g.
        ``lambda k: 1 / k**2``; the kernel is 0 at ``k = 0``. It must be a function of
        ``|k|`` alone (it is evaluated once per distinct ``|k|`` of a rank's slice).
    name : str, optional

    Returns
    -------
    mtf.Tensor
        Real, shape and dtype of ``field`` [the field's units times the kernel's].

    Raises
    ------
    ValueError
        If ``field`` is not a ``[x, y, z]`` field of ``conf.dtype``.
    """
    shape = fft.real_shape(conf)
    if field.shape != shape:
        raise ValueError("radial_filter: the field must be %s, got %s" % (shape, field.shape))
    if field.dtype != conf.tf_dtype:
        raise ValueError("radial_filter: the field must have dtype %s, got %s"
                         % (conf.dtype, field.dtype.name))
    kvecs = layout.kvec_tensors(conf, field.mesh, tf.float64, name)
    return RadialFilterOperation(field, kvecs, values, conf, name).outputs[0]


def inverse_laplace_values(k):
    r""":math:`1 / k^2` [(Mpc/h)^2] of ``|k|`` [h/Mpc] (numpy, positive ``k``): the
    kernel of :meth:`flowpm_mtf.physics.kernels.Kernels.inverse_laplace` as a radial function."""
    k = np.asarray(k, np.float64)
    return 1.0 / (k * k)
