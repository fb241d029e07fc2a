"""Shared helpers of the LPT and N-body tests: a numpy linear field and the
single-device FlowPM reference (``flowpm.tfpm`` in FlowPM 0.1.1)."""
import numpy as np
import mesh_tensorflow as mtf
import tensorflow.compat.v1 as tf

from flowpm_mtf import fft, lpt, painting
from flowpm_mtf.reference import _flowpm_ode_cache, flowpm_cosmo, linear_field_numpy  # noqa: F401

tf.disable_eager_execution()


def import_field(mesh, conf, field):
    """The numpy field as an mtf tensor ``[x, y, z]`` of dtype ``conf.dtype``."""
    return mtf.import_tf_tensor(mesh, tf.constant(np.asarray(field, conf.np_dtype)),
                                fft.real_shape(conf))


def export_state(state, conf, prefix=""):
    """Fetch dict entries for a State in FlowPM's particle order: ``[nx, ny, nz, 3]``,
    positions global (not wrapped)."""
    return {prefix + "x": lpt.particles_to_lattice_order(painting.to_global(state.positions,
                                                                           conf), conf),
            prefix + "p": lpt.particles_to_lattice_order(state.momenta, conf),
            prefix + "f": lpt.particles_to_lattice_order(state.forces, conf)}


def flat(a):
    """``[nx, ny, nz, 3]`` -> ``[N, 3]`` (FlowPM's particle order)."""
    return np.asarray(a).reshape(-1, 3)


def flowpm_run(linear, a0, order, stages=None, parts=False, growth="ours", init=None):
    """FlowPM 0.1.1 ``lpt_init`` (+ ``nbody`` over ``stages``), float32, one batch.

    Returns a dict of ``[N, 3]`` arrays: ``x``, ``p``, ``f`` of the LPT state and,
    with ``stages``, ``nx``, ``np``, ``nf`` of the final state and ``rho`` (final
    CIC density). With ``parts``, also ``psi1`` and ``psi2``: FlowPM's unit-growth
    displacements ``lpt1(delta_k)`` and ``lpt1(lpt2_source(delta_k))`` (the latter
    with FlowPM's 3/7).
    """
    import flowpm.tfpm as tfpm
    from flowpm.utils import cic_paint, r2c3d
    cosmo = flowpm_cosmo(growth)
    nc = list(linear.shape)
    with tf.Graph().as_default():
        lin = tf.constant(linear[None].astype(np.float32))
        if init is None:
            state = tfpm.lpt_init(lin, a0, order=order, cosmology=cosmo)
        else:
            state = tf.constant(np.stack([init[k][None] for k in "xpf"]).astype(np.float32))
        out = {"x": state[0, 0], "p": state[1, 0], "f": state[2, 0]}
        if stages is not None:
            final = tfpm.nbody(state, stages, nc, cosmology=cosmo)
            out.update({"nx": final[0, 0], "np": final[1, 0], "nf": final[2, 0]})
            out["rho"] = cic_paint(tf.zeros([1] + nc), final[0:1, 0])[0]
        if parts:
            Q = np.indices(nc).reshape(3, -1).T.astype(np.float32)[None]
            lk = r2c3d(lin, norm=int(np.prod(nc)))
            out["psi1"] = tfpm.lpt1(lk, Q)[0]
            out["psi2"] = tfpm.lpt1(tfpm.lpt2_source(lk), Q)[0]
        with tf.Session() as sess:
            return sess.run(out)
