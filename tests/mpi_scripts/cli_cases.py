"""Run the command line (:func:`flowpm_mtf.cli.main`) once per case, all in this one job.

    mpirun -np N python cli_cases.py CASES.json RESULTS.json

CASES.json is a list of ``{"argv": [...], "env": {NAME: VALUE}}``; each case runs as
``flowpm-mtf ARGV`` would after its start-up (:func:`flowpm_mtf.cli.entry`: the launcher's
defaults and the allocator, once for the whole job), with ``env`` set for that case only.
Rank 0 writes RESULTS.json: per case, ``{"codes": [...], "err": [...]}``, every rank's
exit code and everything it wrote to stdout/stderr (the one error line, the log), by rank.
The ranks meet after each case (on a communicator of their own, so never in a collective of
the command's). As the command's job would end there (the launcher stops the others when one
rank exits), the job ends with the case named, after writing the results so far, when a rank
waits :data:`CASE_WAIT_S` in vain for the others (one rank refused a case, another went on
with it) or the ranks' exit codes of a case differ: the cases after it would run on ranks
left out of step.

Used by tests/test_safety_cli.py and tests/test_preflight_cli.py: one job (one TensorFlow
import and Horovod start per rank) checks many inputs that are refused before the compute,
where one ``mpirun`` per input took ~10 s each.
"""
import contextlib
import io
import json
import os
import sys
import time

from flowpm_mtf import allocator, launch_env

launch_env.apply()
allocator.ensure()    # re-executes this script under the job's allocator, as entry() does

from mpi4py import MPI  # noqa: E402

from flowpm_mtf import cli  # noqa: E402

#: How long [s] a rank that finished a case waits for the others before it ends the job.
CASE_WAIT_S = 120.0


def run(case):
    """(exit code, captured output) of one case on this rank."""
    env = case.get("env", {})
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    buf = io.StringIO()
    try:
        with contextlib.redirect_stderr(buf), contextlib.redirect_stdout(buf):
            code = cli.main(case["argv"])
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return code, buf.getvalue()


def meet(comm, case, code, text):
    """Wait for every rank to finish ``case`` (at most CASE_WAIT_S), else end the job."""
    req = comm.Ibarrier()
    end = time.monotonic() + CASE_WAIT_S
    while not req.Test():
        if time.monotonic() > end:
            sys.stderr.write("cli_cases.py: rank %d finished %s (exit code %s) but another rank "
                             "did not within %g s; its output:\n%s\n"
                             % (comm.rank, case["argv"], code, CASE_WAIT_S, text[-3000:]))
            sys.stderr.flush()
            MPI.COMM_WORLD.Abort(1)
        time.sleep(0.01)


def write(results, path):
    with open(path, "w") as f:
        json.dump(results, f)


def main(cases_path, results_path):
    with open(cases_path) as f:
        cases = json.load(f)
    comm = MPI.COMM_WORLD.Dup()   # the script's own: never matched with the command's
    results = []
    for case in cases:
        code, text = run(case)
        meet(comm, case, code, text)
        codes, texts = comm.gather(code, root=0), comm.gather(text, root=0)
        if comm.rank == 0:
            results.append({"codes": codes, "err": texts})
        if comm.bcast(comm.rank == 0 and len(set(codes)) > 1, root=0):
            if comm.rank == 0:
                write(results, results_path)
                sys.stderr.write("cli_cases.py: the ranks ended %s with exit codes %s\n"
                                 % (case["argv"], codes))
                sys.stderr.flush()
            comm.Barrier()
            MPI.COMM_WORLD.Abort(1)
    if comm.rank == 0:
        write(results, results_path)


if __name__ == "__main__":
    main(*sys.argv[1:3])
    launch_env.exit_process(0)   # as the command exits (flowpm_mtf.cli.entry)
