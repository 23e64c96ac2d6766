"""Every family through hardy's compression and its fused decode stack: `hardy compress` (GPTQ, AWQ, RTN,
Wanda) of a tiny model of each family, loaded back with quantized layers, stays close to the float
model; its decode steps through the one-call C++ stack (biases, q/k norms, sandwich norms, GELU-tanh,
query scale, soft-capping, sliding windows, local RoPE tables) agree with the model's own modules over
the paged cache in every KV dtype; and the greedy tokens of the two paths are the same."""
from __future__ import annotations

import pytest
import torch

from conftest import hardy_main
from families import hf_configs
from hardy.infer.kv import KV_DTYPES
from hardy.loading.load import load_model

transformers = pytest.importorskip("transformers")
FAMILIES = list(hf_configs(transformers))


def _compress(src, out, *args) -> None:
    proc = hardy_main("compress", "--model", str(src), "--out", str(out), "--calib-data", "tinyshakespeare",
                      "--calib-samples", "8", "--calib-seq", "64", "--group-size", "32", "--no-progress", *args)
    assert proc.returncode == 0, proc.stderr[-2000:]


METHODS = {"gptq4": ("--quant", "gptq", "--bits", "4"), "awq4": ("--quant", "awq", "--bits", "4"),
           "rtn8": ("--quant", "rtn", "--bits", "8"), "wanda": ("--prune", "wanda", "--sparsity", "0.5")}


@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_every_method_compresses_every_family(family_dirs, tmp_path, family):
    float_model = load_model(str(family_dirs[family])).model
    tokens = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(5))
    reference = torch.log_softmax(float_model(tokens), -1)
    for method, args in METHODS.items():
        _compress(family_dirs[family], tmp_path / method, *args)
        model = load_model(str(tmp_path / method)).model
        assert model.cfg == float_model.cfg
        logp = torch.log_softmax(model(tokens), -1)
        kl = float((reference.exp() * (reference - logp)).sum(-1).mean())
        assert kl < (0.5 if method == "wanda" else 0.1), (method, kl)
        if method != "wanda":  # quantized layers swapped in, biases and norms carried over
            assert sum(1 for m in model.modules() if type(m).__name__ == "QuantLinear") >= 7 * model.cfg.n_layers


def _decode(model, fused: bool, kv_dtype, lengths=(30, 11, 23)) -> torch.Tensor:
    """Four batched decode steps of rows prefilled to `lengths` (windows of 8 by default: rows see whole
    windows and partial ones): the logits [steps, rows, vocab]."""
    from hardy.infer.fused_decode import decode_hidden
    from hardy.infer.kv import PagedKVCache

    prompts = torch.randint(0, 320, (3, max(lengths)), generator=torch.Generator().manual_seed(1))
    cache = PagedKVCache(model, 3, max(64, max(lengths) + 8), kv_dtype)
    try:
        for row, n in enumerate(lengths):
            cache.pool.reserve(row, n)
            cache.use([row])
            model.hidden_states(prompts[row:row + 1, :n], 0)
        cache.use([0, 1, 2])
        positions, tokens, out = torch.tensor(lengths), prompts[:, -1:], []
        for _ in range(4):
            for row, p in enumerate(positions.tolist()):
                cache.pool.reserve(row, p + 1)
            h = decode_hidden(model, tokens, positions) if fused else model.hidden_states(tokens, positions)
            out.append(model.logits(h[:, -1]))
            tokens, positions = prompts[:, 20 + len(out):21 + len(out)], positions + 1
        return torch.stack(out)
    finally:
        model.clear_kv_cache()


@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_long_rows_in_chunks_compute_each_family_as_its_modules(int4_families, family):
    """Rows past the stack's 128-position attention chunks: a window of 8 that straddles two chunks
    (row 131 sees 124..131) and rows of several chunks, with each family's scale, caps and head size."""
    from hardy.infer.fused_decode import fused_blocks

    model = load_model(str(int4_families[family])).model
    assert fused_blocks(model) is not None
    lengths = (260, 127, 20)  # decoded to 263, 130 (the window 123..130 straddles 128) and 23
    fused = _decode(model, True, KV_DTYPES["fp32"], lengths)
    modules = _decode(model, False, KV_DTYPES["fp32"], lengths)
    error = (fused - modules).norm(dim=-1) / modules.norm(dim=-1)  # per step and row
    # As above: float rounding, and at most a flipped int8 activation code in a row; a chunk dropped or
    # merged wrong is off in every step of the long rows (7 of the 12)
    assert error.median() < 1e-5 and error.max() < 3e-2, error


@pytest.fixture(scope="module")
def int4_families(family_dirs, tmp_path_factory):
    out = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(f"int4-{family}") / "m"
        _compress(family_dirs[family], path, "--quant", "rtn", "--bits", "4")
        out[family] = path
    return out


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kv", ["fp32", "bf16", "fp16"])
@torch.inference_mode()
def test_fused_stack_computes_each_family_as_its_modules(int4_families, family, kv):
    from hardy.infer.fused_decode import fused_blocks, use_fused_blocks
    from hardy.infer.generate import SamplingConfig, generate

    model = load_model(str(int4_families[family])).model
    assert fused_blocks(model) is not None, "the fused stack must take every family"
    fused, modules = _decode(model, True, KV_DTYPES[kv]), _decode(model, False, KV_DTYPES[kv])
    error = (fused - modules).norm(dim=-1) / modules.norm(dim=-1)  # per step and row
    # The same arithmetic: most rows agree to float rounding. A key or value a last bit apart in fp32 can
    # round to another bf16/fp16 number on the two paths (seen: one row in 12, ~1e-2); a wrong rope,
    # norm, window or cache address is off everywhere.
    assert error.median() < 1e-5 and error.max() < 3e-2, error
    prompt = list(range(5, 17))
    fast = generate(model, prompt, SamplingConfig(max_new_tokens=20), kv_dtype=KV_DTYPES[kv]).tokens
    use_fused_blocks(model, False)
    assert generate(model, prompt, SamplingConfig(max_new_tokens=20), kv_dtype=KV_DTYPES[kv]).tokens == fast
