"""Jobs across hosts, on the simulated cluster of ``scripts/sim_cluster.sh``.

Two nodes (network + UTS namespaces with their own hostnames, TCP between them over veth
links; docs/clusters.md). The same simulation on 2 nodes x 2 ranks (launched by
``scripts/run_mpirun.sh`` with the cluster's hostfile) is bit-identical to 4 ranks on one
host, and the bytes that cross the nodes' links are at least what the scaling model says
the P axis moves; ``horovodrun -H node1:3,node2:1`` runs a job with three ranks on one node
and one on the other, each rank with its own node's local rank, ranks per node and thread
pools. A node lost in the middle of a run (its processes killed, or its link cut for good)
ends the surviving ranks within the peer timeout with one line naming the lost host,
publishes nothing, and the last checkpoint resumes on the remaining node (another process
grid) to the uninterrupted run's result; a link down for 5 s and back is ridden through
(by the two-node run compared with the one host: one launch checks both).
``down`` removes everything ``up`` made. Bad input to the script: one line each, nothing
left half-made.

Needs root and network namespaces (CI runs as root): elsewhere the module is skipped with
the reason.
"""
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import h5py
import numpy as np
import pytest

from flowpm_bench.launch import clean_env, mpirun_command

pytestmark = pytest.mark.single_process

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "sim_cluster.sh")
VENV = sys.prefix
NAME = "fpmtest"            # the tests' own cluster: never one made by hand ("fpmc")
STEPS, EVERY = 80, 10   # 70 steps after the first checkpoint: the window for the cuts
NC, HALO = 32, 2
# float64: resumed on another grid, only the order of sums differs (tests/test_restart.py)
ARGS = ["--nc", str(NC), "--grid", "2x2", "--steps", str(STEPS), "--halo", str(HALO),
        "--dtype", "float64", "--seed", "11", "--checkpoint-every", str(EVERY), "--no-plot"]
BOX = 200.0
GRID_POS_ATOL = 1e-8         # [Mpc/h], as tests/test_restart.py
GRID_VEL_RTOL = 1e-8         # relative to the rms velocity
PEER_TIMEOUT = 10            # [s] FLOWPM_MTF_PEER_TIMEOUT of the lost-node runs
OUTAGE_S = 5                 # [s] node2's link down in the two-node run (ridden through)
# the survivors end within the peer timeout, plus a heartbeat, plus the start of the
# killing and the launcher noticing it
LOST_BOUND_S = PEER_TIMEOUT + 15
JOB_TIMEOUT_S = 600


def _unavailable():
    if os.name != "posix" or os.geteuid() != 0:
        return "the simulated cluster needs root (network and UTS namespaces)"
    for prog in ("ip", "unshare", "nsenter", "mpirun"):
        if shutil.which(prog) is None:
            return "'%s' is not installed" % prog
    probe = subprocess.run(["unshare", "--net", "--uts", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return "network namespaces cannot be made here: %s" % probe.stderr.strip()[:200]
    return None


if _unavailable():
    pytestmark = [pytestmark, pytest.mark.skip(reason=_unavailable())]


def _env(name=NAME, **extra):
    return clean_env(FLOWPM_SIM_CLUSTER=name,
                     FLOWPM_SIM_CLUSTER_DIR=os.path.join(tempfile.gettempdir(),
                                                         "flowpm-sim-cluster-" + name),
                     **extra)


def sim(*args, name=NAME, timeout=120, **extra):
    """``bash scripts/sim_cluster.sh ARGS`` (CompletedProcess, text)."""
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True,
                          timeout=timeout, env=_env(name, **extra))


def namespaces(name):
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(name + "-")]


def counters(node, name=NAME):
    """(tx, rx) bytes of a node's link (of the cluster ``name``)."""
    ns = "%s-%s" % (name, node)
    return tuple(int(subprocess.run(["ip", "netns", "exec", ns, "cat",
                                     "/sys/class/net/eth0/statistics/%s_bytes" % k],
                                    capture_output=True, text=True, check=True).stdout)
                 for k in ("tx", "rx"))


def node_pids(node):
    out = subprocess.run(["ip", "netns", "pids", "%s-%s" % (NAME, node)], capture_output=True,
                         text=True).stdout
    return [int(p) for p in out.split()]


