"""One logical HDF5 file written by every rank, without gathering: per-rank parts + a virtual dataset.

Why virtual datasets (and not parallel HDF5)
--------------------------------------------
Each process writes its own slices into its own small HDF5 file
(``<name>.parts/rank00000.h5``, one file per slice it holds), and rank 0 then
writes ``<name>.h5``, whose datasets are HDF5 *virtual datasets* (VDS, HDF5 >=
1.10) mapping every part file's rows/blocks into one global dataset. A person
opens ``<name>.h5`` with plain ``h5py`` and reads ``f["position"][...]`` as one
``[N, 3]`` array; no MPI is needed to read or write, so:

* it works with the pip ``h5py`` wheel (parallel HDF5 needs h5py rebuilt against
  Debian's ``libhdf5-openmpi-dev`` and an MPI-IO capable file system; NFS and
  many scratch file systems serialise or break MPI-IO locking);
* it works on any Mesh TF ``MeshImpl``: with ``PlacementMeshImpl`` one process
  holds all slices and simply writes all part files;
* a rank never holds more than its own slices, and the part files double as
  a per-rank data set (each is a complete, self-describing HDF5 file).

Source paths are stored **relative** (``<name>.parts/rankNNNNN.h5``); HDF5 resolves
a relative source against the directory of the virtual file before the
current directory (checked by the tests: the file opens from another working
directory and after the run directory is moved). Keep the ``.parts`` directory
next to the ``.h5`` file when copying a run, and do not set
``HDF5_VDS_PREFIX``. A missing part file would read as the fill value (NaN for
floats, -1 for integers), never as silently plausible data; :func:`check_sources`
verifies that every source exists.

A part file is written at disk speed and hashed while written
(:mod:`flowpm_mtf.runs.h5dist_part`); a write fails on every rank alike, a full
disk as :class:`~flowpm_mtf.errors.OutputDirError` (:mod:`flowpm_mtf.runs.collective`).

Cost at scale: one file per rank (fine up to ~10^4 ranks; beyond that group
ranks per file) and a virtual file whose mapping has one entry per rank and
dataset.

Dataset kinds
-------------
:class:`Rows`
    A per-part array whose first axis is concatenated over the parts in pnum
    order (particles: a variable number per rank).
:class:`Block`
    A per-part block of a global array of known shape, placed at ``begin``
    (mesh fields; replicated copies of a block are written once).

Local slices without communication
----------------------------------
:func:`local_slices` returns the slices of an mtf tensor held by *this* process
after lowering, with their processor numbers, for any ``MeshImpl``: one slice
for an SPMD implementation (e.g. ``HvdSimdMeshImpl``), all of them for
``PlacementMeshImpl``. Positions come from ``mesh_impl.slice_begin``.
"""
import json
import logging
import os
import shutil

import numpy as np

from ..errors import FlowpmError
from .collective import HDF5_OVERHEAD_BYTES, collective, reserve_space
from .h5dist_part import Rows, _nbytes, _write_h5, record_digest

__all__ = ["Rows", "Block", "local_slices", "held_pnums", "owns_slice",
           "replicated_value", "part_path", "write_distributed", "check_sources",
           "gather_slab", "COMPRESSIONS"]

log = logging.getLogger(__name__)

PARTS_SUFFIX = ".parts"
FORMAT = "flowpm_mtf.vds/1"


class Block:
    """A block of a global array.

    Parameters
    ----------
    data : array_like
        The block.
    begin : sequence of int
        Index of the block's first element in the global array.
    shape : sequence of int
        Shape of the global array.
    """

    def __init__(self, data, begin, shape):
        self.data = np.asarray(data)
        self.begin = tuple(int(b) for b in begin)
        self.shape = tuple(int(s) for s in shape)
        if not (len(self.begin) == len(self.shape) == self.data.ndim):
            raise ValueError("Block: data %s, begin %s and shape %s differ in rank"
                             % (self.data.shape, self.begin, self.shape))
        for b, n, s in zip(self.begin, self.data.shape, self.shape):
            if b < 0 or b + n > s:
                raise ValueError("Block %s at %s does not fit in %s"
                                 % (self.data.shape, self.begin, self.shape))


