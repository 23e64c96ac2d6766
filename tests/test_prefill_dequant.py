"""Prefill's dequantization (the kernels' dequant_range, vectorized a tile of 8 rows at a time): for every
GGUF type hardy holds in a tiled form, any range of rows — starting and ending inside a tile — comes out
as the `gguf` package's dequantization exactly in fp32, and as that rounded to nearest even in bf16; a
damaged block's NaN scale stays NaN."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hardy.compress import kernels
from hardy.formats.gguf_quant import packed_from_gguf

gguf = pytest.importorskip("gguf")

# each type's fp16 factors (byte offsets in its block): d, or d and dmin / m
TYPES = [("Q4_0", (0,)), ("Q4_1", (0, 2)), ("Q5_0", (0,)), ("Q8_0", (0,)), ("Q4_K", (0, 2)), ("Q5_K", (0, 2)),
         ("Q6_K", (208,))]
ROWS, COLS = 21, 768  # two whole tiles of 8 and a partial one; three super-blocks of 256


def _tensor(qtype, blocks: np.ndarray):
    class Fake:  # what packed_from_gguf reads from a GGUF tensor
        name = f"fake.{qtype.name}"
        tensor_type = qtype
        shape = np.array([COLS, ROWS], dtype=np.uint64)
        data = np.ascontiguousarray(blocks.reshape(ROWS, -1))
    return Fake()


def _blocks(qtype, offsets: tuple[int, ...], seed: int) -> np.ndarray:
    """Random bytes, with the fp16 factors finite, of both signs, one of them exactly zero."""
    rng = np.random.default_rng(seed)
    values, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (ROWS, COLS // values, size), dtype=np.uint8)
    for offset in offsets:
        d = (rng.uniform(1e-4, 4e-3, blocks.shape[:2]) * rng.choice([-1, 1], blocks.shape[:2])).astype(np.float16)
        d[1, 0] = 0
        blocks[:, :, offset:offset + 2] = d.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks


def _layer_of(qtype, blocks: np.ndarray):
    """The blocks as a prepared QuantLinear in the kernels' tiled form, and the `gguf` package's dequantization."""
    from hardy.compress.qlinear import QuantLinear

    module = kernels.load()
    if module is None:
        pytest.skip("could not import 'hardy kernels': the extension did not build")
    t = _tensor(qtype, blocks)
    reference = torch.from_numpy(gguf.quants.dequantize(t.data, qtype).reshape(ROWS, COLS))
    layer = QuantLinear(packed_from_gguf(t, converter=module))
    kernels.prepare(layer)
    assert layer.kernel is not None and layer.tiled
    return layer, reference


def _layer(type_name: str, offsets: tuple[int, ...], seed: int = 0):
    qtype = gguf.GGMLQuantizationType[type_name]
    return _layer_of(qtype, _blocks(qtype, offsets, seed))


@pytest.mark.parametrize("type_name,offsets", TYPES)
def test_any_row_range_is_the_reference_in_fp32_and_its_rounding_in_bf16(type_name, offsets):
    layer, reference = _layer(type_name, offsets)
    for begin, n in ((0, ROWS), (5, 11), (3, 1), (16, 5), (9, 7)):
        fp32 = torch.full((n, COLS), float("nan"))
        layer.kernel.dequant_range(begin, fp32)
        assert torch.equal(fp32, reference[begin:begin + n]), (begin, n)
        bf16 = torch.full((n, COLS), float("nan"), dtype=torch.bfloat16)
        layer.kernel.dequant_range(begin, bf16)
        assert torch.equal(bf16, reference[begin:begin + n].to(torch.bfloat16)), (begin, n)


def test_rows_outside_the_range_are_not_written():
    layer, reference = _layer("Q4_0", (0,))
    out = torch.full((ROWS + 2, COLS), 7.0)
    layer.kernel.dequant_range(6, out[1:1 + 10])
    assert torch.equal(out[1:11], reference[6:16])
    assert (out[0] == 7).all() and (out[11:] == 7).all()


def test_a_nan_scale_stays_nan_in_bf16():
    """A damaged block's NaN scale gives NaN weights (not infinities, not numbers); the rest are exact."""
    qtype = gguf.GGMLQuantizationType.Q8_0
    blocks = _blocks(qtype, (0,), seed=1)
    blocks[2, 1, 0:2] = np.array([np.nan], dtype=np.float16).view(np.uint8)
    layer, reference = _layer_of(qtype, blocks)
    bf16 = torch.empty(ROWS, COLS, dtype=torch.bfloat16)
    layer.kernel.dequant_range(0, bf16)
    nan = reference.isnan()
    assert nan[2, 32:64].all() and nan.sum() == 32
    assert torch.equal(bf16.isnan(), nan) and torch.equal(bf16[~nan], reference[~nan].to(torch.bfloat16))
