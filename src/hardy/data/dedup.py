"""Exact and near-duplicate removal, one document at a time (a corpus streams through; none of it is held).

Exact: documents equal after lower-casing and whitespace collapsing (a 16-byte digest per kept document).
Near: datasketch MinHash signatures over word 5-gram shingles in a datasketch MinHashLSH index, whose
candidates are then compared by their signatures' estimated Jaccard similarity (default: drop when
>= 0.8). The signatures live in a file-backed array, not in memory. The first occurrence is kept.
"""
from __future__ import annotations

import hashlib
import tempfile
import zlib
from pathlib import Path

import numpy as np
from datasketch import MinHash, MinHashLSH


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


class NearDuplicateIndex:
    """Documents added so far, by MinHash-LSH; `is_duplicate_or_add(doc)` answers whether an earlier kept
    document is `threshold`-similar, and keeps `doc` otherwise."""

    def __init__(self, threshold: float = 0.8, ngram: int = 5, num_perm: int = 128, seed: int = 0,
                 scratch: str | Path | None = None):
        self.threshold, self.ngram, self.num_perm, self.seed = threshold, ngram, num_perm, seed
        self.lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)
        self._scratch = tempfile.TemporaryDirectory(dir=scratch, prefix=".dedup-")
        self._capacity, self._count = 0, 0
        self._signatures = None
        self._grow()

    def _grow(self) -> None:
        """The kept documents' signatures: a file-backed array that doubles when full."""
        capacity = max(1024, 2 * self._capacity)
        path = Path(self._scratch.name) / f"signatures_{capacity}.u64"
        grown = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint64, shape=(capacity, self.num_perm))
        if self._signatures is not None:
            grown[:self._count] = self._signatures[:self._count]
            old = Path(self._signatures.filename)
            del self._signatures
            old.unlink()
        self._signatures, self._capacity = grown, capacity

    def is_duplicate_or_add(self, doc: str) -> bool:
        m = MinHash(num_perm=self.num_perm, seed=self.seed, hashfunc=zlib.crc32)  # 32-bit, ~7x sha1's speed
        m.update_batch(shingles(doc, self.ngram))
        for j in self.lsh.query(m):
            if np.count_nonzero(self._signatures[j] == m.hashvalues) >= self.threshold * self.num_perm:
                return True
        if self._count == self._capacity:
            self._grow()
        self._signatures[self._count] = m.hashvalues
        self.lsh.insert(self._count, m, check_duplication=False)
        self._count += 1
        return False

    def close(self) -> None:
        self._signatures = None
        self._scratch.cleanup()
