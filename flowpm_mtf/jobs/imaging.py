"""The imaging job: a 3D MRI reconstruction with the image split over the ranks (issue 29).

``flowpm-mtf imaging`` (the methods: :mod:`mri_mtf`). Makes the Shepp-Logan phantom
(``--nc``), or reads a brain (``--volume mni152`` or a NIfTI file, each rank its slab:
:mod:`mri_mtf.volume`), measures it (variable-density mask of acceleration
``--acceleration``, complex noise ``--noise``; :mod:`mri_mtf.sampling`; with ``--coils N``
> 1, N birdcage coils and SENSE, :mod:`mri_mtf.sense`) and reconstructs it with each
``--method`` (comma-separated, or ``all``):

zero-filled
    ``|A^H y|`` (:func:`mri_mtf.recon.zero_filled`); with coils the root-sum-of-squares
    (:meth:`mri_mtf.sense.Sense.rss`).
tv
    Total variation by ADMM (:class:`mri_mtf.recon.SteppedTV`); with coils TV-SENSE by
    PDHG (:class:`mri_mtf.tv_sense.SteppedTVSense`): one lowered iteration run
    ``--tv-iterations`` times, the state in Mesh TF variables.
unrolled
    The unrolled network (:mod:`mri_mtf.unrolled`) trained for ``--train-steps`` Adam
    steps on perturbed phantoms (a brain: shifted, scaled copies of its training part,
    :mod:`mri_mtf.augment`), then applied to the measurement.

Outputs (run directory):

imaging.h5
    ``truth`` and one magnitude volume per method ``[NX, NY, NZ]``, written by every
    rank (its blocks; :func:`flowpm_mtf.runs.io.write_imaging`), ``train_loss``.
metrics.md
    PSNR [dB] and SSIM per method (a brain: in its mask, and in the mask's held-out part).
summary.json
    Configs, ``psnr_db`` and ``ssim`` per method (a brain: also ``psnr_db_heldout``,
    ``ssim_heldout``), the training loss, timings [s], peak
    memory per rank [MB].
imaging.png
    The three orthogonal mid-slices of the truth and of each reconstruction (only
    those planes are gathered).

checkpoint/
    With ``--checkpoint-every K`` (training steps) or on SIGTERM: every rank's
    slices of the weights and Adam's state, the step count and the loss history;
    ``--resume OUT`` recomputes the data, zero-filled and TV, and continues the
    training, ending bit-identical to an uninterrupted run on the same grid.

SIGTERM to the ranks is acted on at the next phase boundary all ranks agree on: after
the data, the zero-filled reconstruction, every TV iteration and every training step.
Before the training's first step a run with a training writes the checkpoint of its
initial weights (step 0) and exits 0 (without a training, or a run directory: exit 8,
nothing written); during the training it checkpoints as above; after the last loop
the evaluation and the outputs finish (exit 0). ``--train-steps 0`` evaluates the
initial network and labels it ``unrolled (untrained)`` (log, metrics.md, figure;
``summary["untrained"]``).

Bad input (a grid that does not divide the volume, an impossible R, an unknown
method, a volume smaller than the SSIM window, a filter that does not fit the volume
or the halo, counts beyond their bounds, ``--coils 0``, a missing or non-3D NIfTI file, a
file smaller than ``--nc``: exit 2) and an estimated peak memory beyond the node's
(:mod:`mri_mtf.memory`, exit 4) are one ``flowpm-mtf: error:`` line before anything is
built or created.
"""
import dataclasses
import logging
import time

import numpy as np

from ..runs import checkpoint, h5dist, io, writers
from ..logs import rank0_only
from . import register
from .base import ConfigSection, Job

__all__ = ["METHODS", "ImagingOptions", "ImagingJob", "imaging_plot"]

log = rank0_only(logging.getLogger(__name__))

METHODS = ("zero-filled", "tv", "unrolled")
"""The reconstruction methods, in the order they run."""

_KEYS = {"zero-filled": "zero_filled", "tv": "tv", "unrolled": "unrolled"}


