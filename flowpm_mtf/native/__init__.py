"""Native TensorFlow custom ops for the CPU (C++ sources in this folder).

Each ``<name>.cc`` here is compiled into ``lib<name>.tf<TF version>.so`` by
``python -m flowpm_mtf.native.build`` (run by ``scripts/setup_env.sh``); a stamp
file beside the library records the source hash and the TensorFlow version it
was built for, so a library built for other sources or another TensorFlow is
never loaded, and the instruction-set flags it was compiled with
(:func:`arch_flags`; other flags rebuild it, but any of them loads).

:func:`load` returns the loaded op module, or ``None`` when the library is
missing or stale. The environment variable ``FLOWPM_MTF_NATIVE`` chooses:

``auto`` (default)
    use the native op when it is built, else the TensorFlow path (logged once);
``0``
    never use native ops (pure TensorFlow; e.g. to compare the two paths);
``require``
    raise if a native op is missing or stale (the test suite sets this, so CI
    checks that set-up built them).

Native ops are CPU kernels: on a GPU the TensorFlow ops (cuFFT, GPU kernels) stay
the path, chosen by the callers from the device of the computation.
"""
import hashlib
import logging
import os
import re
import sys

log = logging.getLogger(__name__)

HERE = os.path.dirname(os.path.abspath(__file__))
_cache = {}


def mode():
    """``"auto"``, ``"0"`` or ``"require"`` from ``FLOWPM_MTF_NATIVE``."""
    value = os.environ.get("FLOWPM_MTF_NATIVE", "auto").strip().lower()
    if value not in ("auto", "0", "require"):
        raise ValueError("FLOWPM_MTF_NATIVE must be auto, 0 or require, got %r" % value)
    return value


def source_path(name):
    """Path of the C++ source ``<name>.cc``."""
    return os.path.join(HERE, name + ".cc")


def library_path(name):
    """Path of the built library for this TensorFlow: ``lib<name>.tf<version>.so``.

    A library is built against one TensorFlow (its headers and
    ``libtensorflow_framework``); the version in the name lets the two stacks'
    virtualenvs (``FLOWPM_MTF_STACK``, docs/setup.md) share one checkout without
    rebuilding each other's libraries.
    """
    return os.path.join(HERE, "lib%s.tf%s.so" % (name, tf_version()))


# Distributions that provide the ``tensorflow`` module.
_TF_DISTS = ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tensorflow-intel",
             "tensorflow-macos", "tf-nightly")


def tf_version():
    """TensorFlow's version, without importing it when it is not imported yet.

    (``python -m flowpm_mtf.native.build`` on up-to-date libraries then takes a
    fraction of a second instead of TensorFlow's import time.)
    """
    tf = sys.modules.get("tensorflow")
    if tf is not None and getattr(tf, "__version__", None):
        return tf.__version__
    from importlib import metadata

    for dist in _TF_DISTS:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    import tensorflow as tf

    return tf.__version__


def names():
    """Stems of the op libraries: one per ``<name>.cc`` of this folder, sorted."""
    return sorted(f[:-3] for f in os.listdir(HERE) if f.endswith(".cc"))


_LOCAL_INCLUDE = re.compile(rb'^\s*#\s*include\s*"([^"]+)"', re.M)


def local_headers(path):
    """The headers of this folder that ``path`` includes (``#include "x.h"``), directly
    or through another one, in the order first met."""
    found, todo = [], [path]
    while todo:
        with open(todo.pop(0), "rb") as f:
            text = f.read()
        for inc in _LOCAL_INCLUDE.findall(text):
            header = os.path.join(HERE, inc.decode())
            if os.path.isfile(header) and header not in found:
                found.append(header)
                todo.append(header)
    return found


ARCH_TAG = " arch:"
"""Separates the source/TensorFlow part of a stamp from its :func:`arch_flags`."""


NO_CONTRACTION = "-ffp-contract=off"
"""The flag every native build ends with (:func:`arch_flags`)."""


def arch_flags():
    """The instruction-set flags the native ops are compiled with (a list for g++).

    On x86-64 ``-msse4.1`` by default (the x86-64-v2 level: every x86-64 CPU since
    2008, every HPC node): ``floor`` becomes one instruction, and the CIC ops (paint,
    readout, the adjoint's readout VJP) are markedly faster than with the SSE2
    baseline.
    ``FLOWPM_MTF_NATIVE_ARCH=<march>`` compiles with ``-march=<march>`` instead
    (e.g. ``x86-64-v3``; ``native`` only where the build and compute nodes have
    the same CPU), ``none`` with no instruction-set flag. Other machines: none
    unless the variable names one.

    Always ``-ffp-contract=off``: no multiply and add is fused into one
    instruction, so every level gives the baseline's results bit for bit (the
    vector loops give the same correctly rounded operations lane by lane). g++
    contracts by default in C++, ISO mode included (``-std=c++17`` turns it off
    for C only): built with ``x86-64-v3`` without this flag, the CIC library had
    hundreds of fused multiply-adds and the 2LPT source, the paint and the readout
    differed from the default build's in the last bits. On aarch64,
    whose base instruction set has them, the flag matters at every level.
    """
    import platform

    value = os.environ.get("FLOWPM_MTF_NATIVE_ARCH", "").strip()
    if value.lower() == "none":
        isa = []
    elif value:
        isa = ["-march=%s" % value]
    else:
        isa = ["-msse4.1"] if platform.machine().lower() in ("x86_64", "amd64") else []
    return isa + [NO_CONTRACTION]


