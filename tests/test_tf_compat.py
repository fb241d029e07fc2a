"""hvd_mesh_impl.tf_compat: Mesh TF 0.1.21 imports on any supported TensorFlow.

The shims act at import time, so each import order runs in a fresh interpreter: three
interpreters (module fixture ``runs``, side by side), each one order, printing one line
per check. On TF 2.12 the shims must change nothing; on TF >= 2.16 the estimator stub
and the conversion alias must be applied, whichever module imports Mesh TF first.
"""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.rank_independent

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 300

# Each script prints "<key> <value>" lines; an assert fails the interpreter (exit != 0).
SCRIPTS = {
    # flowpm_mtf first: its import is light and installs the hook; then Mesh TF imports
    "flowpm_mtf_first": (
        "import sys, flowpm_mtf\n"
        "assert 'tensorflow' not in sys.modules, 'flowpm_mtf imported tensorflow'\n"
        "assert 'hvd_mesh_impl' not in sys.modules, 'flowpm_mtf ran hvd_mesh_impl/__init__'\n"
        "tf_compat = sys.modules['hvd_mesh_impl.tf_compat']  # loaded from its file\n"
        "print('hooks', sum(isinstance(f, tf_compat._MeshTFImportHook) for f in sys.meta_path))\n"
        "import mesh_tensorflow as mtf, tensorflow.compat.v1 as tf\n"
        "from hvd_mesh_impl import tf_compat\n"
        "assert not any(isinstance(f, tf_compat._MeshTFImportHook) for f in sys.meta_path)\n"
        "g = mtf.Graph(); m = mtf.Mesh(g, 'm')\n"
        "x = mtf.zeros(m, mtf.Shape([mtf.Dimension('a', 2)]))\n"
        "print('installed', ','.join(sorted(tf_compat.installed())) or 'none')\n"),
    # hvd_mesh_impl first: Mesh TF imports; install() is idempotent; the estimator names
    "hvd_mesh_impl_first": (
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
        "print('idempotent ok')\n"),
    # one loader of tf_compat and one function that patches Mesh TF (mtf_compat.apply, run
    # by hvd_mesh_impl's import), our modules imported before Mesh TF
    "one_place": (
        "import sys, flowpm_mtf, _flowpm_mtf_startup\n"
        "tf_compat = sys.modules['hvd_mesh_impl.tf_compat']\n"
        "assert _flowpm_mtf_startup.load_tf_compat() is tf_compat\n"
        "import flowpm_mtf.mesh.fft, flowpm_mtf.mesh.complex_ops, hvd_mesh_impl\n"
        "assert hvd_mesh_impl.tf_compat is tf_compat\n"
        "import mesh_tensorflow as mtf\n"
        "from hvd_mesh_impl import mtf_compat\n"
        "assert mtf_compat.complex_gradients_enabled()\n"
        "assert getattr(mtf.Variable, '_flowpm_mtf_lazy_masters', False)\n"
        "print('applied_again', ','.join(mtf_compat.apply()) or 'none')\n"),
}


def _env():
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TF_CPP_MIN_LOG_LEVEL="2")
    for k in list(env):  # a plain interpreter, not an MPI rank of this job
        if k.startswith(("OMPI_", "PMIX_", "PMI_")):
            del env[k]
    return env


@pytest.fixture(scope="module")
def runs():
    """``{script: (returncode, output)}``, the interpreters run side by side."""
    procs = {name: subprocess.Popen([sys.executable, "-c", code], env=_env(), cwd=REPO,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)
             for name, code in SCRIPTS.items()}
    out = {}
    for name, p in procs.items():
        stdout, _ = p.communicate(timeout=TIMEOUT_S)
        out[name] = (p.returncode, stdout)
    return out


def printed(runs, name, key):
    """The value the script ``name`` printed for ``key``; its interpreter must exit 0."""
    code, out = runs[name]
    assert code == 0, out[-3000:]
    values = [ln[len(key) + 1:] for ln in out.splitlines() if ln.startswith(key + " ")]
    assert len(values) == 1, out[-3000:]
    return values[0]


def tf_minor():
    import tensorflow as tf

    major, minor = tf.__version__.split(".")[:2]
    return int(major), int(minor)


def test_flowpm_mtf_import_is_light_and_installs_the_hook(runs):
    assert printed(runs, "flowpm_mtf_first", "hooks") == "1"


@pytest.mark.parametrize("first", ["flowpm_mtf", "hvd_mesh_impl"])
def test_mesh_tensorflow_imports_after_our_packages(runs, first):
    out = printed(runs, first + "_first", "installed")
    if tf_minor() < (2, 13):
        assert out == "none"  # nothing to shim: TF 2.12 has both names
    elif tf_minor() >= (2, 16):
        assert out == "estimator,register_tensor_conversion_function"


def test_install_is_idempotent_and_estimator_names_exist(runs):
    assert printed(runs, "hvd_mesh_impl_first", "idempotent") == "ok"


def test_mesh_tf_is_patched_in_one_place(runs):
    """One loader of tf_compat (the start-up hook's, also flowpm_mtf's) and one function
    that patches Mesh TF (mtf_compat.apply, run by hvd_mesh_impl's import): after the
    imports every fix is in effect and another call applies nothing."""
    assert printed(runs, "one_place", "applied_again") == "none"
