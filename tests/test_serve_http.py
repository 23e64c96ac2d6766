"""hardy serve as a hostile or careless client meets it: slow and oversized requests are cut off,
a client that leaves frees its slot, an engine failure is a 500 (and under --tp stops every
worker), /metrics counts what happened, the official openai client works, and a schemathesis run
from /openapi.json finds no 5xx and no response outside the schema."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving import Served, fault_env

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def chat_template(tmp_path_factory) -> str:
    template = tmp_path_factory.mktemp("chat") / "chatml.jinja"
    template.write_text(CHATML)
    return str(template)


@pytest.fixture(scope="module")
def served(mini_run, chat_template):
    s = Served(str(mini_run / "run"), "--max-batch", "4", "--max-tokens", "200", "--name", "mini",
               "--chat-template", chat_template, "--header-timeout", "1", "--body-timeout", "1",
               "--max-connections", "6")
    yield s
    s.stop()


def raw_exchange(port: int, data: bytes, timeout: float = 10) -> tuple[bytes, float]:
    """Send `data` as is and read until the server closes: (what came back, seconds it took)."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        chunks = []
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            chunks.append(chunk)
    return b"".join(chunks), time.monotonic() - start


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def json_of(response: bytes) -> dict:
    return json.loads(response.split(b"\r\n\r\n", 1)[1])


def test_slow_clients_are_cut_off_by_the_header_and_body_timeouts(served):
    # connected, sent nothing; sent half its headers: both closed after --header-timeout (1 s)
    for data in (b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"):
        answer, took = raw_exchange(served.port, data)
        assert answer == b"" and 0.8 < took < 5, (answer, took)
    # headers complete, 10 of 100 body bytes: 408 after --body-timeout (1 s)
    answer, took = raw_exchange(served.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                                             b"application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\":")
    assert status_of(answer) == 408 and json_of(answer)["error"]["code"] == "request_timeout" and took < 5
    assert served.json("GET", "/health")[0] == 200


def test_oversized_and_negative_bodies_are_refused(served):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    answer, _ = raw_exchange(served.port, head + b"Content-Length: 2000000\r\n\r\n")  # declared: refused unread
    assert status_of(answer) == 413 and json_of(answer)["error"]["code"] == "request_too_large"
    chunk = b"x" * 65536  # chunked, no length declared: counted as it arrives
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(17)) + b"0\r\n\r\n"
    answer, _ = raw_exchange(served.port, head + b"Transfer-Encoding: chunked\r\n\r\n" + body)
    assert status_of(answer) == 413
    answer, _ = raw_exchange(served.port, head + b"Content-Length: -5\r\n\r\n{}")
    assert status_of(answer) == 400
    assert served.json("GET", "/health")[0] == 200


def test_requests_in_flight_are_capped(served):
    """6 requests sit in the body wait (headers sent, 10 of 100 body bytes): with --max-connections 6 a
    7th gets 503 until they end (408 after --body-timeout, 1 s), then requests are served again."""
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{\"prompt\":")
    held = [socket.create_connection(("127.0.0.1", served.port), timeout=10) for _ in range(6)]
    try:
        for sock in held:
            sock.sendall(head)
        deadline, refused = time.monotonic() + 0.9, None
        while refused is None and time.monotonic() < deadline:  # until the server has taken all 6 in
            status, headers, payload = served.request("GET", "/health")
            if status == 503:
                refused = headers, json.loads(payload)
        assert refused is not None, "a 7th request was served with 6 in flight (--max-connections 6)"
        assert refused[1]["error"]["code"] == "too_many_connections" and refused[0]["Retry-After"] == "1"
        for sock in held:  # each was in flight: it ends in the body timeout's 408
            assert status_of(sock.recv(65536)) == 408
    finally:
        for sock in held:
            sock.close()
    assert served.request("GET", "/health")[0] == 200


def steps_taken_by_a_client_that_leaves(served, body: dict, read_first: bytes | None) -> int:
    before = served.json("GET", "/health")[2]["decode_steps"]
    sock = socket.create_connection(("127.0.0.1", served.port), timeout=30)
    payload = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
    if read_first is not None:  # streaming: wait for its first event
        received = b""
        while read_first not in received:
            received += sock.recv(4096)
    else:
        deadline = time.time() + 30
        while served.json("GET", "/health")[2]["running"] == 0 and time.time() < deadline:
            time.sleep(0.005)
    sock.close()
    deadline = time.time() + 30
    while served.json("GET", "/health")[2]["running"] and time.time() < deadline:
        time.sleep(0.01)
    assert served.json("GET", "/health")[2]["running"] == 0
    return served.json("GET", "/health")[2]["decode_steps"] - before


def test_a_client_that_leaves_frees_its_slot(served):
    """200 tokens asked, the client leaves after its first: the engine stops well short of 200 steps."""
    plain = steps_taken_by_a_client_that_leaves(served, {"prompt": "KING:", "max_tokens": 200}, None)
    streamed = steps_taken_by_a_client_that_leaves(served, {"prompt": "KING:", "max_tokens": 200, "stream": True},
                                                   b"data: ")
    assert plain < 150 and streamed < 150, (plain, streamed)


