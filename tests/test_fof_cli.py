"""``flowpm-mtf simulate --fof`` on 2 ranks: the catalogues of the final state and of a
``--snapshots`` time equal the serial reference FoF of the run's own snapshots, member for
member; the manifest lists them; ``flowpm-mtf halos`` on the run's snapshot finds the same
catalogue; bad FoF options are one line before the compute.

The run and the ``halos`` job on its snapshot are two commands of one 2-rank MPI job
(tests/mpi_scripts/cli_cases.py: one TensorFlow and Horovod start-up per rank for both)."""
import json
import os

import numpy as np
import pytest

from flowpm_mtf.analysis import fof
from flowpm_mtf.runs import halos as halos_io
from flowpm_mtf.runs import snapshot
from test_mpi_jobs import mpirun
from test_fof import reference_catalogue, reference_labels
from test_inputs import assert_config_error, run_cli

NC, BOX, MIN = 16, 16.0, 5
ARGS = ["simulate", "--nc", str(NC), "--box-size", str(BOX), "--steps", "4", "--halo", "4",
        "--seed", "3", "--dtype", "float64", "--no-plot", "--fof", "--fof-min", str(MIN),
        "--fof-members", "--snapshots", "0.6"]
# float64 sums in another order than numpy's (partial sums per rank): round-off only
POS_ATOL = 1e-9            # [Mpc/h], positions ~ 1e1
VEL_ATOL = 1e-8            # [km/s], velocities ~ 1e2
# hvd against placement: the same graph, float64, only the order of sums differs
# (tests/test_simulate.py's BACKEND_POS_ATOL)
BACKEND_POS_ATOL = 1e-8    # [Mpc/h]
MASS_RTOL = 1e-14          # n x the particle mass, computed alike: one rounding at most


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """``simulate`` then ``halos`` on its snapshot, in turn in one 2-rank job: the run's
    folder, the ``halos`` job's folder and, per command, every rank's exit code and output."""
    base = str(tmp_path_factory.mktemp("fofcli"))
    out, halos_out = os.path.join(base, "run"), os.path.join(base, "halos")
    cases = [ARGS + ["--out", out],
             ["halos", "--snapshot", out, "--fof-min", str(MIN), "--fof-members",
              "--out", halos_out]]
    with open(os.path.join(base, "cases.json"), "w") as f:
        json.dump([{"argv": argv} for argv in cases], f)
    results = os.path.join(base, "results.json")
    proc, _ = mpirun(2, "cli_cases.py", os.path.join(base, "cases.json"), results, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    with open(results) as f:
        simulate, halos = json.load(f)
    return out, halos_out, simulate, halos


@pytest.fixture(scope="module")
def run_dir(job):
    out, _, simulate, _ = job
    assert simulate["codes"] == [0, 0], simulate["err"][0][-4000:]
    return out


def check_against_reference(out, name, snap_name, a):
    snap = snapshot.read_snapshot(os.path.join(out, snap_name))
    cat = halos_io.read_halos(os.path.join(out, name))
    pos, vel, ids = snap["position"], snap["velocity"], snap["id"]
    ll = 0.2 * fof.mean_separation(BOX, NC**3)
    labels = reference_labels(pos, ids, BOX, ll)
    ref = reference_catalogue(pos, vel, ids, labels, BOX, MIN)
    assert len(ref["n"]) >= 3, "no clustering to test: %d halos" % len(ref["n"])
    np.testing.assert_array_equal(cat["min_id"], ref["min_id"])
    np.testing.assert_array_equal(cat["n"], ref["n"])
    mass = fof.particle_mass(cat["config"]["cosmology"]["Omega_c"]
                             + cat["config"]["cosmology"]["Omega_b"], BOX, NC**3)
    np.testing.assert_allclose(cat["mass"], ref["n"] * mass, rtol=MASS_RTOL)
    d = cat["position"] - ref["position"]
    d -= BOX * np.round(d / BOX)
    assert np.abs(d).max() < POS_ATOL
    np.testing.assert_allclose(cat["velocity"], ref["velocity"], atol=VEL_ATOL)
    np.testing.assert_allclose(cat["sigma_v"], ref["sigma_v"], atol=VEL_ATOL)
    np.testing.assert_array_equal(cat["member_id"], np.concatenate(ref["members"]))
    attrs = cat["attrs"]
    assert attrs["format"] == halos_io.HALOS_FORMAT and attrs["n_halos"] == len(ref["n"])
    assert abs(attrs["a"] - a) < 1e-12 and attrs["fof_b"] == 0.2
    assert attrs["fof_min_members"] == MIN and abs(attrs["linking_length"] - ll) < 1e-12
    return len(ref["n"])


@pytest.mark.single_process
def test_final_catalogue_equals_the_reference_fof_of_the_snapshot(run_dir):
    check_against_reference(run_dir, "halos.h5", "snapshot.h5", 1.0)


@pytest.mark.single_process
def test_snapshot_time_catalogue_equals_the_reference(run_dir):
    check_against_reference(run_dir, "halos_a0.6000.h5", "snapshot_a0.6000.h5", 0.6)


@pytest.mark.single_process
def test_manifest_and_summary_list_the_catalogues(run_dir):
    with open(os.path.join(run_dir, "manifest.json")) as f:
        files = {e["path"] for e in json.load(f)["files"]}
    for name in ("halos.h5", "halos_a0.6000.h5"):
        stem = name[:-3]
        assert name in files and stem + ".parts/rank00000.h5" in files
        assert stem + ".parts/rank00001.h5" in files
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    assert [r["file"] for r in summary["halos"]] == ["halos_a0.6000.h5", "halos.h5"]
    assert summary["simulate"]["fof"] is True and summary["timings"]["fof_s"] > 0


@pytest.mark.rank_independent
@pytest.mark.parametrize("argv, pattern", [
    (["--fof-b", "0"], r"--fof-b: .*positive fraction .* got 0\.0"),
    (["--fof-b", "-0.2"], r"--fof-b: .*got -0\.2"),
    (["--fof-min", "0"], r"--fof-min: .*integer >= 1.*got 0"),
])
def test_bad_fof_options_are_one_line(argv, pattern, capsys, tmp_path):
    code, lines, _ = run_cli(["simulate", "--fof", *argv, "--out", str(tmp_path)], capsys)
    assert_config_error(code, lines, pattern)


@pytest.mark.single_process
def test_halos_job_on_the_runs_snapshot_equals_simulate_fof(run_dir, job):
    """``flowpm-mtf halos`` on 2 ranks (each reading a share of the snapshot) finds the
    catalogue that ``simulate --fof`` found in the run."""
    _, out, _, halos = job
    assert halos["codes"] == [0, 0], halos["err"][0][-4000:]
    a = halos_io.read_halos(os.path.join(run_dir, "halos.h5"))
    b = halos_io.read_halos(os.path.join(out, "halos.h5"))
    for name in ("n", "min_id", "member_id", "mass"):
        np.testing.assert_array_equal(a[name], b[name])
    np.testing.assert_allclose(a["position"], b["position"], atol=POS_ATOL)
    np.testing.assert_allclose(a["velocity"], b["velocity"], atol=VEL_ATOL)
    np.testing.assert_allclose(a["sigma_v"], b["sigma_v"], atol=VEL_ATOL)
    assert b["attrs"]["a"] == 1.0 and b["attrs"]["n_halos"] == len(a["n"])
    with open(os.path.join(out, "manifest.json")) as f:
        assert "halos.h5" in {e["path"] for e in json.load(f)["files"]}


@pytest.mark.rank_independent
def test_halos_job_without_a_snapshot_is_one_line(capsys, tmp_path):
    from flowpm_mtf import cli

    empty, out = tmp_path / "nosnap", tmp_path / "out"
    empty.mkdir()
    out.mkdir()
    empty = str(empty)
    code = cli.main(["halos", "--snapshot", empty, "--backend", "placement", "--out", str(out)])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("flowpm-mtf: error: ")]
    assert code == 2 and len(errors) == 1, lines
    assert "holds no snapshot" in errors[0] and empty in errors[0]


@pytest.mark.single_process
def test_placement_backend_finds_the_same_halos(run_dir, tmp_path):
    """The same run on PlacementMeshImpl (one process holding both blocks: the finder runs on
    one block of the whole box) finds the hvd run's halos."""
    from flowpm_mtf import cli

    out = str(tmp_path)
    assert cli.main([*ARGS, "--backend", "placement", "--grid", "2x1", "--out", out]) == 0
    a = halos_io.read_halos(os.path.join(run_dir, "halos.h5"))
    b = halos_io.read_halos(os.path.join(out, "halos.h5"))
    for name in ("n", "min_id", "member_id"):
        np.testing.assert_array_equal(a[name], b[name])
    # the two backends' particles differ by the order of float64 sums only
    np.testing.assert_allclose(a["position"], b["position"], atol=BACKEND_POS_ATOL)
