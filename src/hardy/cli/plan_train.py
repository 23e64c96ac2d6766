"""`hardy plan train | compare | check | validate | hardware` (the `plan` group lives in cli/plan.py)."""
from __future__ import annotations

import json
from pathlib import Path

from hardy.errors import HardyError
from hardy.plan.arch import load_arch
from hardy.plan.hardware import describe_hardware, get_hardware, load_catalogue


def register(group) -> None:
    register_train(group)
    register_compare(group)
    register_check(group)
    register_validate(group)
    register_hardware(group)


def _model_and_hardware(p, hardware_required: bool = True) -> None:
    p.add_argument("--model", required=True, help="a hardy preset (tiny, smollm2-135m, llama3.1-8b, ...), a GPT "
                                                  "preset (gpt-22b, gpt-175b, gpt-530b, gpt-1t), a .gguf / model "
                                                  "directory, or a TOML/JSON config with family = llama|gpt")
    p.add_argument("--hardware", required=hardware_required, help="a catalogue entry (see `hardy plan hardware`) "
                                                                   "or probe:FILE from `hardy probe`")
    p.add_argument("--catalogue", default=None, help="a hardware catalogue TOML instead of the built-in one")


def _workload(p) -> None:
    p.add_argument("--devices", type=int, required=True, help="GPUs, or CPU sockets")
    p.add_argument("--tokens", type=float, default=0.0, help="tokens to train on (for time, cost, failures)")
    p.add_argument("--seq", type=int, default=2048, help="sequence length (default 2048)")
    p.add_argument("--global-batch-tokens", type=int, default=None,
                   help="tokens per optimizer step (default: 1M tokens rounded to sequences)")
    p.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--device-mtbf-hours", type=float, default=None, help="default: the catalogue's, else Llama 3's")
    p.add_argument("--restart-s", type=float, default=300.0, help="seconds to detect, restart and reload (default 300)")


def register_train(group) -> None:
    p = group.add_parser("train", help="training: memory per device, step time, MFU, time, cost and goodput")
    _model_and_hardware(p)
    _workload(p)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dp", type=int, default=None, help="default: devices / (tp x pp)")
    p.add_argument("--zero", type=int, default=None, choices=[0, 1, 2, 3],
                   help="3 = ZeRO-3 / FSDP full shard (default 0; 3 under --dp-shard / --dp-replicate)")
    p.add_argument("--dp-shard", type=int, default=None, help="HSDP: FSDP within groups of this many data-parallel "
                   "ranks (a node, typically)")
    p.add_argument("--dp-replicate", type=int, default=None, help="HSDP: that many replicas of the sharded "
                   "model (across nodes); dp-shard x dp-replicate = devices / (tp x pp x cp)")
    p.add_argument("--fp8", default="none", choices=["none", "tensorwise", "rowwise"],
                   help="the blocks' linear GEMMs in fp8 with tensorwise or rowwise scaling (torchao float8); "
                        "attention and the LM head stay bf16")
    p.add_argument("--no-master-weights", dest="master_weights", action="store_false",
                   help="16-bit weights, gradients and AdamW states with no fp32 master copy (pure bf16 training)")
    p.add_argument("--reduce-dtype", default="fp32", choices=["fp32", "bf16"],
                   help="the gradients' data-parallel reduction (default fp32, as FSDP2 in torchtitan and hardy, "
                        "Composer and Megatron run it; bf16 halves its bytes)")
    p.add_argument("--cp", type=int, default=1, help="context parallelism: each sequence split over this many "
                   "ranks (ring attention, load-balanced causal chunks)")
    p.add_argument("--ac", default="none", help="activation recompute: none, selective (GPT), full, every:K")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--offload", default="none", choices=["none", "optimizer", "params"])
    p.add_argument("--sp", action="store_true", help="sequence parallelism with TP")
    p.add_argument("--compile", action="store_true", help="each block torch.compile'd (as torchtitan applies it): "
                   "its norms, RoPE, SwiGLU and residuals fused (Llama-family models)")
    p.add_argument("--sp-style", choices=["megatron", "dtensor"], default="megatron",
                   help="what sequence parallelism keeps for the backward: megatron (the linears' sharded inputs, "
                        "gathered again) or dtensor (torchtitan's: each column-parallel linear keeps its "
                        "all-gathered input); with --sp")
    p.add_argument("--fp8-all-gather", action="store_true",
                   help="FSDP gathers the fp8 linears' weights in fp8 (torchao's enable_fsdp_float8_all_gather; "
                        "needs --fp8 tensorwise and --zero 3)")
    p.add_argument("--loss", choices=["chunked", "full", "compiled"], default=None,
                   help="a Llama model's loss: chunked (hardy's fused linear cross-entropy, the default), full "
                        "(the logits materialized and the cross-entropy taken over their fp32 copy, as torchtitan "
                        "and transformers do) or compiled (that loss torch.compile'd, as torchtitan's --compile "
                        "does since 2025); GPT-style models keep fp32 logits")
    p.add_argument("--async-tp", action="store_true", help="TP's collectives overlapped with the GEMMs they feed "
                   "(torchtitan's async TP: inductor's micro-pipeline TP); needs --sp")
    p.add_argument("--schedule", default="1f1b", choices=["1f1b", "interleaved", "zb-h1"],
                   help="pipeline schedule: 1F1B, interleaved 1F1B (--virtual-stages), or ZB-H1 (zero bubble at "
                        "1F1B's memory: weight gradients deferred into the bubble)")
    p.add_argument("--virtual-stages", type=int, default=2, help="stages per device when interleaved (default 2)")
    p.add_argument("--search", action="store_true", help="enumerate tp/pp/zero/ac/micro-batch; rank the ones that fit")
    p.add_argument("--rank-by", default="time", choices=["time", "cost"])
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--json", action="store_true")
    p.add_argument("--report", default=None, help="write FILE.md or FILE.html with tables and plots")
    p.set_defaults(func=run_train)


