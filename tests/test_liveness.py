"""The peer watchdog (hvd_mesh_impl/liveness.py) on its own: watchdog processes on this
host, each guarding a stand-in rank (a ``sleep`` process), this test playing the ranks' side
of the pipe. A killed rank is reported at once, a vanished watchdog (its node's processes
all killed) within the grace period, a silent one after the timeout, each with one line
naming the lost rank and host, and the other rank is ended; a rank ended by its launcher
first still names the vanished peer; goodbyes, or the launcher ending every rank, end the
watchdogs and print nothing. (Across hosts, with real jobs: tests/test_sim_cluster.py.)"""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.rank_independent

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIVENESS = os.path.join(REPO, "hvd_mesh_impl", "liveness.py")
TIMEOUT_S = 3.0       # the watchdogs' peer timeout in these tests
HEARTBEAT_S = 0.2
BOUND_S = 10.0        # a test fails when nothing happened within this


def _load():
    import importlib.util

    spec = importlib.util.spec_from_file_location("_liveness_under_test", LIVENESS)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _start(n=2, then=b""):
    """``n`` watchdogs (ranks 0..n-1) guarding ``n`` sleepers; returns (watchdogs, sleepers).
    ``then``: bytes each rank writes in the same write as its set-up line."""
    sleepers = [subprocess.Popen(["sleep", "600"]) for _ in range(n)]
    code = ("import importlib.util as u; s = u.spec_from_file_location('w', %r); "
            "m = u.module_from_spec(s); s.loader.exec_module(m); m.main()" % LIVENESS)
    dogs = [subprocess.Popen([sys.executable, "-S", "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(n)]
    ports = [[int(w) for w in d.stdout.readline().split()] for d in dogs]   # UDP, TCP
    host = socket.gethostname()
    table = [{"host": host, "addrs": ["127.0.0.1"], "port": udp, "tcp": tcp}
             for udp, tcp in ports]
    for rank, (dog, sleeper) in enumerate(zip(dogs, sleepers)):
        setup = {"rank": rank, "size": n, "timeout": TIMEOUT_S, "heartbeat": HEARTBEAT_S,
                 "parent": sleeper.pid, "table": table}
        dog.stdin.write((json.dumps(setup) + "\n").encode() + then)
        dog.stdin.flush()
    return dogs, sleepers



def _wait(proc, timeout=BOUND_S):
    t0 = time.monotonic()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    return time.monotonic() - t0


def _cleanup(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_peer_timeout_from_the_environment():
    liveness = _load()
    assert liveness.peer_timeout({}) == liveness.PEER_TIMEOUT_S == 60.0
    assert liveness.peer_timeout({"FLOWPM_MTF_PEER_TIMEOUT": "0"}) == 0.0
    assert liveness.peer_timeout({"FLOWPM_MTF_PEER_TIMEOUT": "12.5"}) == 12.5
    for bad in ("-1", "abc", "inf", "nan", "1"):
        with pytest.raises(ValueError, match="FLOWPM_MTF_PEER_TIMEOUT must be"):
            liveness.peer_timeout({"FLOWPM_MTF_PEER_TIMEOUT": bad})


def test_a_killed_rank_is_reported_at_once():
    dogs, sleepers = _start()
    try:
        time.sleep(3 * HEARTBEAT_S)
        sleepers[1].kill()
        dogs[1].stdin.close()          # the rank's end of the pipe closes without goodbye
        took = _wait(sleepers[0])
        assert took is not None and took < TIMEOUT_S, took    # not the timeout: at once
        assert sleepers[0].returncode == -signal.SIGKILL
        err = dogs[0].stderr.read().decode()
        assert err.count("\n") == 1 and err.startswith(
            "flowpm-mtf: error: lost rank 1 on host %s: its process ended" % socket.gethostname()), err
    finally:
        _cleanup(dogs + sleepers)


def test_silent_ranks_are_lost_together_after_the_timeout_and_rank_0_tells_the_others():
    """Ranks 1 and 2 fall silent one heartbeat apart, as behind one cut link: rank 0 names both
    in one line after the timeout."""
    dogs, sleepers = _start(4)
    try:
        time.sleep(3 * HEARTBEAT_S)
        t0 = time.monotonic()
        os.kill(dogs[1].pid, signal.SIGSTOP)    # silent, as behind a cut link
        time.sleep(HEARTBEAT_S)
        os.kill(dogs[2].pid, signal.SIGSTOP)
        took = _wait(sleepers[0])
        assert took is not None and TIMEOUT_S - 2 * HEARTBEAT_S <= time.monotonic() - t0, took
        err0 = dogs[0].stderr.read().decode()
        assert err0.count("\n") == 1 and "lost ranks 1, 2 on host" in err0 \
            and "no heartbeat for 3 s" in err0, err0
        assert _wait(sleepers[3]) is not None
        assert "(reported by rank 0); ending rank 3" in dogs[3].stderr.read().decode()
        os.kill(dogs[1].pid, signal.SIGCONT)    # it comes back to rank 0's end
        assert _wait(sleepers[1]) is not None
        err1 = dogs[1].stderr.read().decode()
        assert "lost rank 0" in err1, err1
    finally:
        for d in dogs:
            if d.poll() is None:
                os.kill(d.pid, signal.SIGCONT)
        _cleanup(dogs + sleepers)


def test_goodbyes_end_the_watchdogs_and_no_rank():
    dogs, sleepers = _start()
    try:
        time.sleep(3 * HEARTBEAT_S)
        for d in dogs:
            d.stdin.write(b"bye\n")
            d.stdin.flush()
        for d in dogs:
            assert _wait(d) is not None and d.returncode == 0
            assert d.stderr.read() == b""
        time.sleep(TIMEOUT_S + 2 * HEARTBEAT_S)
        assert all(s.poll() is None for s in sleepers)
    finally:
        _cleanup(dogs + sleepers)


def test_a_goodbye_read_with_the_set_up_line_ends_the_watchdog_quietly():
    """A rank that fails at once (a refusal) says goodbye right after its set-up line; one
    read may get both: the watchdog says goodbye, without a traceback (it was a JSON error
    printed under a refused job's one line)."""
    dogs, sleepers = _start(then=b"bye\n")
    try:
        for d in dogs:
            assert _wait(d) is not None and d.returncode == 0
            assert d.stderr.read() == b""
        assert all(s.poll() is None for s in sleepers)
    finally:
        _cleanup(dogs + sleepers)


def test_a_bad_timeout_is_a_configuration_error_before_horovod_starts(monkeypatch):
    import horovod.tensorflow as hvd

    from flowpm_mtf import backend
    from flowpm_mtf.errors import ConfigError

    started = hvd.is_initialized()   # by an earlier test of the same process, maybe
    monkeypatch.setenv("FLOWPM_MTF_PEER_TIMEOUT", "abc")
    with pytest.raises(ConfigError, match="FLOWPM_MTF_PEER_TIMEOUT must be a number"):
        backend.make_mesh_impl("hvd", [("rows", 1)], [("x", "rows")])
    assert hvd.is_initialized() == started   # the check came before Horovod's start


def test_a_job_suspended_longer_than_the_timeout_is_not_lost():
    """Both watchdogs (and their ranks) stopped together, as Slurm's suspend does."""
    dogs, sleepers = _start()
    try:
        time.sleep(3 * HEARTBEAT_S)
        for p in dogs + sleepers:
            os.kill(p.pid, signal.SIGSTOP)
        time.sleep(TIMEOUT_S + 1.0)
        for p in dogs + sleepers:
            os.kill(p.pid, signal.SIGCONT)
        time.sleep(TIMEOUT_S / 2)
        assert all(p.poll() is None for p in dogs + sleepers)
    finally:
        _cleanup(dogs + sleepers)



def test_a_vanished_node_is_named_within_the_grace_period():
    """Rank 2's watchdog and rank killed together (every process of its node): no heartbeat
    timeout to wait for, its connection to rank 0's watchdog closed."""
    dogs, sleepers = _start(3)
    try:
        time.sleep(3 * HEARTBEAT_S)
        t0 = time.monotonic()
        for p in (dogs[2], sleepers[2]):
            p.kill()
        assert _wait(sleepers[0]) is not None and _wait(sleepers[1]) is not None
        took = time.monotonic() - t0
        assert took < TIMEOUT_S, took          # not the timeout
        err0 = dogs[0].stderr.read().decode()
        assert err0.count("\n") == 1 and err0.startswith(
            "flowpm-mtf: error: lost rank 2 on host %s: its watchdog's connection closed"
            % socket.gethostname()), err0
        assert "(reported by rank 0)" in dogs[1].stderr.read().decode()
    finally:
        _cleanup(dogs + sleepers)


def test_a_rank_ended_by_its_launcher_first_still_names_the_vanished_node():
    """The launcher noticed the lost node first and ended rank 0 (its pipe closes), then
    the node's watchdog went: rank 0's watchdog waits the grace period and names it."""
    dogs, sleepers = _start(3)
    try:
        time.sleep(3 * HEARTBEAT_S)
        sleepers[0].kill()
        dogs[0].stdin.close()
        time.sleep(0.2)                        # within the grace period (1 s)
        for p in (dogs[2], sleepers[2]):
            p.kill()
        assert _wait(dogs[0]) is not None
        err0 = dogs[0].stderr.read().decode()
        assert err0 == (
            "flowpm-mtf: error: lost rank 2 on host {h}: its watchdog's connection closed "
            "without a word (node down or every process on it killed); rank 0 on host {h} was "
            "ended by its launcher (peer watchdog, FLOWPM_MTF_PEER_TIMEOUT=3 s)\n"
            .format(h=socket.gethostname())), err0
    finally:
        _cleanup(dogs + sleepers)


def test_a_job_ended_as_a_whole_by_its_launcher_prints_nothing():
    """Every rank ended at once (Ctrl-C, scancel): no watchdog names anyone."""
    dogs, sleepers = _start(3)
    try:
        time.sleep(3 * HEARTBEAT_S)
        for d, s in zip(dogs, sleepers):
            s.kill()
            d.stdin.close()
        for d in dogs:
            assert _wait(d) is not None
        assert [d.stderr.read() for d in dogs] == [b""] * 3
    finally:
        _cleanup(dogs + sleepers)
