"""Block representation and periodic halo exchange.

Data movement is checked *exactly* on integer ``arange`` inputs against a
numpy model of the padded blocks; fill and reduce are checked to be adjoint
(dot-product test, and each is the other's gradient); and on several ranks the
bytes received by the halo fill are exactly the halo slabs (no allgather).
"""
import numpy as np
import pytest
import mesh_tensorflow as mtf
import tensorflow.compat.v1 as tf

import fpm_harness as H
from flowpm_mtf.mesh import complex_ops, fft, halo
from flowpm_mtf.config import SimConfig

# <fill(a), b> and <a, reduce(b)> are float64 sums of ~10^3 products in
# different orders: relative rounding ~1e-13 at most.
ADJOINT_RTOL = 1e-12
NC = (8, 12, 4)
CASES = H.cases(single=True, placement=False)


def conf_for(case, h, dtype="float64"):
    return SimConfig(nc=NC, grid=case[1], halo_size=h, dtype=dtype)


# ----------------------------------------------------------------------------- numpy model
def np_to_blocks(field, conf):
    (P, Q), (sx, sy, nz) = conf.grid, conf.block_shape
    return field.reshape(P, sx, Q, sy, nz).transpose(0, 2, 1, 3, 4)


def np_from_blocks(blocks, conf):
    return blocks.transpose(0, 2, 1, 3, 4).reshape(conf.nc)


def np_global_index(conf):
    """Global (x, y) cell of every padded-block entry (i, j, p, q), periodic."""
    (P, Q), (px, py, _), h = conf.grid, conf.padded_block_shape, conf.halo_size
    sx, sy, _ = conf.block_shape
    i, j, p, q = np.meshgrid(np.arange(P), np.arange(Q), np.arange(px), np.arange(py),
                             indexing="ij")
    return (i * sx + p - h) % conf.nc[0], (j * sy + q - h) % conf.nc[1]


def np_fill(padded, conf):
    h = conf.halo_size
    sx, sy, _ = conf.block_shape
    glob = np_from_blocks(padded[:, :, h:h + sx, h:h + sy], conf)
    gx, gy = np_global_index(conf)
    return glob[gx, gy]


def np_reduce(padded, conf):
    h = conf.halo_size
    sx, sy, _ = conf.block_shape
    gx, gy = np_global_index(conf)
    glob = np.zeros(conf.nc, padded.dtype)
    np.add.at(glob, (gx, gy), padded)
    out = np.zeros_like(padded)
    out[:, :, h:h + sx, h:h + sy] = np_to_blocks(glob, conf)
    return out


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("case", CASES, ids=H.case_id)
@pytest.mark.parametrize("h", [1, 3])
@pytest.mark.parametrize("dtype", [np.float64, np.int32], ids=["float64", "int32"])
def test_blocks_and_halo_exact_on_arange(case, h, dtype):
    conf = conf_for(case, h)
    field = np.arange(np.prod(NC)).reshape(NC).astype(dtype)
    pshape = (conf.grid[0], conf.grid[1]) + conf.padded_block_shape
    padded0 = (np.arange(np.prod(pshape)).reshape(pshape) * 7 + 1).astype(dtype)

    def build(mesh):
        f = mtf.import_tf_tensor(mesh, tf.constant(field), fft.real_shape(conf))
        p = mtf.import_tf_tensor(mesh, tf.constant(padded0), halo.padded_shape(conf))
        blocks = halo.to_blocks(f, conf)
        return {"blocks": blocks,
                "back": halo.from_blocks(blocks, conf),
                "padded": halo.pad_blocks(blocks, conf),
                "filled_field": halo.field_to_padded(f, conf),
                "unpadded": halo.unpad_blocks(p, conf),
                "fill": halo.halo_fill(p, conf),
                "reduce": halo.halo_reduce(p, conf),
                "to_field": halo.padded_to_field(halo.halo_reduce(p, conf), conf),
                "reduced_to_field": halo.reduced_to_field(p, conf)}

    out = H.run(case[0], conf, build)
    (P, Q), (sx, sy, nz) = conf.grid, conf.block_shape
    blocks = np_to_blocks(field, conf)
    padded = np.zeros(pshape, dtype)
    padded[:, :, h:h + sx, h:h + sy] = blocks
    np.testing.assert_array_equal(out["blocks"], blocks)
    np.testing.assert_array_equal(out["back"], field)
    np.testing.assert_array_equal(out["padded"], padded)
    np.testing.assert_array_equal(out["filled_field"], np_fill(padded, conf))
    np.testing.assert_array_equal(out["unpadded"], padded0[:, :, h:h + sx, h:h + sy])
    np.testing.assert_array_equal(out["fill"], np_fill(padded0, conf))
    np.testing.assert_array_equal(out["reduce"], np_reduce(padded0, conf))
    red = np_reduce(padded0, conf)
    np.testing.assert_array_equal(out["to_field"],
                                  np_from_blocks(red[:, :, h:h + sx, h:h + sy], conf))
    np.testing.assert_array_equal(out["reduced_to_field"], out["to_field"])
    # the filled margins of the field hold its periodic neighbours
    gx, gy = np_global_index(conf)
    np.testing.assert_array_equal(out["filled_field"], field[gx, gy])


