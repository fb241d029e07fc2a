"""One rank's part file of a distributed file: written at disk speed and hashed while written.

The part files of :mod:`flowpm_mtf.runs.h5dist` and of the checkpoints
(:mod:`flowpm_mtf.runs.checkpoint_save`) are written here.

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

The datasets' rows are :class:`Rows`, converted piece by piece as they are
written.
"""
import errno
import logging
import os

import numpy as np

from . import digest
from .collective import HDF5_OVERHEAD_BYTES, reserve_space

__all__ = ["Rows", "PIECE_ROWS", "record_digest", "known_digest", "DIRECT_IO"]

log = logging.getLogger(__name__)


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


def _write_h5(path, datasets, attrs, dataset_attrs, compression=None, groups=None):
    """Write an HDF5 file under a temporary name and rename it (atomic for readers).

    Without compression every dataset is contiguous: HDF5 writes the metadata
    and allocates the data, then :func:`_fill_raw` writes the data without
    HDF5 (no copy beyond the converted pieces) and hashes the file on the way.
    With ``compression`` (chunked datasets) h5py writes the pieces and the
    file is hashed after it is written (on this rank). ``groups``: group name ->
    its attributes, created first (e.g. a Gadget file's ``Header``); a dataset name
    may name a group path (``PartType1/Coordinates``).

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
            for group, gattrs in (groups or {}).items():
                g = f.require_group(group)
                for k, v in gattrs.items():
                    g.attrs[k] = v
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


def _nbytes(value):
    """Bytes of a dataset value (Rows, Block data or array) once written."""
    if isinstance(value, Rows):
        return value.nbytes
    return int(np.asarray(value).nbytes)
