r"""LPT displacements and the second-order source in real space, from the potential.

The k-space path of :func:`flowpm_mtf.physics.lpt.lpt_displacements` computes the nine real
fields of the 2LPT (three components of :math:`\Psi^{(1)}`, six second derivatives of
the potential) with five packed complex inverse FFTs, and :math:`\Psi^{(2)}` with two
more. Its kernels are products of FastPM's gradient kernel :math:`i\tilde k_d`, the
transfer function of the four-point difference
:math:`D_d f = [8 (f_{+1} - f_{-1}) - (f_{+2} - f_{-2})] / (12 c_d)`
(:mod:`flowpm_mtf.physics.kernels`), so the same fields are, to rounding, differences of the
potential :math:`\phi = \mathcal{F}^{-1}[\delta_k / |k|^2]` in real space:

* :math:`\Psi_d = D_d\phi / c_d` [cells] (native ``FlowpmGradient``, as the PM force
  field of :func:`flowpm_mtf.physics.gravity.force_field_of_potential`; the ICs take the
  differences inside :func:`flowpm_mtf.physics.lpt.lattice_combine_potentials` instead, from
  :func:`padded_potential`, without a displacement field);
* the source :math:`S = \sum_{i<j} h_{ii} h_{jj} - h_{ij}^2` with
  :math:`h_{ij} = D_i D_j \phi` (native ``FlowpmLpt2Source``, one pass over the
  potential's padded blocks; its gradient ``FlowpmLpt2SourceGrad``, registered below).

One real-output inverse FFT per potential instead of the packed complex ones, and one
halo exchange of one field (:data:`SOURCE_REACH` cells; :data:`GRADIENT_REACH` for a
displacement alone). The TensorFlow twin :func:`source_tf` is the reference of the tests
and the path of a device without the native op.
"""
import dataclasses

import mesh_tensorflow as mtf
import numpy as np
import tensorflow.compat.v1 as tf

from .. import config as cfg
from .. import layout, native
from .gravity import GRADIENT_REACH, gradient_tf, single_block
from ..mesh.halo import field_to_padded, from_blocks, to_blocks

__all__ = ["SOURCE_REACH", "available", "padded_potential", "potential_blocks",
           "difference_coeffs", "displacement", "source", "source_tf"]

SOURCE_REACH = 4
"""Cells :math:`D_i D_i` reads on either side (the halo of the potential for the source)."""


def available(conf, dtype, reach=SOURCE_REACH):
    """Whether the real-space path serves: the native ops are built, ``dtype`` is float32
    or float64 and the blocks are wider than ``reach`` cells along x and y (the halo of
    the potential is filled from the direct neighbours, narrower than a block as every
    halo of a ``SimConfig``)."""
    if dtype not in (tf.float32, tf.float64):
        return False
    if native.load("lpt_ops") is None or native.load("cic_ops") is None:
        return False
    return reach < min(conf.block_shape[:2])


def _coeffs(conf, cells):
    """Coefficients of ``D_d`` [1/(Mpc/h)], over ``c_d`` once more with ``cells``."""
    return np.array([1.0 / (12.0 * c * (c if cells else 1.0)) for c in conf.cell_size],
                    conf.np_dtype)


def padded_potential(phi, conf, reach):
    """``[bx, by, sx + 2 reach, sy + 2 reach, z]``: the potential's blocks with their
    neighbours' cells (one halo exchange of one field)."""
    return field_to_padded(phi, dataclasses.replace(conf, halo_size=reach))


def potential_blocks(phi, conf, reach):
    """``(blocks, margin)``: the potential on blocks for stencils that read ``reach`` cells
    on either side along x and y.

    :func:`padded_potential` with margin ``reach``; where
    :func:`flowpm_mtf.physics.gravity.single_block` holds, the block itself with margin 0, which
    the native stencils (``FlowpmGradient``, ``FlowpmLpt2Source``,
    ``FlowpmLatticeCombinePotentials``) and their TensorFlow twins read periodically: the
    same values, without the padded copy (the two potentials' padded copies take 4
    concatenations, a sizeable part of the 2LPT state's time).
    """
    if single_block(conf):
        return to_blocks(phi, conf), 0
    return padded_potential(phi, conf, reach), reach


def difference_coeffs(conf):
    """Coefficients of :math:`D_d / c_d` [1/(Mpc/h)^2]: ``grad_coeffs`` of ``FlowpmGradient``
    and ``FlowpmLatticeCombinePotentials`` for a displacement in [cells]."""
    return _coeffs(conf, cells=True)


def _particle_shape(conf, rest=()):
    return mtf.Shape(layout.particle_dims(conf) + list(rest))


