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

Writing at disk speed
---------------------
Without compression (the default) a part file's datasets are contiguous: HDF5
writes the metadata and allocates the data, then :func:`_fill_raw` writes the
whole file once more in file order from page-aligned staging buffers with
``O_DIRECT`` (the metadata read back, the rows copied in from the numpy pieces),
hashing it on the way (:mod:`flowpm_mtf.runs.digest`, BLAKE3, in a second thread; writes in
two more), and
fsyncs it; buffered where the file system refuses ``O_DIRECT``
(:data:`DIRECT_IO`). Rank
0 records the digests of every rank's files (:func:`known_digest`), and the run
directory's manifest and the checkpoints take them from there instead of
reading the files again (a file changed since, by inode, size and mtime, is
hashed anew). ``compression="gzip"`` or ``"lzf"``: chunked datasets written by
h5py, then hashed.

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
import errno
import json
import logging
import os
import re
import shutil

import numpy as np

from . import digest
from ..errors import FlowpmError, OutputDirError, error_from_name

__all__ = ["Rows", "Block", "local_slices", "held_pnums", "owns_slice",
           "replicated_value", "part_path", "write_distributed", "check_sources",
           "gather_slab", "DISK_FULL_ERRNOS", "is_disk_full", "disk_full_error",
           "reserve_space", "HDF5_OVERHEAD_BYTES", "COMPRESSIONS", "record_digest",
           "known_digest"]

log = logging.getLogger(__name__)

PARTS_SUFFIX = ".parts"
FORMAT = "flowpm_mtf.vds/1"


class Rows:
    """A per-part array concatenated with the other parts along its first axis.

    Parameters
    ----------
    data : array_like
        ``[n, ...]``; ``n`` may differ between parts (also 0), the trailing
        shape and dtype may not.
    transform : callable, optional
        ``transform(rows) -> array`` applied to consecutive pieces of ``data``
        (at most :data:`PIECE_ROWS` rows) as they are written, so that a
        converted copy (e.g. float32 cells -> Mpc/h) of a rank's whole
        share never exists; it must map rows to rows, elementwise along the
        first axis.
    dtype : dtype, optional
        Dtype of the written rows (default: that of ``data``).
    keep : array_like of bool, optional
        ``[n]``: the rows of ``data`` to write (e.g. the filled slots of a
        fixed-capacity buffer), selected piece by piece (no masked copy of
        the whole share).
    """

    def __init__(self, data, transform=None, dtype=None, keep=None):
        self.source = np.asarray(data)
        if self.source.ndim < 1:
            raise ValueError("Rows needs at least one axis, got a scalar")
        self.transform = transform
        self.dtype = np.dtype(dtype) if dtype is not None else self.source.dtype
        self.keep = None
        if keep is not None:
            keep = np.asarray(keep, bool).reshape(-1)
            if keep.shape[0] != self.source.shape[0]:
                raise ValueError("Rows: keep has %d entries for %d rows"
                                 % (keep.shape[0], self.source.shape[0]))
            if not keep.all():
                self.keep = keep
        self._n = self.source.shape[0] if self.keep is None else int(self.keep.sum())

    @property
    def rows_shape(self):
        """Shape of the written rows."""
        return (self._n,) + self.source.shape[1:]

    @property
    def nbytes(self):
        """Bytes of the written rows."""
        return int(np.prod(self.rows_shape)) * self.dtype.itemsize

    def _convert(self, rows):
        out = rows if self.transform is None else self.transform(rows)
        return np.asarray(out, self.dtype)

    def pieces(self, rows=None):
        """``(first row, array)`` of consecutive pieces of at most ``rows`` source rows."""
        rows = PIECE_ROWS if rows is None else int(rows)
        out = 0
        for i in range(0, self.source.shape[0], rows):
            src = self.source[i:i + rows]
            if self.keep is not None:
                src = src.compress(self.keep[i:i + rows], axis=0)  # faster than src[mask]
            piece = self._convert(src)
            yield out, piece
            out += piece.shape[0]

    @property
    def data(self):
        """All rows, converted (a full copy of this part: for small data and tests)."""
        src = self.source if self.keep is None else self.source[self.keep]
        return self._convert(src)


