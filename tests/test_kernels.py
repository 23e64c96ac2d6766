"""The fused quantized decode kernels (hardy.compress.kernels): exact on activations that sit on the
int8 grid, within 1e-2 of dequantize-then-matmul otherwise, the same numbers from the portable build,
within 1% perplexity of the weight-only path, and used by loaded models for decode-sized inputs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hardy.compress import kernel_build, kernels
from hardy.compress.qlinear import QuantLinear
from hardy.formats.quantized import QuantSpec, QuantTensor, rtn

# int4 on both grids: asymmetric (Q4_1, with mins) and symmetric (Q4_0, the offset from the scale); the 5-bit
# grid (Q5_0: the int4 layout plus a plane of fifth bits)
SPECS = [QuantSpec(4, 32), QuantSpec(4, 128), QuantSpec(4, 32, True), QuantSpec(4, 128, True), QuantSpec(8, 0),
         QuantSpec(8, 32), QuantSpec(5, 32, True), QuantSpec(5, 128, True)]


@pytest.fixture(scope="module")
def ext():
    module = kernels.load()
    if module is None:
        pytest.skip("kernels could not be built here (no compiler): the PyTorch path is used")
    return module


def _layer(spec, out=96, cols=576, seed=0):
    g = torch.Generator().manual_seed(seed)
    return QuantLinear(rtn(torch.randn(out, cols, generator=g) * 0.05, spec))


@pytest.mark.parametrize("spec", SPECS)
def test_exact_on_grid_activations_and_close_otherwise(ext, spec):
    layer = _layer(spec)  # 576 columns: at group 128 the last group is 64 wide
    kernel = kernels.LayerKernel(layer, ext)
    w = layer.dequantized_weight()
    grid = torch.randint(-127, 128, (3, 576)).float()
    grid.view(3, -1, 32)[:, :, 0] = 127  # each block's max is 127 codes: quantization is exact
    x = grid * 0.01
    assert torch.allclose(kernel(x), x @ w.t(), rtol=1e-5, atol=1e-4)
    x = torch.randn(4, 576)
    ref = x @ w.t()
    assert float((kernel(x) - ref).norm() / ref.norm()) < 1e-2
    assert kernel(x[None]).shape == (1, 4, 96)


@pytest.mark.parametrize("spec", [QuantSpec(4, 32), QuantSpec(4, 128, True), QuantSpec(5, 32, True)])
def test_many_rows_give_the_bits_of_one_row_at_a_time(ext, spec):
    """A batch's rows share each tile's unpacked codes (four at a time, then the rest): every row's
    result is bit for bit the one of that row alone, whatever the number of rows."""
    layer = _layer(spec, out=100)
    kernel = kernels.LayerKernel(layer, ext)
    x = torch.randn(11, 576, generator=torch.Generator().manual_seed(1))
    alone = torch.cat([kernel(x[t:t + 1]) for t in range(11)])
    for rows in (2, 3, 4, 5, 7, 11):
        assert torch.equal(kernel(x[:rows]), alone[:rows]), rows


def test_a_copied_layer_computes_with_its_own_tensors(ext):
    """A deep copy of a prepared layer (a model copied to be changed) gets a kernel of its own, on the
    copy's bytes: doubling the copy's scales doubles its output and leaves the original's."""
    import copy

    layer = _layer(QuantSpec(4, 32, True))
    layer.kernel = kernels.LayerKernel(layer, ext)
    x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(1))
    before = layer(x)
    twin = copy.deepcopy(layer)
    twin.scales.mul_(2)
    assert twin.kernel is not layer.kernel and twin.kernel.layer is twin
    assert torch.allclose(twin(x), 2 * before, rtol=1e-5, atol=1e-6)
    assert torch.equal(layer(x), before)


