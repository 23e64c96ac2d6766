"""Compressing a real-size model on this machine: a Llama-3.1-8B-shaped Hugging Face directory with
random bf16 weights is written straight to disk, tensor by tensor (hardy.formats.lazy_weights:
never more than one tensor in memory; 16 GB of safetensors), then `hardy compress --quant gptq
--bits 4 --group-size 128` runs on it in its own process, streaming one block at a time from disk.
Reports the compression's peak RSS (VmHWM, polled), its time, and the output's size.

    .venv/bin/python bench/big_compress.py --dir /tmp/big --calib-samples 4 --calib-seq 256

The tokenizer is SmolLM2's (its 49,152 ids fit the 128,256-row embedding); calibration text is the
bundled WikiText-2 validation split.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from big_cpu_model import SHAPES  # noqa: E402  (the same shapes as the GGUF bench)
from tp_memory import run  # noqa: E402  (peak RSS of a command's processes)

LAYER = {"attention.wq": "q", "attention.wk": "kv", "attention.wv": "kv", "attention.wo": "o",
         "feed_forward.w1": "ffn", "feed_forward.w3": "ffn", "feed_forward.w2": "down"}


def write_hf_dir(out: Path, shape_name: str, seed: int = 0, layers: int | None = None) -> None:
    from hardy.formats.hf import hf_config
    from hardy.formats.lazy_weights import write_safetensors
    from hardy.loading.load import load_model
    from hardy.formats.names import to_format
    from hardy.model.config import ModelConfig

    s = SHAPES[shape_name]
    cfg = ModelConfig(vocab_size=s["vocab"], dim=s["dim"], n_layers=layers or s["n_layers"], n_heads=s["n_heads"],
                      n_kv_heads=s["n_kv_heads"], ffn_dim=s["ffn_dim"], rope_theta=s["rope_theta"],
                      max_seq_len=8192, tie_embeddings=False, name=shape_name)
    d, hd = cfg.dim, cfg.d_head
    rows = {"q": (cfg.n_heads * hd, d), "kv": (cfg.n_kv_heads * hd, d), "o": (d, cfg.n_heads * hd),
            "ffn": (cfg.ffn_dim, d), "down": (d, cfg.ffn_dim)}
    shapes = {"tok_embeddings.weight": (cfg.vocab_size, d), "norm.weight": (d,), "output.weight": (cfg.vocab_size, d)}
    for i in range(cfg.n_layers):
        shapes[f"layers.{i}.attention_norm.weight"] = (d,)
        shapes[f"layers.{i}.ffn_norm.weight"] = (d,)
        for name, kind in LAYER.items():
            shapes[f"layers.{i}.{name}.weight"] = rows[kind]
    gen = torch.Generator().manual_seed(seed)
    hf = {to_format(name, "hf"): name for name in shapes}

    def make(key: str) -> torch.Tensor:
        shape = shapes[hf[key]]
        if len(shape) == 1:
            return torch.ones(shape, dtype=torch.bfloat16)
        return (torch.randn(shape, generator=gen) * 0.02).bfloat16()

    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / "model.safetensors", [(k, torch.bfloat16, shapes[v]) for k, v in hf.items()], make,
                      metadata={"format": "pt"})
    tokenizer = load_model("smollm2-135m").tokenizer
    tokenizer.save_hf(out)
    (out / "config.json").write_text(json.dumps(hf_config(cfg, tokenizer.bos_id, tokenizer.eos_id, "bfloat16"),
                                                indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--dir", default="/tmp/hardy-big")
    ap.add_argument("--quant", default="gptq")
    ap.add_argument("--group-size", default="128")
    ap.add_argument("--calib-samples", default="4")
    ap.add_argument("--calib-seq", default="256")
    ap.add_argument("--threads", default="2")
    ap.add_argument("--layers", type=int, default=None,
                    help="blocks (default: the shape's): the shape's widths at another depth, to see whether the peak grows with it")
    args = ap.parse_args()
    name = args.shape + (f"-{args.layers}layers" if args.layers else "")
    src = Path(args.dir) / f"{name}-bf16"
    if not (src / "config.json").exists():
        t0 = time.perf_counter()
        write_hf_dir(src, args.shape, layers=args.layers)
        size = sum(f.stat().st_size for f in src.iterdir())
        print(f"wrote {src} ({size / 1e9:.2f} GB) in {time.perf_counter() - t0:.0f} s", flush=True)
    out = Path(args.dir) / f"{name}-{args.quant}-int4-g{args.group_size}"
    if out.exists():
        import shutil

        shutil.rmtree(out)
    cmd = [sys.executable, "-m", "hardy", "compress", "--model", str(src), "--out", str(out), "--quant", args.quant,
           "--bits", "4", "--group-size", args.group_size, "--calib-data", "wikitext2-valid", "--calib-samples",
           args.calib_samples, "--calib-seq", args.calib_seq, "--threads", args.threads, "--no-progress"]
    print("$", " ".join(cmd[2:]), flush=True)
    t0 = time.perf_counter()
    peaks, stdout, _ = run(cmd)
    seconds = time.perf_counter() - t0
    peak = max(peaks.values())
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"compress: {seconds / 60:.1f} min, peak RSS {peak / 2 ** 30:.2f} GiB ({peak / 1e9:.2f} GB), output "
          f"{size / 1e9:.2f} GB", flush=True)
    print(stdout.strip(), flush=True)


if __name__ == "__main__":
    main()
