"""hardy serve: concurrent clients get exactly their single-request greedy answers from batched
decoding, streaming works, every malformed request class gets a 4xx JSON error (never taking the
server down), a full queue answers 503 with Retry-After, SIGTERM drains running requests."""
from __future__ import annotations

import json
import math
import signal
import threading
import time

import pytest
import torch

from serving import Served
from hardy.loading.load import load_model
from hardy.infer.generate import SamplingConfig, generate

PROMPTS = ["KING:", "First Citizen:\nBefore we", "ROMEO:\nO", "What is", "Thou art", "MENENIUS:"]


@pytest.fixture(scope="module")
def served(mini_run):
    s = Served(str(mini_run / "run"), "--max-batch", "4", "--max-tokens", "64", "--name", "mini")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(mini_run):
    loaded = load_model(str(mini_run / "run"))
    tok = loaded.tokenizer

    def answer(prompt: str, n: int) -> str:
        out = generate(loaded.model, tok.encode(prompt), SamplingConfig(max_new_tokens=n), stop_ids=tok.stop_ids)
        return tok.decode([t for t in out.tokens if t not in tok.stop_ids])

    return answer


def assert_concurrent_clients_get_their_greedy_answers(served, reference):
    results = {}

    def client(i, prompt):
        results[i] = served.json("POST", "/v1/completions", {"model": "mini", "prompt": prompt, "max_tokens": 32})

    threads = [threading.Thread(target=client, args=(i, p)) for i, p in enumerate(PROMPTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for i, prompt in enumerate(PROMPTS):
        status, _, body = results[i]
        assert status == 200, body
        assert body["choices"][0]["text"] == reference(prompt, 32), prompt
        assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] <= 32
    _, _, health = served.json("GET", "/health")
    assert health["status"] == "ok" and health["largest_batch"] > 1  # requests really shared decode steps


def test_concurrent_clients_get_their_greedy_answers_from_batched_decoding(served, reference):
    assert served.json("GET", "/health")[2]["processes"] == 1
    assert_concurrent_clients_get_their_greedy_answers(served, reference)


def test_streaming_matches_the_plain_answer(served, reference):
    status, headers, payload = served.request("POST", "/v1/completions",
                                              {"prompt": "KING:", "max_tokens": 20, "stream": True})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = [line[len("data: "):] for line in payload.decode().split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == reference("KING:", 20)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop") and chunks[-1]["usage"]["prompt_tokens"] > 0


def test_stop_strings_cut_the_text_and_free_the_slot(served, reference):
    full = reference("KING:", 48)
    stop = full[12:15]
    expected = full[:full.index(stop)]
    steps_before = served.json("GET", "/health")[2]["decode_steps"]
    status, _, body = served.json("POST", "/v1/completions", {"prompt": "KING:", "max_tokens": 48, "stop": [stop, "@@"]})
    assert status == 200 and body["choices"][0]["text"] == expected and body["choices"][0]["finish_reason"] == "stop"
    deadline = time.time() + 10
    while served.json("GET", "/health")[2]["running"] and time.time() < deadline:
        time.sleep(0.02)
    # the engine let the slot go a step or two after the stop string, not after all 48 tokens
    assert served.json("GET", "/health")[2]["decode_steps"] - steps_before < 30
    status, _, payload = served.request("POST", "/v1/completions",
                                        {"prompt": "KING:", "max_tokens": 48, "stop": stop, "stream": True})
    events = [line[len("data: "):] for line in payload.decode().split("\n\n") if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_stop_scanner_holds_back_what_may_become_a_stop_string():
    from hardy.serve.api import StopScanner

    s = StopScanner(["END"])  # the last len("END") - 1 characters wait
    assert s.feed("abc E") == "abc" and s.feed("N") == " " and s.feed("D tail") == "" and s.stopped
    assert s.feed("more") == "" and s.flush() == ""
    s = StopScanner(["END"])
    assert s.feed("abc E") == "abc" and s.feed("x") == " " and s.flush() == "Ex" and not s.stopped


def test_models_endpoint(served):
    status, _, body = served.json("GET", "/v1/models")
    assert status == 200 and [m["id"] for m in body["data"]] == ["mini"]


@pytest.mark.parametrize("path,body,raw,status,code", [
    ("/v1/completions", None, b"{not json", 400, "invalid_json"),
    ("/v1/completions", [1, 2], None, 400, "invalid_request_error"),
    ("/v1/completions", {"max_tokens": 4}, None, 400, "invalid_request_error"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, None, 404, "model_not_found"),
    ("/v1/completions", {"prompt": "KING " * 300, "max_tokens": 8}, None, 400, "context_length_exceeded"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 100000}, None, 400, "invalid_request_error"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, None, 400, "invalid_request_error"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, None, 400, "invalid_request_error"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, None, 400, "invalid_request_error"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, None, 400, "invalid_request_error"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, None, 400, "invalid_request_error"),
    ("/v1/completions", {"prompt": "x", "n": 2}, None, 400, "invalid_request_error"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.5}, None, 400, "invalid_request_error"),
    ("/v1/completions", {"prompt": "x", "temperature": True}, None, 400, "invalid_request_error"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, None, 400, "invalid_request_error"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, None, 400, "invalid_request_error"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -3}, None, 400, "invalid_request_error"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2.5}, None, 400, "invalid_request_error"),
    ("/v1/completions", {"prompt": "x", "stop": [1]}, None, 400, "invalid_request_error"),
    ("/v1/completions", {"prompt": ["a", "b"]}, None, 400, "invalid_request_error"),
    ("/v1/chat/completions", {"messages": "hello"}, None, 400, "invalid_request_error"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, None, 400, "invalid_request_error"),
    ("/v1/embeddings", {"input": "x"}, None, 404, "not_found"),
    ("/v1/rerank", {"query": "x"}, None, 400, "invalid_request_error"),
    ("/v1/rerank", {"query": "x", "documents": []}, None, 400, "invalid_request_error"),
    ("/v1/rerank", {"query": "", "documents": ["a"]}, None, 400, "invalid_request_error"),
    ("/v1/rerank", {"query": "x", "documents": [1]}, None, 400, "invalid_request_error"),
    ("/v1/rerank", {"query": "x", "documents": [{"txt": "a"}]}, None, 400, "invalid_request_error"),
    ("/v1/rerank", {"query": "x", "documents": ["a"], "top_n": 0}, None, 400, "invalid_request_error"),
    ("/v1/rerank", {"query": "x", "documents": ["a"], "model": "gpt-4"}, None, 404, "model_not_found"),
    ("/v1/rerank", {"query": "KING " * 300, "documents": ["a"]}, None, 400, "invalid_request_error"),
])
def test_malformed_requests_get_4xx_json_and_the_server_lives(served, path, body, raw, status, code):
    got, headers, payload = served.request("POST", path, body, raw=raw)
    error = json.loads(payload)["error"]
    assert got == status and error["code"] == code and error["message"], (got, error)
    assert headers["Content-Type"] == "application/json"
    assert served.json("GET", "/health")[0] == 200