# ----------------------------------------------------------------------------- local slices
def held_pnums(mesh_impl, n_slices):
    """Processor numbers of the ``n_slices`` slices this process holds.

    All of them when the process holds one slice per processor (e.g.
    ``PlacementMeshImpl``), else (one slice, an SPMD ``MeshImpl``) the
    implementation's ``pnum``.
    """
    if n_slices == mesh_impl.size:
        return list(range(mesh_impl.size))
    if n_slices == 1 and hasattr(mesh_impl, "pnum"):
        return [int(mesh_impl.pnum)]
    raise TypeError("cannot tell which slices a %s holds (%d slices for %d processors)"
                    % (type(mesh_impl).__name__, n_slices, mesh_impl.size))


def local_slices(lowering, x):
    """The slices of mtf tensor ``x`` held by this process, without communication.

    Parameters
    ----------
    lowering : mtf.Lowering
    x : mtf.Tensor

    Returns
    -------
    list of (int, tf.Tensor, tuple of int)
        ``(pnum, slice, begin)``: processor number, the slice, and the index of
        its first element in the global tensor.
    """
    impl = lowering.mesh_impl(x)
    tensors = lowering.tensors[x].to_laid_out_tensor().tensor_list
    return [(p, t, tuple(int(b) for b in impl.slice_begin(x.shape, p)))
            for p, t in zip(held_pnums(impl, len(tensors)), tensors)]


def owns_slice(mesh_impl, shape, pnum):
    """True if ``pnum`` is the lowest processor holding its slice of ``shape``.

    Replicated copies (mesh axes the tensor is not split over) are written once.
    """
    import mesh_tensorflow as mtf

    coord = mtf.pnum_to_processor_coordinates(mesh_impl.shape, pnum)
    layout = mesh_impl.tensor_layout(shape)
    split_axes = {a for a in layout.tensor_axis_to_mesh_axis if a is not None}
    return all(c == 0 for i, c in enumerate(coord) if i not in split_axes)


def replicated_value(lowering, x):
    """This process's copy of a fully replicated (e.g. reduced) mtf tensor.

    Raises
    ------
    ValueError
        If ``x`` is split over a mesh axis (its local slice is not the whole).
    """
    impl = lowering.mesh_impl(x)
    if not impl.tensor_layout(x.shape).is_fully_replicated:
        raise ValueError("replicated_value: %s is split over the mesh (shape %s); use "
                         "local_slices" % (x.name, x.shape))
    return lowering.tensors[x].to_laid_out_tensor().tensor_list[0]


# ----------------------------------------------------------------------------- writing
def part_path(path, pnum):
    """Path of the part file of processor ``pnum`` for the logical file ``path``."""
    stem = os.fspath(path)
    if stem.endswith(".h5"):
        stem = stem[:-3]
    return os.path.join(stem + PARTS_SUFFIX, "rank%05d.h5" % pnum)


#: Compression filters of :func:`write_distributed` (h5py names; None: none).
COMPRESSIONS = (None, "gzip", "lzf")


def _fill_value(dtype):
    dtype = np.dtype(dtype)
    if dtype.kind in "fc":
        return np.nan
    if dtype.kind in "iu":
        return -1 if dtype.kind == "i" else np.iinfo(dtype).max
    return 0


