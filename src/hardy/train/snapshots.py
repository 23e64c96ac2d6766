"""The trainer's side of in-memory snapshots (hardy.checkpoint.memory): what goes in, how it comes back."""
from __future__ import annotations

import logging
import os
import time

from hardy.checkpoint.manager import rng_state, set_rng_state, step_dirs
from hardy.checkpoint.memory import MemorySnapshots
from hardy.train.local_state import fits, load_local_state, local_state
from hardy.train.precision import load_scaler_state

log = logging.getLogger(__name__)


def make_snapshots(trainer) -> MemorySnapshots | None:
    if not trainer.cfg.checkpoint.memory_interval:
        return None
    if not MemorySnapshots.available():
        log.warning("checkpoint.memory_interval: no writable /dev/shm on this machine; in-memory snapshots are off")
        return None
    env = trainer.env
    return MemorySnapshots(trainer.shared_dir, env.rank, env.world_size,
                           int(os.environ.get("LOCAL_WORLD_SIZE", str(env.world_size))))


def take_snapshot(trainer) -> dict:
    """Every rank at the same step: this rank's state into /dev/shm and a copy to its peer."""
    t0 = time.perf_counter()
    extra = {"rng": rng_state(), "scaler": trainer.scaler.state_dict(), "rollbacks": trainer.rollbacks,
             "world": trainer.env.world_size}
    written = trainer.snapshots.save(trainer.step, local_state(trainer, extra))
    return {"step": trainer.step, "bytes": written, "stall_s": time.perf_counter() - t0,
            "peer": trainer.snapshots.peer_rank}


def restore_snapshot(trainer) -> int | None:
    """Resume from the newest in-memory snapshot when it is not older than the newest disk checkpoint and
    was taken on this layout; returns its step (None: the disk checkpoint, if any, serves)."""
    disk = step_dirs(trainer.ckpt.root)
    found = trainer.snapshots.restore(not_before=disk[0][0] if disk else 0)
    if found is None:
        return None
    step, state = found
    if state["trainer"].get("world") != trainer.env.world_size or not fits(trainer, state):
        return None  # another layout (every rank sees the same world size): DCP reshards the disk checkpoint
    t = load_local_state(trainer, state)
    set_rng_state(t["rng"])
    load_scaler_state(trainer.scaler, t["scaler"], trainer.cfg.precision.loss_scale_growth_interval)
    trainer.rollbacks = int(t["rollbacks"])
    return step
