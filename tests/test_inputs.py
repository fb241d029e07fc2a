"""No input reaches an internal error: every bad option or ``--config`` value ends in one
line ``flowpm-mtf: error: ...`` and exit code 2, before anything runs.

The cases go through the real option parsing (``cli.build_parser``, ``cli.make_configs``,
``jobs.options.make_configs``) and the cli's error path (``cli.report_error``) in this
process; two ``mpirun -np 2`` launches check the one line and the exit code end to end
(a bad option; a bad allocator, refused at start-up).
The exit-code table of docs/running.md is checked against the code.
"""
import ast
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from flowpm_mtf import allocator, cli, errors, jobs
from flowpm_mtf.jobs.options import COSMO_PREFIX
from test_mpi_jobs import clean_env

# Option parsing and error reporting need no process grid: the 1-rank pass covers them (on
# more ranks the CLI reports on rank 0 only, and its mpirun cases launch their own jobs).
pytestmark = pytest.mark.rank_independent

HERE = os.path.dirname(os.path.abspath(__file__))
RUNNING_MD = os.path.join(HERE, os.pardir, "docs", "running.md")
ERROR_PREFIX = "flowpm-mtf: error: "
CONFIG_EXIT = errors.ConfigError.exit_code
REGISTRY = jobs.all_jobs()
# One parser for every case (building it takes ~15 ms, the rest of a case < 1 ms): a parse
# leaves the parser as it was (argparse keeps the values in the namespace it returns).
PARSER = cli.build_parser(REGISTRY)
# Limit per mpirun launch: catches a hang (imports alone have taken 60 s under load).
JOB_DEADLINE_S = 600


# ----------------------------------------------------------------------------- helpers
def run_cli(argv, capsys):
    """(exit code, stderr lines, configs or None): the cli's parsing and config checks,
    then its error path, as ``flowpm-mtf ARGV`` does before it creates anything."""
    args = None
    try:
        args = PARSER.parse_args(argv)
        cli.check_run_options(args)
        configs = cli.make_configs(REGISTRY[args.command], args)
        code = 0
    except Exception as e:  # noqa: BLE001 (what main() does)
        configs, code = None, cli.report_error(e, args, False)
    lines = capsys.readouterr().err.splitlines()
    return code, lines, configs


def assert_config_error(code, lines, *patterns):
    """Exit code 2 and exactly one line, no internal error, matching every pattern."""
    assert code == CONFIG_EXIT, (code, lines)
    assert len(lines) == 1 and lines[0].startswith(ERROR_PREFIX), lines
    assert "internal error" not in lines[0], lines[0]
    for p in patterns:
        assert re.search(p, lines[0]), (p, lines[0])


