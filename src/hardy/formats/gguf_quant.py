"""GGUF quantized tensors straight into hardy's quantized-tensor format (docs/quantization.md),
read from the memory-mapped file one tensor at a time: no float copy of the model is ever made.

  Q4_0        -> int4 symmetric, group 32: exact. Q4_0 *is* hardy's symmetric int4 grid ((q − 8)·d,
                 fp16 d, the same nibble order; no mins: the file's 18 bytes per 32 weights in memory).
  Q4_1        -> int4 asymmetric, group 32: exact. Q4_1 *is* hardy's format (fp16 scale and min,
                 the same nibble order).
  Q8_0        -> int8 symmetric, group 32: exact (fp16 scale, int8 codes).
  Q5_0        -> 5-bit symmetric, group 32: exact. Q5_0 *is* hardy's 5-bit grid ((q − 16)·d, fp16 d); the
                 kernels hold it as Q4 nibbles plus a plane of fifth bits: 5.5 bits per weight, as the file.
  Q4_K        -> int4 in the K-quant form (hardy.formats.quantized): exact. The codes unchanged, each
                 sub-block's 6-bit scale and min unpacked to a byte, d and dmin as they are: 148 bytes
                 per 256 weights against the file's 144.
  Q5_K        -> 5-bit in the K-quant form (hardy.formats.quantized): exact. Q4_K's with each code's fifth
                 bit (codes one per byte as stored; the kernels' nibbles plus a plane of fifth bits):
                 180 bytes per 256 weights against the file's 176.
  Q6_K        -> 6-bit in the K-quant form (hardy.formats.quantized): exact. The codes as low nibbles
                 and two bit planes, the int8 sub-block scales and d as they are: 212 bytes per 256
                 weights against the file's 210.
  any other   -> int8 symmetric, group 32, re-quantized from the `gguf` package's dequantized
  quantized      values (Q5_1, Q2_K, Q3_K, IQ*): at most half an int8 step of error per
  type           weight, ~1.06 bytes per weight in memory.
F32/F16/BF16 tensors and 1-D ones (norms) stay float, as in the file.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import gguf
import numpy as np
import torch

from hardy.errors import HardyError
from hardy.formats.names import unpermute_qk
from hardy.formats.quantized import QuantSpec, QuantTensor, pack_int4, rtn, untile_codes

FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
EXACT = {"Q4_0": "exact", "Q4_1": "exact", "Q8_0": "exact", "Q5_0": "exact", "Q4_K": "exact", "Q5_K": "exact",
         "Q6_K": "exact"}
INT4_G32 = QuantSpec(4, 32, False)
INT4_K = QuantSpec(4, 32, False, super_block=256)
INT5_K = QuantSpec(5, 32, False, super_block=256)
INT6_K = QuantSpec(6, 16, True, super_block=256)
INT4_SYM_G32 = QuantSpec(4, 32, True)
INT8_G32 = QuantSpec(8, 32, True)
INT5_G32 = QuantSpec(5, 32, True)


@dataclass(frozen=True)
class TPSlice:
    """One tensor-parallel rank's part of a matrix: output rows (colwise) or input columns (rowwise)."""

    kind: str  # "colwise" | "rowwise"
    rank: int
    parts: int

    def span(self, n: int) -> tuple[int, int]:
        return self.rank * n // self.parts, (self.rank + 1) * n // self.parts


@dataclass
class PackedQuant:
    """A quantized weight already in hardy's stored layout (qweight / scales / mins): what the module
    swap needs, without unpacking the codes (`QuantTensor` holds one byte per code)."""

    parts: dict[str, torch.Tensor]
    spec: QuantSpec
    shape: tuple[int, int]
    tiled: bool = False  # already in the kernels' tiled layout (hardy.formats.quantized.tile_codes)
    tp_slice: TPSlice | None = None  # only this tensor-parallel rank's rows or columns were read

    def packed(self) -> dict[str, torch.Tensor]:
        return self.parts

    def stored(self) -> dict[str, torch.Tensor]:
        if not self.tiled:
            return self.parts
        return untile_codes(self.parts, self.shape[0])

    def quant_tensor(self) -> QuantTensor:
        return QuantTensor.from_packed(self.stored(), self.spec, self.shape)

    def dequantize(self) -> torch.Tensor:
        return self.quant_tensor().dequantize()

    def map_rows(self, fn) -> "PackedQuant":
        """Rows picked (reordered, or a rank's subset) by `fn` (every stored tensor is [rows, ...])."""
        parts = {k: fn(v).contiguous() for k, v in self.stored().items()}
        return PackedQuant(parts, self.spec, (parts["qweight"].shape[0], self.shape[1]))


