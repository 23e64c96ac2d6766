"""`hardy eval rank`: BM25 alone, then each model's query-likelihood re-ranking of BM25's top k and
the interpolation of the two (its weight chosen on the dev split), with quality, latency and size."""
from __future__ import annotations

import gc
import hashlib
import json
import os
import sys
from pathlib import Path

import torch

from hardy.cli.common import add_device_arg, add_gguf_arg, add_prefill_dtype_arg, apply_prefill_dtype
from hardy.compress.qlinear import set_activation_dtype
from hardy.devices import resolve_device
from hardy.errors import HardyError
from hardy.extras import require as require_extra
from hardy.loading.load import config_for, is_quantized_source, load_model, resolve_source, set_threads


def register_rank(tasks) -> None:
    pr = tasks.add_parser("rank", help="search ranking: BM25, LM re-ranking (query likelihood) and both interpolated")
    pr.add_argument("--model", action="append", default=[], help="a re-ranking model (repeat; none: BM25 only)")
    pr.add_argument("--collection", default="wikitext2",
                    help="wikitext2 (bundled, built from WikiText-2 test) or a directory in the BEIR layout: "
                         "corpus.jsonl, queries.jsonl, qrels/<split>.tsv")
    pr.add_argument("--split", default="test", help="queries evaluated (default test, the held-out split)")
    pr.add_argument("--dev-split", default="dev", help="queries the interpolation weight is chosen on")
    pr.add_argument("--first-stage", default="bm25", choices=["bm25"])
    pr.add_argument("--k", type=int, default=20, help="first-stage candidates re-ranked per query")
    pr.add_argument("--depth", type=int, default=100, help="first-stage list length (Recall@100 reads it)")
    pr.add_argument("--alpha", default="auto",
                    help="BM25 weight of the interpolation in [0, 1], or auto (best nDCG@10 on --dev-split)")
    pr.add_argument("--max-queries", type=int, default=None, help="only the first N queries of each split")
    pr.add_argument("--batch", type=int, default=20, help="candidates per prefill")
    pr.add_argument("--max-passage-tokens", type=int, default=192)
    pr.add_argument("--template", default=None, help="prompt with {passage}; the query follows its end")
    add_prefill_dtype_arg(pr)
    pr.add_argument("--activations", default="fp32", choices=("fp32", "bf16"),
                    help="dtype of the scoring passes' activations: fp32, or bf16 (norm weights, float embeddings "
                         "and heads cast too, quantized layers' GEMMs in bf16: for CPUs with native bf16 dot "
                         "products, where it is the faster)")
    pr.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores; shared by --tp's processes)")
    pr.add_argument("--tp", type=int, default=1,
                    help="re-rank with each model sharded over N tensor-parallel CPU processes (gloo; started here)")
    add_device_arg(pr)
    add_gguf_arg(pr)
    pr.add_argument("--json", default=None, help="also write the rows as JSON to this file")
    pr.add_argument("--plot", default=None, help="write nDCG@10 against latency per query to this PNG")
    pr.add_argument("--no-progress", action="store_true")
    pr.set_defaults(func=run_rank)


def _alpha(spec: str) -> float | None:
    if spec == "auto":
        return None
    try:
        value = float(spec)
    except ValueError:
        raise HardyError(f"--alpha must be a number in [0, 1] or auto (got {spec!r})") from None
    if not 0 <= value <= 1:
        raise HardyError(f"--alpha must be in [0, 1] (got {value})")
    return value


def _texts_behind(spec: str) -> list[tuple[str, str]]:
    """(how it was used, text spec) for the texts that shaped a model's weights, where hardy recorded
    them: a compressed model's calibration data, a trained run's dataset inputs."""
    kind, path = resolve_source(spec)
    if not path.is_dir():
        return []
    texts = []
    manifest = path / "quantization.json"
    if manifest.is_file():
        data = (json.loads(manifest.read_text()).get("calibration") or {}).get("data")
        texts += [("calibrated", data)] if data else []
    config = path / "config.json"
    if kind == "run" and config.is_file():
        data_cfg = json.loads(config.read_text()).get("data") or {}
        inputs = list(data_cfg.get("inputs") or [])
        index = Path(data_cfg.get("path") or "") / "index.json"
        if data_cfg.get("path") and index.is_file():
            inputs += (json.loads(index.read_text()).get("report") or {}).get("inputs") or []
        texts += [("trained", name) for name in dict.fromkeys(inputs)]
    return texts


