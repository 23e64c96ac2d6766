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
    rows = [("layers", cfg.n_layers), ("dim", cfg.dim), ("ffn_dim", cfg.ffn_dim),
            ("heads / kv heads / head dim", f"{cfg.n_heads} / {cfg.n_kv_heads} / {cfg.d_head}"),
            ("vocab", cfg.vocab_size), ("context", cfg.max_seq_len), ("rope theta", cfg.rope_theta),
            ("rope scaling", cfg.rope_scaling or "none"), ("tied embeddings", cfg.tie_embeddings)]
    for key, value in rows:
        print(f"  {key:<28} {value}")
    return 0
