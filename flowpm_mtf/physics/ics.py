r"""Gaussian initial conditions: the linear density field.

The field is built, as in single-device FlowPM (``flowpm.tfpm.linear_field``
of FlowPM 0.1.1), by colouring white noise in Fourier space:

.. math::

    \delta_L = \mathrm{c2r}\Big[\mathrm{r2c}(z)\,
               \sqrt{N\,P(|\mathbf k|)\,D_1^2(a) / V}\Big],
    \qquad \delta_L(\mathbf k = 0) = 0,

with :math:`z` unit white noise (:mod:`flowpm_mtf.mesh.noise`, keyed on
``conf.seed`` and the *global* cell index, so the field is the same on every
process grid), ``r2c``/``c2r`` the FlowPM-normalised transforms of
:mod:`flowpm_mtf.mesh.fft` (``r2c = fftn / N``, ``c2r = N ifftn``),
:math:`N = n_x n_y n_z` the number of cells and :math:`V = L_x L_y L_z` the box
volume [(Mpc/h)^3]. FlowPM draws its noise with standard deviation
:math:`\sqrt N` and multiplies by :math:`\sqrt{P/V}`; this is the same field for
the same deviates :math:`z`.

Normalisation: the Fourier coefficients :math:`\delta_{\mathbf k} =
\mathrm{r2c}(\delta_L)` have :math:`\langle|\delta_{\mathbf k}|^2\rangle =
P(k)/V`, i.e. :func:`flowpm_mtf.physics.power.power_spectrum` (which returns
:math:`V\langle|\delta_{\mathbf k}|^2\rangle`) measures :math:`P(k)`, and the
real-space variance is :math:`\sum_{\mathbf k \ne 0} P(k)/V`.

The mean (``k = 0``) mode is set to zero whatever ``P(0)`` is, so the field has
zero mean up to rounding.

P(k) is evaluated in numpy (float64) on each processor's own k-space slice at
run time (``tf.numpy_function``), so no full-mesh constant is ever embedded in
the graph. The k range the spectrum must cover is checked in Python at graph
construction (on every rank, before any collective is issued).
"""
import logging

import mesh_tensorflow as mtf
import numpy as np
import tensorflow.compat.v1 as tf

from . import cosmology as cosmo_mod
from ..mesh import fft
from .. import layout, native
from . import linear_power
from .linear_power_source import k_range  # noqa: F401 (re-exported: the mesh's k range)
from ..mesh import noise as noise_mod
from ..mesh.radial_filter import gather_radial, radial_scale_tf, radial_tables

__all__ = ["k_range", "power_function", "linear_amplitude", "radial_kernel",
           "apply_radial_kernel", "radial_scale_tf", "linear_modes", "linear_field", "modes_of",
           "noise_of"]

log = logging.getLogger(__name__)

# Points at which a generic P(k) callable is probed at graph-build time.
_N_PROBE = 64


