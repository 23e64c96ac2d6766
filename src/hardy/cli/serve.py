"""hardy serve: an OpenAI-compatible HTTP API with continuous batching (docs/serving.md)."""
from __future__ import annotations

import os
import sys
import threading

from hardy.cli.common import (add_kv_args, add_model_args, add_speculate_args, add_tp_args, kv_settings,
                               load_from_args, parse_speculation, speculator_for, use_fast_prefill, weights_line)
from hardy.errors import HardyError
from hardy.extras import require as require_extra
from hardy.formats.chat import read_template_file, use_chat_template
from hardy.loading.load import config_for
from hardy.parallel.distributed import leave_together


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 = any free port (printed at start)")
    p.add_argument("--name", default=None, help="the model id clients use (default: the --model argument)")
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together")
    p.add_argument("--max-queue", type=int, default=64, help="waiting requests before 503 queue full")
    p.add_argument("--max-tokens", type=int, default=512, help="the largest max_tokens a request may ask")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, seconds to let running requests finish")
    p.add_argument("--max-connections", type=int, default=256,
                   help="requests in flight at once (an HTTP/1.1 connection carries one at a time) before new "
                        "ones get 503; idle connections are closed by the header deadline (default 256)")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection has to send a request's headers, from when it opens or its last "
                        "response ends; the deadline is the smaller of this and --keep-alive (default 10)")
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a request's body may take to arrive after its headers (default 30)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template for /v1/chat/completions, instead of the model's own")
    p.add_argument("--keep-alive", type=float, default=5.0,
                   help="seconds an idle keep-alive connection stays open; the same timer is the header "
                        "deadline, so the smaller of this and --header-timeout applies to both (default 5)")
    p.add_argument("--prefill-chunk", default="0", metavar="N|auto",
                   help="chunked prefill: prompt tokens that ride along in each decode step of the running streams. "
                        "0 (default): each prompt in one pass of its own, which stops the streams meanwhile; auto: "
                        "as many as keep a step within 1.6x a plain one; N: at most N (BENCHMARKS.md: what each costs)")
    add_kv_args(p)
    add_speculate_args(p)
    add_tp_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    require_extra("serve", "hardy serve")
    from hardy.serve.engine import Engine, ModelRunner

    for key in ("max_batch", "max_queue", "max_tokens", "tp", "max_connections"):
        if getattr(args, key) < 1:
            raise HardyError(f"--{key.replace('_', '-')} must be >= 1")
    if args.context is not None and args.context < 2:
        raise HardyError("--context must be >= 2")
    if args.drain_timeout < 0:
        raise HardyError("--drain-timeout must be >= 0")
    for key in ("header_timeout", "body_timeout", "keep_alive"):
        if not getattr(args, key) > 0:
            raise HardyError(f"--{key.replace('_', '-')} must be > 0")
    chunk = prefill_chunk(args.prefill_chunk)
    spec = parse_speculation(args)
    if spec is not None and args.tp > 1:
        raise HardyError("--speculate runs in one process; drop it or --tp")
    if args.chat_template:
        read_template_file(args.chat_template)  # refused before the model loads
    if args.tp > 1:
        from hardy.infer.tensor_parallel import cpu_only

        cpu_only(args)
    if args.tp > 1 and "WORLD_SIZE" not in os.environ:  # the launcher: start the workers, they do the rest
        from hardy.infer.tensor_parallel import check_tp, relaunch_under_torchrun

        check_tp(args.model, config_for(args.model), args.tp, getattr(args, "gguf_weights", "float"))  # bad input fails here, before any process starts
        # torchrun passes SIGTERM on to the workers and waits this long before killing them (torch >= 2.9
        # reads it; older torch waits 30 s): rank 0 must have time to drain.
        os.environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(int(args.drain_timeout) + 15)
        return relaunch_under_torchrun(args.tp, sys.argv[1:], args.threads)
    loaded = load_from_args(args)
    use_chat_template(loaded.tokenizer, args.chat_template, required=False)
    use_fast_prefill(loaded)
    runner, rank = ModelRunner, 0
    if args.tp > 1:
        from hardy.infer.tensor_parallel import shard_model

        rank = shard_model(loaded.model, args.tp).rank
    # each rank's share of the heads; under --tp the ranks agree on one capacity before any refuses
    context, kv_dtype, budget = kv_settings(args, loaded.model, args.max_batch, check=args.tp == 1)
    if args.tp > 1:
        from hardy.serve.tensor_parallel import LeaderRunner, agree_on_capacity, follow

        budget = agree_on_capacity(budget).check()
        if rank != 0:  # a follower: no server, only forward passes
            sys.stdout = open(os.devnull, "w")
            if not follow(loaded.model, args.max_batch, context, kv_dtype, budget.capacity):
                print("hardy: rank 0 stopped in the middle of a forward pass; this worker stops too",
                      file=sys.stderr, flush=True)
                os._exit(1)  # the process group is broken: tearing it down could only hang
            leave_together()  # rank 0 said stop and meets us here
            return 0
        runner = LeaderRunner
    print(f"hardy: {weights_line(loaded)}; {budget.line}", file=sys.stderr, flush=True)
    speculator = speculator_for(args, spec, loaded, args.max_batch, context, kv_dtype)
    if spec is not None:
        print(f"hardy: speculation {spec.label}, up to {spec.tokens} guessed tokens per step for greedy requests",
              file=sys.stderr, flush=True)
    engine = Engine(loaded.model, max_batch=args.max_batch, max_queue=args.max_queue, context=context,
                    runner=runner, kv_dtype=kv_dtype, capacity=budget.capacity, prefill_chunk=chunk,
                    speculator=speculator)
    failed = serve_http(args, engine, loaded.tokenizer)
    if failed:
        print(f"hardy: error: the engine failed ({failed}); stopping", file=sys.stderr, flush=True)
        if args.tp > 1:
            os._exit(1)  # the followers sit in a collective: our exit is what ends it (serve/tensor_parallel.py)
        return 1
    if args.tp > 1:
        leave_together()
    return 0


