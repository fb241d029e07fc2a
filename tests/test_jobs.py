"""The job layer: options generated from the config dataclasses, --config, the time loop
with observers, the comm stand-in, the atomic-write path, quiet TensorFlow start-up."""
import argparse
import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from flowpm_mtf import backend, cli, jobs
from flowpm_mtf.runs import io
from flowpm_mtf.physics import timeloop
from flowpm_mtf.errors import ConfigError
from flowpm_mtf.jobs import options

pytestmark = pytest.mark.rank_independent

# argparse prints the default of every option into its help text.
DEFAULT_MARK = "(default: "


def _parse(argv):
    return cli.build_parser(jobs.all_jobs()).parse_args(argv)


def _configs(argv, config_file=None):
    args = _parse(argv)
    job = jobs.get(args.command)
    return options.make_configs(job, args, config_file, n_ranks=1, backend="placement")


def test_every_field_of_every_job_is_an_option_with_help_and_default():
    parser = cli.build_parser(jobs.all_jobs())
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, job in jobs.all_jobs().items():
        p = sub.choices[name]
        flags = {s: a for a in p._actions for s in a.option_strings}
        for sec in job.sections:
            for f in dataclasses.fields(sec.cls):
                nested = sec.default(f.name)
                fields = ([("--cosmo-" + g.name.replace("_", "-"), g)
                           for g in dataclasses.fields(nested)]
                          if dataclasses.is_dataclass(nested)
                          else [("--" + f.name.replace("_", "-"), f)])
                for flag, _ in fields:
                    assert flag in flags, (name, flag)
                    text = flags[flag].help
                    assert DEFAULT_MARK in text and len(text) > len(DEFAULT_MARK) + 20, \
                        (name, flag, text)


def test_job_defaults_defined_once_and_shown():
    lensing = jobs.get("lensing")
    sec = lensing.sections[0]
    assert sec.default("box_size") == 256.0 and sec.default("a_start") == 0.2
    assert sec.default("nc") == (64, 64, 64)            # the SimConfig default
    confs = _configs(["lensing"])
    assert confs["config"].box_size == (256.0,) * 3 and confs["lensing"].n_planes == 12
    assert _configs(["reconstruct"])["config"].nc == (32, 32, 32)
    assert _configs(["fft-demo"])["config"].dtype == "float64"


def test_box_size_three_values_a_end_and_aliases():
    confs = _configs(["simulate", "--box-size", "100,100,150", "--nc", "16,16,24",
                      "--a-end", "0.5", "--steps", "3", "--halo", "2"])
    conf = confs["config"]
    assert conf.box_size == (100.0, 100.0, 150.0) and conf.nc == (16, 16, 24)
    assert conf.a_end == 0.5 and conf.n_steps == 3 and conf.halo_size == 2
    with pytest.raises(ConfigError, match="--box-size"):  # one line on rank 0, no exit
        _parse(["simulate", "--box-size", "100,100"])


def test_config_file_sets_every_section_and_flags_win(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"nc": 16, "halo_size": 2, "z_source": [0.5, 1.0],
                                "lensing": {"n_planes": 6},
                                "cosmology": {"sigma8": 0.9}}))
    confs = _configs(["lensing", "--n-planes", "8", "--cosmo-h", "0.7"], str(path))
    assert confs["config"].nc == (16, 16, 16) and confs["config"].halo_size == 2
    assert confs["config"].box_size == (256.0,) * 3       # job default kept
    assert confs["config"].cosmology.sigma8 == 0.9 and confs["config"].cosmology.h == 0.7
    assert confs["lensing"].z_source == (0.5, 1.0) and confs["lensing"].n_planes == 8
    path.write_text(json.dumps({"iterations": 5, "reconstruction": {"noise": 0.0}}))
    rc = _configs(["reconstruct"], str(path))["reconstruction"]
    assert rc.iterations == 5 and rc.noise == 0.0
    path.write_text(json.dumps({"n_planes": 3}))
    with pytest.raises(ValueError, match="unknown key 'n_planes'"):
        _configs(["simulate"], str(path))


def test_bool_options_and_snapshot_list():
    assert _configs(["lensing", "--no-randomize"])["lensing"].randomize is False
    opts = _configs(["simulate", "--snapshots", "1.0,0.5", "--power-steps"])["simulate"]
    assert opts.snapshots == (0.5, 1.0) and opts.power_steps is True


def test_time_loop_calls_observers_after_every_step():
    seen = []
    stages = [0.1, 0.4, 0.7, 1.0]
    final = timeloop.integrate(0, stages, lambda s, i, a0, a1: s + 1,
                               [lambda j, a, s: seen.append((j, a, s))])
    assert final == 3
    assert seen == [(0, 0.1, 0), (1, 0.4, 1), (2, 0.7, 2), (3, 1.0, 3)]
    seen.clear()
    timeloop.integrate(1, stages, lambda s, i, a0, a1: s + 1,
                       [lambda j, a, s: seen.append(j)], first=1)
    assert seen == [1, 2, 3]


