"""Any import order works, and TensorFlow's C++ start-up lines are hidden (issue 57).

Every case runs a fresh interpreter exactly as a user starts one: ``sys.executable``
outside the checkout (cwd a temporary directory), no ``PYTHONPATH``, no conftest, no
MPI launcher variables, none of the logging variables this suite sets. What makes
``import mesh_tensorflow`` work first is the installed start-up file
``flowpm_mtf_startup.pth`` (``setup.py``, ``_flowpm_mtf_startup.py``); a failure of
the first two tests means it is missing: re-run ``bash scripts/setup_env.sh``.

The interpreters run side by side (module fixture ``runs``): each imports TensorFlow.
The README order goes on with the rest of a job's imports (the Keras check) in the same
interpreter.
"""
import os
import subprocess
import sys
import tempfile

import pytest

pytestmark = pytest.mark.rank_independent

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 300

# The README quick start's order (Mesh TF first) on one process, a 1x1 mesh; after the
# first Mesh TF graph op, and before TensorFlow or any package of ours is imported by the
# script, it prints which of our modules Mesh TF's import loaded ("modules ...").
README_ORDER = """
import sys
import numpy as np
import mesh_tensorflow as mtf
graph = mtf.Graph()
mtf.zeros(mtf.Mesh(graph, "m"), mtf.Shape([mtf.Dimension("a", 2)]))
ours = sorted(m for m in sys.modules if m.split(".")[0] in ("hvd_mesh_impl", "flowpm_mtf"))
print("modules", ",".join(ours))
import tensorflow.compat.v1 as tf
from hvd_mesh_impl import HvdSimdMeshImpl, runtime
from hvd_mesh_impl.mtf_compat import complex_gradients_enabled

tf.disable_eager_execution()
graph = mtf.Graph()
mesh = mtf.Mesh(graph, "mesh")
x = mtf.import_tf_tensor(mesh, tf.constant(np.arange(64.0).reshape(8, 8)),
                         mtf.Shape([mtf.Dimension("a", 8), mtf.Dimension("b", 8)]))
y = mtf.reduce_sum(mtf.shift(x, 1, x.shape.dims[0], wrap=True) * x)
impl = HvdSimdMeshImpl([("rows", 1), ("cols", 1)], [("a", "rows"), ("b", "cols")])
lowering = mtf.Lowering(graph, {mesh: impl})
y_tf = lowering.export_to_tf_tensor(y)
with tf.Session(config=runtime.session_config()) as sess:
    print("result", sess.run(y_tf), complex_gradients_enabled())
"""
README_RESULT = "result 71008.0 True"  # sum_ij x[i-1, j] x[i, j], x = arange(64) 8x8

TF_ALONE = """
import os, sys
import tensorflow
print("keras", "keras" in sys.modules)
ours = sorted(m for m in sys.modules
              if m.split(".")[0] in ("mesh_tensorflow", "hvd_mesh_impl", "flowpm_mtf"))
print("modules", ",".join(ours) or "none", os.environ.get("TF_CPP_MIN_LOG_LEVEL", "unset"))
"""

OURS_THEN_TF = ("import sys, flowpm_mtf, tensorflow\nprint('keras', 'keras' in sys.modules)\n"
                "print('imported')\n")

# After the README order (Mesh TF first, the start-up file's path, Horovod loaded by
# HvdSimdMeshImpl), the rest of a job's imports: TensorFlow, Horovod and our packages
# have loaded without Keras (hvd_mesh_impl.tf_compat.without_eager_keras, the Horovod
# patch), and tf.keras still loads it on first use.
LEAN = """
import horovod.tensorflow, flowpm_mtf.api
print("keras", "keras" in sys.modules, "sklearn" in sys.modules)
import tensorflow
print("tf.keras", tensorflow.keras.layers.Dense.__module__.split(".")[0])
"""

CASES = {
    "readme_order": (README_ORDER + LEAN, {}),
    "tf_alone": (TF_ALONE, {}),
    "quiet": (OURS_THEN_TF, {}),
    "logs_asked": (OURS_THEN_TF, {"FLOWPM_MTF_TF_LOGS": "1"}),
    "level_0_kept": (OURS_THEN_TF, {"TF_CPP_MIN_LOG_LEVEL": "0"}),
}

# what this suite or a launcher may have set, and what TF's start-up lines depend on
DROPPED_ENV = ("PYTHONPATH", "PYTHONSTARTUP", "PYTHONNOUSERSITE", "TF_CPP_MIN_LOG_LEVEL",
               "TF_CPP_MAX_VLOG_LEVEL", "TF_CPP_VMODULE", "TF_ENABLE_ONEDNN_OPTS",
               "FLOWPM_MTF_TF_LOGS")


def clean_env(extra):
    env = {k: v for k, v in os.environ.items()
           if k not in DROPPED_ENV and not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def runs():
    """``{case: (returncode, stdout, stderr)}`` of every case, run side by side."""
    cwd = tempfile.mkdtemp(prefix="import_order_")
    procs = {name: subprocess.Popen([sys.executable, "-c", code], env=clean_env(extra),
                                    cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)
             for name, (code, extra) in CASES.items()}
    out = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=TIMEOUT_S)
        out[name] = (p.returncode, stdout, stderr)
    os.rmdir(cwd)
    return out


