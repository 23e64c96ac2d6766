"""Chunked prefill in the serving engine: a prompt goes in chunk by chunk between the running streams'
decode steps, with the same tokens as a prompt prefilled in one pass."""
from __future__ import annotations

import pytest
import torch

from hardy.errors import HardyError
from hardy.infer.generate import SamplingConfig
from hardy.model.config import get_preset
from hardy.model.transformer import build_model
from hardy.serve.engine import (IDLE_CHUNK, RIDE_FIRST, RIDE_MAX, RIDE_MIN, ChunkPolicy, Engine, ModelRunner,
                                Request)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(get_preset("micro")).eval()


def prompt_of(n: int, seed: int) -> list[int]:
    return torch.randint(1, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def collect(req: Request, timeout: float = 60) -> tuple[list[int], str]:
    tokens = []
    while True:
        kind, value = req.events.get(timeout=timeout)
        if kind == "token":
            tokens.append(value)
        else:
            return tokens, value


def recording_runner(log: list, on_decode=None):
    class Recording(ModelRunner):
        def prefill(self, row, prompt, budget=None, start=0):
            log.append(("prefill", row, start, prompt.shape[1]))
            return super().prefill(row, prompt, budget, start)

        def decode(self, tokens, positions, rows, want=None):
            log.append(("decode", tuple(rows), tuple(positions.tolist())))
            if on_decode:
                on_decode(rows, positions.tolist())
            return super().decode(tokens, positions, rows, want)

    return Recording


def quantized_mini(cfg=None):
    """A model of `cfg` (default: the mini preset) with every block linear RTN int4 g32, kernels attached."""
    from hardy.compress import kernels
    from hardy.compress.qlinear import swap_quantized
    from hardy.formats.quantized import QuantSpec, rtn
    from hardy.model.transformer import BLOCK_LINEARS

    torch.manual_seed(0)
    model = build_model(cfg or get_preset("mini")).eval()
    names = [f"layers.{i}.{n}" for i in range(len(model.layers)) for n in BLOCK_LINEARS]
    weights = dict(model.named_parameters())
    model = swap_quantized(model, {n: rtn(weights[f"{n}.weight"].detach(), QuantSpec(4, 32)) for n in names})
    kernels.prepare(model)  # the fused kernels, as a quantized load attaches them
    return model


def test_a_prompt_prefilled_in_chunks_gives_the_logits_of_one_pass(model):
    prompt = torch.tensor([prompt_of(90, 1)])
    whole = ModelRunner(model, 1, 128, torch.float32)
    expected = whole.prefill(0, prompt, 100)
    whole.finish()
    chunked = ModelRunner(model, 1, 128, torch.float32)
    for start in range(0, 90, 16):
        logits = chunked.prefill(0, prompt[:, start:start + 16], 100, start)
    chunked.finish()
    assert torch.allclose(logits, expected, atol=1e-5, rtol=0), (logits - expected).abs().max()


@pytest.mark.parametrize("chunk", [7, None])
def test_chunked_engines_answer_with_the_tokens_of_whole_prompt_prefill(model, chunk):
    def answers(prefill_chunk):
        engine = Engine(model, max_batch=3, context=160, prefill_chunk=prefill_chunk)
        try:
            reqs = [engine.submit(Request(prompt_of(n, n), SamplingConfig(max_new_tokens=12), set()))
                    for n in (5, 40, 90)]
            return [collect(r) for r in reqs]
        finally:
            engine.close()

    expected = answers(0)
    assert all(reason == "length" and len(tokens) == 12 for tokens, reason in expected)
    assert answers(chunk) == expected


@pytest.mark.parametrize("quantized", [False, True])
def test_prompt_rows_riding_a_decode_step_give_the_logits_of_feeding_them_one_by_one(model, quantized):
    """A prompt chunk as extra decode rows of one sequence, at consecutive positions, beside another
    sequence's token: each row sees the keys up to its own position (written in the same step). On the
    quantized model this is the fused C++ decode stack."""
    from hardy.infer.fused_decode import fused_blocks

    net = quantized_mini() if quantized else model
    assert (fused_blocks(net) is not None) == quantized
    prompt, other = prompt_of(40, 3), prompt_of(5, 4)
    one_by_one = ModelRunner(net, 2, 64, torch.float32)
    one_by_one.prefill(1, torch.tensor([other]), 10)
    for pos, token in enumerate(prompt[:24]):
        expected = one_by_one.decode(torch.tensor([[token]]), torch.tensor([pos]), [0])[0]
    one_by_one.finish()
    riding = ModelRunner(net, 2, 64, torch.float32)
    riding.prefill(1, torch.tensor([other]), 10)
    riding.prefill(0, torch.tensor([prompt[:8]]), 50)  # a first chunk in a pass of its own
    tokens = torch.tensor([[other[-1]]] + [[t] for t in prompt[8:24]])
    positions = torch.tensor([5, *range(8, 24)])
    logits = riding.decode(tokens, positions, [1] + [0] * 16, want=[0, 16])
    riding.finish()
    assert logits.shape[0] == 2
    assert torch.allclose(logits[1], expected, atol=1e-4, rtol=0), (logits[1] - expected).abs().max()
    assert int(logits[1].argmax()) == int(expected.argmax())


def test_a_long_prompt_rides_the_running_stream_s_decode_steps_one_chunk_each(model):
    log: list = []
    engine = Engine(model, max_batch=2, context=256, runner=recording_runner(log), prefill_chunk=16)
    try:
        running = engine.submit(Request(prompt_of(4, 0), SamplingConfig(max_new_tokens=200), set()))
        first = [running.events.get(timeout=60) for _ in range(3)]  # it is decoding
        assert all(kind == "token" for kind, _ in first)
        long = engine.submit(Request(prompt_of(100, 2), SamplingConfig(max_new_tokens=5), set()))
        long_tokens, reason = collect(long)
        running_tokens, _ = collect(running)
    finally:
        engine.close()
    assert reason == "length" and len(long_tokens) == 5 and len(first) + len(running_tokens) == 200
    other, row = log[0][1], 1 - log[0][1]  # the running stream prefilled alone, in slot 0
    assert log[0] == ("prefill", 0, 0, 4) and [e for e in log if e[0] == "prefill"] == [log[0]]
    steps = [e for e in log if e[0] == "decode" and row in e[1]]
    chunks = [e[2][1:] for e in steps[:7]]  # each step: the stream's token, then a chunk of the prompt
    assert chunks == [tuple(range(s, min(s + 16, 100))) for s in range(0, 100, 16)]
    assert all(e[1] == (other,) + (row,) * len(e[2][1:]) for e in steps[:7])
    assert all(e[1] == (0, 1) for e in steps[7:])  # then both decode, one row each
    # between two chunks nothing else ran: the chunks went in on consecutive decode steps
    first_chunk = log.index(steps[0])
    assert log[first_chunk:first_chunk + 7] == steps[:7]


def test_a_short_prompt_does_not_wait_behind_a_long_one_and_unchunked_prompts_take_passes_of_their_own(model):
    def run(prefill_chunk):
        log: list = []
        engine = Engine(model, max_batch=3, context=256, runner=recording_runner(log), prefill_chunk=prefill_chunk)
        try:
            running = engine.submit(Request(prompt_of(4, 0), SamplingConfig(max_new_tokens=200), set()))
            assert running.events.get(timeout=60)[0] == "token"
            long = engine.submit(Request(prompt_of(100, 2), SamplingConfig(max_new_tokens=3), set()))
            short = engine.submit(Request(prompt_of(5, 3), SamplingConfig(max_new_tokens=3), set()))
            answers = [collect(r) for r in (long, short, running)]
        finally:
            engine.close()
        assert [len(tokens) for tokens, _ in answers] == [3, 3, 199]
        return log

    log = run(16)
    steps = [e for e in log if e[0] == "decode"]
    short_steps = [k for k, e in enumerate(steps) if 2 in e[1] and 0 in e[2][e[1].index(2):]]
    long_last = next(k for k, e in enumerate(steps) if 1 in e[1] and 99 in e[2][e[1].index(1):])
    assert len(short_steps) == 1 and short_steps[0] < long_last  # all 5 tokens at once, before the long one ends
    assert steps[short_steps[0]][1].count(2) == 5 and [e for e in log if e[0] == "prefill"] == [log[0]]

    log = run(0)  # unchunked: each prompt whole, in a pass of its own; decode steps carry streams only
    assert sorted(e[1:] for e in log if e[0] == "prefill") == [(0, 0, 4), (1, 0, 100), (2, 0, 5)]
    assert all(len(set(e[1])) == len(e[1]) for e in log if e[0] == "decode")


def test_a_request_cancelled_while_its_prompt_goes_in_is_freed_and_the_others_go_on(model):
    holder: dict = {}

    def cancel_after_second_chunk(rows, positions):
        if 16 in positions[1:] and "long" in holder:
            holder["long"].cancelled = True

    log: list = []
    engine = Engine(model, max_batch=2, context=256, runner=recording_runner(log, cancel_after_second_chunk),
                    prefill_chunk=16)
    try:
        running = engine.submit(Request(prompt_of(4, 0), SamplingConfig(max_new_tokens=60), set()))
        assert running.events.get(timeout=60)[0] == "token"
        holder["long"] = Request(prompt_of(100, 2), SamplingConfig(max_new_tokens=5), set())
        engine.submit(holder["long"])
        assert collect(holder["long"]) == ([], "cancelled")
        tokens, reason = collect(running)
        assert reason == "length"
        assert engine.runner.promised == [0, 0] and not engine.admitted
    finally:
        engine.close()
    ridden = [p for e in log if e[0] == "decode" for p in e[2][1:]]
    assert ridden == list(range(32))  # no chunk after the one it was cancelled in


def test_the_chunk_policy_grows_the_riding_rows_while_steps_stay_within_their_share():
    assert ChunkPolicy(32).tokens(True) == ChunkPolicy(32).tokens(False) == 32
    assert ChunkPolicy(0).tokens(True) is None  # whole prompts
    auto = ChunkPolicy(None)
    assert auto.tokens(True) == RIDE_FIRST and auto.tokens(False) == IDLE_CHUNK
    auto.observe_step(0.1, 2)  # no plain step measured yet: nothing to compare with
    assert auto.tokens(True) == RIDE_FIRST
    auto.observe_step(0.1, 0)
    sizes = []
    for seconds in (0.15, 0.15, 0.15, 0.17, 0.17, 0.15):  # within 1.6 x 0.1 s, then beyond it twice
        auto.observe_step(seconds, auto.tokens(True))
        sizes.append(auto.tokens(True))
    assert sizes == [3, 4, 5, 3, 2, 3]
    assert auto.tokens(False) == IDLE_CHUNK  # nothing decodes: passes of its own
    for _ in range(100):
        auto.observe_step(0.1, auto.tokens(True))
    assert auto.tokens(True) == RIDE_MAX
    for _ in range(100):
        auto.observe_step(1.0, auto.tokens(True))
    assert auto.tokens(True) == RIDE_MIN
    with pytest.raises(HardyError, match="prefill chunk must be >= 0"):
        ChunkPolicy(-1)


def test_serve_refuses_a_prefill_chunk_that_is_not_auto_or_a_count(tmp_path, capsys):
    from hardy.cli.main import main

    assert main(["serve", "--model", str(tmp_path / "absent"), "--prefill-chunk", "lots"]) == 2
    err = capsys.readouterr().err
    assert err == "hardy: error: --prefill-chunk must be auto or a number of tokens >= 0 (got 'lots')\n"
