"""flowpm_mtf.logs: prefix format, rank detection, idempotence, rank-0 filter.

Independent of the world size: every rank runs the same checks on its own
in-memory stream."""
import io
import logging
import re
import sys

import pytest

from flowpm_mtf import logs

PREFIX = re.compile(r"^\[rank (\d+) \+(\d+\.\d)s\] (\w+) ([\w.]+): (.*)$")


@pytest.fixture
def fresh_root():
    """Remove the handler installed by setup_logging before and after the test."""
    root = logging.getLogger()
    level = root.level

    def strip():
        for h in list(root.handlers):
            if h.get_name() == logs._HANDLER_NAME:
                root.removeHandler(h)

    strip()
    yield root
    strip()
    root.setLevel(level)


def test_prefix_format_and_elapsed(fresh_root):
    stream = io.StringIO()
    logs.setup_logging("DEBUG", rank=3, stream=stream)
    logging.getLogger("flowpm_mtf.test").info("hello %d", 42)
    line = stream.getvalue().strip().splitlines()[-1]
    m = PREFIX.match(line)
    assert m, line
    assert m.group(1) == "3"
    assert 0.0 <= float(m.group(2)) < 60.0
    assert m.groups()[2:] == ("INFO", "flowpm_mtf.test", "hello 42")


def test_idempotent(fresh_root):
    stream = io.StringIO()
    h1 = logs.setup_logging("INFO", rank=0, stream=stream)
    h2 = logs.setup_logging("WARNING")
    assert h1 is h2
    ours = [h for h in fresh_root.handlers if h.get_name() == logs._HANDLER_NAME]
    assert len(ours) == 1
    log = logging.getLogger("flowpm_mtf.test2")
    log.info("dropped")
    log.warning("kept")
    lines = stream.getvalue().strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith("kept")
    with pytest.raises(ValueError):
        logs.setup_logging("NOT_A_LEVEL")


@pytest.mark.parametrize("env, expected", [
    ({}, 0),
    ({"OMPI_COMM_WORLD_RANK": "2"}, 2),
    ({"PMI_RANK": "5"}, 5),
    ({"SLURM_PROCID": "7"}, 7),
    ({"HOROVOD_RANK": "1"}, 1),
    ({"OMPI_COMM_WORLD_RANK": "3", "SLURM_PROCID": "0"}, 3),  # MPI launcher wins
    ({"PMI_RANK": "junk", "SLURM_PROCID": "4"}, 4),
])
def test_detect_rank(env, expected):
    assert logs.detect_rank(env) == expected


def test_rank0_only(fresh_root):
    stream = io.StringIO()
    logs.setup_logging("INFO", rank=0, stream=stream)
    quiet = logs.rank0_only(logging.getLogger("flowpm_mtf.test.rank1"), rank=1)
    loud = logs.rank0_only("flowpm_mtf.test.rank0", rank=0)
    logs.rank0_only(loud, rank=0)  # a second call adds no second filter
    assert sum(isinstance(f, logs.Rank0Filter) for f in loud.filters) == 1
    quiet.info("from rank 1")
    loud.info("from rank 0")
    text = stream.getvalue()
    assert "from rank 0" in text and "from rank 1" not in text


@pytest.mark.parametrize("env, expected", [
    ({}, (0, 1)),
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4"}, (3, 4)),
    # srun --mpi=pmix: PMIX_RANK but no PMIX_SIZE; the size is Slurm's task count
    ({"PMIX_RANK": "1", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, (1, 2)),
    ({"PMIX_RANK": "2"}, (2, 1)),
])
def test_detect_rank_and_size(env, expected):
    assert (logs.detect_rank(env), logs.detect_size(env)) == expected


def test_follows_a_replaced_stderr(fresh_root, monkeypatch):
    """A handler installed on the default stderr writes to the current one after a later
    call (the first stderr may be gone: a test's capture, closed)."""
    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    logs.setup_logging("INFO", rank=0)
    first.close()
    second = io.StringIO()
    monkeypatch.setattr(sys, "stderr", second)
    logs.setup_logging("INFO")
    logging.getLogger("flowpm_mtf.test3").warning("here")
    assert second.getvalue().strip().endswith("here")
