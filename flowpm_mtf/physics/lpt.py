r"""Lagrangian perturbation theory (1LPT, 2LPT) initial conditions on the block layout.

Particles start on the lattice, one per cell, at the corner of every cell
(:func:`flowpm_mtf.physics.painting.lattice`), each with its global id (its lattice
index, :func:`flowpm_mtf.mesh.slots.lattice_ids`), in the slots of their block in
16^3 tiles of its lattice (eulerian; :func:`flowpm_mtf.layout.slot_tiles`,
:func:`lattice_combine`: the CIC ops' cache locality at size). With the eulerian decomposition
(default) the displaced particles then move to the block that contains them,
into buffers of :func:`flowpm_mtf.physics.sizing.capacity` slots
(:func:`flowpm_mtf.mesh.domain.migrate`); with the lagrangian one they stay with
their block for the whole run (block-local coordinates, see
:mod:`flowpm_mtf.physics.painting`).

Conventions (as ``flowpm.tfpm.lpt_init``, FlowPM 0.1.1)
-------------------------------------------------------
The linear field :math:`\delta_L` is the linear density contrast extrapolated to
:math:`a = 1` (:math:`D_1(1) = 1`). With :math:`\Psi^{(1)} = -\nabla\phi^{(1)}`,
:math:`\nabla^2\phi^{(1)} = \delta_L` and :math:`\Psi^{(2)} = -\nabla\phi^{(2)}`,
:math:`\nabla^2\phi^{(2)} = S = \sum_{i<j} [\phi^{(1)}_{,ii}\phi^{(1)}_{,jj} -
(\phi^{(1)}_{,ij})^2]` (kernels of :mod:`flowpm_mtf.physics.kernels`, evaluated on the
lattice, i.e. CIC readout at the lattice sites, which is exact there), the
displacement, momentum and force at scale factor :math:`a` are

.. math::

    \Delta x &= D_1 \Psi^{(1)} - D_2 \Psi^{(2)}  \\
    p        &= a^2 E\,(f_1 D_1 \Psi^{(1)} - f_2 D_2 \Psi^{(2)})  \\
    F        &= a^2 E\,(g_{f}/D_1\; D_1 \Psi^{(1)} - g_{f2}/D_2\; D_2 \Psi^{(2)})

with :math:`D_2` the *physical* second-order growth factor of
:mod:`flowpm_mtf.physics.cosmology` (:math:`D_2 \approx -\tfrac37 D_1^2 < 0`), so the
source :math:`S` carries no factor 3/7. Units: positions and displacements in
[cells]; the momentum is :math:`p = a^3 E\, dx/da = a^2\, dx/dt / H_0` [cells];
the force is :math:`F = a^2 E\, dp/da = \tfrac32\Omega_m \nabla\nabla^{-2}\delta`
[cells] (FastPM's units, with :math:`H_0 = 1`).

Difference from FlowPM 0.1.1: FlowPM normalises :math:`D_2(1) = 1` and puts
:math:`+\tfrac37` into the source, i.e. its second-order term is
:math:`\tfrac{3}{7} / |D_2^{\rm phys}(1)|` times ours
(:math:`|D_2^{\rm phys}(1)| \approx \tfrac37\Omega_m^{-1/143}`, 0.8 % larger
than 3/7 for Planck 2015). The first-order terms are identical.
"""
import logging
from typing import NamedTuple

import mesh_tensorflow as mtf
import numpy as np
import tensorflow.compat.v1 as tf

from .. import config as cfg
from .. import layout
from . import cosmology as cosmo_mod
from ..mesh import domain
from ..mesh.domain_local import wrap_tf
from ..mesh.slots import lattice_ids, pad_particles
from . import sizing
from ..mesh import fft, radial_filter
from . import gravity, ics, lpt_source
from .. import native
from ..mesh.ordering import after
from .kernels import (HESSIAN_PAIRS, gradient_spec, hessian_spec, inverse_after,
                      interleave_xyz, make_kernels, neg_gradient_potential)
from .painting import lattice_added_tf

__all__ = ["State", "lpt_init", "lpt_displacements", "field_to_particles",
           "particles_to_lattice_order", "lpt_coefficients", "lattice_combine",
           "lattice_combine_tf", "lattice_combine_grad_tf", "lattice_combine_potentials",
           "lattice_combine_potentials_tf", "to_slots_tf"]

log = logging.getLogger(__name__)


class State(NamedTuple):
    """Particle state; vectors are ``[bx, by, npart, xyz]``, dtype ``conf.dtype``.

    ``npart`` has :func:`flowpm_mtf.physics.sizing.capacity` slots per block; with the
    lagrangian decomposition the slots are the block's lattice particles in
    order (:func:`flowpm_mtf.physics.painting.lattice`), with the eulerian one any
    particles, in any order, and empty slots (id -1, zero vectors).

    Attributes
    ----------
    positions : mtf.Tensor
        Block-local positions [cells] (global position minus the block origin;
        see :func:`flowpm_mtf.physics.painting.to_global`).
    momenta : mtf.Tensor
        Canonical momenta :math:`p = a^3 E\\, dx/da` [cells] (H_0 = 1).
    forces : mtf.Tensor
        :math:`F = \\tfrac32\\Omega_m\\nabla\\nabla^{-2}\\delta` [cells]
        (so that :math:`dp/da = F / (a^2 E)`).
    ids : mtf.Tensor or None
        ``[bx, by, npart]`` global particle ids (the initial lattice index,
        row-major; :func:`flowpm_mtf.mesh.slots.id_dtype`), -1 for an empty slot.
        None means the lattice order of the lagrangian decomposition.
    stats : mtf.Tensor or None
        Statistics of the last migration (:data:`flowpm_mtf.mesh.domain.STATS`,
        float64 ``[mig_stat]``), or None. Not part of the state proper: a
        diagnostic for the jobs (load imbalance, particles moved).
    """

    positions: mtf.Tensor
    momenta: mtf.Tensor
    forces: mtf.Tensor
    ids: mtf.Tensor = None
    stats: mtf.Tensor = None


