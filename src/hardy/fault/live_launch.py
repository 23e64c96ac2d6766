"""`hardy launch` under live recovery: torchft's lighthouse here, one torchrun per replica group.

Each group (parallel.dp_shard x parallel.tp processes) is an elastic agent of its own: when one of its
processes dies, torchrun restarts that group alone (`--max-restarts` counts per group) while the
others keep stepping. `fault.spares` more groups start beside them. The launcher forwards a stop
signal (SIGTERM, SIGUSR1) to every group's processes as SIGUSR1: the groups agree on the step to stop
after, the quorum's first group checkpoints, and all exit 0.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hardy.errors import HardyError
from hardy.fault.live import (ENV_GROUP, ENV_GROUPS, ENV_LIGHTHOUSE, ENV_START, ENV_START_COUNT, require_torchft,
                              start_lighthouse)
from hardy.fault.preempt import STOP_SIGNALS, report_stop
from hardy.parallel.dims import ParallelDims


@dataclass(frozen=True)
class LiveLayout:
    groups: int  # G: replica groups the batch is cut for
    group_size: int  # processes per group
    spares: int

    @classmethod
    def build(cls, nproc: int, cfg) -> "LiveLayout":
        p = cfg.parallel
        if cfg.checkpoint.memory_interval:
            raise HardyError("checkpoint.memory_interval is for restart recovery: under live recovery a group "
                             "heals from a live peer")
        dims = ParallelDims.build(nproc, p.dp_replicate, p.dp_shard, p.tp)
        if dims.dp_replicate < 2:
            raise HardyError("fault.recovery = live needs parallel.dp_replicate >= 2 replica groups "
                             f"(got {dims.dp_replicate} from --nproc {nproc})")
        return cls(dims.dp_replicate, nproc // dims.dp_replicate, cfg.fault.spares)

    @property
    def processes(self) -> int:
        return (self.groups + self.spares) * self.group_size


def _group_command(layout: LiveLayout, max_restarts: int, train_args: list[str], log_dir: str | None,
                   group: int) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(layout.group_size),
           "--max-restarts", str(max_restarts)]
    if log_dir:
        cmd += ["--log-dir", str(Path(log_dir) / f"replica_{group}"), "--redirects", "3"]
    return cmd + ["--module", "hardy", *train_args]


def run_live(cfg, layout: LiveLayout, train_args: list[str], run_dir: Path, max_restarts: int,
             log_dir: str | None) -> int:
    """Start the lighthouse and every group; wait for them. 0 when a group finished the run (or all
    stopped on a signal with a checkpoint)."""
    # torchft's per-quorum INFO lines (read when it is imported), here and in every group
    os.environ.setdefault("RUST_LOG", "warn")
    require_torchft()
    from torch.distributed import TCPStore  # start-up time: the launcher of a live run only

    f = cfg.fault
    # a dead or stopped group stops heartbeating and is out after heartbeat_timeout_ms; one that is alive but
    # late (saving a checkpoint) is waited for, up to join_timeout_s
    lighthouse = start_lighthouse(1, f.heartbeat_timeout_ms, join_timeout_ms=int(f.join_timeout_s * 1000))
    start_store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    env = {**os.environ, ENV_GROUPS: str(layout.groups), ENV_LIGHTHOUSE: lighthouse.address(),
           ENV_START: f"localhost:{start_store.port}", ENV_START_COUNT: str(layout.processes),
           # a failed group's survivors die at once on SIGTERM; a stop is SIGUSR1, with time to checkpoint
           "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
           "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "110")}
    env.setdefault("OMP_NUM_THREADS", "1")
    started = time.time()
    procs = []
    for g in range(layout.groups + layout.spares):
        procs.append(subprocess.Popen(_group_command(layout, max_restarts, train_args, log_dir, g),
                                      env={**env, ENV_GROUP: str(g)}))
    print(f"hardy launch: live recovery, {layout.groups} replica group(s) of {layout.group_size} process(es)"
          + (f" + {layout.spares} spare group(s)" if layout.spares else "")
          + f", lighthouse {lighthouse.address()}", flush=True)
    stopping = []

    def forward(signum, frame):
        stopping.append(signum)
        stop_workers(procs)

    previous = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
    try:
        codes = [proc.wait() for proc in procs]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        lighthouse.shutdown()
    return _outcome(codes, stopping, run_dir, started, max_restarts)


def stop_workers(agents: list[subprocess.Popen]) -> None:
    """SIGUSR1 to every group's training processes (the agents' children), not to the agents: an agent
    given a signal ends its workers itself, without waiting for the step they agree to stop after."""
    import psutil  # start-up time: only a stopping launcher needs it

    for agent in agents:
        try:
            workers = psutil.Process(agent.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            continue
        for worker in workers:
            try:
                worker.send_signal(signal.SIGUSR1)
            except psutil.NoSuchProcess:
                pass


def _outcome(codes: list[int], stopping: list, run_dir: Path, started: float, max_restarts: int) -> int:
    if stopping:
        return report_stop(signal.Signals(stopping[0]).name, run_dir, started)
    failed = [g for g, code in enumerate(codes) if code]
    for g in failed:
        print(f"hardy: replica group {g} failed after {max_restarts} restart(s) (exit {codes[g]}); "
              "the others went on", file=sys.stderr)
    if len(failed) == len(codes):
        print("hardy: error: every replica group failed", file=sys.stderr)
        return 1
    return 0
