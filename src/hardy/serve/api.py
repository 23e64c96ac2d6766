"""An OpenAI-compatible HTTP API over the engine (stdlib http.server, one thread per connection):
POST /v1/completions, POST /v1/chat/completions (both with SSE streaming), GET /v1/models, GET /health.

Every client mistake is a 4xx with a JSON error body, and none reaches the engine: malformed JSON or
fields (400), unknown model (404), a prompt plus max_tokens beyond the context (400,
code "context_length_exceeded"), max_tokens above the server's limit (400), a full queue (503 with
Retry-After), a server draining for shutdown (503).
"""
from __future__ import annotations

import json
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from hardy.errors import HardyError
from hardy.infer.generate import SamplingConfig
from hardy.serve.engine import Engine, QueueFull, Request, ShuttingDown

MAX_BODY = 1 << 20


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.retry_after = status, message, code, retry_after


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address, engine: Engine, tokenizer, model_name: str, max_tokens_limit: int):
        super().__init__(address, Handler)
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.max_tokens_limit = max_tokens_limit
        self.started = int(time.time())


def _int_field(body: dict, key: str, default: int, low: int, high: int | None = None) -> int:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ApiError(400, f"'{key}' must be an integer >= {low}", "invalid_request_error")
    if high is not None and value > high:
        raise ApiError(400, f"'{key}' = {value} exceeds this server's limit of {high}", "invalid_request_error")
    return value


def _float_field(body: dict, key: str, default: float, low: float, high: float) -> float:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ApiError(400, f"'{key}' must be a number in [{low}, {high}]", "invalid_request_error")
    return float(value)


