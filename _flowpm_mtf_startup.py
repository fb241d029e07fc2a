"""flowpm-mtf's interpreter start-up hook: Mesh TensorFlow imports in any order.

``flowpm_mtf_startup.pth``, which ``setup.py`` installs next to the packages (a wheel's
``pip install .``, the editable install of ``scripts/setup_env.sh``), calls
:func:`install` when Python starts. It imports only :mod:`sys` and puts one entry on
``sys.meta_path`` that compares each imported name with ``mesh_tensorflow`` and does
nothing else: a program that never imports Mesh TF is not changed (no TensorFlow
import, no environment variable, TensorFlow's own start-up lines).

On the first ``import mesh_tensorflow``, whoever makes it, the entry removes itself,
loads :mod:`hvd_mesh_impl.tf_compat` from its file (without running
``hvd_mesh_impl/__init__.py``, which imports Mesh TF) and calls
:func:`hvd_mesh_impl.tf_compat.install`: the shims Mesh TF 0.1.21 needs on TensorFlow
>= 2.13 (none on 2.12), with TensorFlow's C++ start-up lines hidden when that is the
first TensorFlow import (``FLOWPM_MTF_TF_LOGS=1`` shows them). Then Mesh TF loads as
usual.
"""
import sys

__all__ = ["install", "uninstall", "installed"]

_TRIGGER = "mesh_tensorflow"
_TF_COMPAT = "hvd_mesh_impl.tf_compat"


class _StartupHook:
    """The ``sys.meta_path`` entry of :func:`install`; finds nothing itself."""

    def find_spec(self, name, path=None, target=None):
        if name != _TRIGGER:
            return None
        uninstall()
        tf_compat = load_tf_compat()
        if tf_compat is not None:
            tf_compat.install()
        return None


def load_tf_compat():
    """:mod:`hvd_mesh_impl.tf_compat`, loaded from its file if it is not imported yet.

    The one loader of it without ``hvd_mesh_impl/__init__.py``: this hook's, and
    ``flowpm_mtf/__init__.py``'s (which installs its import hook).

    Returns
    -------
    module or None
        None if ``hvd_mesh_impl`` cannot be found (e.g. the package was removed).
    """
    mod = sys.modules.get(_TF_COMPAT)
    if mod is not None:
        return mod
    import importlib.util
    import os

    pkg = importlib.util.find_spec("hvd_mesh_impl")  # a top-level name: imports nothing
    if pkg is None or not pkg.submodule_search_locations:
        return None
    spec = importlib.util.spec_from_file_location(
        _TF_COMPAT, os.path.join(list(pkg.submodule_search_locations)[0], "tf_compat.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[_TF_COMPAT] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[_TF_COMPAT]
        raise
    return mod


def install():
    """Put the hook on ``sys.meta_path`` unless Mesh TF is imported already. Idempotent."""
    if _TRIGGER in sys.modules or installed():
        return
    sys.meta_path.insert(0, _StartupHook())


def uninstall():
    """Remove the hook (nothing if it is not there)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _StartupHook)]


def installed():
    """Whether the hook is on ``sys.meta_path``."""
    return any(isinstance(f, _StartupHook) for f in sys.meta_path)
