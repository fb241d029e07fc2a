r"""Model-parallel 3D convolution of images split over x and y.

An image with channels ``[x, y, z, c_in]`` (``x`` on mesh axis ``row``, ``y`` on
``col``) is cut into its blocks ``[bx, by, sx, sy, z, c_in]`` (one per rank, a local
reshape: :func:`flowpm_mtf.mesh.halo.to_blocks`); Mesh TF's ``mtf.halo_exchange`` brings
each block the ``k // 2`` planes of its neighbours along x then y (corners included;
only the margins travel, through ``mesh_impl.shift_by_n_processors``; a halo wider
than a block takes whole blocks); ``z``, which is local, is padded in place; then
``mtf.Conv3dOperation`` runs ``tf.nn.conv3d`` with ``"VALID"`` padding on every block
and the result is reshaped back to ``[x, y, z, c_out]``. This is what
``mtf.layers.conv3d_with_blocks`` does, on our field layout and with the filter as an
argument (a variable, or any tensor).

Padding (the documented choice)
-------------------------------
``padding="zero"`` (default) treats the volume as surrounded by zeros: the result
equals ``tf.nn.conv3d(x, w, strides=1, padding="SAME")`` on the whole volume (odd
filter sizes), the usual CNN convention. ``padding="periodic"`` wraps around (the
halo exchange of :mod:`flowpm_mtf.mesh.halo`): the result equals ``"VALID"`` on the
volume padded with ``numpy.pad(mode="wrap")``.

Gradients (with respect to the image and the filter) are Mesh TF's: the shifts,
slices and concatenations transpose into the reverse halo exchange, and the filter
gradient sums the blocks' contributions (an allreduce over the grid). Like
``tf.nn.conv3d`` this is a cross-correlation.
"""
import logging

import mesh_tensorflow as mtf

from flowpm_mtf.mesh import halo
from flowpm_mtf.layout import BX, BY, SX, SY, REAL_DIMS, Z

__all__ = ["PADDINGS", "filter_shape", "conv3d"]

log = logging.getLogger(__name__)

PADDINGS = ("zero", "periodic")
"""Boundary conditions of :func:`conv3d`."""

FILTER_DIMS = ("fx", "fy", "fz")
"""Names of the filter's spatial dimensions."""


def filter_shape(size, in_dim, out_dim):
    """mtf Shape ``[fx, fy, fz, c_in, c_out]`` of a filter of ``size`` (3 odd ints)."""
    return mtf.Shape([mtf.Dimension(n, int(s)) for n, s in zip(FILTER_DIMS, size)]
                     + [in_dim, out_dim])


def conv3d(image, kernel, conf, padding="zero", name="conv3d"):
    """3D convolution (cross-correlation, stride 1) of a split image.

    Parameters
    ----------
    image : mtf.Tensor
        ``[x, y, z, c_in]`` (x on ``row``, y on ``col``).
    kernel : mtf.Tensor
        ``[fx, fy, fz, c_in, c_out]`` with odd spatial sizes (:func:`filter_shape`);
        any tensor (a variable for a trainable layer).
    conf : ImagingConfig
        The volume and process grid.
    padding : {"zero", "periodic"}
        Boundary condition (see the module docstring).
    name : str

    Returns
    -------
    mtf.Tensor
        ``[x, y, z, c_out]``, dtype of ``image``.

    Raises
    ------
    ValueError
        For a wrong shape, an even filter size, a filter wider than the volume or an
        unknown padding.
    """
    if padding not in PADDINGS:
        raise ValueError("padding must be one of %s, got %r" % (", ".join(PADDINGS), padding))
    dims = image.shape.dims
    if len(dims) != 4 or [d.name for d in dims[:3]] != list(REAL_DIMS) \
            or tuple(d.size for d in dims[:3]) != tuple(conf.nc):
        raise ValueError("conv3d: the image must have shape [x, y, z, channels] with "
                         "x, y, z = %s, got %s" % (conf.nc, image.shape.to_string))
    kd = kernel.shape.dims
    if len(kd) != 5 or kd[3] != dims[3]:
        raise ValueError("conv3d: the filter must have shape [fx, fy, fz, %s, c_out], got %s"
                         % (dims[3].name, kernel.shape.to_string))
    size = [d.size for d in kd[:3]]
    if any(s % 2 == 0 for s in size):
        raise ValueError("conv3d: filter sizes must be odd, got %s" % (size,))
    if any(s // 2 > n for s, n in zip(size, conf.nc)):
        raise ValueError("conv3d: filter %s is wider than the volume %s" % (size, conf.nc))
    if kd[4] in dims[:3] or kd[4].name in FILTER_DIMS:
        raise ValueError("conv3d: the output channel dimension must be new, got %s" % (kd[4],))
    wrap = padding == "periodic"
    log.debug("conv3d %s * %s (%s padding)", image.shape.to_string, size, padding)
    t = halo.to_blocks(image, conf)                         # [bx, by, sx, sy, z, c_in]
    for block_dim, inner_dim, h in ((BX, SX, size[0] // 2), (BY, SY, size[1] // 2)):
        if h:
            t = mtf.halo_exchange(t, t.shape.get_dim_by_name(block_dim),
                                  t.shape.get_dim_by_name(inner_dim), h, wrap=wrap)
    hz, nz = size[2] // 2, conf.nc[2]
    if hz:
        if wrap:
            t = mtf.concat([mtf.slice(t, nz - hz, hz, Z), t, mtf.slice(t, 0, hz, Z)], Z)
        else:
            t = mtf.pad(t, [hz, hz], Z)
    y = mtf.Conv3dOperation(t, kernel, [1, 1, 1, 1, 1], "VALID", name=name).outputs[0]
    # [bx, by, sx, sy, z, c_out] -> [bx, sx, by, sy, z, c_out] -> [x, y, z, c_out]
    bx, by, sx, sy, z, cout = y.shape.dims
    y = mtf.transpose(y, mtf.Shape([bx, sx, by, sy, z, cout]))
    out = mtf.Shape([mtf.Dimension(d, n) for d, n in zip(REAL_DIMS, conf.nc)] + [cout])
    return mtf.reshape(y, out)