@dataclasses.dataclass(frozen=True)
class ImagingOptions:
    """What the imaging job runs.

    Parameters
    ----------
    method : str
        Comma-separated reconstruction methods among zero-filled, tv, unrolled, or
        all.
    """

    method: str = "all"

    def __post_init__(self):
        if not isinstance(self.method, str):
            raise ValueError("method must be a string, got %r" % (self.method,))
        names = [m.strip() for m in self.method.split(",") if m.strip()]
        bad = [m for m in names if m not in METHODS + ("all",)]
        if bad or not names:
            raise ValueError("unknown method %r: choose from %s, or all (comma-separated)"
                             % (",".join(bad) if bad else self.method, ", ".join(METHODS)))

    @property
    def methods(self):
        """The methods to run, in :data:`METHODS` order."""
        names = {m.strip() for m in self.method.split(",")}
        return METHODS if "all" in names else tuple(m for m in METHODS if m in names)

    def to_dict(self):
        """A JSON-able dict."""
        return dataclasses.asdict(self)


def _sections():
    from mri_mtf.config import ImagingConfig, TVConfig, UnrolledConfig

    return (ConfigSection("config", ImagingConfig),
            ConfigSection("imaging", ImagingOptions),
            ConfigSection("tv", TVConfig),
            ConfigSection("unrolled", UnrolledConfig))


class _Graph:
    """The job's Mesh TF graph (see :meth:`ImagingJob.build`)."""

    def __init__(self, ctx, mesh):
        import mesh_tensorflow as mtf
        import tensorflow.compat.v1 as tf

        from mri_mtf import augment, metrics, operators, phantom, recon, sampling, unrolled
        from mri_mtf import sense, tv_sense, volume
        from ..mesh import complex_ops
        from hvd_mesh_impl.slice_init import unfolded_zeros_initializer

        conf = ctx.conf
        self.methods = ctx.configs["imaging"].methods
        uconf = ctx.configs["unrolled"]
        zeros = unfolded_zeros_initializer()
        self.raw = None
        if conf.volume == "phantom":
            self.truth = phantom.phantom(mesh, conf)
        else:
            # the resampled volume, each rank's slab assigned from its file block (execute)
            self.raw = mtf.get_variable(mesh, "volume_raw", operators.image_shape(conf),
                                        dtype=conf.tf_dtype, initializer=zeros,
                                        trainable=False)
            self.truth = self.raw / mtf.reduce_max(self.raw)
        mask = sampling.mask(mesh, conf)
        if conf.coils > 1:
            op = sense.Sense(mesh, conf, conf.coils, mask)
            measured = op.measure(self.truth)
        else:
            op = unrolled.SingleCoil(conf, mask)
            measured = operators.forward(self.truth, mask, conf) + complex_ops.apply_kernel(
                sampling.complex_noise(mesh, conf), mask, name="noise_mask")
        # the data in a variable (real, imaginary parts): TV's steps read it
        kvar = mtf.get_variable(mesh, "kdata", mtf.Shape(op.kspace_shape.dims
                                                         + [operators.CHAN]),
                                dtype=conf.tf_dtype, initializer=zeros, trainable=False)
        self.observe_op = mtf.assign(kvar, operators.to_channels(measured), name="observe")
        kdata = operators.to_complex(kvar, name="kdata_read")
        self.images = {"truth": self.truth}
        self.tv = self.training = None
        if "zero-filled" in self.methods:
            self.images["zero_filled"] = (op.rss(kdata, name="zero_filled") if conf.coils > 1
                                          else recon.zero_filled(kdata, mask, conf))
        if "tv" in self.methods:
            self.tv = (tv_sense.SteppedTVSense(kdata, op, ctx.configs["tv"]) if conf.coils > 1
                       else recon.SteppedTV(kdata, mask, conf, ctx.configs["tv"]))
            self.images["tv"] = operators.magnitude(self.tv.x, name="tv_magnitude")
        if "unrolled" in self.methods:
            weights = unrolled.make_weights(mesh, conf, uconf)
            source = (None if self.raw is None
                      else augment.VolumeAugmentation(self.truth, conf, uconf.data_seed))
            if uconf.train_steps:
                self.training = unrolled.UnrolledTraining(mesh, conf, uconf, mask, weights,
                                                          op=op, source=source)
            out = unrolled.network(kdata, mask, weights, conf, uconf, name="net", op=op)
            self.images["unrolled"] = unrolled.channel_magnitude(out, name="net_magnitude")
        # metrics: the whole volume (phantom), or the brain mask and its held-out part
        regions = {"": None}
        if self.raw is not None:
            brain = mtf.cwise(lambda t: tf.cast(t > volume.BRAIN_THRESHOLD, t.dtype),
                              [self.truth], name="brain_mask")
            regions = {"": brain, "_heldout": brain * augment.heldout_mask(
                mesh, conf, conf.tf_dtype, name="heldout_mask")}
        self.metrics = {}
        for m in self.methods:
            img, k = self.images[_KEYS[m]], _KEYS[m]
            self.metrics[m] = {}
            for suffix, w in regions.items():
                self.metrics[m]["psnr_db" + suffix] = metrics.psnr(
                    img, self.truth, name="psnr%s_%s" % (suffix, k), weights=w)
                self.metrics[m]["ssim" + suffix] = metrics.ssim(
                    img, self.truth, name="ssim%s_%s" % (suffix, k), weights=w)


