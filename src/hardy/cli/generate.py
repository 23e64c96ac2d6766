"""hardy generate: stream a completion from a prompt."""
from __future__ import annotations

import os
import sys

from hardy.cli.common import (add_kv_args, add_model_args, add_speculate_args, add_tp_args, kv_settings, load_from_args,
                              parse_speculation, speculator_for, use_fast_prefill)
from hardy.errors import HardyError
from hardy.formats.chat import read_template_file, use_chat_template
from hardy.loading.load import config_for
from hardy.parallel.distributed import leave_together


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt (streams tokens)")
    add_model_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message for --chat")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template for --chat, instead of the model's own (or hardy's built-in one "
                        "for a file without a template)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--no-cache", action="store_true", help="recompute the whole sequence every step")
    p.add_argument("--stats", action="store_true", help="print prefill and decode tokens/s at the end")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the decode step (float models, one process; SmolLM2 fp32 decode "
                        "1.07-1.10x faster here after a one-off ~40 s compile)")
    add_kv_args(p)
    add_speculate_args(p)
    add_tp_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from hardy.infer.generate import SamplingConfig, generate

    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_p=args.top_p, seed=args.seed)
    if args.tp < 1:
        raise HardyError(f"--tp must be >= 1 (got {args.tp})")
    if args.chat_template and not args.chat:
        raise HardyError("--chat-template applies to --chat")
    if args.chat_template:
        read_template_file(args.chat_template)  # refused before the model loads
    if args.compile and args.tp > 1:
        raise HardyError("--compile is for one process; drop it or --tp")
    spec = parse_speculation(args)
    if spec is not None and (args.tp > 1 or args.compile or args.no_cache or args.temperature > 0):
        raise HardyError("--speculate needs greedy decoding (--temperature 0) in one process over the KV cache "
                         "(not --tp, --compile or --no-cache)")
    if args.tp > 1:
        from hardy.infer.tensor_parallel import cpu_only

        cpu_only(args)
    if args.tp > 1 and "WORLD_SIZE" not in os.environ:  # the launcher: start the workers, they do the rest
        from hardy.infer.tensor_parallel import check_tp, relaunch_under_torchrun

        check_tp(args.model, config_for(args.model), args.tp, getattr(args, "gguf_weights", "float"))  # bad input fails here, before any process starts
        return relaunch_under_torchrun(args.tp, sys.argv[1:], args.threads)
    loaded = load_from_args(args)
    use_fast_prefill(loaded)
    compile_step = args.compile
    if compile_step:
        from hardy.infer.generate import compile_blocker

        reason = compile_blocker(loaded.model)
        if reason:  # said, not silently dropped: the fused kernels are this model's fast path
            print(f"note: --compile not applied: {reason}", file=sys.stderr)
            compile_step = False
    rank = 0
    if args.tp > 1:
        from hardy.infer.tensor_parallel import shard_model

        rank = shard_model(loaded.model, args.tp).rank
    if rank != 0:  # every rank computes (each holds a slice); only rank 0 talks
        sys.stdout = open(os.devnull, "w")
        sys.stderr = open(os.devnull, "w")
    tok = loaded.tokenizer
    text = args.prompt
    if args.chat:
        use_chat_template(tok, args.chat_template)
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        text = tok.apply_chat_template(messages + [{"role": "user", "content": args.prompt}])
    prompt = tok.encode_chat(text) if args.chat else tok.encode(text)
    context, kv_dtype, budget = kv_settings(args, loaded.model, 1)
    if len(prompt) + args.max_new_tokens > context:
        raise HardyError(f"the prompt ({len(prompt)} tokens) plus --max-new-tokens ({args.max_new_tokens}) exceeds the "
                         f"context of {context} tokens: raise --context (the model allows {loaded.config.max_seq_len})")
    if not args.chat:
        sys.stdout.write(args.prompt)
    stream = tok.stream_decoder()
    stop = tok.stop_ids

    def emit(token: int) -> None:
        if token in stop:
            return
        sys.stdout.write(stream.step(token))
        sys.stdout.flush()

    speculator = speculator_for(args, spec, loaded, 1, len(prompt) + args.max_new_tokens, kv_dtype)
    result = generate(loaded.model, prompt, sampling, stop_ids=stop, use_cache=not args.no_cache, on_token=emit,
                      compile=compile_step, kv_dtype=kv_dtype, speculator=speculator)
    sys.stdout.write("\n")
    if args.stats:
        s = result.stats
        print(f"prefill: {s.prompt_tokens} tokens in {s.prefill_s:.3f} s ({s.prefill_tps:.1f} tokens/s); "
              f"decode: {s.new_tokens} tokens in {s.decode_s:.3f} s ({s.decode_tps:.1f} tokens/s)"
              + (f"; compile: {s.compile_s:.1f} s" if s.compile_s else "")
              + (f"; speculation: {s.accepted} of {s.drafted} guesses kept" if spec else ""), file=sys.stderr)
    if args.tp > 1:
        leave_together()
    return 0
