"""Issue item 5 through the command line: no input reaches an internal error.

Every case ends in one line ``flowpm-mtf: error: ...`` (printed once, by rank 0), the
documented exit code on every rank (2: configuration, 3: particle escape, 4: memory) and
no OUT directory: the checks run before the run directory is created and before any
large allocation.

The refusals run on 2 ranks in one MPI job (``refusals``: tests/mpi_scripts/cli_cases.py
runs the command line once per case, the start-up once for all), which reports every
rank's exit code and output per case; one case of each kind also runs as its own
``mpirun -np 2 flowpm-mtf`` (the process's exit code as the launcher sees it): sizes
beyond int64 here, the particle escape in the halo hint's test, the rank count in
tests/test_cli.py, memory in tests/test_safety_cli.py. The runs that follow a hint run in
the test's process (placement backend). The 1-rank pass only.
"""
import json
import os
import re
import types

import pytest

from flowpm_mtf.runs import preflight, rundir
from flowpm_mtf.config import SimConfig
from test_mpi_jobs import mpirun
from test_safety_cli import flowpm

pytestmark = pytest.mark.single_process

ERROR_LINE = re.compile(r"^flowpm-mtf: error: (.*)$", re.M)
# A refused case imports TensorFlow and stops in the preflight: seconds, minutes under load.
REFUSED_DEADLINE_S = 300
# The job of every refusal (one start-up, then a few seconds per case; more under load).
REFUSALS_DEADLINE_S = 900


def _would_fit(conf, **kw):
    """Whether this machine could hold the estimate (then the case is not a refusal here)."""
    avail = preflight.memory_available()
    return avail is not None and preflight.estimate_peak_memory(conf, **kw) <= avail // 2


def _fft_demo_fits(nc):
    conf = SimConfig(nc=nc, dtype="float64", grid=(2, 1))
    return _would_fit(conf, masters=False, particles=False, extra=preflight.fft_demo_memory(conf))


INT64_SIZES = ["4194304", "100000000000", "2097152", "3000000000,3000000000,2"]
JOBS = ["simulate", "reconstruct", "lensing", "fft-demo"]
FFT_DEMO_NC = [1024, 2048]
LAGRANGIAN = ["--decomposition", "lagrangian", "--steps", "3"]
# How each halo-hint case's first run (the escape) is started: in this process (one
# block), in the refusals' job, or as its own mpirun (the escape's end-to-end launch).
HINT_CASES = {
    "one_block": (["--nc", "16", "--box-size", "64"], None, "here"),
    "two_blocks": (["--nc", "32", "--box-size", "128", "--grid", "2x1"], 2, "refusals"),
    "no_halo_fits": (["--nc", "16", "--box-size", "20", "--grid", "2x1"], 2, "mpirun"),
}
ESCAPE_PATTERN = (r"beyond the 1-cell halo.*(rerun with --halo \d+|no --halo surely "
                  r"suffices on this grid.*--decomposition eulerian)")
END_TO_END_INT64 = INT64_SIZES[0]   # its own mpirun; the others in the refusals' job


