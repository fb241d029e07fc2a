r"""FastPM kick-drift-kick N-body integration, and the full forward model.

Time stepping (Feng et al. 2016; as ``flowpm.tfpm.nbody`` in FlowPM 0.1.1)
-------------------------------------------------------------------------
The loop over stages is :func:`flowpm_mtf.physics.timeloop.integrate` (the one time
loop of the package); this module supplies its step, :func:`kdk_step`. For stages :math:`a_0 < a_1 < \dots < a_n`: the force is first recomputed at
:math:`a_0` (replacing the LPT force); then for each step
:math:`a_i \to a_{i+1}`, with :math:`a_h = \sqrt{a_i a_{i+1}}`,

1. kick :math:`p \mathrel{+}= K(a_i, a_i, a_h)\, F`,
2. drift :math:`x \mathrel{+}= \Delta(a_i, a_h, a_{i+1})\, p`,
3. force :math:`F = F(x)` at :math:`a_{i+1}` (:func:`flowpm_mtf.physics.gravity.pm_forces`),
4. kick :math:`p \mathrel{+}= K(a_h, a_{i+1}, a_{i+1})\, F`,

with the growth-function factors :func:`flowpm_mtf.physics.cosmology.kick_factor`
:math:`K(a_i, a_c, a_f) = (G_f(a_f) - G_f(a_i)) / (a_c^2 E(a_c) g_f(a_c))` and
:func:`flowpm_mtf.physics.cosmology.drift_factor`
:math:`\Delta(a_i, a_c, a_f) = (D_1(a_f) - D_1(a_i)) / (a_c^3 E(a_c) D_1'(a_c))`,
evaluated in float64 at graph-construction time. After each step positions and
momenta are synchronised at :math:`a_{i+1}` (a snapshot may be taken there).

Units and state: see :class:`flowpm_mtf.physics.lpt.State`.
"""
import logging

import numpy as np

from . import cosmology as cosmo_mod
from ..mesh import domain, slots
from . import sizing
from . import timeloop
from ..config import default_stages  # defined with the configuration; part of the N-body API
from .gravity import density, pm_forces
from .kernels import make_kernels
from .lpt import State, lpt_init

__all__ = ["default_stages", "nbody", "kdk_step", "step_factors", "all_step_factors", "forward"]

log = logging.getLogger(__name__)


def nbody(state, conf, stages=None, snapshot_a=None):
    """Integrate the particle state through the stages (FastPM kick-drift-kick).

    Parameters
    ----------
    state : State
        Initial state at ``stages[0]`` (e.g. from :func:`flowpm_mtf.physics.lpt.lpt_init`);
        each entry ``[bx, by, npart, xyz]`` [cells].
    conf : SimConfig
    stages : array_like, optional
        Increasing scale factors [dimensionless]; default
        :func:`flowpm_mtf.config.default_stages` (``conf.a_start`` .. ``conf.a_end``).
    snapshot_a : array_like, optional
        Scale factors at which to return the state; each must equal one of the
        stages (relative tolerance 1e-10).

    Returns
    -------
    State
        The state at ``stages[-1]`` (forces evaluated there), if
        ``snapshot_a`` is None;
    (State, list of State)
        otherwise: the final state and one state per entry of ``snapshot_a``.

    Raises
    ------
    ValueError
        At graph construction, for invalid stages or snapshot scale factors.
    tf.errors.InvalidArgumentError
        At run time, if a particle escaped its block's halo.
    """
    stages = timeloop.check_stages(default_stages(conf) if stages is None else stages)
    keep = timeloop.StateSnapshots(
        timeloop.stage_indices(snapshot_a, stages) if snapshot_a is not None else [])
    kernels = make_kernels(conf, state.positions.mesh)
    rows = sizing.send_capacity(conf, stages=stages)   # the migration's, from these stages
    log.info("nbody: %d steps from a=%g to a=%g", stages.size - 1, stages[0], stages[-1])
    final = timeloop.integrate(
        timeloop.initial_state(state, conf, kernels), stages,
        lambda s, i, a0, a1: kdk_step(s, conf, a0, a1, kernels, send_rows=rows), [keep])
    if snapshot_a is None:
        return final
    return final, keep.states


def step_factors(conf, a0, a1):
    """The three time-integration factors of a kick-drift-kick step ``a0 -> a1``.

    Parameters
    ----------
    conf : SimConfig
    a0, a1 : float
        Scale factors of the step [dimensionless], ``a0 < a1``.

    Returns
    -------
    numpy.ndarray
        ``[K(a0, a0, ah), Delta(a0, ah, a1), K(ah, a1, a1)]`` with
        ``ah = sqrt(a0 a1)``, dtype ``conf.dtype`` (first kick [1/H0 units of
        dp/dF], drift [dx/dp], second kick).
    """
    return all_step_factors(conf, [a0, a1])[0]


