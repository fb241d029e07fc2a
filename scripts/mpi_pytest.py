"""Run pytest on one MPI rank (used by scripts/run_tests.sh under mpirun).

Rank 0 prints to the terminal; other ranks write to ``<logdir>/np<N>_rank<R>.log``.
Every rank writes JUnit XML to ``<logdir>/np<N>_rank<R>.xml``; with
``FLOWPM_MTF_TEST_PART=<part>`` (run_tests.sh's 1-rank job runs ``NP1_PARTS`` parts side by side)
the files are ``np<N>_rank<R>_<part>.*``. pytest's exit code 5 ("no tests collected")
counts as success: some files have no test for a world size.

Every rank gets the MPI environment of a ``flowpm-mtf`` job's rank
(:func:`flowpm_mtf.launch_env.apply`, before MPI loads): Open MPI then yields while it
waits, as in the jobs. Without it, the 2-rank pass (one rank per core, so Open MPI does
not yield by itself) spends its waits busy-polling against the ranks' own TensorFlow and
Horovod threads. The processes the tests launch inherit it.
"""
import os
import sys


def main():
    logdir = os.environ.get("FLOWPM_MTF_TEST_LOGDIR", "test-logs")
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
    size = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE", "1")))
    os.makedirs(logdir, exist_ok=True)
    tag = "np%d_rank%d" % (size, rank)
    part = os.environ.get("FLOWPM_MTF_TEST_PART")
    if part:
        tag += "_" + part
    if rank != 0:
        log = open(os.path.join(logdir, tag + ".log"), "w")
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    from flowpm_mtf import launch_env  # imports only os

    launch_env.apply()
    import pytest

    args = sys.argv[1:] + ["--junitxml", os.path.join(logdir, tag + ".xml"), "-p", "no:cacheprovider"]
    code = pytest.main(args)
    if "horovod.tensorflow" in sys.modules:  # stop Horovod's background thread first
        from hvd_mesh_impl import runtime

        # every rank waits for the others' last collectives before Horovod stops
        runtime.shutdown()
    # As a job's rank exits: the exit handlers and MPI_Finalize (mpirun treats a rank that
    # exits without it as an abnormal termination), not the teardown of every object of
    # the session's graphs (seconds of CPU per process).
    launch_env.exit_process(0 if code in (0, 5) else int(code))


if __name__ == "__main__":
    main()
