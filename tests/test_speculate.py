"""Speculative decoding (hardy.infer.speculate): guesses checked several at a time give the tokens plain
greedy decoding gives — in `generate`, in the serving engine's batches, with prompt-lookup and with a
draft model — and guesses are made only while they pay."""
from __future__ import annotations

import random

import pytest
import torch

from conftest import hardy_main
from hardy.errors import HardyError
from hardy.infer.generate import SamplingConfig, generate
from hardy.infer.speculate import (NGRAM_MAX, DraftModel, DraftPolicy, NgramIndex, SpeculationConfig, Speculator,
                                   parse_speculate)
from hardy.model.config import get_preset
from hardy.model.transformer import build_model
from hardy.serve.engine import Engine, Request
from test_serve_chunked import collect, prompt_of, quantized_mini, recording_runner


def reference_ngram(context: list[int], k: int) -> list[int]:
    """Prompt lookup by brute force: the longest suffix (up to NGRAM_MAX) that occurred before with a
    token after it; the continuation of its latest such occurrence."""
    for n in range(min(NGRAM_MAX, len(context) - 1), 0, -1):
        suffix = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start:start + n] == suffix:
                return context[start + n:start + n + k]
    return []


def test_ngram_index_prefers_the_longest_suffix_then_the_latest_occurrence():
    index = NgramIndex()
    index.extend([7, 2, 3, 4, 4, 9, 2, 3, 5, 5, 7, 2, 3])
    assert index.propose(2) == [4, 4]  # (7, 2, 3) beats the later (2, 3)
    index = NgramIndex()
    index.extend([1, 5, 6, 1, 7, 8, 1])
    assert index.propose(5) == [7, 8, 1]  # (1): its latest continued occurrence, up to the end
    index = NgramIndex()
    index.extend([1, 2, 3])
    assert index.propose(4) == []


def test_ngram_index_grown_token_by_token_equals_a_brute_force_search():
    rng = random.Random(0)
    for trial in range(30):
        seq = [rng.randrange(6) for _ in range(60)]
        index = NgramIndex()
        for end in range(1, len(seq) + 1):
            index.extend(seq[:end])
            assert index.propose(4) == reference_ngram(seq[:end], 4), (trial, end)


def test_policy_stops_guessing_when_guesses_are_rejected_and_retries():
    policy = DraftPolicy(6)
    policy.observe_step(0.010, 1, 0)
    policy.observe_step(0.014, 1, 2)  # a guessed row costs 2 ms: a guess pays at rate > 0.2
    assert policy.row_s == pytest.approx(0.002)
    assert policy.budget(0, 1) == 6  # no evidence yet: optimistic
    for _ in range(12):
        policy.verified(0, 4, 0)
    assert policy.rate(0) < 0.2
    assert [policy.budget(0, 1) for _ in range(DraftPolicy.RETRY)] == [0] * (DraftPolicy.RETRY - 1) + [1]
    for _ in range(20):
        policy.verified(0, 4, 4)
    assert policy.budget(0, 1) == 6


def test_policy_guesses_fewer_tokens_for_a_bigger_batch():
    """rate 0.5, a row 1 ms of a 10 ms step: the i-th guess pays while 0.5^i > batch x 0.1."""
    policy = DraftPolicy(8)
    policy.observe_step(0.010, 1, 0)
    policy.observe_step(0.010, 4, 0)
    policy.observe_step(0.011, 1, 1)
    policy.hits[0] = [1.0, 2.0]
    assert policy.budget(0, 1) == 3  # 0.125 > 0.1 > 0.0625
    assert policy.budget(0, 4) == 1  # 0.5 > 0.4 > 0.25


def test_parse_speculate():
    assert parse_speculate("off") is None
    assert parse_speculate("ngram", 3) == SpeculationConfig("ngram", 3)
    assert parse_speculate("draft:/m/small.gguf").draft_model == "/m/small.gguf"
    for bad, tokens in (("draft:", 4), ("lookahead", 4), ("ngram", 0), ("ngram", 33)):
        with pytest.raises(HardyError):
            parse_speculate(bad, tokens)


