"""Run directories (flowpm_mtf.runs.rundir): lock, staging, publish, manifest, overwrite, cleanup,
a publish killed at every step, a full disk.

In-process tests of the primitives (marked ``rank_independent``), a kill -9 of a
publishing process (subprocess), and the collective publish on every rank of the
MPI job (``test_mpi_*``); the same behaviour through ``flowpm-mtf`` under mpirun is
tested in tests/test_safety_cli.py."""
import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile

import blake3
import numpy as np
import pytest

from flowpm_mtf.runs import collective, h5dist, rundir, rundir_swap
from flowpm_mtf.errors import OutputDirError, ResumeError
from flowpm_mtf.runs.rundir import RunDir

single = pytest.mark.rank_independent


def snapshot_tree(d):
    """{relative path: BLAKE3 digest} of every file under d."""
    out = {}
    for root, _, names in os.walk(d):
        for n in names:
            p = os.path.join(root, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, d)] = blake3.blake3(f.read()).hexdigest()
    return out


def visible(d):
    """Entries of d a user sees (no hidden infrastructure)."""
    return sorted(n for n in os.listdir(d) if not n.startswith("."))


def complete_run(out, files, job="simulate", overwrite=False):
    with RunDir(out, job, overwrite=overwrite) as rd:
        stage(rd, files)
        return rd.publish(config={"seed": 1})


def stage(rd, files):
    for name, data in files.items():
        with open(rd.file(name), "w") as f:
            f.write(data)


@single
def test_publish_writes_manifest_last_and_verifies(tmp_path):
    out = tmp_path / "run"
    m = complete_run(out, {"a.txt": "alpha", "b.txt": "beta"})
    assert visible(out) == ["a.txt", "b.txt", "manifest.json"]
    assert not os.path.exists(out / ".staging") and not os.path.exists(out / ".lock")
    assert rundir.verify_manifest(out) == []
    assert m["job"] == "simulate" and m["config"] == {"seed": 1}
    assert {f["path"] for f in m["files"]} == {"a.txt", "b.txt"}
    (out / "a.txt").write_text("tampered")  # same size: only the hash can tell
    (out / "a.txt").write_text("alphx")
    assert rundir.verify_manifest(out) == ["a.txt: blake3 differs from the manifest"]


@single
def test_damaged_manifest_entries_are_listed_not_raised(tmp_path):
    """A manifest whose entries are damaged or hand-edited (no digest, no size, not a
    record, a path outside the run) gives one listed problem per entry, with and without
    the hashes; locate() does not take such a run as complete."""
    import json

    out = tmp_path / "run"
    complete_run(out, {"a.txt": "alpha", "b.txt": "beta"})
    path = out / "manifest.json"
    m = json.loads(path.read_text())
    good = m["files"]
    no_digest = {k: v for k, v in good[1].items() if k not in ("blake3", "sha256")}
    m["files"] = [good[0], no_digest, {"path": "a.txt"}, ["a.txt", 5],
                  dict(good[0], path="../outside.txt"), dict(good[0], size=True)]
    path.write_text(json.dumps(m))
    assert rundir.verify_manifest(out) == [
        "manifest.json entry 1: b.txt: no digest (one of: blake3, sha256)",
        "manifest.json entry 2: a.txt: no valid size (None)",
        "manifest.json entry 3: not a record (list)",
        "manifest.json entry 4: ../outside.txt: outside the run directory",
        "manifest.json entry 5: a.txt: no valid size (True)"]
    # without the hashes the missing digest is not looked at
    assert len(rundir.verify_manifest(out, check_hashes=False)) == 4
    assert rundir.locate(out) is None


@single
def test_complete_run_is_never_modified_without_overwrite(tmp_path):
    out = tmp_path / "run"
    complete_run(out, {"a.txt": "old"})
    before = snapshot_tree(out)
    with pytest.raises(OutputDirError, match="complete run.*--overwrite"):
        RunDir(out, "simulate").open()
    assert snapshot_tree(out) == before


