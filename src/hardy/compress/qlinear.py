"""Quantized layers for inference: the load-time half of "quantization = an offline state-dict
transform + a module swap". A `QuantLinear` holds the stored tensors (packed codes, fp16 scales and
mins) and never a float copy of its weight; `QuantEmbedding` dequantizes only the rows it looks up.

forward(): many tokens (prefill, evaluation) dequantize the weight a slab at a time and run float
GEMMs — the dequantization is amortized over the tokens; a few tokens (decode, batched decode, short
prompts) go through `hardy.compress.kernels`, the fused path chosen by measurement (docs/quantization.md).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from hardy.formats.quantized import QuantTensor, tile_codes, tiled_rows, untile_codes

if TYPE_CHECKING:  # the gguf package (and, with it, sentencepiece's OpenMP runtime) only where a file is read
    from hardy.formats.gguf_quant import PackedQuant

# At most this many rows use the fused decode kernel (batched decode, short prompts): it beats the
# slab path up to ~64 tokens, from SmolLM2's layers to 8B ones (bench/kernel_tokens.py).
FUSED_MAX_TOKENS = 32
# Prefill dequantizes the weights a slab of rows at a time (this many bytes of float weights: in L2/L3).
PREFILL_SLAB_BYTES = 4 * 2 ** 20
# In bf16, slabs of this many rows: oneDNN's AMX GEMM ran a 512-token prompt's slabs about half as fast at
# 512 rows (what 4 MB gives at width 4,096) as at 768-2,048 (bench/prefill_slabs.py, bench/history.md).
PREFILL_BF16_ROWS = 1024


def set_prefill_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """The GEMM dtype of many-token products on fp32 activations in `model`'s quantized layers: fp32
    (exact: evaluation, the default) or bf16, which inference sets where the CPU has native bf16 dot
    products (the fp32 activations are rounded at the GEMM input, as llama.cpp rounds them to int8)."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"prefill dtype must be float32 or bfloat16, not {dtype}")
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.prefill_dtype = dtype