def _hsdp(args) -> dict:
    """TrainJob's zero, dp and dp_replicate from --zero, --dp, --dp-shard and --dp-replicate."""
    if args.dp_shard is None and args.dp_replicate is None:
        return {"zero": 0 if args.zero is None else args.zero, "dp": args.dp, "dp_replicate": 1}
    if args.zero not in (None, 3):
        raise HardyError(f"--dp-shard / --dp-replicate (HSDP) shard within each replica group: they need --zero 3, "
                         f"not {args.zero}")
    model_parallel = args.tp * args.pp * args.cp
    dp = args.devices // model_parallel
    replicate = args.dp_replicate or dp // args.dp_shard
    shard = args.dp_shard or dp // replicate
    if min(shard, replicate) < 1 or shard * replicate != dp or (args.dp is not None and args.dp != dp):
        what = "tp x pp x cp" if args.cp > 1 else "tp x pp"
        raise HardyError(f"--dp-shard {shard} x --dp-replicate {replicate} must equal devices / ({what}) = "
                         f"{args.devices} / {model_parallel} = {dp}")
    return {"zero": 3, "dp": dp, "dp_replicate": replicate}


def _job(args, hw, arch):
    from hardy.plan.train import TrainJob

    batch = args.global_batch_tokens or max(1, (1 << 20) // args.seq) * args.seq
    return TrainJob(arch=arch, hw=hw, devices=args.devices, seq=args.seq, global_batch_tokens=batch,
                    tokens=args.tokens, precision=args.precision, device_mtbf_hours=args.device_mtbf_hours,
                    restart_s=args.restart_s, **({} if not hasattr(args, "tp") else dict(
                        tp=args.tp, pp=args.pp, **_hsdp(args),
                        ac=args.ac, micro_batch=args.micro_batch, cp=args.cp, fp8=args.fp8,
                        master_weights=args.master_weights, reduce_dtype=args.reduce_dtype,
                        offload=args.offload, sequence_parallel=args.sp, async_tp=args.async_tp,
                        compile=args.compile, loss=args.loss, fp8_all_gather=args.fp8_all_gather, sp_style=args.sp_style,
                        schedule=args.schedule,
                        virtual_stages=args.virtual_stages)))


def run_train(args) -> int:
    from hardy.plan.report import (
        fmt_bytes,
        fmt_time,
        memory_figure,
        pareto_figure,
        print_rows,
        table,
        train_plan_rows,
        write_report,
    )
    from hardy.plan.train import fit_advice, plan_train, search

    hw, arch = get_hardware(args.hardware, args.catalogue), load_arch(args.model)
    if args.devices < 1:
        raise HardyError(f"--devices must be >= 1 (got {args.devices})")
    job = _job(args, hw, arch)
    if args.search:
        plans, tried = search(job, args.rank_by, limit=0)
        if not plans:
            raise HardyError(f"{arch.name} fits in no configuration of {args.devices} x {hw.name} "
                             f"({tried} tried): add devices, use ZeRO-3 + full recompute, or a larger device")
        top = plans[:args.top]
        if args.json:
            print(json.dumps({"tried": tried, "fitting": len(plans), "plans": [p.to_dict() for p in top]}))
        else:
            print(f"{len(plans)} of {tried} configurations fit on {args.devices} x {hw.name}; best by {args.rank_by}:")
            rows = [[i + 1, p.label, fmt_bytes(p.peak_memory), fmt_time(p.step_s), f"{100 * p.mfu:.1f}%",
                     f"{100 * p.reliability['goodput']:.1f}%",
                     fmt_time(p.effective_time_s) if job.tokens else "-",
                     "-" if p.cost is None else f"${p.cost:,.0f}"] for i, p in enumerate(top)]
            print(table(["#", "configuration", "memory/device", "step", "MFU", "goodput", "time", "cost"], rows))
        if args.report:
            best = plans[0]
            points = [(p.step_s if not job.tokens else p.effective_time_s / 3600,
                       (p.cost if p.cost is not None else p.peak_memory / 1e9), p.label) for p in plans]
            ylabel = "cost (USD)" if plans[0].cost is not None else "memory per device (GB)"
            figs = [pareto_figure(points, "time to train (h)" if job.tokens else "step time (s)", ylabel,
                                  f"{arch.name} on {args.devices} x {hw.name}: searched configurations"),
                    memory_figure(top[:6], [p.label for p in top[:6]])]
            write_report(Path(args.report), f"hardy plan train --search: {arch.name}",
                         [("best configuration", print_rows(train_plan_rows(best)))], figs)
        return 0
    plan = plan_train(job)
    # A plan that does not fit is an answer, not an error (scripts search over them): it says so, and why.
    advice = None if plan.fits else fit_advice(plan)
    if args.json:
        print(json.dumps({**plan.to_dict(), "advice": advice}))
    else:
        print(print_rows(train_plan_rows(plan)))
        if advice:
            print(advice)
    if args.report:
        write_report(Path(args.report), f"hardy plan train: {arch.name} on {args.devices} x {hw.name}",
                     [("plan", print_rows(train_plan_rows(plan)))], [memory_figure([plan], [arch.name])])
    return 0


def register_compare(group) -> None:
    p = group.add_parser("compare", help="GPU or CPU? one workload side by side over catalogue entries")
    p.add_argument("workload", choices=["train", "serve"])
    _model_and_hardware(p, hardware_required=False)
    p.add_argument("--hardware-list", default=None,
                   help="comma-separated entries (default: the whole catalogue); probe:FILE allowed")
    p.add_argument("--devices", type=int, required=True, help="GPUs or CPU sockets per option")
    p.add_argument("--tokens", type=float, default=0.0, help="train: tokens to train on")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--global-batch-tokens", type=int, default=None)
    p.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16"],
                   help="train; hardware without fast bf16 falls back to fp32")
    p.add_argument("--device-mtbf-hours", type=float, default=None)
    p.add_argument("--restart-s", type=float, default=300.0)
    p.add_argument("--quant", default="int8", help="serve: weight format (default int8)")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--output-tokens", type=int, default=256)
    p.add_argument("--batch", type=int, default=None, help="serve: concurrent sequences (default: the largest that fits)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--report", default=None, help="FILE.md or FILE.html")
    p.set_defaults(func=run_compare)


