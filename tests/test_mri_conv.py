"""The model-parallel 3D convolution of ``mri_mtf.conv`` against one-process
``tf.nn.conv3d`` on the whole volume: values and gradients (image and filter), float32
and float64, zero and periodic padding, on the grids of this world size (hvd backend)
and the placement grids (``fpm_harness``)."""
import numpy as np
import pytest
import mesh_tensorflow as mtf
import tensorflow.compat.v1 as tf

import fpm_harness as H
from mri_mtf import conv
from mri_mtf.config import ImagingConfig

# float64: a conv3d output is a sum of 27 * c_in products computed in another order
# than tf.nn.conv3d's: ~1e-15 relative; float32: ~1e-6.
RTOL = {"float64": 1e-12, "float32": 2e-5}
NC = (8, 8, 6)
C_IN, C_OUT = 2, 3
CASES = H.cases(single=True, placement=False)


def conf_for(case, dtype):
    return ImagingConfig(nc=NC, grid=case[1], dtype=dtype)


def _wrap_pad(t, h):
    """``numpy.pad(mode="wrap")`` of the three spatial axes, differentiable."""
    for axis, k in enumerate(h):
        if k:
            n = t.shape[axis]
            t = tf.concat([tf.gather(t, list(range(n - k, n)), axis=axis), t,
                           tf.gather(t, list(range(k)), axis=axis)], axis=axis)
    return t


def reference(x, w, dy, padding):
    """One-process tf.nn.conv3d on the whole volume, and the gradients of sum(dy * y)."""
    with tf.Graph().as_default():
        xt, wt = tf.constant(x), tf.constant(w)
        if padding == "periodic":
            xin = _wrap_pad(xt, [s // 2 for s in w.shape[:3]])
            y = tf.nn.conv3d(xin[None], wt, [1] * 5, "VALID")[0]
        else:
            y = tf.nn.conv3d(xt[None], wt, [1] * 5, "SAME")[0]
        gx, gw = tf.gradients(tf.reduce_sum(y * tf.constant(dy)), [xt, wt])
        with tf.Session() as s:
            return s.run({"y": y, "gx": gx, "gw": gw})


@pytest.mark.parametrize("case", CASES, ids=H.case_id)
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("padding,size", [("zero", (3, 3, 3)), ("periodic", (3, 5, 3)),
                                          ("zero", (5, 3, 1))])
def test_conv3d_matches_tf(case, dtype, padding, size):
    conf = conf_for(case, dtype)
    rng = np.random.RandomState(3)
    x = rng.randn(*NC, C_IN).astype(dtype)
    w = rng.randn(*size, C_IN, C_OUT).astype(dtype)
    dy = rng.randn(*NC, C_OUT).astype(dtype)
    cin, cout = mtf.Dimension("cin", C_IN), mtf.Dimension("cout", C_OUT)
    shape = mtf.Shape([mtf.Dimension(d, n) for d, n in zip("xyz", NC)] + [cin])

    def build(mesh):
        xm = mtf.import_tf_tensor(mesh, tf.constant(x), shape)
        wm = mtf.import_tf_tensor(mesh, tf.constant(w), conv.filter_shape(size, cin, cout))
        y = conv.conv3d(xm, wm, conf, padding=padding)
        assert y.shape.dimension_names == ["x", "y", "z", "cout"]
        dym = mtf.import_tf_tensor(mesh, tf.constant(dy), y.shape)
        loss = mtf.reduce_sum(y * dym)
        gx, gw = mtf.gradients([loss], [xm, wm])
        return {"y": y, "gx": gx, "gw": gw}

    out = H.run(case[0], conf, build)
    ref = reference(x, w, dy, padding)
    for k in ("y", "gx", "gw"):
        assert out[k].dtype == np.dtype(dtype)
        assert H.rel_err(out[k], ref[k]) < RTOL[dtype], k


@pytest.mark.rank_independent
def test_conv3d_rejects_bad_input():
    conf = ImagingConfig(nc=NC, grid=(1, 1))
    cin, cout = mtf.Dimension("cin", 1), mtf.Dimension("cout", 1)
    graph = mtf.Graph()
    mesh = mtf.Mesh(graph, "m")
    shape = mtf.Shape([mtf.Dimension(d, n) for d, n in zip("xyz", NC)] + [cin])
    x = mtf.zeros(mesh, shape)
    with pytest.raises(ValueError, match="odd"):
        conv.conv3d(x, mtf.zeros(mesh, conv.filter_shape((2, 3, 3), cin, cout)), conf)
    with pytest.raises(ValueError, match="padding"):
        conv.conv3d(x, mtf.zeros(mesh, conv.filter_shape((3, 3, 3), cin, cout)), conf,
                    padding="reflect")
    with pytest.raises(ValueError, match="shape"):
        conv.conv3d(mtf.zeros(mesh, shape.dims[:3]),
                    mtf.zeros(mesh, conv.filter_shape((3, 3, 3), cin, cout)), conf)
