"""Per-rank writing of one logical HDF5 file (flowpm_mtf.runs.h5dist): local slices without
communication on HvdSimdMeshImpl and PlacementMeshImpl, virtual datasets over per-rank
parts read back with plain h5py, errors on every rank."""
import os
import shutil
import tempfile

import h5py
import mesh_tensorflow as mtf
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

from flowpm_mtf.runs import collective, h5dist, h5dist_part, io
from flowpm_mtf.backend import SerialComm
from flowpm_mtf.errors import FlowpmError
from mtf_harness import hvd_config, hvd_impl, mesh_id, placement_config, placement_impl

tf.disable_eager_execution()


def world_comm():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def shared_tmpdir(comm):
    """One temporary directory for all ranks (created by rank 0)."""
    d = tempfile.mkdtemp(prefix="h5dist") if comm.rank == 0 else None
    return comm.bcast(d, root=0)


GRIDS = {1: [(1, 1)], 2: [(2, 1), (1, 2)], 4: [(2, 2), (4, 1)]}
SHAPE = (8, 4, 3)


def _grids():
    return GRIDS[world_comm().size]


@pytest.mark.parametrize("kind", ["hvd", "placement"])
def test_local_slices_are_the_slices(kind):
    """Every slice a process holds equals the full tensor at its begin; together they cover it."""
    full = np.arange(np.prod(SHAPE), dtype=np.float64).reshape(SHAPE)
    layout = [("a", "m0"), ("b", "m1")]
    for dims in _grids():
        with tf.Graph().as_default():
            graph = mtf.Graph()
            mesh = mtf.Mesh(graph, "mesh")
            shape = mtf.Shape([mtf.Dimension(n, s) for n, s in zip("abc", SHAPE)])
            x = mtf.import_tf_tensor(mesh, tf.constant(full), shape) * 2.0
            total = mtf.reduce_sum(x)
            impl = hvd_impl(dims, layout) if kind == "hvd" else placement_impl(dims, layout)
            lowering = mtf.Lowering(graph, {mesh: impl})
            slices = h5dist.local_slices(lowering, x)
            rep = h5dist.replicated_value(lowering, total)
            config = hvd_config() if kind == "hvd" else placement_config(int(np.prod(dims)))
            with tf.Session(config=config) as sess:
                vals, rep_val = sess.run([[t for _, t, _ in slices], rep])
            n = int(np.prod(dims))
            assert len(slices) == (1 if kind == "hvd" else n), mesh_id(dims)
            covered = np.zeros(SHAPE, int)
            for (p, _, begin), v in zip(slices, vals):
                idx = tuple(slice(b, b + s) for b, s in zip(begin, v.shape))
                np.testing.assert_array_equal(v, 2.0 * full[idx])
                covered[idx] += 1
                assert h5dist.owns_slice(impl, shape, p)
            if kind == "placement":
                assert np.all(covered == 1)
            assert rep_val == 2.0 * full.sum()
            if n > 1:
                with pytest.raises(ValueError, match="split over the mesh"):
                    h5dist.replicated_value(lowering, x)


def test_owns_slice_writes_replicated_copies_once():
    """A tensor split over one mesh axis only is owned by one processor per slice."""
    impl = placement_impl((2, 2), [("a", "m0")])
    shape = mtf.Shape([mtf.Dimension("a", 4), mtf.Dimension("b", 2)])
    owners = [p for p in range(4) if h5dist.owns_slice(impl, shape, p)]
    assert len(owners) == 2
    assert sorted(impl.slice_begin(shape, p)[0] for p in owners) == [0, 2]


def _expected_rows(size):
    return [np.arange(3 * r * 2, dtype=np.float32).reshape(-1, 2) + 100 * r for r in range(size)]


