"""hardy compress: quantization formats (GGUF-identical blocks), GPTQ / AWQ / SparseGPT / Wanda against
their baselines, the stored directory, the quantized runtime and the CLI."""
from __future__ import annotations


import numpy as np
import pytest
import torch

from hardy.compress import awq, gptq, prune
from hardy.formats.quantized import QuantSpec, QuantTensor, fake_quantize, pack_int4, rtn, unpack_int4
from hardy.errors import HardyError


def _correlated(tokens=4096, width=256, seed=0):
    """Activations with correlated channels and a few outlier channels, like an LLM's."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 64, generator=g) @ torch.randn(64, width, generator=g) + 0.1 * torch.randn(tokens, width, generator=g)
    x[:, :4] *= 8
    w = torch.randn(192, width, generator=g) * 0.05
    return x, w


def _out_err(x, w, x_hat, w_hat):
    ref = x @ w.t()
    return float((x_hat @ w_hat.t() - ref).norm() / ref.norm())


# ------------------------------------------------------------------ formats

GRIDS = [QuantSpec(8, 0), QuantSpec(8, 32), QuantSpec(4, 32), QuantSpec(4, 128), QuantSpec(3, 128),
         QuantSpec(4, 32, True), QuantSpec(4, 128, True), QuantSpec(3, 128, True)]  # the last three: Q4_0's grid

@pytest.mark.parametrize("spec", GRIDS)
def test_rtn_round_trips_through_its_stored_form(spec):
    w = torch.randn(64, 256) * 0.02
    q = rtn(w, spec)
    back = QuantTensor.from_packed(q.packed(), spec, (64, 256))
    assert torch.equal(back.dequantize(), q.dequantize())
    err = float((q.dequantize() - w).norm() / w.norm())
    assert err < {8: 0.01, 4: 0.12, 3: 0.25}[spec.bits]
    if spec.bits == 4:
        assert q.packed()["qweight"].shape == (64, 128) and q.packed()["qweight"].dtype == torch.uint8
    assert q.stored_bits() == pytest.approx(spec.bits + 16 * (1 if spec.symmetric else 2) / (spec.group_size or 256))


@pytest.mark.parametrize("spec", GRIDS)
def test_fake_quantize_is_rtn_then_dequantize_bit_for_bit(spec):
    """AWQ's searches score candidates with fake_quantize: it must be exactly what rtn stores (576
    columns: a narrower last group at 128)."""
    w = torch.randn(48, 576) * 0.02
    w[:, 512:] *= 5
    assert torch.equal(fake_quantize(w, spec), rtn(w, spec).dequantize())


def test_a_narrower_last_group():
    """SmolLM2's 576 columns at group 128: four groups of 128 and one of 64."""
    w = torch.randn(8, 576)
    w[:, 512:] *= 10  # the last group has its own range
    q = rtn(w, QuantSpec(4, 128))
    assert q.scale.shape == (8, 5) and q.codes.shape == (8, 576)
    tail = rtn(w[:, 512:], QuantSpec(4, 64))
    assert torch.equal(q.dequantize()[:, 512:], tail.dequantize())
    assert torch.equal(QuantTensor.from_packed(q.packed(), q.spec, (8, 576)).dequantize(), q.dequantize())
    x = torch.randn(64, 576)
    s = awq.search_scale(x, [w], QuantSpec(4, 128))
    assert awq.awq_quantize(x / s, w * s, QuantSpec(4, 128)).scale.shape == (8, 5)
    assert gptq.gptq(w, 2 * x.t() @ x / 64, QuantSpec(4, 128)).scale.shape == (8, 5)


def test_int4_packing_is_ggufs_block_order():
    codes = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    packed = pack_int4(codes)
    assert torch.equal(unpack_int4(packed), codes)
    assert packed[0, 0] == codes[0, 0] | (codes[0, 16] << 4)  # byte j: code j low, code j + 16 high
    assert packed[1, 16] == codes[1, 32] | (codes[1, 48] << 4)


