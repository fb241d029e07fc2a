"""flowpm-mtf: distributed, differentiable particle-mesh N-body simulations on
Mesh TensorFlow, with a Horovod SPMD backend (``hvd_mesh_impl``).

Besides the packages, every kind of install puts the start-up file
``flowpm_mtf_startup.pth`` into site-packages: one line that Python runs when it starts,
calling ``_flowpm_mtf_startup.install`` (a top-level module of this distribution), so that
``import mesh_tensorflow`` works on TensorFlow >= 2.13 before any of our packages is
imported (hvd_mesh_impl/tf_compat.py). It is written by ``build_py`` at the root of the
build (``pip install .``, wheels), by ``develop`` into the install directory (the legacy
editable install, ``pip install -e .`` without a pyproject.toml, as scripts/setup_env.sh
does) and by ``editable_wheel`` into the wheel's root (PEP 660 editable installs). The
line does nothing if the module cannot be imported (a develop install removed by
``pip uninstall`` leaves the file behind).
"""
import os

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.develop import develop

STARTUP_PTH = "flowpm_mtf_startup.pth"  # after easy-install.pth, __editable__.*.pth (sorted)
STARTUP_LINE = ('import sys; exec("try:\\n from _flowpm_mtf_startup import install\\n'
                'except ImportError:\\n pass\\nelse:\\n install()")\n')


def write_startup_pth(directory):
    """Write :data:`STARTUP_PTH` into ``directory``; returns its path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, STARTUP_PTH)
    with open(path, "w") as f:
        f.write(STARTUP_LINE)
    return path


class BuildPy(build_py):
    """``build_py`` that also writes the start-up file at the root of the build."""

    def run(self):
        super().run()
        if not getattr(self, "editable_mode", False):
            write_startup_pth(self.build_lib)

    def get_outputs(self, include_bytecode=1):
        outputs = list(super().get_outputs(include_bytecode))
        if not getattr(self, "editable_mode", False):
            outputs.append(os.path.join(self.build_lib, STARTUP_PTH))
        return outputs


class Develop(develop):
    """``develop`` (legacy editable install) that writes or removes the start-up file."""

    def run(self):
        super().run()
        if self.uninstall:
            path = os.path.join(self.install_dir, STARTUP_PTH)
            if os.path.exists(path):
                os.remove(path)
        else:
            write_startup_pth(self.install_dir)


CMDCLASS = {"build_py": BuildPy, "develop": Develop}

try:  # PEP 660 editable installs (setuptools >= 64): the file goes into the wheel's root
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:
    editable_wheel = None
if editable_wheel is not None and hasattr(editable_wheel, "_run_build_commands"):
    class EditableWheel(editable_wheel):
        """``editable_wheel`` that adds the start-up file to the wheel."""

        def _run_build_commands(self, dist_name, unpacked_wheel, *args, **kwargs):
            result = super()._run_build_commands(dist_name, unpacked_wheel, *args, **kwargs)
            write_startup_pth(str(unpacked_wheel))
            return result

    CMDCLASS["editable_wheel"] = EditableWheel

with open("requirements.txt") as f:
    _reqs = [l.strip() for l in f if l.strip() and not l.startswith("#")
             and not l.startswith(("pytest", "psutil"))]

setup(
    name="flowpm-mtf",
    version="0.1.0",
    description="Distributed differentiable particle-mesh simulations on Mesh TensorFlow "
                "with a Horovod SPMD backend",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    license="MIT",
    python_requires=">=3.11,<3.14",  # TF 2.21: 3.11-3.13; the tf2.12 stack: 3.11 (docs/setup.md)
    # flowpm_bench: the shared library of scripts/ (benchmarks, launchers), run from a checkout
    packages=find_packages(include=["hvd_mesh_impl", "hvd_mesh_impl.*", "flowpm_mtf",
                                    "flowpm_mtf.*", "mri_mtf", "mri_mtf.*", "flowpm_bench",
                                    "flowpm_bench.*"]),
    py_modules=["_flowpm_mtf_startup"],  # the start-up hook (STARTUP_PTH)
    package_data={"flowpm_mtf.runs": ["memory_model.json"]},
    install_requires=_reqs + ["psutil>=5.9"],
    extras_require={"horovod": ["horovod==0.28.1"], "test": ["pytest>=7.4", "pytest-timeout>=2.2"]},
    entry_points={"console_scripts": ["flowpm-mtf=flowpm_mtf.cli:entry"]},
    cmdclass=CMDCLASS,
)
