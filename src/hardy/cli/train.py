"""hardy train / hardy launch: train from a TOML config, single process or under torchrun."""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch

from hardy import fast_exit
from hardy.errors import HardyError
from hardy.fault.preempt import STOP_SIGNALS, report_stop
from hardy.fsio import write_bytes_atomic
from hardy.ops.launch import DEFAULT_PORT, Launch, SlurmJob, node_rank_of


def register(sub) -> None:
    p = sub.add_parser("train", help="train a model from a TOML config (works under torchrun)")
    p.add_argument("config", nargs="?", help="TOML config (e.g. configs/tiny-cpu.toml)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value (repeatable)")
    p.add_argument("--run-dir", default=None, help="where the run writes everything (default runs/<config name>)")
    p.add_argument("--resume", default=None, help="auto (newest complete checkpoint, the default), never, or a "
                                                  "checkpoint directory; same as --set checkpoint.resume=...")
    p.set_defaults(func=run_train)

    lp = sub.add_parser("launch", help="run `hardy train` on N processes per node with torchrun's elastic agent "
                                       "(one node, several nodes, or a Slurm script)")
    lp.add_argument("config")
    lp.add_argument("--nproc", type=int, default=None, help="processes on this node (default: --gpus-per-node with "
                                                            "--slurm; required otherwise)")
    lp.add_argument("--max-restarts", type=int, default=0, help="restarts of the whole group after a failure")
    lp.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    lp.add_argument("--run-dir", default=None)
    lp.add_argument("--log-dir", default=None, help="write each process's output to files under this directory "
                                                   "(ATTEMPT/RANK/stdout.log, stderr.log) instead of the console")
    nodes = lp.add_argument_group("several nodes (torchrun's c10d rendezvous; run the same command on every node)")
    nodes.add_argument("--nnodes", default=None, metavar="N|MIN:MAX",
                       help="nodes in the job; MIN:MAX lets it continue with fewer after a node is lost")
    nodes.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                       help="the rendezvous: the first node's address (the same on every node)")
    nodes.add_argument("--rdzv-id", default=None, help="job id shared by every node (default: the run dir's name)")
    nodes.add_argument("--node-rank", type=int, default=None,
                       help="0 on the node that hosts the rendezvous store (default: $SLURM_NODEID under srun, else "
                            "the node whose address is the endpoint's)")
    slurm = lp.add_argument_group("Slurm (writes an sbatch script: srun starts one launcher per node)")
    slurm.add_argument("--slurm", action="store_true", help="write the sbatch script instead of running the job")
    slurm.add_argument("--nodes", type=int, default=None, help="Slurm nodes")
    slurm.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node (0: a CPU job on gloo)")
    slurm.add_argument("--print", action="store_true", help="print the script (else: RUN_DIR/sbatch.sh)")
    slurm.add_argument("--partition", default=None)
    slurm.add_argument("--time", default=None, help="Slurm time limit, e.g. 24:00:00")
    slurm.add_argument("--port", type=int, default=DEFAULT_PORT, help="rendezvous port on the first node")
    lp.set_defaults(func=run_launch)


STOP_GRACE_S = 110  # what workers get to checkpoint after a stop signal: within Slurm's USR1@120 warning


def default_run_dir(config: str | None) -> Path:
    return Path("runs") / (Path(config).stem if config else "default")


def run_train(args) -> int:
    from hardy.train.config import load_config
    from hardy.train.trainer import train

    overrides = list(args.set) + ([f"checkpoint.resume={args.resume}"] if args.resume else [])
    cfg = load_config(args.config, overrides)
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(args.config)
    if cfg.fault.recovery == "live":
        from hardy.train.live import train_live

        summary = train_live(cfg, run_dir)
        if summary is None:  # evicted as a straggler, or a restart after the launcher's stop: nothing to redo
            return 0
    else:
        summary = train(cfg, run_dir)
    return 0 if summary.steps else 1


