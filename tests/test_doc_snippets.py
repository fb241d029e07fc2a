"""Every documented snippet runs: the code blocks of README.md and docs/*.md (issue 57).

The rules this file checks:

* every fenced block names its language; output listings and file contents are ``text``
  (or another non-shell language), not unlabelled;
* every ``python``, ``bash`` or ``sh`` block starts with one of two lines:
  ``# run with: <command>`` or ``# not run here: <why>`` (GPU, cluster, Slurm, a run of
  minutes or more, the set-up that rebuilds the environment);
* a ``# run with:`` block runs verbatim, in a fresh process, with exactly that command
  (through ``bash -c``): the block is the command's standard input, or, when the command
  names a ``.py``/``.sh`` file that the repository does not have (``mpirun -np 4
  .venv/bin/python quickstart.py``: ``mpirun`` gives standard input to rank 0 only), that
  file, written first. The working directory mirrors the repository root (a symlink to each
  of its entries), so relative paths such as ``.venv/bin/python`` and ``scripts/`` work and
  the outputs (``out/...``) land in a temporary directory. The environment is this one
  without an enclosing MPI job's variables and without an activated virtualenv; ``mpirun``
  may run as root and oversubscribe through ``OMPI_ALLOW_RUN_AS_ROOT``,
  ``OMPI_ALLOW_RUN_AS_ROOT_CONFIRM`` and ``OMPI_MCA_rmaps_base_oversubscribe`` only, so the
  command stays the one a user types. No conftest, no extra import;
* it must exit 0 and print what :data:`EXPECTED` holds for it (regular expressions, in the
  order of the file's ``# run with:`` blocks; a block may also assert by itself).

The blocks of one file run in order in one directory shared by all files (README.md first);
a file that reads another file's outputs names it in :data:`NEEDS`.
"""
import os
import re
import shlex
import subprocess
import sys
import time

import pytest

from flowpm_bench.launch import MPI_LAUNCH_PREFIXES

# It starts its own MPI jobs: the 1-rank pass runs it.
pytestmark = pytest.mark.single_process

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(os.path.join("docs", f)
                              for f in os.listdir(os.path.join(REPO, "docs"))
                              if f.endswith(".md"))
SHELL_OR_PYTHON = {"python", "python3", "py", "bash", "sh", "shell", "console", "zsh"}
RUN, NOT_RUN = "# run with:", "# not run here:"
MPIRUN_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
              "OMPI_MCA_rmaps_base_oversubscribe": "1"}
BLOCK_TIMEOUT = 600   # [s] per block

# sum(x * roll(x, 1)) printed by each of the 4 ranks; print() writes its items one by one, so
# the ranks' lines may interleave (as a user sees them): the value, 4 times
_QUICKSTART = r"(?s)(71008\.0.*){4}"

#: Per file, one entry per ``# run with:`` block in order: a regular expression, or a list of
#: them, that its output (standard output and error) must contain.
EXPECTED = {
    "README.md": [
        r"published \S*/out/sim: \d+ files, manifest\.json",                    # simulate
        r"\(262144, 3\) \(64, 64, 64\) 1\.0\b",                                # h5py
        [r"wrote \S*/snapshot_a0\.5000\.h5", r"published \S*/out/sim2: \d+ files"],  # options
        _QUICKSTART,
    ],
    "docs/api.md": [r"loss \d+\.\d{4} -> \d+\.\d{4}",
                    r"loss after 5 steps: (\d+\.\d{6}) \(numpy: \1\)"],     # 2-layer, 4 ranks
    "docs/clusters.md": [[r"(?s)node1.*node1", r"(?s)node2.*node2"]],         # sim_cluster
    "docs/from-flowpm.md": [r"grid 2x1: mean density (1\.00000|0\.99999)\d, "
                            r"P\(k = 0\.3\d\d h/Mpc\) = \d+ \(Mpc/h\)\^3"],
    "docs/lensing.md": [r"kappa rms \d"],
    "docs/output.md": [r"\[\[[-+0-9.e ]+\]\s*\[[-+0-9.e ]+\]\]"],
    "docs/reconstruction.md": [r"loss [\d.]+ -> [\d.]+ in 20 iterations",
                               r"loss [-+\d.e]+, dL/dOmega_c [-+\d.e]+, dL/dsigma8 [-+\d.e]+"],
}
#: Files whose blocks read another file's outputs (run that file first).
NEEDS = {"docs/output.md": "README.md"}   # out/sim/snapshot.h5

#: Commands that read their standard input (mpirun forwards it to rank 0): in a block fed to
#: ``bash`` on standard input they would swallow the block's next lines.
_READS_STDIN = re.compile(r"\b(mpirun|mpiexec|srun|horovodrun)\b|sim_cluster\.sh\s+(mpirun|run)\b")

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


