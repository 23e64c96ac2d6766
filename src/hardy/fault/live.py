"""Live recovery on torchft: replica groups that keep stepping while a failed one heals from a peer.

The job is G data-parallel replica groups (FSDP/TP inside each, a torchrun of its own). torchft's
lighthouse forms a quorum of the groups every step; each process's Manager all-reduces its gradient
shard with the same-rank processes of the other groups and decides whether the step commits. A group
that dies or stops heartbeating is out of the next quorum; the survivors redo the failed step
without it. A restarted group joins the quorum and torchft copies a live peer's state into it (model,
optimizer, schedule, data position, step) before its first step — no checkpoint read.

The global batch is G fixed shares ("slots"): slot s is data-parallel rank s of the job as if all G
groups were up. Fast mode: participant p computes slot p, so a missing group's slot is dropped for
the steps it is out. Exact mode (`fault.exact`): the participants compute every slot between them,
and slot s's gradient travels in row s of a [G, n] buffer that only its computer fills, so the
all-reduce adds zeros to it and the rows are summed in slot order on every process: the same bits
whoever computed them, however many groups died. Its cost: G times the gradient in the all-reduce.
Groups beyond G (spares) stay in the quorum and in sync, computing nothing until a group is out.
"""
from __future__ import annotations

import logging
import os
import socket
import statistics
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, NamedTuple

import torch

from hardy.extras import require as require_extra
from hardy.fault.straggler import find_stragglers

ENV_GROUP = "HARDY_REPLICA_GROUP"  # this process's replica group (0.. for the job's, G.. for spares)
ENV_GROUPS = "HARDY_REPLICA_GROUPS"  # G: the groups the global batch is cut for
ENV_LIGHTHOUSE = "TORCHFT_LIGHTHOUSE"  # torchft's own variable: the lighthouse's address
ENV_START = "HARDY_LIVE_START"  # host:port of the launcher's store, where the first attempt's processes meet
ENV_START_COUNT = "HARDY_LIVE_PROCESSES"  # processes of the job, spares included
REPLICA_PREFIX = "group_"  # torchft orders participants by replica id: groups keep their order, spares last

log = logging.getLogger(__name__)


def require_torchft() -> None:
    require_extra("ft", "fault.recovery = live")


def start_lighthouse(min_replicas: int, heartbeat_timeout_ms: int, join_timeout_ms: int, quorum_tick_ms: int = 20):
    """torchft's lighthouse in this process (the launcher's); returns it (`.address()`, `.shutdown()`)."""
    require_torchft()
    from torchft._torchft import LighthouseServer  # optional: the `ft` extra, as every torchft import here

    return LighthouseServer(bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                            quorum_tick_ms=quorum_tick_ms, heartbeat_timeout_ms=heartbeat_timeout_ms)


def _weights_only_transport(timeout: timedelta):
    """torchft's HTTP checkpoint transport, loading what a peer sends with weights_only=True: the state
    we exchange is tensors, numbers and strings, and a peer's bytes are never unpickled as code."""
    # optional: the `ft` extra
    from torch.distributed._serialization import _streaming_load
    from torchft.checkpointing.http_transport import HTTPTransport

    class WeightsOnlyHTTPTransport(HTTPTransport):
        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            import urllib.request  # start-up: only a healing process fetches

            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f, warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="The given buffer is not writable")  # read-only: copied from
                return _streaming_load(f, weights_only=True)

    return WeightsOnlyHTTPTransport(timeout=timeout, num_chunks=0)


@dataclass(frozen=True)
class StepPlan:
    """Who computes what this step: `slots` are this group's shares of the global batch."""
    participants: int  # groups in this step's quorum
    rank: int  # this group's place among them
    slots: tuple[int, ...]
    computed: tuple[int, ...]  # every slot some participant computes this step (fast mode: fewer when groups are out)
    healed: bool  # this group just took its state from a peer


