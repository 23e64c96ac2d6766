"""The planner's step-time model against hardy's own implementation: the elementwise traffic it
assumes is what hardy's eager Llama actually moves (counted operator by operator), and the measured
GEMM / attention rates of a profile are the ones it applies."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from hardy.model.config import ModelConfig
from hardy.model.transformer import Rotary, Transformer, TransformerBlock, rope_tables
from hardy.ops.kernel_probe import ElementwiseTraffic, layer_traffic
from hardy.plan.arch import arch_from_llama
from hardy.plan.hardware import get_hardware, interpolate_log
from hardy.plan.timing import StepSetup, layer_elementwise_bytes, layer_seconds, model_elementwise_bytes, step_time

# (dim, ffn, heads, kv heads, head dim, vocab): unequal head/width ratios so every term is exercised
SHAPES = [(64, 176, 4, 2, 16, 512), (96, 640, 3, 1, 64, 2048), (192, 384, 2, 1, 32, 1024)]


def _config(dim, ffn, heads, kv, hd, vocab, layers=1, seq=64):
    return ModelConfig(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv, ffn_dim=ffn,
                       head_dim=hd, max_seq_len=seq, tie_embeddings=True, name="t")


@pytest.mark.parametrize("shape", SHAPES)
def test_layer_traffic_matches_the_count_of_hardys_operators(shape):
    batch, seq = 2, 64
    cfg = _config(*shape, seq=seq)
    block = TransformerBlock(cfg)
    counted = layer_traffic(block, torch.randn(batch, seq, cfg.dim), Rotary.shared(*rope_tables(cfg, seq))).bytes
    predicted = layer_elementwise_bytes(arch_from_llama(cfg), StepSetup(seq=seq, micro_batch=batch, micro_batches=1,
                                                                        precision="fp32"))
    assert predicted == pytest.approx(counted, rel=0.02)


@pytest.mark.parametrize("shape", SHAPES)
def test_model_traffic_outside_the_layers(shape):
    """Whole model, forward + backward: layers + embedding/norm/loss as the planner counts them."""
    batch, seq, layers = 2, 64, 2
    cfg = _config(*shape, layers=layers, seq=seq)
    model = Transformer(cfg)
    x, y = torch.randint(0, cfg.vocab_size, (2, batch, seq))
    with ElementwiseTraffic() as traffic:
        model(x, targets=y).backward()
    s = StepSetup(seq=seq, micro_batch=batch, micro_batches=1, precision="fp32")
    arch = arch_from_llama(cfg)
    assert layers * layer_elementwise_bytes(arch, s) + model_elementwise_bytes(arch, s) == pytest.approx(
        traffic.bytes, rel=0.03)


def test_measured_rates_drive_the_step_time():
    """Halving the attention rate adds exactly the attention core's time; the GEMM rate follows the
    model's width in the measured table; an elementwise rate halved doubles that part."""
    base = get_hardware("h100-sxm")
    hw = dataclasses.replace(base, gemm_efficiency_by_width=((64, 0.2), (4096, 0.8)),
                             attention_efficiency_by_head_dim=((16, 0.1), (128, 0.4)))
    arch = arch_from_llama(_config(64, 176, 4, 2, 16, 512, layers=2, seq=256))
    s = StepSetup(seq=256, micro_batch=4, micro_batches=1, precision="bf16")
    assert hw.gemm_rate("bf16", 64) == pytest.approx(0.2 * hw.peak("bf16"))
    assert hw.gemm_rate("bf16", 512) == pytest.approx(hw.peak("bf16") * interpolate_log(hw.gemm_efficiency_by_width, 512))
    assert 0.2 < interpolate_log(hw.gemm_efficiency_by_width, 512) < 0.8
    one = layer_seconds(arch, hw, s)
    slow_attn = dataclasses.replace(hw, attention_efficiency_by_head_dim=((16, 0.05), (128, 0.2)))
    core_flops = 3 * 4 * (4 * 256) * 256 * arch.q_dim * 0.5  # fwd + bwd: 3 x the causal Q.K^T and P.V
    core_s = core_flops / (0.1 * hw.peak("bf16"))
    assert layer_seconds(arch, slow_attn, s)["gemm"] - one["gemm"] == pytest.approx(core_s, rel=1e-6)
    slow_elem = dataclasses.replace(hw, elementwise_bandwidth=hw.elementwise_rate() / 2)
    assert layer_seconds(arch, slow_elem, s)["elementwise"] == pytest.approx(2 * one["elementwise"])
    # Without measured tables (a catalogue GPU) GEMMs run at the entry's large-GEMM rate and attention at its
    # cited flash-attention figure
    assert base.gemm_rate("bf16", 64) == base.achievable_flops("bf16")
    assert base.attention_rate("bf16", 16) == pytest.approx(base.attention_efficiency * base.peak("bf16"))
    assert step_time(arch, hw, s, 1e6).compute_s > step_time(arch, base, s, 1e6).compute_s


def test_split_shares_compute_and_bandwidth():
    base = get_hardware("h100-sxm")
    half = base.split(2)
    assert half.peak("bf16") == base.peak("bf16") / 2 and half.memory_bytes == base.memory_bytes / 2
    pinned = base.split(2, share=0.25, name="quarter")
    assert pinned.name == "quarter" and pinned.peak("bf16") == base.peak("bf16") / 4
    assert pinned.memory_bandwidth == base.memory_bandwidth / 4 and pinned.memory_bytes == base.memory_bytes / 2
    assert pinned.elementwise_rate() == base.elementwise_rate() / 4
    assert base.split(1) is base
