"""A private one-node Slurm cluster on this machine, for the tests of the batch scripts.

:class:`SlurmCluster` writes a ``slurm.conf`` for this host into a temporary
directory, starts ``munged`` (own key, socket, pid, log and seed files),
``slurmctld`` and ``slurmd`` there (foreground processes, children of the test
process: no systemd, nothing under ``/etc`` or ``/var`` is used), and stops
them again. Nothing leaves the machine: both daemons listen on free high TCP
ports of 127.0.0.1 and the node is this host (``hostname -s``).

Daemons left behind by an earlier test process that was killed (so its
finalizer never ran) are found by the marker variable :data:`MARKER` in their
environment, which names the process that started them: if that process is
gone, :func:`kill_leftovers` ends them (and their job steps, which carry the
same marker) by pid. The daemons also get ``PR_SET_PDEATHSIG`` so that they end
when the test process dies.

Requirements: root (``SlurmUser=root``: slurmd starts job steps as the
submitting user) and the Debian packages ``slurmctld slurmd slurm-client
munge`` (``scripts/setup_env.sh`` installs them when run as root).
:func:`unavailable_reason` says why a cluster cannot be started here.

:class:`SimSlurmCluster` is the same on the nodes of a simulated cluster
(``scripts/sim_cluster.sh up N``: network + UTS namespaces ``node1..nodeN`` with
addresses on a bridge): slurmctld runs in node1's namespaces and listens on node1's
address, one slurmd per node runs in that node's namespaces (``sim_cluster.sh exec
nodeK slurmd -N nodeK``; own spool, pid and log files through ``%n``), the client
commands run on node1. One munged serves all of them: its socket is a file on the
shared file system, which every namespace reaches.
"""
import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