@pytest.fixture(scope="module")
def rerank_reference(mini_run):
    from hardy.infer.rerank import QLMScorer

    loaded = load_model(str(mini_run / "run"))
    scorer = QLMScorer(loaded.model, loaded.tokenizer)

    def scores(query: str, documents: list[str]) -> list[float]:  # the API's relevance_score
        n = len(scorer.score_rows(query, documents)[0].target)
        return [math.exp(s / n) for s in scorer.score(query, documents)]

    return scores


DOCS = ["Now is the winter of our discontent made glorious summer by this sun of York",
        "My lord, I have news", "To be or not to be", "The winter wind blows cold", "Good night, sweet prince"]


def assert_rerank_answers(served, rerank_reference, query: str, top_n: int | None = None, tol: float = 1e-4):
    body = {"model": "mini", "query": query, "documents": DOCS[:3] + [{"text": d} for d in DOCS[3:]]}
    if top_n:
        body["top_n"] = top_n
    status, _, answer = served.json("POST", "/v1/rerank", body)
    assert status == 200, answer
    expected = rerank_reference(query, DOCS)
    order = sorted(range(len(DOCS)), key=lambda i: -expected[i])[:top_n or len(DOCS)]
    assert [r["index"] for r in answer["results"]] == order
    for r in answer["results"]:
        assert r["relevance_score"] == pytest.approx(expected[r["index"]], rel=tol)
        assert r["document"]["text"] == DOCS[r["index"]]
    assert answer["usage"]["total_tokens"] > len(DOCS) and answer["model"] == "mini"


