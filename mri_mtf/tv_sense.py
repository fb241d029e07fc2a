r"""Multi-coil total variation (TV-SENSE) by the primal-dual hybrid gradient, distributed.

Problem
-------
With the SENSE operator ``A`` (:class:`mri_mtf.sense.Sense`, ``sum_c |S_c|^2 = 1``) and
the periodic forward differences ``D_j`` of :func:`mri_mtf.recon.gradient`, the complex
image ``x`` minimises

.. math::

    \Phi(x) = \tfrac12 \|A x - y\|^2 + \lambda\, \mathrm{TV}(x), \qquad
    \mathrm{TV}(x) = \sum_{\mathbf r} \Big(\sum_j |D_j x|^2\Big)^{1/2}
    \ \text{(isotropic)}\quad\text{or}\quad \sum_{\mathbf r} \sum_j |D_j x|
    \ \text{(anisotropic, sigpy's ``TotalVariationRecon``)}.

Why PDHG and not the ADMM of :mod:`mri_mtf.recon`: with coils, ``A^H A = sum_c S_c^H
F^H M F S_c`` is no longer diagonal in k-space, so ADMM's exact ``x`` update becomes a
linear solve (an inner conjugate gradient of several ``A^H A`` per iteration). The
primal-dual hybrid gradient (Chambolle & Pock 2011; sigpy's solver for this problem)
needs one ``A`` and one ``A^H`` (``2 C`` coil FFTs in one batched distributed FFT each)
and the differences per iteration, no inner loop. With ``K = [A; D]``,
``||K||^2 <= ||A||^2 + ||D||^2 <= 1 + 12`` and steps ``tau = sigma = 0.99 / sqrt(13)``
(``tau sigma ||K||^2 < 1``), per iteration:

.. math::

    p &\leftarrow (p + \sigma (A \bar x - y)) / (1 + \sigma), \\
    q &\leftarrow \Pi_\lambda(q + \sigma D \bar x), \\
    x' &\leftarrow x - \tau (A^H p + D^T q), \qquad
    \bar x \leftarrow 2 x' - x, \quad x \leftarrow x',

with ``Pi_lambda`` the projection on ``{|q| <= lambda}`` per voxel (isotropic: the norm
over the three directions; anisotropic: each direction's complex modulus). Start:
``x = xbar = A^H y``, ``p = 0``, ``q = 0``. :class:`SteppedTVSense` holds the state in Mesh
TF variables (one lowered iteration run N times); :func:`tv_sense_numpy` is the numpy
reference and :func:`objective_numpy` the value ``Phi``.
"""
import logging

import mesh_tensorflow as mtf
import numpy as np
import tensorflow.compat.v1 as tf

from flowpm_mtf.mesh import complex_ops

from . import operators
from .recon import gradient, gradient_adjoint

__all__ = ["STEP", "tv_sense", "SteppedTVSense", "tv_sense_numpy", "objective_numpy",
           "tv_numpy"]

log = logging.getLogger(__name__)

STEP = 0.99 / np.sqrt(13.0)
"""PDHG primal and dual steps ``tau = sigma`` (``tau sigma (1 + 12) < 1``)."""


def _project(q, lam, norm):
    """Projection of the complex dual field ``q`` (a list of 3) on ``|q| <= lam``."""
    def scale(n2):
        return mtf.cwise(lambda a: tf.math.reciprocal(tf.maximum(tf.sqrt(a) / lam, 1.0)),
                         [n2], name="tv_project")

    if norm == "isotropic":
        n2 = None
        for qj in q:
            a = complex_ops.abs2(qj)
            n2 = a if n2 is None else n2 + a
        f = mtf.cast(scale(n2), q[0].dtype)
        return [qj * f for qj in q]
    return [qj * mtf.cast(scale(complex_ops.abs2(qj)), qj.dtype) for qj in q]


def _iteration(x, xbar, p, q, y, op, tv):
    """One PDHG iteration; returns the new ``(x, xbar, p, q)``."""
    s = STEP
    p = (p + (op.forward(xbar) - y) * s) * (1.0 / (1.0 + s))
    q = _project([qj + gj * s for qj, gj in zip(q, gradient(xbar))], tv.lam, tv.norm)
    xn = x - (op.adjoint(p) + gradient_adjoint(q)) * s
    return xn, xn * 2.0 - x, p, q


def tv_sense(y, op, tv):
    """TV-SENSE by PDHG, unrolled in the graph (module docstring).

    Parameters
    ----------
    y : mtf.Tensor
        Measured complex ``[coil, kx, ky, kz]`` (zero where not sampled).
    op : mri_mtf.sense.Sense
    tv : mri_mtf.recon.TVConfig
        ``lam``, ``iterations`` and ``norm`` (``rho`` is ADMM's, unused).

    Returns
    -------
    mtf.Tensor
        The complex image ``[x, y, z]`` [image intensity].
    """
    x = op.adjoint(y, name="tvs_x0")
    xbar, p = x, mtf.zeros(y.mesh, y.shape, y.dtype)
    q = [mtf.zeros(y.mesh, x.shape, x.dtype) for _ in range(3)]
    for _ in range(tv.iterations):
        x, xbar, p, q = _iteration(x, xbar, p, q, y, op, tv)
    return x