def build_stamp(name):
    """:func:`expected_stamp` with the :func:`arch_flags` a build writes and compares."""
    return "%s%s%s" % (expected_stamp(name), ARCH_TAG, " ".join(arch_flags()) or "-")


def expected_stamp(name):
    """The stamp a library built from the current source for this TF must carry.

    Its hash covers the source and the headers of this folder it includes
    (:func:`local_headers`, e.g. ``tf_op.h``): editing a header rebuilds every
    library that includes it.
    """
    h = hashlib.sha256()
    src = source_path(name)
    for path in [src] + sorted(local_headers(src)):
        with open(path, "rb") as f:
            content = f.read()
        if path != src:  # a source alone hashes as before
            h.update(b"\0%s\0" % os.path.basename(path).encode())
        h.update(content)
    return "%s tf-%s" % (h.hexdigest()[:16], tf_version())


def unusable_reason(name):
    """Why the library ``name`` cannot be loaded (not built, or stale), or None if it can."""
    path = library_path(name)
    if not os.path.exists(path):
        return "%s is not built" % path
    try:
        with open(path + ".stamp") as f:
            stamp = f.read().strip()
    except OSError:
        stamp = None
    if stamp is None or stamp.split(ARCH_TAG)[0] != expected_stamp(name):
        return "%s is stale (built for other sources or another TensorFlow)" % path
    return None


def unusable():
    """``{name: reason}`` of every library of this folder that :func:`load` would not load
    (empty with ``FLOWPM_MTF_NATIVE=0``: none is wanted)."""
    if mode() == "0":
        return {}
    reasons = {n: unusable_reason(n) for n in names()}
    return {n: r for n, r in reasons.items() if r is not None}


_gpu_visible = None  # whether TensorFlow sees a GPU, asked once


def gpu_visible():
    """Whether TensorFlow sees a GPU (asked once): unplaced ops then run there, and the
    native CPU ops serve none of them."""
    global _gpu_visible
    if _gpu_visible is None:
        import tensorflow as tf

        _gpu_visible = bool(tf.config.list_physical_devices("GPU"))
    return _gpu_visible


def load(name):
    """Load the op library ``lib<name>.tf<TF version>.so``, or ``None`` if not usable.

    Parameters
    ----------
    name : str
        Stem of the source file (``fft_ops`` for ``fft_ops.cc``).

    Returns
    -------
    module or None
        The module returned by ``tf.load_op_library``.

    Raises
    ------
    RuntimeError
        With ``FLOWPM_MTF_NATIVE=require``, if the library is missing or stale.
    """
    if name in _cache:
        return _cache[name]
    m = mode()
    lib = None
    if m != "0":
        reason = unusable_reason(name)
        if reason is not None:
            if m == "require":
                raise RuntimeError("%s; run: python -m flowpm_mtf.native.build" % reason)
            log.warning("%s: using the TensorFlow path (build with "
                        "python -m flowpm_mtf.native.build)", reason)
        else:
            import tensorflow as tf

            lib = tf.load_op_library(library_path(name))
    _cache[name] = lib
    return lib


def runs_on_cpu(t):
    """Whether an op consuming the tf.Tensor ``t`` runs on a CPU (a native op serves it).

    True when ``t`` is placed on a CPU, or unplaced while TensorFlow sees no GPU
    (an unplaced op goes to the GPU when there is one): on a GPU the TensorFlow
    ops stay the path.
    """
    import tensorflow as tf

    kind = tf.DeviceSpec.from_string(t.device or "").device_type
    if kind:
        return kind.upper() == "CPU"
    return not gpu_visible()


FLOATS = ("float32", "float64")  # the dtypes the floating-point ops are registered for


def ops_for(name, *tensors, dtypes=FLOATS):
    """The op module of ``<name>`` if its ops serve these tensors, else None.

    The one choice between a native op and the TensorFlow path: the native op when
    its library is usable, every tensor has a served dtype, and every tensor's op
    runs on a CPU.

    Parameters
    ----------
    name : str
        Stem of the library (``cic_ops``, ``particle_ops``, ``noise_ops``, ``fft_ops``).
    *tensors : tf.Tensor
        The local tensors the op would consume.
    dtypes : sequence of tf.DType or str, or None
        The dtypes the op is registered for (default float32 and float64); None
        skips the dtype check (ops on bool, integer or complex tensors, or whose
        caller checks the dtype itself).

    Returns
    -------
    module or None
        The module of :func:`load`; None when the library is not usable
        (``FLOWPM_MTF_NATIVE=0``, or missing or stale in ``auto`` mode), when a
        tensor's dtype is not in ``dtypes``, or when an op consuming a tensor would
        not run on a CPU (:func:`runs_on_cpu`).

    Raises
    ------
    RuntimeError
        With ``FLOWPM_MTF_NATIVE=require``, if the library is missing or stale
        (from :func:`load`, which is asked first, whatever the tensors).
    """
    lib = load(name)
    if lib is None:
        return None
    if dtypes is not None:
        import tensorflow as tf

        served = [tf.as_dtype(d) for d in dtypes]
    for t in tensors:
        if dtypes is not None and t.dtype not in served:
            return None
        if not runs_on_cpu(t):
            return None
    return lib
