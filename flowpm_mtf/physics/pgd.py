r"""PGD: a sub-grid correction of the PM's small scales (potential gradient descent).

Dai, Feng & Seljak (2018, arXiv:1804.00671): a PM simulation whose force lives on the
particle grid (B = 1) lacks small-scale power, because the force is smoothed by the
mesh. PGD moves every particle once, after the N-body, along the gradient of a
band-passed potential of the particles' own density,

.. math:: \Delta\mathbf x = \alpha(a)\,\nabla\,\mathcal F^{-1}\big[O_l(k)\,O_h(k)\,
          \delta_k / k^2\big],\qquad O_l = e^{-(k_l/k)^2},\quad O_h = e^{-(k/k_s)^4},
          \qquad \alpha(a) = \alpha_0\,a^{\mu},

toward the overdensities (the same sign as the PM force): the high-pass :math:`O_l`
leaves the large scales, which the PM gets right, alone; the low-pass :math:`O_h` stops
the correction below the mesh's resolution. :math:`k_l` and :math:`k_s` are given in
units of the mesh's Nyquist frequency :math:`k_N = \pi / c` (the paper scales them with
the resolution), :math:`\alpha` is dimensionless with positions in cells (as JaxPM's
``pgd_correction``: the density is particles per cell, the potential and its gradient
in cell units).

The displacement is not fed back into the dynamics (as in the paper): the lensing job
paints its planes from ``x + dx`` (:mod:`flowpm_mtf.jobs.lensing`), the time loop goes on
from ``x``.

Built from the force's own pieces: the CIC density (:func:`flowpm_mtf.physics.gravity.density`),
the radial filter on the distributed FFT (:func:`flowpm_mtf.mesh.radial_filter.radial_filter`,
here with the PGD kernel instead of :math:`1/k^2`), the four-point gradient
(:func:`flowpm_mtf.physics.gravity.force_field_of_potential`) and the CIC readout
(:func:`flowpm_mtf.physics.painting.readout_padded`). Plain mtf operations, each with its
gradient: the displacement is differentiable with respect to the positions (the paint and the
readout) and to :math:`\alpha` (linear).

The settings (:class:`PGDConfig`, :data:`FITS`) are numpy: Mesh TF, TensorFlow and the
force's pieces are imported inside the functions that need them, so the command line reads
and checks the settings without importing TensorFlow.
"""
import dataclasses
import typing

import numpy as np

__all__ = ["PGDConfig", "FITS", "fitted_alpha", "is_fitted", "pgd_kernel_values",
           "pgd_displacement", "nyquist", "check_blocks", "clip_to_blocks", "CLIP_MARGIN"]

CLIP_MARGIN = 1e-3
"""How far inside the last paintable position :func:`clip_to_blocks` holds a particle [cells]
(far above float32's resolution at block sizes of a few hundred cells)."""


FIT_KL, FIT_KS = 0.5, 2.0
"""k_l and k_s [units of the Nyquist frequency] of the fits in :data:`FITS`."""

FITS = ((1.0, 0.0912, -1.230, "results/fit_pgd_1mpc.md"),
        (2.0, 0.1862, -1.115, "results/fit_pgd_2mpc.md"),
        (4.0, 0.5534, -0.925, "results/fit_pgd_default.md"))
"""alpha(a) = alpha0 a^mu fitted against halofit by ``scripts/fit_pgd.py`` at the lensing
job's default stages, k_l = 0.5 and k_s = 2 Nyquist: ``(cell size [Mpc/h], alpha0, mu,
results file)``, cell sizes increasing. The stronger the PM's deficit at the Nyquist
scale (the smaller the cells, the more nonlinear that scale), the more the displacement
must move, and the larger cells need a larger alpha."""