def scrape(served) -> dict:
    status, headers, payload = served.request("GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    values = {}
    for family in text_string_to_metric_families(payload.decode()):
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return values


def test_metrics_count_requests_tokens_and_latencies(served):
    def get(values, name, **labels):
        return values.get((name, tuple(sorted(labels.items()))), 0.0)

    before = scrape(served)
    answers = [served.json("POST", "/v1/completions", {"prompt": p, "max_tokens": 12}) for p in ("KING:", "ROMEO:")]
    assert served.json("POST", "/v1/completions", {"prompt": "x", "top_p": 2})[0] == 400
    after = scrape(served)
    tokens = sum(body["usage"]["completion_tokens"] for _, _, body in answers)
    route = "/v1/completions"
    assert get(after, "hardy_http_requests_total", route=route, status="200") - \
        get(before, "hardy_http_requests_total", route=route, status="200") == 2
    assert get(after, "hardy_http_requests_total", route=route, status="400") - \
        get(before, "hardy_http_requests_total", route=route, status="400") == 1
    assert get(after, "hardy_generation_tokens_total") - get(before, "hardy_generation_tokens_total") == tokens
    assert get(after, "hardy_prompt_tokens_total") - get(before, "hardy_prompt_tokens_total") == sum(
        body["usage"]["prompt_tokens"] for _, _, body in answers)
    ttft = get(after, "hardy_time_to_first_token_seconds_count") - get(before, "hardy_time_to_first_token_seconds_count")
    itl = get(after, "hardy_inter_token_latency_seconds_count") - get(before, "hardy_inter_token_latency_seconds_count")
    assert ttft == 2 and itl == tokens - 2
    assert get(after, "hardy_time_to_first_token_seconds_sum") > get(before, "hardy_time_to_first_token_seconds_sum")
    assert get(after, "hardy_queue_depth") == 0 and get(after, "hardy_running_batch") == 0


def test_the_official_openai_client(served):
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{served.port}/v1", api_key="unused", max_retries=0)
    completion = client.completions.create(model="mini", prompt="KING:", max_tokens=10)
    plain = served.json("POST", "/v1/completions", {"prompt": "KING:", "max_tokens": 10})[2]
    assert completion.choices[0].text == plain["choices"][0]["text"] and completion.usage.completion_tokens == 10
    messages = [{"role": "system", "content": "Speak as a king."}, {"role": "user", "content": "Who goes there?"}]
    chat = client.chat.completions.create(model="mini", messages=messages, max_tokens=16)
    streamed = client.chat.completions.create(model="mini", messages=messages, max_tokens=16, stream=True)
    pieces = [c.choices[0].delta.content or "" for c in streamed if c.choices]
    assert "".join(pieces) == chat.choices[0].message.content and chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="mini", prompt="KING:", max_tokens=5000)
    assert error.value.status_code == 400 and error.value.param == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="KING:", max_tokens=5)


def test_schemathesis_fuzzing_finds_no_server_error_and_no_response_outside_the_schema(mini_run, chat_template):
    served = Served(str(mini_run / "run"), "--max-tokens", "8", "--name", "mini", "--chat-template", chat_template)
    try:
        fuzz(served)
    finally:
        served.stop()


def fuzz(served) -> None:
    schema = served.json("GET", "/openapi.json")[2]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"} <= set(schema["paths"])
    cli = Path(sys.executable).parent / "schemathesis"
    # Every check but one: "schema-valid requests are accepted" cannot hold for a prompt longer than the
    # context, a limit in tokens that no JSON schema can state (that case is a 400 context_length_exceeded).
    run = subprocess.run([str(cli), "run", f"http://127.0.0.1:{served.port}/openapi.json", "--max-examples", "15",
                          "--seed", "1", "--checks", "all", "--exclude-checks", "positive_data_acceptance",
                          "--no-color"], capture_output=True, text=True, timeout=600)
    tail = run.stdout[-3000:]
    assert run.returncode == 0, tail
    generated = int(tail.split(" generated")[0].split()[-1])
    assert generated >= 200 and f"{generated} passed" in tail, tail
    assert served.json("GET", "/health")[0] == 200


def test_an_engine_failure_is_a_500_and_the_server_serves_on(mini_run):
    """The 2nd prefill and the 6th decode pass raise (a test hook, tests/fault_hooks): those requests get
    500 JSON errors that name no internals (the cause goes to the server's log under the request's id),
    the requests around them are answered."""
    s = Served(str(mini_run / "run"), "--max-tokens", "16", env=fault_env("prefill@2,decode@6"))
    try:
        statuses, messages = [], []
        for _ in range(4):  # 4 tokens each: one prefill and 3 decode passes
            status, _, body = s.json("POST", "/v1/completions", {"prompt": "KING:", "max_tokens": 4})
            statuses.append(status)
            if status == 500:
                assert body["error"]["type"] == "server_error"
                messages.append(body["error"]["message"])
        assert statuses == [200, 500, 500, 200]
        assert all("injected fault" not in m and "RuntimeError" not in m and "internal error" in m for m in messages)
        values = scrape(s)
        assert values[("hardy_http_requests_total", (("route", "/v1/completions"), ("status", "500")))] == 2
    finally:
        s.stop()
    log = s.stderr
    for m in messages:  # "... the server log has the cause under request N": that line names the fault
        label = m.rsplit("under ", 1)[1].rstrip(")")
        assert any(label + ":" in line and "injected fault" in line for line in log.splitlines()), log


def test_tp_rank0_failure_stops_every_worker(mini_run):
    """Under --tp 2 a pass that fails on rank 0 leaves rank 1 inside a collective: the request gets a
    500, rank 0 exits, and rank 1 (its collective ended by the closed connection) exits too — well
    before the process group's 10-minute timeout."""
    s = Served(str(mini_run / "run"), "--tp", "2", "--threads", "2", "--max-tokens", "16",
               env=fault_env("decode@3"))
    try:
        status, _, body = s.json("POST", "/v1/completions", {"prompt": "KING:", "max_tokens": 8})
        assert status == 500 and "internal error" in body["error"]["message"]
        code = s.proc.wait(timeout=60)
        stderr = s.proc.stderr.read()
        assert code != 0 and "the engine failed" in stderr and "this worker stops too" in stderr, stderr
    finally:
        s.stop()
