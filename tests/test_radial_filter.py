"""Radial filters of real fields on half the spectrum (flowpm_mtf/mesh/radial_filter.py, the native
``FlowpmRadialScaleHalf`` of native/kspace_ops.cc).

* The op against what it replaces, ``pairs_extend`` -> ``FlowpmRadialScale`` ->
  ``pairs_fold``, bit for bit: every combination of first blocks, in the field's memory or
  not, float32 and float64, one and four threads; bad inputs.
* ``radial_filter`` on every grid of the world size, on the half path and on the full
  fallback (and the TensorFlow path), against numpy's ``irfftn(K rfftn(f))`` in float64 and
  against the composition ``c2r(apply_radial_kernel(r2c(f)))``; its gradient (the filter
  itself) by the dot-product test, with float64 round-off tolerances.
* The lowered half path has no full spectrum: no ``FlowpmPairs`` among the ops a filter
  runs; the job's ICs run two half filters and no ``FlowpmPairs``.
"""
import mesh_tensorflow as mtf
import numpy as np
import pytest
import tensorflow.compat.v1 as tf

import fpm_harness as H
from flowpm_mtf.mesh import complex_ops, fft, fft_local, radial_filter
from flowpm_mtf.physics import ics
from flowpm_mtf import native
from flowpm_mtf.config import SimConfig

tf.disable_eager_execution()

PAIRS = [(np.float32, np.complex64), (np.float64, np.complex128)]


def _mirror(p, first):
    return p if (first and p < 2) else p ^ 1


def _symmetric_indices(rng, n, first, bound):
    """Random table indices along an axis in mirror-pair order, equal at a position and
    its mirror (a radial kernel's)."""
    idx = np.empty(n, np.int32)
    for p in range(n):
        m = _mirror(p, first)
        idx[p] = idx[m] if m < p else rng.randint(0, bound)
    return idx


def _op_case(rng, rtype, ctype, first_y, first_z, shape=(6, 4, 3)):
    nx, ly, h = shape
    f = (rng.randn(*shape) + 1j * rng.randn(*shape)).astype(ctype)
    table = (rng.rand(3, 4, 5) + 0.5).astype(rtype)
    ix = _symmetric_indices(rng, nx, True, 3)
    iy = _symmetric_indices(rng, ly, bool(first_y), 4)
    iz = np.empty(2 * h, np.int32)
    for j in range(h):
        iz[2 * j] = rng.randint(0, 5)
        iz[2 * j + 1] = rng.randint(0, 5) if (first_z and j == 0) else iz[2 * j]
    return f, table, ix, iy, iz, np.array([first_y, first_z], np.int32)


@pytest.mark.skipif(H.SIZE != 1, reason="a single-process TensorFlow test")
@pytest.mark.parametrize("rtype,ctype", PAIRS)
@pytest.mark.parametrize("first_y", [0, 1])
@pytest.mark.parametrize("first_z", [0, 1])
def test_op_equals_extend_scale_fold(rtype, ctype, first_y, first_z):
    """The op, on a held and on a forwarded input, equals the extend / scale / fold
    composition bit for bit (the packed slot included), and leaves a held input alone."""
    lib = native.load("kspace_ops")
    rng = np.random.RandomState(10 + 2 * first_y + first_z)
    f, table, ix, iy, iz, firsts = _op_case(rng, rtype, ctype, first_y, first_z)
    with tf.Graph().as_default(), tf.Session() as sess:
        ft, tt, fs = tf.constant(f), tf.constant(table), tf.constant(firsts)
        i3 = [tf.constant(i) for i in (ix, iy, iz)]
        ref = fft_local.pairs_fold(
            lib.flowpm_radial_scale(fft_local.pairs_extend(ft, fs), tt, *i3), fs)
        out = sess.run({"held": radial_filter.radial_scale_half(ft, tt, *i3, fs),
                        "free": radial_filter.radial_scale_half(ft * ctype(1), tt, *i3, fs),
                        "ref": ref, "f": ft})
    np.testing.assert_array_equal(out["f"], f)
    assert np.max(np.abs(out["ref"] - f * table[ix[0], iy[0], iz[2]])) > 0   # not trivial
    for key in ("held", "free"):
        np.testing.assert_array_equal(out[key], out["ref"])


