r"""Gradients of a loss on the final N-body state with respect to the initial field and the cosmology.

The model: a linear field :math:`s` at :math:`a = 1` (given, or coloured from
white noise :math:`w` with the linear power of the cosmology,
:math:`s_{\mathbf k} = A(k; \theta)\, w_{\mathbf k}`,
:func:`flowpm_mtf.physics.ics.linear_field`), LPT initial conditions at
``stages[0]`` (:func:`flowpm_mtf.physics.lpt.lpt_init`), the FastPM N-body to
``stages[-1]``, and a user's loss :math:`L` of the final state. :class:`ModelGradient`
computes :math:`\partial L/\partial s` (or :math:`\partial L/\partial w`) and
:math:`\partial L/\partial \theta` for cosmological parameters :math:`\theta`
(any field of :class:`flowpm_mtf.config.Cosmology`; at least ``Omega_c`` and
``sigma8``) with the memory of one step, by the adjoint of the time loop
(:mod:`flowpm_mtf.gradients.adjoint`).

Where the cosmology enters
--------------------------
:math:`\theta` enters the model through a few numbers and one kernel, and
:math:`\partial L/\partial\theta` is the sum of their cotangents times their
derivatives:

* the time-integration factors :math:`K0_i, D_i, K1_i` of every step
  (:func:`flowpm_mtf.physics.nbody.all_step_factors`): cotangents are the reverse
  step's sums (:data:`flowpm_mtf.gradients.adjoint.SUMS`);
* the force's prefactor :math:`\tfrac32\Omega_m` (:func:`flowpm_mtf.physics.gravity.pm_forces`):
  cotangent :math:`\sum_j \bar f_j\cdot f_j / \Omega_m`, also from the reverse sums;
* the LPT growth coefficients of the displacement and the momentum at
  ``stages[0]`` (:func:`flowpm_mtf.physics.lpt.lpt_coefficients`: :math:`D_1, D_2, f_1, f_2, E`):
  cotangents :math:`\sum \bar x_0\cdot\Psi^{(k)}` and :math:`\sum \bar p_0\cdot\Psi^{(k)}`;
* with white noise, the amplitude :math:`A(k;\theta) = \sqrt{N P(k;\theta)/V}`
  (:func:`flowpm_mtf.physics.ics.linear_amplitude`, Eisenstein & Hu with
  :math:`\sigma_8` normalisation): cotangent field :math:`\bar A(\mathbf k)`
  from ``mtf.gradients``; the term is :math:`\sum_{\mathbf k}\bar A\,\partial A/\partial\theta`.

The derivatives of these background quantities with respect to :math:`\theta`
(scalars, and the radial function :math:`\partial A/\partial\theta (k)`) are
central differences in float64 with a relative step of
:data:`FD_REL_STEP` (measured at 16^3, 3 steps: the reconstruction loss's
:math:`\partial/\partial\Omega_c`, a sum of terms 100x larger than itself,
is off by 9e-3, 9e-5, 9e-7 relative with steps 1e-2, 1e-3, 1e-4 against
differences of the whole loss, and by 4e-8 with 1e-5; the growth ODE's
tolerance, 1e-11, stays below that): every field operation is differentiated exactly, only these few numbers are not. The
cotangents come from the adjoint, so the whole gradient costs one forward
run, one reverse run and one LPT gradient.

Chaining to the initial field
-----------------------------
The adjoint ends with :math:`\bar x_0, \bar p_0` in the slots of the
re-created initial state. With the lagrangian decomposition these are the
lattice slots of :func:`flowpm_mtf.physics.lpt.lpt_displacements`. With the
eulerian one the particles have migrated: :func:`lattice_cotangents` sends
every cotangent back to the block of its particle's lattice site (a
migration with the lattice site, computed from the id, as position; the
same capacities and checks as every migration) and puts it in that site's
slot. Then ``mtf.gradients`` through the LPT displacements, fed with
:math:`\bar\Psi^{(k)} = c_x^{(k)} \bar x_0 + c_p^{(k)} \bar p_0`, gives
:math:`\bar s` (or :math:`\bar w` and :math:`\bar A`).

Use
---
::

    mg = ModelGradient(conf, mesh, loss_fn, noise=w)     # or linear=s
    step = mtf.assign(w, w - mg.field_gradient * lr)     # any use of the gradient
    lowering = mtf.Lowering(graph, {mesh: mesh_impl})
    ops = mg.lower(lowering)
    ...                                                  # session, variables initialised
    out = mg.run(sess, ops, extra=lowering.lowered_operation(step))
    out["loss"], out["cosmology"]["Omega_c"], out["cosmology"]["sigma8"]
"""
import dataclasses
import logging

