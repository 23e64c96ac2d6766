"""`hardy data prepare`: clean, de-duplicate, split, tokenize and write memory-mapped token shards.

Output directory layout (INDEX_VERSION 1):
    tokenizer.json, tokenizer_config.json     the tokenizer (Hugging Face format)
    train_00000.bin, ...                      token ids, little-endian uint16 (vocab <= 65536) or uint32,
    val_00000.bin, ...                        documents joined with the EOS id after each document
    index.json                                written last: shards, token counts, dtype, report
"""
from __future__ import annotations

import codecs
import json
import os
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm

from hardy.data.clean import FILTERS, CleanConfig, normalize, rejection_reason
from hardy.data.dedup import ExactIndex, NearDuplicateIndex
from hardy.data.text import resolve_text_path
from hardy.errors import HardyError
from hardy.formats.gguf_io import gguf_fields, open_gguf
from hardy.formats.packaged import smollm2_gguf_path
from hardy.formats.tokenizer import HardyTokenizer, tokenizer_from_gguf_fields
from hardy.fsio import atomic_file, write_bytes_atomic

INDEX_VERSION = 1
INDEX_FILE = "index.json"


@dataclass
class PrepareReport:
    inputs: list[str]
    documents: int = 0
    kept: int = 0
    removed: dict[str, int] = field(default_factory=dict)
    chars_in: int = 0
    chars_kept: int = 0
    tokens: dict[str, int] = field(default_factory=dict)
    documents_per_split: dict[str, int] = field(default_factory=dict)
    undecodable_bytes: int = 0

    def lines(self) -> list[str]:
        out = [f"documents read: {self.documents:,} ({self.chars_in:,} characters) from {len(self.inputs)} file(s)"]
        for name, count in self.removed.items():
            out.append(f"  removed {count:>7,}  {name}")
        out.append(f"documents kept: {self.kept:,} ({self.chars_kept:,} characters, "
                   f"{100 * self.chars_kept / max(self.chars_in, 1):.1f}%)")
        for split, n in self.tokens.items():
            out.append(f"  {split}: {self.documents_per_split[split]:,} documents, {n:,} tokens")
        return out


READ_BLOCK = 1 << 22  # bytes of input decoded at a time


def stream_documents(inputs: list[str], stats: dict | None = None) -> Iterator[str]:
    """The documents of all inputs, one at a time, as `split_documents(normalize(text))` gives them per
    file, without holding a file: it is read and normalized in blocks of whole lines. Undecodable bytes
    become U+FFFD so the binary filter can see them; `stats` counts characters and those."""
    for spec in inputs:
        path = resolve_text_path(spec)
        if not path.is_file():
            raise HardyError(f"input is not a file: {path}")
        decoder, pending, doc = codecs.getincrementaldecoder("utf-8")(errors="replace"), "", []
        try:
            with open(path, "rb") as f:
                while True:
                    raw = f.read(READ_BLOCK)
                    text = decoder.decode(raw, final=not raw)
                    if stats is not None:
                        stats["chars"] += len(text)
                        stats["bad"] += text.count("\ufffd")
                    text = pending + text
                    cut = text.rfind("\n") + 1 if raw else len(text) + 1
                    block, pending = text[:cut - 1], text[cut:]
                    if raw and block.endswith("\r"):  # the \r of a \r\n cut in two is not a line of its own
                        block = block[:-1]
                    if cut > 0 and (block or raw):
                        for line in normalize(block).split("\n"):
                            if line:
                                doc.append(line)
                            elif doc:
                                yield "\n".join(doc)
                                doc = []
                    if not raw:
                        break
        except OSError as e:
            raise HardyError(f"cannot read input {path}: {e.strerror}") from None
        if doc:
            yield "\n".join(doc)


