"""Shared pytest set-up. The suite runs on 1, 2 and 4 MPI ranks (scripts/run_tests.sh);
each test that depends on the world size picks the meshes of that size."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402


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
    """Tests marked ``single_process`` launch their own mpirun: run them on 1 rank only."""
    if world()[1] > 1:
        skip = pytest.mark.skip(reason="launches its own MPI job; runs in the 1-rank pass")
        for item in items:
            if "single_process" in item.keywords:
                item.add_marker(skip)


def pytest_configure(config):
    config.addinivalue_line("markers", "single_process: test that starts its own mpirun")