def run_compare(args) -> int:
    from hardy.plan.compare import compare_figure, compare_serve, compare_train
    from hardy.plan.report import table, write_report

    names = args.hardware_list.split(",") if args.hardware_list else list(load_catalogue(args.catalogue))
    if args.hardware:
        names = [args.hardware] + [n for n in names if n != args.hardware]
    hws = [get_hardware(n.strip(), args.catalogue) for n in names if n.strip()]
    if args.workload == "train":
        result = compare_train(_job(args, hws[0], load_arch(args.model)), hws)
    else:
        result = compare_serve(args, hws)
    if args.json:
        print(json.dumps(result.records))
    else:
        print(table(result.headers, result.rows))
    if args.report:
        write_report(Path(args.report), f"hardy plan compare {args.workload}: {args.model}",
                     [("comparison", table(result.headers, result.rows))], [compare_figure(result.records, args.workload)])
    return 0


def register_check(group) -> None:
    p = group.add_parser("check", help="predicted vs measured for a finished `hardy train` run")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--hardware", required=True, help="probe:FILE of the machine that ran it (`hardy probe`)")
    p.add_argument("--catalogue", default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_check)


def run_check(args) -> int:
    from hardy.plan.check import check_run, probe_threads
    from hardy.plan.report import table

    hw = get_hardware(args.hardware, args.catalogue)
    threads = probe_threads(args.hardware)
    out, rows = [], []
    for run in args.run_dirs:
        for name, pred, meas, unit in check_run(Path(run), hw, threads).rows:
            err = pred / meas - 1 if meas else float("nan")
            out.append({"run": run, "quantity": name, "predicted": pred, "measured": meas, "unit": unit, "error": err})
            scale, shown = (2 ** 20, "MiB") if unit == "bytes" else (1, unit)
            rows.append([Path(run).name, name, f"{pred / scale:,.3f} {shown}", f"{meas / scale:,.3f} {shown}",
                         f"{100 * err:+.1f}%"])
    if args.json:
        print(json.dumps(out))
    else:
        print(table(["run", "quantity", "predicted", "measured", "error"], rows))
    return 0


