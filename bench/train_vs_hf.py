"""Training throughput and peak memory: `hardy train` vs a plain PyTorch loop over transformers.

Both sides train the same architecture (random init), on the same packed batches of the same
tokens, with AdamW, fp32, the same batch and thread count. Each run is a fresh subprocess so peak
memory (peak RSS minus RSS after imports, as `hardy train` reports it) is not polluted by the
other; runs alternate hardy / transformers. Tokens/s is the median over the steps after warm-up.

    .venv/bin/python bench/train_vs_hf.py --shape tiny --steps 30
    .venv/bin/python bench/train_vs_hf.py --shape smollm2-135m --steps 6 --micro-batch 4
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WARMUP = 2

HF_LOOP = r'''
import json, resource, statistics, sys, time
import psutil, torch, torch.nn.functional as F, transformers
from hardy.data.loader import PackedLoader
from hardy.data.prepare import load_split
from hardy.formats.hf import hf_config
from hardy.model.config import ModelConfig

args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
torch.manual_seed(0)
baseline = psutil.Process().memory_info().rss
cfg = ModelConfig.from_dict(args["model"])
hf_cfg = transformers.LlamaConfig(**{k: v for k, v in hf_config(cfg, None, None).items()
                                     if k not in ("architectures", "torch_dtype", "hardy_preset")})
model = transformers.LlamaForCausalLM(hf_cfg).train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
loader = PackedLoader(load_split(args["data"], "train"), args["seq_len"], args["micro_batch"], seed=0)
times, losses = [], []
for step in range(args["steps"]):
    x, y = loader.next_batch()
    t0 = time.perf_counter()
    logits = model(input_ids=x).logits
    loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - t0)
    losses.append(loss.item())
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline
tokens = args["micro_batch"] * args["seq_len"]
print(json.dumps({"tokens_per_s": tokens / statistics.median(times[%d:]), "peak_mem_bytes": peak, "loss": losses}))
''' % WARMUP


def prepare(shape: str, root: Path) -> Path:
    out = root / f"data-{shape}"
    if not (out / "index.json").exists():
        tokenizer = "smollm2" if shape == "smollm2-135m" else "bpe:8192"
        corpus = "wikitext2-valid" if shape == "smollm2-135m" else "tinyshakespeare"
        subprocess.run([sys.executable, "-m", "hardy", "data", "prepare", "--input", corpus, "--tokenizer", tokenizer,
                        "--out", str(out)], check=True, capture_output=True)
    return out


def run_hardy(shape, data, args, root, ac: str, compile: bool = False) -> dict:
    run_dir = Path(tempfile.mkdtemp(dir=root))
    sets = [f"model.preset={shape}", f"data.path={data}", f"data.seq_len={args.seq_len}",
            f"train.micro_batch={args.micro_batch}", f"train.steps={args.steps}", f"train.threads={args.threads}",
            f"train.activation_checkpoint={ac}", f"train.compile={str(compile).lower()}", "checkpoint.at_end=false", "log.progress=false",
            "optim.lr=1e-4", "optim.warmup_steps=0", "train.deterministic=false"]
    cmd = [sys.executable, "-m", "hardy", "train", "--run-dir", str(run_dir)]
    for s in sets:
        cmd += ["--set", s]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    subprocess.run(cmd, check=True, capture_output=True, env=env, cwd=REPO)
    steps = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s["event"] == "step"]
    resolved = json.loads((run_dir / "config.json").read_text())["resolved"]["model"]
    return {"tokens_per_s": statistics.median(s["tokens_per_s"] for s in steps[WARMUP:]),
            "peak_mem_bytes": steps[-1]["peak_mem_bytes"], "loss": [s["loss"] for s in steps],
            "mfu": statistics.median(s["mfu"] for s in steps[WARMUP:]), "model": resolved}


def run_hf(model_cfg: dict, data: Path, args) -> dict:
    payload = json.dumps({"model": model_cfg, "data": str(data), "seq_len": args.seq_len,
                          "micro_batch": args.micro_batch, "steps": args.steps, "threads": args.threads})
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    proc = subprocess.run([sys.executable, "-c", HF_LOOP, payload], check=True, capture_output=True, text=True,
                          env=env, cwd=REPO)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="tiny", choices=["tiny", "smollm2-135m"])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--compile", action="store_true", help="also run hardy with train.compile = true")
    args = ap.parse_args()
    root = Path(args.workdir or tempfile.mkdtemp(prefix="hardy-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    data = prepare(args.shape, root)
    results = {"hardy": [], "hardy (AC full)": [], "transformers": []}
    for _ in range(args.repeats):
        h = run_hardy(args.shape, data, args, root, "none")
        results["hardy"].append(h)
        results["transformers"].append(run_hf(h["model"], data, args))
        results["hardy (AC full)"].append(run_hardy(args.shape, data, args, root, "full"))
        if args.compile:
            results.setdefault("hardy (compiled)", []).append(run_hardy(args.shape, data, args, root, "none", True))
    print(f"{args.shape}: batch {args.micro_batch} x {args.seq_len}, fp32, {args.threads} threads, {args.steps} steps "
          f"(median after {WARMUP} warm-up), {args.repeats} repeat(s)")
    base = results["transformers"]
    base_tps = statistics.median(r["tokens_per_s"] for r in base)
    base_mem = statistics.median(r["peak_mem_bytes"] for r in base)
    print(f"  {'':<18} {'tokens/s':>9} {'ratio':>6} {'peak MiB':>9} {'ratio':>6} {'MFU':>6}")
    for name, rs in results.items():
        tps = statistics.median(r["tokens_per_s"] for r in rs)
        mem = statistics.median(r["peak_mem_bytes"] for r in rs)
        mfu = f"{100 * statistics.median(r['mfu'] for r in rs):5.1f}%" if "mfu" in rs[0] else "     -"
        print(f"  {name:<18} {tps:9.1f} {tps / base_tps:5.2f}x {mem / 2**20:9.1f} {mem / base_mem:5.2f}x {mfu}")
    print(f"  first-step loss hardy {results['hardy'][0]['loss'][0]:.4f} vs transformers {base[0]['loss'][0]:.4f} "
          f"(same architecture, independent random init)")


if __name__ == "__main__":
    main()
