"""Mesh TensorFlow ``MeshImpl`` on Horovod process sets: one slice per MPI rank.

>>> from hvd_mesh_impl import HvdSimdMeshImpl          # doctest: +SKIP
>>> impl = HvdSimdMeshImpl([("row", 2), ("col", 2)], [("nx", "row"), ("ny", "col")])

Importing this package applies :func:`hvd_mesh_impl.mtf_compat.enable_complex_gradients`.
Horovod itself is imported only when :class:`HvdSimdMeshImpl` (or ``runtime``) is used.
"""
from .mtf_compat import enable_complex_gradients

enable_complex_gradients()

__all__ = ["HvdSimdMeshImpl", "export_local_slice", "enable_complex_gradients", "runtime"]


def __getattr__(name):  # lazy: importing Horovod starts its C++ library
    import importlib

    if name in ("HvdSimdMeshImpl", "export_local_slice"):
        return getattr(importlib.import_module(".mesh_impl", __name__), name)
    if name == "runtime":
        return importlib.import_module(".runtime", __name__)
    raise AttributeError("module %r has no attribute %r" % (__name__, name))