def run_launch(args) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import get_args_parser, run

    from hardy.parallel.dims import ParallelDims
    from hardy.parallel.parallelize import wrapping
    from hardy.train.config import load_config

    if args.slurm:
        return write_slurm_script(args)
    if args.nproc is None:
        raise HardyError("--nproc is required (processes on this node)")
    cfg = load_config(args.config, args.set)  # validate before starting any process
    fast_exit.request()  # once its workers have exited, the launcher ends without the interpreter's teardown
    run_dir = args.run_dir or str(default_run_dir(args.config))
    launch = Launch(args.nproc, args.max_restarts, args.nnodes, args.rdzv_endpoint,
                    args.rdzv_id or Path(run_dir).name, node_rank_of(args.node_rank, args.nnodes, os.environ),
                    args.log_dir)
    train_args = ["train", args.config, "--run-dir", run_dir]
    for item in args.set:
        train_args += ["--set", item]
    if cfg.fault.recovery == "live":
        return launch_live(args, cfg, train_args, Path(run_dir), launch)
    torchrun_args = get_args_parser().parse_args(launch.torchrun_args(train_args))
    for nodes in sorted(set(launch.node_counts())):  # an elastic job must be valid at either end
        dims = ParallelDims.build(args.nproc * nodes, cfg.parallel.dp_replicate, cfg.parallel.dp_shard,
                                  cfg.parallel.tp)
        wrapping(dims, cfg.parallel.wrap)
    if torch.cuda.is_available() and cfg.parallel.backend != "gloo" and args.nproc > torch.cuda.device_count():
        raise HardyError(f"--nproc {args.nproc} on a machine with {torch.cuda.device_count()} visible GPU(s): "
                         "start one process per GPU (or set parallel.backend = gloo to train on the CPU)")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # SIGTERM or SIGUSR1 to the launcher reaches the workers (torchrun's agent forwards the signals it
    # handles); they checkpoint after the next step and exit 0 within the grace period, then SIGKILL.
    os.environ.setdefault("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(STOP_GRACE_S))
    if args.nnodes:
        # A fresh store for every rendezvous round, hosted by that round's rank 0: with the store shared
        # across rounds (torch's default), survivors of a lost node keep dialling the store it hosted.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    started = time.time()
    try:
        run(torchrun_args)
    except SignalException as e:
        return stopped_by_signal(e.sigval, Path(run_dir), started)
    except Exception as e:  # torchrun's ChildFailedError: the workers already printed their errors
        print(f"hardy: error: training failed after {args.max_restarts} restart(s): {type(e).__name__}")
        return 1
    return 0


def launch_live(args, cfg, train_args: list[str], run_dir: Path, launch: Launch) -> int:
    from hardy.fault.live_launch import LiveLayout, run_live
    from hardy.parallel.distributed import DistEnv
    from hardy.train.setup import prepare_dataset

    nodes = launch.live_nodes()
    layout = LiveLayout.build(args.nproc, cfg, nodes.count)
    run_dir.mkdir(parents=True, exist_ok=True)

    def prepare():  # once per node, before its groups start (a no-op where the run dir is shared and ready)
        prepare_dataset(cfg, run_dir, DistEnv(0, 1, 0, torch.device("cpu")))

    return run_live(cfg, layout, train_args, run_dir, args.max_restarts, args.log_dir, prepare, nodes.node_rank, nodes.endpoint)


def stopped_by_signal(sig, run_dir: Path, started: float) -> int:
    """The launcher got SIGTERM/SIGUSR1 (or another signal torchrun handles): 0 if the workers stopped on
    a checkpoint of their own, as a preemption should; 1 otherwise."""
    name = signal.Signals(sig).name
    if sig not in STOP_SIGNALS:
        print(f"hardy: stopped by {name}", file=sys.stderr)
        return 1
    return report_stop(name, run_dir, started)


def write_slurm_script(args) -> int:
    from hardy.train.config import load_config

    if not args.nodes:
        raise HardyError("--slurm needs --nodes N")
    if args.nnodes or args.rdzv_endpoint or args.node_rank is not None:
        raise HardyError("--slurm finds its nodes and rendezvous itself: leave out --nnodes, --rdzv-endpoint and "
                         "--node-rank")
    cfg = load_config(args.config, args.set)  # a bad config is found now, not on the cluster
    procs = args.nproc or args.gpus_per_node or 1
    if cfg.fault.recovery == "live":
        from hardy.fault.live_launch import LiveLayout

        LiveLayout.build(procs, cfg, args.nodes)  # and a layout whose groups do not fit the nodes
    run_dir = str(Path(args.run_dir or default_run_dir(args.config)).resolve())
    train_args = [str(Path(args.config).resolve()), "--run-dir", run_dir]
    for item in args.set:
        train_args += ["--set", item]
    job = SlurmJob(args.nodes, args.gpus_per_node, procs, train_args, run_dir,
                   job_name=f"hardy-{Path(run_dir).name}", max_restarts=args.max_restarts, port=args.port,
                   partition=args.partition, time_limit=args.time, python=sys.executable,
                   live=cfg.fault.recovery == "live")
    script = job.script()
    if args.print:
        print(script, end="")
        return 0
    out = Path(run_dir) / "sbatch.sh"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(out, script.encode())
    print(f"wrote {out}: submit it with `sbatch {out}`")
    return 0
