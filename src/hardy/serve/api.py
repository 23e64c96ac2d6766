"""An OpenAI-compatible HTTP API over the engine, on FastAPI (served by hypercorn, serve/transport.py):
POST /v1/completions, POST /v1/chat/completions (both with SSE streaming), POST /v1/rerank
(serve/rerank.py), GET /v1/models,
GET /health, GET /metrics (Prometheus), GET /openapi.json.

Every client mistake is a 4xx with OpenAI's error body, and none reaches the engine: malformed JSON
or fields (400), unknown model (404), a prompt plus max_tokens beyond the context (400,
code "context_length_exceeded"), max_tokens above the server's limit (400), a full queue (503 with
Retry-After), a server draining for shutdown (503). A failure inside the engine reaches the
waiting request as a 500; a client that leaves frees its slot at the engine's next step.
"""
from __future__ import annotations

import asyncio
import json
import time

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from hardy.errors import HardyError
from hardy.infer.generate import SamplingConfig
from hardy.serve.engine import Engine, Request
from hardy.serve.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from hardy.serve.rerank import Reranker
from hardy.serve.schemas import (ChatCompletion, ChatCompletionRequest, Completion, CompletionRequest,
                                 ErrorResponse, Health, ModelList, RerankRequest, RerankResponse)
from hardy.serve.transport import (ApiError, AsyncEvents, BodyGuard, check_model_name, error_payload,
                                   internal_error, submit_to_engine)

MAX_BODY = 1 << 20
HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 408: "request_timeout", 413: "request_too_large"}
ERRORS = {status: {"model": ErrorResponse} for status in (400, 404, 408, 413, 500, 503)}
# each server-sent event: `data: <a JSON chunk>` ... then `data: [DONE]`
STREAMED = {200: {"content": {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"], "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}}}}}


def _error_response(status: int, message: str, code: str, param: str | None = None,
                    retry_after: int | None = None) -> JSONResponse:
    return JSONResponse(error_payload(status, message, code, param), status, headers={"Retry-After": str(retry_after)} if retry_after else None)


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


def create_app(engine: Engine, tokenizer, model_name: str, max_tokens_limit: int, *,
               max_body: int = MAX_BODY, body_timeout: float = 30.0, max_in_flight: int = 256):
    """The ASGI application: FastAPI's routes behind the body limits and the cap on requests in flight
    (serve/transport.py)."""
    app = FastAPI(title="hardy", version="1", summary="OpenAI-compatible completions from a hardy model",
                  docs_url=None, redoc_url=None)
    metrics = ServerMetrics(engine)
    app.state.metrics = metrics
    add_error_handlers(app)
    add_generation_routes(app, _Api(engine, tokenizer, model_name, max_tokens_limit, metrics),
                          Reranker(engine, tokenizer, model_name), bool(getattr(tokenizer, "chat_template", None)))
    add_status_routes(app, engine, model_name, metrics)
    app.openapi = lambda: openapi_schema(app, max_tokens_limit)
    return BodyGuard(app, max_body, body_timeout, metrics.count_response, max_in_flight)