@register
class ImagingJob(Job):
    """3D MRI reconstruction (zero-filled, TV, unrolled network) with the image split."""

    name = "imaging"
    help = "3D MRI reconstruction with the image split over the ranks (zero-filled, TV, network)"
    sections = _sections()
    default_out = "out/imaging"
    checkpoints = True   # the training's weights, Adam's state, the step count, the losses
    loop_unit = "training step"
    #: The training's state depends on the network and training settings (and the
    #: volume, mask and noise of "config"), not on the logging interval.
    state_sections = {"unrolled": ("log_every",)}

    def preflight(self, ctx):
        from mri_mtf import metrics, unrolled

        conf, uconf = ctx.conf, ctx.configs["unrolled"]
        methods = ctx.configs["imaging"].methods
        if conf.volume != "phantom":
            from mri_mtf.volume import VolumeSource

            try:
                VolumeSource(conf.volume, conf.nc)   # header only: file, 3D, size
            except FileNotFoundError as e:
                raise ValueError(str(e))
        tv = ctx.configs["tv"]
        if "tv" in methods and conf.coils == 1 \
                and tv.norm != "isotropic":
            raise ValueError("--tv-norm %s needs --coils >= 2 (the single-coil ADMM is "
                             "isotropic)" % tv.norm)
        if min(conf.nc) < metrics.SSIM_WINDOW:
            raise ValueError("nc=%s is too small: SSIM needs at least %d voxels per axis"
                             % (conf.nc, metrics.SSIM_WINDOW))
        if "unrolled" in methods:
            unrolled.check_kernel_fits(conf, uconf)
        _check_memory(ctx, methods)
        if ctx.resume:
            if ctx.run_dir is None:
                from ..errors import ResumeError

                raise ResumeError("--resume needs a run directory")
            checkpoint.verify_resume(ctx.run_dir.path, ctx.comm, _identity(ctx))

    def build(self, ctx, mesh):
        return _Graph(ctx, mesh)

    def describe(self, ctx, g):
        conf = ctx.conf
        return "%s %s, %d coil(s), grid %s, R=%g, methods %s" % (
            conf.volume, "x".join(map(str, conf.nc)), conf.coils,
            "x".join(map(str, conf.grid)), conf.acceleration, ",".join(g.methods))

    def lower(self, ctx, g, lowering):
        from . import runner

        ops = {"observe": lowering.lowered_operation(g.observe_op),
               "volume": (None if g.raw is None
                          else runner.VariableSlices(lowering, {"volume": g.raw})),
               "metrics": {m: runner.replicated(lowering, v) for m, v in g.metrics.items()},
               "images": runner.local(lowering, g.images),
               "owned": _owned(lowering, g.images)}
        if g.tv is not None:
            ops["tv_init"] = runner.lowered_group(lowering, g.tv.init_ops)
            ops["tv_step"] = runner.lowered_group(lowering, g.tv.step_ops)
        if g.training is not None:
            ops["train"] = g.training.lower(lowering)
            ops["state"] = runner.VariableSlices(lowering, g.training.checkpoint_variables)
        return ops

    def execute(self, ctx, sess, g, ops):
        conf, timings = ctx.conf, ctx.timings
        res = {"metrics": {}, "loss": []}
        # SIGTERM: every phase ends at a boundary where the ranks agree on a stop request
        # (_stop_point); after the last loop only the evaluation and the outputs are left,
        # and the run finishes (exit 0), as the other jobs after their last step.
        if ops["volume"] is not None:
            with ctx.timed("read_volume_s"):
                _read_volume(ctx, sess, ops["volume"])
        with ctx.timed("observe_s"):
            sess.run(ops["observe"])
        _stop_point(ctx, sess, g, ops, "the data", last=not (
            "zero-filled" in g.methods or g.tv is not None or g.training is not None))
        if "zero-filled" in g.methods:
            with ctx.timed("zero_filled_s"):
                res["metrics"]["zero-filled"] = sess.run(ops["metrics"]["zero-filled"])
            _log_metrics("zero-filled", res["metrics"]["zero-filled"])
            _stop_point(ctx, sess, g, ops, "the zero-filled reconstruction",
                        last=g.tv is None and g.training is None)
        if g.tv is not None:
            n = ctx.configs["tv"].iterations
            t = time.perf_counter()
            sess.run(ops["tv_init"])
            for i in range(n):
                sess.run(ops["tv_step"])
                _stop_point(ctx, sess, g, ops, "TV iteration %d/%d" % (i + 1, n),
                            last=i + 1 == n and g.training is None)
            timings["tv_s"] = time.perf_counter() - t
            timings["tv_per_iteration_s"] = timings["tv_s"] / n
            res["metrics"]["tv"] = sess.run(ops["metrics"]["tv"])
            _log_metrics("tv", res["metrics"]["tv"], "%d %s iterations, %.3f s/iteration"
                         % (n, "PDHG (TV-SENSE)" if conf.coils > 1 else "ADMM",
                            timings["tv_per_iteration_s"]))
        if "unrolled" in g.methods:
            if g.training is not None:
                self._train(ctx, sess, g, ops, res["loss"])
                if ctx.stop is not None:
                    ctx.stop.finished = True   # evaluation and outputs: the run finishes
            with ctx.timed("unrolled_eval_s"):
                res["metrics"]["unrolled"] = sess.run(ops["metrics"]["unrolled"])
            _log_metrics("unrolled", res["metrics"]["unrolled"], None if g.training else
                         "untrained: --train-steps 0, the initial weights")
        with ctx.timed("fetch_s"):
            sl = ops["images"]
            vals = sess.run({n: [t for _, t, _ in s] for n, s in sl.items()})
        res["parts"], res["planes"] = {}, {}
        for name, s in sl.items():
            for (p, _, begin), value in zip(s, vals[name]):
                if p in ops["owned"][name]:
                    res["parts"].setdefault(p, {})[name] = h5dist.Block(value, begin, conf.nc)
            res["planes"][name] = _mid_planes(ctx.comm, conf.nc, [(b, v) for (_, _, b), v in
                                                                   zip(s, vals[name])])
        return res

    def _train(self, ctx, sess, g, ops, history):
        uconf = ctx.configs["unrolled"]
        first = 0
        if ctx.resume:
            with ctx.timed("restore_s"):
                first = _restore(ctx, sess, ops["state"], history)
            log.info("restored training step %d/%d in %.2f s", first, uconf.train_steps,
                     ctx.timings["restore_s"])
        t0 = time.perf_counter()
        for i in range(first, uconf.train_steps):
            history.append(g.training.step(sess, ops["train"], i))
            if (i + 1) % uconf.log_every == 0 or i == first or i + 1 == uconf.train_steps:
                log.info("training step %d/%d: loss %.6g, %.3f s/step", i + 1,
                         uconf.train_steps, history[-1],
                         (time.perf_counter() - t0) / (i + 1 - first))
            ctx.after_step(i + 1, iteration=i + 1, total=uconf.train_steps)
            _checkpoint_or_stop(ctx, sess, ops["state"], i + 1, history)
        ctx.timings["train_s"] = time.perf_counter() - t0
        ctx.timings["train_per_step_s"] = ctx.timings["train_s"] / max(
            1, uconf.train_steps - first)

    def finish(self, ctx, res):
        m = {k: {n: float(v) for n, v in d.items()} for k, d in res["metrics"].items()}
        res["metrics"] = m
        out = {"methods": list(m), "psnr_db": {k: v["psnr_db"] for k, v in m.items()},
               "ssim": {k: v["ssim"] for k, v in m.items()}, "train_loss": list(res["loss"])}
        if "unrolled" in m:
            # --train-steps 0 evaluates the initial network: said, never silent
            out["untrained"] = ["unrolled"] if not ctx.configs["unrolled"].train_steps else []
        conf = ctx.configs["config"]
        if conf.volume != "phantom":
            from mri_mtf import augment

            out["metrics_region"] = "brain mask (normalised intensity > 0.2)"
            out["heldout"] = ("y >= %d (the last %g of the y planes; never in the network's "
                              "training images)" % (augment.heldout_start(conf),
                                                    augment.HELDOUT_FRACTION))
            out["psnr_db_heldout"] = {k: v["psnr_db_heldout"] for k, v in m.items()}
            out["ssim_heldout"] = {k: v["ssim_heldout"] for k, v in m.items()}
        return out

    def write_all(self, ctx, res):
        io.write_imaging(ctx.file("imaging.h5"), ctx.comm, ctx.configs, res["parts"],
                         res["loss"])

    def write(self, ctx, out, res, summary):
        conf = ctx.conf
        held = conf.volume != "phantom"
        rows = [(_label(k, summary), "%.2f" % v["psnr_db"], "%.4f" % v["ssim"])
                + (("%.2f" % v["psnr_db_heldout"], "%.4f" % v["ssim_heldout"]) if held else ())
                for k, v in res["metrics"].items()]
        title = ("flowpm-mtf imaging: %s %s, %d coil(s), grid %s, R = %g, noise sigma %g"
                 % (conf.volume, "x".join(map(str, conf.nc)), conf.coils,
                    "x".join(map(str, conf.grid)), conf.acceleration, conf.noise_sigma))
        head = ("method", "PSNR [dB]", "SSIM") + (
            ("PSNR held-out [dB]", "SSIM held-out") if held else ())
        writers.write_markdown_table(out.path("metrics.md"), head, rows, title=title, rank=0)

    def plot(self, ctx, out, res, summary):
        imaging_plot(out.path("imaging.png"), ctx.conf, res["planes"], res["metrics"],
                     untrained=summary.get("untrained", ()))

    def report(self, ctx, summary):
        return "PSNR %s, " % ", ".join("%s %.2f dB" % (_label(k, summary), v)
                                       for k, v in summary["psnr_db"].items())


