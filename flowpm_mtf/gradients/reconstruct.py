r"""Reconstruction of the initial conditions by gradient descent on the process grid.

Given an observed final density field :math:`d(\mathbf x)` (``1 + delta`` on
the mesh), find the linear density field :math:`s(\mathbf x)` (at
:math:`a = 1`, the input of :func:`flowpm_mtf.physics.lpt.lpt_init`) that maximises
the posterior, i.e. minimises

.. math::

    \mathcal L(s) = \frac1N \Big[
        \underbrace{\sum_{\mathbf x} \frac{(d - F(s))^2}{\sigma^2}}_{\chi^2}
      + \underbrace{\sum_{\mathbf k \ne 0} \frac{|s_{\mathbf k}|^2}{P(k)/V}}_{\rm prior}
    \Big],

with :math:`F` the forward model (``"lpt"``: LPT displacement to
``conf.a_end`` and CIC density; ``"nbody"``: LPT at ``conf.a_start`` then the
FastPM N-body to ``conf.a_end``, :func:`flowpm_mtf.physics.nbody.forward`),
:math:`\sigma` the per-cell Gaussian noise of the data,
:math:`s_{\mathbf k} = \mathrm{r2c}(s)` in FlowPM's normalisation
(``fftn / N``), :math:`V` the box volume and :math:`N` the number of cells.

Normalisation of the prior: :func:`flowpm_mtf.physics.ics.linear_field` gives modes
with :math:`\langle|s_{\mathbf k}|^2\rangle = P(k)/V`, and the sum runs over the
full complex spectrum (both members of every pair :math:`\pm\mathbf k`), so
the prior term is exactly :math:`-2\ln` of the Gaussian density of the
:math:`N - 1` real degrees of freedom of a real field (a pair contributes
:math:`(\mathrm{Re}^2 + \mathrm{Im}^2)/(P/2V)`). A true linear field therefore
has prior :math:`\approx N - 1 \pm \sqrt{2N}` and :math:`\mathcal L \approx 2`
at the truth; :math:`\mathcal L` is :math:`-2\ln(\text{posterior})/N` up to a
constant. Dividing by :math:`N` keeps the loss O(1) on any mesh.

The optimiser is Adam (Kingma & Ba 2015, with bias correction;
:func:`flowpm_mtf.mesh.optim.adam_update`, re-exported here), written with
Mesh TF operations: the field and its two moment estimates are Mesh TF
variables on ``[x, y, z]``, split over the process grid like any field; the
gradient comes from ``mtf.gradients`` through the forward model. The
trajectory does not depend on the process grid beyond the order of
floating-point sums.

The job (:mod:`flowpm_mtf.jobs.reconstruct`, ``flowpm-mtf reconstruct``) makes a truth from
``conf.seed``, observes its final density with Gaussian noise
(:mod:`flowpm_mtf.mesh.noise`, seed ``conf.seed + NOISE_SEED_OFFSET``: the same data
on every process grid), optimises from :math:`s = 0` and writes
``reconstruction.h5``, ``reconstruction.txt``, ``summary.json`` and
``reconstruction.png``.
"""
import logging

import mesh_tensorflow as mtf
import numpy as np
import tensorflow.compat.v1 as tf

from hvd_mesh_impl.slice_init import unfolded_zeros_initializer

from . import adjoint, model_gradient
from ..mesh import complex_ops, fft, slots
from ..physics import gravity, ics, lpt, nbody, power
from ..mesh import noise as noise_mod
from ..logs import rank0_only
from ..mesh.optim import AdamState, adam_update  # noqa: F401  (public here too: __all__)
# the settings, decided before any graph (public here too: __all__)
from .reconstruct_config import (FORWARD_MODELS, GRADIENTS, NOISELESS_SIGMA,  # noqa: F401
                                 ReconConfig)

