"""hvd_mesh_impl.tf_compat: Mesh TF 0.1.21 imports on any supported TensorFlow.

The shims act at import time, so each import order runs in a fresh interpreter: our
package first is ``fresh_imports.ours_first()`` (one interpreter that several test files
share), ``hvd_mesh_impl`` first this file's own (module fixture ``hvd_first``), printing
one line per check. On TF 2.12 the shims must change nothing; on TF >= 2.16 the estimator
stub and the conversion alias must be applied, whichever module imports Mesh TF first.
"""
import subprocess
import sys

import pytest

import fresh_imports

pytestmark = pytest.mark.rank_independent

# hvd_mesh_impl first: Mesh TF imports; install() is idempotent; the estimator names.
# It prints "<key> <value>" lines; an assert fails the interpreter (exit != 0).
HVD_MESH_IMPL_FIRST = (
    "import hvd_mesh_impl, sys\n"
    "import mesh_tensorflow as mtf, tensorflow.compat.v1 as tf\n"
    "from hvd_mesh_impl import tf_compat\n"
    "assert not any(isinstance(f, tf_compat._MeshTFImportHook) for f in sys.meta_path)\n"
    "g = mtf.Graph(); m = mtf.Mesh(g, 'm')\n"
    "x = mtf.zeros(m, mtf.Shape([mtf.Dimension('a', 2)]))\n"
    "print('installed', ','.join(sorted(tf_compat.installed())) or 'none')\n"
    "assert tf_compat.install() == []\n"
    "est = tf.estimator\n"
    "for name in ('CheckpointSaverListener', 'SessionRunHook', 'tpu'):\n"
    "    assert hasattr(est, name), name\n"
    "from tensorflow.python.framework import ops\n"
    "assert callable(ops.register_tensor_conversion_function)\n"
    "print('idempotent ok')\n")


@pytest.fixture(scope="module")
def hvd_first():
    """``(returncode, output)`` of :data:`HVD_MESH_IMPL_FIRST`."""
    out = subprocess.run([sys.executable, "-c", HVD_MESH_IMPL_FIRST],
                         env=fresh_imports.plain_env(), cwd=fresh_imports.REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=fresh_imports.TIMEOUT_S)
    return out.returncode, out.stdout


def printed(run, key):
    """The value ``run`` printed for ``key``; its interpreter must have exited 0."""
    code, out = run
    assert code == 0, out[-3000:]
    values = [ln[len(key) + 1:] for ln in out.splitlines() if ln.startswith(key + " ")]
    assert len(values) == 1, out[-3000:]
    return values[0]


def tf_minor():
    import tensorflow as tf

    major, minor = tf.__version__.split(".")[:2]
    return int(major), int(minor)


def test_flowpm_mtf_import_is_light_and_installs_the_hook():
    """``import flowpm_mtf``: no TensorFlow, no ``hvd_mesh_impl/__init__`` (tf_compat is
    loaded from its file), one Mesh TF import hook, which the first Mesh TF import removes."""
    facts = fresh_imports.ours_first()
    assert facts["flowpm_mtf"]["tensorflow"] is False, "flowpm_mtf imported tensorflow"
    assert facts["flowpm_mtf"]["hvd_mesh_impl"] is False, "flowpm_mtf ran hvd_mesh_impl/__init__"
    assert facts["hooks"] == 1
    assert facts["hooks_after_mtf"] == 0


@pytest.mark.parametrize("first", ["flowpm_mtf", "hvd_mesh_impl"])
def test_mesh_tensorflow_imports_after_our_packages(request, first):
    if first == "flowpm_mtf":
        out = ",".join(fresh_imports.ours_first()["installed"]) or "none"
    else:
        out = printed(request.getfixturevalue("hvd_first"), "installed")
    if tf_minor() < (2, 13):
        assert out == "none"  # nothing to shim: TF 2.12 has both names
    elif tf_minor() >= (2, 16):
        assert out == "estimator,register_tensor_conversion_function"


def test_install_is_idempotent_and_estimator_names_exist(hvd_first):
    assert printed(hvd_first, "idempotent") == "ok"


def test_mesh_tf_is_patched_in_one_place():
    """One loader of tf_compat (the start-up hook's, also flowpm_mtf's) and one function
    that patches Mesh TF (mtf_compat.apply, run by hvd_mesh_impl's import): after the
    imports every fix is in effect and another call applies nothing."""
    facts = fresh_imports.ours_first()
    assert facts["one_loader"] and facts["same_tf_compat"]
    assert facts["complex_gradients"] and facts["lazy_masters"]
    assert facts["applied_again"] == []
