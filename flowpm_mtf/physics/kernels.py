r"""Fourier-space kernels of the particle-mesh solver (FlowPM / FastPM conventions).

Conventions
-----------
A k-space field is the :func:`flowpm_mtf.mesh.fft.r2c` transform of a real field on
``[kx, ky, kz]``. Wave numbers are physical, :math:`k_d = 2\pi\,
\mathrm{fftfreq}(n_d, c_d)` [h/Mpc] with the cell size :math:`c_d` [Mpc/h];
positions are in cells, so a displacement along ``d`` in Mpc/h is divided by
:math:`c_d` to give cells. For cubic cells every expression below reduces
exactly to single-device FlowPM (``flowpm.kernels`` with ``fftk``, which works
in grid units :math:`w_d = k_d c_d`).

* Inverse Laplacian: :math:`1 / |k|^2`, set to 0 at :math:`k = 0`
  (``flowpm.kernels.laplace_kernel``; the sign is folded into the gradient).
* Gradient: the four-point finite-difference kernel of FastPM
  (``flowpm.kernels.gradient_kernel`` with ``order=1``),
  :math:`i\,\tilde k_d`, :math:`\tilde k_d = (8 \sin w_d - \sin 2 w_d) / (6 c_d)`
  [h/Mpc]. It vanishes at the Nyquist frequency.

With these, the field :math:`\Psi_d = \mathcal{F}^{-1}[\,i \tilde k_d\, \delta_k
/ |k|^2\,] / c_d` [cells] is :math:`-\partial_d \phi` for :math:`\nabla^2\phi =
\delta`: the Zel'dovich displacement of the density ``delta`` and, times
:math:`\tfrac32\Omega_m`, the FastPM force.

Two real fields per inverse FFT
-------------------------------
Every field above is the inverse transform of a *Hermitian* spectrum
(:math:`A_{-k} = \overline{A_k}`) when :math:`\delta_k` is the transform of a
real field: :math:`1/|k|^2` and :math:`\tilde k_i \tilde k_j` are even and
real, and :math:`i\tilde k_d` is odd and imaginary *and vanishes at the
Nyquist mode* (where :math:`-k \equiv k`, so an odd kernel that did not
vanish there would break the symmetry). For Hermitian :math:`A, B`,
:math:`\mathcal{F}^{-1}[A + iB] = a + ib` with :math:`a, b` the real fields of
:math:`A, B`: :func:`packed_inverse` transforms the components two at a time
with one complex inverse FFT (no real-output shortcut in the last 1D stage,
but half the first two stages and half the all-to-all bytes: 3 instead of 5
units of 1D FFT work per pair). A non-Hermitian rounding residue of
:math:`B` (relative size float epsilon) leaks into :math:`a`; the unpacked
transform drops it instead, so the two agree to rounding. The packed
composition is made of differentiable operations (:func:`flowpm_mtf.mesh.complex_ops.apply_kernel`,
add, :func:`flowpm_mtf.mesh.fft.c2c_inverse`, real and imaginary parts), so its
gradient is exact for what it computes; with respect to anything real
upstream (noise, a linear field, positions) it equals the unpacked one.
"""
import logging

import mesh_tensorflow as mtf
import numpy as np
import tensorflow.compat.v1 as tf

from .. import config as cfg
from .. import layout
from ..mesh import complex_ops
from ..mesh import fft
from .. import native
from ..mesh.ordering import after

__all__ = ["gradient_kvec", "inverse_laplace_kernel", "apply_inverse_laplace",
           "inverse_laplace_tf", "Kernels", "make_kernels",
           "packed_inverse", "after", "gradient_spec", "hessian_spec", "inverse_after",
           "neg_gradient_potential", "hessian_potential", "potential_fields",
           "HESSIAN_PAIRS", "stack_xyz", "unstack_xyz", "xyz_from_packed"]

log = logging.getLogger(__name__)


def gradient_kvec(conf):
    r"""Finite-difference wave numbers :math:`\tilde k_d` along each axis (numpy).

    Parameters
    ----------
    conf : SimConfig

    Returns
    -------
    list of 3 ndarray
        float64 arrays of length ``nc[d]`` in numpy FFT order [h/Mpc]:
        :math:`(8 \sin w - \sin 2w) / (6 c_d)` with :math:`w = 2\pi\,
        \mathrm{fftfreq}(n_d)`.
    """
    return [(8 * np.sin(w) - np.sin(2 * w)) / (6.0 * c)
            for w, c in zip(layout.axis_k(conf, "grid"), conf.cell_size)]


