"""The linear power of a run from a table or from CAMB (flowpm_mtf.physics.linear_power_source).

* bad tables (every rule of :func:`read_power_table`, a k range short of the mesh's or of
  the sigma8 integral's): one line, before compute; on 2 ranks every rank raises the same
  error and only rank 0 reads the file;
* the normalisation (sigma8, none with the run's growth) and the digest a resume checks:
  a run stopped after a checkpoint whose table file then changed is refused on --resume;
* the run's growth D1(z)^2 against CAMB's P(k, z) / P(k, 0) at linear k (the stored CAMB
  table of tests/data, and CAMB itself when installed);
* the ICs' measured P(k) (an ensemble of seeds) against a table of another shape than the
  Eisenstein & Hu fit, on the first process grid of the world size; a table of the EH fit gives
  the EH path's field to interpolation round-off;
* ModelGradient refuses cosmology parameters with a table, and gives the noise's gradient
  through the table's amplitude without them;
* ``simulate --linear-power FILE`` and ``--boltzmann camb`` on 2 ranks (one MPI job,
  tests/mpi_scripts/cli_cases.py) and their refusals.
"""
import json
import os
import re
import types

import numpy as np
import pytest

from flowpm_mtf.backend import SerialComm
from flowpm_mtf.config import Cosmology, SimConfig
from flowpm_mtf.errors import ConfigError, ResumeError
from flowpm_mtf.physics import cosmology as cm
from flowpm_mtf.physics import linear_power, linear_power_source as lps

HERE = os.path.dirname(os.path.abspath(__file__))
CAMB_FILE = os.path.join(HERE, "data", "halofit_camb.txt")   # CAMB 2.0.5, Planck 2015

# The run's growth (no radiation: cosmology.D1) against CAMB's P(k, z)/P(k, 0) at linear,
# sub-horizon k (1e-3 .. 0.1 h/Mpc), Planck 2015, massless neutrinos: CAMB's radiation
# (photons and 3.046 massless neutrinos, Omega_r ~ 9e-5, which also lowers CAMB's
# Omega_Lambda) changes the growth slightly: CAMB's ratio is above D1^2 by 1.7e-4 at
# z = 1, 5e-5 at z = 0.5 (measured); 5e-4 leaves room and still fails for a z off by
# 4e-4 (d ln D1^2 / dz ~ -1.1 at z = 1).
GROWTH_RTOL = 5e-4
GROWTH_K = (1e-3, 0.1)
# sigma(8 Mpc/h) of a table over SIGMA8_K_RANGE against the converged integral of the EH
# fit: the range misses 1.4e-5 of sigma8^2; the Simpson grid is converged to 1e-9.
SIGMA8_RTOL = 2e-5
# CAMB's own sigma8 (integrated on its transfer functions' k grid, default accuracy)
# against ours on its table (200 points a decade, SIGMA8_RTOL): they differ by 3.5e-4 in
# sigma8^2 (measured, Planck 2015); 1e-3 still catches a wrong window or k unit.
SIGMA8_CAMB_RTOL = 1e-3
# The ICs' P(k) against the table: per mode, |delta_k|^2 V / P(|k|) is an exponential
# deviate of mean 1 (a Gaussian field). The mean over the N independent modes of the
# ensemble (4 seeds x 1792 modes of 16^3) has sd 1/sqrt(N) = 1.2%: MEAN_SD of them
# (deterministic seeds: the test is not flaky; the amplitude bugs it is for, a factor of
# N, V, 2 pi or a growth D1(a), are far beyond). Per shell, the reduced chi^2 of the 12
# shell means (each of sd 1/sqrt(n_shell)) has sd ~0.4: 0.4 .. 1.8 is ~2 sd, and the
# table's +-30% wiggle (what the EH fit lacks) would give chi^2 of hundreds.
MEAN_SD = 3.0
CHI2_MIN, CHI2_MAX = 0.4, 1.8
SEEDS = (1, 2, 3, 4)
# A table of the EH fit at 20000 log-spaced k on 1e-3 .. 10 h/Mpc (step 4.6e-4 in ln k):
# log-log interpolation errs by ~(dlnk)^2/8 x the curvature of ln P (<= ~10 at the
# baryon wiggles) ~ 3e-7 in P, half of that in the field's amplitude; float64 elsewhere.
EH_TABLE_RTOL = 1e-6
EH_TABLE_N = 20000
# CAMB's linear P at z = 0 computed here against the stored CAMB table (same CAMB
# version and cosmology, sigma8-normalised by CAMB there and by us here, log-log
# interpolation between CAMB's points): the normalisations differ by the sigma8
# integral's 1e-5; CAMB's own interpolation and accuracy settings by ~1e-4.
CAMB_RTOL = 2e-3

