"""Mesh TensorFlow ``MeshImpl`` on Horovod process sets: one slice per MPI rank.

>>> from hvd_mesh_impl import HvdSimdMeshImpl          # doctest: +SKIP
>>> impl = HvdSimdMeshImpl([("row", 2), ("col", 2)], [("nx", "row"), ("ny", "col")])

Importing this package applies :func:`hvd_mesh_impl.mtf_compat.enable_complex_gradients`
and :func:`hvd_mesh_impl.mtf_compat.enable_lazy_masters` (build Mesh TF graphs after it).
Horovod itself is imported only when :class:`HvdSimdMeshImpl` (or ``runtime``) is used;
:func:`ordered_update_op` and :class:`FullSizeError` need no Horovod.
"""
from .mtf_compat import enable_complex_gradients, enable_lazy_masters
from .slice_init import FullSizeError
from .training import ordered_update_op

enable_complex_gradients()
enable_lazy_masters()

__all__ = ["HvdSimdMeshImpl", "export_local_slice", "enable_complex_gradients",
           "enable_lazy_masters", "FullSizeError", "ordered_update_op", "runtime"]


def __getattr__(name):  # lazy: importing Horovod starts its C++ library
    import importlib

    if name in ("HvdSimdMeshImpl", "export_local_slice"):
        return getattr(importlib.import_module(".mesh_impl", __name__), name)
    if name == "runtime":
        return importlib.import_module(".runtime", __name__)
    raise AttributeError("module %r has no attribute %r" % (__name__, name))
