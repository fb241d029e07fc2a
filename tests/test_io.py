"""flowpm_mtf.runs.io: HDF5 snapshot and power-spectrum text round trips.

Independent of the world size: every rank writes its own files into its own
temporary directory (``rank=0`` passed explicitly), and the rank-0-only rule is
checked with an explicit ``rank=1``. The reference reader is plain h5py / numpy.
"""
import json
import os
import shutil
import tempfile

import h5py
import numpy as np
import pytest

from flowpm_mtf.runs import io, snapshot, writers

# Text columns are written with 17 significant digits: float64 round trips exactly.
TEXT_RTOL = 0.0


@pytest.fixture
def workdir():
    """A private directory (pytest's tmp_path numbering is shared by the ranks of a job)."""
    path = tempfile.mkdtemp(prefix="flowpm_mtf_io_")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _arrays(dtype=np.float32):
    rng = np.random.default_rng(5)
    pos = (rng.random((4 * 6 * 8, 3)) * 100.0).astype(dtype)
    vel = rng.normal(size=(4 * 6 * 8, 3)).astype(dtype)
    dens = rng.random((4, 6, 8)).astype(dtype)
    return pos, vel, dens


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_snapshot_roundtrip_with_plain_h5py(workdir, dtype):
    pos, vel, dens = _arrays(dtype)
    config = {"nc": (4, 6, 8), "box_size": np.array([100.0, 150.0, 200.0]),
              "a_end": np.float64(1.0), "n_steps": np.int64(10),
              "cosmology": {"Omega_c": 0.2589, "h": 0.6774}}
    path = os.path.join(workdir, "snap.h5")
    assert io.write_snapshot(path, pos, vel, dens, config, rank=0) == path
    assert os.listdir(workdir) == ["snap.h5"]  # no temporary file left behind

    with h5py.File(path, "r") as f:  # the reference reader: plain h5py
        np.testing.assert_array_equal(f["position"][()], pos)
        np.testing.assert_array_equal(f["velocity"][()], vel)
        np.testing.assert_array_equal(f["density"][()], dens)
        assert f["position"].dtype == dtype
        assert f["position"].attrs["units"] == "Mpc/h"
        stored = json.loads(f.attrs["config"])
        assert f.attrs["format"] == io.SNAPSHOT_FORMAT
        for key in ("tensorflow", "mesh_tensorflow", "numpy", "flowpm_mtf"):
            assert f.attrs["version." + key] == io.versions()[key]
    assert stored == {"nc": [4, 6, 8], "box_size": [100.0, 150.0, 200.0], "a_end": 1.0,
                      "n_steps": 10, "cosmology": {"Omega_c": 0.2589, "h": 0.6774}}

    snap = io.read_snapshot(path)
    np.testing.assert_array_equal(snap["position"], pos)
    np.testing.assert_array_equal(snap["velocity"], vel)
    np.testing.assert_array_equal(snap["density"], dens)
    assert snap["config"] == stored
    assert snap["versions"] == io.versions()
    assert snap["units"]["density"] == io.DEFAULT_UNITS["density"]


def test_snapshot_with_simconfig_partial_and_units(workdir):
    from flowpm_mtf.config import SimConfig

    conf = SimConfig()
    _, _, dens = _arrays()
    path = os.path.join(workdir, "dens.h5")
    io.write_snapshot(path, density=dens, attrs=conf, units={"density": "1 + delta"},
                      compression="gzip", rank=0)
    snap = io.read_snapshot(path)
    assert snap["position"] is None and snap["velocity"] is None
    np.testing.assert_array_equal(snap["density"], dens)
    assert snap["units"] == {"density": "1 + delta"}
    assert SimConfig.from_dict(snap["config"]) == conf


def test_snapshot_rank_and_shape_checks(workdir):
    pos, vel, dens = _arrays()
    path = os.path.join(workdir, "not_written.h5")
    assert io.write_snapshot(path, pos, vel, dens, {}, rank=1) is None
    assert not os.path.exists(path)
    with pytest.raises(ValueError, match=r"\[N, 3\]"):
        io.write_snapshot(path, pos[:, :2], rank=0)
    with pytest.raises(ValueError, match="differs"):
        io.write_snapshot(path, pos, vel[:-1], rank=0)
    with pytest.raises(ValueError, match="3-d"):
        io.write_snapshot(path, density=dens[0], rank=0)
    assert not os.listdir(workdir)