def _stop_field(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not 1 <= len(stops) <= 4 or not all(isinstance(x, str) and x for x in stops):
        raise ApiError(400, "'stop' must be a non-empty string or a list of 1 to 4 of them", "invalid_request_error")
    return stops


class StopScanner:
    """Text as it is generated, cut before the first stop string. `feed` returns what is safe to
    send now: text that could still be the start of a stop string is held back until it cannot."""

    def __init__(self, stops: list[str]):
        self.stops, self.text, self.sent, self.stopped = stops, "", 0, False
        self.hold = max((len(x) for x in stops), default=1) - 1

    def feed(self, piece: str) -> str:
        if self.stopped:
            return ""
        self.text += piece
        cuts = [i for i in (self.text.find(x, max(0, self.sent - self.hold)) for x in self.stops) if i >= 0]
        if cuts:
            self.stopped = True
            end = min(cuts)
        else:
            end = len(self.text) - self.hold
        out = self.text[self.sent:max(end, self.sent)]
        self.sent = max(end, self.sent)
        return out

    def flush(self) -> str:
        if self.stopped:
            return ""
        out, self.sent = self.text[self.sent:], len(self.text)
        return out


class Handler(BaseHTTPRequestHandler):
    server: Server
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # quiet: one line per request would drown the console
        pass

    # ------------------------------------------------------------------ plumbing
    def _json(self, status: int, payload: dict, headers: dict | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _error(self, e: ApiError) -> None:
        headers = {"Retry-After": str(e.retry_after)} if e.retry_after else None
        self._json(e.status, {"error": {"message": e.message, "type": "invalid_request_error" if e.status < 500
                                        else "server_error", "code": e.code}}, headers)

    def _body(self) -> dict:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            raise ApiError(400, "bad Content-Length", "invalid_request_error") from None
        if length > MAX_BODY:
            raise ApiError(413, f"request body over {MAX_BODY} bytes", "request_too_large")
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"malformed JSON: {e}", "invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", "invalid_request_error")
        return body

    # ------------------------------------------------------------------ routes
    def do_GET(self):
        try:
            if self.path == "/health":
                engine = self.server.engine
                self._json(200 if engine.accepting else 503, {
                    "status": "ok" if engine.accepting else "draining", "running": engine.busy,
                    "largest_batch": engine.largest_batch, "decode_steps": engine.steps,
                    "processes": engine.runner.processes})
            elif self.path == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": self.server.model_name, "object": "model",
                                                              "created": self.server.started, "owned_by": "hardy"}]})
            else:
                raise ApiError(404, f"no route GET {self.path}", "not_found")
        except ApiError as e:
            self._error(e)

    def do_POST(self):
        try:
            if self.path not in ("/v1/completions", "/v1/chat/completions"):
                raise ApiError(404, f"no route POST {self.path}", "not_found")
            body = self._body()
            chat = self.path == "/v1/chat/completions"
            request, stream = self._make_request(body, chat)
            try:
                self.server.engine.submit(request)
            except QueueFull:
                raise ApiError(503, "the request queue is full; retry shortly", "queue_full", retry_after=1) from None
            except ShuttingDown:
                raise ApiError(503, "the server is shutting down", "shutting_down", retry_after=5) from None
            if stream:
                self._stream(request, chat)
            else:
                self._complete(request, chat)
        except ApiError as e:
            self._error(e)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _make_request(self, body: dict, chat: bool) -> tuple[Request, bool]:
        server, tok = self.server, self.server.tokenizer
        model = body.get("model")
        if model is not None and model != server.model_name:
            raise ApiError(404, f"model {model!r} is not served here (serving {server.model_name!r})", "model_not_found")
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages):
                raise ApiError(400, "'messages' must be a non-empty list of {role, content} strings",
                               "invalid_request_error")
            try:
                text = tok.apply_chat_template(messages)
            except Exception as e:
                raise ApiError(400, f"cannot apply the chat template: {e}", "invalid_request_error") from None
        else:
            text = body.get("prompt")
            if isinstance(text, list) and len(text) == 1 and isinstance(text[0], str):
                text = text[0]
            if not isinstance(text, str) or not text:
                raise ApiError(400, "'prompt' must be a non-empty string", "invalid_request_error")
        try:
            prompt = tok.encode(text)
        except HardyError as e:
            raise ApiError(400, str(e), "invalid_request_error") from None
        max_tokens = _int_field(body, "max_tokens", min(16 if not chat else 256, server.max_tokens_limit), 1,
                                server.max_tokens_limit)
        context = server.engine.context
        if len(prompt) + max_tokens > context:
            raise ApiError(400, f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                                f"context of {context} tokens", "context_length_exceeded")
        temperature = _float_field(body, "temperature", 0.0 if not chat else 0.0, 0.0, 2.0)
        top_p = _float_field(body, "top_p", 1.0, 1e-6, 1.0)
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ApiError(400, "'seed' must be an integer", "invalid_request_error")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, "'stream' must be true or false", "invalid_request_error")
        sampling = SamplingConfig(max_new_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed)
        return Request(prompt=prompt, sampling=sampling, stop_ids=set(tok.stop_ids), stop=_stop_field(body)), stream

    def _events(self, request: Request):
        while True:
            kind, value = request.events.get()
            if kind == "error":
                raise ApiError(500, f"generation failed: {value}", "server_error")
            yield kind, value
            if kind == "done":
                return

    def _payload(self, request: Request, chat: bool, text: str | None, finish: str | None, chunk: bool) -> dict:
        server = self.server
        base = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{request.id}", "created": int(request.created),
                "model": server.model_name}
        if chat:
            if chunk:
                delta = {} if text is None else {"content": text}
                return {**base, "object": "chat.completion.chunk",
                        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            return {**base, "object": "chat.completion",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}]}
        return {**base, "object": "text_completion",
                "choices": [{"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}]}

    def _usage(self, request: Request) -> dict:
        completion = len([t for t in request.tokens if t not in request.stop_ids])
        return {"prompt_tokens": len(request.prompt), "completion_tokens": completion,
                "total_tokens": len(request.prompt) + completion}

    def _generated(self, request: Request):
        """(text to send, None) per token, then (remaining text, finish reason). A stop string ends
        the request early; the caller then cancels it, which frees its slot."""
        decoder, scanner = self.server.tokenizer.stream_decoder(), StopScanner(request.stop)
        for kind, value in self._events(request):
            if kind == "done":
                yield scanner.flush(), value
                return
            text = scanner.feed(decoder.step(value))
            if scanner.stopped:
                yield text, "stop"
                return
            yield text, None

    def _complete(self, request: Request, chat: bool) -> None:
        pieces, finish = [], None
        try:
            for text, finish in self._generated(request):
                pieces.append(text)
        finally:
            self.server.engine.cancel(request)  # after a stop string or a lost client: free the slot
        payload = self._payload(request, chat, "".join(pieces), finish, chunk=False)
        payload["usage"] = self._usage(request)
        self._json(200, payload)

    def _stream(self, request: Request, chat: bool) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

        def send(payload) -> None:
            self.wfile.write(f"data: {json.dumps(payload) if isinstance(payload, dict) else payload}\n\n".encode())
            self.wfile.flush()

        try:
            if chat:
                send({**self._payload(request, chat, None, None, chunk=True),
                      "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]})
            for text, finish in self._generated(request):
                if text:
                    send(self._payload(request, chat, text, None, chunk=True))
                if finish is not None:
                    final = self._payload(request, chat, None if chat else "", finish, chunk=True)
                    final["usage"] = self._usage(request)
                    send(final)
        except ApiError as e:
            send({"error": {"message": e.message, "type": "server_error", "code": e.code}})
        finally:
            self.server.engine.cancel(request)  # after a stop string or a lost client: free the slot
        send("[DONE]")
