"""The variable-stepped time loop in a session: state variables, one fed KDK step, the run.

The particle state of a lowered time loop lives in Mesh TF variables on the
process grid, and **one** kick-drift-kick step serves every step: its
time-integration factors are fed through a placeholder per run (lowering one
copy of the step per step multiplied the graph-build time, and TF paid its
first-run graph optimisation once per copy). :class:`Stepper` owns that part,
written once for its two users:

* :class:`flowpm_mtf.jobs.nbody_run.SimulationGraph`, the jobs' simulation (it
  adds the ICs written into the state's buffers, the reordering by column, the
  density and its P(k); :func:`flowpm_mtf.jobs.nbody_run.run_stages` adds the
  timing, logging and checkpoints around :meth:`Stepper.run`);
* :class:`flowpm_mtf.gradients.adjoint.AdjointGraph`, the adjoint (it adds the
  cotangents, the loss and the reverse step, whose factors are fed the same
  way: :func:`fed_factors`).

A stepper is built in three calls, so that each user keeps the order of its
graph: the constructor creates the positions, momenta and forces variables,
:meth:`Stepper.add_ids` the ids variable (the simulation creates it after its
ICs, whose ids give its shape), :meth:`Stepper.build_step` the fed factors,
the step and its assignments (after the user's own assignments of the state).
"""
import mesh_tensorflow as mtf
import tensorflow.compat.v1 as tf

from hvd_mesh_impl.slice_init import unfolded_zeros_initializer

from ..mesh import donate
from . import nbody, sizing, timeloop
from .lpt import State

__all__ = ["Stepper", "VECTORS", "zeros_variable", "fed_factors"]

VECTORS = ("positions", "momenta", "forces")
"""The state's particle vectors, in the order of :class:`flowpm_mtf.physics.lpt.State`."""


def zeros_variable(mesh, name, shape, dtype):
    """A non-trainable Mesh TF variable started at zero.

    Its initializer is :func:`hvd_mesh_impl.slice_init.unfolded_zeros_initializer`
    (no full-size constant folded by TensorFlow).

    Parameters
    ----------
    mesh : mtf.Mesh
    name : str
    shape : mtf.Shape
    dtype : tf.DType

    Returns
    -------
    mtf.Tensor
        The variable's value.
    """
    return mtf.get_variable(mesh, name, shape, dtype=dtype, trainable=False,
                            initializer=unfolded_zeros_initializer())


def fed_factors(mesh, dtype, n, name):
    """``n`` scalars fed per session run: a placeholder and its Mesh TF scalars.

    Parameters
    ----------
    mesh : mtf.Mesh
    dtype : tf.DType
        Of the placeholder (the run's real dtype).
    n : int
        Number of factors.
    name : str
        Name of the placeholder and of its (replicated) Mesh TF dimension.

    Returns
    -------
    placeholder : tf.Tensor
        ``[n]``, to feed per run (e.g. a row of
        :func:`flowpm_mtf.physics.nbody.all_step_factors`: kick, drift, kick [dimensionless]).
    factors : list of mtf.Tensor
        The ``n`` scalars, replicated on the mesh.
    """
    ph = tf.placeholder(dtype, [n], name=name)
    fac = mtf.import_tf_tensor(mesh, ph, mtf.Shape([mtf.Dimension(name, n)]))
    return ph, mtf.unstack(fac, fac.shape.dims[0])


