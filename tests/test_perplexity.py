"""Perplexity protocols on synthetic data with hand-computed expectations."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from hardy.errors import HardyError
from hardy.eval.perplexity import paired_difference, perplexity, plan_chunks, summarize


class TableModel(nn.Module):
    """Logits depend only on the current token: log p(next | cur) = log_probs[cur, next]."""

    def __init__(self, vocab: int, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(vocab, vocab, generator=g)
        self.seen: list[torch.Tensor] = []
        self.output = nn.Identity()

    def hidden_states(self, tokens):
        self.seen.append(tokens.clone())
        return self.table[tokens]

    def logits(self, hidden):
        return self.output(hidden)


def test_llamacpp_chunking_ctx512():
    chunks = plan_chunks(1100, 512, "llama.cpp")
    assert [(c.start, c.length) for c in chunks] == [(0, 512), (512, 512)]  # the tail of 76 tokens is dropped
    assert all(c.first_scored == 256 and c.last_scored == 510 and c.n_scored == 255 for c in chunks)


def test_llamacpp_needs_two_contexts():
    with pytest.raises(HardyError, match="at least 2\\*ctx"):
        plan_chunks(1023, 512, "llama.cpp")
    assert len(plan_chunks(1024, 512, "llama.cpp")) == 2


def test_full_protocol_scores_every_token_after_the_first_of_each_window():
    chunks = plan_chunks(5000, 2048, "full")
    assert [(c.start, c.length, c.first_scored, c.last_scored) for c in chunks] == [
        (0, 2048, 0, 2046), (2048, 2048, 0, 2046), (4096, 904, 0, 902)]
    assert sum(c.n_scored for c in chunks) == 5000 - 3


def test_standard_error_formula():
    nll = torch.tensor([1.0, 2.0, 4.0])
    ppl, se, mean = summarize(nll)
    m, m2 = 7 / 3, 21 / 3
    assert mean == pytest.approx(m)
    assert ppl == pytest.approx(math.exp(m))
    assert se == pytest.approx(math.exp(m) * math.sqrt((m2 - m * m) / 2))


def _expected_nll(model, tokens, positions):
    logp = torch.log_softmax(model.table, dim=-1)
    return [-logp[tokens[p], tokens[p + 1]].item() for p in positions]


@pytest.mark.parametrize("batch_size", [1, 3])
def test_llamacpp_protocol_on_a_table_model(batch_size):
    vocab, ctx = 11, 8
    tokens = torch.randint(0, vocab, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    model = TableModel(vocab)
    result = perplexity(model, tokens, ctx=ctx, protocol="llama.cpp", batch_size=batch_size)
    # 3 chunks of 8 (the last 6 tokens dropped); logits at chunk positions 4, 5, 6 are scored.
    positions = [c * 8 + j for c in range(3) for j in (4, 5, 6)]
    expected = _expected_nll(model, tokens, positions)
    n = len(expected)
    mean = sum(expected) / n
    var = sum(x * x for x in expected) / n - mean * mean
    assert result.n_scored == 9 and result.n_chunks == 3
    assert result.chunk_nll == pytest.approx([sum(expected[3 * c:3 * c + 3]) / 3 for c in range(3)], rel=1e-6)
    assert "chunk_nll" not in result.to_dict()  # JSON output stays one small record
    assert result.ppl == pytest.approx(math.exp(mean), rel=1e-6)
    assert result.se == pytest.approx(math.exp(mean) * math.sqrt(var / (n - 1)), rel=1e-6)


def test_llamacpp_bos_replaces_first_token_only_when_the_vocab_adds_it():
    tokens = list(range(1, 17))
    model = TableModel(20)
    perplexity(model, tokens, ctx=8, protocol="llama.cpp", bos_id=0, add_bos=True)
    assert [t[0, 0].item() for t in model.seen] == [0, 0]
    assert [t[0, 1:].tolist() for t in model.seen] == [tokens[1:8], tokens[9:16]]
    model.seen.clear()
    perplexity(model, tokens, ctx=8, protocol="llama.cpp", bos_id=0, add_bos=False)
    assert [t[0].tolist() for t in model.seen] == [tokens[:8], tokens[8:16]]


def test_full_protocol_on_a_table_model():
    vocab = 7
    tokens = torch.randint(0, vocab, (21,), generator=torch.Generator().manual_seed(2)).tolist()
    model = TableModel(vocab)
    result = perplexity(model, tokens, ctx=8, protocol="full", batch_size=4)
    positions = [w * 8 + j for w in range(2) for j in range(7)] + [16 + j for j in range(4)]
    expected = _expected_nll(model, tokens, positions)
    assert result.n_scored == len(expected) == 18
    assert result.ppl == pytest.approx(math.exp(sum(expected) / len(expected)), rel=1e-6)


def test_smollm2_perplexity_on_a_short_slice(smollm2):
    from hardy.data.text import read_text

    tokens = smollm2.tokenizer.encode(read_text("wikitext2-test")[:8000])[:1024]
    result = perplexity(smollm2.model, tokens, ctx=512)
    assert result.n_scored == 510
    assert 5 < result.ppl < 60  # a 135M model on WikiText: ~20; a broken import gives thousands


def test_paired_difference_separates_a_real_change_from_chunk_noise():
    vocab, ctx = 11, 8
    tokens = torch.randint(0, vocab, (8 * 200,), generator=torch.Generator().manual_seed(3)).tolist()
    a = perplexity(TableModel(vocab, seed=0), tokens, ctx=ctx, batch_size=16)
    same = paired_difference(a.chunk_nll, a.chunk_nll)
    assert same.delta == 0 and same.z == 0 and not same.significant()
    worse_model = TableModel(vocab, seed=0)
    worse_model.table = worse_model.table * 2  # sharper wrong guesses: worse on uniformly random text
    worse = perplexity(worse_model, tokens, ctx=ctx, batch_size=16)
    d = paired_difference(a.chunk_nll, worse.chunk_nll)
    diffs = torch.tensor(worse.chunk_nll, dtype=torch.float64) - torch.tensor(a.chunk_nll, dtype=torch.float64)
    assert d.n == 200 and d.delta == pytest.approx(diffs.mean().item())
    assert d.se == pytest.approx(diffs.std().item() / math.sqrt(200))
    assert d.delta > 0 and d.significant(), d
    assert paired_difference(worse.chunk_nll, a.chunk_nll).z == pytest.approx(-d.z)
    # a difference far smaller than the chunk-to-chunk spread is not significant
    wiggle = [x + 1e-3 * (-1) ** i for i, x in enumerate(a.chunk_nll)]
    assert not paired_difference(a.chunk_nll, wiggle).significant()
    with pytest.raises(ValueError):
        paired_difference(a.chunk_nll, perplexity(TableModel(vocab), tokens[:80], ctx=ctx).chunk_nll)
