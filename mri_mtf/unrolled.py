r"""An unrolled reconstruction network on the split volume, trained on the process grid.

Network
-------
The complex image is carried as two real channels ``[x, y, z, chan]`` (real and
imaginary parts, ``chan = 2``; split over the grid like any image). Starting from the
zero-filled ``x_0 = A^H y``, ``K`` blocks (``UnrolledConfig.blocks``) each apply

.. math::

    x \leftarrow x + \mathrm{CNN}(x), \qquad
    x \leftarrow x - \eta_k\, A^H (A x - y),

a small residual 3D CNN (``2 -> C -> C -> 2`` channels, ``f^3`` filters, ReLU after the
first two layers, biases; :func:`mri_mtf.conv.conv3d` with zero padding, i.e. a halo
exchange of ``f // 2`` planes with the neighbouring ranks) followed by a gradient step
on the data term with a learned step ``eta_k`` (initialised to ``eta_init``; with the
orthonormal ``A`` and ``eta = 1`` it puts the measured samples back). The CNN weights
are shared by the blocks (as in MoDL, Aggarwal, Mani & Jacob 2019); ``eta_k`` is one per
block. Every weight is a replicated Mesh TF variable: the image is split, the weights
are not, and ``mtf.gradients`` sums each rank's contribution to a weight gradient (an
allreduce).

Training
--------
Loss: the mean over the voxels of ``|x_K - t|^2`` (complex output against the real
truth ``t``) [phantom intensity^2]. Each training step draws, from
``(UnrolledConfig.data_seed, step)``, a phantom with random ellipsoid perturbations
(:func:`mri_mtf.phantom.perturbed_table`, fed to the one lowered graph as a table:
:func:`mri_mtf.phantom.phantom_fed`) and a noise realisation: a random orthonormal mix
of :data:`TRAIN_NOISE_FIELDS` fixed white-noise fields (seeds ``conf.seed +``
:data:`TRAIN_NOISE_SEED_OFFSET` ``+ i``, never the evaluation noise's), so the complex
noise keeps ``E|n|^2 = noise_sigma^2`` and changes from step to step. The measurement
uses the evaluation's mask. Adam with bias correction
(:func:`flowpm_mtf.mesh.optim.adam_update`, Mesh TF operations on the mesh) updates
every weight; the whole optimiser state is :attr:`UnrolledTraining.checkpoint_variables`.
Everything but the order of floating-point sums is independent of the process grid.
With a ``source`` (:class:`mri_mtf.augment.VolumeAugmentation`, the job's brain) the
training images are that source's instead of phantoms; with an encoding operator ``op``
(:class:`mri_mtf.sense.Sense`) the measurement and the data-consistency steps are SENSE's
and the training noise lives on ``[coil, kx, ky, kz]``.
"""
import logging

import mesh_tensorflow as mtf
import numpy as np
import tensorflow.compat.v1 as tf

from flowpm_mtf.mesh import complex_ops, noise as noise_mod
from flowpm_mtf.mesh.optim import adam_update

from . import conv, operators, phantom
from .config import (MAX_BLOCKS, MAX_SEED, MAX_TRAIN_STEPS,  # noqa: F401 (public here too)
                     UnrolledConfig)
from .sampling import NOISE_SEED_OFFSETS

__all__ = ["UnrolledConfig", "MAX_TRAIN_STEPS", "MAX_BLOCKS", "MAX_SEED", "check_kernel_fits",
           "largest_kernel", "CHAN", "TRAIN_NOISE_FIELDS", "TRAIN_NOISE_SEED_OFFSET",
           "channel_magnitude", "init_weights", "weight_shapes", "make_weights",
           "network", "training_sample", "UnrolledTraining", "network_numpy"]

log = logging.getLogger(__name__)

CHAN = operators.CHAN

TRAIN_NOISE_FIELDS = 4
"""Fixed white-noise fields whose random orthonormal mixes are the training noise."""

