r"""Particle-mesh gravity: the FastPM force on the block layout.

One evaluation (as ``flowpm.tfpm.force`` with ``pm_nc_factor=1``):

1. CIC-paint the particles of every block on its padded block and add the
   halos into the neighbours (:func:`flowpm_mtf.physics.painting.cic_paint`): the
   density :math:`1 + \delta` (one particle per cell on average);
2. forward FFT (:func:`flowpm_mtf.mesh.fft.r2c`);
3. the potential :math:`\mathcal{F}^{-1}[\delta_k / |k|^2]` (one inverse FFT;
   the :math:`k = 0` mode is dropped, so the mean density does not matter;
   steps 2 and 3 as one radial filter, :mod:`flowpm_mtf.mesh.radial_filter`, on
   the half spectrum where that path serves), its halos filled two cells
   wider than the readout's, and the three
   components of the force field from it in real space by the four-point
   difference whose transfer function is FastPM's gradient kernel
   :math:`i\tilde k_d` (native ``FlowpmGradient``, :func:`force_field_of_potential`:
   the same field as multiplying by :math:`i\tilde k_d / |k|^2` in k-space,
   to rounding, for one real-output transform instead of two complex ones and
   one halo exchange of one component instead of three). Without the native
   op, or with blocks not wider than the halo plus two cells, the k-space
   products and their packed inverse FFTs
   (:func:`flowpm_mtf.physics.kernels.neg_gradient_potential`);
4. read the three components out at the particles from the padded blocks
   (:func:`flowpm_mtf.physics.painting.readout_padded`, or
   :func:`flowpm_mtf.physics.painting.readout_field` after the k-space path on
   several blocks);
5. multiply by :math:`\tfrac32 \Omega_m`.

Particles that escaped their block's halo make the painting (and readout)
raise ``tf.errors.InvalidArgumentError`` at run time.
"""
import dataclasses
import logging

import mesh_tensorflow as mtf
import numpy as np
import tensorflow.compat.v1 as tf

from ..mesh import fft, radial_filter
from .. import native
from .. import config as cfg
from ..mesh.halo import field_to_padded, from_blocks, padded_shape, reduced_to_field, to_blocks
from ..layout import block_shape
from .kernels import make_kernels, neg_gradient_potential
from .painting import (_assert_none_escaped, escaped_count, paint_field, readout_field,
                       readout_padded)
from .painting_vjp import paint_pair, readout_scaled_grad, readout_vjp

__all__ = ["density", "density_cotangent", "force_field_of_potential", "gradient_tf",
           "gradient_transpose", "neg_divergence_tf", "pm_forces", "pm_forces_vjp"]

log = logging.getLogger(__name__)


def density(positions, conf, weight=None, escape_checked=False):
    """CIC density of the particles, ``1 + delta`` for one particle per cell.

    Parameters
    ----------
    positions : mtf.Tensor
        Block-local positions ``[bx, by, npart, xyz]`` [cells].
    conf : SimConfig
    weight : mtf.Tensor, optional
        ``[bx, by, npart]`` slot weights (:func:`flowpm_mtf.mesh.slots.weights`:
        0 for the empty slots of the eulerian decomposition).
    escape_checked : bool, optional
        The particles were checked to fit their padded blocks (e.g. by
        :func:`flowpm_mtf.mesh.domain.migrate`): no second escape check
        (:func:`flowpm_mtf.physics.painting.cic_paint`).

    Returns
    -------
    mtf.Tensor
        Real field ``[x, y, z]``: particles per cell [dimensionless] (mean 1
        with one particle per cell).
    """
    return paint_field(positions, conf, weight=weight, name="paint_density",
                       escape_checked=escape_checked)