def code_blocks(path):
    """The fenced blocks of a Markdown file: dicts of ``line`` (1-based, the opening fence),
    ``lang`` (first word of the info string, lower case; '' if none) and ``lines`` (the
    body, the opening fence's indentation removed)."""
    lines = open(os.path.join(REPO, path), encoding="utf-8").read().split("\n")
    out, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = m.group("indent"), m.group("fence")
        info = m.group("info").strip().split()
        j = i + 1
        while j < len(lines):
            close = _FENCE.match(lines[j])
            if (close and close.group("fence")[0] == fence[0]
                    and len(close.group("fence")) >= len(fence) and not close.group("info").strip()):
                break
            j += 1
        body = [ln[len(indent):] if ln.startswith(indent) else ln.lstrip()
                for ln in lines[i + 1:j]]
        out.append({"line": i + 1, "lang": info[0].lower() if info else "", "lines": body})
        i = j + 1
    return out


def stdin_hazards(command, lines):
    """Lines of a block fed to its command on standard input that start a command reading
    standard input, with more commands after it: those would become its input."""
    if _file_of(command) is not None:
        return []
    commands, current = [], ""
    for line in lines[1:]:
        current += line.split(" #")[0] if not line.lstrip().startswith("#") else ""
        if current.endswith("\\"):
            current = current[:-1]
            continue
        if current.strip():
            commands.append(current.strip())
        current = ""
    return [c for c in commands[:-1] if _READS_STDIN.search(c) and "<" not in c]


def _file_of(command):
    """The ``.py``/``.sh`` file a command runs that the repository does not have, or None."""
    for token in shlex.split(command):
        if (token.endswith((".py", ".sh")) and "/" not in token
                and not os.path.exists(os.path.join(REPO, token))):
            return token
    return None


def runnable(path):
    """The ``# run with:`` blocks of ``path``: (line, command, text)."""
    return [(b["line"], b["lines"][0][len(RUN):].strip(), "\n".join(b["lines"]) + "\n")
            for b in code_blocks(path)
            if b["lang"] in SHELL_OR_PYTHON and b["lines"] and b["lines"][0].startswith(RUN)]


# ----------------------------------------------------------------------------- the rules
def test_every_block_is_marked():
    """Every block has a language, and every shell/python block one of the two markers."""
    bad = []
    for path in DOCS:
        for b in code_blocks(path):
            where = "%s:%d" % (path, b["line"])
            first = b["lines"][0] if b["lines"] else ""
            if not b["lang"]:
                bad.append("%s: a block without a language (```text for output)" % where)
            elif b["lang"] in SHELL_OR_PYTHON:
                if first.startswith(RUN):
                    command = first[len(RUN):].strip()
                    if not command:
                        bad.append("%s: '# run with:' names no command" % where)
                    for c in stdin_hazards(command, b["lines"]):
                        bad.append("%s: %r reads standard input, which is this block: the "
                                   "lines after it would be its input (end the block with "
                                   "it, or give it '< /dev/null')" % (where, c))
                elif first.startswith(NOT_RUN):
                    if not first[len(NOT_RUN):].strip():
                        bad.append("%s: '# not run here:' gives no reason" % where)
                else:
                    bad.append("%s: ```%s block starts with neither '%s' nor '%s'"
                               % (where, b["lang"], RUN, NOT_RUN))
    assert not bad, "\n".join(bad)


def test_every_run_block_has_an_expectation():
    """EXPECTED has one entry per '# run with:' block of each file, and no other."""
    counts = {path: len(runnable(path)) for path in DOCS}
    bad = ["%s: %d '# run with:' blocks, %d expectations in EXPECTED"
           % (path, n, len(EXPECTED.get(path, []))) for path, n in counts.items()
           if n != len(EXPECTED.get(path, []))]
    bad += ["EXPECTED names %s, which is not a documentation file" % p
            for p in set(EXPECTED) - set(DOCS)]
    assert not bad, "\n".join(bad)


def test_the_parser_finds_indented_and_unlabelled_blocks(tmp_path, monkeypatch):
    text = ("intro\n\n```\nplain\n```\n\n* item:\n\n  ```bash\n  # run with: bash\n  echo hi\n"
            "  ```\n\n~~~python title\n# not run here: why\n~~~\n")
    (tmp_path / "x.md").write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "REPO", str(tmp_path))
    blocks = code_blocks("x.md")
    assert [(b["line"], b["lang"]) for b in blocks] == [(3, ""), (9, "bash"), (14, "python")]
    assert blocks[1]["lines"] == ["# run with: bash", "echo hi"]
    assert runnable("x.md") == [(9, "bash", "# run with: bash\necho hi\n")]


