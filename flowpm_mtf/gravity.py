r"""Particle-mesh gravity: the FastPM force on the block layout.

One evaluation (as ``flowpm.tfpm.force`` with ``pm_nc_factor=1``):

1. CIC-paint the particles of every block on its padded block and add the
   halos into the neighbours (:func:`flowpm_mtf.painting.cic_paint`): the
   density :math:`1 + \delta` (one particle per cell on average);
2. forward FFT (:func:`flowpm_mtf.fft.r2c`);
3. for each axis, multiply by :math:`i\tilde k_d / |k|^2`; one batched inverse FFT
   (:func:`flowpm_mtf.kernels.neg_gradient_potential`; the :math:`k = 0` mode
   is dropped, so the mean density does not matter);
4. fill the halos and read the three components out at the particles
   (:func:`flowpm_mtf.painting.readout_field`; on one block the three
   components are written with their periodic margins as they are
   assembled, :func:`flowpm_mtf.painting.readout_padded`);
5. multiply by :math:`\tfrac32 \Omega_m`.

Particles that escaped their block's halo make the painting (and readout)
raise ``tf.errors.InvalidArgumentError`` at run time.
"""
import logging

import mesh_tensorflow as mtf

from . import fft
from .halo import field_to_padded
from .kernels import make_kernels, neg_gradient_potential
from .painting import (_assert_none_escaped, escaped_count, paint_field, readout_field,
                       readout_padded, readout_vjp)

__all__ = ["density", "pm_forces", "pm_forces_vjp"]

log = logging.getLogger(__name__)


def density(positions, conf, weight=None, escape_checked=False):
    """CIC density of the particles, ``1 + delta`` for one particle per cell.

    Parameters
    ----------
    positions : mtf.Tensor
        Block-local positions ``[bx, by, npart, xyz]`` [cells].
    conf : SimConfig
    weight : mtf.Tensor, optional
        ``[bx, by, npart]`` slot weights (:func:`flowpm_mtf.domain.weights`:
        0 for the empty slots of the eulerian decomposition).
    escape_checked : bool, optional
        The particles were checked to fit their padded blocks (e.g. by
        :func:`flowpm_mtf.domain.migrate`): no second escape check
        (:func:`flowpm_mtf.painting.cic_paint`).

    Returns
    -------
    mtf.Tensor
        Real field ``[x, y, z]``: particles per cell [dimensionless] (mean 1
        with one particle per cell).
    """
    return paint_field(positions, conf, weight=weight, name="paint_density",
                       escape_checked=escape_checked)


def pm_forces(positions, conf, kernels=None, weight=None, escape_checked=False):
    r"""FastPM particle-mesh force at the particle positions.

    Parameters
    ----------
    positions : mtf.Tensor
        Block-local positions ``[bx, by, npart, xyz]`` [cells].
    conf : SimConfig
        Uses ``conf.cosmology.Omega_m`` and the mesh/halo shapes.
    kernels : flowpm_mtf.kernels.Kernels, optional
        Reused across time steps when given (built here otherwise).
    weight : mtf.Tensor, optional
        ``[bx, by, npart]`` slot weights: the painting's particle masses, and
        the force is multiplied by them (zero on empty slots).
    escape_checked : bool, optional
        As in :func:`density`: the paint and the readout skip their escape
        checks (two passes over the particles and two reductions per force).

    Returns
    -------
    mtf.Tensor
        :math:`F = \tfrac32\Omega_m \nabla\nabla^{-2}\delta` read out at the
        particles, ``[bx, by, npart, xyz]`` [cells] (with :math:`H_0 = 1`;
        :math:`dp/da = F/(a^2 E)`).
    """
    if kernels is None:
        kernels = make_kernels(conf, positions.mesh)
    grad, one_block = _force_field(positions, conf, kernels, weight, escape_checked)
    # The three components in one readout: one stencil, one halo fill.
    if one_block:
        force = readout_padded(grad, positions, conf, name="force_readout",
                               escape_checked=escape_checked)
    else:
        force = readout_field(grad, positions, conf, name="force_readout",
                              escape_checked=escape_checked)
    force = force * (1.5 * conf.cosmology.Omega_m)
    return force if weight is None else force * weight


def _force_field(positions, conf, kernels, weight, escape_checked):
    r"""The paint, the forward FFT and the packed inverse FFTs of :func:`pm_forces`.

    Returns ``(grad, one_block)``: :math:`-\nabla\phi` ``[x, y, z, xyz]``, or on
    one block (one rank) the padded block with its periodic margins (written
    as the components are assembled), and which of the two it is.
    """
    rho = density(positions, conf, weight, escape_checked=escape_checked)
    delta_k = fft.r2c(rho, conf, name="force_r2c")
    # [x, y, z, xyz]; the two packed transforms one after the other (half the
    # live spectra and all-to-all buffers of a batched pair). One block (one
    # rank): written directly as the padded block with its periodic margins.
    sx, sy, _ = conf.block_shape
    one_block = tuple(conf.grid) == (1, 1) and conf.halo_size <= min(sx, sy)
    return neg_gradient_potential(delta_k, conf, kernels, sequential=True,
                                  padded=one_block), one_block


def pm_forces_vjp(positions, cotangents, conf, kernels=None, weight=None, escape_checked=False,
                  name="force_vjp"):
    r"""The PM force and its vector-Jacobian product, with one readout for both.

    :math:`F(x)` as :func:`pm_forces` and :math:`J_F(x)^T \bar F`: the adjoint's
    reverse step needs both at every stage (:func:`flowpm_mtf.adjoint.reverse_step`).
    ``mtf.gradients`` of :func:`pm_forces` reads the force field at the particles
    twice (the readout, then its gradient) and multiplies the force and the
    cotangents by the prefactor and the weights as separate passes; here
    :func:`flowpm_mtf.painting.readout_vjp` does the readout, its position
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
    kernels : flowpm_mtf.kernels.Kernels, optional
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
    graph = positions.graph
    start = len(graph.operations)
    grad, one_block = _force_field(positions, conf, kernels, weight, escape_checked)
    if not escape_checked:  # as the readout's own check, before the halo exchange
        grad = _assert_none_escaped(grad, escaped_count(positions, conf), name)
    padded = grad if one_block else field_to_padded(grad, conf)
    field_ops = graph.operations[start:]
    force, dmesh, dpos = readout_vjp(padded, positions, cotangents, conf,
                                     1.5 * conf.cosmology.Omega_m, weight, name=name)
    # the rest of the VJP: through the force field back to the positions (adjoint FFTs,
    # halo reduction, the paint's position gradient)
    dpaint = mtf.gradients([padded], [positions], grad_ys=[dmesh], operations=field_ops)[0]
    return force, (dpos if dpaint is None else dpos + dpaint)
