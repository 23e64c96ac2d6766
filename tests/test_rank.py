"""Search ranking (issue 24): the WikiText-2 collection, BEIR/TREC reading, metrics against hand
computation, interpolation, the batched query-likelihood scorer against a plain forward, the CLI."""
from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import hardy_main, run_hardy

from hardy.data.ranking import (MAX_WORDS, build_wikitext_collection, bundled_collection, collection_files, detokenize,
                                read_collection, write_collection)
from hardy.errors import HardyError
from hardy.eval.rank import QueryRun, best_alpha, per_query_metrics, ranking, system_result

WIKI = """
 = Alpha River = 
 
 The Alpha River is a river in the north . It is 120 km long . 
 
 = = Course = = 
 
 The river rises in the hills and flows west to the sea . 
 
 = = = Lower course = = = 
 
 Near the coast the river widens into an estuary @-@ like bay . 
 
 = = <unk> = = 
 
 A section whose heading WikiText replaced with unk has text . 
 
 = = Wildlife = = 
 
 Otters and herons live along the banks of the river . 
 
 = Beta Castle = 
 
 Beta Castle is a ruined castle on a hill . 
 
 = = History = = 
 
 The castle was built in 1200 and abandoned in 1600 . 
"""


def test_collection_from_wikitext_structure():
    coll = build_wikitext_collection(WIKI, "toy")
    titles = {q.text for q in coll.queries}
    # level-2 headings with text become queries; "<unk>" headings do not; level 3 stays in its section
    assert titles == {"Alpha River — Course", "Alpha River — Wildlife", "Beta Castle — History"}
    by_text = {p.text: p for p in coll.passages}
    assert "Near the coast the river widens into an estuary-like bay." in by_text  # detokenized
    course = next(q for q in coll.queries if q.text.endswith("Course"))
    grades = coll.qrels[course.id]
    lower = by_text["Near the coast the river widens into an estuary-like bay."].id
    lead = by_text["The Alpha River is a river in the north. It is 120 km long."].id
    castle = by_text["Beta Castle is a ruined castle on a hill."].id
    assert grades[lower] == 2 and grades[by_text["The river rises in the hills and flows west to the sea."].id] == 2
    assert grades[lead] == 1 and castle not in grades  # same article: 1; another article: unjudged (0)
    assert all(p.title in ("Alpha River", "Beta Castle") for p in coll.passages)
    assert {q.split for q in coll.queries} <= {"dev", "test"}
    assert len({q.split for q in coll.queries if q.id.startswith("a000")}) == 1  # split by article


def test_long_paragraphs_are_cut_into_windows_at_sentence_ends():
    sentence = "word " * 29 + "end . "  # 30 words once "." joins "end"
    coll = build_wikitext_collection(f" = T = \n \n = = S = = \n \n {sentence * 7}\n", "toy")
    lengths = [len(p.text.split()) for p in coll.passages]
    assert sum(lengths) == 7 * 30 and all(n <= MAX_WORDS for n in lengths)
    assert lengths == [90, 90, 30]  # three sentences fit in 100 words, a fourth does not
    assert all(p.text.endswith("end.") for p in coll.passages)