def test_merge_stages():
    reg = np.linspace(0.1, 1.0, 4)
    np.testing.assert_array_equal(timeloop.merge_stages(reg, [1.0, 0.4]), reg)
    merged = timeloop.merge_stages(reg, [0.5])
    assert merged.size == 5 and 0.5 in merged
    with pytest.raises(ValueError, match="outside the run"):
        timeloop.merge_stages(reg, [1.5])
    with pytest.raises(ValueError, match="not one of the stages"):
        timeloop.stage_indices([0.5], reg)


def test_serial_comm_has_the_mpi4py_lower_case_api():
    comm = backend.SerialComm()
    assert (comm.rank, comm.size) == (0, 1)
    assert comm.bcast(3) == 3 and comm.allgather(4) == [4] and comm.allreduce(5) == 5
    comm.barrier()


def test_atomic_path_keeps_the_old_file_on_failure(tmp_path):
    path = tmp_path / "f.txt"
    path.write_text("old")
    with pytest.raises(RuntimeError):
        with io.atomic_path(path) as tmp:
            open(tmp, "w").write("half")
            raise RuntimeError("killed")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["f.txt"]
    io.write_json(path, {"a": np.float32(1.5)}, rank=0)
    assert json.loads(path.read_text()) == {"a": 1.5}
    assert io.write_json(path, {}, rank=1) is None


@pytest.mark.single_process
def test_tensorflow_start_up_lines_shown_with_verbose(tmp_path):
    """--verbose shows TensorFlow's C++ start-up lines (hidden by default: checked on the
    2-rank fft-demo of tests/test_cli.py)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PMI_", "HOROVOD_", "TF_CPP"))}
    loud = subprocess.run([sys.executable, "-m", "flowpm_mtf.cli", "fft-demo", "--backend",
                           "placement", "--nc", "8", "--halo", "1", "--repeats", "1", "--dtype",
                           "float32", "--out", str(tmp_path / "v"), "--verbose"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert loud.returncode == 0, loud.stderr[-3000:]
    assert "cpu_feature_guard" in loud.stderr or "oneDNN" in loud.stderr, loud.stderr[-3000:]


@pytest.mark.parametrize("backend", ["hvd", "placement"])
def test_session_config_switches_grappler_off_unless_asked(backend, monkeypatch):
    """The jobs' sessions run without Grappler (its passes were most of the ICs' first
    run); FLOWPM_MTF_GRAPPLER=1 gives TensorFlow's default back."""
    from flowpm_mtf.backend import session_config

    monkeypatch.delenv("FLOWPM_MTF_GRAPPLER", raising=False)
    assert session_config(backend).graph_options.rewrite_options.disable_meta_optimizer
    monkeypatch.setenv("FLOWPM_MTF_GRAPPLER", "1")
    assert not session_config(backend).graph_options.rewrite_options.disable_meta_optimizer


def _folded(config):
    """Whether TF folded a constant subgraph into a constant when running it."""
    import tensorflow.compat.v1 as tf

    with tf.Graph().as_default():
        x = tf.cast(tf.range(1000), tf.float32) * 2.0 + 1.0
        md = tf.RunMetadata()
        with tf.Session(config=config) as sess:
            val = sess.run(x, options=tf.RunOptions(output_partition_graphs=True),
                           run_metadata=md)
    np.testing.assert_array_equal(val, np.arange(1000) * 2.0 + 1.0)
    ops = [n.op for g in md.partition_graphs for n in g.node]
    return "Range" not in ops and "Mul" not in ops   # folded into one Const


@pytest.mark.parametrize("backend", ["hvd", "placement"])
def test_session_config_switches_constant_folding_off_unless_asked(backend, monkeypatch):
    """The executor's constant folding (L1) held folded slice-size kernels and slowed the
    first run: off by default, back with FLOWPM_MTF_GRAPPLER=1."""
    from flowpm_mtf.backend import session_config

    monkeypatch.delenv("FLOWPM_MTF_GRAPPLER", raising=False)
    assert not _folded(session_config(backend))
    monkeypatch.setenv("FLOWPM_MTF_GRAPPLER", "1")
    assert _folded(session_config(backend))