def add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape; an unexpected one is a 500 whose detail goes to the log only."""

    @app.exception_handler(ApiError)
    async def api_error(_, e: ApiError):
        return _error_response(e.status, e.message, e.code, e.param, e.retry_after)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: HttpRequest, e: RequestValidationError):
        errors = e.errors()
        if any(err.get("type") == "json_invalid" for err in errors):
            return _error_response(400, "malformed JSON in the request body", "invalid_json")
        if "json" not in request.headers.get("content-type", ""):
            return _error_response(400, "the request body must be JSON, sent with Content-Type: application/json",
                                   "invalid_request_error")
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        where = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(where) or None
        message = f"'{param}': {first['msg']}" if param else f"the request body: {first['msg']}"
        return _error_response(400, message, "invalid_request_error", param)

    @app.exception_handler(HTTPException)
    async def http_error(_, e: HTTPException):
        response = _error_response(e.status_code, str(e.detail), HTTP_CODES.get(e.status_code, "http_error"))
        response.headers.update(e.headers or {})  # e.g. 405's Allow
        if e.status_code in (408, 413):  # the rest of the body is still on its way: do not read it
            response.headers["Connection"] = "close"
        return response

    unexpected_ids = iter(range(1, 1 << 62))

    @app.exception_handler(Exception)
    async def unexpected(_, e: Exception):
        error = internal_error("the request failed", f"{type(e).__name__}: {e}", f"error-{next(unexpected_ids)}")
        return _error_response(error.status, error.message, error.code)


def add_generation_routes(app: FastAPI, api: "_Api", reranker: Reranker, has_chat_template: bool) -> None:
    @app.post("/v1/completions", response_model=Completion, responses={**ERRORS, **STREAMED})
    async def completions(body: CompletionRequest, request: HttpRequest):
        return await api.serve(body, request, chat=False)

    # A model without a chat template answers chat requests 400 and leaves the route out of its schema.
    @app.post("/v1/chat/completions", response_model=ChatCompletion, responses={**ERRORS, **STREAMED},
              include_in_schema=has_chat_template)
    async def chat_completions(body: ChatCompletionRequest, request: HttpRequest):
        return await api.serve(body, request, chat=True)

    rerank_ids = iter(range(1, 1 << 62))

    @app.post("/v1/rerank", response_model=RerankResponse, responses=ERRORS, response_model_exclude_none=True)
    async def rerank(body: RerankRequest):
        return await reranker.rerank(body, f"rerank-{next(rerank_ids)}")


def add_status_routes(app: FastAPI, engine: Engine, model_name: str, metrics: ServerMetrics) -> None:
    started = int(time.time())

    @app.get("/v1/models", response_model=ModelList)
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": started,
                                            "owned_by": "hardy"}]}

    @app.get("/health", response_model=Health, responses={503: {"model": Health}})
    async def health():
        status = "failed" if engine.failed else "ok" if engine.accepting else "draining"
        body = {"status": status, "running": engine.busy, "largest_batch": engine.largest_batch,
                "decode_steps": engine.steps, "processes": engine.runner.processes}
        return JSONResponse(body, 200 if status == "ok" else 503)

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}}}})
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)


def openapi_schema(app: FastAPI, max_tokens_limit: int) -> dict:
    """FastAPI's schema, built once, with hardy's answers: 400 where FastAPI documents 422 (as OpenAI
    answers), and this server's own max_tokens limit."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("CompletionRequest", "ChatCompletionRequest"):
            fields = schema.get("components", {}).get("schemas", {}).get(name, {}).get("properties", {})
            for key in ("max_tokens", "max_completion_tokens"):
                for option in fields.get(key, {}).get("anyOf", []):
                    if option.get("type") == "integer":
                        option["maximum"] = max_tokens_limit
        app.openapi_schema = schema
    return app.openapi_schema