def power_function(conf, power=None, a=1.0):
    r"""The P(k) callable used for ``conf``, validated on the mesh's k range.

    Parameters
    ----------
    conf : SimConfig
    power : callable, PowerTable or None
        ``power(k)``: numpy float64 array of ``k`` [h/Mpc] -> ``P(k)``
        [(Mpc/h)^3] at ``a = 1`` (any object with a ``k_range`` attribute, such
        as :class:`flowpm_mtf.physics.linear_power.PowerTable`, is checked against that
        range); ``None``: Eisenstein & Hu (1998) for ``conf.cosmology``
        (:func:`flowpm_mtf.physics.linear_power.linear_matter_power`).
    a : float or None
        Scale factor [dimensionless]: P is multiplied by :math:`D_1^2(a)`
        (:math:`D_1(1) = 1`); ``None`` or 1 means no growth factor.

    Returns
    -------
    callable
        ``k`` [h/Mpc] (positive, float64) -> ``P(k) D_1^2(a)`` [(Mpc/h)^3], float64.

    Raises
    ------
    ValueError
        If a table does not cover ``k_range(conf)`` (the message names both
        ranges), or if the callable returns values that are not finite and
        non-negative on that range (probed at 64 log-spaced k from ``k_min`` to
        ``k_max``: a callable is the caller's responsibility between the probes),
        or if ``a`` is not positive.
    """
    k_min, k_max = k_range(conf)
    if power is None:
        base = linear_power.linear_matter_power_function(conf.cosmology)  # sigma_8 integral once
        what = "Eisenstein-Hu P(k) of conf.cosmology"
    elif callable(power):
        base = power
        what = "P(k) %s" % type(power).__name__
    else:
        raise ValueError("power must be a callable k [h/Mpc] -> P [(Mpc/h)^3], a PowerTable "
                         "or None, got %r" % (power,))
    table = getattr(power, "k_range", None) if power is not None else None
    if table is not None:
        lo, hi = (float(v) for v in table)
        rtol = getattr(power, "EDGE_RTOL", 0.0)
        if k_min < lo * (1 - rtol) or k_max > hi * (1 + rtol):
            raise ValueError(
                "the P(k) table covers k in [%.6g, %.6g] h/Mpc but the mesh nc=%r in box %r "
                "Mpc/h needs k in [%.6g, %.6g] h/Mpc (fundamental mode 2pi/L_max to the "
                "Nyquist corner sqrt(sum (pi/cell)^2)); extend the table"
                % (lo, hi, conf.nc, conf.box_size, k_min, k_max))
    if a is None or float(a) == 1.0:
        growth2 = 1.0
    else:
        if not (np.isfinite(a) and a > 0):
            raise ValueError("a must be positive and finite, got %r" % (a,))
        growth2 = float(cosmo_mod.D1(conf.cosmology, float(a)))**2

    probe = np.geomspace(k_min, k_max, _N_PROBE)
    p = np.asarray(base(probe), dtype=np.float64)
    if p.shape != probe.shape or not np.all(np.isfinite(p)) or np.any(p < 0):
        raise ValueError("%s must return finite, non-negative values of the shape of k on "
                         "k in [%.6g, %.6g] h/Mpc; got %s" % (what, k_min, k_max, p))
    log.debug("%s on k in [%.4g, %.4g] h/Mpc, D1^2(a=%s) = %.6g", what, k_min, k_max, a,
              growth2)

    def pk(k):
        return growth2 * np.asarray(base(k), dtype=np.float64)
    return pk


def radial_kernel(conf, mesh, values, name):
    """Real k-space kernel ``values(|k|)`` [whatever ``values`` gives], 0 at ``k = 0``.

    Each processor evaluates ``values`` (numpy in, numpy out, ``|k|`` [h/Mpc] > 0,
    float64) once per distinct ``|k|`` of its slice, at run time
    (``tf.numpy_function``: no k-space constant in the graph), and expands the
    result to the slice with TensorFlow gathers (multi-threaded), smallest first:
    along z (1/4 of the cells), y (1/2), then x, which copies whole (y, z) planes.
    To multiply a field by such a kernel, :func:`apply_radial_kernel` does it
    without the full-size kernel.

    Returns
    -------
    mtf.Tensor
        ``[kx, ky, kz]``, dtype ``conf.dtype``.
    """
    kvecs = layout.kvec_tensors(conf, mesh, tf.float64, name)
    shape = fft.k_shape(conf)

    def fn(kx, ky, kz):
        return gather_radial(*radial_tables(conf, values, name, kx, ky, kz))

    return mtf.slicewise(fn, kvecs, output_shape=shape, output_dtype=conf.tf_dtype,
                         splittable_dims=shape.dims, grad_function=0, name=name)


