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
idempotent. They must be in place before ``import mesh_tensorflow``, in any import order:

* the installed package's start-up file ``flowpm_mtf_startup.pth`` (``setup.py``) runs
  :func:`_flowpm_mtf_startup.install` when Python starts: a ``sys.meta_path`` entry that
  imports nothing and does nothing until ``mesh_tensorflow`` is imported, then loads this
  module from its file and calls :func:`install`. A program that never imports Mesh TF is
  not changed (no TensorFlow import, no environment variable);
* ``hvd_mesh_impl`` applies them first thing on import (then our Mesh TF fixes,
  :func:`hvd_mesh_impl.mtf_compat.apply`);
* ``flowpm_mtf`` (whose package import stays free of TensorFlow) through
  :func:`install_import_hook`, for a checkout used without installing it (this module
  loaded from its file by :func:`_flowpm_mtf_startup.load_tf_compat`, the start-up
  hook's loader: one loader for both).

Quiet start-up. :func:`install` imports TensorFlow; when it is the first import of
TensorFlow in the process (and after :func:`install_import_hook`, whoever imports
TensorFlow first) the TensorFlow C++ start-up lines are hidden
(:func:`quiet_tensorflow_import`): ``TF_CPP_MIN_LOG_LEVEL`` defaults to ``1`` (a value in
the environment is kept), and the lines TensorFlow 2.21 writes through absl before its
log level applies (``oneDNN custom operations are on ...`` and absl's ``All log messages
before absl::InitializeLog() ...``) are dropped from the standard error of that import
when their severity is below ``TF_CPP_MIN_LOG_LEVEL``. ``FLOWPM_MTF_TF_LOGS=1``
(:data:`TF_LOGS_ENV`) shows them all (nothing is set or filtered). A program that imports
TensorFlow before any of our packages and before Mesh TF gets TensorFlow's lines as
TensorFlow prints them.

Lean start-up. The same first import of TensorFlow skips TensorFlow's eager load of Keras
(:func:`without_eager_keras`): TensorFlow 2.16+ ends its ``__init__`` by importing
``keras.src.optimizers``, which loads all of Keras 3 (and scikit-learn where it is
installed), about a second of CPU time and 70 MB at every rank's start. Nothing of ours,
nor Mesh TF, nor Horovod (patched: ``patches/horovod-0.28.1-flowpm.patch``) uses Keras;
``tf.keras`` and ``import keras`` still load it on first use.
"""
import os
import re
import sys
import types

_ESTIMATOR_MODULE = "tensorflow.compat.v1.estimator"
_installed = []

TF_LOGS_ENV = "FLOWPM_MTF_TF_LOGS"
"""Environment variable: ``1`` shows TensorFlow's C++ start-up lines (nothing is set or
filtered before our first TensorFlow import); unset or ``0``: they are hidden."""

QUIET_LOG_LEVEL = "1"
"""``TF_CPP_MIN_LOG_LEVEL`` set before our first TensorFlow import unless the environment
has one: TF's C++ INFO lines hidden, warnings and errors shown (the CLI's default too)."""

# One line of absl's log format: severity, MMDD, time (before absl::InitializeLog
# "00:00:<seconds since the epoch>.micro"), thread id, file:line]
_ABSL_LINE = re.compile(rb"^([IWEF])\d{4} [\d:.]+ +\d+ [^ \]]+:\d+\] ")
_ABSL_PREINIT = (b"WARNING: All log messages before absl::InitializeLog() is called are "
                 b"written to STDERR")
_SEVERITY = {b"I": 0, b"W": 1, b"E": 2, b"F": 3}
_filtering = []  # non-empty while a quiet TensorFlow import runs (no nesting)


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

    When this is the process's first import of TensorFlow, its C++ start-up lines are
    hidden (:func:`quiet_tensorflow_import`).

    Returns
    -------
    list of str
        The shims applied by this call (empty on TF 2.12, or when already applied).
    """
    with quiet_tensorflow_import():
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