@pytest.mark.parametrize("case", CASES, ids=H.case_id)
@pytest.mark.parametrize("h", [1, 2, 3])
def test_fill_and_reduce_are_adjoint(case, h):
    """On padded blocks (halo_fill, halo_reduce) and between a field and padded blocks
    (field_to_padded filled, reduced_to_field: one copy per axis; h = 3 on small blocks
    takes their general path): each pair is adjoint, and each is the other's gradient."""
    conf = conf_for(case, h)
    pshape = conf.grid + conf.padded_block_shape
    rng = np.random.RandomState(5)
    a0, b0, f0 = rng.randn(*pshape), rng.randn(*pshape), rng.randn(*NC)

    def build(mesh):
        a = mtf.import_tf_tensor(mesh, tf.constant(a0), halo.padded_shape(conf))
        b = mtf.import_tf_tensor(mesh, tf.constant(b0), halo.padded_shape(conf))
        f = mtf.import_tf_tensor(mesh, tf.constant(f0), fft.real_shape(conf))
        out = {}
        for tag, x, fill, red in (("", a, halo.halo_fill(a, conf), halo.halo_reduce(b, conf)),
                                  ("field_", f, halo.field_to_padded(f, conf),
                                   halo.reduced_to_field(b, conf))):
            l_fill = complex_ops.real_vdot(b, fill)   # <fill x, b>
            l_red = complex_ops.real_vdot(red, x)     # <x, reduce b>
            g_fill, = mtf.gradients([l_fill], [x])
            g_red, = mtf.gradients([l_red], [b])
            out.update({tag + "l_fill": l_fill, tag + "l_red": l_red, tag + "fill": fill,
                        tag + "red": red, tag + "g_fill": g_fill, tag + "g_red": g_red})
        return out

    out = H.run(case[0], conf, build)
    for tag in ("", "field_"):
        np.testing.assert_allclose(out[tag + "l_fill"], out[tag + "l_red"], rtol=ADJOINT_RTOL)
        # gradient of fill is reduce and vice versa (same linear data movement: exact)
        np.testing.assert_array_equal(out[tag + "g_fill"], out[tag + "red"])
        np.testing.assert_array_equal(out[tag + "g_red"], out[tag + "fill"])


@pytest.mark.skipif(H.SIZE == 1, reason="no communication on one rank")
@pytest.mark.parametrize("grid", H.HVD_GRIDS.get(H.SIZE, []), ids=str)
def test_only_halo_bytes_move(grid):
    """HvdSimdMeshImpl: a halo fill receives exactly two h-cell slabs per split axis."""
    h = 2
    conf = SimConfig(nc=NC, grid=grid, halo_size=h, dtype="float64")
    px, py, nz = conf.padded_block_shape

    def build(mesh):
        p = mtf.zeros(mesh, halo.padded_shape(conf), dtype=tf.float64)
        return {"sum": mtf.reduce_sum(halo.halo_fill(p, conf))}

    def extra(lowering, impl):
        return {"bytes": impl.comm_bytes_received("receive"),
                "allconcat": impl.comm_bytes_received("allconcat"),
                "alltoall": impl.comm_bytes_received("alltoall")}

    out = H.run("hvd", conf, build, extra=extra)
    expected = 0
    if grid[0] > 1:
        expected += 2 * h * py * nz * 8
    if grid[1] > 1:
        expected += 2 * px * h * nz * 8
    assert out["bytes"] == expected
    assert out["allconcat"] == 0 and out["alltoall"] == 0


def test_shape_errors():
    conf = SimConfig(nc=NC, grid=(2, 2), halo_size=1)
    with tf.Graph().as_default():
        mesh = mtf.Mesh(mtf.Graph(), "m")
        with pytest.raises(ValueError, match="halo_fill: expected a tensor of shape"):
            halo.halo_fill(mtf.zeros(mesh, halo.block_shape(conf)), conf)
        with pytest.raises(ValueError, match="to_blocks"):
            halo.to_blocks(mtf.zeros(mesh, fft.k_shape(conf)), conf)

