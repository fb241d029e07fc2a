"""Plant known bugs in a copy of the repository and list the tests that catch each one.

The check behind every cut of the suite (issue 56, docs/testing.md "What a cut must keep"):
a bug that a removed test caught must still fail a remaining test. Each bug of :data:`BUGS`
is one exact text replacement in one file of the package; the script extracts a revision
(``git archive``) into a temporary directory, plants the bug, runs the bug's test files on 1
and 2 ranks, and on 4 ranks those of the 4-rank list (``FOUR_RANK_TESTS`` of
scripts/run_tests.sh), as run_tests.sh runs them, and records the failing test ids::

    python scripts/planted_bugs.py                       # every bug, this checkout's HEAD
    python scripts/planted_bugs.py --rev c56d408 y_split # one bug against another revision
    python scripts/planted_bugs.py --out results/planted_bugs.md --json results/planted_bugs.json

A bug that no test catches makes the script exit 1. The native libraries are copied from this
checkout (they must match the revision's sources: build them first).
"""
import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: name -> (file, text, replacement, test files, what the bug is)
BUGS = {
    "halo_offset": (
        "flowpm_mtf/mesh/halo.py",
        "last_inner = mtf.slice(t, s, h, pad_dim)     # padded [s, s+h): goes right",
        "last_inner = mtf.slice(t, s - 1, h, pad_dim)",
        ["tests/test_halo.py", "tests/test_painting.py"],
        "halo fill sends the wrong cells to the right neighbour (off by one cell)"),
    "fft_normalisation": (
        "flowpm_mtf/mesh/fft.py",
        "    unnorm = scale / n if inverse else scale\n",
        "    unnorm = scale / n if inverse else scale\n"
        "    scale, unnorm = (scale * 2.0, unnorm * 2.0) if inverse else (scale, unnorm)\n",
        ["tests/test_fft.py", "tests/test_power.py"],
        "the inverse FFT is twice too large"),
    "migration_row": (
        "flowpm_mtf/mesh/domain.py",
        "        rvalid = recv[..., -1] > 0.5\n",
        "        rvalid = (recv[..., -1] > 0.5) & (tf.range(recv.shape[-2]) > 0)\n",
        ["tests/test_domain.py"],
        "the first row of every received migration buffer is dropped"),
    "kick_factor": (
        "flowpm_mtf/physics/nbody.py",
        "    return np.stack([kick0, drift, kick1], axis=1).astype(conf.np_dtype)",
        "    return np.stack([kick0 * 1.01, drift, kick1], axis=1).astype(conf.np_dtype)",
        ["tests/test_nbody.py"],
        "the first kick of every step is 1 % too strong"),
    "y_split": (
        "flowpm_mtf/mesh/fft.py",
        "        flags = [tf.equal(pc.pop(0), 0) if size > 1 else tf.constant(True) "
        "for size in (P, Q)]\n",
        "        flags = [tf.equal(pc.pop(0), 0) if size > 1 else tf.constant(True) "
        "for size in (P, Q)]\n        flags[1] = tf.constant(True)\n",
        ["tests/test_fft.py", "tests/test_kspace_ops.py", "tests/test_kernels.py",
         "tests/test_force_vjp.py", "tests/test_radial_filter.py"],
        "half-spectrum k-space ops: every block of a split y axis believes it is the first "
        "(wrong kz planes where y is split)"),
    "placement_exchange": (
        "flowpm_mtf/mesh/fft.py",
        "        t = pieces(t, b) if pieces is not None else mesh_impl.alltoall(t, b, 2, 1)\n",
        "        t = pieces(t, b) if pieces is not None else mesh_impl.alltoall(\n"
        "            mesh_impl.slicewise(lambda u: tf.reverse(u, [1]), t), b, 2, 1)\n",
        ["tests/test_fft.py", "tests/test_kspace_ops.py", "tests/test_kernels.py",
         "tests/test_force_vjp.py", "tests/test_radial_filter.py"],
        "the half-spectrum forward FFT on a MeshImpl without laid-out pieces (Mesh TF's "
        "PlacementMeshImpl) reverses y before the exchange on a split y axis"),
}


def four_rank_files():
    """``FOUR_RANK_TESTS`` of scripts/run_tests.sh."""
    with open(os.path.join(REPO, "scripts", "run_tests.sh")) as f:
        text = f.read()
    block = re.search(r"FOUR_RANK_TESTS=\((.*?)\n\)", text, re.S).group(1)
    return set(re.findall(r"^\s*(tests/\S+\.py)", block, re.M))


