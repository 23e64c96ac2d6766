"""hardy generate: stream a completion from a prompt."""
from __future__ import annotations

import sys

from hardy.cli.common import add_model_args, load_from_args


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt (streams tokens)")
    add_model_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message for --chat")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--no-cache", action="store_true", help="recompute the whole sequence every step")
    p.add_argument("--stats", action="store_true", help="print prefill and decode tokens/s at the end")
    p.set_defaults(func=run)


def run(args) -> int:
    from hardy.infer.generate import SamplingConfig, generate

    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_p=args.top_p, seed=args.seed)
    loaded = load_from_args(args)
    tok = loaded.tokenizer
    text = args.prompt
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        text = tok.apply_chat_template(messages + [{"role": "user", "content": args.prompt}])
    prompt = tok.encode(text)
    if not args.chat:
        sys.stdout.write(args.prompt)
    stream = tok.stream_decoder()
    stop = tok.stop_ids

    def emit(token: int) -> None:
        if token in stop:
            return
        sys.stdout.write(stream.step(token))
        sys.stdout.flush()

    result = generate(loaded.model, prompt, sampling, stop_ids=stop, use_cache=not args.no_cache, on_token=emit)
    sys.stdout.write("\n")
    if args.stats:
        s = result.stats
        print(f"prefill: {s.prompt_tokens} tokens in {s.prefill_s:.3f} s ({s.prefill_tps:.1f} tokens/s); "
              f"decode: {s.new_tokens} tokens in {s.decode_s:.3f} s ({s.decode_tps:.1f} tokens/s)", file=sys.stderr)
    return 0
