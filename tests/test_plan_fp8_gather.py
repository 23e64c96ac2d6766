"""`plan train --fp8-all-gather` (torchao's FSDP float8 all-gather): FSDP's per-layer weight gathers carry
1 byte per parameter instead of bf16's 2, the gathered-layer buffers hold fp8 weights, and the step reads
every fp32 weight shard once more for the precomputed scales. Hand-worked on Llama 3 8B."""
from __future__ import annotations

import dataclasses
import json

import pytest

from conftest import hardy_main
from hardy.errors import HardyError
from hardy.plan.hardware import get_hardware
from hardy.plan.public_runs import arch_for
from hardy.plan.timing import StepSetup, ring_allgather, zero3_layer_collectives
from hardy.plan.train import TrainJob, plan_train

ARCH = arch_for("llama3-8b", 8192)
LAYER = ARCH.params_per_layer


def job(**kw) -> TrainJob:
    base = dict(arch=ARCH, hw=get_hardware("h100-sxm"), devices=16, seq=8192, global_batch_tokens=16 * 8192,
                zero=3, fp8="tensorwise", compile=True, ac="selective-op")
    return TrainJob(**{**base, **kw})


def test_the_layer_gather_carries_one_byte_per_parameter():
    hw = get_hardware("h100-sxm")
    s = StepSetup(seq=8192, micro_batch=1, micro_batches=1, dp=16, zero=3, fp8="tensorwise")
    bf16, _ = zero3_layer_collectives(hw, s, LAYER)
    fp8, _ = zero3_layer_collectives(hw, dataclasses.replace(s, fp8_all_gather=True), LAYER)
    link = hw.group_link(16, 8)  # 16 ranks over two 8-GPU nodes
    assert bf16 == pytest.approx(ring_allgather(2 * LAYER, 16, link))
    assert fp8 == pytest.approx(ring_allgather(1 * LAYER, 16, link))
    # the reduce-scatter of the gradients is unchanged (fp32)
    assert zero3_layer_collectives(hw, dataclasses.replace(s, fp8_all_gather=True), LAYER)[1] == \
        zero3_layer_collectives(hw, s, LAYER)[1]


def test_memory_and_the_step_change_by_the_formula():
    plain, gathered = plan_train(job()), plan_train(job(fp8_all_gather=True))
    layer_local = LAYER  # tp 1
    # the buffers: the gathered layer and the prefetched one in fp8 instead of bf16 (the gradient stays)
    assert plain.memory["buffers"] - gathered.memory["buffers"] == pytest.approx(2 * (2 - 1) * layer_local)
    # the optimizer step reads each fp32 weight shard once more for the scales
    params_local = plain.params_local
    extra = 4 * params_local / 16 / get_hardware("h100-sxm").achievable_bandwidth()
    assert gathered.step.optimizer_s - plain.step.optimizer_s == pytest.approx(extra)
    assert gathered.step.compute_s == plain.step.compute_s
    assert gathered.step.dp_comm_s <= plain.step.dp_comm_s


def test_across_a_slow_network_the_halved_gathers_show():
    """FSDP over 64 GPUs whose nodes each give the group one 100 Gb/s NIC: the gathers outlast the layers."""
    hw = get_hardware("h100-sxm")
    slow = dataclasses.replace(hw, inter_node=dataclasses.replace(hw.inter_node, bandwidth=12.5e9))
    plain = plan_train(job(hw=slow, devices=64, global_batch_tokens=64 * 8192, tp=8, sequence_parallel=True))
    gathered = plan_train(job(hw=slow, devices=64, global_batch_tokens=64 * 8192, tp=8, sequence_parallel=True,
                              fp8_all_gather=True))
    assert plain.step.dp_comm_s > 0 and gathered.step.dp_comm_s < 0.75 * plain.step.dp_comm_s


def test_a_search_gathers_in_fp8_wherever_fsdp_shards():
    """`--fp8-all-gather --search`: ZeRO-3 candidates gather in fp8; the others are still planned."""
    from hardy.plan.train import search

    plans, _ = search(job(devices=16, fp8_all_gather=True), limit=0)
    assert {p.job.zero for p in plans} > {3}
    assert all(p.job.fp8_all_gather == (p.job.zero == 3) for p in plans)


def test_impossible_layouts_are_refused_in_one_line():
    for kw, why in (({"fp8": "rowwise"}, "--fp8 rowwise, --zero 3"), ({"fp8": "none"}, "--fp8 none, --zero 3"),
                    ({"zero": 1}, "--fp8 tensorwise, --zero 1")):
        with pytest.raises(HardyError, match="--fp8-all-gather gathers FSDP's weight shards in fp8") as e:
            plan_train(job(fp8_all_gather=True, **kw))
        assert why in str(e.value) and "\n" not in str(e.value)


def test_fp8_all_gather_on_the_command_line():
    base = ["plan", "train", "--model", "llama3.1-8b", "--hardware", "h100-sxm", "--devices", "16", "--zero", "3",
            "--seq", "8192", "--fp8", "tensorwise"]
    proc = hardy_main(*base, "--fp8-all-gather", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["parallel"]["fp8_all_gather"] is True
    assert "fp8 all-gather" in hardy_main(*base, "--fp8-all-gather").stdout
    bad = hardy_main(*base[:-2], "--fp8-all-gather")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "needs --fp8 tensorwise" in bad.stderr