def test_tiled_layout_is_a_lossless_relayout(ext):
    """The kernel re-lays int4 and int8 weights in tiles of 8 interleaved rows (padded): state_dict(), the
    stored tensors, row lookups and embeddings give back exactly the stored layout, a state dict
    loads into a tiled layer, and a row count that is not a multiple of 8 computes correctly."""
    from hardy.compress.qlinear import QuantEmbedding

    layer = _layer(QuantSpec(4, 32), out=100)
    stored = {k: v.clone() for k, v in layer.state_dict().items()}
    weight = layer.dequantized_weight()
    kernel = kernels.LayerKernel(layer, ext)
    assert layer.tiled and layer.qweight.shape == (104, 288) and layer.scales.shape == (13, 18, 8)
    assert not torch.equal(layer.qweight[:100], stored["qweight"])  # really re-laid
    assert all(torch.equal(v, stored[k]) for k, v in layer.state_dict().items()) and len(stored) == 3
    assert torch.equal(layer.dequantized_weight(), weight)
    rows = torch.tensor([0, 7, 8, 99, 42])
    assert all(torch.equal(v, stored[k][rows]) for k, v in layer.stored(rows).items())
    x = torch.randn(2, 576)
    ref = x @ weight.t()
    assert kernel(x).shape == (2, 100) and float((kernel(x) - ref).norm() / ref.norm()) < 1e-2
    other = _layer(QuantSpec(4, 32), out=100, seed=1)
    kernels.LayerKernel(other, ext)
    other.load_state_dict(stored)
    assert torch.equal(other.qweight, layer.qweight) and torch.equal(other.dequantized_weight(), weight)

    # the symmetric int4 grid (no mins), int8 (per group, per channel) and 5-bit: tiled the same way
    for spec in (QuantSpec(4, 32, True), QuantSpec(8, 32), QuantSpec(8, 0), QuantSpec(5, 32, True)):
        other_layer = _layer(spec, out=100)
        other_stored = {k: v.clone() for k, v in other_layer.state_dict().items()}
        other_weight = other_layer.dequantized_weight()
        other_kernel = kernels.LayerKernel(other_layer, ext)
        groups = spec.groups(576)
        assert other_layer.tiled and other_layer.mins is None and set(other_stored) == {"qweight", "scales"}
        assert other_layer.scales.shape == (13, groups, 8)
        assert other_layer.qweight.shape == (104, 288 if spec.bits in (4, 5) else 576)  # 5-bit: nibbles + fifth bits
        assert (other_layer.high.shape == (13, 18, 8)) if spec.bits == 5 else not hasattr(other_layer, "high")
        assert not torch.equal(other_layer.qweight[:100], other_stored["qweight"])
        assert all(torch.equal(v, other_stored[k]) for k, v in other_layer.state_dict().items())
        assert torch.equal(other_layer.dequantized_weight(), other_weight)
        assert all(torch.equal(v, other_stored[k][rows]) for k, v in other_layer.stored(rows).items())
        ref = x @ other_weight.t()
        assert float((other_kernel(x) - ref).norm() / ref.norm()) < 1e-2
        reloaded = _layer(spec, out=100, seed=1)
        kernels.LayerKernel(reloaded, ext)
        reloaded.load_state_dict(other_stored)
        assert torch.equal(reloaded.dequantized_weight(), other_weight)

    for spec in (QuantSpec(4, 32), QuantSpec(4, 32, True), QuantSpec(8, 0), QuantSpec(5, 32, True)):  # lookups
        emb = QuantEmbedding(rtn(torch.randn(60, 64) * 0.05, spec))
        tokens = torch.tensor([[3, 59], [56, 0]])
        before = emb(tokens)
        emb.table.kernel = kernels.LayerKernel(emb.table, ext)  # lookups now dequantize in C++
        assert emb.table.tiled
        assert torch.equal(emb(tokens), before)


