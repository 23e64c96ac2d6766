"""hardy export: write a model in another format."""
from __future__ import annotations

from hardy.cli.common import DTYPES


def register(sub) -> None:
    p = sub.add_parser("export", help="export a model (safetensors in Hugging Face layout)")
    p.add_argument("--model", required=True, help="smollm2-135m, a .gguf file, or a model directory")
    p.add_argument("--format", required=True, choices=["safetensors"])
    p.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="dtype of the written weights")
    p.set_defaults(func=run)


def run(args) -> int:
    from hardy.formats.hf import save_hf_dir
    from hardy.formats.load import load_model

    loaded = load_model(args.model)
    out = save_hf_dir(loaded.config, loaded.model.state_dict(), loaded.tokenizer, args.out, dtype=DTYPES[args.dtype])
    print(f"wrote {out} (model.safetensors, config.json, tokenizer files)")
    return 0
