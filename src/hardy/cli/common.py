"""Arguments shared by several subcommands."""
from __future__ import annotations

import argparse
import os
import sys

import torch

from hardy.compress.qlinear import set_prefill_dtype
from hardy.devices import DTYPES, bind_to_numa_node, compute_device, resolve_device
from hardy.errors import HardyError
from hardy.loading.load import check_fits, is_quantized_source, load_model, set_threads

EXIT_USAGE = 2


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit code 2, like every other user error
        self.exit(EXIT_USAGE, f"hardy: error: {message}\n")




def add_model_args(p, threads: bool = True, gguf: bool = True) -> None:
    """`gguf=False` for commands that need float weights (compression): no --gguf-weights."""
    p.add_argument("--model", required=True,
                   help="smollm2-135m, a .gguf file, or a model directory (hardy export / Hugging Face layout)")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="compute dtype (default fp32)")
    add_device_arg(p)
    if gguf:
        add_gguf_arg(p)
    if threads:
        p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")


def add_gguf_arg(p) -> None:
    p.add_argument("--gguf-weights", default="native", choices=("native", "float"),
                   help="a quantized GGUF: native (default) keeps its Q4_0/Q4_1/Q8_0/K-quant matrices "
                        "quantized, in the memory the file needs; float dequantizes them to --dtype")


def add_device_arg(p) -> None:
    p.add_argument("--device", default="auto",
                   help="auto (default: CUDA when present for float models; quantized ones stay on the CPU, "
                        "where hardy's int8/int4 kernels run), cpu, cuda or cuda:N")


def requested_device(args) -> torch.device:
    """The device `--device` names for `--model` (auto: see add_device_arg)."""
    spec = getattr(args, "device", "auto")
    gguf = getattr(args, "gguf_weights", "float")
    return resolve_device(spec, quantized=spec in ("auto", None) and is_quantized_source(args.model, gguf))


def add_tp_args(p) -> None:
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel processes (one per CPU socket; started with torchrun, gloo)")
    p.add_argument("--numa", choices=("auto", "off"), default="auto",
                   help="with --tp on a multi-socket machine, pin each process to one NUMA node's CPUs "
                        "before it loads, so its weights sit in that node's memory (auto); off: leave "
                        "placement to the OS")


def load_from_args(args, need_tokenizer: bool = True):
    set_threads(getattr(args, "threads", None))
    tp_slices = None
    if getattr(args, "tp", 1) > 1 and "RANK" in os.environ:  # a --tp worker: read only this rank's slices
        from hardy.compress.tensor_parallel import rank_slices  # start-up time: torch.distributed only for --tp

        if getattr(args, "numa", "off") == "auto":  # before the first allocation: pages go where they are touched

            bound = bind_to_numa_node(int(os.environ.get("LOCAL_RANK", 0)),
                                      int(os.environ.get("LOCAL_WORLD_SIZE", args.tp)))
            if bound:
                node, cpus = bound
                print(f"hardy: rank {os.environ['RANK']} on NUMA node {node} ({len(cpus)} CPUs)", file=sys.stderr)
        tp_slices = rank_slices(int(os.environ["RANK"]), args.tp)
    device = requested_device(args)
    if device.type == "cpu" and tp_slices is None:
        check_fits(args.model, DTYPES[args.dtype], getattr(args, "gguf_weights", "float"))
    loaded = load_model(args.model, dtype=DTYPES[args.dtype], device=device,
                        gguf=getattr(args, "gguf_weights", "float"), progress=sys.stderr.isatty(),
                        tp_slices=tp_slices)
    if need_tokenizer and loaded.tokenizer is None:
        raise HardyError(f"{args.model}: the model has no tokenizer")
    return loaded


def use_fast_prefill(loaded) -> None:
    """Inference (generate, serve, eval rank): quantized layers run many-token products in bf16 where the
    CPU has native bf16 dot products (~3.7x fp32's GEMM rate here, BENCHMARKS.md); perplexity keeps fp32."""
    from hardy.ops.matmul_probe import has_fast_bf16

    device = compute_device(loaded.model)
    if device.type == "cpu" and has_fast_bf16(device):
        set_prefill_dtype(loaded.model, torch.bfloat16)


