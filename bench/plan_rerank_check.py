"""Planner check for re-ranking: `plan_rerank` on this machine's probe profile against the latency per
query that `hardy eval rank` measured, for the request shape that run really had (the mean passage,
template and query tokens of its rows: BM25's top k of every test query, tokenized as the scorer
does), and the same shape priced on catalogue hardware (CPU sockets and GPUs: $ per million queries, latency).

    .venv/bin/python -m hardy probe --quick --out /tmp/rank/probe.json
    .venv/bin/python bench/plan_rerank_check.py --profile /tmp/rank/probe.json --rank-json /tmp/rank/rankA.json
"""
from __future__ import annotations

import argparse
import json
import statistics

from hardy.data.ranking import read_collection
from hardy.eval.rank import BM25
from hardy.infer.rerank import QLMConfig, QLMScorer
from hardy.loading.load import config_for, load_model
from hardy.plan.hardware import get_hardware
from hardy.plan.rerank import plan_rerank

CATALOGUE = ("xeon-spr", "epyc-genoa", "l40s", "h100-sxm")


def run_shape(model_spec: str, collection: str, split: str, k: int, depth: int) -> tuple[float, int, float]:
    """(mean passage tokens, template tokens, mean query tokens) of the rows the scorer built."""
    coll = read_collection(collection)
    test = coll.split(split)
    bm25 = BM25(coll)
    texts = {p.id: p.content() for p in coll.passages}
    loaded = load_model(model_spec)
    scorer = QLMScorer(loaded.model, loaded.tokenizer, QLMConfig())
    template = len(scorer.before) + len(scorer.after)
    passages, queries = [], []
    for q in test.queries:
        rows, starts, qids = scorer.rows(q.text, [texts[pid] for pid, _ in bm25.search(q.text, depth)[:k]])
        passages += [s - template for s in starts]
        queries.append(len(qids))
    return statistics.fmean(passages), template, statistics.fmean(queries)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True, help="a `hardy probe` profile of this machine")
    ap.add_argument("--rank-json", required=True, help="`hardy eval rank --json` output")
    ap.add_argument("--collection", default="wikitext2")
    args = ap.parse_args()
    measured = json.loads(open(args.rank_json).read())
    k, depth, split = measured["k"], measured["depth"], measured["split"]
    here = get_hardware("probe:" + args.profile)
    print(f"{'model':<32} {'row tokens':>26} {'measured p50':>12} {'mean':>8} {'predicted':>10} {'pred/mean':>9}  "
          + "  ".join(f"{name + ' $/1M':>16}" for name in CATALOGUE))
    shapes = {}
    for row in measured["rows"]:
        if row["model"] is None or not row["system"].endswith("QLM"):
            continue
        spec = row["model"]
        cfg = config_for(spec)
        key = (cfg.vocab_size, cfg.max_seq_len)  # the rows depend on the tokenizer and the context only
        if key not in shapes:
            shapes[key] = run_shape(spec, args.collection, split, k, depth)
        passage, template, query = shapes[key]
        shape = dict(candidates=k, passage_tokens=round(passage), template_tokens=template, query_tokens=round(query),
                     rerank_batch=k)
        quant = "fp32"  # hardy's prefill multiplies in fp32 on a CPU without fast bf16, whatever the storage
        plan = plan_rerank(cfg, here, quant=quant, **shape)
        mean_ms = 1e3 / row["queries_per_s"]
        # the catalogue: bf16 weights and compute on one device
        prices = [plan_rerank(cfg, get_hardware(name), quant="bf16", **shape) for name in CATALOGUE]
        print(f"{spec:<32} {f'{passage:.0f} + {template} + {query:.1f}':>26} {row['latency_median_ms']:10.0f} ms "
              f"{mean_ms:6.0f} ms {plan.latency_s * 1e3:8.0f} ms {plan.latency_s * 1e3 / mean_ms:8.2f}x  "
              + "  ".join(f"{p.cost_per_million_queries:9.2f} ({p.latency_s * 1e3:.1f} ms)" for p in prices))
    if not shapes:
        raise SystemExit("no re-ranking rows in " + args.rank_json)


if __name__ == "__main__":
    main()