CONF = SimConfig(nc=16, box_size=100.0, halo_size=1, dtype="float64")


def write_table(path, k, pk, header="k [h/Mpc]  P [(Mpc/h)^3]"):
    np.savetxt(path, np.column_stack([k, pk]), header=header)
    return str(path)


def camb_z0():
    d = np.loadtxt(CAMB_FILE)
    return d[:, 0], d[:, 1]


# ----------------------------------------------------------------------------- bad input
BAD_TABLES = {
    "k_zero": ("0 1\n0.1 2\n", r"line 1: k = 0; k must be positive"),
    "k_negative": ("# c\n0.1 1\n-0.2 2\n", r"line 3: k = -0.2; k must be positive"),
    "p_zero": ("0.1 1\n0.2 0\n", r"line 2: P\(k\) = 0; P\(k\) must be positive"),
    "p_negative": ("0.1 -1\n0.2 1\n", r"line 1: P\(k\) = -1; P\(k\) must be positive"),
    "k_nan": ("0.1 1\nnan 2\n", r"line 2: k = nan; k and P\(k\) must be finite"),
    "p_inf": ("0.1 1\n0.2 inf\n", r"line 2: P\(k\) = inf; k and P\(k\) must be finite"),
    "unsorted": ("0.1 1\n0.3 1\n0.2 1\n", r"line 3: k = 0.2 after k = 0.3 on line 2; k must "
                                          r"increase strictly.*unsorted or repeated"),
    "duplicate": ("0.1 1\n0.2 1\n0.2 1\n", r"line 3: k = 0.2 after k = 0.2 on line 2"),
    "three_columns": ("0.1 1 3\n", r"line 1 has 3 columns, expected 2"),
    "not_a_number": ("0.1 1\n0.2 x\n", r"line 2: 'x' is not a number"),
    "one_row": ("# only\n0.1 1\n", r"1 row\(s\) of k, P\(k\); a table needs at least 2"),
}


@pytest.mark.rank_independent
@pytest.mark.parametrize("name", sorted(BAD_TABLES))
def test_bad_table_one_line(tmp_path, name):
    text, pattern = BAD_TABLES[name]
    path = tmp_path / "pk.txt"
    path.write_text(text)
    opts = lps.LinearPowerOptions(linear_power=str(path))
    with pytest.raises(ConfigError) as e:
        lps.resolve(opts, CONF, SerialComm())
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("linear_power=%s: " % path), msg
    assert re.search(pattern, msg), msg


@pytest.mark.rank_independent
def test_missing_file_and_short_ranges(tmp_path):
    opts = lps.LinearPowerOptions(linear_power=str(tmp_path / "none.txt"))
    with pytest.raises(ConfigError, match=r"cannot read a table of k, P\(k\): No such file"):
        lps.resolve(opts, CONF, SerialComm())
    k_min, k_max = lps.k_range(CONF)
    assert (k_min, k_max) == pytest.approx((2 * np.pi / 100, np.sqrt(3) * np.pi / 6.25))
    k = np.geomspace(1e-3, 0.99 * k_max, 50)      # short of the Nyquist corner
    path = write_table(tmp_path / "short.txt", k, linear_power.linear_matter_power(
        CONF.cosmology, k))
    with pytest.raises(ConfigError, match=r"the table covers k in \[0.001, 0.\d+\] h/Mpc but "
                       r"the mesh nc=16x16x16 in box 100x100x100 Mpc/h needs \[0.0628319, "
                       r"0.870\d+\] h/Mpc.*extend the table"):
        lps.resolve(lps.LinearPowerOptions(linear_power=path, linear_power_norm="none"), CONF,
                    SerialComm())
    k = np.geomspace(0.01, 10.0, 50)              # covers the mesh, not the sigma8 integral
    path = write_table(tmp_path / "narrow.txt", k, linear_power.linear_matter_power(
        CONF.cosmology, k))
    with pytest.raises(ConfigError, match=r"normalising it to sigma8 needs k in \[0.002, 4\].*"
                       r"linear_power_norm none"):
        lps.resolve(lps.LinearPowerOptions(linear_power=path), CONF, SerialComm())
    lps.resolve(lps.LinearPowerOptions(linear_power=path, linear_power_norm="none"), CONF,
                SerialComm())   # taken as it is: fine