def all_step_factors(conf, stages):
    """:func:`step_factors` of every step ``stages[i] -> stages[i + 1]``, vectorised.

    One solution of the growth ODEs serves all steps (a per-step call cost ~27 ms,
    over 45 minutes for 100000 steps).

    Parameters
    ----------
    conf : SimConfig
    stages : array_like
        Increasing scale factors [dimensionless], at least two.

    Returns
    -------
    numpy.ndarray
        ``[n_steps, 3]`` (kick, drift, kick) per step, dtype ``conf.dtype``.
    """
    st = np.asarray(stages, dtype=np.float64).reshape(-1)
    a0, a1 = st[:-1], st[1:]
    ah = np.sqrt(a0 * a1)
    g = cosmo_mod.growth(conf.cosmology, np.concatenate([a0, ah, a1]))
    n = a0.size
    part = lambda arr, i: arr[i * n:(i + 1) * n]  # noqa: E731 (a0, ah, a1 thirds)
    Gf, gf, D1, E, gp = g.Gf, g.gf, g.D1, g.E, g.gp
    kick0 = (part(Gf, 1) - part(Gf, 0)) / (a0**2 * part(E, 0) * part(gf, 0))
    drift = (part(D1, 2) - part(D1, 0)) / (ah**3 * part(E, 1) * part(gp, 1))
    kick1 = (part(Gf, 2) - part(Gf, 1)) / (a1**2 * part(E, 2) * part(gf, 2))
    return np.stack([kick0, drift, kick1], axis=1).astype(conf.np_dtype)


def kdk_step(state, conf, a0=None, a1=None, kernels=None, factors=None, send_rows=None):
    """One FastPM kick-drift-kick step from ``a0`` to ``a1``.

    Parameters
    ----------
    state : State
        Positions, momenta and the forces **at** ``a0`` [cells].
    conf : SimConfig
    a0, a1 : float
        Scale factors of the step [dimensionless], ``a0 < a1``.
    kernels : optional
        From :func:`make_kernels` (built once per graph if given).
    factors : sequence of 3 scalars, optional
        Instead of ``a0, a1``: the factors of :func:`step_factors`, as floats or
        as scalar (shape ``[]``) mtf tensors. With tensors (e.g. imported
        placeholders) one lowered step serves every step of a run, fed with
        each step's factors (see :class:`flowpm_mtf.jobs.nbody_run.SimulationGraph`).
    send_rows : int, optional
        Rows of the migration's send buffers [particles] (eulerian), sized by the
        caller for its run: :func:`flowpm_mtf.physics.sizing.send_capacity` of the run's
        stages; default: of :func:`flowpm_mtf.config.default_stages`.

    Returns
    -------
    State
        At ``a1``, with the forces evaluated at the new positions (one PM force
        evaluation per step). Eulerian decomposition: the particles are
        migrated after the drift (:func:`flowpm_mtf.mesh.domain.migrate`), before
        the force; ``stats`` holds the migration's statistics.

    Raises
    ------
    tf.errors.InvalidArgumentError
        At run time (eulerian): a particle moved more than one block in the
        step, or a particle buffer would overflow (see
        :func:`flowpm_mtf.mesh.domain.error_from_tf`).
    """
    if factors is None:
        if a0 is None or a1 is None:
            raise ValueError("kdk_step needs a0 and a1, or factors")
        factors = [v.item() for v in step_factors(conf, a0, a1)]
    elif len(factors) != 3:
        raise ValueError("kdk_step: factors must be (kick, drift, kick), got %d values"
                         % len(factors))
    if kernels is None:
        kernels = make_kernels(conf, state.positions.mesh)
    kick0, drift, kick1 = factors
    x, p, f, ids = state.positions, state.momenta, state.forces, state.ids
    p = p + f * kick0
    dx = p * drift
    x = x + dx
    stats = None
    if conf.decomposition == "eulerian":
        if ids is None:
            raise ValueError("kdk_step: the eulerian decomposition needs particle ids "
                             "(see lpt.lpt_init)")
        if send_rows is None:
            send_rows = sizing.send_capacity(conf)
        x, (p,), ids, stats = domain.migrate(conf, x, [p], ids, send_rows=send_rows,
                                             displacement=dx)
    # After a migration its gate has checked that every particle fits its padded block.
    f = pm_forces(x, conf, kernels, slots.weights(ids, conf),
                  escape_checked=stats is not None)
    p = p + f * kick1
    return State(x, p, f, ids, stats)


def forward(linear, conf, snapshot_a=None):
    """LPT initial conditions at ``conf.a_start`` and N-body evolution to ``conf.a_end``.

    Parameters
    ----------
    linear : mtf.Tensor
        Linear density contrast at a = 1 [dimensionless], real ``[x, y, z]``,
        dtype ``conf.dtype``.
    conf : SimConfig
        ``lpt_order``, ``a_start``, ``a_end``, ``n_steps`` and the cosmology
        define the run.
    snapshot_a : array_like, optional
        See :func:`nbody`.

    Returns
    -------
    state : State
        Final particle state at ``conf.a_end`` (block-local [cells]).
    rho : mtf.Tensor
        Final CIC density ``1 + delta`` on ``[x, y, z]`` [dimensionless].
    snapshots : list of State
        Only if ``snapshot_a`` is given.
    """
    # nbody() replaces the LPT force by the PM force
    state = lpt_init(linear, conf, conf.a_start, conf.lpt_order, forces=False)
    out = nbody(state, conf, snapshot_a=snapshot_a)
    final, snaps = out if snapshot_a is not None else (out, None)
    rho = density(final.positions, conf, slots.weights(final.ids, conf))
    return (final, rho) if snapshot_a is None else (final, rho, snaps)