def pm_forces(positions, conf, kernels=None, weight=None, escape_checked=False, donor=None):
    r"""FastPM particle-mesh force at the particle positions.

    Parameters
    ----------
    positions : mtf.Tensor
        Block-local positions ``[bx, by, npart, xyz]`` [cells].
    conf : SimConfig
        Uses ``conf.cosmology.Omega_m`` and the mesh/halo shapes.
    kernels : flowpm_mtf.physics.kernels.Kernels, optional
        Reused across time steps when given (built here otherwise).
    weight : mtf.Tensor, optional
        ``[bx, by, npart]`` slot weights: the painting's particle masses, and
        the force is multiplied by them (zero on empty slots).
    escape_checked : bool, optional
        As in :func:`density`: the paint and the readout skip their escape
        checks (two passes over the particles and two reductions per force).
    donor : mtf.Tensor, optional
        ``[bx, by, npart, xyz]`` of the positions' dtype: a buffer the readout writes the
        force into where nothing else holds it (:func:`flowpm_mtf.physics.painting.readout_padded`;
        e.g. :func:`flowpm_mtf.mesh.donate.take` of the forces variable); its values are unused.

    Returns
    -------
    mtf.Tensor
        :math:`F = \tfrac32\Omega_m \nabla\nabla^{-2}\delta` read out at the
        particles, ``[bx, by, npart, xyz]`` [cells] (with :math:`H_0 = 1`;
        :math:`dp/da = F/(a^2 E)`).
    """
    if kernels is None:
        kernels = make_kernels(conf, positions.mesh)
    grad, padded = _force_field(positions, conf, kernels, weight, escape_checked)
    # The three components in one readout: one stencil, one halo fill.
    if padded:
        force = readout_padded(grad, positions, conf, name="force_readout",
                               escape_checked=escape_checked, donor=donor)
    else:
        force = readout_field(grad, positions, conf, name="force_readout",
                              escape_checked=escape_checked, donor=donor)
    force = force * (1.5 * conf.cosmology.Omega_m)
    return force if weight is None else force * weight


def _force_field(positions, conf, kernels, weight, escape_checked):
    r"""The paint, the forward FFT and the force field of :func:`pm_forces`.

    Returns ``(grad, padded)``: :math:`-\nabla\phi` on the padded blocks with
    their margins filled, ``[bx, by, px, py, z, xyz]``, or (k-space path on
    several blocks) the field ``[x, y, z, xyz]``, and which of the two it is.
    """
    rho = density(positions, conf, weight, escape_checked=escape_checked)
    return _field_of_density(rho, conf, kernels)


def _field_of_density(rho, conf, kernels, stencil=None):
    """:func:`_force_field` from the painted density ``rho`` ``[x, y, z]``.

    ``stencil``: the real-space path (:func:`force_field_of_potential`), the
    k-space one (False), or the real-space one where it serves (None).
    """
    if stencil is None:
        stencil = _native_stencil(conf, rho.dtype)
    if stencil:
        # the potential c2r(r2c(rho) / k^2) as one radial filter: on the half spectrum
        # where that path serves, without the full spectrum (radial_filter.py)
        pot = radial_filter.radial_filter(rho, conf, radial_filter.inverse_laplace_values,
                                          name="force_potential")
        return force_field_of_potential(pot, conf), True
    delta_k = fft.r2c(rho, conf, name="force_r2c")
    # [x, y, z, xyz]; the two packed transforms one after the other (half the
    # live spectra and all-to-all buffers of a batched pair). One block (one
    # rank): written directly as the padded block with its periodic margins.
    one_block = single_block(conf)
    return neg_gradient_potential(delta_k, conf, kernels, sequential=True,
                                  padded=one_block), one_block


GRADIENT_REACH = 2
"""Cells the four-point difference reads on either side (:func:`force_field_of_potential`)."""


def _native_stencil(conf, dtype):
    """Whether :func:`_field_of_density` takes the real-space path (native ``FlowpmGradient``)."""
    if native.load("cic_ops") is None or dtype not in (tf.float32, tf.float64):
        return False
    return single_block(conf) or conf.halo_size + GRADIENT_REACH < min(conf.block_shape[:2])


