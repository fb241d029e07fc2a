"""flowpm-mtf: distributed, differentiable particle-mesh N-body simulations on
Mesh TensorFlow, with a Horovod SPMD backend (``hvd_mesh_impl``)."""
from setuptools import find_packages, setup

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
    package_data={"flowpm_mtf": ["memory_model.json"]},
    install_requires=_reqs + ["psutil>=5.9"],
    extras_require={"horovod": ["horovod==0.28.1"], "test": ["pytest>=7.4", "pytest-timeout>=2.2"]},
    entry_points={"console_scripts": ["flowpm-mtf=flowpm_mtf.cli:entry"]},
)
