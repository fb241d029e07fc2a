"""No rank's TF graph holds the full volume in the MRI pipeline (issue 29).

The whole imaging graph (phantom, mask, noise, measurement, zero-filled and TV-ADMM
reconstructions, the stepped TV's iteration, the model-parallel convolution with its
gradients, the unrolled network's Adam step on a fed phantom, PSNR and SSIM; and with
4 coils: SENSE's measurement, the root-sum-of-squares, the stepped TV-SENSE and the
network's Adam step through SENSE on augmented copies of the volume) is
lowered with HvdSimdMeshImpl on the grids of the world size (2 or 4 ranks), and every
rank checks every TF tensor its outputs depend on: at most the rank's block padded by the
widest halo (3 planes, SSIM's window), ``(nx/P + 6)(ny/Q + 6) nz`` voxels. Axes of <= 4
elements (channels, unit block axes; the network here has 4 hidden channels) do not
count as voxels; the operations of the multi-coil graph (names in :data:`COIL_OPS`) may hold
the rank's share for each of the 4 coils (the FFT folds the coil axis into its pencils),
so their bound is 4 times that (a gathered 4-coil volume is still above it); the mask
plane ``ny nz`` is
2D and smaller. With 32^3 a full-size volume is 1.2x (2 ranks) or 2.1x (4 ranks) the
bound, so a gathered or full-size tensor fails.
"""
import numpy as np
import pytest
import mesh_tensorflow as mtf
import tensorflow.compat.v1 as tf

from conftest import world

tf.disable_eager_execution()

RANK, SIZE = world()
GRIDS = {2: [(2, 1), (1, 2)], 4: [(2, 2)]}.get(SIZE, [])
NC, HALO, SHORT = 32, 3, 4
COIL_OPS = ("measure", "sense", "tvs", "coil_maps", "train_sense", "augment")
"""Name prefixes of the multi-coil graph's operations (SHORT coils)."""


def _voxels(shape):
    return int(np.prod([n for n in shape if n > SHORT]))


def build(mesh, conf):
    """The mtf tensors and the mtf update operations of the imaging graphs."""
    from mri_mtf import augment, conv, metrics, operators, phantom, recon, sampling, unrolled
    from mri_mtf import sense, tv_sense
    from flowpm_mtf.mesh import complex_ops

    truth = phantom.phantom(mesh, conf)
    mask = sampling.mask(mesh, conf)
    kdata = operators.forward(truth, mask, conf) + complex_ops.apply_kernel(
        sampling.complex_noise(mesh, conf), mask)
    zf = recon.zero_filled(kdata, mask, conf)
    tv = operators.magnitude(recon.tv_admm(kdata, mask, conf, recon.TVConfig(iterations=2)))
    c = mtf.Dimension("c", 1)
    img = mtf.reshape(tv, mtf.Shape(tv.shape.dims + [c]))
    w = mtf.ones(mesh, conv.filter_shape((3, 3, 3), c, mtf.Dimension("cout", 2)), tv.dtype)
    y = conv.conv3d(img, w, conf)
    gx, gw = mtf.gradients([mtf.reduce_sum(mtf.square(y))], [img, w])
    stepped = recon.SteppedTV(kdata, mask, conf, recon.TVConfig(iterations=2))
    uconf = unrolled.UnrolledConfig(blocks=1, channels=SHORT)
    train = unrolled.UnrolledTraining(mesh, conf, uconf, mask,
                                      unrolled.make_weights(mesh, conf, uconf))
    op = sense.Sense(mesh, conf, SHORT, mask)       # the coil axis (4) is not a voxel axis
    ycoils = op.measure(truth)
    tvs = tv_sense.SteppedTVSense(ycoils, op, recon.TVConfig(iterations=2))
    train_sense = unrolled.UnrolledTraining(
        mesh, conf, uconf, mask, unrolled.make_weights(mesh, conf, uconf, name="net_sense"),
        name="train_sense", op=op, source=augment.VolumeAugmentation(truth, conf, 1))
    return ([metrics.psnr(zf, truth), metrics.ssim(tv, truth), gx, gw, train.loss,
             metrics.psnr(op.rss(ycoils), truth, weights=truth), train_sense.loss],
            stepped.step_ops + stepped.init_ops + train.step_ops + tvs.step_ops
            + tvs.init_ops + train_sense.step_ops)


def violations(grid, gather=False):
    """TF tensors of this rank's lowered imaging graph above the share, and with ``gather``
    those of a replicated (full-size) copy of the TV image added to the same graph, which
    the check must catch (the copy's own ancestors: it changes nothing else's lowering).
    Returns ``(bad, bad_of_the_gather)``."""
    from hvd_mesh_impl import HvdSimdMeshImpl
    from hvd_mesh_impl.training import ancestors
    from mri_mtf.config import ImagingConfig

    conf = ImagingConfig(nc=NC, grid=grid)
    P, Q = grid
    bound = (NC // P + 2 * HALO) * (NC // Q + 2 * HALO) * NC
    assert bound < NC ** 3
    impl = HvdSimdMeshImpl(conf.mesh_shape, conf.layout_rules)
    bad, bad_gather = [], []

    def check(ops, out):
        for op in ops:
            for t in op.outputs:
                limit = bound * SHORT if op.name.startswith(COIL_OPS) else bound
                if t.shape.is_fully_defined() and _voxels(t.shape.as_list()) > limit:
                    out.append("%s (%s) %s" % (t.name, op.type, t.shape.as_list()))

    with tf.Graph().as_default():
        graph = mtf.Graph()
        mesh = mtf.Mesh(graph, "mesh")
        outs, updates = build(mesh, conf)
        if gather:
            full = mtf.rename_dimension(mtf.rename_dimension(outs[2], "x", "xa"), "y", "ya")
            gathered = mtf.reduce_sum(full)
        lowering = mtf.Lowering(graph, {mesh: impl})

        def root(t):
            return lowering.tensors[t].to_laid_out_tensor().tensor_list[0].op

        roots = [root(t) for t in outs]
        roots += [lowering.lowered_operation(op) for op in updates]
        check(ancestors(roots), bad)
        if gather:
            check(ancestors([root(gathered)]), bad_gather)
    return bad, bad_gather


_CACHE = {}


def cached_violations(grid):
    """:func:`violations` of ``grid``, the gather added on the first grid: one lowering of
    the imaging graph per grid for both tests."""
    if grid not in _CACHE:
        _CACHE[grid] = violations(grid, gather=grid == GRIDS[0])
    return _CACHE[grid]


@pytest.mark.skipif(SIZE == 1, reason="on one rank the share is the whole volume")
@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: "x".join(map(str, g)))
def test_imaging_graph_holds_only_the_ranks_share(grid):
    bad, _ = cached_violations(grid)
    assert not bad, "rank %d holds full-size arrays:\n%s" % (RANK, "\n".join(bad[:30]))


@pytest.mark.skipif(SIZE == 1, reason="on one rank the share is the whole volume")
def test_a_gathered_volume_is_caught():
    assert cached_violations(GRIDS[0])[1]
