"""A gradient job across hosts: reconstruct on 2 nodes x 2 ranks of the simulated cluster
(``scripts/sim_cluster.sh``) against the same job and process grid (2x2) on one host
(issue 58, item 2; simulate is in tests/test_sim_cluster.py).

The job is launched the way users launch it across nodes: ``scripts/run_mpirun.sh`` with
the cluster's hostfile (``COMMAND=reconstruct``, 2 ranks per node: grid row 0 on node1,
row 1 on node2, so every exchange along the P axis crosses the nodes' TCP link), and on one
host by plain ``mpirun -np 4``. The outputs must be bit-identical: every dataset and
attribute of every HDF5 file of the run directory (the main file and its per-rank parts),
every other file byte for byte (the manifest's digests; the text outputs also read back),
and summary.json but for where and how long it ran. (The main HDF5 file's bytes differ in
the creation times of its virtual datasets only.) Both runs get the same thread pools per
rank (THREADS below). summary.json names the hosts ["node1", "node2"], and node2's link
received at least the scaling model's P-axis bytes of the job's 2LPT forward models (so the
exchanges went over TCP, not shared memory). ``down`` leaves no namespace.

Why reconstruct and simulate, and not every job: a job differs between two nodes and one
host only through what depends on the node (hostname, local rank and size, thread pools,
the launcher, TCP instead of shared memory), and all of that is shared code (the runtime,
the backend, the runner, the run files) that every job goes through; the jobs' own modules
read none of it. The Horovod collectives the lensing and imaging jobs issue are those of
simulate and reconstruct (allreduce on all ranks, alltoall and receive on the 2-rank axis
sets; lensing in float32 where these run float64). Their own physics is checked on one
host, on the 2x2 grid too (tests/test_lensing_job.py, tests/test_imaging_job.py, ...), and
a bug there would be the same on both sides of this comparison.

The cluster is this module's own (``fpmjobs``), never test_sim_cluster.py's ``fpmtest`` or
one made by hand. Needs root and network namespaces; elsewhere skipped with the reason.
"""
import json
import os
import subprocess
import sys
import tempfile

import h5py
import numpy as np
import pytest

from flowpm_bench.launch import clean_env, mpirun_command
from test_sim_cluster import (JOB_TIMEOUT_S, REPO, SCRIPT, VENV, _env, _unavailable,
                              counters, finish, namespaces, two_node_cluster)
from test_sim_cluster import sim as _sim

# It starts its own MPI jobs: the 1-rank pass runs it.
pytestmark = pytest.mark.single_process
if _unavailable():
    pytestmark = [pytestmark, pytest.mark.skip(reason=_unavailable())]

NAME = "fpmjobs"            # this module's cluster
GRID = (2, 2)

# The smallest run that still exercises the job on the 2x2 grid (every rank a block of
# 8 x 8 cells in x, y): CLI arguments (beside --grid and --out), the main HDF5 file, the
# text outputs.
JOBS = {
    # tests/test_reconstruct.py's problem (16^3, 2LPT forward model, float64), 3 iterations
    "reconstruct": (["--nc", "16", "--box-size", "100", "--halo", "4", "--seed", "7",
                     "--dtype", "float64", "--learning-rate", "0.1", "--noise", "0.1",
                     "--forward", "lpt", "--a-start", "0.1", "--iterations", "3",
                     "--log-every", "1", "--no-plot"],
                    "reconstruction.h5", ("reconstruction.txt",)),
}
# TensorFlow's thread pools of every rank, in both runs: what each rank gets on a 2-core
# machine either way (its node's cores divided among its node's ranks: 2 // 2 on a node of
# the cluster, 2 // 4 floored to 1 on one host), set so that the runs stay comparable on a
# machine with more cores (bit-identity needs the same intra-op count: e.g. float64
# tf.nn.conv3d sums in another order with 2 threads than with 1).
THREADS = {"FLOWPM_MTF_INTRA_THREADS": "1", "FLOWPM_MTF_INTER_THREADS": "2"}
# summary.json entries that say where and how long a run ran, not what it computed: the
# only ones allowed to differ between the two runs (the hosts are checked on their own).
WHERE_AND_HOW_LONG = ("timings", "peak_memory_mb_per_rank", "memory_phases_mb_per_rank",
                      "ranks", "hosts")


def sim(*args, **kw):
    return _sim(*args, name=NAME, **kw)



def model_bytes(job, summary):
    """At least what node2's two ranks receive over the link during the job: the scaling
    model's P-axis bytes (scripts/scaling_model.py internode_bytes; each row of the grid on
    a node of its own) of the job's transforms counted here, a subset of what it runs.
    Shared memory across the nodes would leave only the launcher's and Horovod's control
    bytes on the link."""
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import scaling_model

    if job != "reconstruct":
        raise ValueError("no byte model for the job %r" % job)
    # float64: the truth's 2LPT, then >= one forward 2LPT per iteration
    per_lpt = 2 * scaling_model.internode_bytes("lpt", 16, GRID, 4, itemsize=8)
    return (1 + summary["reconstruction"]["iterations"]) * per_lpt


@pytest.fixture(scope="module")
def cluster():
    yield from two_node_cluster(NAME)


def _args(job):
    return ["--grid", "%dx%d" % GRID] + JOBS[job][0]