def _label(method, summary):
    """The method's name in the tables and logs: ``unrolled (untrained)`` with
    ``--train-steps 0``."""
    return method + (" (untrained)" if method in summary.get("untrained", ()) else "")


def _check_memory(ctx, methods):
    """The imaging job's memory check (:mod:`mri_mtf.memory`), once per run, before the
    run directory exists: exit 4 with a configuration that fits (``--force`` skips)."""
    from mri_mtf import memory, unrolled
    from ..runs import preflight

    conf, uconf = ctx.conf, ctx.configs["unrolled"]
    memory.check_sizes(conf, uconf, methods)
    if getattr(ctx, "_imaging_memory_checked", False):
        return
    # the placement backend holds every block in this one process
    held = (conf.replace(grid=(1, 1), coil_split=1) if ctx.backend.name == "placement"
            else conf)
    fits = None if "unrolled" not in methods else (
        lambda c: unrolled.largest_kernel(c) >= uconf.kernel_size)
    subject = "model of mri_mtf/memory.py for %s on grid %s, %s%s" % (
        "x".join(map(str, conf.nc)), "x".join(map(str, conf.full_grid)), conf.dtype,
        ", %d channels, %d^3 filters, %d blocks" % (uconf.channels, uconf.kernel_size,
                                                     uconf.blocks)
        if "unrolled" in methods else "")
    preflight.check_estimate(memory.imaging_terms(held, uconf, methods), ctx.comm, subject,
                             memory.hint(held, uconf, methods, fits),
                             force=getattr(ctx, "force", False))
    memory.check_constants(conf, uconf, methods)
    ctx._imaging_memory_checked = True


