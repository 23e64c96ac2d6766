"""The real SmolLM2-135M: logits parity with transformers, generation, export round trip."""
from __future__ import annotations

import pytest
import torch

from hardy.infer.generate import SamplingConfig, generate

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "In 1492, Columbus sailed 3,000 miles; the crew's food ran low. ",
    "<|im_start|>user\nWhat is 17 + 25?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.mark.parametrize("prompt", PROMPTS)
@torch.inference_mode()
def test_logits_match_transformers_gguf_loader(smollm2, hf_gguf_model, prompt):
    ids = torch.tensor([smollm2.tokenizer.encode(prompt)])
    ours = smollm2.model(ids)
    theirs = hf_gguf_model(ids).logits
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= 1e-3
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_greedy_generation_same_with_and_without_cache(smollm2):
    prompt = smollm2.tokenizer.encode("Once upon a time, in a small village,")
    cfg = SamplingConfig(max_new_tokens=64)
    cached = generate(smollm2.model, prompt, cfg, use_cache=True)
    uncached = generate(smollm2.model, prompt, cfg, use_cache=False)
    assert len(cached.tokens) == 64
    assert cached.tokens == uncached.tokens


def test_chat_answer_is_sensible(smollm2):
    tok = smollm2.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    out = generate(smollm2.model, tok.encode(text), SamplingConfig(max_new_tokens=16), stop_ids=tok.stop_ids)
    assert "Paris" in tok.decode(out.tokens)
    assert out.tokens[-1] in tok.stop_ids  # stops at <|im_end|> by itself


def test_sampling_is_seeded(smollm2):
    prompt = smollm2.tokenizer.encode("My favourite colour is")
    cfg = SamplingConfig(max_new_tokens=12, temperature=0.9, top_p=0.9, seed=7)
    a = generate(smollm2.model, prompt, cfg).tokens
    b = generate(smollm2.model, prompt, cfg).tokens
    c = generate(smollm2.model, prompt, SamplingConfig(max_new_tokens=12, temperature=0.9, top_p=0.9, seed=8)).tokens
    assert a == b
    assert a != c


@torch.inference_mode()
def test_safetensors_export_loads_in_transformers_with_equal_logits(smollm2, tmp_path):
    transformers = pytest.importorskip("transformers")
    from hardy.formats.hf import save_hf_dir
    from hardy.loading.load import load_model

    out = save_hf_dir(smollm2.config, smollm2.model.state_dict(), smollm2.tokenizer, tmp_path / "export")
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()}
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    reloaded = load_model(str(out))
    for prompt in PROMPTS[:2]:
        ids = smollm2.tokenizer.encode(prompt)
        assert hf_tok(prompt, add_special_tokens=True)["input_ids"] == ids
        x = torch.tensor([ids])
        ours = smollm2.model(x)
        assert (hf(x).logits - ours).abs().max().item() <= 1e-4
        assert torch.equal(reloaded.model(x), ours)  # fp32 export is lossless


def test_the_clis_default_native_path_answers_as_llama_cpp_does_on_the_same_file(smollm2_path):
    """The float path above (dequantized weights, fp32 activations) answers "Paris". The CLI's default,
    --gguf-weights native (Q4_1 matrices through hardy's kernels, activations quantized to int8 as
    llama.cpp quantizes them), answers what llama.cpp itself answers with this file, and not Paris:
    measured, the same 16 greedy tokens on an AVX2 EPYC; on an AVX-512 Xeon the same first 11, then a
    near-tie (0.25 apart in fp32-activation logits of spread 4.1) that each engine's int8 rounding broke its
    own way. So: at least 8 tokens agree, and where they part the two choices are within a tenth of the
    logits' spread of each other."""
    from llama_cpp import Llama

    from hardy.compress.qlinear import QuantLinear
    from hardy.loading.load import load_model

    native = load_model("smollm2-135m", gguf="native")
    layers = [m for m in native.model.modules() if isinstance(m, QuantLinear)]
    assert layers and all(m.kernel is not None for m in layers)  # the kernels' path, not a float copy
    tok = native.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    ours = generate(native.model, prompt, SamplingConfig(max_new_tokens=16), stop_ids=tok.stop_ids).tokens
    llm = Llama(model_path=str(smollm2_path), n_ctx=256, n_threads=2, verbose=False)
    theirs = []
    for token in llm.generate(prompt, temp=0.0, top_k=1):
        theirs.append(token)
        if len(theirs) == len(ours):
            break
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
    assert len(ours) == 16 and first >= 8, (tok.decode(ours), tok.decode(theirs))
    if first < len(ours):  # a near-tie, which the two engines' int8 rounding of the activations broke apart
        with torch.inference_mode():
            logits = native.model(torch.tensor([prompt + ours[:first]]))[0, -1].float()  # fp32 activations
        gap = (logits[ours[first]] - logits[theirs[first]]).abs()
        assert gap < 0.1 * logits.std(), (first, gap, tok.decode(ours), tok.decode(theirs))
