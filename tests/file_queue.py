"""Test files shared out between the 1-rank pass's pytest processes (docs/testing.md).

scripts/run_tests.sh starts ``NP1_PARTS`` pytest processes (default 2) side by side on one
rank, so that both cores work. Each collects every test, orders the files by their cost
(:data:`COSTS`, costliest first) and runs a file only if it claims it first: an empty
file named after it, created exclusively in the shared directory ``FLOWPM_MTF_TEST_QUEUE``. A process that
finishes a file claims the next one left, so they end within about the cost of the last
files, whatever the costs are now (a stale or missing cost only changes the order). The
tests of a file run in one process, in their usual order, with their module fixtures.

The costs are the wall seconds per file of a full run's 1-rank pass (:func:`costs_from_logs`);
after a change of the suite, refresh them from that run's logs::

    python tests/file_queue.py test-logs > tests/file_costs.tsv
"""
import glob
import os
import sys

COSTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "file_costs.tsv")


def load_costs(path=COSTS):
    """``{test file: CPU seconds}`` from ``path`` (tab-separated, ``#`` comments); empty if
    there is none."""
    costs = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                if line.strip() and not line.startswith("#"):
                    name, cost = line.rstrip("\n").split("\t")
                    costs[name] = float(cost)
    return costs


def file_of(item):
    """The test file of a collected item, as in a node id (``tests/test_x.py``)."""
    return item.nodeid.split("::")[0]


def ordered_groups(items, costs):
    """The items grouped by file, in their collected order within a file; the files by
    decreasing cost (a file without one: the median cost), ties by name."""
    groups = {}
    for item in items:
        groups.setdefault(file_of(item), []).append(item)
    known = sorted(costs.values())
    default = known[len(known) // 2] if known else 0.0
    return [groups[f] for f in sorted(groups, key=lambda f: (-costs.get(f, default), f))]


def claim(queue, name):
    """True if this process is the first to claim ``name`` in the directory ``queue``."""
    path = os.path.join(queue, name.replace(os.sep, "__"))
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return False
    return True


def run_claimed(session, queue, costs):
    """The test loop of one of the processes sharing ``queue``: every file it claims, in
    :func:`ordered_groups`' order. ``nextitem`` of a file's last test is the first test of
    the next file in that order (claimed or not): its module fixtures are torn down, the
    session's kept."""
    groups = ordered_groups(session.items, costs)
    for g, group in enumerate(groups):
        if not claim(queue, file_of(group[0])):
            continue
        following = groups[g + 1][0] if g + 1 < len(groups) else None
        for i, item in enumerate(group):
            nextitem = group[i + 1] if i + 1 < len(group) else following
            item.config.hook.pytest_runtest_protocol(item=item, nextitem=nextitem)
            if session.shouldfail:
                raise session.Failed(session.shouldfail)
            if session.shouldstop:
                raise session.Interrupted(session.shouldstop)


def costs_from_logs(logdir):
    """``{test file: seconds}`` summed over the 1-rank pass's JUnit reports
    (``np1_rank0*.xml``) in ``logdir``: each test's wall time as that pass ran it (set-up,
    call and tear-down). Wall, not CPU: a file that mostly waits on what it launched (a
    Slurm job, a peer timeout) takes its wall time whatever its CPU, and must start early."""
    import xml.etree.ElementTree as ET

    costs = {}
    for path in glob.glob(os.path.join(logdir, "np1_rank0*.xml")):
        for case in ET.parse(path).getroot().iter("testcase"):
            name = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
            costs[name] = costs.get(name, 0.0) + float(case.get("time") or 0.0)
    return costs


if __name__ == "__main__":
    found = costs_from_logs(sys.argv[1] if len(sys.argv) > 1 else "test-logs")
    if not found:
        sys.exit("no np1_rank0*.xml in %s" % (sys.argv[1:] or ["test-logs"])[0])
    print("# wall seconds per test file in the 1-rank pass (python tests/file_queue.py LOGDIR)")
    for name, cost in sorted(found.items(), key=lambda kv: (-kv[1], kv[0])):
        print("%s\t%.1f" % (name, cost))
