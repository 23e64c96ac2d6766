"""The fused decode path for quantized layers: a small C++ extension (csrc/qgemv.cpp) built with the
package, one module per vector ISA (setup.py; kernel_build.py says how), of which the widest this CPU
runs is used. Where the install built none this process can use (torch's C++ ABI changed, an editable
install's sources were edited, the build had no compiler), it is compiled once per machine type on first
use and cached; where that fails too, quantized layers use the plain PyTorch path, said once.

Why an extension (measured, docs/quantization.md): torch's own `_weight_int8pack_mm` is 5x slower
than the fp32 GEMV here, a `torch.compile`d dequantize-GEMV 1.5x slower on SmolLM2's layers
(call overhead), while int8 multiply-adds on int8-quantized activations (llama.cpp's method on
AVX2) stream the 4-bit weights at their own size.

    python -m hardy.compress.kernels          # which build is in use (compiling it if none is)
"""
from __future__ import annotations

import copy
import hashlib
import importlib
import logging
import os
import sys
from pathlib import Path

import torch

from hardy.compress import kernel_build
from hardy.compress.kernel_build import HEADERS, SOURCES
from hardy.compress.qlinear import QuantLinear
from hardy.model.moe import MoE
from hardy.devices import cpu_flags
from hardy.fsio import cache_dir

log = logging.getLogger(__name__)
_module = None
_tried = False


def _isa() -> str:
    """The widest build this CPU runs (HARDY_KERNEL_ISA=generic|avx2 forces a narrower one)."""
    forced = os.environ.get("HARDY_KERNEL_ISA")
    if forced == "generic":  # the portable build (tests, odd CPUs)
        return "generic"
    flags = cpu_flags()
    if not {"avx2", "fma", "f16c"} <= flags:
        return "generic"
    if forced != "avx2" and {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
        return "avx512vnni"
    return "avx2"


def openmp_link_flags() -> list[str]:
    return kernel_build.openmp_link_flags(Path(torch.__file__).resolve().parent / "lib")


def build_dir() -> Path:
    return cache_dir("kernels")


def installed(isa: str):
    """(the module the install built for `isa`, None) where this process can use it, else (None, why)."""
    try:
        module = importlib.import_module(kernel_build.module_name(isa))
    except ImportError as e:
        return None, f"none was built at install ({str(e).splitlines()[0][:120]})"
    running = torch.__version__.split("+")[0]
    if module.built_for_torch() != running:
        return None, f"the installed build is for torch {module.built_for_torch()}, this is torch {running}"
    if module.sources_digest() != kernel_build.sources_digest():
        return None, "the sources changed since the install built them"
    return module, None


def cached_build(isa: str) -> tuple[str, Path]:
    """The name and cache directory of the `isa` build compiled on first use."""
    version = torch.__version__.split("+")[0].replace(".", "_")
    # the sources' paths and bytes in the name: two checkouts (or two versions) sharing the cache each keep
    # their own build instead of rebuilding over each other's (a rebuild: ~30 s here)
    digest = hashlib.sha256(b"".join(str(p).encode() + p.read_bytes() for p in SOURCES + HEADERS)).hexdigest()[:10]
    name = f"hardy_qgemv_{isa}_t{version}_py{sys.version_info.major}{sys.version_info.minor}_{digest}"
    return name, build_dir() / name


def compile_now(isa: str, verbose: bool = False):
    """Compile the `isa` build into the cache (once per machine type, sources and torch version), or
    load it from there."""
    # start-up: cpp_extension pulls in setuptools; only a compile on first use needs it
    from torch.utils.cpp_extension import load as load_extension

    name, directory = cached_build(isa)
    directory.mkdir(parents=True, exist_ok=True)
    return load_extension(name=name, sources=[str(p) for p in SOURCES], extra_cflags=kernel_build.compile_flags(isa),
                          extra_ldflags=openmp_link_flags(), build_directory=str(directory), verbose=verbose)


def load(verbose: bool = False):
    """The extension (the install's build, else one compiled now), or None where neither is possible
    (then layers use PyTorch). Each fallback is said once, on the first call."""
    global _module, _tried
    if _module is not None or _tried:
        return _module
    _tried = True
    if os.environ.get("HARDY_NO_KERNELS"):
        return None
    isa = _isa()
    _module, why = installed(isa)
    if _module is not None:
        return _module
    name, directory = cached_build(isa)
    if (directory / f"{name}.so").exists():  # a warning where a compile follows, not on each later start
        log.info("quantized decode kernels: %s; loading the %s build compiled on an earlier first use", why, isa)
    else:
        log.warning("quantized decode kernels: %s; compiling the %s build now (once per machine)", why, isa)
    try:
        _module = compile_now(isa, verbose)
    except Exception as e:  # no compiler, no ninja, unsupported platform: the PyTorch path still works
        log.warning("quantized decode kernels unavailable (%s); using the PyTorch path", str(e).splitlines()[0][:200])
        _module = None
    return _module


def kernel_group(layer) -> int:
    """The group width the kernels take: per-channel (group size 0) is one group of the whole row."""
    return layer.spec.group_size or layer.in_features


def supports(layer) -> bool:
    spec, cols = layer.spec, layer.in_features
    if spec.super_block:  # the K-quant forms (GGUF Q4_K, Q5_K, Q6_K): whole super-blocks
        return cols % spec.super_block == 0
    if cols % 32 or kernel_group(layer) % 32:
        return False
    # int4: with mins (Q4_1 grid) or without (Q4_0); 5-bit: symmetric (Q5_0); int8: symmetric (Q8_0)
    return spec.bits == 4 or (spec.bits in (5, 8) and spec.symmetric)


_NO_MINS = torch.empty(0, dtype=torch.float16)  # symmetric layers (int8, int4 Q4_0 grid) have no mins


def kernel_tensors(layer) -> list[torch.Tensor]:
    """(qweight, scales, mins) as the extension takes them: mins empty on a symmetric grid, the fifth
    bits (int32) in their place on the 5-bit one (the 5-bit K-quant form holds them in its mins)."""
    if layer.spec.bits == 5 and not layer.spec.super_block:
        return [layer.qweight, layer.scales, layer.high]
    return [layer.qweight, layer.scales, _NO_MINS if layer.mins is None else layer.mins]


class LayerKernel:
    """The extension's calls on one supported quantized layer, re-laid in the kernel's tiled layout (in
    place of the stored one). They read the layer's tensors at each call: a later re-layout or move is seen."""

    def __init__(self, layer, module):
        self.layer, self.module = layer, module
        self.group, self.rows = kernel_group(layer), layer.out_features
        layer.use_tiled_layout()

    def __deepcopy__(self, memo):
        """A copied layer's kernel reads the copy's tensors (the extension module is shared, not copied)."""
        new = object.__new__(LayerKernel)
        new.layer, new.module = copy.deepcopy(self.layer, memo), self.module
        new.group, new.rows = self.group, self.rows
        return new

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out]. Decode calls this ~200 times per token (SmolLM2), so the common
        case (contiguous fp32) goes straight to C++ with no Python-side reshapes or casts."""
        if x.dtype == torch.float32 and x.is_contiguous():
            return self.module.qgemv(x, *kernel_tensors(self.layer), self.group, self.rows)
        return self.module.qgemv(x.float().contiguous(), *kernel_tensors(self.layer), self.group, self.rows).to(x.dtype)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows (a decode step's one row per sequence), dequantized in C++ from the same bytes."""
        return self.module.dequant_rows(*kernel_tensors(self.layer), self.group, ids)

    def dequant_range(self, begin: int, out: torch.Tensor) -> None:
        """Prefill: consecutive rows from `begin` into a float/bf16 slab (QuantLinear multiplies slab by slab)."""
        self.module.dequant_range(*kernel_tensors(self.layer), self.group, begin, out)