#: Rows converted and written at a time by :class:`Rows` (a piece of 3-vectors and its
#: float64 temporaries stay in the CPU cache: 1.5 MB).
PIECE_ROWS = 1 << 16


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

_KNOWN_DIGEST = {}
"""Real path -> ``(key, hex)`` of the files written here (:func:`known_digest`)."""


def _file_key(st):
    return [int(st.st_ino), int(st.st_size), int(st.st_mtime_ns)]


def record_digest(path, key, hexdigest):
    """Remember the digest of ``path`` computed while it was written.

    The digest is :data:`flowpm_mtf.runs.digest.DIGEST`'s (BLAKE3).

    Parameters
    ----------
    path : str
    key : list of int
        ``[inode, size, mtime_ns]`` of the file when it was complete.
    hexdigest : str
        Hex digest of its bytes.
    """
    _KNOWN_DIGEST[os.path.realpath(path)] = (list(key), hexdigest)


def known_digest(path):
    """The digest recorded by :func:`record_digest` for ``path``, if the file is unchanged.

    Outputs are replaced by rename, never changed in place: the same inode,
    size and modification time are the same bytes. ``None`` for a file not
    written here, or changed since (the caller hashes it).
    """
    rec = _KNOWN_DIGEST.get(os.path.realpath(path))
    if rec is None:
        return None
    try:
        key = _file_key(os.stat(path))
    except OSError:
        return None
    return rec[1] if rec[0] == key else None


def _pwrite_all(fd, buf, offset):
    while len(buf):
        n = os.pwrite(fd, buf, offset)
        buf, offset = buf[n:], offset + n


def _hash_range(fd, h, start, stop, chunk=1 << 22):
    """Hash the bytes ``[start, stop)`` of ``fd`` (``stop`` None: to the end)."""
    pos = start
    while stop is None or pos < stop:
        n = chunk if stop is None else min(chunk, stop - pos)
        block = os.pread(fd, n, pos)
        if not block:
            if stop is not None:
                raise OSError(errno.EIO, "short read at %d (expected data up to %d)" % (pos, stop))
            break
        h.update(block)
        pos += len(block)


#: Bytes of one staging buffer of the direct-I/O writer (:func:`_fill_raw`): a multiple
#: of :data:`DIRECT_ALIGN`; :data:`DIRECT_BUFFERS` of them are in flight at a time.
DIRECT_CHUNK = 1 << 23
#: Staging buffers of :func:`_fill_raw` (one being filled, the others hashed and written).
DIRECT_BUFFERS = 4
#: Threads writing the staging buffers (two writes in flight keep the device busy).
DIRECT_WRITERS = 2
#: Alignment of direct I/O: file offsets, lengths and buffer addresses [bytes].
DIRECT_ALIGN = 4096
#: Whether :func:`_fill_raw` tries ``O_DIRECT`` (the environment variable
#: ``FLOWPM_MTF_DIRECT_IO=0`` turns it off).
DIRECT_IO = os.environ.get("FLOWPM_MTF_DIRECT_IO", "1") != "0"
#: The ``O_DIRECT`` errors that mean "not on this file system": write buffered instead.
_NO_DIRECT_ERRNOS = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)


def _open_direct(path):
    """A write-only ``O_DIRECT`` descriptor of ``path``, or None where the file system refuses it."""
    flag = getattr(os, "O_DIRECT", 0)
    if not (DIRECT_IO and flag):
        return None
    try:
        return os.open(path, os.O_WRONLY | flag)
    except OSError as exc:
        if exc.errno in _NO_DIRECT_ERRNOS:
            return None
        raise


