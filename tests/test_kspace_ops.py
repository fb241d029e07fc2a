"""Real k-space kernels applied in one pass (native/kspace_ops.cc): ``FlowpmInverseLaplace``
(flowpm_mtf.physics.kernels.apply_inverse_laplace) and ``FlowpmRadialScale``
(flowpm_mtf.physics.ics.apply_radial_kernel). The ops against numpy and their TensorFlow twins bit
for bit (in the field's memory or not, on 1 and 4 threads); bad inputs; and on the mesh
(every grid of the world size, native and TensorFlow paths) the fused products against
the full-size kernels they replace (``apply_kernel`` with ``inverse_laplace_kernel`` /
``radial_kernel``), bit for bit, with their gradients by the dot-product test (both dtypes;
float64 only on the placement grid, ``fpm_harness.case_dtypes``)."""
import mesh_tensorflow as mtf
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import fpm_harness as H
from flowpm_mtf.mesh import complex_ops, fft
from flowpm_mtf.physics import ics, kernels
from flowpm_mtf import native
from flowpm_mtf.config import SimConfig

tf.disable_eager_execution()

PAIRS = [(np.float32, np.complex64), (np.float64, np.complex128)]


def _field(rng, shape, ctype):
    f = (rng.randn(*shape) + 1j * rng.randn(*shape)).astype(ctype)
    f.flat[3] = complex(-0.0, 2.0)
    return f


def _kvec(rng, n, rtype):
    k = rng.randn(n).astype(rtype)
    k[0] = 0
    return k


def _inverse_laplace_numpy(f, kx, ky, kz):
    """The op's definition, in the real dtype of the wave numbers."""
    kk = (kx[:, None, None] * kx[:, None, None] + ky[None, :, None] * ky[None, :, None]) + \
        kz[None, None, :] * kz[None, None, :]
    with np.errstate(divide="ignore"):
        s = np.where(kk == 0, kk.dtype.type(0), kk.dtype.type(1) / kk)
    out = np.empty_like(f)
    out.real, out.imag = f.real * s, f.imag * s
    return out


def _same_bits(a, b):
    """Equal values (a zero's sign aside: the op may differ from a complex product there)."""
    np.testing.assert_array_equal(a, b)


@pytest.mark.skipif(H.SIZE != 1, reason="a single-process TensorFlow test")
@pytest.mark.parametrize("rtype,ctype", PAIRS)
def test_ops_numpy_and_twins(rtype, ctype):
    """Both ops, held input and forwarded one, against numpy and the TensorFlow twins."""
    lib = native.load("kspace_ops")
    rng = np.random.RandomState(1)
    shape = (6, 10, 5)
    f = _field(rng, shape, ctype)
    kx, ky, kz = (_kvec(rng, n, rtype) for n in shape)
    table = rng.rand(3, 4, 2).astype(rtype)
    ix = rng.randint(0, 3, shape[0]).astype(np.int32)
    iy = rng.randint(0, 4, shape[1]).astype(np.int32)
    iz = rng.randint(0, 2, shape[2]).astype(np.int32)
    want_il = _inverse_laplace_numpy(f, kx, ky, kz)
    want_rs = f * table[ix][:, iy][:, :, iz]
    assert want_il[0, 0, 0] == 0 and np.all(want_il[1:, 1:, 1:] != 0)
    with tf.Graph().as_default(), tf.Session() as sess:
        ft = tf.constant(f)
        k3 = [tf.constant(k) for k in (kx, ky, kz)]
        i3 = [tf.constant(i) for i in (ix, iy, iz)]
        tt = tf.constant(table)
        out = sess.run({
            "il_held": lib.flowpm_inverse_laplace(ft, *k3),
            "il_free": lib.flowpm_inverse_laplace(ft * ctype(1), *k3),
            "il_tf": kernels.inverse_laplace_tf(ft, *k3),
            "rs_held": lib.flowpm_radial_scale(ft, tt, *i3),
            "rs_free": lib.flowpm_radial_scale(ft * ctype(1), tt, *i3),
            "rs_tf": ics.radial_scale_tf(ft, tt, *i3),
            "f": ft})
    np.testing.assert_array_equal(out["f"], f)          # a held input is not overwritten
    for key in ("il_held", "il_free", "il_tf"):
        _same_bits(out[key], want_il)
    for key in ("rs_held", "rs_free", "rs_tf"):
        _same_bits(out[key], want_rs)