#: Environment variable ``<owner pid>:<cluster dir>`` carried by every process of a test cluster.
MARKER = "FLOWPM_MTF_TEST_SLURM"
#: Programs the cluster needs (Debian packages slurmctld, slurmd, slurm-client, munge).
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "sinfo")
#: The templates run 4 ranks per node: a node with fewer CPUs is declared with this many
#: (``SlurmdParameters=config_overrides``), i.e. oversubscribed.
MIN_CPUS = 4
#: Seconds to wait for the daemons to come up / for running jobs to end at shutdown.
START_TIMEOUT_S = 120
STOP_TIMEOUT_S = 30
#: Job states after which a job does not change any more.
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def unavailable_reason():
    """Why no test cluster can run here (a sentence), or None when it can."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "the Slurm tests need Linux"
    if os.geteuid() != 0:
        return ("the test Slurm cluster runs slurmctld/slurmd as root (SlurmUser=root) and "
                "this test process is not root")
    missing = [p for p in PROGRAMS if shutil.which(p) is None]
    if missing:
        return ("Slurm is not installed (missing %s): run scripts/setup_env.sh as root or "
                "apt-get install slurmctld slurmd slurm-client munge" % ", ".join(missing))
    return None


def free_port():
    """A TCP port of 127.0.0.1 that is free right now (from the kernel's ephemeral range)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _marker_of(pid):
    """The :data:`MARKER` value in the environment of process ``pid`` (None if absent)."""
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return None
    prefix = MARKER.encode() + b"="
    for item in env:
        if item.startswith(prefix):
            return item[len(prefix):].decode(errors="replace")
    return None


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def marked_pids(value=None):
    """Pids of the processes with :data:`MARKER` (equal to ``value`` when given), not this one."""
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            marker = _marker_of(int(name))
            if marker and (value is None or marker == value):
                pids.append(int(name))
    return pids


def kill_leftovers():
    """SIGKILL the processes of test clusters whose owner process is gone.

    Returns
    -------
    list of int
        The pids that were signalled.
    """
    killed, dirs = [], set()
    for pid in marked_pids():
        value = _marker_of(pid) or ""
        owner, _, cluster_dir = value.partition(":")
        if owner.isdigit() and not _alive(int(owner)):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
            dirs.add(cluster_dir)
    for d in dirs:  # only our own temporary directories
        if os.path.basename(d).startswith("flowpm-mtf-slurm-") and os.path.isdir(d):
            shutil.rmtree(d, ignore_errors=True)
    return killed


def _die_with_parent():
    """preexec_fn: SIGTERM this child when the process that started it exits (Linux)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _parse_show(text):
    """``key=value`` pairs of one ``scontrol show -o`` record."""
    return dict(re.findall(r"(\S+?)=(\S*)", text))


class SlurmCluster:
    """One-node Slurm (munged + slurmctld + slurmd) in its own temporary directory.

    Use as a context manager (``with SlurmCluster() as cluster:``): started on entry,
    stopped on exit, also when the block raises.

    Parameters
    ----------
    cpus : int, optional
        CPUs declared for the node (default ``max(nproc, MIN_CPUS)``).

    Attributes
    ----------
    root : str
        The cluster directory (conf, key, state, spool, logs).
    env : dict
        Environment for the Slurm client commands and submitted jobs (``SLURM_CONF``,
        the marker, no launcher variables of the calling process).
    """

    #: What the config's first line calls this cluster.
    description = "one-node test cluster"
    #: Suffix of slurmd's spool, pid and log files and of TmpFS ("" with one slurmd).
    per_node = ""

    def __init__(self, cpus=None):
        self.root = tempfile.mkdtemp(prefix="flowpm-mtf-slurm-")
        os.chmod(self.root, 0o755)  # munged: every directory above its socket must be a+x
        self.host = socket.gethostname().split(".")[0]
        #: (name, address) of the nodes; slurmctld runs on the first
        self.nodes = [(self.host, "127.0.0.1")]
        self.cpus = cpus or max(os.cpu_count() or 1, MIN_CPUS)
        self.conf = os.path.join(self.root, "slurm.conf")
        self.logdir = os.path.join(self.root, "log")
        self.procs = {}
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "OMPI_",
                                         "PMIX_", "PMI_", "HOROVOD_"))}
        self.env.update({"SLURM_CONF": self.conf, MARKER: "%d:%s" % (os.getpid(), self.root)})

    # ------------------------------------------------------------------ set-up
    def _path(self, *parts):
        return os.path.join(self.root, *parts)

    def write_config(self):
        """Write the munge key and ``slurm.conf``; returns the config text."""
        per_node = [d + self.per_node.replace("%n", name)
                    for name, _ in self.nodes for d in ("spool", "tmp")]
        for d in ["munge", "state", "log"] + per_node:
            os.makedirs(self._path(d), mode=0o755, exist_ok=True)
        key = self._path("munge", "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o600)
        real = os.cpu_count() or 1
        ctld_host, ctld_addr = self.nodes[0]
        names = ",".join(name for name, _ in self.nodes)
        text = "\n".join([
            "# %s written by tests/slurm_harness.py" % self.description,
            "ClusterName=flowpmtest",
            "SlurmctldHost=%s(%s)" % (ctld_host, ctld_addr),
            "SlurmUser=root",
            "SlurmdUser=root",
            "SlurmctldPort=%d" % free_port(),
            "SlurmdPort=%d" % free_port(),
            "AuthType=auth/munge",
            "CredType=cred/munge",
            "AuthInfo=socket=%s" % self._path("munge", "munge.socket"),
            "StateSaveLocation=%s" % self._path("state"),
            "SlurmdSpoolDir=%s" % self._path("spool" + self.per_node),
            "SlurmctldPidFile=%s" % self._path("slurmctld.pid"),
            "SlurmdPidFile=%s" % self._path("slurmd%s.pid" % self.per_node),
            "SlurmctldLogFile=%s" % self._path("log", "slurmctld.log"),
            "SlurmdLogFile=%s" % self._path("log", "slurmd%s.log" % self.per_node),
            "MailProg=/bin/true",
            # srun's PMIx plugin puts its per-step directory (spmix_appdir_UID_JOB.STEP) in
            # TmpFS: a private one, so that two test clusters (both at job 1) never share it
            "TmpFS=%s" % self._path("tmp" + self.per_node),
            # no cgroups here: track processes by parentage; no CPU binding, because a node
            # declared with more CPUs than it has cannot be laid out by task/affinity
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SchedulerType=sched/builtin",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "GresTypes=gpu",  # so that --gpus-per-node=0 is understood
            "MpiDefault=none",
            "ReturnToService=2",
            "KillWait=10",
            "MinJobAge=3600",  # keep finished jobs visible to scontrol
            "SlurmdParameters=config_overrides",  # accept the declared CPUs (oversubscription)
        ] + [
            "NodeName=%s NodeAddr=%s CPUs=%d Sockets=1 CoresPerSocket=%d ThreadsPerCore=1 "
            "RealMemory=%d State=UNKNOWN" % (name, addr, self.cpus, self.cpus, 4000)
            for name, addr in self.nodes
        ] + [
            "PartitionName=test Nodes=%s Default=YES MaxTime=INFINITE State=UP" % names,
            "",
        ])
        with open(self.conf, "w") as f:
            f.write(text)
        self.oversubscribed = self.cpus > real
        return text

    def _spawn(self, name, argv):
        log = open(os.path.join(self.logdir, name + ".stdout"), "w")
        self.procs[name] = subprocess.Popen(argv, cwd=self.root, env=self.env, stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            preexec_fn=_die_with_parent)
        log.close()

    def start(self):
        """Start munged, slurmctld and slurmd; wait until the node is idle."""
        kill_leftovers()
        self.write_config()
        sock = self._path("munge", "munge.socket")
        self._spawn("munged", ["munged", "--foreground",
                               "--key-file=" + self._path("munge", "munge.key"),
                               "--socket=" + sock,
                               "--pid-file=" + self._path("munge", "munged.pid"),
                               "--seed-file=" + self._path("munge", "munged.seed"),
                               "--log-file=" + self._path("log", "munged.log")])
        self._wait(lambda: os.path.exists(sock), "munged socket")
        self._spawn("slurmctld", self.on_node(self.nodes[0][0],
                                              ["slurmctld", "-D", "-i", "-f", self.conf]))
        self._wait(lambda: self.run(["scontrol", "ping"], check=False).returncode == 0,
                   "slurmctld")
        for name, _ in self.nodes:
            self._spawn("slurmd" + self.per_node.replace("%n", name),
                        self.on_node(name, ["slurmd", "-D", "-N", name, "-f", self.conf]))
        self._wait(self._node_idle, "slurmd (node%s idle)" % ("s" if len(self.nodes) > 1 else ""))

    def on_node(self, node, argv):
        """The command line that runs ``argv`` on ``node`` (here: this host, unchanged)."""
        return list(argv)

    def _node_idle(self):
        proc = self.run(["sinfo", "-h", "-N", "-o", "%t"], check=False)
        return proc.returncode == 0 and proc.stdout.split() == ["idle"] * len(self.nodes)

    def _wait(self, cond, what, timeout=START_TIMEOUT_S):
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError("%s exited with %s while waiting for %s:\n%s"
                                       % (name, p.returncode, what, self.logs_tail()))
            if cond():
                return
            time.sleep(0.2)
        raise RuntimeError("timed out after %d s waiting for %s:\n%s"
                           % (timeout, what, self.logs_tail()))

    # ------------------------------------------------------------------ use
    def run(self, argv, check=True, timeout=60, **kw):
        """Run a Slurm client command against this cluster (text output captured)."""
        env = kw.pop("env", None) or self.env
        proc = subprocess.run(self.on_node(self.nodes[0][0], argv), env=env, capture_output=True,
                              text=True, timeout=timeout, **kw)
        if check and proc.returncode != 0:
            raise RuntimeError("%s failed (%d): %s" % (" ".join(argv), proc.returncode,
                                                       proc.stderr.strip()))
        return proc

    def sbatch(self, script, options=(), args=(), env=None, cwd=None):
        """Submit ``script`` (options before it, ``args`` after it); returns the job id."""
        proc = self.run(["sbatch", "--parsable", *options, script, *args], env=env, cwd=cwd)
        return int(proc.stdout.strip().split(";")[0])

    def job(self, job_id):
        """``scontrol show job`` of ``job_id`` as a dict (JobState, ExitCode, ...)."""
        return _parse_show(self.run(["scontrol", "show", "job", "-o", str(job_id)]).stdout)

    def wait(self, job_id, timeout):
        """Wait until the job is in a final state; returns its ``scontrol`` record.

        On timeout the job is cancelled and RuntimeError raised.
        """
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            info = self.job(job_id)
            if info.get("JobState") in FINAL_STATES:
                return info
            time.sleep(0.5)
        self.run(["scancel", str(job_id)], check=False)
        raise RuntimeError("job %d did not finish within %d s" % (job_id, timeout))

    def logs_tail(self, n=15):
        """The last lines of the daemons' logs (for error messages)."""
        out = []
        for name in sorted(os.listdir(self.logdir)):
            with open(os.path.join(self.logdir, name), errors="replace") as f:
                lines = f.read().splitlines()[-n:]
            out.append("== %s\n%s" % (name, "\n".join(lines)))
        return "\n".join(out)

    def __enter__(self):
        """Start the cluster (stopped again if that fails)."""
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()
        return False

    # ------------------------------------------------------------------ tear-down
    def stop(self):
        """Cancel all jobs, stop the daemons (TERM, then KILL) and remove the directory."""
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            queue = self.run(["squeue", "-h", "-o", "%i"], check=False).stdout.split()
            if queue:
                self.run(["scancel", *queue], check=False)
                t_end = time.monotonic() + STOP_TIMEOUT_S
                while time.monotonic() < t_end and self.run(
                        ["squeue", "-h", "-o", "%i"], check=False).stdout.split():
                    time.sleep(0.5)
        for name in reversed(list(self.procs)):  # slurmd(s), slurmctld, munged
            p = self.procs[name]
            if p.poll() is not None:
                continue
            p.terminate()
            try:
                p.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        # job steps or stray tasks of this cluster that outlived slurmd
        for pid in marked_pids(self.env[MARKER]):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.root, ignore_errors=True)