def _owned(lowering, images):
    """The processors that write each image's blocks: the ranks of a coil split hold the
    same image blocks (every rank still fetches its own: the images' all-reduces over the
    coils are collective); the lowest one writes them."""
    from . import runner

    return {n: {p for p, _, _ in sl if h5dist.owns_slice(lowering.mesh_impl(images[n]),
                                                         images[n].shape, p)}
            for n, sl in runner.local(lowering, images).items()}


def _stop_point(ctx, sess, g, ops, where, last=False):
    """A phase boundary before the training: stop here if the ranks agree on SIGTERM.

    Collective (every rank, the same boundaries). ``last``: nothing but the evaluation
    and the outputs follow, so the run finishes instead (the signal is logged).

    Raises
    ------
    runner.Stopped
        With a checkpoint of the training before its first step (a fresh run; exit 0,
        ``--resume`` recomputes the data, zero-filled and TV and trains) or the newest
        one of a resumed run.
    StoppedError
        A run without a training to checkpoint or without a run directory (exit 8).
    """
    from . import runner

    if ctx.stop is None:
        return
    if last:
        ctx.stop.finished = True
        return
    if not ctx.stop.agreed():   # collective
        return
    total = ctx.configs["unrolled"].train_steps
    if g.training is None or ctx.run_dir is None:
        from ..errors import StoppedError

        why = ("no run directory to checkpoint into" if g.training is not None else
               "this run has no training to checkpoint (only the training checkpoints)")
        raise StoppedError("stopped by a signal after %s; %s: nothing was written, rerun the "
                           "same command to start over" % (where, why))
    if ctx.resume:   # its newest checkpoint stays the one to continue from
        path, manifest = checkpoint.candidates(ctx.run_dir.path)[0]
        done = int(manifest["step"])
    else:
        done, path = 0, checkpoint.save(
            ctx.run_dir.path, ctx.comm, 0, None, {k: c.to_dict() for k, c in ctx.configs.items()},
            {}, grid=ctx.conf.grid, ident=_identity(ctx), extra={"loop": {"loss": []}},
            fields=ops["state"].fetch(sess))
    log.warning("stopped by signal after %s, before training step %d/%d; checkpoint in %s; "
                "continue with: %s", where, done + 1, total, path,
                checkpoint.resume_command(ctx.run_dir.path, ctx.job.name))
    raise runner.Stopped(done, total, checkpoint=path, unit="training step")


