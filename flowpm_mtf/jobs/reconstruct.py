"""The reconstruction job: observe a truth, then Adam on the linear field.

``flowpm-mtf reconstruct`` (the method: :mod:`flowpm_mtf.gradients.reconstruct`). Makes a
truth from ``conf.seed``, observes its final density with Gaussian noise,
optimises from :math:`s = 0` and writes (rank 0):

reconstruction.h5
    ``truth``, ``reconstruction`` (linear fields at a = 1, [NX, NY, NZ]),
    ``observed`` (1 + delta), ``loss``, ``chi2``, ``prior`` per iteration
    (before each step, plus the final value); attributes: config, settings
    (JSON), versions (:func:`flowpm_mtf.runs.io.write_reconstruction`).
reconstruction.txt
    k [h/Mpc], r(k), T(k), number of modes.
summary.json
    Config, settings, ``loss``/``chi2``/``prior`` per iteration, r(k), T(k),
    timings [s], peak memory [MB].
reconstruction.png
    Slices of the true and reconstructed fields and the data; r(k), T(k), loss.

checkpoint/
    With ``--checkpoint-every K`` (iterations) or on SIGTERM
    (:mod:`flowpm_mtf.runs.checkpoint`): every rank's slices of the optimiser's
    whole state (:attr:`~flowpm_mtf.gradients.reconstruct.ReconstructionGraph.checkpoint_variables`:
    the field, Adam's moments and step count), the iteration count and the
    loss/chi2/prior history; the data are made again from the seed on
    ``--resume OUT``, which ends bit-identical to an uninterrupted run on the
    same process grid. Every reconstruction setting but ``log_every`` is in
    the checkpoint's config hash: a resume with another is refused.

Errors: ``ValueError`` at graph construction, on every rank (see
:class:`flowpm_mtf.gradients.reconstruct.ReconstructionGraph`);
``tf.errors.InvalidArgumentError`` if a trial field displaces particles beyond
the halo (:mod:`flowpm_mtf.physics.painting`), on every rank at once (lower the
learning rate or raise ``halo_size``).
"""
import logging
import time

import numpy as np

from ..runs import checkpoint, h5dist, io, preflight
from ..config import SimConfig
from ..logs import rank0_only
from ..gradients.reconstruct_config import ReconConfig
from . import register
from .base import ConfigSection, Job

__all__ = ["ReconstructJob", "reconstruction_plot"]

log = rank0_only(logging.getLogger(__name__))


