"""``HvdSimdMeshImpl``: a Mesh TensorFlow MeshImpl in which every MPI rank holds one slice.

Each rank builds the same TF graph for *its own* slice (SPMD), in contrast to
Mesh TF's ``PlacementMeshImpl`` where one process builds and runs the graph for
all devices. Communication along a mesh axis uses Horovod collectives on the
process set of that axis: the ranks that differ only in their coordinate along
it. The process sets come from an MPI Cartesian communicator, one
sub-communicator per mesh axis.

Conventions
-----------
* Processor number ``pnum`` = rank of the communicator = row-major index of the
  processor coordinates (as ``mtf.pnum_to_processor_coordinates``).
* Horovod collectives reject complex tensors: complex data is bit-cast to pairs
  of reals on the wire; booleans travel as int32.
* ``export_to_tf_tensor`` returns the **full** tensor (gathered along every
  split mesh axis). Use :meth:`HvdSimdMeshImpl.local_slice` or
  :func:`export_local_slice` for this rank's slice alone.
* No rank holds a full-size copy of a distributed tensor unless asked:
  variables have no master (:class:`HvdSimdMeshImpl.LaidOutVariable`), and
  ``export_to_tf_tensor`` / ``import_tf_tensor`` / full-shape initializers of a
  tensor that is split over more than one rank raise :class:`FullSizeError`
  above ``max_full_elements`` elements.
"""
import hashlib
import itertools
import logging
import os

import mesh_tensorflow as mtf
import numpy as np
import tensorflow.compat.v1 as tf
import horovod.tensorflow as hvd
from mpi4py import MPI

from . import mtf_compat, runtime, slice_init
from .mtf_compat import lazy_master as _lazy_master
from .slice_init import FullSizeError, check_full_size

DEFAULT_MAX_FULL_ELEMENTS = 2**24
"""Default of :attr:`HvdSimdMeshImpl.max_full_elements` (16.8 M elements, 128 MiB in float64)."""

log = logging.getLogger(__name__)

_REDUCE_OPS = {"SUM": hvd.Sum, "MAX": hvd.Max, "MIN": hvd.Min}