__all__ = ["ReconConfig", "FORWARD_MODELS", "NOISE_SEED_OFFSET", "NOISELESS_SIGMA",
           "forward_model", "inverse_power_kernel", "prior_chi2", "loss_terms", "cross_power",
           "AdamState", "adam_update", "ReconstructionGraph"]

log = rank0_only(logging.getLogger(__name__))  # progress: every rank would repeat it

COSMOLOGY_PARAMETERS = ("Omega_c", "sigma8")
"""Parameters whose loss gradient the adjoint reports at the final field."""

NOISE_SEED_OFFSET = 1000003
"""The observation noise uses the seed ``conf.seed + NOISE_SEED_OFFSET`` (an
independent SplitMix64 stream; see :mod:`flowpm_mtf.mesh.noise`)."""


# ----------------------------------------------------------------------------- model
def forward_model(linear, conf, forward="lpt"):
    """Final CIC density ``1 + delta`` of a linear field.

    Parameters
    ----------
    linear : mtf.Tensor
        Linear density contrast at a = 1, real ``[x, y, z]`` [dimensionless].
    conf : SimConfig
    forward : {"lpt", "nbody"}
        ``"lpt"``: ``conf.lpt_order`` LPT displacement evaluated at
        ``conf.a_end``; ``"nbody"``: :func:`flowpm_mtf.physics.nbody.forward` (LPT at
        ``conf.a_start``, ``conf.n_steps`` FastPM steps to ``conf.a_end``).

    Returns
    -------
    mtf.Tensor
        ``[x, y, z]`` particles per cell [dimensionless, mean 1].
    """
    if forward == "lpt":
        state = lpt.lpt_init(linear, conf, a=conf.a_end)
        return gravity.density(state.positions, conf, slots.weights(state.ids, conf))
    if forward == "nbody":
        return nbody.forward(linear, conf)[1]
    raise ValueError("forward must be one of %s, got %r" % (FORWARD_MODELS, forward))


def inverse_power_kernel(conf, mesh, power_fn=None, name="inverse_power_kernel"):
    r"""Real k-space kernel :math:`\sqrt{V / P(|\mathbf k|)}`, zero at ``k = 0``.

    Parameters
    ----------
    conf : SimConfig
    mesh : mtf.Mesh
    power_fn : callable, PowerTable or None
        Linear P(k) at a = 1 (see :func:`flowpm_mtf.physics.ics.power_function`); the
        default is the Eisenstein & Hu spectrum of ``conf.cosmology``, the one
        :func:`flowpm_mtf.physics.ics.linear_field` uses.
    name : str, optional

    Returns
    -------
    mtf.Tensor
        ``[kx, ky, kz]``, dtype ``conf.dtype`` [dimensionless: V/P is the
        inverse of the variance of an r2c mode]. Each processor evaluates P on
        its own slice only.
    """
    pk = ics.power_function(conf, power_fn, a=1.0)
    volume = float(np.prod(conf.box_size))
    return ics.radial_kernel(conf, mesh, lambda k: np.sqrt(volume / pk(k)), name)


def prior_chi2(linear, conf, kernel=None, name="prior_chi2"):
    r"""Gaussian prior :math:`\sum_{\mathbf k \ne 0} |s_{\mathbf k}|^2 V / P(k)` of a linear field.

    Parameters
    ----------
    linear : mtf.Tensor
        Real ``[x, y, z]`` [dimensionless].
    conf : SimConfig
    kernel : mtf.Tensor, optional
        :func:`inverse_power_kernel` (built here if None).
    name : str, optional

    Returns
    -------
    mtf.Tensor
        Real scalar [dimensionless]: :math:`-2 \ln` of the prior density up to
        a constant; about ``N - 1`` for a field of
        :func:`flowpm_mtf.physics.ics.linear_field` (see the module docstring).
    """
    if kernel is None:
        kernel = inverse_power_kernel(conf, linear.mesh, name=name + "_kernel")
    white = complex_ops.apply_kernel(fft.r2c(linear, conf, name=name + "_r2c"), kernel,
                                     name=name + "_whiten")
    return mtf.reduce_sum(complex_ops.abs2(white, name=name + "_abs2"), name=name)


