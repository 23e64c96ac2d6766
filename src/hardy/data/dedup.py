"""Exact and near-duplicate removal, one document at a time (a corpus streams through; none of it is held).

Exact: documents equal after lower-casing and whitespace collapsing (a 16-byte digest per kept document).
Near: datasketch MinHash signatures over word 5-gram shingles in a datasketch MinHashLSH index, whose
candidates are then compared by their signatures' estimated Jaccard similarity (default: drop when
>= 0.8). The signatures live in a scratch file, read and written with pread/pwrite (never mapped, so
they take page cache, not the process's memory). The first occurrence is kept.
The index's buckets are numpy hash tables (a 64-bit band hash and a document number per slot: ~0.2 KB
per document) in place of datasketch's dict-of-sets storage (~3.4 KB per document): memory grows with
the corpus either way, 16x slower here.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import zlib
from pathlib import Path

import numpy as np


def _norm(doc: str) -> str:
    return " ".join(doc.lower().split())


class ExactIndex:
    def __init__(self):
        self._seen: set[bytes] = set()

    def is_duplicate_or_add(self, doc: str) -> bool:
        key = hashlib.blake2b(_norm(doc).encode("utf-8"), digest_size=16).digest()
        if key in self._seen:
            return True
        self._seen.add(key)
        return False


def shingles(doc: str, n: int = 5) -> list[bytes]:
    words = _norm(doc).split()
    n = min(n, len(words)) or 1
    return list({" ".join(words[i:i + n]).encode("utf-8") for i in range(max(len(words) - n + 1, 1))})


class BandBuckets:
    """One LSH band's buckets (datasketch's UnorderedStorage interface, as MinHashLSH uses it): band hash
    -> documents, in an open-addressing table of (hash, first document) pairs; the rare further documents
    with the same band hash (near-duplicate candidates that were not, or hash collisions) in a dict."""

    def __init__(self, capacity: int = 1024):
        self._keys = np.zeros(capacity, dtype=np.uint64)  # 0: an empty slot (a hash of 0 is stored as 1)
        self._docs = np.zeros(capacity, dtype=np.int32)
        self._more: dict[int, list[int]] = {}
        self._count = 0

    def _slot(self, key: int) -> int:
        mask = len(self._keys) - 1
        slot = key & mask
        while True:
            there = int(self._keys[slot])
            if there == 0 or there == key:
                return slot
            slot = (slot + 1) & mask

    @staticmethod
    def _stored(key: int) -> int:
        return (key & 0xFFFFFFFFFFFFFFFF) or 1  # Python's signed hash as uint64; 0 marks an empty slot

    def get(self, key: int) -> list[int]:
        key = self._stored(key)
        slot = self._slot(key)
        if self._keys[slot] == 0:
            return []
        return [int(self._docs[slot]), *self._more.get(key, ())]

    def insert(self, key: int, *docs: int, buffer: bool = False) -> None:
        key = self._stored(key)
        for doc in docs:
            slot = self._slot(key)
            if self._keys[slot] == key:
                self._more.setdefault(key, []).append(doc)
                continue
            self._keys[slot], self._docs[slot] = key, doc
            self._count += 1
            if 2 * self._count > len(self._keys):
                self._grow()

    def _grow(self) -> None:
        keys, docs = self._keys, self._docs
        used = keys != 0
        self._keys = np.zeros(2 * len(keys), dtype=np.uint64)
        self._docs = np.zeros(2 * len(keys), dtype=np.int32)
        for key, doc in zip(keys[used].tolist(), docs[used].tolist()):
            slot = self._slot(key)
            self._keys[slot], self._docs[slot] = key, doc


class _NoKeys:
    """MinHashLSH's key -> band hashes storage, which only removal and duplicate checks read (neither used)."""

    def insert(self, key, *values, buffer: bool = False) -> None:
        pass


def _band_hash(band: bytes) -> int:
    # Python's own 64-bit hash: randomized per process, which changes only which spurious candidates the
    # signature comparison then rejects, never a decision
    return hash(band)


class NearDuplicateIndex:
    """Documents added so far, by MinHash-LSH; `is_duplicate_or_add(doc)` answers whether an earlier kept
    document is `threshold`-similar, and keeps `doc` otherwise."""

    def __init__(self, threshold: float = 0.8, ngram: int = 5, num_perm: int = 128, seed: int = 0,
                 scratch: str | Path | None = None):
        # start-up time: datasketch loads scipy (~0.5 s), which every training process (it imports the data
        # pipeline for its readers) would otherwise pay at each start and restart
        from datasketch import MinHash, MinHashLSH

        self._minhash = MinHash
        self.threshold, self.ngram, self.num_perm, self.seed = threshold, ngram, num_perm, seed
        self.lsh = MinHashLSH(threshold=threshold, num_perm=num_perm, hashfunc=_band_hash)
        self.lsh.hashtables = [BandBuckets() for _ in range(self.lsh.b)]
        self.lsh.keys = _NoKeys()
        self._scratch = tempfile.TemporaryDirectory(dir=scratch, prefix=".dedup-")
        # crc32 hashing keeps every MinHash value below 2**32 (datasketch masks them to 32 bits): uint32 is exact
        self._row = num_perm * 4
        self._fd = os.open(Path(self._scratch.name) / "signatures.u32", os.O_RDWR | os.O_CREAT, 0o600)
        self._count = 0

    def _signature(self, j: int) -> np.ndarray:
        return np.frombuffer(os.pread(self._fd, self._row, j * self._row), dtype=np.uint32)

    def is_duplicate_or_add(self, doc: str) -> bool:
        m = self._minhash(num_perm=self.num_perm, seed=self.seed, hashfunc=zlib.crc32)  # 32-bit, ~7x sha1's speed
        m.update_batch(shingles(doc, self.ngram))
        for j in self.lsh.query(m):
            if np.count_nonzero(self._signature(j) == m.hashvalues) >= self.threshold * self.num_perm:
                return True
        os.pwrite(self._fd, m.hashvalues.astype(np.uint32).tobytes(), self._count * self._row)
        self.lsh.insert(self._count, m, check_duplication=False)
        self._count += 1
        return False

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._scratch.cleanup()
