"""Checkpoints (flowpm_mtf.runs.checkpoint): atomic save, load on the same and on other grids,
torn/corrupted checkpoints fall back to the previous one on every rank, SIGTERM agreement."""
import json
import os
import shutil
import signal
import tempfile

import numpy as np
import pytest

from flowpm_mtf.runs import checkpoint, checkpoint_load, io
from flowpm_mtf.config import SimConfig
from flowpm_mtf.errors import ResumeError
from flowpm_mtf.backend import SerialComm as SelfComm

NC = (8, 8, 4)
# Re-slicing re-expresses float32 block-local positions relative to another block origin
# (|x| < 8 cells): exact in float64, one float32 rounding of the result.
RESLICE_RTOL = 1e-6


def world_comm():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def shared_tmpdir(comm):
    d = tempfile.mkdtemp(prefix="ckpt") if comm.rank == 0 else None
    return comm.bcast(d, root=0)


def grid_for(n):
    return {1: (1, 1), 2: (2, 1), 4: (2, 2)}[n]


def truth(conf, block, step):
    """A synthetic state of one block (lattice order): a function of the global id and step."""
    ids = io.lagrangian_ids(conf, block)
    ny, nz = conf.nc[1], conf.nc[2]
    lattice = np.stack([ids // (ny * nz), (ids // nz) % ny, ids % nz], axis=1).astype(np.float64)
    disp = 0.3 * np.sin(ids[:, None] * np.array([1.0, 2.0, 3.0]) + step)
    origin = np.array([block[0] * conf.block_shape[0], block[1] * conf.block_shape[1], 0])
    return {"positions": (lattice + disp - origin).astype(np.float32),
            "momenta": (ids[:, None] * [1.0, -1.0, 0.5] + step).astype(np.float32),
            "forces": np.cos(ids[:, None] + step * np.arange(3)).astype(np.float32)}


def blocks_of(conf):
    P, Q = conf.grid
    return {bx * Q + by: (bx, by) for bx in range(P) for by in range(Q)}


def parts_for(conf, pnums, step):
    out = {}
    for p in pnums:
        block = blocks_of(conf)[p]
        t = truth(conf, block, step)
        out[p] = dict(t, block=block, id=io.lagrangian_ids(conf, block),
                      origin=[block[0] * conf.block_shape[0], block[1] * conf.block_shape[1], 0])
        out[p]["positions"] = out[p]["positions"].reshape(1, 1, -1, 3)
    return out


def ident_for(conf, job="simulate", stages=None):
    stages = [0.1 * step for step in range(11)] if stages is None else stages
    return checkpoint.identity(job, {"config": conf}, stages)


def save(out, comm, conf, step, pnums, outputs_dir=None, ident=None):
    """A checkpoint at step ``step`` at a = 0.1 step (stage ``step`` of :func:`ident_for`)."""
    return checkpoint.save(out, comm, step, 0.1 * step, {"config": conf.to_dict()},
                           parts_for(conf, pnums, step), grid=conf.grid,
                           ident=ident or ident_for(conf), outputs_dir=outputs_dir)


def test_save_load_same_grid_is_exact_and_torn_ones_are_skipped():
    comm = world_comm()
    # lagrangian: the synthetic lattice-sized parts are the full buffers (an eulerian
    # capacity larger than the lattice count would re-slice them)
    conf = SimConfig(nc=NC, grid=grid_for(comm.size), halo_size=1, decomposition="lagrangian")
    out = shared_tmpdir(comm)
    mine = {comm.rank: blocks_of(conf)[comm.rank]}
    for step in (2, 4, 6):
        save(out, comm, conf, step, [comm.rank])
    # keep=2: step 2 removed after step 6 was complete
    assert [os.path.basename(p) for p, _ in checkpoint.candidates(out)] == ["step_000006",
                                                                             "step_000004"]
    manifest, parts = checkpoint.load(out, comm, conf, mine)
    assert manifest["step"] == 6 and manifest["grid"] == list(conf.grid)
    for k, v in truth(conf, mine[comm.rank], 6).items():
        np.testing.assert_array_equal(parts[comm.rank][k], v)  # bit for bit
    comm.barrier()
    if comm.rank == 0:
        root = checkpoint.checkpoint_root(out)
        # a checkpoint being written when the job died: never renamed
        os.makedirs(os.path.join(root, ".tmp-step_000008"))
        open(os.path.join(root, ".tmp-step_000008", "rank00000.h5"), "w").close()
        # a newer directory whose part file is truncated
        torn = checkpoint.step_dir(out, 9)
        shutil.copytree(checkpoint.step_dir(out, 6), torn)
        with open(os.path.join(torn, "rank00000.h5"), "r+b") as f:
            f.truncate(100)
        # and one without a manifest
        os.makedirs(checkpoint.step_dir(out, 10))
        # step 6: same size, other bytes in the LAST rank's file (only that rank sees it)
        last = os.path.join(checkpoint.step_dir(out, 6), "rank%05d.h5" % (comm.size - 1))
        with open(last, "r+b") as f:
            f.seek(-8, 2)
            tail = f.read(8)
            f.seek(-8, 2)
            f.write(bytes(255 - b for b in tail))
    comm.barrier()
    manifest, parts = checkpoint.load(out, comm, conf, mine)
    assert manifest["step"] == 4  # every rank falls back together
    np.testing.assert_array_equal(parts[comm.rank]["momenta"],
                                  truth(conf, mine[comm.rank], 4)["momenta"])
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(checkpoint.step_dir(out, 4))
    comm.barrier()
    with pytest.raises(ResumeError, match="no valid checkpoint"):
        checkpoint.load(out, comm, conf, mine)
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(out)


@pytest.mark.rank_independent
@pytest.mark.parametrize("decomposition", ["lagrangian", "eulerian"])
@pytest.mark.parametrize("old,new", [((2, 1), (2, 2)), ((2, 2), (1, 1)), ((1, 1), (1, 2)),
                                     ((2, 1), (1, 2))])
def test_reslice_to_another_grid(old, new, decomposition):
    """A checkpoint of grid ``old`` loads on grid ``new`` (one process holding every slice).

    Lagrangian: every particle in its Lagrangian block, lattice order. Eulerian: in
    the block that contains its position (x, y wrapped), ``sizing.capacity`` slots,
    the unused ones id -1; every particle exactly once, its state unchanged.
    """
    from flowpm_mtf.physics import sizing

    out = tempfile.mkdtemp(prefix="ckpt")
    conf_old = SimConfig(nc=NC, grid=old, halo_size=1, decomposition=decomposition)
    conf_new = conf_old.replace(grid=new)
    save(out, SelfComm(), conf_old, 3, list(blocks_of(conf_old)))
    manifest, parts = checkpoint.load(out, SelfComm(), conf_new, blocks_of(conf_new))
    assert manifest["grid"] == list(old)
    if decomposition == "lagrangian":
        for p, block in blocks_of(conf_new).items():
            np.testing.assert_array_equal(parts[p]["id"], io.lagrangian_ids(conf_new, block))
            for k, v in truth(conf_new, block, 3).items():
                np.testing.assert_allclose(parts[p][k], v, rtol=RESLICE_RTOL, atol=RESLICE_RTOL)
        shutil.rmtree(out)
        return
    ref = truth(conf_new.replace(grid=(1, 1)), (0, 0), 3)   # id order, origin 0
    nxy = np.asarray(NC[:2], np.float64)
    s = np.asarray(conf_new.block_shape[:2])
    seen = []
    for p, block in blocks_of(conf_new).items():
        ids = parts[p]["id"]
        assert ids.shape == (sizing.capacity(conf_new),)
        valid = ids >= 0
        assert np.all(ids[valid.sum():] == -1)   # the particles first, then the empty slots
        ids = ids[valid]
        seen.append(ids)
        glob = parts[p]["positions"][valid].astype(np.float64) + [block[0] * s[0],
                                                                  block[1] * s[1], 0]
        np.testing.assert_array_equal(np.floor(glob[:, :2] / s).astype(int),
                                      np.broadcast_to(block, (ids.size, 2)))
        want = ref["positions"][ids].astype(np.float64)
        want[:, :2] %= nxy
        np.testing.assert_allclose(glob, want, rtol=RESLICE_RTOL, atol=RESLICE_RTOL)
        for k in ("momenta", "forces"):
            np.testing.assert_array_equal(parts[p][k][valid], ref[k][ids])
    np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.arange(np.prod(NC)))
    shutil.rmtree(out)


@pytest.mark.rank_independent
def test_eulerian_reslice_reads_only_the_parts_that_can_hold_its_particles(monkeypatch):
    """Each new block reads the old parts whose recorded position range meets it, not all.

    Old grid 4x1 on x in 16 cells (blocks of 4), positions within 0.3 cells of the
    lattice: the new block x in [0, 8) of grid 2x2 can only get particles of the
    old blocks 0 and 1 and of block 2 (which starts at 8 - 0.3), and block 3 wraps
    to [-4.3, -0.7]: 3 of the 4 parts. The result equals a read of every part.
    """
    nc = (16, 8, 4)
    conf_old = SimConfig(nc=nc, grid=(4, 1), halo_size=1, decomposition="eulerian")
    conf_new = conf_old.replace(grid=(2, 2))
    out = tempfile.mkdtemp(prefix="ckpt")
    save(out, SelfComm(), conf_old, 2, list(blocks_of(conf_old)))
    reads = []
    real_read = checkpoint._read_file
    monkeypatch.setattr(checkpoint_load, "_read_file",
                        lambda path, info: reads.append(os.path.basename(path)) or
                        real_read(path, info))
    path = checkpoint.step_dir(out, 2)
    manifest = checkpoint.read_manifest(path)
    pruned, _ = checkpoint._reslice(path, manifest, conf_new, (0, 0))
    assert sorted(reads) == ["rank00000.h5", "rank00001.h5", "rank00002.h5"]
    for info in manifest["files"].values():
        del info["xy_range"]  # a checkpoint without ranges: every part is read
    reads.clear()
    whole, n = checkpoint._reslice(path, manifest, conf_new, (0, 0))
    assert len(reads) == 4
    for k in ("id",) + checkpoint.STATE_NAMES:
        np.testing.assert_array_equal(pruned[k], whole[k])
    assert n == int((whole["id"] >= 0).sum()) > 0
    shutil.rmtree(out)


def test_may_overlap_agrees_with_sampled_positions():
    """``_may_overlap`` is False only when no periodic image of the range meets the block."""
    rng = np.random.default_rng(3)
    box = (16.0, 12.0)
    for _ in range(2000):
        a = rng.uniform(-20, 30, 2)
        b = a + rng.uniform(0, 14, 2)
        lo = rng.integers(0, 4, 2) * np.array([4.0, 3.0])
        hi = lo + np.array([4.0, 3.0])
        pts = a + (b - a) * np.linspace(0, 1, 801)[:, None]
        w = pts % box
        hit = np.any(np.all((w >= lo) & (w < hi), axis=1))
        rng_list = [[a[0], b[0]], [a[1], b[1]]]
        if hit:  # never skip a part that holds a particle of the block
            assert checkpoint._may_overlap(rng_list, lo, hi, box)
        # and skip when every image is at least the margin plus a cell away, per axis
        far = [not np.any(((pts[:, d] % box[d]) >= lo[d] - 1) & ((pts[:, d] % box[d]) < hi[d] + 1))
               and (b[d] - a[d]) < box[d] - 2 for d in range(2)]
        if any(far):
            assert not checkpoint._may_overlap(rng_list, lo, hi, box)
    assert not checkpoint._may_overlap(None, (0, 0), (4, 4), box)


@pytest.mark.rank_independent
def test_resume_config_contradictions():
    conf = SimConfig(nc=NC, grid=(2, 1), halo_size=1, n_steps=4)
    manifest = {"config": {"config": conf.to_dict()}, "step": 2}
    makers = {"config": SimConfig.from_dict}
    same = checkpoint.check_resume_config(
        manifest, {"config": {"nc": [8, 8, 4], "grid": (1, 2)}}, makers)["config"]
    assert same.grid == (1, 2) and same.nc == NC
    with pytest.raises(ResumeError, match="n_steps=6 contradicts the checkpoint's n_steps=4"):
        checkpoint.check_resume_config(manifest, {"config": {"n_steps": 6}}, makers)
    with pytest.raises(ResumeError, match="nc=8 contradicts"):
        checkpoint.check_resume_config(manifest, {"config": {"nc": 8}}, makers)
    with pytest.raises(ResumeError, match="seed"):
        checkpoint.check_resume_config(manifest, {"config": {"seed": 1}}, makers)


def test_sigterm_on_one_rank_is_agreed_by_all():
    comm = world_comm()
    previous = signal.getsignal(signal.SIGTERM)
    with checkpoint.StopRequest(comm) as stop:
        assert not stop.agreed()
        if comm.rank == comm.size - 1:
            os.kill(os.getpid(), signal.SIGTERM)  # handled: only sets the flag
        assert stop.agreed()
        assert (stop.received is not None) == (comm.rank == comm.size - 1)
    assert signal.getsignal(signal.SIGTERM) == previous


@pytest.mark.rank_independent
def test_sigterm_stays_ignored_after_a_run_until_the_process_exits():
    """``until_exit`` (the flowpm-mtf command): a block left normally leaves SIGTERM ignored
    (the rank shuts down next; a signal there ended it with "exited on signal 15"); a block
    left by an error restores the previous handler; the default restores it always."""
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with checkpoint.StopRequest(SelfComm(), until_exit=True) as stop:
            stop.finished = True
            os.kill(os.getpid(), signal.SIGTERM)   # after the last step: recorded only
        assert stop.received == signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGTERM)       # ignored: this process lives on
        signal.signal(signal.SIGTERM, previous)
        with pytest.raises(RuntimeError):
            with checkpoint.StopRequest(SelfComm(), until_exit=True):
                raise RuntimeError("a failed run")
        assert signal.getsignal(signal.SIGTERM) == previous
        with checkpoint.StopRequest(SelfComm()):
            pass
        assert signal.getsignal(signal.SIGTERM) == previous
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.rank_independent
def test_manifest_records_files_and_checksums():
    out = tempfile.mkdtemp(prefix="ckpt")
    conf = SimConfig(nc=NC, grid=(2, 2), halo_size=1)
    path = save(out, SelfComm(), conf, 5, list(blocks_of(conf)))
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["format"] == checkpoint.FORMAT and manifest["step"] == 5
    assert manifest["n_particles"] == int(np.prod(NC))
    assert sorted(manifest["files"]) == ["rank%05d.h5" % p for p in range(4)]
    assert all(len(v["blake3"]) == 64 for v in manifest["files"].values())
    assert not [d for d in os.listdir(checkpoint.checkpoint_root(out)) if d.startswith(".tmp")]
    shutil.rmtree(out)


