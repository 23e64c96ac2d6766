"""hardy serve: an OpenAI-compatible HTTP API with continuous batching (docs/serving.md)."""
from __future__ import annotations

import signal
import sys
import threading

from hardy.cli.common import add_model_args, add_tp_args


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 = any free port (printed at start)")
    p.add_argument("--name", default=None, help="the model id clients use (default: the --model argument)")
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together")
    p.add_argument("--max-queue", type=int, default=64, help="waiting requests before 503 queue full")
    p.add_argument("--max-tokens", type=int, default=512, help="the largest max_tokens a request may ask")
    p.add_argument("--context", type=int, default=None, help="KV cache length per request (default: the model's)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, seconds to let running requests finish")
    add_tp_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    import os

    from hardy.cli.common import load_from_args, use_fast_prefill
    from hardy.errors import HardyError
    from hardy.parallel.distributed import leave_together
    from hardy.serve.api import Server
    from hardy.serve.engine import Engine, ModelRunner, context_length

    for key in ("max_batch", "max_queue", "max_tokens", "tp"):
        if getattr(args, key) < 1:
            raise HardyError(f"--{key.replace('_', '-')} must be >= 1")
    if args.context is not None and args.context < 2:
        raise HardyError("--context must be >= 2")
    if args.drain_timeout < 0:
        raise HardyError("--drain-timeout must be >= 0")
    if args.tp > 1:
        from hardy.infer.tensor_parallel import cpu_only

        cpu_only(args)
    if args.tp > 1 and "WORLD_SIZE" not in os.environ:  # the launcher: start the workers, they do the rest
        from hardy.formats.load import config_for
        from hardy.infer.tensor_parallel import check_tp, relaunch_under_torchrun

        check_tp(args.model, config_for(args.model), args.tp, getattr(args, "gguf_weights", "float"))  # bad input fails here, before any process starts
        # torchrun passes SIGTERM on to the workers and waits this long before killing them (torch >= 2.9
        # reads it; older torch waits 30 s): rank 0 must have time to drain.
        os.environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(int(args.drain_timeout) + 15)
        return relaunch_under_torchrun(args.tp, sys.argv[1:], args.threads)
    loaded = load_from_args(args)
    use_fast_prefill(loaded)
    runner = ModelRunner
    if args.tp > 1:
        from hardy.infer.tensor_parallel import shard_model
        from hardy.serve.tensor_parallel import LeaderRunner, follow

        if shard_model(loaded.model, args.tp).rank != 0:  # a follower: no server, only forward passes
            sys.stdout = open(os.devnull, "w")
            follow(loaded.model, args.max_batch, context_length(loaded.model, args.context))
            leave_together()  # rank 0 said stop and meets us here
            return 0
        runner = LeaderRunner
    engine = Engine(loaded.model, max_batch=args.max_batch, max_queue=args.max_queue, context=args.context,
                    runner=runner)
    try:
        server = Server((args.host, args.port), engine, loaded.tokenizer, args.name or args.model, args.max_tokens)
    except OSError as e:
        engine.close()
        if args.tp > 1:
            leave_together()
        raise HardyError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    host, port = server.server_address[:2]
    print(f"hardy: serving {args.name or args.model} on http://{host}:{port}/v1 (max batch {args.max_batch}, "
          f"context {engine.context})", flush=True)
    stopping = threading.Event()

    def drain_then_stop():  # started before serving: the signal handler itself only sets an event
        stopping.wait()
        done = engine.drain(args.drain_timeout)
        print(f"hardy: {'drained' if done else 'drain timeout; dropping'} running requests, stopping",
              file=sys.stderr, flush=True)
        server.shutdown()

    def on_signal(signum, frame):
        # Nothing that takes locks a handler thread's start-up may hold (a handler runs between any
        # two bytecodes of the main thread, e.g. inside Thread.start() for a new connection).
        stopping.set()

    threading.Thread(target=drain_then_stop, name="hardy-drain", daemon=True).start()
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        server.serve_forever(poll_interval=0.1)
    finally:
        server.server_close()
        engine.close()  # under --tp this tells the followers to stop
        if args.tp > 1:
            leave_together()
    return 0