def test_virtual_file_reads_with_plain_h5py_anywhere():
    """Variable rows per rank (also 0) and blocks: one logical file, read from another working
    directory and after the directory is moved."""
    comm = world_comm()
    d = shared_tmpdir(comm)
    rows = _expected_rows(comm.size)
    nx = 2 * comm.size
    field = np.arange(nx * 3 * 5, dtype=np.float64).reshape(nx, 3, 5)
    parts = {comm.rank: {"rows": h5dist.Rows(rows[comm.rank]),
                         "ids": h5dist.Rows(np.arange(rows[comm.rank].shape[0]) + 10 * comm.rank),
                         "field": h5dist.Block(field[2 * comm.rank:2 * comm.rank + 2],
                                               (2 * comm.rank, 0, 0), field.shape)}}
    path = os.path.join(d, "run", "data.h5")
    os.makedirs(os.path.dirname(path), exist_ok=True) if comm.rank == 0 else None
    comm.barrier()
    assert h5dist.write_distributed(path, comm, parts, attrs={"note": "x"},
                                    dataset_attrs={"rows": {"units": "m"}}) == path
    comm.barrier()
    if comm.rank == 0:
        moved = os.path.join(d, "elsewhere")
        shutil.move(os.path.join(d, "run"), moved)
        cwd = os.getcwd()
        os.chdir(tempfile.mkdtemp())
        try:
            with h5py.File(os.path.join(moved, "data.h5"), "r") as f:
                np.testing.assert_array_equal(f["rows"][...], np.concatenate(rows))
                np.testing.assert_array_equal(f["field"][...], field)
                assert f["ids"].shape == (sum(r.shape[0] for r in rows),)
                assert f["rows"].attrs["units"] == "m" and f.attrs["note"] == "x"
            h5dist.check_sources(os.path.join(moved, "data.h5"))
            os.remove(h5dist.part_path(os.path.join(moved, "data.h5"), comm.size - 1))
            with pytest.raises(FlowpmError, match="missing"):
                h5dist.check_sources(os.path.join(moved, "data.h5"))
        finally:
            os.chdir(cwd)
        shutil.rmtree(d)
    comm.barrier()


def test_rows_with_a_transform_are_written_piece_by_piece(monkeypatch):
    """A transform (float32 -> float64 here) is applied to pieces of PIECE_ROWS rows as they
    are written; the file holds exactly the whole conversion, also for 0 rows and for a
    last piece shorter than the others."""
    comm = world_comm()
    d = shared_tmpdir(comm)
    monkeypatch.setattr(h5dist_part, "PIECE_ROWS", 7)
    n = 23 + 5 * comm.rank if comm.rank != 1 else 0
    src = (np.arange(3 * n, dtype=np.float32).reshape(n, 3) + 0.1 * comm.rank) / 3
    pieces = []

    def transform(rows):
        pieces.append(rows.shape[0])
        return rows.astype(np.float64) * 2.5 + 1.0

    rows = h5dist.Rows(src, transform, np.float64)
    path = os.path.join(d, "t.h5")
    h5dist.write_distributed(path, comm, {comm.rank: {"x": rows}})
    assert pieces == [min(7, n - i) for i in range(0, n, 7)]
    want = np.concatenate(comm.allgather(src.astype(np.float64) * 2.5 + 1.0))
    with h5py.File(path, "r") as f:
        assert f["x"].dtype == np.float64
        np.testing.assert_array_equal(f["x"][...], want)
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(d)
    comm.barrier()


def _file_blake3(path):
    import blake3

    with open(path, "rb") as f:
        return blake3.blake3(f.read()).hexdigest()


