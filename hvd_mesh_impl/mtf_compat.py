"""Backend-neutral fixes to Mesh TensorFlow 0.1.21 (no Horovod import).

Stock Mesh TF decides whether an operation takes part in ``mtf.gradients`` with
``Operation.has_gradient``, which requires a *floating* input and output. Every
operation on complex tensors (FFT kernels, collectives that move k-space data)
is therefore silently skipped and the gradient through it is ``None``.

:func:`enable_complex_gradients` widens that test to complex dtypes. The
gradients of Mesh TF's data-movement operations (reshape, alltoall, allconcat,
shift, ...) are linear maps of the upstream gradient and are valid for complex
tensors as they are. Elementwise products of two complex tensors use Mesh TF's
``dy * other`` rule, which lacks the complex conjugate: differentiable code must
multiply complex fields by *real* kernels, or use an op with its own gradient
(as ``flowpm_mtf`` does).

Stock Mesh TF also creates a full-size *master* ``tf.Variable`` for every
``mtf.Variable`` when the Mesh TF graph is built (``Variable.__init__`` calls
``tf.get_variable`` with the full shape and initializer), before any MeshImpl
is known. :func:`enable_lazy_masters` defers that call until something asks for
the master (``get_master``, ``master_device``, ``assign_to_master``), and
records the initializer. ``mtf.Lowering`` creates the masters first for every
mesh whose implementation does not declare ``slice_only_variables = True``
(Mesh TF's ``PlacementMeshImpl`` and ``SimdMeshImpl`` need them), so that
:class:`~hvd_mesh_impl.HvdSimdMeshImpl` can initialise each rank's slice
without a full-size master, initializer op or broadcast in the TF graph. The
master, when created, is the same ``tf.get_variable`` call
in the variable scope, graph and device of the ``mtf.get_variable`` call.
Autostacked variables (``mtf.StackedVariable``) keep their members and read
their masters lazily too.

:func:`apply` is the one place that patches Mesh TF: it applies both, once
(idempotent). Importing :mod:`hvd_mesh_impl` (any of its modules, this one
included) calls it, after the TensorFlow shims Mesh TF needs to import
(:mod:`hvd_mesh_impl.tf_compat`); :class:`~hvd_mesh_impl.HvdSimdMeshImpl`,
:mod:`flowpm_mtf.mesh.fft` and :mod:`flowpm_mtf.mesh.complex_ops` call it too, to say
what they rely on. Build Mesh TF graphs after the import: a variable created before it has an eager
full-size master (HvdSimdMeshImpl then initialises from it, subject to its
``max_full_elements`` limit).
"""
import mesh_tensorflow as mtf
import tensorflow.compat.v1 as tf

_PATCHED_ATTR = "_flowpm_mtf_complex_gradients"


def apply():
    """Apply every fix of this module to Mesh TF: the one place Mesh TF is patched.

    Idempotent: a fix already in effect is left as it is.

    Returns
    -------
    list of str
        The fixes applied by this call (``"complex_gradients"``, ``"lazy_masters"``);
        empty when all were in effect.
    """
    done = []
    if enable_complex_gradients():
        done.append("complex_gradients")
    if enable_lazy_masters():
        done.append("lazy_masters")
    return done


def _differentiable(dtype):
    return dtype.is_floating or dtype.is_complex


def _has_gradient(self):
    return bool(
        [t for t in self.inputs if _differentiable(t.dtype)]
        and [t for t in self.outputs if _differentiable(t.dtype)]
    )


def enable_complex_gradients():
    """Let ``mtf.gradients`` flow through operations with complex tensors.

    Returns
    -------
    bool
        True if the patch was applied by this call, False if it already was.
    """
    if getattr(mtf.Operation, _PATCHED_ATTR, False):
        return False
    mtf.Operation.has_gradient = property(_has_gradient)
    setattr(mtf.Operation, _PATCHED_ATTR, True)
    return True


def complex_gradients_enabled():
    """Whether :func:`enable_complex_gradients` is in effect."""
    return bool(getattr(mtf.Operation, _PATCHED_ATTR, False))


# ----------------------------------------------------------------------------- lazy masters
_LAZY_ATTR = "_flowpm_mtf_lazy_masters"