def add_prefill_dtype_arg(p) -> None:
    p.add_argument("--prefill-dtype", default="auto", choices=("auto", "fp32", "bf16"),
                   help="GEMM dtype of quantized layers' many-token products: auto (bf16 where the CPU has native "
                        "bf16 dot products, as serve runs them; else fp32), fp32 (exact), bf16")


def apply_prefill_dtype(loaded, choice: str) -> None:
    """--prefill-dtype on a loaded model (add_prefill_dtype_arg)."""
    if choice == "auto":
        use_fast_prefill(loaded)
    else:
        set_prefill_dtype(loaded.model, torch.bfloat16 if choice == "bf16" else torch.float32)


def add_kv_args(p) -> None:
    """The KV cache of generate and serve (hardy.infer.kv)."""
    p.add_argument("--context", type=int, default=None,
                   help="positions per request's KV cache (default: the model's maximum, at most 4096)")
    p.add_argument("--kv-dtype", default="bf16", choices=("bf16", "fp16", "fp32"),
                   help="the KV cache's dtype (default bf16: half fp32's memory, fp32's range)")


def kv_settings(args, model, sequences: int, check: bool = True):
    """(context, kv dtype, budget) for `sequences` requests; the budget's line says what the cache may
    take, and a cache that cannot hold even one full request is refused (exit 2; `check` False: the
    caller checks, after tensor-parallel ranks agree on one capacity)."""
    from hardy.infer.kv import KV_DTYPES, kv_budget
    from hardy.serve.engine import context_length

    if args.context is not None and args.context < 2:
        raise HardyError("--context must be >= 2")
    if args.context is not None and args.context > model.cfg.max_seq_len:
        raise HardyError(f"--context {args.context} exceeds the model's maximum of {model.cfg.max_seq_len} positions")
    context = context_length(model, args.context)
    dtype = KV_DTYPES[args.kv_dtype]
    budget = kv_budget(model, sequences, context, dtype)
    return context, dtype, budget.check() if check else budget


def weights_line(loaded) -> str:
    from hardy.infer.kv import GiB, model_bytes

    return f"weights {model_bytes(loaded.model) / GiB:.2f} GiB ({loaded.config.family}, {loaded.config.n_layers} layers)"


def add_speculate_args(p) -> None:
    """Speculative decoding for generate and serve (hardy.infer.speculate)."""
    p.add_argument("--speculate", default="off", metavar="off|ngram|draft:MODEL",
                   help="check several guessed tokens per decode step (greedy requests; output unchanged): "
                        "ngram guesses by prompt lookup, draft:MODEL with a small model of the same vocabulary")
    p.add_argument("--speculate-tokens", type=int, default=6, metavar="K",
                   help="the most tokens guessed per step (default 6; fewer while guesses are rejected)")


def parse_speculation(args):
    """The SpeculationConfig of --speculate (None when off); a bad value fails before any load."""
    from hardy.infer.speculate import parse_speculate

    return parse_speculate(args.speculate, args.speculate_tokens)


def speculator_for(args, spec, loaded, sequences: int, context: int, kv_dtype):
    """The Speculator of `spec` (None when off), its draft model loaded like --model and checked against it."""
    from hardy.infer.speculate import DraftModel, Speculator, check_draft

    if spec is None:
        return None
    if spec.mode == "ngram":
        return Speculator(spec)
    draft = load_model(spec.draft_model, dtype=DTYPES[args.dtype], device=compute_device(loaded.model),
                       gguf=getattr(args, "gguf_weights", "float"), progress=sys.stderr.isatty())
    check_draft(loaded.model, draft.model, context)
    use_fast_prefill(draft)
    return Speculator(spec, DraftModel(draft.model, sequences, context, kv_dtype))