def test_a_command_reading_stdin_must_end_a_stdin_block():
    lines = ["# run with: bash", "echo {} > a.json", "mpirun -np 2 x \\", "  --y 1  # why",
             "ls"]
    assert stdin_hazards("bash", lines) == ["mpirun -np 2 x   --y 1"]
    assert stdin_hazards("bash", lines[:-1]) == []
    assert stdin_hazards("bash", lines[:2] + ["mpirun -np 2 z < /dev/null", "ls"]) == []
    assert stdin_hazards("bash block.sh", lines) == []        # a file: stdin is not the block


# ----------------------------------------------------------------------------- running
def block_env():
    """This environment without an enclosing MPI job, pytest or an activated virtualenv,
    plus mpirun's permissions to run as root and to oversubscribe."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(MPI_LAUNCH_PREFIXES + ("PYTEST_", "FLOWPM_MTF_TEST_"))
           and k != "VIRTUAL_ENV"}
    venv = os.environ.get("VIRTUAL_ENV")
    if venv:
        env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                      if not p.startswith(venv))
    env.update(MPIRUN_ENV)
    return env


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A directory that mirrors the repository root: one symlink per entry (not out/)."""
    ws = tmp_path_factory.mktemp("doc-snippets")
    for name in os.listdir(REPO):
        if name not in (".git", "out", "test-logs"):
            os.symlink(os.path.join(REPO, name), ws / name)
    return ws


def run_block(ws, path, line, command, text):
    """Run one block as documented; returns (seconds, exit code, output)."""
    stdin, name = text, _file_of(command)
    if name is not None:
        (ws / name).write_text(text)   # the block is the file the command runs
        stdin = None
    t0 = time.time()
    try:
        proc = subprocess.run(command, shell=True, executable="/bin/bash", cwd=ws,
                              env=block_env(), input=stdin,
                              stdin=subprocess.DEVNULL if stdin is None else None,
                              capture_output=True, text=True, timeout=BLOCK_TIMEOUT)
        code, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        code, output = "timeout", "%s%s" % (e.stdout or "", e.stderr or "")
    seconds = time.time() - t0
    print("%s:%d  %.1f s  exit %s  $ %s" % (path, line, seconds, code, command))
    return seconds, code, output


_done = {}


def run_file(ws, path):
    """Run every '# run with:' block of ``path`` in order (once per session)."""
    if path in _done:
        return _done[path]
    if path in NEEDS:
        run_file(ws, NEEDS[path])
    results = []
    for (line, command, text), expected in zip(runnable(path), EXPECTED.get(path, [])):
        hazards = stdin_hazards(command, text.split("\n"))
        if hazards:   # not run: its last lines would not run (e.g. a clean-up)
            results.append((line, command, 0.0, "not run", ["no line reading stdin before "
                                                           "others: %s" % hazards], ""))
            continue
        seconds, code, output = run_block(ws, path, line, command, text)
        patterns = [expected] if isinstance(expected, str) else expected
        missing = [p for p in patterns if not re.search(p, output)]
        results.append((line, command, seconds, code, missing, output))
    _done[path] = results
    return results


@pytest.mark.parametrize("path", [p for p in DOCS if runnable(p)])
def test_documented_blocks_run(path, workspace):
    venv = os.path.join(REPO, ".venv")
    if os.path.realpath(sys.prefix) != os.path.realpath(venv):
        pytest.skip("the documented commands use .venv; this run uses %s (another stack)"
                    % sys.prefix)
    results = run_file(workspace, path)
    bad = ["%s:%d exit %s, output lacks %s ($ %s)\n%s"
           % (path, line, code, missing, command, output[-3000:])
           for line, command, seconds, code, missing, output in results
           if code != 0 or missing]
    print("%s: %d blocks in %.1f s" % (path, len(results), sum(r[2] for r in results)))
    assert not bad, "\n\n".join(bad)


#: docs/benchmarks.md holds the current table of each benchmark with its command; the history
#: of the measurements is in git and results/ (issue 56): a page past this length is a log.
BENCHMARKS_MAX_LINES = 400


def test_benchmarks_page_stays_a_reference():
    with open(os.path.join(REPO, "docs", "benchmarks.md")) as f:
        n = len(f.read().splitlines())
    assert n <= BENCHMARKS_MAX_LINES, (
        "docs/benchmarks.md has %d lines (at most %d): keep the current tables and their "
        "commands, move history to results/" % (n, BENCHMARKS_MAX_LINES))