TRAIN_NOISE_SEED_OFFSET = 7919
"""Training noise field ``i`` has the seed ``conf.seed + 7919 + i`` (the evaluation
noise uses ``conf.seed +`` :data:`mri_mtf.sampling.NOISE_SEED_OFFSETS`)."""

assert not set(NOISE_SEED_OFFSETS) & set(range(TRAIN_NOISE_SEED_OFFSET,
                                               TRAIN_NOISE_SEED_OFFSET + TRAIN_NOISE_FIELDS))


def largest_kernel(conf):
    """The largest odd filter side that fits the volume and the halo of ``conf``'s grid.

    A filter fits if it is no wider than the volume along every axis (``f <= n``) and its
    halo ``f // 2`` is no wider than a rank's block along the split axes x and y, so that
    every rank's convolution needs only the planes of its direct neighbours (a wider halo
    makes :func:`mri_mtf.conv.conv3d` gather whole blocks of farther ranks, and the
    convolution's cost grows as ``f^3``) [voxels].
    """
    sx, sy, _ = conf.block_shape
    k = min(min(conf.nc), 2 * min(sx, sy) + 1)
    return k if k % 2 else k - 1


def check_kernel_fits(conf, uconf):
    """Raise ``ValueError`` (one line) if ``uconf.kernel_size`` does not fit ``conf``.

    See :func:`largest_kernel` for the rule.
    """
    f, best = uconf.kernel_size, largest_kernel(conf)
    if f <= best:
        return
    sx, sy, _ = conf.block_shape
    why = ("wider than the volume %s" % "x".join(map(str, conf.nc)) if f > min(conf.nc) else
           "its halo of %d planes is wider than a rank's block (%d x %d voxels in x, y on "
           "grid %dx%d)" % (f // 2, sx, sy, conf.grid[0], conf.grid[1]))
    raise ValueError("kernel_size %d does not fit: %s; use --kernel-size %d or less"
                     % (f, why, best))


# ----------------------------------------------------------------------------- channels
def channel_magnitude(x2, name="magnitude"):
    """``|x|`` of a two-channel image, real ``[x, y, z]`` [phantom intensity]."""
    return mtf.sqrt(mtf.reduce_sum(mtf.square(x2), reduced_dim=CHAN), name=name)


# ----------------------------------------------------------------------------- weights
def _layer_dims(uconf):
    hid = mtf.Dimension("hidden", uconf.channels)
    hid2 = mtf.Dimension("hidden2", uconf.channels)
    return [("w1", "b1", CHAN, hid), ("w2", "b2", hid, hid2), ("w3", "b3", hid2, CHAN)]


def init_weights(uconf, dtype=np.float64):
    """The initial weights (numpy): name -> array.

    ``w1, w2, w3``: filters ``[f, f, f, c_in, c_out]``, normal with standard deviation
    ``init_scale * sqrt(2 / (f^3 c_in))`` (a tenth of it for ``w3``); ``b1, b2, b3``
    zero; ``eta``: ``[K]`` filled with ``eta_init``.
    """
    rng = np.random.default_rng(uconf.init_seed)
    f = uconf.kernel_size
    out = {}
    for wn, bn, cin, cout in _layer_dims(uconf):
        std = uconf.init_scale * np.sqrt(2.0 / (f ** 3 * cin.size))
        if wn == "w3":
            std *= 0.1
        out[wn] = (std * rng.standard_normal((f, f, f, cin.size, cout.size))).astype(dtype)
        out[bn] = np.zeros(cout.size, dtype)
    out["eta"] = np.full(uconf.blocks, uconf.eta_init, dtype)
    return out


def weight_shapes(uconf):
    """name -> mtf Shape of the weights (:func:`init_weights`)."""
    f = [uconf.kernel_size] * 3
    out = {}
    for wn, bn, cin, cout in _layer_dims(uconf):
        out[wn] = conv.filter_shape(f, cin, cout)
        out[bn] = mtf.Shape([cout])
    out["eta"] = mtf.Shape([mtf.Dimension("block", uconf.blocks)])
    return out


def make_weights(mesh, conf, uconf, name="unrolled"):
    """The network's weights as replicated Mesh TF variables (trainable).

    Returns
    -------
    dict
        ``w1, w2, w3`` ``[fx, fy, fz, c_in, c_out]``, ``b1, b2, b3`` ``[c_out]``,
        ``eta`` ``[block]`` (:func:`init_weights`).
    """
    init = init_weights(uconf, conf.np_dtype)
    return {n: mtf.get_variable(mesh, "%s_%s" % (name, n), shape, dtype=conf.tf_dtype,
                                initializer=tf.constant_initializer(init[n]))
            for n, shape in weight_shapes(uconf).items()}


# ----------------------------------------------------------------------------- network
def _cnn(x2, w, conf, name):
    h = mtf.relu(conv.conv3d(x2, w["w1"], conf, name=name + "_c1") + w["b1"])
    h = mtf.relu(conv.conv3d(h, w["w2"], conf, name=name + "_c2") + w["b2"])
    return x2 + conv.conv3d(h, w["w3"], conf, name=name + "_c3") + w["b3"]


class SingleCoil:
    """``A = M F`` of :mod:`mri_mtf.operators` with the interface of
    :class:`mri_mtf.sense.Sense` (``forward``, ``adjoint``)."""

    def __init__(self, conf, mask):
        self.conf, self.mask = conf, mask
        self.kspace_shape = operators.kspace_shape(conf)

    def forward(self, x, name="forward"):
        return operators.forward(x, self.mask, self.conf, name=name)

    def adjoint(self, y, name="adjoint"):
        return operators.adjoint(y, self.mask, self.conf, name=name)


def network(kdata, mask, weights, conf, uconf, name="unrolled", op=None):
    """The unrolled network (module docstring) on measured k-space.

    Parameters
    ----------
    kdata : mtf.Tensor
        Complex ``[kx, ky, kz]``, zero where not sampled [phantom intensity].
    mask : mtf.Tensor
        Real 0/1 ``[ky, kz]``.
    weights : dict
        :func:`make_weights` (or any tensors of those shapes).
    conf : ImagingConfig
    uconf : UnrolledConfig
    op : optional
        The encoding operator (``forward``, ``adjoint``): default :class:`SingleCoil`;
        :class:`mri_mtf.sense.Sense` for ``kdata`` on ``[coil, kx, ky, kz]``.

    Returns
    -------
    mtf.Tensor
        Real ``[x, y, z, chan]``: the reconstruction's real and imaginary parts
        [phantom intensity] (:func:`channel_magnitude` for ``|x|``).
    """
    op = op or SingleCoil(conf, mask)
    x2 = operators.to_channels(op.adjoint(kdata, name=name + "_x0"),
                     name=name + "_x0_channels")
    block = weights["eta"].shape.dims[0]
    for k in range(uconf.blocks):
        x2 = _cnn(x2, weights, conf, "%s_cnn%d" % (name, k))
        eta = mtf.slice(weights["eta"], k, 1, block.name)
        eta = mtf.reshape(eta, mtf.Shape([]))
        r = op.forward(operators.to_complex(x2, name="%s_z%d" % (name, k)),
                       name="%s_fwd%d" % (name, k)) - kdata
        g = operators.to_channels(op.adjoint(r, name="%s_adj%d" % (name, k)),
                        name="%s_g%d" % (name, k))
        x2 = x2 - g * eta
    return x2


def network_numpy(kdata, mask2d, weights, uconf):
    """Reference of :func:`network` on whole arrays (numpy FFT order, float64).

    Parameters
    ----------
    kdata : ndarray, complex, shape ``nc``
    mask2d : ndarray, shape ``(ny, nz)``
    weights : dict of ndarray
        As :func:`init_weights` returns.
    uconf : UnrolledConfig

    Returns
    -------
    ndarray, complex128, shape ``nc``
    """
    from scipy.signal import correlate

    m = np.broadcast_to(mask2d[None].astype(np.float64), kdata.shape)
    A = lambda x: m * np.fft.fftn(x, norm="ortho")  # noqa: E731
    AH = lambda k: np.fft.ifftn(m * k, norm="ortho")  # noqa: E731

    def conv3(h, w, b):   # "SAME" zero-padded cross-correlation, channels last
        out = np.zeros(h.shape[:3] + (w.shape[4],))
        for o in range(w.shape[4]):
            for i in range(w.shape[3]):
                out[..., o] += correlate(h[..., i], w[..., i, o], mode="same", method="direct")
        return out + b

    x = AH(kdata)
    for k in range(uconf.blocks):
        x2 = np.stack([x.real, x.imag], -1)
        h = np.maximum(conv3(x2, weights["w1"], weights["b1"]), 0)
        h = np.maximum(conv3(h, weights["w2"], weights["b2"]), 0)
        x2 = x2 + conv3(h, weights["w3"], weights["b3"])
        x = x2[..., 0] + 1j * x2[..., 1]
        x = x - weights["eta"][k] * AH(A(x) - kdata)
    return x


# ----------------------------------------------------------------------------- training
def training_sample(step, uconf):
    """The training phantom and noise mix of a step (numpy, the same on every rank).

    Returns
    -------
    rows : ndarray, shape (10, 16)
        :func:`mri_mtf.phantom.table_rows` of a perturbed Shepp-Logan table.
    mix : ndarray, shape (2, TRAIN_NOISE_FIELDS)
        Orthonormal rows: the real and imaginary parts of the noise as mixes of the
        fixed training noise fields.
    """
    rng = np.random.default_rng([uconf.data_seed, int(step)])
    table = phantom.perturbed_table(int(rng.integers(2**62)), uconf.perturbation)
    q, _ = np.linalg.qr(rng.standard_normal((TRAIN_NOISE_FIELDS, 2)))
    return phantom.table_rows(table), np.ascontiguousarray(q.T)


class UnrolledTraining:
    """The training graph: one Adam step on a fed phantom, and its loss.

    Parameters
    ----------
    mesh : mtf.Mesh
    conf : ImagingConfig
    uconf : UnrolledConfig
    mask : mtf.Tensor
        Real 0/1 ``[ky, kz]`` (:func:`mri_mtf.sampling.mask`).
    weights : dict
        :func:`make_weights`.
    op : optional
        The encoding operator (default :class:`SingleCoil`; :class:`mri_mtf.sense.Sense`).
    source : optional
        The training images: an object with ``truth(mesh)`` (an mtf ``[x, y, z]`` image)
        and ``feed(step)`` (its feed dict); default the perturbed phantoms.

    Attributes
    ----------
    rows, mix : tf.placeholder
        The step's sample (:func:`training_sample`), fed by :meth:`step`.
    truth : mtf.Tensor
        The fed phantom ``[x, y, z]``.
    loss : mtf.Tensor
        Replicated scalar: mean ``|x_K - truth|^2`` before the step
        [phantom intensity^2].
    step_ops : list of mtf.Operation
        Adam's updates of every weight.
    checkpoint_variables : dict
        Name -> variable: the weights and Adam's moments and step counts.
    """

    def __init__(self, mesh, conf, uconf, mask, weights, name="train", op=None, source=None):
        self.conf, self.uconf, self.source = conf, uconf, source
        self.op = op or SingleCoil(conf, mask)
        self.mix = tf.placeholder(tf.float64, (2, TRAIN_NOISE_FIELDS), name=name + "_mix")
        if source is None:
            self.rows = tf.placeholder(tf.float64, (len(phantom.SHEPP_LOGAN_3D),
                                                    phantom.TABLE_ROW_WIDTH), name=name + "_rows")
            self.truth = phantom.phantom_fed(mesh, conf, self.rows, name=name + "_phantom")
        else:
            self.truth = source.truth(mesh)
        kdata = self.op.forward(self.truth, name=name + "_forward")
        if conf.noise_sigma > 0:
            kdata = kdata + complex_ops.apply_kernel(self._noise(mesh), mask,
                                                     name=name + "_noise_mask")
        x2 = network(kdata, mask, weights, conf, uconf, name=name + "_net", op=self.op)
        truth2 = self.truth * mtf.import_tf_tensor(
            mesh, tf.constant(np.array([1.0, 0.0], conf.np_dtype)), mtf.Shape([CHAN]),
            name=name + "_real_channel")
        self.loss = mtf.reduce_mean(mtf.square(x2 - truth2)) * 2.0   # mean over voxels
        names = sorted(weights)
        grads = mtf.gradients([self.loss], [weights[n] for n in names])
        self.step_ops, self.checkpoint_variables = [], {}
        for n, g in zip(names, grads):
            ops, state = adam_update(weights[n], g, uconf.learning_rate, uconf.beta1,
                                     uconf.beta2, uconf.epsilon, name="%s_adam_%s" % (name, n))
            self.step_ops += ops
            self.checkpoint_variables.update({n: weights[n], n + "_adam_m": state.m,
                                              n + "_adam_v": state.v,
                                              n + "_adam_step": state.step})

    def _noise(self, mesh):
        """This step's complex noise on ``[kx, ky, kz]`` (module docstring)."""
        conf = self.conf
        field = mtf.Dimension("noise_field", TRAIN_NOISE_FIELDS)
        parts = mtf.Dimension("noise_part", 2)
        kshape = self.op.kspace_shape
        fields = [noise_mod.white_noise(mesh, kshape, conf.seed + TRAIN_NOISE_SEED_OFFSET + i,
                                        conf.tf_dtype, name="train_noise%d" % i)
                  for i in range(TRAIN_NOISE_FIELDS)]
        mix = mtf.import_tf_tensor(mesh, tf.cast(self.mix, conf.tf_dtype),
                                   mtf.Shape([parts, field]), name="train_noise_mix")
        re_im = None
        for i, f in enumerate(fields):
            w = mtf.reshape(mtf.slice(mix, i, 1, field.name), mtf.Shape([parts]))
            t = f * w
            re_im = t if re_im is None else re_im + t          # [kx, ky, kz, noise_part]
        s = conf.noise_sigma / np.sqrt(2.0)
        cdtype = conf.tf_complex_dtype
        return mtf.slicewise(lambda t: tf.cast(tf.complex(t[..., 0] * s, t[..., 1] * s),
                                               cdtype), [re_im], output_shape=kshape,
                             output_dtype=cdtype, splittable_dims=kshape.dims,
                             name="train_noise")

    def lower(self, lowering):
        """The lowered step (Adam updates ordered after every read) and loss."""
        from hvd_mesh_impl.training import ordered_update_op  # Horovod-free (floor 0)

        return {"step": ordered_update_op(lowering, self.step_ops),
                "loss": lowering.tensors[self.loss].to_laid_out_tensor().tensor_list[0]}

    def feed(self, step):
        """The feed dict of training step ``step`` (0-based)."""
        rows, mix = training_sample(step, self.uconf)
        if self.source is not None:
            out = dict(self.source.feed(step))
            out[self.mix] = mix
            return out
        return {self.rows: rows, self.mix: mix}

    def step(self, sess, ops, step):
        """Run Adam step ``step`` (0-based); returns the loss before it."""
        loss, _ = sess.run([ops["loss"], ops["step"]], self.feed(step))
        return float(loss)