def test_power_roundtrip(workdir):
    k = np.linspace(0.01, 1.0, 37) + 1e-3 / 3.0
    pk = 1e4 * k**-1.5 * (1.0 + 0.1 * np.sin(k * 17.0))
    modes = np.arange(1, 38) * 6
    path = os.path.join(workdir, "pk.txt")
    assert io.write_power(path, k, pk, modes, header={"seed": 3}, rank=0) == path
    k2, pk2, modes2, header = io.read_power(path)
    np.testing.assert_allclose(k2, k, rtol=TEXT_RTOL)
    np.testing.assert_allclose(pk2, pk, rtol=TEXT_RTOL)
    np.testing.assert_array_equal(modes2, modes)
    assert header[0] == '{"seed": 3}'
    assert header[-1] == "k [h/Mpc]  P(k) [(Mpc/h)^3]  modes"
    # plain numpy reads it too
    np.testing.assert_allclose(np.loadtxt(path)[:, 1], pk, rtol=TEXT_RTOL)
    # without modes: two columns
    io.write_power(path, k, pk, rank=0)
    k3, pk3, modes3, _ = io.read_power(path)
    assert modes3 is None and np.array_equal(pk3, pk)
    assert io.write_power(os.path.join(workdir, "other.txt"), k, pk, rank=2) is None
    with pytest.raises(ValueError):
        io.write_power(path, k, pk[:-1], rank=0)


def test_versions_and_jsonable():
    v = io.versions()
    import mesh_tensorflow
    import tensorflow as tf

    assert v["numpy"] == np.__version__
    assert v["tensorflow"] == tf.__version__
    assert v["mesh_tensorflow"] == "0.1.21" and mesh_tensorflow is not None
    assert v["flowpm_mtf"] != "unknown"
    assert io.to_jsonable({"a": (1, np.float32(2.5)), "b": np.arange(3)}) == {
        "a": [1, 2.5], "b": [0, 1, 2]}


@pytest.mark.parametrize("writer", ["hdf5", "table", "json"])
def test_disk_full_keeps_the_old_file_and_stays_an_oserror(workdir, writer):
    """A real ENOSPC (the temporary file is /dev/full): the OSError (ENOSPC) reaches the
    caller (rank 0 alone writes: the runner makes it collective, exit 5 on every rank, see
    tests/test_rundir.py), the previous file is untouched, no temporary file is left."""
    import errno

    from flowpm_mtf.runs import collective

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    path = os.path.join(workdir, "out." + {"hdf5": "h5", "table": "txt", "json": "json"}[writer])
    with open(path, "w") as f:
        f.write("previous")
    os.symlink("/dev/full", writers._tmp_name(path))
    big = np.zeros((20000, 3))
    with pytest.raises(OSError) as err:
        if writer == "hdf5":
            io.write_hdf5(path, [("x", big, {})], rank=0)
        elif writer == "table":
            io.write_table(path, [big[:, 0]], "x", rank=0)
        else:
            io.write_json(path, {"x": big.tolist()}, rank=0)
    assert err.value.errno == errno.ENOSPC and collective.is_disk_full(err.value)
    with open(path) as f:
        assert f.read() == "previous"
    assert sorted(os.listdir(workdir)) == [os.path.basename(path)]


def test_hdf5_space_is_reserved_before_hdf5_writes(workdir, monkeypatch):
    """A disk too full for the file fails before HDF5 opens it (HDF5 writes its metadata
    at close, where a full disk leaves a file it cannot close: a crash at exit)."""
    import errno

    def fallocate(fd, offset, length):
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    path = os.path.join(workdir, "a.h5")
    with pytest.raises(OSError) as err:
        io.write_hdf5(path, [("x", np.zeros(10), {})], rank=0)
    assert err.value.errno == errno.EDQUOT
    assert os.listdir(workdir) == []  # neither the file, its temporary nor the scratch file