def register_validate(group) -> None:
    p = group.add_parser("validate", help="reproduce the published cases (ZeRO, DeepSpeed, Megatron) with errors, "
                                          "and report the error on published GPU training runs")
    p.add_argument("--catalogue", default=None)
    p.add_argument("--markdown", action="store_true", help="Markdown tables (docs/planner.md)")
    p.add_argument("--json", action="store_true", help='{"cases": [...], "gpu_runs": {per run, per source, per '
                   'hardware, leave-one-source-out}}')
    p.set_defaults(func=run_validate)


def run_validate(args) -> int:
    from hardy.plan.public_runs import report
    from hardy.plan.report import markdown_table, table
    from hardy.plan.validation import all_cases

    cases = all_cases(args.catalogue)
    runs = report(args.catalogue)
    if args.json:
        print(json.dumps({"cases": [dict(c.__dict__, error=c.error, ok=c.ok) for c in cases], "gpu_runs": runs}))
    else:
        rows = [[c.group, c.name + (" *" if c.fitted_here else ""), f"{c.published:g} {c.unit}",
                 f"{c.predicted:.3g} {c.unit}", f"{100 * c.error:+.1f}%", f"±{100 * c.tolerance:.0f}%",
                 "ok" if c.ok else "FAIL", c.formula] for c in cases]
        headers = ["group", "case", "published", "hardy", "error", "goal", "", "formula"]
        render = markdown_table if args.markdown else (lambda h, r: table(h, r, align_right=False))
        print(render(headers, rows))
        fitted = sorted({name for c in cases for name in c.fitted_here})
        if fitted:
            print(f"\n* {', '.join(fitted)} was fitted on this case's own source: consistency, not prediction "
                  "(the held-out rows predict the same cases without it)")
        print()
        print(gpu_runs_text(runs, render))
    failed = [c for c in cases if not c.ok]
    if failed:
        raise HardyError(f"{len(failed)} published case(s) outside tolerance: {', '.join(c.name for c in failed)}")
    return 0


