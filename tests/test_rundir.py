"""Run directories (flowpm_mtf.rundir): lock, staging, publish, manifest, overwrite, cleanup.

In-process tests of the primitives; the same behaviour through ``flowpm-mtf`` under
mpirun is tested in tests/test_safety_cli.py."""
import hashlib
import json
import os

import pytest

from flowpm_mtf import rundir
from flowpm_mtf.errors import OutputDirError, ResumeError
from flowpm_mtf.rundir import RunDir

pytestmark = pytest.mark.rank_independent


def snapshot_tree(d):
    """{relative path: sha256} of every file under d."""
    out = {}
    for root, _, names in os.walk(d):
        for n in names:
            p = os.path.join(root, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, d)] = hashlib.sha256(f.read()).hexdigest()
    return out


def visible(d):
    """Entries of d a user sees (no hidden infrastructure)."""
    return sorted(n for n in os.listdir(d) if not n.startswith("."))


def complete_run(out, files, job="simulate", overwrite=False):
    with RunDir(out, job, overwrite=overwrite) as rd:
        for name, data in files.items():
            with open(rd.staged(name), "w") as f:
                f.write(data)
        return rd.publish(config={"seed": 1})


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
    assert rundir.verify_manifest(out) == ["a.txt: sha256 differs from the manifest"]


def test_complete_run_is_never_modified_without_overwrite(tmp_path):
    out = tmp_path / "run"
    complete_run(out, {"a.txt": "old"})
    before = snapshot_tree(out)
    with pytest.raises(OutputDirError, match="complete run.*--overwrite"):
        RunDir(out, "simulate").open()
    assert snapshot_tree(out) == before


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


def test_second_concurrent_run_fails_at_once(tmp_path):
    out = tmp_path / "run"
    first = RunDir(out, "simulate").open()
    try:
        with pytest.raises(OutputDirError, match="in use by another run.*simulate run, host"):
            RunDir(out, "simulate", overwrite=True).open()
    finally:
        first.close()
    RunDir(out, "simulate").open().close()  # free again once released


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


def test_torn_run_is_cleaned_and_replaced(tmp_path):
    """A publish killed after removing the manifest: no manifest, mixed files."""
    out = tmp_path / "run"
    complete_run(out, {"a.txt": "old", "plot.png": "old"})
    os.remove(out / "manifest.json")
    (out / ".lock").write_text("{}")
    complete_run(out, {"a.txt": "new"})  # no --overwrite needed: nothing complete there
    assert visible(out) == ["a.txt", "manifest.json"]
    assert rundir.verify_manifest(out) == []


def test_failed_run_leaves_no_staging(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(RuntimeError):
        with RunDir(out, "simulate") as rd:
            (tmp_path / "run" / ".staging" / "x").write_text("partial")
            raise RuntimeError("compute failed")
    assert os.listdir(out) == []


@pytest.mark.parametrize("case", ["file", "under_file"])
def test_unwritable_out_fails(tmp_path, case):
    f = tmp_path / "afile"
    f.write_text("x")
    out = f if case == "file" else f / "sub"
    with pytest.raises(OutputDirError, match="--out"):
        RunDir(out, "simulate").open()
    assert f.read_text() == "x"


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


def test_foreign_directory_is_never_touched(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    for kw in ({}, {"overwrite": True}):
        with pytest.raises(OutputDirError, match="not a flowpm-mtf run"):
            RunDir(tmp_path, "simulate", **kw).open()
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"]


def test_checkpointed_run_needs_resume_or_overwrite(tmp_path):
    out = tmp_path / "run"
    os.makedirs(out / "checkpoint" / "step_000004")
    (out / "checkpoint" / "step_000004" / "manifest.json").write_text("{}")
    (out / ".lock").write_text("{}")
    with pytest.raises(OutputDirError, match="--resume .* --overwrite"):
        RunDir(out, "simulate").open()
    with RunDir(out, "simulate", resume=True) as rd:  # keeps the checkpoint
        assert rundir.has_checkpoint(out)
        rd.publish()
    assert not os.path.exists(out / "checkpoint")  # complete: checkpoints dropped
    with pytest.raises(ResumeError, match="complete"):
        RunDir(out, "simulate", resume=True).open()


def test_resume_without_checkpoint_fails(tmp_path):
    with pytest.raises(ResumeError, match="no checkpoint"):
        RunDir(tmp_path / "new", "simulate", resume=True).open()


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


def test_other_ranks_raise_rank0s_error(tmp_path):
    rd = RunDir(tmp_path / "run", "simulate",
                comm=FakeComm(1, ("OutputDirError", "--out x is in use")))
    with pytest.raises(OutputDirError, match="in use"):
        rd.open()
    assert not os.path.exists(tmp_path / "run")  # rank 1 never touches the file system


def test_manifest_is_json_with_sizes(tmp_path):
    out = tmp_path / "run"
    complete_run(out, {"a.txt": "12345"})
    with open(out / "manifest.json") as f:
        m = json.load(f)
    assert m["format"] == rundir.MANIFEST_FORMAT
    assert m["files"] == [{"path": "a.txt", "size": 5,
                           "sha256": hashlib.sha256(b"12345").hexdigest()}]