def write_config(tmp_path, data, name="c.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def _fields(job):
    """(section, field, job default) of every config key of ``job``."""
    for sec in job.sections:
        for f in dataclasses.fields(sec.cls):
            yield sec, f, sec.default(f.name)


# ----------------------------------------------------------------------------- the issue's cases
def test_halo_zero_is_a_config_error(capsys):
    assert_config_error(*run_cli(["simulate", "--halo", "0"], capsys)[:2],
                        r"halo_size \(--halo\) must be >= 1 cell.*got 0")


def test_config_file_missing_or_a_directory(tmp_path, capsys):
    missing = str(tmp_path / "nope.json")
    assert_config_error(*run_cli(["simulate", "--config", missing], capsys)[:2],
                        re.escape("--config %s: no such file" % missing))
    assert_config_error(*run_cli(["simulate", "--config", str(tmp_path)], capsys)[:2],
                        re.escape("--config %s: is a directory" % tmp_path))


@pytest.mark.parametrize("text, where", [
    ('{"nc": 32,\n "n_steps": }\n', "line 2, column 13"),
    ('{"nc": 32', "line 1, column 10"),
    ("", "line 1, column 1"),
    ("{'nc': 32}", "line 1, column 2"),
])
def test_malformed_json_names_file_line_and_column(tmp_path, capsys, text, where):
    path = write_config(tmp_path, text)
    assert_config_error(*run_cli(["simulate", "--config", path], capsys)[:2],
                        re.escape("--config %s: invalid JSON at %s: " % (path, where)))


def test_config_not_an_object_or_not_utf8(tmp_path, capsys):
    path = write_config(tmp_path, [32])
    assert_config_error(*run_cli(["simulate", "--config", path], capsys)[:2],
                        r"expected a JSON object .*got \[32\]")
    path = tmp_path / "bin.json"
    path.write_bytes(b'{"nc": "\xff"}')
    assert_config_error(*run_cli(["simulate", "--config", str(path)], capsys)[:2],
                        r"not UTF-8 text")


@pytest.mark.parametrize("data, patterns", [
    ({"nc": "thirty-two"}, [r"'nc': expected an integer or a list of 3 integers, "
                            r'got "thirty-two"']),
    ({"nc": None}, [r"'nc': expected an integer.*got null"]),
    ({"cosmology": {"Omega_cc": 0.3}}, [r"unknown cosmology key 'Omega_cc' "
                                        r"\(did you mean 'Omega_c'\?\)"]),
    ({"config": {"cosmology": {"sigma_8": 0.8}}}, [r"unknown cosmology key 'sigma_8' "
                                                   r"\(did you mean 'sigma8'\?\)"]),
    ({"Omega_c": 0.3}, [r"unknown key 'Omega_c' \(a cosmology parameter: "
                        r'\{"cosmology": \{"Omega_c": \.\.\.\}\}\)']),
    ({"steps": 3}, [r"unknown key 'steps' \(the flag --steps is the key 'n_steps'\)"]),
    ({"n_step": 3}, [r"unknown key 'n_step' \(did you mean 'n_steps'\?\)"]),
    ({"config": {"seeed": 3}}, [r"unknown key 'seeed' in section 'config' "
                                r"\(did you mean 'seed'\?\)"]),
    ({"simulate": 3}, [r"section 'simulate': expected an object"]),
    ({"cosmology": {"h": "0.7"}}, [r"'cosmology.h': expected a number, got \"0.7\""]),
    ({"cosmology": None}, [r"'cosmology': expected an object of cosmology fields.*got null"]),
    ({"grid": "2by1"}, [r"'grid': expected \[P, Q\].*got \"2by1\""]),
    # JSON integers have no limit: one beyond 64 bits is named with its key (numpy's
    # "ufunc 'isfinite' not supported" before), for every field
    ({"nc": 99999999999999999999999}, [r"'nc': 9{23} does not fit in 64 bits"]),
    ({"nc": [16, 16, -2**63 - 1]}, [r"'nc': -9223372036854775809 does not fit in 64 bits"]),
    ({"seed": 99999999999999999999999}, [r"'seed': 9{23} does not fit in 64 bits"]),
    ({"config": {"n_steps": 2**64}}, [r"'n_steps': 18446744073709551616 does not fit"]),
    ({"cosmology": {"h": 10**400}}, [r"'cosmology': 10{400} does not fit in 64 bits"]),
    # a key twice is refused, not resolved to the last value (json's default)
    ('{"nc": 16,\n "nc": 32}', [r"key 'nc' appears twice in one object \(again at line 2\)"]),
    ('{"config": {"seed": 1, "seed": 2}}', [r"key 'seed' appears twice in one object"]),
    ('{"cosmology": {"h": 0.7, "h": 0.6}}', [r"key 'h' appears twice in one object"]),
    ({"nc": 16, "config": {"nc": 32}}, [r"'nc' is set twice, at the top level and in section "
                                        r"'config'; give it once"]),
    ({"cosmology": {"h": 0.7}, "config": {"cosmology": {"h": 0.6}}},
     [r"'cosmology.h' is set twice, at the top level and in section 'config'"]),
])
def test_config_values_of_the_issue(tmp_path, capsys, data, patterns):
    path = write_config(tmp_path, data)
    assert_config_error(*run_cli(["simulate", "--config", path], capsys)[:2],
                        re.escape("--config %s: " % path), *patterns)


def test_valid_config_file_forms(tmp_path, capsys):
    """The forms the checks must keep accepting (flat, per section, null = automatic)."""
    path = write_config(tmp_path, {"nc": [16, 16, 8], "grid": "1x1", "halo_size": None,
                                   "config": {"cosmology": {"sigma8": 0.7}, "n_steps": 3},
                                   "simulate": {"snapshots": 0.5}, "box_size": 100,
                                   "cosmology": {"h": 0.7}})   # other cosmology keys: merged
    code, lines, configs = run_cli(["simulate", "--config", path], capsys)
    assert code == 0 and lines == [], lines
    conf = configs["config"]
    assert conf.nc == (16, 16, 8) and conf.grid == (1, 1) and conf.halo_size == 2
    assert conf.cosmology.sigma8 == 0.7 and conf.cosmology.h == 0.7 and conf.n_steps == 3
    assert configs["simulate"].snapshots == (0.5,)


# ----------------------------------------------------------------------------- classes of --config values
def _wrong_types(f, default):
    """JSON values of the wrong type for field ``f`` (its job default ``default``)."""
    if dataclasses.is_dataclass(default):
        return ["planck", 0.3, [0.3], None]
    choices = f.metadata.get("choices")
    optional = default is None or "Optional" in str(f.type)
    out = []
    if choices is not None:
        out += [7 if isinstance(choices[0], str) else "two", [choices[0]]]
    elif f.type is bool:
        out += ["yes", 1]
    elif f.type is str:
        out += [5, ["x"]]
    else:
        out += ["thirty-two", {"value": 1}, [[1]]]
        if f.name != "grid" and "..." not in str(f.type) and "Tuple" not in str(f.type):
            out.append([1, 2])          # a list for a scalar
    if not optional and f.name != "grid":   # "grid": null is the automatic grid
        out.append(None)
    if f.type is int or "Optional[int]" in str(f.type):
        out.append(2.5)
    return out


TYPE_CASES = [(name, f.name, v) for name, job in sorted(REGISTRY.items())
              for _, f, default in _fields(job) for v in _wrong_types(f, default)]


@pytest.mark.parametrize("job, key, value", TYPE_CASES,
                         ids=["%s-%s-%s" % (j, k, json.dumps(v)) for j, k, v in TYPE_CASES])
def test_every_config_key_with_a_wrong_type(tmp_path, capsys, job, key, value):
    path = write_config(tmp_path, {key: value})
    assert_config_error(*run_cli([job, "--config", path], capsys)[:2],
                        re.escape("--config %s: " % path), re.escape("%r" % key),
                        r"expected", re.escape(json.dumps(value)))


# Values of the right type but out of range: the dataclass names the key and the value.
RANGE_CASES = [
    ("simulate", "nc", -1), ("simulate", "nc", [16, 0, 16]), ("simulate", "box_size", 0),
    ("simulate", "box_size", [100, -1, 100]), ("simulate", "n_steps", 0),
    ("simulate", "n_steps", -2), ("simulate", "halo_size", 0), ("simulate", "halo_size", -1),
    ("simulate", "a_start", -0.1), ("simulate", "a_end", 0), ("simulate", "capacity", -5),
    ("simulate", "send_capacity", 0), ("simulate", "seed", -1), ("simulate", "grid", [0, 1]),
    ("simulate", "snapshots", [-0.5]), ("simulate", "cosmology", {"sigma8": -0.8}),
    ("simulate", "cosmology", {"h": 0}), ("simulate", "cosmology", {"Omega_c": 0}),
    ("simulate", "cosmology", {"Omega_b": -0.1}), ("lensing", "z_source", [0]),
    ("lensing", "z_source", []), ("lensing", "field_deg", -1), ("lensing", "field_npix", 0),
    ("lensing", "n_planes", 0), ("reconstruct", "iterations", 0),
    ("reconstruct", "learning_rate", 0), ("reconstruct", "noise", -0.1),
    ("reconstruct", "sigma", 0), ("reconstruct", "epsilon", -1e-8),
    ("reconstruct", "log_every", 0), ("reconstruct", "beta1", 1.0),
    ("reconstruct", "gradient", "backprop"), ("fft-demo", "repeats", 0),
]


@pytest.mark.parametrize("job, key, value", RANGE_CASES,
                         ids=["%s-%s-%s" % (j, k, json.dumps(v)) for j, k, v in RANGE_CASES])
def test_every_config_key_out_of_range(tmp_path, capsys, job, key, value):
    path = write_config(tmp_path, {key: value})
    name = next(iter(value)) if isinstance(value, dict) else key
    shown = next(iter(value.values())) if isinstance(value, dict) else value
    shown = shown[0] if isinstance(shown, list) and len(shown) == 1 else shown
    patterns = [re.escape(name)]
    if not isinstance(shown, list):
        patterns.append(re.escape(str(shown)))
    assert_config_error(*run_cli([job, "--config", path], capsys)[:2], *patterns)


# ----------------------------------------------------------------------------- numeric options
def _numeric_options(job_name):
    """(flag, dest) of every numeric option of a job (config fields and run options)."""
    parser = cli.build_parser(REGISTRY)
    sub = next(a for a in parser._actions if a.dest == "command").choices[job_name]
    numeric = (int, float, cli.parse_nc, cli.parse_floats)
    for action in sub._actions:
        kind = getattr(action, "type", None)
        if action.option_strings and (kind in numeric or getattr(kind, "__name__", "") ==
                                      "parse"):
            yield action.option_strings[-1], action.dest


# (flag, value) pairs that are valid: everything else at 0 / negative / nan / inf is an error.
VALID_NUMERIC = {("--seed", "0"), ("--cosmo-Omega-b", "0"), ("--noise", "0"),
                 ("--beta1", "0"), ("--beta2", "0"),
                 ("--sort-every", "0")}    # 0: the particles are never reordered (the default)
# imaging: a uniform random mask, seeds, no training (the initial network), no perturbation
VALID_NUMERIC |= {("--density-power", "0"), ("--init-seed", "0"), ("--data-seed", "0"),
                  ("--train-steps", "0"), ("--perturbation", "0")}
VALID_NUMERIC |= {("--%s%s" % (COSMO_PREFIX, name), v) for name in ("w0", "wa", "Omega-k", "n-s")
                  for v in ("0", "-1")}
VALID_NUMERIC.add(("--linear-power-z", "0"))   # a table at z = 0 (the default)
# PGD: alpha(a) = alpha0 a^mu; any finite mu (the default is negative); alpha0 = 0 is no
# correction (the run equals one without --pgd)
VALID_NUMERIC |= {("--pgd-mu", "0"), ("--pgd-mu", "-1"), ("--pgd-alpha0", "0")}
NUMERIC_VALUES = ("0", "-1", "nan", "inf")
NUMERIC_CASES = [(name, flag, dest, v) for name in sorted(REGISTRY)
                 for flag, dest in _numeric_options(name) for v in NUMERIC_VALUES]


@pytest.mark.parametrize("job, flag, dest, value", NUMERIC_CASES,
                         ids=["%s%s=%s" % (j, f, v) for j, f, _, v in NUMERIC_CASES])
def test_every_numeric_option_at_zero_negative_nan_inf(capsys, job, flag, dest, value):
    code, lines, _ = run_cli([job, "%s=%s" % (flag, value)], capsys)
    if (flag, value) in VALID_NUMERIC:
        assert code == 0 and lines == [], lines
        return
    field = dest.split(":")[-1].split(".")[-1]
    assert_config_error(code, lines, r"(?i)(%s|%s)" % (re.escape(flag), re.escape(field)),
                        r"(?i)%s" % re.escape(value))


@pytest.mark.parametrize("grid", ["0x1", "1x0", "-1x2"])
def test_grid_option_zero_or_negative(capsys, grid):
    assert_config_error(*run_cli(["simulate", "--grid=" + grid], capsys)[:2], r"grid")
    assert_config_error(*run_cli(["simulate", "--grid", grid], capsys)[:2], r"grid")


NEGATIVE_VALUES = ("-0.5,0.5,1.0", "-1e-3", "-2,-2,-2")
NEGATIVE_CASES = [(name, flag) for name in sorted(REGISTRY)
                  for flag, _ in _numeric_options(name)]


@pytest.mark.parametrize("job, flag", NEGATIVE_CASES, ids=["%s%s" % c for c in NEGATIVE_CASES])
def test_negative_value_after_a_space_is_a_value(capsys, job, flag):
    """``--nz-bins -0.5,0.5,1.0``: argparse took a negative comma list (or ``-1e-3``) for an
    option and failed with "expected one argument"; now ``--flag V`` is ``--flag=V``: the
    value reaches the option's own checks (the same verdict, the same line)."""
    for value in NEGATIVE_VALUES:
        spaced = run_cli([job, flag, value], capsys)[:2]
        assert not any("expected one argument" in line for line in spaced[1]), spaced
        assert spaced == run_cli([job, "%s=%s" % (flag, value)], capsys)[:2]


def test_negative_nz_bin_edge_is_the_rule_it_breaks(capsys):
    assert_config_error(*run_cli(["lensing", "--nz-smail", "2,1.5,0.3", "--nz-bins",
                                  "-0.5,0.5,1.0"], capsys)[:2],
                        re.escape("nz_bins: redshifts are >= 0, got the edge -0.5"))


def test_numeric_option_list_is_not_empty():
    """The numeric options the test above drives include the ones of every job."""
    flags = {flag for _, flag, _, _ in NUMERIC_CASES}
    assert {"--nc", "--box-size", "--halo", "--steps", "--a-start", "--a-end", "--seed",
            "--capacity", "--send-capacity", "--cosmo-sigma8", "--snapshots",
            "--checkpoint-every", "--z-source", "--field-deg", "--field-npix", "--n-planes",
            "--iterations", "--learning-rate", "--noise", "--sigma", "--beta1", "--epsilon",
            "--log-every", "--repeats"} <= flags


def test_tiny_blocks_are_a_config_error(capsys):
    """Blocks of 1 cell leave no room for the CIC halo (the automatic halo would be 0)."""
    assert_config_error(*run_cli(["simulate", "--nc", "4", "--grid", "4x1"], capsys)[:2],
                        r"blocks of \(1, 4\) cells")


# ----------------------------------------------------------------------------- exit codes
def _table_codes():
    """Exit code -> cause, from the table of docs/running.md's "Errors and exit codes"."""
    text = open(RUNNING_MD).read()
    section = text.split("## Errors and exit codes", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\|\s*(\d+)\s*\|(.*)\|\s*$", section, re.M)
    codes = [int(c) for c, _ in rows]
    assert len(codes) == len(set(codes)), "a code twice in the table"
    return {int(c): cause.strip() for c, cause in rows}


def _code_exit_codes():
    """Every exit code the cli can return: its named returns and every error class's."""
    codes = {cli.EXIT_OK, errors.EXIT_INTERNAL}
    todo = [errors.FlowpmError]
    while todo:
        cls = todo.pop()
        codes.add(cls.exit_code)
        todo.extend(cls.__subclasses__())
    return codes


def test_exit_code_table_matches_the_code():
    assert issubclass(allocator.AllocatorError, errors.FlowpmError)   # counted above
    assert set(_table_codes()) == _code_exit_codes()


def test_cli_returns_no_unnamed_exit_code():
    """Every ``return`` / ``Abort`` / ``exit`` of cli.py with a literal code is in the table
    (the named ones are counted by the test above)."""
    tree = ast.parse(open(cli.__file__).read())
    literal = set()
    for node in ast.walk(tree):
        value = None
        if isinstance(node, ast.Return):
            value = node.value
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(
                node.func, "id", None)) in ("Abort", "exit", "_exit"):
            value = node.args[0] if node.args else None
        if isinstance(value, ast.Constant) and isinstance(value.value, int) \
                and not isinstance(value.value, bool):
            literal.add(value.value)
    assert literal <= set(_table_codes()), literal


# ----------------------------------------------------------------------------- end to end
def _mpirun(np_, *args, env=None):
    cmd = [shutil.which("mpirun"), "--oversubscribe", "-np", str(np_)]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    cmd += [sys.executable, "-m", "flowpm_mtf.cli", *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=JOB_DEADLINE_S,
                          env=dict(clean_env(), **(env or {})))
    proc.out = proc.stdout + proc.stderr
    return proc


def assert_one_line_end_to_end(proc, pattern, out):
    lines = [ln for ln in proc.out.splitlines() if ERROR_PREFIX in ln]
    assert len(lines) == 1, proc.out[-4000:]
    assert re.search(pattern, lines[0]), lines[0]
    assert "Traceback" not in proc.out and "internal error" not in proc.out, proc.out[-4000:]
    assert proc.returncode == CONFIG_EXIT, (proc.returncode, proc.out[-3000:])
    assert not os.path.exists(out)


@pytest.mark.single_process
def test_two_ranks_one_line_exit_2(tmp_path):
    """An option refused on 2 ranks, end to end (a --config key refused on 2 ranks: in the
    refusals' job of tests/test_preflight_cli.py)."""
    out = tmp_path / "D"
    proc = _mpirun(2, "simulate", "--nc", "16", "--halo", "0", "--out", out)
    assert_one_line_end_to_end(proc, r"halo_size \(--halo\) must be >= 1", out)


@pytest.mark.single_process
def test_two_ranks_bad_allocator_one_line_exit_2(tmp_path):
    out = tmp_path / "D"
    proc = _mpirun(2, "simulate", "--nc", "16", "--out", out, env={allocator.ENV: "bogus"})
    assert_one_line_end_to_end(proc, r"FLOWPM_MTF_ALLOCATOR='bogus': choose one of", out)
