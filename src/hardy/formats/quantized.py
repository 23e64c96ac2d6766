"""Weight quantization formats: group-wise integer codes with fp16 scales (docs/quantization.md).

Three grids, each chosen so that llama.cpp's blocks are the same numbers:
  symmetric (int8):   w = code · scale,               code ∈ [−127, 127]   (GGUF Q8_0 at group 32)
  symmetric (5/4/3):  w = (code − 2^(b−1)) · scale,   code ∈ [0, 2^b − 1]  (GGUF Q5_0 / Q4_0 at 5 / 4 bits,
                      group 32: no min stored — 18 bytes per 32 weights against Q4_1's 20)
  asymmetric (4/3):   w = code · scale + min,         code ∈ [0, 2^b − 1]  (GGUF Q4_1 at 4 bits, group 32)
`scale` and `min` are stored as fp16 and the arithmetic is fp32, exactly as llama.cpp dequantizes,
so hardy's int8/int4 tensors repack into GGUF blocks losslessly.
The K-quant form (`super_block` 256: GGUF Q4_K and Q5_K, exact) stores each group's scale and min as
6-bit integers sc and m and each super-block's fp16 factors d and dmin:
  w = code · (d·sc) − dmin·m,  code ∈ [0, 15] or [0, 31]   (both products exact in fp32, as llama.cpp)
and its 6-bit symmetric variant (GGUF Q6_K, exact) an int8 sc per 16 values and fp16 d per super-block:
  w = (code − 32) · (d·sc),    code ∈ [0, 63]
A group is `group_size` consecutive input columns of one output row (group 0 = the whole row: per-channel).
4-bit codes are packed two per byte in blocks of 32 columns: byte j of a block holds code j in its
low nibble and code j + 16 in its high nibble (GGUF's Q4 order). 3-bit codes are kept one per byte
(the size they would have packed is reported; their accuracy is what is evaluated), and so are 5-bit
codes on disk; the kernels hold them as the low nibbles in the 4-bit layout plus a plane of fifth bits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hardy.errors import HardyError

PACK_BLOCK = 32


@dataclass(frozen=True)
class QuantSpec:
    bits: int
    group_size: int = 0  # 0: one group per output row
    symmetric: bool | None = None  # default: symmetric for 8 bits, asymmetric below
    super_block: int = 0  # 256: a K-quant form (module docstring); 0: fp16 scales and mins per group

    def __post_init__(self):
        k_form = (self.bits, self.group_size, self.symmetric, self.super_block)
        if self.super_block and k_form not in ((4, 32, False, 256), (5, 32, False, 256), (6, 16, True, 256)):
            raise HardyError(f"the K-quant forms are 4- or 5-bit asymmetric in groups of 32 or 6-bit symmetric in "
                             f"groups of 16, in super-blocks of 256 (got {self.bits}-bit, group {self.group_size}, "
                             f"super-block {self.super_block})")
        if self.bits not in (8, 5, 4, 3) and not (self.bits == 6 and self.super_block):  # 6: GGUF Q6_K's form only
            raise HardyError(f"--bits must be 8, 5, 4 or 3 (got {self.bits})")
        if self.group_size < 0 or (self.group_size and self.group_size % PACK_BLOCK and self.bits == 4):
            raise HardyError(f"--group-size must be 0 (per channel) or a multiple of {PACK_BLOCK} (got {self.group_size})")
        if self.symmetric is None:
            object.__setattr__(self, "symmetric", self.bits == 8)

    @property
    def code_dtype(self) -> torch.dtype:
        """Unpacked codes: signed for the symmetric 8-bit grid, unsigned (offset) below 8 bits."""
        return torch.int8 if self.bits == 8 and self.symmetric else torch.uint8

    @property
    def offset(self) -> int:
        """The code of zero on a symmetric grid below 8 bits (8 at 4 bits, as in Q4_0); else 0."""
        return 1 << (self.bits - 1) if self.symmetric and self.bits < 8 else 0

    @property
    def maxq(self) -> int:
        return 127 if self.bits == 8 and self.symmetric else (1 << self.bits) - 1

    def group_width(self, in_features: int) -> int:
        return min(self.group_size or in_features, in_features)

    def groups(self, in_features: int) -> int:
        """Groups per row; a last group may be narrower (SmolLM2's 576 columns = 4 x 128 + 64)."""
        return -(-in_features // self.group_width(in_features))

    def to_dict(self) -> dict:
        d = {"bits": self.bits, "group_size": self.group_size, "symmetric": self.symmetric}
        return {**d, "super_block": self.super_block} if self.super_block else d

    @classmethod
    def from_dict(cls, d: dict) -> "QuantSpec":
        return cls(bits=int(d["bits"]), group_size=int(d["group_size"]), symmetric=bool(d["symmetric"]),
                   super_block=int(d.get("super_block", 0)))


def group_params(w: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(scale, min) per group for w [rows, columns] (all columns one group), fp16-rounded, as fp32."""
    w = w.float()
    if spec.offset:  # llama.cpp's Q4_0 rule: the group's largest-magnitude value maps to code 0 exactly
        extreme = w.gather(-1, w.abs().argmax(dim=-1, keepdim=True))
        scale = (extreme / -spec.offset).half().float()
        return torch.where(scale == 0, torch.ones_like(scale), scale), None
    if spec.symmetric:
        scale = w.abs().amax(dim=-1, keepdim=True) / spec.maxq
        scale = scale.half().float()
        return torch.where(scale == 0, torch.ones_like(scale), scale), None
    lo, hi = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
    scale = ((hi - lo) / spec.maxq).half().float()
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return scale, lo.half().float()


def quantize_with(w: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor | None, spec: QuantSpec) -> torch.Tensor:
    """Codes of w under given group parameters (broadcast over the group's columns)."""
    if spec.offset:
        return torch.clamp(torch.round(w.float() / scale) + spec.offset, 0, spec.maxq)
    if spec.symmetric:
        return torch.clamp(torch.round(w.float() / scale), -spec.maxq, spec.maxq)
    return torch.clamp(torch.round((w.float() - mn) / scale), 0, spec.maxq)


def dequantize_with(codes: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor | None, offset: int = 0) -> torch.Tensor:
    """code · scale (+ min); a symmetric grid below 8 bits subtracts its offset first: (code − offset) · scale."""
    out = (codes.float() - offset) * scale if offset else codes.float() * scale
    return out if mn is None else out + mn


@dataclass
class QuantTensor:
    """A quantized weight [out, in]: unpacked codes (int8 for symmetric, uint8 otherwise) and fp16
    scale/min of shape [out, groups]. The K-quant form: scale and min are the 6-bit sc and m (uint8
    [out, groups]) and `supers` the fp16 d and dmin of each super-block ([out, super-blocks, 2])."""

    codes: torch.Tensor
    scale: torch.Tensor
    mins: torch.Tensor | None
    spec: QuantSpec
    supers: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def group_scales(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each group's scale and min as fp32 [out, groups] (the K-quant form's d·sc and −dmin·m)."""
        if not self.spec.super_block:
            return self.scale.float(), None if self.mins is None else self.mins.float()
        per = self.spec.super_block // self.spec.group_size
        if self.spec.symmetric:  # the 6-bit form: d only
            return self.supers.float().repeat_interleave(per, dim=1) * self.scale.float(), None
        d, dmin = (f.repeat_interleave(per, dim=1) for f in self.supers.float().unbind(-1))
        return d * self.scale.float(), -(dmin * self.mins.float())

    def dequantize(self) -> torch.Tensor:
        cols = self.codes.shape[1]
        g = self.spec.group_width(cols)
        scale, mins = self.group_scales()
        scale = scale.repeat_interleave(g, dim=1)[:, :cols]
        mins = None if mins is None else mins.repeat_interleave(g, dim=1)[:, :cols]
        return dequantize_with(self.codes, scale, mins, self.spec.offset)

    def packed(self) -> dict[str, torch.Tensor]:
        """The stored tensors: qweight (int8 codes, packed 4-bit bytes, or 3-bit codes), scales, mins.
        The K-quant form: scales holds each group's sc and m in turn (uint8 [out, 2 x groups]) and
        mins each super-block's d and dmin (fp16 [out, 2 x super-blocks]): the kernels' three tensors."""
        if self.spec.bits == 4:
            qweight = pack_int4(self.codes)
        else:
            qweight = self.codes.to(self.spec.code_dtype)
        if self.spec.super_block and self.spec.symmetric:  # codes one per byte, int8 sc, d widened to fp32
            return {"qweight": qweight.contiguous(), "scales": self.scale.to(torch.int8).contiguous(),
                    "mins": self.supers.float().contiguous()}
        if self.spec.super_block:
            scales = torch.stack((self.scale, self.mins), dim=-1).to(torch.uint8).reshape(self.shape[0], -1)
            return {"qweight": qweight.contiguous(), "scales": scales,
                    "mins": self.supers.half().reshape(self.shape[0], -1).contiguous()}
        out = {"qweight": qweight.contiguous(), "scales": self.scale.half().contiguous()}
        if self.mins is not None:
            out["mins"] = self.mins.half().contiguous()
        return out

    @classmethod
    def from_packed(cls, tensors: dict[str, torch.Tensor], spec: QuantSpec, shape: tuple[int, int],
                    where: str = "") -> "QuantTensor":
        try:
            qweight, scales = tensors["qweight"], tensors["scales"]
            mins = tensors.get("mins")
            codes = (unpack_int4(qweight) if spec.bits == 4 else qweight).to(spec.code_dtype)
            groups = spec.groups(shape[1])
            if spec.super_block:
                return cls._k_form(codes, scales, mins, spec, shape)
            if tuple(codes.shape) != tuple(shape) or tuple(scales.shape) != (shape[0], groups) or (
                    (mins is None) != spec.symmetric) or (mins is not None and mins.shape != scales.shape):
                raise KeyError("shape")
        except (KeyError, RuntimeError):
            raise HardyError(f"{where}: quantized tensors do not match {spec.to_dict()} for shape {shape}") from None
        return cls(codes=codes, scale=scales.half(), mins=None if mins is None else mins.half(), spec=spec)

    @classmethod
    def _k_form(cls, codes, scales, mins, spec: QuantSpec, shape) -> "QuantTensor":
        rows, cols = shape
        if spec.symmetric:
            if (tuple(codes.shape) != tuple(shape) or cols % spec.super_block or scales.dtype != torch.int8
                    or tuple(scales.shape) != (rows, cols // spec.group_size) or mins is None
                    or tuple(mins.shape) != (rows, cols // spec.super_block)):
                raise KeyError("shape")
            return cls(codes=codes, scale=scales, mins=None, spec=spec, supers=mins.float())
        if (tuple(codes.shape) != tuple(shape) or cols % spec.super_block or scales.dtype != torch.uint8
                or tuple(scales.shape) != (rows, 2 * cols // spec.group_size) or mins is None
                or tuple(mins.shape) != (rows, 2 * cols // spec.super_block)):
            raise KeyError("shape")
        pairs = scales.reshape(rows, -1, 2)
        return cls(codes=codes, scale=pairs[..., 0].contiguous(), mins=pairs[..., 1].contiguous(), spec=spec,
                   supers=mins.half().reshape(rows, -1, 2))

    def stored_bits(self) -> float:
        """Bits per weight including scales and mins (3-bit codes counted as if packed)."""
        n = self.codes.numel()
        if self.spec.super_block:  # a byte each for sc (and m); fp16 d and dmin, or d held as fp32
            per_sc = 8 if self.spec.symmetric else 16
            return (self.spec.bits * n + per_sc * self.scale.numel() + 8 * self.supers.element_size()
                    * self.supers.numel()) / n
        extra = 16 * self.scale.numel() * (1 if self.mins is None else 2)
        return (self.spec.bits * n + extra) / n


def grouped(t: torch.Tensor, g: int, fill: str = "edge") -> torch.Tensor:
    """[..., cols] -> [..., groups, g]; a narrower last group is padded by repeating its last column
    ("edge": min, max and |max| unchanged) or with zeros ("zero": no contribution to a dot product)."""
    cols = t.shape[-1]
    pad = -cols % g
    if pad:
        extra = t[..., -1:].expand(*t.shape[:-1], pad) if fill == "edge" else t.new_zeros(*t.shape[:-1], pad)
        t = torch.cat([t, extra], dim=-1)
    return t.reshape(*t.shape[:-1], t.shape[-1] // g, g)


def fake_quantize_groups(wg: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Round-to-nearest and back to float on grouped weights [..., groups, g]: what rtn(...).dequantize()
    holds, bit for bit (the same fp32 operations), without packing codes or regrouping. AWQ's searches
    score hundreds of candidates per linear with it."""
    scale, mn = group_params(wg, spec)
    return dequantize_with(quantize_with(wg, scale, mn, spec), scale, mn, spec.offset)


def fake_quantize(w: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """rtn(w, spec).dequantize() for w [out, in], bit for bit, faster."""
    out, cols = w.shape
    return fake_quantize_groups(grouped(w.float(), spec.group_width(cols)), spec).reshape(out, -1)[:, :cols]


def rtn(w: torch.Tensor, spec: QuantSpec) -> QuantTensor:
    """Round-to-nearest on the group grid."""
    out, cols = w.shape
    wg = grouped(w.float(), spec.group_width(cols))
    scale, mn = group_params(wg, spec)
    codes = quantize_with(wg, scale, mn, spec).reshape(out, -1)[:, :cols]
    return QuantTensor(codes=codes.to(spec.code_dtype), scale=scale.squeeze(-1).half(),
                       mins=None if mn is None else mn.squeeze(-1).half(), spec=spec)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[out, in] codes 0..15 -> [out, in/2] bytes in GGUF Q4 block order."""
    out, cols = codes.shape
    if cols % PACK_BLOCK:
        raise HardyError(f"4-bit packing needs a multiple of {PACK_BLOCK} columns (got {cols})")
    blocks = codes.to(torch.uint8).reshape(out, cols // PACK_BLOCK, 2, PACK_BLOCK // 2)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(out, cols // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    out, half = packed.shape
    blocks = packed.reshape(out, half * 2 // PACK_BLOCK, PACK_BLOCK // 2)
    return torch.stack((blocks & 15, blocks >> 4), dim=2).reshape(out, half * 2)


# The kernels' tiled layout (csrc/qgemv.cpp reads it; GGUF loading converts straight into it).
TILE = 8  # rows interleaved per tile (csrc/qgemv.cpp, matrix_tiles)
# Where code j's fifth bit goes in its row's 32-bit word of a block (csrc/qgemv.cpp, fifth_bits): byte i,
# bit 2c + h, for j = 16h + 4c + i — the byte and bit the tile loop reads for chunk c's nibble h.
FIFTH_BIT_AT = torch.tensor([8 * (j % 4) + 2 * ((j % 16) // 4) + j // 16 for j in range(PACK_BLOCK)])


def tile_codes(stored: dict[str, torch.Tensor], bits: int = 0) -> dict[str, torch.Tensor]:
    """int4 or int8 qweight/scales[/mins] from the stored layout ([rows, bytes]: GGUF Q4 blocks or
    int8 codes; [rows, groups]) to the kernel's: rows padded to a multiple of 8 with zeros, each
    tile's row bytes as 4-byte chunks of its 8 rows in turn, scales and mins [tiles, groups, 8] (no
    mins on a symmetric grid). A byte permutation: nothing is re-quantized, and `untile_codes`
    restores the stored tensors exactly. `bits` 5: codes one per byte become their low nibbles in the
    int4 layout and `high`, each row's fifth bits per block of 32 as one int32 [tiles, blocks, 8].
    `bits` 6 (the 6-bit K-quant form): the low nibbles likewise, and `mins` becomes the fifth and
    sixth bit planes and d (fp32 bits), int32 [tiles, 2 x blocks + super-blocks, 8]. `bits` 5 in the
    K-quant form (uint8 sc/m scales): `mins` becomes each tile's fifth-bit plane followed by its fp16
    d/dmin (as the 4-bit K-quant form tiles them), int32 [tiles, blocks + super-blocks, 8]."""
    if bits == 6:
        codes, d = stored["qweight"], stored["mins"]
        aux = torch.cat([_bit_plane(codes, 4), _bit_plane(codes, 5), d.float().contiguous().view(torch.int32)], dim=1)
        return tile_codes({"qweight": pack_int4(codes & 15), "scales": stored["scales"], "mins": aux})
    if bits == 5 and "mins" in stored:  # the 5-bit K-quant form
        codes = stored["qweight"]
        out = tile_codes({"qweight": pack_int4(codes & 15), "scales": stored["scales"], "mins": stored["mins"]})
        high = _tiled_plane(_bit_plane(codes, 4))
        supers = out["mins"].reshape(high.shape[0], -1, 2 * TILE).view(torch.int32)  # [tiles, super-blocks, 8]
        return {**out, "mins": torch.cat([high, supers], dim=1)}
    if bits == 5:
        codes = stored["qweight"]
        out = tile_codes({"qweight": pack_int4(codes & 15), "scales": stored["scales"]})
        return {**out, "high": _tiled_plane(_bit_plane(codes, 4))}
    q, per_group = stored["qweight"], {k: stored[k] for k in ("scales", "mins") if k in stored}
    rows, width = q.shape
    pad = -rows % TILE
    if pad:
        q = torch.cat([q, q.new_zeros(pad, width)])
        per_group = {k: torch.cat([t, t.new_zeros(pad, t.shape[1])]) for k, t in per_group.items()}
    tiles = q.shape[0] // TILE
    out = {"qweight": q.view(tiles, TILE, width // 4, 4).transpose(1, 2).reshape(tiles * TILE, width)}
    out.update({k: t.view(tiles, TILE, -1).transpose(1, 2).contiguous() for k, t in per_group.items()})
    return out


def _tiled_plane(plane: torch.Tensor) -> torch.Tensor:
    """A plane [rows, blocks] in the kernels' layout: rows padded to whole tiles, [tiles, blocks, 8]."""
    rows = plane.shape[0]
    plane = torch.cat([plane, plane.new_zeros(-rows % TILE, plane.shape[1])]) if rows % TILE else plane
    return plane.view(-1, TILE, plane.shape[1]).transpose(1, 2).contiguous()


def _bit_plane(codes: torch.Tensor, bit: int) -> torch.Tensor:
    """Bit `bit` of every code, one int32 per row and block of 32 in the tile loop's order [rows, blocks]."""
    rows, cols = codes.shape
    plane = (((codes >> bit) & 1).to(torch.int64).view(rows, cols // PACK_BLOCK, PACK_BLOCK) << FIFTH_BIT_AT).sum(-1)
    return plane.to(torch.int32)


def _from_bit_planes(low: torch.Tensor, plane: torch.Tensor, bit: int) -> torch.Tensor:
    """Codes with bit `bit` set from a plane [rows, blocks] (the inverse of _bit_plane)."""
    bits = ((plane.to(torch.int64) & 0xFFFFFFFF)[:, :, None] >> FIFTH_BIT_AT) & 1
    return low | (bits.reshape(low.shape) << bit).to(torch.uint8)


def _six_bit_form(tiled: dict[str, torch.Tensor]) -> bool:
    """Kernel-layout tensors of the 6-bit K-quant form: int8 sub-block scales beside the bit planes."""
    return "mins" in tiled and tiled["scales"].dtype == torch.int8


def _with_six_bits(nibbles: dict[str, torch.Tensor], aux: torch.Tensor) -> dict[str, torch.Tensor]:
    """The 6-bit form's stored tensors (codes one per byte, int8 scales, fp32 d) from the kernel's."""
    low = unpack_int4(nibbles["qweight"])
    nb = low.shape[1] // PACK_BLOCK
    codes = _from_bit_planes(_from_bit_planes(low, aux[:, :nb], 4), aux[:, nb:2 * nb], 5)
    return {"qweight": codes, "scales": nibbles["scales"], "mins": aux[:, 2 * nb:].contiguous().view(torch.float32)}


def _with_fifth_bits(nibbles: dict[str, torch.Tensor], high: torch.Tensor) -> dict[str, torch.Tensor]:
    """Stored 5-bit codes (one per byte) from the low nibbles' stored layout and rows' fifth bits [rows, blocks]."""
    return {**nibbles, "qweight": _from_bit_planes(unpack_int4(nibbles["qweight"]), high, 4)}


def _split_five_bit_k_form(tiled: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The 5-bit K-quant form's kernel tensors with its int32 `mins` split back into the fifth-bit plane
    (`high`, as the 5-bit grid keeps it) and fp16 d/dmin [tiles, 2 x super-blocks, 8] (the 4-bit form's)."""
    if not ("mins" in tiled and tiled["scales"].dtype == torch.uint8 and tiled["mins"].dtype == torch.int32):
        return tiled
    aux = tiled["mins"]
    blocks = tiled["qweight"].shape[1] * 2 // PACK_BLOCK
    supers = aux[:, blocks:].contiguous().view(torch.float16).reshape(aux.shape[0], -1, TILE)
    return {**tiled, "high": aux[:, :blocks], "mins": supers}


def tiled_rows(tiled: dict[str, torch.Tensor], rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """The stored-layout tensors of the given rows only (embedding lookups read a few rows)."""
    tiled = _split_five_bit_k_form(tiled)
    q = tiled["qweight"]
    width = q.shape[1]
    tile, lane = rows // TILE, rows % TILE
    out = {"qweight": q.view(-1, width // 4, TILE, 4)[tile, :, lane].reshape(-1, width)}
    for name in ("scales", "mins"):
        if name in tiled:
            out[name] = tiled[name][tile, :, lane]
    if _six_bit_form(tiled):
        return _with_six_bits(out, out.pop("mins"))
    if "high" in tiled:
        return _with_fifth_bits(out, tiled["high"][tile, :, lane])
    return out


def untile_codes(tiled: dict[str, torch.Tensor], rows: int) -> dict[str, torch.Tensor]:
    """All rows back in the stored layout (the inverse permutation: one copy, no gather)."""
    tiled = _split_five_bit_k_form(tiled)
    q = tiled["qweight"]
    padded, width = q.shape
    out = {"qweight": q.view(padded // TILE, width // 4, TILE, 4).transpose(1, 2).reshape(padded, width)}
    for name in ("scales", "mins"):
        if name in tiled:
            out[name] = tiled[name].transpose(1, 2).reshape(padded, -1)
    out = {name: t[:rows] for name, t in out.items()}
    if _six_bit_form(tiled):
        return _with_six_bits(out, out.pop("mins"))
    if "high" in tiled:
        return _with_fifth_bits(out, tiled["high"].transpose(1, 2).reshape(padded, -1)[:rows])
    return out
