"""scripts/bench_write.py on a tiny snapshot in one process: both modes written, their
files read back as the snapshot, GB/s and the mode that wrote them reported."""
import json
import os

import pytest

from flowpm_bench.scripts import load_script

bw = load_script("bench_write")

pytestmark = pytest.mark.rank_independent


def test_tiny_write_in_both_modes(tmp_path):
    out = tmp_path / "w.json"
    res = bw.main(["--nc", "16", "--repeat", "2", "--dir", str(tmp_path), "--json", str(out)])
    assert set(res) == {"direct", "buffered"}
    for mode, runs in res.items():
        assert len(runs) == 2
        for r in runs:
            # float32 position + velocity, int64 id: 32 bytes per particle, plus HDF5 metadata
            assert 16**3 * 32 < r["bytes"] < 16**3 * 32 + (1 << 16)
            assert r["gb_per_s"] > 0 and r["seconds"] > 0 and r["cpu_s"] >= 0
            assert r["mode"] in ("direct", "buffered")
    assert {r["mode"] for r in res["buffered"]} == {"buffered"}
    assert json.loads(out.read_text())["runs"]["direct"][0]["bytes"] == res["direct"][0]["bytes"]
    assert os.listdir(tmp_path) == ["w.json"]      # every snapshot removed after its write