def check_no_leak(spec: str, source_sha256: str | None) -> None:
    """Refuse a model calibrated or trained on the collection's source text: its queries' passages
    would have shaped the weights being evaluated."""
    if not source_sha256:
        return
    from hardy.data.text import resolve_text_path

    for use, data in _texts_behind(spec):
        try:
            text = resolve_text_path(data)
        except HardyError:
            continue  # the file is gone: nothing to compare
        # the collection hashes the text as read (universal newlines), so the same here
        if text.is_file() and hashlib.sha256(text.read_text(errors="replace").encode()).hexdigest() == source_sha256:
            raise HardyError(f"{spec} was {use} on {data}, the text this collection's queries come from: "
                             "its ranking quality would not be a held-out measurement")


def model_bytes(model) -> int:
    """Bytes of the weights as held in memory (packed codes and scales for quantized layers)."""
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def apply_dtypes(loaded, args) -> None:
    """--prefill-dtype, then --activations (bf16 overrides the quantized layers' GEMM dtype too)."""
    apply_prefill_dtype(loaded, args.prefill_dtype)
    if args.activations == "bf16":
        set_activation_dtype(loaded.model, torch.bfloat16)


def load_sharded(spec: str, device, args):
    """(loaded model, None) in one process; under --tp, this rank's shard and, on rank 0, the runner
    that announces each scoring pass to the other ranks."""
    if args.tp == 1:
        loaded = load_model(spec, device=device, gguf=args.gguf_weights)
        apply_dtypes(loaded, args)
        return loaded, None
    # start-up time: torch.distributed only for --tp
    from hardy.compress.tensor_parallel import rank_slices
    from hardy.infer.tensor_parallel import shard_model
    from hardy.serve.tensor_parallel import LeaderRunner

    rank = int(os.environ["RANK"])
    loaded = load_model(spec, device=device, gguf=args.gguf_weights, tp_slices=rank_slices(rank, args.tp))
    shard_model(loaded.model, args.tp)
    apply_dtypes(loaded, args)
    return loaded, (LeaderRunner(loaded.model, 1, 2) if rank == 0 else None)


def follow_models(args) -> int:
    """Ranks 1..N-1 of --tp: each model's shard, running rank 0's scoring passes until it moves on."""
    from hardy.parallel.distributed import leave_together
    from hardy.serve.tensor_parallel import follow

    sys.stdout = open(os.devnull, "w")
    for spec in args.model:
        loaded, _ = load_sharded(spec, "cpu", args)
        if not follow(loaded.model, 1, 2):
            print("hardy: rank 0 stopped in the middle of a scoring pass; this worker stops too",
                  file=sys.stderr, flush=True)
            os._exit(1)  # the process group is broken: tearing it down could only hang
        del loaded
        gc.collect()
    leave_together()
    return 0