def extract(rev, dest):
    """The tree of ``rev`` in ``dest``, with this checkout's native libraries."""
    archive = subprocess.run(["git", "-C", REPO, "archive", rev], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
    for lib in glob.glob(os.path.join(REPO, "flowpm_mtf", "native", "lib*.so*")):
        shutil.copy2(lib, os.path.join(dest, "flowpm_mtf", "native"))


def plant(dest, path, text, replacement):
    full = os.path.join(dest, path)
    with open(full) as f:
        src = f.read()
    if src.count(text) != 1:
        raise SystemExit("planted_bugs: %s: the text to replace occurs %d times (expected 1)"
                         % (path, src.count(text)))
    with open(full, "w") as f:
        f.write(src.replace(text, replacement))


def failures(xml_path):
    """(ran, failing test ids) of one JUnit file."""
    if not os.path.exists(xml_path):
        return 0, ["<no results: %s>" % os.path.basename(xml_path)]
    ran, failed = 0, []
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        if case.find("skipped") is not None:
            continue
        ran += 1
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append("%s::%s" % (case.get("classname").split(".")[-1], case.get("name")))
    return ran, failed


def run_bug(rev, name, nps):
    path, text, replacement, files, what = BUGS[name]
    four = four_rank_files()
    out = {"bug": name, "what": what, "file": path, "rev": rev, "runs": []}
    with tempfile.TemporaryDirectory(prefix="planted_%s_" % name) as dest:
        extract(rev, dest)
        plant(dest, path, text, replacement)
        env = dict(os.environ, PYTHONPATH=dest, TF_CPP_MIN_LOG_LEVEL="2", OMP_NUM_THREADS="1",
                   FLOWPM_MTF_NATIVE="require", HOROVOD_STALL_CHECK_TIME_SECONDS="60",
                   PYTHONDONTWRITEBYTECODE="1")
        for np_ in nps:
            run_files = [f for f in files if np_ != 4 or f in four]
            if not run_files:
                continue
            logdir = os.path.join(dest, "logs%d" % np_)
            os.makedirs(logdir)
            env["FLOWPM_MTF_TEST_LOGDIR"] = logdir
            cmd = [sys.executable, "scripts/mpi_pytest.py"] + run_files + [
                "-q", "-p", "no:randomly", "--timeout", "600", "--timeout-method=thread"]
            if np_ > 1:
                cmd = ["mpirun", "--bind-to", "none", "--allow-run-as-root", "--oversubscribe",
                       "-np", str(np_)] + cmd
            t0 = time.time()
            subprocess.run(cmd, cwd=dest, env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=3000)
            ran, failed = failures(os.path.join(logdir, "np%d_rank0.xml" % np_))
            out["runs"].append({"ranks": np_, "files": run_files, "ran": ran,
                                "failed": failed, "seconds": round(time.time() - t0, 1)})
    out["caught"] = any(r["failed"] for r in out["runs"])
    return out


def markdown(results):
    lines = ["# Planted bugs and the tests that catch them", "",
             "Command: `python scripts/planted_bugs.py %s`" % " ".join(sys.argv[1:]), ""]
    for r in results:
        lines += ["## %s (revision %s): %s" % (r["bug"], r["rev"], r["what"]), "",
                  "`%s`; caught: **%s**" % (r["file"], "yes" if r["caught"] else "NO"), "",
                  "| ranks | tests run | failed | failing tests |", "|---|---|---|---|"]
        for run in r["runs"]:
            shown = ", ".join(run["failed"][:12]) + (" ..." if len(run["failed"]) > 12 else "")
            lines.append("| %d | %d | %d | %s |" % (run["ranks"], run["ran"], len(run["failed"]),
                                                     shown or "-"))
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("bugs", nargs="*", metavar="BUG",
                   help="bugs to plant (default: all): %s" % ", ".join(sorted(BUGS)))
    p.add_argument("--rev", default="HEAD", help="revision to plant them in (default HEAD)")
    p.add_argument("--ranks", default="1,2,4", help="rank counts (default 1,2,4)")
    p.add_argument("--out", help="markdown table to write")
    p.add_argument("--json", help="JSON record to write (appended to an existing list)")
    args = p.parse_args(argv)
    nps = [int(n) for n in args.ranks.split(",")]
    unknown = sorted(set(args.bugs) - set(BUGS))
    if unknown:
        p.error("unknown bug(s) %s; known: %s" % (", ".join(unknown), ", ".join(sorted(BUGS))))
    results = []
    for name in args.bugs or sorted(BUGS):
        r = run_bug(args.rev, name, nps)
        results.append(r)
        print("%-20s %-10s caught=%s %s" % (name, args.rev, r["caught"],
                                            [(x["ranks"], len(x["failed"]), x["ran"])
                                             for x in r["runs"]]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(markdown(results))
    if args.json:
        old = []
        if os.path.exists(args.json):
            with open(args.json) as f:
                old = json.load(f)
        with open(args.json, "w") as f:
            json.dump(old + results, f, indent=1)
    return 0 if all(r["caught"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
