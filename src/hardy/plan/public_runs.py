"""Published GPU training runs the planner is checked against (`hardy plan validate`): tokens/s per GPU,
per source and per device family, and a leave-one-source-out error.

Each run is a configuration that ran, as its source publishes it, and the throughput it reached. The
planner predicts it from the catalogue unchanged. Some catalogue constants were taken from a source that
is also in this set (a hardware entry's `calibrated_on`): those runs are reported apart, and the
leave-one-source-out error re-derives every such constant from the other sources' runs before predicting
the held-out source's, so no run is predicted by a constant fitted to it.
"""
from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

from hardy.model.config import ModelConfig
from hardy.plan.arch import Arch, GPTConfig, arch_from_gpt, arch_from_llama, load_arch
from hardy.plan.hardware import Hardware, load_catalogue
from hardy.plan.train import TrainJob, plan_train

SOURCES = {
    "llm-foundry": "MosaicML llm-foundry, scripts/train/benchmarking/README.md (MPT, FSDP full shard, 8 GPUs, "
                   "amp_bf16, H100 80GB and A100 80GB tables)",
    "torchtitan": "pytorch/torchtitan docs/performance.md (Llama 2 / 3, FSDP2 on 64 A100 80GB; \"selective layer\" "
                  "= every 2nd block checkpointed) and benchmarks/llama3_h100_202412_torchtitan.md (H100 96GB HBM2e "
                  "at 500 W; Tables 1-3: Llama 3.1 8B, FSDP2, eager / torch.compile / + Float8 tensorwise, and FSDP x "
                  "CP at 32k-256k tokens; Table 4: Llama 3.1 70B, FSDP 32 x TP 8 with and without async TP) and "
                  "benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (the same H100s, June 2025: Llama 3.1 70B "
                  "FSDP 32 x TP 8 and 8B FSDP 8 x TP 8, compiled, vanilla and async TP, bf16 and Float8 tensorwise)",
    "korthikanti-2022": "Korthikanti et al. 2022, arXiv 2205.05198, Tables 3 and 5 (Megatron-LM on A100 80GB; "
                        "tokens/s per GPU = global batch x 2048 / iteration time / GPUs)",
    "trainy-whitefiber": "Trainy on WhiteFiber, pytorch/torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md "
                         "(Llama 3.1 8B on 4 and 8 hosts of 8 H200, 400 Gb/s RDMA per GPU; torchtitan llama3_8b.toml "
                         "at e7c0cae: seq 8192, op-level selective checkpointing, FSDP over all ranks; local batch 2, "
                         "torch.compile, Float8 tensorwise)",
    "kempnerforge": "KempnerInstitute/KempnerForge benchmarks/weak_scaling_160gpu/README.md (Llama-3-style 13B and "
                    "70B, TP 4 x FSDP, full activation checkpointing, H200 141GB, 4 per node; tokens/s per GPU = "
                    "the published aggregate / GPUs) and kempnerforge/distributed/parallel.py (the model cast to "
                    "bf16 before training: no fp32 master weights)",
}

# MPT (d_model, n_layers, n_heads), vocabulary 50,368; Llama shapes as their configs give them
MPT = {"350m": (1024, 24, 16), "760m": (1536, 24, 12), "1b": (2048, 24, 16), "3b": (2560, 32, 20),
       "7b": (4096, 32, 32), "13b": (5120, 40, 40), "30b": (7168, 48, 56)}
LLAMA = {"llama3-8b": dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                           max_seq_len=8192),
         "llama2-13b": dict(vocab_size=32000, dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, ffn_dim=13824,
                            max_seq_len=4096),
         "llama2-70b": dict(vocab_size=32000, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                            max_seq_len=4096),
         "llama3-70b": dict(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                            max_seq_len=8192),
         "kempner-13b": dict(vocab_size=128256, dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, ffn_dim=17920,
                             max_seq_len=4096)}


