"""Launching a training job: torchrun's arguments for one node or many, and a ready Slurm script.

One node: torchrun's `--standalone`. Several: its c10d rendezvous — every node runs the same
`hardy launch --nnodes MIN:MAX --rdzv-endpoint HOST:PORT` and the elastic agents agree on membership,
ranks and restarts; the store lives on the endpoint's node (`--node-rank 0` hosts it). Slurm: one
launcher per node started by `srun`, the endpoint being the job's first node (the pattern of the
PyTorch and torchtitan docs).
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass

from hardy.errors import HardyError

PREEMPTED = "preempted.json"  # RUN_DIR/...: written by a run that stopped on a signal with a checkpoint

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class LiveNodes:
    count: int
    endpoint: tuple[str, int] | None  # (host, port) of the first node's store; None on one node
    node_rank: int


def parse_nnodes(spec: str) -> tuple[int, int]:
    """'N' or 'MIN:MAX' -> (min, max)."""
    parts = spec.split(":")
    if len(parts) not in (1, 2) or not all(p.isdigit() for p in parts):
        raise HardyError(f"--nnodes must be N or MIN:MAX (got {spec!r})")
    low, high = int(parts[0]), int(parts[-1])
    if not 1 <= low <= high:
        raise HardyError(f"--nnodes {spec}: need 1 <= MIN <= MAX")
    return low, high


def parse_endpoint(spec: str) -> tuple[str, int]:
    host, sep, port = spec.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise HardyError(f"--rdzv-endpoint must be HOST:PORT (got {spec!r})")
    return host, int(port)


def node_rank_of(given: int | None, nnodes: str | None, env) -> int | None:
    """--node-rank, else $SLURM_NODEID under srun for a multi-node launch: Slurm numbers the nodes and
    node 0 is the one the script's endpoint names (a head node whose host name resolves to loopback
    would not recognize the endpoint's address as its own, and no node would host the store)."""
    if given is not None or not nnodes:
        return given
    slurm = env.get("SLURM_NODEID", "")
    return int(slurm) if slurm.isdigit() else None


@dataclass(frozen=True)
class Launch:
    nproc: int  # processes on this node
    max_restarts: int = 0
    nnodes: str | None = None  # None: this node alone
    rdzv_endpoint: str | None = None
    rdzv_id: str = "hardy"
    node_rank: int | None = None  # 0 hosts the rendezvous store; None: torch decides from the endpoint's address
    log_dir: str | None = None  # each worker's stdout and stderr go to files here (torchrun's layout), not the console

    def node_counts(self) -> tuple[int, int]:
        return parse_nnodes(self.nnodes) if self.nnodes else (1, 1)

    def checked_nodes(self) -> tuple[int, int] | None:
        """(min, max) nodes, with the endpoint and this node's rank checked; None for this node alone."""
        if self.nnodes is None:
            if self.rdzv_endpoint or self.node_rank is not None:
                raise HardyError("--rdzv-endpoint and --node-rank go with --nnodes (several nodes)")
            return None
        counts = parse_nnodes(self.nnodes)
        if not self.rdzv_endpoint:
            raise HardyError("--nnodes needs --rdzv-endpoint HOST:PORT (the first node's address, the same on every node)")
        parse_endpoint(self.rdzv_endpoint)
        if self.node_rank is not None and self.node_rank < 0:
            raise HardyError(f"--node-rank must be >= 0 (got {self.node_rank})")
        return counts

    def live_nodes(self) -> LiveNodes:
        """Live recovery's nodes: a fixed N, and the rank given (or $SLURM_NODEID), since every node's
        groups are its own to start."""
        counts = self.checked_nodes()
        if counts is None:
            return LiveNodes(1, None, 0)
        low, high = counts
        if low != high:
            raise HardyError("fault.recovery = live takes a fixed --nnodes N: its replica groups leave and rejoin "
                             "on their own (MIN:MAX is for restart recovery)")
        if self.node_rank is None or self.node_rank >= low:
            raise HardyError(f"live recovery on {low} nodes needs --node-rank 0..{low - 1} (0 on the endpoint's "
                             "node; $SLURM_NODEID under srun)")
        return LiveNodes(low, parse_endpoint(self.rdzv_endpoint), self.node_rank)

    def torchrun_args(self, module_args: list[str]) -> list[str]:
        """The torchrun command line (after `torchrun`) that runs `python -m hardy MODULE_ARGS`."""
        if self.nproc < 1:
            raise HardyError(f"--nproc must be >= 1 (got {self.nproc})")
        if self.max_restarts < 0:
            raise HardyError(f"--max-restarts must be >= 0 (got {self.max_restarts})")
        common = ["--nproc-per-node", str(self.nproc), "--max-restarts", str(self.max_restarts)]
        if self.log_dir:
            common += ["--log-dir", self.log_dir, "--redirects", "3"]
        if self.checked_nodes() is None:
            return ["--standalone", *common, "--module", "hardy", *module_args]
        args = ["--nnodes", self.nnodes, *common, "--rdzv-backend", "c10d", "--rdzv-endpoint", self.rdzv_endpoint,
                "--rdzv-id", self.rdzv_id]
        if self.node_rank is not None:  # explicit: on loopback every node's address matches the endpoint
            args += ["--rdzv-conf", f"is_host={'true' if self.node_rank == 0 else 'false'}"]
        return [*args, "--module", "hardy", *module_args]