def _refusal_cases():
    """Name -> argv (without --out) of every case of the refusals' job."""
    cases = {"int64-%s" % nc: ["simulate", "--nc", nc] for nc in INT64_SIZES
             if nc != END_TO_END_INT64}
    cases.update({"absurd-%s" % job: [job, "--nc", "65536"] for job in JOBS})
    cases["field_npix"] = ["lensing", "--field-npix", "100000"]
    cases["maps_int64"] = ["lensing", "--field-npix", "3037000500"]
    cases.update({"fft_demo-%d" % nc: ["fft-demo", "--nc", str(nc)] for nc in FFT_DEMO_NC
                  if not _fft_demo_fits(nc)})
    cases["capacity"] = ["simulate", "--capacity", "100000000000"]
    cases["box_1e7"] = ["simulate", "--box-size", "1e7"]
    cases["hint-two_blocks"] = ["simulate", *HINT_CASES["two_blocks"][0], *LAGRANGIAN,
                                "--halo", "1"]
    cases["placement_under_mpi"] = ["simulate", "--nc", "16", "--halo", "2", "--steps", "2",
                                    "--backend", "placement"]
    cases["repeats_0"] = ["fft-demo", "--nc", "16", "--halo", "2", "--repeats", "0"]
    cases["a_start_1e-10"] = ["simulate", "--nc", "16", "--halo", "2", "--steps", "2",
                              "--a-start", "1e-10"]
    cases["config_typo"] = ["simulate", "--config", "TYPO.json"]   # written by the fixture
    cases["resume_empty"] = ["simulate", "--resume", "EMPTY"]      # an empty directory
    # PGD's alpha by the cell size: 16 Mpc/h cells are outside the fits
    cases["pgd_cells"] = ["lensing", "--nc", "16", "--box-size", "256", "--pgd"]
    return cases


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    """Name -> (result, OUT) of every refusal, run in one 2-rank job."""
    base = tmp_path_factory.mktemp("refusals")
    typo = base / "typo.json"
    typo.write_text(json.dumps({"cosmology": {"Omega_cc": 1}}))
    empty = base / "empty"
    empty.mkdir()
    names, cases = [], []
    for name, argv in _refusal_cases().items():
        argv = [{"TYPO.json": str(typo), "EMPTY": str(empty)}.get(a, a) for a in argv]
        if "--resume" not in argv:   # a resumed run writes where it resumes
            argv += ["--out", str(base / name)]
        names.append(name)
        cases.append({"argv": argv + ["--no-plot"]})
    (base / "cases.json").write_text(json.dumps(cases))
    proc, _ = mpirun(2, "cli_cases.py", base / "cases.json", base / "results.json",
                     timeout=REFUSALS_DEADLINE_S)
    assert proc.returncode == 0 and (base / "results.json").exists(), \
        (proc.stdout + proc.stderr)[-6000:]
    results = json.loads((base / "results.json").read_text())
    return {name: (types.SimpleNamespace(codes=r["codes"], out="\n".join(r["err"])),
                   base / name) for name, r in zip(names, results)}


def check(proc, code, pattern, out=None):
    """One error line (no internal error, no traceback) matching ``pattern``, exit code
    ``code`` (on every rank: ``proc.codes``, or the launcher's ``proc.returncode``) and, if
    ``out`` is given, no OUT. Returns the line."""
    lines = ERROR_LINE.findall(proc.out)
    assert len(lines) == 1, proc.out[-4000:]
    assert "internal error" not in lines[0] and "Traceback" not in proc.out, proc.out[-4000:]
    assert re.search(pattern, lines[0]), lines[0]
    codes = getattr(proc, "codes", None) or [proc.returncode]
    assert codes == [code] * len(codes), (codes, proc.out[-3000:])
    if out is not None:
        assert not out.exists(), "OUT was created before the check"
    return lines[0]


def refused(refusals, name, code, pattern):
    """The refusals' job's case ``name``: :func:`check`, OUT not created."""
    proc, out = refusals[name]
    assert len(proc.codes) == 2
    return check(proc, code, pattern, out)


INT64_PATTERN = r"beyond the 2\^63-1 a TensorFlow shape can count.*use a smaller --nc"


@pytest.mark.parametrize("nc", INT64_SIZES)
def test_sizes_beyond_int64_one_line_exit_2(refusals, tmp_path, nc):
    if nc != END_TO_END_INT64:
        refused(refusals, "int64-%s" % nc, 2, INT64_PATTERN)
        return
    out = tmp_path / "OUT"
    proc = flowpm("simulate", "--nc", nc, "--out", out, "--no-plot", np_=2,
                  timeout=REFUSED_DEADLINE_S)
    check(proc, 2, INT64_PATTERN, out)


@pytest.mark.parametrize("job", JOBS)
def test_absurd_but_countable_sizes_one_line_exit_4(refusals, job):
    refused(refusals, "absurd-%s" % job, 4, r"estimated peak memory .* exceeds .*no rank count")


def test_lensing_field_npix_100000_refused_with_a_field_npix(refusals):
    line = refused(refusals, "field_npix", 4,
                   r"the lensing rays .*alone would take .*use --field-npix \d+ or less")
    assert int(re.search(r"--field-npix (\d+) or less", line).group(1)) < 100000


def test_lensing_maps_beyond_int64_exit_2(refusals):
    refused(refusals, "maps_int64", 2, r"convergence maps .*beyond the 2\^63-1.*--field-npix")


