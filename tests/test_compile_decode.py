"""`generate --compile`: the decode step under torch.compile gives the eager tokens and logits, and
compiles once per (rounded) cache size — static shapes — not once per step or per length."""
from __future__ import annotations

import pytest
import torch
from conftest import hardy_main, run_hardy


@pytest.fixture(scope="module")
def mini_model(mini_run):
    from hardy.loading.load import load_model

    return load_model(str(mini_run / "run")).model.eval()


def test_compiled_decode_gives_the_eager_tokens_and_compiles_once(mini_model):
    from torch._dynamo.utils import counters

    from hardy.infer.generate import COMPILED_CACHE_STEP, SamplingConfig, compiled_decode_step, generate, next_logits

    prompt, cfg = [5, 80, 13, 200, 41], SamplingConfig(max_new_tokens=24)
    eager = generate(mini_model, prompt, cfg)
    counters.clear()
    compiled = generate(mini_model, prompt, cfg, compile=True)
    assert compiled.tokens == eager.tokens and len(set(eager.tokens)) > 3
    kept = list(mini_model.kept_kv_caches)  # the static cache, detached from the layers but kept
    assert len(kept) == mini_model.cfg.n_layers and all(b.attention.kv_cache is None for b in mini_model.layers)
    assert counters["stats"]["unique_graphs"] == 1  # 23 decode steps, one graph
    assert compiled.stats.compile_s > 0 and compiled.stats.decode_s > 0

    # Teacher-forced on the same tokens: every step's logits agree with the eager cached step.
    seq, total = prompt + eager.tokens, len(prompt) + len(eager.tokens)
    step = compiled_decode_step(mini_model)
    with torch.inference_mode():
        logits = {}
        for name in ("eager", "compiled"):
            mini_model.setup_kv_cache(1, min(COMPILED_CACHE_STEP, mini_model.cfg.max_seq_len))  # generate's size
            mini_model.hidden_states(torch.tensor([prompt]), 0)
            rows = []
            for pos in range(len(prompt), total):
                token = torch.tensor([[seq[pos]]])
                rows.append(next_logits(mini_model, token, pos) if name == "eager"
                            else step(mini_model, token, torch.tensor([pos]))[0])
            logits[name] = torch.stack(rows)
            mini_model.clear_kv_cache()
    assert counters["stats"]["unique_graphs"] == 1  # same shapes again: no recompile
    longer = generate(mini_model, prompt + [7, 7, 7], SamplingConfig(max_new_tokens=40), compile=True)
    assert counters["stats"]["unique_graphs"] == 1  # another length, the same rounded cache size
    # ... and the same buffers: a CUDA graph replays on the addresses it was captured with
    assert len(mini_model.kept_kv_caches) == len(kept) and all(a is b for a, b in zip(mini_model.kept_kv_caches, kept))
    assert longer.tokens == generate(mini_model, prompt + [7, 7, 7], SamplingConfig(max_new_tokens=40)).tokens
    diff = (logits["compiled"] - logits["eager"]).abs().max() / logits["eager"].abs().max()
    assert diff < 1e-4, diff


def test_generate_compile_cli(mini_run, mini_compressed):
    args = ["generate", "--model", str(mini_run / "run"), "--prompt", "KING:", "--max-new-tokens", "16", "--stats"]
    plain, compiled = hardy_main(*args), run_hardy(*args, "--compile", timeout=300)  # compiling in a fresh process
    assert plain.returncode == 0 and compiled.returncode == 0, compiled.stderr[-2000:]
    assert compiled.stdout == plain.stdout and "compile:" in compiled.stderr and "compile:" not in plain.stderr

    bad = hardy_main(*args, "--compile", "--tp", "2")
    assert bad.returncode == 2 and "--compile is for one process" in bad.stderr and "Traceback" not in bad.stderr
    bad = hardy_main(*args, "--compile", "--no-cache")
    assert bad.returncode == 2 and "--no-cache" in bad.stderr and "Traceback" not in bad.stderr

    out = mini_compressed("--bits", "8")  # quantized: the fused C++ stack is the fast path; the note says compile is not applied
    quant = hardy_main("generate", "--model", str(out), "--prompt", "KING:", "--max-new-tokens", "8", "--compile")
    assert quant.returncode == 0 and "note: --compile not applied: quantized layers" in quant.stderr
