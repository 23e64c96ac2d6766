"""hardy eval: model quality measurements."""
from __future__ import annotations

import json

from hardy.cli.common import Parser, add_model_args, load_from_args


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


def run_perplexity(args) -> int:
    from hardy.data.text import read_text
    from hardy.errors import HardyError
    from hardy.eval.perplexity import perplexity

    text = read_text(args.data)  # read before loading the model: bad input fails fast
    if args.batch < 1:
        raise HardyError(f"--batch must be >= 1 (got {args.batch})")
    ctx = args.ctx or (512 if args.protocol == "llama.cpp" else 2048)
    loaded = load_from_args(args)
    if ctx > loaded.config.max_seq_len:
        raise HardyError(f"--ctx {ctx} exceeds the model's context of {loaded.config.max_seq_len}")
    tok = loaded.tokenizer
    tokens = tok.encode(text)  # llama-perplexity tokenizes with the vocab's own BOS policy
    if args.max_tokens:
        tokens = tokens[:args.max_tokens]
    result = perplexity(loaded.model, tokens, ctx=ctx, protocol=args.protocol, bos_id=tok.bos_id,
                        add_bos=tok.add_bos, batch_size=args.batch, progress=not args.no_progress)
    print(json.dumps(result.to_dict()) if args.json else result.line())
    return 0
