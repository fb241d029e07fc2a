"""Across hosts: bytes between nodes per step against the scaling model, step time on 2 nodes
against one host, and weak scaling over 1, 2 and 4 nodes, on the simulated cluster.

Every run is ``flowpm-mtf simulate`` (float32, 2LPT, grid as stated) launched by
``scripts/run_mpirun.sh`` with the hostfile of a cluster that ``scripts/sim_cluster.sh`` makes
(nodes: network + UTS namespaces, TCP over veth links; docs/clusters.md). The bytes are the
kernel's counters of each node's link (``/sys/class/net/eth0/statistics``), read before and
after each run.

* **Bytes per step**: two runs that differ only in their number of steps (``--steps`` S1, S2):
  (bytes(S2) - bytes(S1)) / (S2 - S1) is what one step moves across node2's link, start-up,
  graph, ICs and output cancelling out. The model (``scripts/scaling_model.py``
  ``internode_bytes``) is what the ranks of node2 receive over the first mesh axis, which
  spans the nodes (ranks ``p Q .. p Q + Q - 1`` on node p): the all-to-all pieces of the
  FFTs and the halo margins along x, plus the migration's two x buffers per rank
  (``summary.json`` ``migration.bytes_sent_per_rank_per_step`` / 2: fixed-capacity buffers,
  sent full). The wire adds TCP/IP and Ethernet framing (66 bytes per segment of at most
  1448 payload bytes, and ACKs) and Horovod's control messages (a few per millisecond cycle).
* **Step time**: the median step of 2 nodes x 2 ranks against 4 ranks on one host (shared
  memory), same grid.
* **Weak scaling**: 1, 2, 4 nodes x 1 rank with ~32^3 particles per rank (32^3 on 1x1, 40^3
  on 2x1, 52^3 on 2x2).

All nodes share this machine's cores: the times measure what TCP between the nodes costs
against shared memory, not the speed of more hardware. Run it alone (``uptime``)::

    python scripts/bench_internode.py                 # all, writes results/bench_internode.md
    python scripts/bench_internode.py --quick         # smoke run: 16^3, 1 and 3 steps

Needs root (namespaces). The cluster it makes (``FLOWPM_SIM_CLUSTER=fpmbench``) is removed at
the end, also after a failure.
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from flowpm_bench import REPO, RESULTS  # noqa: E402
from flowpm_bench.launch import clean_env, mpirun_command  # noqa: E402
from flowpm_bench.provenance import commit_label  # noqa: E402
from flowpm_bench.results import json_path, read_json, write_result  # noqa: E402

import scaling_model  # noqa: E402

NAME = "fpmbench"
SCRIPT = os.path.join(REPO, "scripts", "sim_cluster.sh")
VENV = sys.prefix
FRAME = 66        # Ethernet 14 + IPv4 20 + TCP with timestamps 32 [bytes per segment]
MSS = 1448        # payload per segment on a 1500-byte MTU with timestamps [bytes]
WEAK = ((1, 32, "1x1"), (2, 40, "2x1"), (4, 52, "2x2"))


def env():
    return clean_env(FLOWPM_SIM_CLUSTER=NAME, FLOWPM_SIM_CLUSTER_DIR=os.path.join(
        tempfile.gettempdir(), "flowpm-sim-cluster-" + NAME))


def sim(*args):
    proc = subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, env=env(),
                          timeout=120)
    if proc.returncode:
        raise RuntimeError("sim_cluster.sh %s: %s" % (" ".join(args), proc.stderr.strip()))
    return proc.stdout


def link_bytes(node):
    """(tx, rx) of a node's link [bytes]."""
    ns = "%s-%s" % (NAME, node)
    return tuple(int(subprocess.run(["ip", "netns", "exec", ns, "cat",
                                     "/sys/class/net/eth0/statistics/%s_bytes" % k],
                                    capture_output=True, text=True, check=True).stdout)
                 for k in ("tx", "rx"))


