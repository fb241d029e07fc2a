"""The batch scripts on a real Slurm.

A private one-node Slurm 22.05 cluster (:mod:`slurm_harness`: munged, slurmctld and
slurmd in a temporary directory, stopped at the end of this module) runs the template
``slurm/single_node_multi_gpu.sbatch`` exactly as it is in the repository; only sbatch
command-line options adapt it to this CPU-only node (``--gpus-per-node=0``, ranks per node,
one CPU per task). ``slurm/multi_node.sbatch`` runs the same way on two simulated nodes
(tests/test_slurm_multinode.py: every line of it, on more than one node, and the preempted run
that resumes; the two templates differ only in their node defaults, checked here). srun starts
the ranks through PMIx (Debian's Open MPI 4.1 is built against PMIx and has no Slurm
PMI-1/PMI-2 support, so ``--mpi=pmi2`` fails here). The jobs are tiny (16^3 cells).

These tests start their own jobs (``single_process``: the 1-rank pass runs them). Without
root or without the Slurm packages the Slurm tests are skipped with the reason.
"""
import glob
import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from slurm_harness import MARKER, SlurmCluster, kill_leftovers, marked_pids, unavailable_reason

pytestmark = pytest.mark.single_process

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SINGLE = os.path.join(REPO, "slurm", "single_node_multi_gpu.sbatch")
MULTI = os.path.join(REPO, "slurm", "multi_node.sbatch")
#: The jobs: 16^3 cells, halo 4 (< the 8-cell blocks of a 2x2 grid).
NC = 16
HALO = 4
#: Steps of a preempted run and its reference (tests/test_slurm_multinode.py, and the opt-in
#: lensing case here): the loop must last long enough for the SIGTERM to arrive in it: 10-20 ms per step at 16^3 plus the checkpoints, i.e. seconds.
STEPS = 200
CHECKPOINT_EVERY = 10
#: Steps of the uninterrupted single-node run (nothing to stop: a few steps suffice).
TEMPLATE_STEPS = 4
#: Seconds a tiny job may take on this loaded 2-core machine before it counts as hung.
JOB_TIMEOUT_S = 420
#: pytest-timeout limit of a test that runs up to two jobs (CI's --timeout 600 is per test;
#: each job is bounded by JOB_TIMEOUT_S on its own).
two_jobs_timeout = pytest.mark.timeout(2 * JOB_TIMEOUT_S + 120)
#: sbatch options that fit the GPU templates to this CPU-only node.
CPU_NODE = ("--gpus-per-node=0", "--cpus-per-task=1", "--time=00:15:00")