@register
class ReconstructJob(Job):
    """Reconstruction of the initial field by gradient descent (module docstring)."""

    name = "reconstruct"
    help = "reconstruct the initial field by gradient descent"
    sections = (ConfigSection("config", SimConfig, {"nc": 32, "n_steps": 5}),
                ConfigSection("reconstruction", ReconConfig))
    default_out = "out/recon"
    checkpoints = True   # the optimiser's variables, the iteration count and the history
    loop_unit = "iteration"
    #: Every reconstruction setting changes the result but the logging interval.
    state_sections = {"reconstruction": ("log_every",)}

    def preflight(self, ctx):
        # the field variables, Adam's moments, the data and the gradient tape are in the
        # estimate (the simulation's terms alone are not)
        preflight.check_job_memory(ctx, preflight.reconstruct_memory(
            ctx.conf, ctx.configs["reconstruction"].forward,
            ctx.configs["reconstruction"].gradient))
        if ctx.resume:   # a checkpoint of another run is refused before any graph
            if ctx.run_dir is None:
                from ..errors import ResumeError

                raise ResumeError("--resume needs a run directory")
            checkpoint.verify_resume(ctx.run_dir.path, ctx.comm, _identity(ctx))

    def build(self, ctx, mesh):
        from ..gradients.reconstruct import ReconstructionGraph

        return ReconstructionGraph(ctx.conf, ctx.configs["reconstruction"], mesh)

    def describe(self, ctx, rg):
        conf, rconf = ctx.conf, ctx.configs["reconstruction"]
        return "mesh %s, grid %s, forward %s, %d iterations" % (
            "x".join(map(str, conf.nc)), "x".join(map(str, conf.grid)), rconf.forward,
            rconf.iterations)

    def lower(self, ctx, rg, lowering):
        from . import runner

        return {"iteration": rg.lower_iteration(lowering),
                # the fields: this process's slices only (no gather)
                "fields": runner.local(lowering, {"truth": rg.truth,
                                                  "reconstruction": rg.linear,
                                                  "observed": rg.observed}),
                "spectra": runner.replicated(lowering, {n: getattr(rg, n) for n in
                                                        ("k", "r", "transfer", "n_modes")}),
                # the optimiser's whole state: this process's slices, for checkpoints
                "state": runner.VariableSlices(lowering, rg.checkpoint_variables)}

    def execute(self, ctx, sess, rg, ops):
        conf, rconf, timings = ctx.conf, ctx.configs["reconstruction"], ctx.timings
        history = {"loss": [], "chi2": [], "prior": []}
        with ctx.timed("observe_s"):
            rg.observe(sess, ops["iteration"])   # the data, made again from the seed on a resume
        log.info("truth observed (noise %g, likelihood sigma %g) in %.2f s", rconf.noise,
                 rconf.likelihood_sigma, timings["observe_s"])
        first = 0
        if ctx.resume:
            with ctx.timed("restore_s"):
                first = _restore(ctx, sess, ops["state"], history)
            log.info("restored iteration %d/%d in %.2f s", first, rconf.iterations,
                     timings["restore_s"])
        t_opt = time.perf_counter()
        for i in range(first, rconf.iterations):
            vals = rg.iterate(sess, ops["iteration"])
            for n in history:
                history[n].append(float(vals[n]))
            if (i + 1) % rconf.log_every == 0 or i == first or i + 1 == rconf.iterations:
                log.info("iteration %d/%d: loss %.6g (chi2/N %.4g, prior/N %.4g), "
                         "%.3f s/iteration", i + 1, rconf.iterations, vals["loss"],
                         vals["chi2"] / conf.n_cells, vals["prior"] / conf.n_cells,
                         (time.perf_counter() - t_opt) / (i + 1 - first))
            ctx.after_step(i + 1, iteration=i + 1, total=rconf.iterations)
            _checkpoint_or_stop(ctx, sess, ops["state"], i + 1, history)
        timings["optimise_s"] = time.perf_counter() - t_opt
        timings["per_iteration_s"] = timings["optimise_s"] / max(1, rconf.iterations - first)
        with ctx.timed("fetch_s"):
            fields = {n: [t for _, t, _ in sl] for n, sl in ops["fields"].items()}
            res = sess.run({**fields, **ops["spectra"]})
            res["final"] = rg.evaluate(sess, ops["iteration"], cosmology=True)
        res["history"] = history
        res["slices"] = ops["fields"]
        return res

    def finish(self, ctx, res):
        rconf = ctx.configs["reconstruction"]
        history = res["history"]
        for n in history:
            history[n].append(float(res["final"][n]))
        keep = res["n_modes"] > 0
        res["table"] = [res[n][keep] for n in ("k", "r", "transfer", "n_modes")]
        conf = ctx.conf
        res["parts"] = {}
        for name, sl in res["slices"].items():
            for (p, _, begin), value in zip(sl, res[name]):
                res["parts"].setdefault(p, {})[name] = h5dist.Block(value, begin, conf.nc)
        res["depth"] = depth = max(1, conf.nc[2] // 8)
        res["slabs"] = {name: h5dist.gather_slab(
            ctx.comm, [(v[:, :, :depth].mean(axis=2), b[:2]) for (_, _, b), v in
                       zip(sl, res[name])], conf.nc[:2]) for name, sl in res["slices"].items()}
        k, r, tk, _ = res["table"]
        # the adjoint's d loss / d cosmology at the final field (the data term; see
        # ReconstructionGraph.evaluate)
        cosmology = {n[len("d_loss_d_"):]: v for n, v in res["final"].items()
                     if n.startswith("d_loss_d_")}
        return {"likelihood_sigma": rconf.likelihood_sigma, "loss": history["loss"],
                **({"cosmology_gradient": cosmology} if cosmology else {}),
                "chi2": history["chi2"], "prior": history["prior"],
                "k": k.tolist(), "r": r.tolist(), "transfer": tk.tolist()}

    def write_all(self, ctx, res):
        io.write_reconstruction(ctx.file("reconstruction.h5"), ctx.comm, ctx.conf,
                                ctx.configs["reconstruction"], res["parts"], res["history"])

    def write(self, ctx, out, res, summary):
        conf, rconf = ctx.conf, ctx.configs["reconstruction"]
        io.write_reconstruction_table(out.path("reconstruction.txt"), conf, rconf,
                                      *res["table"], rank=0)

    def plot(self, ctx, out, res, summary):
        k, r, tk, _ = res["table"]
        slabs = res["slabs"]
        reconstruction_plot(out.path("reconstruction.png"), ctx.conf, slabs["truth"],
                            slabs["reconstruction"], slabs["observed"], k, r, tk,
                            res["history"]["loss"], res["depth"])

    def report(self, ctx, summary):
        return "loss %.4g -> %.4g in %d iterations (%.3f s/iteration), " % (
            summary["loss"][0], summary["loss"][-1], ctx.configs["reconstruction"].iterations,
            ctx.timings["per_iteration_s"])


def _identity(ctx):
    """:func:`flowpm_mtf.runs.checkpoint.identity` of a reconstruction (no stages: iterations)."""
    return checkpoint.identity(ctx.job.name, ctx.configs, (),
                               sections=ctx.job.state_sections,
                               total=ctx.configs["reconstruction"].iterations)


def _configs_dict(ctx):
    return {key: cfg.to_dict() for key, cfg in ctx.configs.items()}


def _restore(ctx, sess, state, history):
    """Assign the newest valid checkpoint to the optimiser's variables; returns its iteration.

    Every rank reads its own slices (:func:`flowpm_mtf.runs.checkpoint.load`); the
    loss history before it goes into ``history``. The checkpoint holds no
    outputs (the job writes them at the end).
    """
    manifest, _, values = checkpoint.load(ctx.run_dir.path, ctx.comm, ctx.conf, None,
                                          ident=_identity(ctx), fields=state.requests())
    state.restore(sess, values)
    saved = manifest.get("loop", {}).get("history", {})
    for n in history:
        history[n][:] = [float(v) for v in saved.get(n, [])]
    step = int(manifest["step"])
    if any(len(v) != step for v in history.values()):
        from ..errors import ResumeError

        raise ResumeError("%s holds a loss history of %s values for %d iterations; start a new "
                          "run with --overwrite" % (checkpoint.step_dir(ctx.run_dir.path, step),
                                                    [len(v) for v in history.values()], step))
    return step


def _checkpoint_or_stop(ctx, sess, state, done, history):
    """After ``done`` iterations: checkpoint every K iterations or on an agreed stop request.

    Collective (every rank, the same iteration). Not after the last
    iteration: the run then writes its outputs.

    Raises
    ------
    runner.Stopped
        On every rank, after the checkpoint, when the ranks agreed on a stop
        request (SIGTERM).
    """
    from . import runner

    total = ctx.configs["reconstruction"].iterations
    stop = ctx.stop is not None and done < total and ctx.stop.agreed()   # collective
    every = ctx.checkpoint_every
    path = None
    if done < total and ctx.run_dir is not None and (stop or (every and done % every == 0)):
        t = time.perf_counter()
        path = checkpoint.save(ctx.run_dir.path, ctx.comm, done, None, _configs_dict(ctx), {},
                               grid=ctx.conf.grid, ident=_identity(ctx),
                               extra={"loop": {"history": {n: list(v)
                                                           for n, v in history.items()}}},
                               fields=state.fetch(sess))
        ctx.timings.setdefault("checkpoint_s", []).append(time.perf_counter() - t)
    if stop:
        if path is None:  # no run directory: nothing to continue from
            raise runner.Stopped(done, total, unit="iteration")
        log.warning("stopped by signal after iteration %d/%d; checkpoint in %s; continue "
                    "with: %s", done, total, path,
                    checkpoint.resume_command(ctx.run_dir.path, ctx.job.name))
        raise runner.Stopped(done, total, checkpoint=path, unit="iteration")


def reconstruction_plot(path, conf, truth, recon, observed, k, r, tk, loss, depth):
    """Slabs of the true and reconstructed linear fields and the data; r(k), T(k), loss.

    ``truth``, ``recon``, ``observed`` are ``[NX, NY]`` means over the first
    ``depth`` cells along z (:func:`flowpm_mtf.runs.h5dist.gather_slab`: only these
    2D slabs are gathered).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(13, 8))
    ext = [0, conf.box_size[0], 0, conf.box_size[1]]
    vmax = float(np.abs(truth).max())
    for ax, field, title in ((axes[0, 0], truth, "true linear field"),
                             (axes[0, 1], recon, "reconstructed linear field")):
        ax.imshow(field.T, origin="lower", cmap="RdBu_r",
                  vmin=-vmax, vmax=vmax, extent=ext)
        ax.set_title("%s (slab of %d cells)" % (title, depth))
        ax.set_xlabel("x [Mpc/h]")
        ax.set_ylabel("y [Mpc/h]")
    axes[0, 2].imshow(np.log10(np.maximum(observed, 1e-2)).T,
                      origin="lower", cmap="magma", extent=ext)
    axes[0, 2].set_title("observed log10(1+delta), a=%.2f" % conf.a_end)
    axes[1, 0].semilogx(k, r, "o-", ms=3)
    axes[1, 0].axhline(1.0, color="k", lw=0.5)
    axes[1, 0].set_ylim(min(0.0, float(np.min(r))), 1.05)
    axes[1, 0].set_xlabel("k [h/Mpc]")
    axes[1, 0].set_ylabel("r(k)")
    axes[1, 0].set_title("cross-correlation, reconstructed vs true")
    axes[1, 1].semilogx(k, tk, "o-", ms=3)
    axes[1, 1].axhline(1.0, color="k", lw=0.5)
    axes[1, 1].set_xlabel("k [h/Mpc]")
    axes[1, 1].set_ylabel("T(k)")
    axes[1, 1].set_title("transfer function sqrt(P_r / P_t)")
    axes[1, 2].semilogy(np.arange(len(loss)), loss)
    axes[1, 2].set_xlabel("iteration")
    axes[1, 2].set_ylabel("(chi2 + prior) / N")
    axes[1, 2].set_title("loss")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
