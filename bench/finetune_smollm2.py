"""Fine-tune SmolLM2-135M on WikiText-2 valid and compare WikiText-2 test perplexity before/after.

Every step is a `hardy` command, printed before it runs, so the numbers can be reproduced by hand:

    .venv/bin/python bench/finetune_smollm2.py --steps 30 --eval-tokens 16384
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def hardy(*args: str, capture: bool = False) -> str:
    cmd = [sys.executable, "-m", "hardy", *args]
    print("$ hardy " + " ".join(shlex.quote(a) for a in args), flush=True)
    proc = subprocess.run(cmd, cwd=REPO, text=True, capture_output=capture,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if proc.returncode:
        sys.exit(f"command failed ({proc.returncode}): {proc.stderr if capture else ''}")
    return proc.stdout if capture else ""


def ppl(model: str, tokens: int) -> dict:
    out = hardy("eval", "perplexity", "--model", model, "--data", "wikitext2-test", "--ctx", "512",
                "--max-tokens", str(tokens), "--batch", "4", "--json", "--no-progress", capture=True)
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--eval-tokens", type=int, default=16384, help="WikiText-2 test prefix to score")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    root = Path(args.workdir or tempfile.mkdtemp(prefix="hardy-finetune-"))
    data, run = root / "wikitext2-valid-smollm2", root / "run"
    if not (data / "index.json").exists():
        hardy("data", "prepare", "--input", "wikitext2-valid", "--tokenizer", "smollm2", "--out", str(data))
    before = ppl("smollm2-135m", args.eval_tokens)
    sets = ["model.init_from=smollm2-135m", f"data.path={data}", f"data.seq_len={args.seq_len}",
            f"train.micro_batch={args.micro_batch}", f"train.steps={args.steps}", f"optim.lr={args.lr}",
            "optim.warmup_steps=3", "optim.weight_decay=0.0", "train.threads=2", "log.every=5"]
    hardy("train", "--run-dir", str(run), *[a for s in sets for a in ("--set", s)])
    after = ppl(str(run), args.eval_tokens)
    print(f"\nWikiText-2 test, first {args.eval_tokens} tokens, llama.cpp protocol (ctx 512):")
    print(f"  SmolLM2-135M before fine-tuning: PPL {before['ppl']:.4f} +/- {before['se']:.4f}")
    print(f"  after {args.steps} steps on WikiText-2 valid ({args.steps * args.micro_batch * args.seq_len:,} tokens): "
          f"PPL {after['ppl']:.4f} +/- {after['se']:.4f}  ({100 * (after['ppl'] / before['ppl'] - 1):+.1f}%)")


if __name__ == "__main__":
    main()
