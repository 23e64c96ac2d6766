"""The paged KV cache (hardy.infer.kv): memory that follows the tokens held (measured: the process's
resident memory while a pool for 8 x 131072 positions holds a few thousand, and after it gives them back),
the same keys and values as a static cache, blocks handed out and taken back per sequence, and a budget
that refuses a cache no request could fit in."""
from __future__ import annotations

import psutil
import pytest
import torch

from conftest import hardy_main
from hardy.errors import HardyError
from hardy.infer.kv import BLOCK, GiB, KVPool, PagedKVCache, kv_budget, kv_layout
from hardy.model.config import ModelConfig
from hardy.model.transformer import build_model

MiB = 2 ** 20


def _model(layers=4, kv_heads=4, head_dim=64, max_seq=131072):
    cfg = ModelConfig(vocab_size=256, dim=256, n_layers=layers, n_heads=kv_heads * 2, n_kv_heads=kv_heads, ffn_dim=512,
                      head_dim=head_dim, max_seq_len=max_seq, name="kv-test")
    return build_model(cfg, seed=0).eval()


def _rss() -> int:
    return psutil.Process().memory_info().rss


def test_memory_follows_the_tokens_held_not_sequences_times_context():
    model = _model()
    layout = kv_layout(model, torch.bfloat16)
    assert layout.bytes_per_token == 4 * 2 * 4 * 64 * 2  # layers x (k, v) x heads x head size x bf16
    before = _rss()
    pool = KVPool(layout, sequences=8, max_len=131072, capacity=8 * 131072 // BLOCK)
    reserved = pool.capacity * layout.block_bytes
    assert reserved == 4 * GiB  # 8 x 131072 positions: address space, not memory
    assert _rss() - before < 16 * MiB
    held = 12_288  # positions written: 48 MiB of keys and values
    for seq in range(3):
        pool.reserve(seq, held // 3)
        for block in pool.held[seq]:
            pool.blocks[block].fill_(1.0)  # what attention's writes do, block by block
    grown = _rss() - before
    expected = held * layout.bytes_per_token
    assert 0.9 * expected < grown < expected + 24 * MiB, (grown / MiB, expected / MiB)
    for seq in range(3):
        pool.release(seq)
    assert _rss() - before < grown - 0.8 * expected  # given back to the OS, not only to the free list
    assert pool.free_blocks == pool.capacity


def test_blocks_come_and_go_per_sequence():
    pool = KVPool(kv_layout(_model(layers=1, kv_heads=1), torch.float32), sequences=3, max_len=100, capacity=6)
    pool.reserve(0, 33)  # two blocks
    pool.reserve(1, 1)
    pool.reserve(0, 64)  # still two: nothing more taken
    assert [len(h) for h in pool.held] == [2, 1, 0] and pool.free_blocks == 3
    assert sorted(pool.held[0] + pool.held[1]) == [0, 1, 2]  # the lowest blocks first
    with pytest.raises(HardyError, match="exceeds the KV cache"):
        pool.reserve(2, 101)
    pool.reserve(2, 96)
    with pytest.raises(HardyError, match="the KV cache is full"):
        pool.reserve(1, 40)
    pool.release(0)
    pool.reserve(1, 40)
    assert pool.tables[1, :2].tolist() == pool.held[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@torch.inference_mode()
def test_paged_attention_equals_a_static_cache(dtype):
    """Prefill two sequences of different lengths into scattered blocks, then decode them together: the
    same logits as the static cache with K/V rounded to the same dtype (fp32: the same to the last bit)."""
    model = _model(layers=2, kv_heads=2, head_dim=32, max_seq=256)
    tokens = torch.randint(0, 256, (2, 70), generator=torch.Generator().manual_seed(0))
    lengths = [70, 37]
    outs = {}
    for kind in ("paged", "static"):
        if kind == "paged":
            cache = PagedKVCache(model, 4, 128, dtype)
            cache.pool.reserve(3, 5)  # another sequence's block first: the rows' blocks are not 0, 1, 2...
            rows = [2, 0]
        else:
            model.setup_kv_cache(2, 128, dtype)
        steps = []
        for r, n in enumerate(lengths):
            if kind == "paged":
                cache.pool.reserve(rows[r], n)
                cache.use([rows[r]])
                steps.append(model(tokens[r:r + 1, :n], 0)[0, -1])
            else:
                caches = [layer.attention.kv_cache for layer in model.layers]
                for layer, c in zip(model.layers, caches):
                    layer.attention.kv_cache = c.rows(r, r + 1)
                steps.append(model(tokens[r:r + 1, :n], 0)[0, -1])
                for layer, c in zip(model.layers, caches):
                    layer.attention.kv_cache = c
        positions = torch.tensor(lengths)
        nxt = torch.tensor([[5], [9]])
        for _ in range(3):
            if kind == "paged":
                for r, p in zip(rows, positions.tolist()):
                    cache.pool.reserve(r, p + 1)
                cache.use(rows)
            steps.append(model(nxt, positions)[:, -1].flatten())
            positions = positions + 1
        model.clear_kv_cache()
        outs[kind] = torch.cat(steps)
    assert torch.equal(outs["paged"], outs["static"]) if dtype == torch.float32 else torch.allclose(
        outs["paged"], outs["static"], atol=1e-5, rtol=1e-5)


def test_the_budget_holds_what_memory_allows_and_refuses_what_cannot_fit():
    model = _model()
    per = kv_layout(model, torch.bfloat16).bytes_per_token
    full = kv_budget(model, 8, 4096, torch.bfloat16, available=64 * GiB)
    assert full.capacity == 8 * 4096 and "taken in blocks of 32" in full.line and "waits" not in full.line
    part = kv_budget(model, 8, 4096, torch.bfloat16, available=3 * 4096 * per + 100)
    assert part.capacity == 3 * 4096 and "a request waits for blocks" in part.line
    with pytest.raises(HardyError, match=r"one request of 4096 tokens needs 16.0 MiB \(4.0 KiB per token\); memory "
                                         r"beside the model holds 15.6 MiB"):
        kv_budget(model, 8, 4096, torch.bfloat16, available=4000 * per).check()


def test_serve_refuses_a_cache_memory_cannot_hold(mini_run, monkeypatch):
    """`hardy serve --context` beyond what memory holds: one line, exit 2, before any socket opens."""
    import hardy.infer.kv as kv

    monkeypatch.setattr(kv, "available_memory", lambda device: 64 * 1024)  # 128 of the mini model's tokens
    proc = hardy_main("serve", "--model", str(mini_run / "run"), "--context", "256", "--port", "0")
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip()
    assert line.startswith("hardy: error: the KV cache for one request of 256 tokens needs") and "\n" not in line


def test_a_model_memory_cannot_hold_is_refused_before_loading(monkeypatch):
    from collections import namedtuple

    memory = namedtuple("memory", "available free")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory(50 * MiB, 50 * MiB))
    monkeypatch.setattr(psutil, "swap_memory", lambda: memory(0, 0))
    proc = hardy_main("generate", "--model", "smollm2-135m", "--prompt", "x", "--gguf-weights", "float")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == ("hardy: error: smollm2-135m: loading needs about 0.5 GiB of memory, 0.0 GiB is "
                                   "available (--gguf-weights native keeps a quantized file quantized)")