@pytest.mark.rank_independent
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_particle_part_per_axis_constants(dtype, monkeypatch):
    """Non-cubic cells, a block away from the origin: the rows converted over the flat array
    with tiled per-axis constants (snapshot._PerAxis) equal numpy's broadcast of the [3] constants
    bit for bit, for pieces of one row to several tiles (PIECE_ROWS 7 on 50 rows)."""
    from flowpm_mtf.runs import h5dist_part
    from flowpm_mtf.config import SimConfig

    monkeypatch.setattr(h5dist_part, "PIECE_ROWS", 7)
    conf = SimConfig(nc=(16, 8, 4), box_size=(100.0, 60.0, 20.0), grid=(2, 2), dtype=dtype)
    sx, sy, _ = conf.block_shape
    rng = np.random.RandomState(2)
    x = rng.uniform(0, 4, (50, 3)).astype(dtype)
    mom = rng.normal(size=(50, 3)).astype(dtype)
    part = io.particle_part(conf, (1, 1), x, mom, 0.5, ids=np.arange(50))
    pos = np.concatenate([p for _, p in part["position"].pieces()])
    vel = np.concatenate([p for _, p in part["velocity"].pieces()])
    cell = np.array(conf.cell_size, np.float64)
    origin = np.array([sx, sy, 0], np.float64)
    if dtype == "float32":
        want_pos = x * cell.astype(np.float32) + (origin * cell).astype(np.float32)
        want_vel = mom * (cell * 200.0).astype(np.float32)
    else:
        want_pos, want_vel = (x + origin) * cell, mom * (cell * 200.0)
    assert pos.dtype == vel.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(pos, want_pos)
    np.testing.assert_array_equal(vel, want_vel)
    assert len(set(np.round(cell, 6))) == 3 and np.all(want_pos[:, :2] > 0)


@pytest.mark.rank_independent
def test_particle_part_writes_the_runs_dtype():
    """A float32 run's snapshot rows are float32 (to float32 round-off of the exact unit change), in
    [0, box) also where the rounding reaches the box edge (the periodic image 0); a float64
    run's are float64; ids stay int64 and only the valid slots are written."""
    from flowpm_mtf.config import SimConfig

    conf = SimConfig(nc=(8, 8, 8), box_size=100.0, grid=(1, 1), dtype="float32")
    rng = np.random.RandomState(1)
    x = rng.uniform(0, 8, (50, 3)).astype(np.float32)
    x[0] = -1e-9                      # just below 0 cells: wraps to just below the box
    mom = rng.normal(size=(50, 3)).astype(np.float32)
    ids = np.arange(50, dtype=np.int32)
    valid = ids % 4 != 3
    part = io.particle_part(conf, (0, 0), x, mom, 0.5, ids=ids, valid=valid)
    pos, vel, pid = part["position"].data, part["velocity"].data, part["id"].data
    assert pos.dtype == np.float32 and vel.dtype == np.float32 and pid.dtype == np.int64
    np.testing.assert_array_equal(pid, ids[valid])
    assert np.all(pos >= 0) and np.all(pos < 100.0) and np.all(pos[0] == 0)
    ref = np.mod(x[valid].astype(np.float64) * 12.5, 100.0)
    np.testing.assert_allclose(pos[1:], ref[1:], rtol=2.5e-7, atol=1e-5)   # float32 arithmetic
    np.testing.assert_allclose(vel, mom[valid].astype(np.float64) * 2500.0, rtol=2.5e-7)
    part64 = io.particle_part(conf.replace(dtype="float64"), (0, 0), x.astype(np.float64), mom,
                              0.5, ids=ids, valid=valid)
    assert part64["position"].data.dtype == np.float64
    np.testing.assert_allclose(part64["position"].data[1:], ref[1:], rtol=1e-6)


@pytest.mark.rank_independent
@pytest.mark.parametrize("box", [(200.0, 200.0, 200.0), (100.0, 250.0, 40.0)])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_periodic_wrap_equals_numpy_mod(box, dtype):
    """snapshot._PerAxis.wrap (the snapshot's positions across the periodic edge, without numpy's
    slow mod) gives np.mod's values bit for bit, per axis, in [0, box), also at the edges:
    values just below 0 and just below the box, the box itself, -box, multiples of it."""
    rng = np.random.RandomState(3)
    v = np.asarray(box, dtype)
    x = (rng.uniform(-1.2, 2.2, (4000, 3)) * v).astype(dtype)
    tiny = np.finfo(dtype).tiny
    edge = [-tiny, -1e-9, -0.0, 0.0, np.nextafter(v[0], 0), v[0], -v[0], 2 * v[0],
            np.nextafter(-v[0], 0), np.nextafter(2 * v[0], 0)]
    x[:len(edge), 0] = np.asarray(edge, dtype)
    got = x.copy()
    snapshot._PerAxis(v).wrap(got)
    want = np.mod(x, v)
    want[want >= v] -= np.broadcast_to(v, want.shape)[want >= v]   # rounded up to the box: 0
    np.testing.assert_array_equal(got, want)
    assert got.dtype == np.dtype(dtype) and np.all(got >= 0) and np.all(got < v)