def cross_power(a, b, conf, edges=None, name="cross_power"):
    r"""Auto and cross power spectra of two real fields (distributed).

    Parameters
    ----------
    a, b : mtf.Tensor
        Real fields ``[x, y, z]`` [dimensionless].
    conf : SimConfig
    edges : array_like, optional
        Shell edges [h/Mpc]; default :func:`flowpm_mtf.physics.power.default_edges`.
    name : str, optional

    Returns
    -------
    k : mtf.Tensor
        Mean ``|k|`` per shell [h/Mpc], float64 ``[kbin]``.
    p_ab, p_aa, p_bb : mtf.Tensor
        :math:`V \langle \mathrm{Re}(a_{\mathbf k}^* b_{\mathbf k})\rangle`,
        :math:`V\langle|a_{\mathbf k}|^2\rangle`, :math:`V\langle|b_{\mathbf k}|^2\rangle`
        per shell [(Mpc/h)^3], dtype of ``a``, ``[kbin]``; the estimator and
        mode counting of :func:`flowpm_mtf.physics.power.power_spectrum`.
    n_modes : mtf.Tensor
        Modes per shell (full complex spectrum), float64 ``[kbin]``.

    Notes
    -----
    The cross-correlation is :math:`r = P_{ab} / \sqrt{P_{aa} P_{bb}}` and the
    transfer function :math:`T = \sqrt{P_{bb} / P_{aa}}`.
    """
    for t, what in ((a, "a"), (b, "b")):
        if t.shape != fft.real_shape(conf):
            raise ValueError("cross_power: %s must have the shape %s, got %s"
                             % (what, fft.real_shape(conf), t.shape))
    edges = power.default_edges(conf) if edges is None else np.asarray(edges, np.float64)
    n_bins = edges.size - 1
    volume = float(np.prod(conf.box_size))
    bins, knorm = power.bin_index(conf, a.mesh, edges, name=name + "_bins")
    ak = fft.r2c(a, conf, name=name + "_r2c_a")
    bk = fft.r2c(b, conf, name=name + "_r2c_b")
    re_ab = mtf.slicewise(lambda u, v: tf.math.real(tf.math.conj(u) * v), [ak, bk],
                          output_shape=ak.shape, output_dtype=a.dtype,
                          splittable_dims=ak.shape.dims, name=name + "_re_ab")
    n_modes = power.binned_sum(mtf.ones(a.mesh, knorm.shape, tf.float64), bins, n_bins,
                               name=name + "_modes")
    safe = mtf.maximum(n_modes, 1.0)
    k_mean = power.binned_sum(knorm, bins, n_bins, name=name + "_ksum") / safe
    scale = mtf.cast(volume / safe, a.dtype)
    out = [power.binned_sum(v, bins, n_bins, name=name + "_" + s) * scale
           for v, s in ((re_ab, "ab"), (complex_ops.abs2(ak), "aa"), (complex_ops.abs2(bk), "bb"))]
    return (k_mean, *out, n_modes)


