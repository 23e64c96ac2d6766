"""What stands between the network and the API: uvicorn with limits a public server needs.

- A header timeout (uvicorn has none): a connection that is waiting for a request's headers — a
  client that connected and sent nothing, or sent half its headers — is closed after
  `header_timeout` s, so slow clients cannot hold connections forever. Idle keep-alive connections
  close after uvicorn's `timeout_keep_alive`.
- A body limit and a body timeout (`BodyGuard`, ASGI middleware): a declared or streamed body over
  `max_body` bytes is 413, a body not complete within `body_timeout` s of its headers is 408.
- A cap on open connections (uvicorn's `limit_concurrency`: beyond it a request gets 503).
- SIGTERM/SIGINT are handed to hardy's drain instead of uvicorn's immediate shutdown.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import sys
import threading
from typing import Callable

import h11
import uvicorn
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from hardy.serve.engine import EngineFailed, QueueFull, ShuttingDown


class ApiError(Exception):
    """A request answered with an error body (error_payload) instead of a result."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.retry_after = status, message, code, param, retry_after


class AsyncEvents:
    """A request's event queue as the engine thread sees it (`put`) and as the event loop reads it."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop has closed: nobody is waiting any more
            pass

    async def get(self):
        return await self.queue.get()


def check_model_name(asked: str | None, served: str) -> None:
    """A request naming another model is a 404; naming none is fine (OpenAI clients often must)."""
    if asked is not None and asked != served:
        raise ApiError(404, f"model {asked!r} is not served here (serving {served!r})", "model_not_found", "model")


def submit_to_engine(engine, request) -> None:
    """Hand a request to the engine, or answer 503 (with Retry-After where a retry can succeed)."""
    try:
        engine.submit(request)
    except QueueFull:
        raise ApiError(503, "the request queue is full; retry shortly", "queue_full", retry_after=1) from None
    except ShuttingDown:
        raise ApiError(503, "the server is shutting down", "shutting_down", retry_after=5) from None
    except EngineFailed:  # why is the server's own stderr line ("the engine failed (...); stopping")
        raise ApiError(503, "the engine has failed and the server is stopping (its log says why)",
                       "engine_failed") from None


def internal_error(what: str, cause: str, request_id: str) -> ApiError:
    """A 500 whose cause goes to the server's log, one line under the request's id, and not to the
    client: exception text can name files, paths and internals the client has no business seeing."""
    first = cause.strip().splitlines()[0] if cause.strip() else "no detail"
    print(f"hardy serve: {request_id}: {what}: {first}", file=sys.stderr, flush=True)
    return ApiError(500, f"{what}: internal error (the server log has the cause under {request_id})", "server_error")


def error_payload(status: int, message: str, code: str, param: str | None = None) -> dict:
    """OpenAI's error body: every error hardy's server sends has this shape."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class BodyGuard:
    """ASGI middleware: bounded request bodies, read within a deadline; each response's status is
    reported to `on_response(path, status)` (for the metrics)."""

    def __init__(self, app, max_body: int, body_timeout: float, on_response: Callable[[str, int], None]):
        self.app, self.max_body, self.body_timeout, self.on_response = app, max_body, body_timeout, on_response

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 0

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            declared = dict(scope["headers"]).get(b"content-length")
            if declared is not None and int(declared) > self.max_body:  # h11 has refused non-numeric ones
                return await self._refuse(send_status, 413, f"request body over {self.max_body} bytes",
                                          "request_too_large")
            await self.app(scope, self._bounded(receive), send_status)
        finally:
            self.on_response(scope["path"], status)

    def _bounded(self, receive):
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout
        state = {"more": True, "total": 0}

        async def bounded_receive():
            if not state["more"]:  # the body is in: from now on only a disconnect can arrive
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise HTTPException(408, f"the request body did not arrive within {self.body_timeout:g} s") from None
            if message["type"] == "http.request":
                state["total"] += len(message.get("body", b""))
                state["more"] = message.get("more_body", False)
                if state["total"] > self.max_body:
                    raise HTTPException(413, f"request body over {self.max_body} bytes")
            else:
                state["more"] = False
            return message

        return bounded_receive

    @staticmethod
    async def _refuse(send, status: int, message: str, code: str) -> None:
        body = json.dumps(error_payload(status, message, code)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def protocol_with_header_timeout(header_timeout: float) -> type[H11Protocol]:
    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _watch_headers(self) -> None:
            waiting = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
            if waiting and self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout, self._header_timed_out)
            elif not waiting and self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timed_out(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._watch_headers()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch_headers()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._watch_headers()

        def connection_lost(self, exc) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            super().connection_lost(exc)

    return HeaderTimeoutProtocol


def listen(host: str, port: int, backlog: int = 128) -> socket.socket:
    """Bind and listen before the server starts, so the port is known (and taken) up front and clients
    that connect early wait in the backlog."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class HttpServer(uvicorn.Server):
    """uvicorn, except that a signal only calls `on_signal`: hardy drains the engine first and then
    sets `should_exit` itself."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None]):
        super().__init__(config)
        self._on_signal = on_signal

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.signal(s, lambda *_: self._on_signal()) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def server_config(app, *, header_timeout: float, keep_alive: float, max_connections: int) -> uvicorn.Config:
    return uvicorn.Config(app, http=protocol_with_header_timeout(header_timeout), lifespan="off",
                          timeout_keep_alive=keep_alive, limit_concurrency=max_connections,
                          timeout_graceful_shutdown=5, log_level="warning", access_log=False)
