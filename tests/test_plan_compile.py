"""Kernel-level terms of the training planner: `--compile` (each block's elementwise operators fused, by
inductor's own count of the fused kernels' traffic) and fp8 GEMMs at their own best-case matmul figure."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conftest import hardy_main
from hardy.model.config import ModelConfig
from hardy.model.transformer import Rotary, TransformerBlock, rope_tables
from hardy.ops.compiled_traffic import compiled_layer_traffic
from hardy.ops.kernel_probe import layer_traffic
from hardy.plan.arch import arch_from_llama
from hardy.plan.hardware import get_hardware
from hardy.plan.public_runs import arch_for
from hardy.plan.timing import (LLAMA_COMPILED_KERNELS_PER_LAYER, StepSetup, layer_elementwise_bytes, layer_seconds,
                               step_time)
from hardy.plan.train import TrainJob, plan_train


def test_the_compiled_layer_traffic_is_what_inductors_fused_kernels_move():
    """A shape outside the seven the coefficients were fitted on: the planner's count within 3% of inductor's,
    and well under the eager count (fusion is what compile changes)."""
    batch, seq = 2, 64
    cfg = ModelConfig(vocab_size=512, dim=96, n_layers=1, n_heads=6, n_kv_heads=2, ffn_dim=288, head_dim=16,
                      max_seq_len=seq, tie_embeddings=True, name="t")
    torch.manual_seed(0)
    block, x = TransformerBlock(cfg), torch.randn(batch, seq, cfg.dim)
    rope = Rotary.shared(*rope_tables(cfg, seq))
    compiled = compiled_layer_traffic(block, x, rope)
    eager = layer_traffic(block, x, rope)
    s = StepSetup(seq=seq, micro_batch=batch, micro_batches=1, precision="fp32", compiled=True)
    assert layer_elementwise_bytes(arch_from_llama(cfg), s) == pytest.approx(compiled.bytes, rel=0.03)
    assert compiled.bytes < 0.5 * eager.bytes
    assert 40 <= compiled.kernels <= LLAMA_COMPILED_KERNELS_PER_LAYER < eager.ops


def test_compile_changes_the_elementwise_work_and_nothing_else():
    arch, hw = arch_for("llama3-8b", 8192), get_hardware("h100-sxm")
    eager = StepSetup(seq=8192, micro_batch=1, micro_batches=2)
    compiled = dataclasses.replace(eager, compiled=True)
    per_token = 28.3 * 4096 + 7.8 * 14336 + 10.1 * 4096 + 8.5 * 1024  # fp32 elements, forward + backward
    assert layer_elementwise_bytes(arch, compiled) == pytest.approx(8192 * per_token * 2)
    one, two = layer_seconds(arch, hw, eager), layer_seconds(arch, hw, compiled)
    assert two["gemm"] == one["gemm"] and two["tp"] == one["tp"]
    assert two["elementwise"] == pytest.approx(layer_elementwise_bytes(arch, compiled) / hw.elementwise_rate())
    a, b = step_time(arch, hw, eager, 1e9), step_time(arch, hw, compiled, 1e9)
    assert b.compute_s == a.compute_s and b.elementwise_s < 0.5 * a.elementwise_s
    # on a CPU the launches do not hide: compile's fewer kernels cost fewer dispatches
    cpu = get_hardware("xeon-spr")
    small = arch_for("llama3-8b", 512)
    s = StepSetup(seq=512, micro_batch=1, micro_batches=1)
    dispatch = step_time(small, cpu, s, 1e9).dispatch_s - step_time(small, cpu, dataclasses.replace(s, compiled=True),
                                                                     1e9).dispatch_s
    assert dispatch == pytest.approx((3 * 30 - LLAMA_COMPILED_KERNELS_PER_LAYER) * 32 * cpu.op_overhead_s)


def test_compile_on_the_command_line():
    base = ["plan", "train", "--model", "llama3.1-8b", "--hardware", "h100-sxm", "--devices", "8", "--zero", "3",
            "--seq", "8192"]
    eager, compiled = hardy_main(*base, "--json"), hardy_main(*base, "--compile", "--json")
    assert eager.returncode == compiled.returncode == 0, eager.stderr + compiled.stderr
    eager, compiled = json.loads(eager.stdout), json.loads(compiled.stdout)
    assert (eager["parallel"]["compile"], compiled["parallel"]["compile"]) == (False, True)
    assert compiled["step_time_s"]["elementwise_s"] < 0.5 * eager["step_time_s"]["elementwise_s"]
    assert compiled["tokens_per_s"] > eager["tokens_per_s"]
    text = hardy_main(*base, "--compile")
    assert text.returncode == 0 and "gradients reduced in fp32, compiled" in text.stdout
    gpt = hardy_main("plan", "train", "--model", "gpt-22b", "--hardware", "a100-80g", "--devices", "8", "--tp", "8",
                     "--compile")
    assert gpt.returncode == 2 and gpt.stderr.count("\n") == 1, gpt.stderr
    assert "--compile is modelled for Llama-family models" in gpt.stderr and "gpt-22b is a gpt model" in gpt.stderr


def test_fp8_gemms_reach_the_in_layer_share_of_their_own_best_case_matmul():
    for name, best_fp8 in (("h100-sxm", 0.709), ("h200", 0.734), ("b200", 0.763), ("gb200", 0.723)):
        hw = get_hardware(name)
        assert hw.best_gemm_efficiency_fp8 == best_fp8
        assert hw.gemm_efficiency("fp8") == pytest.approx(hw.flops_efficiency / hw.best_gemm_efficiency * best_fp8)
        assert hw.gemm_rate("fp8") == pytest.approx(hw.sustained_peak("fp8") * hw.gemm_efficiency("fp8"))
        assert hw.gemm_efficiency("bf16") == hw.flops_efficiency
    mi300x = get_hardware("mi300x")  # no fp8 matmul measured: the bf16 figure
    assert mi300x.best_gemm_efficiency_fp8 is None and mi300x.gemm_efficiency("fp8") == mi300x.flops_efficiency


def test_fp8_speeds_a_compiled_step_by_less_than_the_peak_ratio():
    job = dict(arch=arch_for("llama3-8b", 8192), hw=get_hardware("h100-sxm"), devices=8, seq=8192,
               global_batch_tokens=16 * 8192, zero=3, micro_batch=2, ac="selective-op", compile=True)
    bf16, fp8 = plan_train(TrainJob(**job)), plan_train(TrainJob(**job, fp8="tensorwise"))
    speedup = fp8.tokens_per_s / bf16.tokens_per_s
    assert 1.0 < speedup < 1979 / 989 * 0.709 / 0.803  # attention stays bf16, the casts cost memory traffic