class Stepper:
    """State variables, fed step factors, one KDK step and its assignments; the step run.

    Parameters
    ----------
    conf : SimConfig
    mesh : mtf.Mesh
    stages : sequence of float, optional
        Scale factors of the stages [dimensionless], increasing (default
        :func:`flowpm_mtf.config.default_stages`).
    shape : mtf.Shape
        Of the particle vectors, ``[bx, by, npart, xyz]`` (the slots of every block).
    prefix : str
        Prepended to the names of the variables (``positions``, ``momenta``,
        ``forces``, ``ids``), of the placeholder (``step_factors``) and of the
        step's takes (``step_take_<vector>``).

    Attributes
    ----------
    stages : numpy.ndarray
        The checked stages [dimensionless].
    vectors : list of mtf.Tensor
        The positions, momenta [cells] and forces variables, started at zero: the
        state's buffers.
    variables : lpt.State or None
        Positions, momenta, forces and ids as mtf variables (after :meth:`add_ids`).
    send_rows : int
        Rows of the migration's send buffers [particles] (eulerian), sized once for
        the longest of these stages' steps (:func:`flowpm_mtf.physics.sizing.send_capacity`).
    step_factors : list of numpy.ndarray
        The fed factors of step ``i`` (``stages[i] -> stages[i + 1]``): kick, drift,
        kick [dimensionless] (:func:`flowpm_mtf.physics.nbody.all_step_factors`); empty for
        one stage.
    factors : tf.Tensor or None
        The placeholder they are fed through (after :meth:`build_step`).
    step_ops : list of mtf.Operation
        The assignments of the variables from one step (after :meth:`build_step`).
    step_stats : mtf.Tensor or None
        The step's migration statistics (:data:`flowpm_mtf.mesh.domain.STATS`; eulerian
        only).
    """

    def __init__(self, conf, mesh, stages=None, shape=None, prefix=""):
        if shape is None:
            raise ValueError("Stepper: the particle shape is needed")
        self.conf, self.mesh, self.prefix = conf, mesh, prefix
        self.stages = timeloop.check_stages(nbody.default_stages(conf) if stages is None
                                            else [float(a) for a in stages])
        # The zeros are the state's buffers: a user's ICs may write into them and the step
        # updates the state in them where it can (donate.take).
        self.vectors = [zeros_variable(mesh, prefix + n, shape, conf.tf_dtype) for n in VECTORS]
        self.variables = None
        self.send_rows = sizing.send_capacity(conf, stages=self.stages)
        self.step_factors = (list(nbody.all_step_factors(conf, self.stages))
                             if self.stages.size > 1 else [])
        self.factors, self.step_ops, self.step_stats = None, [], None

    @property
    def n_steps(self):
        """Number of steps (stages - 1)."""
        return len(self.stages) - 1

    def add_ids(self, shape, dtype):
        """Create the ids variable (started at zero); completes :attr:`variables`.

        Parameters
        ----------
        shape : mtf.Shape
            ``[bx, by, npart]``.
        dtype : tf.DType
            :func:`flowpm_mtf.mesh.slots.id_dtype`.

        Returns
        -------
        lpt.State
            :attr:`variables`.
        """
        ids = zeros_variable(self.mesh, self.prefix + "ids", shape, dtype)
        self.variables = State(*self.vectors, ids=ids)
        return self.variables

    def build_step(self, kernels, take=False):
        """The fed factors, one KDK step of the variables and its assignments.

        Parameters
        ----------
        kernels : object
            From :func:`flowpm_mtf.physics.kernels.make_kernels`.
        take : bool
            Take the positions, momenta and forces out of their variables
            (:func:`flowpm_mtf.mesh.donate.take`): the step updates them in the
            variables' own buffers where it can (no second copy of the state);
            the step then runs only as a whole.

        Returns
        -------
        list of mtf.Operation
            :attr:`step_ops`.
        """
        if self.variables is None:
            raise ValueError("Stepper.build_step: add_ids first")
        self.factors, fac = fed_factors(self.mesh, self.conf.tf_dtype, 3,
                                        self.prefix + "step_factors")
        state = self.variables
        if take:
            state = State(*[donate.take(t, name=self.prefix + "step_take_" + n)
                            for t, n in zip(self.vectors, VECTORS)], ids=state.ids)
        new = nbody.kdk_step(state, self.conf, kernels=kernels, factors=fac,
                             send_rows=self.send_rows)
        self.step_ops = [mtf.assign(v, t) for v, t in zip(self.variables[:4], new[:4])]
        self.step_stats = new.stats
        return self.step_ops

    def run(self, sess, step, stats, observers=(), first=0, after_step=None):
        """The time loop from ``stages[first]``: one session run of the lowered step per step.

        Parameters
        ----------
        sess : tf.Session
        step : tf.Operation
            The lowered :attr:`step_ops` (one op).
        stats : tf.Tensor or tf.Operation
            Fetched with each step: the step's replicated migration statistics
            (or a no-op).
        observers : sequence of callable
            ``observer(j, a_j, None)`` at stage ``first`` and after every step
            (:func:`flowpm_mtf.physics.timeloop.integrate`).
        first : int
            The stage the variables hold (> 0 when continuing a run).
        after_step : callable, optional
            ``after_step(i, stats_i)`` right after step ``i``'s run, before the
            observers of the stage it reached.

        Returns
        -------
        list
            The fetched ``stats`` of every step run (None entries for a no-op).
        """
        out = []

        def one(state, i, a0, a1):
            out.append(sess.run([step, stats], {self.factors: self.step_factors[i]})[1])
            if after_step is not None:
                after_step(i, out[-1])
            return state

        timeloop.integrate(None, self.stages, one, observers, first=first)
        return out