def fitted_alpha(cell):
    """``(alpha0, mu)`` for cells of ``cell`` Mpc/h: between the fits of :data:`FITS`,
    log alpha0 and mu linear in log cell size.

    Raises
    ------
    ValueError
        One line, for a cell size outside the fitted range (give alpha0 and mu).
    """
    cells = np.array([f[0] for f in FITS])
    cell = float(cell)
    if not cells[0] * (1 - 1e-9) <= cell <= cells[-1] * (1 + 1e-9):
        raise ValueError("PGD's alpha is fitted for cells of %g-%g Mpc/h, this run's are %.3g "
                         "Mpc/h: give --pgd-alpha0 and --pgd-mu (scripts/fit_pgd.py fits "
                         "them)" % (cells[0], cells[-1], cell))
    x = np.log(np.clip(cell, cells[0], cells[-1]))
    alpha0 = float(np.exp(np.interp(x, np.log(cells), np.log([f[1] for f in FITS]))))
    mu = float(np.interp(x, np.log(cells), [f[2] for f in FITS]))
    return alpha0, mu


def is_fitted(pconf, conf):
    """Whether ``pconf`` is PGD with the fitted alpha for ``conf``'s cells (:data:`FITS`,
    the fits' k_l and k_s): then the particles' P(k) follows halofit up to 0.75 of the
    Nyquist frequency, as fitted."""
    if not pconf.pgd or (pconf.pgd_kl, pconf.pgd_ks) != (FIT_KL, FIT_KS):
        return False
    try:
        alpha0, mu = fitted_alpha(max(conf.cell_size))
    except ValueError:
        return False
    return (pconf.pgd_alpha0 is None or np.isclose(pconf.pgd_alpha0, alpha0, rtol=1e-9)) and \
        (pconf.pgd_mu is None or np.isclose(pconf.pgd_mu, mu, rtol=1e-9))