@pytest.mark.parametrize("compression", [None, "gzip"])
def test_part_files_are_hashed_while_written(compression, monkeypatch):
    """Every part file's BLAKE3 digest is computed while it is written (contiguous data
    written past HDF5, hashed in file order with the metadata between them; or hashed after a
    compressed write) and recorded on rank 0, which then knows the digest of every rank's file
    (h5dist_part.known_digest) as long as the file is unchanged; masked rows (keep) are written
    piece by piece; stats count the bytes of all part files."""
    comm = world_comm()
    d = shared_tmpdir(comm)
    monkeypatch.setattr(h5dist_part, "PIECE_ROWS", 5)
    n = 17 + 3 * comm.rank
    src = np.arange(3 * n, dtype=np.float32).reshape(n, 3) + 100 * comm.rank
    keep = np.arange(n) % 3 != 1
    ids = np.arange(n, dtype=np.int32) + 1000 * comm.rank
    nx = 2 * comm.size
    field = np.arange(nx * 3 * 4, dtype=np.float32).reshape(nx, 3, 4)
    parts = {comm.rank: {"x": h5dist.Rows(src, lambda r: r * 2.0, np.float32, keep=keep),
                         "id": h5dist.Rows(ids, None, np.int64, keep=keep),
                         "none": h5dist.Rows(np.zeros((0, 3))),
                         "field": h5dist.Block(field[2 * comm.rank:2 * comm.rank + 2],
                                               (2 * comm.rank, 0, 0), field.shape)}}
    path = os.path.join(d, "h.h5")
    stats = {}
    h5dist.write_distributed(path, comm, parts, attrs={"note": "x"},
                             dataset_attrs={"x": {"units": "m"}}, compression=compression,
                             stats=stats)
    comm.barrier()
    files = [h5dist.part_path(path, p) for p in range(comm.size)]
    assert stats["files"] == comm.size and stats["seconds"] > 0
    assert stats["bytes"] == sum(os.path.getsize(f) for f in files)
    want_x = np.concatenate(comm.allgather(src[keep] * 2.0))
    want_id = np.concatenate(comm.allgather(ids[keep].astype(np.int64)))
    with h5py.File(path, "r") as f:
        np.testing.assert_array_equal(f["x"][...], want_x)
        np.testing.assert_array_equal(f["id"][...], want_id)
        np.testing.assert_array_equal(f["field"][...], field)
        assert f["x"].dtype == np.float32 and f["id"].dtype == np.int64
        assert f["none"].shape == (0, 3) and f["x"].attrs["units"] == "m"
    with h5py.File(files[comm.rank], "r") as f:
        assert f["x"].compression == compression
    comm.barrier()
    if comm.rank == 0:
        for f in files:
            assert h5dist_part.known_digest(f) == _file_blake3(f)
        os.utime(files[-1], ns=(1, 1))          # changed since: hashed again by the caller
        assert h5dist_part.known_digest(files[-1]) is None
        assert h5dist_part.known_digest(path) is None  # the virtual file was not recorded
        shutil.rmtree(d)
    comm.barrier()


def _write_modes(comm, d, name, monkeypatch):
    """Write the same parts (several staging buffers and a partial last block); return
    ``(bytes of this rank's part file, its recorded SHA-256 or None, stats)``."""
    monkeypatch.setattr(h5dist_part, "DIRECT_CHUNK", 3 * h5dist_part.DIRECT_ALIGN)
    monkeypatch.setattr(h5dist_part, "DIRECT_BUFFERS", 2)
    monkeypatch.setattr(h5dist_part, "PIECE_ROWS", 1000)
    n = 4000 + 777 * comm.rank        # 48 kB + a tail: 4+ buffers, not a multiple of 4096
    rng = np.random.default_rng(comm.rank)
    src = rng.standard_normal((n, 3)).astype(np.float32)
    keep = rng.random(n) > 0.1
    parts = {comm.rank: {"x": h5dist.Rows(src, lambda r: r * 3.0, np.float32, keep=keep),
                         "id": h5dist.Rows(np.arange(n), None, np.int64, keep=keep)}}
    path = os.path.join(d, name + ".h5")
    stats = {}
    h5dist.write_distributed(path, comm, parts, attrs={"note": "same"}, stats=stats)
    part = h5dist.part_path(path, comm.rank)
    with open(part, "rb") as f:
        data = f.read()
    with h5py.File(path, "r") as f:
        np.testing.assert_array_equal(
            f["x"][...], np.concatenate(comm.allgather(src[keep] * np.float32(3.0))))
    known = comm.bcast([h5dist_part.known_digest(h5dist.part_path(path, p))
                        for p in range(comm.size)] if comm.rank == 0 else None, root=0)
    return data, known[comm.rank], stats


