"""A Qwen3-30B-A3B-shaped GGUF with random weights, written straight to the file with the `gguf`
package (not by hardy's exporter), for the mixture-of-experts decode benchmarks: the real hidden
size (2048), attention (32 query heads, 4 KV heads of 128), 128 experts of width 768 with 8 active per
token, a 151,936-entry vocabulary (SmolLM2's BPE padded with control tokens); the layer count cut to
fit this machine (`--layers`, the real model has 48). Routers and norms F32, everything else `--type`.

    .venv/bin/python bench/moe_shaped.py --out /tmp/qwen3-30b-a3b-4l.gguf --layers 4 --type Q4_0
    .venv/bin/python bench/family_decode.py --model /tmp/qwen3-30b-a3b-4l.gguf --reps 5
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from big_cpu_model import random_blocks  # noqa: E402

SHAPE = dict(dim=2048, n_heads=32, n_kv_heads=4, head_dim=128, n_experts=128, top_k=8, expert_ffn=768,
             vocab=151936, rope_theta=1000000.0)


def tensor_plan(n_layers: int, qtype: str) -> list[tuple[str, tuple[int, ...], str]]:
    s = SHAPE
    d, hd, e, f = s["dim"], s["head_dim"], s["n_experts"], s["expert_ffn"]
    plan = [("token_embd.weight", (s["vocab"], d), qtype)]
    for i in range(n_layers):
        b = f"blk.{i}."
        plan += [(b + "attn_norm.weight", (d,), "F32"), (b + "attn_q.weight", (s["n_heads"] * hd, d), qtype),
                 (b + "attn_k.weight", (s["n_kv_heads"] * hd, d), qtype),
                 (b + "attn_v.weight", (s["n_kv_heads"] * hd, d), qtype),
                 (b + "attn_output.weight", (d, s["n_heads"] * hd), qtype),
                 (b + "attn_q_norm.weight", (hd,), "F32"), (b + "attn_k_norm.weight", (hd,), "F32"),
                 (b + "ffn_norm.weight", (d,), "F32"), (b + "ffn_gate_inp.weight", (e, d), "F32R"),
                 (b + "ffn_gate_exps.weight", (e, f, d), qtype), (b + "ffn_up_exps.weight", (e, f, d), qtype),
                 (b + "ffn_down_exps.weight", (e, d, f), qtype)]
    return plan + [("output_norm.weight", (d,), "F32"), ("output.weight", (s["vocab"], d), qtype)]


def write(path: Path, n_layers: int, qtype: str, seed: int = 0) -> None:
    import gguf

    from hardy.formats.gguf_io import open_gguf
    from hardy.formats.packaged import smollm2_gguf_path

    s = SHAPE
    fields = open_gguf(smollm2_gguf_path()).fields
    tokens, types = list(fields["tokenizer.ggml.tokens"]), list(fields["tokenizer.ggml.token_type"])
    pad = s["vocab"] - len(tokens)
    tokens += [f"<|reserved_{i}|>" for i in range(pad)]
    types += [3] * pad
    tmp = path.with_suffix(".part")
    w = gguf.GGUFWriter(str(tmp), "qwen3moe")
    w.add_name(f"qwen3-30b-a3b-shaped-{n_layers}l-random-{qtype}")
    w.add_context_length(40960)
    w.add_embedding_length(s["dim"])
    w.add_block_count(n_layers)
    w.add_feed_forward_length(6144)
    w.add_expert_feed_forward_length(s["expert_ffn"])
    w.add_expert_count(s["n_experts"])
    w.add_expert_used_count(s["top_k"])
    w.add_head_count(s["n_heads"])
    w.add_head_count_kv(s["n_kv_heads"])
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    w.add_rope_freq_base(s["rope_theta"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(s["vocab"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(fields.get("tokenizer.ggml.pre", "gpt-2"))
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(list(fields["tokenizer.ggml.merges"]))
    w.add_bos_token_id(int(fields["tokenizer.ggml.bos_token_id"]))
    w.add_eos_token_id(int(fields["tokenizer.ggml.eos_token_id"]))
    plan = tensor_plan(n_layers, qtype)
    for name, dims, t in plan:
        if t.startswith("F32"):
            w.add_tensor_info(name, dims, np.dtype(np.float32), int(np.prod(dims)) * 4)
        else:
            qt = gguf.GGMLQuantizationType[t]
            values, size = gguf.GGML_QUANT_SIZES[qt]
            byte_shape = (*dims[:-1], dims[-1] // values * size)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, dims, t in plan:  # one tensor in memory at a time
        if t == "F32":
            data = np.ones(dims, np.float32)
        elif t == "F32R":  # a router: random scores, so tokens spread over the experts as trained ones do
            data = rng.standard_normal(dims, dtype=np.float32) * 0.05
        else:
            rows = int(np.prod(dims[:-1]))
            data = random_blocks(rng, rows, dims[-1], t).reshape(*dims[:-1], -1)
        w.write_tensor_data(data)
    w.close()
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--type", default="Q4_0", choices=("Q4_0", "Q8_0"))
    args = ap.parse_args()
    write(Path(args.out), args.layers, args.type)
    print(f"wrote {args.out} ({Path(args.out).stat().st_size / 2 ** 30:.2f} GiB)")


if __name__ == "__main__":
    main()
