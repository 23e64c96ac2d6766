"""Tensor-parallel inference on N processes (`hardy generate --tp N`), the way multi-socket CPU
servers run models one socket cannot: torchrun starts one process per socket/NUMA node, each holds a
1/N slice of every attention and MLP matrix (the trainer's column/row plan: DTensor for float
weights, sliced codes and scales for quantized ones), and each attention and MLP ends in one
all-reduce. Logits come out replicated, so every rank
samples the same token; rank 0 prints.
"""
from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import get_args_parser, run

from hardy.compress.store import MANIFEST, is_compressed_dir
from hardy.compress.tensor_parallel import check_split, shard_quantized_linear
from hardy.errors import HardyError
from hardy.formats.gguf_io import native_layout
from hardy.formats.quantized import QuantSpec
from hardy.loading.load import resolve_source
from hardy.parallel.distributed import init_distributed
from hardy.parallel.parallelize import apply_tp, check_tp_degree, tp_kind


def relaunch_under_torchrun(nproc: int, argv: list[str], threads: int | None) -> int:
    """Run `python -m hardy ARGV` on `nproc` local processes (torchrun, no restarts)."""
    total = threads or os.cpu_count() or 1
    os.environ["OMP_NUM_THREADS"] = str(max(1, total // nproc))
    args = get_args_parser().parse_args(["--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "0",
                                         "--module", "hardy", *argv])
    try:
        run(args)
    except SignalException as e:  # torchrun passed the signal on to the workers and waited for them
        if e.sigval in (signal.SIGTERM, signal.SIGINT):
            return 0
        print(f"hardy: error: stopped by {e.sigval.name}", file=sys.stderr)
        return 1
    except Exception as e:  # torchrun's ChildFailedError: the workers printed their own errors
        print(f"hardy: error: tensor-parallel workers failed ({type(e).__name__})", file=sys.stderr)
        return 1
    return 0


def cpu_only(args) -> None:
    """`--tp` shards over CPU processes (gloo, one per socket): `--device auto` means the CPU there, and
    CUDA asked for by name is refused rather than silently dropped."""
    if args.device not in ("auto", "cpu"):
        raise HardyError(f"--tp runs tensor-parallel CPU processes over gloo (one per socket); --device "
                         f"{args.device} is for one process: drop --tp, or use --device cpu")
    args.device = "cpu"


def check_tp(spec: str, cfg, tp: int, gguf: str = "float") -> None:
    """Refuse, before any process starts, a degree the model cannot be split into."""
    check_tp_degree(cfg, tp)
    if gguf == "native":
        kind, path = resolve_source(spec)
        if kind == "gguf":
            for name, qspec, shape in native_layout(path):
                kind = tp_kind(name)
                if kind:
                    check_split(name, qspec, shape, kind, tp)
    if is_compressed_dir(Path(spec)):
        try:
            tensors = json.loads((Path(spec) / MANIFEST).read_text())["tensors"]
            for name, entry in tensors.items():
                kind = tp_kind(name)
                if kind:
                    check_split(name, QuantSpec.from_dict(entry), tuple(entry["shape"]), kind, tp)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise HardyError(f"{spec}: unreadable {MANIFEST} ({e})") from None


def shard_model(model, tp: int):
    """Shard a loaded (float or quantized) model over the torchrun world; returns the distributed environment."""
    env = init_distributed("gloo")
    if env.world_size != tp:
        raise HardyError(f"--tp {tp} but {env.world_size} processes were started")

    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    apply_tp(model, mesh, shard_other=shard_quantized_linear)
    # the launcher's share of --threads, at most the CPUs this process may run on (its NUMA node's)
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(1, min(int(os.environ.get("OMP_NUM_THREADS", "1")), allowed)))
    return env
