"""Quantized GGUF files load straight into hardy's quantized layers: bit-exact for Q4_0/Q4_1/Q8_0,
within the documented error for K-quants and the re-quantized types, in the memory the file needs,
through a header reader that agrees with the `gguf` package's and refuses damaged headers."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import hardy_main, run_hardy
from hardy.errors import HardyError
from hardy.formats.gguf_io import load_gguf, load_gguf_quantized, open_gguf
from hardy.formats.gguf_quant import INT4_G32, INT4_SYM_G32, INT8_G32, packed_from_gguf
from hardy.loading.load import load_model

gguf = pytest.importorskip("gguf")
LEGACY = ("Q8_0", "Q4_0", "Q4_1")


@pytest.fixture(scope="module")
def mini_ggufs(mini_run, tmp_path_factory):
    """The trained `mini` model exported by `hardy export` in each legacy quantized type."""
    out = tmp_path_factory.mktemp("native")
    paths = {}
    for qtype in LEGACY:
        paths[qtype] = out / f"mini.{qtype}.gguf"
        proc = hardy_main("export", "--model", str(mini_run / "run"), "--format", "gguf", "--type", qtype,
                          "--out", str(paths[qtype]))
        assert proc.returncode == 0, proc.stderr[-2000:]
    return paths


@pytest.mark.parametrize("qtype", LEGACY)
def test_legacy_types_load_bit_exact_without_a_float_copy(mini_ggufs, qtype):
    path = mini_ggufs[qtype]
    cfg_float, reference, _, _ = load_gguf(path)  # the gguf package's dequantizer: the reference
    from hardy.compress import kernels

    cfg, floats, quantized, _, types = load_gguf_quantized(path, converter=kernels.load())  # as hardy loads it
    assert cfg == cfg_float
    matrices = [t for t in open_gguf(path).tensors if len(t.shape) == 2]
    assert types == {qtype: len(matrices)} and len(quantized) == len(matrices)
    assert set(quantized) | set(floats) == set(reference) and not set(quantized) & set(floats)
    for name, q in quantized.items():
        assert q.spec == {"Q8_0": INT8_G32, "Q4_0": INT4_SYM_G32, "Q4_1": INT4_G32}[qtype]
        assert torch.equal(q.dequantize(), reference[name]), name  # q/k rows unpermuted too
    # in memory, the layers hold the file's bytes: Q4_0 keeps no mins (rows padded to whole tiles of 8)
    held = sum(t.numel() * t.element_size() for q in quantized.values() for t in q.parts.values())
    padded = sum(int(t.n_bytes) * (-(-int(t.shape[1]) // 8) * 8) // int(t.shape[1]) for t in matrices)
    assert held == (padded if qtype != "Q8_0" else sum(int(t.n_bytes) for t in matrices)), (held, padded)
    for name, t in floats.items():
        assert t.ndim == 1 and torch.equal(t, reference[name]), name


def test_native_model_prefills_exactly_like_the_float_one(mini_ggufs, mini_run):
    native = load_model(str(mini_ggufs["Q4_0"]), gguf="native")
    dense = load_model(str(mini_ggufs["Q4_0"]), gguf="float")
    from hardy.compress.qlinear import QuantLinear

    assert sum(isinstance(m, QuantLinear) for m in native.model.modules()) > 0
    assert not any(p.numel() > 100_000 for p in native.model.parameters())  # no float matrix left
    ids = torch.tensor([native.tokenizer.encode((mini_run / "heldout.txt").read_text()[:600])[:96]])
    with torch.no_grad():  # many tokens: dequantized once per call, the same fp32 GEMMs
        assert torch.equal(native.model(ids), dense.model(ids))


def _fake_tensor(qtype, rows: int, blocks: np.ndarray):
    class Fake:  # what packed_from_gguf reads from a GGUF tensor
        name = f"fake.{qtype.name}"
        tensor_type = qtype
        shape = np.array([blocks.shape[1] * gguf.GGML_QUANT_SIZES[qtype][0], rows], dtype=np.uint64)
        data = np.ascontiguousarray(blocks.reshape(rows, -1))
    return Fake()


def _random_blocks(qtype, rows: int, cols: int, half_offsets: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Random bytes in every block, with its fp16 scales set to finite, positive values."""
    rng = np.random.default_rng(seed)
    values, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // values, size), dtype=np.uint8)
    for offset in half_offsets:
        d = rng.uniform(1e-4, 4e-3, blocks.shape[:2]).astype(np.float16)
        blocks[:, :, offset:offset + 2] = d.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks


