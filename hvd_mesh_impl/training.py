"""Ordered variable updates for any Mesh TF backend (no Horovod import).

Mesh TF lowers a training step (forward, gradients, optimizer assignments) to
TF ops without ordering the assignments after the reads of the same variables:
inside one ``session.run`` a gradient may read a variable that an assignment
of the same step has already changed. With Mesh TF's ``PlacementMeshImpl`` this
happens (the trajectory then depends on TF's thread count).
:class:`~hvd_mesh_impl.HvdSimdMeshImpl` orders its updates by construction (one
snapshot read per variable and step, assignments after it); for other backends
:func:`ordered_update_op` adds the missing control dependencies.
"""
import mesh_tensorflow as mtf
import tensorflow.compat.v1 as tf

# Ops that change a resource variable. FlowpmTakeVariable (flowpm_mtf/native/variable_ops.cc,
# flowpm_mtf.mesh.donate) moves the value out of the variable (its buffer becomes the next value's
# output) and leaves it uninitialised until the assignment: every read of the step must run
# before it, as before an assignment.
_ASSIGN_TYPES = ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp",
                 "FlowpmTakeVariable")
_REF_ASSIGN_TYPES = ("Assign", "AssignAdd", "AssignSub")


def ancestors(ops):
    """Every TF op the given ops depend on (data and control inputs), the ops included."""
    seen, stack = set(), list(ops)
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    return seen


def ordered_update_op(lowering, update_ops, name="ordered_update"):
    """One TF op running a step's updates after every read of the updated variables.

    For each variable assignment (``AssignVariableOp``, ``AssignAdd...``,
    ``AssignSub...``, and the take of a value by ``FlowpmTakeVariable``, which
    uninitialises the variable until it is assigned) that the updates run, every
    ``ReadVariableOp`` of the same
    resource variable in the graph becomes a control input of the assignment,
    except reads that come after an assignment by construction (those that
    depend on any assignment, e.g. the value returned by ``tf.assign`` or by
    ``copy_masters_to_slices``: forcing them would re-run that assignment). In one ``session.run``
    of the returned op (with or without other fetches such as the loss), all
    reads of a variable, forward and gradient, then see its value before the
    step, for any optimizer and thread count. Resource variables copy on write,
    so a read that ran before an assignment keeps its value.

    Parameters
    ----------
    lowering : mtf.Lowering
    update_ops : list of mtf.Operation or tf.Operation
        The step's updates, e.g. the result of ``optimizer.apply_grads``.
    name : str, optional

    Returns
    -------
    tf.Operation
        A ``tf.group`` of the lowered updates.

    Raises
    ------
    TypeError
        If an update assigns a reference (non-resource) variable, whose reads
        are not snapshots; create variables with ``use_resource=True`` (the
        default in TensorFlow 2).

    Notes
    -----
    Workaround: control inputs are added to the already-lowered TF ops with
    ``tf.Operation._add_control_input`` (TensorFlow has no public API to add
    them after creation). Call this before the first ``session.run`` of the
    graph.
    """
    tf_ops = [lowering.lowered_operation(op) if isinstance(op, mtf.Operation) else op
              for op in update_ops]
    for op in ancestors(tf_ops):
        if op.type in _REF_ASSIGN_TYPES:
            raise TypeError("ordered_update_op: %s assigns a reference variable; use resource "
                            "variables (use_resource=True)" % op.name)
        if op.type not in _ASSIGN_TYPES:
            continue
        handle = op.inputs[0]
        reads = [c for c in handle.consumers() if c.type == "ReadVariableOp"]
        present = set(op.control_inputs)
        for read in reads:
            if read in present or any(o.type in _ASSIGN_TYPES + _REF_ASSIGN_TYPES
                                      for o in ancestors([read])):
                continue
            op._add_control_input(read)  # pylint: disable=protected-access
    return tf.group(tf_ops, name=name)
