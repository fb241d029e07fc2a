"""Batch and launch scripts: syntax (bash -n), shellcheck when installed, and what the
Slurm templates and launchers actually run (with stand-ins for srun/mpirun on PATH)."""
import glob
import os
import re
import shutil
import stat
import subprocess

import pytest

# Subprocesses and files only, no mesh: the 1-rank pass covers them. On 4 ranks the four
# copies of the set-up tests ran scripts/setup_env.sh side by side (CI of 090a9ea).
pytestmark = pytest.mark.rank_independent

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SBATCH = sorted(glob.glob(os.path.join(REPO, "slurm", "*.sbatch")))
SHELL = sorted(glob.glob(os.path.join(REPO, "scripts", "*.sh")))
# Scripts of the batch/launch issue: held to shellcheck's default severity (style
# notes included); every other script must be free of shellcheck errors.
OWN = SBATCH + [os.path.join(REPO, "scripts", f)
             for f in ("run_mpirun.sh", "run_horovodrun.sh", "sim_cluster.sh")]
# Things a portable template must not contain: absolute site paths and fixed accounts.
SITE_PATTERNS = (r"/(home|scratch|gpfs|lustre|project|projects|work|sw|apps)/",
                 r"^#SBATCH\s+--(account|partition|qos)\b", r"^#SBATCH\s+-[Ap]\b")


def _ids(paths):
    return [os.path.relpath(p, REPO) for p in paths]


def test_templates_exist():
    names = {os.path.basename(p) for p in SBATCH}
    assert {"single_node_multi_gpu.sbatch", "multi_node.sbatch"} <= names
    for f in ("run_mpirun.sh", "run_horovodrun.sh"):
        assert os.path.exists(os.path.join(REPO, "scripts", f))