# ---------------------------------------------------------------- quiet start-up
def tf_logs_requested():
    """Whether the environment asks for TensorFlow's C++ start-up lines.

    Returns
    -------
    bool
        True if :data:`TF_LOGS_ENV` is set to anything but ``0`` / ``false`` / ``no``,
        or TensorFlow's verbose logging is on (``TF_CPP_MAX_VLOG_LEVEL``,
        ``TF_CPP_VMODULE``).
    """
    if os.environ.get(TF_LOGS_ENV, "").strip().lower() not in ("", "0", "false", "no"):
        return True
    return bool(os.environ.get("TF_CPP_MAX_VLOG_LEVEL") or os.environ.get("TF_CPP_VMODULE"))


def _quiet_level():
    """Before the first TensorFlow import: set the log-level default; the severity filtered.

    Returns
    -------
    int or None
        Lines of absl severity below it (0 INFO, 1 WARNING, 2 ERROR) are dropped from
        the import's standard error; None: TensorFlow is already imported, the lines
        are asked for, or ``TF_CPP_MIN_LOG_LEVEL`` is ``0`` or not a number.
    """
    if "tensorflow" in sys.modules or _filtering or tf_logs_requested():
        return None
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", QUIET_LOG_LEVEL)
    try:
        level = int(os.environ["TF_CPP_MIN_LOG_LEVEL"])
    except ValueError:
        return None
    return level if level > 0 else None


def _drop_startup_lines(data, level):
    """``data`` (bytes written to fd 2) without absl lines of severity below ``level``.

    absl's ``All log messages before absl::InitializeLog() ...`` notice goes with them
    when no absl line of the block is kept.
    """
    kept, dropped_all = [], True
    for line in data.splitlines(keepends=True):
        m = _ABSL_LINE.match(line)
        if m is not None:
            if _SEVERITY[m.group(1)] < level:
                continue
            dropped_all = False
        kept.append(line)
    if dropped_all:
        kept = [line for line in kept if line.rstrip(b"\r\n") != _ABSL_PREINIT]
    return b"".join(kept)


class _FilteredStderr:
    """Context: fd 2 into a temporary file, written back without the start-up lines.

    Everything else written to the standard error in the block (Python warnings,
    other threads) comes out in order when the block ends, also on an exception.
    """

    def __init__(self, level):
        self.level = level
        self._saved = self._tmp = None

    def __enter__(self):
        _filtering.append(self)
        try:
            import tempfile

            _flush_stderr()
            self._tmp = tempfile.TemporaryFile()
            self._saved = os.dup(2)
            os.dup2(self._tmp.fileno(), 2)
        except OSError:  # no fd 2, no temporary directory: nothing is filtered
            self._close()
        return self

    def __exit__(self, *exc):
        try:
            if self._saved is not None:
                _flush_stderr()
                os.dup2(self._saved, 2)
                self._tmp.seek(0)
                data = _drop_startup_lines(self._tmp.read(), self.level)
                while data:
                    data = data[os.write(2, data):]
        finally:
            self._close()
            _filtering.remove(self)
        return False

    def _close(self):
        if self._saved is not None:
            os.close(self._saved)
            self._saved = None
        if self._tmp is not None:
            self._tmp.close()
            self._tmp = None


class _NoFilter:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _flush_stderr():
    try:
        if sys.stderr is not None:
            sys.stderr.flush()
    except (OSError, ValueError):
        pass


def quiet_tensorflow_import():
    """A context for the first import of TensorFlow: start-up lines hidden, no Keras.

    If TensorFlow is not imported yet: TensorFlow's eager load of Keras is skipped
    (:func:`without_eager_keras`); and unless :func:`tf_logs_requested`, sets
    ``TF_CPP_MIN_LOG_LEVEL`` to :data:`QUIET_LOG_LEVEL` unless the environment has it,
    and drops from the standard error written in the block the absl lines below that
    level (TensorFlow 2.21 writes ``oneDNN custom operations are on ...`` before its
    level applies). Otherwise it does nothing.

    Returns
    -------
    context manager
    """
    if "tensorflow" in sys.modules or _filtering:
        return _NoFilter()
    return _FirstImport(_quiet_level())


