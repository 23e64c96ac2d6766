"""Document cleaning: Unicode/whitespace normalization and quality filters for noise and outliers.

A document is a block of text separated from the next by a blank line (a WikiText paragraph, a
Shakespeare speech). Each filter is a named predicate so the report can say what it removed.
"""
from __future__ import annotations

import re
import unicodedata
from collections import Counter
from dataclasses import dataclass

from hardy.errors import HardyError

_SPACES = re.compile(r"[ \t\u00a0\u2000-\u200b\u3000]+")
_BLANK = re.compile(r"\n\s*\n")


@dataclass(frozen=True)
class CleanConfig:
    min_words: int = 3  # fewer words: a fragment, not text (one-token lines)
    max_chars: int = 100_000  # longer: an outlier document (a dump, not prose)
    max_symbol_ratio: float = 0.25  # share of characters that are neither letters, digits nor spaces
    max_bad_char_ratio: float = 0.01  # control characters and U+FFFD from undecodable bytes
    max_dup_line_ratio: float = 0.3  # share of lines that repeat an earlier line of the same document
    max_dup_ngram_ratio: float = 0.5  # share of word 3-grams that repeat within the document

    def __post_init__(self):
        if self.min_words < 0 or self.max_chars < 1:
            raise HardyError("invalid cleaning config: min_words must be >= 0 and max_chars >= 1")
        for name in ("max_symbol_ratio", "max_bad_char_ratio", "max_dup_line_ratio", "max_dup_ngram_ratio"):
            if not 0 <= getattr(self, name) <= 1:
                raise HardyError(f"invalid cleaning config: {name} must be in [0, 1]")


def normalize(text: str) -> str:
    """NFC, unified newlines, runs of spaces collapsed, trailing spaces stripped."""
    text = unicodedata.normalize("NFC", text.replace("\r\n", "\n").replace("\r", "\n"))
    lines = (_SPACES.sub(" ", line).strip() for line in text.split("\n"))
    return "\n".join(lines)


def split_documents(text: str) -> list[str]:
    return [d.strip() for d in _BLANK.split(text) if d.strip()]


def _bad_char(c: str) -> bool:
    if c == "\ufffd":
        return True
    return unicodedata.category(c) in ("Cc", "Cs", "Co", "Cn") and c not in "\n\t"


def _dup_ngram_ratio(words: list[str], n: int = 3) -> float:
    if len(words) < n + 1:
        return 0.0
    grams = Counter(tuple(words[i:i + n]) for i in range(len(words) - n + 1))
    repeated = sum(c - 1 for c in grams.values() if c > 1)
    return repeated / (len(words) - n + 1)


def bad_chars(doc: str) -> int:
    """Control characters (not newline or tab), surrogates, private-use, unassigned, U+FFFD: counted per
    distinct character (a document has a few hundred), not per character."""
    return sum(doc.count(c) for c in set(doc) if _bad_char(c))


def symbol_chars(doc: str) -> int:
    """Characters that are neither letters, digits nor spaces (str.isalnum / str.isspace)."""
    return sum(doc.count(c) for c in set(doc) if not (c.isalnum() or c.isspace()))


def rejection_reason(doc: str, cfg: CleanConfig) -> str | None:
    """The first filter a document fails, or None if it is kept."""
    n = len(doc)
    if bad_chars(doc) > cfg.max_bad_char_ratio * n:
        return "binary/control characters"
    words = doc.split()
    if len(words) < cfg.min_words:
        return "too short"
    if n > cfg.max_chars:
        return "too long"
    if symbol_chars(doc) > cfg.max_symbol_ratio * n:
        return "symbol-heavy"
    lines = [line for line in doc.split("\n") if line]
    if len(lines) >= 4:
        dup_lines = len(lines) - len(set(lines))
        if dup_lines > cfg.max_dup_line_ratio * len(lines):
            return "repetitive"
    if _dup_ngram_ratio([w.lower() for w in words]) > cfg.max_dup_ngram_ratio:
        return "repetitive"
    return None


FILTERS = ("binary/control characters", "too short", "too long", "symbol-heavy", "repetitive")
