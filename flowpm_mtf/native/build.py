"""Build the native ops: ``python -m flowpm_mtf.native.build [name ...]``.

Compiles every ``*.cc`` of this folder (or the named ones) into ``lib<name>.tf<TF version>.so``
with TensorFlow's compile and link flags; a source includes this folder's headers
(``#include "tf_op.h"``) by their name. Extra libraries are declared in the
source by a line ``// LINK: -lfftw3f -lfftw3``, extra compiler flags by a line
``// CXXFLAGS: -fno-math-errno``. The library is written under a
temporary name and renamed, then its stamp is written (see
:func:`flowpm_mtf.native.build_stamp`: the sources, TensorFlow's version and the
instruction-set flags of :func:`flowpm_mtf.native.arch_flags`); an up-to-date library is not rebuilt,
so the command is idempotent and cheap.
"""
import logging
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from . import arch_flags, build_stamp, library_path, source_path
from . import names as all_names

log = logging.getLogger(__name__)

# -Wno-deprecated-declarations: TF 2.21's headers deprecate tsl::Status and errors::*
# (hundreds of warnings per source, from its own headers); the code is unchanged.
CXXFLAGS = ["-std=c++17", "-shared", "-fPIC", "-O3", "-Wno-deprecated-declarations"]


def declared_flags(source, key="LINK"):
    """The ``// <key>:`` flags declared in ``source`` (``LINK`` or ``CXXFLAGS``)."""
    flags = []
    with open(source) as f:
        for line in f:
            m = re.match(r"\s*//\s*%s:\s*(.*)$" % key, line)
            if m:
                flags += shlex.split(m.group(1))
    return flags


def build(name, force=False):
    """Compile ``<name>.cc`` into :func:`~flowpm_mtf.native.library_path` unless it is up to date.

    Returns
    -------
    bool
        True if the library was (re)built.
    """
    out = library_path(name)
    stamp = build_stamp(name)
    if not force and os.path.exists(out) and os.path.exists(out + ".stamp"):
        with open(out + ".stamp") as f:
            if f.read().strip() == stamp:
                return False
    import tensorflow as tf  # only to build: the check above stays cheap

    src = source_path(name)
    tmp = "%s.tmp-%d" % (out, os.getpid())
    cmd = (["g++"] + CXXFLAGS + arch_flags() + declared_flags(src, "CXXFLAGS") + [src, "-o", tmp]
           + tf.sysconfig.get_compile_flags() + tf.sysconfig.get_link_flags()
           + declared_flags(src, "LINK"))
    log.info("building %s: %s", os.path.basename(out), " ".join(cmd))
    try:
        subprocess.run(cmd, check=True)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    with open(out + ".stamp", "w") as f:
        f.write(stamp + "\n")
    return True


def main(argv=None):
    """Build the named libraries (default: all), as many at once as there are CPUs: each
    is one g++ process of some seconds, independent of the others."""
    logging.basicConfig(level=logging.INFO, format="[native.build] %(message)s")
    names = (argv if argv is not None else sys.argv[1:]) or all_names()
    with ThreadPoolExecutor(max_workers=max(1, min(len(names), os.cpu_count() or 1))) as pool:
        built = list(pool.map(build, names))   # the first failure is raised here
    for name, new in zip(names, built):
        log.info("%s: %s", name, "built" if new else "up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