def _import_1d(mesh, values, dim_name, dtype, name):
    return mtf.import_tf_tensor(mesh, tf.constant(np.asarray(values, dtype)),
                                mtf.Shape([mtf.Dimension(dim_name, len(values))]), name=name)


def inverse_laplace_kernel(conf, mesh):
    r"""Inverse Laplacian kernel :math:`1/|k|^2` [(Mpc/h)^2], zero at :math:`k = 0`.

    Parameters
    ----------
    conf : SimConfig
    mesh : mtf.Mesh

    Returns
    -------
    mtf.Tensor
        Real, ``[kx, ky, kz]``, dtype ``conf.dtype``.
    """
    kx, ky, kz = layout.kvec(conf, mesh, units="h/Mpc")
    kk = mtf.square(kx) + mtf.square(ky) + mtf.square(kz)

    # 1 / kk, 0 where kk = 0 (kk >= 0); one pass (recomputed every step).
    return mtf.cwise(lambda t: tf.math.divide_no_nan(tf.ones([], t.dtype), t), [kk],
                     name="inverse_laplace")


class Kernels:
    """The k-space kernels used by LPT and the PM force, built once per graph.

    Attributes
    ----------
    kvec : list of 3 mtf.Tensor
        :math:`k_d` on ``[k_d]`` [h/Mpc] (:func:`flowpm_mtf.layout.kvec`), from which
        :meth:`inverse_laplace` computes :math:`1/|k|^2` on the fly.
    grad : list of 3 mtf.Tensor
        :math:`\\tilde k_d` on ``[k_d]`` [h/Mpc] (the phase ``i`` is applied
        by :func:`flowpm_mtf.mesh.complex_ops.apply_kernel`).
    grad_cells : list of 3 mtf.Tensor
        :math:`\\tilde k_d / c_d` on ``[k_d]`` [h/Mpc / (Mpc/h)]: gradient
        followed by the conversion of a length from Mpc/h to cells.
    """

    def __init__(self, conf, mesh, kvec, grad, grad_cells):
        self._conf, self._mesh = conf, mesh
        self.kvec = kvec
        self.grad = grad
        self.grad_cells = grad_cells
        self._inv_laplace = None

    @property
    def inv_laplace(self):
        """:math:`1/|k|^2` as a full-size ``[kx, ky, kz]`` tensor [(Mpc/h)^2].

        Built on first use (:func:`inverse_laplace_kernel`); the solver itself
        multiplies by it with :meth:`inverse_laplace`, which never makes it.
        """
        if self._inv_laplace is None:
            self._inv_laplace = inverse_laplace_kernel(self._conf, self._mesh)
        return self._inv_laplace

    def inverse_laplace(self, delta_k, name="inv_laplace"):
        """``delta_k / |k|^2`` (0 at ``k = 0``): :func:`apply_inverse_laplace`."""
        return apply_inverse_laplace(delta_k, self.kvec, name)


def inverse_laplace_tf(field, kx, ky, kz):
    """The TensorFlow twin of the native ``FlowpmInverseLaplace`` (one slice).

    ``field`` complex ``[nx, ny, nz]``, ``kx, ky, kz`` its real 1-d wave numbers
    [h/Mpc]: ``field * (1 / |k|^2)``, 0 where ``|k| = 0``; the operations of
    :func:`inverse_laplace_kernel` and :func:`flowpm_mtf.mesh.complex_ops.apply_kernel`
    in the same order (so bit for bit the native op, up to the sign of a zero).
    """
    with tf.control_dependencies([field.op]):     # no full-size kernel before it is needed
        kk = (tf.square(kx)[:, None, None] + tf.square(ky)[None, :, None]) + \
            tf.square(kz)[None, None, :]
        s = tf.cast(tf.math.divide_no_nan(tf.ones([], kk.dtype), kk), field.dtype)
    return field * s


