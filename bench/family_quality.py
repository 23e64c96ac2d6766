"""Quality of a GGUF model in hardy against llama.cpp's own `llama-perplexity` on the same file: WikiText-2
test perplexity under llama.cpp's protocol (ctx 512, the second half of each window scored), both runtimes
on the same text, and the relative difference (the issue-37 goal: within 0.5%).

    python bench/family_quality.py --model gemma3-270m                 # the whole test text (~2 x 25 min)
    python bench/family_quality.py --model gemma3-270m --chunks 20     # the first 20 windows

Perplexity does not depend on timing, so this can run beside other work.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from native import LLAMA_CPP, llama_perplexity  # noqa: E402

TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext2-test.txt"


def hardy_perplexity(model: str, text: Path, ctx: int, threads: int, chunks: int | None) -> tuple[float, float]:
    cmd = [sys.executable, "-m", "hardy", "eval", "perplexity", "--model", model, "--data", str(text), "--ctx", str(ctx),
           "--threads", str(threads)] + (["--max-tokens", str(chunks * ctx)] if chunks else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    m = re.search(r"PPL = ([0-9.]+) \+/- ([0-9.]+)", out.stdout)
    return float(m.group(1)), float(m.group(2))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunks", type=int, default=None, help="only the first N windows (default: all)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from hardy.loading.load import resolve_source

    _, path = resolve_source(args.model)
    theirs = llama_perplexity(path, TEXT, args.ctx, args.threads, args.chunks)
    ours = hardy_perplexity(args.model, TEXT, args.ctx, args.threads, args.chunks)
    diff = ours[0] / theirs[0] - 1
    print(f"{args.model} ({path.name}), WikiText-2 test, ctx {args.ctx}, {args.chunks or 'all'} windows; {LLAMA_CPP}")
    print(f"| runtime | PPL |\n|---|---|\n| llama.cpp llama-perplexity | {theirs[0]:.4f} ± {theirs[1]:.4f} |")
    print(f"| hardy eval perplexity --protocol llama.cpp | {ours[0]:.4f} ± {ours[1]:.4f} |")
    print(f"hardy / llama.cpp - 1 = {100 * diff:+.2f}%")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "llama_cpp": theirs, "hardy": ours,
                                               "relative": diff, "chunks": args.chunks, "ctx": args.ctx}, indent=1))


if __name__ == "__main__":
    main()