def test_direct_and_buffered_writes_give_the_same_files(monkeypatch):
    """The part files written with O_DIRECT from aligned staging buffers, buffered (the
    file system refuses O_DIRECT at open, or only at the first write), are the same bytes
    (HDF5 puts its metadata at the same offsets: only the data are written past it), with
    the right BLAKE3 digest recorded; stats and the log say which mode wrote them."""
    import errno
    import fcntl
    import blake3

    comm = world_comm()
    d = shared_tmpdir(comm)
    probe = os.path.join(d, "probe-%d" % comm.rank)
    open(probe, "wb").close()
    fd = h5dist_part._open_direct(probe)
    direct_ok = fd is not None
    if fd is not None:
        try:
            os.pwrite(fd, memoryview(h5dist_part._aligned_buffer(h5dist_part.DIRECT_ALIGN)), 0)
        except OSError:
            direct_ok = False
        os.close(fd)
    os.remove(probe)
    files = {}
    files["direct"] = _write_modes(comm, d, "direct", monkeypatch)

    refused = []
    real = h5dist_part._pwrite_all

    def no_direct_writes(fd, buf, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0):
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, buf, offset)

    monkeypatch.setattr(h5dist_part, "_pwrite_all", no_direct_writes)
    files["refused_at_write"] = _write_modes(comm, d, "write", monkeypatch)
    monkeypatch.setattr(h5dist_part, "_pwrite_all", real)
    monkeypatch.setattr(h5dist_part, "DIRECT_IO", False)
    files["buffered"] = _write_modes(comm, d, "buffered", monkeypatch)

    data, sha, stats = files["direct"]
    problems = []      # gathered, so that a failure on one rank does not hang the others
    if stats["mode"] != ("direct" if direct_ok else "buffered"):
        problems.append("direct write mode %s (O_DIRECT works: %s)" % (stats["mode"], direct_ok))
    align = h5dist_part.DIRECT_ALIGN
    if not (len(data) % align and len(data) > 4 * 3 * align):
        problems.append("part file of %d bytes: not several buffers and a tail" % len(data))
    if files["refused_at_write"][2]["mode"] != "buffered" or files["buffered"][2]["mode"] != \
            "buffered":
        problems.append("fallback modes %s" % [files[k][2]["mode"] for k in files])
    # the first refusal switches the mode (writes in flight then may be refused too)
    if not (1 <= len(refused) <= h5dist_part.DIRECT_WRITERS if direct_ok else not refused):
        problems.append("%d direct writes refused" % len(refused))
    for mode, (other, other_sha, _) in files.items():
        if other != data:
            problems.append("%s: other bytes than the direct write" % mode)
        if other_sha != blake3.blake3(other).hexdigest():
            problems.append("%s: recorded BLAKE3 digest %s is wrong" % (mode, other_sha))
    problems = comm.allgather(problems)
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(d)
    assert problems == [[]] * comm.size


@pytest.mark.rank_independent
def test_unknown_compression_is_refused():
    with pytest.raises(ValueError, match="compression"):
        h5dist.write_distributed("/nonexistent/x.h5", SerialComm(),
                                 {0: {"a": h5dist.Rows(np.zeros(3))}}, compression="zstd")


def test_failure_on_one_rank_raises_on_every_rank():
    comm = world_comm()
    d = shared_tmpdir(comm)
    bad = comm.rank == comm.size - 1
    data = np.array([object(), object()]) if bad else np.zeros((2,))
    with pytest.raises(FlowpmError, match="failed on rank %d" % (comm.size - 1)):
        h5dist.write_distributed(os.path.join(d, "x.h5"), comm, {comm.rank: {"a": h5dist.Rows(data)}})
    comm.barrier()
    if comm.rank == 0:
        assert not os.path.exists(os.path.join(d, "x.h5"))
        shutil.rmtree(d)


def test_gather_slab_assembles_blocks():
    comm = world_comm()
    full = np.arange(4 * comm.size * 3, dtype=np.float64).reshape(4 * comm.size, 3)
    mine = [(full[4 * comm.rank:4 * comm.rank + 4], (4 * comm.rank, 0))]
    np.testing.assert_array_equal(h5dist.gather_slab(comm, mine, full.shape), full)


@pytest.mark.rank_independent
def test_distributed_snapshot_reads_like_a_serial_one():
    """io.read_snapshot on a distributed snapshot (one process holding 3 parts)."""
    from flowpm_mtf.config import SimConfig

    conf = SimConfig(nc=(6, 6, 4), box_size=60.0, grid=(3, 1), halo_size=1)
    d = tempfile.mkdtemp(prefix="snapdist")
    rng = np.random.RandomState(0)
    parts, pos_all = {}, {}
    for bx in range(3):
        pos = rng.uniform(0, 2, (2 * 6 * 4, 3))
        parts[bx] = io.particle_part(conf, (bx, 0), pos, np.zeros_like(pos), a=1.0)
        pos_all[bx] = pos
        parts[bx]["density"] = h5dist.Block(np.full((2, 6, 4), bx, np.float64), (2 * bx, 0, 0),
                                            conf.nc)
    io.write_snapshot_distributed(os.path.join(d, "snapshot.h5"), SerialComm(), parts,
                                  attrs=conf)
    snap = io.read_snapshot(os.path.join(d, "snapshot.h5"))
    assert sorted(snap["id"]) == list(range(6 * 6 * 4))
    assert snap["config"]["nc"] == [6, 6, 4] and snap["units"]["position"] == "Mpc/h"
    assert snap["position"].dtype == np.float32   # the run's dtype (conf.dtype)
    # particle with id i started at lattice cell i (row-major): check one per block
    for bx in range(3):
        i = 2 * bx
        rows = np.nonzero(snap["id"] == i * 24)[0]
        np.testing.assert_allclose(snap["position"][rows[0]],
                                   (pos_all[bx][0] + [2 * bx, 0, 0]) * conf.cell_size % 60.0,
                                   rtol=2.5e-7)   # float32 arithmetic (an ulp)
    np.testing.assert_array_equal(snap["density"][:, 0, 0], [0, 0, 1, 1, 2, 2])
    shutil.rmtree(d)


