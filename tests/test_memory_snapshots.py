"""In-memory snapshots (checkpoint.memory_interval): /dev/shm and a peer's copy, instead of shared storage."""
from __future__ import annotations

import json
import os
import socket
import pytest
import torch
import torch.multiprocessing as mp

from trainutil import assert_bitwise_equal, launch, read_records

from hardy.checkpoint.memory import MemorySnapshots


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _node_loss(rank: int, world: int, port: int, base: str, out: str) -> None:
    """Two 'nodes' of one process each: both snapshot steps 5 and 10; rank 1's node is then replaced
    (its /dev/shm is empty) and the restore takes its state from the copy rank 0 holds."""
    from pathlib import Path

    from hardy.parallel import distributed as D

    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK="0")
    D.init_distributed("gloo")
    try:
        snaps = MemorySnapshots(Path(out) / "run", rank, world, local_world=1, base=Path(base))
        states = {step: {"w": torch.full((3,), float(10 * rank + step)), "step": step} for step in (5, 10)}
        for step, state in states.items():
            snaps.save(step, state)
        assert sorted(p.name for p in snaps.own.iterdir()) == ["step_00000010.pt"]  # the newest only
        assert sorted(p.name for p in snaps.held.iterdir()) == ["step_00000010.pt"]  # and the peer's copy
        D.barrier()
        if rank == 1:
            import shutil

            shutil.rmtree(snaps.own)  # the replaced node's memory is gone
        D.barrier()
        assert snaps.restore(not_before=11) is None  # a disk checkpoint newer than the snapshot wins
        step, state = snaps.restore(not_before=10)
        assert step == 10 and torch.equal(state["w"], states[10]["w"]), (rank, state)
        snaps.discard()
        (Path(out) / f"ok{rank}").write_text(json.dumps({"step": step}))
    finally:
        D.destroy()


def test_a_replaced_node_takes_its_snapshot_from_the_peer_copy(tmp_path):
    base = tmp_path / "shm"
    base.mkdir()
    mp.spawn(_node_loss, args=(2, _free_port(), str(base), str(tmp_path)), nprocs=2, join=True)
    assert (tmp_path / "ok0").exists() and (tmp_path / "ok1").exists()
    assert not any(base.rglob("*.pt"))  # discarded at the end


def test_one_node_has_no_peer_copy(tmp_path):
    snaps = MemorySnapshots(tmp_path / "run", 1, 2, local_world=2, base=tmp_path)
    assert snaps.peer_rank is None and snaps.held is None


@pytest.mark.timeout(300)
def test_a_crashed_run_resumes_from_its_memory_snapshot_bitwise(tmp_path, micro_dataset):
    sets = ["parallel.dp_shard=2", "train.steps=16", "checkpoint.interval=0", "checkpoint.at_end=true",
            "checkpoint.memory_interval=5"]
    launch(tmp_path / "clean", micro_dataset, 2, *sets)
    launch(tmp_path / "crash", micro_dataset, 2, *sets, "fault.inject=kill@12@rank1", max_restarts=1)
    records = read_records(tmp_path / "crash")
    starts = [r for r in records if r["event"] == "start"]
    # no disk checkpoint before the end: the restart resumed from step 10's snapshot in /dev/shm
    assert starts[1]["step"] == 10 and starts[1]["resumed_from"].endswith("step_00000010"), starts[1]
    assert [r["step"] for r in records if r["event"] == "snapshot"] == [5, 10, 15]
    final = "checkpoints/step_00000016"
    assert_bitwise_equal(tmp_path / "clean" / final, tmp_path / "crash" / final)
