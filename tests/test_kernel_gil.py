"""The extension's long calls run without the GIL: the serving engine makes them on its own thread, and
while one held the GIL the HTTP threads could stream tokens only between decode steps (a client's
token gaps grew with the step's length)."""
from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

from hardy.compress import kernels
from hardy.model.config import ModelConfig
from test_serve_chunked import quantized_mini


@pytest.fixture(scope="module")
def model():
    if kernels.load() is None:
        pytest.skip("kernels could not be built here (no compiler): the PyTorch path is used")
    return quantized_mini(ModelConfig(vocab_size=512, dim=512, n_layers=4, n_heads=8, n_kv_heads=2, ffn_dim=2048,
                                      max_seq_len=512))


def share_running_beside(call, calls: int = 6) -> tuple[float, float]:
    """(the share of the time this thread's Python loop ran, the shortest of the calls) while another
    thread makes `calls` calls back to back. A call holding the GIL stops the loop for all of it, so the
    loop runs only between calls; the share is not a longest stall because a busy machine (another test
    worker) can deschedule the loop for milliseconds either way."""
    durations: list[float] = []

    def worker():
        torch.set_num_threads(1)  # OpenMP's thread count is per thread: the other core is the loop's
        for _ in range(calls):
            t = time.perf_counter()
            call()
            durations.append(time.perf_counter() - t)

    call()  # warm-up (first-use allocations)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # the GIL changes hands within 0.1 ms between calls, not the default 5 ms
    try:
        thread = threading.Thread(target=worker)
        thread.start()
        start = last = time.perf_counter()
        ran = 0.0
        while thread.is_alive():
            now = time.perf_counter()
            ran += now - last if now - last < 1e-3 else 0.0  # a longer gap: the loop was stopped
            last = now
        thread.join()
    finally:
        sys.setswitchinterval(interval)
    return ran / (last - start), min(durations)


def test_the_fused_decode_step_runs_without_the_gil(model):
    from hardy.infer.fused_decode import fused_blocks
    from hardy.infer.kv import PagedKVCache

    stack = fused_blocks(model)
    assert stack is not None
    rows = 64
    cache = PagedKVCache(model, rows, 512, torch.bfloat16)
    try:
        positions = torch.full((rows,), 500)
        for row in range(rows):
            cache.pool.reserve(row, 501)
        cache.use(list(range(rows)))
        x = torch.randn(rows, model.cfg.dim)
        table, cos, sin = cache.pool.tables[cache.rows].contiguous(), model.rope_cos, model.rope_sin
        with torch.inference_mode():  # the stack's call as decode_hidden makes it
            share, call = share_running_beside(lambda: stack(x, positions, cos, sin, cos, sin, cache.pool.blocks, table))
    finally:
        model.clear_kv_cache()
    assert call > 0.002, f"a step of {call * 1e3:.1f} ms is too short to tell"
    assert share > 0.25, f"the Python loop ran {share:.0%} of the time beside {call * 1e3:.1f} ms steps"


@pytest.fixture(scope="module")
def wide_layer(model):
    from hardy.compress.qlinear import QuantLinear
    from hardy.formats.quantized import QuantSpec, rtn

    layer = QuantLinear(rtn(torch.randn(8192, 4096, generator=torch.Generator().manual_seed(0)) * 0.02,
                            QuantSpec(4, 32)))
    kernels.prepare(layer)
    return layer


@pytest.mark.parametrize("what", ["qgemv", "dequant_range"])
def test_the_quantized_products_and_slab_dequantization_run_without_the_gil(wide_layer, what):
    x = torch.randn(32, wide_layer.in_features)
    slab = torch.empty(wide_layer.out_features, wide_layer.in_features, dtype=torch.bfloat16)
    call = (lambda: wide_layer.kernel(x)) if what == "qgemv" else (lambda: wide_layer.kernel.dequant_range(0, slab))
    share, shortest = share_running_beside(call)
    assert shortest > 0.002, f"a call of {shortest * 1e3:.1f} ms is too short to tell"
    assert share > 0.25, f"the Python loop ran {share:.0%} of the time beside {shortest * 1e3:.1f} ms calls"
