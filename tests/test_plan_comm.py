"""The training planner's communication and attention terms, on hand-worked cases: FSDP's per-layer overlap,
the gradients' reduce dtype, collectives across nodes, and catalogue GPUs' cited flash-attention rates."""
from __future__ import annotations

import dataclasses
import json

import pytest

from conftest import hardy_main
from hardy.errors import HardyError
from hardy.plan.hardware import CATALOGUE, get_hardware, load_catalogue
from hardy.plan.public_runs import arch_for
from hardy.plan.timing import (StepSetup, data_parallel_seconds, layer_gemm_flops, layer_seconds, ring_allgather,
                               step_time, zero3_exposed_seconds, zero3_layer_collectives)
from hardy.plan.train import TrainJob, plan_train

H100 = get_hardware("h100-sxm")  # 8 per node; NVLink 450 GB/s x 0.80, InfiniBand 50 GB/s x 0.90 per GPU


def test_catalogue_gpus_run_attention_at_their_cited_flash_figure_and_projections_at_the_gemm_rate():
    assert H100.attention_efficiency == 0.35  # FlashAttention-2 on H100 (the FlashAttention-3 paper)
    assert H100.attention_rate("bf16", 128) == pytest.approx(0.35 * 989e12)
    assert H100.attention_rate("fp32", 128) == H100.achievable_flops("fp32")  # the flash kernels are 16-bit
    derated = get_hardware("h100-hbm2e-96gb-500w")  # the same kernel at the 500 W clock
    assert derated.attention_rate("bf16", 128) == pytest.approx(0.35 * 989.4e12 * derated.clock_fraction)
    b200 = get_hardware("b200")  # no kernel figure cited: the GEMM rate
    assert b200.attention_efficiency is None
    assert b200.attention_rate("bf16", 128) == b200.achievable_flops("bf16")

    arch = arch_for("llama3-8b", 8192)
    s = StepSetup(seq=8192, micro_batch=1, micro_batches=1)
    fwd, core = layer_gemm_flops(arch, s)
    expected = 3 * (fwd - core) / H100.achievable_flops("bf16") + 3 * core / (0.35 * 989e12)
    assert layer_seconds(arch, H100, s)["gemm"] == pytest.approx(expected)


@pytest.mark.parametrize("field, good, bad", [("attention_efficiency", "0.35", "35.0"),
                                              ("best_gemm_efficiency_fp8", "0.709", "70.9")])
def test_a_catalogue_fraction_outside_0_1_is_a_one_line_error(tmp_path, field, good, bad):
    text = CATALOGUE.read_text().replace(f"{field} = {good}", f"{field} = {bad}", 1)
    path = tmp_path / "catalogue.toml"
    path.write_text(text)
    with pytest.raises(HardyError, match=rf"\[h100-sxm\]: bad or missing field \({field} must be in "
                                         rf"\(0, 1\], got {bad}\)"):
        load_catalogue(path)


def test_gradients_reduce_in_fp32_by_default_and_bf16_halves_their_bytes():
    """ZeRO-2 on one node: the gradients' reduce-scatter (4 or 2 bytes per parameter) plus the all-gather of
    the updated bf16 weights (2 bytes)."""
    params, link = 1e9, H100.intra_node
    fp32 = StepSetup(seq=4096, micro_batch=1, micro_batches=1, dp=8, zero=2)
    bf16 = dataclasses.replace(fp32, reduce_dtype="bf16")
    weights = ring_allgather(2 * params, 8, link)
    assert data_parallel_seconds(H100, fp32, params, 32) == pytest.approx(ring_allgather(4 * params, 8, link) + weights)
    assert data_parallel_seconds(H100, bf16, params, 32) == pytest.approx(ring_allgather(2 * params, 8, link) + weights)
    assert dataclasses.replace(bf16, precision="fp32").reduce_bytes == 4  # an fp32 run's gradients are fp32


def test_reduce_dtype_on_the_command_line():
    base = ["plan", "train", "--model", "llama3.1-8b", "--hardware", "h100-sxm", "--devices", "64", "--zero", "3",
            "--json"]
    fp32, bf16 = hardy_main(*base), hardy_main(*base, "--reduce-dtype", "bf16")
    assert fp32.returncode == bf16.returncode == 0, fp32.stderr + bf16.stderr
    fp32, bf16 = json.loads(fp32.stdout), json.loads(bf16.stdout)
    assert (fp32["parallel"]["reduce_dtype"], bf16["parallel"]["reduce_dtype"]) == ("fp32", "bf16")
    assert bf16["step_time_s"]["dp_comm_s"] < fp32["step_time_s"]["dp_comm_s"]
    bad = hardy_main(*base[:-1], "--precision", "fp32", "--reduce-dtype", "bf16")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert "--reduce-dtype bf16 is for --precision bf16 (got fp32" in bad.stderr


