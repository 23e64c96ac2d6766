"""Tokenizers (the `tokenizers` library) built from GGUF metadata or Hugging Face files.

GGUF holds one of two kinds (`tokenizer.ggml.model`):
  - "gpt2": byte-level BPE (Llama 3, Qwen, SmolLM): the vocabulary already spelled in GPT-2's byte
    alphabet ("Ġ" for a space), the merges as "a b" strings, token types (3 = control, 4 =
    user-defined) and a pre-tokenizer name (`tokenizer.ggml.pre`) that selects how text is split
    before BPE, as in llama.cpp.
  - "llama": SentencePiece-style BPE (Gemma, Mistral, Llama 2): pieces with "▁" for a space, a score
    per piece and no merges. llama.cpp merges adjacent pieces highest score first and falls back to
    byte tokens (<0x0A>) for what no piece covers; that is a BPE whose merges are every split of every
    piece, ranked by the merged piece's score, with byte fallback (`spm_merges`).
"""
from __future__ import annotations

import json
import logging
import re
import threading
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from hardy.errors import HardyError

log = logging.getLogger(__name__)

NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 3, 4, 6
# end-of-turn tokens chat models emit, recognized by their text (as llama.cpp does) beside the file's EOS
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "<end_of_turn>", "<|end|>",
               "<|eom_id|>", "<EOT>")
SPACE = "\u2581"  # SentencePiece's "▁"

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


def _qwen2():
    # Llama 3's split with single digits (llama.cpp's "qwen2" pre-tokenizer)
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