_KERAS_PACKAGES = ("keras", "tf_keras")


class without_eager_keras:  # noqa: N801 (a context manager used like a function)
    """Context: ``import keras`` / ``import tf_keras`` raise ImportError in the block.

    TensorFlow 2.16+ ends its ``__init__`` with
    ``importlib.import_module("keras.src.optimizers")`` (``tf_keras`` with
    ``TF_USE_LEGACY_KERAS``) in a ``try``/``except ImportError`` ("so that ... registration
    of optimizers in the SavedModel registry" happens at load time). Around the first
    ``import tensorflow`` this context maps both packages to None in ``sys.modules``
    (those not imported yet), so that import fails at once and TensorFlow goes on; the
    entries are removed when the block ends. ``tf.keras`` is TensorFlow's lazy module and
    loads Keras on first use, as ``import keras`` does; the only difference is that
    Keras's optimizers enter the SavedModel registry then rather than at
    ``import tensorflow`` (import Keras first if a program needs them there).
    """

    def __enter__(self):
        self._blocked = [name for name in _KERAS_PACKAGES if name not in sys.modules]
        for name in self._blocked:
            sys.modules[name] = None
        return self

    def __exit__(self, *exc):
        for name in self._blocked:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]
        return False


class _FirstImport:
    """Context of the process's first TensorFlow import: no eager Keras; start-up lines
    below ``level`` dropped (None: nothing filtered)."""

    def __init__(self, level):
        self._keras = without_eager_keras()
        self._filter = _NoFilter() if level is None else _FilteredStderr(level)

    def __enter__(self):
        _filtering.append(self)
        self._keras.__enter__()
        try:
            self._filter.__enter__()
        except BaseException:
            self._keras.__exit__(None, None, None)
            _filtering.remove(self)
            raise
        return self

    def __exit__(self, *exc):
        try:
            self._filter.__exit__(*exc)
        finally:
            self._keras.__exit__(*exc)
            _filtering.remove(self)
        return False


class _QuietLoader:
    """Loader of ``tensorflow`` that runs the real one in :class:`_FirstImport`.

    The module's ``__loader__`` and ``__spec__.loader`` are set back to the real loader
    before it runs.
    """

    def __init__(self, loader, level):
        self._loader = loader
        self._level = level

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        with _FirstImport(self._level):
            self._loader.exec_module(module)


# ---------------------------------------------------------------- import hook
class _MeshTFImportHook:
    """A ``sys.meta_path`` entry that runs :func:`install` before ``mesh_tensorflow`` loads.

    It loads nothing itself (the normal finders load Mesh TF) and removes itself on
    first use, so it costs one string comparison per import until then. Before that,
    the first import of ``tensorflow`` (by anyone) runs in
    :func:`quiet_tensorflow_import`: its spec is the normal finders' one with the
    loader wrapped.
    """

    def find_spec(self, name, path=None, target=None):
        if name == "tensorflow":
            return self._quiet_tensorflow_spec(name, path, target)
        if name != "mesh_tensorflow":
            return None
        remove_import_hook()
        install()
        return None

    def _quiet_tensorflow_spec(self, name, path, target):
        if path is not None or "tensorflow" in sys.modules or _filtering:
            return None
        for finder in list(sys.meta_path):
            if isinstance(finder, _MeshTFImportHook) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is None or not hasattr(spec.loader, "exec_module"):
                    return None
                # the default log level is set here, before the import (None: logs kept)
                spec.loader = _QuietLoader(spec.loader, _quiet_level())
                return spec
        return None


def install_import_hook():
    """Apply :func:`install` when ``mesh_tensorflow`` is imported (now, if it already is).

    Does not import TensorFlow until then; the first import of TensorFlow after this
    call hides its C++ start-up lines (:func:`quiet_tensorflow_import`). Idempotent.
    """
    if "mesh_tensorflow" in sys.modules:
        return
    if not any(isinstance(f, _MeshTFImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _MeshTFImportHook())


def remove_import_hook():
    """Remove the hook of :func:`install_import_hook` (nothing if there is none)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _MeshTFImportHook)]
