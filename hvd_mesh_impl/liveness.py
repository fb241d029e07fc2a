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
so a single killed rank ends the job within seconds.

Beside the heartbeats, every watchdog holds a TCP connection to rank 0's. A node whose
processes are all killed (the watchdogs too: an out-of-memory killer, a node health
check, ``SIGKILL`` of everything on it) closes those connections at once, so rank 0's
watchdog names its ranks within a second instead of the timeout; a node that loses power
or its link closes nothing and takes the timeout. The launcher often notices such a
node too and ends the surviving ranks first (Open MPI: "ORTE was unable to reliably
start one or more daemons", which names no host): a watchdog whose rank ends without
goodbye therefore looks for peers whose connection closed without a word before it
goes, and still writes the line naming them. The watchdogs run in their own session,
so that a launcher's signal to the rank's process group leaves them the time to.

A job suspended as a whole (``SIGSTOP``, e.g. Slurm's ``scontrol suspend``) is not lost:
a watchdog that finds it did not run for several heartbeats starts every timeout anew.

At a normal exit every rank says goodbye (:func:`stop`, called by the exit barrier
once all ranks have reached their exit), and its watchdog stops. When the parent
process ends, its watchdog ends too. ``FLOWPM_MTF_PEER_TIMEOUT=0`` disables the
watchdogs.

The datagrams are a few bytes (``hb``, ``bye``, ``dead``, ``lost``) on a port of
every address of the rank's host; rank 0's watchdog learns each rank's address from
the datagrams it receives. The TCP connections carry the same words (``hello`` first),
one per line, so that a goodbye always arrives before its connection's end. Nothing
here depends on Horovod: the addresses are exchanged on the job's MPI communicator.
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
GRACE_S = 1.0
"""Seconds a watchdog waits for the other ranks of a host whose watchdog vanished (at most:
it names them as soon as all of that host's connections closed), and for closed
connections once its own rank ended without goodbye."""

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
    proc, port, tcp = None, None, None
    if enabled:
        # this file alone, without the package (which imports TensorFlow), nor site hooks
        code = ("import importlib.util as u; s = u.spec_from_file_location('_flowpm_watchdog', %r); "
                "m = u.module_from_spec(s); s.loader.exec_module(m); m.main()" % __file__)
        # its own session: a launcher's signal to the rank's process group leaves it
        # alive until the rank's pipe closes (then it reports and ends)
        proc = subprocess.Popen([sys.executable, "-S", "-c", code], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=None,
                                env={"PATH": os.environ.get("PATH", "")}, close_fds=True,
                                start_new_session=True)
        words = proc.stdout.readline().split()
        if len(words) == 2:
            port, tcp = int(words[0]), int(words[1])
    # collective even where this rank failed to start one: all ranks agree below
    table = comm.allgather({"host": socket.gethostname(), "addrs": host_addresses(),
                            "port": port, "tcp": tcp})
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
        ``table`` (per rank: ``host``, ``addrs``, ``port``, ``tcp``; ``tcp`` is the
        port of the watchdog's TCP listener, ``None`` without one).
    control : int
        File descriptor of the parent's pipe: a line ``bye`` (or ``abort``) is a normal
        exit, end of file a killed parent.
    listener : socket.socket, optional
        Listening TCP socket (used on rank 0: the other watchdogs connect to it).
    said : bytes, optional
        What the parent wrote after its set-up line, read together with it: a rank that
        fails at once says ``bye`` right after the set-up.
    """

    def __init__(self, sock, setup, control, listener=None, said=b""):
        self.sock, self.control = sock, control
        self.said = said
        self.rank, self.size = setup["rank"], setup["size"]
        self.timeout, self.heartbeat = setup["timeout"], setup["heartbeat"]
        self.grace = setup.get("grace", GRACE_S)
        self.parent, self.table = setup["parent"], setup["table"]
        now = time.monotonic()
        self.last = {r: now for r in range(self.size) if r != self.rank}
        self.addr = {}       # rank -> (ip, port) it was last heard from
        self.done = set()    # ranks that said goodbye
        self.dead = set()    # ranks whose process ended (their watchdog said so)
        self.listener = listener if self.rank == 0 else None
        if listener is not None and self.rank != 0:
            listener.close()
        self.conns = {}      # TCP socket -> [rank or None before its hello, bytes buffered]
        self.closed = {}     # rank -> when its connection closed without a word
        if self.rank != 0:
            self.connect()

    # candidate addresses of a rank: the one it was heard from, else all it advertised
    def hosts_of(self, r):
        t = self.table[r]
        if t["host"] == self.table[self.rank]["host"]:
            return ["127.0.0.1"]
        return [a for a in t["addrs"] if not a.startswith("127.")]

    def targets(self, r):
        if r in self.addr:
            return [self.addr[r]]
        return [(a, self.table[r]["port"]) for a in self.hosts_of(r)]

    def connect(self):
        """Open the TCP connection to rank 0's watchdog (none: heartbeats only)."""
        port = self.table[0].get("tcp")
        if port is None:
            return
        for a in self.hosts_of(0):
            try:
                conn = socket.create_connection((a, port), timeout=max(1.0, self.heartbeat))
            except OSError:
                continue
            conn.settimeout(2.0)   # bounds a send to a peer that stopped reading
            try:
                conn.sendall(b"hello %d\n" % self.rank)
            except OSError:
                conn.close()
                continue
            self.conns[conn] = [0, b""]
            return

    def send(self, r, msg):
        for target in self.targets(r):
            try:
                self.sock.sendto(msg.encode(), target)
            except OSError:
                pass  # unreachable now: the silence is what counts

    def tell(self, r, msg):
        """``msg`` to rank ``r`` on the TCP connection (if there is one), then as datagrams."""
        for conn, (peer, _) in list(self.conns.items()):
            if peer == r:
                try:
                    conn.sendall(msg.encode() + b"\n")
                except OSError:
                    pass
        self.send(r, msg)

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
                    self.tell(p, "lost %s %s" % (",".join(str(r) for r in ranks), why))
                    for _ in range(2):
                        self.send(p, "lost %s %s" % (",".join(str(r) for r in ranks), why))
        self.end("lost %s: %s" % (self.describe(ranks), why))

    def line(self, text, what):
        """One line on the rank's standard error; ``what`` (``%d`` rank, ``%s`` host) says
        what becomes of this watchdog's rank."""
        fate = what % (self.rank, self.table[self.rank]["host"])
        sys.stderr.write("flowpm-mtf: error: %s; %s (peer watchdog, "
                         "FLOWPM_MTF_PEER_TIMEOUT=%g s)\n" % (text, fate, self.timeout))
        sys.stderr.flush()

    def end(self, text):
        self.line(text, "ending rank %d on host %s")
        try:
            os.kill(self.parent, signal.SIGKILL)
        except OSError:
            pass
        os._exit(0)

    def goodbye(self, word):
        for p in self.peers():
            self.tell(p, "%s %d" % (word, self.rank))
            self.send(p, "%s %d" % (word, self.rank))

    VANISHED = ("its watchdog's connection closed without a word (node down or every process "
                "on it killed)")

    def vanished(self):
        """Ranks whose connection closed without a goodbye, nor a word that their process ended."""
        return sorted(r for r in self.closed if r not in self.done and r not in self.dead)

    def read_conn(self, conn):
        """Read what ``conn`` has; returns the complete lines, marks a closed connection."""
        peer, buf = self.conns[conn]
        try:
            data = conn.recv(4096)
        except OSError:
            data = b""
        if not data:
            del self.conns[conn]
            conn.close()
            if peer is not None:
                self.closed.setdefault(peer, time.monotonic())
            return []
        buf += data
        *lines, rest = buf.split(b"\n")
        self.conns[conn][1] = rest
        if peer is None and lines:   # the first line names the rank: "hello 2"
            words = lines.pop(0).split()
            if len(words) == 2 and words[0] == b"hello" and words[1].isdigit() \
                    and 0 < int(words[1]) < self.size:
                self.conns[conn][0] = int(words[1])
        return [ln.decode(errors="replace") for ln in lines]

    def handle(self, text, src=None):
        """One word of a peer (a datagram from ``src``, or a line of a connection)."""
        words = text.split(" ", 2)
        if len(words) < 2 or not words[1].replace(",", "").isdigit():
            return None
        ranks = [int(w) for w in words[1].split(",") if w]
        if not ranks or any(not 0 <= r < self.size for r in ranks):
            return None
        if words[0] == "lost" and len(words) == 3:
            self.end("lost %s: %s (reported by rank 0)" % (self.describe(ranks), words[2]))
        r = ranks[0]
        if r == self.rank:
            return None
        if words[0] == "hb" and r not in self.done:
            self.last[r] = time.monotonic()
            if src is not None:
                self.addr[r] = src
        elif words[0] == "bye":
            self.done.add(r)
            if self.rank != 0:   # rank 0 is done: nothing more to watch
                return "return"
        elif words[0] == "dead":
            self.dead.add(r)
            self.lost([r], "its process ended without reaching the end of the job")
        return None

    def drain(self):
        """This watchdog's rank ended without goodbye (killed, most likely by the launcher
        after a lost node): wait up to the grace period for connections that close
        without a word, and name their ranks in one line before going."""
        deadline = time.monotonic() + self.grace
        while self.conns and time.monotonic() < deadline:
            watched = [c for c, (peer, _) in self.conns.items()
                       if peer not in self.done and peer not in self.dead]
            if not watched:
                break
            ready, _, _ = select.select(watched, [], [], max(0.0, deadline - time.monotonic()))
            for conn in ready:
                for text in self.read_conn(conn):
                    words = text.split(" ", 2)
                    if len(words) >= 2 and words[1].isdigit():
                        if words[0] == "bye":
                            self.done.add(int(words[1]))
                        elif words[0] == "dead":
                            self.dead.add(int(words[1]))
        gone = self.vanished()
        if gone:
            self.line("lost %s: %s" % (self.describe(gone), self.VANISHED),
                      "rank %d on host %s was ended by its launcher")

    def run(self):
        if self.said.split(b"\n")[0].strip() in (b"bye", b"abort"):
            self.goodbye("bye")
            return
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
                # the ranks behind one cut link fell silent together, their heartbeats up to
                # one period apart: name them all at once
                near = max(2.5 * self.heartbeat, self.timeout - 2 * self.heartbeat)
                silent = [p for p in self.peers()
                          if p not in self.done and now - self.last[p] > near]
                self.lost(silent, "no heartbeat for %.0f s (node down or network cut)"
                          % max(now - self.last[p] for p in silent))
            gone = self.vanished()
            wait = next_beat - time.monotonic()
            if gone:
                # the ranks of one node close theirs within milliseconds of each other: name
                # them all at once, as soon as every rank of their hosts is accounted for (a
                # launcher that noticed the node too ends this rank within a second)
                first = min(self.closed[r] for r in gone)
                hosts = {self.table[r]["host"] for r in gone}
                pending = [p for p in self.peers() if self.table[p]["host"] in hosts
                           and p not in gone and p not in self.done and p not in self.dead]
                if not pending or now - first >= self.grace:
                    self.lost(gone, self.VANISHED)
                wait = min(wait, first + self.grace - now)
            watched = [self.sock, self.control] + list(self.conns)
            if self.listener is not None:
                watched.append(self.listener)
            ready, _, _ = select.select(watched, [], [], max(0.0, wait))
            if self.control in ready:
                line = os.read(self.control, 64).strip()
                if line in (b"bye", b"abort"):
                    self.goodbye("bye")
                else:  # end of file without goodbye: the rank was killed
                    self.drain()
                    self.goodbye("dead")
                return
            if self.listener is not None and self.listener in ready:
                try:
                    conn, _ = self.listener.accept()
                    conn.settimeout(2.0)
                    self.conns[conn] = [None, b""]
                except OSError:
                    pass
            for conn in [c for c in ready if c in self.conns]:
                for text in self.read_conn(conn):
                    if self.handle(text) == "return":
                        return
            if self.sock in ready:
                try:
                    data, src = self.sock.recvfrom(256)
                except OSError:
                    continue
                if self.handle(data.decode(errors="replace"), src) == "return":
                    return


def main():
    """Entry of the watchdog process (:func:`start` runs this file alone with ``python -S``).

    Prints the UDP port and the TCP port it bound, reads the set-up line from standard
    input, then runs :class:`Watchdog` until its rank says goodbye or ends.
    """
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)   # it ends with its rank (end of file), not before
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", 0))
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("0.0.0.0", 0))
    listener.listen(128)
    sys.stdout.write("%d %d\n" % (sock.getsockname()[1], listener.getsockname()[1]))
    sys.stdout.flush()
    fd = sys.stdin.fileno()
    line = b""
    while b"\n" not in line:
        chunk = os.read(fd, 65536)
        if not chunk:
            return  # the rank ended before the set-up
        line += chunk
    setup, _, said = line.partition(b"\n")
    Watchdog(sock, json.loads(setup), fd, listener, said).run()
