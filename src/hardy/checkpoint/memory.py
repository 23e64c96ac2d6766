"""In-memory snapshots: every N steps each process keeps its share of the training state in /dev/shm,
and a copy on a process of the next node, so a restart that did not lose the node reads RAM, and one
that lost a node takes that node's shares from their copies, not from shared storage.

A snapshot is one file per process (its shards of the weights and optimizer state, the schedule, the
data position, RNG: hardy.train.local_state), written with torch.save and read with weights_only=True.
Only the newest is kept, beside the copies this process holds for its peer. The peer of rank r is
r + (processes per node) mod world: the same local rank on the next node. On one node there is no
peer copy: losing the node loses the snapshots, and the disk checkpoint is the answer.

A restart agrees, through the rendezvous store, on the newest step for which every rank's file exists
somewhere (its own /dev/shm or its peer's copy), sends the missing ones from the peers point to point,
and loads them — when that step is not older than the newest disk checkpoint. The layout must be the
one the snapshot was taken on (the same processes, the same sharding); otherwise the disk checkpoint
(resharded by DCP) serves.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from hardy.fsio import write_bytes_atomic
from hardy.parallel.distributed import gather_strings

SHM = Path("/dev/shm")
_FILE = re.compile(r"^step_(\d{8})\.pt$")
EXCHANGE_TIMEOUT_S = 600.0

log = logging.getLogger(__name__)


def snapshot_root(run_dir: Path, base: Path = SHM) -> Path:
    key = hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
    return base / "hardy" / key


class MemorySnapshots:
    def __init__(self, run_dir: Path, rank: int, world: int, local_world: int, base: Path = SHM):
        self.rank, self.world, self.local_world = rank, world, max(1, local_world)
        self.root = snapshot_root(run_dir, base)
        self.own = self.root / f"rank{rank}"
        self.peer_rank = (rank + self.local_world) % world if world > self.local_world else None
        self.source_rank = (rank - self.local_world) % world if self.peer_rank is not None else None
        self.held = self.root / f"copy_of_rank{self.source_rank}" if self.source_rank is not None else None
        self._rounds = 0
        # the copies travel as host bytes: over gloo even where training's group is NCCL (a collective: every
        # rank builds its snapshots at the same point)
        self.group = None
        if self.peer_rank is not None and dist.get_backend() != "gloo":
            self.group = dist.new_group(backend="gloo")

    @staticmethod
    def available(base: Path = SHM) -> bool:
        return base.is_dir() and os.access(base, os.W_OK)

    # --- saving ---------------------------------------------------------------------------------

    def save(self, step: int, state: dict) -> int:
        """Write this rank's snapshot, swap copies with the peers (a collective: every rank calls it at
        the same step), and drop older ones. Returns the bytes written here (own + the copy held)."""
        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = buffer.getvalue()
        _write(self.own, step, data)
        written = len(data)
        if self.peer_rank is not None:
            received = self._swap(data)
            _write(self.held, step, received)
            written += len(received)
        return written

    def _swap(self, data: bytes) -> bytes:
        """Send this rank's bytes to its peer, receive its source's: sizes first, then the payloads."""
        mine = torch.tensor([len(data)], dtype=torch.int64)
        theirs = torch.zeros(1, dtype=torch.int64)
        _exchange(mine, self.peer_rank, theirs, self.source_rank, self.group)
        out = torch.empty(int(theirs), dtype=torch.uint8)
        _exchange(torch.frombuffer(bytearray(data), dtype=torch.uint8), self.peer_rank, out, self.source_rank,
                  self.group)
        return out.numpy().tobytes()

    # --- restoring ------------------------------------------------------------------------------

    def restore(self, not_before: int) -> tuple[int, dict] | None:
        """(step, this rank's state) of the newest snapshot every rank can have, if it is at least
        `not_before` (the newest disk checkpoint's step); None otherwise. Every rank calls it."""
        self._rounds += 1
        tag = f"memory/{self._rounds}"
        listing = {"own": _steps(self.own), "held": _steps(self.held) if self.held else [], "source": self.source_rank}
        tables = [json.loads(s) for s in gather_strings(tag, json.dumps(listing), self.rank, self.world,
                                                         EXCHANGE_TIMEOUT_S)]
        holder_of = {t["source"]: r for r, t in enumerate(tables) if t["source"] is not None}
        common = None
        for step in sorted({s for t in tables for s in t["own"]}, reverse=True):
            if all(step in t["own"] or (r in holder_of and step in tables[holder_of[r]]["held"])
                   for r, t in enumerate(tables)):
                common = step
                break
        if common is None or common < not_before:
            return None
        # ranks without their own file get it from the rank holding their copy, in rank order
        for r, t in enumerate(tables):
            if common in t["own"]:
                continue
            holder = holder_of[r]
            if self.rank == holder:
                payload = torch.frombuffer(bytearray(_path(self.held, common).read_bytes()), dtype=torch.uint8)
                dist.send(torch.tensor([payload.numel()], dtype=torch.int64), r, group=self.group)
                dist.send(payload, r, group=self.group)
            elif self.rank == r:
                size = torch.zeros(1, dtype=torch.int64)
                dist.recv(size, holder, group=self.group)
                payload = torch.empty(int(size), dtype=torch.uint8)
                dist.recv(payload, holder, group=self.group)
                _write(self.own, common, payload.numpy().tobytes())
        state = torch.load(_path(self.own, common), weights_only=True, map_location="cpu")
        return common, state

    def discard(self) -> None:
        """The run finished: its snapshots only take memory now."""
        for d in (self.own, self.held):
            if d is not None:
                shutil.rmtree(d, ignore_errors=True)


def _path(directory: Path, step: int) -> Path:
    return directory / f"step_{step:08d}.pt"


def _steps(directory: Path | None) -> list[int]:
    if directory is None or not directory.is_dir():
        return []
    return sorted(int(m.group(1)) for f in directory.iterdir() if (m := _FILE.match(f.name)))


def _write(directory: Path, step: int, data: bytes) -> None:
    """The new file, then the older ones away: a crash in between leaves one complete snapshot."""
    directory.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(_path(directory, step), data, durable=False)  # RAM: nothing to fsync for
    for old in _steps(directory):
        if old != step:
            _path(directory, old).unlink(missing_ok=True)


def _exchange(send: torch.Tensor, to: int, recv: torch.Tensor, source: int, group) -> None:
    ops = [dist.P2POp(dist.isend, send, to, group), dist.P2POp(dist.irecv, recv, source, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
