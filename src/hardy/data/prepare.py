"""`hardy data prepare`: clean, de-duplicate, split, tokenize and write memory-mapped token shards.

Output directory layout (INDEX_VERSION 1):
    tokenizer.json, tokenizer_config.json     the tokenizer (Hugging Face format)
    train_00000.bin, ...                      token ids, little-endian uint16 (vocab <= 65536) or uint32,
    val_00000.bin, ...                        documents joined with the EOS id after each document
    index.json                                written last: shards, token counts, dtype, report
"""
from __future__ import annotations

import json
import os
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from hardy.data.clean import FILTERS, CleanConfig, normalize, rejection_reason, split_documents
from hardy.data.dedup import exact_duplicates, near_duplicates
from hardy.data.text import resolve_text_path
from hardy.errors import HardyError
from hardy.formats.gguf_io import gguf_fields, open_gguf
from hardy.formats.packaged import smollm2_gguf_path
from hardy.formats.tokenizer import HardyTokenizer, tokenizer_from_gguf_fields
from hardy.fsio import write_bytes_atomic

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


def read_documents(inputs: list[str]) -> tuple[list[str], int, int]:
    """Documents of all inputs; undecodable bytes become U+FFFD so the binary filter can see them."""
    docs, chars, bad = [], 0, 0
    for spec in inputs:
        path = resolve_text_path(spec)
        if not path.is_file():
            raise HardyError(f"input is not a file: {path}")
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise HardyError(f"cannot read input {path}: {e.strerror}") from None
        text = raw.decode("utf-8", errors="replace")
        bad += text.count("\ufffd")
        chars += len(text)
        docs += split_documents(normalize(text))
    if not docs:
        raise HardyError(f"no text in the inputs: {', '.join(inputs)}")
    return docs, chars, bad


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


def prepare(inputs: list[str], tokenizer: str, out: str | os.PathLike, clean: CleanConfig = CleanConfig(),
            near_threshold: float = 0.8, val_fraction: float = 0.05, seed: int = 0,
            shard_tokens: int = 1 << 26) -> PrepareReport:
    if not inputs:
        raise HardyError("no --input given")
    if not 0 <= val_fraction < 1:
        raise HardyError(f"--val-fraction must be in [0, 1) (got {val_fraction})")
    if not 0 < near_threshold <= 1:
        raise HardyError(f"--near-dup-threshold must be in (0, 1] (got {near_threshold})")
    out = Path(out)
    if (out / INDEX_FILE).exists():
        raise HardyError(f"{out} already holds a prepared dataset; choose another --out")
    docs, chars, bad = read_documents(inputs)
    report = PrepareReport(inputs=list(inputs), documents=len(docs), chars_in=chars, undecodable_bytes=bad)
    removed = {name: 0 for name in FILTERS}
    survivors = []
    for doc in docs:
        reason = rejection_reason(doc, clean)
        if reason is None:
            survivors.append(doc)
        else:
            removed[reason] += 1
    exact = exact_duplicates(survivors)
    near = near_duplicates(survivors, threshold=near_threshold, skip=exact, seed=seed)
    removed["exact duplicate"] = len(exact)
    removed[f"near duplicate (Jaccard >= {near_threshold:g})"] = len(near)
    kept = [d for i, d in enumerate(survivors) if i not in exact and i not in near]
    if not kept:
        raise HardyError("every document was filtered out; check the inputs or relax the filters")
    report.removed, report.kept, report.chars_kept = removed, len(kept), sum(len(d) for d in kept)

    rng = random.Random(seed)
    splits: dict[str, list[str]] = {"train": [], "val": []}
    for doc in kept:
        splits["val" if rng.random() < val_fraction else "train"].append(doc)
    if not splits["train"]:
        raise HardyError("the train split is empty; lower --val-fraction or add text")

    tok = build_tokenizer(tokenizer, splits["train"])
    out.mkdir(parents=True, exist_ok=True)
    tok.save_hf(out)
    eos = tok.eos_id
    if eos is None:
        raise HardyError("the tokenizer has no end-of-text token to separate documents")
    dtype = token_dtype(tok.vocab_size)
    encoded_splits = {}
    for split, split_docs in splits.items():
        encoded = tok.backend.encode_batch(split_docs, add_special_tokens=False) if split_docs else []
        pieces = [np.asarray(e.ids + [eos], dtype=dtype) for e in encoded]
        encoded_splits[split] = (np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype), len(split_docs))
        report.tokens[split] = int(len(encoded_splits[split][0]))
        report.documents_per_split[split] = len(split_docs)
    write_token_dataset(out, encoded_splits, tok.vocab_size, eos, tokenizer, seed, asdict(report), shard_tokens)
    return report


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 65536 else np.uint32


def write_token_dataset(out: Path, splits: dict[str, tuple[np.ndarray, int]], vocab_size: int, eos_id: int,
                        tokenizer: str, seed: int, report: dict | None = None,
                        shard_tokens: int = 1 << 26) -> None:
    """Token shards and index.json (written last: the completion marker) for {split: (tokens, documents)}."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(vocab_size)
    index = {"version": INDEX_VERSION, "dtype": np.dtype(dtype).name, "vocab_size": vocab_size,
             "eos_id": eos_id, "tokenizer": tokenizer, "seed": seed, "splits": {}}
    for split, (tokens, documents) in splits.items():
        shards = []
        for k, start in enumerate(range(0, max(len(tokens), 1), shard_tokens)):
            chunk = tokens[start:start + shard_tokens]
            name = f"{split}_{k:05d}.bin"
            write_bytes_atomic(out / name, chunk.astype("<" + np.dtype(dtype).str[1:]).tobytes())
            shards.append({"file": name, "tokens": int(len(chunk))})
        index["splits"][split] = {"documents": documents, "tokens": int(len(tokens)), "shards": shards}
    index["report"] = report or {}
    write_bytes_atomic(out / INDEX_FILE, json.dumps(index, indent=2).encode())


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


def load_split(path: str | os.PathLike, split: str) -> np.ndarray:
    """All tokens of a split as one read-only memory map (or a concatenation of shard maps)."""
    path = Path(path)
    index = load_index(path)
    if split not in index["splits"]:
        raise HardyError(f"{path}: no split {split!r}")
    maps = []
    for shard in index["splits"][split]["shards"]:
        f = path / shard["file"]
        if not f.is_file():
            raise HardyError(f"{path}: missing shard {shard['file']}")
        expected = shard["tokens"] * np.dtype(index["dtype"]).itemsize
        if f.stat().st_size != expected:
            raise HardyError(f"{f}: has {f.stat().st_size} bytes, index says {expected} (truncated or corrupt)")
        if shard["tokens"]:
            maps.append(np.memmap(f, dtype=np.dtype(index["dtype"]).newbyteorder("<"), mode="r"))
    if not maps:
        return np.zeros(0, dtype=np.int64)
    return maps[0] if len(maps) == 1 else np.concatenate(maps)