def write_distributed(path, comm, parts, *, attrs=None, dataset_attrs=None, small=None,
                      compression=None, stats=None):
    """Write one logical HDF5 file from the parts held by every process.

    Collective over ``comm``: every rank calls it with the parts it holds (an
    empty dict if none). Each part goes to :func:`part_path`; rank 0 then
    writes ``path`` with one virtual dataset per name.

    Parameters
    ----------
    path : str or os.PathLike
        The logical file (``.h5``).
    comm : object
        mpi4py-like communicator (``rank``, ``size``, ``allgather``); see
        :class:`flowpm_mtf.backend.SerialComm` for one process.
    parts : dict
        ``pnum -> {name: Rows or Block}`` for the parts this process holds. A
        name may be missing from some parts (e.g. a Block only some hold).
    attrs : dict, optional
        Attributes of the logical file (strings/numbers; also written into the
        part files).
    dataset_attrs : dict, optional
        ``name -> {attr: value}`` (e.g. units).
    small : dict, optional
        ``name -> array`` of small replicated data (maps, spectra, histories)
        that rank 0 writes directly into ``path`` (not virtual).
    compression : {None, "gzip", "lzf"}
        Compression of the part files' datasets (default none: the data are
        written contiguously at disk speed, see :mod:`flowpm_mtf.runs.h5dist_part`).
    stats : dict, optional
        Filled with ``bytes`` (the part files of all ranks), ``files`` (their
        number), ``seconds`` (this rank's wall time of the call) [s] and
        ``mode``: how the part files' data were written, ``"direct"``
        (``O_DIRECT``), ``"buffered"`` (the file system refused it),
        ``"hdf5"`` (compressed: by h5py), or these joined by ``+`` if the
        files differ.

    Every part file is fsynced and hashed (:mod:`flowpm_mtf.runs.digest`) while it is
    written; rank 0 records the digests
    (:func:`flowpm_mtf.runs.h5dist_part.known_digest`), so a run directory's manifest
    does not read the files again.

    Returns
    -------
    str
        ``path``, on every rank.

    Raises
    ------
    FlowpmError
        On every rank, if writing failed on any rank.
    """
    import time

    t0 = time.perf_counter()
    if compression not in COMPRESSIONS:
        raise ValueError("compression must be one of %s, got %r" % (COMPRESSIONS, compression))
    path = os.fspath(path)
    base = os.path.dirname(os.path.abspath(path))

    def write_parts():
        meta = {}
        os.makedirs(os.path.dirname(part_path(path, 0)), exist_ok=True)
        for pnum, items in parts.items():
            data = {name: item if isinstance(item, Rows) else item.data
                    for name, item in items.items()}
            pattrs = dict(attrs or {}, pnum=int(pnum))
            for name, item in items.items():
                if isinstance(item, Block):
                    pattrs["begin." + name] = np.asarray(item.begin, np.int64)
            ppath = part_path(path, pnum)
            written = _write_h5(ppath, data, pattrs, dataset_attrs, compression)
            meta[int(pnum)] = {
                "file": os.path.relpath(ppath, base), "written": written,
                "datasets": {name: {"kind": type(item).__name__,
                                    "shape": (item.rows_shape if isinstance(item, Rows)
                                              else item.data.shape),
                                    "dtype": (item.dtype if isinstance(item, Rows)
                                              else item.data.dtype).str,
                                    "begin": getattr(item, "begin", None),
                                    "global": getattr(item, "shape", None)}
                             for name, item in items.items()}}
        return meta

    all_meta = collective(comm, write_parts,
                          lambda meta: _write_virtual(path, meta, attrs, dataset_attrs, small),
                          "writing %s" % path)
    nbytes = sum(m["written"]["size"] for m in all_meta.values())
    mode = "+".join(sorted({m["written"]["mode"] for m in all_meta.values()})) or "none"
    if comm.rank == 0:
        for m in all_meta.values():
            w = m["written"]
            record_digest(os.path.join(base, m["file"]), w["key"], w["digest"])
    seconds = time.perf_counter() - t0
    if stats is not None:
        stats.update(bytes=nbytes, files=len(all_meta), seconds=seconds, mode=mode)
    if comm.rank == 0:
        log.info("wrote %s (%d parts in %s, %.3g GB in %.2f s: %.2f GB/s, %s)", path,
                 len(all_meta), os.path.basename(os.path.dirname(part_path(path, 0))),
                 nbytes / 1e9, seconds, nbytes / 1e9 / max(seconds, 1e-9), mode)
    return path


