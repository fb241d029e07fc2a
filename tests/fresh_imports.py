"""One fresh interpreter whose imports several test files check (``ours_first()``).

Import behaviour (what a module pulls in, which hook is installed, which fixes are in
effect) can only be seen in an interpreter that has imported nothing yet, and each such
interpreter costs a TensorFlow import. The claims below all start the same way, our
package before Mesh TF, so one interpreter runs them in order and prints what it saw as
one JSON object; the tests of ``test_api_flowpm.py``, ``test_design_map.py``,
``test_fft.py`` and ``test_tf_compat.py`` assert on it. It runs once per pytest process
(cached), with ``PYTHONPATH`` the checkout, not as an MPI rank.

The script's steps, each fact read before the next step can change it:

1. ``import flowpm_mtf``: no TensorFlow, no ``hvd_mesh_impl/__init__``, no API module;
   one Mesh TF import hook on ``sys.meta_path``; the start-up hook's loader returns the
   same ``hvd_mesh_impl.tf_compat``;
2. ``import flowpm_mtf.layout``: still no TensorFlow;
3. ``import flowpm_mtf.mesh.fft_local``: no Mesh TF, no ``flowpm_mtf.mesh.fft``;
4. ``import mesh_tensorflow`` (the first, by the user): the hook removed itself, a Mesh TF
   graph op builds, the TensorFlow shims installed;
5. ``flowpm_mtf.cic_paint``: the API module loaded on first use of a name, no Horovod;
6. ``flowpm_mtf.mesh.fft``, ``complex_ops``, ``hvd_mesh_impl``: one ``tf_compat``, the
   Mesh TF fixes in effect, another ``mtf_compat.apply()`` applies nothing;
7. every module of ``flowpm_mtf`` and ``mri_mtf``: the Horovod modules loaded (none).
"""
import functools
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 300
PACKAGES = ("flowpm_mtf", "mri_mtf")   # step 7: every module of these

OURS_FIRST = """
import importlib, json, sys
facts = {}
def loaded(*names):
    return {n: n in sys.modules for n in names}
def hooks():
    return sum(isinstance(f, tf_compat._MeshTFImportHook) for f in sys.meta_path)

import flowpm_mtf
facts["flowpm_mtf"] = loaded("tensorflow", "hvd_mesh_impl", "flowpm_mtf.api")
tf_compat = sys.modules["hvd_mesh_impl.tf_compat"]  # loaded from its file
facts["hooks"] = hooks()
import _flowpm_mtf_startup
facts["one_loader"] = _flowpm_mtf_startup.load_tf_compat() is tf_compat

import flowpm_mtf.layout
facts["layout"] = loaded("tensorflow")
import flowpm_mtf.mesh.fft_local
facts["fft_local"] = loaded("mesh_tensorflow", "flowpm_mtf.mesh.fft")

import mesh_tensorflow as mtf
facts["hooks_after_mtf"] = hooks()
g = mtf.Graph()
mtf.zeros(mtf.Mesh(g, "m"), mtf.Shape([mtf.Dimension("a", 2)]))
facts["installed"] = sorted(tf_compat.installed())

flowpm_mtf.cic_paint
facts["api_name"] = loaded("flowpm_mtf.api", "tensorflow", "horovod")

import flowpm_mtf.mesh.fft, flowpm_mtf.mesh.complex_ops, hvd_mesh_impl
from hvd_mesh_impl import mtf_compat
facts["same_tf_compat"] = hvd_mesh_impl.tf_compat is tf_compat
facts["complex_gradients"] = mtf_compat.complex_gradients_enabled()
facts["lazy_masters"] = bool(getattr(mtf.Variable, "_flowpm_mtf_lazy_masters", False))
facts["applied_again"] = list(mtf_compat.apply())

for m in %r:
    importlib.import_module(m)
facts["horovod"] = sorted(k for k in sys.modules if k == "horovod" or k.startswith("horovod."))
print("facts", json.dumps(facts))
"""


def package_modules():
    """Dotted names of every Python module of :data:`PACKAGES` in the checkout."""
    out = []
    for pkg in PACKAGES:
        for root, dirs, files in os.walk(os.path.join(REPO, pkg)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for f in sorted(files):
                if f.endswith(".py"):
                    name = os.path.relpath(os.path.join(root, f[:-3]), REPO).replace(os.sep, ".")
                    out.append(name[:-len(".__init__")] if name.endswith(".__init__") else name)
    return out


def plain_env():
    """The environment of a plain interpreter on the checkout, not an MPI rank of this job."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TF_CPP_MIN_LOG_LEVEL="2")
    for k in list(env):
        if k.startswith(("OMPI_", "PMIX_", "PMI_")):
            del env[k]
    return env


@functools.lru_cache(maxsize=None)
def _run_ours_first():
    modules = package_modules()
    out = subprocess.run([sys.executable, "-c", OURS_FIRST % (modules,)], cwd=REPO,
                         env=plain_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    return out.returncode, out.stdout, out.stderr


def ours_first():
    """The facts of :data:`OURS_FIRST` (a dict; see the module docstring for its steps).

    The interpreter must have exited 0 and printed them (an AssertionError with its
    standard error otherwise).
    """
    code, stdout, stderr = _run_ours_first()
    lines = [ln[len("facts "):] for ln in stdout.splitlines() if ln.startswith("facts ")]
    assert code == 0 and len(lines) == 1, "exit %d:\n%s\n%s" % (code, stdout[-2000:],
                                                                stderr[-3000:])
    return json.loads(lines[0])