@pytest.mark.rank_independent
def test_options_refuse_contradictions():
    for kw, pattern in (({"linear_power": "a", "boltzmann": "camb"}, "not both"),
                        ({"boltzmann": "camb", "linear_power_norm": "none"},
                         "applies to a linear_power table"),
                        ({"boltzmann": "camb", "linear_power_z": 1.0},
                         "applies to a linear_power table"),
                        ({"linear_power_z": 1.0}, "applies to a linear_power table"),
                        ({"linear_power": "a", "linear_power_z": -1.0}, "redshift"),
                        ({"linear_power_digest": "sha256:0"}, "without a table"),
                        ({"boltzmann": "class"}, "boltzmann must be one of none, camb")):
        with pytest.raises(ValueError, match=pattern):
            lps.LinearPowerOptions(**kw)


def test_every_rank_raises_rank0_reads(tmp_path, monkeypatch):
    """A bad table: the same one line on every rank; only rank 0 reads the file (the
    others would fail if they tried)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    path = comm.bcast(str(tmp_path / "bad.txt") if comm.rank == 0 else None, root=0)
    if comm.rank == 0:
        with open(path, "w") as f:
            f.write("0.1 1\n0.05 2\n")
    comm.barrier()
    if comm.rank != 0:
        monkeypatch.setattr(lps, "read_power_table", lambda p: 1 / 0)
    with pytest.raises(ConfigError) as e:
        lps.resolve(lps.LinearPowerOptions(linear_power=path), CONF, comm)
    msgs = comm.allgather(str(e.value))
    assert len(set(msgs)) == 1 and "line 2: k = 0.05 after k = 0.1" in msgs[0], msgs


# ----------------------------------------------------------------------------- normalisation
@pytest.mark.rank_independent
def test_normalisation_and_digest(tmp_path):
    c = CONF.cosmology
    table = linear_power.linear_power_table(c, 1e-4, 1e2, n=4096)
    assert lps.sigma8_of_table(table) == pytest.approx(c.sigma8, rel=SIGMA8_RTOL)
    # a table at z = 1, 3x too high: sigma8 -> the fit; none -> 3 x the fit at a = 1
    d2 = float(cm.D1(c, 0.5))**2
    path = write_table(tmp_path / "z1.txt", table.k, 3 * d2 * table.pk)
    for norm, want in (("sigma8", 1.0), ("none", 3.0)):
        lp = lps.resolve(lps.LinearPowerOptions(linear_power=path, linear_power_z=1.0,
                                                linear_power_norm=norm), CONF, SerialComm())
        np.testing.assert_allclose(lp.table.pk, want * table.pk,
                                   rtol=SIGMA8_RTOL if norm == "sigma8" else 1e-12)
        assert lp.digest == lps.file_digest(path) and lp.digest.startswith("sha256:")
        assert lp.record["norm"] == norm and lp.record["rows"] == table.k.size
    # a given digest is checked: another table is refused (a resume: ResumeError)
    opts = lps.LinearPowerOptions(linear_power=path, linear_power_digest="sha256:00")
    with pytest.raises(ConfigError, match="the table is sha256:[0-9a-f]{64} but the run asks"):
        lps.resolve(opts, CONF, SerialComm())
    with pytest.raises(ResumeError, match="the run that wrote the checkpoint used sha256:00"):
        lps.resolve(opts, CONF, SerialComm(), resume=True)


@pytest.mark.rank_independent
def test_checkpoint_identity_records_the_table():
    """The digest is part of the state config: another table, another config hash."""
    from flowpm_mtf.runs import checkpoint

    def ident(digest):
        configs = {"config": CONF, "linear_power": lps.LinearPowerOptions(
            linear_power="pk.txt", linear_power_digest=digest)}
        return checkpoint.identity("simulate", configs, [0.1, 1.0],
                                   sections={"linear_power": ()})

    a, b = ident("sha256:aa"), ident("sha256:bb")
    assert a["config_hash"] != b["config_hash"]
    why = checkpoint.check_identity({**a, "format": checkpoint.FORMAT}, b, "ckpt")
    assert "config differs: linear_power.linear_power_digest" in why, why


# ----------------------------------------------------------------------------- growth
@pytest.mark.rank_independent
def test_growth_against_camb_table():
    """The run's D1(z)^2 against the stored CAMB P(k, z) / P(k, 0) at linear k."""
    d = np.loadtxt(CAMB_FILE)
    k = d[:, 0]
    sel = (k >= GROWTH_K[0]) & (k <= GROWTH_K[1])
    for z, col in ((0.5, 3), (1.0, 5)):
        ratio = d[sel, col] / d[sel, 1]
        d2 = float(cm.D1(Cosmology(), 1.0 / (1.0 + z)))**2
        np.testing.assert_allclose(ratio, d2, rtol=GROWTH_RTOL, err_msg="z=%g" % z)


