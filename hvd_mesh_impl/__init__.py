"""Mesh TensorFlow ``MeshImpl`` on Horovod process sets: one slice per MPI rank.

>>> from hvd_mesh_impl import HvdSimdMeshImpl          # doctest: +SKIP
>>> impl = HvdSimdMeshImpl([("row", 2), ("col", 2)], [("nx", "row"), ("ny", "col")])

Importing this package applies our Mesh TF fixes, :func:`hvd_mesh_impl.mtf_compat.apply`
(complex gradients, lazy master variables; build Mesh TF graphs after it).
Horovod itself is imported only when :class:`HvdSimdMeshImpl` (or ``runtime``) is used;
:func:`ordered_update_op` and :class:`FullSizeError` need no Horovod. The TensorFlow
shims that Mesh TF 0.1.21 needs on TF >= 2.13 (:mod:`hvd_mesh_impl.tf_compat`) are
applied first; if that imports TensorFlow for the first time, TensorFlow's C++ start-up
lines are hidden (``FLOWPM_MTF_TF_LOGS=1`` shows them).
"""
from . import tf_compat

tf_compat.install()  # before Mesh TF's import: its TF >= 2.13 shims (no-op on TF 2.12)

from . import mtf_compat  # noqa: E402
from .mtf_compat import enable_complex_gradients, enable_lazy_masters  # noqa: E402,F401
from .slice_init import FullSizeError  # noqa: E402
from .training import ordered_update_op  # noqa: E402

mtf_compat.apply()  # the one place Mesh TF is patched (idempotent)

__all__ = ["HvdSimdMeshImpl", "export_local_slice", "enable_complex_gradients",
           "enable_lazy_masters", "FullSizeError", "ordered_update_op", "runtime"]


def __getattr__(name):  # lazy: importing Horovod starts its C++ library
    import importlib

    if name in ("HvdSimdMeshImpl", "export_local_slice"):
        return getattr(importlib.import_module(".mesh_impl", __name__), name)
    if name == "runtime":
        return importlib.import_module(".runtime", __name__)
    raise AttributeError("module %r has no attribute %r" % (__name__, name))