def loss_terms(linear, observed, conf, rconf, kernel=None):
    r"""The reconstruction loss :math:`\mathcal L = (\chi^2 + {\rm prior}) / N` and its terms.

    Parameters
    ----------
    linear : mtf.Tensor
        Trial linear field at a = 1, real ``[x, y, z]`` [dimensionless].
    observed : mtf.Tensor
        Data, ``1 + delta`` on ``[x, y, z]`` [dimensionless].
    conf : SimConfig
    rconf : ReconConfig
        ``forward`` and :attr:`ReconConfig.likelihood_sigma` are used.
    kernel : mtf.Tensor, optional
        :func:`inverse_power_kernel` (built here if None).

    Returns
    -------
    loss, chi2, prior : mtf.Tensor
        Real scalars [dimensionless]: :math:`\mathcal L`,
        :math:`\sum_x (d - F(s))^2 / \sigma^2` and :func:`prior_chi2`.
    """
    for t, what in ((linear, "linear"), (observed, "observed")):
        if t.shape != fft.real_shape(conf):
            raise ValueError("%s field must have the shape %s, got %s"
                             % (what, fft.real_shape(conf), t.shape))
    model = forward_model(linear, conf, rconf.forward)
    chi2 = mtf.reduce_sum(mtf.square(observed - model), name="chi2") * float(
        1.0 / rconf.likelihood_sigma**2)
    prior = prior_chi2(linear, conf, kernel)
    return (chi2 + prior) * float(1.0 / conf.n_cells), chi2, prior


