"""Parallel layouts against each other on CPU/gloo: 10 fp32 steps, losses within 1e-5 relative."""
from __future__ import annotations

import pytest

from trainutil import launch, read_records, rel_close, step_losses

RTOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory, micro_dataset):
    """Each layout is launched once and shared by the comparisons below."""
    root = tmp_path_factory.mktemp("parallel")
    cache = {}

    def get(name: str, nproc: int, *sets: str) -> list[float]:
        if name not in cache:
            launch(root / name, micro_dataset, nproc, *sets)
            cache[name] = step_losses(root / name)
            assert len(cache[name]) == 10
        return cache[name]

    get.root = root
    return get


def test_ddp_matches_single_process_with_accumulation(runs):
    single = runs("single_accum2", 1, "train.grad_accum=2")
    ddp = runs("ddp2", 2)
    assert rel_close(ddp, single, RTOL), (ddp, single)
    assert single[-1] < single[0]  # it trains


def test_fsdp_full_shard_matches_ddp(runs):
    assert rel_close(runs("fsdp2", 2, "parallel.dp_shard=2"), runs("ddp2", 2), RTOL)


def test_fsdp_shard_grad_op_matches_ddp(runs):
    sgo = runs("fsdp2_sgo", 2, "parallel.dp_shard=2", "parallel.reshard_after_forward=false")
    assert rel_close(sgo, runs("ddp2", 2), RTOL)


def test_fsdp_cpu_offload_trains_exactly_like_fsdp(runs):
    # FSDP2's CPUOffloadPolicy runs on a CPU host too (unpinned): its path — host-resident shards copied
    # to the compute device per layer, the optimizer stepping on host gradients — changes no number.
    # That the policy is applied is checked in tests/test_gpu_paths.py.
    offload = runs("fsdp2_offload", 2, "parallel.dp_shard=2", "parallel.cpu_offload=true")
    assert offload == runs("fsdp2", 2, "parallel.dp_shard=2")
    # and the two runs did differ in what FSDP2 was given: every unit offloaded in one, none in the other
    policies = {name: next(r for r in read_records(runs.root / name) if r["event"] == "start")["fsdp"]
                for name in ("fsdp2_offload", "fsdp2")}
    assert policies["fsdp2_offload"]["offloaded"] == policies["fsdp2_offload"]["units"] > 0
    assert policies["fsdp2"]["offloaded"] == 0


def test_tensor_parallel_matches_single_process(runs):
    assert rel_close(runs("tp2", 2, "parallel.tp=2"), runs("single", 1), RTOL)


def test_tensor_parallel_ranks_draw_the_single_process_dropout_masks(runs):
    dropped = runs("single_dropout", 1, "model.dropout=0.2")
    assert not rel_close(dropped, runs("single", 1), 1e-3)
    assert rel_close(runs("tp2_dropout", 2, "parallel.tp=2", "model.dropout=0.2"), dropped, RTOL)


def test_hsdp_2x2_matches_ddp(runs):
    hsdp = runs("hsdp2x2", 4, "parallel.dp_replicate=2", "parallel.dp_shard=2")
    ddp_accum = runs("ddp2_accum2", 2, "train.grad_accum=2")  # the same 4 x 4 sequences per step
    assert rel_close(hsdp, ddp_accum, RTOL)


def test_ddp_accumulation_matches_single_process(runs):
    # DDP skips the all-reduce on the first micro-batch (no_sync); the result must not change.
    assert rel_close(runs("ddp2_accum2", 2, "train.grad_accum=2"), runs("single_accum4", 1, "train.grad_accum=4"), RTOL)


def test_fsdp_accumulation_matches_ddp(runs):
    fsdp = runs("fsdp2_accum2", 2, "parallel.dp_shard=2", "train.grad_accum=2")
    assert rel_close(fsdp, runs("ddp2_accum2", 2, "train.grad_accum=2"), RTOL)


def test_fsdp_bf16_mixed_precision_tracks_fp32(runs):
    bf16 = runs("fsdp2_bf16", 2, "parallel.dp_shard=2", "precision.dtype=bf16")
    fp32 = runs("fsdp2", 2, "parallel.dp_shard=2")
    assert abs(bf16[-1] - fp32[-1]) <= 0.02 * fp32[-1]
    assert bf16 != fp32  # the policy really changed the compute dtype


def test_ddp_bf16_gradient_reduction_tracks_fp32(runs):
    red = runs("ddp2_reduce_bf16", 2, "precision.reduce_dtype=bf16")
    fp32 = runs("ddp2", 2)
    assert abs(red[-1] - fp32[-1]) <= 0.02 * fp32[-1]
    assert red != fp32
