"""The Llama model on the micro preset: parameter counts, meta-device build, RoPE and KV cache."""
from __future__ import annotations

import pytest
import torch

from hardy.errors import HardyError
from hardy.model.config import PRESETS, ModelConfig, count_parameters, get_preset
from hardy.model.transformer import Transformer, build_model, rope_inv_freq

PUBLISHED = {"llama3.1-8b": 8.03e9, "llama3.1-70b": 70.6e9, "llama3.1-405b": 405.9e9}


@pytest.mark.parametrize("name", ["micro", "tiny", "smollm2-135m"])
def test_param_count_equals_numel(name):
    cfg = get_preset(name)
    model = build_model(cfg)
    assert count_parameters(cfg).total == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_llama31_param_counts_on_meta(name):
    cfg = get_preset(name)
    with torch.device("meta"):
        model = Transformer(cfg)
    assert all(p.is_meta for p in model.parameters())
    numel = sum(p.numel() for p in model.parameters())
    assert numel == count_parameters(cfg).total
    assert abs(numel - PUBLISHED[name]) / PUBLISHED[name] < 0.005


def test_untied_count_includes_head():
    cfg = get_preset("micro").replace(tie_embeddings=False)
    model = build_model(cfg)
    assert model.output.weight is not model.tok_embeddings.weight
    assert count_parameters(cfg).total == sum(p.numel() for p in model.parameters())


def test_meta_build_then_materialize_is_seeded_and_tied():
    cfg = get_preset("micro")
    a, b = build_model(cfg, seed=3), build_model(cfg, seed=3)
    c = build_model(cfg, seed=4)
    for (name, pa), pb, pc in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.layers[0].attention.wq.weight, c.layers[0].attention.wq.weight)
    assert a.output.weight is a.tok_embeddings.weight


def test_unknown_preset_and_bad_config():
    with pytest.raises(HardyError, match="unknown model preset"):
        get_preset("gpt-5")
    with pytest.raises(HardyError, match="multiple of n_kv_heads"):
        ModelConfig(vocab_size=10, dim=64, n_layers=1, n_heads=4, n_kv_heads=3, ffn_dim=8)
    with pytest.raises(HardyError, match=r"dropout must be in \[0, 1\)"):
        get_preset("micro").replace(dropout=1.0)


def test_dropout_acts_only_in_training_mode():
    plain, dropped = build_model(get_preset("micro"), seed=1), build_model(get_preset("micro").replace(dropout=0.3), seed=1)
    tokens = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    plain.eval(), dropped.eval()
    assert torch.equal(dropped(tokens), plain(tokens))  # inference: no dropout at all
    dropped.train()
    torch.manual_seed(5)
    a = dropped(tokens)
    torch.manual_seed(5)
    assert torch.equal(dropped(tokens), a)  # the masks come from the global RNG
    assert (a - plain(tokens)).abs().max() > 1e-3


def test_llama31_rope_scaling_matches_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = get_preset("llama3.1-8b")
    hf_cfg = transformers.LlamaConfig(
        hidden_size=cfg.dim, num_attention_heads=cfg.n_heads, head_dim=cfg.d_head,
        rope_parameters={"rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192})
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    ours = rope_inv_freq(cfg.d_head, cfg.rope_theta, cfg.rope_scaling)
    unscaled = rope_inv_freq(cfg.d_head, cfg.rope_theta, None)
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)
    assert not torch.allclose(ours, unscaled)  # the scaling really changes low frequencies


@torch.inference_mode()
def test_kv_cache_decode_matches_full_forward(micro_model):
    tokens = torch.randint(0, micro_model.cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    full = micro_model(tokens)
    micro_model.setup_kv_cache(2, 32)
    try:
        steps = [micro_model(tokens[:, :10], 0)]  # prefill
        steps.append(micro_model(tokens[:, 10:16], 10))  # a continued prefill uses the offset mask
        steps += [micro_model(tokens[:, i:i + 1], i) for i in range(16, 24)]
    finally:
        micro_model.clear_kv_cache()
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)


# parameter counts on the models' cards (Hugging Face: SmolLM2-135M, Llama-3.1-8B/70B/405B)
PUBLISHED_PARAMS = {"smollm2-135m": 134_515_008, "llama3.1-8b": 8_030_261_248, "llama3.1-70b": 70_553_706_496,
                    "llama3.1-405b": 405_853_388_800}


def test_presets_of_real_models_have_their_published_parameter_counts():
    """Built (shapes only, on the meta device) from each preset: the published count, tied embeddings
    counted once — a wrong width, head count, FFN size, vocabulary or tying changes it."""
    from hardy.model.transformer import meta_transformer

    assert set(PUBLISHED_PARAMS) <= set(PRESETS)
    for name, cfg in PRESETS.items():
        assert cfg.name == name
        if name in PUBLISHED_PARAMS:
            assert sum(p.numel() for p in meta_transformer(cfg).parameters()) == PUBLISHED_PARAMS[name], name


@pytest.mark.parametrize("masked", [False, True])
def test_expanded_kv_heads_give_native_gqa_attention(masked):
    """The two ways attend() runs grouped KV heads through SDPA (native enable_gqa, or K/V repeated per
    query head: what CUDA needs to keep a fused kernel for fp32 or masked calls) agree, values and
    gradients; and the choice between them follows the device, dtype and mask."""
    import types

    from hardy.model.transformer import attend, attention_mask, expand_kv_for_sdpa

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 5, 16, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 5, 16, generator=g, requires_grad=True)
    v = torch.randn(2, 2, 5, 16, generator=g, requires_grad=True)
    mask = attention_mask(torch.arange(5), 5, window=3) if masked else None
    outs = []
    for expand in (False, True):
        out = attend(q, k, v, mask, causal=not masked, scale=None, cap=None, expand_kv=expand)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        outs.append((out.detach(), grads))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-6)
    for a, b in zip(outs[0][1], outs[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    def fake(cuda: bool, dtype) -> types.SimpleNamespace:
        return types.SimpleNamespace(is_cuda=cuda, dtype=dtype)

    assert not expand_kv_for_sdpa(fake(False, torch.float32), mask)  # CPU: native GQA costs no copy
    assert expand_kv_for_sdpa(fake(True, torch.float32), None)  # flash takes no fp32
    assert expand_kv_for_sdpa(fake(True, torch.bfloat16), torch.ones(1, dtype=torch.bool))  # nor a mask
    assert not expand_kv_for_sdpa(fake(True, torch.bfloat16), None)  # flash, with native GQA
