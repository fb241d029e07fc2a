r"""Training images for the unrolled network from one volume, with a held-out part.

The volume (e.g. the MNI brain, ``[x, y, z]`` split over the ranks) is cut along ``y``:
the last :data:`HELDOUT_FRACTION` of its ``y`` planes (``y >= ny - ny // 4``, the
anterior brain, the frontal lobes, in the MNI orientation) is the *held-out part*; the
network never sees it in training, and the job reports every method's PSNR and SSIM in
the brain mask restricted to it (:func:`heldout_mask`).

Each training step (:class:`VolumeAugmentation`) shows the network the training part
(the held-out planes set to 0), circularly shifted by a random integer vector
``s`` (each component uniform in ``[-n/4, n/4]``: the training anatomy then also lies
where the held-out part is) and scaled by a random intensity ``a`` in ``[0.8, 1.2]``,
all drawn from ``(data_seed, step)``. The shift is applied in k-space, ``x_s = Re F^H
(e^{-2 pi i f . s} F x)`` (exact for integer shifts; the phase is three fed 1-D tables,
so one lowered graph serves every step and the shifted image is split like any image).
"""
import logging

import mesh_tensorflow as mtf
import numpy as np
import tensorflow.compat.v1 as tf

from flowpm_mtf import layout
from flowpm_mtf.layout import K_DIMS, REAL_DIMS
from flowpm_mtf.mesh import complex_ops

from . import operators

__all__ = ["HELDOUT_FRACTION", "heldout_start", "heldout_mask", "VolumeAugmentation",
           "augmentation_sample"]

log = logging.getLogger(__name__)

HELDOUT_FRACTION = 0.25
"""Share of the ``y`` planes held out of training (the last ones)."""


def heldout_start(conf):
    """First held-out ``y`` plane, ``ny - ny // 4``."""
    return conf.nc[1] - int(conf.nc[1] * HELDOUT_FRACTION)


def heldout_mask(mesh, conf, dtype, heldout=True, name="heldout"):
    """Real 0/1 ``[y]``: 1 on the held-out planes (or, ``heldout=False``, on the others)."""
    y0 = heldout_start(conf)
    i = mtf.range(mesh, mtf.Dimension(REAL_DIMS[1], conf.nc[1]), tf.int32, name=name + "_y")
    return mtf.cwise(lambda t: tf.cast((t >= y0) if heldout else (t < y0), dtype), [i],
                     output_dtype=dtype, name=name)


def augmentation_sample(step, seed, nc):
    """The shift ``s`` [voxels] and intensity scale of a training step (numpy)."""
    rng = np.random.default_rng([int(seed), int(step), 17])
    shift = np.array([rng.integers(-(n // 4), n // 4 + 1) for n in nc])
    return shift, float(rng.uniform(0.8, 1.2))


class VolumeAugmentation:
    """Shifted, scaled copies of a volume's training part (module docstring).

    Parameters
    ----------
    volume : mtf.Tensor
        Real ``[x, y, z]`` [image intensity].
    conf : ImagingConfig
    seed : int
        ``UnrolledConfig.data_seed``.
    """

    def __init__(self, volume, conf, seed, name="augment"):
        self.volume, self.conf, self.seed, self.name = volume, conf, seed, name
        dt = conf.np_dtype
        self.cos = [tf.placeholder(dt, (n,), name="%s_cos_%s" % (name, d))
                    for d, n in zip(K_DIMS, conf.nc)]
        self.sin = [tf.placeholder(dt, (n,), name="%s_sin_%s" % (name, d))
                    for d, n in zip(K_DIMS, conf.nc)]
        self.scale = tf.placeholder(dt, (), name=name + "_scale")

    def truth(self, mesh):
        """The fed training image ``a x_s`` ``[x, y, z]``."""
        conf, name = self.conf, self.name
        train = self.volume * heldout_mask(mesh, conf, self.volume.dtype, heldout=False,
                                           name=name + "_train_part")
        k = operators.fft_ortho(train, conf, name=name + "_fft")
        for d, n, c, s in zip(K_DIMS, conf.nc, self.cos, self.sin):
            shape = mtf.Shape([mtf.Dimension(d, n)])
            ct = mtf.import_tf_tensor(mesh, c, shape, name="%s_cos_%s" % (name, d))
            st = mtf.import_tf_tensor(mesh, s, shape, name="%s_sin_%s" % (name, d))
            k = (complex_ops.apply_kernel(k, ct, name="%s_rc_%s" % (name, d))
                 + complex_ops.apply_kernel(k, st, phase=-1j, name="%s_rs_%s" % (name, d)))
        x = operators.ifft_ortho(k, conf, real=True, name=name + "_ifft")
        a = mtf.import_tf_tensor(mesh, self.scale, mtf.Shape([]), name=name + "_scale")
        return x * a

    def feed(self, step):
        """The feed dict of training step ``step``."""
        shift, scale = augmentation_sample(step, self.seed, self.conf.nc)
        out = {self.scale: scale}
        for c, s, n, sh in zip(self.cos, self.sin, self.conf.nc, shift):
            f = np.fft.fftfreq(n)[layout.k_order(n)]
            out[c] = np.cos(2.0 * np.pi * f * sh)
            out[s] = np.sin(2.0 * np.pi * f * sh)
        return out