def skip_unless_slurm_can_run():
    """Skip (with the reason) where no test cluster can run."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def slurm():
    """The running test cluster (skips with the reason when it cannot run here)."""
    skip_unless_slurm_can_run()
    with SlurmCluster() as cluster:
        yield cluster


def job_env(cluster, **extra):
    """Environment of a submission: the cluster's, this venv, the template variables."""
    env = dict(cluster.env, VENV=sys.prefix, PYTHONUNBUFFERED="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def submit(cluster, template, out, log_dir, ntasks, nodes=1, **env):
    """sbatch ``template`` unchanged (options on the command line) from the repository.

    ``ntasks`` ranks on each of ``nodes`` nodes.

    Returns
    -------
    (int, str)
        The job id and its output file.
    """
    log = os.path.join(str(log_dir), "%s-%%j.out" % os.path.basename(str(out)))
    options = CPU_NODE + ("--nodes=%d" % nodes, "--ntasks-per-node=%d" % ntasks,
                          "--output=" + log)
    job_id = cluster.sbatch(template, options, args=("--halo", str(HALO), "--no-plot"),
                            env=job_env(cluster, NC=NC, OUT=out, **env), cwd=REPO)
    return job_id, log.replace("%j", str(job_id))


def finished(cluster, job_id, log):
    """Wait for the job; assert it COMPLETED with exit code 0; returns its output."""
    info = cluster.wait(job_id, JOB_TIMEOUT_S)
    text = open(log, errors="replace").read() if os.path.exists(log) else "(no output file)"
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", \
        "job %d: %s, exit %s\n%s" % (job_id, info["JobState"], info["ExitCode"], text[-4000:])
    return text


def read_snapshot(path):
    """The snapshot's datasets, particles sorted by id when the file has ids."""
    import h5py

    with h5py.File(path, "r") as f:
        data = {name: f[name][...] for name in f if isinstance(f[name], h5py.Dataset)}
    if "id" in data:
        order = np.argsort(data["id"], kind="stable")
        for name in ("id", "position", "velocity"):
            data[name] = data[name][order]
    return data


def check_run(out, ntasks, steps):
    """A complete run of ``ntasks`` ranks in ``out``: snapshot and summary."""
    snap = read_snapshot(os.path.join(out, "snapshot.h5"))
    n = NC ** 3
    assert snap["position"].shape == (n, 3) and snap["velocity"].shape == (n, 3)
    assert snap["density"].shape == (NC, NC, NC)
    for name in ("position", "velocity", "density"):
        assert np.all(np.isfinite(snap[name])), name
    # CIC painting conserves mass: the mean of 1 + delta is 1
    assert abs(float(snap["density"].mean()) - 1.0) < 1e-4
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    # one MPI world of ntasks ranks: every rank reported its memory, the grid uses them all
    assert len(summary["peak_memory_mb_per_rank"]) == ntasks, summary["peak_memory_mb_per_rank"]
    assert int(np.prod(summary["config"]["grid"])) == ntasks
    assert summary["config"]["n_steps"] == steps and list(summary["config"]["nc"]) == [NC] * 3
    return snap, summary


def check_srun_started_ranks(text, ntasks, nodes=1):
    """The template launched ``ntasks`` ranks on ``nodes`` nodes with srun's PMIx plugin."""
    assert re.search(r"flowpm-mtf: simulate on %d ranks \(%d node\(s\), srun --mpi=pmix\)"
                     % (ntasks, nodes), text), text[-3000:]
    assert "not built with SLURM's PMI support" not in text


@pytest.fixture(scope="module")
def reference(slurm, tmp_path_factory):
    """single_node_multi_gpu.sbatch, 2 ranks, TEMPLATE_STEPS steps, uninterrupted: (out, output)."""
    base = tmp_path_factory.mktemp("slurm-reference")
    out = str(base / "out-reference")
    job_id, log = submit(slurm, SINGLE, out, base, ntasks=2, STEPS=TEMPLATE_STEPS)
    return out, finished(slurm, job_id, log)


def test_leftovers_of_a_dead_test_process_are_killed(tmp_path):
    """The guard ends processes marked by a test process that is gone, and only those."""
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid names an owner that no longer exists
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    orphan = subprocess.Popen(sleeper, env=dict(os.environ, **{MARKER: "%d:%s" % (
        dead.pid, tmp_path / "flowpm-mtf-slurm-gone")}))
    alive = subprocess.Popen(sleeper, env=dict(os.environ, **{MARKER: "%d:%s" % (
        os.getpid(), tmp_path / "flowpm-mtf-slurm-mine")}))
    try:
        t_end = time.monotonic() + 10  # the environment is readable once exec is done
        while {orphan.pid, alive.pid} - set(marked_pids()) and time.monotonic() < t_end:
            time.sleep(0.05)
        killed = kill_leftovers()
        assert orphan.pid in killed and alive.pid not in killed
        assert orphan.wait(timeout=10) == -9 and alive.poll() is None
    finally:
        for p in (orphan, alive):
            p.kill()
            p.wait()


def test_cluster_stops_without_leftovers():
    """start() then stop(): no daemon of the cluster survives, its directory is gone."""
    skip_unless_slurm_can_run()
    with SlurmCluster() as cluster:
        pids = [p.pid for p in cluster.procs.values()]
        assert len(pids) == 3 and set(pids) <= set(marked_pids(cluster.env[MARKER]))
    assert marked_pids(cluster.env[MARKER]) == []
    assert all(p.poll() is not None for p in cluster.procs.values())
    assert not os.path.exists(cluster.root)


def test_pmix_is_the_mpi_plugin_here(slurm):
    """srun offers PMIx, the interface Debian's Open MPI was built for (ext3x component)."""
    proc = slurm.run(["srun", "--mpi=list"])
    plugins = proc.stdout + proc.stderr
    assert "pmix" in plugins, plugins


@two_jobs_timeout
def test_single_node_template(reference):
    out, text = reference
    check_srun_started_ranks(text, 2)
    check_run(out, 2, TEMPLATE_STEPS)


def _has_checkpointing():
    """None when ``flowpm-mtf simulate`` has --checkpoint-every and --resume, else why not."""
    exe = os.path.join(sys.prefix, "bin", "flowpm-mtf")
    proc = subprocess.run([exe, "simulate", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, "%s simulate --help failed:\n%s" % (exe, proc.stderr[-3000:])
    missing = [f for f in ("--checkpoint-every", "--resume") if f not in proc.stdout]
    if missing:
        return ("flowpm-mtf simulate has no %s: the checkpoint/resume/SIGTERM feature "
                "(issue 11, flowpm_mtf/runs/checkpoint.py) is not in this tree" % " / ".join(missing))
    return None


def _wait_for(pattern, log, cluster, job_id, timeout=JOB_TIMEOUT_S):
    """Poll the job's output until ``pattern`` shows up (fails if the job ends first)."""
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        text = open(log, errors="replace").read() if os.path.exists(log) else ""
        if re.search(pattern, text):
            return text
        state = cluster.job(job_id)["JobState"]
        if state not in ("PENDING", "CONFIGURING", "RUNNING"):
            pytest.fail("job %d ended (%s) before %r appeared:\n%s"
                        % (job_id, state, pattern, text[-3000:]))
        time.sleep(0.05)
    pytest.fail("%r did not appear in %s within %d s" % (pattern, log, timeout))


def preempt_and_resume(cluster, template, out, log_dir, ntasks, reference_out, nodes=1):
    """Submit ``template`` (STEPS steps, a checkpoint every CHECKPOINT_EVERY), SIGTERM it
    after its first step, check what it left, submit it again and compare the resumed run's
    snapshot with the uninterrupted run in ``reference_out``: all datasets bit-identical.

    ``ntasks`` ranks on each of ``nodes`` nodes, as :func:`submit`.
    """
    env = dict(STEPS=STEPS, CHECKPOINT_EVERY=CHECKPOINT_EVERY)
    job_id, log = submit(cluster, template, out, log_dir, ntasks=ntasks, nodes=nodes, **env)
    # SIGTERM once the time loop runs (rank 0 logged its first step), through Slurm to
    # every task of the job's steps, as before a time limit (--signal) or at preemption
    _wait_for(r"step 1/%d\b" % STEPS, log, cluster, job_id)
    cluster.run(["scancel", "--signal=TERM", str(job_id)])
    first = finished(cluster, job_id, log)
    steps = sorted(int(os.path.basename(d)[len("step_"):])
                   for d in glob.glob(os.path.join(out, "checkpoint", "step_*")))
    assert steps, "no checkpoint in %s:\n%s" % (out, first[-3000:])
    assert steps[-1] < STEPS, "the run was not stopped early:\n%s" % first[-3000:]
    assert not os.path.exists(os.path.join(out, "summary.json")), \
        "a stopped run must not look complete"

    # the same submission again: the template sees the unfinished run and resumes it
    job_id, log = submit(cluster, template, out, log_dir, ntasks=ntasks, nodes=nodes, **env)
    second = finished(cluster, job_id, log)
    assert "resuming the unfinished run in %s" % out in second, second[-3000:]
    resumed, _ = check_run(out, ntasks * nodes, STEPS)
    expected = read_snapshot(os.path.join(reference_out, "snapshot.h5"))
    assert sorted(resumed) == sorted(expected)
    for name, value in expected.items():
        assert resumed[name].dtype == value.dtype and np.array_equal(resumed[name], value), \
            "%s differs from the uninterrupted run's (stopped after step %d)" % (name, steps[-1])
    return first, second


#: Lines in which slurm/multi_node.sbatch may differ from slurm/single_node_multi_gpu.sbatch:
#: comments, the node count, the default mesh, and the inter-node Horovod settings.
TEMPLATE_DIFFERENCES = re.compile(
    r"[+-](#(?!SBATCH).*|#SBATCH --nodes=\d+|NC=\"\$\{NC:-\d+\}\""
    r"|export (HOROVOD_FUSION_THRESHOLD|HOROVOD_CYCLE_TIME)=.*)")


def test_templates_differ_only_in_their_node_defaults():
    """The two templates run the same script: the same options, environment, resume logic
    (RESUME=auto finds the unfinished run) and launch line. So the preemption test of
    tests/test_slurm_multinode.py (multi_node.sbatch stopped by Slurm's SIGTERM, submitted
    again, bit-identical) checks the single-node template's resume as well, and this module
    runs that template uninterrupted only."""
    import difflib

    with open(SINGLE) as f, open(MULTI) as g:
        single, multi = f.read().splitlines(), g.read().splitlines()
    changed = [line for line in difflib.unified_diff(single, multi, lineterm="", n=0)
               if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert any(line.startswith("+#SBATCH --nodes=") for line in changed), changed
    assert [line for line in changed if not TEMPLATE_DIFFERENCES.fullmatch(line)] == []


def _datasets(path):
    import h5py

    with h5py.File(path, "r") as f:
        return {name: f[name][...] for name in f if isinstance(f[name], h5py.Dataset)}


# Opt-in (FLOWPM_MTF_SLOW_TESTS=1; 76-143 s): Slurm's preemption and resubmission are
# checked by tests/test_slurm_multinode.py (test_preempted_run_on_two_nodes_resumes_bit_identical,
# which covers the single-node template too: test_templates_differ_only_in_their_node_defaults), the lensing job's SIGTERM and resume
# under mpirun by tests/test_lensing_resume.py; this runs the two together.
@pytest.mark.skipif(not os.environ.get("FLOWPM_MTF_SLOW_TESTS"),
                    reason="slow; set FLOWPM_MTF_SLOW_TESTS=1")
@pytest.mark.timeout(3 * JOB_TIMEOUT_S + 120)
def test_preempted_lensing_resumes_bit_identical(slurm, tmp_path):
    """COMMAND=lensing through the template: stopped by Slurm's SIGTERM mid-run, submitted
    again, and its convergence maps equal the uninterrupted run's bit for bit."""
    env = dict(COMMAND="lensing", STEPS=STEPS)
    ref = str(tmp_path / "lens-reference")
    job_id, log = submit(slurm, SINGLE, ref, tmp_path, ntasks=2, **env)
    finished(slurm, job_id, log)
    out = str(tmp_path / "lens-preempted")
    env["CHECKPOINT_EVERY"] = CHECKPOINT_EVERY
    job_id, log = submit(slurm, SINGLE, out, tmp_path, ntasks=2, **env)
    _wait_for(r"step 1/\d+\b", log, slurm, job_id)
    slurm.run(["scancel", "--signal=TERM", str(job_id)])
    first = finished(slurm, job_id, log)
    assert glob.glob(os.path.join(out, "checkpoint", "step_*")), first[-3000:]
    assert not os.path.exists(os.path.join(out, "summary.json")), first[-3000:]
    job_id, log = submit(slurm, SINGLE, out, tmp_path, ntasks=2, **env)
    second = finished(slurm, job_id, log)
    assert "resuming the unfinished run in %s" % out in second, second[-3000:]
    expected = _datasets(os.path.join(ref, "kappa.h5"))
    resumed = _datasets(os.path.join(out, "kappa.h5"))
    assert expected and sorted(resumed) == sorted(expected)
    for name, value in expected.items():
        assert resumed[name].dtype == value.dtype and np.array_equal(resumed[name], value), name
