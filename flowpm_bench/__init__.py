"""The shared library of the benchmark and launch scripts in ``scripts/``.

The scripts (``scripts/bench_*.py``, ``scripts/scaling_model.py``) are run from a
checkout of the repository; this package holds what they have in common, so that
each helper exists once:

:mod:`flowpm_bench.launch`
    ``mpirun`` command lines, the environment of a launched sub-run, the default
    process grid, running a sub-run.
:mod:`flowpm_bench.measure`
    Peak and private memory of a process.
:mod:`flowpm_bench.provenance`
    ``git`` queries, the commit and the machine a result came from.
:mod:`flowpm_bench.results`
    Where results go (raw JSON under the unversioned ``results/raw/``, tables in
    ``results/``) and the writers that stamp every table with its provenance.
:mod:`flowpm_bench.configs`
    Configurations shared by several benchmarks.
:mod:`flowpm_bench.fft_timing`
    Timing of the distributed FFT round trip, ours and mpi4py-fft's.
:mod:`flowpm_bench.scripts`
    Loading a script of ``scripts/`` as a module (for the tests).
:mod:`flowpm_bench.reference`
    Single-device numpy references (and FlowPM 0.1.1's cosmology) for the tests
    and the benchmarks.
``flowpm_bench/peers/``
    Programs that run in a peer's own environment (e.g. JaxPM's virtualenv): they
    import neither this package nor ``flowpm_mtf``.

Importing this package (or :mod:`launch`, :mod:`measure`, :mod:`provenance`,
:mod:`results`) loads neither TensorFlow nor MPI. It imports :mod:`flowpm_mtf`, whose
import hook puts Mesh TF's TensorFlow >= 2.13 shims in place before a script's own
``import mesh_tensorflow`` (:mod:`hvd_mesh_impl.tf_compat`).
"""
import os

import flowpm_mtf  # noqa: F401  (the Mesh TF import hook; no TensorFlow)

#: Root of the checkout this package lives in (the scripts run from it).
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Versioned results: Markdown tables and figures.
RESULTS = os.path.join(REPO, "results")
#: Unversioned raw results (``.gitignore``): per-run JSON that benchmark runs rewrite.
RAW = os.path.join(RESULTS, "raw")
