"""The bytes of a model's weights as hardy holds them when they come from a file: a quantized GGUF
loaded natively keeps each tensor in the format its type maps to (hardy.formats.gguf_quant: Q4_0 as
symmetric int4 g32, Q4_1 as int4 g32 with mins, Q4_K / Q5_K / Q6_K in their K-quant forms, Q8_0 and the
rest as int8 g32), and its
float tensors in fp32. `hardy plan serve --quant file` plans with these instead of one uniform format."""
from __future__ import annotations

from dataclasses import dataclass

from hardy.errors import HardyError
from hardy.formats.gguf_io import open_gguf
from hardy.formats.gguf_quant import FLOAT_TYPES, is_quantized, spec_for
from hardy.formats.names import from_format
from hardy.formats.quantized import QuantSpec


@dataclass(frozen=True)
class WeightLayout:
    matmul_bytes: float  # attention + MLP matrices of all layers (read every decode step)
    head_bytes: float  # the LM head; the tied embedding when tied (read every step)
    embedding_bytes: float  # an untied input embedding (one row read per token); 0 when tied
    norm_bytes: float
    types: str  # the file's tensor types, e.g. "Q4_0 x 225, F32 x 65"
    quantized: bool  # any matrix quantized: decode runs hardy's int4/int8 kernels
    expert_bytes: float = 0.0  # of matmul_bytes: every expert of every mixture-of-experts layer

    @property
    def total(self) -> float:
        return self.matmul_bytes + self.head_bytes + self.embedding_bytes + self.norm_bytes


def held_bytes(spec: QuantSpec, rows: int, cols: int) -> float:
    """Bytes of one quantized matrix in memory: codes + an fp16 scale (and, asymmetric, an fp16 min)
    per group, or the K-quant form's byte each of sc and m per group and fp16 d and dmin per
    super-block (rows of int4 padded to whole tiles of 8 are ignored: < 0.1% at real sizes)."""
    groups = spec.groups(cols)
    if spec.super_block:  # 4/5-bit: sc and m bytes, fp16 d and dmin; 6-bit: an int8 sc per 16, d as fp32
        return rows * (cols * spec.bits / 8 + (1 if spec.symmetric else 2) * groups + 4 * cols / spec.super_block)
    per_group = 2 * (1 if spec.symmetric else 2)
    return rows * (cols * spec.bits / 8 + groups * per_group)


def layout_from_gguf(path) -> WeightLayout:
    matmul = head = embedding = norms = experts = 0.0
    counts: dict[str, int] = {}
    quantized = False
    names = set()
    for t in open_gguf(path).tensors:
        ours = from_format(t.name, "gguf")
        if ours is None:
            continue
        names.add(ours)
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
        elements = 1
        for d in t.shape:
            elements *= int(d)
        stacked = len(t.shape) == 3  # a projection of all experts: [experts, rows, columns]
        if is_quantized(t) or (stacked and t.tensor_type.name not in FLOAT_TYPES):
            quantized = True
            rows = int(t.shape[1]) * (int(t.shape[2]) if stacked else 1)
            nbytes = held_bytes(spec_for(t.tensor_type.name), rows, int(t.shape[0]))
        else:
            nbytes = 4.0 * elements  # float tensors load as fp32
        if stacked:
            matmul += nbytes
            experts += nbytes
        elif ours == "output.weight":
            head += nbytes
        elif ours == "tok_embeddings.weight":
            embedding += nbytes
        elif len(t.shape) == 2:
            matmul += nbytes
        else:
            norms += nbytes
    if not matmul:
        raise HardyError(f"{path}: no attention or MLP matrices found")
    if "output.weight" not in names:  # tied: the embedding table is the head
        head, embedding = embedding, 0.0
    types = ", ".join(f"{k} x {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))
    return WeightLayout(matmul, head, embedding, norms, types, quantized, experts)
