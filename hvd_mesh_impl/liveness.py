"""Lost ranks and lost nodes end the job within a bounded time.

A rank whose node dies (power, kernel panic, ``SIGKILL`` of every process on it) or
whose link is cut leaves its peers blocked in the next collective: TCP does not
notice a silent peer for many minutes, and neither MPI nor Horovod bounds the
wait. Each rank of a multi-rank job therefore has a small **watchdog process**
(started by :func:`start`, from :func:`hvd_mesh_impl.runtime.init`): a separate
process, so that it answers while its rank holds the Python interpreter lock in a
long call (an HDF5 write, a graph build) or waits in a collective.

The watchdogs exchange UDP heartbeats in a star: every watchdog sends one to rank
0's every :data:`HEARTBEAT_S` seconds, and rank 0's answers each. Rank 0's watchdog
declares rank *k* lost when nothing came from it for ``FLOWPM_MTF_PEER_TIMEOUT``
seconds (default :data:`PEER_TIMEOUT_S`), tells every other watchdog, and each
watchdog then writes one line naming the lost rank and its host to its rank's
standard error and ends its rank with ``SIGKILL`` (a ``SIGTERM`` would start the
job's checkpoint, a collective that cannot finish without the lost rank). A
watchdog that hears nothing from rank 0 for the timeout does the same, naming rank
0. A watchdog whose rank ends without saying goodbye (killed) reports it at once,
so a single killed rank ends the job within seconds; a whole node lost (its
watchdogs too) takes the timeout.

A job suspended as a whole (``SIGSTOP``, e.g. Slurm's ``scontrol suspend``) is not lost:
a watchdog that finds it did not run for several heartbeats starts every timeout anew.

At a normal exit every rank says goodbye (:func:`stop`, called by the exit barrier
once all ranks have reached their exit), and its watchdog stops. When the parent
process ends, its watchdog ends too. ``FLOWPM_MTF_PEER_TIMEOUT=0`` disables the
watchdogs.

The datagrams are a few bytes (``hb``, ``bye``, ``dead``, ``lost``) on a port of
every address of the rank's host; rank 0's watchdog learns each rank's address from
the datagrams it receives. Nothing here depends on Horovod: the addresses are
exchanged on the job's MPI communicator.
"""
import json
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time

log = logging.getLogger(__name__)

PEER_TIMEOUT_S = 60.0
"""Default of ``FLOWPM_MTF_PEER_TIMEOUT`` [s]: silence after which a rank counts as lost."""
HEARTBEAT_S = 1.0
"""Seconds between two heartbeats of a watchdog."""

_state = {"proc": None}


def peer_timeout(environ=None):
    """The peer timeout [s] from ``FLOWPM_MTF_PEER_TIMEOUT`` (0 disables the watchdogs).

    Raises
    ------
    ValueError
        If the variable is not a number >= 0, or is below three heartbeats.
    """
    environ = os.environ if environ is None else environ
    raw = environ.get("FLOWPM_MTF_PEER_TIMEOUT", "")
    if raw == "":
        return PEER_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise ValueError("FLOWPM_MTF_PEER_TIMEOUT must be a number of seconds >= 0 "
                         "(0 disables the watchdog), got %r" % raw)
    if 0 < value < 3 * HEARTBEAT_S:
        raise ValueError("FLOWPM_MTF_PEER_TIMEOUT must be 0 or at least %g s (three "
                         "heartbeats), got %r" % (3 * HEARTBEAT_S, raw))
    return value


def host_addresses():
    """The IPv4 addresses of this host's interfaces that are up (loopback last)."""
    import fcntl

    addrs = []
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24])  # SIOCGIFADDR
            except OSError:
                continue
            if addr not in addrs:
                addrs.append(addr)
    finally:
        s.close()
    addrs.sort(key=lambda a: a.startswith("127."))
    if not any(a.startswith("127.") for a in addrs):
        addrs.append("127.0.0.1")
    return addrs