def test_int4_g32_and_int8_g32_are_gguf_q4_1_and_q8_0_exactly():
    gguf = pytest.importorskip("gguf")
    w = torch.randn(8, 128) * 0.05
    q4 = rtn(w, QuantSpec(4, 32)).packed()
    blocks = np.concatenate([q4["scales"].reshape(-1, 1).numpy().view(np.uint8),
                             q4["mins"].reshape(-1, 1).numpy().view(np.uint8),
                             q4["qweight"].reshape(-1, 16).numpy()], axis=1).reshape(8, -1)
    ref = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_1)
    assert np.array_equal(ref, rtn(w, QuantSpec(4, 32)).dequantize().numpy())
    q8 = rtn(w, QuantSpec(8, 32)).packed()
    blocks = np.concatenate([q8["scales"].reshape(-1, 1).numpy().view(np.uint8),
                             q8["qweight"].reshape(-1, 32).numpy().view(np.uint8)], axis=1).reshape(8, -1)
    ref = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(ref, rtn(w, QuantSpec(8, 32)).dequantize().numpy())


def test_symmetric_int4_g32_is_gguf_q4_0_exactly():
    """No mins: the fp16 scale and the nibbles are a Q4_0 block, dequantized as (q − 8)·d; the group's
    largest-magnitude weight lands on code 0 exactly (llama.cpp's rule), and zero weights stay zero."""
    gguf = pytest.importorskip("gguf")
    w = torch.randn(8, 128) * 0.05
    w[:, 40:50] = 0
    q = rtn(w, QuantSpec(4, 32, True))
    p = q.packed()
    assert set(p) == {"qweight", "scales"} and q.stored_bits() == 4.5
    blocks = np.concatenate([p["scales"].reshape(-1, 1).numpy().view(np.uint8), p["qweight"].reshape(-1, 16).numpy()],
                            axis=1).reshape(8, -1)
    ref = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_0)
    assert np.array_equal(ref, q.dequantize().numpy())
    extreme = w.view(8, 4, 32).abs().argmax(-1)
    assert (q.codes.view(8, 4, 32).gather(-1, extreme[..., None]) == 0).all()
    assert (q.dequantize()[:, 40:50] == 0).all()
    # what llama.cpp's own Q4_0 quantizer makes of the same weights: the same scales, codes within one step
    theirs = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_0).reshape(8, 4, 18)
    assert np.array_equal(theirs[..., :2].copy().view(np.float16)[..., 0], p["scales"].numpy())
    their_codes = torch.from_numpy(np.ascontiguousarray(theirs[..., 2:]).reshape(8, 64))
    assert (unpack_int4(their_codes).int() - q.codes.int()).abs().max() <= 1


def test_bad_specs_are_readable_errors():
    with pytest.raises(HardyError, match="bits must be 8, 5, 4 or 3"):
        QuantSpec(6, 32)
    with pytest.raises(HardyError, match="K-quant forms are 4- or 5-bit .* or 6-bit"):  # 6 bits: GGUF Q6_K's form alone
        QuantSpec(6, 32, True, super_block=256)
    with pytest.raises(HardyError, match="multiple of 32"):
        QuantSpec(4, 48)
    with pytest.raises(HardyError, match="multiple of 32"):
        rtn(torch.randn(4, 80), QuantSpec(4, 32)).packed()
    with pytest.raises(HardyError, match="sparsity"):
        prune.Sparsity.parse("1.5")


# ------------------------------------------------------------------ methods on one layer

@pytest.mark.parametrize("spec", [QuantSpec(4, 32), QuantSpec(4, 128), QuantSpec(3, 128), QuantSpec(8, 0),
                                  QuantSpec(4, 32, True)])