class _Writer:
    """Writes aligned chunks with ``O_DIRECT`` (``fd_direct``), else buffered (``fd``).

    The first refusal of a direct write (EINVAL: e.g. a file system that opens
    with ``O_DIRECT`` but cannot do it) switches to buffered writes for the rest
    of the file; :attr:`mode` says which was used (``"direct"``, ``"buffered"``).
    """

    def __init__(self, fd, fd_direct):
        self.fd, self.fd_direct = fd, fd_direct
        self.mode = "direct" if fd_direct is not None else "buffered"

    def write(self, buf, offset):
        """Write all of ``buf`` at ``offset`` (direct if ``buf`` is aligned and direct works)."""
        if self.mode == "direct" and len(buf) % DIRECT_ALIGN == 0:
            try:
                _pwrite_all(self.fd_direct, buf, offset)
                return
            except OSError as exc:
                if exc.errno not in _NO_DIRECT_ERRNOS:
                    raise
                log.info("O_DIRECT refused (%s): writing buffered", exc)
                self.mode = "buffered"
        _pwrite_all(self.fd, buf, offset)


def _aligned_buffer(nbytes):
    """A ``uint8`` array of ``nbytes`` whose address is a multiple of :data:`DIRECT_ALIGN`."""
    block = np.empty(nbytes + DIRECT_ALIGN, np.uint8)
    skip = (-block.ctypes.data) % DIRECT_ALIGN
    return block[skip:skip + nbytes]


def _file_stream(fd, raw, size, chunk):
    """The bytes of the file in order: HDF5's own bytes read back between the datasets.

    Yields buffers: the gaps (metadata, small datasets; kilobytes) read from
    ``fd`` in pieces of at most ``chunk`` bytes, and every dataset's rows as
    converted by :meth:`Rows.pieces`, checked against the dataset's size.
    """
    pos = 0
    for offset, nbytes, rows in sorted(raw, key=lambda r: r[0]):
        while pos < offset:
            block = os.pread(fd, min(chunk, offset - pos), pos)
            if not block:
                raise OSError(errno.EIO, "short read at %d (expected data up to %d)"
                              % (pos, offset))
            yield block
            pos += len(block)
        at = offset
        for _, piece in rows.pieces():
            if piece.size == 0:          # every row of a piece masked out
                continue
            buf = memoryview(np.ascontiguousarray(piece)).cast("B")
            if at + len(buf) > offset + nbytes:
                raise ValueError("dataset at %d: more data than its %d bytes" % (offset, nbytes))
            yield buf
            at += len(buf)
        if at != offset + nbytes:
            raise ValueError("dataset at %d: %d of its %d bytes written"
                             % (offset, at - offset, nbytes))
        pos = at
    while pos < size:
        block = os.pread(fd, min(chunk, size - pos), pos)
        if not block:
            break
        yield block
        pos += len(block)