def force_field_of_potential(phi, conf, name="force_field"):
    r"""The force field :math:`-\nabla\phi` [cells] on the padded blocks, from the potential.

    With :math:`\phi = \mathcal{F}^{-1}[\delta_k / |k|^2]` (note the sign: the
    solution of :math:`\nabla^2\phi = -\delta`), component :math:`d` is
    :math:`D_d\phi / c_d` with the four-point difference
    :math:`D_d f = [8 (f_{+1} - f_{-1}) - (f_{+2} - f_{-2})] / (12 c_d)`, whose
    transfer function is FastPM's gradient kernel :math:`i\tilde k_d`
    (:mod:`flowpm_mtf.physics.kernels`): the same field as
    :func:`flowpm_mtf.physics.kernels.neg_gradient_potential` of :math:`\delta_k`, to
    rounding. On several blocks the potential's halo is filled
    :data:`GRADIENT_REACH` cells wider than ``conf.halo_size`` (one exchange of
    one component), then the difference is taken on each padded block; on one
    block holding the whole mesh it is taken periodically and written with the
    periodic margins directly (native ``FlowpmGradient``, or
    :func:`gradient_tf`). Either leaves the three components with their
    margins filled, ready for :func:`flowpm_mtf.physics.painting.readout_padded`. Its
    gradient is the transpose (``FlowpmNegDivergence`` with negated
    coefficients, registered below).

    Parameters
    ----------
    phi : mtf.Tensor
        Real ``[x, y, z]`` potential [(Mpc/h)^2 times the density's units].
    conf : SimConfig
        On several blocks, needs ``conf.halo_size + 2`` cells or fewer than the
        blocks along x and y.
    name : str

    Returns
    -------
    mtf.Tensor
        ``[bx, by, px, py, z, xyz]`` [cells times the density's units], margins filled.
    """
    r = GRADIENT_REACH
    h = conf.halo_size
    one_block = single_block(conf)
    if not one_block and h + r >= min(conf.block_shape[:2]):
        raise ValueError("force_field_of_potential: halo %d + %d cells must be narrower "
                         "than the blocks %s"
                         % (h, r, tuple(conf.block_shape[:2])))
    coeffs = np.array([1.0 / (12.0 * c * c) for c in conf.cell_size], conf.np_dtype)
    px, py, nz = conf.padded_block_shape
    out_shape = mtf.Shape(padded_shape(conf).dims + [mtf.Dimension(cfg.XYZ, 3)])
    # one block holding the whole mesh: the difference taken periodically and the padded
    # field written with its periodic margins in the same pass (no padded potential)
    margin = -h if one_block else r
    ax, ay = (px - 2 * h, py - 2 * h) if one_block else (px + 2 * r, py + 2 * r)

    def fn(t):
        nbx, nby = t.shape.as_list()[:2]
        lib = _stencil_ops(t)
        t, c = tf.reshape(t, [nbx * nby, ax, ay, nz]), tf.constant(coeffs)
        out = (lib.flowpm_gradient(t, c, margin=margin) if lib is not None
               else gradient_tf(t, c, margin))
        return tf.reshape(out, [nbx, nby, px, py, nz, 3])

    if one_block:
        blocks = to_blocks(phi, conf)
    else:
        blocks = field_to_padded(phi, dataclasses.replace(conf, halo_size=h + r))
    return mtf.slicewise(fn, [blocks], output_shape=out_shape, output_dtype=phi.dtype,
                         splittable_dims=blocks.shape.dims[:2], name=name)


def _stencil_ops(t):
    """The native library for ``FlowpmGradient`` on ``t``'s device, or None (TensorFlow ops)."""
    return native.ops_for("cic_ops", t)


def gradient_tf(phi, coeffs, margin):
    r"""``FlowpmGradient`` as TensorFlow ops (the reference; GPU path).

    ``phi`` ``[B, ax, ay, nz]``, ``coeffs`` ``[3]``, ``margin`` >= 2 (x and y read
    inside the array) or <= 0 (periodic, output margins ``-margin``); returns ``[B, ax
    - 2 m, ay - 2 m, nz, 3]``: component ``d`` is :math:`c_d\,(8 (\phi(+1) -
    \phi(-1)) - (\phi(+2) - \phi(-2)))` along axis ``d``, ``z`` periodic.
    """
    m = margin
    ax, ay = phi.shape.as_list()[1:3]
    if m <= 0:   # periodic: the array extended periodically by 2 - m cells, then inside
        w = GRADIENT_REACH - m
        phi = tf.gather(tf.gather(phi, np.arange(-w, ax + w) % ax, axis=1),
                        np.arange(-w, ay + w) % ay, axis=2)
        return gradient_tf(phi, coeffs, GRADIENT_REACH)

    def at(axis, o):   # phi at the neighbour o along axis, on the inner cells
        if axis == 3:
            return tf.roll(phi, -o, 3)[:, m:ax - m, m:ay - m]
        if axis == 1:
            return phi[:, m + o:ax - m + o, m:ay - m]
        return phi[:, m:ax - m, m + o:ay - m + o]

    comps = [coeffs[d] * (8 * (at(d + 1, 1) - at(d + 1, -1)) - (at(d + 1, 2) - at(d + 1, -2)))
             for d in range(3)]
    return tf.stack(comps, axis=-1)


