"""Exact and near-duplicate removal.

Exact: documents equal after lower-casing and whitespace collapsing. Near: MinHash signatures
over word 5-gram shingles, banded LSH to find candidate pairs, then the exact Jaccard similarity
of the candidates' shingle sets decides (default: drop when >= 0.8). The first occurrence is kept.
"""
from __future__ import annotations

import hashlib
import zlib
from collections import defaultdict

import numpy as np

_PRIME = np.uint64(4294967311)  # smallest prime above 2**32


def _norm(doc: str) -> str:
    return " ".join(doc.lower().split())


def exact_duplicates(docs: list[str]) -> set[int]:
    seen, dups = set(), set()
    for i, d in enumerate(docs):
        key = hashlib.blake2b(_norm(d).encode("utf-8"), digest_size=16).digest()
        if key in seen:
            dups.add(i)
        seen.add(key)
    return dups


def shingles(doc: str, n: int = 5) -> set[int]:
    words = _norm(doc).split()
    n = min(n, len(words)) or 1
    return {zlib.crc32(" ".join(words[i:i + n]).encode("utf-8")) for i in range(max(len(words) - n + 1, 1))}


def jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


class MinHasher:
    def __init__(self, num_perm: int = 128, seed: int = 0):
        rng = np.random.default_rng(seed)
        # a, b < 2**31 and x < 2**32 keep a*x + b below 2**64: no uint64 overflow.
        self.a = rng.integers(1, 2**31, size=num_perm, dtype=np.uint64)
        self.b = rng.integers(0, 2**31, size=num_perm, dtype=np.uint64)

    def signature(self, shingle_set: set[int]) -> np.ndarray:
        x = np.fromiter(shingle_set, dtype=np.uint64, count=len(shingle_set))
        return ((np.outer(x, self.a) + self.b) % _PRIME).min(axis=0)


def near_duplicates(docs: list[str], threshold: float = 0.8, ngram: int = 5, num_perm: int = 128,
                    bands: int = 32, skip: set[int] = frozenset(), seed: int = 0) -> set[int]:
    """Indices of documents whose shingle-set Jaccard with an earlier kept document is >= threshold."""
    rows = num_perm // bands
    hasher = MinHasher(num_perm, seed)
    buckets: dict[tuple, list[int]] = defaultdict(list)
    sets: dict[int, set[int]] = {}
    dups: set[int] = set()
    for i, doc in enumerate(docs):
        if i in skip:
            continue
        s = shingles(doc, ngram)
        sig = hasher.signature(s)
        keys = [(band, sig[band * rows:(band + 1) * rows].tobytes()) for band in range(bands)]
        candidates = {j for key in keys for j in buckets.get(key, ())}
        if any(jaccard(s, sets[j]) >= threshold for j in sorted(candidates)):
            dups.add(i)
            continue
        sets[i] = s
        for key in keys:
            buckets[key].append(i)
    return dups