def test_bundled_collection_is_deterministic_and_documented(tmp_path):
    a, b = bundled_collection(), bundled_collection()
    files_a, files_b = collection_files(a), collection_files(b)
    assert {k: hashlib.sha256(v).hexdigest() for k, v in files_a.items()} == \
           {k: hashlib.sha256(v).hexdigest() for k, v in files_b.items()}
    stats = a.stats()
    # The sizes BENCHMARKS.md and the docs quote for wikitext2-sections/1: a builder change must bump the version.
    assert (stats["passages"], stats["queries"], stats["queries_by_split"]) == (3204, 270, {"dev": 79, "test": 191})
    manifest = write_collection(a, tmp_path / "c")
    back = read_collection(str(tmp_path / "c"))
    assert back.passages == a.passages and back.qrels == a.qrels
    assert sorted(back.queries, key=lambda q: q.id) == sorted(a.queries, key=lambda q: q.id)
    assert back.meta["source_sha256"] == a.meta["source_sha256"] and manifest["judged_pairs"] == stats["judged_pairs"]
    for name, digest in manifest["sha256"].items():
        assert hashlib.sha256((tmp_path / "c" / name).read_bytes()).hexdigest() == digest
    # builds in other processes, with other string-hash seeds (set and dict orders that depend on them
    # would differ there, not within this process), give the same bytes
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        proc = subprocess.run([sys.executable, "-m", "hardy", "data", "rank-collection", "--out",
                               str(tmp_path / f"cli{seed}")], capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0 and "3204 passages, 270 queries" in proc.stdout, proc.stderr
        assert json.loads((tmp_path / f"cli{seed}" / "collection.json").read_text())["sha256"] == manifest["sha256"]
    again = hardy_main("data", "rank-collection", "--out", str(tmp_path / "cli1"))
    assert again.returncode == 2 and "already exists" in again.stderr


def test_queries_never_leak_into_training_or_calibration_corpora():
    from hardy.data.text import read_text

    coll = bundled_collection()
    for corpus in ("wikitext2-valid", "tinyshakespeare"):
        text = " ".join(detokenize(line) for line in read_text(corpus).split("\n"))
        leaked = [p.id for p in coll.passages if len(p.text.split()) >= 12 and p.text in text]
        assert not leaked, f"{corpus} contains collection passages: {leaked[:5]}"
    valid = build_wikitext_collection(read_text("wikitext2-valid"), "wikitext2-valid")
    named = {p.title for p in coll.passages if p.title.replace("<unk>", "").strip()}  # "<unk>" names nothing
    assert not named & {p.title for p in valid.passages}  # no shared article


def _beir(root, queries, corpus, qrels_by_split, trec=False):
    root.mkdir(parents=True)
    (root / "corpus.jsonl").write_text("".join(json.dumps({"_id": i, "title": "", "text": t}) + "\n"
                                               for i, t in corpus.items()))
    (root / "queries.jsonl").write_text("".join(json.dumps({"_id": i, "text": t}) + "\n" for i, t in queries.items()))
    (root / "qrels").mkdir()
    for split, rows in qrels_by_split.items():
        lines = [f"{q} 0 {d} {g}" for q, d, g in rows] if trec else \
            ["query-id\tcorpus-id\tscore"] + [f"{q}\t{d}\t{g}" for q, d, g in rows]
        (root / "qrels" / f"{split}.tsv").write_text("\n".join(lines) + "\n")
    return root


def test_reads_beir_and_trec_qrels_and_names_bad_input(tmp_path):
    corpus = {"d1": "red apples", "d2": "green pears", "d3": "blue sky"}
    coll = read_collection(str(_beir(tmp_path / "beir", {"q1": "apples", "q2": "sky"}, corpus,
                                     {"dev": [("q1", "d1", 1)], "test": [("q2", "d3", 2), ("q2", "d2", 0)]})))
    assert {q.id: q.split for q in coll.queries} == {"q1": "dev", "q2": "test"}
    assert coll.qrels == {"q1": {"d1": 1}, "q2": {"d3": 2}}  # grade 0 is the default, not stored
    trec = read_collection(str(_beir(tmp_path / "trec", {"q1": "apples"}, corpus, {"test": [("q1", "d2", 1)]}, True)))
    assert trec.qrels == {"q1": {"d2": 1}}
    bad = _beir(tmp_path / "bad", {"q1": "apples"}, corpus, {"test": [("q1", "d9", 1)]})
    with pytest.raises(HardyError, match="d9"):
        read_collection(str(bad))
    (bad / "corpus.jsonl").write_text('{"_id": "d1", "text": "ok"}\n{not json\n')
    with pytest.raises(HardyError, match=r"corpus.jsonl:2: not JSON"):
        read_collection(str(bad))
    with pytest.raises(HardyError, match="collection not found"):
        read_collection(str(tmp_path / "missing"))
    with pytest.raises(HardyError, match="no queries in split 'train'"):
        coll.split("train")


def test_metrics_match_hand_computation():
    qrels = {"q1": {"a": 2, "b": 1, "c": 2}, "q2": {"z": 2}}
    got = per_query_metrics(qrels, {"q1": ["b", "x", "a"], "q2": []}, grade=2)
    # nDCG@10, trec_eval's linear gains: DCG = 1/log2(2) + 0 + 2/log2(4); ideal = 2 + 2/log2(3) + 1/log2(4)
    dcg, ideal = 1 + 2 / 2, 2 + 2 / math.log2(3) + 1 / 2
    assert got["ndcg@10"]["q1"] == pytest.approx(dcg / ideal, abs=1e-9)
    assert got["mrr@10"]["q1"] == pytest.approx(1 / 3)  # the first grade-2 passage is third
    assert got["recall@100"]["q1"] == pytest.approx(1 / 2)  # a of {a, c}
    assert got["ndcg@10"]["q2"] == 0.0 and got["mrr@10"]["q2"] == 0.0  # nothing retrieved counts as 0


def test_interpolation_and_its_weight_chosen_on_dev():
    run = QueryRun(first=[("a", 9.0), ("b", 5.0), ("c", 4.0), ("d", 1.0)], first_s=0.0, lm=[-9.0, -1.0, -5.0])
    assert ranking(run, 3, 1.0) == ["a", "b", "c", "d"]  # BM25 alone
    assert ranking(run, 3, 0.0) == ["b", "c", "a", "d"]  # the LM's order of the top 3, then the rest
    assert ranking(run, 3, 0.5) == ["b", "a", "c", "d"]  # 0.5·(1, .2, 0) + 0.5·(0, 1, .5) = (.5, .6, .25)
    # relevant "b": every weight below 1 puts it first; the grid's smallest BM25 weight wins ties
    assert best_alpha({"q": {"b": 2}}, {"q": run}, 3, 2) == 0.0
    assert best_alpha({"q": {"a": 2}}, {"q": run}, 3, 2) == 0.6  # only a BM25 weight > 0.5 keeps "a" first


def test_paired_z_against_bm25():
    qrels = {f"q{i}": {"good": 2} for i in range(6)}
    runs = {q: QueryRun([("bad", 2.0), ("good", 1.0)], 0.001, [0.0, 1.0] if i < 4 else [1.0, 0.0], 0.002)
            for i, q in enumerate(qrels)}
    base = system_result("BM25", None, qrels, runs, 2, 1.0, 2, None, None)
    lm = system_result("m QLM", "m", qrels, runs, 2, 0.0, 2, 10, base.per_query_ndcg)
    gain = 1 - 1 / math.log2(3)  # nDCG 1 instead of 1/log2(3) on 4 of 6 queries
    assert lm.delta_ndcg_vs_bm25 == pytest.approx(4 / 6 * gain)
    d = torch.tensor([gain] * 4 + [0.0] * 2, dtype=torch.float64)
    assert lm.z_vs_bm25 == pytest.approx((d.mean() / (d.std() / math.sqrt(6))).item())
    assert lm.latency_median_ms == pytest.approx(3.0)


@pytest.fixture(scope="module")
def mini_lm(mini_run):
    from hardy.loading.load import load_model

    return load_model(str(mini_run / "run"))


def _reference_scores(model, rows, starts, query_ids):
    out = []
    with torch.inference_mode():
        for row, start in zip(rows, starts):
            logp = torch.log_softmax(model(torch.tensor([row])).float()[0], -1)
            out.append(sum(logp[start - 1 + j, t].item() for j, t in enumerate(query_ids)))
    return out


@pytest.mark.parametrize("kind", ["float", "int4"])
def test_batched_qlm_scores_equal_a_plain_forward(mini_lm, mini_compressed, kind):
    from hardy.infer.rerank import QLMConfig, QLMScorer
    from hardy.loading.load import load_model

    loaded = mini_lm if kind == "float" else load_model(str(mini_compressed("--bits", "4", "--group-size", "32")))
    passages = ["To be, or not to be, that is the question.", "My lord,", "Now is the winter of our discontent "
                "made glorious summer by this sun of York; and all the clouds that lour'd upon our house."]
    query = "the winter of discontent"
    for batch in (1, 2, 8):  # padding and batch composition must not move a score
        scorer = QLMScorer(loaded.model, loaded.tokenizer, QLMConfig(batch_size=batch))
        rows = scorer.score_rows(query, passages)
        reference = _reference_scores(loaded.model, [r.tokens for r in rows], [r.start for r in rows], rows[0].target)
        assert scorer.score(query, passages) == pytest.approx(reference,
                                                              rel=1e-3 if kind == "int4" else 1e-5)
    scores = scorer.score(query, passages)
    assert scores.index(max(scores)) == 2  # the passage that contains the query's words explains it best


def test_passes_minimize_padded_tokens():
    """plan_batches against every split of the sorted rows into consecutive passes (brute force)."""
    import itertools
    import random

    from hardy.infer.rerank import plan_batches

    def cost(lengths, passes, pass_cost):
        return sum(len(p) * max(lengths[i] for i in p) + pass_cost for p in passes)

    rng = random.Random(0)
    for trial in range(60):
        n, max_rows, pass_cost = rng.randint(1, 9), rng.randint(1, 5), rng.choice([0, 8, 32, 200])
        lengths = [rng.randint(5, 200) for _ in range(n)]
        passes = plan_batches(lengths, max_rows, pass_cost)
        assert sorted(i for p in passes for i in p) == list(range(n)) and all(len(p) <= max_rows for p in passes)
        order = sorted(range(n), key=lambda i: lengths[i])
        best = min(cost(lengths, [order[a:b] for a, b in zip((0, *cuts), (*cuts, n))], pass_cost)
                   for k in range(n) for cuts in itertools.combinations(range(1, n), k)
                   if all(b - a <= max_rows for a, b in zip((0, *cuts), (*cuts, n))))
        assert cost(lengths, passes, pass_cost) == best
    # BM25's top 20 of a test query: cutting by count computed 2,844 padded tokens for 1,507 real ones
    lengths = [39, 41, 43, 44, 45, 45, 45, 46, 46, 50, 52, 54, 55, 87, 91, 129, 133, 136, 159, 167]
    padded = sum(len(p) * max(lengths[i] for i in p) for p in plan_batches(lengths, 16, pass_cost=32))
    assert padded <= 1.05 * sum(lengths)


def _shakespeare_collection(root):
    corpus = {f"d{i}": t for i, t in enumerate([
        "Now is the winter of our discontent made glorious summer", "To be or not to be that is the question",
        "Friends, Romans, countrymen, lend me your ears", "A horse, a horse, my kingdom for a horse",
        "The winter wind blows cold upon the heath", "Is this a dagger which I see before me"])}
    queries = {"q1": "winter of discontent", "q2": "kingdom for a horse", "q3": "a dagger I see", "q4": "lend me ears"}
    qrels = {"dev": [("q1", "d0", 2), ("q1", "d4", 1), ("q2", "d3", 2)], "test": [("q3", "d5", 2), ("q4", "d2", 2)]}
    return _beir(root, queries, corpus, qrels)


def test_eval_rank_cli(tmp_path, mini_run):
    root = _shakespeare_collection(tmp_path / "c")
    out = tmp_path / "rank.json"
    proc = hardy_main("eval", "rank", "--collection", str(root), "--model", str(mini_run / "run"), "--k", "4",
                      "--depth", "6", "--json", str(out), "--plot", str(tmp_path / "rank.png"), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["system"].split(" ", 1)[-1] if r["model"] else r["system"] for r in rows][0] == "BM25"
    assert len(rows) == 3 and rows[2]["alpha"] in [i / 10 for i in range(11)]
    assert all(0 <= r["ndcg10"] <= 1 and r["queries_per_s"] > 0 for r in rows)
    assert all(sorted(r["per_query_ndcg"]) == sorted(r["per_query_ms"]) == ["q3", "q4"] for r in rows)  # test split only
    assert rows[1]["size_bytes"] > 0 and "nDCG@10" in proc.stdout and (tmp_path / "rank.png").stat().st_size > 0
    for bad, message in ((["--alpha", "2"], "--alpha must be in [0, 1]"), (["--k", "9", "--depth", "6"], "--k 9"),
                         (["--collection", str(tmp_path / "none")], "collection not found")):
        proc = hardy_main("eval", "rank", "--collection", str(root), *bad)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


def test_eval_rank_prefill_dtype_sets_the_quantized_layers_gemm_dtype(tmp_path, mini_compressed, monkeypatch):
    """--prefill-dtype: bf16 moves an int4 model's scores (its many-token products run in bf16) by no more
    than bf16 rounding; auto is bf16 exactly where the CPU has native bf16, fp32 elsewhere. --activations
    bf16 runs the whole pass in bf16 (test_kernels checks its dtypes): scores neither fp32's nor those of
    bf16 GEMMs alone, within bf16 rounding of fp32's."""
    import hardy.ops.matmul_probe as probe

    root = _shakespeare_collection(tmp_path / "c")
    model = str(mini_compressed("--bits", "4", "--group-size", "32"))
    scores = {}
    for dtype, fast in (("fp32", True), ("bf16", False), ("auto", True), ("auto", False), ("activations", True)):
        monkeypatch.setattr(probe, "has_fast_bf16", lambda device, fast=fast: fast)
        out = tmp_path / f"{dtype}-{fast}.json"
        flags = ("--activations", "bf16") if dtype == "activations" else ("--prefill-dtype", dtype)
        proc = hardy_main("eval", "rank", "--collection", str(root), "--model", model, "--k", "4", "--depth", "6",
                          "--alpha", "0.5", "--batch", "4", *flags, "--json", str(out), "--no-progress")
        assert proc.returncode == 0, proc.stderr
        by_query = json.loads(out.read_text())["rows"][1]["per_query_lm"]
        scores[dtype, fast] = [s for q in sorted(by_query) for s in by_query[q].values()]
    exact, bf16 = scores["fp32", True], scores["bf16", False]
    assert bf16 != exact and bf16 == pytest.approx(exact, rel=2e-2)
    assert scores["auto", True] == bf16 and scores["auto", False] == exact
    everywhere = scores["activations", True]
    assert everywhere not in (exact, bf16) and everywhere == pytest.approx(exact, rel=5e-2)
    for flag, value in (("--prefill-dtype", "int8"), ("--activations", "fp16")):
        proc = hardy_main("eval", "rank", "--collection", str(root), "--model", model, flag, value)
        assert proc.returncode == 2 and flag in proc.stderr


def test_eval_rank_tensor_parallel_scores_equal_one_process(tmp_path, mini_run):
    """`--tp 2`: two torchrun workers, each holding half of every sharded matrix, score the same
    candidates as one process does (to float tolerance), in the same order."""
    root = _shakespeare_collection(tmp_path / "c")
    scores = {}
    for tp in ("1", "2"):
        out = tmp_path / f"rank{tp}.json"
        proc = run_hardy("eval", "rank", "--collection", str(root), "--model", str(mini_run / "run"), "--k", "4",
                         "--depth", "6", "--alpha", "0.5", "--tp", tp, "--threads", "2", "--json", str(out),
                         "--no-progress", timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert "nDCG@10" in proc.stdout and proc.stdout.count("BM25+QLM") == 1  # one table: rank 0's
        scores[tp] = json.loads(out.read_text())["rows"][1]["per_query_lm"]
    assert sorted(scores["1"]) == ["q3", "q4"] and all(len(v) == 4 for v in scores["1"].values())
    for qid, by_passage in scores["1"].items():
        assert scores["2"][qid] == pytest.approx(by_passage, rel=1e-4, abs=1e-4)
        assert len(set(by_passage.values())) == 4  # distinct scores: the comparison tests the model, not ties
    bad = run_hardy("eval", "rank", "--collection", str(root), "--model", str(mini_run / "run"), "--tp", "3")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_refuses_a_model_calibrated_on_the_collections_source(tmp_path):
    from hardy.cli.eval_rank import check_no_leak
    from hardy.data.text import resolve_text_path

    model = tmp_path / "m"
    model.mkdir()
    (model / "quantization.json").write_text(json.dumps({"calibration": {"data": "wikitext2-test"}}))
    source = hashlib.sha256(resolve_text_path("wikitext2-test").read_text().encode()).hexdigest()
    with pytest.raises(HardyError, match="calibrated on wikitext2-test"):
        check_no_leak(str(model), source)
    (model / "quantization.json").write_text(json.dumps({"calibration": {"data": "wikitext2-valid"}}))
    check_no_leak(str(model), source)  # calibrated elsewhere: fine
    # a trained run: the inputs its dataset was prepared from (the data index) or named in its config
    run, data = tmp_path / "run", tmp_path / "data"
    (run / "checkpoints").mkdir(parents=True)
    data.mkdir()
    (data / "index.json").write_text(json.dumps({"report": {"inputs": ["tinyshakespeare", "wikitext2-test"]}}))
    (run / "config.json").write_text(json.dumps({"data": {"path": str(data), "inputs": []}}))
    with pytest.raises(HardyError, match="trained on wikitext2-test"):
        check_no_leak(str(run), source)
    (data / "index.json").write_text(json.dumps({"report": {"inputs": ["tinyshakespeare"]}}))
    check_no_leak(str(run), source)
    (run / "config.json").write_text(json.dumps({"data": {"path": str(data), "inputs": ["wikitext2-test"]}}))
    with pytest.raises(HardyError, match="trained on wikitext2-test"):
        check_no_leak(str(run), source)