@single
def test_overwrite_leaves_only_the_new_runs_files(tmp_path):
    out = tmp_path / "run"
    complete_run(out, {"old.png": "plot", "a.txt": "old"})
    rd = RunDir(out, "reconstruct", overwrite=True).open()
    with open(rd.staged("a.txt"), "w") as f:
        f.write("new")
    # Until publish the old run stays complete and intact.
    assert rundir.verify_manifest(out) == []
    rd.publish()
    rd.close()
    assert visible(out) == ["a.txt", "manifest.json"]
    assert (out / "a.txt").read_text() == "new"
    assert rundir.read_manifest(out)["job"] == "reconstruct"


@single
def test_second_concurrent_run_fails_at_once(tmp_path):
    out = tmp_path / "run"
    first = RunDir(out, "simulate").open()
    try:
        with pytest.raises(OutputDirError, match="in use by another run.*simulate run, host"):
            RunDir(out, "simulate", overwrite=True).open()
    finally:
        first.close()
    RunDir(out, "simulate").open().close()  # free again once released


@single
def test_killed_run_leftovers_are_removed_by_the_next_run(tmp_path):
    out = tmp_path / "run"
    complete_run(out, {"a.txt": "old"})
    # What kill -9 leaves: the staging directory, a temporary file, the lock file.
    os.makedirs(out / ".staging")
    (out / ".staging" / "snapshot.h5").write_text("partial")
    (out / "snapshot.h5.tmp-1234").write_text("partial")
    (out / ".lock").write_text("{}")
    with pytest.raises(OutputDirError, match="complete run"):
        RunDir(out, "simulate").open()  # the old run is complete: refused, untouched
    assert rundir.verify_manifest(out) == []
    complete_run(out, {"b.txt": "new"}, overwrite=True)
    assert sorted(os.listdir(out)) == ["b.txt", "manifest.json"]


@single
def test_torn_run_is_cleaned_and_replaced(tmp_path):
    """A publish killed after removing the manifest: no manifest, mixed files."""
    out = tmp_path / "run"
    complete_run(out, {"a.txt": "old", "plot.png": "old"})
    os.remove(out / "manifest.json")
    (out / ".lock").write_text("{}")
    complete_run(out, {"a.txt": "new"})  # no --overwrite needed: nothing complete there
    assert visible(out) == ["a.txt", "manifest.json"]
    assert rundir.verify_manifest(out) == []