def test_q4_k_loads_exactly_in_its_own_form_at_148_bytes_per_256_weights():
    """Q4_K in the K-quant form: every weight equals the `gguf` package's dequantization (llama.cpp's
    fp32 d·sc·q − dmin·m) bit for bit, held in 148 bytes per super-block (the file's 144 + unpacked sc/m);
    the kernels' product is the dequantized matrix's within int8 activation rounding."""
    from hardy.compress import kernels
    from hardy.formats.gguf_quant import INT4_K

    qtype = gguf.GGMLQuantizationType.Q4_K
    t = _fake_tensor(qtype, 6, _random_blocks(qtype, 6, 1024, (0, 2)))
    reference = torch.from_numpy(gguf.quants.dequantize(t.data, qtype).reshape(6, 1024))
    q = packed_from_gguf(t)
    assert q.spec == INT4_K and torch.equal(q.dequantize(), reference)
    assert sum(p.numel() * p.element_size() for p in q.parts.values()) == 6 * 4 * 148
    from hardy.plan.weights import held_bytes

    assert held_bytes(INT4_K, 6, 1024) == 6 * 4 * 148  # what the planner prices a Q4_K matrix at
    assert q.quant_tensor().stored_bits() == 148 * 8 / 256
    module = kernels.load()
    if module is None:
        pytest.skip("could not import 'hardy kernels': the extension did not build")
    fast = packed_from_gguf(t, converter=module)
    assert fast.tiled and torch.equal(fast.dequantize(), reference)
    _kernel_paths_give(fast, reference)


def _kernel_paths_give(fast, reference: torch.Tensor) -> None:
    """A converted matrix's kernel product is the reference's within int8 activation rounding; its
    prefill slab and embedding lookups are the reference's rows exactly."""
    from hardy.compress import kernels
    from hardy.compress.qlinear import QuantLinear

    rows, cols = reference.shape
    layer = QuantLinear(fast)
    kernels.prepare(layer)
    assert layer.kernel is not None
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(0))
    want = x @ reference.T
    assert (layer(x) - want).abs().max() < 2e-2 * want.abs().max()
    slab = torch.empty(rows, cols)
    layer.kernel.dequant_range(0, slab)
    assert torch.equal(slab, reference)
    assert torch.equal(layer.kernel.lookup(torch.tensor([rows - 1, 0])), reference[[rows - 1, 0]])


def test_q5_0_is_the_5_bit_grid_exactly_and_exports_back_to_the_same_bytes(tmp_path):
    """Q5_0's (q − 16)·d is hardy's 5-bit symmetric grid: loaded without a rounding, computed by the
    kernels from the file's 5.5 bits per weight (nibbles + fifth bits), and repacked into identical blocks."""
    from hardy.formats.gguf_export import repack_blocks
    from hardy.formats.gguf_quant import INT5_G32

    qtype = gguf.GGMLQuantizationType.Q5_0
    t = _fake_tensor(qtype, 6, _random_blocks(qtype, 6, 512, (0,), seed=3))
    reference = torch.from_numpy(gguf.quants.dequantize(t.data, qtype).reshape(6, 512))
    q = packed_from_gguf(t)
    assert q.spec == INT5_G32 and torch.equal(q.dequantize(), reference)
    assert np.array_equal(repack_blocks(q.quant_tensor(), "Q5_0"), np.asarray(t.data).reshape(6, -1))


