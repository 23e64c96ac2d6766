"""hardy data prepare: clean, de-duplicate, tokenize and shard a corpus; hardy data rank-collection: the
search-ranking collection of hardy eval rank, written in the BEIR layout."""
from __future__ import annotations

from hardy.cli.common import Parser


def register(sub) -> None:
    p = sub.add_parser("data", help="data preparation")
    tasks = p.add_subparsers(dest="task", required=True, parser_class=Parser)
    pp = tasks.add_parser("prepare", help="clean, de-duplicate, split, tokenize and write token shards")
    pp.add_argument("--input", nargs="+", required=True, help="text files or bundled corpora (tinyshakespeare, ...)")
    pp.add_argument("--tokenizer", required=True, help="smollm2, bpe:VOCAB (train a byte-level BPE) or a directory")
    pp.add_argument("--out", required=True)
    pp.add_argument("--val-fraction", type=float, default=0.05)
    pp.add_argument("--near-dup-threshold", type=float, default=0.8, help="Jaccard over word 5-gram shingles")
    pp.add_argument("--min-words", type=int, default=3)
    pp.add_argument("--max-chars", type=int, default=100_000)
    pp.add_argument("--max-symbol-ratio", type=float, default=0.25)
    pp.add_argument("--seed", type=int, default=0)
    pp.set_defaults(func=run_prepare)
    pr = tasks.add_parser("rank-collection", help="write a search-ranking collection (BEIR layout) built from a "
                                                   "WikiText file's articles and section headings")
    pr.add_argument("--out", required=True, help="a new directory")
    pr.add_argument("--source", default="wikitext2-test",
                    help="a WikiText-format text file or bundled corpus (default wikitext2-test: evaluation only)")
    pr.set_defaults(func=run_rank_collection)


def run_prepare(args) -> int:
    from hardy.data.clean import CleanConfig
    from hardy.data.prepare import prepare

    clean = CleanConfig(min_words=args.min_words, max_chars=args.max_chars, max_symbol_ratio=args.max_symbol_ratio)
    report = prepare(args.input, args.tokenizer, args.out, clean=clean, near_threshold=args.near_dup_threshold,
                     val_fraction=args.val_fraction, seed=args.seed, progress=True)
    for line in report.lines():
        print(line)
    print(f"wrote {args.out}")
    return 0


def run_rank_collection(args) -> int:
    from hardy.data.ranking import build_wikitext_collection, write_collection
    from hardy.data.text import read_text
    from hardy.fsio import check_new_output

    check_new_output(args.out)  # before the work
    manifest = write_collection(build_wikitext_collection(read_text(args.source), args.source), args.out)
    print(f"wrote {args.out}: {manifest['passages']} passages, {manifest['queries']} queries "
          f"({', '.join(f'{n} {s}' for s, n in manifest['queries_by_split'].items())}), {manifest['judged_pairs']} "
          f"judged pairs ({manifest['version']}, source sha256 {manifest['source_sha256'][:12]})")
    return 0