def gradient_transpose(dy, coeffs, margin, shape=None):
    """The transpose of ``FlowpmGradient(phi, coeffs, margin)`` applied to ``dy`` ``[B, sx,
    sy, nz, 3]``: ``FlowpmNegDivergence(dy, -coeffs, margin=-2)`` (the four-point difference
    is antisymmetric), padded back to the input's margins, or (periodic, ``margin`` <= 0)
    its margins folded back into the cells they came from. Without the native op on
    ``dy``'s device, the gradient of :func:`gradient_tf` on a potential of ``shape`` ``[B,
    ax, ay, nz]`` (the map is linear)."""
    lib = _stencil_ops(dy)
    if lib is None:
        phi = tf.zeros(shape, dy.dtype)
        return tf.gradients(gradient_tf(phi, coeffs, margin), phi, grad_ys=dy)[0]
    dphi = lib.flowpm_neg_divergence(dy, -coeffs, margin=-GRADIENT_REACH)
    if margin > GRADIENT_REACH:
        p = margin - GRADIENT_REACH
        dphi = tf.pad(dphi, [[0, 0], [p, p], [p, p], [0, 0]])
    elif margin <= 0:
        w = GRADIENT_REACH - margin
        dphi = tf.stack([lib.flowpm_interleave_grad(t[..., None], picks=[0, 0], wrap=w,
                                                    widths=[1], N=1)[0][..., 0]
                         for t in tf.unstack(dphi, axis=0)], axis=0)
    return dphi


@tf.RegisterGradient("FlowpmGradient")
def _gradient_grad(op, dy):
    """:func:`gradient_transpose` (the op's gradient)."""
    return gradient_transpose(dy, op.inputs[1], op.get_attr("margin"),
                              tf.shape(op.inputs[0])), None


def single_block(conf):
    """Whether one block holds the whole mesh along x and y (one process along both, a
    halo no wider than the block): the stencils then read their fields periodically, with
    no padded copy (the force field here, the ICs' potentials in
    :func:`flowpm_mtf.physics.lpt_source.potential_blocks`)."""
    sx, sy, _ = conf.block_shape
    return tuple(conf.grid) == (1, 1) and conf.halo_size <= min(sx, sy)


def pm_forces_vjp(positions, cotangents, conf, kernels=None, weight=None, escape_checked=False,
                  name="force_vjp"):
    r"""The PM force and its vector-Jacobian product, with one readout for both.

    :math:`F(x)` as :func:`pm_forces` and :math:`J_F(x)^T \bar F`: the adjoint's
    reverse step needs both at every stage (:func:`flowpm_mtf.gradients.adjoint.reverse_step`).
    ``mtf.gradients`` of :func:`pm_forces` reads the force field at the particles
    twice (the readout, then its gradient) and multiplies the force and the
    cotangents by the prefactor and the weights as separate passes; here
    :func:`flowpm_mtf.physics.painting_vjp.readout_vjp` does the readout, its position
    gradient and the paint of the scaled cotangents in one pass, and
    ``mtf.gradients`` runs only from the force field back to the positions
    (the adjoint FFTs, the halo reduction, the paint's position gradient). The
    same values as ``pm_forces`` and its ``mtf.gradients`` (bit for bit for the
    force; the VJP to rounding: its two position terms are summed here, in
    ``mtf.gradients`` in the other order).

    Parameters
    ----------
    positions : mtf.Tensor
        Block-local positions ``[bx, by, npart, xyz]`` [cells].
    cotangents : mtf.Tensor
        :math:`\bar F`, ``[bx, by, npart, xyz]`` [loss units / force units].
    conf : SimConfig
    kernels : flowpm_mtf.physics.kernels.Kernels, optional
    weight : mtf.Tensor, optional
        ``[bx, by, npart]`` slot weights, as in :func:`pm_forces`.
    escape_checked : bool, optional
        As in :func:`pm_forces`.
    name : str

    Returns
    -------
    force : mtf.Tensor
        :func:`pm_forces` ``(positions, ...)`` [cells].
    vjp : mtf.Tensor
        :math:`J_F(x)^T \bar F` ``[bx, by, npart, xyz]`` [loss units / cells].
    """
    if kernels is None:
        kernels = make_kernels(conf, positions.mesh)
    scale = 1.5 * conf.cosmology.Omega_m
    if _native_cotangent(conf, positions.dtype, single_block(conf)):
        # the cotangents' paint with the density's (one slab scan), the force field, the
        # density's cotangent (the divergence in real space, one FFT round trip), then
        # one pass over the particles: the force, its readout's position gradient and
        # the paint's
        painted, dmesh = paint_pair(positions, cotangents, conf, scale, weight,
                                    name=name + "_paint", escape_checked=escape_checked)
        grad, is_padded = _field_of_density(reduced_to_field(painted, conf), conf, kernels)
        padded = grad if is_padded else field_to_padded(grad, conf)
        rho_bar = density_cotangent(dmesh, conf, kernels, single_block(conf),
                                    name=name + "_density")
        return readout_scaled_grad(padded, positions, cotangents, conf, scale, weight,
                                   density_bar=field_to_padded(rho_bar, conf), name=name)
    # no native divergence: the readout's VJP in one pass, mtf.gradients for the rest
    graph = positions.graph
    start = len(graph.operations)
    rho = density(positions, conf, weight, escape_checked=escape_checked)
    grad, is_padded = _field_of_density(rho, conf, kernels)
    if not escape_checked:  # as the readout's own check, before the halo exchange
        grad = _assert_none_escaped(grad, escaped_count(positions, conf), name)
    padded = grad if is_padded else field_to_padded(grad, conf)
    field_ops = graph.operations[start:]
    force, dmesh, dpos = readout_vjp(padded, positions, cotangents, conf, scale, weight,
                                     name=name)
    dpaint = mtf.gradients([padded], [positions], grad_ys=[dmesh], operations=field_ops)[0]
    return force, (dpos if dpaint is None else dpos + dpaint)


