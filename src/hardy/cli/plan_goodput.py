"""hardy plan goodput: checkpoint-restart against live recovery (with and without warm spares), simulated
at the scale of the fleets people ask about (hardy.plan.goodput)."""
from __future__ import annotations

import io
import json
from dataclasses import fields
from pathlib import Path

from hardy.errors import HardyError
from hardy.extras import require as require_extra
from hardy.fsio import write_bytes_atomic
from hardy.plan.goodput import LLAMA3_EFFECTIVE_TRAINING_TIME, STRATEGIES, Fleet, Recovery, simulate

DEFAULT_GPUS = (16384, 131072)


def register(group) -> None:
    p = group.add_parser("goodput", help="failure-aware goodput at 16K+ GPUs: restart vs live recovery vs "
                                         "live + warm spares, simulated over a job's failure history")
    p.add_argument("--strategy", action="append", default=None, metavar="|".join(STRATEGIES),
                   help="a recovery strategy (repeatable or comma-separated; default: all three)")
    p.add_argument("--gpus", type=int, action="append", default=None,
                   help=f"fleet size (repeatable; default: {' and '.join(map(str, DEFAULT_GPUS))})")
    p.add_argument("--group-gpus", type=int, default=Fleet.group_gpus, help="GPUs per replica group")
    p.add_argument("--days", type=float, default=Fleet.days, help="the job's wall time")
    p.add_argument("--device-mtbf-hours", type=float, default=Fleet.device_mtbf_hours,
                   help="hours between interruptions per GPU (default: Llama 3's 419 in 54 days on 16,384)")
    p.add_argument("--hardware-share", type=float, default=Fleet.hardware_share,
                   help="share of interruptions that need a node replaced (default: Llama 3's 0.78)")
    for f in fields(Recovery):
        flag = "--" + f.name.replace("_", "-")
        p.add_argument(flag, type=type(f.default), default=f.default, help=f"(default {f.default})")
    p.add_argument("--trials", type=int, default=20, help="failure histories simulated per fleet")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="the strategies side by side per fleet size")
    p.set_defaults(func=run_goodput)


def strategies_of(values: list[str] | None) -> list[str]:
    chosen = [s.strip() for v in (values or [",".join(STRATEGIES)]) for s in v.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in STRATEGIES]
    if unknown:
        raise HardyError(f"--strategy {unknown[0]!r}: choose from {', '.join(STRATEGIES)}")
    return list(dict.fromkeys(chosen))


def run_goodput(args) -> int:
    if args.plot:
        require_extra("plots", "--plot")
    strategies = strategies_of(args.strategy)
    rec = Recovery(**{f.name: getattr(args, f.name) for f in fields(Recovery)})
    results = [simulate(Fleet(gpus, args.group_gpus, args.days, args.device_mtbf_hours, args.hardware_share), rec,
                        strategies, args.trials, args.seed) for gpus in (args.gpus or DEFAULT_GPUS)]
    if args.plot:
        plot(results, strategies, Path(args.plot))
    if args.json:
        print(json.dumps({"recovery": rec.__dict__, "fleets": results}))
        return 0
    print(table(results, strategies, args.trials))
    if args.plot:
        print(f"wrote {args.plot}")
    return 0


def _pct(s: dict) -> str:
    return f"{100 * s['median']:.2f}% [{100 * s['low']:.2f}, {100 * s['high']:.2f}]"


def table(results: list[dict], strategies: list[str], trials: int) -> str:
    head = ["GPUs", "groups", "job MTBF", "interruptions", *strategies]
    rows = [[f"{r['gpus']:,}", str(r["groups"]), f"{r['job_mtbf_h'] * 60:.0f} min", f"{r['interruptions']:.0f}",
             *[_pct(r["strategies"][s]) for s in strategies]] for r in results]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(x) + " |" for x in rows]
    lines.append(f"goodput: median [95% interval] over {trials} simulated failure histories; Llama 3 published "
                 f"> {100 * LLAMA3_EFFECTIVE_TRAINING_TIME:.0f}% effective training time at 16,384 GPUs")
    return "\n".join(lines)


def plot(results: list[dict], strategies: list[str], path: Path) -> None:
    if path.suffix != ".png":
        raise HardyError(f"--plot must end in .png (got {path.name})")
    if not path.parent.is_dir():
        raise HardyError(f"--plot: directory {path.parent} does not exist")
    from hardy.plan.report import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(strategies)
    for i, s in enumerate(strategies):
        xs = [j + (i - (len(strategies) - 1) / 2) * width for j in range(len(results))]
        med = [100 * r["strategies"][s]["median"] for r in results]
        err = [[m - 100 * r["strategies"][s]["low"] for m, r in zip(med, results)],
               [100 * r["strategies"][s]["high"] - m for m, r in zip(med, results)]]
        ax.bar(xs, med, width, yerr=err, capsize=3, label=s)
    ax.axhline(100 * LLAMA3_EFFECTIVE_TRAINING_TIME, color="gray", linestyle="--", linewidth=1,
               label="Llama 3 published (16K GPUs)")
    ax.set_xticks(range(len(results)), [f"{r['gpus']:,} GPUs" for r in results])
    ax.set_ylabel("goodput (%)")
    low = min(100 * r["strategies"][s]["low"] for r in results for s in strategies)
    ax.set_ylim(max(0, min(low, 100 * LLAMA3_EFFECTIVE_TRAINING_TIME) - 5), 100)
    ax.legend(loc="center", fontsize=8)
    ax.set_title("simulated goodput under Llama 3's failure rate")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    write_bytes_atomic(path, buf.getvalue())