# ----------------------------------------------------------------------------- identity
@pytest.mark.rank_independent
def test_identity_hashes_the_state_config_not_the_layout():
    """The grid, halo and capacities (layout) leave the hash alone; every physics field moves it."""
    from flowpm_mtf.config import Cosmology

    conf = SimConfig(nc=NC, grid=(2, 1), halo_size=1, n_steps=10)
    ref = ident_for(conf)
    for layout in (conf.replace(grid=(1, 2)), conf.replace(halo_size=2),
                   conf.replace(capacity=conf.n_particles, send_capacity=64)):
        assert ident_for(layout)["config_hash"] == ref["config_hash"]
    for other in (conf.replace(n_steps=20), conf.replace(seed=1), conf.replace(dtype="float64"),
                  conf.replace(lpt_order=1), conf.replace(a_start=0.2), conf.replace(nc=(8, 8, 8)),
                  conf.replace(box_size=(100.0,) * 3), conf.replace(decomposition="lagrangian"),
                  conf.replace(cosmology=Cosmology(sigma8=0.9))):
        assert ident_for(other)["config_hash"] != ref["config_hash"], other
    assert ident_for(conf, stages=[0.1, 0.2])["config_hash"] != ref["config_hash"]
    assert ref["job"] == "simulate" and ref["stages"][3] == 0.1 * 3
    assert "grid" not in ref["state_config"] and ref["state_config"]["n_steps"] == 10