@pytest.mark.parametrize("isa", ["generic", "avx2"])
def test_narrower_builds_compute_the_same(ext, tmp_path, isa):
    """The scalar fallback (no vector ISA) and, on a VNNI machine, the AVX2 build (maddubs instead of
    vpdpbusd) agree with the build in use, for groups of 32, wider groups, per-channel scales and the
    K-quant forms (GGUF Q4_K's sc/m bytes and d/dmin, Q5_K's with a plane of fifth bits; Q6_K's bit
    planes and scales per 16)."""
    if isa == "avx2" and not ext.has_vnni():
        pytest.skip("the build in use is the AVX2 one (or narrower)")
    check = "not m.has_avx2()" if isa == "generic" else "m.has_avx2() and not m.has_vnni()"
    specs = [(4, 32, False), (4, 128, False), (4, 32, True), (8, 32, True), (8, 0, True), (5, 32, True)]
    script = (
        "import torch, json; from hardy.compress import kernels; from hardy.compress.qlinear import QuantLinear;"
        f"from hardy.formats.quantized import QuantSpec, QuantTensor, rtn; m = kernels.load(); assert {check};"
        "g = torch.Generator().manual_seed(0); x = torch.randn(2, 576, generator=g); out = {};"
        "[out.__setitem__(f'{b} {s} {y}', kernels.LayerKernel(QuantLinear(rtn(torch.randn(64, 576, generator=g) * 0.05,"
        f" QuantSpec(b, s, y))), m)(x).tolist()) for b, s, y in {specs!r}];"
        f"exec({_K_FORM!r}); out['K'] = kernels.LayerKernel(QuantLinear(k_form(g)), m)(x[:, :512]).tolist();"
        "out['K6'] = kernels.LayerKernel(QuantLinear(k6_form(g)), m)(x[:, :512]).tolist();"
        "out['K5'] = kernels.LayerKernel(QuantLinear(k_form(g, bits=5)), m)(x[:, :512]).tolist();"
        "print(json.dumps(out))")
    env = dict(os.environ, HARDY_KERNEL_ISA=isa, HARDY_CACHE=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    narrow = json.loads(proc.stdout.strip().splitlines()[-1])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 576, generator=g)
    for bits, size, sym in specs:
        layer = QuantLinear(rtn(torch.randn(64, 576, generator=g) * 0.05, QuantSpec(bits, size, sym)))
        ours = kernels.LayerKernel(layer, ext)(x)
        assert torch.allclose(torch.tensor(narrow[f"{bits} {size} {sym}"]), ours, rtol=1e-5, atol=1e-5), (bits, size)
    namespace = {"torch": torch, "QuantSpec": QuantSpec, "QuantTensor": QuantTensor}
    exec(_K_FORM, namespace)
    k_tensor = namespace["k_form"](g)
    for key, make in (("K", "k_form"), ("K6", "k6_form"), ("K5", "k_form")):
        k_tensor = k_tensor if key == "K" else namespace[make](g, bits=5) if key == "K5" else namespace[make](g)
        ours = kernels.LayerKernel(QuantLinear(k_tensor), ext)(x[:, :512])
        assert torch.allclose(torch.tensor(narrow[key]), ours, rtol=1e-5, atol=1e-5), key
        want = x[:, :512] @ k_tensor.dequantize().T  # and the form computes its own dequantized weights
        assert (ours - want).abs().max() < 2e-2 * want.abs().max(), key


# A random matrix in the K-quant form (GGUF Q4_K's, or Q5_K's at 5 bits): codes, 6-bit sc and m, fp16 d
# and dmin per 256.
_K_FORM = """
def k_form(g, rows=64, cols=512, bits=4):
    def ints(high, *shape):
        return torch.randint(0, high, shape, generator=g, dtype=torch.int64).to(torch.uint8)
    supers = (torch.rand(rows, cols // 256, 2, generator=g) * 4e-3 + 1e-4).half()
    return QuantTensor(ints(1 << bits, rows, cols), ints(64, rows, cols // 32), ints(64, rows, cols // 32),
                       QuantSpec(bits, 32, False, super_block=256), supers)


def k6_form(g, rows=64, cols=512):  # GGUF Q6_K's: 6-bit codes, an int8 scale per 16, d per 256
    codes = torch.randint(0, 64, (rows, cols), generator=g, dtype=torch.int64).to(torch.uint8)
    scales = torch.randint(-128, 128, (rows, cols // 16), generator=g, dtype=torch.int64).to(torch.int8)
    d = (torch.rand(rows, cols // 256, generator=g) * 1e-3 + 1e-5).half().float()
    return QuantTensor(codes, scales, None, QuantSpec(6, 16, True, super_block=256), d)
"""


