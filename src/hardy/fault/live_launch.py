"""`hardy launch` under live recovery: torchft's lighthouse here, one torchrun per replica group.

Each group (parallel.dp_shard x parallel.tp processes) is an elastic agent of its own: when one of its
processes dies, torchrun restarts that group alone (`--max-restarts` counts per group) while the
others keep stepping. `fault.spares` more groups start beside them. The launcher forwards a stop
signal (SIGTERM, SIGUSR1) to every group's processes as SIGUSR1: the groups agree on the step to stop
after, the quorum's first group checkpoints, and all exit 0.

On several nodes (`--nnodes N --rdzv-endpoint HOST:PORT --node-rank R`, the same command on each), a
group lives within one node and node R runs its share of them. Node 0's launcher prepares the data,
runs the lighthouse and hosts the store at the endpoint where every process meets before the first
step. A lost node's groups are out of the quorum like any dead group; the same command, run again on
that node (or its replacement), starts them and they heal from a live peer.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from hardy.errors import HardyError, first_line
from hardy.fault.live import (ENV_GROUP, ENV_GROUPS, ENV_LIGHTHOUSE, ENV_START, ENV_START_COUNT, announce_stop,
                              require_torchft, start_lighthouse)
from hardy.fault.preempt import STOP_SIGNALS, report_stop
from hardy.parallel.dims import ParallelDims


@dataclass(frozen=True)
class LiveLayout:
    groups: int  # G: replica groups the batch is cut for
    group_size: int  # processes per group
    spares: int
    nodes: int = 1
    per_node: int = 0  # --nproc: the job's processes on each node (spares come beyond it)

    @classmethod
    def build(cls, nproc: int, cfg, nodes: int = 1) -> "LiveLayout":
        p = cfg.parallel
        if cfg.checkpoint.memory_interval:
            raise HardyError("checkpoint.memory_interval is for restart recovery: under live recovery a group "
                             "heals from a live peer")
        dims = ParallelDims.build(nproc * nodes, p.dp_replicate, p.dp_shard, p.tp)
        if dims.dp_replicate < 2:
            raise HardyError("fault.recovery = live needs parallel.dp_replicate >= 2 replica groups "
                             f"(got {dims.dp_replicate} from --nproc {nproc} x {nodes} node(s))")
        size = nproc * nodes // dims.dp_replicate
        if nproc % size:
            raise HardyError(f"a replica group ({size} processes: dp_shard x tp) runs on one node: --nproc {nproc} "
                             f"must be a multiple of {size}")
        return cls(dims.dp_replicate, size, cfg.fault.spares, nodes, nproc)

    @property
    def processes(self) -> int:
        return (self.groups + self.spares) * self.group_size

    def node_groups(self, node: int) -> list[int]:
        """The groups `node` runs: its share of the job's, in order, and spare s on node s mod nodes."""
        per = self.per_node // self.group_size
        return [*range(node * per, (node + 1) * per),
                *(self.groups + s for s in range(self.spares) if s % self.nodes == node)]


def _group_command(layout: LiveLayout, max_restarts: int, train_args: list[str], log_dir: str | None,
                   group: int) -> list[str]:
    cmd = [sys.executable, "-m", "hardy.fault.agent", "--standalone", "--nproc-per-node", str(layout.group_size),
           "--max-restarts", str(max_restarts)]
    if log_dir:
        cmd += ["--log-dir", str(Path(log_dir) / f"replica_{group}"), "--redirects", "3"]
    return cmd + ["--module", "hardy", *train_args]