@pytest.mark.rank_independent
def test_check_identity_names_what_differs():
    conf = SimConfig(nc=NC, grid=(2, 1), halo_size=1, n_steps=10)
    out = tempfile.mkdtemp(prefix="ckpt")
    path = save(out, SelfComm(), conf, 6, list(blocks_of(conf)))
    saved = checkpoint.read_manifest(path)
    assert saved["job"] == "simulate" and saved["a"] == 0.1 * 6
    assert checkpoint.check_identity(saved, ident_for(conf.replace(grid=(1, 1))), path) is None

    def why(manifest=saved, ident=None):
        return checkpoint.check_identity(manifest, ident or ident_for(conf), path)

    assert why(ident=ident_for(conf, job="lensing")) == \
        "%s was written by job 'simulate', not 'lensing'" % path
    assert why(ident=ident_for(conf.replace(n_steps=20))) == \
        "%s: config differs: n_steps 10 (checkpoint) != 20 (this run)" % path
    assert "cosmology.sigma8 0.8159 (checkpoint) != 0.9" in why(
        ident=ident_for(conf.replace(cosmology=conf.cosmology.__class__(sigma8=0.9))))
    # the saved state is at a = 0.6 = stage 6 of the checkpoint's stages; another list
    moved = [0.1 * i for i in range(6)] + [0.68] + [0.7 + 0.1 * i for i in range(4)]
    assert why(ident=ident_for(conf, stages=moved)) == (
        "%s holds the state after step 6 at a=0.6, but this run has stage 6 at a=0.68; the "
        "stage lists differ" % path)
    assert "only 3 stages" in why(ident=ident_for(conf, stages=[0.1, 0.2, 0.3]))
    assert "stages differ: stage 9 at a=0.9 (checkpoint) != 0.95" in why(
        ident=ident_for(conf, stages=[0.1 * i for i in range(9)] + [0.95, 1.0]))
    assert "stages differ: 11 (checkpoint) != 12" in why(
        ident=ident_for(conf, stages=[0.1 * i for i in range(12)]))
    # a record that does not hash to its hash; an old checkpoint without a record
    assert "is damaged" in why(dict(saved, state_config=dict(saved["state_config"], seed=3)))
    old = {k: v for k, v in saved.items()
           if k not in ("job", "config_hash", "state_config", "stages")}
    old["format"] = checkpoint.FORMAT_V1
    assert "older flowpm-mtf (flowpm_mtf.runs.checkpoint/1)" in why(old)
    assert "--overwrite" in why(old)
    shutil.rmtree(out)


