"""Distributed FlowPM on Mesh TensorFlow.

Importing the package imports no TensorFlow; it only installs
:func:`hvd_mesh_impl.tf_compat.install_import_hook`, so that Mesh TensorFlow 0.1.21
imports on TensorFlow >= 2.13 whichever module imports it first (the shims are
applied when ``mesh_tensorflow`` is imported; nothing changes on TF 2.12).
``hvd_mesh_impl.tf_compat`` is loaded from its file here, without running
``hvd_mesh_impl/__init__.py`` (which imports Mesh TF).
"""
import sys as _sys


def _load_tf_compat():
    name = "hvd_mesh_impl.tf_compat"
    mod = _sys.modules.get(name)
    if mod is None:
        import importlib.util
        import os

        pkg = importlib.util.find_spec("hvd_mesh_impl")
        spec = importlib.util.spec_from_file_location(
            name, os.path.join(list(pkg.submodule_search_locations)[0], "tf_compat.py"))
        mod = importlib.util.module_from_spec(spec)
        _sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return mod


_load_tf_compat().install_import_hook()
