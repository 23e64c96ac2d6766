"""hardy export: write a model in another format."""
from __future__ import annotations

from hardy.compress.qlinear import quantized_modules
from hardy.devices import DTYPES
from hardy.errors import HardyError
from hardy.formats.hf import save_hf_dir
from hardy.loading.load import load_model


def register(sub) -> None:
    p = sub.add_parser("export", help="export a model: safetensors (Hugging Face layout) or GGUF (llama.cpp)")
    p.add_argument("--model", required=True, help="smollm2-135m, a .gguf file, or a model directory")
    p.add_argument("--format", required=True, choices=["safetensors", "gguf"])
    p.add_argument("--out", required=True, help="output directory (safetensors) or .gguf file (must not exist)")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="safetensors: dtype of the written weights")
    p.add_argument("--type", default="F32", choices=["F32", "F16", "Q8_0", "Q5_0", "Q4_0", "Q4_1"],
                   help="gguf: tensor type (hardy int4 g32 / int8 g32 weights are repacked as Q4_1 / Q8_0 losslessly)")
    p.set_defaults(func=run)


def run(args) -> int:
    loaded = load_model(args.model)
    if args.format == "gguf":
        from hardy.formats.gguf_export import export_gguf

        counts = export_gguf(loaded.model, loaded.config, loaded.tokenizer, args.out, args.type)
        print(f"wrote {args.out} ({args.type}: {counts['repacked']} tensors repacked from hardy's quantized "
              f"weights, {counts['requantized']} quantized, {counts['float']} float)")
        return 0

    if quantized_modules(loaded.model):
        raise HardyError(f"{args.model} is quantized: export it as GGUF, or compress its float original")
    out = save_hf_dir(loaded.config, loaded.model.state_dict(), loaded.tokenizer, args.out, dtype=DTYPES[args.dtype])
    print(f"wrote {out} (model.safetensors, config.json, tokenizer files)")
    return 0
