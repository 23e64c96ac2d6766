"""Ranking quality and cost: BM25 (bm25s) first stage, LM query-likelihood re-ranking
(hardy.infer.rerank), their interpolation, and the metrics of ir-measures (trec_eval's definitions).

Metrics per query: nDCG@10 on the graded judgements (trec_eval's linear gains), RR@10 and R@100
counting only the highest grade as relevant (in the bundled collection every passage of the query's
article is graded 1, so "any relevant" would be found by the title alone) — reported as MRR@10 and
Recall@100, means over queries. Systems are compared per query with a paired z (mean difference
over its standard error), as `hardy eval compare` compares perplexities over chunks.
"""
from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

import bm25s
import ir_measures
import Stemmer
from ir_measures import RR, R, nDCG
from tqdm import tqdm

from hardy.data.ranking import Collection, Query
from hardy.errors import HardyError
from hardy.eval.perplexity import paired_difference

ALPHAS = tuple(i / 10 for i in range(11))  # BM25 weight grid searched on the dev split


def measures(top_grade: int):
    return {"ndcg@10": nDCG @ 10, "mrr@10": RR(rel=top_grade) @ 10, "recall@100": R(rel=top_grade) @ 100}


def top_grade(coll: Collection) -> int:
    return max((g for judged in coll.qrels.values() for g in judged.values()), default=1)


def per_query_metrics(qrels: dict[str, dict[str, int]], rankings: dict[str, list[str]],
                      grade: int) -> dict[str, dict[str, float]]:
    """metric name -> query id -> value, for ranked passage-id lists (first = best). A query with
    no ranking scores 0 on every metric (trec_eval would leave it out of the mean)."""
    named = measures(grade)
    by_measure = {m: name for name, m in named.items()}
    # Strictly decreasing scores in rank order: trec_eval sorts by score and breaks ties by id.
    run = {qid: {pid: float(len(ranked) - i) for i, pid in enumerate(ranked)} for qid, ranked in rankings.items()
           if ranked}
    out = {name: {qid: 0.0 for qid in qrels} for name in named}
    for metric in ir_measures.iter_calc(list(named.values()), qrels, run):
        out[by_measure[metric.measure]][metric.query_id] = float(metric.value)
    return out


class BM25:
    """bm25s over the passages' title + text, English stop words and Snowball stemming."""

    def __init__(self, coll: Collection):
        self._stemmer = Stemmer.Stemmer("english")
        self.ids = [p.id for p in coll.passages]
        self.index = bm25s.BM25()
        logging.getLogger("bm25s").setLevel(logging.WARNING)  # its per-call INFO lines are not events
        self.index.index(self._tokens([p.content() for p in coll.passages]), show_progress=False)

    def _tokens(self, texts: list[str]):
        return bm25s.tokenize(texts, stopwords="en", stemmer=self._stemmer, show_progress=False)

    def search(self, text: str, depth: int) -> list[tuple[str, float]]:
        depth = min(depth, len(self.ids))
        docs, scores = self.index.retrieve(self._tokens([text]), k=depth, show_progress=False, n_threads=1)
        return [(self.ids[int(d)], float(s)) for d, s in zip(docs[0], scores[0])]


@dataclass
class QueryRun:
    """One query's first-stage list and, where re-ranked, the LM's scores of its top k."""
    first: list[tuple[str, float]]
    first_s: float
    lm: list[float] | None = None
    lm_s: float = 0.0


def _minmax(xs: list[float]) -> list[float]:
    lo, hi = min(xs), max(xs)
    return [(x - lo) / (hi - lo) if hi > lo else 0.0 for x in xs]


def ranking(run: QueryRun, k: int, alpha: float) -> list[str]:
    """The final list: the top k ordered by alpha · BM25 + (1 − alpha) · LM (each min-max normalized
    over the k candidates; alpha = 1 keeps BM25's order), then the rest of the first stage."""
    head = run.first[:k]
    if run.lm is None or alpha >= 1.0:
        return [pid for pid, _ in run.first]
    mixed = [alpha * b + (1 - alpha) * q for b, q in zip(_minmax([s for _, s in head]), _minmax(run.lm))]
    order = sorted(range(len(head)), key=lambda i: -mixed[i])
    return [head[i][0] for i in order] + [pid for pid, _ in run.first[k:]]


def run_queries(bm25: BM25, queries: list[Query], passages: dict[str, str], depth: int, k: int,
                score: Callable[[str, list[str]], list[float]] | None, progress: bool = True,
                desc: str = "rerank") -> dict[str, QueryRun]:
    """First stage for every query; with `score` (query, passage texts -> scores) the top k re-scored.
    Times are wall-clock per query (the scorer's device is synchronized by its final .tolist())."""
    runs = {}
    for q in tqdm(queries, desc=desc, unit="q", disable=not progress, leave=False):
        t0 = time.perf_counter()
        first = bm25.search(q.text, depth)
        runs[q.id] = QueryRun(first, time.perf_counter() - t0)
        if score is not None:
            t0 = time.perf_counter()
            runs[q.id].lm = score(q.text, [passages[pid] for pid, _ in first[:k]])
            runs[q.id].lm_s = time.perf_counter() - t0
    return runs


