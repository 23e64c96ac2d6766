"""The compressed-model directory (docs/quantization.md): a Hugging Face-layout directory whose
quantized linears are stored as integer codes + fp16 scales, with a JSON description — no pickle.

  config.json            the model (Hugging Face Llama keys) + "quantization_config"
  model.safetensors      float tensors under HF names; a quantized weight `X.weight` is stored as
                         `X.qweight` (int8 codes, packed 4-bit bytes, or 3-bit codes one per byte),
                         `X.scales` (fp16, [out, groups]) and, asymmetric, `X.mins` (fp16); in the
                         K-quant form (GGUF Q4_K) `X.scales` holds each group's 6-bit scale and min
                         as bytes and `X.mins` each super-block's fp16 d and dmin
  quantization.json      {"format": "hardy.quant/1", "tensors": {hardy name: {bits, group_size,
                         symmetric}}, "packing": ..., "compress": the settings, "report": ...}
  tokenizer files
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from hardy.compress.qlinear import swap_quantized
from hardy.errors import HardyError
from hardy.formats.families import HFNames, config_from_hf, hf_config
from hardy.formats.lazy_weights import SafetensorsFile, write_safetensors
from hardy.formats.quantized import QuantSpec, QuantTensor
from hardy.formats.tokenizer import HardyTokenizer
from hardy.fsio import atomic_directory
from hardy.model.transformer import meta_transformer

FORMAT = "hardy.quant/1"
MANIFEST = "quantization.json"
PACKING = ("4-bit: two codes per byte in blocks of 32 input columns, byte j = code j (low nibble) | "
           "code j+16 (high nibble); 8-bit: int8 codes (symmetric: w = code * scale); 3-bit and 5-bit: one uint8 "
           "code per byte; asymmetric: w = code * scale + min; symmetric below 8 bits: w = (code - 2^(bits-1)) * "
           "scale, no mins; scale/min fp16 per (row, group), computed in fp32")


def is_compressed_dir(path: Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


class SpilledQuant:
    """A packed quantized weight parked in a spill file during a streamed compression (`spill`): only
    its spec, shape and where its tensors are stay in memory, and they are read back one at a time
    when the output is written — so a compression holds one block's results, not the whole model's
    (an 8B model's packed int4 weights are 3.6 GB, a 70B's 35 GB)."""

    def __init__(self, file: SafetensorsFile, prefix: str, spec: QuantSpec, shape: tuple[int, int]):
        self.file, self.prefix, self.spec, self.shape = file, prefix, spec, shape
        self.keys = [k.removeprefix(prefix) for k in file.tensors if k.startswith(prefix)]

    def layout(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return {k: self.file.tensors[self.prefix + k][:2] for k in self.keys}

    def tensor(self, key: str) -> torch.Tensor:
        return self.file.read(self.prefix + key)

    def packed(self) -> dict[str, torch.Tensor]:
        return {k: self.tensor(k) for k in self.keys}


def spill(quantized: dict, names: list[str], path: Path) -> None:
    """Write the packed tensors of `quantized[name]` for `names` to the safetensors file `path` and
    replace those entries with `SpilledQuant`s reading them back from it."""
    tensors = {f"{name}.{key}": t for name in names for key, t in quantized[name].packed().items()}
    write_safetensors(path, [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()], tensors.__getitem__)
    del tensors
    file = SafetensorsFile(Path(path))
    for name in names:
        quantized[name] = SpilledQuant(file, f"{name}.", quantized[name].spec, tuple(quantized[name].shape))


def _packed_makers(qt) -> dict[str, tuple[torch.dtype, tuple[int, ...], object]]:
    """key -> (dtype, shape, make tensor) of one quantized weight's stored tensors, read from its spill
    file only when the writer asks for it."""
    if isinstance(qt, SpilledQuant):
        return {key: (dtype, shape, lambda key=key: qt.tensor(key)) for key, (dtype, shape) in qt.layout().items()}
    return {key: (t.dtype, tuple(t.shape), lambda t=t: t.cpu()) for key, t in qt.packed().items()}


def save_compressed(cfg, state: dict[str, torch.Tensor], quantized: dict[str, QuantTensor], tokenizer,
                    out: str | os.PathLike, meta: dict) -> Path:
    """Write atomically (temporary sibling directory, fsync, rename)."""
    with atomic_directory(out) as tmp:
        # written one tensor at a time (save_file would serialize them all into memory at once: twice
        # an 8B model's compressed size at the end of a streamed compression)
        makers, names = {}, HFNames(cfg)
        for name, t in state.items():
            if name in quantized or (cfg.tie_embeddings and name == "output.weight"):
                continue
            makers[names.to_hf(name)] = (torch.float32, tuple(t.shape),  # on a GPU too
                                         lambda t=t, name=name: names.write(name, t.detach()).float().contiguous().cpu())
        for name, qt in quantized.items():
            base = names.to_hf(name).removesuffix(".weight")
            for key, maker in _packed_makers(qt).items():
                makers[f"{base}.{key}"] = maker
        entries = [(key, dtype, shape) for key, (dtype, shape, _) in makers.items()]
        write_safetensors(tmp / "model.safetensors", entries, lambda key: makers[key][2](),
                          metadata={"format": "pt", "hardy": FORMAT})
        manifest = {"format": FORMAT, "packing": PACKING,
                    "tensors": {name: {**qt.spec.to_dict(), "shape": list(qt.shape)} for name, qt in quantized.items()},
                    **meta}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        bos = tokenizer.bos_id if tokenizer else None
        eos = tokenizer.eos_id if tokenizer else None
        config = hf_config(cfg, bos, eos)
        config["quantization_config"] = {"quant_method": "hardy", "format": FORMAT}
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if tokenizer is not None:
            tokenizer.save_hf(tmp)
    return Path(out)


def load_compressed(path: str | os.PathLike):
    """(config, float state in hardy names, {hardy name: QuantTensor}, tokenizer, manifest)."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        cfg = config_from_hf(json.loads((path / "config.json").read_text()), path)
        raw = load_file(str(path / "model.safetensors"))
    except (OSError, json.JSONDecodeError, SafetensorError, ValueError) as e:
        raise HardyError(f"{path}: unreadable compressed model ({e})") from None
    if manifest.get("format") != FORMAT:
        raise HardyError(f"{path}/{MANIFEST}: unknown format {manifest.get('format')!r} (expected {FORMAT})")
    quantized, names = {}, HFNames(cfg)
    for name, info in manifest.get("tensors", {}).items():
        try:
            spec, shape = QuantSpec.from_dict(info), tuple(info["shape"])
            base = names.to_hf(name).removesuffix(".weight")
        except (KeyError, TypeError, ValueError):
            raise HardyError(f"{path}/{MANIFEST}: bad entry for {name}") from None
        parts = {k: raw.pop(f"{base}.{k}") for k in ("qweight", "scales", "mins") if f"{base}.{k}" in raw}
        quantized[name] = QuantTensor.from_packed(parts, spec, shape, where=f"{path}: {name}")
    state = {}
    for key, tensor in raw.items():
        ours = names.from_hf(key)
        if ours is None:
            raise HardyError(f"{path}: unexpected tensor {key} in model.safetensors")
        state[ours] = names.read(ours, tensor).float()
    tokenizer = HardyTokenizer.from_hf_dir(path) if (path / "tokenizer.json").is_file() else None
    return cfg, state, quantized, tokenizer, manifest


def model_from_compressed(cfg, state: dict[str, torch.Tensor], quantized: dict[str, QuantTensor], source: str):
    """Build on the meta device, swap in the quantized modules, load the float tensors in place."""
    model = meta_transformer(cfg)
    swap_quantized(model, quantized)
    model.load_state_dict(state, strict=False, assign=True)
    if "tok_embeddings.weight" not in quantized:
        model.tie_weights()
    left = [n for n, p in list(model.named_parameters()) + list(model.named_buffers())
            if p.device.type == "meta" and not n.startswith("rope_")]
    if left:
        raise HardyError(f"{source}: weights missing for {left[:3]}")
    model.reset_rope()
    return model.eval()