def apply_inverse_laplace(delta_k, kvec, name="inv_laplace"):
    r"""``delta_k / |k|^2`` [(Mpc/h)^2 times ``delta_k``'s units], 0 at ``k = 0``.

    The product of :func:`flowpm_mtf.mesh.complex_ops.apply_kernel` with
    :func:`inverse_laplace_kernel`, in one pass over the field without a full-size
    kernel (native ``FlowpmInverseLaplace``, kspace_ops.cc, in the field's memory
    when nothing else holds it; :func:`inverse_laplace_tf` where no native op
    serves), bit for bit the same values. Its gradient is itself (a real diagonal
    operator); the wave numbers get none.

    Parameters
    ----------
    delta_k : mtf.Tensor
        Complex ``[kx, ky, kz]``.
    kvec : list of 3 mtf.Tensor
        ``[kx]``, ``[ky]``, ``[kz]`` [h/Mpc] (:attr:`Kernels.kvec`), real dtype of
        ``delta_k``.
    name : str, optional

    Returns
    -------
    mtf.Tensor
        Complex, shape and dtype of ``delta_k``.
    """
    shape = delta_k.shape
    if [d.name for d in shape.dims] != list(cfg.K_DIMS):
        raise ValueError("inverse_laplace: the field must be on %s, got %s"
                         % (list(cfg.K_DIMS), shape))

    def fn(f, kx, ky, kz):
        lib = native.ops_for("kspace_ops", f, kx, ky, kz, dtypes=None)
        if lib is None or f.dtype.real_dtype != kx.dtype:   # e.g. float32 k, complex128
            return inverse_laplace_tf(f, kx, ky, kz)
        return lib.flowpm_inverse_laplace(f, kx, ky, kz)

    def gradient(op, dy):
        return [apply_inverse_laplace(dy, kvec, name + "_grad"), None, None, None]

    return mtf.slicewise(fn, [delta_k] + list(kvec), output_shape=shape,
                         output_dtype=delta_k.dtype, splittable_dims=shape.dims,
                         grad_function=gradient, name=name)


def make_kernels(conf, mesh):
    """Build :class:`Kernels` for ``conf`` on ``mesh``.

    Parameters
    ----------
    conf : SimConfig
    mesh : mtf.Mesh

    Returns
    -------
    Kernels
    """
    gk = gradient_kvec(conf)
    dt = conf.np_dtype
    grad = [_import_1d(mesh, g, d, dt, "grad_" + d) for g, d in zip(gk, cfg.K_DIMS)]
    grad_cells = [_import_1d(mesh, g / c, d, dt, "grad_cells_" + d)
                  for g, c, d in zip(gk, conf.cell_size, cfg.K_DIMS)]
    return Kernels(conf, mesh, layout.kvec(conf, mesh, units="h/Mpc"), grad, grad_cells)


def stack_xyz(components, name):
    """Stack 3 tensors along a new last dimension ``xyz`` (e.g. ``[x, y, z]`` -> ``[x, y, z, xyz]``)."""
    return mtf.stack(components, cfg.XYZ, axis=components[0].shape.ndims, name=name)


def interleave_xyz(components, name):
    """:func:`stack_xyz` of 3 real tensors in one pass (the native ``FlowpmInterleave``).

    The same values as :func:`stack_xyz`; ``tf.stack`` along the short last
    axis copies one element at a time (a visible part of the ICs),
    ``FlowpmInterleave`` writes rows. Without the native
    op (GPU, ``FLOWPM_MTF_NATIVE=0``) ``tf.stack``. Gradient: each component
    of ``dy`` back to its input (the op's registered gradient).

    Parameters
    ----------
    components : sequence of 3 mtf.Tensor
        Real, the same shape.
    name : str

    Returns
    -------
    mtf.Tensor
        ``[..., xyz]``.
    """
    if len(components) != 3:
        raise ValueError("interleave_xyz: 3 components, got %d" % len(components))
    shape = components[0].shape
    xyz = mtf.Dimension(cfg.XYZ, 3)

    def fwd(*ts):
        lib = native.ops_for("cic_ops", ts[0], dtypes=None)
        if lib is None:
            return tf.stack(ts, axis=-1)
        return lib.flowpm_interleave([t[..., None] for t in ts], picks=[0, 0, 1, 0, 2, 0],
                                     wrap=0)

    return mtf.slicewise(fwd, list(components), output_shape=mtf.Shape(shape.dims + [xyz]),
                         output_dtype=components[0].dtype, splittable_dims=shape.dims,
                         name=name)