def run_rank(args) -> int:
    require_extra("rank", "hardy eval rank")
    if args.plot:
        require_extra("plots", "--plot")
    from hardy.data.ranking import read_collection
    from hardy.eval.rank import (BM25, best_alpha, check_sizes, format_table, plot, run_queries, system_result,
                                 top_grade)
    from hardy.infer.rerank import QLMConfig, QLMScorer

    check_sizes(args.depth, args.k)
    if args.tp < 1:
        raise HardyError(f"--tp must be >= 1 (got {args.tp})")
    alpha = _alpha(args.alpha)
    qcfg = QLMConfig(max_passage_tokens=args.max_passage_tokens, batch_size=args.batch,
                     **({"template": args.template} if args.template else {}))
    if args.max_queries is not None and args.max_queries < 1:
        raise HardyError(f"--max-queries must be >= 1 (got {args.max_queries})")
    coll = read_collection(args.collection)
    test = coll.split(args.split)
    dev = None
    if args.model and alpha is None:
        if args.dev_split not in {q.split for q in coll.queries}:
            raise HardyError(f"collection {coll.name} has no {args.dev_split!r} split to choose --alpha on: "
                             "give --alpha or --dev-split")
        dev = coll.split(args.dev_split)
    for spec in args.model:
        check_no_leak(spec, coll.meta.get("source_sha256"))
    if args.tp > 1:
        from hardy.infer.tensor_parallel import check_tp, cpu_only, relaunch_under_torchrun

        cpu_only(args)
        if not args.model:
            raise HardyError("--tp shards the re-ranking models: give --model")
        if "WORLD_SIZE" not in os.environ:  # the launcher: bad input was refused above, before any process starts
            for spec in args.model:
                check_tp(spec, config_for(spec), args.tp, args.gguf_weights)
            return relaunch_under_torchrun(args.tp, sys.argv[1:], args.threads)
        if int(os.environ["RANK"]) != 0:
            return follow_models(args)
    if args.max_queries:
        test.queries = test.queries[:args.max_queries]
        if dev is not None:
            dev.queries = dev.queries[:args.max_queries]
    set_threads(args.threads)
    grade = top_grade(coll)
    bm25 = BM25(coll)
    passages = {p.id: p.content() for p in coll.passages}
    progress = not args.no_progress
    base_runs = run_queries(bm25, test.queries, passages, args.depth, args.k, None, progress, "BM25")
    qrels = {q.id: test.qrels[q.id] for q in test.queries}
    rows = [system_result("BM25", None, qrels, base_runs, args.k, 1.0, grade, None, None)]
    baseline = rows[0].per_query_ndcg
    for spec in args.model:
        device = resolve_device(args.device, quantized=args.device == "auto"
                                and is_quantized_source(spec, args.gguf_weights))
        loaded, runner = load_sharded(spec, device, args)
        scorer = QLMScorer(loaded.model, loaded.tokenizer, qcfg, run=runner and runner.score_batch)
        size = model_bytes(loaded.model)
        chosen = alpha
        if dev is not None:
            dev_runs = run_queries(bm25, dev.queries, passages, args.depth, args.k, scorer.score, progress,
                                   f"{spec} dev")
            chosen = best_alpha({q.id: dev.qrels[q.id] for q in dev.queries}, dev_runs, args.k, grade)
        runs = run_queries(bm25, test.queries, passages, args.depth, args.k, scorer.score, progress, spec)
        rows.append(system_result(f"{spec} QLM", spec, qrels, runs, args.k, 0.0, grade, size, baseline))
        rows.append(system_result(f"{spec} BM25+QLM (a={chosen:.1f})", spec, qrels, runs, args.k, chosen, grade,
                                  size, baseline))
        rows[-1].alpha = chosen
        if runner is not None:
            runner.finish()  # the other ranks go on to the next model
        del loaded, scorer, runner
        gc.collect()
    if args.tp > 1:
        from hardy.parallel.distributed import leave_together

        leave_together()
    print(format_table(rows))
    print(f"({coll.name}, split {args.split}: {len(test.queries)} queries, {len(coll.passages)} passages; "
          f"{args.first_stage} top {args.depth}, re-ranking its top {args.k}; nDCG@10 graded, MRR@10 and R@100 "
          f"count grade {grade}; Δ and z: per-query nDCG@10 against BM25; latency: first stage + re-ranking)")
    if args.json:
        Path(args.json).write_text(json.dumps({"collection": coll.name, "split": args.split,
                                               "queries": len(test.queries), "k": args.k, "depth": args.depth,
                                               "rows": [r.to_dict() for r in rows]}, indent=2))
    if args.plot:
        plot(rows, Path(args.plot), f"{coll.name} ({args.split}, {len(test.queries)} queries), BM25 top {args.k} re-ranked")
        print(f"wrote {args.plot}")
    return 0