def test_the_5_bit_k_form_round_trips_through_the_tiled_layout(ext):
    """The 5-bit K-quant form (GGUF Q5_K's) tiles its fifth bits and d/dmin into one int32 tensor: its
    state dict, row lookups and dequantized weight are the stored layout's exactly, a state dict loads
    into a tiled layer, and 13 rows (a partial tile) compute the dequantized product."""
    namespace = {"torch": torch, "QuantSpec": QuantSpec, "QuantTensor": QuantTensor}
    exec(_K_FORM, namespace)
    g = torch.Generator().manual_seed(2)
    qt = namespace["k_form"](g, rows=13, bits=5)
    layer = QuantLinear(qt)
    stored = {k: v.clone() for k, v in layer.state_dict().items()}
    kernel = kernels.LayerKernel(layer, ext)
    assert layer.tiled and layer.mins.dtype == torch.int32 and layer.mins.shape == (2, 16 + 2, 8)
    assert all(torch.equal(v, stored[k]) for k, v in layer.state_dict().items()) and len(stored) == 3
    weight = qt.dequantize()
    assert torch.equal(layer.dequantized_weight(), weight) and int(weight.abs().max()) > 0
    rows = torch.tensor([12, 0, 8])
    assert all(torch.equal(v, stored[k][rows]) for k, v in layer.stored(rows).items())
    other = QuantLinear(namespace["k_form"](g, rows=13, bits=5))
    kernels.LayerKernel(other, ext)
    other.load_state_dict(stored)
    assert torch.equal(other.mins, layer.mins) and torch.equal(other.dequantized_weight(), weight)
    x = torch.randn(2, 512, generator=g)
    want = x @ weight.T
    assert (kernel(x) - want).abs().max() < 2e-2 * want.abs().max()


def test_loaded_models_decode_through_the_kernel_within_1pct_ppl(ext, mini_run, mini_compressed, monkeypatch):
    from hardy.compress import qlinear
    from hardy.eval.perplexity import perplexity
    from hardy.loading.load import load_model

    loaded = load_model(str(mini_compressed("--bits", "4", "--group-size", "32", "--quantize-embeddings")))
    layers = [m for m in loaded.model.modules() if isinstance(m, QuantLinear)]
    assert layers and all(m.kernel is not None for m in layers)  # the tied head too
    tokens = loaded.tokenizer.encode((mini_run / "heldout.txt").read_text())[:4096]
    weight_only = perplexity(loaded.model, tokens, ctx=128, batch_size=8).ppl  # many tokens: dequantize + GEMM
    monkeypatch.setattr(qlinear, "FUSED_MAX_TOKENS", 1 << 30)  # every call through the int8-activation kernel
    fused = perplexity(loaded.model, tokens, ctx=128, batch_size=8).ppl
    assert fused != weight_only and abs(fused / weight_only - 1) < 0.01


def test_kv_cached_decode_matches_uncached_logits(mini_run):
    from hardy.infer.kv import PagedKVCache
    from hardy.loading.load import load_model

    model = load_model(str(mini_run / "run")).model
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)
        cache = PagedKVCache(model, 1, 40, torch.float32)
        try:
            cache.pool.reserve(0, 24)
            steps = [model(tokens[:, :24])]
            for i in range(24, 40):
                cache.pool.reserve(0, i + 1)
                steps.append(model(tokens[:, i:i + 1], start_pos=i))
        finally:
            model.clear_kv_cache()
    cached = torch.cat(steps, dim=1)
    assert (cached - full).abs().max() < 1e-4


@pytest.fixture(scope="module")
def int4_and_int8_models(mini_compressed):
    from hardy.loading.load import load_model

    return {bits: load_model(str(mini_compressed("--bits", bits, "--group-size", group, "--quantize-embeddings"))).model
            for bits, group in (("4", "32"), ("8", "0"))}


def _batched_decode(model, prompts, lengths, fused: bool, kv_dtype, steps: int = 5) -> torch.Tensor:
    """Prefill each row alone (as the engine does), then `steps` batched decode steps of all rows at
    their own positions, feeding back each row's argmax: the logits [steps, rows, vocab]."""
    from hardy.infer.fused_decode import decode_hidden
    from hardy.infer.kv import PagedKVCache

    cache = PagedKVCache(model, len(lengths), max(64, max(lengths) + steps + 1), kv_dtype)
    try:
        with torch.inference_mode():
            for row, n in enumerate(lengths):
                cache.pool.reserve(row, n)
                cache.use([row])
                model.hidden_states(prompts[row:row + 1, :n], 0)
            cache.use(list(range(len(lengths))))
            positions, tokens, out = torch.tensor(lengths), prompts[:, -1:], []
            for _ in range(steps):
                for row, p in enumerate(positions.tolist()):
                    cache.pool.reserve(row, p + 1)
                h = decode_hidden(model, tokens, positions) if fused else model.hidden_states(tokens, positions)
                out.append(model.logits(h[:, -1]))
                tokens, positions = out[-1].argmax(-1, keepdim=True), positions + 1
            return torch.stack(out)
    finally:
        model.clear_kv_cache()