def unstack_xyz(t):
    """Split a tensor along its ``xyz`` dimension into a list of 3 tensors."""
    return mtf.unstack(t, t.shape.get_dim_by_name(cfg.XYZ))


def packed_inverse(specs, conf, groups, name="packed_inverse", raw=False):
    r"""Real fields :math:`\mathrm{c2r}[\,p_n K_n F_n]`, two per complex inverse FFT.

    Component ``n`` is ``c2r(apply_kernel(F_n, K_n, p_n))`` for
    ``specs[n] = (F_n, K_n, p_n)``; components ``2m`` and ``2m + 1`` share one
    complex transform, :math:`\mathcal{F}^{-1}[A + iB] = a + ib` (module
    docstring), and all pairs go through one batched
    :func:`flowpm_mtf.mesh.fft.c2c_inverse` (two all-to-alls in all).

    Parameters
    ----------
    specs : sequence of (mtf.Tensor, mtf.Tensor, complex)
        Complex ``[kx, ky, kz]`` field, real kernel on a subset of its
        dimensions, constant phase. Each product must be Hermitian (e.g. a
        kernel of this module times the transform of a real field).
    conf : SimConfig
    groups : sequence of (str or None, int)
        Consecutive components returned together: dimension name and size
        (sizes add up to ``len(specs)``); ``(None, 1)``: one component
        without a component dimension.
    name : str, optional
    raw : bool, optional
        Return the packed complex transform instead (``groups`` unused).

    Returns
    -------
    list of mtf.Tensor
        One real ``[x, y, z, <group dim>]`` (or ``[x, y, z]``) tensor per
        group, dtype ``conf.dtype``; with ``raw``, one complex ``[x, y, z,
        <name>_pair]`` tensor: pair ``m`` holds components ``2m`` (real part)
        and ``2m + 1`` (imaginary part).
    """
    n = len(specs)
    if sum(size for _, size in groups) != n:
        raise ValueError("packed_inverse: groups %r do not cover %d components" % (groups, n))
    packed = []
    for m in range(0, n, 2):
        f, k, ph = specs[m]
        z = complex_ops.apply_kernel(f, k, ph, name="%s_%d" % (name, m))
        if m + 1 < n:
            f, k, ph = specs[m + 1]
            z = z + complex_ops.apply_kernel(f, k, 1j * complex(ph), name="%s_%d" % (name, m + 1))
        packed.append(z)
    pair = mtf.Dimension(name + "_pair", len(packed))
    z = mtf.stack(packed, pair.name, axis=packed[0].shape.ndims, name=name + "_stack")
    z = fft.c2c_inverse(z, conf, name=name + "_c2c")
    if raw:
        return [z]
    out, lo = [], 0
    for dim_name, size in groups:
        out.append(_real_components(z, lo, size, dim_name, name="%s_%s" % (name, dim_name)))
        lo += size
    return out


def _real_components(z, lo, size, dim_name, name):
    """Components ``lo .. lo + size - 1`` of ``[..., pair]`` complex read as ``[..., 2 pair]`` real.

    The interleaved (real, imaginary) view is a bitcast (no copy); only the
    selected components are copied. ``dim_name`` None (``size`` 1) drops the
    component dimension. Gradient: the selected entries of ``dy`` put back
    into a complex tensor (``dy_re + i dy_im``, TF's convention), zeros
    elsewhere.
    """
    npair = z.shape.dims[-1].size
    width = 2 * npair
    rdtype = tf.float64 if z.dtype == tf.complex128 else tf.float32
    lead = z.shape.dims[:-1]
    out_shape = mtf.Shape(lead if dim_name is None else lead + [mtf.Dimension(dim_name, size)])

    def fwd(t):
        s = t.shape.as_list()
        r = tf.reshape(tf.bitcast(t, rdtype), s[:-1] + [width])
        if dim_name is None:
            return r[..., lo]
        return r if (lo, size) == (0, width) else r[..., lo:lo + size]

    def bwd(g):
        if dim_name is None:
            g = g[..., None]
        s = g.shape.as_list()
        if (lo, size) != (0, width):
            lib = native.ops_for("cic_ops", g)
            if lib is not None:  # one pass (tf.pad along the short last axis is slow)
                g, = lib.flowpm_interleave_grad(g, picks=[v for j in range(size) for v in (0, lo + j)],
                                                wrap=0, widths=[width], N=1)
            else:
                g = tf.pad(g, [[0, 0]] * (len(s) - 1) + [[lo, width - lo - size]])
        return tf.bitcast(tf.reshape(g, s[:-1] + [npair, 2]), z.dtype)

    def grad(op, dy):
        return [mtf.slicewise(bwd, [dy], output_shape=z.shape, output_dtype=z.dtype,
                              splittable_dims=lead, name=name + "_grad")]

    return mtf.slicewise(fwd, [z], output_shape=out_shape, output_dtype=rdtype,
                         splittable_dims=lead, grad_function=grad, name=name)