def plan_slots(groups: int, participants: int, rank: int, exact: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(this participant's slots, all computed slots). The first min(participants, groups) participants
    compute; the rest (spares) wait in sync."""
    workers = min(participants, groups)
    if exact:
        computed = tuple(range(groups))
        mine = tuple(s for s in computed if rank < workers and s % workers == rank)
    else:
        computed = tuple(range(workers))
        mine = (rank,) if rank < workers else ()
    return mine, computed


class LiveReplica:
    """One process's torchft Manager: the quorum, the cross-group all-reduce, the commit, healing."""

    def __init__(self, group: int, groups: int, group_rank: int, group_world: int, exact: bool,
                 state_fn: Callable[[], dict], load_fn: Callable[[dict], None], timeout_s: float,
                 quorum_timeout_s: float, device: torch.device):
        require_torchft()
        from torchft.manager import Manager  # optional: the `ft` extra

        self.group, self.groups, self.exact = group, groups, exact
        timeout = timedelta(seconds=timeout_s)
        pg = self._process_group(device, timeout)
        addr, port = _group_store(group_rank, quorum_timeout_s)
        self._healed = False

        def load(state: dict) -> None:
            load_fn(state)
            self._healed = True

        for name in ("torchft_quorums", "torchft_commits", "torchft_errors", "torchft"):
            # per-step lines, CPU-only warnings and a failed peer's tracebacks: the trainer says it in one line
            logging.getLogger(name).setLevel(logging.CRITICAL)
        self.manager = Manager(
            pg=pg, load_state_dict=load, state_dict=state_fn, min_replica_size=1, use_async_quorum=False,
            timeout=timeout, quorum_timeout=timedelta(seconds=quorum_timeout_s),
            connect_timeout=timedelta(seconds=quorum_timeout_s), rank=group_rank, world_size=group_world,
            store_addr=addr, store_port=port, replica_id=f"{REPLICA_PREFIX}{group:05d}",
            hostname=socket.gethostname(), checkpoint_transport=_weights_only_transport(timeout), init_sync=False)

    @staticmethod
    def _process_group(device: torch.device, timeout: timedelta):
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL  # optional: the `ft` extra

        return ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)

    def set_step(self, step: int) -> None:
        """After a checkpoint resume: the manager counts committed steps from there."""
        self.manager.load_state_dict({"step": step, "batches_committed": 0})

    def begin_step(self) -> StepPlan:
        """A quorum for the next step; heals this group from a peer first if it is behind."""
        self._healed = False
        self.manager.start_quorum()  # synchronous (use_async_quorum=False): healed before it returns
        n = self.manager.num_participants()
        rank = self.manager.participating_rank()
        mine, computed = plan_slots(self.groups, n, rank if rank is not None else n, self.exact)
        return StepPlan(participants=n, rank=rank if rank is not None else -1, slots=mine, computed=computed,
                        healed=self._healed)

    def all_reduce(self, buffer: torch.Tensor) -> bool:
        """Sum `buffer` over the quorum's groups, in place; False if a peer failed (the step must not
        commit; should_commit says so on every rank of the group)."""
        from torch.distributed import ReduceOp  # start-up: only live runs get here, beside the torchft imports

        work = self.manager.allreduce(buffer, reduce_op=ReduceOp.SUM)
        return bool(work.wait()) and self.manager.errored() is None

    def error(self) -> str:
        """Why this step failed (a peer's death or silence), in one line."""
        e = self.manager.errored()
        return f"{type(e.original_exception).__name__}: {e.original_exception}".splitlines()[0] if e else ""

    def commit(self) -> bool:
        return self.manager.should_commit()

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


def wait_for_start(group: int, rank: int, timeout_s: float) -> None:
    """The first attempt's processes start stepping together, so the first quorum holds every group
    (else the first group to arrive would step alone and heal the others later)."""
    store = _start_store(timeout_s)
    if store is None:
        return
    store.set(f"ready/{group}/{rank}", "1")
    total, size = int(os.environ[ENV_START_COUNT]), int(os.environ.get("WORLD_SIZE", "1"))
    store.wait([f"ready/{g}/{r}" for g in range(total // size) for r in range(size)], timedelta(seconds=timeout_s))


STOP_KEY = "launcher-stop"  # set in the launcher's store when it forwards a stop signal: its name


def announce_stop(store, name: str) -> None:
    """Before the launcher signals the groups: a worker that its agent restarts afterwards (one that died
    of the signal before its handler was installed) reads this and does not train on alone."""
    store.set_timeout(timedelta(seconds=5))  # node 0's store may be gone: a stop does not wait on it
    try:
        store.set(STOP_KEY, name)
    except RuntimeError as e:  # DistStoreError: the signal still reaches every worker alive now
        log.warning("the stop could not be recorded in the launcher's store (%s)", e)


def launcher_stopping(timeout_s: float) -> str | None:
    """The stop signal the launcher forwarded before this restarted attempt began, if any. Only restarts
    ask: a first attempt that left at once would hold up its peers, which wait for it before step 1."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        return None
    store = _start_store(timeout_s)
    if store is None:
        return None
    return store.get(STOP_KEY).decode() if store.check([STOP_KEY]) else None


def _start_store(timeout_s: float):
    """A client of the launcher's store ($HARDY_LIVE_START); None outside `hardy launch`."""
    addr = os.environ.get(ENV_START)
    if not addr:
        return None
    from torch.distributed import TCPStore  # start-up time: live runs only

    host, port = addr.rsplit(":", 1)
    return TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))


def _group_store(group_rank: int, timeout_s: float) -> tuple[str, int]:
    """A TCPStore for this attempt of this group, hosted by its rank 0: torchrun's store outlives a
    restart and would hand a replacement the dead attempt's manager address."""
    # start-up: live runs only (every other importer of this module need not load them)
    from torch.distributed import TCPStore
    from hardy.parallel import distributed as D

    host = os.environ.get("MASTER_ADDR", "localhost")
    store = None
    if group_rank == 0:
        store = TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
        _keep.append(store)  # alive as long as the process
    port = D.share_from_main("live-store-port", str(store.port) if store else "", group_rank, timeout_s)
    return host, int(port)


_keep: list = []


def combine_slot_rows(rows: torch.Tensor, computed: tuple[int, ...]) -> torch.Tensor:
    """The mean of the computed slots' rows, summed in slot order (the same bits on every process)."""
    total = rows[computed[0]].clone()
    for s in computed[1:]:
        total += rows[s]
    return total.div_(len(computed))


class GroupVerdict(NamedTuple):
    slow: list[tuple[int, float]]  # (group, its median ÷ the others') at a window's end
    act: int | None  # the group slow for `act_after` windows in a row, to stop or evict


# Acting needs a majority that sets the pace: between two groups alone, one twice as slow as the other is
# as likely the other running fast (a shared host's noise), and evicting would leave a single group.
MIN_GROUPS_TO_ACT = 3


class GroupStragglers:
    """Straggler replica groups, from each step's per-group busy times (every group sees the same table:
    it rides the step's all-reduce). Every `every` steps, a group whose median busy time exceeds
    `factor` times the others' median is named; `act_after` windows in a row, with at least
    MIN_GROUPS_TO_ACT groups computing, and it is acted on."""

    def __init__(self, every: int, factor: float, act_after: int):
        self.every, self.factor, self.act_after = every, factor, act_after
        self.window: list[list[float]] = []
        self.flagged: dict[int, int] = {}

    def observe(self, times: list[float]) -> GroupVerdict:
        """`times[g]`: group g's busy seconds in the last step (0: not in it). Names the stragglers at a
        window's end; nothing otherwise."""
        self.window.append(times)
        if len(self.window) < self.every:
            return GroupVerdict([], None)
        present = [g for g in range(len(times)) if sum(1 for t in self.window if t[g] > 0) * 2 >= self.every]
        medians = [statistics.median([t[g] for t in self.window if t[g] > 0]) for g in present]
        self.window = []
        slow = [(present[i], ratio) for i, ratio in find_stragglers(medians, self.factor)]
        self.flagged = {g: self.flagged.get(g, 0) + 1 for g, _ in slow}
        act = None
        if len(present) >= MIN_GROUPS_TO_ACT:
            act = next((g for g, _ in slow if self.act_after and self.flagged[g] >= self.act_after), None)
        return GroupVerdict(slow, act)
