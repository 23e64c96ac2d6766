"""Write GGUF files llama.cpp loads: `hardy export --format gguf --type F32|F16|Q8_0|Q4_0|Q4_1`.

Tensor names and metadata follow llama.cpp's architecture for the model's family
(`hardy.formats.gguf_families`: llama, qwen2, qwen3, gemma2, gemma3, qwen2moe, qwen3moe; Mixtral as
`llama` with experts, each projection of all experts stacked in one tensor); a `llama` file's attn_q/attn_k
rows are permuted to llama.cpp's interleaved rotary order. The tokenizer goes in as `gpt2`-style
byte-level BPE (tokens in GPT-2's byte alphabet, merges, token types, BOS/EOS, `tokenizer.ggml.pre`)
or, for a SentencePiece-style vocabulary (Gemma, Mistral), as `llama` pieces with scores and types.
Norms and biases stay F32 (llama.cpp needs 1-D tensors in F32) and a matrix whose rows are not a
multiple of the 32-value block is written F16.

hardy's own quantized tensors are written without re-quantizing where the formats match: int4
asymmetric group 32 *is* Q4_1, int4 symmetric group 32 *is* Q4_0, 5-bit symmetric group 32 *is* Q5_0 and
int8 symmetric group 32 *is* Q8_0
(same fp16 scale/min and codes, same packing) — the bytes are repacked, not recomputed. Anything else is dequantized and quantized
with the `gguf` package's reference kernels.
"""
from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from pathlib import Path

import gguf
import numpy as np
import torch

from hardy.errors import HardyError
from hardy.formats.gguf_families import PERMUTED_QK, gguf_arch, write_metadata
from hardy.formats.names import permute_qk, stacked_name, to_format
from hardy.formats.quantized import QuantSpec, QuantTensor, pack_int4

TYPES = ("F32", "F16", "Q8_0", "Q5_0", "Q4_0", "Q4_1")
log = logging.getLogger("hardy")
BLOCK = 32


