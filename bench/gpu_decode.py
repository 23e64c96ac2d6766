"""Decode speed of a float model on one device, eager and compiled (on CUDA: a CUDA graph per step),
and whether its greedy tokens equal the CPU's.

Batch 1, greedy, a fixed prompt; the median of `--repeats` generations after a warm-up one. The CPU
reference generation runs once in the same process. Writes a JSON file.

    python bench/gpu_decode.py --model smollm2-135m --device cuda --out gpu_decode.json
    python bench/gpu_decode.py --model smollm2-135m --device cpu --new-tokens 16 --out d.json   # CPU rehearsal
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

PROMPT = "The history of large-scale machine learning shows that"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--check-tokens", type=int, default=32, help="greedy tokens compared with the CPU's")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from hardy.devices import resolve_device
    from hardy.loading.load import load_model
    from hardy.infer.generate import SamplingConfig, generate

    device = resolve_device(args.device)
    loaded = load_model(args.model, device=device)
    prompt = loaded.tokenizer.encode(PROMPT)
    result = {"model": args.model, "device": str(device), "prompt_tokens": len(prompt), "new_tokens": args.new_tokens,
              "torch": torch.__version__}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)

    def speed(compile_step: bool) -> dict:
        sampling = SamplingConfig(max_new_tokens=args.new_tokens)
        first = generate(loaded.model, prompt, sampling, compile=compile_step)  # warm-up (and the compile)
        runs = [generate(loaded.model, prompt, sampling, compile=compile_step) for _ in range(args.repeats)]
        return {"decode_tps": statistics.median(r.stats.decode_tps for r in runs),
                "prefill_tps": statistics.median(r.stats.prefill_tps for r in runs),
                "compile_s": first.stats.compile_s, "tokens": runs[0].tokens}

    result["eager"] = speed(False)
    print(f"{args.model} on {device}: eager decode {result['eager']['decode_tps']:,.1f} tokens/s", flush=True)
    if not args.no_compile:
        result["compiled"] = speed(True)
        print(f"  compiled decode {result['compiled']['decode_tps']:,.1f} tokens/s "
              f"(compile {result['compiled']['compile_s']:.1f} s)", flush=True)
    n = args.check_tokens
    cpu = load_model(args.model, device="cpu")
    reference = generate(cpu.model, prompt, SamplingConfig(max_new_tokens=n)).tokens
    result["cpu_tokens"] = reference
    result["greedy_equal_cpu"] = result["eager"]["tokens"][:n] == reference
    if "compiled" in result:
        result["compiled_equal_eager"] = result["compiled"]["tokens"] == result["eager"]["tokens"]
    print(f"  first {n} greedy tokens equal the CPU's: {result['greedy_equal_cpu']}", flush=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 0 if result["greedy_equal_cpu"] else 1


if __name__ == "__main__":
    sys.exit(main())
