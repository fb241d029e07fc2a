"""Digests of the files a run writes: what the manifests record and the readers check.

New records use BLAKE3 (:data:`DIGEST`): on one core it hashes about ten times as fast
as SHA-256 on a CPU without SHA instructions (``sha_ni``), where a SHA-256 digest bounded
the snapshot's write below the disk's speed. BLAKE3 is a cryptographic hash like SHA-256: a changed,
truncated or swapped file does not match.

A record is a dict holding the hex digest under the algorithm's name
(``{"blake3": "..."}`` beside the record's other keys, e.g. ``path`` and
``size``). Records of earlier runs hold ``"sha256"``: they are still checked,
with SHA-256 (:func:`matches`).
"""
import hashlib

import blake3

__all__ = ["DIGEST", "ALGORITHMS", "new", "file_digest", "recorded", "matches"]

#: The algorithm of new records.
DIGEST = "blake3"
#: Algorithms a record may name (the checkers read all of them), by preference.
ALGORITHMS = {"blake3": blake3.blake3, "sha256": hashlib.sha256}


def new(algorithm=DIGEST):
    """A hasher (``update(bytes)``, ``hexdigest()``) of ``algorithm`` (default :data:`DIGEST`)."""
    try:
        return ALGORITHMS[algorithm]()
    except KeyError:
        raise ValueError("unknown digest algorithm %r (known: %s)"
                         % (algorithm, ", ".join(ALGORITHMS))) from None


def file_digest(path, algorithm=DIGEST, chunk=1 << 22):
    """Hex digest of a file's content, read in ``chunk``-byte pieces (default 4 MiB).

    Parameters
    ----------
    path : str or os.PathLike
    algorithm : str
        A key of :data:`ALGORITHMS`.
    chunk : int
        Bytes read at a time.

    Returns
    -------
    str
    """
    h = new(algorithm)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def recorded(record):
    """``(algorithm, hex)`` of a record (``{"blake3": ...}`` or an earlier ``{"sha256": ...}``).

    Raises
    ------
    ValueError
        If the record names no known algorithm.
    """
    for algorithm in ALGORITHMS:
        if algorithm in record:
            return algorithm, record[algorithm]
    raise ValueError("the record %r holds no digest (one of: %s)"
                     % (sorted(record), ", ".join(ALGORITHMS)))


def matches(path, record):
    """Whether the file ``path`` has the digest ``record`` holds (reads every byte).

    Parameters
    ----------
    path : str or os.PathLike
    record : dict
        Holds the hex digest under its algorithm's name (:func:`recorded`).

    Returns
    -------
    bool
    """
    algorithm, expected = recorded(record)
    return file_digest(path, algorithm) == expected
