"""Byte-level BPE tokenizer (the `tokenizers` library) built from GGUF metadata or HF files.

GGUF stores the vocabulary already spelled in GPT-2's byte alphabet ("Ġ" for a space), the
merges as "a b" strings, token types (3 = control, 4 = user-defined) and a pre-tokenizer name
(`tokenizer.ggml.pre`) that selects how text is split before BPE, as in llama.cpp.
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from hardy.errors import HardyError

log = logging.getLogger(__name__)

CONTROL, USER_DEFINED = 3, 4
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>")

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level():
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _smollm():
    # SmolLM/SmolLM2 split every digit on its own before GPT-2's byte-level regex.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level()])


def _llama3():
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


# llama.cpp pre-tokenizer names -> the equivalent `tokenizers` pre-tokenizer.
PRE_TOKENIZERS = {
    "gpt-2": _byte_level, "gpt2": _byte_level, "default": _byte_level, "smollm": _smollm,
    "llama-bpe": _llama3, "llama3": _llama3, "llama-v3": _llama3,
}


def pre_tokenizer_for(name: str | None):
    if name is None:
        return _byte_level()
    if name not in PRE_TOKENIZERS:
        log.warning("unknown GGUF pre-tokenizer %r: using GPT-2 byte-level splitting; token ids may differ "
                    "from llama.cpp on digits and punctuation", name)
        return _byte_level()
    return PRE_TOKENIZERS[name]()


@dataclass
class HardyTokenizer:
    """A `tokenizers.Tokenizer` plus what a runtime needs: BOS/EOS policy and the chat template."""

    backend: Tokenizer = field(repr=False)
    bos_id: int | None = None
    eos_id: int | None = None
    add_bos: bool = False
    chat_template: str | None = field(default=None, repr=False)
    pre: str | None = None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @cached_property
    def _unrepresentable(self) -> re.Pattern | None:
        return unrepresentable_pattern(set(self.backend.get_vocab()))

    def check_representable(self, text: str) -> None:
        """Byte-level BPE silently drops bytes missing from the vocabulary: refuse instead."""
        if self._unrepresentable is not None:
            m = self._unrepresentable.search(text)
            if m:
                raise HardyError(f"text contains a character the vocabulary cannot encode: U+{ord(m.group()):04X} "
                                 f"at offset {m.start()}")

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        self.check_representable(text)
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids, skip_special: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    def stream_decoder(self) -> "StreamDecoder":
        return StreamDecoder(self)

    def token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @property
    def stop_ids(self) -> set[int]:
        """EOS plus the end-of-turn tokens chat models emit (<|im_end|>, <|eot_id|>)."""
        ids = {self.backend.token_to_id(t) for t in END_OF_TURN} | {self.eos_id}
        return {i for i in ids if i is not None}

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise HardyError("this model has no chat template; run without --chat")
        from jinja2.sandbox import ImmutableSandboxedEnvironment  # start-up: only chat prompts need jinja2

        def raise_exception(message):
            raise HardyError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        template = env.from_string(self.chat_template)
        return template.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.token(self.bos_id) if self.bos_id is not None else "",
            eos_token=self.token(self.eos_id) if self.eos_id is not None else "")

    # --- Hugging Face files -------------------------------------------------------------------

    def save_hf(self, out_dir: Path) -> list[Path]:
        """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
        out_dir = Path(out_dir)
        self.backend.save(str(out_dir / "tokenizer.json"))
        special = {}
        if self.bos_id is not None:
            special["bos_token"] = self.token(self.bos_id)
        if self.eos_id is not None:
            special["eos_token"] = self.token(self.eos_id)
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": self.add_bos,
            "add_eos_token": False, "clean_up_tokenization_spaces": False, "model_max_length": 1 << 30,
            **special, "hardy_pre_tokenizer": self.pre,
        }
        if self.chat_template:
            config["chat_template"] = self.chat_template
        (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
        (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2, ensure_ascii=False))
        return [out_dir / n for n in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")]

    @classmethod
    def from_hf_dir(cls, path: Path) -> "HardyTokenizer":
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise HardyError(f"{path}: no tokenizer.json")
        try:
            backend = Tokenizer.from_file(str(tok_file))
        except Exception as e:  # tokenizers raises a plain Exception on malformed JSON
            raise HardyError(f"{tok_file}: cannot read tokenizer ({e})") from None
        config = {}
        if (path / "tokenizer_config.json").is_file():
            config = json.loads((path / "tokenizer_config.json").read_text())

        def token_id(key):
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            return backend.token_to_id(value) if value else None

        return cls(backend=backend, bos_id=token_id("bos_token"), eos_id=token_id("eos_token"),
                   add_bos=bool(config.get("add_bos_token", False)), chat_template=config.get("chat_template"),
                   pre=config.get("hardy_pre_tokenizer"))


def unrepresentable_pattern(vocab: set[str]) -> re.Pattern | None:
    """Regex matching characters whose UTF-8 bytes include a byte with no token in `vocab`."""
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    to_byte = {c: b for b, c in enumerate(_bytes_to_unicode())}
    missing = sorted(to_byte[c] for c in byte_chars if c not in vocab)
    if not missing:
        return None
    ranges = []
    if any(0x80 <= b <= 0xBF for b in missing):  # a missing continuation byte: test every code point
        missing_set = set(missing)
        bad = [cp for cp in range(0x110000) if not 0xD800 <= cp <= 0xDFFF
               and missing_set & set(chr(cp).encode("utf-8"))]
        ranges = [(cp, cp) for cp in bad]
    else:
        for b in missing:
            if b < 0x80:
                ranges.append((b, b))
            elif 0xC2 <= b <= 0xDF:
                ranges.append(((b & 0x1F) << 6, ((b & 0x1F) << 6) + 0x3F))
            elif 0xE0 <= b <= 0xEF:
                ranges.append(((b & 0x0F) << 12, ((b & 0x0F) << 12) + 0xFFF))
            elif 0xF0 <= b <= 0xF4:
                ranges.append(((b & 0x07) << 18, ((b & 0x07) << 18) + 0x3FFFF))
            # 0xC0, 0xC1 and 0xF5..0xFF never occur in valid UTF-8.
    if not ranges:
        return None
    parts = "".join(re.escape(chr(lo)) if lo == hi else f"{re.escape(chr(lo))}-{re.escape(chr(hi))}" for lo, hi in ranges)
    return re.compile(f"[{parts}]")


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table, indexed by byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


class StreamDecoder:
    """Incremental detokenization that holds back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer: HardyTokenizer):
        self._tok = tokenizer
        self._stream = decoders.DecodeStream(skip_special_tokens=False)

    def step(self, token_id: int) -> str:
        return self._stream.step(self._tok.backend, token_id) or ""


def tokenizer_from_gguf_fields(fields: dict, source: object = "GGUF file") -> HardyTokenizer:
    """Build the tokenizer from decoded GGUF key/values (`tokenizer.ggml.*`)."""
    kind = fields.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise HardyError(f"{source}: GGUF tokenizer model {kind!r} is not supported (hardy reads byte-level BPE, 'gpt2')")
    tokens = fields.get("tokenizer.ggml.tokens")
    merges = fields.get("tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise HardyError(f"{source}: no tokenizer vocabulary/merges")
    if not all(isinstance(x, str) for x in tokens) or not all(isinstance(m, str) and " " in m for m in merges):
        raise HardyError(f"{source}: the tokenizer's tokens and merges must be strings ('a b' for a merge)")
    for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
        value = fields.get(key)
        if value is not None and not (isinstance(value, int) and 0 <= value < len(tokens)):
            raise HardyError(f"{source}: {key} = {value!r} is not a token of the vocabulary ({len(tokens)})")
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    try:
        backend = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    except Exception as e:  # tokenizers raises a bare Exception for inconsistent tables
        raise HardyError(f"{source}: the tokenizer's tables do not agree ({e})") from None
    pre = fields.get("tokenizer.ggml.pre")
    backend.pre_tokenizer = pre_tokenizer_for(pre)
    backend.decoder = decoders.ByteLevel()
    types = fields.get("tokenizer.ggml.token_type") or []
    control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED]
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)
    return HardyTokenizer(
        backend=backend, bos_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_id=fields.get("tokenizer.ggml.eos_token_id"),
        add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
        chat_template=fields.get("tokenizer.chat_template"), pre=pre)
