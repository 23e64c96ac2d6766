"""The families through what serves them: `generate --tp 2` (q/k/v biases sliced with their rows, q/k norms
and sandwich norms replicated) gives one process's greedy text; `hardy serve` on the real Gemma 3 file with
default flags answers concurrent clients with the text `generate` gives; `eval rank` scores candidates
with each family."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import hardy_main, run_hardy

TP_FAMILIES = ["qwen2", "gemma3_text"]


@pytest.fixture(scope="module")
def int4_dirs(family_dirs, tmp_path_factory):
    out = {}
    for family in TP_FAMILIES:
        path = tmp_path_factory.mktemp(f"tp-{family}") / "m"
        proc = hardy_main("compress", "--model", str(family_dirs[family]), "--out", str(path), "--quant", "rtn",
                          "--bits", "4", "--group-size", "32", "--no-progress")
        assert proc.returncode == 0, proc.stderr
        out[family] = path
    return out


PROMPT = "KING RICHARD:"
# Logits within which --tp 2 and one process may order two tokens either way: float ranks add in another
# order (~1e-6 apart); int8-quantized activations turn that into a flipped rounding now and then (~1e-2).
NEAR_TIE = {"float": 1e-4, "int4": 0.05}


def _module_path_greedy(model_dir, n: int) -> tuple[list[int], list[float], object]:
    """One process's greedy tokens through the blocks as modules (the path --tp runs: its blocks are
    sharded, so the fused decode stack does not apply), with each step's top-2 logit margin."""
    from unittest import mock

    from hardy.cli.common import use_fast_prefill
    from hardy.infer import fused_decode
    from hardy.infer.generate import SamplingConfig, generate
    from hardy.loading.load import load_model

    loaded = load_model(str(model_dir))
    use_fast_prefill(loaded)
    model, margins = loaded.model, []
    head = model.logits

    def recorded(h):
        out = head(h)
        top = torch.topk(out.reshape(-1, out.shape[-1])[-1].float(), 2).values
        margins.append(float(top[0] - top[1]))
        return out

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with mock.patch.object(fused_decode, "fused_blocks", lambda m: None), \
                mock.patch.object(model, "logits", recorded):
            tokens = generate(model, loaded.tokenizer.encode(PROMPT), SamplingConfig(max_new_tokens=n),
                              stop_ids=loaded.tokenizer.stop_ids, kv_dtype=torch.float32).tokens
    finally:
        torch.set_num_threads(threads)
    return tokens, margins, loaded.tokenizer


@pytest.mark.parametrize("family", TP_FAMILIES)
@pytest.mark.parametrize("kind", ["float", "int4"])
def test_tp2_generates_one_process_text(family_dirs, int4_dirs, family, kind):
    """`generate --tp 2` prints one process's greedy text up to the first near-tie of one process's
    logits (all of it where there is none). A random model has many: gemma3_text int4 parted from
    one process at a 0.0003-logit tie on 2026-12-05's EPYC."""
    model = family_dirs[family] if kind == "float" else int4_dirs[family]
    ours, margins, tok = _module_path_greedy(model, 24)
    agreed = next((i for i, m in enumerate(margins) if m < NEAR_TIE[kind]), len(ours))
    stream = tok.stream_decoder()
    expected = PROMPT + "".join(stream.step(t) for t in ours[:agreed] if t not in tok.stop_ids)
    two = run_hardy("generate", "--model", str(model), "--prompt", PROMPT, "--max-new-tokens", "24", "--threads", "2",
                    "--kv-dtype", "fp32", "--stats", "--tp", "2", timeout=300)
    assert two.returncode == 0, two.stderr[-2000:]
    # a random model's text: bytes, some not printable (held back as partial UTF-8); all 24 generated
    assert "decode: 24 tokens" in two.stderr and len(ours) == 24
    if agreed == len(ours):
        assert two.stdout == expected + "\n"
    else:
        assert two.stdout.startswith(expected), (agreed, margins[agreed])


def test_serve_answers_concurrent_clients_on_the_real_gemma_file():
    """`hardy serve --model gemma3-270m` with default flags: context min(32768, 4096), a bf16 paged cache,
    three clients batched; each gets the greedy text `generate` gives alone."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from hardy.infer.generate import SamplingConfig, generate
    from hardy.loading.load import load_model
    from serving import Served

    loaded = load_model("gemma3-270m", gguf="native")
    prompts = ["The capital of France is", "Robert Boulter is an English film", "def fibonacci(n):"]
    expected = [loaded.tokenizer.decode(generate(loaded.model, loaded.tokenizer.encode(text),
                                                 SamplingConfig(max_new_tokens=16), kv_dtype=torch.bfloat16).tokens)
                for text in prompts]
    del loaded
    server = Served("gemma3-270m", "--name", "g")
    try:
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda p: server.json("POST", "/v1/completions", {
                "model": "g", "prompt": p, "max_tokens": 16, "temperature": 0}), prompts))
    finally:
        server.stop()
    assert [a[0] for a in answers] == [200] * 3
    assert [a[2]["choices"][0]["text"] for a in answers] == expected
    assert "context 4096" in server.banner and "KV cache bf16" in server.stderr


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])
def test_eval_rank_scores_with_a_family_model(family_dirs, tmp_path, family):
    from test_rank import _shakespeare_collection

    root = _shakespeare_collection(tmp_path / "c")
    out = tmp_path / "rank.json"
    proc = hardy_main("eval", "rank", "--collection", str(root), "--model", str(family_dirs[family]), "--k", "4",
                      "--depth", "6", "--alpha", "0.5", "--json", str(out), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    scores = json.loads(out.read_text())["rows"][1]["per_query_lm"]
    assert sorted(scores) == ["q3", "q4"] and all(len(set(v.values())) == 4 for v in scores.values())
