"""The 1-rank pass's file queue (tests/file_queue.py): with NP1_PARTS pytest processes
side by side (scripts/run_tests.sh), every test file runs in exactly one of them."""
import os
import subprocess
import sys

import pytest

import file_queue

pytestmark = pytest.mark.rank_independent

HERE = os.path.dirname(os.path.abspath(__file__))
FILES = ["tests/test_%02d.py" % i for i in range(60)]
CLAIMER = r"""
import sys
sys.path.insert(0, sys.argv[1])
import file_queue
queue, files = sys.argv[2], sys.argv[3:]
print("\n".join(f for f in files if file_queue.claim(queue, f)))
"""


def test_processes_side_by_side_claim_every_file_exactly_once(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", CLAIMER, HERE, str(tmp_path), *FILES],
                              stdout=subprocess.PIPE, text=True) for _ in range(3)]
    claimed = [p.communicate(timeout=60)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    every = [f for part in claimed for f in part]
    assert sorted(every) == sorted(FILES)   # each file once: none lost, none run twice


def test_costliest_files_first_unknown_at_the_median():
    class Item:
        def __init__(self, nodeid):
            self.nodeid = nodeid

    items = [Item("tests/test_a.py::x"), Item("tests/test_b.py::y"),
             Item("tests/test_c.py::z"), Item("tests/test_a.py::w")]
    costs = {"tests/test_a.py": 1.0, "tests/test_b.py": 5.0, "tests/test_d.py": 3.0}
    groups = file_queue.ordered_groups(items, costs)
    assert [[i.nodeid for i in g] for g in groups] == [
        ["tests/test_b.py::y"], ["tests/test_c.py::z"],   # c unknown: the median cost, 3.0
        ["tests/test_a.py::x", "tests/test_a.py::w"]]


def test_costs_are_the_wall_seconds_of_each_file(tmp_path):
    """A file that waits (wall far above its CPU) gets its wall time: it starts early."""
    (tmp_path / "np1_rank0_a.xml").write_text(
        '<testsuites><testsuite>'
        '<testcase classname="tests.test_slurm" name="x" time="100.5"/>'
        '<testcase classname="tests.test_slurm" name="y" time="0.5"/>'
        '<testcase classname="tests.test_fft" name="z" time="3.0"/>'
        '</testsuite></testsuites>')
    (tmp_path / "np1_rank0_b.xml").write_text(
        '<testsuites><testsuite><testcase classname="tests.test_fft" name="w" time="2.0"/>'
        '</testsuite></testsuites>')
    (tmp_path / "np1_rank0_a_cpu.tsv").write_text(
        "# cpu\n1.00\t1.00\t0.00\ttests/test_slurm.py::x\n")
    assert file_queue.costs_from_logs(str(tmp_path)) == {"tests/test_slurm.py": 101.0,
                                                         "tests/test_fft.py": 5.0}
