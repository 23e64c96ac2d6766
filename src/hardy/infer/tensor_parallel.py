"""Tensor-parallel inference on N processes (`hardy generate --tp N`), the way multi-socket CPU
servers run models one socket cannot: torchrun starts one process per socket/NUMA node, each holds a
1/N slice of every attention and MLP matrix (DTensor column/row sharding on gloo, the same plan the
trainer uses), and each layer ends in one all-reduce. Logits come out replicated, so every rank
samples the same token; rank 0 prints.
"""
from __future__ import annotations

import os
import sys

from hardy.errors import HardyError


def relaunch_under_torchrun(nproc: int, argv: list[str], threads: int | None) -> int:
    """Run `python -m hardy ARGV` on `nproc` local processes (torchrun, no restarts)."""
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import get_args_parser, run

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


def check_tp(spec: str, cfg, tp: int) -> None:
    from pathlib import Path

    from hardy.compress.store import is_compressed_dir

    if is_compressed_dir(Path(spec)):
        raise HardyError("tensor parallelism runs float models; a compressed model cannot be sharded yet")
    for what, n in (("n_heads", cfg.n_heads), ("n_kv_heads", cfg.n_kv_heads), ("ffn_dim", cfg.ffn_dim)):
        if n % tp:
            raise HardyError(f"--tp {tp} does not divide the model's {what} = {n}")


def shard_model(model, tp: int):
    """Shard a loaded (float) model over the torchrun world; returns the distributed environment."""
    import torch

    from hardy.parallel.distributed import init_distributed
    from hardy.parallel.parallelize import apply_tp

    env = init_distributed("gloo")
    if env.world_size != tp:
        raise HardyError(f"--tp {tp} but {env.world_size} processes were started")
    from hardy.compress.qlinear import quantized_modules

    if quantized_modules(model):
        raise HardyError("tensor parallelism runs float models (fp32/bf16); quantized layers cannot be sharded yet")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    apply_tp(model, mesh)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    return env
