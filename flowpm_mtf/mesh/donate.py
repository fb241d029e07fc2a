"""A variable's buffer handed to the op that writes the variable's next value.

An op that computes a variable's next value allocates a fresh output; the assignment then
takes that output over and frees the variable's old buffer. Where the old value is not
needed, the old buffer can be the output instead: :func:`take` moves a Mesh TF variable's
slice out of its TensorFlow variable (``FlowpmTakeVariable``,
``flowpm_mtf/native/variable_ops.cc``), and an op that accepts *donors* (e.g.
:func:`flowpm_mtf.physics.lpt.lattice_combine_potentials`), or any TensorFlow op that forwards an
input it alone holds (the kicks' and the drift's sums and products), writes its output into
it. The job (:class:`flowpm_mtf.jobs.nbody_run.SimulationGraph`) does this in its ICs with the
state's initial zeros (the first force too: ``FlowpmCicReadoutInto``), and in every step with
the state itself: the ICs' positions, momenta and forces are written into memory the process
has already touched instead of fresh pages (slow to fill on a VM), and the steps keep one
copy of the state instead of two.

The take happens only where it is safe and useful: on a mesh implementation whose laid-out
variable is one TensorFlow resource variable per process (``slice_variable``, as
:class:`hvd_mesh_impl.HvdSimdMeshImpl`'s), with the native library. Elsewhere (Mesh TF's
``PlacementMeshImpl``, ``FLOWPM_MTF_NATIVE=0``) the donor is the variable's value as read,
which no consumer can take over (the variable still holds it): the consumer allocates as
before. The results are the same either way.

Between the take and the assignment, in the same ``session.run``, the variable is
uninitialised; the take runs after the variable's snapshot read of the run (the read every
consumer of the variable sees, :class:`hvd_mesh_impl.HvdSimdMeshImpl`), so nothing in the
run reads it afterwards. A run that fails in between leaves the variable uninitialised, and
its next read raises ``FailedPrecondition``: nothing is lost that the job needs, since a
failed ICs or step run ends the job or rebuilds it from the ICs or its last checkpoint (the
capacity retry of :func:`flowpm_mtf.jobs.runner.run`), whose runs assign every taken
variable again.
"""
import mesh_tensorflow as mtf

from .. import native


class TakeOperation(mtf.Operation):
    """A Mesh TF variable's value, moved out of its slice variable (see the module docstring).

    Parameters
    ----------
    variable : mtf.Tensor
        A variable (the output of ``mtf.get_variable``).
    name : str, optional
    """

    def __init__(self, variable, name=None):
        super().__init__([], mesh=variable.mesh, name=name or "take")
        self._variable = variable.operation
        self._outputs = [mtf.Tensor(self, variable.shape, variable.dtype)]

    def lower(self, lowering):
        import tensorflow.compat.v1 as tf

        laid_out = lowering.variables[self._variable]
        reads = laid_out.laid_out_tensor.tensor_list
        slice_var = getattr(laid_out, "slice_variable", None)
        lib = (native.ops_for("variable_ops", *reads, dtypes=None)
               if slice_var is not None and len(reads) == 1 else None)
        if lib is None:
            out = list(reads)
        else:
            # After the run's snapshot read: nothing in the run reads the variable later.
            with tf.control_dependencies(reads):
                out = [lib.flowpm_take_variable(slice_var.handle, dtype=reads[0].dtype,
                                                shape=reads[0].shape, name=self.name)]
        mesh_impl = lowering.mesh_impl(self)
        lowering.set_tensor_lowering(self.outputs[0], mesh_impl.LaidOutTensor(out))


def take(variable, name=None):
    """The value of ``variable``, as a donor for the op that writes its next value.

    Parameters
    ----------
    variable : mtf.Tensor
        A Mesh TF variable.
    name : str, optional

    Returns
    -------
    mtf.Tensor
        Its value (same shape and dtype). On a mesh of one resource variable per process
        the variable gives its buffer up to this tensor and is uninitialised until its next
        assignment in the same run; the run must assign it.
    """
    return TakeOperation(variable, name=name).outputs[0]
