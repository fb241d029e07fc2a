r"""A real brain volume from a NIfTI file, resampled to the grid, each rank reading its slab.

Sources
-------
``"mni152"`` is the MNI ICBM152 2009a nonlinear symmetric T1 template (1 mm, 197 x 233
x 189 voxels, skull-stripped, uint8), the file
``nilearn/datasets/data/mni_icbm152_t1_tal_nlin_sym_09a_converted.nii.gz`` shipped in the
nilearn wheel (found from the installed package, never downloaded); any other value is
the path of a 3D NIfTI file (``.nii`` or ``.nii.gz``, read with nibabel).

Resampling
----------
The field of view is a box of the source (for ``mni152`` the brain's bounding box
:data:`MNI152_BOX`, otherwise the whole volume) scaled isotropically *in millimetres* to
fit the grid ``nc``: with the source's voxel sizes ``d_a`` [mm] (the header's
``get_zooms()``), the output voxel is a cube of ``H = max_a(extent_a d_a / nc_a)`` mm,
``h_a = H / d_a`` source voxels along axis ``a``, the box centred (zero outside the
source); so a file of 1 x 1 x 3 mm voxels keeps its physical aspect. Along each axis the
output voxel ``i`` is the mean of the source's linear interpolation at ``s = ceil(h_a)``
equally spaced points inside it (a box filter: no aliasing of the fine anatomy into a
coarse grid; plain linear interpolation along an axis of thick voxels, ``h_a < 1``), so
the resampling is separable, ``out = W_x W_y W_z src`` with sparse 1-D matrices
(:func:`resampling_matrix`). A box whose extent along an axis is below ``nc_a`` voxels of
the source's finest size ``min_a d_a`` is refused (for cubic voxels: fewer voxels than
``nc``; the grid would be finer than the data), and so is an oblique affine (a rotation
that is not a permutation of the axes: the grid is the file's voxel axes). The output is
raw intensity; the job divides it by its maximum (a Mesh TF reduction: no rank holds the
volume) to get ``[0, 1]``.

Each rank reads only the source block its slab needs (nibabel's ``dataobj`` slicing):
for an uncompressed ``.nii`` that is the bytes of the block (memory-mapped); for a
``.nii.gz`` the gzip stream is decompressed from its start up to the block's last byte
(gzip cannot seek), so the time is that of reading up to the slab, the memory that of
the block.

Brain mask
----------
Voxels whose normalised intensity exceeds :data:`BRAIN_THRESHOLD` (the template is
skull-stripped: outside the brain it is 0).
"""
import logging
import math
import os

import numpy as np

__all__ = ["MNI152_FILE", "MNI152_BOX", "BRAIN_THRESHOLD", "AFFINE_RTOL", "source_path",
           "voxel_sizes", "VolumeSource",
           "resampling_matrix", "resample_numpy"]

log = logging.getLogger(__name__)

MNI152_FILE = "mni_icbm152_t1_tal_nlin_sym_09a_converted.nii.gz"
"""The T1 template's file name in ``nilearn/datasets/data``."""

MNI152_BOX = ((26, 171), (27, 208), (0, 155))
"""The template's non-zero voxels lie in these ``[lo, hi)`` index ranges (x, y, z)."""

BRAIN_THRESHOLD = 0.2
"""Brain mask: normalised intensity above this [fraction of the volume's maximum]."""


def source_path(volume):
    """The file of ``volume`` (``"mni152"`` or a path); ``FileNotFoundError`` if missing."""
    if volume == "mni152":
        import importlib.util

        spec = importlib.util.find_spec("nilearn")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError("--volume mni152 needs the nilearn package (its wheel "
                                    "ships the MNI152 template): pip install nilearn")
        path = os.path.join(spec.submodule_search_locations[0], "datasets", "data",
                            MNI152_FILE)
    else:
        path = os.path.expanduser(str(volume))
    if not os.path.isfile(path):
        raise FileNotFoundError("volume file %s does not exist" % path)
    return path


def resampling_matrix(n_out, box, h, n_src):
    """1-D resampling weights ``W[i, j]`` (output voxel ``i``, source voxel ``j``).

    Parameters
    ----------
    n_out : int
        Output voxels.
    box : (int, int)
        Source ``[lo, hi)`` range whose centre is the output's centre.
    h : float
        Source voxels per output voxel (>= 1).
    n_src : int
        Source voxels along the axis (indices outside ``[0, n_src)`` are background).

    Returns
    -------
    ndarray, float64, shape ``(n_out, n_src)``
        Rows sum to the fraction of the output voxel inside the source (1 inside).
    """
    s = max(1, int(math.ceil(h - 1e-9)))
    centre = 0.5 * (box[0] + box[1])              # in voxel-edge coordinates
    i = np.arange(n_out)[:, None] + (np.arange(s)[None, :] + 0.5) / s   # [n_out, s]
    p = centre + (i - 0.5 * n_out) * h - 0.5       # source index coordinate (centres at j)
    j = np.arange(n_src)
    w = np.maximum(0.0, 1.0 - np.abs(p[:, :, None] - j[None, None, :]))
    return w.mean(axis=1)