@pytest.mark.skipif(H.SIZE != 1, reason="a single-process TensorFlow test")
def test_op_threads_independent():
    """One and four threads of the intra-op pool write the same bits, in place."""
    lib = native.load("kspace_ops")
    rng = np.random.RandomState(3)
    f, table, ix, iy, iz, firsts = _op_case(rng, np.float32, np.complex64, 1, 1, (16, 12, 9))
    outs = []
    for threads in (1, 4):
        cfg = tf.ConfigProto(intra_op_parallelism_threads=threads,
                             inter_op_parallelism_threads=1)
        with tf.Graph().as_default(), tf.Session(config=cfg) as sess:
            outs.append(sess.run(lib.flowpm_radial_scale_half(
                tf.constant(f) * 1, table, ix, iy, iz, firsts)))
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.skipif(H.SIZE != 1, reason="a single-process TensorFlow test")
def test_op_bad_input():
    """Index vectors of the wrong length, an index outside the table, odd extents, a
    missing first flag: one clear error each."""
    lib = native.load("kspace_ops")
    f = np.zeros((4, 2, 3), np.complex64)
    t = np.ones((2, 2, 2), np.float32)
    i = [np.zeros(n, np.int32) for n in (4, 2, 6)]
    fs = np.array([1, 1], np.int32)
    cases = [
        (lambda: lib.flowpm_radial_scale_half(f, t, i[0], i[1], i[1], fs),
         "iz must be a vector of 6"),
        (lambda: lib.flowpm_radial_scale_half(f, t, i[0], i[1], i[2] + 2, fs),
         "index 2 of axis 2 is outside the table"),
        (lambda: lib.flowpm_radial_scale_half(f[:3], t, i[0][:3], i[1], i[2], fs),
         "extents must be even"),
        (lambda: lib.flowpm_radial_scale_half(f, t, i[0], i[1], i[2], fs[:1]),
         "firsts must hold 2 values"),
    ]
    for make, message in cases:
        with tf.Graph().as_default(), tf.Session() as sess:
            with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match=message):
                sess.run(make())


@pytest.mark.skipif(H.SIZE != 1, reason="a single-process TensorFlow test")
@pytest.mark.parametrize("rtype,ctype", PAIRS)
def test_summed_table_equals_grid(rtype, ctype):
    """The 1-d table over n = mx^2 + my^2 + mz^2 with the squared mode numbers
    (``radial_table_numpy(summed=True)``) gives both radial ops the bits of the grid of distinct
    |k| (slices of a cubic box's k with both signs and the Nyquist mode); a summed index
    past the table's end is refused with one clear error."""
    lib = native.load("kspace_ops")
    box, n = 100.0, 8
    dk = 2 * np.pi / box
    kfull = 2 * np.pi * np.fft.fftfreq(n, d=box / n)
    kx, ky, kz = kfull, kfull[[0, 1, 7, 6]], kfull[:6]       # ky block in mirror pairs
    rng = np.random.RandomState(3)
    f = (rng.randn(n, 4, 6) + 1j * rng.randn(n, 4, 6)).astype(ctype)
    half = (rng.randn(n, 4, 3) + 1j * rng.randn(n, 4, 3)).astype(ctype)
    grid = radial_filter.radial_table_numpy(kx, ky, kz, _values, rtype, dk)
    summed = radial_filter.radial_table_numpy(kx, ky, kz, _values, rtype, dk, summed=True)
    assert grid[0].ndim == 3 and summed[0].ndim == 1
    fs = np.array([1, 1], np.int32)
    with tf.Graph().as_default(), tf.Session() as sess:
        got = sess.run([lib.flowpm_radial_scale(f, *grid), lib.flowpm_radial_scale(f, *summed),
                        lib.flowpm_radial_scale_half(half, *grid, fs),
                        lib.flowpm_radial_scale_half(half, *summed, fs)])
    assert np.max(np.abs(got[0])) > 0.1
    np.testing.assert_array_equal(got[0], got[1])
    np.testing.assert_array_equal(got[2], got[3])
    table, ix, iy, iz = summed
    with tf.Graph().as_default(), tf.Session() as sess:
        with pytest.raises(tf.errors.InvalidArgumentError, match="summed indices reach"):
            sess.run(lib.flowpm_radial_scale(f, table[:-1], ix, iy, iz))


def _values(k):
    return np.sqrt(1e3 * k ** -1.5 * np.exp(-k)) / (k * k)


def _numpy_filter(x, conf, values):
    """irfftn(K(|k|) rfftn(x)) in float64, K = 0 at k = 0."""
    (nx, ny, nz), (lx, ly, lz) = conf.nc, conf.box_size
    ks = [2 * np.pi * np.fft.fftfreq(nx, d=lx / nx), 2 * np.pi * np.fft.fftfreq(ny, d=ly / ny),
          2 * np.pi * np.fft.rfftfreq(nz, d=lz / nz)]
    kk = np.sqrt(ks[0][:, None, None] ** 2 + ks[1][None, :, None] ** 2
                 + ks[2][None, None, :] ** 2)
    kern = np.zeros_like(kk)
    kern[kk > 0] = values(kk[kk > 0])
    return np.fft.irfftn(np.fft.rfftn(x.astype(np.float64)) * kern, s=x.shape, axes=(0, 1, 2))


