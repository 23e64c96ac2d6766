"""`hardy plan compare`: one training or serving workload over several hardware entries — the
"GPU cluster or CPU servers?" answer as a table and a plot."""
from __future__ import annotations

from dataclasses import dataclass, replace

from hardy.errors import HardyError
from hardy.plan.arch import load_arch
from hardy.plan.report import _pyplot, fmt_bytes, fmt_time
from hardy.plan.serve import plan_serve
from hardy.plan.train import search


@dataclass
class Comparison:
    headers: list[str]
    rows: list[list]  # the table's cells, a row per hardware entry
    records: list[dict]  # the same, unformatted (--json, the figure)


def compare_train(base, hws) -> Comparison:
    """The best configuration of `base` (a TrainJob) on each hardware entry; hardware without fast
    16-bit matmul is planned in fp32."""
    headers = ["hardware", "devices", "precision", "best configuration", "memory/device", "headroom", "step", "MFU",
               "goodput", "time to train", "cost"]
    rows, records = [], []
    for hw in hws:
        precision = base.precision if base.precision in hw.peak_flops and hw.fast_bf16 else "fp32"
        job = replace(base, hw=hw, precision=precision)
        plans, tried = search(job, "time", limit=1)
        if not plans:
            rows.append([hw.name, base.devices, precision, f"does not fit ({tried} configurations tried)"] + ["-"] * 7)
            records.append({"hardware": hw.name, "fits": False})
            continue
        p = plans[0]
        head = 1 - p.peak_memory / hw.memory_bytes
        rows.append([hw.name, base.devices, precision, p.label, fmt_bytes(p.peak_memory), f"{100 * head:.0f}%",
                     fmt_time(p.step_s), f"{100 * p.mfu:.1f}%", f"{100 * p.reliability['goodput']:.1f}%",
                     fmt_time(p.effective_time_s) if job.tokens else "-",
                     "-" if p.cost is None else f"${p.cost:,.0f}"])
        records.append({"hardware": hw.name, "fits": True, "configuration": p.label,
                        "memory_per_device": p.peak_memory, "headroom": head, "step_s": p.step_s, "mfu": p.mfu,
                        "goodput": p.reliability["goodput"], "time_s": p.effective_time_s if job.tokens else None,
                        "tokens_per_s": p.tokens_per_s, "cost_usd": p.cost})
    return Comparison(headers, rows, records)


def compare_serve(args, hws) -> Comparison:
    model = load_arch(args.model).model_config()
    headers = ["hardware", "devices", "quant", "memory/device", "headroom", "max batch", "TTFT", "decode tok/s/seq",
               "tok/s (max batch)", "$/M tokens"]
    rows, records = [], []
    for hw in hws:
        try:
            s = plan_serve(model, hw, devices=args.devices, quant=args.quant, context=args.context,
                           output_tokens=args.output_tokens, batch=args.batch)
        except HardyError as e:
            rows.append([hw.name, args.devices, args.quant, f"n/a: {e}"] + ["-"] * 6)
            records.append({"hardware": hw.name, "fits": False, "reason": str(e)})
            continue
        head = 1 - s.memory_per_device / (hw.memory_bytes)
        cost = s.max_batch_cost_per_million_tokens
        rows.append([hw.name, args.devices, args.quant, fmt_bytes(s.memory_per_device), f"{100 * head:.0f}%",
                     s.max_batch, fmt_time(s.prefill_s), f"{s.decode_tokens_per_s:,.1f}",
                     f"{s.max_batch_throughput_tokens_per_s:,.0f}", "-" if cost is None else f"${cost:,.3f}"])
        records.append({"hardware": hw.name, "fits": True, "memory_per_device": s.memory_per_device, "headroom": head,
                        "max_batch": s.max_batch, "ttft_s": s.prefill_s, "decode_tokens_per_s": s.decode_tokens_per_s,
                        "throughput_tokens_per_s": s.max_batch_throughput_tokens_per_s, "cost_per_million": cost})
    return Comparison(headers, rows, records)


def compare_figure(records: list[dict], workload: str):
    plt = _pyplot()
    ok = [r for r in records if r.get("fits")]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if workload == "train":
        xs = [r["time_s"] / 3600 if r["time_s"] else r["step_s"] for r in ok]
        ys = [r["cost_usd"] if r["cost_usd"] is not None else float("nan") for r in ok]
        ax.set_xlabel("time to train (h)" if ok and ok[0]["time_s"] else "step time (s)")
        ax.set_ylabel("cost (USD)")
    else:
        xs = [r["throughput_tokens_per_s"] for r in ok]
        ys = [r["cost_per_million"] if r["cost_per_million"] is not None else float("nan") for r in ok]
        ax.set_xlabel("output tokens/s at the largest batch")
        ax.set_ylabel("USD per million output tokens")
    ax.scatter(xs, ys)
    for x, y, r in zip(xs, ys, ok):
        ax.annotate(r["hardware"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.set_title(f"hardy plan compare {workload}")
    fig.tight_layout()
    return fig