def _blocks(t, block_values: int, block_bytes: int) -> tuple[np.ndarray, int, int]:
    """The tensor's bytes as [rows, blocks per row, block bytes], checked against its shape."""
    cols, rows = int(t.shape[0]), int(np.prod([int(d) for d in t.shape[1:]]))
    if cols % block_values:
        raise HardyError(f"GGUF tensor {t.name}: {cols} columns are not whole {t.tensor_type.name} blocks")
    nb = cols // block_values
    data = np.asarray(t.data)
    if data.size != rows * nb * block_bytes:
        raise HardyError(f"GGUF tensor {t.name}: {data.size} bytes where {t.tensor_type.name} "
                         f"{rows}x{cols} needs {rows * nb * block_bytes}")
    return data.reshape(rows, nb, block_bytes), rows, cols


def _half(blocks: np.ndarray, offset: int) -> torch.Tensor:
    """The fp16 at byte `offset` of every block, as a [rows, blocks] fp16 tensor."""
    raw = np.ascontiguousarray(blocks[:, :, offset:offset + 2])
    return torch.from_numpy(raw.view(np.float16)[..., 0].copy())


def _q4_legacy(t, with_min: bool) -> PackedQuant:
    block_bytes = 20 if with_min else 18
    blocks, rows, cols = _blocks(t, 32, block_bytes)
    qs = torch.from_numpy(np.ascontiguousarray(blocks[:, :, block_bytes - 16:]).reshape(rows, cols // 2))
    parts = {"qweight": qs, "scales": _half(blocks, 0)}
    if with_min:
        parts["mins"] = _half(blocks, 2)
    return PackedQuant(parts, INT4_G32 if with_min else INT4_SYM_G32, (rows, cols))


def _q8_0(t) -> PackedQuant:
    blocks, rows, cols = _blocks(t, 32, 34)
    codes = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(rows, cols)
    return PackedQuant({"qweight": torch.from_numpy(codes), "scales": _half(blocks, 0)}, INT8_G32, (rows, cols))


def _q5_0(t) -> PackedQuant:
    """Q5_0 blocks (fp16 d, 32 fifth bits, 16 bytes of low nibbles) as 5-bit codes q on scale d."""
    blocks, rows, cols = _blocks(t, 32, 22)
    high = np.ascontiguousarray(blocks[:, :, 2:6]).view(np.uint32)  # [rows, nb, 1], bit j: value j's fifth bit
    bits = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [rows, nb, 32]
    qs = blocks[:, :, 6:]
    low = np.concatenate([qs & 15, qs >> 4], axis=2)  # values 0-15 in the low nibbles, 16-31 in the high
    codes = (low | (bits << 4)).reshape(rows, cols)
    return PackedQuant({"qweight": torch.from_numpy(codes), "scales": _half(blocks, 0)}, INT5_G32, (rows, cols))


def _q4_k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit (scale, min) pairs of each Q4_K super-block from its 12 packed bytes
    (llama.cpp's get_scale_min_k4), as [..., 8] integer arrays."""
    s = s.astype(np.uint16)
    sc = np.empty(s.shape[:-1] + (8,), np.uint16)
    mn = np.empty_like(sc)
    sc[..., :4], mn[..., :4] = s[..., 0:4] & 63, s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, mn


def _k_quant(t, five: bool) -> PackedQuant:
    """Q4_K super-blocks (fp16 d, fp16 dmin, 12 bytes of 6-bit sc/m, 128 bytes of nibbles) or Q5_K ones
    (the same with 32 bytes of fifth bits, qh, before the nibbles) in the K-quant form."""
    blocks, rows, cols = _blocks(t, 256, 176 if five else 144)
    sc, mn = _q4_k_scales(blocks[:, :, 4:16])
    scales = torch.from_numpy(np.stack((sc, mn), axis=-1).astype(np.uint8).reshape(rows, -1))  # sc, m per group
    supers = torch.from_numpy(np.ascontiguousarray(blocks[:, :, 0:4]).view(np.float16).reshape(rows, -1).copy())
    # 4 chunks of 64 values per super-block, 32 bytes each: low nibbles = values 0-31 of the chunk,
    # high nibbles = values 32-63. hardy's blocks of 32 pack code j with code j + 16 instead.
    qs = np.ascontiguousarray(blocks[:, :, 48 if five else 16:]).reshape(rows, -1, 4, 1, 32)
    codes = np.concatenate((qs & 15, qs >> 4), axis=3).reshape(rows, -1, 8, 32)  # [rows, super-blocks, group, value]
    if not five:
        return PackedQuant({"qweight": pack_int4(torch.from_numpy(codes.reshape(rows, cols))), "scales": scales,
                            "mins": supers}, INT4_K, (rows, cols))
    qh = blocks[:, :, None, 16:48]  # bit g of qh[i]: value i of group g's fifth bit
    codes = codes | (((qh >> np.arange(8, dtype=np.uint8)[:, None]) & 1) << 4)
    return PackedQuant({"qweight": torch.from_numpy(codes.reshape(rows, cols)), "scales": scales, "mins": supers},
                       INT5_K, (rows, cols))


def _q6_k(t) -> PackedQuant:
    """Q6_K super-blocks (ql[128], qh[64], int8 scales[16], fp16 d) as 6-bit codes, as llama.cpp's
    dequantize_row_q6_K reads them, with the int8 scale of each 16 values and d (as fp32)."""
    blocks, rows, cols = _blocks(t, 256, 210)
    ql, qh = blocks[:, :, :128].reshape(rows, -1, 2, 64), blocks[:, :, 128:192].reshape(rows, -1, 2, 32)
    low = np.concatenate([ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=-1)
    high = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=-1)
    codes = torch.from_numpy((low | (high << 4)).reshape(rows, cols).astype(np.uint8))
    scales = torch.from_numpy(np.ascontiguousarray(blocks[:, :, 192:208]).view(np.int8).reshape(rows, -1).copy())
    d = _half(blocks, 208).float()
    return PackedQuant({"qweight": codes, "scales": scales, "mins": d}, INT6_K, (rows, cols))


REQUANT_ROWS = 2048  # rows dequantized at a time: a 128k-row Q6_K head never exists whole in fp32


def _requantized(t) -> PackedQuant:
    cols = int(t.shape[0])
    data = np.asarray(t.data)
    data = data.reshape(-1, data.shape[-1])
    codes, scales = [], []
    for r0 in range(0, data.shape[0], REQUANT_ROWS):
        try:
            values = gguf.quants.dequantize(data[r0:r0 + REQUANT_ROWS], t.tensor_type)
        except NotImplementedError:
            raise HardyError(f"GGUF tensor {t.name}: type {t.tensor_type.name} is not supported") from None
        qt = rtn(torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(-1, cols)), INT8_G32)
        part = qt.packed()
        codes.append(part["qweight"])
        scales.append(part["scales"])
    return PackedQuant({"qweight": torch.cat(codes), "scales": torch.cat(scales)}, INT8_G32, (data.shape[0], cols))


def is_quantized(t) -> bool:
    return t.tensor_type.name not in FLOAT_TYPES and len(t.shape) == 2


def conversion(type_name: str) -> str:
    """How a GGUF type becomes a hardy quantized tensor (for the load summary and docs)."""
    return EXACT.get(type_name, "re-quantized to int8 g32")


# A large matrix is converted this many bytes of the file at a time, each part's mapped pages dropped
# once it is written (`pages`): loading then holds the converted tensor and one part of the file, not
# the whole file tensor as well (a 151,936 x 2048 Q4_0 LM head: 175 MB more peak RSS otherwise).
CONVERT_PART_BYTES = 16 << 20


def _converted_in_cpp(t, order: torch.Tensor | None, tp: TPSlice | None = None,
                      converter=None, pages=None) -> PackedQuant | None:
    """Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K straight into the kernels' tiled layout, rows reordered on the way,
    by the kernels extension (`converter`: hardy.compress.kernels.load(), passed in by the loader, which
    sits above both); None where it is not given or not built (then the numpy path). `order`:
    the source row of each output row (fewer than the file's for a colwise rank); `tp` rowwise: only
    that rank's input columns are read. `pages` (hardy.formats.gguf_reader.TensorRows): the file rows'
    pages are mapped before each part is read and dropped after it is written, where parts are read in
    file order; otherwise all of them up front."""
    name = t.tensor_type.name
    module = converter if name in ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K") else None
    if module is None:
        return None
    values, block_bytes = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q4_K": (256, 144),
                           "Q5_K": (256, 176), "Q6_K": (256, 210)}[name]
    blocks, rows, cols = _blocks(t, values, block_bytes)
    in_file_order = order is None and not (tp is not None and tp.kind == "rowwise")
    if pages is not None and not in_file_order:
        pages.prefetch(0, rows)
    if tp is not None and tp.kind == "rowwise":  # whole blocks of this rank's columns, copied out of the map
        b0, b1 = _column_blocks(t, tp, cols, values)
        blocks, cols = np.ascontiguousarray(blocks[:, b0:b1]), (b1 - b0) * values
    with warnings.catch_warnings():  # a read-only view of the mapped file: read, never written
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.from_numpy(blocks.reshape(rows, -1))
    order = torch.arange(rows) if order is None else order
    spec = spec_for(name)
    n_out = order.numel()
    step = max(8, CONVERT_PART_BYTES // max(1, raw.shape[1]) // 8 * 8)  # whole tiles of 8 rows per part
    parts = None
    for r0 in range(0, n_out, step):
        r1 = min(n_out, r0 + step)
        if pages is not None and in_file_order:
            pages.prefetch(r0, r1)
        part = _convert_rows(module, name, raw, order[r0:r1])
        if r0 == 0 and r1 == n_out:
            parts = part
        else:  # each tensor's first dimension counts tiles of 8 rows (qweight: 8 entries per tile)
            per_tile = [p.shape[0] // -(-(r1 - r0) // 8) for p in part]
            if parts is None:
                parts = [torch.empty((-(-n_out // 8) * k,) + tuple(p.shape[1:]), dtype=p.dtype)
                         for p, k in zip(part, per_tile)]
            for whole, p, k in zip(parts, part, per_tile):
                whole[r0 // 8 * k:r0 // 8 * k + p.shape[0]].copy_(p)
        if pages is not None and in_file_order:
            pages.release(r0, r1)
    keys = ("qweight", "scales", "mins")[:len(parts)]
    return PackedQuant(dict(zip(keys, parts)), spec, (n_out, cols), tiled=True)


def _convert_rows(module, name: str, raw: torch.Tensor, order: torch.Tensor) -> list[torch.Tensor]:
    """The converter's tensors (qweight, scales[, mins]) for the file's rows `order`, in that order."""
    if name == "Q6_K":  # the 6-bit form (the table above): only the rows wanted, in their order
        return list(module.q6k_to_tiled(raw[order].contiguous()))
    if name in ("Q4_K", "Q5_K"):
        return list((module.q4k_to_tiled if name == "Q4_K" else module.q5k_to_tiled)(raw, order))
    if name == "Q8_0":
        return list(module.q8_gguf_to_tiled(raw, order))
    q, scales, mins = module.q4_gguf_to_tiled(raw, name == "Q4_1", order)
    return [q, scales] if name == "Q4_0" else [q, scales, mins]  # Q4_0: the symmetric grid has no mins


def _column_blocks(t, tp: TPSlice, cols: int, values: int) -> tuple[int, int]:
    """The rank's input columns as a range of whole blocks of the tensor's type."""
    c0, c1 = tp.span(cols)
    if cols % tp.parts or c0 % values or c1 % values:
        raise HardyError(f"--tp {tp.parts}: GGUF tensor {t.name} ({t.tensor_type.name}, {cols} columns in blocks "
                         f"of {values}) does not split into {tp.parts} processes along whole blocks")
    return c0 // values, c1 // values


def packed_from_gguf(t, heads: int | None = None, tp: TPSlice | None = None, converter=None,
                     pages=None) -> PackedQuant:
    """One quantized 2-D GGUF tensor as hardy's packed format; `heads`: undo llama.cpp's q/k row
    permutation (hardy.formats.names.unpermute_qk) on the way; `tp`: read only one tensor-parallel
    rank's rows (colwise) or columns (rowwise) of it — the rest of the file is never touched;
    `converter`: the compiled converters (see `_converted_in_cpp`), else numpy; `pages`: the tensor's
    hardy.formats.gguf_reader.TensorRows, to map its pages ahead of reading (and drop them as it goes)."""
    rows = int(np.prod([int(d) for d in t.shape[1:]]))
    order = None
    if heads:
        order = unpermute_qk(torch.arange(rows), heads)
    if tp is not None and tp.kind == "colwise":
        if rows % tp.parts:
            raise HardyError(f"--tp {tp.parts}: GGUF tensor {t.name} has {rows} rows, which do not split into "
                             f"{tp.parts} processes")
        r0, r1 = tp.span(rows)
        order = (torch.arange(rows) if order is None else order)[r0:r1]
    fast = _converted_in_cpp(t, order, tp, converter, pages)
    if fast is None:
        if pages is not None:
            pages.prefetch(0, rows)
        fast = _packed_in_file_order(t)
        if tp is not None and tp.kind == "rowwise":
            fast = _column_slice(fast, t, tp)
        if order is not None:
            fast = fast.map_rows(lambda x: x[order])
    if tp is not None:
        fast.tp_slice = tp
    return fast


def _column_slice(q: PackedQuant, t, tp: TPSlice) -> PackedQuant:
    """The numpy path's rowwise slice: whole groups of 32 of the stored tensors."""
    rows, cols = q.shape
    values = gguf_block_values(t)
    b0, b1 = _column_blocks(t, tp, cols, values)
    c0, c1 = b0 * values, b1 * values
    stored = q.stored()
    per_byte = 2 if q.spec.bits == 4 else 1  # codes per stored byte (one per byte at 3, 5 and 8 bits)
    parts = {"qweight": stored["qweight"][:, c0 // per_byte:c1 // per_byte].contiguous()}
    # columns per stored entry: a group of 32 (the K-quant form: sc and m of a group, 16 columns each;
    # d and dmin of a super-block of 256, 128 each)
    per_entry = {"scales": 32, "mins": 32}
    if q.spec.super_block:
        per_entry = {"scales": 16, "mins": 256 if q.spec.symmetric else 128}
    for name, width in per_entry.items():
        if name in stored:
            parts[name] = stored[name][:, c0 // width:c1 // width].contiguous()
    return PackedQuant(parts, q.spec, (rows, c1 - c0))


def gguf_block_values(t) -> int:
    """Values per block of the tensor's GGUF type (32 for the legacy types, 256 for K-quants)."""
    return gguf.GGML_QUANT_SIZES[t.tensor_type][0]


def _packed_in_file_order(t) -> PackedQuant:
    name = t.tensor_type.name
    if name == "Q4_0":
        return _q4_legacy(t, with_min=False)
    if name == "Q4_1":
        return _q4_legacy(t, with_min=True)
    if name == "Q8_0":
        return _q8_0(t)
    if name == "Q5_0":
        return _q5_0(t)
    if name in ("Q4_K", "Q5_K"):
        return _k_quant(t, five=name == "Q5_K")
    if name == "Q6_K":
        return _q6_k(t)
    return _requantized(t)


def check_unpacks(q: PackedQuant, where: str) -> None:
    """Shapes agree with the spec (what QuantTensor.from_packed checks, without unpacking 8-bit)."""
    rows, cols = q.shape
    groups = q.spec.groups(cols)
    per_row = 2 * groups if q.spec.super_block and not q.spec.symmetric else groups  # 4-bit K: sc and m per group
    if q.tiled:
        padded = -(-rows // 8) * 8
        want, want_scales = (padded, cols // 2 if q.spec.bits in (4, 5, 6) else cols), (padded // 8, per_row, 8)
    else:
        want, want_scales = ((rows, cols // 2) if q.spec.bits == 4 else (rows, cols)), (rows, per_row)
    if tuple(q.parts["qweight"].shape) != want or tuple(q.parts["scales"].shape) != want_scales:
        raise HardyError(f"{where}: quantized tensors do not match {q.spec.to_dict()} for shape {q.shape}")



def spec_for(type_name: str) -> QuantSpec:
    """The hardy format a quantized GGUF type loads as (see the table above)."""
    if type_name == "Q4_0":
        return INT4_SYM_G32
    if type_name == "Q5_0":
        return INT5_G32
    if type_name == "Q4_K":
        return INT4_K
    if type_name == "Q5_K":
        return INT5_K
    if type_name == "Q6_K":
        return INT6_K
    return INT4_G32 if type_name == "Q4_1" else INT8_G32