def xyz_from_packed(first, last, name="xyz_from_packed", padded_conf=None):
    r"""``[x, y, z, xyz]`` real from two packed complex transforms, in one pass.

    Component 0 and 1 are the real and imaginary parts of ``first``, component 2
    the real part of ``last`` (:func:`packed_inverse` with ``raw``: the pair
    ``(0, 1)`` and the single ``2``); the same values as
    :func:`stack_xyz` of the three real parts. On the CPU the native op
    ``FlowpmInterleave`` (``flowpm_mtf/native/cic_ops.cc``) writes the
    interleaved result directly; ``tf.stack`` along the short last axis copies
    one element at a time (a visible part of a step). Elsewhere (GPU,
    ``FLOWPM_MTF_NATIVE=0``) ``tf.stack``. Gradient: ``dy_0 + i dy_1`` to
    ``first`` and ``dy_2 + 0i`` to ``last`` (TF's convention for real and
    imaginary parts).

    Parameters
    ----------
    first, last : mtf.Tensor
        Complex ``[x, y, z, pair]`` with a pair dimension of size 1 (any
        leading dimensions, the same in both).
    name : str, optional
    padded_conf : SimConfig, optional
        A configuration of one block (``grid`` (1, 1)) whose transforms
        ``first``, ``last`` are on ``[x, y, z, pair]``: return the padded block
        ``[bx, by, px, py, z, xyz]`` with periodic margins instead (what
        :func:`flowpm_mtf.mesh.halo.field_to_padded` makes of the field, written in
        the same pass: no copy of the field per axis). Gradient: the margins
        added back into the cells they copy.

    Returns
    -------
    mtf.Tensor
        Real ``[..., xyz]`` (or the padded block), the real dtype of the inputs.
    """
    for t in (first, last):
        if t.shape.dims[-1].size != 1 or not t.dtype.is_complex:
            raise ValueError("xyz_from_packed: complex [..., pair(1)] inputs expected, got %s %s"
                             % (t.dtype, t.shape))
    lead = first.shape.dims[:-1]
    if last.shape.dims[:-1] != lead:
        raise ValueError("xyz_from_packed: leading shapes differ: %s vs %s"
                         % (first.shape, last.shape))
    rdtype = tf.float64 if first.dtype == tf.complex128 else tf.float32
    xyz = mtf.Dimension(cfg.XYZ, 3)
    out_shape = mtf.Shape(lead + [xyz])
    wrap = 0
    if padded_conf is not None:
        h, (sx, sy, nz) = padded_conf.halo_size, padded_conf.block_shape
        if (tuple(padded_conf.grid) != (1, 1) or [d.size for d in lead] != [sx, sy, nz]
                or not 0 < h <= min(sx, sy)):
            raise ValueError("xyz_from_packed: padded_conf must be one block [x, y, z] with "
                             "0 < halo <= the block, got grid %s, halo %d and %s"
                             % (padded_conf.grid, h, first.shape))
        wrap = h
        out_shape = mtf.Shape(layout.padded_shape(padded_conf).dims + [xyz])

    def wrap_pad(t):
        for ax in (0, 1):
            n = t.shape.as_list()[ax]
            t = tf.gather(t, np.arange(-wrap, n + wrap) % n, axis=ax)
        return t

    def fwd(a, b):
        ra, rb = [tf.reshape(tf.bitcast(t, rdtype), t.shape.as_list()[:-1] + [2]) for t in (a, b)]
        lib = native.ops_for("cic_ops", ra, dtypes=None)
        if lib is not None:
            out = lib.flowpm_interleave([ra, rb], picks=[0, 0, 0, 1, 1, 0], wrap=wrap)
        else:
            out = tf.stack([ra[..., 0], ra[..., 1], rb[..., 0]], axis=-1)
            out = wrap_pad(out) if wrap else out
        return tf.reshape(out, out_shape.to_integer_list) if wrap else out

    def bwd(g):
        lib = native.ops_for("cic_ops", g)
        if lib is not None:  # one pass: margins added back, columns to (re, im) pairs
            if wrap:
                g = tf.reshape(g, [sx + 2 * wrap, sy + 2 * wrap, nz, 3])
            ga, gb = lib.flowpm_interleave_grad(g, picks=[0, 0, 0, 1, 1, 0], wrap=wrap,
                                                widths=[2, 2], N=2)
            return tuple(tf.bitcast(t, first.dtype)[..., None] for t in (ga, gb))
        if wrap:  # the adjoint of the periodic padding: margins added back
            g = _unwrap(tf.reshape(g, [sx + 2 * wrap, sy + 2 * wrap, nz, 3]), wrap, (sx, sy))
        zero = tf.zeros_like(g[..., 2])
        return (tf.complex(g[..., 0], g[..., 1])[..., None],
                tf.complex(g[..., 2], zero)[..., None])

    # one block: the mesh axes have size 1 (declared splittable, nothing is split)
    split = lead + out_shape.dims[:2] if wrap else lead

    def grad(op, dy):
        da = mtf.slicewise(lambda g: bwd(g)[0], [dy], output_shape=first.shape,
                           output_dtype=first.dtype, splittable_dims=split,
                           name=name + "_grad_0")
        db = mtf.slicewise(lambda g: bwd(g)[1], [dy], output_shape=last.shape,
                           output_dtype=last.dtype, splittable_dims=split, name=name + "_grad_1")
        return [da, db]

    return mtf.slicewise(fwd, [first, last], output_shape=out_shape, output_dtype=rdtype,
                         splittable_dims=split, grad_function=grad, name=name)