@pytest.mark.parametrize("bits", ["4", "8"])
@pytest.mark.parametrize("kv", ["fp32", "bf16", "fp16"])
def test_fused_decode_block_matches_the_modules(ext, int4_and_int8_models, bits, kv):
    """The one-call C++ block stack (decode_layer.cpp) against the model's own modules running the same
    kernels over the same paged cache: per-row positions (the serving engine's batched decode) and a
    greedy generation; the cache in fp32, bf16 or fp16 (the stack reads its blocks in place)."""
    from hardy.infer.fused_decode import fused_blocks, use_fused_blocks
    from hardy.infer.generate import SamplingConfig, generate
    from hardy.infer.kv import KV_DTYPES

    model = int4_and_int8_models[bits]
    assert fused_blocks(model) is not None
    prompts = torch.randint(0, model.cfg.vocab_size, (3, 30), generator=torch.Generator().manual_seed(1))
    lengths = [30, 11, 23]  # rows at different positions
    fused = _batched_decode(model, prompts, lengths, True, KV_DTYPES[kv])
    modules = _batched_decode(model, prompts, lengths, False, KV_DTYPES[kv])
    # Not bit-equal: norms and attention sum in another order, and a last-bit difference in an input
    # can flip one int8 activation code (measured ~1e-4); a wrong rope, mask or cache write is >1e-2.
    assert (fused - modules).norm() / modules.norm() < 1e-3
    prompt = prompts[0, :8].tolist()
    fast = generate(model, prompt, SamplingConfig(max_new_tokens=24), kv_dtype=KV_DTYPES[kv]).tokens
    use_fused_blocks(model, False)  # the module path
    try:
        slow = generate(model, prompt, SamplingConfig(max_new_tokens=24), kv_dtype=KV_DTYPES[kv]).tokens
    finally:
        use_fused_blocks(model)
    assert fast == slow


@pytest.mark.parametrize("kv", ["fp32", "bf16"])
def test_long_rows_attended_in_chunks_match_the_modules(ext, int4_and_int8_models, kv):
    """Past 128 positions the stack attends to a row in chunks whose partial results (largest score,
    sum, weighted values) are merged (attention.h): rows of three chunks, of one, and of two whose
    second holds a single position, against the modules' attention over the whole row at once."""
    from hardy.infer.kv import KV_DTYPES

    model = int4_and_int8_models["4"]
    prompts = torch.randint(0, model.cfg.vocab_size, (3, 300), generator=torch.Generator().manual_seed(4))
    lengths = [300, 40, 128]
    fused = _batched_decode(model, prompts, lengths, True, KV_DTYPES[kv], steps=3)
    modules = _batched_decode(model, prompts, lengths, False, KV_DTYPES[kv], steps=3)
    # bf16 keys and values (8 significant bits) left 1.1e-3 in one full-suite run on an AVX-512 Xeon
    assert (fused - modules).norm() / modules.norm() < (1e-3 if kv == "fp32" else 4e-3)


