"""hardy eval: model quality measurements."""
from __future__ import annotations

import json
from pathlib import Path

from hardy.cli.common import Parser, add_device_arg, add_gguf_arg, add_model_args, load_from_args
from hardy.cli.eval_rank import register_rank
from hardy.devices import resolve_device
from hardy.errors import HardyError
from hardy.extras import require as require_extra
from hardy.loading.load import is_quantized_source, load_model, set_threads


def register(sub) -> None:
    p = sub.add_parser("eval", help="evaluate a model")
    tasks = p.add_subparsers(dest="task", required=True, parser_class=Parser)
    pp = tasks.add_parser("perplexity", help="perplexity on a text file (llama.cpp or full protocol)")
    add_model_args(pp)
    pp.add_argument("--data", required=True, help="text file, or a bundled corpus: wikitext2-test, "
                                                  "wikitext2-valid, tinyshakespeare")
    pp.add_argument("--ctx", type=int, default=None, help="context per chunk (default 512 llama.cpp, 2048 full)")
    pp.add_argument("--protocol", default="llama.cpp", choices=["llama.cpp", "full"])
    pp.add_argument("--batch", type=int, default=1, help="chunks evaluated together")
    pp.add_argument("--max-tokens", type=int, default=None, help="only use the first N tokens of the data")
    pp.add_argument("--json", action="store_true", help="print the result as JSON")
    pp.add_argument("--no-progress", action="store_true")
    pp.set_defaults(func=run_perplexity)
    register_compare(tasks)
    register_rank(tasks)


def run_perplexity(args) -> int:
    from hardy.data.text import read_text
    from hardy.eval.perplexity import perplexity

    text = read_text(args.data)  # read before loading the model: bad input fails fast
    if args.batch < 1:
        raise HardyError(f"--batch must be >= 1 (got {args.batch})")
    ctx = args.ctx or (512 if args.protocol == "llama.cpp" else 2048)
    loaded = load_from_args(args)
    if ctx > loaded.config.max_seq_len:
        raise HardyError(f"--ctx {ctx} exceeds the model's context of {loaded.config.max_seq_len}")
    tok = loaded.tokenizer
    tokens = tok.encode(text, special=False)  # as llama-perplexity: the vocab's BOS policy, "<unk>" as text
    if args.max_tokens:
        tokens = tokens[:args.max_tokens]
    result = perplexity(loaded.model, tokens, ctx=ctx, protocol=args.protocol, bos_id=tok.bos_id,
                        add_bos=tok.add_bos, batch_size=args.batch, progress=not args.no_progress)
    print(json.dumps(result.to_dict()) if args.json else result.line())
    return 0


def register_compare(tasks) -> None:
    pc = tasks.add_parser("compare", help="compare models against the first: PPL, KL, top-1, size, RSS, speed")
    pc.add_argument("--model", action="append", required=True,
                    help="a model (repeat; the first is the reference for KL and top-1)")
    pc.add_argument("--data", default="wikitext2-test", help="text file or bundled corpus (default wikitext2-test)")
    pc.add_argument("--ctx", type=int, default=None, help="context per chunk (default 512 llama.cpp, 2048 full)")
    pc.add_argument("--protocol", default="llama.cpp", choices=["llama.cpp", "full"])
    pc.add_argument("--max-tokens", type=int, default=None, help="only use the first N tokens of the data")
    pc.add_argument("--batch", type=int, default=4, help="chunks evaluated together")
    pc.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    add_device_arg(pc)
    add_gguf_arg(pc)
    pc.add_argument("--no-speed", action="store_true", help="skip the speed and peak-RSS measurement")
    pc.add_argument("--prompt-tokens", type=int, default=128)
    pc.add_argument("--new-tokens", type=int, default=64)
    pc.add_argument("--json", default=None, help="also write the rows as JSON to this file")
    pc.add_argument("--plot", default=None, help="write the Pareto plot (PPL vs size, PPL vs decode speed) to this PNG")
    pc.add_argument("--no-progress", action="store_true")
    pc.set_defaults(func=run_compare)


def run_compare(args) -> int:
    if args.plot:
        require_extra("plots", "--plot")
    from hardy.data.text import read_text
    from hardy.eval.compare import CompareRow, format_table, measure_speed, plot, quality, rows_to_json, size_on_disk

    if len(args.model) < 2:
        raise HardyError("give at least two --model (the first is the reference)")
    text = read_text(args.data)
    ctx = args.ctx or (512 if args.protocol == "llama.cpp" else 2048)
    set_threads(args.threads)
    sizes = [size_on_disk(m) for m in args.model]
    devices = [resolve_device(args.device, quantized=args.device == "auto" and is_quantized_source(m, args.gguf_weights))
               for m in args.model]
    loaded = [load_model(m, device=d, gguf=args.gguf_weights) for m, d in zip(args.model, devices)]
    tok = loaded[0].tokenizer
    if tok is None:
        raise HardyError(f"{args.model[0]}: the reference model has no tokenizer")
    vocab = loaded[0].config.vocab_size
    for spec, lm in zip(args.model[1:], loaded[1:]):
        if lm.config.vocab_size != vocab:
            raise HardyError(f"{spec}: vocabulary of {lm.config.vocab_size} differs from the reference's {vocab}")
        if ctx > lm.config.max_seq_len:
            raise HardyError(f"--ctx {ctx} exceeds {spec}'s context of {lm.config.max_seq_len}")
    tokens = tok.encode(text, special=False)
    if args.max_tokens:
        tokens = tokens[:args.max_tokens]
    results = quality([lm.model for lm in loaded], tokens, ctx, args.protocol, tok.bos_id, tok.add_bos,
                      batch_size=args.batch, progress=not args.no_progress)
    del loaded
    rows = []
    for spec, size, q, device in zip(args.model, sizes, results, devices):
        q.pop("chunk_nll")
        row = CompareRow(model=spec, size_bytes=size, **q)
        if not args.no_speed:
            s = measure_speed(spec, args.threads, args.prompt_tokens, args.new_tokens, device=str(device))
            row.prefill_tps, row.decode_tps, row.peak_rss_bytes = s["prefill_tps"], s["decode_tps"], s["peak_rss_bytes"]
        rows.append(row)
    print(format_table(rows))
    print(f"({args.protocol} protocol, ctx {ctx}, {len(tokens)} tokens of {args.data}; KL and top-1 against "
          f"{args.model[0]}; speed: batch 1, {args.prompt_tokens}-token prompt, {args.new_tokens} new tokens)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows_to_json(rows), indent=2))
    if args.plot:
        plot(rows, Path(args.plot), f"{args.data}, {args.protocol} protocol, ctx {ctx}")
        print(f"wrote {args.plot}")
    return 0