#: The simulated cluster's command (network + UTS namespaces node1..nodeN).
SIM_CLUSTER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "scripts", "sim_cluster.sh")


def sim_cluster_env(name):
    """The variables that name the simulated cluster ``name`` and its state directory.

    The directory is ``sim_cluster.sh``'s: ``FLOWPM_SIM_CLUSTER_DIR`` when this environment
    names the same cluster and sets it, else ``/tmp/flowpm-sim-cluster-NAME``.
    """
    sim_dir = "/tmp/flowpm-sim-cluster-" + name
    if os.environ.get("FLOWPM_SIM_CLUSTER") == name and os.environ.get("FLOWPM_SIM_CLUSTER_DIR"):
        sim_dir = os.environ["FLOWPM_SIM_CLUSTER_DIR"]
    return {"FLOWPM_SIM_CLUSTER": name, "FLOWPM_SIM_CLUSTER_DIR": sim_dir}


def sim_cluster_nodes(sim_dir):
    """(name, address) of the simulated cluster's nodes in ``sim_dir`` (from its hosts file)."""
    try:
        with open(os.path.join(sim_dir, "hosts")) as f:
            rows = [line.split() for line in f]
    except OSError:
        return []
    return [(row[1], row[0]) for row in rows if len(row) == 2 and row[1].startswith("node")]


