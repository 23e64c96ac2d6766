"""hardy doctor: a pre-flight table (pass / warn / fail) on the ranks a job is about to run on."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from hardy.fsio import write_bytes_atomic
from hardy.ops.launch import Launch

CHECK_BYTES = 16 << 20  # the all-reduce measured: big enough for bandwidth, quick on CPUs


def register(sub) -> None:
    p = sub.add_parser("doctor", help="pre-flight checks for a training job: devices, collectives, checkpoint "
                                      "directory, clocks, precision, versions, shared filesystem")
    p.add_argument("config", nargs="?", help="the job's TOML config (model size and checkpoint keep set the space "
                                             "needed; default: the built-in defaults)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--run-dir", default=None, help="the job's run directory (default runs/<config name>)")
    p.add_argument("--nproc", type=int, default=None, help="start N local processes under torchrun and check across "
                                                           "them (under torchrun or hardy launch: leave it out)")
    p.add_argument("--hardware", default=None, help="catalogue entry or probe:FILE whose link the measured "
                                                    "all-reduce is compared with")
    p.add_argument("--json", default=None, help="also write the table as JSON here")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.nproc is not None and "WORLD_SIZE" not in os.environ:
        return _spawn(args)
    import torch.distributed as dist

    from hardy.cli.train import default_run_dir
    from hardy.model.config import get_preset
    from hardy.ops import doctor as D
    from hardy.parallel.distributed import init_distributed
    from hardy.plan.arch import arch_from_llama
    from hardy.plan.hardware import get_hardware
    from hardy.plan.timing import ring_allreduce
    from hardy.plan.train import checkpoint_bytes
    from hardy.train.config import load_config

    cfg = load_config(args.config, args.set)
    hardware = get_hardware(args.hardware) if args.hardware else None
    run_dir = Path(args.run_dir or default_run_dir(args.config))
    env = init_distributed(cfg.parallel.backend, timeout_s=120)
    arch = arch_from_llama(get_preset(cfg.model.preset))
    # kept checkpoints, one being written, and the final one
    needed = checkpoint_bytes(arch, cfg.precision.dtype) * (cfg.checkpoint.keep + 1)
    checks = D.local_checks(run_dir, env.device, env.rank, cfg.precision.dtype, needed)
    seconds = D.measure_allreduce(env.device, CHECK_BYTES)
    shared = D.check_shared_filesystem(run_dir, env.rank, env.world_size, env.device)
    everything = D.gather_json({"checks": D.as_dicts(checks), "versions": D.versions()}, env.device)
    if dist.is_initialized():
        dist.destroy_process_group()
    if env.rank != 0:
        return 0
    rows = [D.Check(**c) for per_rank in everything for c in per_rank["checks"]]
    expected = link = None
    if hardware is not None and env.world_size > 1:
        fabric = hardware.intra_node if env.world_size <= hardware.devices_per_node else hardware.inter_node
        expected, link = ring_allreduce(CHECK_BYTES, env.world_size, fabric), f"{hardware.name} {fabric.name}"
    rows.append(D.check_collective(seconds, CHECK_BYTES, env.world_size, expected, link))
    rows.append(shared)
    seen = {json.dumps(v["versions"], sort_keys=True) for v in everything}
    rows.append(D.Check("versions", D.PASS if len(seen) == 1 else D.FAIL,
                        ", ".join(f"{k} {v}" for k, v in everything[0]["versions"].items())
                        + ("" if len(seen) == 1 else "; the ranks DIFFER: " + " | ".join(sorted(seen)))))
    print(render(rows, env.world_size))
    if args.json:
        write_bytes_atomic(Path(args.json), json.dumps(D.as_dicts(rows), indent=2).encode())
    failed = [r for r in rows if r.status == D.FAIL]
    if failed:
        print(f"hardy doctor: {len(failed)} check(s) failed: {', '.join(sorted({r.name for r in failed}))}",
              file=sys.stderr)
        return 1
    return 0


def render(rows, world: int) -> str:
    """One line per check, and per rank for the checks every rank runs: check, rank, status, detail."""
    width = max(len(r.name) for r in rows)
    lines = [f"hardy doctor: {world} rank(s)", f"{'check'.ljust(width)}  rank  status  detail"]
    for r in rows:
        lines.append(f"{r.name.ljust(width)}  {str(r.rank) if world > 1 else '-':>4}  {r.status.upper():<6}  {r.detail}")
    return "\n".join(lines)


def _spawn(args) -> int:
    """`--nproc N`: the same command under torchrun's standalone launcher, one check per process."""
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torchrun

    forwarded = ["doctor", *([args.config] if args.config else [])]
    for item in args.set:
        forwarded += ["--set", item]
    for flag, value in (("--run-dir", args.run_dir), ("--hardware", args.hardware), ("--json", args.json)):
        if value:
            forwarded += [flag, value]
    torchrun_args = get_args_parser().parse_args(Launch(args.nproc).torchrun_args(forwarded))  # checks --nproc
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        torchrun(torchrun_args)
    except Exception as e:  # noqa: BLE001 - torchrun's ChildFailedError: the table already said why
        print(f"hardy: error: doctor failed: {type(e).__name__}", file=sys.stderr)
        return 1
    return 0