AFFINE_RTOL = 1e-6
"""An affine entry below this fraction of its column's norm counts as zero (axis-aligned)."""


def voxel_sizes(img, path="volume"):
    """The voxel sizes [mm] along the array's three axes (the header's ``get_zooms()``).

    Raises
    ------
    ValueError
        If the affine is oblique (its 3x3 part is not a scaled permutation of the axes)
        or a voxel size is not positive and finite.
    """
    m = np.asarray(img.affine, np.float64)[:3, :3]
    norms = np.sqrt((m * m).sum(axis=0))
    big = np.abs(m) > AFFINE_RTOL * np.maximum(norms, 1e-300)[None, :]
    if not (big.sum(axis=0) == 1).all() or not (big.sum(axis=1) == 1).all():
        raise ValueError("volume %s has an oblique affine (its voxel axes are rotated "
                         "against the scanner's); resample it to an axis-aligned grid first"
                         % path)
    zooms = tuple(float(z) for z in img.header.get_zooms()[:3])
    if len(zooms) != 3 or not all(np.isfinite(z) and z > 0 for z in zooms):
        raise ValueError("volume %s has voxel sizes %s: they must be positive" % (path, zooms))
    return zooms


class VolumeSource:
    """A NIfTI volume and its resampling to a grid ``nc`` (header only until :meth:`read`).

    Parameters
    ----------
    volume : str
        ``"mni152"`` or a NIfTI path.
    nc : 3-tuple of int
        Output voxels.

    Raises
    ------
    FileNotFoundError
        Missing file (or nilearn for ``mni152``).
    ValueError
        Not a 3D NIfTI, or smaller than ``nc`` (one line each).
    """

    def __init__(self, volume, nc):
        self.volume = volume
        self.path = source_path(volume)
        try:
            import nibabel as nib
        except ImportError:
            raise ValueError("--volume %s needs the nibabel package (pip install nibabel)"
                             % volume)
        try:
            img = nib.load(self.path)
        except Exception as e:
            raise ValueError("volume %s is not a NIfTI file nibabel can read (%s)"
                             % (self.path, str(e).splitlines()[0] if str(e) else type(e).__name__))
        shape = tuple(int(n) for n in img.shape)
        if len(shape) == 4 and shape[3] == 1:
            shape = shape[:3]
        if len(shape) != 3:
            raise ValueError("volume %s must be a 3D NIfTI, got shape %s" % (self.path, shape))
        self.img, self.shape = img, shape
        self.zooms = voxel_sizes(img, self.path)
        self.box = MNI152_BOX if volume == "mni152" else tuple((0, n) for n in shape)
        extent = [hi - lo for lo, hi in self.box]
        mm = [e * d for e, d in zip(extent, self.zooms)]
        finest = min(self.zooms)
        nc = tuple(int(n) for n in nc)
        if any(n * finest > m * (1 + 1e-9) for n, m in zip(nc, mm)):
            most = "x".join(str(int(math.floor(m / finest + 1e-9))) for m in mm)
            raise ValueError("volume %s (%s voxels%s) is smaller than --nc %s (its voxels: "
                             "%s mm): choose --nc <= %s"
                             % (self.path, "x".join(map(str, extent)),
                                " in the brain's box" if volume == "mni152" else "",
                                "x".join(map(str, nc)), "x".join("%g" % d for d in self.zooms),
                                most))
        self.nc = nc
        self.voxel_mm = max(m / n for m, n in zip(mm, nc))
        self.h = tuple(self.voxel_mm / d for d in self.zooms)
        self.matrices = [resampling_matrix(n, b, h, ns)
                         for n, b, h, ns in zip(nc, self.box, self.h, shape)]

    def read(self, begin, size):
        """The resampled block ``[begin, begin + size)`` (raw intensity, float64).

        Reads only the source block whose voxels weigh in it.
        """
        ws, sl = [], []
        for w, b, n in zip(self.matrices, begin, size):
            rows = w[b:b + n]
            nz = np.nonzero(rows.any(axis=0))[0]
            lo, hi = (int(nz[0]), int(nz[-1]) + 1) if nz.size else (0, 0)
            ws.append(rows[:, lo:hi])
            sl.append(slice(lo, hi))
        if any(w.shape[1] == 0 for w in ws):
            return np.zeros(tuple(size))
        obj = self.img.dataobj
        src = np.asarray(obj[tuple(sl) + ((0,) if len(self.img.shape) == 4 else ())],
                         np.float64)
        out = np.tensordot(ws[0], src, axes=(1, 0))                    # [nx, sy, sz]
        out = np.tensordot(ws[1], out, axes=(1, 1)).transpose(1, 0, 2)  # [nx, ny, sz]
        return np.tensordot(out, ws[2], axes=(2, 1))                    # [nx, ny, nz]


def resample_numpy(volume, nc):
    """Reference: the whole resampled volume, normalised to ``[0, 1]`` (tests)."""
    v = VolumeSource(volume, nc).read((0, 0, 0), nc)
    return v / v.max()
