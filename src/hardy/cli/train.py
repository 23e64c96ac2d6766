"""hardy train / hardy launch: train from a TOML config, single process or under torchrun."""
from __future__ import annotations

import os
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("train", help="train a model from a TOML config (works under torchrun)")
    p.add_argument("config", nargs="?", help="TOML config (e.g. configs/tiny-cpu.toml)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value (repeatable)")
    p.add_argument("--run-dir", default=None, help="where the run writes everything (default runs/<config name>)")
    p.add_argument("--resume", default=None, help="auto (newest complete checkpoint, the default), never, or a "
                                                  "checkpoint directory; same as --set checkpoint.resume=...")
    p.set_defaults(func=run_train)

    lp = sub.add_parser("launch", help="run `hardy train` on N local processes with torchrun's elastic agent")
    lp.add_argument("config")
    lp.add_argument("--nproc", type=int, required=True, help="processes on this node")
    lp.add_argument("--max-restarts", type=int, default=0, help="restarts of the whole group after a failure")
    lp.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    lp.add_argument("--run-dir", default=None)
    lp.set_defaults(func=run_launch)


def default_run_dir(config: str | None) -> Path:
    return Path("runs") / (Path(config).stem if config else "default")


def run_train(args) -> int:
    from hardy.train.config import load_config
    from hardy.train.trainer import train

    overrides = list(args.set) + ([f"checkpoint.resume={args.resume}"] if args.resume else [])
    cfg = load_config(args.config, overrides)
    summary = train(cfg, Path(args.run_dir) if args.run_dir else default_run_dir(args.config))
    return 0 if summary.steps else 1


def run_launch(args) -> int:
    import torch
    from torch.distributed.run import get_args_parser, run

    from hardy.errors import HardyError
    from hardy.parallel.dims import ParallelDims
    from hardy.parallel.parallelize import wrapping
    from hardy.train.config import load_config

    if args.nproc < 1:
        raise HardyError(f"--nproc must be >= 1 (got {args.nproc})")
    cfg = load_config(args.config, args.set)  # validate before starting any process
    dims = ParallelDims.build(args.nproc, cfg.parallel.dp_replicate, cfg.parallel.dp_shard, cfg.parallel.tp)
    wrapping(dims, cfg.parallel.wrap)
    if torch.cuda.is_available() and cfg.parallel.backend != "gloo" and args.nproc > torch.cuda.device_count():
        raise HardyError(f"--nproc {args.nproc} on a machine with {torch.cuda.device_count()} visible GPU(s): "
                         "start one process per GPU (or set parallel.backend = gloo to train on the CPU)")
    run_dir = args.run_dir or str(default_run_dir(args.config))
    train_args = ["train", args.config, "--run-dir", run_dir]
    for item in args.set:
        train_args += ["--set", item]
    torchrun_args = get_args_parser().parse_args(
        ["--standalone", "--nproc-per-node", str(args.nproc), "--max-restarts", str(args.max_restarts),
         "--module", "hardy", *train_args])
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        run(torchrun_args)
    except Exception as e:  # torchrun's ChildFailedError: the workers already printed their errors
        print(f"hardy: error: training failed after {args.max_restarts} restart(s): {type(e).__name__}")
        return 1
    return 0