@dataclass(frozen=True)
class PublicRun:
    source: str  # a SOURCES key
    hardware: str  # the catalogue entry it ran on
    model: str  # an MPT or LLAMA key, or a catalogue architecture (gpt-22b, ...)
    gpus: int
    seq: int
    micro_batch: int
    grad_accum: int  # micro-batches per step and data-parallel rank
    tokens_per_gpu_s: float  # published
    ac: str = "none"
    tp: int = 1
    pp: int = 1
    zero: int = 3
    sequence_parallel: bool = False
    interleaved_stages: int = 1  # > 1: the interleaved pipeline schedule
    per_node: int | None = None  # GPUs per node where the run's nodes differ from the catalogue entry's
    master_weights: bool = True  # False: the run keeps weights and AdamW states in bf16 (no fp32 copy)
    cp: int = 1
    fp8: str = "none"
    compile: bool = False
    async_tp: bool = False
    loss: str | None = None  # "full": torchtitan's cross-entropy over fp32 logits, "compiled": compiled (2025 on)
    memory_gib: float | None = None  # published peak memory per GPU: torchtitan's max_reserved (GiB)
    fp8_all_gather: bool = False  # torchao's FSDP float8 all-gather, where the run's command enables it
    sp_style: str = "megatron"  # "dtensor": torchtitan's sequence parallelism (the gathered inputs kept)

    @property
    def label(self) -> str:
        par = f" tp{self.tp} pp{self.pp}" if self.tp * self.pp > 1 else ""
        par += f" cp{self.cp}" if self.cp > 1 else ""
        extra = "".join((" compiled" if self.compile else "", f" fp8 {self.fp8}" if self.fp8 != "none" else "",
                         " fp8-all-gather" if self.fp8_all_gather else "", " async-tp" if self.async_tp else ""))
        return f"{self.model} {self.hardware} x{self.gpus}{par} s{self.seq} mb{self.micro_batch} ac {self.ac}{extra}"


def _foundry(hw, model, seq, mb, ga, ac, tps):
    return PublicRun("llm-foundry", hw, model, 8, seq, mb, ga, tps, ac)


def _titan(model, seq, mb, ac, tps, hardware="a100-80g", gpus=64, **kw):
    # torchtitan's loss: cross_entropy(pred.flatten(0, 1).float(), labels) (train.py at 9dec370)
    return PublicRun("torchtitan", hardware, model, gpus, seq, mb, 1, tps, ac, loss="full", **kw)


def _titan_h100(model, gpus, seq, mb, ac, tps, **kw):
    """benchmarks/llama3_h100_202412_torchtitan.md: FSDP2 (+ TP with sequence parallelism, + CP), bf16
    with fp32 gradient reduction, on the 96 GB H100 at 500 W."""
    sp = kw.get("tp", 1) > 1
    return PublicRun("torchtitan", "h100-hbm2e-96gb-500w", model, gpus, seq, mb, 1, tps, ac, sequence_parallel=sp,
                     **{"loss": "full", **kw}, sp_style="dtensor" if sp else "megatron")


def _kempner(model, gpus, mb, aggregate):
    # build_parallel_model casts the TP-sharded model to bf16 (model.to(dtype=param_dtype)): FSDP2 keeps
    # bf16 shards, and AdamW's m and v follow the parameters' dtype
    return PublicRun("kempnerforge", "h200", model, gpus, 4096, mb, 4, aggregate / gpus, "full", tp=4, per_node=4,
                     master_weights=False)


def _megatron(model, t, p, gpus, batch, mb, stages, ac, step_s):
    sp = ac == "selective"
    return PublicRun("korthikanti-2022", "a100-80g", model, gpus, 2048, mb, batch // (mb * gpus // (t * p)),
                     batch * 2048 / step_s / gpus, ac, t, p, zero=0, sequence_parallel=sp, interleaved_stages=stages)