class Oracle:
    """Guesses the true continuation (from a plain run) with every `wrong`-th guess spoiled."""

    def __init__(self, truth: list[int], prompt_len: int, wrong: int):
        self.truth, self.prompt_len, self.wrong = truth, prompt_len, wrong
        self.drafted = self.accepted = 0

    def propose(self, contexts, batch):
        context, room = contexts[0]
        done = len(context) - self.prompt_len
        guess = self.truth[done:done + min(room, 4)]
        return {0: [t if (j + 1) % self.wrong else t + 1 for j, t in enumerate(guess)]} if guess else {}

    def verified(self, seq, drafted, accepted):
        self.drafted += drafted
        self.accepted += accepted

    def observe_step(self, *args):
        pass


@pytest.fixture(scope="module")
def float_model():
    return build_model(get_preset("micro"), seed=0).eval()


@pytest.fixture(scope="module")
def fused_model():
    return quantized_mini()


@pytest.mark.parametrize("which", ["float_model", "fused_model"])
def test_checked_guesses_keep_the_tokens_of_plain_greedy_decoding(which, request):
    model = request.getfixturevalue(which)
    prompt = prompt_of(30, 4) * 2 + prompt_of(5, 5)
    cfg = SamplingConfig(max_new_tokens=40)
    plain = generate(model, prompt, cfg).tokens
    oracle = Oracle(plain, len(prompt), wrong=3)  # two right, then a wrong one: 2 of 3 kept per step
    assert generate(model, prompt, cfg, speculator=oracle).tokens == plain
    assert oracle.accepted >= 20 and oracle.drafted - oracle.accepted >= 10
    ngram = Speculator(SpeculationConfig("ngram", 6))
    out = generate(model, prompt, cfg, speculator=ngram)
    assert out.tokens == plain and out.stats.drafted > 0


def test_a_draft_model_guesses_and_the_output_stays(fused_model):
    draft = DraftModel(quantized_mini(), 1, 256, torch.float32)  # the same weights: its guesses hold
    prompt = prompt_of(40, 6)
    cfg = SamplingConfig(max_new_tokens=48)
    plain = generate(fused_model, prompt, cfg).tokens
    out = generate(fused_model, prompt, cfg, speculator=Speculator(SpeculationConfig("draft", 4, "same"), draft))
    assert out.tokens == plain
    assert out.stats.accepted >= 0.9 * out.stats.drafted > 0
    other = build_model(get_preset("mini"), seed=7).eval()  # other weights: mostly wrong guesses
    out = generate(fused_model, prompt, cfg,
                   speculator=Speculator(SpeculationConfig("draft", 4, "other"), DraftModel(other, 1, 256, torch.float32)))
    assert out.tokens == plain and out.stats.drafted > 0


def test_speculation_needs_greedy_decoding(float_model):
    with pytest.raises(HardyError, match="greedy"):
        generate(float_model, [1, 2, 3], SamplingConfig(max_new_tokens=4, temperature=0.8, seed=0),
                 speculator=Speculator(SpeculationConfig("ngram")))


def engine_answers(model, requests: list[Request], speculator=None, log=None):
    engine = Engine(model, max_batch=4, context=256, kv_dtype=torch.float32, speculator=speculator,
                    runner=recording_runner(log if log is not None else []))
    try:
        for r in requests:
            engine.submit(r)
        return [collect(r) for r in requests]
    finally:
        engine.close()


def batch_requests(stop_token: int | None = None) -> list[Request]:
    """Two greedy streams of different lengths, a greedy one with a stop token, a seeded sampled one."""
    greedy = SamplingConfig(max_new_tokens=30)
    return [Request(prompt_of(24, 1) * 2, greedy, set()),
            Request(prompt_of(24, 2) * 2, SamplingConfig(max_new_tokens=17), set()),
            Request(prompt_of(20, 3) * 2, greedy, set() if stop_token is None else {stop_token}),
            Request(prompt_of(24, 4) * 2, SamplingConfig(max_new_tokens=20, temperature=0.9, seed=3), set())]


