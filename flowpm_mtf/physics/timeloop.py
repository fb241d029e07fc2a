r"""The one time loop: kick-drift-kick over stages, with observers.

Every N-body integration of the package goes through :func:`integrate`:

* :func:`flowpm_mtf.physics.nbody.nbody` (one unrolled graph; snapshots as
  :class:`StateSnapshots`),
* :func:`flowpm_mtf.physics.lensing.lightcone_forward` (unrolled; lens planes painted
  by an observer),
* the jobs (:mod:`flowpm_mtf.jobs.nbody_run`): one lowered step run once per
  stage in a session, with observers that write snapshots, paint lens planes,
  measure P(k), time and log each step, and call the runner's after-step hook
  (checkpoints, signals).

The stepping rule is written once, here:

1. :func:`initial_state`: at the first stage the force is recomputed at the
   initial (LPT) positions (replacing the LPT force; as FlowPM's ``nbody``);
2. for each step ``stages[i] -> stages[i + 1]`` the caller's ``step``
   (normally :func:`flowpm_mtf.physics.nbody.kdk_step`, treated as a black box) maps
   the state at ``stages[i]`` to the state at ``stages[i + 1]``;
3. after the initial stage and after every step, each observer sees
   ``(stage index j, a_j, state)``; positions and momenta are synchronised
   there.

Stage lists: :func:`check_stages` validates them and :func:`merge_stages`
adds requested scale factors (snapshots) to a regular list.
"""
import logging

import numpy as np

from .gravity import pm_forces

__all__ = ["STAGE_RTOL", "initial_state", "check_stages", "stage_indices", "merge_stages",
           "integrate", "StateSnapshots"]

log = logging.getLogger(__name__)

STAGE_RTOL = 1e-10
"""Relative tolerance for matching a requested scale factor to a stage."""


def initial_state(state, conf, kernels, escape_checked=None, donor=None):
    """The state the first kick starts from: the PM force at the initial positions.

    Parameters
    ----------
    state : lpt.State
        Positions and momenta at the first stage (the LPT force is replaced).
    conf : SimConfig
    kernels : from :func:`flowpm_mtf.physics.kernels.make_kernels`
    escape_checked : bool, optional
        Whether a migration's gate has already checked that every particle fits its
        padded block (:func:`flowpm_mtf.mesh.domain.migrate`): then the force's paint and
        readout skip their own escape check, as in
        :func:`flowpm_mtf.physics.nbody.kdk_step`. Default: ``state.stats is not None`` (the
        positions come straight out of a migration, e.g. the eulerian
        :func:`flowpm_mtf.physics.lpt.lpt_init`).
    donor : mtf.Tensor, optional
        A buffer of the forces' shape the force's readout writes into where nothing else
        holds it (:func:`flowpm_mtf.physics.gravity.pm_forces`; the job's forces variable,
        :func:`flowpm_mtf.mesh.donate.take`).

    Returns
    -------
    lpt.State
        ``state`` with ``forces = pm_forces(positions)`` [cells].
    """
    from ..mesh.slots import weights
    if escape_checked is None:
        escape_checked = state.stats is not None
    return state._replace(forces=pm_forces(state.positions, conf, kernels,
                                           weights(state.ids, conf),
                                           escape_checked=bool(escape_checked),
                                           donor=donor))


def check_stages(stages):
    """Validated stages: finite, positive, strictly increasing scale factors.

    Returns
    -------
    ndarray
        float64, 1-d.

    Raises
    ------
    ValueError
        For an empty, non-positive or non-increasing list.
    """
    stages = np.asarray(stages, dtype=np.float64).reshape(-1)
    if stages.size < 1:
        raise ValueError("nbody: stages must hold at least one scale factor")
    if not np.all(np.isfinite(stages)) or np.any(stages <= 0):
        raise ValueError("nbody: stages must be finite and positive, got %s" % stages)
    if np.any(np.diff(stages) <= 0):
        raise ValueError("nbody: stages must be strictly increasing, got %s" % stages)
    return stages


def stage_indices(scale_factors, stages):
    """Index of the stage equal to each requested scale factor.

    Raises
    ------
    ValueError
        If one is not a stage (relative tolerance :data:`STAGE_RTOL`).
    """
    idx = []
    for a in np.asarray(scale_factors, dtype=np.float64).reshape(-1):
        hit = np.nonzero(np.abs(stages - a) <= STAGE_RTOL * a)[0]
        if hit.size == 0:
            raise ValueError("nbody: snapshot at a=%r is not one of the stages %s; positions and "
                             "momenta are synchronised only at stages (pass stages that include "
                             "it)" % (float(a), stages))
        idx.append(int(hit[0]))
    return idx


def merge_stages(stages, extra):
    """``stages`` with the scale factors ``extra`` added (those already there are kept once).

    Parameters
    ----------
    stages : array_like
        Increasing scale factors.
    extra : array_like
        Scale factors within ``[stages[0], stages[-1]]``.

    Returns
    -------
    ndarray
        The merged increasing stages; equal to ``stages`` when every extra
        value is already a stage (relative tolerance :data:`STAGE_RTOL`).

    Raises
    ------
    ValueError
        For a scale factor outside the stages' range.
    """
    stages = check_stages(stages)
    out = list(stages)
    for a in np.asarray(extra, dtype=np.float64).reshape(-1):
        if not stages[0] * (1 - STAGE_RTOL) <= a <= stages[-1] * (1 + STAGE_RTOL):
            raise ValueError("snapshot at a=%g is outside the run, a = %g .. %g"
                             % (a, stages[0], stages[-1]))
        if not np.any(np.abs(np.asarray(out) - a) <= STAGE_RTOL * a):
            out.append(float(a))
    return np.array(sorted(out))


def integrate(state, stages, step, observers=(), first=0):
    """Run the time loop from ``stages[first]`` to ``stages[-1]``.

    Parameters
    ----------
    state : object
        The state at ``stages[first]`` (an ``lpt.State`` of mtf tensors when
        the loop builds one graph, or anything, e.g. ``None``, when ``step``
        runs a lowered step in a session).
    stages : array_like
        Increasing scale factors [dimensionless] (see :func:`check_stages`).
    step : callable
        ``step(state, i, a0, a1) -> state`` advances step ``i`` from
        ``a0 = stages[i]`` to ``a1 = stages[i + 1]``.
    observers : sequence of callable
        Each called as ``observer(j, a_j, state)`` at stage ``first`` and after
        every step (``j`` = index of the stage reached), in order.
    first : int
        Index of the stage of ``state`` (> 0 when continuing a run).

    Returns
    -------
    object
        The state at ``stages[-1]``.
    """
    stages = check_stages(stages)
    for obs in observers:
        obs(first, float(stages[first]), state)
    for i in range(first, stages.size - 1):
        state = step(state, i, float(stages[i]), float(stages[i + 1]))
        for obs in observers:
            obs(i + 1, float(stages[i + 1]), state)
    return state


class StateSnapshots:
    """Observer keeping the state at requested stages (for a loop that builds one graph).

    Parameters
    ----------
    indices : sequence of int
        Stage indices to keep (from :func:`stage_indices`).

    Attributes
    ----------
    states : list
        After the loop: one state per entry of ``indices``, in that order.
    """

    def __init__(self, indices):
        self.indices = list(indices)
        self._kept = {}

    def __call__(self, j, a, state):
        if j in self.indices:
            self._kept[j] = state

    @property
    def states(self):
        return [self._kept[j] for j in self.indices]