RUNS = (
    _foundry("h100-sxm", "760m", 2048, 24, 2, "none", 63147), _foundry("h100-sxm", "1b", 2048, 14, 1, "none", 45455),
    _foundry("h100-sxm", "3b", 4096, 5, 6, "none", 20964), _foundry("h100-sxm", "7b", 2048, 6, 1, "none", 10643),
    _foundry("h100-sxm", "7b", 4096, 16, 2, "full", 8611), _foundry("h100-sxm", "13b", 2048, 2, 1, "none", 4792),
    _foundry("h100-sxm", "30b", 2048, 3, 21, "full", 2002),
    _foundry("a100-80g", "350m", 2048, 32, 2, "none", 58782), _foundry("a100-80g", "1b", 2048, 14, 4, "none", 20513),
    _foundry("a100-80g", "3b", 4096, 5, 6, "none", 9457), _foundry("a100-80g", "7b", 2048, 6, 2, "none", 4641),
    _foundry("a100-80g", "13b", 2048, 2, 3, "none", 2262), _foundry("a100-80g", "30b", 2048, 3, 21, "full", 916),
    _titan("llama3-8b", 8192, 1, "every:2", 2904), _titan("llama2-13b", 4096, 2, "none", 2162),
    _titan("llama3-70b", 8192, 1, "full", 331), _titan("llama2-13b", 4096, 2, "every:2", 1914),
    _titan("llama2-70b", 4096, 2, "full", 353),
    # Tables 1 and 3: Llama 3.1 8B, local batch 2, op-level selective checkpointing; eager, compiled, + fp8
    *(_titan_h100("llama3-8b", gpus, 8192, 2, "selective-op", tps, memory_gib=gib, **kw)
      for gpus, tables in ((8, ((5762, 82.4), (6667, 77.0), (8532, 76.8))),
                           (128, ((5605, 67.0), (6514, 62.0), (8380, 61.8))))
      for (tps, gib), kw in zip(tables, ({}, {"compile": True}, {"compile": True, "fp8": "tensorwise"}))),
    # Table 2: Llama 3.1 8B on 8 GPUs, local batch 1, full checkpointing, compiled + fp8, FSDP x CP
    *(_titan_h100("llama3-8b", 8, seq, 1, "full", tps, cp=cp, compile=True, fp8="tensorwise", memory_gib=gib)
      for seq, cp, tps, gib in ((32768, 1, 3890, 83.9), (65536, 2, 2540, 84.2), (131072, 4, 1071, 84.0),
                                (262144, 8, 548, 84.5))),
    # Table 4: Llama 3.1 70B on 256 GPUs, FSDP 32 x TP 8, local batch 16, full checkpointing, compiled + fp8
    *(_titan_h100("llama3-70b", 256, 8192, 16, "full", tps, tp=8, compile=True, fp8="tensorwise", async_tp=a,
                  memory_gib=gib) for a, tps, gib in ((False, 829, 71.9), (True, 876, 67.6))),
    # asyncTP_llama3_h100_2025-06: compiled (the loss too, components/loss.py at 820504e), vanilla and async TP,
    # bf16 and Float8 tensorwise. Its Float8 rowwise rows are left out: the benchmark itself flags their
    # baseline as a performance bug being fixed (torchtitan issue 1207).
    *(_titan_h100(model, gpus, 8192, mb, ac, tps, tp=8, compile=True, fp8=fp8, async_tp=a, loss="compiled")
      for model, gpus, mb, ac, table in (("llama3-70b", 256, 16, "full", ((597.3, 652.4), (809.8, 942.4))),
                                         ("llama3-8b", 64, 12, "selective-op", ((4378, 4809.4), (5078.1, 5570.1))))
      for fp8, pair in zip(("none", "tensorwise"), table) for a, tps in zip((False, True), pair)),
    # Table 3's configurations; Table 5's iteration times, full recompute and selective + sequence parallel
    _megatron("gpt-22b", 8, 1, 8, 4, 4, 1, "full", 1.42), _megatron("gpt-22b", 8, 1, 8, 4, 4, 1, "selective", 1.10),
    _megatron("gpt-175b", 8, 8, 64, 64, 1, 3, "full", 18.13),
    _megatron("gpt-175b", 8, 8, 64, 64, 1, 3, "selective", 13.75),
    _megatron("gpt-530b", 8, 35, 280, 280, 1, 3, "full", 49.05),
    _megatron("gpt-530b", 8, 35, 280, 280, 1, 3, "selective", 37.83),
    _megatron("gpt-1t", 8, 64, 512, 512, 1, 1, "full", 94.42),
    _megatron("gpt-1t", 8, 64, 512, 512, 1, 1, "selective", 71.49),
    # torchtitan at e7c0cae compiles the loss with the model (components/loss.py)
    *(PublicRun("trainy-whitefiber", "h200", "llama3-8b", gpus, 8192, 2, 1, tps, "selective-op", compile=True,
                fp8="tensorwise", loss="compiled", memory_gib=gib, fp8_all_gather=True)
      for gpus, tps, gib in ((32, 10938, 47.96), (64, 10753, 46.97))),
    *(_kempner("kempner-13b", g, 4, tps) for g, tps in ((8, 29860), (32, 110373), (64, 216507), (128, 423306),
                                                        (160, 534644))),
    *(_kempner("llama3-70b", g, 2, tps) for g, tps in ((8, 3623), (32, 18688), (64, 35824), (96, 52190),
                                                       (128, 69985), (160, 85571))),
)
# torchtitan's A100 "selective op" rows are not listed: they ran with torch.compile in part, which the
# planner does not model yet.