def gpu_runs_text(runs: dict, render) -> str:
    """The published GPU runs: each run, then the error per source, per hardware and left out by source."""
    def pct(x: float) -> str:
        return f"{100 * x:+.1f}%"

    lines = [render(["source", "run", "published tok/s/GPU", "hardy", "error", "fits", "constant from it"],
                    [[r["source"], r["case"], f"{r['published']:,.0f}", f"{r['predicted']:,.0f}", pct(r["error"]),
                      "yes" if r["fits"] else "NO", "yes" if r["shares_source_with_a_constant"] else ""]
                     for r in runs["runs"]]), ""]
    loso = runs["leave_one_source_out"]
    rows = [[name, s["n"], f"{100 * s['mape']:.1f}%", pct(s["mean_error"]),
             f"{100 * loso['by_source'][name]['mape']:.1f}%" if name in loso["by_source"] else "-"]
            for name, s in runs["by_source"].items()]
    rows += [[f"hardware {name}", s["n"], f"{100 * s['mape']:.1f}%", pct(s["mean_error"]), ""]
             for name, s in runs["by_hardware"].items()]
    for label, s, left_out in (("all runs", runs["overall"], loso["overall"]),
                               ("runs sharing no source with a constant", runs["independent"], None)):
        rows.append([label, s["n"], f"{100 * s['mape']:.1f}%", pct(s["mean_error"]),
                     f"{100 * left_out['mape']:.1f}%" if left_out else ""])
    lines.append(render(["group", "runs", "MAPE", "mean error", "MAPE, its source left out"], rows))
    lines += [f"left out, re-derived: {k} {v['catalogue']:g} -> {v['refit']:g}" for k, v in loso["refits"].items()]
    lines += [f"left out, no other source to re-derive it from: {name}" for name in loso["unfittable"]]
    oom = runs.get("out_of_memory") or []
    if oom:
        lines += ["", render(["source", "published out of memory", "hardy's peak", "device", "hardy"],
                             [[r["source"], r["case"], f"{r['predicted_peak_bytes'] / 1e9:,.1f} GB",
                               f"{r['device_bytes'] / 1e9:,.0f} GB",
                               "fits (WRONG)" if r["predicted_to_fit"] else "does not fit"] for r in oom])]
    memory = runs.get("memory") or {}
    if memory.get("runs"):
        lines += ["", memory_text(memory, render)]
    return "\n".join(lines)


def memory_text(memory: dict, render) -> str:
    """Published peak memory (reserved by the caching allocator) against the planner's live tensors."""
    def gib(x: float) -> str:
        return f"{x / (1 << 30):.1f} GiB"

    frag, top = 100 * memory["allocator_fragmentation"], 100 * memory["allocator_fragmentation_max"]
    table = render(["source", "run", "published reserved", "hardy allocated", f"hardy reserved (+{frag:.0f}%)",
                    "error", f"reserved/allocated in 1-{1 / (1 - top / 100):.2f}"],
                   [[r["source"], r["case"], gib(r["published_reserved_bytes"]), gib(r["predicted_allocated_bytes"]),
                     gib(r["predicted_reserved_bytes"]), f"{100 * r['error']:+.1f}%",
                     "yes" if r["in_cited_range"] else "NO"] for r in memory["runs"]])
    return (f"{table}\nmemory: MAPE {100 * memory['mape']:.1f}%, mean error {100 * memory['mean_error']:+.1f}% over "
            f"{len(memory['runs'])} runs; {memory['in_cited_range']} in the allocator's cited range (fragmentation "
            f"{frag:.0f}% of reserved on average, up to {top:.0f}%: GMLake, arXiv 2401.08156)")


def register_hardware(group) -> None:
    p = group.add_parser("hardware", help="list the hardware catalogue, or describe one entry / probe profile")
    p.add_argument("name", nargs="?", help="an entry or probe:FILE")
    p.add_argument("--catalogue", default=None)
    p.set_defaults(func=run_hardware)


def run_hardware(args) -> int:
    from hardy.plan.report import print_rows, table

    if args.name:
        print(print_rows(describe_hardware(get_hardware(args.name, args.catalogue))))
        return 0
    rows = []
    for name, hw in load_catalogue(args.catalogue).items():
        dtype = "bf16" if "bf16" in hw.peak_flops else "fp32"
        price = "-" if hw.price_per_device_hour is None else f"${hw.price_per_device_hour:.2f}"
        rows.append([name, hw.kind, f"{hw.peak_flops[dtype] / 1e12:,.0f} {dtype}", f"{hw.memory_bytes / 1e9:,.0f} GB",
                     f"{hw.memory_bandwidth / 1e9:,.0f} GB/s", hw.devices_per_node, price, hw.date])
    print(table(["name", "kind", "peak TFLOP/s", "memory", "bandwidth", "per node", "$/device-h", "date"], rows,
                align_right=False))
    return 0