# ----------------------------------------------------------------------------- graph
class ReconstructionGraph:
    """The Mesh TF graph of a reconstruction: data, variables, loss, Adam, diagnostics.

    Parameters
    ----------
    conf : SimConfig
    rconf : ReconConfig
    mesh : mtf.Mesh
    observed : numpy.ndarray or mtf.Tensor, optional
        The data, ``1 + delta`` of shape ``conf.nc`` (numpy; embedded in the
        graph as a constant, so meant for small meshes) or an mtf tensor on
        ``[x, y, z]``. Default: simulated from ``truth`` with the forward
        model plus noise of standard deviation ``rconf.noise`` (seed
        ``conf.seed + NOISE_SEED_OFFSET``).
    truth : mtf.Tensor, optional
        True linear field ``[x, y, z]`` for the diagnostics (and the data
        when ``observed`` is None); default
        :func:`flowpm_mtf.physics.ics.linear_field` with ``conf.seed`` when
        ``observed`` is None, no diagnostics otherwise.

    Attributes
    ----------
    observe_op : mtf.Operation
        Stores the data in the ``observed`` variable: run once, first.
    step_ops : list of mtf.Operation
        One Adam step (run once per iteration).
    loss, chi2, prior : mtf.Tensor
        Scalars at the current field, before the step: :math:`\\mathcal L`,
        and the two un-normalised terms [dimensionless].
    linear, observed : mtf.Tensor
        Variables (``mtf.get_variable`` outputs) on ``[x, y, z]``: the
        reconstructed linear field (initialised to zero) and the data.
    k, r, transfer, n_modes : mtf.Tensor or None
        Cross-correlation and transfer function of ``linear`` against
        ``truth`` per shell (None without a truth).
    checkpoint_variables : dict of str to mtf.Tensor
        The optimiser's whole state (variables by name: the field, Adam's moments
        and step count): what a checkpoint must hold besides the iteration count
        and the loss history (the data are re-made from the seed).

    Raises
    ------
    ValueError
        At graph construction, if ``observed`` or ``truth`` do not have the
        mesh shape of ``conf``.
    """

    def __init__(self, conf, rconf, mesh, observed=None, truth=None):
        self.conf, self.rconf = conf, rconf
        shape = fft.real_shape(conf)
        dtype = conf.tf_dtype
        if truth is not None and truth.shape != shape:
            raise ValueError("truth must have the shape %s, got %s" % (shape, truth.shape))
        stepped = False   # the data made by the adjoint's stepped forward (below)
        self.observe_init_ops = []
        if observed is None:
            truth = ics.linear_field(conf, mesh, name="truth") if truth is None else truth
            stepped = rconf.uses_adjoint
            # the unrolled forward model otherwise (its graph is the stored gradient's anyway)
            data = None if stepped else self._noisy(forward_model(truth, conf, rconf.forward))
        elif isinstance(observed, mtf.Tensor):
            if observed.shape != shape:
                raise ValueError("observed field must have the shape %s, got %s"
                                 % (shape, observed.shape))
            data = observed
        else:
            arr = np.asarray(observed)
            if arr.shape != tuple(conf.nc):
                raise ValueError("observed field must have the shape nc=%s, got %s"
                                 % (tuple(conf.nc), arr.shape))
            if not np.all(np.isfinite(arr)):
                raise ValueError("observed field has non-finite values")
            data = mtf.import_tf_tensor(mesh, tf.constant(arr.astype(conf.np_dtype)), shape,
                                        name="observed_input")
        zeros = unfolded_zeros_initializer()  # no full-size constant (slice_init)
        self.observed = mtf.get_variable(mesh, "observed", shape, dtype=dtype,
                                         initializer=zeros, trainable=False)
        if data is not None:
            self.observe_op = mtf.assign(self.observed, data, name="observe")
        self.linear = mtf.get_variable(mesh, "linear", shape, dtype=dtype, initializer=zeros,
                                       trainable=True)
        s = self.linear
        self.model_gradient = None
        if rconf.uses_adjoint:
            inv_n = float(1.0 / conf.n_cells)
            sigma2 = float(1.0 / rconf.likelihood_sigma**2)

            def data_term(state):   # chi2 / N of the final state
                model = gravity.density(state.positions, conf, slots.weights(state.ids, conf))
                return mtf.reduce_sum(mtf.square(self.observed - model)) * (sigma2 * inv_n)

            mg = model_gradient.ModelGradient(conf, mesh, data_term, linear=s,
                                              params=COSMOLOGY_PARAMETERS)
            self.model_gradient = mg
            if stepped:
                # the data: the truth's ICs, the same lowered steps as every iteration, the
                # final density (an unrolled graph of the run would grow with the steps)
                adj = mg.adjoint
                self.observe_init_ops = adj.assign_initial_state(
                    lpt.lpt_init(truth, conf, a=float(adj.stages[0]), forces=False))
                v = adj.variables
                self.observe_op = mtf.assign(self.observed, self._noisy(
                    gravity.density(v.positions, conf, slots.weights(v.ids, conf))),
                    name="observe")
            kernel = inverse_power_kernel(conf, mesh)
            self.prior = prior_chi2(s, conf, kernel)
            # the prior's dependence on the cosmology, through P(k): sum(K_bar dK/dtheta)
            kbar = mtf.gradients([self.prior * inv_n], [kernel])[0]
            volume = float(np.prod(conf.box_size))
            self.prior_cosmology = {p: mtf.reduce_sum(kbar * model_gradient.power_kernel_derivative(
                conf, mesh, p, lambda pk, k: np.sqrt(volume / pk), name="prior_d_" + p),
                output_shape=mtf.Shape([])) for p in COSMOLOGY_PARAMETERS}
            self.chi2 = mg.adjoint.loss * float(conf.n_cells)
            self.loss = mg.adjoint.loss + self.prior * inv_n
            grad = mg.field_gradient + mtf.gradients([self.prior * inv_n], [s])[0]
        else:
            self.loss, self.chi2, self.prior = loss_terms(s, self.observed, conf, rconf)
            grad = mtf.gradients([self.loss], [s])[0]
        self.step_ops, self.adam = adam_update(self.linear, grad, rconf.learning_rate,
                                               rconf.beta1, rconf.beta2, rconf.epsilon)
        self.truth = truth
        self.k = self.r = self.transfer = self.n_modes = None
        if truth is not None:
            self.k, p_tr, p_tt, p_rr, self.n_modes = cross_power(truth, s, conf)
            tiny = np.finfo(conf.np_dtype).tiny
            self.r = p_tr / mtf.sqrt(mtf.maximum(p_tt * p_rr, tiny))
            self.transfer = mtf.sqrt(p_rr / mtf.maximum(p_tt, tiny))
        self.checkpoint_variables = {"linear": self.linear, "adam_m": self.adam.m,
                                     "adam_v": self.adam.v, "adam_step": self.adam.step}

    def _noisy(self, data):
        """``data`` plus the observation noise (seed ``conf.seed + NOISE_SEED_OFFSET``)."""
        conf, rconf = self.conf, self.rconf
        if rconf.noise <= 0:
            return data
        noise = noise_mod.white_noise(data.mesh, fft.real_shape(conf),
                                      conf.seed + NOISE_SEED_OFFSET, conf.tf_dtype,
                                      name="observation_noise")
        return data + noise * float(rconf.noise)

    def observe(self, sess, ops):
        """Store the data in the ``observed`` variable (run once, first; again on a resume).

        With the adjoint (``--forward nbody``) the truth goes through the same lowered
        steps as every iteration; otherwise one run of the forward model's graph.
        """
        if "observe_init" in ops:
            sess.run(ops["observe_init"])
            adjoint.run_forward(sess, self.model_gradient.adjoint, ops["adjoint"])
        sess.run(ops["observe"])

    def lower_iteration(self, lowering):
        """The lowered ops of one iteration and of the loss (call before the first run).

        Returns
        -------
        dict
            For :meth:`iterate` and :meth:`evaluate`.
        """
        from hvd_mesh_impl.training import ordered_update_op  # Horovod-free (floor 0)

        scalars = {n: lowering.tensors[getattr(self, n)].to_laid_out_tensor().tensor_list[0]
                   for n in ("loss", "chi2", "prior")}
        ops = {"step": ordered_update_op(lowering, self.step_ops), "scalars": scalars,
               "observe": lowering.lowered_operation(self.observe_op)}
        if self.observe_init_ops:
            ops["observe_init"] = ordered_update_op(lowering, self.observe_init_ops)
        if self.model_gradient is not None:
            ops["adjoint"] = self.model_gradient.lower(lowering)
            ops["prior_cosmology"] = {
                p: lowering.tensors[t].to_laid_out_tensor().tensor_list[0]
                for p, t in self.prior_cosmology.items()}
        return ops

    def iterate(self, sess, ops):
        """One Adam iteration; returns the loss terms at the field before the step.

        Parameters
        ----------
        sess : tf.Session
        ops : dict
            From :meth:`lower_iteration`.

        Returns
        -------
        dict
            ``loss``, ``chi2``, ``prior`` (floats) at the field before the step.
        """
        if self.model_gradient is None:
            vals, _ = sess.run([ops["scalars"], ops["step"]])
            return {n: float(v) for n, v in vals.items()}
        # ICs and forward (the loss terms are those of the final state), loss cotangent,
        # reverse, then the chain to the field together with the Adam step
        vals = self._forward(sess, ops)
        self._reverse(sess, ops, extra=ops["step"])
        return vals

    def evaluate(self, sess, ops, cosmology=False):
        """The loss terms at the current field (no step), as :meth:`iterate` returns them.

        With ``cosmology`` (adjoint only), also ``d_loss_d_<param>`` for
        :data:`COSMOLOGY_PARAMETERS` at the fixed field: the data term through
        the growth, the time steps and the force (:mod:`flowpm_mtf.gradients.model_gradient`)
        plus the prior's through P(k).
        """
        if self.model_gradient is None:
            return {n: float(v) for n, v in sess.run(ops["scalars"]).items()}
        vals = self._forward(sess, ops)
        if cosmology:
            data = self._reverse(sess, ops)
            prior = sess.run(ops["prior_cosmology"])
            vals.update({"d_loss_d_" + p: g + float(prior[p]) for p, g in data.items()})
        return vals

    def _forward(self, sess, ops):
        return {n: float(v) for n, v in self.model_gradient.forward(
            sess, ops["adjoint"], fetch=ops["scalars"]).items()}

    def _reverse(self, sess, ops, extra=None):
        return self.model_gradient.backward(sess, ops["adjoint"], extra)["cosmology"]