# Configurations a source reports as out of memory: the planner must predict that they do not fit.
# torchtitan docs/performance.md (64 A100 80GB, FSDP2): Llama 2 70B at local batch 2 with "selective layer"
# (every 2nd block) and with "selective op" checkpointing, both OOM (its full-checkpointing run is above).
OOM_RUNS = (_titan("llama2-70b", 4096, 2, "every:2", 0.0), _titan("llama2-70b", 4096, 2, "selective-op", 0.0))


def arch_for(model: str, seq: int) -> Arch:
    if model in LLAMA:  # the context a run trains at (torchtitan's CP runs exceed the config's)
        cfg = LLAMA[model]
        return arch_from_llama(ModelConfig(**{**cfg, "max_seq_len": max(cfg["max_seq_len"], seq)}, name=model))
    if model in MPT:
        d, layers, heads = MPT[model]
        return arch_from_gpt(GPTConfig(vocab_size=50368, dim=d, n_layers=layers, n_heads=heads, max_seq_len=seq,
                                       dropout=False, attention="flash", name=f"mpt-{model}"))
    return load_arch(model)


@dataclass(frozen=True)
class RunResult:
    run: PublicRun
    predicted: float  # tokens/s per GPU
    fits: bool
    shares_source: bool  # a constant of its hardware entry was taken from its own source

    @property
    def error(self) -> float:
        return self.predicted / self.run.tokens_per_gpu_s - 1


def predict(run: PublicRun, hw: Hardware) -> tuple[float, bool]:
    """(tokens/s per GPU, fits in memory) the planner gives for `run` on `hw`."""
    plan = plan_for(run, hw)
    return plan.tokens_per_s / run.gpus, plan.fits


def plan_for(run: PublicRun, hw: Hardware):
    """The planner's plan of `run` on `hw`."""
    dp = run.gpus // (run.tp * run.pp * run.cp)
    if run.per_node:
        hw = dataclasses.replace(hw, devices_per_node=run.per_node)
    job = TrainJob(arch=arch_for(run.model, run.seq), hw=hw, devices=run.gpus, seq=run.seq,
                   global_batch_tokens=dp * run.micro_batch * run.grad_accum * run.seq, tp=run.tp, pp=run.pp,
                   zero=run.zero, ac=run.ac, micro_batch=run.micro_batch, precision="bf16",
                   sequence_parallel=run.sequence_parallel,
                   schedule="interleaved" if run.interleaved_stages > 1 else "1f1b",
                   virtual_stages=run.interleaved_stages, master_weights=run.master_weights, cp=run.cp,
                   fp8=run.fp8, compile=run.compile, async_tp=run.async_tp, loss=run.loss,
                   fp8_all_gather=run.fp8_all_gather, sp_style=run.sp_style)
    return plan_train(job)


def evaluate(runs=RUNS, catalogue=None) -> list[RunResult]:
    entries = load_catalogue(catalogue)
    out = []
    for run in runs:
        hw = entries[run.hardware]
        predicted, fits = predict(run, hw)
        out.append(RunResult(run, predicted, fits, run.source in dict(hw.calibrated_on).values()))
    return out


def error_summary(results: list[RunResult]) -> dict:
    """n, MAPE, mean signed error, worst |error| and the share within ±25%."""
    errors = [r.error for r in results]
    if not errors:
        return {"n": 0}
    return {"n": len(errors), "mape": statistics.fmean(abs(e) for e in errors), "mean_error": statistics.fmean(errors),
            "worst": max(errors, key=abs), "within_25": sum(abs(e) <= 0.25 for e in errors) / len(errors)}


def grouped(results: list[RunResult], key) -> dict[str, dict]:
    groups: dict[str, list[RunResult]] = {}
    for r in results:
        groups.setdefault(key(r), []).append(r)
    return {name: error_summary(rs) for name, rs in sorted(groups.items())}


FIT_GRID = tuple(round(0.30 + 0.01 * i, 2) for i in range(66))  # efficiencies 0.30 .. 0.95


def refit(hw: Hardware, field: str, runs: list[PublicRun]) -> float:
    """The value of `hw`'s constant `field` that minimizes the planner's MAPE over `runs` (grid search)."""
    def mape(value: float) -> float:
        trial = dataclasses.replace(hw, **{field: value})
        return statistics.fmean(abs(predict(r, trial)[0] / r.tokens_per_gpu_s - 1) for r in runs)

    return min(FIT_GRID, key=mape)