def build_tokenizer(spec: str, train_docs: list[str]):
    if spec == "smollm2":
        return tokenizer_from_gguf_fields(gguf_fields(open_gguf(smollm2_gguf_path())))
    if spec.startswith("bpe:"):
        try:
            vocab = int(spec[4:])
        except ValueError:
            raise HardyError(f"--tokenizer bpe:VOCAB needs an integer vocabulary size (got {spec!r})") from None
        if not 300 <= vocab <= 1_000_000:
            raise HardyError(f"BPE vocabulary must be between 300 and 1,000,000 (got {vocab})")
        return train_bpe(train_docs, vocab)
    path = Path(spec)
    if path.is_dir():
        return HardyTokenizer.from_hf_dir(path)
    raise HardyError(f"unknown tokenizer {spec!r}: use smollm2, bpe:VOCAB or a directory with tokenizer.json")


EOT = "<|endoftext|>"


def train_bpe(docs: list[str], vocab_size: int):
    """Byte-level BPE with GPT-2's pre-tokenizer, so GGUF export can declare pre = "gpt-2" (llama.cpp's name for it)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs, trainer=trainer)
    eot = tok.token_to_id(EOT)
    return HardyTokenizer(backend=tok, bos_id=eot, eos_id=eot, add_bos=False, pre="gpt-2")


DROP, TRAIN, VAL = 0, 1, 2  # each document's fate, one byte per document


def prepare(inputs: list[str], tokenizer: str, out: str | os.PathLike, clean: CleanConfig = CleanConfig(),
            near_threshold: float = 0.8, val_fraction: float = 0.05, seed: int = 0,
            shard_tokens: int = 1 << 26, progress: bool = False) -> PrepareReport:
    """Three passes over the inputs, each streaming: clean, de-duplicate and split (a byte per document
    is kept); train the tokenizer on the train documents if asked; tokenize both splits into shards."""
    if not inputs:
        raise HardyError("no --input given")
    if not 0 <= val_fraction < 1:
        raise HardyError(f"--val-fraction must be in [0, 1) (got {val_fraction})")
    if not 0 < near_threshold <= 1:
        raise HardyError(f"--near-dup-threshold must be in (0, 1] (got {near_threshold})")
    out = Path(out)
    if (out / INDEX_FILE).exists():
        raise HardyError(f"{out} already holds a prepared dataset; choose another --out")
    for spec in inputs:  # every input checked before the long first pass
        if not resolve_text_path(spec).is_file():
            raise HardyError(f"input is not a file: {resolve_text_path(spec)}")
    out.mkdir(parents=True, exist_ok=True)
    report, fate = select_documents(inputs, out, clean, near_threshold, val_fraction, seed, progress)

    train_docs = (d for d, f in zip(stream_documents(inputs), fate) if f == TRAIN)
    tok = build_tokenizer(tokenizer, train_docs)
    eos = tok.eos_id
    if eos is None:
        raise HardyError("the tokenizer has no end-of-text token to separate documents")
    tok.save_hf(out)
    dtype = token_dtype(tok.vocab_size)
    splits = {TRAIN: ShardWriter(out, "train", dtype, shard_tokens), VAL: ShardWriter(out, "val", dtype, shard_tokens)}
    with splits[TRAIN], splits[VAL]:  # one pass for both splits
        for split, batch in _batches(zip(stream_documents(inputs), fate), 1 << 20):
            writer = splits[split]
            for e in tok.backend.encode_batch(batch, add_special_tokens=False):
                writer.write(np.asarray(e.ids + [eos], dtype=writer.dtype))
            writer.documents += len(batch)
    for writer in splits.values():
        report.tokens[writer.split], report.documents_per_split[writer.split] = writer.tokens, writer.documents
    write_index(out, {w.split: w for w in splits.values()}, tok.vocab_size, eos, tokenizer, seed, asdict(report))
    return report


def select_documents(inputs, out: Path, clean: CleanConfig, near_threshold: float, val_fraction: float, seed: int,
                     progress: bool) -> tuple[PrepareReport, bytearray]:
    """The first pass: each document's fate (DROP, TRAIN, VAL) and the report."""
    stats = {"chars": 0, "bad": 0}
    removed = {name: 0 for name in FILTERS}
    exact_name, near_name = "exact duplicate", f"near duplicate (Jaccard >= {near_threshold:g})"
    removed[exact_name] = removed[near_name] = 0
    exact, near = ExactIndex(), NearDuplicateIndex(near_threshold, seed=seed, scratch=out)
    rng, fate, chars_kept = random.Random(seed), bytearray(), 0
    total = sum(resolve_text_path(spec).stat().st_size for spec in inputs)
    try:
        with tqdm(total=total, unit="B", unit_scale=True, desc="cleaning and de-duplicating", disable=not progress,
                  leave=False) as bar:
            for doc in stream_documents(inputs, stats):
                bar.update(len(doc.encode("utf-8")) + 2)
                reason = rejection_reason(doc, clean)
                if reason is None and exact.is_duplicate_or_add(doc):
                    reason = exact_name
                if reason is None and near.is_duplicate_or_add(doc):
                    reason = near_name
                if reason is not None:
                    removed[reason] += 1
                    fate.append(DROP)
                    continue
                chars_kept += len(doc)
                fate.append(VAL if rng.random() < val_fraction else TRAIN)
    finally:
        near.close()
    if not fate:
        raise HardyError(f"no text in the inputs: {', '.join(inputs)}")
    kept = len(fate) - fate.count(DROP)
    if not kept:
        raise HardyError("every document was filtered out; check the inputs or relax the filters")
    if not fate.count(TRAIN):
        raise HardyError("the train split is empty; lower --val-fraction or add text")
    report = PrepareReport(inputs=list(inputs), documents=len(fate), chars_in=stats["chars"],
                           undecodable_bytes=stats["bad"], removed=removed, kept=kept, chars_kept=chars_kept)
    return report, fate


