"""What stands between the network and the API: hypercorn, through its public API, with the limits a
public server needs.

- A header deadline: hypercorn's keep-alive timer runs from when a connection opens, and again from the
  end of each response, until a request's headers are complete. Set to min(header_timeout, keep_alive),
  it closes a client that connected and sent nothing or half its headers, and an idle keep-alive
  connection, alike.
- A body limit and a body timeout (`BodyGuard`, ASGI middleware): a declared or streamed body over
  `max_body` bytes is 413, a body not complete within `body_timeout` s of its headers is 408.
- A cap on requests in flight (`BodyGuard` too, as hypercorn has no connection limit): beyond
  `max_in_flight` a request gets 503. An HTTP/1.1 connection carries one request at a time, and an idle
  one holds no slot: the header deadline closes it.
- SIGTERM/SIGINT only call hardy's `on_signal`: hardy drains the engine first, then calls
  `HttpServer.stop`.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import threading
from typing import Callable

from hypercorn.asyncio import serve
from hypercorn.config import Config
from starlette.exceptions import HTTPException

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
    """ASGI middleware: at most `max_in_flight` requests at once (beyond it 503), bounded request bodies
    read within a deadline; each response's status is reported to `on_response(path, status)` (for the
    metrics)."""

    def __init__(self, app, max_body: int, body_timeout: float, on_response: Callable[[str, int], None],
                 max_in_flight: int = 256):
        self.app, self.max_body, self.body_timeout, self.on_response = app, max_body, body_timeout, on_response
        self.max_in_flight, self.in_flight = max_in_flight, 0

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
            if self.in_flight >= self.max_in_flight:
                return await self._refuse(send_status, 503, f"the server's {self.max_in_flight} requests in flight "
                                          "are taken; retry shortly", "too_many_connections", retry_after=1)
            self.in_flight += 1  # one event loop: no lock needed
            try:
                await self._guarded(scope, receive, send_status)
            finally:
                self.in_flight -= 1
        finally:
            self.on_response(scope["path"], status)

    async def _guarded(self, scope, receive, send) -> None:
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and int(declared) > self.max_body:  # the HTTP parser has refused non-numeric ones
            return await self._refuse(send, 413, f"request body over {self.max_body} bytes", "request_too_large")
        await self.app(scope, self._bounded(receive), send)

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
    async def _refuse(send, status: int, message: str, code: str, retry_after: int | None = None) -> None:
        body = json.dumps(error_payload(status, message, code)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        if retry_after is not None:
            headers.append((b"retry-after", str(retry_after).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


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


def server_config(sock: socket.socket, *, header_timeout: float, keep_alive: float) -> Config:
    """hypercorn's settings: serve on a duplicate of `sock` (hypercorn closes the socket it is given; the
    caller still closes its own), no access log, warnings and errors to stderr."""
    config = Config()
    config.bind = [f"fd://{os.dup(sock.fileno())}"]
    config.backlog = 128  # listen()'s: hypercorn listens again on the socket with its own
    config.keep_alive_timeout = min(header_timeout, keep_alive)  # the header deadline (module docstring)
    config.graceful_timeout = 5
    config.accesslog = None
    config.errorlog = "-"
    config.loglevel = "WARNING"
    return config


class HttpServer:
    """hypercorn serving `app` until `stop()`, which any thread may call, once or more, before or after
    the server has started."""

    def __init__(self, app, config: Config):
        self.app, self.config = app, config
        self._asked = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None

    def run(self, on_signal: Callable[[], None]) -> None:
        """Serve until stopped; meanwhile SIGTERM and SIGINT only call `on_signal`."""
        with signals_call(on_signal):
            asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._stop = asyncio.Event()  # before the loop is published: stop() reads both
        self._loop = asyncio.get_running_loop()
        if self._asked.is_set():  # stop() came before the loop existed
            self._stop.set()
        await serve(self.app, self.config, shutdown_trigger=self._stop.wait)

    def stop(self) -> None:
        self._asked.set()
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: the server has stopped already
                self._loop.call_soon_threadsafe(self._stop.set)


@contextlib.contextmanager
def signals_call(handler: Callable[[], None]):
    """While inside, SIGTERM and SIGINT call `handler` (in the main thread; elsewhere signals cannot be
    handled and nothing changes); the previous handlers come back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, lambda *_: handler()) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)