# llama.cpp pre-tokenizer names -> the equivalent `tokenizers` pre-tokenizer.
PRE_TOKENIZERS = {
    "gpt-2": _byte_level, "gpt2": _byte_level, "default": _byte_level, "smollm": _smollm,
    "llama-bpe": _llama3, "llama3": _llama3, "llama-v3": _llama3, "qwen2": _qwen2,
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
    """A `tokenizers.Tokenizer` plus what a runtime needs: BOS/EOS policy and the chat template.
    `scores` / `types`: a SentencePiece-style vocabulary's piece scores and GGUF token types, kept
    for GGUF export (None: derived from the merges when needed)."""

    backend: Tokenizer = field(repr=False)
    bos_id: int | None = None
    eos_id: int | None = None
    add_bos: bool = False
    chat_template: str | None = field(default=None, repr=False)
    pre: str | None = None
    extra_stop_ids: frozenset[int] = frozenset()  # end-of-turn ids the file names (GGUF eot/eom, HF eos lists)
    unk_id: int | None = None
    pad_id: int | None = None
    add_space_prefix: bool = False  # SentencePiece style: a "▁" before the text
    scores: list[float] | None = field(default=None, repr=False)
    types: list[int] | None = field(default=None, repr=False)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @cached_property
    def sentencepiece(self) -> bool:
        """A SentencePiece-style BPE ("▁" for spaces, byte fallback), as Gemma and Mistral ship."""
        return bool(getattr(self.backend.model, "byte_fallback", False))

    @cached_property
    def _unrepresentable(self) -> re.Pattern | None:
        if self.sentencepiece:  # byte fallback: every character has tokens
            return None
        return unrepresentable_pattern(set(self.backend.get_vocab()))

    def check_representable(self, text: str) -> None:
        """Byte-level BPE silently drops bytes missing from the vocabulary: refuse instead."""
        if self._unrepresentable is not None:
            m = self._unrepresentable.search(text)
            if m:
                raise HardyError(f"text contains a character the vocabulary cannot encode: U+{ord(m.group()):04X} "
                                 f"at offset {m.start()}")

    def encode(self, text: str, add_bos: bool | None = None, special: bool = True) -> list[int]:
        """Token ids of `text`; `special` False: control tokens' text ("<unk>", "<|im_end|>") is read as
        plain text, as llama.cpp reads evaluation text (llama-perplexity); user-defined tokens still match."""
        self.check_representable(text)
        if special:
            ids = self.backend.encode(text, add_special_tokens=False).ids
        else:
            with self._plain_text:
                self.backend.encode_special_tokens = True
                try:
                    ids = self.backend.encode(text, add_special_tokens=False).ids
                finally:
                    self.backend.encode_special_tokens = False
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    @cached_property
    def _plain_text(self) -> threading.Lock:  # `encode_special_tokens` is the backend's state: one at a time
        return threading.Lock()

    def encode_chat(self, text: str) -> list[int]:
        """A rendered chat prompt: BOS as the model wants it, once (templates often write it themselves)."""
        bos = self.token(self.bos_id) if self.bos_id is not None else None
        return self.encode(text, add_bos=self.add_bos and not (bos and text.startswith(bos)))

    def decode(self, ids, skip_special: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    def stream_decoder(self) -> "StreamDecoder":
        return StreamDecoder(self)

    def token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @property
    def stop_ids(self) -> set[int]:
        """EOS, the end-of-turn ids the file names, and the end-of-turn tokens chat models emit
        (<|im_end|>, <|eot_id|>, <end_of_turn> ...)."""
        ids = {self.backend.token_to_id(t) for t in END_OF_TURN} | {self.eos_id} | set(self.extra_stop_ids)
        return {i for i in ids if i is not None}

    def special_tokens(self) -> dict[str, str]:
        """bos_token, eos_token ... as chat templates see them (transformers passes the same names)."""
        ids = {"bos_token": self.bos_id, "eos_token": self.eos_id, "unk_token": self.unk_id, "pad_token": self.pad_id}
        return {key: self.token(i) for key, i in ids.items() if i is not None and self.token(i) is not None}

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        if not self.chat_template:
            raise HardyError("this model has no chat template; run without --chat or give one with --chat-template")
        from hardy.formats.chat import render_chat  # start-up: only chat prompts need jinja2

        return render_chat(self.chat_template, messages, add_generation_prompt, **self.special_tokens(), **extra)

    # --- Hugging Face files -------------------------------------------------------------------

    def save_hf(self, out_dir: Path) -> list[Path]:
        """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
        out_dir = Path(out_dir)
        self.backend.save(str(out_dir / "tokenizer.json"))
        special = self.special_tokens()
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
        config = _json_object(path / "tokenizer_config.json")

        def token_id(key):
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            return backend.token_to_id(value) if isinstance(value, str) and value else None

        bos = token_id("bos_token")
        add_bos = config.get("add_bos_token")
        if add_bos is None:  # not said: whether the file's post-processor puts BOS first
            add_bos = bos is not None and backend.encode("a", add_special_tokens=True).ids[:1] == [bos]
        eos = _json_object(path / "generation_config.json").get("eos_token_id")
        stops = [i for i in (eos if isinstance(eos, list) else [eos]) if isinstance(i, int)]
        return cls(backend=backend, bos_id=bos, eos_id=token_id("eos_token"), add_bos=bool(add_bos),
                   chat_template=hf_chat_template(path, config), pre=config.get("hardy_pre_tokenizer"),
                   extra_stop_ids=frozenset(stops), unk_id=token_id("unk_token"), pad_id=token_id("pad_token"))


def _json_object(path: Path) -> dict:
    """A JSON object file of a model directory ({} when absent); a malformed one is a one-line error."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HardyError(f"{path}: malformed JSON ({e})") from None
    if not isinstance(data, dict):
        raise HardyError(f"{path}: expected a JSON object")
    return data


def hf_chat_template(path: Path, config: dict) -> str | None:
    """The directory's chat template: chat_template.jinja (transformers' own file since 4.43), else the
    `chat_template` of tokenizer_config.json (a string, or named templates: the "default" one)."""
    jinja = Path(path) / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


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


def _check_ids(fields: dict, n_tokens: int, source) -> None:
    for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
                "tokenizer.ggml.padding_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = fields.get(key)
        if value is not None and not (isinstance(value, int) and 0 <= value < n_tokens):
            raise HardyError(f"{source}: {key} = {value!r} is not a token of the vocabulary ({n_tokens})")


def tokenizer_from_gguf_fields(fields: dict, source: object = "GGUF file") -> HardyTokenizer:
    """Build the tokenizer from decoded GGUF key/values (`tokenizer.ggml.*`)."""
    kind = fields.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise HardyError(f"{source}: GGUF tokenizer model {kind!r} is not supported (hardy reads byte-level BPE "
                         "'gpt2' and SentencePiece-style 'llama')")
    tokens = fields.get("tokenizer.ggml.tokens")
    if not tokens or not all(isinstance(x, str) for x in tokens):
        raise HardyError(f"{source}: no tokenizer vocabulary (tokenizer.ggml.tokens must be strings)")
    types = fields.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens) or not all(isinstance(t, int) for t in types):
        raise HardyError(f"{source}: tokenizer.ggml.token_type must give one integer type per token")
    _check_ids(fields, len(tokens), source)
    space_prefix, scores = False, None
    if kind == "gpt2":
        backend = _byte_level_bpe(fields, tokens, source)
    else:
        scores = fields.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens) or not all(isinstance(x, (int, float)) for x in scores):
            raise HardyError(f"{source}: a SentencePiece-style vocabulary needs one score per token (tokenizer.ggml.scores)")
        space_prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", True))
        backend = sentencepiece_bpe(tokens, scores, types, space_prefix, fields.get("tokenizer.ggml.unknown_token_id"),
                                    source)
    control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED]
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)
    stops = {fields.get(k) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")} - {None}
    return HardyTokenizer(
        backend=backend, bos_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_id=fields.get("tokenizer.ggml.eos_token_id"),
        add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", kind == "llama")),
        chat_template=fields.get("tokenizer.chat_template"), pre=fields.get("tokenizer.ggml.pre"),
        extra_stop_ids=frozenset(stops), unk_id=fields.get("tokenizer.ggml.unknown_token_id"),
        pad_id=fields.get("tokenizer.ggml.padding_token_id"), add_space_prefix=space_prefix,
        scores=[float(x) for x in scores] if scores is not None else None, types=list(types))


def _byte_level_bpe(fields: dict, tokens: list[str], source) -> Tokenizer:
    merges = fields.get("tokenizer.ggml.merges")
    if merges is None:
        raise HardyError(f"{source}: no tokenizer merges (tokenizer.ggml.merges)")
    if not all(isinstance(m, str) and " " in m for m in merges):
        raise HardyError(f"{source}: the tokenizer's merges must be strings ('a b' for a merge)")
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    try:
        backend = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    except Exception as e:  # tokenizers raises a bare Exception for inconsistent tables
        raise HardyError(f"{source}: the tokenizer's tables do not agree ({e})") from None
    backend.pre_tokenizer = pre_tokenizer_for(fields.get("tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()
    return backend


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every split (a, b) of every normal piece into two pieces, the merged piece's score first (longer
    left parts first on a tie): BPE over these merges is llama.cpp's SentencePiece merging."""
    pieces = {t for t, ty in zip(tokens, types) if ty in (NORMAL, USER_DEFINED, BYTE)}
    ranked = []  # (-score, -len(left), id, left, right): sorted ascending = best merge first
    for i, (piece, ty, score) in enumerate(zip(tokens, types, scores)):
        if ty != NORMAL:
            continue
        for cut in range(len(piece) - 1, 0, -1):
            left = piece[:cut]
            if left in pieces and piece[cut:] in pieces:
                ranked.append((-score, -cut, i, left, piece[cut:]))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def sentencepiece_bpe(tokens: list[str], scores: list[float], types: list[int], space_prefix: bool,
                      unk_id: int | None, source="the vocabulary") -> Tokenizer:
    """A SentencePiece-style vocabulary as a `tokenizers` BPE with byte fallback. Spaces become "▁"; with
    `space_prefix`, each stretch of text between special tokens starts with one more (llama.cpp's rule)."""
    vocab: dict[str, int] = {}
    for i, piece in enumerate(tokens):
        if piece in vocab and types[i] == NORMAL and types[vocab[piece]] == NORMAL:
            raise HardyError(f"{source}: the piece {piece!r} appears twice in the vocabulary")
        vocab.setdefault(piece, i)
    unk = tokens[unk_id] if unk_id is not None else None
    try:
        backend = Tokenizer(models.BPE(vocab=vocab, merges=spm_merges(tokens, scores, types), unk_token=unk,
                                       fuse_unk=True, byte_fallback=True))
    except Exception as e:  # tokenizers raises a bare Exception for inconsistent tables
        raise HardyError(f"{source}: the tokenizer's tables do not agree ({e})") from None
    # a normalizer runs on each stretch between added tokens: the prefix space comes after every special
    # token too, as in llama.cpp (and unconditionally: " x" is "▁▁x")
    spaces = [normalizers.Replace(" ", SPACE)]
    backend.normalizer = normalizers.Sequence(([normalizers.Prepend(SPACE)] if space_prefix else []) + spaces)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if space_prefix else []))
    return backend
