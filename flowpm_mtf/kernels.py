r"""Fourier-space kernels of the particle-mesh solver (FlowPM / FastPM conventions).

Conventions
-----------
A k-space field is the :func:`flowpm_mtf.fft.r2c` transform of a real field on
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
"""
import logging

import mesh_tensorflow as mtf
import numpy as np
import tensorflow.compat.v1 as tf

from . import config as cfg
from . import layout
from . import fft

__all__ = ["gradient_kvec", "inverse_laplace_kernel", "Kernels", "make_kernels",
           "neg_gradient_potential", "hessian_potential", "unstack_xyz"]

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
    kx, ky, kz = fft.kvec(conf, mesh, units="h/Mpc")
    kk = mtf.square(kx) + mtf.square(ky) + mtf.square(kz)

    def inv(t):
        safe = tf.where(t > 0, t, tf.ones_like(t))
        return tf.where(t > 0, 1.0 / safe, tf.zeros_like(t))

    return mtf.cwise(inv, [kk], name="inverse_laplace")


class Kernels:
    """The k-space kernels used by LPT and the PM force, built once per graph.

    Attributes
    ----------
    inv_laplace : mtf.Tensor
        :math:`1/|k|^2` on ``[kx, ky, kz]`` [(Mpc/h)^2].
    grad : list of 3 mtf.Tensor
        :math:`\\tilde k_d` on ``[k_d]`` [h/Mpc] (the phase ``i`` is applied
        by :func:`flowpm_mtf.fft.apply_kernel`).
    grad_cells : list of 3 mtf.Tensor
        :math:`\\tilde k_d / c_d` on ``[k_d]`` [h/Mpc / (Mpc/h)]: gradient
        followed by the conversion of a length from Mpc/h to cells.
    """

    def __init__(self, inv_laplace, grad, grad_cells):
        self.inv_laplace = inv_laplace
        self.grad = grad
        self.grad_cells = grad_cells


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
    return Kernels(inverse_laplace_kernel(conf, mesh), grad, grad_cells)


def _stack_xyz(components, name):
    return mtf.stack(components, cfg.XYZ, axis=components[0].shape.ndims, name=name)


def unstack_xyz(t):
    """Split a tensor along its ``xyz`` dimension into a list of 3 tensors."""
    return mtf.unstack(t, t.shape.get_dim_by_name(cfg.XYZ))


def neg_gradient_potential(delta_k, conf, kernels):
    r"""Real-space :math:`-\nabla\phi` [cells] for :math:`\nabla^2\phi = \delta`.

    The three components go through one batched inverse FFT.

    Parameters
    ----------
    delta_k : mtf.Tensor
        Complex ``[kx, ky, kz]``: :func:`flowpm_mtf.fft.r2c` of a real field
        :math:`\delta` [dimensionless].
    conf : SimConfig
    kernels : Kernels

    Returns
    -------
    mtf.Tensor
        Real ``[x, y, z, xyz]``: component ``d`` is :math:`\mathcal{F}^{-1}[i\tilde
        k_d\, \delta_k / |k|^2] / c_d` [cells], as FlowPM's ``lpt1`` and
        ``apply_longrange`` before the readout.
    """
    pot = fft.apply_kernel(delta_k, kernels.inv_laplace, name="inv_laplace")
    comps = [fft.apply_kernel(pot, g, 1j, name="grad_%d" % d)
             for d, g in enumerate(kernels.grad_cells)]
    return fft.c2r(_stack_xyz(comps, "grad_stack"), conf, name="c2r_grad")


def hessian_potential(delta_k, conf, kernels, pairs):
    r"""Real-space :math:`-\partial_i\partial_j\phi` for :math:`\nabla^2\phi = \delta` [dimensionless].

    As FlowPM's ``lpt2_source``: :math:`\mathcal{F}^{-1}[(i\tilde k_i)(i\tilde
    k_j)\,\delta_k / |k|^2]` (physical finite-difference wave numbers, so the
    result does not depend on the cell size). The three requested components
    go through one batched inverse FFT.

    Parameters
    ----------
    delta_k : mtf.Tensor
        Complex ``[kx, ky, kz]``.
    conf : SimConfig
    kernels : Kernels
    pairs : sequence of 3 (int, int)
        Axes ``(i, j)`` of each component, e.g. ``((0, 0), (1, 1), (2, 2))``.

    Returns
    -------
    mtf.Tensor
        Real ``[x, y, z, xyz]``; entry ``n`` along ``xyz`` is the component
        ``pairs[n]``.
    """
    if len(pairs) != 3:
        raise ValueError("hessian_potential: need 3 (i, j) pairs, got %r" % (pairs,))
    pot = fft.apply_kernel(delta_k, kernels.inv_laplace, name="inv_laplace_h")
    comps = []
    for i, j in pairs:
        t = fft.apply_kernel(pot, kernels.grad[i], 1j, name="grad_%d%d_a" % (i, j))
        comps.append(fft.apply_kernel(t, kernels.grad[j], 1j, name="grad_%d%d_b" % (i, j)))
    return fft.c2r(_stack_xyz(comps, "hessian_stack"), conf, name="c2r_hessian")