def test_rerank_scores_beside_running_generations(served, reference, rerank_reference):
    """POST /v1/rerank while generations decode: each answer is the in-process scorer's, best first,
    and the generations still get exactly their greedy answers (scoring passes leave the KV cache alone)."""
    errors = []

    def rerank_client(query, top_n):
        try:
            assert_rerank_answers(served, rerank_reference, query, top_n)
        except AssertionError as e:
            errors.append(e)

    threads = [threading.Thread(target=rerank_client, args=(q, n)) for q, n in
               (("winter of discontent", None), ("a prince", 2), ("news for my lord", 1))]
    for t in threads:
        t.start()
    assert_concurrent_clients_get_their_greedy_answers(served, reference)
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[0]
    status, _, bare = served.json("POST", "/v1/rerank", {"query": "winter", "documents": DOCS, "return_documents": False})
    assert status == 200 and bare["results"] and all("document" not in r for r in bare["results"])


def test_unknown_fields_are_ignored_as_openai_does(served, reference):
    status, _, body = served.json("POST", "/v1/completions", {"prompt": "KING:", "max_tokens": 8, "logit_bias": {},
                                                              "user": "u1", "presence_penalty": 0})
    assert status == 200 and body["choices"][0]["text"] == reference("KING:", 8)


def test_queue_full_is_503_with_retry_after_then_sigterm_drains(mini_run):
    """One server for both (a start costs ~4 s): a full queue answers 503, then SIGTERM lets a running
    request finish."""
    s = Served(str(mini_run / "run"), "--max-batch", "1", "--max-queue", "1", "--max-tokens", "200",
               "--drain-timeout", "60")
    try:
        answers = []

        def client():
            answers.append(s.request("POST", "/v1/completions", {"prompt": "KING:", "max_tokens": 200}))

        threads = [threading.Thread(target=client) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        statuses = sorted(a[0] for a in answers)
        assert 200 in statuses and 503 in statuses, statuses
        full = next(a for a in answers if a[0] == 503)
        assert full[1]["Retry-After"] == "1" and json.loads(full[2])["error"]["code"] == "queue_full"
    except BaseException:
        s.stop()
        raise
    sigterm_drains_a_running_request(s)


def sigterm_drains_a_running_request(s: Served) -> None:
    answer = {}

    def client():
        answer["r"] = s.json("POST", "/v1/completions", {"prompt": "KING:", "max_tokens": 200})

    t = threading.Thread(target=client)
    t.start()
    deadline = time.time() + 30
    while s.json("GET", "/health")[2]["running"] == 0 and time.time() < deadline:
        time.sleep(0.01)
    s.proc.send_signal(signal.SIGTERM)
    t.join(timeout=120)
    status, _, body = answer["r"]
    assert status == 200 and body["usage"]["completion_tokens"] > 0  # finished, not cut off
    assert body["choices"][0]["finish_reason"] in ("length", "stop")
    assert s.proc.wait(timeout=60) == 0
    assert "drained" in s.proc.stderr.read()
    s.stop()


def test_tp2_server_starts_its_workers_batches_and_drains(mini_run, reference, rerank_reference):
    """`serve --tp 2` starts two torchrun workers itself; rank 0 serves, rank 1 follows every forward."""
    s = Served(str(mini_run / "run"), "--tp", "2", "--threads", "2", "--max-batch", "4", "--max-tokens", "200",
               "--name", "mini", "--drain-timeout", "30")
    try:
        assert s.json("GET", "/health")[2]["processes"] == 2
        assert_concurrent_clients_get_their_greedy_answers(s, reference)
        assert_rerank_answers(s, rerank_reference, "winter of discontent", 3, tol=1e-3)  # a SCORE pass on both ranks
    except BaseException:
        s.stop()
        raise
    sigterm_drains_a_running_request(s)


def test_sampling_survives_extreme_top_p_and_temperature():
    """Found by the schemathesis run: top_p = 5e-324 is 0 in float32 and kept no token at all (NaN
    probabilities, a 500). The most likely token now always stays; a temperature too small to divide
    by is the greedy limit."""
    from hardy.infer.generate import sample

    logits = torch.tensor([0.5, 3.0, -1.0, 2.9])
    gen = torch.Generator().manual_seed(0)
    assert all(sample(logits, SamplingConfig(temperature=1.0, top_p=5e-324), gen) == 1 for _ in range(20))
    assert sample(logits, SamplingConfig(temperature=1e-300), gen) == 1
    drawn = {sample(logits, SamplingConfig(temperature=1.0, top_p=0.6), gen) for _ in range(200)}
    assert drawn == {1, 3}  # 1 alone holds 0.46 < 0.6 of the mass: the nucleus is {1, 3}
