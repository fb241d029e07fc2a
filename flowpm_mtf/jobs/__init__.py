"""Jobs: everything ``flowpm-mtf`` can run, driven by one runner.

* :mod:`flowpm_mtf.jobs.base` -- the Job protocol and config sections;
* :mod:`flowpm_mtf.jobs.runner` -- the one runner (build, lower, run, time,
  memory, summary, write) and its hook points;
* :mod:`flowpm_mtf.jobs.options` -- command-line options and ``--config``
  keys generated from the jobs' config dataclasses;
* :mod:`flowpm_mtf.jobs.nbody_run` -- the simulation graph and the session
  side of the time loop, shared by the N-body jobs;
* the jobs: :mod:`~flowpm_mtf.jobs.simulate`, :mod:`~flowpm_mtf.jobs.lensing`,
  :mod:`~flowpm_mtf.jobs.reconstruct`, :mod:`~flowpm_mtf.jobs.imaging`,
  :mod:`~flowpm_mtf.jobs.fft_demo`, :mod:`~flowpm_mtf.jobs.halos` (also the FoF of
  ``simulate --fof``).

Adding a job = one module with a :class:`~flowpm_mtf.jobs.base.Job` subclass
decorated with :func:`register`, and its name in :data:`JOB_MODULES`. A job module
imports no TensorFlow, Mesh TF or Horovod at module level (its methods that build and
run the graph do): :func:`all_jobs` is what the command line's parser and configs need,
so a wrong option or value is reported before TensorFlow loads.
"""
import importlib

__all__ = ["JOB_MODULES", "register", "get", "all_jobs"]

JOB_MODULES = ("simulate", "lensing", "reconstruct", "imaging", "fft_demo", "halos")
"""Modules of the registered jobs, in the order of ``flowpm-mtf --help``."""

_REGISTRY = {}


def register(cls):
    """Class decorator: register an instance of a Job subclass under ``cls.name``."""
    if cls.name in _REGISTRY and type(_REGISTRY[cls.name]) is not cls:
        raise ValueError("job %r registered twice" % cls.name)
    _REGISTRY[cls.name] = cls()
    return cls


def all_jobs():
    """Every registered job (imports the job modules), name -> Job instance."""
    for mod in JOB_MODULES:
        importlib.import_module("%s.%s" % (__name__, mod))
    return dict(_REGISTRY)


def get(name):
    """The registered job ``name`` (e.g. ``"simulate"``)."""
    jobs = all_jobs()
    if name not in jobs:
        raise ValueError("unknown job %r (choose from %s)" % (name, sorted(jobs)))
    return jobs[name]