def _log_metrics(method, values, extra=""):
    held = ("; held-out PSNR %.2f dB, SSIM %.4f" % (float(values["psnr_db_heldout"]),
                                                    float(values["ssim_heldout"]))
            if "psnr_db_heldout" in values else "")
    log.info("%s: PSNR %.2f dB, SSIM %.4f%s%s", method, float(values["psnr_db"]),
             float(values["ssim"]), held, (" (%s)" % extra) if extra else "")


def _read_volume(ctx, sess, slices):
    """Assign every local slice of the volume variable from its block of the file."""
    from mri_mtf.volume import VolumeSource

    src = VolumeSource(ctx.conf.volume, ctx.conf.nc)
    values = {}
    for p, t, begin in slices.slices["volume"]:
        values.setdefault(p, {})["volume"] = src.read(begin, t.shape.as_list())
    slices.restore(sess, values)


def _mid_planes(comm, nc, blocks):
    """The three orthogonal mid-planes of a split volume, on every rank.

    Parameters
    ----------
    blocks : list of (begin, ndarray)
        This process's blocks of the ``[NX, NY, NZ]`` volume.

    Returns
    -------
    dict
        ``"x"``: ``[NY, NZ]`` at ``x = NX // 2``; ``"y"``: ``[NX, NZ]``; ``"z"``:
        ``[NX, NY]``. Only these 2D planes travel (:func:`flowpm_mtf.runs.h5dist.gather_slab`).
    """
    out = {}
    for axis, name in enumerate("xyz"):
        mid = nc[axis] // 2
        keep = [a for a in range(3) if a != axis]
        mine = []
        for begin, v in blocks:
            if begin[axis] <= mid < begin[axis] + v.shape[axis]:
                plane = np.take(v, mid - begin[axis], axis=axis)
                mine.append((plane, (begin[keep[0]], begin[keep[1]])))
        out[name] = h5dist.gather_slab(comm, mine, (nc[keep[0]], nc[keep[1]]))
    return out


