"""Shared pytest set-up. The suite runs on 1, 2 and 4 MPI ranks (scripts/run_tests.sh);
each test that depends on the world size picks the meshes of that size."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402

# Installs the import hook that lets test modules import mesh_tensorflow first on
# TensorFlow >= 2.13 (hvd_mesh_impl.tf_compat); imports no TensorFlow itself.
import flowpm_mtf  # noqa: E402,F401


def world():
    """(rank, size) of MPI.COMM_WORLD, without starting Horovod."""
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


@pytest.fixture(scope="session")
def world_size():
    return world()[1]


@pytest.fixture(scope="session")
def world_rank():
    return world()[0]


def pytest_collection_modifyitems(config, items):
    """On more than one rank, skip the tests marked ``single_process`` (they launch
    their own mpirun) and ``rank_independent`` (no mesh: the 1-rank pass covers them)."""
    if world()[1] > 1:
        reasons = {"single_process": "launches its own MPI job; runs in the 1-rank pass",
                   "rank_independent": "does not depend on the rank count; runs in the "
                                       "1-rank pass"}
        for item in items:
            for marker, reason in reasons.items():
                if marker in item.keywords:
                    item.add_marker(pytest.mark.skip(reason=reason))
                    break


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    """With ``FLOWPM_MTF_TEST_QUEUE`` (the 1-rank pass of scripts/run_tests.sh), run only
    the test files this process claims from the directory both of its processes share
    (tests/file_queue.py); otherwise pytest's own loop."""
    queue = os.environ.get("FLOWPM_MTF_TEST_QUEUE")
    if not queue or session.config.option.collectonly:
        return None
    if session.testsfailed and not session.config.option.continue_on_collection_errors:
        raise session.Interrupted("%d errors during collection" % session.testsfailed)
    import file_queue

    file_queue.run_claimed(session, queue, file_queue.load_costs())
    return True


def pytest_configure(config):
    config.addinivalue_line("markers", "single_process: test that starts its own mpirun")
    config.addinivalue_line("markers", "rank_independent: test without a Mesh TF mesh")


# CPU seconds per test (this process and the processes it waited for: the MPI jobs and CLI
# runs a test starts), written at the end to <FLOWPM_MTF_TEST_LOGDIR>/<tag>_cpu.tsv, costliest
# first: where the suite's CPU goes, which on this 2-core machine is where its time goes
# (docs/testing.md, "Where the time goes").
_CPU = {}


def _cpu_now():
    import resource

    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime, c.ru_utime + c.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    own0, kids0 = _cpu_now()
    yield
    own1, kids1 = _cpu_now()
    _CPU[item.nodeid] = (own1 - own0, kids1 - kids0)


def pytest_sessionfinish(session, exitstatus):
    logdir = os.environ.get("FLOWPM_MTF_TEST_LOGDIR")
    if not logdir or not _CPU:
        return
    rank, size = world()
    part = os.environ.get("FLOWPM_MTF_TEST_PART")
    tag = "np%d_rank%d%s" % (size, rank, "_" + part if part else "")
    rows = sorted(_CPU.items(), key=lambda kv: -sum(kv[1]))
    with open(os.path.join(logdir, tag + "_cpu.tsv"), "w") as f:
        f.write("# cpu_s\tprocess_s\tchildren_s\ttest (total %.1f s)\n"
                % sum(sum(v) for v in _CPU.values()))
        for nodeid, (own, kids) in rows:
            f.write("%.2f\t%.2f\t%.2f\t%s\n" % (own + kids, own, kids, nodeid))
