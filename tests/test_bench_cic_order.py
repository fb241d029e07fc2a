"""scripts/bench_cic_order.py at 16^3 in one process: the synthetic lattice and a one-rank
snapshot are timed in both orders, the column order reads every particle's values bit for
bit and paints the same mass, a rerun replaces its record, and a multi-rank snapshot is
refused with one line."""
import json

import h5py
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

# as in the suite, where modules imported before this one turn eager execution off: the
# script builds its own graph and session, in either mode (run by hand, it is eager)
tf.disable_eager_execution()

from flowpm_bench.scripts import load_script

bc = load_script("bench_cic_order")

pytestmark = pytest.mark.rank_independent


def _records(out):
    with open(bc.json_path(str(out), bc.NAME)) as f:    # out/ itself outside results/
        return json.load(f)


def _check(rec, n):
    assert rec["n"] == n
    assert set(rec["ns_per_particle"]) == set(bc.COLUMNS)
    assert all(v > 0 for v in rec["ns_per_particle"].values())
    assert rec["checks"]["readout_bitwise"] is True
    assert rec["checks"]["paint_max_rel_diff"] < 1e-5
    slot, column = rec["checks"]["mass"]
    assert slot == pytest.approx(n, rel=1e-5) and column == pytest.approx(n, rel=1e-5)


def test_synthetic_lattice(tmp_path):
    pos, nc = bc.synthetic_cells(16, 3.0)
    assert nc == (16, 16, 16) and pos.shape == (16**3, 3) and pos.dtype == np.float32
    assert pos.min() >= 0 and pos.max() < 16
    q = np.indices(nc).reshape(3, -1).T
    d = np.mod(pos - q + 8, 16) - 8                      # periodic displacement
    assert 2.0 < d.std() < 4.0                          # ~3 cells rms, not zero

    assert bc.main(["--synthetic", "16", "--displacement", "3", "--repeat", "1",
                    "--out", str(tmp_path)]) == 0
    assert bc.main(["--synthetic", "16", "--displacement", "3", "--repeat", "1",
                    "--out", str(tmp_path)]) == 0
    recs = _records(tmp_path)
    assert len(recs) == 1                                # the rerun replaced its record
    _check(recs[0], 16**3)
    table = (tmp_path / "bench_cic_order.md").read_text()
    assert "| synthetic rms 3 cells | 16^3 |" in table


def _snapshot(path, grid, nc=16, box=50.0):
    rng = np.random.default_rng(3)
    with h5py.File(path, "w") as f:
        f.attrs["config"] = json.dumps({"grid": list(grid), "nc": [nc] * 3, "box_size": [box] * 3})
        f["position"] = (rng.random((nc**3, 3)) * box).astype(np.float32)
        f["id"] = rng.permutation(nc**3).astype(np.int32)


def test_lagrangian_orders():
    """``lattice``: each particle at its id; ``tiles``: the lattice sites of 16^3 tiles in
    row-major tile order (a 32x32x16 mesh: 2x2x1 tiles); ids that are not 0..N-1 refused."""
    nc = (32, 32, 16)
    n = 32 * 32 * 16
    ids = np.random.default_rng(1).permutation(n)
    pos = np.stack([ids, ids * 2, ids * 3], -1).astype(np.float32)    # the id, recoverable
    out = bc.lagrangian_orders(pos, ids, nc)
    np.testing.assert_array_equal(out["lattice"][:, 0], np.arange(n))
    site = out["tiles"][:, 0].astype(np.int64)
    i, j, k = np.unravel_index(site, nc)
    assert np.array_equal(site[:16 * 16 * 16].reshape(16, 16, 16)[0, 0], np.arange(16))
    tile = (i // 16) * 2 + j // 16                                     # nz / 16 = 1 tile in z
    assert np.all(np.diff(tile) >= 0) and np.array_equal(np.bincount(tile), [4096] * 4)
    assert np.array_equal(np.sort(site), np.arange(n))
    with pytest.raises(SystemExit, match="not 0 .. N-1"):
        bc.lagrangian_orders(pos, ids // 2, nc)


def test_one_rank_snapshot(tmp_path):
    _snapshot(tmp_path / "snapshot.h5", (1, 1))
    pos, nc = bc.snapshot_cells(str(tmp_path / "snapshot.h5"))
    assert nc == (16, 16, 16) and pos.min() >= 0 and pos.max() < 16
    assert bc.main(["--snapshot", str(tmp_path / "snapshot.h5"), "--repeat", "1",
                    "--out", str(tmp_path / "res")]) == 0
    _check(_records(tmp_path / "res")[0], 16**3)


def test_multi_rank_snapshot_refused(tmp_path):
    _snapshot(tmp_path / "snapshot.h5", (2, 1))
    with pytest.raises(SystemExit, match="a one-rank snapshot is needed"):
        bc.main(["--snapshot", str(tmp_path / "snapshot.h5"), "--out", str(tmp_path)])