def sim_unavailable_reason():
    """Why no Slurm can run on a simulated cluster here (a sentence), or None when it can."""
    reason = unavailable_reason()
    if reason:
        return reason
    for prog in ("ip", "unshare", "nsenter", "mount"):
        if shutil.which(prog) is None:
            return "the simulated cluster needs '%s' (iproute2, util-linux)" % prog
    probe = subprocess.run(["unshare", "--net", "--uts", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return ("network and UTS namespaces cannot be made here (the simulated cluster "
                "needs them): %s" % (probe.stderr.strip().splitlines() or ["?"])[-1][:200])
    return None


class SimSlurmCluster(SlurmCluster):
    """Slurm on the nodes of a simulated cluster that is up (``scripts/sim_cluster.sh up N``).

    slurmctld runs in node1's namespaces at node1's address, one slurmd per node in that
    node's namespaces (``NodeName=nodeK NodeAddr=<its address>``; spool, pid, log and TmpFS
    per node), munged on this host (its socket file is reached from every namespace). The
    client commands (:meth:`run`, :meth:`sbatch`, ...) run on node1, so jobs are
    submitted from there, as from a login node.

    Parameters
    ----------
    name : str
        The simulated cluster (``FLOWPM_SIM_CLUSTER``); its state directory is
        ``sim_cluster.sh``'s (:func:`sim_cluster_env`).
    cpus : int, optional
        CPUs declared per node (default ``max(nproc, MIN_CPUS)``; the nodes share this
        host's CPUs, so they are oversubscribed).
    """

    description = "multi-node test cluster on the simulated nodes"
    per_node = "-%n"

    def __init__(self, name, cpus=None):
        super().__init__(cpus=cpus)
        self.sim_env = sim_cluster_env(name)
        self.env.update(self.sim_env)
        self.nodes = sim_cluster_nodes(self.sim_env["FLOWPM_SIM_CLUSTER_DIR"])
        if not self.nodes:
            shutil.rmtree(self.root, ignore_errors=True)
            raise RuntimeError("no simulated cluster '%s' is up: run 'FLOWPM_SIM_CLUSTER=%s "
                               "bash scripts/sim_cluster.sh up N' first" % (name, name))
        self.host = self.nodes[0][0]

    def write_config(self):
        """``slurm.conf`` and a ``cgroup.conf`` next to it.

        ``ip netns exec`` mounts a /sys of the node's network namespace, without
        /sys/fs/cgroup, where slurmd's default cgroup plugin (autodetect) looks and fails
        ("No filesystem mounted on /sys/fs/cgroup"): the cgroup/v1 plugin is named instead
        (nothing uses cgroups here: proctrack/linuxproc, task/none).
        """
        text = super().write_config()
        with open(self._path("cgroup.conf"), "w") as f:
            f.write("# written by tests/slurm_harness.py\nCgroupPlugin=cgroup/v1\n")
        return text

    def on_node(self, node, argv):
        """``argv`` in the namespaces of ``node`` (``sim_cluster.sh exec``, whatever the
        environment the caller gives)."""
        return ["env", *("%s=%s" % kv for kv in sorted(self.sim_env.items())),
                "bash", SIM_CLUSTER, "exec", node, *argv]


def main(argv=None):
    """``python tests/slurm_harness.py [--sim-cluster [NAME]]``: a test cluster by hand.

    Starts the one-node cluster (or, with ``--sim-cluster``, Slurm on the nodes of that
    simulated cluster, which must be up), prints how to use it and stops it at Ctrl-C or
    SIGTERM.
    """
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("--sim-cluster", metavar="NAME", nargs="?",
                        const=os.environ.get("FLOWPM_SIM_CLUSTER") or "fpmc",
                        help="run on the nodes of this simulated cluster (default: "
                             "FLOWPM_SIM_CLUSTER, else fpmc, as scripts/sim_cluster.sh)")
    args = parser.parse_args(argv)
    reason = sim_unavailable_reason() if args.sim_cluster else unavailable_reason()
    if reason:
        parser.exit(2, "slurm_harness: error: %s\n" % reason)
    # Ctrl-C and kill -INT stop it, also when a script started it with & (SIGINT ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        cluster = SimSlurmCluster(args.sim_cluster) if args.sim_cluster else SlurmCluster()
    except RuntimeError as exc:
        parser.exit(2, "slurm_harness: error: %s\n" % exc)
    with cluster:
        prefix = ""
        if args.sim_cluster:
            prefix = "FLOWPM_SIM_CLUSTER=%s bash %s exec node1 " % (
                args.sim_cluster, os.path.relpath(SIM_CLUSTER))
        print("Slurm is up on %s (pid %d); Ctrl-C stops it. In another shell:\n"
              "  export SLURM_CONF=%s\n  %ssinfo -N\n  %ssrun --nodes=%d --mpi=pmix hostname"
              % (", ".join(n for n, _ in cluster.nodes), os.getpid(), cluster.conf, prefix,
                 prefix, len(cluster.nodes)), flush=True)
        try:
            while all(p.poll() is None for p in cluster.procs.values()):
                time.sleep(1)
            print("a daemon ended:\n" + cluster.logs_tail(), flush=True)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
