"""References kept for the later passes of a test run (tests/world_share.py, ``kept``): a
value is computed once per key, loaded again for an equal key, and never kept without the
run's directory or a key, or when its computation fails."""
import numpy as np
import pytest

import world_share
from world_share import REFERENCES_ENV, kept

pytestmark = pytest.mark.rank_independent


class Counted:
    """A reference computation that counts its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return {"field": np.arange(6.0).reshape(2, 3) * self.calls, "calls": self.calls}


def test_computed_once_per_key_then_loaded(tmp_path, monkeypatch):
    monkeypatch.setenv(REFERENCES_ENV, str(tmp_path))
    fn = Counted()
    linear = np.linspace(0.0, 1.0, 8)
    first = kept(fn, key=("name", linear, 0.1))
    # an equal key made of new objects (as a later pass builds it) loads the kept value
    again = kept(fn, key=("name", np.linspace(0.0, 1.0, 8), 0.1))
    assert fn.calls == 1 and again["calls"] == 1
    np.testing.assert_array_equal(again["field"], first["field"])
    # another input, or another name: computed
    kept(fn, key=("name", linear + 1e-12, 0.1))
    kept(fn, key=("other", linear, 0.1))
    assert fn.calls == 3
    assert len(list(tmp_path.iterdir())) == 3          # whole files only, no temporaries


def test_nothing_kept_without_the_directory_or_a_key(tmp_path, monkeypatch):
    fn = Counted()
    monkeypatch.delenv(REFERENCES_ENV, raising=False)
    kept(fn, key=("name", 1))
    kept(fn, key=("name", 1))
    monkeypatch.setenv(REFERENCES_ENV, str(tmp_path))
    kept(fn, key=None)
    kept(fn, key=None)
    assert fn.calls == 4 and list(tmp_path.iterdir()) == []


def test_a_failed_computation_keeps_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(REFERENCES_ENV, str(tmp_path))

    def fails():
        raise ValueError("no reference")

    with pytest.raises(ValueError, match="no reference"):
        kept(fails, key=("name",))
    assert list(tmp_path.iterdir()) == []
    assert kept(Counted(), key=("name",))["calls"] == 1


def test_on_rank0_of_one_process_keeps_with_a_key(tmp_path, monkeypatch):
    monkeypatch.setenv(REFERENCES_ENV, str(tmp_path))
    fn = Counted()
    assert world_share.on_rank0(fn, key=("name", 2))["calls"] == 1
    assert world_share.on_rank0(fn, key=("name", 2))["calls"] == 1
    assert world_share.on_rank0(fn)["calls"] == 2      # no key: computed