def test_variables_initialised_one_by_one_in_graph_order(monkeypatch):
    """``runner.session`` initialises every variable, each in its own ``session.run`` in the
    order of ``tf.global_variables()`` (the allocation order of the state's initial values,
    which decides the reuse of their memory: :func:`runner.initialize_variables`)."""
    import tensorflow.compat.v1 as tf

    from flowpm_mtf.jobs import runner

    used = []
    one_by_one = runner.initialize_variables
    monkeypatch.setattr(runner, "initialize_variables",
                        lambda sess, variables=None: used.append(1) or one_by_one(sess, variables))
    with tf.Graph().as_default():
        vs = [tf.get_variable("v%d" % i, initializer=tf.fill([3 + i], float(i)),
                              use_resource=True) for i in range(4)]
        calls = []

        class Recorder:
            def run(self, fetches):
                calls.append(fetches)

        one_by_one(Recorder())
        assert calls == [v.initializer for v in tf.global_variables()]
        assert calls == [v.initializer for v in vs]
        with runner.session() as sess:
            assert used == [1]                   # the session initialised through it
            assert sess.run(tf.report_uninitialized_variables()).size == 0
            for i, v in enumerate(vs):
                np.testing.assert_array_equal(sess.run(v), np.full(3 + i, float(i)))


def test_peak_memory_survives_the_phase_resets():
    """The run's peak [MB] is kept across ``clear_refs`` resets of the kernel's counter
    (which also lower what ``ru_maxrss`` reports afterwards)."""
    from flowpm_mtf.jobs import runner

    if runner._phase_peak_mb() is None:
        pytest.skip("no /proc/self/status VmHWM on this system")
    base = runner.current_memory_mb()
    big = np.ones(300 * 2**20 // 8)   # 300 MB touched, then freed
    held = runner.current_memory_mb()
    del big
    runner._reset_phase_peak()
    assert runner._phase_peak_mb() < held - 200    # the counter was reset ...
    assert runner.peak_memory_mb() >= held - 1     # ... the peak was not lost
    assert held > base + 250


class _FakeJob:
    def __init__(self, checkpoints):
        self.name, self.checkpoints = "fake", checkpoints


def _stop_context(checkpoints, received):
    """A RunContext of a job, with a StopRequest that did (or did not) record a signal."""
    import signal
    import types

    from flowpm_mtf.runs import checkpoint
    from flowpm_mtf.config import SimConfig
    from flowpm_mtf.jobs import runner

    stop = checkpoint.StopRequest(backend.SerialComm())
    stop.received = signal.SIGTERM if received else None
    return runner.RunContext(_FakeJob(checkpoints), {"config": SimConfig(nc=8)},
                             types.SimpleNamespace(comm=backend.SerialComm()), None, False,
                             runner.Hooks(), stop=stop)


def test_sigterm_stops_a_job_that_does_not_checkpoint_at_a_step_boundary():
    """``Job.checkpoints = False``: the after-step check stops it (not after its last step); a
    job that checkpoints is left to its time loop (checkpoint, then stop)."""
    from flowpm_mtf.jobs import runner

    seen = []
    ctx = _stop_context(checkpoints=False, received=True)
    ctx.hooks.after_step.append(lambda c, i, info: seen.append(i))
    with pytest.raises(runner.Stopped) as stopped:
        ctx.after_step(5, a=0.5, total=14)
    assert seen == [5]   # the hooks ran first
    assert stopped.value.checkpoint is None and stopped.value.where == "step 5/14"
    with pytest.raises(runner.Stopped, match="after iteration 3"):
        ctx.after_step(3, iteration=3)
    ctx.after_step(14, a=1.0, total=14)                  # the last step: let it finish
    _stop_context(checkpoints=False, received=False).after_step(5, a=0.5, total=14)
    _stop_context(checkpoints=True, received=True).after_step(5, a=0.5, total=14)
    err = runner._not_resumable(_FakeJob(False), stopped.value)
    assert str(err) == ("stopped by a signal after step 5/14; fake cannot resume yet (it writes "
                        "no checkpoint): nothing was written, rerun the same command to start "
                        "over")
    assert err.exit_code == 8 and "--resume" not in str(err)


@pytest.mark.rank_independent
@pytest.mark.parametrize("writer", ["write_summary", "write_power"])
def test_disk_full_in_a_rank0_output_of_the_runner_is_exit_5(tmp_path, monkeypatch, writer):
    """A full disk while rank 0 writes an output (summary.json after the run, or a P(k) file
    during the loop) ends the job with OutputDirError (exit 5, one line) through the runner's
    collective write, not an OSError (exit 1) that would leave the other ranks waiting."""
    import errno

    import fpm_harness as H
    from flowpm_mtf.config import SimConfig
    from flowpm_mtf.errors import OutputDirError
    from flowpm_mtf.jobs import runner
    from flowpm_mtf.jobs.simulate import SimulateOptions

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(io, writer, full)
    conf = SimConfig(nc=8, box_size=50.0, grid=(1, 1), n_steps=1, dtype="float64")
    with pytest.raises(OutputDirError) as err:
        runner.run(jobs.get("simulate"),
                   {"config": conf, "simulate": SimulateOptions(power_steps=True)},
                   H.backend("placement", conf), str(tmp_path / "run"), plot=False)
    assert err.value.exit_code == 5
    assert "no space left on device" in str(err.value).lower() and "\n" not in str(err.value)