def launch(out, *extra, hostfile, peer_timeout=None, per_node=2):
    """Popen of ``scripts/run_mpirun.sh`` on node1 with the cluster's hostfile: ``per_node``
    ranks on each node (2: grid 2x2; 1: grid 2x1, rank 0 on node1, rank 1 on node2)."""
    env = {"NP": str(2 * per_node), "HOSTFILE": hostfile, "GPUS_PER_NODE": str(per_node),
           "OUT": out, "VENV": VENV}
    if peer_timeout is not None:
        env["FLOWPM_MTF_PEER_TIMEOUT"] = str(peer_timeout)
    args = ARGS if per_node == 2 else [
        "2x%d" % per_node if a == "2x2" else a for a in ARGS]
    cmd = ["bash", SCRIPT, "run", "env"] + ["%s=%s" % kv for kv in env.items()] + [
        "bash", os.path.join(REPO, "scripts", "run_mpirun.sh"), *args, *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env(), cwd=REPO)


def snapshot(out):
    with h5py.File(os.path.join(out, "snapshot.h5"), "r") as f:
        return {k: f[k][...] for k in ("position", "velocity", "density", "id")}


def wait_for_checkpoint(out, proc, timeout=JOB_TIMEOUT_S):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if glob.glob(os.path.join(out, "checkpoint", "step_*", "manifest.json")):
            return
        if proc.poll() is not None:
            raise AssertionError("the run ended before its first checkpoint:\n"
                                 + proc.stdout.read()[-3000:])
        time.sleep(0.2)
    raise AssertionError("no checkpoint within %d s" % timeout)