@dataclasses.dataclass(frozen=True)
class PGDConfig:
    """The PGD correction of a run (automatic by default: on where alpha is fitted).

    Parameters
    ----------
    pgd : bool or None
        Apply the correction to the particles the lens planes are painted from. None (the
        default): on where alpha is fitted for the run's cells (:data:`FITS`) and its blocks
        hold the gradient stencil (:func:`check_blocks`), off elsewhere; any other PGD
        setting given turns it on (:meth:`resolve`).
    pgd_alpha0 : float or None
        alpha0 of alpha(a) = alpha0 a^mu, the displacement per unit potential gradient
        [dimensionless, positions in cells], >= 0. None: the fit for the run's cell size
        (:data:`FITS`, :meth:`resolve`).
    pgd_mu : float or None
        mu of alpha(a) [dimensionless]. None: the fit for the run's cell size.
    pgd_kl : float
        High-pass scale k_l [units of the PM mesh's Nyquist frequency pi/cell], > 0.
    pgd_ks : float
        Low-pass scale k_s [units of the PM mesh's Nyquist frequency pi/cell], > 0.

    Raises
    ------
    ValueError
        For values out of range or not finite (the message names the value).
    """

    pgd: typing.Optional[bool] = None
    pgd_alpha0: typing.Optional[float] = None
    pgd_mu: typing.Optional[float] = None
    pgd_kl: float = FIT_KL
    pgd_ks: float = FIT_KS

    def __post_init__(self):
        if self.pgd is not None:
            object.__setattr__(self, "pgd", bool(self.pgd))
        for name, positive in (("pgd_alpha0", False), ("pgd_mu", None), ("pgd_kl", True),
                               ("pgd_ks", True)):
            v = getattr(self, name)
            if v is None and name in ("pgd_alpha0", "pgd_mu"):
                continue
            if isinstance(v, bool) or not np.isfinite(float(v)):
                raise ValueError("PGDConfig: %s must be a finite number, got %r" % (name, v))
            v = float(v)
            if positive is True and v <= 0:
                raise ValueError("PGDConfig: %s must be positive, got %r" % (name, v))
            if positive is False and v < 0:
                raise ValueError("PGDConfig: %s must not be negative, got %r" % (name, v))
            object.__setattr__(self, name, v)

    def alpha(self, a):
        """:math:`\\alpha(a) = \\alpha_0 a^\\mu` at scale factor ``a`` [dimensionless]
        (of a resolved configuration: :meth:`resolve`)."""
        if self.pgd_alpha0 is None or self.pgd_mu is None:
            raise ValueError("PGDConfig.alpha: alpha0 and mu are chosen by the cell size: "
                             "call resolve(conf) first")
        return self.pgd_alpha0 * float(a)**self.pgd_mu

    def resolve(self, conf):
        """This configuration for ``conf``: ``pgd`` decided where it is None (automatic),
        ``pgd_alpha0`` and ``pgd_mu`` given where they are None (the fit for the cell size,
        :func:`fitted_alpha`). Unchanged when PGD is off or everything is given.

        Automatic: on when a PGD setting is given (alpha0, mu, k_l or k_s other than the
        fits'), else on where :func:`fitted_alpha` and :func:`check_blocks` accept ``conf``.

        Raises
        ------
        ValueError
            One line (PGD on): the cell size outside the fitted range, or k_l, k_s other
            than the fits' with alpha0 or mu left to them.
        """
        if self.pgd is None:
            if self.given():
                on = True
            else:
                try:
                    fitted_alpha(max(conf.cell_size))
                    check_blocks(conf)
                    on = True
                except ValueError:
                    on = False
            return dataclasses.replace(self, pgd=on).resolve(conf)
        if not self.pgd or (self.pgd_alpha0 is not None and self.pgd_mu is not None):
            return self
        if (self.pgd_kl, self.pgd_ks) != (FIT_KL, FIT_KS):
            raise ValueError("PGD's fitted alpha is for --pgd-kl %g --pgd-ks %g: with "
                             "--pgd-kl %g --pgd-ks %g give --pgd-alpha0 and --pgd-mu "
                             "(scripts/fit_pgd.py fits them)"
                             % (FIT_KL, FIT_KS, self.pgd_kl, self.pgd_ks))
        alpha0, mu = fitted_alpha(max(conf.cell_size))
        return dataclasses.replace(
            self, pgd_alpha0=alpha0 if self.pgd_alpha0 is None else self.pgd_alpha0,
            pgd_mu=mu if self.pgd_mu is None else self.pgd_mu)

    def given(self):
        """Whether a PGD setting other than the default is given (alpha0, mu, k_l, k_s)."""
        return (self.pgd_alpha0 is not None or self.pgd_mu is not None
                or (self.pgd_kl, self.pgd_ks) != (FIT_KL, FIT_KS))

    def to_dict(self):
        return dataclasses.asdict(self)


def nyquist(conf):
    """The PM mesh's Nyquist frequency :math:`\\pi / c` [h/Mpc] (the coarsest axis's)."""
    return float(np.pi / max(conf.cell_size))


def pgd_kernel_values(k, conf, pconf):
    r"""The PGD potential's kernel :math:`O_l(k)\,O_h(k)/k^2` [(Mpc/h)^2] (numpy, float64).

    Parameters
    ----------
    k : array_like
        :math:`|\mathbf k|` [h/Mpc], positive.
    conf : SimConfig
    pconf : PGDConfig

    Returns
    -------
    ndarray
        :math:`e^{-(k_l/k)^2} e^{-(k/k_s)^4} / k^2` with :math:`k_{l,s}` = ``pgd_kl``,
        ``pgd_ks`` times :func:`nyquist`.
    """
    k = np.asarray(k, np.float64)
    kn = nyquist(conf)
    kl, ks = pconf.pgd_kl * kn, pconf.pgd_ks * kn
    return np.exp(-(kl / k)**2 - (k / ks)**4) / (k * k)


def check_blocks(conf):
    """Raise ``ValueError`` (one line) if the blocks are too narrow for the gradient stencil
    of :func:`pgd_displacement` (on several blocks: ``halo_size + 2`` cells narrower than a
    block along x and y)."""
    from .gravity import GRADIENT_REACH, single_block

    if single_block(conf):
        return
    if conf.halo_size + GRADIENT_REACH >= min(conf.block_shape[:2]):
        raise ValueError("PGD needs blocks wider than the halo plus %d cells: halo %d, blocks "
                         "%s (fewer processes or a smaller --halo)"
                         % (GRADIENT_REACH, conf.halo_size, "x".join(map(str,
                                                                        conf.block_shape[:2]))))