class LazyMaster:
    """The ``tf.get_variable`` call of an ``mtf.Variable``'s master, made on first use.

    Attributes
    ----------
    full_name : str
        The master's variable name (variable scope + name).
    initializer : callable or None
        The initializer given to ``mtf.get_variable``, else the variable
        scope's, else None (TensorFlow's default).
    shape : list of int
    dtype : tf.DType
        The master dtype.
    """

    def __init__(self, mesh, name, shape, dtype, initializer, trainable, kwargs):
        self._graph = tf.get_default_graph()
        self._scope = tf.get_variable_scope()
        self._placer = mesh.variable_placer_fn
        self._name = name
        self._trainable = trainable
        self._kwargs = dict(kwargs)
        self._explicit_initializer = initializer
        self.shape = list(shape)
        self.dtype = dtype
        self.full_name = self._scope.name + "/" + name if self._scope.name else name
        self.variable = None

    @property
    def initializer(self):
        if self._explicit_initializer is not None:
            return self._explicit_initializer
        return self._scope.initializer

    @property
    def materialized(self):
        """Whether the master ``tf.Variable`` exists."""
        return self.variable is not None

    def materialize(self):
        """Create (once) and return the master ``tf.Variable``."""
        if self.variable is None:
            with self._graph.as_default(), tf.control_dependencies(None), \
                    tf.variable_scope(self._scope, auxiliary_name_scope=False), \
                    tf.device(self._placer), mtf.utils.outside_all_rewrites():
                var = tf.get_variable(self._name, self.shape, dtype=self.dtype,
                                      initializer=self._explicit_initializer,
                                      trainable=self._trainable, **self._kwargs)
            # TF may add a suffix ("x_1") when a TF op or name scope "x" exists
            # already; Mesh TF keeps using full_name.
            self.variable = var
        return self.variable


def _variable_init(self, mesh, name, shape, dtype, initializer, trainable, **kwargs):
    """``mtf.Variable.__init__`` with a :class:`LazyMaster` instead of ``tf.get_variable``."""
    mtf.Operation.__init__(self, [], mesh, name="name_will_be_set_later")
    if not isinstance(dtype, mtf.VariableDType):
        raise ValueError("dtype must be a VariableDType got %s" % dtype)
    self._dtype = dtype
    self._trainable = trainable
    if not isinstance(self, mtf.StackedVariable):
        self._lazy_master = LazyMaster(mesh, name, shape.to_integer_list, dtype.master_dtype,
                                       initializer, trainable, kwargs)
        self._name = self._lazy_master.full_name
    self._outputs = [mtf.Tensor(self, shape, dtype.activation_dtype)]
    self._splittable_dims, self._unsplittable_dims = (
        self._initialize_all_dimensions_as_splittable())
    self.graph.all_variables.append(self)
    if trainable:
        self.graph.trainable_variables.append(self)


def _stacked_init(self, vs):
    """``mtf.StackedVariable.__init__`` that keeps its members instead of their masters."""
    shape = mtf.Shape([mtf.Dimension("stacked", len(vs))] + vs[0].shape.dims)
    name = "stacked/" + vs[0].name
    mtf.Variable.__init__(self, vs[0].mesh, name, shape, vs[0].dtype, None, vs[0].trainable)
    self._name = name
    self._stacked_members = list(vs)
    self._original_names = [v.name for v in vs]
    self._splittable_dims, self._unsplittable_dims = (
        self._initialize_all_dimensions_as_splittable())


def _lowering_init(self, graph, mesh_to_impl, *args, **kwargs):
    """``mtf.Lowering.__init__`` that first creates the masters a MeshImpl needs.

    Masters of variables on a mesh whose implementation does not declare
    ``slice_only_variables = True`` are created before anything is lowered, in
    the order of the variables, as stock Mesh TF had them (their TF names then
    match the Mesh TF names).
    """
    for v in list(graph.all_variables):
        master = lazy_master(v)
        impl = mesh_to_impl.get(v.mesh)
        if master is not None and not getattr(impl, "slice_only_variables", False):
            master.materialize()
    _ORIGINAL["Lowering.__init__"](self, graph, mesh_to_impl, *args, **kwargs)


_ORIGINAL = {}


def enable_lazy_masters():
    """Create Mesh TF master variables on first use instead of at graph construction.

    Returns
    -------
    bool
        True if the patch was applied by this call, False if it already was.
    """
    if getattr(mtf.Variable, _LAZY_ATTR, False):
        return False
    _ORIGINAL["Lowering.__init__"] = mtf.Lowering.__init__
    mtf.Lowering.__init__ = _lowering_init
    mtf.Variable.__init__ = _variable_init
    # upstream reads self._master in master_device / get_master / assign_to_master
    mtf.Variable._master = property(lambda self: self._lazy_master.materialize())
    mtf.StackedVariable.__init__ = _stacked_init
    mtf.StackedVariable._masters = property(
        lambda self: [v.get_master() for v in self._stacked_members])
    setattr(mtf.Variable, _LAZY_ATTR, True)
    return True


def lazy_master(variable):
    """The :class:`LazyMaster` of an ``mtf.Variable``, or None (created before the patch)."""
    return getattr(variable, "_lazy_master", None)
