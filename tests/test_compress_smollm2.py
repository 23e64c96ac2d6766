"""The perplexity orderings of the compression methods, on SmolLM2 (a converged model, loaded once per
session) and a short slice of WikiText-2 test.

Why here and not on the `mini` model trained in the test session: a few hundred steps leave that model
far from any optimum (its held-out loss gradient has norm 1.2–1.9), so a weight change δ moves held-out
perplexity to first order (g·δ, of either sign, a different draw for every trained instance) while what
GPTQ, AWQ and SparseGPT improve — fidelity to the dense model — moves it to second order. Measured on
four instances of that model (BENCHMARKS.md, bench/first_order_probe.py): RTN int4 ended up to 0.6%
*below* the dense model, magnitude 2:4 beat SparseGPT in perplexity with 3.5× its KL, and which method
"won" flipped between an AVX2 and an AVX-512 machine. test_compress_model.py checks the orderings there
in KL to the dense model (1.4–3.7× margins); here, on a model near its optimum, perplexity tracks
fidelity.

Only BLOCKS are compressed (the rest stay dense and carry the calibration activations on): AWQ's search
alone takes 210 s for all 30 blocks here. They are the two blocks where RTN int4 g128 costs the most
perplexity on its own (29: +7.7%, 19: +5.0%; most blocks cost < 1%, some "gain" from the same
first-order noise). The weights are fixed, not trained in the session, so the margins are the same on
every machine. Measured on the slice used here / two more 1,024-token slices of WikiText-2 test (from
tokens 20,000 and 40,000): int4 g128 RTN +13.3 / +10.5 / +10.9%, GPTQ +3.9 / +0.7 / +2.1%, AWQ
−0.5 / +1.2 / +1.6%; int3 g128 RTN +25 / +37 / +26%, GPTQ +12 / +13 / +12%, AWQ +4 / +6 / +4%; 50%:
magnitude +58 / +170 / +118%, Wanda +0.1 / +5 / +4%, SparseGPT +3 / +10 / +5%; 2:4: magnitude +51 /
+102 / +63%, Wanda +10 / +17 / +9%, SparseGPT +8 / +14 / +13%. (With blocks 19, 20 and 29 the margins
were alike and the tests took a third longer.)
"""
from __future__ import annotations

import pytest
import torch

from hardy.compress.pipeline import CompressConfig, compress_model
from hardy.errors import HardyError
from hardy.eval.perplexity import perplexity

BLOCKS = (19, 29)


@pytest.fixture(scope="module")
def smol(smollm2):
    from hardy.compress.pipeline import calibration_batch
    from hardy.data.text import read_text

    model, tok = smollm2.model, smollm2.tokenizer
    calib = calibration_batch(tok, read_text("wikitext2-valid")[:100_000], 4, 128, seed=0)
    heldout = tok.encode(read_text("wikitext2-test")[:10_000])[:1024]
    base = {k: v.clone() for k, v in model.state_dict().items()}
    results = {}

    def run(**kw) -> float:
        key = tuple(sorted(kw.items()))
        if key not in results:
            model.load_state_dict(base)
            compress_model(model, CompressConfig(calib_samples=4, calib_seq=128, blocks=BLOCKS, **kw), calib,
                           progress=False)
            results[key] = perplexity(model, heldout, ctx=512, bos_id=tok.bos_id, add_bos=tok.add_bos,
                                      batch_size=2).ppl
            model.load_state_dict(base)  # the session's shared SmolLM2 stays dense
        return results[key]

    yield {"run": run, "model": model, "base": base, "calib": calib}
    model.load_state_dict(base)


@pytest.mark.parametrize("bits", [4, 3])
def test_gptq_and_awq_beat_rtn_in_perplexity(smol, bits):
    rtn = smol["run"](quant="rtn", bits=bits, group_size=128)  # int4 g32 is exact for RTN on SmolLM2
    for method in ("gptq", "awq"):
        ppl = smol["run"](quant=method, bits=bits, group_size=128)
        assert ppl < rtn, (method, bits, ppl, rtn)


@pytest.mark.parametrize("sparsity", ["0.5", "2:4"])
def test_wanda_and_sparsegpt_beat_magnitude_in_perplexity(smol, sparsity):
    """Wanda's ‖X_j‖ factor exists for models with outlier activation features; SmolLM2 has them, the
    tiny test models do not (there Wanda and magnitude trade places: BENCHMARKS.md)."""
    magnitude = smol["run"](prune="magnitude", sparsity=sparsity)
    for method in ("wanda", "sparsegpt"):
        ppl = smol["run"](prune=method, sparsity=sparsity)
        assert ppl < magnitude, (method, sparsity, ppl, magnitude)


def test_blocks_compresses_only_those_blocks(smol):
    model, base = smol["model"], smol["base"]
    try:
        result = compress_model(model, CompressConfig(quant="gptq", bits=4, group_size=128, calib_samples=4,
                                                      calib_seq=128, blocks=(2,)), smol["calib"], progress=False)
        state = model.state_dict()
        assert not torch.equal(state["layers.2.attention.wq.weight"], base["layers.2.attention.wq.weight"])
        assert all(torch.equal(state[k], base[k]) for k in base if not k.startswith("layers.2."))
        assert {r.name.split(".")[1] for r in result.reports} == {"2"} and set(result.quantized) == {
            r.name for r in result.reports}
    finally:
        model.load_state_dict(base)
    with pytest.raises(HardyError, match="the model has 30 blocks"):
        compress_model(model, CompressConfig(quant="rtn", blocks=(30,)), None, progress=False)
    with pytest.raises(HardyError, match="distinct indices"):
        CompressConfig(quant="rtn", blocks=(1, 1))