def test_a_cleared_cache_is_freed_and_a_new_one_read(ext, int4_and_int8_models):
    """The stack reads whatever pool the model's attention holds at each step: a cleared one is freed
    (nothing keeps it alive), and a new one of another length is the one written and read."""
    import gc
    import weakref

    from hardy.infer.fused_decode import decode_hidden
    from hardy.infer.kv import PagedKVCache

    model = int4_and_int8_models["4"]
    prompt = torch.randint(0, model.cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        cache = PagedKVCache(model, 1, 16, torch.float32)
        cache.pool.reserve(0, 9)
        model.hidden_states(prompt[:, :8], 0)
        decode_hidden(model, prompt[:, 8:], 8)
        old = weakref.ref(cache.pool.blocks)
        model.clear_kv_cache()
        del cache
        gc.collect()
        assert old() is None
        results = []
        for path in ("fused", "modules"):
            cache = PagedKVCache(model, 1, 24, torch.float32)  # a stale pool would be written and read
            cache.pool.reserve(0, 9)
            try:
                model.hidden_states(prompt[:, :8], 0)
                results.append(decode_hidden(model, prompt[:, 8:], 8) if path == "fused"
                               else model.hidden_states(prompt[:, 8:], 8))
            finally:
                model.clear_kv_cache()
    assert (results[0] - results[1]).norm() / results[1].norm() < 1e-3


def _mixed_model(int4_and_int8_models):
    """The int4 model with some blocks' v and down projections int8, as a Q4_K_M file loads (its Q6_K
    tensors become int8 g32): phases whose matrices differ in bytes per tile."""
    import copy

    source, int8 = int4_and_int8_models["4"], int4_and_int8_models["8"]
    model = copy.deepcopy(source)  # without the source's C++ stack: the copy builds its own
    for i in range(0, len(model.layers), 2):
        model.layers[i].attention.wv = copy.deepcopy(int8.layers[i].attention.wv)
        model.layers[i].feed_forward.w2 = copy.deepcopy(int8.layers[i].feed_forward.w2)
    return model


def _decode_steps(model, fused: bool, threads: int = 2, prefill: int = 10) -> torch.Tensor:
    """Two decode steps of two rows after a `prefill`-token prefill: the fused stack's or the modules' states."""
    from hardy.infer.fused_decode import decode_hidden
    from hardy.infer.kv import PagedKVCache

    n = prefill
    prompts = torch.randint(0, model.cfg.vocab_size, (2, n + 2), generator=torch.Generator().manual_seed(3))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            cache = PagedKVCache(model, 2, max(32, -(-(n + 2) // 32) * 32), torch.float32)
            try:
                for row in range(2):
                    cache.pool.reserve(row, n + 2)
                cache.use([0, 1])
                model.hidden_states(prompts[:, :n], 0)
                steps = []
                for i in range(2):
                    tokens, positions = prompts[:, n + i:n + i + 1], torch.tensor([n + i, n + i])
                    steps.append(decode_hidden(model, tokens, positions) if fused
                                 else model.hidden_states(tokens, positions))
                return torch.cat(steps, dim=1)
            finally:
                model.clear_kv_cache()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("bits", ["4", "8", "mixed"])
def test_fused_decode_is_the_same_on_any_number_of_threads(ext, int4_and_int8_models, bits):
    """The stack splits each product's tiles (by bytes, across a phase's matrices), the attention heads
    and the SwiGLU blocks between the threads of one parallel region (decode_layer.cpp): every output
    element is computed whole by one thread, so 1, 2 and 3 threads give the same bits; with int4 and
    int8 matrices mixed in a phase the stack still matches the modules."""
    from hardy.infer.fused_decode import fused_blocks

    model = _mixed_model(int4_and_int8_models) if bits == "mixed" else int4_and_int8_models[bits]
    assert fused_blocks(model) is not None
    outs = {threads: _decode_steps(model, True, threads) for threads in (1, 2, 3)}
    assert outs[1].abs().sum() > 0
    assert torch.equal(outs[1], outs[2]) and torch.equal(outs[1], outs[3])
    # rows of three chunks: the threads share one row's chunks, and the merge adds them in chunk order
    long = {threads: _decode_steps(model, True, threads, prefill=300) for threads in (1, 2, 3)}
    assert torch.equal(long[1], long[2]) and torch.equal(long[1], long[3])
    if bits == "mixed":
        modules = _decode_steps(model, False)
        assert (outs[2] - modules).norm() / modules.norm() < 1e-3


def test_one_openmp_runtime_per_process(ext):
    """torch brings its OpenMP runtime; the kernels link against that same one (kernels.openmp_link_flags),
    so a process that loads both has a single runtime and one thread pool, not two competing ones."""
    script = ("import json, re, torch; from hardy.compress import kernels; assert kernels.load() is not None;"
              "maps = open('/proc/self/maps').read();"
              "print(json.dumps(sorted(set(re.findall(r'/(lib(?:g|i)?omp[^/\\s]*\\.so[^/\\s]*)', maps)))))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    runtimes = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(runtimes) == 1, runtimes
    flags = kernels.openmp_link_flags()
    bundled = sorted((Path(torch.__file__).parent / "lib").glob("libgomp*.so*"))
    if bundled:
        assert f"-l:{bundled[0].name}" in flags and runtimes == [bundled[0].name]


def test_the_kernels_in_use_are_the_ones_the_install_built(ext):
    """make test installs the package, which builds a module per ISA (setup.py): the loader uses the one
    for this CPU as it is, compiling nothing on first use."""
    assert ext.__name__ == kernel_build.module_name(kernels._isa())
    assert ext.built_for_torch() == torch.__version__.split("+")[0]
    assert ext.sources_digest() == kernel_build.sources_digest()


def _fresh_loader(monkeypatch, compile_now, cache):
    monkeypatch.setenv("HARDY_CACHE", str(cache))  # no build compiled on an earlier first use
    monkeypatch.setattr(kernels, "_module", None)
    monkeypatch.setattr(kernels, "_tried", False)
    monkeypatch.setattr(kernels, "compile_now", compile_now)


def test_an_install_build_for_other_sources_or_another_torch_is_compiled_again(ext, monkeypatch, caplog, tmp_path):
    isa = kernels._isa()
    monkeypatch.setattr(kernel_build, "sources_digest", lambda: ext.sources_digest() ^ 1)
    assert kernels.installed(isa) == (None, "the sources changed since the install built them")
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "9.9.9+cpu")
    module, why = kernels.installed(isa)
    assert module is None and why == f"the installed build is for torch {ext.built_for_torch()}, this is torch 9.9.9"
    compiled = []
    _fresh_loader(monkeypatch, lambda isa, verbose=False: compiled.append(isa) or "a fresh build", tmp_path)
    with caplog.at_level("WARNING", logger="hardy.compress.kernels"):
        assert kernels.load() == "a fresh build" and kernels.load() == "a fresh build"
    assert compiled == [isa]  # once, for this CPU's ISA, and said once
    assert [r.getMessage() for r in caplog.records] == [
        f"quantized decode kernels: {why}; compiling the {isa} build now (once per machine)"]


def test_without_a_usable_build_or_a_compiler_the_pytorch_path_is_said_once(monkeypatch, caplog, tmp_path):
    def no_compiler(isa, verbose=False):
        raise RuntimeError("Error building extension: c++: not found\nmore detail")

    _fresh_loader(monkeypatch, no_compiler, tmp_path)
    monkeypatch.setattr(kernels, "installed", lambda isa: (None, "none was built at install"))
    with caplog.at_level("WARNING", logger="hardy.compress.kernels"):
        assert kernels.load() is None and kernels.load() is None
    assert [r.getMessage() for r in caplog.records] == [
        f"quantized decode kernels: none was built at install; compiling the {kernels._isa()} build now (once per "
        "machine)", "quantized decode kernels unavailable (Error building extension: c++: not found); using the "
        "PyTorch path"]


def test_a_build_compiled_on_an_earlier_first_use_loads_without_a_warning(monkeypatch, caplog, tmp_path):
    isa = kernels._isa()
    _fresh_loader(monkeypatch, lambda isa, verbose=False: "the cached build", tmp_path)
    monkeypatch.setattr(kernels, "installed", lambda isa: (None, "none was built at install"))
    name, directory = kernels.cached_build(isa)
    directory.mkdir(parents=True)
    (directory / f"{name}.so").write_bytes(b"")
    with caplog.at_level("INFO", logger="hardy.compress.kernels"):
        assert kernels.load() == "the cached build"
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", f"quantized decode kernels: none was built at install; loading the {isa} build compiled on an "
                 "earlier first use")]


def test_bf16_activations_leave_the_quantized_bytes_and_run_the_pass_in_bf16(ext, int4_and_int8_models):
    """set_activation_dtype(bf16): float parameters outside the quantized layers (norm weights) in bf16,
    quantized embeddings looked up in bf16, the codes and scales untouched; the hidden states come out in
    bf16 within bf16 rounding of the float32 pass."""
    import copy

    from hardy.compress.qlinear import QuantEmbedding, set_activation_dtype

    model = copy.deepcopy(int4_and_int8_models["4"])
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        exact = model.hidden_states(tokens, 0)
    stored = {n: t.clone() for n, t in model.state_dict().items() if not n.endswith("norm.weight")}
    set_activation_dtype(model, torch.bfloat16)
    assert isinstance(model.tok_embeddings, QuantEmbedding) and model.tok_embeddings(tokens).dtype == torch.bfloat16
    assert model.norm.weight.dtype == torch.bfloat16
    assert all(torch.equal(t, stored[n]) for n, t in model.state_dict().items() if n in stored)
    with torch.inference_mode():
        fast = model.hidden_states(tokens, 0)
    assert fast.dtype == torch.bfloat16
    error = (fast.float() - exact).norm() / exact.norm()
    assert 0 < error < 3e-2, error
    with pytest.raises(ValueError):
        set_activation_dtype(model, torch.float16)
