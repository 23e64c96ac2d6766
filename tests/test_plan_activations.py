"""`layer_activation_bytes` and `output_activation_bytes` on layers small enough to count by hand: every
recompute mode, tensor and sequence parallelism, dropout masks on GPU and CPU, flash and unfused
attention, the fused loss's chunks. The numbers below are counted from the tensors each layout keeps (the
formulas' comments), not computed by the formulas."""
from __future__ import annotations

import dataclasses

import pytest

from hardy.errors import HardyError
from hardy.plan.arch import Arch
from hardy.plan.memory import ActivationSetup, layer_activation_bytes, output_activation_bytes

# 8 tokens (2 sequences of 4) in bf16 (e = 2 bytes); h = 8, two heads of 4, one KV head, ffn 16 (Llama) or 32 (GPT)
LLAMA = Arch(family="llama", name="hand-llama", vocab_size=16, dim=8, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=4,
             ffn_dim=16, tie_embeddings=True, dropout=False, max_seq_len=4, params_total=0, params_per_layer=0,
             params_embedding=0, params_head=0)
GPT = Arch(family="gpt", name="hand-gpt", vocab_size=16, dim=8, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=4,
           ffn_dim=32, tie_embeddings=True, dropout=False, max_seq_len=4, params_total=0, params_per_layer=0,
           params_embedding=0, params_head=0, flash_attention=False)


def setup(**kw) -> ActivationSetup:
    return ActivationSetup(seq=4, micro_batch=2, **kw)


@pytest.mark.parametrize("recompute, tp, sp, expected", [
    # none: per token, replicated 6·h·e + two fp32 1/rms = 104, split (2q + 2kv + 4f)·e + 4 per head = 184
    ("none", 1, False, 8 * (104 + 184)),
    ("none", 2, False, 8 * (104 + 184 / 2)),
    ("none", 2, True, 8 * (104 + 184) / 2),
    # hardy's op-level selective: replicated 3·h·e = 48, split (2q + 2kv + 2f)·e + 8 = 120
    ("selective", 1, False, 8 * (48 + 120)),
    ("selective", 2, True, 8 * (48 + 120) / 2),
    # torchtitan's op-level policy: replicated 2·h·e = 32, split (2q + kv + f)·e + 8 = 80
    ("selective_op", 2, False, 8 * (32 + 80 / 2)),
    ("selective_op", 4, True, 8 * (32 + 80) / 4),
    # full: the layer input alone, h·e = 16, split only by SP
    ("full", 2, False, 8 * 16),
    ("full", 2, True, 8 * 16 / 2),
])
def test_llama_layer_by_hand(recompute, tp, sp, expected):
    assert layer_activation_bytes(LLAMA, setup(tp=tp, sequence_parallel=sp, recompute=recompute)) == expected


@pytest.mark.parametrize("cpu, mask_bytes", [(False, 1), (True, 2)])
def test_llama_dropout_keeps_two_masks_of_a_byte_on_gpu_and_of_the_dtype_on_cpu(cpu, mask_bytes):
    arch = dataclasses.replace(LLAMA, dropout=True)
    masks = 2 * 8 * mask_bytes  # two residual dropouts per token
    assert layer_activation_bytes(arch, setup(cpu=cpu)) == 8 * (104 + masks + 184)
    assert layer_activation_bytes(arch, setup(cpu=cpu, recompute="selective", tp=2, sequence_parallel=True)) == \
        8 * (48 + masks + 120) / 2
    assert layer_activation_bytes(arch, setup(cpu=cpu, recompute="selective_op")) == 8 * (32 + masks + 80)


@pytest.mark.parametrize("dropout, flash, recompute, tp, sp, expected", [
    # replicated 4·h·e = 64 (+ two 1-byte masks per h with dropout: 16), split 4·h·e + 2·f·e = 192;
    # unfused scores 2 sequences x 2 heads x 4 x 4: e each (128), with dropout 2e + 1 each (320)
    (False, False, "none", 1, False, 8 * 64 + 8 * 192 + 128),
    (True, False, "none", 1, False, 8 * 80 + 8 * 192 + 320),
    (True, False, "none", 2, True, (8 * 80 + 8 * 192 + 320) / 2),
    (True, False, "none", 2, False, 8 * 80 + (8 * 192 + 320) / 2),
    (True, False, "selective", 2, False, 8 * 80 + 8 * 192 / 2),  # Megatron's selective drops the scores
    # a flash kernel keeps an fp32 log-sum-exp per head and token instead: 8 x 2 x 4 = 64
    (True, True, "none", 1, False, 8 * 80 + 8 * 192 + 64),
    (True, True, "selective", 2, True, (8 * 80 + 8 * 192 + 64) / 2),
])
def test_gpt_layer_by_hand(dropout, flash, recompute, tp, sp, expected):
    arch = dataclasses.replace(GPT, dropout=dropout, flash_attention=flash)
    assert layer_activation_bytes(arch, setup(tp=tp, sequence_parallel=sp, recompute=recompute)) == expected


def test_an_unknown_recompute_mode_is_a_one_line_error_naming_the_modes():
    with pytest.raises(HardyError) as err:
        layer_activation_bytes(LLAMA, setup(recompute="half"))
    assert str(err.value) == "recompute must be one of none, selective, full, selective_op (got 'half')"


@pytest.mark.parametrize("tp, sp, kept", [
    (1, False, 8 * 8 * 2 + 4 * 8 * 16),  # the final LayerNorm's input (h·e) and fp32 logits (4·V) per token
    (2, False, 8 * 8 * 2 + 4 * 8 * 16 / 2),  # the logits split by TP
    (2, True, (8 * 8 * 2 + 4 * 8 * 16) / 2),  # and the LayerNorm input by SP
])
def test_gpt_output_layer_by_hand(tp, sp, kept):
    out = output_activation_bytes(GPT, setup(tp=tp, sequence_parallel=sp))
    assert out == (kept, 0.0)


def test_llama_fused_loss_keeps_gradients_and_holds_its_chunks_only_while_computing():
    # per token the final norm's input and output and d(loss)/d(hidden) (3·h·e) and 1/rms (4); the head
    # weight's fp32 gradient (4·V·h); while computing, one chunk's logits and log-softmax in fp32
    out = output_activation_bytes(LLAMA, setup())
    assert out == (8 * (3 * 8 * 2 + 4) + 4 * 16 * 8, 2 * 4 * 8 * 16)  # 8 rows fit one chunk of 2^24 logits
    # 3,000,000 words: 5 rows per chunk; 11 tokens in 3 chunks of at most 4 rows
    big = dataclasses.replace(LLAMA, vocab_size=3_000_000)
    out = output_activation_bytes(big, ActivationSetup(seq=11, micro_batch=1))
    assert out == (11 * 52 + 4 * 3_000_000 * 8, 2 * 4 * 4 * 3_000_000)
    # a vocabulary past 2^24: a row per chunk
    huge = dataclasses.replace(LLAMA, vocab_size=1 << 25)
    assert output_activation_bytes(huge, ActivationSetup(seq=11, micro_batch=1)).transient == 2 * 4 * (1 << 25)