def one_host(job, out):
    """The job on this host: plain ``mpirun -np 4``, grid 2x2."""
    cmd = mpirun_command(4) + [os.path.join(VENV, "bin", "flowpm-mtf"), job, *_args(job),
                               "--out", out]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=JOB_TIMEOUT_S,
                          env=clean_env(**THREADS), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]


def two_nodes(job, out, hostfile):
    """The job on node1 and node2 (2 ranks each) through ``scripts/run_mpirun.sh``."""
    env = {"NP": "4", "HOSTFILE": hostfile, "GPUS_PER_NODE": "2", "COMMAND": job,
           "OUT": out, "VENV": VENV, **THREADS}   # run_mpirun.sh passes THREADS on (-x)
    cmd = ["bash", SCRIPT, "run", "env"] + ["%s=%s" % kv for kv in env.items()] + [
        "bash", os.path.join(REPO, "scripts", "run_mpirun.sh"), *_args(job)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env(NAME), cwd=REPO)
    rc, log = finish(proc)
    assert rc == 0, log[-3000:]


def h5_contents(path):
    """{name: value} of every dataset and attribute of an HDF5 file (virtual datasets read
    through their sources)."""
    with h5py.File(path, "r") as f:
        items = {"/@" + k: v for k, v in f.attrs.items()}

        def visit(name, obj):
            for k, v in obj.attrs.items():
                items[name + "@" + k] = v
            if isinstance(obj, h5py.Dataset):
                items[name] = obj[...]
        f.visititems(visit)
    return items


def manifest(run):
    with open(os.path.join(run, "manifest.json")) as f:
        return json.load(f)


def files_of(run):
    """Paths of a run directory's files, relative to it."""
    return sorted(os.path.relpath(os.path.join(d, n), run)
                  for d, _, names in os.walk(run) for n in names)


def assert_same(a, b, what):
    """Bit-identical values (arrays: same dtype, shape and bytes; NaN equal to NaN)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype,
                                                           a.shape, b.shape)
        if a.dtype.kind == "f" or a.dtype.kind == "c":
            diff = np.abs(a - b)
            worst = float(np.nanmax(diff)) if diff.size else 0.0
            assert a.tobytes() == b.tobytes(), "%s differs: max |diff| %.3g" % (what, worst)
        else:
            assert a.tobytes() == b.tobytes(), what
    else:
        assert a == b, what


@pytest.mark.parametrize("job", list(JOBS))
def test_job_on_two_nodes_equals_one_host(cluster, job, tmp_path):
    ref, run = str(tmp_path / "one_host"), str(tmp_path / "two_nodes")
    one_host(job, ref)
    before = counters("node2", NAME)
    two_nodes(job, run, cluster)
    after = counters("node2", NAME)

    with open(os.path.join(run, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(ref, "summary.json")) as f:
        ref_summary = json.load(f)
    assert summary["hosts"] == ["node1", "node2"]
    assert summary["config"]["grid"] == list(GRID)
    assert [r["host"] for r in summary["ranks"]] == ["node1", "node1", "node2", "node2"]
    assert ref_summary["hosts"] == [os.uname().nodename]
    for ranks in (summary["ranks"], ref_summary["ranks"]):
        assert [(r["intra_threads"], r["inter_threads"]) for r in ranks] == [(1, 2)] * 4
    received = after[1] - before[1]
    assert received >= model_bytes(job, summary), (received, model_bytes(job, summary))

    # the same files, and the same bytes (manifest.json's digests) but for summary.json and
    # the main HDF5 file: its virtual datasets carry their creation time (HDF5 object
    # modification times), so that file is compared by content below, as every HDF5 file
    names = files_of(run)
    assert names == files_of(ref)
    digests = [{f["path"]: f["blake3"] for f in manifest(d)["files"]} for d in (run, ref)]
    assert sorted(digests[0]) == sorted(digests[1]) == sorted(
        n for n in names if n != "manifest.json")
    assert [p for p in digests[0] if digests[0][p] != digests[1][p]
            and p not in ("summary.json", JOBS[job][1])] == []
    h5_files = [n for n in names if n.endswith(".h5")]
    main_h5, texts = JOBS[job][1], JOBS[job][2]
    assert main_h5 in h5_files and len(h5_files) == 1 + 4, h5_files   # main file + 4 parts
    for name in h5_files:
        a, b = h5_contents(os.path.join(run, name)), h5_contents(os.path.join(ref, name))
        assert sorted(a) == sorted(b), name
        assert any(isinstance(v, np.ndarray) and v.ndim >= 1 for v in a.values()), name
        for key in a:
            assert_same(a[key], b[key], "%s:%s" % (name, key))
    for name in texts:
        with open(os.path.join(run, name), "rb") as f, open(os.path.join(ref, name), "rb") as g:
            assert f.read() == g.read(), name
    results = [k for k in ref_summary if k not in WHERE_AND_HOW_LONG]
    assert sorted(results) == sorted(k for k in summary if k not in WHERE_AND_HOW_LONG)
    for key in results:
        assert summary[key] == ref_summary[key], key


def test_down_leaves_no_namespace(cluster):
    assert sim("down").returncode == 0
    assert namespaces(NAME) == []
    assert not os.path.exists(os.path.join(tempfile.gettempdir(), "flowpm-sim-cluster-" + NAME))