_particle_shape = layout.particle_dims


def field_to_particles(field, conf):
    """Values of a real field ``[x, y, z, <rest>]`` at the lattice particles of each block.

    Equal to a CIC readout at the initial lattice positions (integer positions
    read exactly one cell), without communication.

    Parameters
    ----------
    field : mtf.Tensor
        Real field ``[x, y, z]`` followed by optional unsplit dimensions
        (e.g. ``xyz``).
    conf : SimConfig

    Returns
    -------
    mtf.Tensor
        ``[bx, by, npart, <rest>]``, particles in the order of
        :func:`flowpm_mtf.physics.painting.lattice`.
    """
    real = fft.real_shape(conf)
    if field.shape.dims[:3] != real.dims:
        raise ValueError("field_to_particles: expected [x, y, z, ...] = %s..., got %s"
                         % (real, field.shape))
    rest = field.shape.dims[3:]
    bx, by, _ = layout.particle_dims(conf)
    dsx, dsy, dz = layout.block_cell_dims(conf)
    # [bx, sx, by, sy, z] keeps the split dimensions in place: a local reshape
    t = mtf.reshape(field, mtf.Shape([bx, dsx, by, dsy, dz] + rest))
    t = mtf.transpose(t, mtf.Shape([bx, by, dsx, dsy, dz] + rest))
    return mtf.reshape(t, mtf.Shape(_particle_shape(conf) + rest))


def particles_to_lattice_order(t, conf):
    """Re-arrange a per-particle tensor by the particles' initial global lattice cell.

    Parameters
    ----------
    t : mtf.Tensor
        ``[bx, by, npart, <rest>]`` (e.g. global positions, momenta).
    conf : SimConfig

    Returns
    -------
    mtf.Tensor
        ``[x, y, z, <rest>]``: entry ``(i, j, k)`` belongs to the particle that
        started at global cell ``(i, j, k)`` (FlowPM's particle order,
        ``np.indices(nc).reshape(3, -1).T``, after flattening). A local
        reshape (no communication).
    """
    names = t.shape.dimension_names
    if names[:3] != [cfg.BX, cfg.BY, cfg.NPART]:
        raise ValueError("particles_to_lattice_order: expected [bx, by, npart, ...], got %s"
                         % t.shape)
    rest = t.shape.dims[3:]
    bx, by = t.shape.dims[:2]
    dsx, dsy, dz = layout.block_cell_dims(conf)
    t = mtf.reshape(t, mtf.Shape([bx, by, dsx, dsy, dz] + rest))
    t = mtf.transpose(t, mtf.Shape([bx, dsx, by, dsy, dz] + rest))
    return mtf.reshape(t, fft.real_shape(conf) + mtf.Shape(rest))