def prefill_chunk(value: str) -> int | None:
    """--prefill-chunk: None for auto, else a token count >= 0."""
    if value == "auto":
        return None
    if not value.isdigit():
        raise HardyError(f"--prefill-chunk must be auto or a number of tokens >= 0 (got {value!r})")
    return int(value)


def serve_http(args, engine, tokenizer) -> str | None:
    """Serve until SIGTERM/SIGINT (after draining) or until the engine fails; close the engine. Returns
    why the engine failed, or None."""
    from hardy.serve.api import create_app
    from hardy.serve.transport import HttpServer, listen, server_config

    try:
        sock = listen(args.host, args.port)
    except OSError as e:
        engine.close()
        raise HardyError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    app = create_app(engine, tokenizer, args.name or args.model, args.max_tokens, body_timeout=args.body_timeout,
                     max_in_flight=args.max_connections)
    stopping = threading.Event()
    server = HttpServer(app, server_config(sock, header_timeout=args.header_timeout, keep_alive=args.keep_alive))

    def drain_then_stop():  # the signal handler itself only sets an event
        while not stopping.wait(0.1):
            if engine.failed:
                server.stop()
                return
        done = engine.drain(args.drain_timeout)
        print(f"hardy: {'drained' if done else 'drain timeout; dropping'} running requests, stopping",
              file=sys.stderr, flush=True)
        server.stop()

    host, port = sock.getsockname()[:2]
    print(f"hardy: serving {args.name or args.model} on http://{host}:{port}/v1 (max batch {args.max_batch}, "
          f"context {engine.context})", flush=True)
    threading.Thread(target=drain_then_stop, name="hardy-drain", daemon=True).start()
    try:
        server.run(on_signal=stopping.set)
    finally:
        sock.close()
        engine.close()  # under --tp this tells the followers to stop (unless the engine failed)
    return engine.failed
