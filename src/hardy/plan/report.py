"""Planner output: aligned terminal tables, and Markdown/HTML reports with matplotlib plots."""
from __future__ import annotations

import base64
import html
import io
from pathlib import Path

from hardy.errors import HardyError
from hardy.extras import require as require_extra
from hardy.fsio import write_bytes_atomic

MEMORY_PARTS = ("weights", "gradients", "optimizer", "activations", "buffers", "optimizer_temporaries", "runtime")


def fmt_bytes(n: float) -> str:
    return f"{n / 1e9:,.2f} GB" if n >= 1e8 else f"{n / 2 ** 20:,.1f} MiB"


def fmt_time(s: float) -> str:
    if s != s or s == float("inf"):
        return "n/a"
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
        if s >= 2 * size:
            return f"{s / size:,.1f} {unit}"
    return f"{s:,.3g} s"


def table(headers: list[str], rows: list[list], align_right: bool = True) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for k, r in enumerate(cells):
        parts = [c.ljust(w) if i == 0 or not align_right else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(parts).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(headers: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


SCHEDULES = {"1f1b": "1F1B", "interleaved": "interleaved 1F1B", "zb-h1": "ZB-H1"}


# the losses other than hardy's fused one (`plan train --loss`), as the parallelism line names them
LOSS_LABELS = {"full": "loss over fp32 logits", "compiled": "compiled loss over the logits"}


def train_plan_rows(plan) -> list[tuple[str, str]]:
    j, m, st, r = plan.job, plan.memory, plan.step, plan.reliability
    device_mem = j.hw.memory_bytes
    rows = [("model", f"{j.arch.name} ({j.arch.family}, {j.arch.params_total / 1e9:.3f} B parameters)"),
            ("hardware", f"{j.devices} x {j.hw.name} ({fmt_bytes(device_mem)} each)"),
            ("parallelism", f"{plan.dims.describe()}, ZeRO-{j.zero}, ac {j.ac}, micro-batch {j.micro_batch} x "
                            f"{plan.micro_batches} per step, {j.precision}"
                            + ("" if j.master_weights else " (no fp32 master weights)")
                            + f", gradients reduced in {j.reduce_dtype}"
                            + ((", sequence parallel" + (" (DTensor's)" if j.sp_style == "dtensor" else ""))
                               if j.sequence_parallel else "")
                            + (", async TP" if j.async_tp else "") + (", compiled" if j.compile else "")
                            + (f", {LOSS_LABELS[j.loss]}" if j.loss in LOSS_LABELS else "")
                            + (", fp8 all-gather" if j.fp8_all_gather else "")
                            + (f", {SCHEDULES[j.schedule]} schedule" if j.pp > 1 else "")),
            ("batch", f"{j.global_batch_tokens:,} tokens per step (sequences of {j.seq})")]
    for part in MEMORY_PARTS:
        if m[part]:
            rows.append((f"  memory: {part.replace('_', ' ')}", fmt_bytes(m[part])))
    head = (device_mem - plan.peak_memory) / device_mem
    rows.append(("memory per device (peak)", f"{fmt_bytes(plan.peak_memory)} = {100 * plan.peak_memory / device_mem:.0f}% "
                                              f"of the device ({'fits' if plan.fits else 'DOES NOT FIT'}; "
                                              f"headroom {100 * head:.0f}%)"))
    if plan.host_memory:
        rows.append(("host memory (offloaded)", fmt_bytes(plan.host_memory)))
    rows += [("FLOPs per token", f"{plan.flops_per_token / 1e9:,.2f} GFLOP (model)"),
             ("step time", f"{fmt_time(st.total_s)}: GEMM {fmt_time(st.compute_s)}, elementwise "
                           f"{fmt_time(st.elementwise_s)}, dispatch {fmt_time(st.dispatch_s)}, TP {fmt_time(st.tp_comm_s)}, "
                           f"PP {fmt_time(st.pp_comm_s)}, bubble {fmt_time(st.bubble_s)}, DP exposed "
                           f"{fmt_time(st.dp_comm_s)}, optimizer {fmt_time(st.optimizer_s)}"),
             ("throughput", f"{plan.tokens_per_s:,.0f} tokens/s; MFU {100 * plan.mfu:.1f}%, HFU {100 * plan.hfu:.1f}%")]
    if j.tokens:
        rows.append(("time to train", f"{fmt_time(plan.train_time_s)} for {j.tokens:,.0f} tokens without failures"))
    rows += [("reliability", f"device MTBF {r['device_mtbf_hours']:,.0f} h -> job MTBF {fmt_time(r['job_mtbf_s'])}; "
                             f"checkpoint {fmt_bytes(r['checkpoint_bytes'])}, stall {fmt_time(r['checkpoint_stall_s'])}"),
             ("checkpoint interval", f"{fmt_time(r['interval_s'])} (Young/Daly) = every {r['interval_steps']:,} steps"),
             ("goodput", f"{100 * r['goodput']:.1f}% (restart {fmt_time(r['restart_s'])} each)")]
    if j.tokens:
        rows.append(("expected interruptions", f"{r['expected_interruptions']:,.1f}"))
        rows.append(("effective time", fmt_time(plan.effective_time_s)))
        rows.append(("cost", "n/a (no price in the catalogue)" if plan.cost is None else f"${plan.cost:,.0f}"))
    rows += [(f"note {i + 1}", n) for i, n in enumerate(plan.notes)]
    return rows


def print_rows(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


# ------------------------------------------------------------------------------------ plots

def _pyplot():
    require_extra("plots", "drawing a plot or report")
    import matplotlib  # optional: the `plots` extra, and start-up: only reports draw

    matplotlib.use("Agg")  # files only: no display
    import matplotlib.pyplot as plt  # order: after use("Agg")
    return plt


def memory_figure(plans, labels):
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 0.6 * len(plans) + 1.6))
    left = [0.0] * len(plans)
    for part in MEMORY_PARTS:
        values = [p.memory[part] / 1e9 for p in plans]
        if any(values):
            ax.barh(labels, values, left=left, label=part.replace("_", " "))
            left = [a + b for a, b in zip(left, values)]
    limit = plans[0].job.hw.memory_bytes / 1e9
    ax.axvline(limit, color="black", linestyle="--", linewidth=1, label=f"device memory ({limit:.0f} GB)")
    ax.set_xlabel("GB per device")
    ax.set_title("Memory per device")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


def pareto_figure(points, xlabel: str, ylabel: str, title: str):
    """points: (x, y, label); the Pareto-optimal ones (lower x and y) are joined by a line."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    ax.scatter(xs, ys, s=18, alpha=0.6)
    front, best = [], float("inf")
    for x, y, label in sorted(points, key=lambda p: (p[0], p[1])):
        if y < best:
            front.append((x, y, label))
            best = y
    ax.plot([p[0] for p in front], [p[1] for p in front], color="tab:red", linewidth=1)
    for x, y, label in front[:8]:
        ax.annotate(label, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def write_report(path: Path, title: str, sections: list[tuple[str, str]], figures: list) -> Path:
    """Markdown (plots as PNG files beside it) or HTML (plots inline); `sections` are (heading,
    preformatted or Markdown text)."""
    path = Path(path)
    if path.suffix not in (".md", ".html"):
        raise HardyError(f"--report must end in .md or .html (got {path.name})")
    if not path.parent.is_dir():
        raise HardyError(f"--report: directory {path.parent} does not exist")
    pngs = []
    for fig in figures:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110)
        _pyplot().close(fig)
        pngs.append(buf.getvalue())
    if path.suffix == ".md":
        parts = [f"# {title}", ""]
        for heading, text in sections:
            parts += [f"## {heading}", "", text, ""]
        for i, png in enumerate(pngs):
            name = f"{path.stem}-{i + 1}.png"
            write_bytes_atomic(path.with_name(name), png)
            parts += [f"![plot {i + 1}]({name})", ""]
        write_bytes_atomic(path, "\n".join(parts).encode())
        return path
    body = [f"<h1>{html.escape(title)}</h1>"]
    for heading, text in sections:
        body.append(f"<h2>{html.escape(heading)}</h2><pre>{html.escape(text)}</pre>")
    for png in pngs:
        body.append(f'<img alt="plot" src="data:image/png;base64,{base64.b64encode(png).decode()}">')
    doc = f"<!doctype html><meta charset='utf-8'><title>{html.escape(title)}</title>{''.join(body)}"
    write_bytes_atomic(path, doc.encode())
    return path