def simulate(out, nc, grid, steps, ranks, per_node=None, hostfile=None):
    """One run; returns (summary, {node: (tx, rx) bytes during the run})."""
    args = ["--nc", str(nc), "--grid", grid, "--steps", str(steps), "--no-plot", "--overwrite"]
    nodes = [] if hostfile is None else ["node%d" % i for i in range(1, ranks // per_node + 1)]
    before = {n: link_bytes(n) for n in nodes}
    if hostfile is None:
        cmd = mpirun_command(ranks) + [os.path.join(VENV, "bin", "flowpm-mtf"), "simulate", *args,
                                       "--out", out]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=clean_env(), cwd=REPO)
    else:
        cmd = ["bash", SCRIPT, "run", "env", "NP=%d" % ranks, "HOSTFILE=" + hostfile,
               "GPUS_PER_NODE=%d" % per_node, "VENV=" + VENV, "OUT=" + out, "bash",
               os.path.join(REPO, "scripts", "run_mpirun.sh"), *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=REPO)
    if proc.returncode:
        raise RuntimeError("run failed (%s):\n%s" % (" ".join(cmd), proc.stderr[-3000:]))
    after = {n: link_bytes(n) for n in nodes}
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    return summary, {n: (after[n][0] - before[n][0], after[n][1] - before[n][1]) for n in nodes}


def median_step(summary):
    steps = summary["timings"]["steps_s"]
    return statistics.median(steps[1:] if len(steps) > 2 else steps)


def framed(payload):
    """Payload bytes plus TCP/IP/Ethernet headers on full segments [bytes]."""
    return payload * (1 + FRAME / MSS)


def bytes_per_step(tmp, nc, s1, s2, hostfile):
    runs = {}
    for s in (s1, s2):
        runs[s] = simulate(os.path.join(tmp, "bytes-%d-%d" % (nc, s)), nc, "2x2", s, 4, 2,
                           hostfile)
    (sum1, b1), (sum2, b2) = runs[s1], runs[s2]
    rx = (b2["node2"][1] - b1["node2"][1]) / (s2 - s1)
    tx = (b2["node2"][0] - b1["node2"][0]) / (s2 - s1)
    fields = 2 * scaling_model.internode_bytes("nbody_step", nc, (2, 2), sum2["config"]["halo_size"])
    migration = 2 * sum2["migration"]["bytes_sent_per_rank_per_step"] / 2
    return {"nc": nc, "steps": [s1, s2], "rx_per_step": rx, "tx_per_step": tx,
            "model_fields": fields, "model_migration": migration,
            "model": fields + migration, "model_framed": framed(fields + migration),
            "halo": sum2["config"]["halo_size"], "two_nodes_step_s": median_step(sum2)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nc", type=int, nargs="+", default=[32, 64],
                    help="meshes of the bytes-per-step and step-time runs (default 32 64)")
    ap.add_argument("--steps", type=int, nargs=2, default=[2, 12], metavar=("S1", "S2"))
    ap.add_argument("--quick", action="store_true", help="smoke run: 16^3, steps 1 and 3, "
                    "weak scaling on 1 and 2 nodes at 16^3 / 20^3")
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--render", action="store_true",
                    help="only rewrite the table from the JSON of the last run")
    args = ap.parse_args(argv)
    if args.quick:
        args.nc, args.steps = [16], [1, 3]
    weak = ((1, 16, "1x1"), (2, 20, "2x1")) if args.quick else WEAK
    name = "bench_internode_quick" if args.quick else "bench_internode"
    if args.render:
        rec = read_json(json_path(args.out, name))
        write_result(args.out, name, rec, render(rec), script="scripts/bench_internode.py")
        return
    load = os.getloadavg()[0]
    hostfile = sim("up", "4").strip()
    rec = {"commit": commit_label(), "date": datetime.datetime.now(datetime.timezone.utc)
           .strftime("%Y-%m-%d %H:%M UTC"), "load_before": load, "bytes": [], "step": [],
           "weak": []}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-internode") as tmp:
            for nc in args.nc:
                b = bytes_per_step(tmp, nc, *args.steps, hostfile)
                rec["bytes"].append(b)
                one, _ = simulate(os.path.join(tmp, "one-%d" % nc), nc, "2x2", args.steps[1], 4)
                rec["step"].append({"nc": nc, "one_host_s": median_step(one),
                                    "two_nodes_s": b["two_nodes_step_s"]})
            for nodes, nc, grid in weak:
                summary, moved = simulate(os.path.join(tmp, "weak-%d" % nodes), nc, grid,
                                          args.steps[1], nodes, 1, hostfile)
                rec["weak"].append({"nodes": nodes, "nc": nc, "grid": grid,
                                    "step_s": median_step(summary),
                                    "node1_tx_rx": moved["node1"]})
    finally:
        sim("down")
    rec["load_after"] = os.getloadavg()[0]
    write_result(args.out, name, rec, render(rec), script="scripts/bench_internode.py")
    print(render(rec))


def render(rec):
    mb = 1e6
    lines = ["# Across hosts on the simulated cluster",
             "",
             "`python scripts/bench_internode.py` (float32, 2LPT; commit %s, %s; load %.1f before, "
             "%.1f after; every node shares the machine's 2 cores)." % (
                 rec["commit"], rec["date"], rec["load_before"], rec.get("load_after", 0.0)),
             "",
             "Bytes per step across node2's link, 2 nodes x 2 ranks, grid 2x2 (the P axis spans "
             "the nodes), measured from two runs of S1 and S2 steps. *scaling.md model*: the "
             "step's FFT all-to-alls and halo margins on the P axis "
             "(`scaling_model.internode_bytes` x 2 ranks) with TCP/IP/Ethernet headers; "
             "*migration*: the eulerian migration's two x buffers per rank at their nominal "
             "capacity (`summary.json`), which that model leaves out.",
             "",
             "| mesh | steps | received [MB/step] | sent [MB/step] | scaling.md model, framed "
             "[MB] | received / model | migration, nominal [MB] | received / (model + "
             "migration) |",
             "|---|---|---|---|---|---|---|---|"]
    for b in rec["bytes"]:
        fields = framed(b["model_fields"])
        lines.append("| %d^3 | %d, %d | %.3f | %.3f | %.3f | %.2f | %.3f | %.2f |" % (
            b["nc"], b["steps"][0], b["steps"][1], b["rx_per_step"] / mb, b["tx_per_step"] / mb,
            fields / mb, b["rx_per_step"] / fields, b["model_migration"] / mb,
            b["rx_per_step"] / b["model_framed"]))
    lines += ["", "Median step, grid 2x2: 4 ranks on one host (shared memory) against 2 nodes x "
              "2 ranks (TCP between the nodes).", "",
              "| mesh | one host [s] | 2 nodes [s] | ratio |", "|---|---|---|---|"]
    for s in rec["step"]:
        lines.append("| %d^3 | %.4f | %.4f | %.2f |" % (s["nc"], s["one_host_s"], s["two_nodes_s"],
                                                       s["two_nodes_s"] / s["one_host_s"]))
    lines += ["", "Weak scaling, 1 rank per node, ~32^3 particles per rank.", "",
              "| nodes | mesh | grid | median step [s] | node1 sent + received [MB] |",
              "|---|---|---|---|---|"]
    for w in rec["weak"]:
        lines.append("| %d | %d^3 | %s | %.4f | %.2f |" % (
            w["nodes"], w["nc"], w["grid"], w["step_s"], sum(w["node1_tx_rx"]) / mb))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