def _identity(ctx):
    """:func:`flowpm_mtf.runs.checkpoint.identity` of the training (no stages: steps)."""
    return checkpoint.identity(ctx.job.name, ctx.configs, (), sections=ctx.job.state_sections,
                               total=ctx.configs["unrolled"].train_steps)


def _restore(ctx, sess, state, history):
    """Assign the newest valid checkpoint to the training's variables; returns its step."""
    manifest, _, values = checkpoint.load(ctx.run_dir.path, ctx.comm, ctx.conf, None,
                                          ident=_identity(ctx), fields=state.requests())
    state.restore(sess, values)
    history[:] = [float(v) for v in manifest.get("loop", {}).get("loss", [])]
    step = int(manifest["step"])
    if len(history) != step:
        from ..errors import ResumeError

        raise ResumeError("%s holds %d training losses for %d steps; start a new run with "
                          "--overwrite" % (checkpoint.step_dir(ctx.run_dir.path, step),
                                           len(history), step))
    return step


def _checkpoint_or_stop(ctx, sess, state, done, history):
    """After ``done`` training steps: checkpoint every K steps or on an agreed stop request.

    Collective (every rank, the same step); not after the last step.

    Raises
    ------
    runner.Stopped
        On every rank, after the checkpoint, when the ranks agreed on a stop request.
    """
    from . import runner

    total = ctx.configs["unrolled"].train_steps
    stop = ctx.stop is not None and done < total and ctx.stop.agreed()   # collective
    every = ctx.checkpoint_every
    path = None
    if done < total and ctx.run_dir is not None and (stop or (every and done % every == 0)):
        t = time.perf_counter()
        path = checkpoint.save(ctx.run_dir.path, ctx.comm, done, None,
                               {k: c.to_dict() for k, c in ctx.configs.items()}, {},
                               grid=ctx.conf.grid, ident=_identity(ctx),
                               extra={"loop": {"loss": list(history)}},
                               fields=state.fetch(sess))
        ctx.timings.setdefault("checkpoint_s", []).append(time.perf_counter() - t)
    if stop:
        if path is None:
            raise runner.Stopped(done, total, unit="training step")
        log.warning("stopped by signal after training step %d/%d; checkpoint in %s; continue "
                    "with: %s", done, total, path,
                    checkpoint.resume_command(ctx.run_dir.path, ctx.job.name))
        raise runner.Stopped(done, total, checkpoint=path, unit="training step")


def imaging_plot(path, conf, planes, metrics, untrained=()):
    """The three orthogonal mid-slices of the truth and of each reconstruction.

    ``planes``: name -> ``{"x": [NY, NZ], "y": [NX, NZ], "z": [NX, NY]}``
    (:func:`_mid_planes`); ``metrics``: method -> ``{"psnr_db", "ssim"}``;
    ``untrained``: methods labelled "(untrained)".
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["truth"] + [_KEYS[m] for m in METHODS if m in metrics]
    titles = {"truth": "truth"}
    for m in metrics:
        titles[_KEYS[m]] = "%s%s\nPSNR %.2f dB, SSIM %.3f" % (
            m, " (untrained)" if m in untrained else "", metrics[m]["psnr_db"],
            metrics[m]["ssim"])
        if "psnr_db_heldout" in metrics[m]:   # a brain: in its mask, and its held-out part
            titles[_KEYS[m]] += "\nheld-out %.2f dB, %.3f" % (metrics[m]["psnr_db_heldout"],
                                                             metrics[m]["ssim_heldout"])
    vmax = max(float(planes["truth"][a].max()) for a in "xyz")
    fig, axes = plt.subplots(3, len(names), figsize=(3.2 * len(names), 9.5), squeeze=False)
    labels = {"x": ("y", "z"), "y": ("x", "z"), "z": ("x", "y")}
    for j, name in enumerate(names):
        for i, a in enumerate("xyz"):
            ax = axes[i, j]
            ax.imshow(planes[name][a].T, origin="lower", cmap="gray", vmin=0.0, vmax=vmax)
            ax.set_xticks([])
            ax.set_yticks([])
            if i == 0:
                ax.set_title(titles[name], fontsize=9)
            if j == 0:
                ax.set_ylabel("%s = %d (%s-%s plane)" % (a, conf.nc["xyz".index(a)] // 2,
                                                         *labels[a]))
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
