"""The demo's report: one self-contained HTML page (plots inline as PNG), every number from demo.json."""
from __future__ import annotations

import base64
import html
import io
import logging
import time
from pathlib import Path

from hardy.fault.goodput import LOSS_KEYS
from hardy.fsio import write_bytes_atomic

SECTIONS = ("Summary", "Machine", "Plan and measurement", "Data", "Training", "Goodput", "Live recovery", "Telemetry",
            "Evaluation", "Compression", "Generation")
MARKS = {"killed": ("tab:red", "x"), "hung": ("tab:purple", "s"), "failed": ("black", "x"), "nan": ("tab:orange", "o"),
         "spike": ("tab:brown", "^")}
CSS = """body{font:15px/1.45 system-ui,sans-serif;max-width:1000px;margin:2em auto;padding:0 1em;color:#222}
h1{margin-bottom:.2em}h2{border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;margin:.6em 0}td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left}
td.num{text-align:right;white-space:nowrap}th{background:#f3f3f3}img{max-width:100%}
.note{color:#555;font-size:13px}pre{background:#f7f7f7;padding:.6em;white-space:pre-wrap}"""


def _pyplot():
    import matplotlib  # optional: the plots extra, not needed to run the demo's stages

    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # not its font-cache notices among the demo's lines
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # order: after use("Agg")
    return plt


def _img(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    _pyplot().close(fig)
    return f'<img alt="plot" src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}">'


def _table(headers: list[str], rows: list[list]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td{_align(c)}>{html.escape(str(c))}</td>" for c in row) + "</tr>"
                   for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _align(cell) -> str:
    """Figures right-aligned, prose left."""
    text = str(cell)
    figure = text[:1].isdigit() or (text[:1] in "+-" and text[1:2].isdigit())
    return " class=num" if figure and len(text) <= 32 else ""


def _ratio(measured: float, planned: float) -> str:
    return f"{measured / planned:.2f}x" if planned else "-"


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _steps(events: list[dict]) -> list[dict]:
    return [e for e in events if e.get("event") == "step"]


def loss_figure(events: list[dict], incidents: list[dict]):
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    t0 = events[0]["time"]
    # one line per attempt: a restart replays steps from its checkpoint, and the replay is drawn too
    attempt, lines = -1, {}
    for e in events:
        if e.get("event") == "start":
            attempt += 1
        elif e.get("event") == "step" and not e.get("skipped"):
            lines.setdefault(attempt, []).append((e["step"], e["loss"]))
    for i, points in lines.items():
        ax.plot([p[0] for p in points], [p[1] for p in points], linewidth=1.2, label=f"attempt {i + 1}")
    for inc in incidents:
        color, marker = MARKS.get(inc["kind"], ("black", "x"))
        ax.axvline(inc["step"], color=color, linestyle="--", linewidth=0.9)
        label = inc["kind"] + (" (injected)" if inc["injected"] else "")
        if inc.get("resumed_from") is not None and inc["kind"] in ("killed", "hung", "failed"):
            label += f"\nresumed from {inc['resumed_from']}, {inc['recovery_s']:.1f} s"
        ax.annotate(label, (inc["step"], ax.get_ylim()[1]), fontsize=7, color=color, va="top", ha="left",
                    xytext=(3, -3), textcoords="offset points")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"Loss over {events[-1]['time'] - t0:.0f} s of wall time, failures marked")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center right")
    fig.tight_layout()
    return fig


def goodput_figure(goodput: dict, predicted: float):
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 2.4))
    wall = goodput["wall_s"]
    left = 0.0
    parts = [("useful steps", goodput["useful_s"])] + [(k, goodput["losses_s"][k]) for k in LOSS_KEYS]
    for name, value in parts:
        if value > 0:
            ax.barh(["measured"], [value], left=[left], label=f"{name} {value:.1f} s")
            left += value
    ax.barh(["planned"], [wall * predicted], color="tab:gray", label=f"planned goodput {100 * predicted:.0f}%")
    ax.set_xlabel(f"seconds of the {wall:.0f} s run")
    ax.set_title(f"Goodput {100 * goodput['goodput']:.1f}% measured vs {100 * predicted:.1f}% planned")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    return fig


def plan_figure(rows: list[list]):
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 2.8))
    names = [r[0] for r in rows]
    ratios = [r[2] / r[1] if r[1] else 0.0 for r in rows]
    ax.barh(names, ratios, color=["tab:green" if 0.75 <= x <= 1.33 else "tab:orange" for x in ratios])
    ax.axvline(1.0, color="black", linewidth=1)
    for i, x in enumerate(ratios):
        ax.annotate(f"{x:.2f}x", (x, i), fontsize=8, xytext=(3, -3), textcoords="offset points")
    ax.set_xlabel("measured / predicted")
    ax.set_title("The planner against this run")
    fig.tight_layout()
    return fig