def best_alpha(qrels: dict[str, dict[str, int]], runs: dict[str, QueryRun], k: int, grade: int) -> float:
    """The BM25 weight with the best mean nDCG@10 on these (dev) queries; ties go to less BM25."""
    best, best_ndcg = 0.0, -1.0
    for alpha in ALPHAS:
        values = per_query_metrics(qrels, {qid: ranking(r, k, alpha) for qid, r in runs.items()}, grade)["ndcg@10"]
        mean = statistics.fmean(values.values())
        if mean > best_ndcg + 1e-12:
            best, best_ndcg = alpha, mean
    return best


@dataclass
class SystemResult:
    system: str  # "BM25", "MODEL QLM" or "MODEL BM25+QLM"
    model: str | None
    ndcg10: float
    mrr10: float
    recall100: float
    latency_median_ms: float
    latency_p95_ms: float
    queries_per_s: float
    size_bytes: int | None = None
    alpha: float | None = None  # BM25 weight of an interpolated system
    delta_ndcg_vs_bm25: float = 0.0
    z_vs_bm25: float = 0.0
    per_query_ndcg: dict[str, float] = field(default_factory=dict, repr=False)  # query id -> nDCG@10
    per_query_ms: dict[str, float] = field(default_factory=dict, repr=False)  # query id -> latency
    # query id -> {candidate id: the LM's log-likelihood of the query}: the re-ranked top k's scores
    per_query_lm: dict[str, dict[str, float]] = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict:
        """Everything, the per-query nDCG@10, latency and LM scores included (paired comparisons across runs)."""
        return asdict(self)


class Latency(NamedTuple):
    median_ms: float
    p95_ms: float
    queries_per_s: float  # one query at a time


def _latency_stats(seconds: list[float]) -> Latency:
    ordered = sorted(seconds)
    p95 = ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]
    mean = statistics.fmean(ordered)
    return Latency(statistics.median(ordered) * 1e3, p95 * 1e3, 1 / mean if mean > 0 else math.inf)


def system_result(name: str, model: str | None, qrels, runs: dict[str, QueryRun], k: int, alpha: float,
                  grade: int, size: int | None, baseline: dict[str, float] | None) -> SystemResult:
    values = per_query_metrics(qrels, {qid: ranking(r, k, alpha) for qid, r in runs.items()}, grade)
    seconds = {qid: r.first_s + r.lm_s for qid, r in runs.items()}
    lat = _latency_stats(list(seconds.values()))
    ndcg = values["ndcg@10"]
    res = SystemResult(name, model, statistics.fmean(ndcg.values()), statistics.fmean(values["mrr@10"].values()),
                       statistics.fmean(values["recall@100"].values()), latency_median_ms=lat.median_ms,
                       latency_p95_ms=lat.p95_ms, queries_per_s=lat.queries_per_s, size_bytes=size, per_query_ndcg=ndcg,
                       per_query_ms={qid: 1e3 * s for qid, s in seconds.items()},
                       per_query_lm={qid: {pid: v for (pid, _), v in zip(r.first[:k], r.lm)}
                                     for qid, r in runs.items() if r.lm is not None})
    if baseline is not None:
        qids = sorted(ndcg)
        diff = paired_difference([baseline[q] for q in qids], [ndcg[q] for q in qids])
        res.delta_ndcg_vs_bm25, res.z_vs_bm25 = diff.delta, diff.z
    return res


def format_table(rows: list[SystemResult]) -> str:
    head = (f"{'system':<40} {'nDCG@10':>8} {'MRR@10':>7} {'R@100':>6} {'ΔnDCG':>7} {'z':>6} "
            f"{'p50 ms':>8} {'p95 ms':>8} {'q/s':>7} {'size MB':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        size = f"{r.size_bytes / 1e6:8.1f}" if r.size_bytes else f"{'-':>8}"
        delta = f"{100 * r.delta_ndcg_vs_bm25:+7.2f} {r.z_vs_bm25:6.2f}" if r.model else f"{'':>7} {'':>6}"
        lines.append(f"{r.system:<40} {100 * r.ndcg10:8.2f} {100 * r.mrr10:7.2f} {100 * r.recall100:6.1f} {delta} "
                     f"{r.latency_median_ms:8.1f} {r.latency_p95_ms:8.1f} {r.queries_per_s:7.2f} {size}")
    return "\n".join(lines)


def plot(rows: list[SystemResult], path: Path, title: str) -> None:
    import matplotlib  # start-up time: matplotlib only when a plot is asked for

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # order: after use("Agg")

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for r in rows:
        marker = "s" if r.model is None else ("o" if "BM25+" not in r.system else "^")
        ax.scatter(r.latency_median_ms, 100 * r.ndcg10, marker=marker, s=50)
        ax.annotate(r.system, (r.latency_median_ms, 100 * r.ndcg10), textcoords="offset points", xytext=(5, 4),
                    fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("median latency per query (ms, log scale)")
    ax.set_ylabel("nDCG@10 (%)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def check_sizes(depth: int, k: int) -> None:
    if k < 1 or depth < 1:
        raise HardyError(f"--k and --depth must be >= 1 (got {k}, {depth})")
    if k > depth:
        raise HardyError(f"--k {k} re-ranks more candidates than the first stage returns (--depth {depth})")