def _file_type(name: str):
    return {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
            "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "Q5_0": gguf.LlamaFileType.MOSTLY_Q5_0,
            "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
            "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1}[name]


def repack_blocks(qt: QuantTensor, qtype: str) -> np.ndarray | None:
    """GGUF block bytes [rows, row bytes] for a hardy tensor whose format is `qtype`, else None."""
    p = qt.packed()
    rows = qt.shape[0]
    if qtype == "Q4_1" and qt.spec == QuantSpec(4, BLOCK, False):
        parts = [p["scales"].reshape(-1, 1).numpy().view(np.uint8), p["mins"].reshape(-1, 1).numpy().view(np.uint8),
                 p["qweight"].reshape(-1, BLOCK // 2).numpy()]
    elif qtype == "Q4_0" and qt.spec == QuantSpec(4, BLOCK, True):
        parts = [p["scales"].reshape(-1, 1).numpy().view(np.uint8), p["qweight"].reshape(-1, BLOCK // 2).numpy()]
    elif qtype == "Q8_0" and qt.spec == QuantSpec(8, BLOCK, True):
        parts = [p["scales"].reshape(-1, 1).numpy().view(np.uint8), p["qweight"].reshape(-1, BLOCK).numpy().view(np.uint8)]
    elif qtype == "Q5_0" and qt.spec == QuantSpec(5, BLOCK, True):
        codes = qt.codes.to(torch.int64).reshape(-1, BLOCK)  # a block per row: d, the fifth bits, the nibbles
        high = (((codes >> 4) & 1) << torch.arange(BLOCK)).sum(-1).to(torch.int32)
        parts = [p["scales"].reshape(-1, 1).numpy().view(np.uint8), high.reshape(-1, 1).numpy().view(np.uint8),
                 pack_int4((qt.codes & 15).reshape(-1, BLOCK)).numpy()]
    else:
        return None
    return np.ascontiguousarray(np.concatenate(parts, axis=1).reshape(rows, -1))


def _permute_quant(qt: QuantTensor, heads: int) -> QuantTensor:
    """Row permutation of a quantized q/k matrix: codes, scales and mins move with their rows."""
    return QuantTensor(codes=permute_qk(qt.codes, heads), scale=permute_qk(qt.scale, heads),
                       mins=None if qt.mins is None else permute_qk(qt.mins, heads), spec=qt.spec,
                       supers=None if qt.supers is None else permute_qk(qt.supers, heads))


def _holds_quantized_weight(module) -> bool:
    """hardy's quantized modules (hardy.compress.qlinear) expose their weight as `quant_tensor()`."""
    return callable(getattr(module, "quant_tensor", None))


def _tensors(model, cfg) -> tuple[dict[str, torch.Tensor], dict[str, QuantTensor]]:
    """(float tensors, quantized tensors) by hardy name, with the tied head left out."""
    quantized, floats = {}, {}
    quantized_table = _holds_quantized_weight(model.tok_embeddings)
    for name, module in model.named_modules():
        # an embedding's inner `.table` is the embedding's own weight; a tied head is that same table
        if _holds_quantized_weight(module) and not name.endswith(".table") and not (
                name == "output" and quantized_table):
            quantized[f"{name}.weight"] = module.quant_tensor()
    for name, p in model.named_parameters():
        floats[name] = p.detach().float()
    if cfg.tie_embeddings:
        floats.pop("output.weight", None)
        quantized.pop("output.weight", None)
    return floats, quantized


def _vocabulary(tokenizer) -> list[str]:
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    tokens = [None] * (max(vocab.values()) + 1)
    for token, i in vocab.items():
        tokens[i] = token
    if any(t is None for t in tokens):
        raise HardyError("the tokenizer's ids are not contiguous; cannot write a GGUF vocabulary")
    return tokens


def _byte_level_metadata(writer, tokenizer, tokens: list[str]) -> None:
    model = json.loads(tokenizer.backend.to_str())["model"]
    if model.get("type") != "BPE":
        raise HardyError(f"GGUF export supports BPE tokenizers (this one is {model.get('type')})")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    special = {t.content for t in tokenizer.backend.get_added_tokens_decoder().values() if t.special}
    writer.add_tokenizer_model("gpt2")
    # llama.cpp calls GPT-2's splitting "gpt-2" and refuses "gpt2" (runs before this fix stored that)
    writer.add_tokenizer_pre("gpt-2" if tokenizer.pre in (None, "gpt2") else tokenizer.pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])  # 3 = control, 1 = normal
    writer.add_token_merges(merges)


BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")


def _sentencepiece_metadata(writer, tokenizer, tokens: list[str]) -> None:
    """Pieces, scores and types. A vocabulary read from GGUF keeps its own; one from tokenizer.json gets
    types from its added tokens and scores from its merges (a piece's score: minus the rank of the first
    merge that makes it), so llama.cpp's highest-score-first merging follows the merges' order."""
    types, scores = tokenizer.types, tokenizer.scores
    if types is None or len(types) != len(tokens):
        added = tokenizer.backend.get_added_tokens_decoder()
        kinds = {t.content: (3 if t.special else 4) for t in added.values()}
        types = [kinds.get(t, 6 if BYTE_TOKEN.fullmatch(t) else 1) for t in tokens]
    if scores is None or len(scores) != len(tokens):
        merges = json.loads(tokenizer.backend.to_str())["model"].get("merges", [])
        rank = {}
        for i, m in enumerate(merges):
            rank.setdefault("".join(m.split(" ", 1) if isinstance(m, str) else m), i)
        scores = [-float(rank.get(t, len(merges) + i)) if ty == 1 else 0.0 for i, (t, ty) in enumerate(zip(tokens, types))]
    prefix = tokenizer.backend.encode("a", add_special_tokens=False).tokens[:1] == ["\u2581a"] or tokenizer.add_space_prefix
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_add_space_prefix(bool(prefix))


def _tokenizer_metadata(writer, tokenizer) -> None:
    tokens = _vocabulary(tokenizer)
    if tokenizer.sentencepiece:
        _sentencepiece_metadata(writer, tokenizer, tokens)
    else:
        _byte_level_metadata(writer, tokenizer, tokens)
    for add, token_id in ((writer.add_bos_token_id, tokenizer.bos_id), (writer.add_eos_token_id, tokenizer.eos_id),
                          (writer.add_unk_token_id, tokenizer.unk_id), (writer.add_pad_token_id, tokenizer.pad_id)):
        if token_id is not None:
            add(token_id)
    writer.add_add_bos_token(bool(tokenizer.add_bos))
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


def export_gguf(model, cfg, tokenizer, out: str | os.PathLike, qtype: str = "F32") -> dict:
    """Write `out` atomically; returns {"repacked": n, "requantized": n, "float": n} tensor counts."""
    logging.getLogger("gguf").setLevel(logging.WARNING)  # its writer narrates every file at INFO
    if qtype not in TYPES:
        raise HardyError(f"--type must be one of {', '.join(TYPES)} (got {qtype!r})")
    if tokenizer is None:
        raise HardyError("the model has no tokenizer: llama.cpp needs one in the GGUF file")
    if cfg.rope_scaling is not None and cfg.rope_scaling.kind == "llama3":  # llama.cpp wants a rope_freqs tensor
        raise HardyError("GGUF export of Llama 3.1-style RoPE scaling is not supported yet")
    arch = gguf_arch(cfg)
    if arch == "llama" and cfg.sliding_window:
        log.warning("llama.cpp runs `llama` files without a sliding window: it computes this model as hardy "
                    "does only up to %d positions", cfg.sliding_window)
    out = Path(out)
    if out.exists():
        raise HardyError(f"output {out} already exists")
    out.parent.mkdir(parents=True, exist_ok=True)
    floats, quantized = _tensors(model, cfg)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    counts = {"repacked": 0, "requantized": 0, "float": 0}
    try:
        writer = gguf.GGUFWriter(str(tmp), arch)
        write_metadata(writer, cfg, _file_type(qtype))
        _tokenizer_metadata(writer, tokenizer)
        experts: dict[str, list] = {}  # stacked name -> each expert's (array, raw type), in expert order
        for name in sorted([*floats, *quantized], key=_order):  # disjoint: quantized layers hold no parameters
            array, raw, kind = _encoded(name, floats, quantized, cfg, arch, qtype)
            counts[kind] += 1
            stacked = stacked_name(name)
            if stacked is None:
                writer.add_tensor(to_format(name, "gguf"), array, raw_dtype=raw)
                continue
            experts.setdefault(stacked, []).append((array, raw))
            if len(experts[stacked]) == cfg.moe.n_experts:  # GGUF holds a projection of all experts as one tensor
                parts = experts.pop(stacked)
                if len({(a.dtype, a.shape, r) for a, r in parts}) != 1:
                    raise HardyError(f"{stacked}: the experts are not stored alike; cannot stack them")
                writer.add_tensor(to_format(stacked, "gguf"), np.stack([a for a, _ in parts]), raw_dtype=parts[0][1])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.rename(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return counts


def _encoded(name: str, floats: dict, quantized: dict, cfg, arch: str, qtype: str):
    """(array, raw GGUF type or None, which count) of one tensor as the file stores it."""
    heads = None
    if arch in PERMUTED_QK and name.endswith((".wq.weight", ".wq.bias", ".wk.weight", ".wk.bias")):
        heads = cfg.n_heads if ".wq." in name else cfg.n_kv_heads
    qt = quantized.get(name)
    if qt is not None and heads:
        qt = _permute_quant(qt, heads)
    if qt is not None:
        blocks = repack_blocks(qt, qtype)
        if blocks is not None:
            return blocks, gguf.GGMLQuantizationType[qtype], "repacked"
        values = qt.dequantize()
    else:
        values = floats[name]
        if heads:
            values = permute_qk(values, heads)
    if name.endswith("shared_gate.weight"):  # [1, dim] in the model, a vector in llama.cpp's files
        values = values.reshape(-1)
    array = np.ascontiguousarray(values.numpy().astype(np.float32))
    # routers stay F32 as llama-quantize leaves them: a rounded router sends tokens to other experts
    if array.ndim == 1 or qtype == "F32" or name.endswith("router.weight"):
        return array, None, "float"
    if qtype == "F16" or array.shape[-1] % BLOCK:
        return array.astype(np.float16), None, "float"
    t = gguf.GGMLQuantizationType[qtype]
    return gguf.quants.quantize(array, t), t, "requantized"


def _order(name: str) -> tuple:
    """llama.cpp's conventional order: token_embd, blocks in order, output_norm, output (a block's experts
    in expert order, so that each stacked tensor's parts arrive one after another)."""
    if name.startswith("layers."):
        parts = name.split(".")
        if ".experts." in name:
            return (1, int(parts[1]), f"{stacked_name(name)}", int(parts[4]))
        return (1, int(parts[1]), name, 0)
    return ({"tok_embeddings.weight": 0, "norm.weight": 2, "output.weight": 3}.get(name, 4), 0, name, 0)