def ok(runs, name, prefix=None):
    """The last line ``name`` printed (starting with ``prefix`` if given) and its stderr;
    its interpreter must have exited 0."""
    code, stdout, stderr = runs[name]
    assert code == 0, "%s failed (is flowpm_mtf_startup.pth installed? bash " \
                      "scripts/setup_env.sh):\n%s" % (name, stderr[-3000:])
    lines = [ln for ln in stdout.strip().splitlines() if prefix is None or ln.startswith(prefix)]
    assert lines, "%s printed no %r line:\n%s" % (name, prefix, stdout[-3000:])
    return lines[-1], stderr


def oneDNN_lines(stderr):  # noqa: N802 (the library's name)
    return [line for line in stderr.splitlines() if "oneDNN custom operations" in line]


def test_readme_order_runs_with_the_backend_fixes(runs):
    """Mesh TF imported before our packages: the shims, then Mesh TF, then our fixes."""
    last, stderr = ok(runs, "readme_order", "result ")
    assert last == README_RESULT
    assert not oneDNN_lines(stderr), stderr   # quiet: Mesh TF's hook imported TensorFlow


def test_mesh_tensorflow_alone_imports_no_package_of_ours(runs):
    ok(runs, "readme_order")
    lines = [ln for ln in runs["readme_order"][1].splitlines() if ln.startswith("modules ")]
    # only the shims, loaded from their file (no hvd_mesh_impl/__init__, no flowpm_mtf)
    assert lines == ["modules hvd_mesh_impl.tf_compat"]


def test_tensorflow_alone_is_not_changed(runs):
    last, _ = ok(runs, "tf_alone")
    assert last == "modules none unset"
    assert "keras True" in runs["tf_alone"][1].splitlines()  # TF's own eager Keras load


def test_no_keras_at_start_up_and_tf_keras_on_first_use(runs):
    """Our first TensorFlow import skips its eager Keras load; Horovod does not load it
    (after the README order, then the rest of a job's imports: ``LEAN``)."""
    ok(runs, "readme_order")
    assert runs["readme_order"][1].splitlines()[-2:] == ["keras False False", "tf.keras keras"]
    for case in ("quiet", "logs_asked"):  # flowpm_mtf's import hook, with or without logs
        ok(runs, case)
        assert "keras False" in runs[case][1].splitlines(), case


def test_tensorflow_start_up_lines_hidden_by_default(runs):
    last, stderr = ok(runs, "quiet")
    assert last == "imported"
    assert not oneDNN_lines(stderr), stderr
    assert "cpu_feature_guard" not in stderr and "absl::InitializeLog" not in stderr, stderr


@pytest.mark.parametrize("case", ["logs_asked", "level_0_kept"])
def test_tensorflow_start_up_lines_on_request(runs, case):
    """FLOWPM_MTF_TF_LOGS=1, or the user's TF_CPP_MIN_LOG_LEVEL=0: the lines as TF prints them."""
    last, stderr = ok(runs, case)
    assert last == "imported"
    _, reference = ok(runs, "tf_alone")
    if not oneDNN_lines(reference):
        pytest.skip("this TensorFlow prints no oneDNN line")
    assert len(oneDNN_lines(stderr)) == len(oneDNN_lines(reference)), stderr


def test_start_up_file_is_in_every_build():
    """``build_py`` (wheels, ``pip install .``) writes the start-up file at the build's root."""
    with tempfile.TemporaryDirectory() as build:
        subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", build],
                       cwd=REPO, check=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       env=clean_env({}), timeout=TIMEOUT_S)
        with open(os.path.join(build, "flowpm_mtf_startup.pth")) as f:
            line = f.read()
        assert line.startswith("import ") and line.count("\n") == 1  # one line site.py runs
        assert "_flowpm_mtf_startup" in line
        assert os.path.exists(os.path.join(build, "_flowpm_mtf_startup.py"))
        assert os.path.exists(os.path.join(build, "hvd_mesh_impl", "tf_compat.py"))


ABSL_INFO = (b"I0000 00:00:1796531221.635100    9729 port.cc:153] oneDNN custom operations "
             b"are on.\n")
ABSL_WARNING = b"W0000 00:00:1796531221.635100    9729 x.cc:1] a warning\n"
PREINIT = (b"WARNING: All log messages before absl::InitializeLog() is called are written "
           b"to STDERR\n")
OTHER = b"/some/file.py:3: DeprecationWarning: kept\n"


@pytest.mark.parametrize("level,kept", [
    (1, PREINIT + ABSL_WARNING + OTHER),   # a kept absl line keeps absl's notice
    (2, OTHER),
])
def test_drop_startup_lines(level, kept):
    from hvd_mesh_impl import tf_compat

    data = PREINIT + ABSL_INFO + ABSL_WARNING + OTHER
    assert tf_compat._drop_startup_lines(data, level) == kept


def test_filtered_stderr_replays_the_rest_also_on_an_error(capfd):
    from hvd_mesh_impl import tf_compat

    with pytest.raises(RuntimeError):
        with tf_compat._FilteredStderr(1):
            os.write(2, PREINIT + ABSL_INFO + OTHER)
            raise RuntimeError("in the import")
    assert capfd.readouterr().err == OTHER.decode()
    assert not tf_compat._filtering