def apply_radial_kernel(kfield, conf, values, name):
    """``kfield * values(|k|)`` (0 at ``k = 0``) without a full-size kernel.

    The product of :func:`flowpm_mtf.mesh.complex_ops.apply_kernel` with
    :func:`radial_kernel` bit for bit, in one pass over the field: the native
    ``FlowpmRadialScale`` (kspace_ops.cc) reads the table of distinct ``|k|``
    through the three index vectors and writes in the field's memory when nothing
    else holds it (it replaces full-size gathers, a cast and a product, and their new
    memory, in the ICs); :func:`radial_scale_tf` where
    no native op serves. Its gradient with respect to the field is itself; the
    kernel is a constant (as :func:`radial_kernel`'s).

    Parameters
    ----------
    kfield : mtf.Tensor
        Complex ``[kx, ky, kz]`` of ``conf``'s complex dtype.
    conf : SimConfig
    values : callable
        float64 ``|k|`` [h/Mpc] (positive) -> float64 kernel values (numpy).
    name : str

    Returns
    -------
    mtf.Tensor
        Complex, shape and dtype of ``kfield``.
    """
    shape = fft.k_shape(conf)
    if kfield.shape != shape:
        raise ValueError("apply_radial_kernel: the field must be %s, got %s"
                         % (shape, kfield.shape))
    kvecs = layout.kvec_tensors(conf, kfield.mesh, tf.float64, name)

    def fn(f, kx, ky, kz):
        lib = native.ops_for("kspace_ops", f, dtypes=None)
        if lib is None or f.dtype.real_dtype != conf.tf_dtype:   # a field of another dtype
            return radial_scale_tf(f, *radial_tables(conf, values, name, kx, ky, kz))
        return lib.flowpm_radial_scale(f, *radial_tables(conf, values, name, kx, ky, kz,
                                                          summed=True))

    def gradient(op, dy):
        return [apply_radial_kernel(dy, conf, values, name + "_grad"), None, None, None]

    return mtf.slicewise(fn, [kfield] + kvecs, output_shape=shape, output_dtype=kfield.dtype,
                         splittable_dims=shape.dims, grad_function=gradient, name=name)


def linear_amplitude(conf, mesh, power=None, a=1.0, name="linear_amplitude"):
    r"""Real k-space kernel :math:`\sqrt{N P(|k|) D_1^2(a) / V}`, zero at ``k = 0``.

    Parameters
    ----------
    conf : SimConfig
    mesh : mtf.Mesh
    power, a :
        See :func:`power_function`.
    name : str, optional

    Returns
    -------
    mtf.Tensor
        Real (``conf.dtype``), shape ``[kx, ky, kz]`` [(Mpc/h)^{3/2} / (Mpc/h)^{3/2}:
        dimensionless, since ``N/V`` is the inverse cell volume]. Each processor
        evaluates ``P`` on its own slice only.
    """
    return radial_kernel(conf, mesh, _amplitude_values(conf, power, a), name)


def _amplitude_values(conf, power, a):
    """``|k| -> sqrt(N P(|k|) D_1^2(a) / V)`` (numpy) of :func:`linear_amplitude`."""
    pk = power_function(conf, power, a)
    factor = conf.n_cells / float(np.prod(conf.box_size))
    return lambda k: np.sqrt(factor * pk(k))


def linear_modes(conf, mesh, power=None, a=1.0, noise=None, name="linear_modes"):
    r"""Fourier modes of the linear field, ``r2c(z) * sqrt(N P D_1^2 / V)``.

    Parameters
    ----------
    conf : SimConfig
    mesh : mtf.Mesh
    power, a :
        See :func:`power_function`.
    noise : mtf.Tensor, optional
        Real unit-variance white noise on ``[x, y, z]`` to colour instead of the
        seeded noise (e.g. a variable, for field-level inference); gradients flow
        to it. Default: :func:`flowpm_mtf.mesh.noise.white_noise` with ``conf.seed``.
    name : str, optional

    Returns
    -------
    mtf.Tensor
        Complex (``conf``'s complex dtype) on ``[kx, ky, kz]``, FlowPM
        normalisation (``r2c = fftn / N``): :math:`\langle|\delta_k|^2\rangle = P/V`
        [dimensionless]; the ``k = 0`` mode is 0.
    """
    noise = _noise(conf, mesh, noise, name)
    return _coloured(noise, conf, _amplitude_values(conf, power, a), name)


def _noise(conf, mesh, noise, name):
    """``noise``, checked, or the seeded white noise when it is None."""
    if noise is None:
        return noise_mod.white_noise(mesh, fft.real_shape(conf), conf.seed, conf.tf_dtype,
                                     name=name + "_white_noise")
    if noise.shape != fft.real_shape(conf):
        raise ValueError("noise must have the shape %s, got %s" % (fft.real_shape(conf),
                                                                    noise.shape))
    return noise