def set_activation_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """Run a quantized model's forward passes with activations in `dtype` (float32, or bfloat16 where the
    CPU has native bf16 dot products): its float parameters outside the quantized layers (norm weights,
    float embeddings and heads) are cast, quantized embeddings look up rows in `dtype`, and the quantized
    layers' many-token GEMMs run in it. Norms still reduce in float32 (RMSNorm upcasts); the rotary tables
    are rounded to `dtype` where they are applied. For scoring passes (eval rank): the fused decode stack
    takes float32 norms only and leaves a bf16 model to the modules."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"activation dtype must be float32 or bfloat16, not {dtype}")
    set_prefill_dtype(model, dtype)
    for m in model.modules():
        if isinstance(m, QuantLinear):
            continue  # its codes and scales are what they are; a float bias follows the output's dtype
        if isinstance(m, QuantEmbedding):
            m.dtype = dtype
        for p in m.parameters(recurse=False):
            if p.is_floating_point():
                p.data = p.data.to(dtype)


class QuantLinear(nn.Module):
    """`bias`: the layer has a float bias (Qwen2's q/k/v), filled by load_state_dict like any parameter."""

    def __init__(self, qt: QuantTensor | PackedQuant, bias: bool = False):
        super().__init__()
        self.spec = qt.spec
        self.out_features, self.in_features = qt.shape
        for name, tensor in qt.packed().items():
            self.register_buffer(name, tensor)
        if "mins" not in self._buffers:
            self.mins = None
        self.bias = nn.Parameter(torch.zeros(self.out_features)) if bias else None
        # the extension's calls on this layer's bytes (hardy.compress.kernels.LayerKernel), set by prepare()
        self.kernel = None
        self.prefill_dtype = torch.float32  # see set_prefill_dtype
        # codes re-laid for the kernel (prepare, or a GGUF loader that writes that layout
        # directly); state_dict() stays in the stored layout
        packed = not isinstance(qt, QuantTensor)  # a PackedQuant, as a GGUF file is read
        self.tiled = packed and qt.tiled
        # a tensor-parallel rank's part, read as such by the loader (hardy.formats.gguf_quant.TPSlice):
        # apply_tp then only wires it up instead of slicing a whole matrix
        self.tp_slice = qt.tp_slice if packed else None

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        if self.qweight.device.type != "cpu":  # the fused kernels read host memory: off the CPU, PyTorch's path
            self.kernel = None
        return out

    def _tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in ("qweight", "scales", "mins", "high")
                if getattr(self, name, None) is not None}

    def use_tiled_layout(self) -> None:
        """Re-lay the codes for the kernel (hardy.formats.quantized.tile_codes), once."""
        if not self.tiled:
            for name, tensor in tile_codes(self._tensors(), self.spec.bits).items():
                if name in self._buffers:
                    setattr(self, name, tensor)  # replaces the buffer: one copy of the weights either way
                else:
                    self.register_buffer(name, tensor)  # the 5-bit grid's fifth bits
            self.tiled = True

    def stored(self, rows: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """qweight/scales/mins in the stored layout (docs/quantization.md), all rows or some."""
        tensors = self._tensors()
        if self.tiled:
            return untile_codes(tensors, self.out_features) if rows is None else tiled_rows(tensors, rows)
        return tensors if rows is None else {name: t[rows] for name, t in tensors.items()}

    def quant_tensor(self) -> QuantTensor:
        return QuantTensor.from_packed(self.stored(), self.spec, (self.out_features, self.in_features))

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for name, tensor in self.stored().items():
            destination[prefix + name] = tensor if keep_vars else tensor.detach()
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def _load_from_state_dict(self, state_dict, prefix, *args):
        if self.tiled:  # stored layout in, kernel layout kept
            names = [prefix + n for n in self._tensors() if n != "high"]  # no mins on a symmetric grid
            if all(n in state_dict for n in names):
                tiled = tile_codes({n.removeprefix(prefix): state_dict[n] for n in names}, self.spec.bits)
                state_dict = {**state_dict, **{prefix + n: t for n, t in tiled.items()}}
        super()._load_from_state_dict(state_dict, prefix, *args)

    def dequantized_weight(self) -> torch.Tensor:
        return self.quant_tensor().dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and x.numel() <= FUSED_MAX_TOKENS * self.in_features:
            y = self.kernel(x)
        elif self.kernel is not None:
            y = self._slab_forward(x)
        else:
            return F.linear(x, self.dequantized_weight().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def _slab_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Many tokens: the weights dequantized in C++ a slab of rows at a time (never the whole float
        matrix: an 8B model's LM head would be 2 GB of fp32), each slab one GEMM."""
        dtype = self.prefill_dtype if x.dtype == torch.float32 else x.dtype
        if dtype not in (torch.float32, torch.bfloat16):
            dtype = torch.float32
        xd = x.to(dtype)
        if dtype == torch.bfloat16:
            rows = PREFILL_BF16_ROWS
        else:
            rows = max(8, PREFILL_SLAB_BYTES // (self.in_features * xd.element_size()) // 8 * 8)
        if self.out_features <= 2 * rows:  # one slab (a GEMM's rate holds up to ~2,048 rows): no copy out of it
            w = torch.empty(self.out_features, self.in_features, dtype=dtype)
            self.kernel.dequant_range(0, w)
            return F.linear(xd, w).to(x.dtype)
        out = x.new_empty(*x.shape[:-1], self.out_features)
        slab = torch.empty(min(rows, self.out_features), self.in_features, dtype=dtype)
        for r0 in range(0, self.out_features, rows):
            w = slab[:min(rows, self.out_features - r0)]
            self.kernel.dequant_range(r0, w)
            out[..., r0:r0 + w.shape[0]] = F.linear(xd, w)
        return out

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.spec.to_dict()}"


class QuantEmbedding(nn.Module):
    """A quantized lookup table (and, tied, the LM head: `linear` computes x·Wᵀ from the same bytes)."""

    def __init__(self, qt: QuantTensor):
        super().__init__()
        self.table = QuantLinear(qt)
        self.dtype = torch.float32  # of the rows looked up (set_activation_dtype)

    @property
    def weight(self) -> torch.Tensor:  # the float table, for code that reads embedding weights
        return self.table.dequantized_weight()

    def quant_tensor(self) -> QuantTensor:  # what GGUF export repacks (hardy.formats.gguf_export)
        return self.table.quant_tensor()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = self.table
        rows = tokens.reshape(-1)
        if t.kernel is not None:
            out = t.kernel.lookup(rows.long().contiguous())
        else:
            out = QuantTensor.from_packed(t.stored(rows), t.spec, (rows.numel(), t.in_features)).dequantize()
        return out.reshape(*tokens.shape, t.in_features).to(self.dtype)


def swap_quantized(model: nn.Module, quantized: dict[str, QuantTensor]) -> nn.Module:
    """Replace the modules whose weights are in `quantized` (hardy parameter names) by quantized ones."""
    for name, qt in quantized.items():
        module_name = name.removesuffix(".weight")
        parent_name, _, child = module_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if module_name == "tok_embeddings":
            emb = QuantEmbedding(qt)
            setattr(parent, child, emb)
            if getattr(model.cfg, "tie_embeddings", False):
                model.output = emb.table  # the tied head reads the same stored bytes
        else:
            setattr(parent, child, QuantLinear(qt, bias=getattr(getattr(parent, child), "bias", None) is not None))
    return model


def quantized_modules(model: nn.Module) -> dict[str, QuantLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}