def start(comm, timeout=None):
    """Start this rank's watchdog (collective over ``comm``; once per process).

    Parameters
    ----------
    comm : mpi4py.MPI.Comm
        The job's communicator (every rank calls this).
    timeout : float, optional
        Seconds of silence after which a peer is lost (default :func:`peer_timeout`).

    Returns
    -------
    bool
        Whether a watchdog runs (not on one rank, nor with a timeout of 0).
    """
    if _state["proc"] is not None:
        return True
    timeout = peer_timeout() if timeout is None else float(timeout)
    size, rank = comm.Get_size(), comm.Get_rank()
    enabled = size > 1 and timeout > 0
    proc, port = None, None
    if enabled:
        # this file alone, without the package (which imports TensorFlow), nor site hooks
        code = ("import importlib.util as u; s = u.spec_from_file_location('_flowpm_watchdog', %r); "
                "m = u.module_from_spec(s); s.loader.exec_module(m); m.main()" % __file__)
        proc = subprocess.Popen([sys.executable, "-S", "-c", code], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=None,
                                env={"PATH": os.environ.get("PATH", "")}, close_fds=True)
        line = proc.stdout.readline()
        port = int(line) if line.strip() else None
    # collective even where this rank failed to start one: all ranks agree below
    table = comm.allgather({"host": socket.gethostname(), "addrs": host_addresses(),
                            "port": port})
    if not enabled:
        return False
    if any(t["port"] is None for t in table):
        bad = [r for r, t in enumerate(table) if t["port"] is None]
        log.warning("no peer watchdog: it did not start on rank(s) %s", bad)
        if proc is not None:
            proc.kill()
        return False
    setup = {"rank": rank, "size": size, "timeout": timeout, "heartbeat": HEARTBEAT_S,
             "parent": os.getpid(), "table": table}
    proc.stdin.write((json.dumps(setup) + "\n").encode())
    proc.stdin.flush()
    _state["proc"] = proc
    log.debug("peer watchdog of rank %d on port %d (timeout %.0f s)", rank, port, timeout)
    return True


def stop(word="bye"):
    """Say goodbye to the peers and stop this rank's watchdog (idempotent).

    Parameters
    ----------
    word : {"bye", "abort"}
        ``bye`` at a normal exit (all ranks are at their exit); ``abort`` when this rank
        is about to abort the MPI job itself (the peers then stay quiet about it).
    """
    proc = _state["proc"]
    _state["proc"] = None
    if proc is None:
        return
    try:
        proc.stdin.write(word.encode() + b"\n")
        proc.stdin.close()
        proc.wait(timeout=5)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        proc.kill()


def running():
    """Whether this rank's watchdog runs."""
    proc = _state["proc"]
    return proc is not None and proc.poll() is None


