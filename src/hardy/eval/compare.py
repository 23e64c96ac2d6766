"""`hardy eval compare`: models side by side against the first (the reference) — perplexity, KL
divergence and top-1 agreement of next-token distributions at the same scored positions, size on
disk, peak RSS, prefill and decode tokens/s — as a table, JSON and a Pareto plot.

Quality runs in one pass over the chunks with every model loaded, so the reference's logits are
computed once; speed and memory are measured per model in a fresh subprocess (`python -m
hardy.eval.compare --measure SPEC`) so that one model's allocations never show in another's RSS.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from hardy.devices import compute_device
from hardy.errors import HardyError
from hardy.eval.perplexity import chunk_batches, paired_difference, plan_chunks, summarize
from hardy.fsio import atomic_file
from hardy.infer.generate import SamplingConfig, generate
from hardy.loading.load import config_for, load_model, resolve_source, set_threads
from hardy.model.config import count_parameters
from hardy.ops.memory import peak_rss_bytes


@dataclass
class CompareRow:
    model: str
    ppl: float
    ppl_se: float
    kl: float  # mean KL(reference ‖ model) per scored token, nats
    top1: float  # share of scored positions where the argmax agrees with the reference's
    size_bytes: int
    # Δ mean NLL vs the reference over the same chunks / its standard error: |z| < 2 is within the
    # chunk-to-chunk noise of this text (the reference's own row: 0)
    ppl_z: float = 0.0
    peak_rss_bytes: int | None = None
    prefill_tps: float | None = None
    decode_tps: float | None = None


def size_on_disk(spec: str) -> int:
    kind, path = resolve_source(spec)
    if kind == "run":  # a training checkpoint also holds optimizer state: count the fp32 weights it exports

        return 4 * count_parameters(config_for(spec)).total
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size


@torch.inference_mode()
def quality(models: list, tokens: list[int], ctx: int, protocol: str, bos_id: int | None, add_bos: bool,
            batch_size: int = 1, progress: bool = False) -> list[dict]:
    """Per model: ppl, se, and KL / top-1 agreement against models[0], on the same positions; the
    perplexity difference to models[0] as a paired z over chunks; each chunk's mean NLL (`chunk_nll`,
    for pairing any two of the models)."""
    chunks = plan_chunks(len(tokens), ctx, protocol)
    nlls = [[] for _ in models]
    per_chunk = [[] for _ in models]  # each chunk's mean NLL, for the paired difference
    kl_sum = [0.0] * len(models)
    agree = [0] * len(models)
    scored = 0
    bar = None
    if progress:
        bar = tqdm(total=len(chunks), unit="chunk", desc="compare", dynamic_ncols=True)
    for group, batch in chunk_batches(chunks, tokens, batch_size, protocol, bos_id, add_bos):
        first, last = group[0].first_scored, group[0].last_scored
        ref_logp = None
        for m, model in enumerate(models):
            device = compute_device(model)  # each model where it was loaded; compared on the reference's
            hidden = model.hidden_states(batch.to(device))[:, first:last + 1]
            logp = F.log_softmax(model.logits(hidden).float().flatten(0, 1), dim=-1)
            if m == 0:
                targets = batch[:, first + 1:last + 2].flatten().to(logp.device)
            else:
                logp = logp.to(ref_logp.device)
            nlls[m].append(-logp.gather(1, targets[:, None])[:, 0].cpu())
            per_chunk[m].extend(nlls[m][-1].view(len(group), -1).double().mean(-1).tolist())
            if m == 0:
                ref_logp = logp
            else:
                kl_sum[m] += float((ref_logp.exp() * (ref_logp - logp)).sum())
                agree[m] += int((ref_logp.argmax(-1) == logp.argmax(-1)).sum())
        scored += targets.numel()
        if bar is not None:
            bar.update(len(group))
    if bar is not None:
        bar.close()
    out = []
    for m in range(len(models)):
        ppl, se, _ = summarize(torch.cat(nlls[m]))
        out.append({"ppl": ppl, "ppl_se": se, "kl": kl_sum[m] / scored if m else 0.0,
                    "top1": agree[m] / scored if m else 1.0,
                    "ppl_z": paired_difference(per_chunk[0], per_chunk[m]).z if m else 0.0,
                    "chunk_nll": tuple(per_chunk[m])})
    return out


def measure_speed(spec: str, threads: int | None, prompt_tokens: int, new_tokens: int, timeout: float = 1800,
                  device: str = "cpu") -> dict:
    """Prefill / decode tokens/s and peak RSS of one model, in a fresh interpreter."""
    cmd = [sys.executable, "-m", "hardy.eval.compare", "--measure", spec, str(threads or 0), str(prompt_tokens),
           str(new_tokens), device]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        raise HardyError(f"speed measurement of {spec} failed: {tail[0]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _measure_main(spec: str, threads: int, prompt_tokens: int, new_tokens: int, device: str) -> None:
    set_threads(threads or None)
    loaded = load_model(spec, device=device)
    vocab = loaded.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (prompt_tokens,), generator=gen).tolist()
    sampling = SamplingConfig(max_new_tokens=new_tokens)
    generate(loaded.model, prompt[:16], SamplingConfig(max_new_tokens=4))  # warm-up
    best = None
    for _ in range(3):
        stats = generate(loaded.model, prompt, sampling).stats
        if best is None or stats.decode_tps > best.decode_tps:
            best = stats
    print(json.dumps({"prefill_tps": best.prefill_tps, "decode_tps": best.decode_tps,
                      "peak_rss_bytes": peak_rss_bytes(), "threads": torch.get_num_threads()}))


def pareto(rows: list[CompareRow], x_key: str, smaller_x_better: bool) -> list[str]:
    """Models not dominated on (ppl, x)."""
    front = []
    for r in rows:
        rx = getattr(r, x_key)
        if rx is None:
            continue
        dominated = any(o is not r and getattr(o, x_key) is not None and o.ppl <= r.ppl and (
            getattr(o, x_key) <= rx if smaller_x_better else getattr(o, x_key) >= rx) and (
            o.ppl < r.ppl or getattr(o, x_key) != rx) for o in rows)
        if not dominated:
            front.append(r.model)
    return front


def plot(rows: list[CompareRow], out: Path, title: str) -> None:
    import matplotlib  # start-up: matplotlib loads only when a plot is drawn

    matplotlib.use("Agg")  # files only: no display
    import matplotlib.pyplot as plt  # order: after use("Agg")

    panels = [("size_bytes", "size on disk (MB)", 1e6, True)]
    if any(r.decode_tps for r in rows):
        panels.append(("decode_tps", "decode tokens/s (batch 1)", 1.0, False))
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (key, label, unit, smaller) in zip(axes[0], panels):
        front = set(pareto(rows, key, smaller))
        for r in rows:
            x = getattr(r, key)
            if x is None:
                continue
            ax.scatter(x / unit, r.ppl, color="tab:red" if r.model in front else "tab:blue", zorder=3)
            ax.annotate(Path(r.model).name, (x / unit, r.ppl), fontsize=7, xytext=(4, 2), textcoords="offset points")
        pts = sorted((getattr(r, key) / unit, r.ppl) for r in rows if r.model in front)
        if len(pts) > 1:
            ax.plot(*zip(*pts), color="tab:red", linewidth=1, zorder=2, label="Pareto front")
            ax.legend(fontsize=8)
        ax.set_xlabel(label)
        ax.set_ylabel("perplexity")
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    with atomic_file(out, durable=False) as f:
        fig.savefig(f, dpi=120, format="png")
    plt.close(fig)


def format_table(rows: list[CompareRow]) -> str:
    header = ["model", "PPL", "±", "z vs ref", "KL (nats)", "top-1", "size MB", "peak RSS MB", "prefill tok/s",
              "decode tok/s"]

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    lines = [header]
    for r in rows:
        lines.append([r.model, f"{r.ppl:.4f}", f"{r.ppl_se:.4f}", f"{r.ppl_z:+.1f}", f(r.kl, ".5f"),
                      f(100 * r.top1, ".2f") + "%",
                      f"{r.size_bytes / 1e6:.1f}", f(r.peak_rss_bytes and r.peak_rss_bytes / 2 ** 20, ".0f"),
                      f(r.prefill_tps, ".1f"), f(r.decode_tps, ".1f")])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
                     for line in lines)


def rows_to_json(rows: list[CompareRow]) -> list[dict]:
    return [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(r).items()}
            for r in rows]


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "--measure":
        _measure_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    else:
        print("usage: python -m hardy.eval.compare --measure SPEC THREADS PROMPT_TOKENS NEW_TOKENS DEVICE", file=sys.stderr)
        sys.exit(2)
