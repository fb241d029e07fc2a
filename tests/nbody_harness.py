"""Shared helpers of the LPT and N-body tests: a numpy linear field and the
single-device FlowPM reference (``flowpm.tfpm`` in FlowPM 0.1.1)."""
import numpy as np
import mesh_tensorflow as mtf
import tensorflow.compat.v1 as tf

from flowpm_mtf.mesh import fft
from flowpm_mtf import layout
from flowpm_mtf.physics import painting
from flowpm_bench.reference import _flowpm_ode_cache, flowpm_cosmo, linear_field_numpy  # noqa: F401

tf.disable_eager_execution()


def import_field(mesh, conf, field):
    """The numpy field as an mtf tensor ``[x, y, z]`` of dtype ``conf.dtype``."""
    return mtf.import_tf_tensor(mesh, tf.constant(np.asarray(field, conf.np_dtype)),
                                fft.real_shape(conf))


def id_field(ids, conf, seed):
    """A fixed pseudo-random vector per particle id, ``[bx, by, npart, xyz]``, zero on
    empty slots: the same for a particle whatever its slot (slot orders differ)."""
    xyz = mtf.Dimension(layout.XYZ, 3)
    k = mtf.cast(mtf.range(ids.mesh, xyz, dtype=tf.int32), conf.tf_dtype)
    i = mtf.cast(ids, conf.tf_dtype)
    valid = mtf.cast(mtf.greater_equal(ids, mtf.zeros(ids.mesh, ids.shape, ids.dtype)),
                     conf.tf_dtype)
    return mtf.sin(i * 0.618034 + k * 1.3 + float(seed)) * valid


def export_state(state, conf, prefix=""):
    """Fetch dict entries for a State: global positions (not wrapped), momenta, forces
    and ids of every slot; :func:`by_id` turns them into FlowPM's particle order."""
    out = {prefix + "x": painting.to_global(state.positions, conf),
           prefix + "p": state.momenta, prefix + "f": state.forces}
    if state.ids is not None:
        out[prefix + "ids"] = state.ids
    return out


def by_id(out):
    """Fetched :func:`export_state` entries (any prefixes) -> ``[N, 3]`` arrays in id
    order (FlowPM's particle order), empty slots dropped; checks that the ids are
    exactly ``0 .. N-1``. Other entries are returned unchanged."""
    out = dict(out)
    for key in [k for k in out if k.endswith("ids")]:
        prefix = key[:-3]
        ids = np.asarray(out.pop(key)).reshape(-1)
        valid = ids >= 0
        order = np.argsort(ids[valid], kind="stable")
        np.testing.assert_array_equal(ids[valid][order], np.arange(valid.sum()))
        for k in "xpf":
            if prefix + k in out:
                out[prefix + k] = np.asarray(out[prefix + k]).reshape(-1, 3)[valid][order]
    return out


def disp(x, conf):
    """Periodic displacement of ``[N, 3]`` global positions [cells] from FlowPM's lattice
    (in ``[-n/2, n/2)`` per axis): compares wrapped (eulerian) and unwrapped positions."""
    n = np.asarray(conf.nc, np.float64)
    q = np.indices(conf.nc).reshape(3, -1).T
    return (np.asarray(x, np.float64) - q + n / 2) % n - n / 2


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