class SteppedTVSense:
    """TV-SENSE as one lowered PDHG iteration run ``tv.iterations`` times.

    The state ``x``, ``xbar``, ``p`` (``[coil, kx, ky, kz]``), ``q`` (3) lives in Mesh TF
    variables (real and imaginary parts as the ``chan`` dimension,
    :func:`mri_mtf.operators.to_channels`); :attr:`init_ops` sets the start,
    :attr:`step_ops` one iteration (lower them with
    :func:`hvd_mesh_impl.training.ordered_update_op`). After ``n`` steps :attr:`x` equals
    :func:`tv_sense` with ``n`` iterations.

    Parameters
    ----------
    y : mtf.Tensor
        Measured complex ``[coil, kx, ky, kz]``.
    op : mri_mtf.sense.Sense
    tv : mri_mtf.recon.TVConfig
    """

    def __init__(self, y, op, tv, name="tvs"):
        from hvd_mesh_impl.slice_init import unfolded_zeros_initializer

        self.tv = tv
        mesh, conf = y.mesh, op.conf
        zeros = unfolded_zeros_initializer()
        img = mtf.Shape(op.image_shape.dims + [operators.CHAN])
        ksh = mtf.Shape(y.shape.dims + [operators.CHAN])
        shapes = {"x": img, "xbar": img, "p": ksh, "q0": img, "q1": img, "q2": img}
        self.variables = {n: mtf.get_variable(mesh, "%s_%s" % (name, n), s, dtype=conf.tf_dtype,
                                              initializer=zeros, trainable=False)
                          for n, s in shapes.items()}
        c = {n: operators.to_complex(v, name="%s_%s_read" % (name, n))
             for n, v in self.variables.items()}
        self.x = c["x"]
        x0 = op.adjoint(y, name=name + "_x0")
        zero_img = mtf.zeros(mesh, x0.shape, x0.dtype)
        start = {"x": x0, "xbar": x0, "p": mtf.zeros(mesh, y.shape, y.dtype),
                 "q0": zero_img, "q1": zero_img, "q2": zero_img}
        x, xbar, p, q = _iteration(c["x"], c["xbar"], c["p"], [c["q0"], c["q1"], c["q2"]],
                                   y, op, tv)
        new = {"x": x, "xbar": xbar, "p": p, "q0": q[0], "q1": q[1], "q2": q[2]}
        self.init_ops = [mtf.assign(self.variables[n], operators.to_channels(start[n]),
                                    name="%s_init_%s" % (name, n)) for n in shapes]
        self.step_ops = [mtf.assign(self.variables[n], operators.to_channels(new[n]),
                                    name="%s_assign_%s" % (name, n)) for n in shapes]


# ----------------------------------------------------------------------------- numpy
def _grad(a):
    return [np.roll(a, -1, j) - a for j in range(3)]


def _grad_t(g):
    return sum(np.roll(g[j], 1, j) - g[j] for j in range(3))


def tv_numpy(x, norm="isotropic"):
    """``TV(x)`` (module docstring) of a whole complex array."""
    g = _grad(x)
    if norm == "isotropic":
        return float(np.sum(np.sqrt(sum(np.abs(a) ** 2 for a in g))))
    return float(sum(np.sum(np.abs(a)) for a in g))


def objective_numpy(x, y, A, lam, norm="isotropic"):
    """``Phi(x) = 1/2 |A x - y|^2 + lam TV(x)``.

    ``A`` is a function (:func:`mri_mtf.sense.sense_numpy`).
    """
    return float(0.5 * np.sum(np.abs(A(x) - y) ** 2) + lam * tv_numpy(x, norm))


def tv_sense_numpy(y, A, AH, lam, iterations, norm="isotropic", start="adjoint"):
    """Reference of :func:`tv_sense` on whole arrays (numpy FFT order, complex128).

    Parameters
    ----------
    y : ndarray ``[coil, x, y, z]``
    A, AH : functions
        :func:`mri_mtf.sense.sense_numpy`.
    start : {"adjoint", "zero"}
        ``x = A^H y`` (as :func:`tv_sense`) or ``x = 0`` (as sigpy's PDHG).
    """
    s = STEP
    x = AH(y) if start == "adjoint" else np.zeros_like(AH(y))
    xbar, p = x, np.zeros_like(y)
    q = [np.zeros_like(x) for _ in range(3)]
    for _ in range(iterations):
        p = (p + s * (A(xbar) - y)) / (1.0 + s)
        q = [a + s * b for a, b in zip(q, _grad(xbar))]
        if norm == "isotropic":
            f = 1.0 / np.maximum(np.sqrt(sum(np.abs(a) ** 2 for a in q)) / lam, 1.0)
            q = [a * f for a in q]
        else:
            q = [a / np.maximum(np.abs(a) / lam, 1.0) for a in q]
        xn = x - s * (AH(p) + _grad_t(q))
        x, xbar = xn, 2.0 * xn - x
    return x