@single
def test_failed_run_leaves_no_staging(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(RuntimeError):
        with RunDir(out, "simulate") as rd:
            (tmp_path / "run" / ".staging" / "x").write_text("partial")
            raise RuntimeError("compute failed")
    assert os.listdir(out) == []


@single
@pytest.mark.parametrize("case", ["file", "under_file"])
def test_unwritable_out_fails(tmp_path, case):
    f = tmp_path / "afile"
    f.write_text("x")
    out = f if case == "file" else f / "sub"
    with pytest.raises(OutputDirError, match="--out"):
        RunDir(out, "simulate").open()
    assert f.read_text() == "x"


@single
def test_read_only_directory_fails(tmp_path):
    out = tmp_path / "ro"
    out.mkdir()
    os.chmod(out, 0o555)
    try:
        if os.access(out, os.W_OK):
            pytest.skip("running as root: permissions do not stop writes (see the CLI test "
                        "with a read-only file system)")
        with pytest.raises(OutputDirError, match="--out"):
            RunDir(out, "simulate").open()
    finally:
        os.chmod(out, 0o755)


@single
def test_foreign_directory_is_never_touched(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    for kw in ({}, {"overwrite": True}):
        with pytest.raises(OutputDirError, match="not a flowpm-mtf run"):
            RunDir(tmp_path, "simulate", **kw).open()
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"]


@single
def test_checkpointed_run_needs_resume_or_overwrite(tmp_path):
    out = tmp_path / "run"
    os.makedirs(out / "checkpoint" / "step_000004")
    (out / "checkpoint" / "step_000004" / "manifest.json").write_text(json.dumps(
        {"format": "flowpm_mtf.runs.checkpoint/2", "job": "simulate", "step": 4, "files": {}}))
    (out / ".lock").write_text("{}")
    with pytest.raises(OutputDirError, match="pass --resume .* --overwrite"):
        RunDir(out, "simulate").open()
    # the hint is true for the checkpoint there: another job's command, or --overwrite only
    with pytest.raises(OutputDirError, match="'simulate' run: continue it with 'flowpm-mtf "
                                             "simulate --resume"):
        RunDir(out, "lensing").open()
    with RunDir(out, "simulate", resume=True) as rd:  # keeps the checkpoint
        assert rundir.has_checkpoint(out)
        rd.publish()
    assert not os.path.exists(out / "checkpoint")  # complete: checkpoints dropped
    with pytest.raises(ResumeError, match="complete"):
        RunDir(out, "simulate", resume=True).open()


@single
def test_resume_without_checkpoint_fails(tmp_path):
    with pytest.raises(ResumeError, match="no valid checkpoint in .*--checkpoint-every K"):
        RunDir(tmp_path / "new", "simulate", resume=True).open()


@single
@pytest.mark.parametrize("where", ["out", "killed_publish"])
def test_resume_of_a_complete_run_says_it_is_complete(tmp_path, capsys, where):
    """``flowpm-mtf JOB --resume OUT`` of a finished run: one line saying that the run there
    is complete (it said "no valid checkpoint ... run with --checkpoint-every K"), exit 6
    (a resume with nothing to continue, docs/running.md), OUT untouched; also when the
    complete run sits next to OUT after a killed publish, and from RunDir itself."""
    from flowpm_mtf import cli

    out = tmp_path / "run"
    complete_run(out, {"a.txt": "x"})
    if where == "killed_publish":
        os.rename(out, rundir.swap_paths(out)[0])   # OUT absent, the run in .run.flowpm-new
    before = snapshot_tree(tmp_path)
    assert cli.main(["simulate", "--resume", str(out), "--backend", "placement"]) == \
        ResumeError.exit_code == 6
    lines = capsys.readouterr().err.splitlines()
    errors = [line for line in lines if line.startswith("flowpm-mtf: error: ")]
    assert errors == ["flowpm-mtf: error: --resume %s: the 'simulate' run there is complete "
                      "(manifest.json): nothing to resume; its outputs are in %s (to run it "
                      "again: --out %s --overwrite, without --resume)" % (out, out, out)], lines
    assert snapshot_tree(tmp_path) == before
    if where == "out":
        with pytest.raises(ResumeError, match="the 'simulate' run there is complete"):
            RunDir(out, "simulate", resume=True).open()


@single
def test_overwrite_drops_old_checkpoints(tmp_path):
    out = tmp_path / "run"
    os.makedirs(out / "checkpoint" / "step_000009")
    (out / ".lock").write_text("{}")
    with RunDir(out, "simulate", overwrite=True):
        assert not os.path.exists(out / "checkpoint")


class FakeComm:
    """Rank r of a 2-rank job whose bcast returns what rank 0 decided."""

    def __init__(self, rank, verdict):
        self.rank, self.size, self.verdict = rank, 2, verdict

    def bcast(self, obj, root=0):
        return obj if self.rank == 0 else self.verdict

    def allgather(self, obj):
        return [obj, obj]

    def barrier(self):
        pass


@single
def test_other_ranks_raise_rank0s_error(tmp_path):
    rd = RunDir(tmp_path / "run", "simulate",
                comm=FakeComm(1, ("OutputDirError", "--out x is in use")))
    with pytest.raises(OutputDirError, match="in use"):
        rd.open()
    assert not os.path.exists(tmp_path / "run")  # rank 1 never touches the file system


@single
def test_manifest_is_json_with_sizes(tmp_path):
    out = tmp_path / "run"
    complete_run(out, {"a.txt": "12345"})
    with open(out / "manifest.json") as f:
        m = json.load(f)
    assert m["format"] == rundir.MANIFEST_FORMAT
    assert m["files"] == [{"path": "a.txt", "size": 5,
                           "blake3": blake3.blake3(b"12345").hexdigest()}]


# ----------------------------------------------------------------------------- killed publish
# An old complete run and the new run replacing it, both with per-rank part folders (as
# flowpm_mtf.runs.h5dist writes them) and a file only one of them has.
OLD_FILES = {"summary.json": "old summary", "snap.h5": "old virtual file",
             "snap.parts/rank00000.h5": "old part 0", "snap.parts/rank00001.h5": "old part 1",
             "old_only.png": "old plot"}
NEW_FILES = {"summary.json": "new summary, longer", "snap.h5": "new virtual file",
             "snap.parts/rank00000.h5": "new part 0", "snap.parts/rank00001.h5": "new part 1",
             "snap.parts/rank00002.h5": "new part 2"}
# Every file-system call that changes something (or makes it durable): a kill -9 can fall
# between any two of them. shutil.rmtree and os.makedirs go through these too.
MUTATORS = ("rename", "replace", "remove", "unlink", "rmdir", "mkdir", "fsync")


class Killed(BaseException):
    """kill -9 at this point: no ``except OSError`` clean-up runs after it."""


class KillAt:
    """Patch the mutators (and the directory exchange) to die at the k-th call (k >= 1).

    ``exchange=False`` makes the file system one without RENAME_EXCHANGE (NFS, Lustre).
    """

    def __init__(self, monkeypatch, k, exchange):
        self.mp, self.k, self.exchange, self.calls = monkeypatch, k, exchange, 0

    def _wrap(self, fn):
        def wrapped(*args, **kwargs):
            self.calls += 1
            if self.calls == self.k:
                raise Killed()
            return fn(*args, **kwargs)
        return wrapped

    def __enter__(self):
        self.ctx = self.mp.context()
        mp = self.ctx.__enter__()
        for name in MUTATORS:
            mp.setattr(os, name, self._wrap(getattr(os, name)))
        if self.exchange:
            mp.setattr(rundir_swap, "_exchange", self._wrap(rundir_swap._exchange))
        else:
            def no_exchange(a, b):
                raise rundir_swap._NoExchange("not on this file system (test)")
            mp.setattr(rundir_swap, "_exchange", no_exchange)
        return self

    def __exit__(self, *exc):
        self.ctx.__exit__(*exc)
        return False


def die(rd):
    """What the kernel does for a killed process: close its files (locks go), nothing else."""
    for fd in [rd._lock_fd] + rd._other_locks:
        if fd is not None:
            os.close(fd)
    rd._lock_fd, rd._other_locks = None, []


def run_files(d):
    """{path: text} of the run's files in d (not the manifest, lock, staging, checkpoint)."""
    out = {}
    for root, dirs, names in os.walk(d):
        if root == str(d):
            dirs[:] = [x for x in dirs if not x.startswith(".") and x != "checkpoint"]
            names = [n for n in names if not n.startswith(".") and n != "manifest.json"]
        for n in names:
            p = os.path.join(root, n)
            with open(p) as f:
                out[os.path.relpath(p, d)] = f.read()
    return out


def which_run(d):
    """"old" or "new" if d holds exactly that complete run (every digest checked), else None."""
    if d is None or rundir.verify_manifest(d) != []:
        return None
    files = run_files(d)
    listed = {e["path"] for e in rundir.read_manifest(d)["files"]}
    for name, want in (("old", OLD_FILES), ("new", NEW_FILES)):
        if files == want and listed == set(want):
            return name
    return None


def reader_view(out, exchange):
    """What a reader finds: the run OUT holds (via rundir.locate); checks it is one whole run."""
    d = rundir.locate(out)
    state = which_run(d)
    assert state in ("old", "new"), (d, os.listdir(os.path.dirname(out)))
    if exchange:  # one atomic swap: OUT itself is always a complete run
        assert d == str(out)
    return state, d == str(out)


def recovered(out):
    """The next start (no --overwrite: refused, after recovering); OUT holds one whole run."""
    with pytest.raises(OutputDirError, match="holds a complete run"):
        RunDir(out, "simulate").open()
    state = which_run(str(out))
    assert state in ("old", "new")
    assert sorted(os.listdir(os.path.dirname(out))) == [os.path.basename(out)]  # no sibling
    # No lock left; a killed run's staging is removed by the next run that goes on.
    assert set(n for n in os.listdir(out) if n.startswith(".")) <= {".staging"}
    assert rundir.read_manifest(out)["generation"] == (2 if state == "new" else 1)
    return state


def killed_publish(parent, monkeypatch, k, exchange):
    """An --overwrite publish over a complete run, killed at the k-th call; True if it finished."""
    out = parent / "run"
    complete_run(out, OLD_FILES)
    rd = RunDir(out, "simulate", overwrite=True).open()
    stage(rd, NEW_FILES)
    try:
        with KillAt(monkeypatch, k, exchange):
            rd.publish()
    except Killed:
        die(rd)
        return out, False
    rd.close()
    return out, True


@single
@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two_renames"])
def test_publish_killed_at_every_step_keeps_one_complete_run(tmp_path, monkeypatch, exchange):
    """kill -9 at every step of an --overwrite publish, and again at every step of the
    recovery that follows: a reader always finds the old or the new complete run (never
    mixed, never none), never the old again once it saw the new, and the next start leaves
    exactly one complete run at OUT."""
    seen = set()
    k = 0
    while True:
        k += 1
        case = tmp_path / ("k%03d" % k)
        case.mkdir()
        out, finished = killed_publish(case, monkeypatch, k, exchange)
        before, at_out = reader_view(out, exchange)
        seen.add((before, at_out))
        if finished:
            assert before == "new" and recovered(out) == "new"
            break
        saved = tmp_path / ("saved%03d" % k)
        shutil.copytree(case, saved, symlinks=True)
        k2 = 0
        while True:  # the recovery killed at its k2-th step, then a clean start
            k2 += 1
            try:
                with KillAt(monkeypatch, k2, exchange):
                    rd = RunDir(out, "simulate")
                    rd.open()
            except Killed:
                die(rd)
                state, _ = reader_view(out, exchange)
                assert state == before or (before, state) == ("old", "new")
                final = recovered(out)
                assert final == state or (state, final) == ("old", "new")
                shutil.rmtree(case)
                shutil.copytree(saved, case, symlinks=True)
                continue
            except OutputDirError:  # recovery complete, the start refused (no --overwrite)
                pass
            final = which_run(str(out))
            assert final == before or (before, final) == ("old", "new")
            assert recovered(out) == final
            break
        shutil.rmtree(saved)
        shutil.rmtree(case)
    assert k > 10  # the injection reached the whole sequence
    assert ("old", True) in seen and ("new", True) in seen  # both sides were exercised
    if not exchange:  # the moment between the two renames: OUT absent, the run beside it
        assert ("old", False) in seen or ("new", False) in seen


KILL_SCRIPT = r"""
import os, sys
from flowpm_mtf.runs import rundir, rundir_swap
out, k, exchange = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
files = %r
mutators = %r
rd = rundir.RunDir(out, "simulate", overwrite=True).open()
for name, data in files.items():
    with open(rd.file(name), "w") as f:
        f.write(data)
calls = [0]
def wrap(fn):
    def wrapped(*a, **kw):
        calls[0] += 1
        if calls[0] == k:
            os._exit(9)  # no clean-up of any kind, as kill -9
        return fn(*a, **kw)
    return wrapped
for name in mutators:
    setattr(os, name, wrap(getattr(os, name)))
if exchange:
    rundir_swap._exchange = wrap(rundir_swap._exchange)
else:
    def no_exchange(a, b):
        raise rundir_swap._NoExchange("test")
    rundir_swap._exchange = no_exchange
rd.publish()
rd.close()
os._exit(0)
""" % (NEW_FILES, MUTATORS)


@single
@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two_renames"])
def test_publishing_process_killed_at_every_step(tmp_path, exchange):
    """The same with a real process that exits at once (os._exit, as kill -9) at every step:
    its locks are released by the kernel and the next start recovers one complete run."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(rundir.__file__))))]
        + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    states = set()
    for k in range(1, 200):
        case = tmp_path / ("k%03d" % k)
        case.mkdir()
        out = case / "run"
        complete_run(out, OLD_FILES)
        rc = subprocess.run([sys.executable, "-c", KILL_SCRIPT, str(out), str(k),
                             "1" if exchange else "0"], env=env).returncode
        assert rc in (0, 9)
        before, _ = reader_view(out, exchange)
        after = recovered(out)
        assert after == before or (before, after) == ("old", "new")
        states.add(after)
        shutil.rmtree(case)
        if rc == 0:
            assert after == "new"
            break
    assert k > 10 and states == {"old", "new"}


# ----------------------------------------------------------------------------- disk full
def enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@single
@pytest.mark.parametrize("where", ["manifest", "second_rename", "in_place"])
def test_disk_full_while_publishing_keeps_the_previous_state(tmp_path, monkeypatch, where):
    """ENOSPC during publish: OutputDirError (exit 5, one line), the old complete run (or the
    checkpoint of an unfinished one) intact, no new run half in place."""
    out = tmp_path / "run"
    if where == "in_place":  # no complete run: a checkpointed one, resumed
        os.makedirs(out / "checkpoint" / "step_000004")
        rd = RunDir(out, "simulate", resume=True).open()
    else:
        complete_run(out, OLD_FILES)
        rd = RunDir(out, "simulate", overwrite=True).open()
    stage(rd, NEW_FILES)
    if where == "second_rename":  # the file system has no exchange; OUT is already aside
        real = os.rename

        def rename(src, dst, *a, **kw):
            if str(dst) == str(out) and str(src).endswith("flowpm-new"):
                enospc()
            return real(src, dst, *a, **kw)

        def no_exchange(a, b):
            raise rundir_swap._NoExchange("test")
        monkeypatch.setattr(rundir_swap, "_exchange", no_exchange)
        monkeypatch.setattr(os, "rename", rename)
    else:
        monkeypatch.setattr(rundir, "_write_json", enospc)
    with pytest.raises(OutputDirError, match="no space left on device") as err:
        rd.publish()
    rd.close()
    monkeypatch.undo()
    assert err.value.exit_code == 5 and "\n" not in str(err.value)
    assert sorted(os.listdir(tmp_path)) == ["run"]
    if where == "in_place":
        assert rundir.read_manifest(out) is None and rundir.has_checkpoint(out)
        assert sorted(os.listdir(out)) == ["checkpoint"]
    else:
        assert which_run(str(out)) == "old"
        assert sorted(n for n in os.listdir(out) if n.startswith(".")) == []


@single
def test_disk_full_in_a_rank0_output_is_exit_5_when_written_collectively(tmp_path):
    """A real ENOSPC (/dev/full) in a rank-0 output (summary.json) written the way the
    runner should write them, inside collective.collective: OutputDirError (exit 5) on every
    rank, one line; the old run intact after close."""
    from flowpm_mtf.runs import io, writers

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    out = tmp_path / "run"
    complete_run(out, OLD_FILES)
    with pytest.raises(OutputDirError,
                       match="no space left on device.*writing the outputs in .*run on rank 0") as e:
        with RunDir(out, "simulate", overwrite=True) as rd:
            path = rd.file("summary.json")
            os.symlink("/dev/full", writers._tmp_name(path))  # the temporary file: a full disk
            collective.collective(rd.comm, dict, lambda _: io.write_json(
                path, {"x": list(range(10000))}, rank=0), "writing the outputs in %s" % out)
            rd.publish()
    assert e.value.exit_code == 5 and "\n" not in str(e.value)
    assert which_run(str(out)) == "old"
    assert sorted(os.listdir(tmp_path)) == ["run"]


@single
def test_stale_checkpoint_of_a_complete_run_is_removed(tmp_path):
    """A publish killed after its manifest but before removing the checkpoint."""
    out = tmp_path / "run"
    os.makedirs(out / "checkpoint" / "step_000004")
    with RunDir(out, "simulate", resume=True) as rd:
        stage(rd, {"a.txt": "x"})
        m = rd.publish()
    assert m["checkpoint_kept"] is False and m["generation"] == 1
    os.makedirs(out / "checkpoint" / "step_000004")
    with pytest.raises(ResumeError, match="complete"):
        RunDir(out, "simulate", resume=True).open()
    assert not os.path.exists(out / "checkpoint")


@single
def test_symlinked_out_is_replaced_behind_the_link(tmp_path):
    real = tmp_path / "data" / "run"
    os.makedirs(real)
    link = tmp_path / "link"
    os.symlink(real, link)
    complete_run(link, {"a.txt": "old"})
    complete_run(link, {"a.txt": "new"}, overwrite=True)
    assert os.path.islink(link) and (link / "a.txt").read_text() == "new"
    assert sorted(os.listdir(tmp_path / "data")) == ["run"]


# ----------------------------------------------------------------------------- every rank
def world_comm():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def shared_dir(comm):
    d = tempfile.mkdtemp(prefix="rundir") if comm.rank == 0 else None
    return comm.bcast(d, root=0)


def write_parts(rd, comm, value):
    """A distributed file of every rank's part, as the jobs write it."""
    rows = h5dist.Rows(np.full((3,), float(value)))
    h5dist.write_distributed(rd.file("snap.h5"), comm, {comm.rank: {"x": rows}})


def test_mpi_overwrite_publishes_every_ranks_parts_atomically():
    import h5py

    comm = world_comm()
    out = os.path.join(shared_dir(comm), "run")
    for gen in (1, 2):
        with RunDir(out, "simulate", comm=comm, overwrite=True, all_ranks_write=True) as rd:
            write_parts(rd, comm, gen)
            m = rd.publish()
        assert m["generation"] == gen
        assert {f["path"] for f in m["files"]} == {"snap.h5"} | {
            "snap.parts/rank%05d.h5" % r for r in range(comm.size)}
        comm.barrier()
        if comm.rank == 0:
            assert rundir.verify_manifest(out) == []
            assert sorted(os.listdir(os.path.dirname(out))) == ["run"]
            with h5py.File(os.path.join(out, "snap.h5"), "r") as f:
                np.testing.assert_array_equal(f["x"][...], np.full(3 * comm.size, float(gen)))
        comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(os.path.dirname(out))


@pytest.mark.parametrize("where", ["parts_last_rank", "publish_rank0"])
def test_mpi_disk_full_is_exit_5_on_every_rank(monkeypatch, where):
    """ENOSPC on one rank (a real one, /dev/full, while writing its part; or on rank 0
    while publishing): the same OutputDirError on every rank, the old run intact."""
    comm = world_comm()
    out = os.path.join(shared_dir(comm), "run")
    with RunDir(out, "simulate", comm=comm) as rd:
        write_parts(rd, comm, 1)
        rd.publish()
    with pytest.raises(OutputDirError, match="no space left on device") as err:
        with RunDir(out, "simulate", comm=comm, overwrite=True) as rd:
            if where == "parts_last_rank":
                part = h5dist.part_path(rd.staged("snap.h5"), comm.rank)
                if comm.rank == comm.size - 1:
                    os.makedirs(os.path.dirname(part), exist_ok=True)
                    os.symlink("/dev/full", "%s.tmp-%d" % (part, os.getpid()))
            elif comm.rank == 0:
                monkeypatch.setattr(rundir, "_write_json", enospc)
            write_parts(rd, comm, 2)
            rd.publish()
    assert err.value.exit_code == 5
    if where == "parts_last_rank":
        assert "rank %d" % (comm.size - 1) in str(err.value)
    comm.barrier()
    if comm.rank == 0:
        assert rundir.verify_manifest(out) == [] and rundir.read_manifest(out)["generation"] == 1
        assert sorted(os.listdir(os.path.dirname(out))) == ["run"]
        assert not os.path.exists(os.path.join(out, ".staging"))
        shutil.rmtree(os.path.dirname(out))
    comm.barrier()