def _batches(docs, chars: int) -> Iterator[tuple[int, list[str]]]:
    """(split, documents) in batches of about `chars` characters per split, in document order within each
    split, from (document, fate) pairs: what one tokenizer call holds at a time. Dropped ones are left out."""
    batches, sizes = {TRAIN: [], VAL: []}, {TRAIN: 0, VAL: 0}
    for doc, split in docs:
        if split == DROP:
            continue
        batches[split].append(doc)
        sizes[split] += len(doc)
        if sizes[split] >= chars:
            yield split, batches[split]
            batches[split], sizes[split] = [], 0
    for split, batch in batches.items():
        if batch:
            yield split, batch


class ShardWriter:
    """A split's token shards of `shard_tokens` tokens each (the last one shorter), written as they fill:
    each appears under its name only once complete (fsio.atomic_file)."""

    def __init__(self, out: Path, split: str, dtype, shard_tokens: int):
        self.out, self.split, self.shard_tokens = out, split, shard_tokens
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.shards: list[dict] = []
        self.tokens = self.documents = 0
        self._file, self._in_shard = None, 0

    def __enter__(self) -> "ShardWriter":
        return self

    def write(self, ids: np.ndarray) -> None:
        ids = ids.astype(self.dtype, copy=False)
        while len(ids):
            if self._file is None:
                self._open()
            n = min(len(ids), self.shard_tokens - self._in_shard)
            self._file.write(ids[:n].tobytes())
            self._in_shard += n
            self.tokens += n
            ids = ids[n:]
            if self._in_shard == self.shard_tokens:
                self._close()

    def _open(self) -> None:
        name = f"{self.split}_{len(self.shards):05d}.bin"
        self._context = atomic_file(self.out / name)
        self._file, self._in_shard = self._context.__enter__(), 0
        self.shards.append({"file": name, "tokens": 0})

    def _close(self) -> None:
        self.shards[-1]["tokens"] = self._in_shard
        self._context.__exit__(None, None, None)
        self._file = None

    def __exit__(self, kind, value, tb) -> None:
        if self._file is not None:
            if kind is None:
                self._close()
            else:
                self._context.__exit__(kind, value, tb)
        elif kind is None and not self.shards:  # an empty split still has its (empty) shard
            self._open()
            self._close()


def write_index(out: Path, splits: dict, vocab_size: int, eos_id: int, tokenizer: str, seed: int,
                report: dict) -> None:
    index = {"version": INDEX_VERSION, "dtype": np.dtype(token_dtype(vocab_size)).name, "vocab_size": vocab_size,
             "eos_id": eos_id, "tokenizer": tokenizer, "seed": seed, "splits": {}}
    for name, writer in splits.items():
        index["splits"][name] = {"documents": writer.documents, "tokens": writer.tokens, "shards": writer.shards}
    index["report"] = report
    write_bytes_atomic(out / INDEX_FILE, json.dumps(index, indent=2).encode())


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 65536 else np.uint32