@dataclass(frozen=True)
class SlurmJob:
    nodes: int
    gpus_per_node: int  # 0: a CPU job, `procs_per_node` processes per node on gloo
    procs_per_node: int
    train_args: list[str]  # `hardy train` arguments: config, --run-dir, --set ...
    run_dir: str
    job_name: str = "hardy"
    max_restarts: int = 3
    port: int = DEFAULT_PORT
    partition: str | None = None
    time_limit: str | None = None  # Slurm's --time, e.g. 24:00:00
    cpus_per_task: int | None = None
    python: str = "python3"  # the interpreter hardy is installed in, as every node sees it
    live: bool = False  # fault.recovery = live: a lost node's groups drop out and the others go on

    def script(self) -> str:
        if self.nodes < 1 or self.procs_per_node < 1 or self.gpus_per_node < 0:
            raise HardyError("--nodes and processes per node must be >= 1, --gpus-per-node >= 0")
        if self.gpus_per_node and self.procs_per_node != self.gpus_per_node:
            raise HardyError("one process per GPU: --nproc must equal --gpus-per-node (or leave --nproc out)")
        lines = ["#!/bin/bash", f"#SBATCH --job-name={self.job_name}", f"#SBATCH --nodes={self.nodes}",
                 "#SBATCH --ntasks-per-node=1  # one hardy launcher per node; it starts the node's processes"]
        if self.gpus_per_node:
            lines.append(f"#SBATCH --gpus-per-node={self.gpus_per_node}")
        if self.cpus_per_task:
            lines.append(f"#SBATCH --cpus-per-task={self.cpus_per_task}")
        if self.partition:
            lines.append(f"#SBATCH --partition={self.partition}")
        if self.time_limit:
            lines.append(f"#SBATCH --time={self.time_limit}")
        # 120 s before the time limit (or a preemption) every process gets SIGUSR1: the run checkpoints
        # after its next step and exits 0; requeued, the job resumes from that checkpoint
        lines += ["#SBATCH --signal=USR1@120", "#SBATCH --requeue"]
        if self.live:  # a failed node must not end the allocation, nor a failed launcher the job step
            lines.append("#SBATCH --no-kill  # live recovery: the other nodes' replica groups go on")
        # Slurm opens the output file before the script runs: RUN_DIR must exist (`hardy launch --slurm`
        # creates it when it writes RUN_DIR/sbatch.sh)
        lines += [f"#SBATCH --output={self.run_dir}/slurm-%j.out", "", "set -euo pipefail",
                  "# the rendezvous runs on the job's first node, at an address the other nodes can reach",
                  "# awk, not head: it reads the whole list, so pipefail sees no SIGPIPE on a long one",
                  'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | awk \'NR == 1\')',
                  'head_addr=$(srun --nodes=1 --ntasks=1 -w "$head_node" hostname --ip-address | awk \'{print $1}\')',
                  'case "$head_addr" in',
                  "  127.*|::1|\"\")  # /etc/hosts may map the name to loopback: use the node's first real address",
                  '    head_addr=$(srun --nodes=1 --ntasks=1 -w "$head_node" hostname -I | awk \'{print $1}\') ;;',
                  "esac",
                  'if [ -z "$head_addr" ]; then echo "hardy: error: no address for $head_node" >&2; exit 1; fi',
                  f'echo "hardy: {self.nodes} node(s), rendezvous at $head_addr:{self.port}, job $SLURM_JOB_ID"',
                  "", "# every node's launcher joins the same c10d rendezvous; torchrun's agents restart the group",
                  "# (from the newest complete checkpoint) after a failure, up to --max-restarts times"]
        launcher = [self.python, "-m", "hardy", "launch", "--nnodes", str(self.nodes), "--nproc",
                    str(self.procs_per_node)]
        srun = "srun --kill-on-bad-exit=0 " if self.live else "srun "
        lines.append(srun + " ".join(shlex.quote(a) for a in launcher)
                     + f' --rdzv-endpoint "$head_addr:{self.port}" --rdzv-id "$SLURM_JOB_ID"'
                     + f" --max-restarts {self.max_restarts} " + " ".join(shlex.quote(a) for a in self.train_args))
        preempted = shlex.quote(f"{self.run_dir}/{PREEMPTED}")
        lines += ["# stopped on the warning signal with a checkpoint (not finished): run again from it",
                  f'if [ -f {preempted} ]; then scontrol requeue "$SLURM_JOB_ID"; fi']
        return "\n".join(lines) + "\n"