@pytest.mark.parametrize("nc", FFT_DEMO_NC)
def test_fft_demo_large_mesh_refused_before_allocating(refusals, nc):
    if _fft_demo_fits(nc):
        pytest.skip("this machine holds a %d^3 FFT demo" % nc)
    refused(refusals, "fft_demo-%d" % nc, 4,
            r"the full-size numpy reference of every rank alone would take .*--nc \d+")


def test_capacity_1e11_advises_a_capacity_not_a_rank_count(refusals):
    line = refused(refusals, "capacity", 4,
                   r"particle buffers .* alone would take .*use --capacity \d+ or less")
    assert "smallest rank count" not in line and "grid 1x1" not in line


def test_box_size_1e7_says_no_a_start_fixes_it(refusals):
    refused(refusals, "box_1e7", 2,
            r"no --a-start below a_end=1 resolves them.*use --dtype float64")


def test_placement_backend_refused_under_mpi(refusals):
    refused(refusals, "placement_under_mpi", 2,
            r"--backend placement runs the whole mesh in one process")


def test_user_errors_one_line(refusals):
    refused(refusals, "repeats_0", 2, r"repeats must be an integer >= 1, got 0")
    refused(refusals, "a_start_1e-10", 2,
            r"a_start=1e-10 is below what float32 resolves.*--a-start >= ")


def test_pgd_without_a_fit_for_the_cells_one_line_exit_2(refusals):
    refused(refusals, "pgd_cells", 2, r"PGD's alpha is fitted for cells of [\d.]+-[\d.]+ "
                                      r"Mpc/h, this run's are 16 Mpc/h: give --pgd-alpha0")


def test_config_file_typo_one_line_exit_2(refusals):
    """A --config key refused on every rank (the messages of every key: tests/test_inputs.py)."""
    refused(refusals, "config_typo", 2,
            r"unknown cosmology key 'Omega_cc' \(did you mean 'Omega_c'\?\)")


def test_resume_without_checkpoint_is_one_clear_error_on_every_rank(refusals):
    """The other refusals of --resume: tests/test_restart.py."""
    proc, _ = refusals["resume_empty"]
    assert len(proc.codes) == 2
    check(proc, 6, r"no valid checkpoint")   # ResumeError


def _here(capsys, *args):
    """``flowpm-mtf ARGS`` in this process (placement backend), like :func:`flowpm`'s result."""
    from flowpm_mtf import cli

    capsys.readouterr()
    code = cli.main([str(a) for a in args] + ["--backend", "placement"])
    cap = capsys.readouterr()
    return types.SimpleNamespace(returncode=code, out=cap.out + cap.err)


@pytest.mark.parametrize("case", list(HINT_CASES))
def test_lagrangian_halo_hint_followed_once_succeeds(refusals, tmp_path, capsys, case):
    """The hint used to be 2h + 1 (1 -> 3 -> 7 ...): followed once it now gives a run whose
    particles stay in the halo. Where no halo surely suffices on the grid (16 cells on 2
    ranks), the hint is a grid whose blocks hold the halo (or the eulerian decomposition).
    The escaped run leaves no run and nothing else in OUT."""
    args, np_, how = HINT_CASES[case]
    common = ["simulate", *args, *LAGRANGIAN]
    if how == "refusals":
        proc, out = refusals["hint-" + case]
    else:
        out = tmp_path / "OUT"
        first = [*common, "--halo", "1", "--no-plot", "--out", out]
        proc = flowpm(*first, np_=np_, timeout=REFUSED_DEADLINE_S) if how == "mpirun" else \
            _here(capsys, *first, "--grid", "1x1")
    line = check(proc, 3, ESCAPE_PATTERN)
    assert rundir.read_manifest(out) is None
    assert os.listdir(out) == []  # no staging or lock left
    m = re.search(r"rerun with --halo (\d+)", line)
    if m:
        rerun = ["--halo", m.group(1)] + ([] if "--grid" in common else ["--grid", "1x1"])
    else:
        m = re.search(r"or on (\d+) ranks? with --grid (\d+x\d+) --halo (\d+)", line)
        assert m, line
        rerun = ["--grid", m.group(2), "--halo", m.group(3)]
        if "--grid" in common:
            i = common.index("--grid")
            del common[i:i + 2]
    # in this process: the placement backend runs the grid the hint names
    proc = _here(capsys, *common, *rerun, "--no-plot", "--out", tmp_path / "RERUN")
    assert proc.returncode == 0, proc.out[-3000:]
    assert not ERROR_LINE.search(proc.out)
