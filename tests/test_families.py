"""Every family against stock `transformers`: a tiny random model it builds and saves loads in hardy
with the same fp32 logits (1e-4) and the same greedy tokens; hardy's export loads back in
`transformers` with the same logits; what makes each family different really is exercised."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import hardy_main
from families import WINDOW, hf_configs, save_hf_model
from hardy.formats.hf import save_hf_dir
from hardy.infer.generate import SamplingConfig, generate
from hardy.loading.load import load_model

transformers = pytest.importorskip("transformers")
FAMILIES = list(hf_configs(transformers))
SEQ = 3 * WINDOW  # the windowed layers see a third of it
GREEDY = 12


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> (transformers model, directory it saved)."""
    out = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family)
        out[family] = (save_hf_model(transformers, family, path), path)
    return out


def _tokens(batch=2, seq=SEQ, seed=3):
    return torch.randint(0, 320, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_logits_and_greedy_tokens_equal_transformers(saved, family):
    hf, path = saved[family]
    ours = load_model(str(path))
    assert ours.config.family == family
    tokens = _tokens()
    torch.testing.assert_close(ours.model(tokens), hf(tokens).logits, rtol=0, atol=1e-4)
    prompt = _tokens(1, 10, seed=4)
    theirs = hf.generate(prompt, max_new_tokens=GREEDY, min_new_tokens=GREEDY, do_sample=False,
                         pad_token_id=0)[0, 10:].tolist()
    assert generate(ours.model, prompt[0].tolist(), SamplingConfig(max_new_tokens=GREEDY)).tokens == theirs


# What makes a family different, switched off: the logits must move (or the parity above proves little).
DISTINCT = {
    "mistral": dict(sliding_window=None, layer_types=()),
    "qwen2": "biases",
    "qwen3": "qk_norm",
    "gemma2": dict(attn_softcap=None, logit_softcap=None),
    "gemma3_text": dict(rope_local_theta=None),
}


@pytest.mark.parametrize("family", list(DISTINCT))
@torch.inference_mode()
def test_what_makes_the_family_different_is_exercised(saved, family):
    ours = load_model(str(saved[family][1]))
    tokens = _tokens()
    reference = ours.model(tokens)
    change = DISTINCT[family]
    if change == "biases":
        for layer in ours.model.layers:
            for lin in (layer.attention.wq, layer.attention.wk, layer.attention.wv):
                lin.bias.zero_()
    elif change == "qk_norm":
        for layer in ours.model.layers:
            layer.attention.q_norm.weight.fill_(1.0)
    else:
        from hardy.model.transformer import Transformer

        other = Transformer(ours.config.replace(**change))
        other.load_state_dict(ours.model.state_dict())
        other.reset_rope()
        ours.model = other.eval()
    assert (ours.model(tokens) - reference).abs().max() > 1e-2


@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_hardys_export_loads_in_transformers_with_the_same_logits(saved, family, tmp_path):
    ours = load_model(str(saved[family][1]))
    save_hf_dir(ours.config, ours.model.state_dict(), None, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32,
                                                             attn_implementation="eager").eval()
    tokens = _tokens()
    torch.testing.assert_close(back(tokens).logits, ours.model(tokens), rtol=0, atol=1e-4)
    assert load_model(str(tmp_path / "out")).config == ours.config  # the config round-trips exactly


@torch.inference_mode()
def test_sharded_bf16_checkpoint_stays_bf16_with_dtype_bf16(tmp_path):
    hf = save_hf_model(transformers, "qwen3", tmp_path / "fp32")
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "bf16", max_shard_size="40KB")
    assert (tmp_path / "bf16" / "model.safetensors.index.json").is_file()
    bf16 = load_model(str(tmp_path / "bf16"), dtype=torch.bfloat16)
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
    for name, p in hf.state_dict().items():  # the file's own bf16 numbers, not re-rounded from fp32
        ours = bf16.model.get_parameter(_hardy_name(name)) if _hardy_name(name) else None
        if ours is not None:
            assert torch.equal(ours, p), name
    fp32 = load_model(str(tmp_path / "bf16"))  # widened tensor by tensor as it is placed
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32).eval()
    tokens = _tokens()
    torch.testing.assert_close(fp32.model(tokens), theirs(tokens).logits, rtol=0, atol=1e-4)


def _hardy_name(hf_name: str) -> str | None:
    from hardy.formats.names import from_format

    return from_format(hf_name, "hf")


def test_shapes_that_disagree_with_the_config_are_one_line_errors(saved, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(saved["qwen3"][1], bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "head_dim": 16}))
    proc = hardy_main("generate", "--model", str(bad), "--prompt", "x")
    assert proc.returncode == 2
    assert "tensor model.layers.0.self_attn.k_norm.weight has shape (32,), the config implies (16,)" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    (bad / "config.json").write_text(json.dumps({**config, "model_type": "mamba"}))
    proc = hardy_main("info", "--model", str(bad))
    assert proc.returncode == 2 and "unsupported model_type 'mamba'" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