@pytest.mark.parametrize("type_name,half_offsets", [("Q5_1", (0, 2)), ("Q3_K", (108,))])
def test_other_types_are_requantized_to_int8_within_half_a_step(type_name, half_offsets):
    qtype = gguf.GGMLQuantizationType[type_name]
    t = _fake_tensor(qtype, 4, _random_blocks(qtype, 4, 512, half_offsets, seed=1))
    reference = torch.from_numpy(gguf.quants.dequantize(t.data, qtype).reshape(4, 512))
    q = packed_from_gguf(t)
    assert q.spec == INT8_G32
    qt = q.quant_tensor()
    scale = qt.scale.float().repeat_interleave(32, dim=1)
    group_max = reference.abs().reshape(4, -1, 32).amax(-1).repeat_interleave(32, dim=1)
    err = (qt.dequantize() - reference).abs()
    assert (err <= scale / 2 * 1.001 + group_max * 2.0 ** -10).all()


def test_header_reader_agrees_with_the_gguf_package(smollm2_path):
    ours, theirs = open_gguf(smollm2_path), gguf.GGUFReader(smollm2_path)
    fields = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert fields == ours.fields
    assert len(ours.tensors) == len(theirs.tensors) > 0
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.tensor_type, list(a.shape), a.data_offset, a.n_bytes) == (
            b.name, b.tensor_type, list(b.shape), b.data_offset, b.n_bytes)
        assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data)