@pytest.mark.rank_independent
def test_camb_in_process():
    """--boltzmann camb's table: its growth against the run's, its z = 0 power against
    the stored CAMB table, its normalisation to sigma8."""
    pytest.importorskip("camb", reason="camb is not installed (requirements.txt)")
    c = Cosmology()
    k, rows, info = lps.camb_table(c, 0.03, 2.0, z=[0.0, 1.0])
    assert k[0] <= lps.SIGMA8_K_RANGE[0] and k[-1] >= lps.SIGMA8_K_RANGE[1]
    sel = (k >= GROWTH_K[0]) & (k <= GROWTH_K[1])
    np.testing.assert_allclose(rows[1, sel] / rows[0, sel], float(cm.D1(c, 0.5))**2,
                               rtol=GROWTH_RTOL)
    table, factor = lps.normalise(linear_power.PowerTable(k, rows[0]), c)
    assert factor == pytest.approx((c.sigma8 / info["sigma8_camb"])**2, rel=SIGMA8_CAMB_RTOL)
    ks, ps = camb_z0()
    inside = (ks >= k[0]) & (ks <= k[-1])
    np.testing.assert_allclose(table(ks[inside]), ps[inside], rtol=CAMB_RTOL)
    lp = lps.resolve(lps.LinearPowerOptions(boltzmann="camb"), CONF, SerialComm())
    assert lp.digest == "camb %s" % info["camb_version"]
    assert lp.record["A_s"] == pytest.approx(2.1e-9 * lp.record["factor"])


# ----------------------------------------------------------------------------- the ICs
@pytest.fixture(scope="module")
def tf_harness():
    import fpm_harness as H
    return H


def _fields(H, case, conf, power):
    """The linear fields of SEEDS on ``case``'s grid (one graph per seed)."""
    from flowpm_mtf.physics import ics

    out = []
    for seed in SEEDS:
        c = conf.replace(seed=seed, grid=case[1])
        out.append(H.run(case[0], c, lambda mesh: {"d": ics.linear_field(c, mesh, power)})["d"])
    return out