# ------------------------------------------------------------------ the watchdog process
class Watchdog:
    """The loop of one rank's watchdog process (see the module docstring).

    Parameters
    ----------
    sock : socket.socket
        Bound UDP socket.
    setup : dict
        ``rank``, ``size``, ``timeout`` [s], ``heartbeat`` [s], ``parent`` (pid),
        ``table`` (per rank: ``host``, ``addrs``, ``port``).
    control : int
        File descriptor of the parent's pipe: a line ``bye`` (or ``abort``) is a normal
        exit, end of file a killed parent.
    """

    def __init__(self, sock, setup, control):
        self.sock, self.control = sock, control
        self.rank, self.size = setup["rank"], setup["size"]
        self.timeout, self.heartbeat = setup["timeout"], setup["heartbeat"]
        self.parent, self.table = setup["parent"], setup["table"]
        now = time.monotonic()
        self.last = {r: now for r in range(self.size) if r != self.rank}
        self.addr = {}       # rank -> (ip, port) it was last heard from
        self.done = set()    # ranks that said goodbye

    # candidate addresses of a rank: the one it was heard from, else all it advertised
    def targets(self, r):
        if r in self.addr:
            return [self.addr[r]]
        t = self.table[r]
        same_host = t["host"] == self.table[self.rank]["host"]
        addrs = ["127.0.0.1"] if same_host else [a for a in t["addrs"] if not a.startswith("127.")]
        return [(a, t["port"]) for a in addrs]

    def send(self, r, msg):
        for target in self.targets(r):
            try:
                self.sock.sendto(msg.encode(), target)
            except OSError:
                pass  # unreachable now: the silence is what counts

    def peers(self):
        return [r for r in range(self.size) if r != self.rank] if self.rank == 0 else [0]

    def describe(self, ranks):
        """``rank 2 on host node2`` / ``ranks 2, 3 on host node2``."""
        hosts = sorted({self.table[r]["host"] for r in ranks})
        return "rank%s %s on host%s %s" % ("s" if len(ranks) > 1 else "",
                                          ", ".join(str(r) for r in ranks),
                                          "s" if len(hosts) > 1 else "", ", ".join(hosts))

    def lost(self, ranks, why):
        if self.rank == 0:
            for p in self.peers():
                if p not in ranks and p not in self.done:
                    for _ in range(3):
                        self.send(p, "lost %s %s" % (",".join(str(r) for r in ranks), why))
        self.end("lost %s: %s" % (self.describe(ranks), why))

    def end(self, text):
        sys.stderr.write("flowpm-mtf: error: %s; ending rank %d on host %s (peer watchdog, "
                         "FLOWPM_MTF_PEER_TIMEOUT=%g s)\n"
                         % (text, self.rank, self.table[self.rank]["host"], self.timeout))
        sys.stderr.flush()
        try:
            os.kill(self.parent, signal.SIGKILL)
        except OSError:
            pass
        os._exit(0)

    def goodbye(self, word):
        for p in self.peers():
            for _ in range(2):
                self.send(p, "%s %d" % (word, self.rank))

    def run(self):
        next_beat = 0.0
        tick = time.monotonic()
        while True:
            now = time.monotonic()
            if now - tick > 3 * self.heartbeat + 1.0:
                # this watchdog did not run for a while (the job suspended with SIGSTOP, as
                # Slurm's suspend does, or the host starved): nobody could be heard meanwhile,
                # so everyone gets a new timeout from now
                self.last = {p: now for p in self.last}
            tick = now
            if now >= next_beat:
                for p in self.peers():
                    if p not in self.done:
                        self.send(p, "hb %d" % self.rank)
                next_beat = now + self.heartbeat
            silent = [p for p in self.peers()
                      if p not in self.done and now - self.last[p] > self.timeout]
            if silent:
                self.lost(silent, "no heartbeat for %.0f s (node down or network cut)"
                          % max(now - self.last[p] for p in silent))
            ready, _, _ = select.select([self.sock, self.control], [], [],
                                        max(0.0, next_beat - time.monotonic()))
            if self.control in ready:
                line = os.read(self.control, 64).strip()
                if line in (b"bye", b"abort"):
                    self.goodbye("bye")
                else:  # end of file without goodbye: the rank was killed
                    self.goodbye("dead")
                return
            if self.sock in ready:
                try:
                    data, src = self.sock.recvfrom(256)
                except OSError:
                    continue
                words = data.decode(errors="replace").split(" ", 2)
                if len(words) < 2 or not words[1].replace(",", "").isdigit():
                    continue
                ranks = [int(w) for w in words[1].split(",") if w]
                if not ranks or any(not 0 <= r < self.size for r in ranks):
                    continue
                if words[0] == "lost" and len(words) == 3:
                    self.end("lost %s: %s (reported by rank 0)"
                             % (self.describe(ranks), words[2]))
                r = ranks[0]
                if r == self.rank:
                    continue
                if words[0] == "hb" and r not in self.done:
                    self.last[r] = time.monotonic()
                    self.addr[r] = src
                elif words[0] == "bye":
                    self.done.add(r)
                    if self.rank != 0:   # rank 0 is done: nothing more to watch
                        return
                elif words[0] == "dead":
                    self.lost([r], "its process ended without reaching the end of the job")


def main():
    """Entry of the watchdog process (:func:`start` runs this file alone with ``python -S``).

    Prints the UDP port it bound, reads the set-up line from standard input, then runs
    :class:`Watchdog` until its rank says goodbye or ends.
    """
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)   # it ends with its rank (end of file), not before
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", 0))
    sys.stdout.write("%d\n" % sock.getsockname()[1])
    sys.stdout.flush()
    fd = sys.stdin.fileno()
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(fd, 65536)
        if not chunk:
            return  # the rank ended before the set-up
        line += chunk
    Watchdog(sock, json.loads(line), fd).run()