def _per_block(blocks, conf, compute, output_shape, name):
    """``compute`` on each padded block ``[B, ax, ay, nz]`` of ``blocks``, its result
    reshaped to ``output_shape`` (split along ``bx``, ``by`` as ``blocks``)."""
    nz = conf.block_shape[2]
    rest = [d.size for d in output_shape.dims[2:]]

    def fn(t):
        nbx, nby, ax, ay, _ = t.shape.as_list()
        return tf.reshape(compute(tf.reshape(t, [nbx * nby, ax, ay, nz])), [nbx, nby] + rest)

    return mtf.slicewise(fn, [blocks], output_shape=output_shape, output_dtype=blocks.dtype,
                         splittable_dims=blocks.shape.dims[:2], name=name)


def displacement(blocks, conf, margin, name="displacement"):
    r"""The displacement :math:`D_d\phi / c_d` [cells] of the potential at the lattice
    particles: :func:`flowpm_mtf.physics.kernels.neg_gradient_potential` of :math:`\delta_k`
    for :math:`\phi = \mathcal{F}^{-1}[\delta_k/|k|^2]`, to rounding.

    Parameters
    ----------
    blocks : mtf.Tensor
        The potential [(Mpc/h)^2] on padded blocks (:func:`padded_potential`).
    conf : SimConfig
    margin : int
        The blocks' margins [cells], at least :data:`GRADIENT_REACH`, or 0 for the
        unpadded block of :func:`potential_blocks` (read periodically).
    name : str

    Returns
    -------
    mtf.Tensor
        ``[bx, by, npart, xyz]`` [cells], particles in lattice order.
    """
    coeffs = difference_coeffs(conf)

    def compute(t):
        lib, c = native.ops_for("cic_ops", t), tf.constant(coeffs)
        return (lib.flowpm_gradient(t, c, margin=margin) if lib is not None
                else gradient_tf(t, c, margin))

    return _per_block(blocks, conf, compute,
                      _particle_shape(conf, [mtf.Dimension(cfg.XYZ, 3)]), name)


def source(blocks, conf, margin=SOURCE_REACH, name="lpt2_source"):
    r"""The 2LPT source from :math:`\phi^{(1)} = \mathcal{F}^{-1}[\delta_k/|k|^2]`.

    Parameters
    ----------
    blocks : mtf.Tensor
        The potential of the linear field [(Mpc/h)^2] on blocks padded by ``margin``
        cells (:func:`potential_blocks`).
    conf : SimConfig
    margin : int
        At least :data:`SOURCE_REACH` (:func:`padded_potential`; the blocks wider than
        that along x and y), or 0: one block holding the whole mesh along x and y, read
        periodically (:func:`flowpm_mtf.physics.gravity.single_block`).
    name : str

    Returns
    -------
    mtf.Tensor
        Real ``[x, y, z]`` [dimensionless]: :math:`S` of :mod:`flowpm_mtf.physics.lpt`.
    """
    m = int(margin)
    if m != 0 and m < SOURCE_REACH:
        raise ValueError("lpt_source.source: margin %d must be 0 or at least %d"
                         % (m, SOURCE_REACH))
    if m == 0 and not single_block(conf):
        raise ValueError("lpt_source.source: margin 0 (periodic) needs one block holding the "
                         "whole mesh along x and y, got blocks %s of a mesh %s"
                         % (conf.block_shape, tuple(conf.nc)))
    coeffs = _coeffs(conf, cells=False)

    def compute(t):
        lib, c = native.ops_for("lpt_ops", t), tf.constant(coeffs)
        return (lib.flowpm_lpt2_source(t, c, margin=m) if lib is not None
                else source_tf(t, c, m))

    return from_blocks(_per_block(blocks, conf, compute, layout.block_shape(conf), name), conf)


def source_tf(phi, coeffs, margin):
    r"""``FlowpmLpt2Source`` as TensorFlow ops (the reference; the path of a device without
    the native op): two four-point differences (:func:`flowpm_mtf.physics.gravity.gradient_tf`).

    ``phi`` ``[B, ax, ay, nz]``, ``coeffs`` ``[3]`` (of :math:`D_d`), ``margin`` >= 4
    (or 0: periodic along x and y); returns ``[B, ax - 2 margin, ay - 2 margin, nz]``.
    """
    r = 0 if margin == 0 else GRADIENT_REACH
    first = gradient_tf(phi, coeffs, r)                      # D_d phi, margin - r left
    h = [gradient_tf(first[..., i], coeffs, margin - r) for i in range(3)]   # h[i][..., j]
    xx, yy, zz = h[0][..., 0], h[1][..., 1], h[2][..., 2]
    xy, xz, yz = h[0][..., 1], h[0][..., 2], h[1][..., 2]
    return ((xx * yy + yy * zz) + zz * xx) - ((xy * xy + xz * xz) + yz * yz)


@tf.RegisterGradient("FlowpmLpt2Source")
def _source_grad(op, dy):
    """``FlowpmLpt2SourceGrad``: :math:`\\sum_{ij} D_i D_j (\\bar S\\, \\partial S/\\partial
    h_{ij})` on the input's cells (the weights extended by zeros)."""
    lib = native.load("lpt_ops")
    return (lib.flowpm_lpt2_source_grad(op.inputs[0], dy, op.inputs[1],
                                        margin=op.get_attr("margin")), None)