class _Api:
    def __init__(self, engine: Engine, tokenizer, model_name: str, max_tokens_limit: int, metrics: ServerMetrics):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.max_tokens_limit, self.metrics = max_tokens_limit, metrics

    # ------------------------------------------------------------------ admission
    def _make_request(self, body, chat: bool) -> Request:
        tok = self.tokenizer
        check_model_name(body.model, self.model_name)
        if chat:
            if not getattr(tok, "chat_template", None):
                raise ApiError(400, "this model has no chat template: use /v1/completions", "invalid_request_error",
                               "messages")
            try:
                text = tok.apply_chat_template([m.model_dump() for m in body.messages])
            except Exception as e:
                raise ApiError(400, f"cannot apply the chat template: {e}", "invalid_request_error", "messages") from None
        else:
            text = body.text()
        try:
            prompt = tok.encode_chat(text) if chat else tok.encode(text)
        except HardyError as e:
            raise ApiError(400, str(e), "invalid_request_error") from None
        limit = self.max_tokens_limit
        for key in ("max_tokens", "max_completion_tokens"):
            asked = getattr(body, key, None)
            if asked is not None and asked > limit:
                raise ApiError(400, f"'{key}' = {asked} exceeds this server's limit of {limit}",
                               "invalid_request_error", key)
        max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens or min(256 if chat else 16, limit)
        context = self.engine.context
        if len(prompt) + max_tokens > context:
            raise ApiError(400, f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                                f"context of {context} tokens", "context_length_exceeded", "max_tokens")
        sampling = SamplingConfig(max_new_tokens=max_tokens, temperature=float(body.temperature or 0.0),
                                  top_p=float(1.0 if body.top_p is None else body.top_p), seed=body.seed)
        return Request(prompt=prompt, sampling=sampling, stop_ids=set(tok.stop_ids), stop=body.stops(),
                       events=AsyncEvents(asyncio.get_running_loop()))

    async def serve(self, body, http: HttpRequest, chat: bool):
        arrived = time.monotonic()
        request = self._make_request(body, chat)
        submit_to_engine(self.engine, request)
        self.metrics.prompt_tokens.inc(len(request.prompt))
        if body.stream:
            return StreamingResponse(self._stream(request, chat, arrived), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await self._complete(request, chat, arrived, http)

    # ------------------------------------------------------------------ answers
    async def _generated(self, request: Request, arrived: float):
        """(text to send, None) per token, then (remaining text, finish reason). A stop string ends
        the request early; the caller then cancels it, which frees its slot."""
        decoder, scanner = self.tokenizer.stream_decoder(), StopScanner(request.stop)
        last = None
        while True:
            kind, value = await request.events.get()
            if kind == "error":
                raise internal_error("generation failed", str(value), f"request {request.id}")
            if kind == "done":
                yield scanner.flush(), "length" if value == "length" else "stop"
                return
            now = time.monotonic()
            (self.metrics.time_to_first_token if last is None else self.metrics.inter_token_latency).observe(
                now - (arrived if last is None else last))
            last = now
            self.metrics.generated_tokens.inc()
            text = scanner.feed(decoder.step(value))
            if scanner.stopped:
                yield text, "stop"
                return
            yield text, None

    def _ids(self, request: Request, chat: bool) -> dict:
        return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{request.id}", "created": int(request.created),
                "model": self.model_name}

    def _usage(self, request: Request) -> dict:
        completion = len([t for t in request.tokens if t not in request.stop_ids])
        return {"prompt_tokens": len(request.prompt), "completion_tokens": completion,
                "total_tokens": len(request.prompt) + completion}

    async def _complete(self, request: Request, chat: bool, arrived: float, http: HttpRequest) -> dict:
        async def cancel_on_disconnect():  # the body is in, so the next message can only be a disconnect
            while (await http.receive())["type"] != "http.disconnect":
                pass
            self.engine.cancel(request)

        watcher = asyncio.ensure_future(cancel_on_disconnect())
        pieces, finish = [], None
        try:
            async for text, finish in self._generated(request, arrived):
                pieces.append(text)
        finally:
            watcher.cancel()
            self.engine.cancel(request)  # after a stop string: free the slot
        text = "".join(pieces)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
            return {**self._ids(request, chat), "object": "chat.completion", "choices": [choice],
                    "usage": self._usage(request)}
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
        return {**self._ids(request, chat), "object": "text_completion", "choices": [choice],
                "usage": self._usage(request)}

    def _chunk(self, request: Request, chat: bool, text: str | None, finish: str | None, role: bool = False) -> dict:
        if chat:
            delta = {"role": "assistant"} if role else {} if text is None else {"content": text}
            return {**self._ids(request, chat), "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        return {**self._ids(request, chat), "object": "text_completion",
                "choices": [{"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}]}

    async def _stream(self, request: Request, chat: bool, arrived: float):
        def event(payload) -> str:
            return f"data: {json.dumps(payload) if isinstance(payload, dict) else payload}\n\n"

        try:
            if chat:
                yield event(self._chunk(request, chat, None, None, role=True))
            async for text, finish in self._generated(request, arrived):
                if text:
                    yield event(self._chunk(request, chat, text, None))
                if finish is not None:
                    final = self._chunk(request, chat, None, finish)
                    final["usage"] = self._usage(request)
                    yield event(final)
        except ApiError as e:  # the status line has gone out: the error travels as an event
            yield event(error_payload(e.status, e.message, e.code, e.param))
        finally:
            self.engine.cancel(request)  # after a stop string or a lost client: free the slot
        yield event("[DONE]")