def test_disk_full_on_one_rank_is_exit_5_on_every_rank():
    """A real ENOSPC (/dev/full) while the last rank writes its part file: the same
    one-line OutputDirError (exit 5) on every rank, naming that rank."""
    from flowpm_mtf.errors import OutputDirError

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    comm = world_comm()
    d = shared_tmpdir(comm)
    path = os.path.join(d, "x.h5")
    if comm.rank == comm.size - 1:
        part = h5dist.part_path(path, comm.rank)
        os.makedirs(os.path.dirname(part), exist_ok=True)
        os.symlink("/dev/full", "%s.tmp-%d" % (part, os.getpid()))
    with pytest.raises(OutputDirError, match="no space left on device.*rank %d"
                       % (comm.size - 1)) as err:
        h5dist.write_distributed(path, comm, {comm.rank: {"a": h5dist.Rows(np.zeros((5000, 3)))}})
    assert err.value.exit_code == 5 and "\n" not in str(err.value)
    comm.barrier()
    if comm.rank == 0:
        assert not os.path.exists(path)
        shutil.rmtree(d)
    comm.barrier()


@pytest.mark.parametrize("error, cls", [
    ("OSError: [Errno 28] No space left on device: '/x'", "OutputDirError"),  # checkpoint.save
    ("OSError: [Errno 122] Disk quota exceeded", "OutputDirError"),
    ("OSError: [Errno 13] Permission denied", "FlowpmError"),
])
def test_agree_classifies_a_ranks_error_text(error, cls):
    """Errors passed between ranks as text (as checkpoint.save does) keep their meaning."""
    with pytest.raises(FlowpmError) as err:
        collective._agree(SerialComm(), error, "writing y")
    assert type(err.value).__name__ == cls
    assert err.value.exit_code == (5 if cls == "OutputDirError" else 1)


def test_collective_keeps_the_class_of_a_flowpm_error():
    from flowpm_mtf.errors import ResumeError

    def root(_):
        raise ResumeError("bad checkpoint")

    with pytest.raises(ResumeError, match="writing z failed on rank 0: bad checkpoint"):
        collective.collective(SerialComm(), dict, root, "writing z")


FULL_DISK_SCRIPT = r"""
import os, sys
import numpy as np
from flowpm_mtf.runs import h5dist
from flowpm_mtf.backend import SerialComm
d = sys.argv[1]
st = os.statvfs(d)
with open(os.path.join(d, "filler"), "wb") as f:  # leave 8 KiB free
    f.write(b"\0" * (st.f_bavail * st.f_frsize - 8192))
try:  # 24 KB of data: small enough for HDF5 to keep in its cache until the file closes
    h5dist.write_distributed(os.path.join(d, "x.h5"), SerialComm(),
                             {0: {"a": h5dist.Rows(np.ones((1000, 3)))}})
    print("no error")
except Exception as e:
    print(type(e).__name__, e)
"""


def test_nearly_full_disk_fails_cleanly_not_in_hdf5s_close(tmp_path):
    """On a real nearly full file system (a 256 KiB tmpfs; root only): HDF5 would fail
    writing its cache while closing the file (an error from a destructor, then a crash at
    exit); the space reservation makes it a clean OutputDirError and a normal exit."""
    import subprocess
    import sys

    if world_comm().size > 1 or os.geteuid() != 0:
        pytest.skip("mounts a tmpfs: root, 1-rank pass only")
    d = str(tmp_path / "fs")
    os.makedirs(d)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", d],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        proc = subprocess.run([sys.executable, "-c", FULL_DISK_SCRIPT, d], capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr  # no crash at exit
        assert proc.stdout.startswith("OutputDirError no space left on device"), proc.stdout
        assert sorted(os.listdir(d)) == ["filler", "x.parts"]
        assert os.listdir(os.path.join(d, "x.parts")) == []
    finally:
        subprocess.run(["umount", d])