def write_token_dataset(out: Path, splits: dict[str, tuple[np.ndarray, int]], vocab_size: int, eos_id: int,
                        tokenizer: str, seed: int, report: dict | None = None,
                        shard_tokens: int = 1 << 26) -> None:
    """Token shards and index.json (written last: the completion marker) for {split: (tokens, documents)}."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    writers = {}
    for split, (tokens, documents) in splits.items():
        with ShardWriter(out, split, token_dtype(vocab_size), shard_tokens) as writer:
            writer.write(np.asarray(tokens))
            writer.documents = documents
        writers[split] = writer
    write_index(out, writers, vocab_size, eos_id, tokenizer, seed, report or {})


def load_index(path: str | os.PathLike) -> dict:
    path = Path(path)
    index_file = path / INDEX_FILE
    if not index_file.is_file():
        raise HardyError(f"{path}: not a prepared dataset (no {INDEX_FILE}; run `hardy data prepare`)")
    try:
        index = json.loads(index_file.read_text())
    except json.JSONDecodeError as e:
        raise HardyError(f"{index_file}: malformed JSON ({e})") from None
    if index.get("version") != INDEX_VERSION:
        raise HardyError(f"{index_file}: unsupported dataset version {index.get('version')!r}")
    return index


def load_split(path: str | os.PathLike, split: str) -> "TokenShards":
    """A split's tokens as one sequence over its shard files, read on demand (nothing is held)."""
    path = Path(path)
    index = load_index(path)
    if split not in index["splits"]:
        raise HardyError(f"{path}: no split {split!r}")
    dtype = np.dtype(index["dtype"]).newbyteorder("<")
    files = []
    for shard in index["splits"][split]["shards"]:
        f = path / shard["file"]
        if not f.is_file():
            raise HardyError(f"{path}: missing shard {shard['file']}")
        expected = shard["tokens"] * dtype.itemsize
        if f.stat().st_size != expected:
            raise HardyError(f"{f}: has {f.stat().st_size} bytes, index says {expected} (truncated or corrupt)")
        if shard["tokens"]:
            files.append((f, shard["tokens"]))
    return TokenShards(files, dtype)


class TokenShards:
    """Token shard files as one read-only 1-D sequence: `len`, integer and slice indexing (to a numpy
    array), iteration. Slices are read with pread, so the process holds what it asked for, not the
    split (a memory map would keep every page a long run touched in its RSS)."""

    def __init__(self, files: list[tuple[Path, int]], dtype: np.dtype):
        self.dtype = dtype
        self._fds = [os.open(f, os.O_RDONLY) for f, _ in files]
        self._starts = np.cumsum([0] + [n for _, n in files])

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                return self[start:stop][::step]
            return self._read(start, max(start, stop))
        i = int(key) + (len(self) if int(key) < 0 else 0)
        if not 0 <= i < len(self):
            raise IndexError(f"token {key} of {len(self)}")
        return self._read(i, i + 1)[0]

    def _read(self, start: int, stop: int) -> np.ndarray:
        out = np.empty(stop - start, dtype=self.dtype)
        view = memoryview(out).cast("B")
        pos, size = start, self.dtype.itemsize
        while pos < stop:
            shard = int(np.searchsorted(self._starts, pos, side="right")) - 1
            end = min(stop, int(self._starts[shard + 1]))
            want = view[(pos - start) * size:(end - start) * size]
            got = os.preadv(self._fds[shard], [want], (pos - int(self._starts[shard])) * size)
            if got != len(want):
                raise HardyError(f"token shard {shard} ended early (truncated while in use?)")
            pos = end
        return out

    def __iter__(self):
        for start in range(0, len(self), 1 << 20):
            yield from self[start:start + (1 << 20)].tolist()

    def tolist(self) -> list[int]:
        return self[:].tolist()

    def __del__(self):
        for fd in getattr(self, "_fds", ()):
            os.close(fd)