def pgd_displacement(positions, conf, pconf, alpha, weight=None, escape_checked=False,
                     name="pgd"):
    r"""The PGD displacement of every particle [cells].

    Parameters
    ----------
    positions : mtf.Tensor
        Block-local positions ``[bx, by, npart, xyz]`` [cells].
    conf : SimConfig
    pconf : PGDConfig
        Its kernel scales (``pgd_kl``, ``pgd_ks``); ``pgd`` and ``alpha0``/``mu`` are not read.
    alpha : float or mtf.Tensor
        :math:`\alpha` at the particles' scale factor (e.g. ``pconf.alpha(a)``, or a fed
        scalar) [dimensionless].
    weight : mtf.Tensor, optional
        ``[bx, by, npart]`` slot weights: the painting's masses, and the displacement is
        multiplied by them (zero on empty slots).
    escape_checked : bool, optional
        The particles were checked to fit their padded blocks (no second check).
    name : str

    Returns
    -------
    mtf.Tensor
        :math:`\alpha\,\nabla\mathcal F^{-1}[O_l O_h\,\delta_k/k^2]` at the particles,
        ``[bx, by, npart, xyz]`` [cells].

    Raises
    ------
    ValueError
        If the blocks are too narrow for the gradient (:func:`check_blocks`).
    """
    from ..mesh import radial_filter
    from .gravity import density, force_field_of_potential
    from .painting import readout_padded

    check_blocks(conf)
    rho = density(positions, conf, weight, escape_checked=escape_checked)
    pot = radial_filter.radial_filter(rho, conf, lambda k: pgd_kernel_values(k, conf, pconf),
                                      name=name + "_potential")
    field = force_field_of_potential(pot, conf, name=name + "_field")
    dx = readout_padded(field, positions, conf, name=name + "_readout",
                        escape_checked=escape_checked)
    dx = dx * alpha
    return dx if weight is None else dx * weight


def clip_to_blocks(positions, conf, name="pgd_clip"):
    r"""Block-local positions held inside the range their padded block can paint.

    The PGD displacement can push a particle that already sits near the edge of its
    block's halo beyond it (a few particles in 10^5 at large :math:`\alpha`); the CIC
    painting on the padded blocks would then stop the run. Here the x and y positions are
    clipped to :math:`[-h, s + h - 1 - \epsilon]` (``h`` the halo, ``s`` the block side,
    :math:`\epsilon` = :data:`CLIP_MARGIN`): those particles are painted at the halo's edge
    instead, every other particle is unchanged. For what is painted on the PM mesh (the lens
    planes' mesh copies, the P(k)); the rays' planes
    (:func:`flowpm_mtf.physics.lensing.ray_born_terms`) take the unclipped positions,
    whatever the blocks. The gradient is 1 inside, 0 where
    clipped.

    Parameters
    ----------
    positions : mtf.Tensor
        ``[bx, by, npart, xyz]`` [cells].
    conf : SimConfig

    Returns
    -------
    mtf.Tensor
        Same shape [cells].
    """
    import mesh_tensorflow as mtf
    import tensorflow.compat.v1 as tf

    h = conf.halo_size
    sx, sy, _ = conf.block_shape
    dt = conf.np_dtype
    lo = np.array([-h, -h, -np.inf], dt)
    hi = np.array([sx + h - 1 - CLIP_MARGIN, sy + h - 1 - CLIP_MARGIN, np.inf], dt)

    def fn(x):
        return tf.clip_by_value(x, tf.constant(lo), tf.constant(hi))

    return mtf.slicewise(fn, [positions], output_shape=positions.shape,
                         output_dtype=positions.dtype,
                         splittable_dims=positions.shape.dims[:-1], name=name)