@pytest.mark.parametrize("path", SBATCH + SHELL, ids=_ids(SBATCH + SHELL))
def test_bash_syntax(path):
    proc = subprocess.run(["bash", "-n", path], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("path", SBATCH + SHELL, ids=_ids(SBATCH + SHELL))
def test_shellcheck(path):
    exe = shutil.which("shellcheck")
    if exe is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    severity = [] if path in OWN else ["--severity=error"]
    proc = subprocess.run([exe, "--shell=bash", *severity, path], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("path", SBATCH, ids=_ids(SBATCH))
def test_sbatch_template_is_portable(path):
    text = open(path).read()
    directives = re.findall(r"^#SBATCH\s+--([a-z-]+)", text, flags=re.M)
    for required in ("nodes", "gpus-per-node", "ntasks-per-node", "time"):
        assert required in directives, "missing #SBATCH --%s" % required
    for pat in SITE_PATTERNS:
        assert not re.search(pat, text, flags=re.M), "site-specific content: %s" % pat
    assert "SLURM_SUBMIT_DIR" in text and "VENV" in text and re.search(r"\bsrun\b", text)


def _stub(bindir, name):
    """An executable ``name`` that records its arguments (one per line) and exits 0."""
    path = os.path.join(bindir, name)
    with open(path, "w") as f:
        f.write('#!/usr/bin/env bash\nprintf "%%s\\n" "$@" > "%s.args"\n' % path)
    os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)
    return path + ".args"


@pytest.fixture
def fake_env(tmp_path):
    """A PATH with stand-ins for srun/mpirun and a fake venv (activate, flowpm-mtf)."""
    bindir = tmp_path / "bin"
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    bindir.mkdir()
    (venv / "bin" / "activate").write_text("# fake venv\n")
    for exe in ("flowpm-mtf", "python", "horovodrun"):
        _stub(str(venv / "bin"), exe)
    # set-up runs on a machine that has every system package (run_tests.sh set it up
    # first): an apt-get here means its detection is wrong, never a real install
    apt = bindir / "apt-get"
    apt.write_text('#!/usr/bin/env bash\necho "stand-in apt-get $*: set-up asked for system '
                   'packages that are installed" >&2\nexit 100\n')
    apt.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMIX_"))}
    env.update(PATH="%s:%s" % (bindir, env.get("PATH", "")), VENV=str(venv))
    return env, bindir, venv, tmp_path


@pytest.mark.parametrize("name", ["single_node_multi_gpu.sbatch", "multi_node.sbatch"])
def test_sbatch_runs_one_rank_per_gpu_with_srun(fake_env, name):
    env, bindir, _, tmp = fake_env
    args_file = _stub(str(bindir), "srun")
    env.update(SLURM_SUBMIT_DIR=str(tmp), SLURM_NTASKS="8", SLURM_JOB_ID="123",
               SLURM_JOB_NUM_NODES="2", SLURM_CPUS_PER_TASK="4", NC="128", GRID="4x2")
    proc = subprocess.run(["bash", os.path.join(REPO, "slurm", name), "--halo", "4"],
                          cwd=str(tmp), env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    argv = open(args_file).read().split("\n")
    assert "--ntasks=8" in argv and "--kill-on-bad-exit=1" in argv
    # every task sees the node's GPUs: the backend picks the local rank's
    assert not any(a.startswith(("--gpus-per-task", "--gpu-bind")) for a in argv)
    i = argv.index("simulate")
    assert argv[i - 1].endswith("flowpm-mtf")
    tail = argv[i:]
    for pair in (["--nc", "128"], ["--grid", "4x2"], ["--out", "out/slurm-123"],
                 ["--halo", "4"]):
        assert any(tail[j:j + 2] == pair for j in range(len(tail))), (pair, tail)
    assert os.path.isdir(tmp / "out" / "slurm-123")


@pytest.mark.parametrize("command", ["lensing", "reconstruct"])
def test_sbatch_runs_the_other_jobs(fake_env, command):
    """COMMAND=lensing|reconstruct: the same srun line, checkpoints and resume as simulate."""
    env, bindir, _, tmp = fake_env
    args_file = _stub(str(bindir), "srun")
    env.update(SLURM_SUBMIT_DIR=str(tmp), SLURM_NTASKS="2", SLURM_JOB_ID="9", NC="32",
               COMMAND=command, CHECKPOINT_EVERY="5", RESUME="1")
    path = os.path.join(REPO, "slurm", "single_node_multi_gpu.sbatch")
    proc = subprocess.run(["bash", path], cwd=str(tmp), env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    argv = open(args_file).read().split("\n")
    i = argv.index(command)
    assert argv[i - 1].endswith("flowpm-mtf")
    tail = argv[i:]
    for pair in (["--nc", "32"], ["--resume", "out/slurm-9"], ["--checkpoint-every", "5"]):
        assert any(tail[j:j + 2] == pair for j in range(len(tail))), (pair, tail)


def test_sbatch_bench_mode_needs_a_grid(fake_env):
    env, bindir, _, tmp = fake_env
    _stub(str(bindir), "srun")
    env.update(SLURM_SUBMIT_DIR=str(tmp), SLURM_NTASKS="4", SLURM_JOB_ID="7", COMMAND="bench")
    path = os.path.join(REPO, "slurm", "single_node_multi_gpu.sbatch")
    proc = subprocess.run(["bash", path], cwd=str(tmp), env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and "needs GRID" in proc.stderr
    env["GRID"] = "2x2"
    proc = subprocess.run(["bash", path], cwd=str(tmp), env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    argv = open(os.path.join(str(bindir), "srun.args")).read().split("\n")
    assert "scripts/bench_compare.py" in argv and argv[argv.index("--grid") + 1] == "2x2"


def test_mpirun_launcher(fake_env):
    env, bindir, venv, tmp = fake_env
    args_file = _stub(str(bindir), "mpirun")
    env.update(NP="4", GRID="2x2", OUT=str(tmp / "o"))
    proc = subprocess.run(["bash", os.path.join(REPO, "scripts", "run_mpirun.sh"), "--steps", "3"],
                          env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    argv = open(args_file).read().split("\n")
    assert argv[argv.index("-np") + 1] == "4"
    assert str(venv / "bin" / "flowpm-mtf") in argv
    assert argv[argv.index("--grid") + 1] == "2x2" and "--steps" in argv
    assert "OMP_NUM_THREADS" in argv  # forwarded with -x


def test_horovodrun_launcher(fake_env):
    env, _, venv, tmp = fake_env
    env.update(NP="2", COMMAND="fft-demo", OUT=str(tmp / "o"))
    proc = subprocess.run(["bash", os.path.join(REPO, "scripts", "run_horovodrun.sh"),
                           "--nc", "16"], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    argv = open(str(venv / "bin" / "horovodrun.args")).read().split("\n")
    assert "--mpi" in argv and argv[argv.index("-np") + 1] == "2"
    assert argv[argv.index("-H") + 1] == "localhost:2" and "fft-demo" in argv


@pytest.mark.parametrize("state, resume, expect_resume", [
    ("empty", None, False),
    ("checkpoint", None, True),        # RESUME=auto: an unfinished run in OUT
    ("complete", None, False),         # a complete run is never resumed by default
    ("checkpoint", "0", False),
    ("empty", "1", True),
])
def test_sbatch_resume_and_checkpoint_options(fake_env, state, resume, expect_resume):
    env, bindir, _, tmp = fake_env
    args_file = _stub(str(bindir), "srun")
    out = tmp / "run"
    if state != "empty":
        (out / "checkpoint" / "step_000004").mkdir(parents=True)
    if state == "complete":
        (out / "summary.json").write_text("{}")
    env.update(SLURM_SUBMIT_DIR=str(tmp), SLURM_NTASKS="2", SLURM_JOB_ID="5", OUT=str(out),
               CHECKPOINT_EVERY="7")
    if resume is not None:
        env["RESUME"] = resume
    path = os.path.join(REPO, "slurm", "single_node_multi_gpu.sbatch")
    proc = subprocess.run(["bash", path], cwd=str(tmp), env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    argv = open(args_file).read().split("\n")
    assert argv[argv.index("--checkpoint-every") + 1] == "7"
    if expect_resume:
        assert argv[argv.index("--resume") + 1] == str(out) and "--out" not in argv
        assert "resuming the unfinished run" in proc.stdout
    else:
        assert argv[argv.index("--out") + 1] == str(out) and "--resume" not in argv


def test_sbatch_rejects_an_unknown_resume_value(fake_env):
    env, bindir, _, tmp = fake_env
    _stub(str(bindir), "srun")
    env.update(SLURM_SUBMIT_DIR=str(tmp), SLURM_NTASKS="2", SLURM_JOB_ID="5", RESUME="maybe")
    path = os.path.join(REPO, "slurm", "multi_node.sbatch")
    proc = subprocess.run(["bash", path], cwd=str(tmp), env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and "RESUME=maybe" in proc.stderr


def test_setup_env_refuses_a_full_disk_before_pip(fake_env):
    """scripts/setup_env.sh checks the free space where the venv goes before creating it:
    one clear line and exit 1 (the last CI failure was pip's "No space left on device"
    half-way through the install). A stand-in ``df`` reports 100 MB free."""
    env, bindir, _, tmp = fake_env
    df = bindir / "df"
    df.write_text("#!/usr/bin/env bash\n"
                  "echo 'Filesystem 1048576-blocks Used Available Capacity Mounted on'\n"
                  "echo '/dev/fake 2000 1900 100 95% /'\n")
    df.chmod(0o755)
    venv = tmp / "new" / "venv"
    env["VENV"] = str(venv)
    proc = subprocess.run(["bash", os.path.join(REPO, "scripts", "setup_env.sh")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr
    assert re.search(r"not enough disk space: the environment needs ~\d+ MB in .*new, "
                     r"100 MB free", proc.stderr), proc.stderr
    assert not venv.exists()


def test_setup_env_picks_the_newest_python_that_runs(fake_env):
    """TF 2.21 (the default stack): set-up creates its venv with the newest of Python 3.13,
    3.12, 3.11 that runs with venv and ensurepip. Stand-ins: python3.13 cannot import them
    (as Debian's without python3-venv), python3.12 can and reports 3.12.9, then fails to
    create the venv (so nothing is installed); the log line names the one picked."""
    env, bindir, _, tmp = fake_env
    for name, body in (("python3.13", "exit 1\n"),
                       ("python3.12", 'case "$*" in *"import sys"*) echo "Python 3.12.9";;\n'
                                      '  *"-m venv"*) echo "stand-in: no venv" >&2; exit 3;;\n'
                                      'esac\nexit 0\n')):
        path = bindir / name
        path.write_text("#!/usr/bin/env bash\n" + body)
        path.chmod(0o755)
    venv = tmp / "new-venv"
    env.update(VENV=str(venv), PYENV_ROOT=str(tmp / "no-pyenv"))
    env.pop("PYTHON", None)
    env.pop("FLOWPM_MTF_STACK", None)
    proc = subprocess.run(["bash", os.path.join(REPO, "scripts", "setup_env.sh")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 3, proc.stderr
    assert "creating %s (tf2.21 stack, Python 3.12.9)" % venv in proc.stderr, proc.stderr
    assert not venv.exists()


def test_stack_names_venvs_and_requirements():
    """FLOWPM_MTF_STACK: tf2.21 by default (.venv, requirements.txt), tf2.12 the previous
    one (.venv-tf2.12, requirements-tf2.12.txt, which exists); another value: one line,
    exit 2."""
    def run(value):
        env = {k: v for k, v in os.environ.items() if k != "FLOWPM_MTF_STACK"}
        if value is not None:
            env["FLOWPM_MTF_STACK"] = value
        return subprocess.run(["bash", "-c", "source scripts/launch_lib.sh; stack_name && "
                               "stack_venv /r && stack_requirements /r"], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=60)
    assert run(None).stdout.split() == ["tf2.21", "/r/.venv", "/r/requirements.txt"]
    assert run("tf2.12").stdout.split() == ["tf2.12", "/r/.venv-tf2.12",
                                            "/r/requirements-tf2.12.txt"]
    for f in ("requirements.txt", "requirements-tf2.12.txt"):
        assert os.path.exists(os.path.join(REPO, f))
    with open(os.path.join(REPO, "requirements.txt")) as f:
        assert "tensorflow-cpu==2.21.0\n" in f.read()
    bad = run("tf2.13")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip() == "FLOWPM_MTF_STACK must be tf2.21 or tf2.12, got 'tf2.13'"


@pytest.mark.parametrize("command", ["simulate", "fft-demo", "lensing", "reconstruct",
                                     "imaging"])
def test_launchers_run_every_job(command):
    """run_mpirun.sh / run_horovodrun.sh dispatch through launch_lib.sh's exec_subcommand:
    every job of flowpm-mtf is launched (under a stand-in launcher, echo), with NC, GRID,
    OUT and the extra arguments in place."""
    script = ('source scripts/launch_lib.sh; NC=16 GRID=2x1 exec_subcommand /v %s /o echo -- --x 1'
              % command)
    out = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["/v/bin/flowpm-mtf", command, "--nc", "16", "--grid", "2x1",
                                  "--out", "/o", "--x", "1"]


def test_launchers_refuse_an_unknown_command():
    out = subprocess.run(["bash", "-c", "source scripts/launch_lib.sh; "
                          "exec_subcommand /v simulat /o echo --"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip() == ("unknown COMMAND=simulat (simulate, fft-demo, lensing, "
                                  "reconstruct, imaging or bench)")