def _meet(cfg, node_rank: int, endpoint: tuple[str, int] | None, prepare):
    """Node 0 prepares the data, runs the lighthouse (unless $TORCHFT_LIGHTHOUSE names one already
    running) and hosts the store where every process meets before the first step; the other nodes wait
    for it there and read the lighthouse's address from it. Returns (lighthouse or None, its address,
    the store, the store's host:port)."""
    from torch.distributed import TCPStore  # start-up time: the launcher of a live run only

    f = cfg.fault
    wait = timedelta(seconds=f.startup_timeout_s or 7 * 86400)
    host, port = endpoint or ("localhost", 0)
    if node_rank > 0:
        try:
            store = TCPStore(host, port, is_master=False, timeout=wait)
            address = store.get("lighthouse").decode()
        except (RuntimeError, ValueError) as e:  # DistStoreError is a RuntimeError
            raise HardyError(f"node {node_rank}: no word from node 0's launcher at {host}:{port} "
                             f"({first_line(e, 200)})") from None
        prepare()
        return None, address, store, f"{host}:{port}"
    prepare()
    address, lighthouse = os.environ.get(ENV_LIGHTHOUSE), None
    if not address:
        # a dead or stopped group stops heartbeating and is out after heartbeat_timeout_ms; one that is alive
        # but late (saving a checkpoint) is waited for, up to join_timeout_s
        lighthouse = start_lighthouse(1, f.heartbeat_timeout_ms, join_timeout_ms=int(f.join_timeout_s * 1000))
        address = lighthouse.address()
        if endpoint:  # as the other nodes reach this one, not by a host name they may not resolve
            address = f"http://{host}:{address.rsplit(':', 1)[1]}"
    try:
        store = TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=wait)
    except RuntimeError as e:
        raise HardyError(f"node 0 cannot host the store at {host}:{port} "
                         f"({first_line(e, 200)})") from None
    store.set("lighthouse", address)
    return lighthouse, address, store, f"{host}:{store.port}"


def run_live(cfg, layout: LiveLayout, train_args: list[str], run_dir: Path, max_restarts: int,
             log_dir: str | None, prepare=lambda: None, node_rank: int = 0,
             endpoint: tuple[str, int] | None = None) -> int:
    """Meet the other nodes, start this node's groups and wait for them. 0 when a group finished the
    run (or all stopped on a signal with a checkpoint)."""
    # torchft's per-quorum INFO lines (read when it is imported), here and in every group
    os.environ.setdefault("RUST_LOG", "warn")
    require_torchft()
    # `store` stays referenced until the groups exit: a restarted group meets there again
    lighthouse, address, store, store_addr = _meet(cfg, node_rank, endpoint, prepare)
    env = {**os.environ, ENV_GROUPS: str(layout.groups), ENV_LIGHTHOUSE: address,
           ENV_START: store_addr, ENV_START_COUNT: str(layout.processes),
           # a failed group's survivors die at once on SIGTERM; a stop is SIGUSR1, with time to checkpoint
           "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
           "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "110")}
    env.setdefault("OMP_NUM_THREADS", "1")
    started = time.time()
    groups = layout.node_groups(node_rank)
    procs = [subprocess.Popen(_group_command(layout, max_restarts, train_args, log_dir, g),
                              env={**env, ENV_GROUP: str(g)}) for g in groups]
    where = f"node {node_rank} of {layout.nodes} runs group(s) {', '.join(map(str, groups))} of " \
        if layout.nodes > 1 else ""
    print(f"hardy launch: live recovery, {where}{layout.groups} replica group(s) of {layout.group_size} process(es)"
          + (f" + {layout.spares} spare group(s)" if layout.spares else "") + f", lighthouse {address}", flush=True)
    stopping = []

    def forward(signum, frame):
        stopping.append(signum)
        announce_stop(store, signal.Signals(signum).name)  # first: a worker restarted after it reads it
        stop_workers(procs)

    previous = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
    try:
        codes = [proc.wait() for proc in procs]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if lighthouse is not None:
            lighthouse.shutdown()
    return _outcome(dict(zip(groups, codes)), stopping, run_dir, started, max_restarts)


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


def _outcome(codes: dict[int, int], stopping: list, run_dir: Path, started: float, max_restarts: int) -> int:
    if stopping:
        return report_stop(signal.Signals(stopping[0]).name, run_dir, started)
    failed = [g for g, code in codes.items() if code]
    for g in failed:
        print(f"hardy: replica group {g} failed after {max_restarts} restart(s) (exit {codes[g]}); "
              "the others went on", file=sys.stderr)
    if len(failed) == len(codes):
        print("hardy: error: every replica group on this node failed", file=sys.stderr)
        return 1
    return 0