def _ratios(conf, fields, pk):
    """Per independent mode (rfft, 0 < kz < Nyquist) |delta_k|^2 V / P(|k|), and |k|."""
    n, L = conf.nc[0], conf.box_size[0]
    kx = 2 * np.pi * np.fft.fftfreq(n, L / n)
    kz = 2 * np.pi * np.fft.rfftfreq(n, L / n)
    kk = np.sqrt(kx[:, None, None]**2 + kx[None, :, None]**2 + kz[None, None, :]**2)
    sl = (slice(None), slice(None), slice(1, n // 2))
    kk = kk[sl]
    r = [np.abs(np.fft.rfftn(f)[sl] / f.size)**2 * L**3 / pk(kk) for f in fields]
    return kk, np.stack(r)


def test_ics_power_matches_table(tmp_path, tf_harness):
    """The ensemble's P(k) against a table of CAMB's shape, taken as it is (the first
    hvd grid of the world size: 1x1, 2x1; the field's grid independence is
    tests/test_ics.py's)."""
    H = tf_harness
    case = H.cases()[0]
    conf = SimConfig(nc=16, box_size=100.0, halo_size=1, dtype="float64")
    ks, ps = camb_z0()
    ps = ps * (1 + 0.3 * np.sin(np.log(ks) * 3))   # not any fit's shape: the table is used
    path = comm_path(tmp_path, "camb_like.txt", ks, ps)
    lp = lps.resolve(lps.LinearPowerOptions(linear_power=path, linear_power_norm="none"), conf,
                     comm_world())
    kk, r = _ratios(conf, _fields(H, case, conf, lp.table), lp.table)
    n_modes = r.size
    assert abs(r.mean() - 1) < MEAN_SD / np.sqrt(n_modes), (r.mean(), n_modes)
    edges = np.linspace(kk.min(), kk.max() * (1 + 1e-9), 13)
    idx = np.digitize(kk, edges) - 1
    chi2 = []
    for b in range(len(edges) - 1):
        sel = r[:, idx == b]
        if sel.size:
            chi2.append((sel.mean() - 1)**2 * sel.size)
    red = float(np.mean(chi2))
    assert CHI2_MIN < red < CHI2_MAX, (red, chi2)


def test_eh_table_gives_the_eh_field(tmp_path, tf_harness):
    """A table of the EH fit (norm none) -> the EH path's field to interpolation round-off."""
    from flowpm_mtf.physics import ics

    H = tf_harness
    case = H.cases()[0]
    conf = CONF.replace(grid=case[1], seed=5)
    table = linear_power.linear_power_table(conf.cosmology, 1e-3, 10.0, n=EH_TABLE_N)
    path = comm_path(tmp_path, "eh.txt", table.k, table.pk)
    lp = lps.resolve(lps.LinearPowerOptions(linear_power=path, linear_power_norm="none"), conf,
                     comm_world())
    out = H.run(case[0], conf, lambda mesh: {"eh": ics.linear_field(conf, mesh),
                                             "table": ics.linear_field(conf, mesh, lp.table)})
    assert H.rel_err(out["table"], out["eh"]) < EH_TABLE_RTOL


def comm_world():
    from mpi4py import MPI
    return MPI.COMM_WORLD


def comm_path(tmp_path, name, k, pk):
    """A table written by rank 0, its path on every rank."""
    comm = comm_world()
    path = comm.bcast(str(tmp_path / name) if comm.rank == 0 else None, root=0)
    if comm.rank == 0:
        write_table(path, k, pk)
    comm.barrier()
    return path


# ----------------------------------------------------------------------------- gradients
@pytest.mark.rank_independent
def test_model_gradient_refuses_cosmology_with_a_table():
    from flowpm_mtf.gradients.model_gradient import ModelGradient

    table = linear_power.linear_power_table(CONF.cosmology, 1e-3, 10.0, n=64)
    noise = types.SimpleNamespace(shape=None)
    with pytest.raises(ValueError, match=r"cosmology gradients \(params=Omega_c,sigma8\) need "
                       r"the Eisenstein & Hu P\(k\).*pass params=\(\)"):
        ModelGradient(CONF, None, None, noise=noise, power=table)
    with pytest.raises(ValueError, match="power colours the noise"):
        ModelGradient(CONF, None, None, linear=noise, power=table, params=())


# 1 rank: the table enters ModelGradient as the values of ics.linear_amplitude's kernel, the
# EH path's kernel (distributed in test_model_gradient.py's noise-mode tests), evaluated on
# each processor's own slice; the table's values on a split grid are
# test_eh_table_gives_the_eh_field's (2 ranks)
@pytest.mark.skipif(comm_world().size > 1, reason="the table's amplitude per slice: "
                    "test_eh_table_gives_the_eh_field on 2 ranks")
def test_model_gradient_with_a_table_is_the_fields(tf_harness):
    """params=() with a table: the noise's gradient through the table's amplitude, equal to
    the EH path's for a table of the EH fit (to EH_TABLE_RTOL: only the amplitude differs),
    another for 4 times that table."""
    import mesh_tensorflow as mtf
    import tensorflow.compat.v1 as tf
    import nbody_harness as NH
    from flowpm_mtf.gradients.model_gradient import ModelGradient
    from test_model_gradient import conf_for, make_loss

    H = tf_harness
    kind, grid = H.cases()[0]
    conf = conf_for(grid, n_steps=1)
    white = np.random.RandomState(5).randn(*conf.nc)
    weight = np.random.RandomState(13).randn(*conf.nc)
    table = linear_power.linear_power_table(conf.cosmology, 1e-3, 10.0, n=EH_TABLE_N)
    out = {}
    four = linear_power.PowerTable(table.k, 4 * table.pk)     # the table is what is used
    for name, plin in (("eh", None), ("table", table), ("four", four)):
        with tf.Graph().as_default():
            graph = mtf.Graph()
            mesh = mtf.Mesh(graph, "mesh")
            mg = ModelGradient(conf, mesh, make_loss(conf, weight), params=(),
                               noise=NH.import_field(mesh, conf, white), power=plin)
            lowering = mtf.Lowering(graph, {mesh: H.make_impl(kind, conf)})
            ops = mg.lower(lowering)
            grad = lowering.export_to_tf_tensor(mg.field_gradient)
            with tf.Session(config=H.session_config(kind, conf)) as sess:
                sess.run(tf.global_variables_initializer())
                sess.run(lowering.copy_masters_to_slices())
                res = mg.run(sess, ops, extra=grad)
        out[name] = res["loss"], res["extra"]
    assert np.abs(out["eh"][1]).max() > 0
    assert out["table"][0] == pytest.approx(out["eh"][0], rel=EH_TABLE_RTOL)
    assert H.rel_err(out["table"][1], out["eh"][1]) < EH_TABLE_RTOL
    assert H.rel_err(out["four"][1], out["eh"][1]) > 0.1


# ----------------------------------------------------------------------------- the command
ARGS = ["simulate", "--nc", "16", "--box-size", "100", "--steps", "1", "--seed", "7",
        "--dtype", "float64", "--no-plot"]
# The EH path and a table of it (EH_TABLE_N points, norm none) give the same run: the
# ICs differ by EH_TABLE_RTOL relative, a float64 step carries it over; positions
# ~1e2 Mpc/h.
CLI_POS_ATOL = 1e-4   # [Mpc/h]
CLI_DEADLINE_S = 900


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """Every command case in one 2-rank job (tests/mpi_scripts/cli_cases.py)."""
    from test_mpi_jobs import mpirun

    base = tmp_path_factory.mktemp("lp_cli")
    table = linear_power.linear_power_table(CONF.cosmology, 1e-3, 10.0, n=EH_TABLE_N)
    eh = write_table(base / "eh.txt", table.k, table.pk)
    short = write_table(base / "short.txt", table.k[:EH_TABLE_N // 2],
                        table.pk[:EH_TABLE_N // 2])
    bad = base / "bad.txt"
    bad.write_text("# k P\n0.1 1\n0.3 2\n0.2 3\n")
    cases = {"eh": [], "table": ["--linear-power", eh, "--linear-power-norm", "none"],
             "short": ["--linear-power", short], "unsorted": ["--linear-power", str(bad)]}
    try:
        import camb  # noqa: F401
        cases["camb"] = ["--boltzmann", "camb"]
    except ImportError:
        pass
    names = list(cases)
    (base / "cases.json").write_text(json.dumps([
        {"argv": ARGS + cases[n] + ["--out", str(base / n)]} for n in names]))
    proc, _ = mpirun(2, "cli_cases.py", base / "cases.json", base / "results.json",
                     timeout=CLI_DEADLINE_S)
    assert proc.returncode == 0 and (base / "results.json").exists(), \
        (proc.stdout + proc.stderr)[-6000:]
    results = json.loads((base / "results.json").read_text())
    return base, {n: types.SimpleNamespace(codes=r["codes"], out="\n".join(r["err"]))
                  for n, r in zip(names, results)}


def _snapshot(d):
    from flowpm_mtf.runs import io

    snap = io.read_snapshot(os.path.join(d, "snapshot.h5"))
    order = np.argsort(snap["id"])
    return snap["position"][order]


@pytest.mark.single_process
def test_cli_table_run_equals_eh_run(cli_runs):
    base, res = cli_runs
    for name in ("eh", "table"):
        assert res[name].codes == [0, 0], res[name].out[-3000:]
    a, b = _snapshot(base / "eh"), _snapshot(base / "table")
    d = np.abs(a - b)
    assert np.minimum(d, 100 - d).max() < CLI_POS_ATOL
    summary = json.loads((base / "table" / "summary.json").read_text())
    lp = summary["linear_power"]
    assert lp["linear_power"] == str(base / "eh.txt")
    assert lp["linear_power_digest"] == lps.file_digest(base / "eh.txt")
    assert summary["linear_power_table"]["rows"] == EH_TABLE_N
    assert "linear_power_table" not in json.loads((base / "eh" / "summary.json").read_text())


@pytest.mark.single_process
@pytest.mark.parametrize("name, pattern", [
    ("short", r"linear_power=.*short.txt: the table covers k in \[0.001, 0.0999\d*\] h/Mpc but "
              r"the mesh nc=16x16x16 .*needs \[0.0628319, 0.870\d*\] h/Mpc"),
    ("unsorted", r"linear_power=.*bad.txt: line 4: k = 0.2 after k = 0.3 on line 3")])
def test_cli_bad_tables_one_line(cli_runs, name, pattern):
    base, res = cli_runs
    lines = re.findall(r"^flowpm-mtf: error: (.*)$", res[name].out, re.M)
    assert len(lines) == 1 and re.search(pattern, lines[0]), res[name].out[-3000:]
    assert res[name].codes == [2, 2] and not (base / name).exists()


@pytest.mark.single_process
def test_cli_boltzmann_camb(cli_runs):
    pytest.importorskip("camb", reason="camb is not installed (requirements.txt)")
    base, res = cli_runs
    assert res["camb"].codes == [0, 0], res["camb"].out[-3000:]
    summary = json.loads((base / "camb" / "summary.json").read_text())
    rec = summary["linear_power_table"]
    assert rec["source"] == "camb" and rec["digest"].startswith("camb ")
    assert summary["linear_power"]["linear_power_digest"] == rec["digest"]
    assert 1.5e-9 < rec["A_s"] < 3e-9
    # its ICs differ from the EH run's (CAMB's shape), not by much
    a, b = _snapshot(base / "eh"), _snapshot(base / "camb")
    d = np.abs(a - b)
    d = np.minimum(d, 100 - d)
    assert 1e-3 < d.max() < 5.0


# ----------------------------------------------------------------------------- resume
@pytest.mark.rank_independent   # one process (placement backend); the CLI prints on rank 0
def test_resume_refuses_another_table(tmp_path, capsys):
    """A run stopped (SIGTERM) after a checkpoint; its table file changed: --resume is
    refused in one line before any graph; with the table back, it resumes."""
    from test_reconstruct_resume import _main, _refused

    table = linear_power.linear_power_table(CONF.cosmology, 1e-3, 10.0, n=512)
    path = write_table(tmp_path / "pk.txt", table.k, table.pk)
    out = str(tmp_path / "run")
    args = ["simulate", "--nc", "16", "--box-size", "100", "--steps", "3", "--dtype",
            "float64", "--no-plot", "--backend", "placement"]
    code, sent = _main(args + ["--linear-power", path, "--checkpoint-every", "1", "--out",
                               out], sigterm_at="step 2/3 ")
    assert code == 0 and sent and os.path.isdir(os.path.join(out, "checkpoint"))
    original, digest = open(path, "rb").read(), lps.file_digest(path)
    write_table(path, table.k, 1.01 * table.pk)
    capsys.readouterr()   # the first run's log
    line = _refused(["simulate", "--resume", out, "--backend", "placement"], capsys)
    assert re.search(r"linear_power=%s: the table is sha256:[0-9a-f]{64} but the run that "
                     r"wrote the checkpoint used %s" % (re.escape(path), digest), line), line
    with open(path, "wb") as f:
        f.write(original)
    assert _main(["simulate", "--resume", out, "--backend", "placement"])[0] == 0
    summary = json.loads(open(os.path.join(out, "summary.json")).read())
    assert summary["resumed"] and summary["linear_power"]["linear_power_digest"] == \
        lps.file_digest(path)