def test_gptq_and_awq_cut_the_layer_output_error_of_rtn(spec):
    x, w = _correlated()
    h = 2 * x.t() @ x / x.shape[0]
    e_rtn = _out_err(x, w, x, rtn(w, spec).dequantize())
    e_gptq = _out_err(x, w, x, gptq.gptq(w, h, spec).dequantize())
    assert e_gptq <= 0.9 * e_rtn
    assert _out_err(x, w, x, gptq.gptq(w, h, spec, act_order=False).dequantize()) <= e_rtn
    s = awq.search_scale(x, [w], spec)
    e_awq = _out_err(x, w, x / s, awq.awq_quantize(x / s, w * s, spec).dequantize())
    assert e_awq <= 0.9 * e_rtn


def test_awq_searches_the_duo_form_too():
    """Input channels whose weights are small within their groups (here: channels of very different
    weight magnitude) are better served by AutoAWQ's s = mean|x|^α / salience(w)^(1-α) than by any
    s = mean|x|^α of the paper's grid; the search finds it."""
    x, w = _correlated()
    w = w * torch.exp(torch.randn(w.shape[1], generator=torch.Generator().manual_seed(10)))
    spec = QuantSpec(4, 32)

    def err(s):
        return _out_err(x, w, x / s, rtn(w * s, spec).dequantize())

    paper = [x.abs().mean(0).pow(i / awq.GRID) for i in range(awq.GRID)]
    best_paper = min(err(s / (s.max() * s.min()).sqrt()) for s in paper)
    assert err(awq.search_scale(x, [w], spec)) < 0.7 * best_paper


def test_awq_scores_candidates_by_the_second_moment_exactly():
    x, w = _correlated()
    delta = torch.randn_like(w) * 0.01
    direct = float(((x @ delta.t()) ** 2).mean())
    assert awq._output_error(awq.second_moment(x), delta) == pytest.approx(direct, rel=1e-4)


def test_awq_clip_search_moves_both_ends_of_an_asymmetric_grid():
    """Groups with one large positive weight: the best range cuts the top and keeps the bottom, which
    no single shrink ratio of both ends can do."""
    x, w = _correlated()
    w[:, ::32] = w.abs().max() * 3  # a lone large weight at the top of every group
    spec = QuantSpec(4, 32)

    def err(clipped):
        return _out_err(x, w, x, rtn(clipped, spec).dequantize())

    wg = w.reshape(w.shape[0], -1, 32)
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    one_ratio = min(err(torch.minimum(torch.maximum(wg, lo * r), hi * r).reshape(w.shape)) for r in awq.CLIP_RATIOS)
    assert err(awq.search_clip(x, w, spec)) < 0.8 * one_ratio


def test_gptq_keeps_a_pruning_mask():
    x, w = _correlated()
    h = 2 * x.t() @ x / x.shape[0]
    pruned, mask = prune.sparsegpt(w, h, prune.Sparsity(fraction=0.5))
    q = gptq.gptq(pruned, h, QuantSpec(8, 0), mask=mask)
    assert (q.dequantize()[~mask] == 0).all()  # symmetric grid: zero is exact


@pytest.mark.parametrize("sparsity", ["0.5", "2:4"])
def test_pruning_methods_hit_the_sparsity_and_beat_magnitude(sparsity):
    x, w = _correlated()
    h = 2 * x.t() @ x / x.shape[0]
    sp = prune.Sparsity.parse(sparsity)
    results = {"magnitude": prune.magnitude(w, sp), "wanda": prune.wanda(w, torch.diag(h), sp),
               "sparsegpt": prune.sparsegpt(w, h, sp)}
    for name, (pruned, mask) in results.items():
        assert (pruned[~mask] == 0).all() and float((~mask).float().mean()) == pytest.approx(0.5, abs=0.01), name
        if sp.structured:  # exactly 2 zeros in every 4 consecutive input weights
            assert ((~mask).reshape(w.shape[0], -1, 4).sum(-1) == 2).all(), name
    err = {name: _out_err(x, w, x, p) for name, (p, _) in results.items()}
    assert err["wanda"] < err["magnitude"] and err["sparsegpt"] < err["magnitude"], err