def _ran_ops(ops):
    """{op type: count} of the TF ``ops`` and of the ops they depend on."""
    seen, stack, count = set(), list(ops), {}
    while stack:
        op = stack.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        count[op.type] = count.get(op.type, 0) + 1
        stack.extend(i.op for i in op.inputs)
        stack.extend(op.control_inputs)
    return count


@pytest.mark.parametrize("case", H.cases(placement=False), ids=H.case_id)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("path", ["half", "full", "tf"])
def test_filter_against_numpy_and_composition(case, dtype, path, monkeypatch):
    """``radial_filter`` equals numpy's filter and the composition it replaces, on the half
    path (its ops: no FlowpmPairs), the native full fallback and the TensorFlow path;
    <y, F x> = <F y, x> through ``mtf.gradients``."""
    if path == "full":
        monkeypatch.setattr(fft, "half_path_serves", lambda *a: False)
    if path == "tf":
        monkeypatch.setattr(native, "load", lambda name: None)
    conf = SimConfig(nc=(8, 8, 12), box_size=(40.0, 40.0, 60.0), grid=case[1], dtype=dtype)
    rng = np.random.RandomState(5)
    x0, y0 = rng.randn(*conf.nc).astype(dtype), rng.randn(*conf.nc).astype(dtype)
    seen = {}

    def build(mesh):
        real = fft.real_shape(conf)
        x = mtf.import_tf_tensor(mesh, tf.constant(x0), real)
        y = mtf.import_tf_tensor(mesh, tf.constant(y0), real)
        fx = radial_filter.radial_filter(x, conf, _values, name="filt")
        comp = fft.c2r(ics.apply_radial_kernel(fft.r2c(x, conf), conf, _values, "comp"), conf)
        seen["fx"] = fx
        loss = complex_ops.real_vdot(y, fx)
        g, = mtf.gradients([loss], [x])
        return {"fx": fx, "comp": comp, "loss": loss, "xg": complex_ops.real_vdot(x, g),
                "g": g}

    def extra(lowering, impl):
        seen["ops"] = _ran_ops(
            t.op for t in lowering.tensors[seen["fx"]].to_laid_out_tensor().tensor_list)
        return {}

    out = H.run(case[0], conf, build, extra=extra)
    want = _numpy_filter(x0, conf, _values)
    tol = 2e-5 if dtype == "float32" else 1e-12
    scale = np.max(np.abs(want))
    assert scale > 0
    assert np.max(np.abs(out["fx"] - want)) < tol * scale
    assert np.max(np.abs(out["fx"] - out["comp"])) < tol * scale
    assert np.max(np.abs(out["g"] - _numpy_filter(y0, conf, _values))) < tol * scale
    np.testing.assert_allclose(out["xg"], out["loss"], rtol=1e-4 if dtype == "float32"
                               else 1e-11)
    half = path == "half" and fft.half_spectrum_fits(conf.nc, case[1])
    assert ("FlowpmRadialScaleHalf" in seen["ops"]) == half
    if half:
        assert "FlowpmPairs" not in seen["ops"]


def test_filter_rejects_bad_fields():
    """A field not on [x, y, z] or not of the configuration's dtype is refused at graph
    construction."""
    conf = SimConfig(nc=(4, 4, 4))
    with tf.Graph().as_default():
        mesh = mtf.Mesh(mtf.Graph(), "mesh")
        z = mtf.zeros(mesh, fft.real_shape(conf), tf.float32)
        with pytest.raises(ValueError, match="must be"):
            radial_filter.radial_filter(
                mtf.transpose(z, mtf.Shape(fft.real_shape(conf).dims[::-1])), conf, _values)
        with pytest.raises(ValueError, match="dtype float32"):
            radial_filter.radial_filter(mtf.cast(z, tf.float64), conf, _values)


@pytest.mark.skipif(H.SIZE != 1, reason="a graph inspection on one rank")
def test_job_ics_use_half_filters():
    """The job's ICs (the 2LPT state) run the two potentials as half-spectrum filters:
    two FlowpmRadialScaleHalf, no FlowpmPairs (no full spectrum)."""
    with H.job_graph((1, 1)) as (conf, impl, graph, mesh, sim):
        lowering = mtf.Lowering(graph, {mesh: impl})
        count = _ran_ops(lowering.lowered_operation(op) for op in sim.init_ops)
    assert count.get("FlowpmRadialScaleHalf") == 2, count
    assert "FlowpmPairs" not in count
    assert "FlowpmInverseLaplace" not in count
