"""Distributed FlowPM on Mesh TensorFlow.

Importing the package imports no TensorFlow; it only installs
:func:`hvd_mesh_impl.tf_compat.install_import_hook`, so that Mesh TensorFlow 0.1.21
imports on TensorFlow >= 2.13 whichever module imports it first (the shims are
applied when ``mesh_tensorflow`` is imported; nothing changes on TF 2.12).
``hvd_mesh_impl.tf_compat`` is loaded from its file, without running
``hvd_mesh_impl/__init__.py`` (which imports Mesh TF), by the loader of the start-up
hook, :func:`_flowpm_mtf_startup.load_tf_compat` (a top-level module installed with
the packages, and at the root of a checkout beside them).

The public API (:mod:`flowpm_mtf.api`: ``linear_field``, ``lpt_init``, ``cic_paint``,
``power_spectrum``, ``SimConfig``, ...) is re-exported here and loaded on first use of
one of its names (module ``__getattr__``), ``flowpm_mtf.nbody`` included (the module of
the time loop is ``flowpm_mtf.physics.nbody``).

The package's folders follow ``docs/design.md``: the front (this package's modules:
``api``, ``config``, ``layout``, ``backend``, ``cli``, ``errors``, ``logs``), ``mesh``
(distributed primitives, no physics), ``physics``, ``gradients``, ``runs`` (files and run
state), ``jobs`` and ``native``.
"""
from _flowpm_mtf_startup import load_tf_compat as _load_tf_compat

_load_tf_compat().install_import_hook()


# flowpm_mtf.api's __all__ (no name of it is a submodule's): kept equal to it by
# tests/test_api_flowpm.py. Listed here so that the package imports no TensorFlow.
_API_NAMES = frozenset((
    "SimConfig", "Cosmology", "LensingConfig", "LightconeGeometry", "State", "ModelGradient",
    "Backend", "Lightcone", "default_stages", "process_grid", "backend_for", "field_shape",
    "linear_matter_power", "linear_field", "lpt_init", "cic_paint", "cic_readout",
    "global_positions", "power_spectrum", "lensing_geometry", "density_plane",
    "born_convergence", "lightcone", "adjoint_gradient", "nbody"))


def __getattr__(name):  # lazy: flowpm_mtf.api imports TensorFlow and Mesh TF
    if name in _API_NAMES:
        import importlib

        return getattr(importlib.import_module(".api", __name__), name)
    raise AttributeError("module %r has no attribute %r" % (__name__, name))


def __dir__():
    return sorted(set(globals()) | _API_NAMES)
