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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from big_cpu_model import add_vocabulary, write_random_tensors  # noqa: E402

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

    s = SHAPE
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
    add_vocabulary(w, s["vocab"])
    write_random_tensors(w, tensor_plan(n_layers, qtype), seed)
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
