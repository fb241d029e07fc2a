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


def pytest_configure(config):
    config.addinivalue_line("markers", "single_process: test that starts its own mpirun")
    config.addinivalue_line("markers", "rank_independent: test without a Mesh TF mesh")