def _native_cotangent(conf, dtype, one_block):
    """Whether :func:`density_cotangent` takes the native divergence (else None)."""
    if native.load("cic_ops") is None or dtype not in (tf.float32, tf.float64):
        return False
    return one_block or conf.halo_size + DIVERGENCE_REACH <= min(conf.block_shape[:2])


DIVERGENCE_REACH = 2
"""Cells the four-point divergence reads on either side (:func:`density_cotangent`)."""


def density_cotangent(dmesh, conf, kernels, one_block, name="density_cotangent"):
    r"""The density's cotangent from the force field's: the transpose of the force solve.

    The force field is :math:`G_d = C_d \rho` with :math:`C_d = \mathcal{F}^{-1}
    [\,i\tilde k_d / (c_d |k|^2)\,] \mathcal{F}` (:func:`_force_field`). Its
    kernel is odd and imaginary, so :math:`C_d^T = -C_d`, and :math:`i\tilde k_d`
    is exactly the transfer function of the four-point difference
    :math:`D_d f = [8 (f_{+1} - f_{-1}) - (f_{+2} - f_{-2})] / (12 c_d)` on the
    periodic grid, which commutes with :math:`1/|k|^2`. Hence

    .. math:: \bar\rho = \sum_d C_d^T \bar G_d
              = \mathcal{F}^{-1}\Big[\frac{1}{|k|^2}\,\mathcal{F}\Big[
                -\sum_d \frac{D_d \bar G_d}{c_d}\Big]\Big]:

    the divergence in real space, then one FFT round trip, instead of
    ``mtf.gradients`` through the two packed inverse transforms (two complex
    forward transforms, the kernels' gradients, the transpose of the
    real-to-complex one). The same values to rounding.

    The divergence is linear and translation invariant, so it commutes with the
    halo reduction: it is taken on each painted block as it is (native
    ``FlowpmNegDivergence`` with the block extended by zeros, output margins
    :data:`DIVERGENCE_REACH` cells wider), and the *scalar* is reduced (the
    halo exchange of one component with margins ``h + 2``, or on one block
    the periodic fold), instead of reducing and refilling the three components
    of :math:`\bar G` before the stencil.

    Parameters
    ----------
    dmesh : mtf.Tensor
        :math:`\bar G` on the padded blocks ``[bx, by, px, py, z, xyz]``, margins
        not reduced (the paint of the readout's cotangents).
    conf : SimConfig
    kernels : flowpm_mtf.physics.kernels.Kernels
    one_block : bool
        One block (one rank): the margins are folded locally.
    name : str

    Returns
    -------
    mtf.Tensor or None
        :math:`\bar\rho` ``[x, y, z]``; None where the native op does not serve
        (no library, or on several blocks a block narrower than ``h + 2``
        cells): the caller takes ``mtf.gradients``.
    """
    h = conf.halo_size
    sx, sy, nz = conf.block_shape
    if not _native_cotangent(conf, dmesh.dtype, one_block):
        return None
    coeffs = np.array([-1.0 / (12.0 * c * c) for c in conf.cell_size], conf.np_dtype)
    px, py, _ = conf.padded_block_shape
    r = DIVERGENCE_REACH
    wide = dataclasses.replace(conf, halo_size=h + r)   # the blocks of the divergence

    def fn(t):
        nbx, nby = t.shape.as_list()[:2]
        lib = native.ops_for("cic_ops", t)
        t, c = tf.reshape(t, [nbx * nby, px, py, nz, 3]), tf.constant(coeffs)
        out = (lib.flowpm_neg_divergence(t, c, margin=-r) if lib is not None
               else neg_divergence_tf(t, c, -r))
        if not one_block:
            return tf.reshape(out, [nbx, nby, px + 2 * r, py + 2 * r, nz])
        out = tf.reshape(out, [px + 2 * r, py + 2 * r, nz, 1])
        if lib is not None:
            out, = lib.flowpm_interleave_grad(out, picks=[0, 0], wrap=h + r, widths=[1], N=1)
        else:
            out = _fold_tf(out, h + r, sx, sy)
        return tf.reshape(out, [nbx, nby, sx, sy, nz])

    if one_block:
        phi = mtf.slicewise(fn, [dmesh], output_shape=block_shape(conf), output_dtype=dmesh.dtype,
                            splittable_dims=dmesh.shape.dims[:2], name=name + "_divergence")
        phi = from_blocks(phi, conf)
    else:
        phi = mtf.slicewise(fn, [dmesh], output_shape=padded_shape(wide),
                            output_dtype=dmesh.dtype, splittable_dims=dmesh.shape.dims[:2],
                            name=name + "_divergence")
        phi = reduced_to_field(phi, wide)
    pk = kernels.inverse_laplace(fft.r2c(phi, conf, name=name + "_r2c"),
                                 name=name + "_inv_laplace")
    return fft.c2r(pk, conf, name=name + "_c2r")


