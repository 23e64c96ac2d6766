"""hardy eval compare: KL / top-1 against the reference on the same positions, sizes, speed, the plot."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import hardy_main, run_hardy
from hardy.eval.compare import CompareRow, pareto, quality
from hardy.eval.perplexity import paired_difference, perplexity
from hardy.loading.load import load_model


def test_quality_matches_perplexity_and_kl_definitions(mini_run):
    ref = load_model(str(mini_run / "run"))
    other = load_model(str(mini_run / "run"))
    with torch.no_grad():
        for p in other.model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    tokens = ref.tokenizer.encode((mini_run / "heldout.txt").read_text())[:2048]
    rows = quality([ref.model, ref.model, other.model], tokens, 128, "llama.cpp", None, False, batch_size=4)
    alone = [perplexity(m.model, tokens, ctx=128) for m in (ref, other)]
    assert rows[0]["ppl"] == pytest.approx(alone[0].ppl, rel=1e-9)
    assert rows[2]["ppl"] == pytest.approx(alone[1].ppl, rel=1e-9)
    # the paired z: over the same chunks as two separate evaluations; the reference against itself is 0
    assert rows[2]["ppl_z"] == pytest.approx(paired_difference(alone[0].chunk_nll, alone[1].chunk_nll).z, rel=1e-6)
    assert rows[2]["ppl_z"] != 0 and rows[1]["ppl_z"] == 0 and rows[0]["ppl_z"] == 0
    assert rows[2]["chunk_nll"] == pytest.approx(alone[1].chunk_nll, rel=1e-9)  # for pairing any two models
    assert rows[1]["kl"] == pytest.approx(0.0, abs=1e-9) and rows[1]["top1"] == 1.0  # itself
    assert rows[2]["kl"] > 0 and rows[2]["top1"] < 1.0
    # KL(ref || other) by hand, averaged over every chunk's scored positions (64..126 of each 128)
    batch = torch.tensor(tokens).view(-1, 128)
    with torch.no_grad():
        p = torch.log_softmax(ref.model(batch)[:, 64:127].double(), -1)
        q = torch.log_softmax(other.model(batch)[:, 64:127].double(), -1)
    kl = float((p.exp() * (p - q)).sum(-1).mean())
    assert rows[2]["kl"] == pytest.approx(kl, rel=1e-4)


def test_pareto_front():
    rows = [CompareRow("a", 10, 0, 0, 1, 100), CompareRow("b", 11, 0, 0, 1, 50), CompareRow("c", 12, 0, 0, 1, 60),
            CompareRow("d", 13, 0, 0, 1, 20)]
    assert pareto(rows, "size_bytes", smaller_x_better=True) == ["a", "b", "d"]


def test_cli_compare_table_json_and_plot(mini_run, mini_compressed, tmp_path):
    comp = mini_compressed("--bits", "8")
    proc = run_hardy("eval", "compare", "--model", str(mini_run / "run"), "--model", str(comp), "--data",
                     str(mini_run / "heldout.txt"), "--ctx", "128", "--max-tokens", "2048", "--new-tokens", "8",
                     "--prompt-tokens", "16", "--threads", "1", "--json", str(tmp_path / "c.json"),
                     "--plot", str(tmp_path / "c.png"), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads((tmp_path / "c.json").read_text())
    assert [r["model"] for r in rows] == [str(mini_run / "run"), str(comp)]
    assert rows[0]["kl"] == 0 and 0 < rows[1]["kl"] < 0.01 and rows[1]["top1"] > 0.95
    assert rows[1]["size_bytes"] < rows[0]["size_bytes"]
    assert all(r["decode_tps"] > 0 and r["prefill_tps"] > 0 and r["peak_rss_bytes"] > 10 << 20 for r in rows)
    assert (tmp_path / "c.png").stat().st_size > 10_000 and "KL (nats)" in proc.stdout and "z vs ref" in proc.stdout
    assert rows[0]["ppl_z"] == 0 and rows[1]["ppl_z"] is not None
    bad = hardy_main("eval", "compare", "--model", str(mini_run / "run"), "--data", "tinyshakespeare")
    assert bad.returncode == 2 and "at least two" in bad.stderr