def prepare(model) -> int:
    """Attach the fused kernel to every supported quantized layer; returns how many got it."""
    module = load()
    if module is None:
        return 0
    count = 0
    for layer in model.modules():
        if isinstance(layer, QuantLinear) and layer.qweight.device.type == "cpu" and supports(layer):
            layer.kernel = LayerKernel(layer, module)
            count += 1
    for block in model.modules():
        if isinstance(block, MoE):
            block.grouped = grouped_experts(block, module)
    return count


def grouped_experts(block: MoE, module):
    """The experts of an MoE block as one C++ call (csrc/moe.cpp) where all of them have the kernel and
    no bias, else None (the block then runs each active expert's modules)."""
    linears = [lin for expert in block.experts for lin in (expert.w1, expert.w3, expert.w2)]
    if not all(isinstance(lin, QuantLinear) and lin.kernel is not None and lin.bias is None for lin in linears):
        return None
    stack = experts_kernel(module, linears, block.experts[0].act == "gelu_tanh")
    return lambda x, weights, experts: stack(x, experts, weights)


def experts_kernel(module, linears: list, gelu: bool):
    """The extension's MoEExperts over prepared layers given as each expert's gate, up and down in
    turn: called (x [T, D], experts [T, k] int64, weights [T, k]) -> [T, D]."""
    tensors, dims = [], []
    for lin in linears:
        tensors += kernel_tensors(lin)
        dims += [kernel_group(lin), lin.out_features]
    return module.MoEExperts(tensors, dims, gelu)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="hardy: %(message)s")
    m = load(verbose="-v" in sys.argv)
    if m is None:
        print("hardy: kernels could not be built; quantized layers will use the PyTorch path", file=sys.stderr)
        sys.exit(1)
    isa = "AVX-512 VNNI" if m.has_vnni() else "AVX2" if m.has_avx2() else "portable scalar"
    where = "built at install" if m.__name__.startswith("hardy.") else f"compiled into {build_dir()}"
    print(f"hardy: quantized decode kernels ready ({isa}, {where}: {m.__name__})")