def to_slots_tf(y, tile):
    """TensorFlow ops: ``y`` ``[B, sx, sy, nz, C]`` (lattice order) -> ``[B, sx sy nz, C]`` in
    the slot order of the tiles ``tile = (tx, ty, tz)`` (:func:`flowpm_mtf.layout.slot_tiles`;
    a transpose: the reference of ``FlowpmLatticeCombine``, the path without it)."""
    b, sx, sy, nz, c = y.shape.as_list()
    tx, ty, tz = tile
    if (tx, ty, tz) != (1, 1, 1):
        y = tf.reshape(y, [b, sx // tx, tx, sy // ty, ty, nz // tz, tz, c])
        y = tf.transpose(y, [0, 1, 3, 5, 2, 4, 6, 7])
    return tf.reshape(y, [b, sx * sy * nz, c])


def _weighted_sum(ts, ws):
    """``((ts[0] * ws[0]) + (ts[1] * ws[1])) + ...`` as TensorFlow ops, in that order."""
    out = None
    for t, w in zip(ts, ws):
        term = t * w
        out = term if out is None else out + term
    return out


def lattice_combine_tf(inputs, coeffs, tile, lattice_output=-1):
    """``FlowpmLatticeCombine`` as TensorFlow ops (its reference; the path of a device
    without the native op): output ``m`` is ``((inputs[0] * coeffs[m, 0]) + (inputs[1] *
    coeffs[m, 1])) + ...`` [+ the lattice sites for ``m == lattice_output``], then
    :func:`to_slots_tf`.

    ``inputs``: ``N`` tensors ``[B, sx, sy, nz, C]``; ``coeffs``: ``[M, N]`` tensor of their
    dtype. Returns a list of ``M`` tensors ``[B, sx sy nz, C]``."""
    outs = []
    for m in range(coeffs.shape[0]):
        out = _weighted_sum(inputs, [coeffs[m, n] for n in range(len(inputs))])
        if m == lattice_output:
            out = lattice_added_tf(out)
        outs.append(to_slots_tf(out, tile))
    return outs


def lattice_combine_grad_tf(dys, coeffs, tile, block):
    """``FlowpmLatticeCombineGrad`` as TensorFlow ops: ``sum_m dys[m] coeffs[m, n]`` (``m`` in
    order), each ``[B, sx sy nz, C]`` back in lattice order ``[B, sx, sy, nz, C]``."""
    b, _, c = dys[0].shape.as_list()
    sx, sy, nz = block
    tx, ty, tz = tile

    def to_lattice(y):
        if (tx, ty, tz) != (1, 1, 1):
            y = tf.reshape(y, [b, sx // tx, sy // ty, nz // tz, tx, ty, tz, c])
            y = tf.transpose(y, [0, 1, 4, 2, 5, 3, 6, 7])
        return tf.reshape(y, [b, sx, sy, nz, c])

    lat = [to_lattice(d) for d in dys]
    return [_weighted_sum(lat, [coeffs[m, n] for m in range(len(lat))])
            for n in range(coeffs.shape[1])]


@tf.RegisterGradient("FlowpmLatticeCombine")
def _lattice_combine_grad(op, *dys):
    """``FlowpmLatticeCombineGrad``: each input's gradient, ``sum_m dys[m] coeffs[m, n]``
    back in lattice order (the lattice sites are constants; no gradient for the
    coefficients, constants too)."""
    lib = native.load("lpt_ops")
    block = op.inputs[0].shape.as_list()[1:4]
    dys = [tf.zeros_like(y) if d is None else d for d, y in zip(dys, op.outputs)]
    n = len(op.inputs) - 1
    grads = lib.flowpm_lattice_combine_grad(dys, op.inputs[-1], tile=op.get_attr("tile"),
                                            block=block, N=n)
    return list(grads) + [None]


def _coefficient_rows(coeffs, conf, n, lattice_output, who, what):
    """``coeffs`` as ``[M, n]`` of ``conf.dtype``, checked with ``lattice_output`` (-1 or an
    output); a clear ``ValueError`` naming ``who`` otherwise."""
    cvals = np.asarray(coeffs, conf.np_dtype)
    if cvals.ndim != 2 or cvals.shape[1] != n or cvals.shape[0] < 1:
        raise ValueError("%s: coefficients must be rows of %d (one per %s), got shape %s"
                         % (who, n, what, cvals.shape))
    if not -1 <= lattice_output < cvals.shape[0]:
        raise ValueError("%s: lattice_output %r is not one of the %d outputs"
                         % (who, lattice_output, cvals.shape[0]))
    return cvals


def lattice_combine(psis, coeffs, conf, lattice_output=-1, name="lattice_combine"):
    r"""The particles' initial vectors from the LPT displacements, in the ICs' slot order.

    Output ``m`` is :math:`\sum_n c_{mn} \Psi^{(n)}` (plus the lattice site for
    ``m == lattice_output``: the positions), the slots in the tile order of
    :func:`flowpm_mtf.layout.slot_tiles` (the lattice order with the lagrangian
    decomposition). One native pass for all outputs (``FlowpmLatticeCombine``,
    :func:`lattice_combine_tf` without it): the products, the sums and the lattice site's
    addition of the TensorFlow ops, bit for bit. Output ``m < N`` takes the memory of
    displacement ``m`` when nothing else uses it (the positions and momenta of the ICs
    then need none of their own: 3.2 GB at 512^3).

    Parameters
    ----------
    psis : list of mtf.Tensor
        ``N`` displacements ``[bx, by, npart, xyz]`` [cells], lattice order
        (:func:`lpt_displacements`).
    coeffs : sequence of sequences of float
        ``M`` rows of ``N`` coefficients (:func:`lpt_coefficients`), rounded to
        ``conf.dtype``.
    conf : SimConfig
    lattice_output : int
        The output to add the lattice site to (block-local [cells]), -1 for none.
    name : str

    Returns
    -------
    list of mtf.Tensor
        ``M`` tensors ``[bx, by, npart, xyz]``, dtype ``conf.dtype``; the gradient with
        respect to displacement ``n`` is :math:`\sum_m c_{mn}` times output ``m``'s, in
        lattice order.
    """
    cvals = _coefficient_rows(coeffs, conf, len(psis), lattice_output, "lattice_combine",
                              "displacement")
    m_out = cvals.shape[0]
    sx, sy, nz = conf.block_shape
    tile = list(layout.slot_tiles(conf))

    def fn(*ts):
        nbx, nby, n, c = ts[0].shape.as_list()
        blocks = [tf.reshape(t, [nbx * nby, sx, sy, nz, c]) for t in ts]
        cf = tf.constant(cvals)
        lib = native.ops_for("lpt_ops", *blocks)
        outs = (lib.flowpm_lattice_combine(blocks, cf, tile=tile, M=m_out,
                                           lattice_output=int(lattice_output))
                if lib is not None else lattice_combine_tf(blocks, cf, tile, lattice_output))
        return tuple(tf.reshape(o, [nbx, nby, n, c]) for o in outs)

    def grad_fn(*dys):      # [nbx, nby, npart, c] each -> N lattice-order gradients
        nbx, nby, n, c = dys[0].shape.as_list()
        flat = [tf.reshape(d, [nbx * nby, n, c]) for d in dys]
        cf = tf.constant(cvals)
        lib = native.ops_for("lpt_ops", *flat)
        if lib is not None:
            grads = lib.flowpm_lattice_combine_grad(flat, cf, tile=tile, block=[sx, sy, nz],
                                                    N=len(psis))
        else:
            grads = lattice_combine_grad_tf(flat, cf, tile, [sx, sy, nz])
        return tuple(tf.reshape(g, [nbx, nby, n, c]) for g in grads)

    def gradient(op, *dys):
        # an output the loss does not use has no gradient: zeros, so the op gets all M
        dys = [mtf.zeros_like(o) if d is None else d for d, o in zip(dys, op.outputs)]
        out = mtf.slicewise(grad_fn, dys, output_shape=[p.shape for p in psis],
                            output_dtype=[p.dtype for p in psis],
                            splittable_dims=psis[0].shape.dims[:2], name=name + "_grad")
        return list(out)

    out = mtf.slicewise(fn, list(psis), output_shape=[psis[0].shape] * m_out,
                        output_dtype=[psis[0].dtype] * m_out,
                        splittable_dims=psis[0].shape.dims[:2], grad_function=gradient,
                        name=name)
    return list(out)


def lattice_combine_potentials_tf(phis, grad_coeffs, coeffs, tile, margins, lattice_output=-1,
                                  wrap=(0.0, 0.0, 0.0)):
    """``FlowpmLatticeCombinePotentials`` as TensorFlow ops (its reference; the path of a
    device without the native op): :func:`flowpm_mtf.physics.gravity.gradient_tf` of each potential
    ``[B, ax, ay, nz]`` with its margin, then :func:`lattice_combine_tf`, then output
    ``lattice_output`` wrapped to the sizes ``wrap``
    (:func:`flowpm_mtf.mesh.domain_local.wrap_tf`)."""
    psis = [gravity.gradient_tf(p, grad_coeffs, m) for p, m in zip(phis, margins)]
    outs = lattice_combine_tf(psis, coeffs, tile, lattice_output)
    if any(wrap):
        outs[lattice_output] = wrap_tf(outs[lattice_output], list(wrap))
    return outs


def _potentials_combine_grad(dys, grad_coeffs, coeffs, tile, margins, shapes):
    """The gradient of ``FlowpmLatticeCombinePotentials`` with respect to its potentials:
    ``FlowpmLatticeCombineGrad`` (or its twin), then the transpose of each difference
    (:func:`flowpm_mtf.physics.gravity.gradient_transpose`). ``shapes``: the potentials'. The
    ``dys`` may have more slots than the lattice's (a capacity): those past it are zero
    outputs, and get no gradient."""
    b, sx, sy, nz = shapes[0][0], shapes[0][1] - 2 * margins[0], shapes[0][2] - 2 * margins[0], \
        shapes[0][3]
    cells = sx * sy * nz
    dys = [d if d.shape.as_list()[1] == cells else d[:, :cells] for d in dys]
    lib = native.ops_for("lpt_ops", *dys)
    if lib is not None:
        dpsis = lib.flowpm_lattice_combine_grad(dys, coeffs, tile=list(tile),
                                                block=[sx, sy, nz], N=len(margins))
    else:
        dpsis = lattice_combine_grad_tf(dys, coeffs, tile, [sx, sy, nz])
    return [gravity.gradient_transpose(tf.reshape(d, [b, sx, sy, nz, 3]), grad_coeffs, m, s)
            for d, m, s in zip(dpsis, margins, shapes)]


@tf.RegisterGradient("FlowpmLatticeCombinePotentials")
def _lattice_combine_potentials_grad(op, *dys):
    """:func:`_potentials_combine_grad` (none for the coefficients, constants, nor for the
    donors, whose values are not read)."""
    n, k = op.get_attr("N"), op.get_attr("K")
    dys = [tf.zeros_like(y) if d is None else d for d, y in zip(dys, op.outputs)]
    shapes = [p.shape.as_list() for p in op.inputs[:n]]
    grads = _potentials_combine_grad(dys, op.inputs[n], op.inputs[n + 1], op.get_attr("tile"),
                                     op.get_attr("margins"), shapes)
    return grads + [None, None] + [None] * k


def lattice_combine_potentials(potentials, coeffs, conf, lattice_output=-1, wrap=None,
                               capacity=None, donors=(), name="lattice_combine"):
    r""":func:`lattice_combine` of the displacements of potentials, without making them.

    Output ``m`` is :math:`\sum_n c_{mn} \Psi^{(n)}` with :math:`\Psi^{(n)} = D\phi^{(n)}
    / c` the four-point difference of potential ``n`` (:func:`flowpm_mtf.physics.lpt_source.displacement`),
    plus the lattice site for ``m == lattice_output``, in the slots of
    :func:`lattice_combine`. One native pass (``FlowpmLatticeCombinePotentials``,
    :func:`lattice_combine_potentials_tf` without it): the same bits as
    :func:`lattice_combine` of :func:`flowpm_mtf.physics.lpt_source.displacement`, without the
    displacement fields (at 512^3 the 2LPT's two are 3.2 GB, written once and read once
    by the two passes it replaces).

    Parameters
    ----------
    potentials : list of (mtf.Tensor, int)
        ``N`` potentials [(Mpc/h)^2] on padded blocks ``[bx, by, sx + 2 m, sy + 2 m, z]``
        (:func:`flowpm_mtf.physics.lpt_source.padded_potential`), each with its margin ``m`` >= 2,
        or, where one block holds the whole mesh along x and y, unpadded with ``m`` = 0
        (read periodically; :func:`flowpm_mtf.physics.lpt_source.potential_blocks`).
    coeffs : sequence of sequences of float
        ``M`` rows of ``N`` coefficients (:func:`lpt_coefficients`), rounded to
        ``conf.dtype``.
    conf : SimConfig
    lattice_output : int
        The output to add the lattice site to (block-local [cells]), -1 for none.
    wrap : sequence of 3 floats, optional
        That output wrapped into ``[0, s)`` along every axis of size ``s`` > 0 [cells], as
        the eulerian migration's wrap (:func:`flowpm_mtf.mesh.domain.wrap_sizes`; its gradient
        the identity), in the same pass. Default: none.
    capacity : int, optional
        Slots per block [particles], at least the block's lattice sites: the slots past
        them are zero (:func:`flowpm_mtf.mesh.slots.pad_particles`, in the same pass).
        Default: the lattice sites.
    donors : sequence of mtf.Tensor, optional
        At most ``M`` tensors of the outputs' shape (``[bx, by, capacity, xyz]``), e.g.
        state variables' values from :func:`flowpm_mtf.mesh.donate.take`: output ``m`` is
        written into donor ``m``'s buffer when nothing else holds it (no fresh memory).
        Their values are not read; no gradient flows to them.
    name : str

    Returns
    -------
    list of mtf.Tensor
        ``M`` tensors ``[bx, by, npart, xyz]`` (``npart`` of size ``capacity``), dtype
        ``conf.dtype``; the gradient with respect to a potential is the transpose of its
        difference applied to that of :func:`lattice_combine` (of the lattice's slots).
    """
    blocks = [b for b, _ in potentials]
    margins = [int(m) for _, m in potentials]
    cvals = _coefficient_rows(coeffs, conf, len(blocks), lattice_output,
                              "lattice_combine_potentials", "potential")
    m_out = cvals.shape[0]
    sx, sy, nz = conf.block_shape
    for b, m in potentials:
        if ((m < gravity.GRADIENT_REACH and not (m == 0 and gravity.single_block(conf)))
                or b.shape.to_integer_list[2:] != [sx + 2 * m, sy + 2 * m, nz]):
            raise ValueError("lattice_combine_potentials: a potential of shape %s with margin "
                             "%d for blocks %s (margins >= %d, or 0 for one block holding "
                             "the whole mesh along x and y)"
                             % (b.shape, m, conf.block_shape, gravity.GRADIENT_REACH))
    wrap = [0.0, 0.0, 0.0] if wrap is None else [float(w) for w in wrap]
    if len(wrap) != 3 or min(wrap) < 0 or (any(wrap) and lattice_output < 0):
        raise ValueError("lattice_combine_potentials: wrap must be 3 sizes >= 0 and needs a "
                         "lattice_output, got %r" % (wrap,))
    tile = list(layout.slot_tiles(conf))
    gvals = lpt_source.difference_coeffs(conf)
    cells = sx * sy * nz
    cap = cells if capacity is None else int(capacity)
    if cap < cells:
        raise ValueError("lattice_combine_potentials: capacity %d is below the %d lattice "
                         "sites of a block" % (cap, cells))
    bdims = layout.particle_dims(conf)[:2]
    out_shape = mtf.Shape(bdims + [mtf.Dimension(cfg.NPART, cap), mtf.Dimension(cfg.XYZ, 3)])
    donors = list(donors)
    if len(donors) > m_out or any(d.shape != out_shape or d.dtype != blocks[0].dtype
                                  for d in donors):
        raise ValueError("lattice_combine_potentials: at most %d donors of shape %s and dtype "
                         "%s, got %s" % (m_out, out_shape, blocks[0].dtype,
                                         [(d.shape, d.dtype) for d in donors]))
    n_in = len(blocks)

    def flat(ts):
        return [tf.reshape(t, [-1] + t.shape.as_list()[2:]) for t in ts]

    def fn(*ts):
        nbx, nby = ts[0].shape.as_list()[:2]
        phis, gifts = flat(ts[:n_in]), flat(ts[n_in:])
        gc, cf = tf.constant(gvals), tf.constant(cvals)
        lib = native.ops_for("lpt_ops", *phis)
        if lib is not None:
            outs = lib.flowpm_lattice_combine_potentials(
                phis, gc, cf, gifts, tile=tile, margins=margins, M=m_out,
                lattice_output=int(lattice_output), wrap=wrap, capacity=cap)
        else:
            outs = [tf.pad(o, [[0, 0], [0, cap - cells], [0, 0]]) if cap > cells else o
                    for o in lattice_combine_potentials_tf(phis, gc, cf, tile, margins,
                                                           lattice_output, wrap)]
        return tuple(tf.reshape(o, [nbx, nby, cap, 3]) for o in outs)

    def grad_fn(*dys):      # [nbx, nby, capacity, 3] each -> N padded-block gradients
        nbx, nby = dys[0].shape.as_list()[:2]
        shapes = [[nbx * nby] + b.shape.to_integer_list[2:] for b in blocks]
        grads = _potentials_combine_grad(flat(dys), tf.constant(gvals), tf.constant(cvals),
                                         tile, margins, shapes)
        return tuple(tf.reshape(g, [nbx, nby] + s[1:]) for g, s in zip(grads, shapes))

    def gradient(op, *dys):
        dys = [mtf.zeros_like(o) if d is None else d for d, o in zip(dys, op.outputs)]
        out = mtf.slicewise(grad_fn, dys, output_shape=[b.shape for b in blocks],
                            output_dtype=[b.dtype for b in blocks],
                            splittable_dims=blocks[0].shape.dims[:2], name=name + "_grad")
        return list(out) + [None] * len(donors)

    out = mtf.slicewise(fn, blocks + donors, output_shape=[out_shape] * m_out,
                        output_dtype=[blocks[0].dtype] * m_out,
                        splittable_dims=blocks[0].shape.dims[:2], grad_function=gradient,
                        name=name)
    return list(out)


def _check_linear(linear, conf):
    shape = fft.real_shape(conf)
    if linear.shape != shape:
        if set(linear.shape.dims) == set(shape.dims):
            return mtf.transpose(linear, shape)
        raise ValueError("lpt: the linear field must have the shape %s, got %s"
                         % (shape, linear.shape))
    if linear.dtype != conf.tf_dtype:
        raise ValueError("lpt: the linear field must have dtype %s, got %s"
                         % (conf.dtype, linear.dtype.name))
    return linear


def lpt_displacements(linear, conf, order=None, kernels=None, real_space=None):
    r"""Unit-growth LPT displacement fields at the lattice particles.

    Parameters
    ----------
    linear : mtf.Tensor
        Linear density contrast at :math:`a = 1`, real ``[x, y, z]``
        [dimensionless], dtype ``conf.dtype``.
    conf : SimConfig
    order : {1, 2}, optional
        Default ``conf.lpt_order``.
    kernels : flowpm_mtf.physics.kernels.Kernels, optional
        Built with :func:`flowpm_mtf.physics.kernels.make_kernels` if None.
    real_space : bool, optional
        The fields as differences of the potential in real space
        (:mod:`flowpm_mtf.physics.lpt_source`: one real inverse FFT per potential) or in
        k-space (packed complex inverse FFTs); the same values to rounding. Default:
        real space where it serves (:func:`flowpm_mtf.physics.lpt_source.available`).

    Returns
    -------
    list of mtf.Tensor
        ``[psi1]`` or ``[psi1, psi2]``, each ``[bx, by, npart, xyz]`` [cells]:
        :math:`\Psi^{(1)}` and :math:`\Psi^{(2)}` of the module docstring.
    """
    order, linear, kernels, real_space = _lpt_inputs(linear, conf, order, kernels, real_space)
    if real_space:
        return _displacements_real_space(linear, conf, order, kernels)
    return _displacements_kspace(_modes(linear, conf), conf, order, kernels)


def _displacements_kspace(delta_k, conf, order, kernels):
    """:func:`lpt_displacements` by packed complex inverse FFTs."""
    def displacement(dk):
        return field_to_particles(neg_gradient_potential(dk, conf, kernels, sequential=True),
                                  conf)

    if order == 1:
        return [displacement(delta_k)]
    # psi1 and the six second derivatives of phi1: 9 real fields, 5 complex
    # inverse FFTs (two fields each), one after the other, each pair consumed
    # into the 2LPT source before the next starts: a batched transform of all
    # five held ~10 complex fields at once (the ICs' peak). Same pairing and
    # arithmetic as kernels.potential_fields, so the same values.
    pot = kernels.inverse_laplace(delta_k, name="inv_laplace_lpt")
    grad = [gradient_spec(kernels, d) for d in range(3)]
    hess = {p: hessian_spec(kernels, *p, name="lpt_hessian") for p in HESSIAN_PAIRS}
    yy, zz = inverse_after(pot, [hess[1, 1], hess[2, 2]], conf, name="lpt_fields_yy_zz")
    gz, xx = inverse_after(pot, [grad[2], hess[0, 0]], conf, [yy, zz], name="lpt_fields_z_xx")
    source = yy * zz + zz * xx + xx * yy
    xy, yz = inverse_after(pot, [hess[0, 1], hess[1, 2]], conf, [source],
                           name="lpt_fields_xy_yz")
    source = source - xy * xy
    source = source - yz * yz
    zx, = inverse_after(pot, [hess[2, 0]], conf, [source], name="lpt_fields_zx")
    source = source - zx * zx
    gx, gy = inverse_after(pot, [grad[0], grad[1]], conf, [source], name="lpt_fields_x_y")
    psi1 = field_to_particles(interleave_xyz([gx, gy, gz], "lpt_psi1"), conf)
    source = after(source, [gx, gy], name="lpt2_source_after")    # pot is free by then
    return [psi1, displacement(fft.r2c(source, conf, name="lpt2_source_r2c"))]


def _lpt_inputs(linear, conf, order, kernels, real_space):
    """The LPT order, the linear field, the kernels and whether the real-space path serves
    (:func:`lpt_displacements`'s parameters, checked and defaulted)."""
    order = conf.lpt_order if order is None else int(order)
    if order not in (1, 2):
        raise ValueError("lpt: order must be 1 or 2, got %r" % order)
    checked = _check_linear(linear, conf)
    for attr in ("_flowpm_linear_modes", "_flowpm_linear_noise"):   # ics.modes_of, noise_of
        if checked is not linear and hasattr(linear, attr):
            setattr(checked, attr, getattr(linear, attr))
    if kernels is None:
        kernels = make_kernels(conf, checked.mesh)
    if real_space is None:
        reach = lpt_source.SOURCE_REACH if order == 2 else lpt_source.GRADIENT_REACH
        real_space = lpt_source.available(conf, checked.dtype, reach)
    return order, checked, kernels, real_space


def _modes(linear, conf):
    """The Fourier modes of the linear field: those of :func:`flowpm_mtf.physics.ics.linear_field`
    when it made the field (no FFT round trip, :func:`flowpm_mtf.physics.ics.modes_of`), else its
    r2c."""
    modes = ics.modes_of(linear)
    return fft.r2c(linear, conf, name="lpt_r2c") if modes is None else modes


def _linear_potential(linear, conf, kernels):
    r"""The first-order potential :math:`\mathcal{F}^{-1}[\delta_k / |k|^2]`, real
    ``[x, y, z]``.

    For a :func:`flowpm_mtf.physics.ics.linear_field` output, one radial filter of its white noise
    by :math:`\sqrt{N P / V} / k^2` (:func:`flowpm_mtf.physics.ics.noise_of`,
    :mod:`flowpm_mtf.mesh.radial_filter`: the full spectrum is never made); for a field given
    by its modes alone (:func:`flowpm_mtf.physics.ics.modes_of`), the inverse Laplacian of the
    modes and one c2r; otherwise the radial filter :math:`1 / k^2` of the field.
    """
    recipe = ics.noise_of(linear)
    if recipe is not None:
        noise, amplitude = recipe
        return radial_filter.radial_filter(
            noise, conf, lambda k: amplitude(k) * radial_filter.inverse_laplace_values(k),
            name="lpt_phi1")
    modes = ics.modes_of(linear)
    if modes is not None:
        return fft.c2r(kernels.inverse_laplace(modes, name="lpt_phi1_inv_laplace"), conf,
                       name="lpt_phi1_c2r")
    return radial_filter.radial_filter(linear, conf, radial_filter.inverse_laplace_values,
                                       name="lpt_phi1")


def _second_potential(first, conf, deps=()):
    r"""``(blocks, margin)`` of :math:`\phi^{(2)}` for the displacement's reach
    (:func:`flowpm_mtf.physics.lpt_source.potential_blocks`), from ``(blocks, margin)`` of
    :math:`\phi^{(1)}` for the source's: the radial filter :math:`1 / k^2` of the 2LPT
    source (:mod:`flowpm_mtf.mesh.radial_filter`), whose forward FFT runs after ``deps``."""
    blocks1, margin1 = first
    source = lpt_source.source(blocks1, conf, margin1, name="lpt1_source")
    if deps:
        source = after(source, list(deps), name="lpt2_source_after")
    phi2 = radial_filter.radial_filter(source, conf, radial_filter.inverse_laplace_values,
                                       name="lpt_phi2")
    return lpt_source.potential_blocks(phi2, conf, lpt_source.GRADIENT_REACH)


def _displacements_real_space(linear, conf, order, kernels):
    r""":func:`lpt_displacements` in real space: each potential by one real inverse FFT,
    the fields by differences of it (:mod:`flowpm_mtf.physics.lpt_source`); :math:`\Psi^{(1)}`
    before the source's FFT, so that the padded :math:`\phi^{(1)}` is free by then."""
    reach, wide = lpt_source.GRADIENT_REACH, lpt_source.SOURCE_REACH
    phi1 = _linear_potential(linear, conf, kernels)
    if order == 1:
        blocks, margin = lpt_source.potential_blocks(phi1, conf, reach)
        return [lpt_source.displacement(blocks, conf, margin, name="lpt_psi1")]
    first = lpt_source.potential_blocks(phi1, conf, wide)
    psi1 = lpt_source.displacement(first[0], conf, first[1], name="lpt1_psi1")
    blocks2, margin2 = _second_potential(first, conf, [psi1])
    return [psi1, lpt_source.displacement(blocks2, conf, margin2, name="lpt_psi2")]


def _potentials_real_space(linear, conf, order, kernels):
    """The potentials of :func:`_displacements_real_space` on blocks, with their margins,
    for :func:`lattice_combine_potentials`: ``[(blocks, margin), ...]``
    (:func:`flowpm_mtf.physics.lpt_source.potential_blocks`: padded, or one unpadded block read
    periodically, margin 0)."""
    reach, wide = lpt_source.GRADIENT_REACH, lpt_source.SOURCE_REACH
    phi1 = _linear_potential(linear, conf, kernels)
    if order == 1:
        return [lpt_source.potential_blocks(phi1, conf, reach)]
    first = lpt_source.potential_blocks(phi1, conf, wide)
    return [first, _second_potential(first, conf)]


def lpt_coefficients(conf, a, order=None):
    r"""Growth coefficients multiplying :math:`\Psi^{(1)}, \Psi^{(2)}` at scale factor ``a``.

    Parameters
    ----------
    conf : SimConfig
    a : float
        Scale factor [dimensionless].
    order : {1, 2}, optional
        Default ``conf.lpt_order``.

    Returns
    -------
    dict
        ``"x"``, ``"p"``, ``"f"``: lists (one entry per order) of floats, the
        coefficients of the displacement, momentum and force (module docstring);
        the second-order ones include the sign of :math:`-D_2`.
    """
    order = conf.lpt_order if order is None else int(order)
    g = cosmo_mod.growth(conf.cosmology, [a])
    a2e = a**2 * float(g.E[0])
    d1, d2 = float(g.D1[0]), float(g.D2[0])
    coef = {"x": [d1], "p": [a2e * float(g.f1[0]) * d1], "f": [a2e * float(g.gf[0])]}
    if order == 2:
        coef["x"].append(-d2)
        coef["p"].append(-a2e * float(g.f2[0]) * d2)
        coef["f"].append(-a2e * float(g.gf2[0]))
    return coef


def state_shape(conf):
    """Shape ``[bx, by, npart, xyz]`` of the vectors of the state :func:`lpt_init` returns.

    ``npart``: the block's lattice sites for the lagrangian decomposition, else
    :func:`flowpm_mtf.physics.sizing.capacity` slots (mtf.Shape).
    """
    dims = layout.particle_dims(conf)
    n = (dims[2].size if conf.decomposition == "lagrangian" else sizing.capacity(conf))
    return mtf.Shape(dims[:2] + [mtf.Dimension(cfg.NPART, n), mtf.Dimension(cfg.XYZ, 3)])


def lpt_init(linear, conf, a=None, order=None, forces=True, kernels=None, donors=()):
    r"""LPT initial conditions: particles displaced from the lattice at scale factor ``a``.

    Parameters
    ----------
    linear : mtf.Tensor
        Linear density contrast at :math:`a = 1` [dimensionless], real
        ``[x, y, z]`` with dtype ``conf.dtype``.
    conf : SimConfig
    a : float, optional
        Scale factor of the initial conditions (default ``conf.a_start``).
    order : {1, 2}, optional
        LPT order (default ``conf.lpt_order``).
    forces : bool, optional
        False: no LPT force (``forces`` is None), for a caller that replaces
        it by the PM force (:func:`flowpm_mtf.physics.timeloop.initial_state`); the
        eulerian migration then carries one field fewer.
    kernels : flowpm_mtf.physics.kernels.Kernels, optional
        Shared with the caller's PM force (built here if None).
    donors : sequence of mtf.Tensor, optional
        Buffers for the positions, momenta (and forces), in that order, of the returned
        state's shape (e.g. the state variables' values from
        :func:`flowpm_mtf.mesh.donate.take`): with the real-space fields the vectors are
        written into them where nothing else holds them (:func:`lattice_combine_potentials`);
        otherwise unused.

    Returns
    -------
    State
        ``positions`` (lattice + displacement, block-local [cells]),
        ``momenta``, ``forces`` and ``ids`` (see :class:`State`). Eulerian
        decomposition: migrated to the blocks that contain them
        (:func:`flowpm_mtf.mesh.domain.migrate`, with enough rounds for the
        estimated LPT displacement); ``stats`` holds that migration's
        statistics.

    Notes
    -----
    Lagrangian decomposition: escapes are not checked here; the first painting
    (e.g. in :func:`flowpm_mtf.physics.nbody.nbody`) raises if a particle left its halo.
    """
    a = conf.a_start if a is None else float(a)
    order, linear, kernels, real_space = _lpt_inputs(linear, conf, order, kernels, None)
    coef = lpt_coefficients(conf, a, order)
    log.debug("lpt_init: order %d at a=%g, coefficients %s", order, a, coef)

    # All vectors in one pass, in the slots of layout.slot_tiles: in real space from the
    # potentials (no displacement field), else from the displacements, the positions and
    # momenta in their memory; the data-independent ids only when they are needed (ids
    # alike).
    keys = ("x", "p", "f") if forces else ("x", "p")
    rows = [coef[k] for k in keys]
    lagrangian = conf.decomposition == "lagrangian"
    slots = None if lagrangian else sizing.capacity(conf)
    pad = (lambda t: t) if lagrangian else (lambda t: pad_particles(t, slots))
    if real_space:   # the positions wrapped as the migration would, padded (no more passes)
        vecs = lattice_combine_potentials(_potentials_real_space(linear, conf, order, kernels),
                                          rows, conf, lattice_output=0,
                                          wrap=None if lagrangian else domain.wrap_sizes(conf),
                                          capacity=slots,
                                          donors=list(donors)[:len(rows)], name="lpt_state")
    else:
        vecs = lattice_combine(_displacements_kspace(_modes(linear, conf), conf, order, kernels),
                               rows, conf,
                               lattice_output=0, name="lpt_state")
        vecs = [pad(v) for v in vecs]
    x, fields = vecs[0], vecs[1:]
    ids = lattice_ids(conf, linear.mesh, deps=fields[-1:])
    # What uses the positions (the migration, a PM force) waits for the other results
    # too: psi1, psi2 are freed first.
    x = after(x, fields + [ids], name="lpt_after")
    if lagrangian:
        return State(x, fields[0], fields[1] if forces else None, ids)
    ids = pad_particles(ids, slots, value=-1)
    disp = sizing.lpt_displacement_cells(conf, a)
    rounds = sizing.migration_rounds(conf, disp)
    x, fields, ids, stats = domain.migrate(conf, x, fields, ids, rounds=rounds,
                                           send_rows=sizing.send_capacity(conf, disp, lattice=True),
                                           wrapped=real_space, name="migrate_lpt")
    return State(x, fields[0], fields[1] if forces else None, ids, stats)