def leave_one_source_out(runs=RUNS, catalogue=None) -> dict:
    """For each source: every catalogue constant taken from it is re-derived from the other sources' runs
    on that hardware, then the source's runs are predicted. Returns the per-source summaries, the refits,
    and the overall MAPE; a constant with no other source to fit on is named in `unfittable`."""
    entries = load_catalogue(catalogue)
    held_out, refits, unfittable = [], {}, []
    for source in sorted({r.source for r in runs}):
        mine = [r for r in runs if r.source == source]
        for name in sorted({r.hardware for r in mine}):
            hw = entries[name]
            for field, origin in hw.calibrated_on:
                if origin != source:
                    continue
                others = [r for r in runs if r.hardware == name and r.source != source]
                if not others:
                    unfittable.append(f"{name}.{field}")
                    continue
                value = refit(hw, field, others)
                refits[f"{source}: {name}.{field}"] = {"catalogue": getattr(hw, field), "refit": value}
                hw = dataclasses.replace(hw, **{field: value})
            for run in (r for r in mine if r.hardware == name):
                predicted, fits = predict(run, hw)
                held_out.append(RunResult(run, predicted, fits, False))
    return {"overall": error_summary(held_out), "by_source": grouped(held_out, lambda r: r.run.source),
            "refits": refits, "unfittable": unfittable}


def report(catalogue=None) -> dict:
    """What `hardy plan validate --json` gives for the GPU runs."""
    results = evaluate(RUNS, catalogue)
    independent = [r for r in results if not r.shares_source]
    return {
        "runs": [{"source": r.run.source, "case": r.run.label, "hardware": r.run.hardware,
                  "published": r.run.tokens_per_gpu_s, "predicted": r.predicted, "error": r.error, "fits": r.fits,
                  "shares_source_with_a_constant": r.shares_source} for r in results],
        "sources": SOURCES,
        "overall": error_summary(results),
        "independent": error_summary(independent),
        "by_source": grouped(results, lambda r: r.run.source),
        "by_hardware": grouped(results, lambda r: r.run.hardware),
        "leave_one_source_out": leave_one_source_out(RUNS, catalogue),
        "predicted_to_fit": sum(r.fits for r in results),
        "out_of_memory": out_of_memory(catalogue),
        "memory": memory_comparison(catalogue),
    }


# PyTorch's caching allocator reserves more than the tensors it holds: its fragmentation averages 15% of
# reserved memory, up to 33%, over eight LLMs trained on A100 80GB (Guo et al., GMLake, ASPLOS 2024,
# arXiv 2401.08156, abstract). Published reserved memory is compared with the planner's peak of live
# tensors grossed up by the average, and said to be in the cited range when reserved ÷ allocated is
# between 1 and 1 ÷ (1 − 0.33).
ALLOCATOR_FRAGMENTATION = 0.15
ALLOCATOR_FRAGMENTATION_MAX = 0.33
GIB = 1 << 30


def memory_comparison(catalogue=None, runs=RUNS) -> dict:
    """Published peak memory (torchtitan's max_reserved) against the planner's: its peak of live tensors
    (allocated) and that peak as the caching allocator would reserve it."""
    entries = load_catalogue(catalogue)
    rows = []
    for run in (r for r in runs if r.memory_gib):
        allocated = plan_for(run, entries[run.hardware]).memory["peak"]
        reserved = allocated / (1 - ALLOCATOR_FRAGMENTATION)
        published = run.memory_gib * GIB
        rows.append({"source": run.source, "case": run.label, "published_reserved_bytes": published,
                     "predicted_allocated_bytes": allocated, "predicted_reserved_bytes": reserved,
                     "error": reserved / published - 1,
                     "in_cited_range": allocated <= published <= allocated / (1 - ALLOCATOR_FRAGMENTATION_MAX)})
    errors = [r["error"] for r in rows]
    return {"allocator_fragmentation": ALLOCATOR_FRAGMENTATION,
            "allocator_fragmentation_max": ALLOCATOR_FRAGMENTATION_MAX, "runs": rows,
            "mape": statistics.fmean(abs(e) for e in errors) if errors else None,
            "mean_error": statistics.fmean(errors) if errors else None,
            "in_cited_range": sum(r["in_cited_range"] for r in rows)}


def out_of_memory(catalogue=None) -> list[dict]:
    """The published out-of-memory configurations, each with the planner's peak and verdict."""
    entries = load_catalogue(catalogue)
    out = []
    for run in OOM_RUNS:
        hw = entries[run.hardware]
        plan = plan_for(run, hw)
        out.append({"source": run.source, "case": run.label, "hardware": run.hardware, "published": "OOM",
                    "predicted_peak_bytes": plan.memory["peak"], "device_bytes": hw.memory_bytes,
                    "predicted_to_fit": plan.fits})
    return out
