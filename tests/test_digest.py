"""File digests of the manifests (flowpm_mtf.runs.digest): BLAKE3 for new records, SHA-256
records of earlier runs still checked, against the published test vectors and hashlib."""
import hashlib
import json

import pytest

from flowpm_mtf.runs import digest, rundir
from flowpm_mtf.runs.rundir import RunDir

single = pytest.mark.rank_independent

# BLAKE3's reference test vectors (github.com/BLAKE3-team/BLAKE3, test_vectors.json): the
# input of length n is bytes i % 251 for i < n; the first 32 bytes of the hash.
BLAKE3_VECTORS = {
    0: "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262",
    1: "2d3adedff11b61f14c886e35afa036736dcd87a74d27b5c1510225d0f592e213",
    1024: "42214739f095a406f3fc83deb889744ac00df831c10daa55189b5d121c855af7",
    1025: "d00278ae47eb27b34faecf67b4fe263f82d5412916c1ffd97c8cb7fb814b8444",
}


def _vector_input(n):
    return bytes(i % 251 for i in range(n))


@single
@pytest.mark.parametrize("n", sorted(BLAKE3_VECTORS))
def test_blake3_test_vectors(n, tmp_path):
    """New records are BLAKE3: the file digest equals the reference vectors, also when the
    file is read in pieces shorter than BLAKE3's 1024-byte chunk."""
    path = tmp_path / "v.bin"
    path.write_bytes(_vector_input(n))
    assert digest.DIGEST == "blake3"
    assert digest.file_digest(path) == BLAKE3_VECTORS[n]
    assert digest.file_digest(path, chunk=7) == BLAKE3_VECTORS[n]
    h = digest.new()
    h.update(_vector_input(n))
    assert h.hexdigest() == BLAKE3_VECTORS[n]


@single
def test_records_of_either_algorithm_are_checked(tmp_path):
    """A record names its algorithm; SHA-256 records (manifests of earlier runs) are checked
    with SHA-256; a changed byte fails both; a record without a digest is an error."""
    path = tmp_path / "f.bin"
    path.write_bytes(b"particle data")
    new = {"path": "f.bin", digest.DIGEST: digest.file_digest(path)}
    old = {"path": "f.bin", "sha256": hashlib.sha256(b"particle data").hexdigest()}
    assert digest.recorded(old) == ("sha256", old["sha256"])
    assert digest.matches(path, new) and digest.matches(path, old)
    path.write_bytes(b"particle datA")
    assert not digest.matches(path, new) and not digest.matches(path, old)
    with pytest.raises(ValueError, match="holds no digest"):
        digest.recorded({"path": "f.bin", "size": 13})
    with pytest.raises(ValueError, match="unknown digest algorithm 'md5'"):
        digest.new("md5")


@single
def test_manifest_of_an_earlier_run_still_verifies(tmp_path):
    """A run directory published before BLAKE3 (its manifest lists sha256) verifies, and a
    tampered file in it is named with the algorithm its record uses."""
    out = tmp_path / "run"
    with RunDir(out, "simulate") as rd:
        with open(rd.file("a.txt"), "w") as f:
            f.write("alpha")
        rd.publish(config={})
    manifest_path = out / rundir.MANIFEST
    m = json.loads(manifest_path.read_text())
    (entry,) = m["files"]
    assert set(entry) == {"path", "size", "blake3"}
    entry.pop("blake3")
    entry["sha256"] = hashlib.sha256(b"alpha").hexdigest()
    manifest_path.write_text(json.dumps(m))
    assert rundir.verify_manifest(out) == []
    (out / "a.txt").write_text("alphx")
    assert rundir.verify_manifest(out) == ["a.txt: sha256 differs from the manifest"]