import mesh_tensorflow as mtf
import numpy as np
import tensorflow.compat.v1 as tf

from . import adjoint
from ..mesh import complex_ops, domain, fft
from ..physics import ics, lpt, nbody, sizing, timeloop
from .. import layout, native
from .. import config as cfg
from ..physics.kernels import make_kernels
from ..logs import rank0_only

__all__ = ["FD_REL_STEP", "DEFAULT_PARAMETERS", "PARAMETERS", "lattice_cotangents",
           "background", "background_derivatives", "power_kernel_derivative", "amplitude_derivative",
           "ModelGradient"]

log = rank0_only(logging.getLogger(__name__))

FD_REL_STEP = 1e-5
"""Relative step of the central differences of the background quantities (module docstring)."""

PARAMETERS = tuple(f.name for f in dataclasses.fields(cfg.Cosmology))
"""Cosmological parameters a gradient can be taken for."""

DEFAULT_PARAMETERS = ("Omega_c", "sigma8")


# ----------------------------------------------------------------------------- lattice order
def _home_fn(conf):
    """Local fn: ids -> the lattice site relative to the current block [cells]."""
    nx, ny, nz = conf.nc
    sx, sy, _ = conf.block_shape
    dtype = conf.tf_dtype

    def fn(ids, cx, cy):
        valid = ids >= 0
        i = tf.where_v2(valid, ids, tf.zeros_like(ids))
        gx, rest = i // (ny * nz), i % (ny * nz)
        gy, gz = rest // nz, rest % nz
        cx = tf.cast(cx, ids.dtype)[:, None, None]
        cy = tf.cast(cy, ids.dtype)[None, :, None]
        hx = tf.math.floormod(gx - cx * sx + nx // 2, nx) - nx // 2   # minimum image
        hy = tf.math.floormod(gy - cy * sy + ny // 2, ny) - ny // 2
        zero = tf.zeros_like(hx)
        comps = [tf.cast(tf.where_v2(valid, h, zero), dtype)[..., None] for h in (hx, hy, gz)]
        lib = native.ops_for("cic_ops", comps[0])
        if lib is not None:  # one pass (tf.stack along the short last axis copies elementwise)
            return lib.flowpm_interleave(comps, picks=[0, 0, 1, 0, 2, 0], wrap=0)
        return tf.concat(comps, axis=-1)
    return fn


def _scatter_fn(conf, n_lattice):
    """Local fn: (home positions, ids, fields...) -> fields in lattice slot order.

    Native ``FlowpmLatticeScatter`` on the CPU (one pass), else
    ``tf.math.unsorted_segment_sum`` (the same sums).
    """
    sx, sy, nz = conf.block_shape

    def fn(x, ids, *fields):
        b1, b2, cap = x.shape[0], x.shape[1], x.shape[2]
        lib = native.ops_for("particle_ops", x, *fields)
        if lib is not None:  # one pass (FlowpmLatticeScatter), the same sums
            outs = lib.flowpm_lattice_scatter(
                tf.reshape(x, [b1 * b2, cap, 3]), tf.reshape(ids, [b1 * b2, cap]),
                [tf.reshape(f, [b1 * b2, cap, 3]) for f in fields], sy=sy, nz=nz,
                lattice=n_lattice)
            outs = [tf.reshape(o, [b1, b2, n_lattice, 3]) for o in outs]
            return tuple(outs) if len(outs) > 1 else outs[0]
        r = tf.cast(tf.round(x), tf.int32)
        slot = (r[..., 0] * sy + r[..., 1]) * nz + r[..., 2]
        block = tf.range(b1)[:, None, None] * b2 + tf.range(b2)[None, :, None]
        seg = tf.where_v2(ids >= 0, slot + block * n_lattice, -tf.ones_like(slot))
        seg = tf.reshape(seg, [-1])
        outs = []
        for f in fields:
            out = tf.math.unsorted_segment_sum(tf.reshape(f, [b1 * b2 * cap, 3]), seg,
                                               b1 * b2 * n_lattice)
            outs.append(tf.reshape(out, [b1, b2, n_lattice, 3]))
        return tuple(outs) if len(outs) > 1 else outs[0]
    return fn


def lattice_cotangents(conf, cotangents, ids, a, name="lattice_cotangents"):
    """Per-particle vectors in any slot order -> the lattice order of the LPT displacements.

    Parameters
    ----------
    conf : SimConfig
    cotangents : sequence of mtf.Tensor
        ``[bx, by, npart, xyz]`` per slot (e.g. ``dL/dx_0, dL/dp_0`` after the
        adjoint's reverse loop), zero on empty slots.
    ids : mtf.Tensor
        ``[bx, by, npart]`` particle ids of the slots (-1: empty).
    a : float
        Scale factor of the state the slots belong to [dimensionless]: its
        LPT displacement bounds how far a particle is from its lattice site
        (the migration rounds, as in :func:`flowpm_mtf.physics.lpt.lpt_init`).
    name : str

    Returns
    -------
    list of mtf.Tensor
        ``[bx, by, npart, xyz]`` with ``npart`` the lattice count ``sx sy nz``:
        entry ``k`` of block ``(i, j)`` belongs to the particle that started at
        that block's ``k``-th lattice site (:func:`flowpm_mtf.mesh.slots.lattice_ids`).
        Lagrangian decomposition: the input (already in that order).

    Raises
    ------
    tf.errors.InvalidArgumentError
        At run time (eulerian), as any migration: a buffer would overflow.
    """
    cotangents = list(cotangents)
    if conf.decomposition == "lagrangian":
        return cotangents
    mesh = ids.mesh
    bx, by, _ = ids.shape.dims
    shape = cotangents[0].shape
    cx = mtf.range(mesh, bx, dtype=tf.int32)
    cy = mtf.range(mesh, by, dtype=tf.int32)
    home = mtf.slicewise(_home_fn(conf), [ids, cx, cy], output_shape=shape,
                         output_dtype=conf.tf_dtype, splittable_dims=[bx, by],
                         grad_function=0, name=name + "_home")
    disp = sizing.lpt_displacement_cells(conf, a)
    x, fields, ids, _ = domain.migrate(conf, home, cotangents, ids,
                                       rounds=sizing.migration_rounds(conf, disp),
                                       send_rows=sizing.send_capacity(conf, disp, lattice=True),
                                       name=name + "_migrate")
    lat = mtf.Shape(list(layout.particle_dims(conf)) + [shape.dims[3]])
    outs = mtf.slicewise(_scatter_fn(conf, lat.dims[2].size), [x, ids] + fields,
                         output_shape=[lat] * len(fields),
                         output_dtype=[conf.tf_dtype] * len(fields), splittable_dims=[bx, by],
                         grad_function=0, name=name + "_scatter")
    return list(outs) if isinstance(outs, (list, tuple)) else [outs]


# ----------------------------------------------------------------------------- background
def _check_params(params):
    params = tuple(params)
    for p in params:
        if p not in PARAMETERS:
            raise ValueError("unknown cosmological parameter %r; the parameters are %s"
                             % (p, ", ".join(PARAMETERS)))
    if len(set(params)) != len(params):
        raise ValueError("cosmological parameters listed twice: %s" % (params,))
    return params


def _with(conf, param, value):
    cosmo = dataclasses.replace(conf.cosmology, **{param: value})
    return dataclasses.replace(conf, cosmology=cosmo, dtype="float64")


def _step(value):
    return FD_REL_STEP * max(abs(value), 1e-2)


def background(conf, stages, lpt_order=None):
    """The background numbers of the model through which the cosmology enters (float64).

    Parameters
    ----------
    conf : SimConfig
    stages : array_like
        The N-body stages [dimensionless]; the LPT is at ``stages[0]``.
    lpt_order : {1, 2}, optional
        Default ``conf.lpt_order``.

    Returns
    -------
    dict of numpy.ndarray
        ``steps`` ``[n_steps, 3]`` (K0, D, K1 per step), ``lpt_x`` and
        ``lpt_p`` (one coefficient per LPT order), ``omega_m`` (shape ``[1]``).
    """
    conf64 = dataclasses.replace(conf, dtype="float64")
    stages = timeloop.check_stages(stages)
    steps = (nbody.all_step_factors(conf64, stages) if stages.size > 1
             else np.zeros((0, 3)))
    coef = lpt.lpt_coefficients(conf64, float(stages[0]), lpt_order)
    return {"steps": np.asarray(steps, np.float64), "lpt_x": np.asarray(coef["x"], np.float64),
            "lpt_p": np.asarray(coef["p"], np.float64),
            "omega_m": np.array([conf.cosmology.Omega_m], np.float64)}


def background_derivatives(conf, stages, params=DEFAULT_PARAMETERS, lpt_order=None):
    """d :func:`background` / d parameter, by central differences in float64.

    Returns
    -------
    dict
        ``param -> {key: derivative}`` with the keys and shapes of :func:`background`.
    """
    out = {}
    for p in _check_params(params):
        v = float(getattr(conf.cosmology, p))
        h = _step(v)
        hi = background(_with(conf, p, v + h), stages, lpt_order)
        lo = background(_with(conf, p, v - h), stages, lpt_order)
        out[p] = {k: (hi[k] - lo[k]) / (2 * h) for k in hi}
    return out


def power_kernel_derivative(conf, mesh, param, transform, name="power_kernel_derivative"):
    r"""Real k-space kernel :math:`\partial g(P(k;\theta), k)/\partial\theta` of a kernel made from P(k).

    Central differences in float64 (relative step :data:`FD_REL_STEP`) of
    ``transform(P, k)`` with :math:`P` the Eisenstein & Hu power of
    ``conf.cosmology`` at :math:`a = 1` (:math:`\sigma_8`-normalised),
    evaluated per processor on its own slice (:func:`flowpm_mtf.physics.ics.radial_kernel`).

    Parameters
    ----------
    conf : SimConfig
    mesh : mtf.Mesh
    param : str
        One of :data:`PARAMETERS`.
    transform : callable
        ``(P [(Mpc/h)^3], k [h/Mpc]) -> kernel values`` (numpy, float64).
    name : str

    Returns
    -------
    mtf.Tensor
        ``[kx, ky, kz]``, dtype ``conf.dtype`` [kernel units / units of ``param``].
    """
    _check_params([param])
    v = float(getattr(conf.cosmology, param))
    h = _step(v)
    pk_hi = ics.power_function(_with(conf, param, v + h))
    pk_lo = ics.power_function(_with(conf, param, v - h))

    def values(k):
        return (transform(pk_hi(k), k) - transform(pk_lo(k), k)) / (2 * h)

    return ics.radial_kernel(conf, mesh, values, name)


def amplitude_derivative(conf, mesh, param, name="amplitude_derivative"):
    r""":math:`\partial A/\partial\theta` of :func:`flowpm_mtf.physics.ics.linear_amplitude`,
    :math:`A = \sqrt{N P / V}` (:func:`power_kernel_derivative`)."""
    factor = conf.n_cells / float(np.prod(conf.box_size))
    return power_kernel_derivative(conf, mesh, param, lambda p, k: np.sqrt(factor * p), name)


# ----------------------------------------------------------------------------- the gradient
class ModelGradient:
    r"""Adjoint gradient of a loss on the final state w.r.t. the initial field and the cosmology.

    Parameters
    ----------
    conf : SimConfig
        Mesh, decomposition, dtype, LPT order and cosmology (the point at
        which the gradient is taken).
    mesh : mtf.Mesh
    loss_fn : callable
        ``loss_fn(state) -> scalar mtf.Tensor``: the loss of the final state
        (an :class:`flowpm_mtf.physics.lpt.State` of positions, momenta, forces and
        ids, block-local positions [cells]; e.g. a function of
        :func:`flowpm_mtf.physics.gravity.density`).
    linear : mtf.Tensor, optional
        The linear field at :math:`a = 1`, real ``[x, y, z]``: the gradient
        is taken w.r.t. it, and the cosmology enters only through the growth,
        the time steps and the force (the field itself is held fixed).
    noise : mtf.Tensor, optional
        Instead of ``linear``: real unit-variance white noise ``[x, y, z]``
        coloured with the linear power of ``conf.cosmology``
        (:func:`flowpm_mtf.physics.ics.linear_field`); the gradient is taken w.r.t.
        the noise, and the cosmology also enters through :math:`P(k)`.
    params : sequence of str
        Cosmological parameters (:data:`PARAMETERS`) to differentiate.
    stages : sequence of float, optional
        N-body stages (default :func:`flowpm_mtf.config.default_stages`); the
        LPT is evaluated at ``stages[0]``.
    power : PowerTable or callable, optional
        With ``noise``: the linear P(k) at a = 1 that colours it (e.g. a table of
        :mod:`flowpm_mtf.physics.linear_power_source`) instead of the Eisenstein & Hu fit
        of ``conf.cosmology``. A table does not move with the cosmology, so the
        gradient is then the field's alone: ``params`` must be empty (refused
        otherwise, rather than a gradient through the growth only that would leave
        out the power's, usually the largest, term).

    Attributes
    ----------
    adjoint : flowpm_mtf.gradients.adjoint.AdjointGraph
    field_gradient : mtf.Tensor
        :math:`\partial L/\partial s` (or :math:`\partial L/\partial w`),
        ``[x, y, z]``: valid in a session run after the reverse loop (use it
        through ``extra`` of :meth:`run`).
    linear_field : mtf.Tensor
        :math:`s` (the input, or the coloured noise).

    Raises
    ------
    ValueError
        At graph construction: neither or both of ``linear`` and ``noise``,
        wrong shapes, an unknown or repeated parameter, ``power`` without
        ``noise`` or with cosmological parameters.
    """

    def __init__(self, conf, mesh, loss_fn, linear=None, noise=None,
                 params=DEFAULT_PARAMETERS, stages=None, power=None):
        if (linear is None) == (noise is None):
            raise ValueError("ModelGradient: give exactly one of linear (a linear field) and "
                             "noise (white noise coloured with P(k))")
        self.conf = conf
        self.params = _check_params(params)
        if power is not None and noise is None:
            raise ValueError("ModelGradient: power colours the noise; with linear= the field "
                             "is given (pass power only with noise=)")
        if power is not None and self.params:
            raise ValueError("ModelGradient: cosmology gradients (params=%s) need the "
                             "Eisenstein & Hu P(k), which moves with the cosmology; a P(k) "
                             "table does not: pass params=() for the field gradient alone"
                             % (",".join(self.params),))
        self.stages = timeloop.check_stages(cfg.default_stages(conf) if stages is None
                                            else [float(a) for a in stages])
        kernels = make_kernels(conf, mesh)
        shape = fft.real_shape(conf)
        self.amplitude = None
        if noise is not None:
            if noise.shape != shape:
                raise ValueError("ModelGradient: noise must have the shape %s, got %s"
                                 % (shape, noise.shape))
            self.amplitude = ics.linear_amplitude(conf, mesh, power=power, name="mg_amplitude")
            modes = complex_ops.apply_kernel(fft.r2c(noise, conf, name="mg_noise_r2c"),
                                             self.amplitude, name="mg_modes")
            s = fft.c2r(modes, conf, name="mg_linear")
            s._flowpm_linear_modes = modes
            source = noise
        else:
            if linear.shape != shape:
                raise ValueError("ModelGradient: the linear field must have the shape %s, got %s"
                                 % (shape, linear.shape))
            s = source = linear
        self.linear_field = s
        a0 = float(self.stages[0])
        init = lpt.lpt_init(s, conf, a=a0, forces=False, kernels=kernels)
        self.adjoint = adjoint.AdjointGraph(conf, mesh, self.stages, initial_state=init,
                                            loss_fn=loss_fn, kernels=kernels)
        # the chain: the re-created initial state's cotangents -> lattice order -> LPT
        xb, pb = lattice_cotangents(conf, self.adjoint.cotangents, self.adjoint.variables.ids,
                                    a0)
        psis = lpt.lpt_displacements(s, conf, kernels=kernels)
        coef = lpt.lpt_coefficients(conf, a0)
        grad_ys = [xb * float(cx) + pb * float(cp)
                   for cx, cp in zip(coef["x"], coef["p"])]
        xs = [source] + ([self.amplitude] if self.amplitude is not None else [])
        grads = mtf.gradients(psis, xs, grad_ys=grad_ys)
        self.field_gradient = (grads[0] if grads[0] is not None
                               else mtf.zeros(mesh, shape, conf.tf_dtype))
        scalars = {}
        for k, psi in enumerate(psis):
            scalars["lpt_x%d" % k] = mtf.reduce_sum(xb * psi, output_shape=mtf.Shape([]))
            scalars["lpt_p%d" % k] = mtf.reduce_sum(pb * psi, output_shape=mtf.Shape([]))
        if self.amplitude is not None and grads[1] is not None:
            for p in self.params:
                dA = amplitude_derivative(conf, mesh, p, name="mg_dA_" + p)
                scalars["amplitude_" + p] = mtf.reduce_sum(grads[1] * dA,
                                                           output_shape=mtf.Shape([]))
        self.chain_scalars = scalars
        self._derivatives = background_derivatives(conf, self.stages, self.params)

    def lower(self, lowering):
        """The lowered ops (call before the first session run).

        Returns
        -------
        dict
            The adjoint's ops (:func:`flowpm_mtf.gradients.adjoint.lower_adjoint`) and
            ``chain``: this process's copies of the chain's scalars.
        """
        ops = adjoint.lower_adjoint(self.adjoint, lowering)
        ops["chain"] = {k: lowering.tensors[v].to_laid_out_tensor().tensor_list[0]
                        for k, v in self.chain_scalars.items()}
        return ops

    def forward(self, sess, ops, fetch=None):
        """Initial conditions and the forward loop; then ``fetch`` (default: the loss).

        Returns
        -------
        The fetched value (``loss``: a float).
        """
        sess.run(ops["init"])
        self.forward_stats = adjoint.run_forward(sess, self.adjoint, ops)
        if fetch is None:
            return float(sess.run(ops["loss_value"]))
        return sess.run(fetch)

    def backward(self, sess, ops, extra=None):
        """After :meth:`forward`: the loss cotangent, the reverse loop, the chain (and ``extra``).

        Returns
        -------
        dict
            ``cosmology`` (``param -> dL/dparam``, float), ``terms``
            (``param -> {source: contribution}``, for diagnostics), ``extra``
            (the fetched values) and ``reverse`` (migration statistics).
        """
        sess.run(ops["loss"])
        stats, sums = adjoint.run_reverse(sess, self.adjoint, ops)
        chain, extra_out = sess.run([ops["chain"], extra if extra is not None else tf.no_op()])
        terms = self.cosmology_terms(sums, chain)
        return {"cosmology": {p: float(sum(t.values())) for p, t in terms.items()},
                "terms": terms, "extra": extra_out if extra is not None else None,
                "reverse": stats}

    def run(self, sess, ops, extra=None):
        """:meth:`forward` then :meth:`backward`.

        Parameters
        ----------
        sess : tf.Session
        ops : dict
            From :meth:`lower`.
        extra : optional
            Fetches run together with the chain (e.g. an update that uses
            :attr:`field_gradient`, or the lowered gradient itself).

        Returns
        -------
        dict
            ``loss`` (float) and :meth:`backward`'s entries.
        """
        loss = self.forward(sess, ops)
        return {"loss": loss, **self.backward(sess, ops, extra)}

    def cosmology_terms(self, sums, chain):
        """Combine the cotangents with the background derivatives (module docstring).

        Parameters
        ----------
        sums : numpy.ndarray
            ``[n_steps + 1, 4]`` (:func:`flowpm_mtf.gradients.adjoint.run_reverse`).
        chain : dict
            The chain's scalars (fetched ``ops["chain"]``).

        Returns
        -------
        dict
            ``param -> {"steps", "force", "lpt", "power"}`` contributions to
            :math:`\\partial L/\\partial\\theta` (float).
        """
        sums = np.asarray(sums, np.float64)
        n = self.stages.size - 1
        # reverse run r = 1..n is step i = n - r: [K1_i, D_i, K0_i] cotangents
        g_steps = np.zeros((n, 3))
        for r in range(1, n + 1):
            i = n - r
            g_steps[i] = [sums[r, 2], sums[r, 1], sums[r, 0]]
        g_force = float(sums[:, 3].sum()) / self.conf.cosmology.Omega_m
        order = len(self._derivatives[self.params[0]]["lpt_x"]) if self.params else 0
        out = {}
        for p in self.params:
            d = self._derivatives[p]
            lpt_term = sum(float(chain["lpt_x%d" % k]) * d["lpt_x"][k]
                           + float(chain["lpt_p%d" % k]) * d["lpt_p"][k] for k in range(order))
            out[p] = {"steps": float(np.sum(g_steps * d["steps"])),
                      "force": g_force * float(d["omega_m"][0]),
                      "lpt": float(lpt_term),
                      "power": float(chain.get("amplitude_" + p, 0.0))}
        return out