def telemetry_figure(samples: dict[str, list[dict]], t0: float):
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(10, 3))
    for (key, label, scale), ax in zip((("rss_bytes", "RSS (MiB)", 2**20), ("cpu_freq_mhz", "CPU clock (MHz)", 1),
                                        ("load_1m", "load average (1 min)", 1)), axes):
        drawn = False
        for rank, points in sorted(samples.items()):
            pts = [(p["time"] - t0, p[key] / scale) for p in points if p.get(key) is not None and "time" in p]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", linewidth=1, label=f"rank {rank}")
                drawn = True
        if not drawn:
            ax.text(0.5, 0.5, "sensor absent on this machine", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("s since training started", fontsize=8)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def compression_figure(rows: list[dict]):
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    ppls = [r["ppl"] for r in rows]
    # at least +-1% of the reference's perplexity in view: differences in the noise should look it
    low, high = min(min(ppls), 0.99 * ppls[0]), max(max(ppls), 1.01 * ppls[0])
    for ax, key, xlabel in ((axes[0], "size_bytes", "size on disk (MiB)"), (axes[1], "decode_tps", "decode tokens/s")):
        for r in rows:
            x = r[key] / 2**20 if key == "size_bytes" else r[key]
            ax.scatter([x], [r["ppl"]], s=40)
            ax.annotate(r["name"], (x, r["ppl"]), fontsize=8, xytext=(4, 4), textcoords="offset points")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation perplexity")
        ax.set_ylim(low - 0.1 * (high - low), high + 0.1 * (high - low))
        ax.ticklabel_format(axis="y", useOffset=False)
        ax.grid(alpha=0.3)
    axes[0].set_title("Quality vs size (lower left is better)", fontsize=9)
    axes[1].set_title("Quality vs decode speed (lower right is better)", fontsize=9)
    fig.tight_layout()
    return fig


def sections(r: dict) -> dict[str, str]:
    out = {}
    out["Summary"] = _table(["stage", "result", "time"], [[s["name"], s["summary"], f"{s['seconds']:.1f} s"]
                                                          for s in r["stages"]]) + \
        f"<p>The whole demo took {r['wall_s']:.0f} s on this machine.</p>"
    p = r["probe"]
    cpu = p["cpu"]
    out["Machine"] = _table(["measure", "value"], [
        ["CPU", f"{cpu['model']} ({cpu['physical_cores']} cores)"],
        ["vector extensions", ", ".join(f for f, on in cpu["flags"].items() if on) or "none"],
        *[[f"matmul {name}", f"{d['best_flops'] / 1e9:,.1f} GFLOP/s"] for name, d in p["matmul"]["dtypes"].items()],
        ["memory copy", f"{p['memory']['bandwidth'] / 1e9:.1f} GB/s"],
        ["disk write / read", f"{p['disk']['write_bandwidth'] / 1e9:.2f} / {p['disk']['read_bandwidth'] / 1e9:.2f} GB/s"],
        ["all-reduce", "not measured" if "error" in p["allreduce"] else
         f"{p['allreduce']['latency_s'] * 1e6:,.0f} us, {p['allreduce']['bus_bandwidth'] / 1e9:.2f} GB/s bus"],
        ["probe took", f"{p['duration_s']:.1f} s"]])
    plan, train = r["plan"], r["train"]
    units = {"bytes": _mib, "s": lambda x: f"{x:.3f} s", "tokens/s": lambda x: f"{x:,.0f} tokens/s"}
    rows = [[q, units[u](pred), units[u](meas), _ratio(meas, pred)] for q, pred, meas, u in train["check"]]
    g, pg = train["goodput"], plan["reliability"]["goodput"]
    rows.append(["goodput", f"{100 * pg:.1f}%", f"{100 * g['goodput']:.1f}%", _ratio(g["goodput"], pg)])
    restarts = [i["recovery_s"] for i in train["incidents"] if i.get("recovery_s") is not None]
    if restarts:
        assumed = plan["reliability"]["restart_s"]
        mean = sum(restarts) / len(restarts)
        rows.append(["restart (incl. hang detection)", f"{assumed:.1f} s (assumed)", f"{mean:.1f} s (mean of "
                     f"{len(restarts)})", _ratio(mean, assumed)])
    out["Plan and measurement"] = (
        f"<p>Planned for {plan['model']} on {plan['devices']} processes of this machine (the probe's figures split "
        f"between them): checkpoint every {plan['interval_used']} steps — the Young/Daly interval for "
        f"{plan['injected_stops']} failures in the planned time (job MTBF {plan['job_mtbf_s']:.0f} s) and a "
        f"predicted checkpoint stall of {plan['reliability']['checkpoint_stall_s']:.3f} s.</p>"
        + _table(["quantity", "planned", "measured", "ratio"], rows) + _img(plan_figure(train["check"])) +
        "<p class=note>Memory measured = each process's peak resident-set growth during training, with glibc's "
        "default allocator, which keeps freed activation blocks; the planner predicts live tensors plus the runtime "
        "overhead the probe measured (with <code>train.release_memory = true</code> the two agree within a few "
        "percent, at a cost in speed). The restart time the plan assumed is a guess until a run measures one.</p>")
    d = r["data"]
    out["Data"] = _table(["", "documents"], [["read", f"{d['documents']:,}"],
                                            *[[f"removed: {k}", f"{n:,}"] for k, n in d["removed"].items()],
                                            ["kept", f"{d['kept']:,} ({100 * d['chars_kept'] / max(1, d['chars_in']):.1f}%"
                                                     " of characters)"],
                                            *[[f"{s} split", f"{d['documents_per_split'][s]:,} documents, {n:,} tokens"]
                                              for s, n in d["tokens"].items()]]) + \
        f"<p class=note>Sources: {', '.join(d['inputs'])} (bundled with hardy).</p>"
    events, incidents = train["events"], train["incidents"]
    t0 = events[0]["time"]
    out["Training"] = _img(loss_figure(events, incidents)) + _table(
        ["at", "what happened and what the job did"], [[f"{i['time'] - t0:.1f} s", i["line"]] for i in incidents])
    out["Goodput"] = _img(goodput_figure(g, pg)) + _table(
        ["where the wall time went", "seconds", "share"],
        [["useful steps", f"{g['useful_s']:.1f}", f"{100 * g['useful_s'] / g['wall_s']:.1f}%"]] +
        [[k, f"{v:.1f}", f"{100 * v / g['wall_s']:.1f}%"] for k, v in g["losses_s"].items() if v > 0])
    live = r.get("live")
    if live:
        restart = live.get("restart_recovery_s")
        out["Live recovery"] = _table(["", "checkpoint-restart (training above)", "live recovery (torchft)"], [
            ["what a failure stops", "every process: the job restarts from its newest checkpoint",
             "the failed replica group only; the other commits the next step without it"],
            ["time until training goes on", f"{restart:.1f} s" if restart is not None else "no restart measured",
             f"{live['stall_s']:.2f} s beyond a {live['step_s']:.3f} s step"],
            ["the failed process back in", "the restart above",
             f"{live['heal_s']:.1f} s, healed from the live peer at step {live['heal_step']}"
             if live["heal_s"] is not None else "after the run ended"]]) + \
            f"<p class=note>The same model and data on 2 replica groups of 1 process, exact mode (the survivor " \
            f"computes the missing group's share, so the result is the fault-free run's); group 1 SIGKILLed after " \
            f"step {live['kill_step']}. Final loss {live['final_loss']:.3f} after {live['steps']} steps.</p>"
    absent = sorted({k for samples in train["telemetry"].values() for s in samples for k in s.get("absent", [])})
    n = sum(len(v) for v in train["telemetry"].values())
    out["Telemetry"] = _img(telemetry_figure(train["telemetry"], t0)) + \
        f"<p class=note>{n} samples from {len(train['telemetry'])} ranks; sensors absent here: {', '.join(absent) or 'none'}.</p>"
    e = r["evaluate"]
    out["Evaluation"] = (f"<p>Perplexity on {e['tokens']:,} held-out validation tokens (context {e['ctx']}): "
                         f"<b>{e['ppl']:.2f}</b> ± {e['ppl_se']:.2f}.</p>")
    c = r["compress"]
    out["Compression"] = _table(["model", "perplexity", "paired z vs fp32", "KL vs fp32", "top-1 agreement", "size",
                                 "decode tokens/s", "prefill tokens/s", "peak RSS"],
                                [[x["name"], f"{x['ppl']:.2f}", f"{x['ppl_z']:+.2f}", f"{x['kl']:.2e}",
                                  f"{100 * x['top1']:.1f}%",
                                  _mib(x["size_bytes"]), f"{x['decode_tps']:,.0f}", f"{x['prefill_tps']:,.0f}",
                                  _mib(x["peak_rss_bytes"])] for x in c]) + _img(compression_figure(c)) + \
        "<p class=note>int8: round-to-nearest per channel; int4: GPTQ, groups of 32, calibrated on the training " \
        "split. Paired z: the change in mean log-likelihood over the same text windows in units of its standard " \
        "error (|z| < 2: within the noise of this text). Speed: batch 1, one thread, each model in a fresh " \
        "process.</p>"
    gen = r["generate"]
    out["Generation"] = (f"<p>From the {gen['model']} model ({gen['decode_tps']:,.0f} tokens/s), prompt "
                         f"<code>{html.escape(gen['prompt'])}</code>:</p><pre><b>{html.escape(gen['prompt'])}</b>"
                         f"{html.escape(gen['text'])}</pre>")
    return out


def write_report(path: Path, results: dict) -> Path:
    parts = sections(results)
    stamp = time.strftime("%Y-%m-%d %H:%M", time.localtime(results["started"]))
    body = [f"<h1>hardy demo</h1><p class=note>Run of {stamp}; every number below was measured in this run "
            f"(demo.json beside this page).</p>"]
    for name in (n for n in SECTIONS if n in parts):
        body.append(f'<h2 id="{name.lower().replace(" ", "-")}">{html.escape(name)}</h2>{parts[name]}')
    doc = f"<!doctype html><meta charset='utf-8'><title>hardy demo</title><style>{CSS}</style>{''.join(body)}"
    write_bytes_atomic(Path(path), doc.encode())
    return Path(path)