def test_a_collective_across_nodes_moves_through_every_nic_its_group_has_in_a_node():
    assert H100.group_link(8, 8) is H100.intra_node
    assert H100.group_link(64, 1) is H100.inter_node  # one member per node: its own NIC
    two = H100.group_link(64, 2)
    assert two.bandwidth * two.efficiency == pytest.approx(2 * 50e9 * 0.9)
    eight = H100.group_link(64, 8)  # eight NICs would carry 360 GB/s: NVLink's 360 caps it too
    assert eight.bandwidth * eight.efficiency == pytest.approx(min(8 * 50e9 * 0.9, 450e9 * 0.8))
    # FSDP over 64 devices (8 nodes): a node's 8 shards share its 8 NICs; with TP 4 inside the node, each
    # sharding group has 2 members per node
    params = 1e9
    plain = StepSetup(seq=4096, micro_batch=1, micro_batches=1, dp=64, zero=2)
    assert data_parallel_seconds(H100, plain, params, 32) == pytest.approx(
        ring_allgather(4 * params, 64, eight) + ring_allgather(2 * params, 64, eight))
    with_tp = StepSetup(seq=4096, micro_batch=1, micro_batches=1, dp=16, tp=4, zero=2)
    assert data_parallel_seconds(H100, with_tp, params, 32) == pytest.approx(
        ring_allgather(4 * params, 16, two) + ring_allgather(2 * params, 16, two))


def test_fsdp_traffic_shows_only_where_a_layer_outlasts_its_compute():
    """Four layers, two micro-batches, gradients reduce-scattered on the last one: g = one layer's gather,
    r = its reduce-scatter (fp32: twice a bf16 gather's bytes)."""
    s = StepSetup(seq=4096, micro_batch=1, micro_batches=2, dp=8, zero=3)
    g, r = zero3_layer_collectives(H100, s, 2e8)
    assert r == pytest.approx(2 * g - 7 * H100.intra_node.latency)  # the same hops, twice the bytes
    # compute far longer than any collective: the first gather and the last reduce-scatter only
    assert zero3_exposed_seconds(H100, s, 2e8, 4, 1.0, 2.0) == pytest.approx(2 * g + r)
    # no compute at all: per micro-batch 4 forward gathers and 3 backward ones (the last layer's runs behind
    # the output layer's backward), and 4 reduce-scatters once
    assert zero3_exposed_seconds(H100, s, 2e8, 4, 0.0, 0.0) == pytest.approx(2 * (4 + 3) * g + 4 * r)
    # a forward of half a gather and a backward of 1.5 gathers: forward g + 3 * g/2 per micro-batch, an
    # accumulating backward hides its gathers, the reducing one shows 3 * (g + r - 1.5 g) + r
    assert zero3_exposed_seconds(H100, s, 2e8, 4, g / 2, 1.5 * g) == pytest.approx(
        2 * (g + 1.5 * g) + 3 * (r - 0.5 * g) + r)


def test_kempnerforges_70b_waits_on_fsdp_where_its_13b_does_not():
    """TP 4 inside each 4-GPU node, FSDP over 16 nodes: a 70B layer at micro-batch 2 gathers over one NIC
    for longer than its forward computes (their report: 'less arithmetic per collective to hide behind');
    the 13B at micro-batch 4 hides it."""
    hw = dataclasses.replace(get_hardware("h200"), devices_per_node=4)

    def step(model, micro_batch):
        job = TrainJob(arch=arch_for(model, 4096), hw=hw, devices=64, seq=4096, tp=4, zero=3, ac="full",
                       micro_batch=micro_batch, global_batch_tokens=16 * micro_batch * 4 * 4096,
                       master_weights=False)
        return plan_train(job).step

    big, small = step("llama3-70b", 2), step("kempner-13b", 4)
    assert big.dp_comm_s > 0.05 * big.total_s
    assert small.dp_comm_s < 0.01 * small.total_s


def test_cpu_collectives_hide_nothing():
    """On a CPU host the collectives run on the cores that compute: ZeRO-3's whole traffic is in the step."""
    cpu = get_hardware("xeon-spr")
    arch = arch_for("llama3-8b", 2048)
    s = StepSetup(seq=2048, micro_batch=1, micro_batches=2, dp=2, zero=3)
    params = arch.params_total
    assert step_time(arch, cpu, s, params).dp_comm_s == pytest.approx(
        data_parallel_seconds(cpu, s, params, arch.n_layers))
