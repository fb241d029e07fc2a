"""Issue item 5 through the command line: no input reaches an internal error.

Every case ends in one line ``flowpm-mtf: error: ...`` (printed once, by rank 0), the
documented exit code on every rank (2: configuration, 3: particle escape, 4: memory) and
no OUT directory: the checks run before the run directory is created and before any
large allocation. Each test starts its own ``flowpm-mtf`` processes (``mpirun -np 2``, or
one process), so they run in the 1-rank pass only.
"""
import re

import pytest

from flowpm_mtf.runs import preflight
from flowpm_mtf.config import SimConfig
from test_safety_cli import flowpm

pytestmark = pytest.mark.single_process

ERROR_LINE = re.compile(r"^flowpm-mtf: error: (.*)$", re.M)
# A refused case imports TensorFlow and stops in the preflight: seconds, minutes under load.
REFUSED_DEADLINE_S = 300


def refused(tmp_path, *args, code, pattern, np_=2, preflight_error=True):
    """Run ``flowpm-mtf ARGS --out OUT``; assert the one error line, the code, and (for an
    error of the checks before the run) that OUT was not created."""
    out = tmp_path / "OUT"
    proc = flowpm(*args, "--out", out, "--no-plot", np_=np_, timeout=REFUSED_DEADLINE_S)
    lines = ERROR_LINE.findall(proc.out)
    assert len(lines) == 1, proc.out[-4000:]
    assert "internal error" not in lines[0] and "Traceback" not in proc.out, proc.out[-4000:]
    assert re.search(pattern, lines[0]), lines[0]
    assert proc.returncode == code, (proc.returncode, proc.out[-3000:])
    if preflight_error:
        assert not out.exists(), "OUT was created before the check"
    return lines[0]


def _would_fit(conf, **kw):
    """Whether this machine could hold the estimate (then the case is not a refusal here)."""
    avail = preflight.memory_available()
    return avail is not None and preflight.estimate_peak_memory(conf, **kw) <= avail // 2


@pytest.mark.parametrize("nc", ["4194304", "100000000000", "2097152", "3000000000,3000000000,2"])
def test_sizes_beyond_int64_one_line_exit_2(tmp_path, nc):
    refused(tmp_path, "simulate", "--nc", nc, code=2,
            pattern=r"beyond the 2\^63-1 a TensorFlow shape can count.*use a smaller --nc")


@pytest.mark.parametrize("job", ["simulate", "reconstruct", "lensing", "fft-demo"])
def test_absurd_but_countable_sizes_one_line_exit_4(tmp_path, job):
    refused(tmp_path, job, "--nc", "65536", code=4,
            pattern=r"estimated peak memory .* exceeds .*no rank count")


def test_lensing_field_npix_100000_refused_with_a_field_npix(tmp_path):
    line = refused(tmp_path, "lensing", "--field-npix", "100000", code=4,
                   pattern=r"the lensing rays .*alone would take .*use --field-npix \d+ or less")
    assert int(re.search(r"--field-npix (\d+) or less", line).group(1)) < 100000


def test_lensing_maps_beyond_int64_exit_2(tmp_path):
    refused(tmp_path, "lensing", "--field-npix", "3037000500", code=2,
            pattern=r"convergence maps .*beyond the 2\^63-1.*--field-npix")


@pytest.mark.parametrize("nc", [1024, 2048])
def test_fft_demo_large_mesh_refused_before_allocating(tmp_path, nc):
    conf = SimConfig(nc=nc, dtype="float64", grid=(2, 1))
    if _would_fit(conf, masters=False, particles=False, extra=preflight.fft_demo_memory(conf)):
        pytest.skip("this machine holds a %d^3 FFT demo" % nc)
    refused(tmp_path, "fft-demo", "--nc", nc, code=4,
            pattern=r"the full-size numpy reference of every rank alone would take .*--nc \d+")


def test_capacity_1e11_advises_a_capacity_not_a_rank_count(tmp_path):
    line = refused(tmp_path, "simulate", "--capacity", "100000000000", code=4,
                   pattern=r"particle buffers .* alone would take .*use --capacity \d+ or less")
    assert "smallest rank count" not in line and "grid 1x1" not in line


def test_box_size_1e7_says_no_a_start_fixes_it(tmp_path):
    refused(tmp_path, "simulate", "--box-size", "1e7", code=2,
            pattern=r"no --a-start below a_end=1 resolves them.*use --dtype float64")


@pytest.mark.parametrize("args,np_", [(["--nc", "16", "--box-size", "64"], None),
                                      (["--nc", "32", "--box-size", "128", "--grid", "2x1"], 2),
                                      (["--nc", "16", "--box-size", "20", "--grid", "2x1"], 2)])
def test_lagrangian_halo_hint_followed_once_succeeds(tmp_path, args, np_):
    """The hint used to be 2h + 1 (1 -> 3 -> 7 ...): followed once it now gives a run whose
    particles stay in the halo. Where no halo surely suffices on the grid (16 cells on 2
    ranks), the hint is a grid whose blocks hold the halo (or the eulerian decomposition)."""
    common = ["simulate", *args, "--decomposition", "lagrangian", "--steps", "3"]
    line = refused(tmp_path, *common, "--halo", "1", code=3, np_=np_, preflight_error=False,
                   pattern=r"beyond the 1-cell halo.*(rerun with --halo \d+|no --halo surely "
                           r"suffices on this grid.*--decomposition eulerian)")
    m = re.search(r"rerun with --halo (\d+)", line)
    if m:
        rerun, ranks = ["--halo", m.group(1)], np_
    else:
        m = re.search(r"or on (\d+) ranks? with --grid (\d+x\d+) --halo (\d+)", line)
        assert m, line
        rerun = ["--grid", m.group(2), "--halo", m.group(3)]
        ranks = int(m.group(1)) if int(m.group(1)) > 1 else None
    i = common.index("--grid") if "--grid" in common else None
    if i is not None and "--grid" in rerun:
        del common[i:i + 2]
    proc = flowpm(*common, *rerun, "--no-plot", "--out", tmp_path / "RERUN", np_=ranks)
    assert proc.returncode == 0, proc.out[-3000:]
    assert not ERROR_LINE.search(proc.out)