@pytest.mark.parametrize("drafter", ["ngram", "draft"])
def test_engine_batches_checked_guesses_with_the_tokens_of_plain_decoding(fused_model, drafter):
    plain = engine_answers(fused_model, batch_requests())
    stop_token = plain[2][0][5]
    draft = DraftModel(quantized_mini(), 4, 256, torch.float32) if drafter == "draft" else None
    speculator = Speculator(SpeculationConfig(drafter, 4, "same" if draft else None), draft)
    log = []
    answers = engine_answers(fused_model, batch_requests(stop_token), speculator, log)
    assert answers[:2] == plain[:2] and answers[3] == plain[3]  # the greedy ones, and the seeded sampled one
    assert [len(a[0]) for a in answers[:2]] == [30, 17]  # never past max_tokens
    stop_at = plain[2][0].index(stop_token)
    assert answers[2] == (plain[2][0][:stop_at], "stop")  # a stop token among kept guesses ends it there
    assert speculator.accepted > 0
    guessed = [e for e in log if e[0] == "decode" and len(e[1]) > len(set(e[1]))]
    assert guessed, "no decode step carried guesses"


def test_cli_generate_speculates_and_prints_the_same_text():
    prompt = ("Copy this list exactly: apples, pears, plums, cherries, grapes, lemons, limes, figs, dates. "
              "Copy: apples, pears,")
    common = ("generate", "--model", "smollm2-135m", "--prompt", prompt, "--max-new-tokens", "24", "--stats")
    plain = hardy_main(*common)
    spec = hardy_main(*common, "--speculate", "ngram")
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr[-2000:]
    assert spec.stdout == plain.stdout
    kept, tried = map(int, spec.stderr.split("speculation: ")[1].split(" guesses")[0].split(" of "))
    assert 0 < kept <= tried


@pytest.mark.parametrize("args, fragment", [
    (("--speculate", "lookahead"), "--speculate must be"),
    (("--speculate", "ngram", "--temperature", "0.7"), "greedy"),
    (("--speculate", "ngram", "--speculate-tokens", "0"), "--speculate-tokens"),
])
def test_cli_refuses_bad_speculation_in_one_line(args, fragment):
    proc = hardy_main("generate", "--model", "smollm2-135m", "--prompt", "x", *args)
    assert proc.returncode == 2 and fragment in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def test_cli_refuses_a_draft_model_of_another_vocabulary(mini_run):
    proc = hardy_main("generate", "--model", "smollm2-135m", "--prompt", "x", "--speculate",
                      f"draft:{mini_run / 'run'}")
    assert proc.returncode == 2 and "vocabulary" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def test_a_speculating_server_answers_as_generate_does_and_counts_guesses():
    from serving import Served

    prompt = "Repeat exactly: red, green, blue, red, green, blue, red, green, blue. Repeat exactly: red, green,"
    expected = hardy_main("generate", "--model", "smollm2-135m", "--prompt", prompt, "--max-new-tokens", "20")
    assert expected.returncode == 0, expected.stderr[-2000:]
    served = Served("smollm2-135m", "--speculate", "ngram", "--max-batch", "2")
    try:
        status, _, body = served.json("POST", "/v1/completions", {"prompt": prompt, "max_tokens": 20, "temperature": 0})
        assert status == 200, body
        assert prompt + body["choices"][0]["text"] == expected.stdout.rstrip("\n")
        _, _, metrics = served.request("GET", "/metrics")
        counts = {line.split()[0]: float(line.split()[1]) for line in metrics.decode().splitlines()
                  if line.startswith("hardy_speculation_")}
        assert 0 < counts["hardy_speculation_accepted_tokens_total"] <= counts["hardy_speculation_drafted_tokens_total"]
    finally:
        served.stop()


def test_serve_refuses_speculation_under_tensor_parallelism():
    proc = hardy_main("serve", "--model", "smollm2-135m", "--speculate", "ngram", "--tp", "2")
    assert proc.returncode == 2 and "--speculate runs in one process" in proc.stderr, proc.stderr
