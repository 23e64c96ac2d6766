"""hardy info: a model's configuration and parameter count, without loading its weights."""
from __future__ import annotations

import json

from hardy.loading.load import config_for
from hardy.model.config import count_parameters


def register(sub) -> None:
    p = sub.add_parser("info", help="show a model's config and parameter count (presets need no weights)")
    p.add_argument("--model", required=True, help="a preset (micro, tiny, smollm2-135m, llama3.1-8b, ...), "
                                                  "a .gguf file or a model directory")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def run(args) -> int:
    cfg = config_for(args.model)
    counts = count_parameters(cfg)
    if args.json:
        print(json.dumps({"config": cfg.to_dict(), "parameters": counts.total,
                          "non_embedding": counts.non_embedding}))
        return 0
    print(f"model {cfg.name}: {counts.total:,} parameters ({counts.total / 1e9:.3f} B; "
          f"{counts.non_embedding:,} non-embedding)")
    rows = [("family", cfg.family), ("layers", cfg.n_layers), ("dim", cfg.dim), ("ffn_dim", cfg.ffn_dim),
            ("heads / kv heads / head dim", f"{cfg.n_heads} / {cfg.n_kv_heads} / {cfg.d_head}"),
            ("vocab", cfg.vocab_size), ("context", cfg.max_seq_len), ("rope theta", cfg.rope_theta),
            ("rope scaling", cfg.rope_scaling or "none"), ("tied embeddings", cfg.tie_embeddings)]
    rows += family_rows(cfg)
    for key, value in rows:
        print(f"  {key:<28} {value}")
    return 0


def family_rows(cfg) -> list[tuple[str, object]]:
    """The block options a family sets (only those that differ from a plain Llama block)."""
    rows = []
    if "sliding" in cfg.kinds:
        sliding = cfg.kinds.count("sliding")
        rows.append(("attention", f"{sliding} sliding (window {cfg.sliding_window}), {cfg.n_layers - sliding} full"))
    if cfg.rope_local_theta is not None:
        rows.append(("rope theta of sliding layers", cfg.rope_local_theta))
    options = [name for name, on in (("q/k/v bias", cfg.attn_bias), ("q/k norms", cfg.qk_norm),
                                     ("sandwich norms", cfg.sandwich_norms)) if on]
    if options:
        rows.append(("block", ", ".join(options)))
    if cfg.mlp_act != "silu":
        rows.append(("mlp activation", cfg.mlp_act))
    if cfg.embed_scale != 1.0:
        rows.append(("embedding scale", f"{cfg.embed_scale:.4g}"))
    if cfg.attn_scale is not None:
        rows.append(("query scale", f"{cfg.attn_scale:.6g}"))
    for name, cap in (("attention soft-cap", cfg.attn_softcap), ("logit soft-cap", cfg.logit_softcap)):
        if cap is not None:
            rows.append((name, cap))
    return rows