def _write_virtual(path, all_meta, attrs, dataset_attrs, small=None):
    import h5py

    pnums = sorted(all_meta)
    names = []
    for p in pnums:
        names += [n for n in all_meta[p]["datasets"] if n not in names]
    tmp = "%s.tmp-%d" % (path, os.getpid())
    reserve_space(path, HDF5_OVERHEAD_BYTES + sum(_nbytes(v) for v in (small or {}).values())
                  + 512 * len(pnums) * max(1, len(names)))  # one mapping per part and dataset
    try:
        with h5py.File(tmp, "w") as f:
            for name, value in (small or {}).items():
                dset = f.create_dataset(name, data=np.asarray(value))
                for k, v in (dataset_attrs or {}).get(name, {}).items():
                    dset.attrs[k] = v
            for name in names:
                infos = [(p, all_meta[p]["datasets"][name]) for p in pnums
                         if name in all_meta[p]["datasets"]]
                kind, dtype = infos[0][1]["kind"], np.dtype(infos[0][1]["dtype"])
                if any(i["kind"] != kind or np.dtype(i["dtype"]) != dtype for _, i in infos):
                    raise ValueError("dataset %s: parts differ in kind or dtype" % name)
                if kind == "Rows":
                    tail = tuple(infos[0][1]["shape"][1:])
                    if any(tuple(i["shape"][1:]) != tail for _, i in infos):
                        raise ValueError("dataset %s: parts differ in trailing shape" % name)
                    total = sum(i["shape"][0] for _, i in infos)
                    shape = (total,) + tail
                else:
                    shape = tuple(infos[0][1]["global"])
                    volume = sum(int(np.prod(i["shape"])) for _, i in infos)
                    if volume != int(np.prod(shape)):
                        raise ValueError("dataset %s: the blocks cover %d of %d elements"
                                         % (name, volume, int(np.prod(shape))))
                if int(np.prod(shape)) == 0:
                    dset = f.create_dataset(name, shape=shape, dtype=dtype)
                else:
                    layout = h5py.VirtualLayout(shape=shape, dtype=dtype)
                    row = 0
                    for p, i in infos:
                        n = tuple(i["shape"])
                        if int(np.prod(n)) == 0:
                            continue
                        src = h5py.VirtualSource(all_meta[p]["file"], name, shape=n)
                        if kind == "Rows":
                            layout[row:row + n[0]] = src
                            row += n[0]
                        else:
                            layout[tuple(slice(b, b + s) for b, s in zip(i["begin"], n))] = src
                    dset = f.create_virtual_dataset(name, layout, fillvalue=_fill_value(dtype))
                for k, v in (dataset_attrs or {}).get(name, {}).items():
                    dset.attrs[k] = v
            for k, v in (attrs or {}).items():
                f.attrs[k] = v
            f.attrs["vds_format"] = FORMAT
            f.attrs["parts"] = json.dumps([all_meta[p]["file"] for p in pnums])
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# ----------------------------------------------------------------------------- reading
def check_sources(path):
    """Raise if a part file of the logical file ``path`` is missing.

    HDF5 reads a missing source of a virtual dataset as the fill value; this
    check turns that into an error.

    Raises
    ------
    FlowpmError
        Naming the first missing part file.
    """
    import h5py

    path = os.fspath(path)
    base = os.path.dirname(os.path.abspath(path))
    with h5py.File(path, "r") as f:
        for name, dset in f.items():
            if not isinstance(dset, h5py.Dataset) or not dset.is_virtual:
                continue
            for vs in dset.virtual_sources():
                src = vs.file_name
                full = src if os.path.isabs(src) else os.path.join(base, src)
                if not os.path.exists(full):
                    raise FlowpmError("%s: part file %s of dataset %s is missing (keep the %s "
                                      "directory next to the file)" % (path, full, name,
                                                                       PARTS_SUFFIX))


def remove(path):
    """Remove a logical file and its parts (if present)."""
    path = os.fspath(path)
    if os.path.exists(path):
        os.remove(path)
    parts = os.path.dirname(part_path(path, 0))
    if os.path.isdir(parts):
        shutil.rmtree(parts)


# ----------------------------------------------------------------------------- 2D slabs
def gather_slab(comm, blocks, shape2d):
    """Assemble a small 2D array from per-part 2D blocks on every rank.

    Parameters
    ----------
    comm : object
        mpi4py-like communicator.
    blocks : list of (array, (i0, j0))
        The 2D blocks this process contributes (replicated copies may be sent
        more than once; they are identical).
    shape2d : (int, int)

    Returns
    -------
    ndarray
        ``shape2d``, float64. Only 2D data travel (e.g. a projected density slab).
    """
    out = np.zeros(shape2d, np.float64)
    for rank_blocks in comm.allgather([(np.asarray(b, np.float64), tuple(o))
                                       for b, o in blocks]):
        for b, (i0, j0) in rank_blocks:
            out[i0:i0 + b.shape[0], j0:j0 + b.shape[1]] = b
    return out