def test_load_and_verify_refuse_another_run_on_every_rank():
    """A complete checkpoint of another job or config is refused (not skipped to an older one)."""
    comm = world_comm()
    conf = SimConfig(nc=NC, grid=grid_for(comm.size), halo_size=1, decomposition="lagrangian")
    out = shared_tmpdir(comm)
    mine = {comm.rank: blocks_of(conf)[comm.rank]}
    with pytest.raises(ResumeError, match="no valid checkpoint"):
        checkpoint.verify_resume(out, comm, ident_for(conf))
    save(out, comm, conf, 2, [comm.rank])
    save(out, comm, conf, 4, [comm.rank], ident=ident_for(conf, job="lensing"))
    for check in (lambda ident: checkpoint.load(out, comm, conf, mine, ident=ident),
                  lambda ident: checkpoint.verify_resume(out, comm, ident)):
        with pytest.raises(ResumeError, match="step_000004 was written by job 'lensing', not "
                                              "'simulate'"):
            check(ident_for(conf))
    assert checkpoint.verify_resume(out, comm, ident_for(conf, job="lensing"))["step"] == 4
    manifest, _ = checkpoint.load(out, comm, conf, mine, ident=ident_for(conf, job="lensing"))
    assert manifest["step"] == 4
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(out)


@pytest.mark.rank_independent
def test_resume_config_of_another_job_is_left_to_the_identity_check():
    """Another job's sections are not compared field by field (its identity check names it)."""
    conf = SimConfig(nc=NC, grid=(2, 1), halo_size=1, n_steps=4)
    manifest = {"config": {"config": conf.to_dict(), "lensing": {"n_planes": 3}}, "step": 2,
                "job": "lensing"}
    makers = {"config": SimConfig.from_dict, "simulate": lambda d: _Opts(**d)}
    got = checkpoint.check_resume_config(manifest, {"config": {"n_steps": 6, "grid": (1, 2)}},
                                         makers)
    assert got["config"].n_steps == 6 and got["config"].grid == (1, 2)
    with pytest.raises(ResumeError, match="written by job 'lensing'"):
        checkpoint.check_resume_config(manifest, {"config": {"nc": 7, "grid": (2, 1)}}, makers)


