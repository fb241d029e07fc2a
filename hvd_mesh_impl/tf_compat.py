"""Shims that let Mesh TensorFlow 0.1.21 import on TensorFlow >= 2.13 (no Mesh TF import).

Mesh TF 0.1.21 (2021, dormant upstream) uses two TensorFlow names that newer
TensorFlow releases no longer have:

* ``from tensorflow.compat.v1 import estimator as tf_estimator`` (``mesh_tensorflow/ops.py``,
  at import): ``tensorflow_estimator`` is gone from TF 2.16 and the ``estimator``
  attribute of ``tf.compat.v1`` with it (on TF 2.13-2.15 it exists while the
  ``tensorflow-estimator`` distribution is installed). Mesh TF's core needs only the
  base classes ``CheckpointSaverListener`` and ``SessionRunHook`` (for its checkpoint
  hooks, which we never use) and the name ``tpu``. :func:`install` sets
  ``tf.compat.v1.estimator`` to a stub module with these names: the two classes are
  TensorFlow's own ``tf.compat.v1.train.CheckpointSaverListener`` /
  ``SessionRunHook`` where they still exist (they do on 2.21), else empty base
  classes; ``tpu`` is an empty module. ``ModeKeys`` (used only by Mesh TF's
  ``transformer`` models, not imported by ``import mesh_tensorflow``) is added too.
* ``ops.register_tensor_conversion_function`` (``mesh_tensorflow/tpu_variables.py``, at
  import) moved to ``tensorflow.python.framework.tensor_conversion_registry`` (TF 2.13);
  :func:`install` aliases it back onto ``tensorflow.python.framework.ops``.

Both are harmless on TensorFlow 2.12 (the names exist there; nothing is changed) and
idempotent. They must be in place before ``import mesh_tensorflow``: ``hvd_mesh_impl``
applies them first thing on import, and ``flowpm_mtf`` (whose package import stays free
of TensorFlow) through :func:`install_import_hook`, which applies them when
``mesh_tensorflow`` is imported the first time, whatever imports it. A script that
imports ``mesh_tensorflow`` before any of our packages fails on TF >= 2.16 with
``cannot import name 'estimator' from 'tensorflow.compat.v1'``: import
``hvd_mesh_impl`` (or anything of ``flowpm_mtf``) first.
"""
import sys
import types

_ESTIMATOR_MODULE = "tensorflow.compat.v1.estimator"
_installed = []


def _stub_estimator(tf1):
    train = getattr(tf1, "train", None)

    def base(name):
        cls = getattr(train, name, None) if train is not None else None
        return cls if cls is not None else type(name, (object,), {"__module__": _ESTIMATOR_MODULE})

    class ModeKeys:
        TRAIN = "train"
        EVAL = "eval"
        PREDICT = "infer"

    est = types.ModuleType(_ESTIMATOR_MODULE, "flowpm-mtf stub of tf.compat.v1.estimator "
                           "(hvd_mesh_impl.tf_compat): the names Mesh TF 0.1.21 imports.")
    est.CheckpointSaverListener = base("CheckpointSaverListener")
    est.SessionRunHook = base("SessionRunHook")
    est.ModeKeys = ModeKeys
    est.tpu = types.ModuleType(_ESTIMATOR_MODULE + ".tpu", "flowpm-mtf stub (empty)")
    est._flowpm_mtf_stub = True
    return est


def install():
    """Apply the shims (imports TensorFlow). Idempotent.

    Returns
    -------
    list of str
        The shims applied by this call (empty on TF 2.12, or when already applied).
    """
    import tensorflow.compat.v1 as tf1
    from tensorflow.python.framework import ops

    done = []
    try:
        tf1.estimator  # TF <= 2.15 with tensorflow-estimator: the real one (lazily loaded)
    except (AttributeError, ImportError):
        est = _stub_estimator(tf1)
        tf1.estimator = est
        sys.modules[_ESTIMATOR_MODULE] = est
        done.append("estimator")
    if not hasattr(ops, "register_tensor_conversion_function"):
        from tensorflow.python.framework import tensor_conversion_registry

        ops.register_tensor_conversion_function = \
            tensor_conversion_registry.register_tensor_conversion_function
        done.append("register_tensor_conversion_function")
    _installed.extend(done)
    return done


def installed():
    """The shims applied in this process so far (see :func:`install`)."""
    return list(_installed)


class _MeshTFImportHook:
    """A ``sys.meta_path`` entry that runs :func:`install` before ``mesh_tensorflow`` loads.

    It finds nothing itself (the normal finders load Mesh TF) and removes itself on
    first use, so it costs one string comparison per import until then.
    """

    def find_spec(self, name, path=None, target=None):
        if name != "mesh_tensorflow":
            return None
        remove_import_hook()
        install()
        return None


def install_import_hook():
    """Apply :func:`install` when ``mesh_tensorflow`` is imported (now, if it already is).

    Does not import TensorFlow until then. Idempotent.
    """
    if "mesh_tensorflow" in sys.modules:
        return
    if not any(isinstance(f, _MeshTFImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _MeshTFImportHook())


def remove_import_hook():
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _MeshTFImportHook)]
