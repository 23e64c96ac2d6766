"""hardy probe: measure this machine (matmul, memory, disk, all-reduce) and write a hardware profile."""
from __future__ import annotations

import json
from pathlib import Path

from hardy.errors import HardyError
from hardy.fsio import write_json_atomic


def register(sub) -> None:
    p = sub.add_parser("probe", help="measure this machine and write a hardware profile "
                                     "(use it with --hardware probe:FILE)")
    p.add_argument("--out", type=Path, default=Path("hardware-profile.json"),
                   help="profile to write (default: hardware-profile.json)")
    p.add_argument("--dir", type=Path, default=Path("."), help="directory whose disk is measured (default: .)")
    p.add_argument("--quick", action="store_true", help="smaller measurements (~15 s instead of ~1 min)")
    p.add_argument("--json", action="store_true", help="print the profile as JSON instead of a table")
    p.set_defaults(func=run)


def _g(x: float) -> str:
    return f"{x / 1e9:,.1f}"


def table(profile: dict) -> list[tuple[str, str]]:
    cpu, gpu = profile["cpu"], profile.get("gpu")
    flags = ", ".join(f for f, on in cpu["flags"].items() if on) or "none of interest"
    rows = [("host", f"{profile['hostname']} ({profile['platform']})"),
            ("torch / python", f"{profile['torch']} / {profile['python']}"),
            ("cpu", f"{cpu['model']}: {cpu['physical_cores']} cores, {cpu['logical_cpus']} logical, "
                    f"{cpu['sockets'] or '?'} socket(s)"),
            ("isa", flags), ("ram", f"{cpu['memory_total_bytes'] / 1e9:.1f} GB total, "
                                   f"{cpu['memory_available_bytes'] / 1e9:.1f} GB available")]
    if gpu:
        rows.append(("gpu", f"{gpu['count']} x {gpu['name']}, {gpu['memory_bytes'] / 1e9:.1f} GB"))
    mm = profile["matmul"]
    for name, d in mm["dtypes"].items():
        sizes = " ".join(f"{r['size']}:{_g(r['flops'])}" for r in d["sizes"])
        rows.append((f"matmul {name} GFLOP/s", f"best {_g(d['best_flops'])}  (size:GFLOP/s {sizes})"))
    fp8 = mm.get("fp8")
    if fp8:
        sizes = " ".join(f"{r['size']}:{_g(r['flops'])}" for r in fp8.get("sizes", []))
        rows.append(("matmul fp8 GFLOP/s", f"not measured: {fp8['skipped']}" if "skipped" in fp8 else
                     f"best {_g(fp8['best_flops'])}  (size:GFLOP/s {sizes}; {fp8['recipe']})"
                     + ("" if mm.get("fast_fp8") else "; emulated, not planned")))
    rows.append(("fast bf16 / fp16", f"{mm['fast_bf16']} / {mm['fast_fp16']}  ({mm['threads']} threads)"))
    if profile.get("training_gemm"):
        tg, el = profile["training_gemm"], profile["elementwise"]
        by_width = " ".join(f"{w}:{100 * e:.0f}%" for w, e in sorted((tg.get("efficiency_by_width") or {}).items(), key=lambda kv: int(kv[0])))
        rows.append(("training GEMMs fp32", f"{_g(tg['flops'])} GFLOP/s = {100 * tg['efficiency']:.0f}% of the best "
                                            f"matmul (fwd + 2 bwd GEMMs; by width {by_width})"))
        attn = profile.get("attention")
        if attn:
            by_head = " ".join(f"{h}:{_g(r['flops'])}" for h, r in sorted(attn["by_head_dim"].items(), key=lambda kv: int(kv[0])))
            rows.append(("attention fwd+bwd", f"GFLOP/s by head size {by_head}  (causal SDPA, seq {attn['seq']})"))
        note = "a Llama layer's non-GEMM operators, fwd + bwd" if "layer" in el else "median of mul/add/silu/square-mean"
        rows.append(("elementwise ops GB/s", f"{_g(el['bandwidth'])}  ({note})"))
    gemv = profile.get("gemv")
    if gemv:
        by_width = " ".join(f"{w}:{_g(r)}" for w, r in sorted(gemv["bandwidth_by_width"].items(), key=lambda kv: int(kv[0])))
        rows.append(("decode GEMV fp32 GB/s", f"{_g(gemv['bandwidth'])}  (batch 1, {gemv.get('bytes', 64 << 20) >> 20} MiB of weights; by width {by_width})"))
    quant = profile.get("quant_gemv")
    if quant:
        by_width = " ".join(f"{w}:{_g(r)}" for w, r in sorted((quant.get("bandwidth_by_width") or {}).items(),
                                                              key=lambda kv: int(kv[0])))
        rows.append(("decode int4 kernel GB/s", f"{_g(quant['bandwidth'])}  (hardy's fused kernel, batch 1, "
                                                f"{quant['bytes'] >> 20} MiB of {quant['format']} weights"
                                                + (f"; by width {by_width})" if by_width else ")")))
        if "expert_bandwidth" in quant:
            shape = quant["expert_shape"]
            rows.append(("decode MoE experts GB/s", f"{_g(quant['expert_bandwidth'])}  (grouped kernel, "
                                                    f"{shape['top_k']} of {shape['experts']} experts of {shape['ffn']} x {shape['dim']}"
                                                    " per token)"))
    mem = profile["memory"]
    rows.append(("memory copy GB/s", f"{_g(mem['bandwidth'])}  ({mem['buffer_bytes'] >> 20} MiB, read+write)"))
    dispatch = profile["dispatch"]
    rows.append(("op overhead", f"{dispatch['op_overhead_s'] * 1e6:.1f} us per training op "
                                f"({dispatch['no_grad_op_s'] * 1e6:.1f} us without autograd)"))
    disk = profile["disk"]
    read_note = "" if disk["read_cache_dropped"] else "  (page cache not dropped)"
    rows.append(("disk write / read GB/s", f"{_g(disk['write_bandwidth'])} / {_g(disk['read_bandwidth'])}"
                                           f"{read_note}"))
    ar = profile["allreduce"]
    if "error" in ar:
        rows.append(("all-reduce", f"not measured: {ar['error']}"))
    else:
        rows.append(("all-reduce", f"{ar['backend']}, {ar['processes']} processes: latency "
                                   f"{ar['latency_s'] * 1e6:.0f} us, bus bandwidth {_g(ar['bus_bandwidth'])} GB/s"))
        for r in ar["sizes"]:
            rows.append((f"  {r['bytes'] >> 10} KiB", f"{r['seconds'] * 1e6:,.0f} us, "
                                                      f"bus {_g(r['bus_bandwidth'])} GB/s"))
    tr = profile.get("training_runtime")
    if tr:
        rows.append(("training runtime", f"not measured: {tr['error']}" if "error" in tr else
                     f"{tr['runtime_overhead_bytes'] / 2 ** 20:.1f} MiB beyond tensors, "
                     f"{tr.get('distributed_runtime_overhead_bytes', 0) / 2 ** 20:.1f} MiB per process of 2 "
                     f"(micro preset runs)"))
    rows.append(("probe took", f"{profile['duration_s']:.1f} s{' (quick)' if profile['quick'] else ''}"))
    return rows


def run(args) -> int:
    from hardy.ops.probe import run_probe

    out = Path(args.out)
    if not out.parent.is_dir():  # fail before a minute of measuring, not after
        raise HardyError(f"--out {out}: directory {out.parent} does not exist")
    from hardy.compress.kernel_rate import measure_quant_gemv
    from hardy.plan.runtime_probe import measure_training_runtime

    profile = run_probe(args.dir, quick=args.quick, progress=not args.json, measure_quant=measure_quant_gemv,
                        measure_runtime=measure_training_runtime)
    try:
        write_json_atomic(out, profile)
    except OSError as e:
        raise HardyError(f"cannot write {out}: {e.strerror or e}") from None
    if args.json:
        print(json.dumps(profile, indent=1, sort_keys=True))
        return 0
    for key, value in table(profile):
        print(f"  {key:<24} {value}")
    print(f"hardy: wrote {out} (use it with --hardware probe:{out})")
    return 0