class _Opts:
    def __init__(self, **kw):
        self.kw = kw

    def to_dict(self):
        return dict(self.kw)


# ----------------------------------------------------------------------------- outputs
def _tree(root):
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            with open(os.path.join(d, n), "rb") as f:
                out[os.path.relpath(os.path.join(d, n), root)] = f.read()
    return out


@pytest.mark.rank_independent
def test_outputs_written_before_a_checkpoint_are_kept_and_restored(monkeypatch):
    """Every staged file goes into the checkpoint and back, byte for byte; a replaced file is
    the new one in the next checkpoint, an unchanged one is not hashed again, a damaged one
    makes the load fall back to the previous checkpoint."""
    conf = SimConfig(nc=NC, grid=(1, 1), halo_size=1, decomposition="lagrangian")
    out = tempfile.mkdtemp(prefix="ckpt")
    staging = os.path.join(out, ".staging")
    os.makedirs(os.path.join(staging, "snap.parts"))
    files = {"power_a0.1000.txt": b"1 2 3\n", os.path.join("snap.parts", "rank00000.h5"): b"x" * 99,
             "snap.h5": b"vds"}
    for rel, data in files.items():
        with open(os.path.join(staging, rel), "wb") as f:
            f.write(data)
    for junk in (".probe-1", "power.txt.tmp-123"):   # never part of a checkpoint
        open(os.path.join(staging, junk), "w").close()
    save(out, SelfComm(), conf, 2, [0], outputs_dir=staging)
    m2 = checkpoint.read_manifest(checkpoint.step_dir(out, 2))
    assert sorted(m2["outputs"]) == sorted(files)
    # the run goes on: one file replaced by rename (as every writer does), one added
    with io.atomic_path(os.path.join(staging, "snap.h5")) as tmp:
        with open(tmp, "wb") as f:
            f.write(b"vds2")
    files["snap.h5"] = b"vds2"
    with open(os.path.join(staging, "power_a0.2000.txt"), "wb") as f:
        f.write(b"4 5 6\n")
    files["power_a0.2000.txt"] = b"4 5 6\n"
    hashed = []
    real = checkpoint.digest.file_digest
    monkeypatch.setattr(checkpoint.digest, "file_digest",
                        lambda p, *a: hashed.append(p) or real(p, *a))
    save(out, SelfComm(), conf, 4, [0], outputs_dir=staging)
    monkeypatch.setattr(checkpoint.digest, "file_digest", real)
    hashed_outputs = sorted(p.split(os.sep + "outputs" + os.sep, 1)[1]
                            for p in hashed if os.sep + "outputs" + os.sep in p)
    assert hashed_outputs == ["power_a0.2000.txt", "snap.h5"]   # the others kept their hash
    assert _tree(os.path.join(checkpoint.step_dir(out, 2), "outputs"))["snap.h5"] == b"vds"
    shutil.rmtree(staging)                                     # a stopped run: staging dropped
    manifest, _ = checkpoint.load(out, SelfComm(), conf, blocks_of(conf))
    assert manifest["step"] == 4
    dest = os.path.join(out, "new-staging")
    names = checkpoint.restore_outputs(checkpoint.step_dir(out, 4), manifest, dest, SelfComm())
    assert sorted(names) == sorted(files) and _tree(dest) == files
    # same size, other bytes in an output of step 4: back to step 2 (its own outputs)
    with open(os.path.join(checkpoint.step_dir(out, 4), "outputs", "power_a0.2000.txt"),
              "wb") as f:
        f.write(b"4 5 7\n")
    manifest, _ = checkpoint.load(out, SelfComm(), conf, blocks_of(conf))
    assert manifest["step"] == 2 and sorted(manifest["outputs"]) == sorted(m2["outputs"])
    shutil.rmtree(out)