def _stable_seed(*parts):
    """A 31-bit seed from the repr of ``parts`` (SHA-256; unlike ``hash``, not salted)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def _to_wire(t):
    """Represent ``t`` in a dtype Horovod accepts; returns (tensor, inverse function)."""
    if t.dtype.is_complex:
        real = tf.float32 if t.dtype == tf.complex64 else tf.float64
        # A bitcast appends a trailing axis of 2 (real, imag): no copy, axis 0 intact.
        return tf.bitcast(t, real), lambda w: tf.bitcast(w, t.dtype)
    if t.dtype == tf.bool:
        return tf.cast(t, tf.int32), lambda w: tf.cast(w, tf.bool)
    return t, lambda w: w


def _move_axis_to_front(t, axis):
    rank = t.shape.ndims
    if axis == 0:
        return t
    return tf.transpose(t, [axis] + [i for i in range(rank) if i != axis])


def _move_front_axis_to(t, axis):
    rank = t.shape.ndims
    if axis == 0:
        return t
    perm = list(range(1, axis + 1)) + [0] + list(range(axis + 1, rank))
    return tf.transpose(t, perm)


class HvdSimdMeshImpl(mtf.MeshImpl):
    """Mesh TensorFlow MeshImpl on Horovod process sets, one slice per MPI rank.

    Parameters
    ----------
    mesh_shape : mtf.Shape, str or list of (name, size)
        The processor mesh, e.g. ``[("row", 2), ("col", 2)]`` or ``"row:2;col:2"``;
        its size must equal the number of ranks of ``comm``.
    layout_rules : mtf.LayoutRules, str or list of (tensor dim, mesh axis)
        Which tensor dimensions are split along which mesh axis.
    comm : mpi4py.MPI.Comm, optional
        The ranks of the mesh (default ``MPI.COMM_WORLD``). Horovod is started on
        it if it is not running yet (with an exit barrier, see
        :func:`hvd_mesh_impl.runtime.init`).
    max_full_elements : int, optional
        Largest number of elements of a *distributed* tensor (split over more
        than one rank) that may exist whole on one rank: the full tensor of
        ``export_to_tf_tensor``, the input of ``import_tf_tensor``, an
        initializer that can only be evaluated on the full shape. Above it
        these raise :class:`FullSizeError` at graph construction. Default:
        the environment variable ``FLOWPM_MTF_MAX_FULL_ELEMENTS``, else
        :data:`DEFAULT_MAX_FULL_ELEMENTS`; ``0`` or a negative value: no limit.
        Also settable as the attribute ``max_full_elements``.

    Raises
    ------
    ValueError
        If the communicator size differs from the mesh size, a mesh axis has a
        non-positive size or a duplicate name, or a layout rule names a mesh
        axis that does not exist. Every rank raises the same error, before
        Horovod starts. A tensor dimension that is not divisible by the mesh
        axis it is split over raises at graph construction
        (:meth:`tensor_layout`).
    """

    slice_only_variables = True
    """Variables have no master copy (read by :func:`hvd_mesh_impl.mtf_compat.enable_lazy_masters`)."""

    def __init__(self, mesh_shape, layout_rules, comm=None, max_full_elements=None):
        super().__init__(mesh_shape, layout_rules)
        mtf_compat.apply()   # slices need lazy masters, k-space gradients complex ones
        if max_full_elements is None:
            max_full_elements = int(os.environ.get("FLOWPM_MTF_MAX_FULL_ELEMENTS",
                                                   DEFAULT_MAX_FULL_ELEMENTS))
        self.max_full_elements = max_full_elements if max_full_elements > 0 else None
        self._validate_shape_and_layout()
        comm = MPI.COMM_WORLD if comm is None else comm
        if comm.Get_size() != self.size:
            raise ValueError(
                "HvdSimdMeshImpl: the mesh %s has %d processors but the job has %d MPI "
                "ranks; launch with -np %d or change the mesh shape"
                % (self.shape.to_string, self.size, comm.Get_size(), self.size))
        self._comm = runtime.init(comm)
        self._recv_bytes = []  # (collective kind, tf int64 scalar) per collective issued
        self._op_counter = itertools.count()

        dims = self.shape.to_integer_list
        # reorder=False: Cartesian rank == communicator rank == mtf pnum (row-major).
        self._cart = comm.Create_cart(dims=dims, periods=[True] * len(dims), reorder=False)
        self._pnum = self._cart.Get_rank()
        self._pcoord = list(self._cart.Get_coords(self._pnum))
        if self._pcoord != mtf.pnum_to_processor_coordinates(self.shape, self._pnum):
            raise RuntimeError("MPI Cartesian coordinates disagree with Mesh TF's row-major order")

        self._axis_comms = []
        self._axis_sets = []
        for axis, n in enumerate(dims):
            remain = [a == axis for a in range(len(dims))]
            sub = self._cart.Sub(remain)
            self._axis_comms.append(sub)
            # Register the process sets of *all* groups along this axis, identically
            # on every rank (Horovod adds dynamic sets collectively).
            mine = None
            for group in self._axis_groups(axis):
                ps = runtime.process_set_for(group) if n > 1 else None
                if self._pnum in group:
                    mine = (group, ps)
            own_ranks = MPI.Group.Translate_ranks(sub.Get_group(), list(range(n)),
                                                  comm.Get_group())
            if list(own_ranks) != list(mine[0]):
                raise RuntimeError("axis %d: sub-communicator ranks %s != group %s"
                                   % (axis, own_ranks, mine[0]))
            self._axis_sets.append(mine[1])
        log.debug("rank %d: pcoord %s on mesh %s", self._pnum, self._pcoord, self.shape.to_string)

    # ------------------------------------------------------------------ set-up helpers
    def _validate_shape_and_layout(self):
        names = [d.name for d in self.shape.dims]
        if len(set(names)) != len(names):
            raise ValueError("mesh axis names must be unique, got %s" % names)
        for d in self.shape.dims:
            if d.size < 1:
                raise ValueError("mesh axis %r has size %d" % (d.name, d.size))
        for tensor_dim, mesh_axis in sorted(self.layout_rules._pairs):  # no public accessor
            if mesh_axis not in names:
                raise ValueError(
                    "layout rule (%r, %r) names mesh axis %r, which is not in the mesh %s"
                    % (tensor_dim, mesh_axis, mesh_axis, names))

    def tensor_layout(self, arg):
        """Mesh TF's layout of a tensor or shape, each split dimension checked.

        Mesh TF asks for the layout of every tensor it lowers, so a bad dimension
        fails at graph construction (``mtf.Lowering``, imports, variables), on every
        rank alike (all build the same graph) and before any collective of the
        graph runs.

        Parameters
        ----------
        arg : mtf.Tensor or mtf.Shape

        Returns
        -------
        mtf.TensorLayout

        Raises
        ------
        ValueError
            If a dimension is not divisible by the size of the mesh axis its layout
            rule splits it over (every rank holds an equal slice); the message names
            the dimension, the axis and their sizes. Mesh TF's own error if two
            dimensions of one tensor map to the same mesh axis.
        """
        layout = super().tensor_layout(arg)
        shape = arg.shape if isinstance(arg, mtf.Tensor) else mtf.convert_to_shape(arg)
        for dim, axis in zip(shape.dims, layout.tensor_axis_to_mesh_axis):
            if axis is None:
                continue
            mesh_dim = self.shape.dims[axis]
            if dim.size % mesh_dim.size:
                raise ValueError(
                    "tensor dimension %r (size %d) is split over mesh axis %r (size %d) by "
                    "the layout rule (%r, %r) but is not divisible by it: every rank holds an "
                    "equal slice; make %r a multiple of %d or change the layout (tensor "
                    "shape %s, mesh %s)"
                    % (dim.name, dim.size, mesh_dim.name, mesh_dim.size, dim.name,
                       mesh_dim.name, dim.name, mesh_dim.size, shape.to_string,
                       self.shape.to_string))
        return layout

    def _axis_groups(self, axis):
        """Groups of ranks differing only along ``axis``, each ordered by that coordinate."""
        dims = self.shape.to_integer_list
        others = [range(n) if a != axis else [0] for a, n in enumerate(dims)]
        groups = []
        for base in itertools.product(*others):
            coords = list(base)
            group = []
            for i in range(dims[axis]):
                coords[axis] = i
                group.append(self._cart.Get_cart_rank(coords))
            groups.append(tuple(group))
        return groups

    # ------------------------------------------------------------------ properties
    @property
    def comm(self):
        """The MPI Cartesian communicator of the mesh."""
        return self._cart

    @property
    def pnum(self):
        """This rank's processor number (int)."""
        return self._pnum

    @property
    def pcoord(self):
        """This rank's processor coordinates, one int per mesh axis."""
        return list(self._pcoord)

    def axis_comm(self, mesh_axis):
        """MPI sub-communicator of the ranks differing only along ``mesh_axis``."""
        return self._axis_comms[mesh_axis]

    @property
    def supports_control_dependencies(self):
        return True

    # ------------------------------------------------------------------ laid-out tensors
    class LaidOutTensor:
        """The one slice of a tensor held by this rank."""

        def __init__(self, tensor_list):
            if len(tensor_list) != 1:
                raise ValueError("HvdSimdMeshImpl holds one slice per rank, got %d" % len(tensor_list))
            self._tensor_list = list(tensor_list)

        def __repr__(self):
            return "[" + ",".join(str(t) for t in self._tensor_list) + "]"

        @property
        def tensor_list(self):
            return self._tensor_list

        @property
        def one_slice(self):
            return self._tensor_list[0]

        @classmethod
        def from_tensor_list(cls, tensor_list):
            return cls(tensor_list)

        @property
        def all_slices(self):
            return self._tensor_list

        @property
        def slice_shape(self):
            return self.one_slice.shape.as_list()

        def to_laid_out_tensor(self):
            return self

    class LaidOutVariable:
        """This rank's slice of a Mesh TF variable; no full-size master copy.

        * **Initial value.** The slice ``tf.Variable`` (``<name>_slice``) is
          initialised by ``tf.global_variables_initializer()`` from the
          initializer evaluated on the slice alone
          (:func:`hvd_mesh_impl.slice_init.initial_slice`): no full-size
          initial value, master or broadcast exists in the TF graph.
        * **Masters.** None is created (see
          :func:`hvd_mesh_impl.mtf_compat.enable_lazy_masters`), so
          ``copy_master_to_slices`` and ``copy_slices_to_master`` are no-ops.
          If the program itself created the master (``variable.get_master()``,
          e.g. for a ``tf.train.Saver``), ``copy_master_to_slices`` reads this
          rank's slice of it (slice-local) and ``copy_slices_to_master``
          gathers the slices into it (subject to ``max_full_elements``).
        * **Ordered updates.** Every consumer of the variable in a step
          (forward, gradient, exports) reads one snapshot, ``ReadVariableOp``
          of the resource variable, and every assignment to the slice runs with
          a control dependency on that snapshot. A step's reads therefore all
          see the value before the step, whatever the optimizer, TF's thread
          count or op ordering; resource variables copy on write, so an
          assignment never changes a snapshot already taken.
        """

        def __init__(self, variable, mesh_impl):
            self._variable = variable
            self._mesh_impl = mesh_impl
            shape = variable.outputs[0].shape
            with tf.control_dependencies(None):
                initial = mesh_impl._initial_slice(variable)
                self._slice_var = tf.get_variable(
                    variable.name + "_slice",
                    initializer=tf.cast(initial, variable.slice_dtype),
                    trainable=False, use_resource=True,
                    collections=[tf.GraphKeys.GLOBAL_VARIABLES])
                # The one read of the slice per session.run: see "Ordered updates".
                self._snapshot = self._slice_var.read_value()
            self._shape = shape
            self._laid_out_tensor = mesh_impl.LaidOutTensor([self._snapshot])

        def assign_to_slices(self, assign_fn, values):
            """Assign ``values`` (a list with this rank's one slice) to the slice variable.

            The assignment runs after this step's snapshot read of the variable.
            """
            if len(values) != 1:
                raise ValueError("expected one slice, got %d" % len(values))
            with tf.control_dependencies([self._snapshot]):
                return tf.group(assign_fn(self._variable, self._slice_var, values[0]))

        @property
        def laid_out_tensor(self):
            return self._laid_out_tensor

        @property
        def slice_variable(self):
            """The ``tf.Variable`` holding this rank's slice."""
            return self._slice_var

        def _existing_master(self):
            """The master if the program created it (all members of a stacked variable)."""
            members = getattr(self._variable, "_stacked_members", None) or [self._variable]
            lazies = [_lazy_master(m) for m in members]
            if all(m is not None and not m.materialized for m in lazies):
                return None  # never ask a StackedVariable for get_master(): it creates them
            return self._variable.get_master()

        @property
        def copy_master_to_slices(self):
            master = self._existing_master()
            if master is None:
                return tf.no_op(name=self._variable.name.replace("/", "_") + "_no_master")
            value = self._mesh_impl._local_slice_of_full(tf.convert_to_tensor(master), self._shape)
            return self.assign_to_slices(mtf.assign_slice, [value])

        @property
        def copy_slices_to_master(self):
            master = self._existing_master()
            if master is None:
                return tf.no_op(name=self._variable.name.replace("/", "_") + "_no_master")
            gathered = self._mesh_impl.export_to_tf_tensor(
                self._variable.outputs[0],
                self._mesh_impl.LaidOutTensor([tf.cast(self._snapshot,
                                                       self._variable.master_dtype)]))
            return self._variable.assign_to_master(gathered)

    # ------------------------------------------------------------------ slicewise
    def slicewise(self, fn, *inputs):
        """Apply ``fn`` to this rank's slices of ``inputs``.

        Returns
        -------
        LaidOutTensor, or a tuple of them if ``fn`` returns a tuple.
        """
        inputs = mtf.convert_args_to_laid_out_tensors(inputs)
        args = [x.one_slice if isinstance(x, self.LaidOutTensor) else x for x in inputs]
        ret = fn(*args)
        if isinstance(ret, tuple):
            return tuple(self.LaidOutTensor([t]) for t in ret)
        return self.LaidOutTensor([ret])

    def laid_out_pnum(self):
        """LaidOutTensor holding this rank's processor number (int32 scalar)."""
        return self.LaidOutTensor([tf.constant(self._pnum, tf.int32)])

    def laid_out_pcoord(self, mesh_axis):
        """LaidOutTensor holding this rank's coordinate along ``mesh_axis`` (int32 scalar)."""
        return self.LaidOutTensor([tf.constant(self._pcoord[mesh_axis], tf.int32)])

    # ------------------------------------------------------------------ collectives
    def _op_name(self, kind):
        """A rank-independent name for the next Horovod op.

        Horovod matches collectives across ranks by op name. Its default name is
        derived from the *input* tensor's name, which differs between ranks when
        rank-dependent Python builds that input (as ``receive`` does), and then the
        job stalls. Collectives are issued in the same order on every rank, so a
        counter gives the same name everywhere.
        """
        return "HvdSimd_%s_%d" % (kind, next(self._op_counter))

    def _issue(self, kind, hvd_fn, tensor, **kwargs):
        """Issue one Horovod collective with a rank-independent name.

        Horovod's TF ops are not registered as stateful, so Grappler may
        constant-fold them or merge two of them with identical inputs (common
        subexpression elimination). Inputs are rank-local: two collectives can
        have identical inputs on *some* ranks only (two empty sends in
        ``receive``, equal constant slices), and a merge there leaves the other
        ranks waiting forever. The input therefore goes through a
        ``PlaceholderWithDefault``, a no-copy forward that Grappler neither folds
        nor deduplicates. (Horovod negotiates readiness, so the order in which
        ranks reach collectives does not matter; no ordering is imposed, which
        would drag unrelated collectives into every ``session.run``.)
        """
        tensor = tf.placeholder_with_default(tensor, tensor.shape)
        return hvd_fn(tensor, name=self._op_name(kind), **kwargs)

    def _record(self, kind, received, static_bytes=None):
        """Remember the bytes this rank receives from other ranks in one collective."""
        if static_bytes is not None:
            nbytes = tf.constant(static_bytes, tf.int64)
        else:
            nbytes = tf.size(received, out_type=tf.int64) * received.dtype.size
        self._recv_bytes.append((kind, nbytes))

    def comm_bytes_received(self, kind=None):
        """Bytes this rank receives in the collectives lowered so far.

        Horovod's accounting: the size of each collective's result on this rank.
        For ``alltoall`` and ``allconcat`` that includes the rank's own piece
        (the bytes from other ranks are ``(n - 1) / n`` of it on an axis of
        ``n`` ranks); ``allreduce`` counts the reduced tensor once (a ring
        algorithm moves ``2 (n - 1) / n`` times that); ``receive`` (shift)
        counts only the slice that comes from another rank.

        Parameters
        ----------
        kind : str, optional
            One of ``"allreduce"``, ``"allconcat"``, ``"alltoall"``, ``"receive"``;
            default all.

        Returns
        -------
        tf.Tensor
            int64 scalar; evaluating it does not trigger the collectives.
        """
        vals = [b for k, b in self._recv_bytes if kind is None or k == kind]
        return tf.add_n(vals) if vals else tf.constant(0, tf.int64)

    def allreduce(self, x, mesh_axes, reduction_fn_string):
        """Reduce over the ranks differing only along ``mesh_axes``.

        Parameters
        ----------
        x : LaidOutTensor
        mesh_axes : list of int
        reduction_fn_string : {"SUM", "MAX", "MIN"}

        Raises
        ------
        NotImplementedError
            For any other reduction, or MAX/MIN of complex tensors.
        """
        if reduction_fn_string not in _REDUCE_OPS:
            raise NotImplementedError(
                "HvdSimdMeshImpl.allreduce: reduction %r is not supported (supported: %s)"
                % (reduction_fn_string, ", ".join(sorted(_REDUCE_OPS))))
        x = x.to_laid_out_tensor()
        t = x.one_slice
        if t.dtype.is_complex and reduction_fn_string != "SUM":
            raise NotImplementedError(
                "HvdSimdMeshImpl.allreduce: %s of a complex tensor is not defined"
                % reduction_fn_string)
        axes = [a for a in mesh_axes if self.shape[a].size > 1]
        if not axes:
            return x
        op = _REDUCE_OPS[reduction_fn_string]
        wire, back = _to_wire(t)
        if len(axes) == len([a for a in range(self.ndims) if self.shape[a].size > 1]):
            sets = [hvd.global_process_set]  # every non-trivial axis: one global reduction
        else:
            sets = [self._axis_sets[a] for a in axes]  # associative: one axis at a time
        for ps in sets:
            wire = self._issue("allreduce", hvd.allreduce, wire, op=op, process_set=ps)
            self._record("allreduce", wire)
        return self.LaidOutTensor([back(wire)])

    def allconcat(self, x, mesh_axis, concat_axis, stack=False):
        """Concatenate (or stack) the slices of the ranks along ``mesh_axis``.

        Parameters
        ----------
        x : LaidOutTensor
        mesh_axis : int
        concat_axis : int
            Tensor axis to concatenate along (with ``stack``, the position of the
            new axis).
        stack : bool
            Stack along a new axis instead of concatenating.
        """
        x = x.to_laid_out_tensor()
        t = x.one_slice
        if stack:
            t = tf.expand_dims(t, concat_axis)
        n = self.shape[mesh_axis].size
        if n == 1:
            return self.LaidOutTensor([t])
        shape = t.shape.as_list()
        wire, back = _to_wire(_move_axis_to_front(t, concat_axis))
        gathered = self._issue("allconcat", hvd.allgather, wire,
                               process_set=self._axis_sets[mesh_axis])
        self._record("allconcat", gathered)
        gathered = tf.reshape(back(gathered),
                              [n * shape[concat_axis]] + [s for i, s in enumerate(shape)
                                                          if i != concat_axis])
        return self.LaidOutTensor([_move_front_axis_to(gathered, concat_axis)])

    def alltoall(self, x, mesh_axis, split_axis, concat_axis):
        """Split along ``split_axis``, exchange, concatenate along ``concat_axis``.

        Piece ``j`` of rank ``i`` goes to rank ``j``; rank ``j`` concatenates the
        pieces in the order of ``i`` (as Mesh TF's reference implementations).
        """
        x = x.to_laid_out_tensor()
        n = self.shape[mesh_axis].size
        if n == 1:
            return x
        t = x.one_slice
        shape = t.shape.as_list()
        if shape[split_axis] % n:
            raise ValueError("alltoall: axis %d of size %d is not divisible by %d ranks"
                             % (split_axis, shape[split_axis], n))
        wire, back = _to_wire(t)  # complex: a trailing axis of 2 reals, no copy
        ws = wire.shape.as_list()
        s = ws[split_axis] // n
        # Send buffer [n, piece]: piece j = wire[.., j*s:(j+1)*s, ..] made contiguous. With the
        # axes before split_axis merged into a and those after into b, that is one
        # block transpose [a, n, s*b] -> [n, a, s*b]; none at all when a == 1 (split
        # along the leading axis).
        a, b = int(np.prod(ws[:split_axis])), int(np.prod(ws[split_axis + 1:]))
        send = tf.reshape(wire, [n, a * s * b] if a == 1 else [a, n, s * b])
        if a > 1:
            send = tf.reshape(tf.transpose(send, [1, 0, 2]), [n, a * s * b])
        recv = self._exchange_pieces(send, mesh_axis)
        # recv [n, piece] (in the order of the source rank), each piece of the wire shape
        # with split_axis reduced to s; concatenating along concat_axis is the inverse
        # block transpose [n, c, d] -> [c, n, d] (c: the piece's axes before
        # concat_axis merged, d: concat_axis and the axes after), none when c == 1.
        piece = list(ws)
        piece[split_axis] = s
        c = int(np.prod(piece[:concat_axis]))
        if c > 1:
            recv = tf.transpose(tf.reshape(recv, [n, c, -1]), [1, 0, 2])
        new_shape = list(ws)
        new_shape[split_axis] = s
        new_shape[concat_axis] *= n
        return self.LaidOutTensor([back(tf.reshape(recv, new_shape))])

    def _exchange_pieces(self, send, mesh_axis):
        """Row ``j`` of ``send`` (``[n, ...]``, wire dtype) to rank ``j`` along the axis;
        the rows received, in the order of the source rank."""
        recv = self._issue("alltoall", hvd.alltoall, send, process_set=self._axis_sets[mesh_axis])
        self._record("alltoall", recv)
        return recv

    def alltoall_pieces(self, x, mesh_axis):
        """Exchange pieces that are already laid out: ``x[j]`` goes to rank ``j``.

        The building block of :meth:`alltoall` for callers that write the send
        buffer in this layout themselves (e.g. fused into the op before the exchange,
        see ``flowpm_mtf.mesh.fft.FFT3DOperation``) and read the received pieces directly.

        Parameters
        ----------
        x : LaidOutTensor
            Slice of shape ``[n, ...]``, ``n`` the size of ``mesh_axis``.
        mesh_axis : int

        Returns
        -------
        LaidOutTensor
            Shape ``[n, ...]``: row ``i`` is the piece rank ``i`` sent to this rank.
        """
        t = x.to_laid_out_tensor().one_slice
        n = self.shape[mesh_axis].size
        shape = t.shape.as_list()
        if not shape or shape[0] != n:
            raise ValueError("alltoall_pieces: the slice must have a leading axis of %d pieces, "
                             "got shape %s" % (n, shape))
        if n == 1:
            return self.LaidOutTensor([t])
        wire, back = _to_wire(t)
        recv = self._exchange_pieces(tf.reshape(wire, [n, -1]), mesh_axis)
        return self.LaidOutTensor([back(tf.reshape(recv, wire.shape))])

    def receive(self, x, mesh_axis, source_pcoord):
        """Each rank receives the slice of rank ``source_pcoord[own pcoord]`` along the axis.

        Only the sender's slice travels: an alltoall with uneven splits in which
        every rank sends its slice to the ranks that want it and nothing to the
        others. ``None`` in ``source_pcoord`` means "receive zeros".
        """
        x = x.to_laid_out_tensor()
        n = self.shape[mesh_axis].size
        if len(source_pcoord) != n:
            raise ValueError("receive: source_pcoord has %d entries for a mesh axis of size %d"
                             % (len(source_pcoord), n))
        if list(source_pcoord) == list(range(n)):
            return x
        t = x.one_slice
        shape = t.shape.as_list()
        me = self._pcoord[mesh_axis]
        if n == 1:  # only "receive zeros" is left
            return self.LaidOutTensor([tf.zeros(shape, t.dtype)])
        wire, back = _to_wire(t)
        flat = tf.reshape(wire, [-1])
        length = int(np.prod(wire.shape.as_list()))
        dests = [q for q in range(n) if source_pcoord[q] == me]
        send = tf.concat([flat] * len(dests), axis=0) if dests else flat[:0]
        splits = [length if source_pcoord[q] == me else 0 for q in range(n)]
        recv, _ = self._issue("receive", hvd.alltoall, send,
                              splits=tf.constant(splits, tf.int32),
                              process_set=self._axis_sets[mesh_axis])
        src = source_pcoord[me]
        self._record("receive", None,
                     static_bytes=length * wire.dtype.size if src not in (None, me) else 0)
        if src is None:
            # recv is empty; concatenating it keeps the alltoall (which still sends
            # our slice to others) in the graph, where zeros alone would not.
            recv = tf.concat([recv, tf.zeros_like(flat)], axis=0)
        return self.LaidOutTensor([back(tf.reshape(recv, wire.shape))])

    # ------------------------------------------------------------------ random
    def random(self, shape, tf_fn, kwargs):
        """Call a random TF op (e.g. ``tf.random.uniform``) on this rank's slice.

        The seed is derived deterministically (SHA-256, not Python's salted
        ``hash``) from the user's ``seed`` in ``kwargs`` or, if absent, from the
        name of the Mesh TF operation being lowered (unique in its graph), and
        from the slice's position
        along the *split* tensor axes: ranks holding the same slice (replicated
        axes) draw identical values without communication, and every run gives
        the same numbers.
        """
        kwargs = dict(kwargs)
        user_seed = kwargs.pop("seed", None)
        base = ("user", user_seed) if user_seed is not None else (
            "auto", tf.get_default_graph().get_name_scope())
        slice_begin = tuple(self.slice_begin(shape, self._pnum))
        seed = _stable_seed(base, shape.to_string, slice_begin)
        return self.LaidOutTensor([tf_fn(self.slice_shape(shape), seed=seed, **kwargs)])

    # ------------------------------------------------------------------ import / export
    def _check_full(self, tensor_shape, what):
        """Raise :class:`FullSizeError` if ``what`` needs a too large split tensor whole."""
        tensor_shape = mtf.convert_to_shape(tensor_shape)
        if self.tensor_layout(tensor_shape).is_fully_replicated:
            return  # the slice is the full tensor: nothing is gathered or sliced
        check_full_size(tensor_shape.size, self.max_full_elements,
                        "%s of %s" % (what, tensor_shape.to_string))

    def _local_slice_of_full(self, tf_x, tensor_shape):
        if self.tensor_layout(tensor_shape).is_fully_replicated:
            return tf_x
        return tf.slice(tf_x, self.slice_begin(tensor_shape, self._pnum),
                        self.slice_shape(tensor_shape))

    def _initial_slice(self, variable):
        """This rank's initial slice of an mtf variable (see :mod:`hvd_mesh_impl.slice_init`)."""
        shape = variable.outputs[0].shape
        begin = self.slice_begin(shape, self._pnum)
        size = self.slice_shape(shape)
        if isinstance(variable, mtf.StackedVariable):
            members = variable._stacked_members  # set by mtf_compat.enable_lazy_masters
            parts = [self._member_initial_slice(m, begin[1:], size[1:])
                     for m in members[begin[0]:begin[0] + size[0]]]
            return tf.stack(parts)
        return self._member_initial_slice(variable, begin, size)

    def _member_initial_slice(self, variable, begin, size):
        master = _lazy_master(variable)
        shape = variable.outputs[0].shape
        if master is None or master.materialized:
            # A master already exists (graph built before the patch, or the program
            # asked for it): take this slice of its initial value.
            if list(size) != shape.to_integer_list:
                self._check_full(shape, "the initial value of master variable %r" % variable.name)
            initial = tf.convert_to_tensor(variable.get_master().initial_value)
            return tf.slice(initial, begin, size) if list(size) != shape.to_integer_list \
                else initial
        limit = self.max_full_elements if list(size) != shape.to_integer_list else None
        return slice_init.initial_slice(master.initializer, shape.to_integer_list, begin, size,
                                        master.dtype, variable.name, limit)

    def import_tf_tensor(self, x, tf_x):
        """Each rank takes its slice of the full tensor ``tf_x``.

        Raises
        ------
        FullSizeError
            If ``x`` is split over more than one rank and has more than
            ``max_full_elements`` elements (every rank would hold ``tf_x``).
        """
        self._check_full(x.shape, "import_tf_tensor")
        return self.LaidOutTensor([self._local_slice_of_full(tf_x, x.shape)])

    def export_to_tf_tensor(self, x, laid_out_x):
        """The **full** tensor ``x`` on every rank, gathered along each split mesh axis.

        See :meth:`local_slice` for this rank's slice without communication.

        Raises
        ------
        FullSizeError
            If ``x`` is split over more than one rank and has more than
            ``max_full_elements`` elements.
        """
        self._check_full(x.shape, "export_to_tf_tensor")
        t = laid_out_x.to_laid_out_tensor()
        layout = self.tensor_layout(x.shape)
        for mesh_axis, tensor_axis in enumerate(layout.mesh_axis_to_tensor_axis(self.ndims)):
            if tensor_axis is not None:
                t = self.allconcat(t, mesh_axis, tensor_axis)
        return t.one_slice

    def local_slice(self, laid_out_x):
        """This rank's slice as a ``tf.Tensor`` (no communication)."""
        return laid_out_x.to_laid_out_tensor().one_slice

    def local_slice_begin(self, tensor_shape):
        """Index of this rank's slice in the full tensor, one int per tensor axis."""
        return self.slice_begin(mtf.convert_to_shape(tensor_shape), self._pnum)


def export_local_slice(lowering, x):
    """This rank's slice of the mtf tensor ``x`` after ``lowering``, without communication.

    Parameters
    ----------
    lowering : mtf.Lowering
    x : mtf.Tensor

    Returns
    -------
    tf.Tensor
        The slice, of shape ``mesh_impl.slice_shape(x.shape)``.
    """
    impl = lowering.mesh_impl(x)
    laid_out = lowering.tensors[x].to_laid_out_tensor()
    if isinstance(impl, HvdSimdMeshImpl):
        return impl.local_slice(laid_out)
    raise TypeError("export_local_slice needs an HvdSimdMeshImpl lowering, got %s"
                    % type(impl).__name__)
