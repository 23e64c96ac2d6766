"""The coefficients of the planner's `--compile` elementwise count (hardy.plan.timing.
LLAMA_COMPILED_LAYER_ELEMENTS): what inductor's fused kernels move in one compiled forward + backward of a
hardy Llama block, by inductor's own per-kernel count, at seven shapes, and the least-squares fit of
elements per token over (dim, ffn, q, kv) — beside the eager count of the same blocks.

    .venv/bin/python bench/compiled_traffic.py

A count, not a timing: the same on any machine with the same torch.
"""
from __future__ import annotations

import numpy as np
import torch

from hardy.model.config import ModelConfig
from hardy.model.transformer import Rotary, TransformerBlock, rope_tables
from hardy.ops.compiled_traffic import compiled_layer_traffic
from hardy.ops.kernel_probe import layer_traffic

# (dim, ffn, heads, kv heads, head dim): unequal ratios so that every coefficient is exercised
SHAPES = [(64, 176, 4, 2, 16), (96, 640, 3, 1, 64), (192, 384, 2, 1, 32), (128, 256, 4, 4, 32),
          (256, 512, 8, 2, 32), (64, 512, 1, 1, 64), (160, 160, 5, 5, 32)]
BATCH, SEQ = 2, 64


def main() -> None:
    rows, compiled, eager = [], [], []
    print(f"{'shape (dim, ffn, heads, kv, hd)':<32} {'compiled el/token':>18} {'eager el/token':>15} {'kernels':>8} "
          f"{'eager ops':>9}")
    for dim, ffn, heads, kv, hd in SHAPES:
        cfg = ModelConfig(vocab_size=512, dim=dim, n_layers=1, n_heads=heads, n_kv_heads=kv, ffn_dim=ffn,
                          head_dim=hd, max_seq_len=SEQ, tie_embeddings=True, name="t")
        torch.manual_seed(0)
        block, x = TransformerBlock(cfg), torch.randn(BATCH, SEQ, dim)
        rope = Rotary.shared(*rope_tables(cfg, SEQ))
        fused, plain = compiled_layer_traffic(block, x, rope), layer_traffic(block, x, rope)
        tokens = BATCH * SEQ
        rows.append([dim, ffn, heads * hd, kv * hd])
        compiled.append(fused.bytes / 4 / tokens)
        eager.append(plain.bytes / 4 / tokens)
        print(f"{str((dim, ffn, heads, kv, hd)):<32} {compiled[-1]:>18,.1f} {eager[-1]:>15,.1f} {fused.kernels:>8} "
              f"{plain.ops:>9}")
    a, y = np.array(rows, dtype=float), np.array(compiled)
    coef = np.linalg.lstsq(a, y, rcond=None)[0]
    worst = float(np.max(np.abs(a @ coef - y) / y))
    print("fit, elements per token: " + " + ".join(f"{c:.2f}·{n}" for c, n in zip(coef, ("h", "f", "q", "kv")))
          + f"  (worst shape {100 * worst:.1f}% off)")


if __name__ == "__main__":
    main()
