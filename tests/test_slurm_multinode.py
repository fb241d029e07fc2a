"""Slurm across nodes: srun and the multi-node template on two simulated nodes.

The nodes are those of ``scripts/sim_cluster.sh`` (network + UTS namespaces node1, node2
with their own hostnames and addresses, TCP between them over veth links; this module's
own cluster, ``FLOWPM_SIM_CLUSTER=fpmslurm``, made at the start and removed at the end,
also on failure). On them :class:`slurm_harness.SimSlurmCluster` runs slurmctld in node1's
namespaces, one slurmd in each node's namespaces and the client commands on node1
(docs/clusters.md, "Multi-node Slurm on the simulated cluster"). Checked:

* slurmctld runs in node1's network namespace, each slurmd in its node's, at the node's
  address;
* ``srun --nodes=2 --ntasks-per-node=2 --mpi=pmix hostname`` runs two tasks on each node;
* ``slurm/multi_node.sbatch`` as shipped (only sbatch options and the job environment, as
  in tests/test_slurm.py) runs a simulate on 2 nodes x 2 ranks: COMPLETED, exit 0, and
  summary.json places ranks 0, 1 on node1 and 2, 3 on node2 (local ranks 0, 1 on each);
* that job stopped by ``scancel --signal=TERM`` after its first step leaves a checkpoint
  and nothing published; submitted again it resumes, and its snapshot equals the
  uninterrupted run's bit for bit.

Without root, network namespaces or the Slurm packages the module is skipped with the reason.
"""
import json
import os
import subprocess

import pytest

from slurm_harness import (MARKER, SIM_CLUSTER, SimSlurmCluster, marked_pids, sim_cluster_env,
                           sim_unavailable_reason)
from test_slurm import (MULTI, NC, STEPS, _has_checkpointing, check_run,
                        check_srun_started_ranks, finished, preempt_and_resume, submit,
                        two_jobs_timeout)

pytestmark = pytest.mark.single_process

#: This module's simulated cluster (never one made by hand, "fpmc", or test_sim_cluster's).
NAME = "fpmslurm"
NODES = ["node1", "node2"]
#: Ranks per node of the jobs (2 x 2 = grid 2x2, as the one-node template test's 4 ranks).
PER_NODE = 2


def sim(*args, timeout=120):
    """``bash scripts/sim_cluster.sh ARGS`` on this module's cluster."""
    return subprocess.run(["bash", SIM_CLUSTER, *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, **sim_cluster_env(NAME)))


@pytest.fixture(scope="module")
def slurm():
    """Slurm on two simulated nodes (removed again at the end of the module)."""
    reason = sim_unavailable_reason()
    if reason:
        pytest.skip(reason)
    proc = sim("up", str(len(NODES)))
    try:
        assert proc.returncode == 0, proc.stderr
        with SimSlurmCluster(NAME) as cluster:
            yield cluster
        # stopped: no daemon or job step of the cluster is left, its directory is gone
        assert marked_pids(cluster.env[MARKER]) == [] and not os.path.exists(cluster.root)
    finally:
        down = sim("down")
        assert down.returncode == 0, down.stderr


def netns_of(pid):
    """The name of the network namespace process ``pid`` is in ("" for the host's)."""
    return subprocess.run(["ip", "netns", "identify", str(pid)], capture_output=True,
                          text=True, check=True).stdout.strip()


@pytest.fixture(scope="module")
def reference(slurm, tmp_path_factory):
    """multi_node.sbatch on 2 nodes x 2 ranks, STEPS steps, uninterrupted: (out, output)."""
    base = tmp_path_factory.mktemp("slurm-multinode-reference")
    out = str(base / "out-reference")
    job_id, log = submit(slurm, MULTI, out, base, ntasks=PER_NODE, nodes=len(NODES),
                         STEPS=STEPS)
    return out, finished(slurm, job_id, log)


def test_daemons_run_in_their_nodes_namespaces(slurm):
    assert slurm.nodes == [("node1", "198.18.0.1"), ("node2", "198.18.0.2")]
    assert netns_of(slurm.procs["slurmctld"].pid) == NAME + "-node1"
    for node in NODES:
        assert netns_of(slurm.procs["slurmd-" + node].pid) == "%s-%s" % (NAME, node)
    assert netns_of(slurm.procs["munged"].pid) == ""  # one munged, on the host
    nodes = slurm.run(["sinfo", "-h", "-N", "-o", "%N %o %t"]).stdout.split("\n")
    assert nodes[:2] == ["node1 198.18.0.1 idle", "node2 198.18.0.2 idle"], nodes


def test_srun_runs_tasks_on_both_nodes(slurm):
    proc = slurm.run(["srun", "--nodes=2", "--ntasks-per-node=2", "--mpi=pmix", "hostname"])
    assert sorted(proc.stdout.split()) == ["node1", "node1", "node2", "node2"], \
        proc.stdout + proc.stderr


@two_jobs_timeout
def test_multi_node_template_on_two_nodes(reference):
    out, text = reference
    ranks = PER_NODE * len(NODES)
    check_srun_started_ranks(text, ranks, nodes=len(NODES))
    check_run(out, ranks, STEPS)
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    assert summary["hosts"] == NODES, summary["hosts"]
    placement = [(r["rank"], r["host"], r["local_rank"], r["local_size"])
                 for r in summary["ranks"]]
    # srun's default block distribution: ranks 0, 1 on node1, 2, 3 on node2
    assert placement == [(0, "node1", 0, 2), (1, "node1", 1, 2),
                         (2, "node2", 0, 2), (3, "node2", 1, 2)], placement


@two_jobs_timeout
def test_preempted_run_on_two_nodes_resumes_bit_identical(slurm, request, tmp_path):
    reason = _has_checkpointing()
    if reason:
        pytest.skip(reason)
    reference = request.getfixturevalue("reference")
    out = str(tmp_path / "out-preempted")
    preempt_and_resume(slurm, MULTI, out, tmp_path, PER_NODE, reference[0], nodes=len(NODES))