def _unwrap(t, wrap, sizes):
    """Adjoint of padding the first two axes of ``t`` periodically by ``wrap``: each
    margin entry added to the entry it copies (axis lengths ``sizes`` unpadded)."""
    for ax, n in zip((0, 1), sizes):
        seg = np.arange(-wrap, n + wrap) % n
        if ax == 1:
            t = tf.transpose(t, [1, 0] + list(range(2, t.shape.ndims)))
        t = tf.math.unsorted_segment_sum(t, seg, n)
        if ax == 1:
            t = tf.transpose(t, [1, 0] + list(range(2, t.shape.ndims)))
    return t


def _interleave_grad(op, dy):
    """Gradient of ``FlowpmInterleave``: each picked column of ``dy`` back to its input
    (after the adjoint of the periodic padding, with ``wrap``): the native
    ``FlowpmInterleaveGrad`` in one pass, or TensorFlow ops."""
    picks = op.get_attr("picks")
    wrap = op.get_attr("wrap")
    lib = native.ops_for("cic_ops", dy)
    if lib is not None:  # one pass (FlowpmInterleaveGrad)
        widths = [x.shape.as_list()[-1] for x in op.inputs]
        return list(lib.flowpm_interleave_grad(dy, picks=picks, wrap=wrap, widths=widths,
                                               N=len(widths)))
    if wrap:
        dy = _unwrap(dy, wrap, op.inputs[0].shape.as_list()[:2])
    pairs = [(picks[2 * j], picks[2 * j + 1]) for j in range(len(picks) // 2)]
    grads = []
    for i, x in enumerate(op.inputs):
        cols = []
        for c in range(x.shape.as_list()[-1]):
            hits = [dy[..., j] for j, pick in enumerate(pairs) if pick == (i, c)]
            cols.append(tf.add_n(hits) if hits else tf.zeros_like(dy[..., 0]))
        grads.append(tf.stack(cols, axis=-1))
    return grads


try:
    tf.RegisterGradient("FlowpmInterleave")(_interleave_grad)
except KeyError:  # already registered (module reloaded)
    pass


def _gradient_specs(pot, kernels):
    return [(pot, g, 1j) for g in kernels.grad_cells]


def _hessian_specs(pot, kernels, pairs, name):
    first = {}
    specs = []
    for i, j in pairs:
        if i not in first:
            first[i] = complex_ops.apply_kernel(pot, kernels.grad[i], 1j,
                                                name="%s_grad_%d" % (name, i))
        specs.append((first[i], kernels.grad[j], 1j))
    return specs


def gradient_spec(kernels, d):
    """Spec builder (see :func:`inverse_after`) of the ``-d_d phi`` component [cells]."""
    return lambda pot: (pot, kernels.grad_cells[d], 1j)


def hessian_spec(kernels, i, j, name="hessian"):
    """Spec builder (see :func:`inverse_after`) of ``-d_i d_j phi`` [dimensionless].

    The same operations as :func:`hessian_potential`'s components (the first
    derivative is rebuilt per use instead of being shared: one elementwise
    product, and no complex field kept between transforms).
    """
    return lambda pot: (complex_ops.apply_kernel(pot, kernels.grad[i], 1j,
                                                 name="%s_grad_%d" % (name, i)),
                        kernels.grad[j], 1j)


def inverse_after(pot, builders, conf, deps=(), name="inverse_after", raw=False):
    r"""One or two real fields of ``pot`` through one packed inverse FFT, after ``deps``.

    For computing several fields one transform at a time (instead of one
    batched transform of all of them, which holds every packed spectrum and
    its all-to-all buffers at once): chain the calls through ``deps``.

    Parameters
    ----------
    pot : mtf.Tensor
        Complex ``[kx, ky, kz]`` potential (Hermitian).
    builders : sequence of callable
        One or two ``pot -> (field, kernel, phase)`` (:func:`gradient_spec`,
        :func:`hessian_spec`): the specs of :func:`packed_inverse`.
    conf : SimConfig
    deps : sequence of mtf.Tensor, optional
        The transform starts only after these are computed (:func:`after`).
    name : str, optional
    raw : bool, optional
        Return the packed complex transform (see :func:`packed_inverse`).

    Returns
    -------
    list of mtf.Tensor
        One real ``[x, y, z]`` field per builder, dtype ``conf.dtype``; equal
        to the corresponding components of a batched :func:`packed_inverse`
        with the same pairing.
    """
    if len(builders) not in (1, 2):
        raise ValueError("inverse_after: one or two fields per transform, got %d"
                         % len(builders))
    pot = after(pot, deps, name=name + "_after")
    return packed_inverse([b(pot) for b in builders], conf, [(None, 1)] * len(builders),
                          name=name, raw=raw)


def neg_gradient_potential(delta_k, conf, kernels, packed=True, sequential=False,
                           padded=False):
    r"""Real-space :math:`-\nabla\phi` [cells] for :math:`\nabla^2\phi = \delta`.

    The three components go through one batched inverse FFT: two complex
    transforms (:func:`packed_inverse`), or three real-output ones
    (``packed=False``).

    Parameters
    ----------
    delta_k : mtf.Tensor
        Complex ``[kx, ky, kz]``: :func:`flowpm_mtf.mesh.fft.r2c` of a real field
        :math:`\delta` [dimensionless] (Hermitian).
    conf : SimConfig
    kernels : Kernels
    packed : bool, optional
        Two components per complex transform (default), or the real part of
        one transform per component (the same to rounding).
    sequential : bool, optional
        With ``packed``: the two complex transforms one after the other
        (:func:`inverse_after`) instead of batched, so only one packed
        spectrum and its all-to-all buffers are live at a time (the same
        values; one more all-to-all round trip).
    padded : bool, optional
        With ``packed`` and ``sequential``, on one block (``conf.grid`` (1, 1)):
        return the padded block with periodic margins, ``[bx, by, px, py, z,
        xyz]`` (:func:`xyz_from_packed` with ``padded_conf``), ready for
        :func:`flowpm_mtf.physics.painting.readout_padded`.

    Returns
    -------
    mtf.Tensor
        Real ``[x, y, z, xyz]``: component ``d`` is :math:`\mathcal{F}^{-1}[i\tilde
        k_d\, \delta_k / |k|^2] / c_d` [cells], as FlowPM's ``lpt1`` and
        ``apply_longrange`` before the readout.
    """
    pot = kernels.inverse_laplace(delta_k, name="inv_laplace")
    if packed and sequential:
        first = inverse_after(pot, [gradient_spec(kernels, 0), gradient_spec(kernels, 1)], conf,
                              name="grad_0", raw=True)
        last = inverse_after(pot, [gradient_spec(kernels, 2)], conf, first, name="grad_1",
                             raw=True)
        return xyz_from_packed(first[0], last[0], name="grad_stack",
                               padded_conf=conf if padded else None)
    if padded:
        raise ValueError("neg_gradient_potential: padded needs packed and sequential")
    return _inverse_xyz(_gradient_specs(pot, kernels), conf, packed, "grad")


def _inverse_xyz(specs, conf, packed, name):
    """The 3 components of ``specs`` (see :func:`packed_inverse`) as ``[x, y, z, xyz]``."""
    if packed:
        return packed_inverse(specs, conf, [(cfg.XYZ, 3)], name=name)[0]
    comps = [complex_ops.apply_kernel(f, k, ph, name="%s_%d" % (name, n))
             for n, (f, k, ph) in enumerate(specs)]
    return fft.c2r(stack_xyz(comps, name + "_stack"), conf, name="c2r_" + name)


def hessian_potential(delta_k, conf, kernels, pairs, packed=True):
    r"""Real-space :math:`-\partial_i\partial_j\phi` for :math:`\nabla^2\phi = \delta` [dimensionless].

    As FlowPM's ``lpt2_source``: :math:`\mathcal{F}^{-1}[(i\tilde k_i)(i\tilde
    k_j)\,\delta_k / |k|^2]` (physical finite-difference wave numbers, so the
    result does not depend on the cell size). The three requested components
    go through one batched inverse FFT (two complex transforms when
    ``packed``, see :func:`neg_gradient_potential`).

    Parameters
    ----------
    delta_k : mtf.Tensor
        Complex ``[kx, ky, kz]`` (Hermitian).
    conf : SimConfig
    kernels : Kernels
    pairs : sequence of 3 (int, int)
        Axes ``(i, j)`` of each component, e.g. ``((0, 0), (1, 1), (2, 2))``.
    packed : bool, optional

    Returns
    -------
    mtf.Tensor
        Real ``[x, y, z, xyz]``; entry ``n`` along ``xyz`` is the component
        ``pairs[n]``.
    """
    if len(pairs) != 3:
        raise ValueError("hessian_potential: need 3 (i, j) pairs, got %r" % (pairs,))
    pot = kernels.inverse_laplace(delta_k, name="inv_laplace_h")
    return _inverse_xyz(_hessian_specs(pot, kernels, pairs, "hessian"), conf, packed, "hessian")


HESSIAN_PAIRS = ((0, 0), (1, 1), (2, 2), (0, 1), (1, 2), (2, 0))


def potential_fields(delta_k, conf, kernels, pairs=HESSIAN_PAIRS):
    r""":math:`-\nabla\phi` and second derivatives :math:`-\partial_i\partial_j\phi` together.

    The 3 + ``len(pairs)`` real fields of :func:`neg_gradient_potential` and
    :func:`hessian_potential` from one potential, packed two per complex
    inverse FFT in one batched transform (9 fields: 5 complex transforms
    instead of 9 real-output ones); what 2LPT needs from the linear modes.
    :func:`flowpm_mtf.physics.lpt.lpt_displacements` computes the same fields with
    the same pairing one transform at a time (:func:`inverse_after`), which
    holds far less memory than this batched form.

    Parameters
    ----------
    delta_k : mtf.Tensor
        Complex ``[kx, ky, kz]`` (Hermitian).
    conf : SimConfig
    kernels : Kernels
    pairs : sequence of (int, int), optional
        Axes of the second derivatives (default: the six distinct ones,
        ``xx, yy, zz, xy, yz, zx``).

    Returns
    -------
    (mtf.Tensor, list of mtf.Tensor)
        Real ``[x, y, z, xyz]`` :math:`-\nabla\phi` [cells], and one real
        ``[x, y, z]`` field per pair [dimensionless].
    """
    pot = kernels.inverse_laplace(delta_k, name="inv_laplace_lpt")
    specs = _gradient_specs(pot, kernels) + _hessian_specs(pot, kernels, pairs, "lpt_hessian")
    out = packed_inverse(specs, conf, [(cfg.XYZ, 3)] + [(None, 1)] * len(pairs),
                         name="lpt_fields")
    return out[0], out[1:]