def test_damaged_headers_are_one_line_errors(mini_ggufs, tmp_path):
    good = mini_ggufs["Q8_0"].read_bytes()
    header_end = open_gguf(mini_ggufs["Q8_0"]).tensors[0].data_offset
    cases = {"magic": b"GGUX" + good[4:], "version": good[:4] + (9).to_bytes(4, "little") + good[8:],
             "counts": good[:8] + (2 ** 62).to_bytes(8, "little") + good[16:],
             "header cut": good[:header_end // 2], "data cut": good[:header_end + 100]}
    # the first key's value type (after magic, version, two counts and the key string)
    key_len = int.from_bytes(good[24:32], "little")
    cases["value type"] = good[:32 + key_len] + (77).to_bytes(4, "little") + good[36 + key_len:]
    for name, data in cases.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(data)
        with pytest.raises(HardyError) as e:
            load_gguf_quantized(path)
        assert str(path) in str(e.value) and "\n" not in str(e.value), name


# Peak RSS from VmHWM after resetting it (ru_maxrss would start at the forking pytest's own RSS).
MEMORY_PROBE = """
import json, psutil, sys
import hardy.loading.load as L
open("/proc/self/clear_refs", "w").write("5")
base = psutil.Process().memory_info().rss
m = L.load_model("smollm2-135m", gguf=sys.argv[1])
held = sum(t.numel() * t.element_size() for t in [*m.model.parameters(), *m.model.buffers()])
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
print(json.dumps({"peak": hwm * 1024 - base, "held": held}))
"""


def test_native_load_needs_the_memory_of_the_file_not_of_fp32(smollm2_path):
    size = smollm2_path.stat().st_size

    def probe(weights: str) -> dict:
        return json.loads(subprocess.run([sys.executable, "-c", MEMORY_PROBE, weights], capture_output=True,
                                         text=True, check=True).stdout)

    native, dense = probe("native"), probe("float")
    assert native["held"] <= size * 1.01 < dense["held"] / 5  # the tensors are the file's bytes, not fp32
    # the file's pages (mapped while reading) + the tensors + tokenizer and kernels
    assert native["peak"] <= 2 * size + 128 * 2 ** 20 < dense["peak"], (native, dense)


def test_generate_runs_a_native_gguf_and_tp2_matches_one_process(mini_ggufs):
    args = ["generate", "--model", str(mini_ggufs["Q4_1"]), "--prompt", "KING:", "--max-new-tokens", "24",
            "--threads", "2"]
    one = hardy_main(*args)
    two = run_hardy(*args, "--tp", "2", timeout=300)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-2000:]
    assert two.stdout == one.stdout and len(one.stdout) > len("KING:") + 10
    dense = hardy_main(*args, "--gguf-weights", "float")
    assert dense.returncode == 0 and dense.stdout.startswith("KING:")


@pytest.mark.parametrize("qtype", LEGACY)
def test_tp_ranks_read_only_their_slices_and_they_make_the_whole(mini_ggufs, qtype):
    """`--tp 2` workers load only their rows (colwise) / columns (rowwise) of every attention and MLP
    matrix from the file: each rank holds half of those bytes, and the two halves put together are the
    single-process model's matrices exactly (q/k rows unpermuted before slicing)."""
    from hardy.compress.qlinear import QuantLinear
    from hardy.parallel.parallelize import TP_PLAN
    from hardy.compress.tensor_parallel import rank_slices

    def layers(loaded) -> dict:
        return {n: m for n, m in loaded.model.named_modules() if isinstance(m, QuantLinear) and n.startswith("layers.")}

    whole = layers(load_model(str(mini_ggufs[qtype]), gguf="native"))
    ranks = [layers(load_model(str(mini_ggufs[qtype]), gguf="native", tp_slices=rank_slices(r, 2)))
             for r in range(2)]
    assert set(whole) == set(ranks[0]) == set(ranks[1]) and len(whole) == 7 * 2
    for name, full in whole.items():
        kind = TP_PLAN[name.split(".", 2)[2]]
        parts = [r[name] for r in ranks]
        assert [p.tp_slice.rank for p in parts] == [0, 1] and all(p.tp_slice.kind == kind for p in parts)
        nbytes = [sum(t.numel() * t.element_size() for t in p.stored().values()) for p in parts]
        assert nbytes[0] == nbytes[1] == sum(t.numel() * t.element_size() for t in full.stored().values()) // 2
        joined = torch.cat([p.dequantized_weight() for p in parts], dim=0 if kind == "colwise" else 1)
        assert torch.equal(joined, full.dequantized_weight()), name


@pytest.mark.parametrize("bits", [4, 8])
def test_prefill_slabs_give_the_whole_matrix_product(bits, monkeypatch):
    """Many tokens: the C++ dequantization of a slab of rows at a time, one GEMM per slab, equals the
    product with the whole dequantized matrix (fp32), and stays within bf16 rounding in bf16."""
    from torch import nn

    from hardy.compress import kernels, qlinear
    from hardy.formats.quantized import QuantSpec, rtn

    if kernels.load() is None:
        pytest.skip("could not import 'hardy kernels': the extension did not build")
    torch.manual_seed(0)
    spec = QuantSpec(4, 32, False) if bits == 4 else QuantSpec(8, 32, True)
    layer = qlinear.QuantLinear(rtn(torch.randn(100, 256), spec))  # 100 rows: a partial tile of 8
    assert kernels.prepare(nn.Sequential(layer)) == 1 and layer.kernel is not None
    monkeypatch.setattr(qlinear, "PREFILL_SLAB_BYTES", 24 * 256 * 4)  # slabs of 24 rows: 5 of them
    monkeypatch.setattr(qlinear, "PREFILL_BF16_ROWS", 24)  # the same in bf16
    x = torch.randn(2, 20, 256)
    exact = torch.nn.functional.linear(x, layer.dequantized_weight())
    assert torch.allclose(layer(x), exact, rtol=1e-6, atol=1e-5)
    qlinear.set_prefill_dtype(layer, torch.bfloat16)
    fast = layer(x)
    assert fast.dtype == torch.float32 and 0 < (fast - exact).norm() / exact.norm() < 1e-2


def test_q6_k_loads_exactly_in_its_own_form_at_212_bytes_per_256_weights():
    """Q6_K in the 6-bit K-quant form: every weight equals the `gguf` package's dequantization (llama.cpp's
    d·sc·(q − 32)) bit for bit on the numpy and C++ paths, held in 212 bytes per super-block (the file's
    210, d widened to fp32); the kernel's product is the dequantized matrix's within int8 activation
    rounding, its prefill slab and lookups are the dequantized rows exactly, and its stored tensors
    are the numpy path's."""
    from hardy.compress import kernels
    from hardy.formats.gguf_quant import INT6_K, _q6_k
    from hardy.plan.weights import held_bytes

    qtype = gguf.GGMLQuantizationType.Q6_K
    t = _fake_tensor(qtype, 11, _random_blocks(qtype, 11, 768, (208,), seed=3))  # 11 rows: a partial tile
    reference = torch.from_numpy(gguf.quants.dequantize(t.data, qtype).reshape(11, 768))
    slow = packed_from_gguf(t)
    assert slow.spec == INT6_K and torch.equal(slow.dequantize(), reference)
    assert slow.quant_tensor().stored_bits() == 212 * 8 / 256 and held_bytes(INT6_K, 11, 768) == 11 * 3 * 212
    module = kernels.load()
    if module is None:
        pytest.skip("could not import 'hardy kernels': the extension did not build")
    fast = packed_from_gguf(t, converter=module)
    assert fast.tiled and sum(p.numel() * p.element_size() for p in fast.parts.values()) == 16 * 3 * 212
    for name, tensor in _q6_k(t).parts.items():
        assert torch.equal(fast.stored()[name], tensor), name
    _kernel_paths_give(fast, reference)


def test_q5_k_loads_exactly_in_its_own_form_at_180_bytes_per_256_weights():
    """Q5_K in the 5-bit K-quant form: every weight equals the `gguf` package's dequantization (llama.cpp's
    d·sc·q − dmin·m, q with its fifth bit) bit for bit on the numpy and C++ paths, held in 180 bytes per
    super-block (the file's 176 + unpacked sc/m); the C++ converter's stored tensors are the numpy path's
    for rows in any order; the kernel, prefill slab and lookups compute the dequantized matrix."""
    from hardy.compress import kernels
    from hardy.formats.gguf_quant import INT5_K, _converted_in_cpp, _k_quant, conversion
    from hardy.plan.weights import held_bytes

    qtype = gguf.GGMLQuantizationType.Q5_K
    t = _fake_tensor(qtype, 11, _random_blocks(qtype, 11, 768, (0, 2), seed=3))  # 11 rows: a partial tile
    reference = torch.from_numpy(gguf.quants.dequantize(t.data, qtype).reshape(11, 768))
    slow = packed_from_gguf(t)
    assert slow.spec == INT5_K and torch.equal(slow.dequantize(), reference)
    assert slow.quant_tensor().stored_bits() == 180 * 8 / 256 and held_bytes(INT5_K, 11, 768) == 11 * 3 * 180
    assert conversion("Q5_K") == "exact"
    module = kernels.load()
    if module is None:
        pytest.skip("could not import 'hardy kernels': the extension did not build")
    fast = packed_from_gguf(t, converter=module)
    assert fast.tiled and sum(p.numel() * p.element_size() for p in fast.parts.values()) == 16 * 3 * 180
    order = torch.randperm(11, generator=torch.Generator().manual_seed(1))
    moved = _converted_in_cpp(t, order, converter=module)
    for name, tensor in _k_quant(t, five=True).parts.items():
        assert torch.equal(fast.stored()[name], tensor), name
        assert torch.equal(moved.stored()[name], tensor[order]), name
    _kernel_paths_give(fast, reference)


def test_q4_k_in_cpp_equals_the_numpy_conversion():
    from hardy.compress import kernels
    from hardy.formats.gguf_quant import _k_quant

    if kernels.load() is None:
        pytest.skip("could not import 'hardy kernels': the extension did not build")
    qtype = gguf.GGMLQuantizationType.Q4_K
    t = _fake_tensor(qtype, 11, _random_blocks(qtype, 11, 512, (0, 2), seed=4))  # 11 rows: a partial tile
    fast, slow = packed_from_gguf(t, converter=kernels.load()), _k_quant(t, five=False)
    assert fast.tiled and not slow.tiled
    for name in ("qweight", "scales", "mins"):
        assert torch.equal(fast.stored()[name], slow.parts[name]), name


@pytest.mark.parametrize("type_name,half_offsets", [("Q4_0", (0,)), ("Q4_1", (0, 2)), ("Q8_0", (0,))])
def test_legacy_types_in_cpp_equal_the_numpy_conversion(type_name, half_offsets):
    """The one-pass C++ converters (rows reordered on the way) and the numpy path give the same stored
    tensors; Q4_0 on both paths keeps no mins (the symmetric grid)."""
    from hardy.compress import kernels
    from hardy.formats.gguf_quant import _packed_in_file_order

    if kernels.load() is None:
        pytest.skip("could not import 'hardy kernels': the extension did not build")
    qtype = gguf.GGMLQuantizationType[type_name]
    t = _fake_tensor(qtype, 13, _random_blocks(qtype, 13, 256, half_offsets, seed=5))  # 13 rows: a partial tile
    order = torch.randperm(13, generator=torch.Generator().manual_seed(0))
    fast, slow = packed_from_gguf(t, converter=kernels.load()), _packed_in_file_order(t)
    assert fast.spec == slow.spec and set(fast.stored()) == set(slow.parts)
    assert ("mins" in slow.parts) == (type_name == "Q4_1")
    for name, tensor in slow.parts.items():
        assert torch.equal(fast.stored()[name], tensor), name
    from hardy.formats.gguf_quant import _converted_in_cpp

    moved = _converted_in_cpp(t, order, converter=kernels.load())
    for name, tensor in slow.parts.items():
        assert torch.equal(moved.stored()[name], tensor[order]), name


@pytest.mark.parametrize("type_name,half_offsets", [("Q4_0", (0,)), ("Q8_0", (0,)), ("Q4_K", (0, 2)),
                                                    ("Q5_K", (0, 2)), ("Q6_K", (208,))])
def test_tp_slices_are_the_same_on_both_paths(type_name, half_offsets):
    """A rank's rows (q/k-unpermuted) or columns read by the C++ converters equal the numpy path's
    slice of the whole tensor; a split inside a K-quant super-block is a one-line error."""
    from hardy.compress import kernels
    from hardy.formats.gguf_quant import TPSlice

    if kernels.load() is None:
        pytest.skip("could not import 'hardy kernels': the extension did not build")
    qtype = gguf.GGMLQuantizationType[type_name]
    t = _fake_tensor(qtype, 16, _random_blocks(qtype, 16, 1024, half_offsets, seed=6))
    for tp in (TPSlice("colwise", 1, 2), TPSlice("rowwise", 0, 2), TPSlice("rowwise", 1, 2)):
        heads = 2 if tp.kind == "colwise" else None
        fast = packed_from_gguf(t, heads, tp, converter=kernels.load())
        slow = packed_from_gguf(t, heads, tp)  # no converter: the numpy path
        assert fast.tp_slice == slow.tp_slice == tp and fast.shape == slow.shape
        assert fast.shape == ((8, 1024) if tp.kind == "colwise" else (16, 512))
        assert torch.equal(fast.dequantize(), slow.dequantize()), tp
    if type_name in ("Q4_K", "Q5_K", "Q6_K"):
        with pytest.raises(HardyError, match="whole blocks"):
            packed_from_gguf(t, tp=TPSlice("rowwise", 0, 8), converter=kernels.load())  # 128 columns: half a super-block


@pytest.mark.parametrize("qtype", LEGACY)
def test_the_planners_file_layout_is_what_a_native_load_holds(mini_ggufs, qtype):
    """hardy.plan.weights reads a file's header into the bytes its weights take once loaded natively:
    the planner's memory and per-step bytes for `--quant file` (int4 tiles padded to 8 rows aside)."""
    from hardy.plan.weights import layout_from_gguf

    layout = layout_from_gguf(mini_ggufs[qtype])
    model = load_model(str(mini_ggufs[qtype]), gguf="native").model
    held = sum(t.numel() * t.element_size() for name, t in [*model.named_parameters(), *model.named_buffers()]
               if not name.startswith("rope_"))
    assert layout.quantized and layout.types.startswith(qtype)
    assert held == pytest.approx(layout.total, rel=0.01), (held, layout)


@pytest.mark.parametrize("type_name,half_offsets", [("Q4_0", (0,)), ("Q4_1", (0, 2)), ("Q8_0", (0,)),
                                                    ("Q4_K", (0, 2)), ("Q5_K", (0, 2)), ("Q6_K", (208,))])
def test_a_matrix_converted_in_parts_equals_it_converted_at_once(monkeypatch, type_name, half_offsets):
    """A large matrix is converted a few rows at a time (to bound load-time memory): the stored tensors
    equal the one-part conversion for a row count that is not a multiple of 8, in file order and with
    the q/k rows reordered; in file order each part's rows are mapped before and dropped after it is
    converted, and every row is dropped once; reordered rows are all mapped up front."""
    from hardy.compress import kernels
    from hardy.formats import gguf_quant

    if kernels.load() is None:
        pytest.skip("could not import 'hardy kernels': the extension did not build")

    class Pages:  # records what the converter asks to map and drop
        def __init__(self):
            self.calls = []

        def prefetch(self, r0, r1):
            self.calls.append(("prefetch", r0, r1))

        def release(self, r0, r1):
            self.calls.append(("release", r0, r1))

    qtype = gguf.GGMLQuantizationType[type_name]
    t = _fake_tensor(qtype, 36, _random_blocks(qtype, 36, 512, half_offsets, seed=7))
    row_bytes = t.data.shape[1]
    whole = {h: packed_from_gguf(t, h, converter=kernels.load()) for h in (None, 2)}
    monkeypatch.setattr(gguf_quant, "CONVERT_PART_BYTES", 16 * row_bytes)  # 16 rows a part: 3 parts
    for heads in (None, 2):
        pages = Pages()
        parts = packed_from_gguf(t, heads, converter=kernels.load(), pages=pages)
        assert parts.shape == whole[heads].shape == (36, 512) and parts.spec == whole[heads].spec
        assert set(parts.stored()) == set(whole[heads].stored())
        for name, tensor in whole[heads].stored().items():
            assert torch.equal(parts.stored()[name], tensor), (heads, name)
        if heads is None:
            assert pages.calls == [(op, r0, min(36, r0 + 16)) for r0 in (0, 16, 32)
                                   for op in ("prefetch", "release")]
        else:
            assert pages.calls == [("prefetch", 0, 36)]
    assert not torch.equal(whole[None].stored()["qweight"], whole[2].stored()["qweight"])


def test_loading_a_gguf_and_generating_leave_distributed_checkpointing_unimported(mini_ggufs):
    """Inference never needs torch.distributed.checkpoint or DTensor (with sympy they were ~50 MB of a
    process's memory and ~0.9 s of its start), so a native load, a generation and the serving engine
    import neither; loading a training run's checkpoint still can (it is the same function)."""
    code = ("import sys, torch; from hardy.loading.load import load_model; "
            "from hardy.infer.generate import SamplingConfig, generate; from hardy.serve.engine import ModelRunner; "
            f"m = load_model({str(mini_ggufs['Q4_0'])!r}, gguf='native'); "
            "print(generate(m.model, [1, 2, 3], SamplingConfig(max_new_tokens=4)).tokens); "
            "print(sorted(n for n in ('torch.distributed.checkpoint', 'torch.distributed.tensor', 'sympy') "
            "if n in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    tokens, imported = proc.stdout.strip().splitlines()[-2:]
    assert len(json.loads(tokens)) == 4 and imported == "[]", proc.stdout


def _resident_pages(path) -> tuple[int, int]:
    """(resident, all) pages of `path`'s tensor data as this process maps it (/proc/self/pagemap's
    present bit: readable without privileges)."""
    reader = open_gguf(path)
    first = min(t.data_offset for t in reader.tensors) // 4096
    for line in open("/proc/self/maps"):
        fields = line.split()
        if fields[-1] == str(path.resolve()):
            begin, end = (int(x, 16) for x in fields[0].split("-"))
            with open("/proc/self/pagemap", "rb") as f:
                f.seek((begin // 4096 + first) * 8)
                entries = np.frombuffer(f.read((end - begin) // 4096 * 8 - first * 8), dtype=np.uint64)
            return int((entries >> np.uint64(63)).sum()), entries.size
    raise AssertionError(f"{path} is not mapped")


def test_a_native_load_keeps_none_of_the_files_pages(smollm2_path):
    """Each tensor's pages leave the process once it is converted, including those the kernel mapped
    again around the next tensor's first read (fault-around), and the map itself is gone after the load:
    the process holds the weights once, not the converted copy plus the file."""
    from hardy.compress import kernels
    from hardy.formats.gguf_io import close_gguf_files

    close_gguf_files()  # a map other tests read through may hold any of the file's pages
    load_gguf_quantized(smollm2_path, converter=kernels.load())
    resident, pages = _resident_pages(smollm2_path)
    assert pages > 20_000 and resident <= pages // 200, (resident, pages)
    load_model(str(smollm2_path), gguf="native")
    assert str(smollm2_path.resolve()) not in open("/proc/self/maps").read()