def _fill_raw(path, raw):
    """Write the data of the contiguous datasets ``raw`` into the closed HDF5 file ``path``.

    HDF5 has written the file's metadata and allocated every dataset at its
    offset. The whole file is then written once more, in order, from
    page-aligned staging buffers (:data:`DIRECT_CHUNK` bytes each):
    HDF5's own bytes between the datasets are read back (kilobytes) and the
    datasets' rows copied in piece by piece (:meth:`Rows.pieces`). A full
    buffer is hashed (BLAKE3, one thread, in file order) and written with
    ``O_DIRECT`` (:data:`DIRECT_WRITERS` threads; no page cache: the disk's
    speed, not the kernel's copy, is the limit) while the next one is filled;
    the last partial block goes through the page cache. Where the file
    system refuses ``O_DIRECT`` the same buffers are written buffered. The
    file is fsynced.

    Returns
    -------
    (str, list of int, str)
        The hex digest of the file (:data:`flowpm_mtf.runs.digest.DIGEST`), its key
        (:func:`known_digest`) and the
        write mode (``"direct"`` or ``"buffered"``).
    """
    from concurrent.futures import ThreadPoolExecutor

    h = digest.new()
    fd = os.open(path, os.O_RDWR)
    fd_direct = None
    try:
        size = os.fstat(fd).st_size
        fd_direct = _open_direct(path)
        writer = _Writer(fd, fd_direct)
        chunk = max(DIRECT_ALIGN, DIRECT_CHUNK // DIRECT_ALIGN * DIRECT_ALIGN)
        stages = [_aligned_buffer(chunk) for _ in range(max(2, DIRECT_BUFFERS))]
        views = [memoryview(b) for b in stages]
        busy = [[] for _ in stages]
        with ThreadPoolExecutor(1) as hasher, \
                ThreadPoolExecutor(max(1, DIRECT_WRITERS)) as writers:

            def flush(i, n, at):
                """Hash and write the first ``n`` bytes of buffer ``i`` at file offset ``at``."""
                whole = n - n % DIRECT_ALIGN
                busy[i] = [hasher.submit(h.update, views[i][:n])]
                if whole:
                    busy[i].append(writers.submit(writer.write, views[i][:whole], at))
                if whole < n:
                    busy[i].append(writers.submit(writer.write, views[i][whole:n],
                                                  at + whole))

            def take(i):
                for f in busy[i]:
                    f.result()
                busy[i] = []

            i, fill, at = 0, 0, 0
            for buf in _file_stream(fd, raw, size, chunk):
                src = np.frombuffer(buf, np.uint8)
                while src.size:
                    n = min(src.size, chunk - fill)
                    stages[i][fill:fill + n] = src[:n]
                    src, fill = src[n:], fill + n
                    if fill == chunk:
                        flush(i, chunk, at)
                        at += chunk
                        i, fill = (i + 1) % len(stages), 0
                        take(i)
            if fill:
                flush(i, fill, at)
                at += fill
            for j in range(len(stages)):
                take(j)
        if at != size:
            raise OSError(errno.EIO, "%s: wrote %d of its %d bytes" % (path, at, size))
        os.fsync(fd)
        key = _file_key(os.fstat(fd))
    finally:
        if fd_direct is not None:
            os.close(fd_direct)
        os.close(fd)
    return h.hexdigest(), key, writer.mode


def _raw_ok(shape, dtype, compression):
    """Whether a dataset is written by :func:`_fill_raw` (contiguous, plain numbers)."""
    return (compression is None and len(shape) >= 1 and int(np.prod(shape)) > 0
            and dtype.kind in "biufc" and not dtype.hasobject)


def _write_h5(path, datasets, attrs, dataset_attrs, compression=None):
    """Write an HDF5 file under a temporary name and rename it (atomic for readers).

    Without compression every dataset is contiguous: HDF5 writes the metadata
    and allocates the data, then :func:`_fill_raw` writes the data without
    HDF5 (no copy beyond the converted pieces) and hashes the file on the way.
    With ``compression`` (chunked datasets) h5py writes the pieces and the
    file is hashed after it is written (on this rank).

    Returns
    -------
    dict
        ``size`` [bytes], ``digest`` (hex, :data:`flowpm_mtf.runs.digest.DIGEST`) and ``key``
        (:func:`known_digest`)
        of the file written.
    """
    import h5py

    tmp = "%s.tmp-%d" % (path, os.getpid())
    reserve_space(path, HDF5_OVERHEAD_BYTES + sum(_nbytes(v) for v in datasets.values()))
    try:
        raw = []
        with h5py.File(tmp, "w") as f:
            for name, value in datasets.items():
                if not isinstance(value, Rows):
                    value = np.asarray(value)
                    if value.ndim >= 1 and value.dtype.kind in "biufc":
                        value = Rows(value)
                if isinstance(value, Rows) and _raw_ok(value.rows_shape, value.dtype,
                                                       compression):
                    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
                    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
                    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
                    dset = f.create_dataset(name, shape=value.rows_shape, dtype=value.dtype,
                                            dcpl=dcpl)
                    raw.append((dset.id.get_offset(), value.nbytes, value))
                elif isinstance(value, Rows):  # compressed (chunked), or empty
                    comp = compression if int(np.prod(value.rows_shape)) > 0 else None
                    dset = f.create_dataset(name, shape=value.rows_shape, dtype=value.dtype,
                                            compression=comp)
                    for i, piece in value.pieces():
                        dset[i:i + piece.shape[0]] = piece
                else:
                    dset = f.create_dataset(name, data=value)
                for k, v in (dataset_attrs or {}).get(name, {}).items():
                    dset.attrs[k] = v
            for k, v in (attrs or {}).items():
                f.attrs[k] = v
        if raw or compression is None:
            hexdigest, key, mode = _fill_raw(tmp, raw)
        else:
            hexdigest, key, mode = _hash_file(tmp), None, "hdf5"
        os.replace(tmp, path)
        if key is None:
            key = _file_key(os.stat(path))
        return {"size": key[1], "digest": hexdigest, "key": key, "mode": mode}
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _hash_file(path):
    """Hex digest (:data:`flowpm_mtf.runs.digest.DIGEST`) of a file (fsynced first)."""
    h = digest.new()
    fd = os.open(path, os.O_RDWR)
    try:
        os.fsync(fd)
        _hash_range(fd, h, 0, None)
    finally:
        os.close(fd)
    return h.hexdigest()


# ----------------------------------------------------------------------------- disk full
#: ``errno`` values of a full disk or an exhausted quota: the run directory's
#: fault (:class:`flowpm_mtf.errors.OutputDirError`, exit 5), not an internal error.
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# The same in the text of an error that wraps the OSError (h5py, TensorFlow, another rank).
_DISK_FULL_TEXT = re.compile(r"\[Errno (%s)\]|%s" % (
    "|".join(str(e) for e in DISK_FULL_ERRNOS),
    "|".join(re.escape(os.strerror(e)) for e in DISK_FULL_ERRNOS)), re.IGNORECASE)


def is_disk_full(exc):
    """Whether ``exc`` (an exception, or its text) says the disk or the quota is full.

    Parameters
    ----------
    exc : BaseException or str or None

    Returns
    -------
    bool
        True for an ``OSError`` with ``errno`` ENOSPC or EDQUOT, or an error
        whose text names them (h5py, TensorFlow and other ranks pass them on as
        text).
    """
    if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
        return True
    return exc is not None and bool(_DISK_FULL_TEXT.search(str(exc)))


def disk_full_error(what, exc):
    """The one-line :class:`OutputDirError` (exit 5) for a full disk while doing ``what``.

    Parameters
    ----------
    what : str
        E.g. ``"writing /out/.staging/snapshot.h5"``.
    exc : BaseException or str
        The original error (its first line is kept).

    Returns
    -------
    OutputDirError
    """
    text = (str(exc).strip().splitlines() or [""])[0]
    return OutputDirError("no space left on device (or disk quota exceeded) %s: %s; nothing was "
                          "published and the previous complete run of the run directory, if "
                          "any, is intact; free space (or raise the quota) and run again"
                          % (what, text))


#: Bytes reserved beyond the data of an HDF5 file (object headers, attributes,
#: virtual-dataset mappings; see :func:`reserve_space`).
HDF5_OVERHEAD_BYTES = 1 << 20


def reserve_space(path, nbytes):
    """Fail now, with a plain ``OSError`` (ENOSPC/EDQUOT), if ``nbytes`` do not fit at ``path``.

    HDF5 keeps metadata (and small datasets) in its cache and writes them when
    the file is closed; a disk that fills up then leaves the library with a
    file it can neither flush nor close (an error from a destructor, a crash at
    exit). So an HDF5 file is written only after its size (data plus
    :data:`HDF5_OVERHEAD_BYTES`) was allocated once in a scratch file
    (``posix_fallocate``: real blocks, charged to the quota) and freed again.
    Another process filling the disk in between can still defeat it.

    Parameters
    ----------
    path : str
        The file about to be written (the scratch file is ``path.reserve.tmp-<pid>``).
    nbytes : int
        Bytes to reserve.

    Raises
    ------
    OSError
        With ``errno`` ENOSPC or EDQUOT, before anything was written.
    """
    nbytes = int(nbytes)
    if nbytes <= 0 or not hasattr(os, "posix_fallocate"):
        return
    scratch = "%s.reserve.tmp-%d" % (path, os.getpid())
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno in DISK_FULL_ERRNOS:
            raise OSError(exc.errno, os.strerror(exc.errno), path) from None
        # No fallocate on this file system (EINVAL, EOPNOTSUPP): nothing reserved.
    finally:
        os.close(fd)
        os.remove(scratch)


def _nbytes(value):
    """Bytes of a dataset value (Rows, Block data or array) once written."""
    if isinstance(value, Rows):
        return value.nbytes
    return int(np.asarray(value).nbytes)


def _fill_value(dtype):
    dtype = np.dtype(dtype)
    if dtype.kind in "fc":
        return np.nan
    if dtype.kind in "iu":
        return -1 if dtype.kind == "i" else np.iinfo(dtype).max
    return 0


def _describe(error):
    """``(class name, text)`` of a rank's error, as :func:`_agree` sends it."""
    if error is None or isinstance(error, tuple):
        return error
    if isinstance(error, FlowpmError):  # keeps its class (and exit code) on every rank
        name, text = type(error).__name__, str(error)
    elif isinstance(error, BaseException):
        name, text = "FlowpmError", "%s: %s" % (type(error).__name__, error)
    else:
        name, text = "FlowpmError", str(error)
    return name, text


def _agree(comm, error, what):
    """Raise on every rank if any rank reported an error (one line naming the first).

    Parameters
    ----------
    comm : object
        mpi4py-like communicator.
    error : None, str or BaseException
        This rank's error (``None``: none).
    what : str
        What was being done.

    Raises
    ------
    FlowpmError
        The same on every rank: :class:`OutputDirError` (exit 5) if the first
        failing rank ran out of disk space or quota, the class of a
        :class:`FlowpmError` it raised, else :class:`FlowpmError`.
    """
    errors = comm.allgather(_describe(error))
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if bad:
        r, (name, text) = bad[0]
        where = "rank %d%s" % (r, " (and %d other ranks)" % (len(bad) - 1) if len(bad) > 1
                               else "")
        if name != "OutputDirError" and is_disk_full(text):
            raise disk_full_error("%s on %s" % (what, where), text)
        raise error_from_name(name, "%s failed on %s: %s" % (what, where, text))


def collective(comm, local, root, what):
    """Run ``local()`` on every rank, then ``root(merged)`` on rank 0; errors reach every rank.

    Parameters
    ----------
    comm : object
        mpi4py-like communicator.
    local : callable
        ``() -> dict`` of this rank's results (e.g. the files it wrote).
    root : callable
        ``(merged dict of all ranks) -> None``, run on rank 0 only.
    what : str
        What is being done, for the error message.

    Returns
    -------
    dict
        The merged results, on every rank.

    Raises
    ------
    FlowpmError
        On every rank if ``local`` failed on any rank or ``root`` failed (one
        line naming the rank), never a hang.
    """
    mine, error = {}, None
    try:
        mine = local()
    except Exception as exc:  # reported on every rank below
        error = exc
    _agree(comm, error, what)
    merged = {}
    for m in comm.allgather(mine):
        merged.update(m)
    error = None
    if comm.rank == 0:
        try:
            root(merged)
        except Exception as exc:
            error = exc
    _agree(comm, error, what)
    return merged


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
        written contiguously at disk speed, see :func:`_write_h5`).
    stats : dict, optional
        Filled with ``bytes`` (the part files of all ranks), ``files`` (their
        number), ``seconds`` (this rank's wall time of the call) [s] and
        ``mode``: how the part files' data were written, ``"direct"``
        (``O_DIRECT``), ``"buffered"`` (the file system refused it),
        ``"hdf5"`` (compressed: by h5py), or these joined by ``+`` if the
        files differ.

    Every part file is fsynced and hashed (:mod:`flowpm_mtf.runs.digest`) while it is
    written; rank 0 records the digests (:func:`known_digest`), so a run directory's manifest
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