def wait_gone(pids, timeout):
    """Seconds until none of ``pids`` is alive (None: still alive after ``timeout``)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        alive = [p for p in pids if os.path.exists("/proc/%d" % p)
                 and _state(p) not in ("Z", "X")]
        if not alive:
            return time.monotonic() - t0
        time.sleep(0.2)
    return None


def _state(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "X"


def rank_pids(node):
    """Pids of the flowpm-mtf ranks (python processes, not their watchdogs) on a node."""
    pids = []
    for p in node_pids(node):
        try:
            with open("/proc/%d/cmdline" % p, "rb") as f:
                cmd = f.read().split(b"\0")
        except OSError:
            continue
        if os.path.basename(cmd[0]).startswith(b"python") and any(
                c.endswith(b"flowpm-mtf") for c in cmd):
            pids.append(p)
    return pids


def finish(proc, timeout=JOB_TIMEOUT_S):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError("still running after %d s:\n%s" % (timeout, out[-3000:]))
    return proc.returncode, out


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("args, message", [
    (["up", "0"], "whole number from 1 to 16, got '0'"),
    (["up", "100"], "whole number from 1 to 16, got '100'"),
    (["up", "two"], "whole number from 1 to 16, got 'two'"),
    (["mpirun", "-np", "2", "hostname"], "no simulated cluster 'fpmbad' is up"),
    (["exec", "node1", "hostname"], "no simulated cluster 'fpmbad' is up"),
    (["link", "node1", "down"], "no simulated cluster 'fpmbad' is up"),
    (["frobnicate"], "unknown command 'frobnicate'"),
])
def test_bad_input_is_one_line_and_leaves_nothing(args, message):
    proc = sim(*args, name="fpmbad")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sim_cluster: error: ") and message in lines[0], \
        proc.stderr
    assert namespaces("fpmbad") == []
    assert not os.path.exists(os.path.join(tempfile.gettempdir(), "flowpm-sim-cluster-fpmbad"))


def test_a_failed_up_removes_what_it_made():
    proc = subprocess.run(["bash", SCRIPT, "up", "2"], capture_output=True, text=True,
                          env=clean_env(FLOWPM_SIM_CLUSTER="fpmbad",
                                        FLOWPM_SIM_CLUSTER_DIR="/proc/no-such-dir"))
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("sim_cluster: error: up failed")
    assert namespaces("fpmbad") == []


# ---------------------------------------------------------------------------- the cluster
def two_node_cluster(name=NAME):
    """The body of a module fixture: ``up 2`` of the cluster ``name``, its hostfile, and
    ``down`` at the end (also after a failure)."""
    proc = sim("up", "2", name=name)
    assert proc.returncode == 0, proc.stderr
    try:
        yield proc.stdout.strip()
    finally:
        sim("down", name=name)


@pytest.fixture(scope="module")
def cluster():
    yield from two_node_cluster()


def test_up_makes_nodes_with_their_own_hostnames(cluster):
    assert sorted(namespaces(NAME)) == ["%s-node1" % NAME, "%s-node2" % NAME,
                                        "%s-switch" % NAME]
    with open(cluster) as f:
        assert f.read().split() == ["node1", "slots=2", "node2", "slots=2"]
    for node in ("node1", "node2"):
        proc = sim("exec", node, "hostname")
        assert proc.stdout.strip() == node, proc.stderr
    assert sim("exec", "node3", "true").returncode == 2


@pytest.fixture(scope="module")
def reference():
    """The run on one host: 4 ranks, grid 2x2."""
    out = tempfile.mkdtemp(prefix="simcluster-ref")
    cmd = mpirun_command(4) + [os.path.join(VENV, "bin", "flowpm-mtf"), "simulate", *ARGS,
                               "--out", os.path.join(out, "run")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=JOB_TIMEOUT_S,
                          env=clean_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    yield os.path.join(out, "run")
    shutil.rmtree(out, ignore_errors=True)


@pytest.fixture(scope="module")
def two_node_run(cluster, tmp_path_factory):
    """The simulation on 2 nodes x 2 ranks (``scripts/run_mpirun.sh``, the default peer
    timeout of 60 s), node2's link taken down for OUTAGE_S after the run's first checkpoint
    and up again: (run directory, rc, output, bytes node2 received, whether the job was
    still running when the link came back)."""
    out = str(tmp_path_factory.mktemp("two-nodes") / "run")
    before = counters("node2")
    proc = launch(out, hostfile=cluster)
    try:
        wait_for_checkpoint(out, proc)
        down = sim("link", "node2", "down")
        time.sleep(OUTAGE_S)
    except BaseException:
        proc.kill()
        raise
    finally:
        up = sim("link", "node2", "up")
    assert down.returncode == 0 and up.returncode == 0, down.stderr + up.stderr
    running = proc.poll() is None
    rc, log = finish(proc)
    after = counters("node2")
    return out, rc, log, after[1] - before[1], running


def test_simulate_on_two_nodes_equals_one_host_over_tcp(two_node_run, reference):
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import scaling_model

    out, rc, log, received, _ = two_node_run
    assert rc == 0, log[-3000:]
    a, b = snapshot(out), snapshot(reference)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    assert summary["hosts"] == ["node1", "node2"]
    assert [r["host"] for r in summary["ranks"]] == ["node1", "node1", "node2", "node2"]
    # Ranks 2, 3 (grid row 1) are on node2: every P-axis exchange crosses the link. What
    # node2 received is at least the model's P-axis bytes of the ICs and the steps (shared
    # memory across the nodes would leave only the launcher's and Horovod's control bytes).
    model = 2 * (scaling_model.internode_bytes("lpt", NC, (2, 2), HALO, itemsize=8)
                 + STEPS * scaling_model.internode_bytes("nbody_step", NC, (2, 2), HALO,
                                                         itemsize=8))
    assert received >= model, (received, model)


def test_horovodrun_three_ranks_on_one_node_and_one_on_the_other(cluster, tmp_path):
    out = str(tmp_path / "run")
    # the FFT demo: the smallest graph that runs through the job runner (summary.json)
    cmd = ["bash", SCRIPT, "run", "env", "NP=4", "HOSTS=node1:3,node2:1", "NC=16",
           "COMMAND=fft-demo", "OUT=" + out, "VENV=" + VENV,
           "bash", os.path.join(REPO, "scripts", "run_horovodrun.sh"),
           "--repeats", "1", "--grid", "2x2", "--no-plot"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=JOB_TIMEOUT_S,
                          env=_env(), cwd=REPO)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    with open(os.path.join(out, "summary.json")) as f:
        ranks = json.load(f)["ranks"]
    assert [(r["host"], r["local_rank"], r["local_size"]) for r in ranks] == [
        ("node1", 0, 3), ("node1", 1, 3), ("node1", 2, 3), ("node2", 0, 1)]
    # each node's 2 cores divided among its own ranks (hvd_mesh_impl.runtime.thread_counts)
    cores = os.cpu_count()
    assert [r["intra_threads"] for r in ranks] == [max(1, cores // 3)] * 3 + [cores]


def _lost_node_run(out, hostfile, cut, per_node=2):
    """Start the run (``per_node`` ranks on each node), wait for its first checkpoint,
    ``cut()`` node2; return (seconds until node1's ranks were gone, the launcher's rc, its
    output)."""
    proc = launch(out, hostfile=hostfile, peer_timeout=PEER_TIMEOUT, per_node=per_node)
    try:
        wait_for_checkpoint(out, proc)
        survivors = rank_pids("node1")
        assert len(survivors) == per_node
        cut()
        gone = wait_gone(survivors, LOST_BOUND_S + 30)
    finally:
        sim("link", "node2", "up")
    rc, log = finish(proc, timeout=120)
    return gone, rc, log


def _check_lost(out, gone, rc, log):
    assert gone is not None and gone <= LOST_BOUND_S, (gone, log[-3000:])
    assert rc != 0
    # the watchdog's line names the lost host (Open MPI's own message, when the launcher
    # notices first, may name none: "ORTE was unable to reliably start one or more daemons")
    assert re.search(r"^flowpm-mtf: error: lost ranks? [0-9, ]+ on host node2: ", log,
                     re.MULTILINE), log[-3000:]
    # nothing published as a complete run; the checkpoint is intact
    assert not os.path.exists(os.path.join(out, "summary.json"))
    assert not os.path.exists(os.path.join(out, "manifest.json"))
    assert glob.glob(os.path.join(out, "checkpoint", "step_*", "manifest.json"))


def test_a_killed_node_ends_the_job_and_resumes_on_the_other(cluster, reference, tmp_path):
    """One rank on each node (grid 2x1; the cut link below has two on each, and the ranks
    that hear of the loss from another rank): node2 killed, the run resumes on one rank of
    node1 (grid 1x1) to the one host's 2x2 result."""
    out = str(tmp_path / "run")

    def kill_node2():
        for pid in node_pids("node2"):   # every process of the node: daemon, ranks, watchdogs
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    gone, rc, log = _lost_node_run(out, cluster, kill_node2, per_node=1)
    _check_lost(out, gone, rc, log)
    # resume on node1 alone: 1 rank, another process grid (1x1)
    cmd = ["bash", SCRIPT, "mpirun", "-np", "1", "--host", "node1:1",
           os.path.join(VENV, "bin", "flowpm-mtf"), "simulate", "--resume", out, "--grid", "1x1",
           "--no-plot"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=JOB_TIMEOUT_S,
                          env=_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = snapshot(out), snapshot(reference)
    order_a, order_b = np.argsort(a["id"]), np.argsort(b["id"])
    dp = np.abs(a["position"][order_a] - b["position"][order_b])
    assert np.minimum(dp, BOX - dp).max() < GRID_POS_ATOL
    vrms = np.sqrt(np.mean(b["velocity"] ** 2))
    assert np.abs(a["velocity"][order_a] - b["velocity"][order_b]).max() < GRID_VEL_RTOL * vrms


def test_a_cut_link_ends_the_job_within_the_peer_timeout(cluster, tmp_path):
    out = str(tmp_path / "run")
    gone, rc, log = _lost_node_run(out, cluster, lambda: sim("link", "node2", "down"))
    _check_lost(out, gone, rc, log)
    # rank 0's watchdog names both ranks of the node; rank 1 hears it from rank 0
    assert ("flowpm-mtf: error: lost ranks 2, 3 on host node2: no heartbeat for 1" in log
            and "(reported by rank 0); ending rank 1 on host node1" in log), log[-3000:]


def test_a_link_down_for_5_s_is_ridden_through(two_node_run):
    """The run of the test above: its link was down for OUTAGE_S in the middle of the run
    (the job still ran when it came back), and the run completed (its result equals the
    one host's, checked there)."""
    out, rc, log, _, running = two_node_run
    assert running, "the run ended before the link came back: no outage in it\n" + log[-3000:]
    assert rc == 0, log[-3000:]
    assert os.path.exists(os.path.join(out, "summary.json"))


def test_down_removes_everything(cluster):
    assert sim("down").returncode == 0
    assert namespaces(NAME) == []
    assert not os.path.exists(os.path.join(tempfile.gettempdir(), "flowpm-sim-cluster-" + NAME))
    assert not glob.glob("/etc/netns/%s-*" % NAME)
    with open("/proc/mounts") as f:
        assert "flowpm-sim-cluster-" + NAME not in f.read()
    assert sim("down").returncode == 0     # idempotent