@pytest.mark.skipif(H.SIZE != 1, reason="a single-process TensorFlow test")
def test_threads_independent():
    """One and four threads of the intra-op pool write the same bits."""
    lib = native.load("kspace_ops")
    rng = np.random.RandomState(2)
    shape = (16, 12, 33)
    f = _field(rng, shape, np.complex64)
    ks = [_kvec(rng, n, np.float32) for n in shape]
    outs = []
    for threads in (1, 4):
        cfg = tf.ConfigProto(intra_op_parallelism_threads=threads,
                             inter_op_parallelism_threads=1)
        with tf.Graph().as_default(), tf.Session(config=cfg) as sess:
            outs.append(sess.run(lib.flowpm_inverse_laplace(tf.constant(f) * 1, *ks)))
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.skipif(H.SIZE != 1, reason="a single-process TensorFlow test")
def test_bad_input():
    """Wave numbers or indices of the wrong length, an index outside the table, a field
    that is not 3-d: one clear error each."""
    lib = native.load("kspace_ops")
    f = np.zeros((4, 3, 2), np.complex64)
    k = [np.zeros(n, np.float32) for n in (4, 3, 2)]
    t = np.ones((2, 2, 2), np.float32)
    i = [np.zeros(n, np.int32) for n in (4, 3, 2)]
    cases = [
        (lambda: lib.flowpm_inverse_laplace(f, k[0], k[1], k[1]), "kz must be a vector of 2"),
        (lambda: lib.flowpm_inverse_laplace(f[0], k[1], k[2], k[2]), "rank|must be"),
        (lambda: lib.flowpm_radial_scale(f, t, i[0], i[0], i[2]), "iy must be a vector of 3"),
        (lambda: lib.flowpm_radial_scale(f, t, i[0], i[1], i[2] + 2),
         "index 2 of axis 2 is outside the table"),
        (lambda: lib.flowpm_radial_scale(f, t, i[0] - 1, i[1], i[2]),
         "index -1 of axis 0 is outside"),
    ]
    for make, message in cases:
        with tf.Graph().as_default(), tf.Session() as sess:
            with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match=message):
                sess.run(make())


def _values(k):
    return np.sqrt(1e3 * k ** -1.5 * np.exp(-k))


@pytest.mark.parametrize("case, dtype", H.case_dtypes(H.cases(), ("float32", "float64")))
@pytest.mark.parametrize("use_native", [True, False], ids=["native", "tf"])
def test_fused_equals_full_kernel(case, dtype, use_native, monkeypatch):
    """On every grid: the fused products equal ``apply_kernel`` with the full-size
    kernels bit for bit, and so do their gradients; <A x, y> = <x, A^T y> for the
    composition x -> c2r(A r2c(x)) of both (each A real and diagonal)."""
    if not use_native:
        monkeypatch.setattr(native, "load", lambda name: None)
    nc = (8, 6, 4)
    conf = SimConfig(nc=nc, box_size=(40.0, 30.0, 20.0), grid=case[1], dtype=dtype)
    cubic = SimConfig(nc=(8, 8, 8), box_size=(50.0,) * 3, grid=case[1], dtype=dtype)
    rng = np.random.RandomState(4)

    def build(mesh):
        out = {}
        for tag, c in (("", conf), ("c_", cubic)):
            x0, y0 = rng.randn(*c.nc).astype(dtype), rng.randn(*c.nc).astype(dtype)
            real = fft.real_shape(c)
            x = mtf.import_tf_tensor(mesh, tf.constant(x0), real)
            y = mtf.import_tf_tensor(mesh, tf.constant(y0), real)
            dk = fft.r2c(x, c)
            kern = kernels.make_kernels(c, mesh)
            fused = {"il": kern.inverse_laplace(dk),
                     "rs": ics.apply_radial_kernel(dk, c, _values, "rs")}
            full = {"il": complex_ops.apply_kernel(dk, kern.inv_laplace),
                    "rs": complex_ops.apply_kernel(dk, ics.radial_kernel(c, mesh, _values,
                                                                         "rk"))}
            for key in ("il", "rs"):
                for kind, z in (("fused", fused[key]), ("full", full[key])):
                    r = fft.c2r(z, c)
                    loss = complex_ops.real_vdot(y, r)
                    g, = mtf.gradients([loss], [x])
                    out[tag + key + "_" + kind] = r
                    out[tag + key + "_" + kind + "_g"] = g
                    out[tag + key + "_" + kind + "_loss"] = loss
                    out[tag + key + "_" + kind + "_xg"] = complex_ops.real_vdot(x, g)
        return out

    out = H.run(case[0], conf, build)
    rtol = 1e-4 if dtype == "float32" else 1e-12
    for tag in ("", "c_"):
        for key in ("il", "rs"):
            f = tag + key + "_fused"
            np.testing.assert_array_equal(out[f], out[tag + key + "_full"])
            np.testing.assert_array_equal(out[f + "_g"], out[tag + key + "_full_g"])
            assert np.max(np.abs(out[f])) > 0
            np.testing.assert_allclose(out[f + "_xg"], out[f + "_loss"], rtol=rtol)


def test_inverse_laplace_rejects_other_dims():
    """A field not on [kx, ky, kz] (e.g. transposed) is refused at graph construction."""
    conf = SimConfig(nc=(4, 4, 4))
    with tf.Graph().as_default():
        mesh = mtf.Mesh(mtf.Graph(), "mesh")
        kern = kernels.make_kernels(conf, mesh)
        z = mtf.zeros(mesh, fft.k_shape(conf), tf.complex64)
        with pytest.raises(ValueError, match="must be on"):
            kern.inverse_laplace(mtf.transpose(z, mtf.Shape(fft.k_shape(conf).dims[::-1])))
        with pytest.raises(ValueError, match="must be"):
            ics.apply_radial_kernel(mtf.transpose(z, mtf.Shape(fft.k_shape(conf).dims[::-1])),
                                    conf, _values, "rs")
