"""The FFT demo: a distributed 3D r2c/c2r round trip checked against ``numpy.fft``.

``flowpm-mtf fft-demo``. Writes ``fft_demo.json`` (errors and timings) and
``summary.json``; raises ``RuntimeError`` when the error exceeds the dtype's
tolerance.
"""
import dataclasses
import logging

import numpy as np

from ..runs import preflight, writers
from .. import layout
from ..config import SimConfig
from ..logs import rank0_only
from . import register
from .base import ConfigSection, Job

__all__ = ["FftDemoOptions", "FftDemoJob", "TOLERANCE"]

log = rank0_only(logging.getLogger(__name__))

TOLERANCE = {"float64": 1e-10, "float32": 1e-4}
"""Largest accepted relative error against numpy per dtype (round-off with margin)."""


@dataclasses.dataclass(frozen=True)
class FftDemoOptions:
    """Settings of the FFT demo.

    Parameters
    ----------
    repeats : int
        Timed round trips (the median is reported), >= 1.
    """

    repeats: int = 5

    def __post_init__(self):
        if isinstance(self.repeats, bool) or int(self.repeats) < 1:
            raise ValueError("repeats must be an integer >= 1, got %r" % (self.repeats,))
        object.__setattr__(self, "repeats", int(self.repeats))

    def to_dict(self):
        """A JSON-able dict."""
        return dataclasses.asdict(self)


@register
class FftDemoJob(Job):
    """Distributed FFT round trip vs numpy.fft."""

    name = "fft-demo"
    help = "distributed FFT round trip checked against numpy"
    sections = (ConfigSection("config", SimConfig, {"dtype": "float64"}),
                ConfigSection("fft_demo", FftDemoOptions))
    default_out = "out/fft-demo"

    def preflight(self, ctx):
        # Every rank holds the full-size numpy reference (field, FFT and copies): refused
        # before any allocation if it does not fit (the CLI checks no memory for this job).
        preflight.check_job_memory(ctx, preflight.fft_demo_memory(ctx.conf), particles=False)

    def build(self, ctx, mesh):
        from ..mesh import fft, noise

        conf = ctx.conf
        # Generated in the graph slice by slice (a full-size constant would hit the 2 GB
        # graph limit); the numpy reference is the bit-identical white_noise_numpy.
        x = noise.white_noise(mesh, fft.real_shape(conf), conf.seed, conf.tf_dtype,
                              name="fft_demo_field")
        field_np = noise.white_noise_numpy(conf.seed, conf.nc, conf.np_dtype)
        k = fft.r2c(x, conf)
        return {"field": field_np, "k": k, "back": fft.c2r(k, conf)}

    def lower(self, ctx, g, lowering):
        import tensorflow.compat.v1 as tf

        from . import runner

        # Each process checks its own slices (no gather); timed op: the round trip.
        return {"slices": runner.local(lowering, {"k": g["k"], "back": g["back"]}),
                "round_trip": tf.group(lowering.tensors[g["back"]].to_laid_out_tensor()
                                       .tensor_list)}

    def execute(self, ctx, sess, g, ops):
        from .runner import median_time

        res = sess.run({n: [t for _, t, _ in sl] for n, sl in ops["slices"].items()})
        res["slices"] = ops["slices"]
        sess.run(ops["round_trip"])  # warm-up
        res["round_trip_s"] = median_time(lambda: sess.run(ops["round_trip"]),
                                          ctx.configs["fft_demo"].repeats)
        res["field"] = g["field"]
        return res

    def finish(self, ctx, res):
        conf, repeats = ctx.conf, ctx.configs["fft_demo"].repeats
        field = res["field"]
        # FlowPM's r2c normalisation, in the stored (mirror-pair) k order
        ref = layout.to_stored(np.fft.fftn(field) / field.size)
        def max_err(name, full):   # over this process's slices, then over the ranks
            local = max(float(np.max(np.abs(v - full[tuple(slice(b, b + n) for b, n in
                                                          zip(begin, v.shape))])))
                        for (_, _, begin), v in zip(res["slices"][name], res[name]))
            return max(ctx.comm.allgather(local))

        err_fwd = max_err("k", ref) / float(np.max(np.abs(ref)))
        err_rt = max_err("back", field) / float(np.max(np.abs(field)))
        res["result"] = {"nc": list(conf.nc), "grid": list(conf.grid),
                         "backend": ctx.backend.name, "dtype": conf.dtype,
                         "ranks": int(ctx.comm.size),
                         "max_rel_error_forward_vs_numpy": err_fwd,
                         "max_rel_error_round_trip": err_rt,
                         "graph_build_s": ctx.timings["graph_build_s"],
                         "round_trip_median_s": res["round_trip_s"], "repeats": repeats}
        log.info("FFT %s on grid %s (%s, %s): forward vs numpy max rel. error %.2e, round trip "
                 "%.2e; round trip %.1f ms (median of %d); graph build %.2f s",
                 "x".join(map(str, conf.nc)), "x".join(map(str, conf.grid)), ctx.backend.name,
                 conf.dtype, err_fwd, err_rt, 1e3 * res["round_trip_s"], repeats,
                 ctx.timings["graph_build_s"])
        return {"fft": res["result"]}

    def write(self, ctx, out, res, summary):
        writers.write_json(out.path("fft_demo.json"), res["result"], rank=0)

    def check(self, ctx, summary):
        err = max(summary["fft"]["max_rel_error_forward_vs_numpy"],
                  summary["fft"]["max_rel_error_round_trip"])
        tol = TOLERANCE[ctx.conf.dtype]
        if err > tol:
            raise RuntimeError("FFT error %.2e exceeds %.0e" % (err, tol))