def neg_divergence_tf(g, coeffs, margin):
    r"""``FlowpmNegDivergence`` as TensorFlow ops (the reference; GPU path).

    ``g`` ``[B, ax, ay, nz, 3]``, ``coeffs`` ``[3]``; returns ``[B, ax - 2 m,
    ay - 2 m, nz]``: :math:`\sum_d c_d\,(8 (g_d(+1) - g_d(-1)) - (g_d(+2) - g_d(-2)))`
    along axis ``d``, ``z`` periodic, ``x, y`` inside the margins (``m >= 2``),
    periodic (``m = 0``) or extended by zeros (``m = -2``: the output is 2 cells wider
    on either side).
    """
    m = margin
    if m < 0:  # extended by zeros: the same stencil on the array padded by 4 cells
        return neg_divergence_tf(tf.pad(g, [[0, 0], [4, 4], [4, 4], [0, 0], [0, 0]]), coeffs,
                                 m + 4)
    ax, ay = g.shape.as_list()[1:3]

    def at(comp, axis, o):  # g_comp at the neighbour o along axis, on the inner cells
        t = g[..., comp]
        if axis == 3 or m == 0:
            t = tf.roll(t, -o, axis)
            return t if m == 0 else t[:, m:ax - m, m:ay - m]
        lo = m + o
        if axis == 1:
            return t[:, lo:lo + ax - 2 * m, m:ay - m]
        return t[:, m:ax - m, lo:lo + ay - 2 * m]

    terms = [8 * (at(d, d + 1, 1) - at(d, d + 1, -1)) - (at(d, d + 1, 2) - at(d, d + 1, -2))
             for d in range(3)]
    return (coeffs[0] * terms[0] + coeffs[1] * terms[1]) + coeffs[2] * terms[2]


def _fold_tf(t, h, sx, sy):
    """Periodic margins of one padded block ``[px, py, ...]`` added into its cells."""
    ix = np.arange(-h, sx + h) % sx
    iy = np.arange(-h, sy + h) % sy
    t = tf.math.unsorted_segment_sum(t, ix, sx)
    t = tf.transpose(tf.math.unsorted_segment_sum(tf.transpose(t, [1, 0, 2, 3]), iy, sy),
                     [1, 0, 2, 3])
    return t
