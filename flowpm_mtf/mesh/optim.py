r"""Optimisers on distributed Mesh TF variables (no physics).

:func:`adam_update`: one Adam step with bias correction, Mesh TF operations on the
mesh, for any variable's shape and layout. The reconstruction of the initial
conditions (:mod:`flowpm_mtf.gradients.reconstruct`) and the unrolled imaging network
(:mod:`mri_mtf.unrolled`) both train with it; it imports nothing of either (only
Mesh TF and the backend layer's zeros initializer,
:func:`hvd_mesh_impl.slice_init.unfolded_zeros_initializer`).
"""
import dataclasses

import mesh_tensorflow as mtf
import numpy as np

from hvd_mesh_impl.slice_init import unfolded_zeros_initializer

__all__ = ["AdamState", "adam_update"]


@dataclasses.dataclass
class AdamState:
    """Mesh TF variables of Adam (``mtf.get_variable`` outputs): step count, moments."""

    step: mtf.Tensor
    m: mtf.Tensor
    v: mtf.Tensor


def adam_update(var, grad, learning_rate, beta1=0.9, beta2=0.999, epsilon=1e-8,
                name="adam"):
    r"""One Adam step (with bias correction) on a distributed Mesh TF variable.

    .. math::

        t &\leftarrow t + 1, \quad
        m \leftarrow \beta_1 m + (1 - \beta_1) g, \quad
        v \leftarrow \beta_2 v + (1 - \beta_2) g^2, \\
        x &\leftarrow x - \eta\, \frac{m / (1 - \beta_1^t)}
                                        {\sqrt{v / (1 - \beta_2^t)} + \epsilon}.

    Parameters
    ----------
    var : mtf.Tensor
        The parameters: the output of ``mtf.get_variable`` (any shape and
        layout; real floating dtype).
    grad : mtf.Tensor
        :math:`g = \partial\mathcal L / \partial x`, shape of ``var``.
    learning_rate : float
        :math:`\eta` [units of ``var`` per step].
    beta1, beta2, epsilon : float
    name : str, optional

    Returns
    -------
    ops : list of mtf.Operation
        Assignments of ``var``, ``m``, ``v`` and ``t`` (run together, once per
        step). Every new value is computed from the values before the step.
    state : AdamState
        The optimiser's variables (``m``, ``v`` laid out like ``var``;
        ``step`` a replicated scalar), initialised to zero.
    """
    if grad.shape != var.shape:
        raise ValueError("adam_update: gradient shape %s differs from the variable's %s"
                         % (grad.shape, var.shape))
    if not isinstance(var.operation, mtf.Variable):
        raise ValueError("adam_update: %s is not a Mesh TF variable" % (var,))
    dtype = var.dtype
    mesh = var.mesh
    zeros = unfolded_zeros_initializer()  # no full-size constant (slice_init)
    m = mtf.get_variable(mesh, name + "_m", var.shape, dtype=dtype, initializer=zeros,
                         trainable=False)
    v = mtf.get_variable(mesh, name + "_v", var.shape, dtype=dtype, initializer=zeros,
                         trainable=False)
    step = mtf.get_variable(mesh, name + "_step", mtf.Shape([]), dtype=dtype,
                            initializer=zeros, trainable=False)
    t = step + 1.0
    m_new = m * beta1 + grad * (1.0 - beta1)
    v_new = v * beta2 + mtf.square(grad) * (1.0 - beta2)
    bias1 = 1.0 - mtf.exp(t * float(np.log(beta1))) if beta1 > 0 else None
    bias2 = 1.0 - mtf.exp(t * float(np.log(beta2))) if beta2 > 0 else None
    m_hat = m_new / bias1 if bias1 is not None else m_new
    v_hat = v_new / bias2 if bias2 is not None else v_new
    x_new = var - m_hat / (mtf.sqrt(v_hat) + epsilon) * float(learning_rate)
    ops = [mtf.assign(var, x_new, name=name + "_assign_x"),
           mtf.assign(m, m_new, name=name + "_assign_m"),
           mtf.assign(v, v_new, name=name + "_assign_v"),
           mtf.assign(step, t, name=name + "_assign_step")]
    return ops, AdamState(step, m, v)