def _coloured(noise, conf, amplitude, name):
    """``r2c(noise)`` times the radial ``amplitude`` (apply_kernel with linear_amplitude,
    without the full-size kernel)."""
    return apply_radial_kernel(fft.r2c(noise, conf, name=name + "_r2c"), conf, amplitude,
                               name=name)


def linear_field(conf, mesh, power=None, a=1.0, noise=None, name="linear_field"):
    r"""Gaussian linear density contrast :math:`\delta_L(\mathbf x)` in real space.

    Parameters
    ----------
    conf : SimConfig
        Mesh, box, dtype, ``seed`` and ``cosmology`` are used.
    mesh : mtf.Mesh
    power : callable, PowerTable or None, optional
        Linear power spectrum at ``a = 1``: ``k`` [h/Mpc] -> ``P`` [(Mpc/h)^3]
        (numpy in, numpy out), a :class:`flowpm_mtf.physics.linear_power.PowerTable`
        (checked to cover the mesh's k range, see :func:`k_range`), or ``None``
        for Eisenstein & Hu (1998) with ``conf.cosmology``.
    a : float or None, optional
        Scale factor [dimensionless]; the field is multiplied by :math:`D_1(a)`
        (default 1: the linear field today, as FlowPM's ``lpt_init`` expects).
    noise : mtf.Tensor, optional
        White noise to use instead of the seeded noise (see :func:`linear_modes`).
    name : str, optional

    Returns
    -------
    mtf.Tensor
        Real (``conf.dtype``) on ``[x, y, z]`` [dimensionless density contrast],
        zero mean, the same for a given seed on every process grid and in a
        single process; equal to ``flowpm.linear_field`` (FlowPM 0.1.1) fed with
        the same white noise.

    Raises
    ------
    ValueError
        At graph construction, on every rank, if a P(k) table does not cover
        the k range of the mesh (message gives both ranges) or a callable
        returns invalid values there.
    """
    noise = _noise(conf, mesh, noise, name + "_modes")
    amplitude = _amplitude_values(conf, power, a)
    kfield = _coloured(noise, conf, amplitude, name + "_modes")
    field = fft.c2r(kfield, conf, name=name)
    # LPT needs r2c(field) == kfield: let it skip that FFT (and this c2r, if the
    # field itself is not used), see modes_of; or filter the noise itself, see noise_of.
    field._flowpm_linear_modes = kfield
    field._flowpm_linear_noise = (noise, amplitude)
    return field


def modes_of(field):
    """The Fourier modes a :func:`linear_field` output was transformed from, or None.

    :func:`flowpm_mtf.physics.lpt.lpt_displacements` uses them instead of transforming
    the field back (``r2c(c2r(modes)) == modes`` for the Hermitian modes of a
    real field, up to rounding): one forward and, when nothing else uses the
    real field, one inverse FFT fewer per run. Gradients with respect to the
    noise, the power spectrum, or anything upstream are unchanged; the real
    field tensor itself is then no longer on the LPT's path (a gradient taken
    with respect to *it* would not see the LPT).

    Parameters
    ----------
    field : mtf.Tensor

    Returns
    -------
    mtf.Tensor or None
        Complex ``[kx, ky, kz]`` modes of :func:`linear_modes`.
    """
    return getattr(field, "_flowpm_linear_modes", None)


def noise_of(field):
    """The white noise and the amplitude a :func:`linear_field` output was coloured with,
    or None.

    :func:`flowpm_mtf.physics.lpt.lpt_init` filters the noise by ``amplitude(|k|) / k^2`` in one
    radial filter (:func:`flowpm_mtf.mesh.radial_filter.radial_filter`) for the first-order
    potential, instead of transforming the modes of :func:`modes_of`: the full spectrum
    of the linear field is then never made. Gradients flow to the noise as through the
    modes.

    Parameters
    ----------
    field : mtf.Tensor

    Returns
    -------
    (mtf.Tensor, callable) or None
        The real ``[x, y, z]`` noise and the float64 ``|k|`` [h/Mpc] -> ``sqrt(N P(|k|)
        D_1^2(a) / V)`` function (numpy) of :func:`linear_amplitude`.
    """
    return getattr(field, "_flowpm_linear_noise", None)
