"""`hardy compress`: prune and/or quantize a model's linear layers, layer by layer on calibration
text, the way GPTQ/SparseGPT/AWQ are run: each layer is calibrated on the outputs of the layers
before it *after* those were compressed, so errors do not compound unseen.

Per transformer layer: one pass of the calibration activations through the (still float) layer
collects, for each distinct linear input, the Hessian XᵀX (GPTQ, SparseGPT; its diagonal is Wanda's
‖X_j‖²) and a token sample (AWQ's searches, the error report); then pruning, AWQ scaling, and
quantization; then the compressed layer produces the next layer's inputs.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from hardy.compress import awq, gptq, prune
from hardy.compress.store import spill
from hardy.devices import compute_device
from hardy.errors import HardyError
from hardy.formats.gguf_quant import PackedQuant
from hardy.formats.quantized import QuantSpec, QuantTensor, fake_quantize, rtn
from hardy.model.moe import MoE
from hardy.model.transformer import meta_transformer

QUANT_METHODS = ("rtn", "gptq", "awq")
PRUNE_METHODS = ("magnitude", "wanda", "sparsegpt")
# Linear layers of a block and the input each reads (q/k/v share one, gate/up share one).
LINEARS = {"attention.wq": "attn_in", "attention.wk": "attn_in", "attention.wv": "attn_in",
           "attention.wo": "attn_out", "feed_forward.w1": "ffn_in", "feed_forward.w3": "ffn_in",
           "feed_forward.w2": "ffn_mid"}
# `--prune-layers` names a linear by its last component (wq, ..., w3), the same in every block.
SHORT_NAMES = {name.rsplit(".", 1)[1]: name for name in LINEARS}


# An expert that calibration routes fewer tokens to is calibrated on every token of its layer instead
# (all tokens through its own w1/w3 for its w2): a Hessian from a handful of tokens is mostly damping.
MIN_EXPERT_TOKENS = 64


def block_linears(block) -> dict[str, str]:
    """The linears of `block` that are compressed -> the input each reads. In a mixture-of-experts block
    each expert reads only its own tokens; the router (tiny, and a rounded router sends tokens to other
    experts) and the shared expert's gate stay float."""
    ffn = block.feed_forward
    if not isinstance(ffn, MoE):
        return LINEARS
    out = {k: v for k, v in LINEARS.items() if k.startswith("attention.")}
    for e in range(len(ffn.experts)):
        out.update({f"feed_forward.experts.{e}.w1": f"expert{e}_in", f"feed_forward.experts.{e}.w3": f"expert{e}_in",
                    f"feed_forward.experts.{e}.w2": f"expert{e}_mid"})
    if ffn.shared is not None:
        out.update({"feed_forward.shared.w1": "ffn_in", "feed_forward.shared.w3": "ffn_in",
                    "feed_forward.shared.w2": "shared_mid"})
    return out


def _input_readers(block, linears: dict[str, str]) -> dict[str, str]:
    """The first module reading each distinct input (its pre-hook records that input for all its readers;
    an MoE block's own input: every token of the layer)."""
    readers = {kind: name for name, kind in reversed(linears.items())}
    if isinstance(block.feed_forward, MoE):
        readers["ffn_in"] = "feed_forward"
    return readers


def parse_prune_layers(text: str | None) -> tuple[str, ...]:
    """`--prune-layers` as typed ("w2, wo") into CompressConfig.prune_layers; nothing given: ()."""
    return tuple(n.strip() for n in text.split(",")) if text else ()

SAMPLE_TOKENS = 2048  # tokens kept per input for AWQ's searches and the error report


EMBEDDINGS = ("int8", "same", "dense")
EMBEDDING_INT8 = QuantSpec(8, 32, True)  # = GGUF Q8_0


@dataclass(frozen=True)
class CompressConfig:
    quant: str | None = None
    bits: int = 4
    group_size: int = 128
    # below 8 bits: the symmetric grid ((code − 2^(b−1))·scale, no mins: GGUF Q4_0 at 4 bits g32) instead
    # of the asymmetric one (code·scale + min: Q4_1); 8 bits is always symmetric
    symmetric: bool = False
    prune: str | None = None
    sparsity: str = "0.5"
    prune_layers: tuple[str, ...] = ()  # short names of the linears to prune; () = all of them
    # transformer blocks to compress, by index; () = all. The others stay as they are and only carry the
    # calibration activations on, so every compressed block sees the inputs the whole model gives it.
    blocks: tuple[int, ...] = ()
    # the embedding table and an untied LM head: int8 g32 (GGUF files keep them at 8 bits or a
    # K-quant), "same" as the layers' spec, or "dense"; only when quantizing
    embeddings: str = "int8"
    act_order: bool = True
    damp: float = 0.01
    block_size: int = 128
    calib_samples: int = 128
    calib_seq: int = 512
    seed: int = 0

    def __post_init__(self):
        if self.embeddings not in EMBEDDINGS:
            raise HardyError(f"--embeddings must be one of {', '.join(EMBEDDINGS)} (got {self.embeddings!r})")
        if self.quant is None and self.prune is None:
            raise HardyError("nothing to do: give --quant and/or --prune")
        if self.quant is not None and self.quant not in QUANT_METHODS:
            raise HardyError(f"--quant must be one of {', '.join(QUANT_METHODS)} (got {self.quant!r})")
        if self.prune is not None and self.prune not in PRUNE_METHODS:
            raise HardyError(f"--prune must be one of {', '.join(PRUNE_METHODS)} (got {self.prune!r})")
        if self.quant is not None:
            self.spec()
        if self.prune is not None:
            prune.Sparsity.parse(self.sparsity)
        if self.prune_layers:
            if self.prune is None:
                raise HardyError("--prune-layers needs --prune")
            unknown = [n for n in self.prune_layers if n not in SHORT_NAMES]
            if unknown:
                raise HardyError(f"--prune-layers: unknown {','.join(unknown)} (names: {','.join(SHORT_NAMES)})")
            if len(set(self.prune_layers)) != len(self.prune_layers):
                raise HardyError(f"--prune-layers names a linear twice ({','.join(self.prune_layers)})")
        if any(b < 0 for b in self.blocks) or len(set(self.blocks)) != len(self.blocks):
            raise HardyError(f"blocks must be distinct indices >= 0 (got {self.blocks})")
        if self.calib_samples < 1 or self.calib_seq < 2:
            raise HardyError("--calib-samples must be >= 1 and --calib-seq >= 2")

    def prunes(self, name: str) -> bool:
        """Is the linear `name` (as in LINEARS) pruned?"""
        return self.prune is not None and (not self.prune_layers or
                                           name.rsplit(".", 1)[1] in self.prune_layers)

    def spec(self) -> QuantSpec:
        return QuantSpec(bits=self.bits, group_size=self.group_size, symmetric=True if self.symmetric else None)

    @property
    def needs_hessian(self) -> bool:
        return self.quant == "gptq" or self.prune == "sparsegpt"

    @property
    def needs_calibration(self) -> bool:
        return self.quant in ("gptq", "awq") or self.prune in ("wanda", "sparsegpt")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class LayerReport:
    name: str  # the parameter: layers.{i}.{linear}.weight
    linear: str  # which linear of the block, as in LINEARS
    output_error: float  # ‖X(Ŵ − W)ᵀ‖ / ‖XWᵀ‖ on calibration tokens
    rtn_output_error: float | None = None  # the same for plain RTN at the same bits (quantized runs)
    sparsity: float = 0.0


@dataclass
class CompressResult:
    quantized: dict[str, QuantTensor]  # hardy parameter name -> quantized weight
    state: dict[str, torch.Tensor]  # the float state dict after pruning / AWQ scaling (dequantized where quantized)
    reports: list[LayerReport] = field(default_factory=list)


class _InputStats:
    """Σ xᵀx over calibration tokens (GPTQ, SparseGPT) — or only its diagonal Σ x_j² when no method
    needs more (Wanda's norms; the full product costs a GEMM per chunk) — and a token sample.

    Accumulated in float64 on the CPU, in float32 on a GPU: most GPUs run float64 at 1/32-1/64 of
    float32, and an fp32 GEMM's own fp32 accumulation over a chunk is what the sum adds to anyway."""

    def __init__(self, width: int, generator: torch.Generator, full: bool, device: torch.device):
        self.full = full
        dtype = torch.float64 if device.type == "cpu" else torch.float32
        shape = (width, width) if full else (width,)
        self.hessian = torch.zeros(shape, dtype=dtype, device=device)
        self.count = 0
        self.samples: list[torch.Tensor] = []
        self.budget = SAMPLE_TOKENS
        self.generator = generator

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        h = self.hessian.dtype
        if self.full:  # the fp32 product widened a slab of rows at a time: no second full-size copy
            product = x.t() @ x
            for r in range(0, product.shape[0], 2048):
                self.hessian[r:r + 2048] += product[r:r + 2048].to(h)
        else:
            self.hessian += x.to(h).pow(2).sum(0)
        self.count += x.shape[0]
        if self.budget > 0:
            # the sample is drawn with a CPU generator: the same tokens whatever the device
            keep = x[torch.randperm(x.shape[0], generator=self.generator)[:self.budget].to(x.device)]
            self.samples.append(keep)
            self.budget -= keep.shape[0]

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(2·XᵀX / tokens in fp32, the token sample); the accumulator is consumed (scaled in place and
        dropped: for an 8B model's down projection it is 14336² float64 = 1.6 GB)."""
        h = self.hessian.mul_(2).div_(max(1, self.count)).float()
        self.hessian = None
        return (h if self.full else torch.diag(h)), torch.cat(self.samples)


def _block_inputs(block, x, rope, chunk: int, full_hessian: bool) -> dict[str, _InputStats]:
    """Run the block on x [n, s, dim] in chunks, recording each distinct linear input."""
    gen = torch.Generator().manual_seed(0)
    stats: dict[str, _InputStats] = {}
    hooks = []
    for kind, name in _input_readers(block, block_linears(block)).items():
        module = block.get_submodule(name)

        def hook(mod, args, kind=kind):
            inp = args[0]
            if kind not in stats:
                stats[kind] = _InputStats(inp.shape[-1], gen, full_hessian, inp.device)
            stats[kind].add(inp)

        hooks.append(module.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            for i in range(0, x.shape[0], chunk):
                block(x[i:i + chunk], rope)
    finally:
        for h in hooks:
            h.remove()
    return stats


def _rarely_routed(block, inputs: dict, full: bool) -> None:
    """Experts calibration reached with fewer than MIN_EXPERT_TOKENS tokens get the statistics of every
    token of the layer: its input (the MoE block's) and, for w2, what the expert's w1/w3 make of it."""
    ffn = block.feed_forward
    if not isinstance(ffn, MoE):
        return
    h_all, x_all = inputs["ffn_in"]
    for e, expert in enumerate(ffn.experts):
        kind = f"expert{e}_in"
        if kind in inputs and inputs[kind][1].shape[0] >= MIN_EXPERT_TOKENS:
            continue
        inputs[kind] = (h_all, x_all)
        with torch.no_grad():
            gate = expert.w1(x_all)
            gate = torch.nn.functional.silu(gate) if expert.act == "silu" else torch.nn.functional.gelu(gate, approximate="tanh")
            mid = gate * expert.w3(x_all)
        h = 2 * mid.t() @ mid / mid.shape[0] if full else torch.diag(2 * mid.pow(2).sum(0) / mid.shape[0])
        inputs[f"expert{e}_mid"] = (h, mid)


def _rel_error(x: torch.Tensor, w: torch.Tensor, x_hat: torch.Tensor, w_hat: torch.Tensor,
               out_scale: torch.Tensor | None = None) -> float:
    """‖x̂·ŵᵀ − x·wᵀ‖ / ‖x·wᵀ‖: the compressed linear (on its possibly rescaled input) vs the original
    (whose outputs are scaled by `out_scale` where AWQ moved a scale into this linear's rows)."""
    ref = x @ w.t()
    if out_scale is not None:
        ref = ref * out_scale
    return float((x_hat @ w_hat.t() - ref).norm() / ref.norm().clamp_min(1e-12))


def _apply_awq_scales(block, inputs: dict[str, tuple[torch.Tensor, torch.Tensor]], spec: QuantSpec,
                      n_heads: int, n_kv_heads: int) -> dict[str, torch.Tensor]:
    """Search and fold the scales; returns the output-channel factor each producer linear now has
    (its rows were divided by the next linear's scale), for comparing against the original."""
    att, ffn = block.attention, block.feed_forward
    groups = [("attn_in", block.attention_norm.weight, None, [att.wq, att.wk, att.wv])]
    if isinstance(ffn, MoE):  # each expert's down projection on its own tokens (the shared input is not
        groups += [(f"expert{e}_mid", None, f"feed_forward.experts.{e}.w3", [x.w2]) for e, x in enumerate(ffn.experts)]
        if ffn.shared is not None:  # scaled: the router reads it too and stays float)
            groups.append(("shared_mid", None, "feed_forward.shared.w3", [ffn.shared.w2]))
    else:
        groups += [("ffn_in", block.ffn_norm.weight, None, [ffn.w1, ffn.w3]),
                   ("ffn_mid", None, "feed_forward.w3", [ffn.w2])]
    if n_heads == n_kv_heads:
        groups.append(("attn_out", None, "attention.wv", [att.wo]))
    out_scale = {}
    with torch.no_grad():
        for kind, norm_weight, producer_rows, linears in groups:
            x = inputs[kind][1]
            s = awq.search_scale(x, [lin.weight for lin in linears], spec)
            if norm_weight is not None:
                norm_weight.div_(s)
            else:
                producer = block.get_submodule(producer_rows)
                producer.weight.div_(s[:, None])
                if producer.bias is not None:  # the output rows, bias included (Qwen2's v)
                    producer.bias.div_(s)
                out_scale[producer_rows] = 1 / s
            for lin in linears:
                lin.weight.mul_(s[None, :])
            inputs[kind] = (inputs[kind][0] / s[:, None] / s[None, :], x / s)
    return out_scale


def _propagate(block, x: torch.Tensor, rope, chunk: int) -> None:
    """The calibration activations through `block` (as compressed), in place, `chunk` samples at a time."""
    for i in range(0, x.shape[0], chunk):
        x[i:i + chunk] = block(x[i:i + chunk], rope)


def _compress_block(block, li: int, x: torch.Tensor, rope, chunk: int, cfg: CompressConfig, mcfg,
                    quantized: dict, reports: list, pack: bool = False) -> None:
    """Calibrate, prune, scale and quantize one block's linears on its inputs `x` (then carry `x` through
    the compressed block, in place). `pack`: keep each quantized weight packed (4-bit codes two per
    byte), not as one byte per code — the streaming path's memory."""
    spec = cfg.spec() if cfg.quant else None
    sparsity = prune.Sparsity.parse(cfg.sparsity) if cfg.prune else None
    linears = block_linears(block)
    stats = _block_inputs(block, x, rope, chunk, cfg.needs_hessian)
    inputs = {k: stats.pop(k).finish() for k in list(stats)}
    _rarely_routed(block, inputs, cfg.needs_hessian)
    originals = {name: block.get_submodule(name).weight.detach().clone() for name in linears}
    masks = {}
    if sparsity is not None:
        for name, kind in linears.items():
            if not cfg.prunes(name):
                continue
            lin = block.get_submodule(name)
            h = inputs[kind][0]
            if cfg.prune == "magnitude":
                w, mask = prune.magnitude(lin.weight, sparsity)
            elif cfg.prune == "wanda":
                w, mask = prune.wanda(lin.weight, torch.diag(h), sparsity)
            else:
                w, mask = prune.sparsegpt(lin.weight, h, sparsity, cfg.block_size, cfg.damp)
            lin.weight.copy_(w)
            masks[name] = mask
    samples = {kind: xs for kind, (_, xs) in inputs.items()}  # before any AWQ rescaling
    # the weights RTN's error is reported for: after pruning, before AWQ's scales (without either,
    # the originals themselves: no second copy of the block)
    unscaled = ({name: block.get_submodule(name).weight.detach().clone() for name in linears}
                if masks or cfg.quant == "awq" else originals)
    out_scales = {}
    if cfg.quant == "awq":  # rescales weights and inputs by s: (X/s)·(W·s)ᵀ = X·Wᵀ
        out_scales = _apply_awq_scales(block, inputs, spec, mcfg.n_heads, mcfg.n_kv_heads)
    for name, kind in linears.items():
        lin = block.get_submodule(name)
        h, xs = inputs[kind]
        w = lin.weight.detach().float()
        full = f"layers.{li}.{name}.weight"
        rtn_error = None
        if cfg.quant is not None:
            if cfg.quant == "gptq":
                q = gptq.gptq(w, h, spec, cfg.block_size, cfg.damp, cfg.act_order, masks.get(name))
            elif cfg.quant == "awq":
                q = awq.awq_quantize(xs, w, spec)
            else:
                q = rtn(w, spec)
            quantized[full] = PackedQuant(q.packed(), q.spec, q.shape) if pack else q
            w_hat = q.dequantize()
            rtn_error = _rel_error(samples[kind], originals[name], samples[kind],
                                   fake_quantize(unscaled[name], spec))
        else:
            w_hat = w
        error = _rel_error(samples[kind], originals[name], xs, w_hat, out_scales.get(name))
        reports.append(LayerReport(name=full, linear=name, output_error=error, rtn_output_error=rtn_error,
                                   sparsity=float((w_hat == 0).float().mean()) if masks else 0.0))
        lin.weight.copy_(w_hat)
    _propagate(block, x, rope, chunk)


def _calibration(cfg: CompressConfig, calib: torch.Tensor | None, mcfg) -> torch.Tensor:
    """The calibration tokens, with the checks both entry points share (data-free methods get a few
    seeded random tokens: they only feed the error report)."""
    if cfg.needs_calibration and calib is None:
        raise HardyError(f"{cfg.quant if cfg.quant in ('gptq', 'awq') else cfg.prune} needs calibration text "
                         "(--calib-data)")
    if cfg.blocks and max(cfg.blocks) >= mcfg.n_layers:
        raise HardyError(f"blocks {cfg.blocks}: the model has {mcfg.n_layers} blocks")
    if calib is None:
        calib = torch.randint(0, mcfg.vocab_size, (4, min(64, mcfg.max_seq_len)),
                              generator=torch.Generator().manual_seed(cfg.seed))
    return calib


def _tables(cfg: CompressConfig, mcfg) -> tuple[QuantSpec | None, list[str]]:
    """How the embedding table and an untied LM head are quantized (RTN: a lookup table has no
    calibration input; None: kept dense — also when only some `blocks` are compressed), and their names."""
    names = ["tok_embeddings.weight"] + ([] if mcfg.tie_embeddings else ["output.weight"])
    if cfg.embeddings == "dense" or cfg.quant is None or cfg.blocks:
        return None, names
    return (EMBEDDING_INT8 if cfg.embeddings == "int8" else cfg.spec()), names


def compress_model(model, cfg: CompressConfig, calib: torch.Tensor | None, progress: bool = True) -> CompressResult:
    """Compress `model` (fp32, modified in place: it ends up holding the dequantized weights)."""
    mcfg = model.cfg
    quantized: dict[str, QuantTensor] = {}
    reports: list[LayerReport] = []
    with torch.no_grad():
        calib = _calibration(cfg, calib, mcfg).to(compute_device(model))  # calibrated where the model is
        seq = calib.shape[1]
        model.reset_rope(max(seq, model._rope_len))
        rope = model.rotary(0, seq, torch.float32)
        x = model.embed(calib).float()
        chunk = max(1, 8192 // seq)
        bar = tqdm(total=mcfg.n_layers, desc="compress", unit="layer", disable=not progress, leave=False)
        for li, block in enumerate(model.layers):
            if cfg.blocks and li not in cfg.blocks:
                _propagate(block, x, rope, chunk)
            else:
                _compress_block(block, li, x, rope, chunk, cfg, mcfg, quantized, reports)
            bar.update()
        bar.close()
        table_spec, tables = _tables(cfg, mcfg)
        if table_spec is not None:
            for name in tables:
                weight = model.get_parameter(name)
                quantized[name] = q = rtn(weight.detach().float(), table_spec)
                weight.copy_(q.dequantize())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return CompressResult(quantized=quantized, state=state, reports=reports)

EMBEDDING_ROWS = 8192  # rows of an embedding table / LM head quantized at a time from disk


def _rtn_rows(weights, name: str, spec: QuantSpec) -> PackedQuant:
    """RTN of a [rows, dim] table read EMBEDDING_ROWS at a time (rows are independent: groups run
    along a row), packed: an 8B model's 128k-row head is never in memory as fp32."""
    rows, cols = weights.shape(name)
    parts: dict[str, list[torch.Tensor]] = {}
    for r0 in range(0, rows, EMBEDDING_ROWS):
        for key, t in rtn(weights.rows(name, r0, min(rows, r0 + EMBEDDING_ROWS)), spec).packed().items():
            parts.setdefault(key, []).append(t)
    return PackedQuant({k: torch.cat(v) for k, v in parts.items()}, spec, (rows, cols))


def compress_from_disk(mcfg, weights, cfg: CompressConfig, calib: torch.Tensor | None,
                       progress: bool = True, spill_dir: Path | None = None) -> CompressResult:
    """`compress_model` on weights streamed from disk (`hardy.formats.lazy_weights.LazyWeights`): one
    block at a time is read (bf16 stays bf16 on disk), widened to fp32, compressed, packed and freed,
    so memory holds one block's fp32 working set, its calibration statistics and the activations —
    an 8B model compresses in a fraction of its fp32 size. With `spill_dir`, each block's packed
    results go to a file there as soon as the block is done (`hardy.compress.store.spill`), so memory
    does not grow with the model's depth either. The same computation as `compress_model` on the
    loaded model (tested bit for bit). `state` holds only the float tensors that stay float (norms;
    dense embeddings; blocks outside `cfg.blocks`)."""
    calib = _calibration(cfg, calib, mcfg)
    model = meta_transformer(mcfg)  # the structure; each block is materialized in turn
    quantized: dict = {}
    reports: list[LayerReport] = []
    state: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        seq = calib.shape[1]
        model.reset_rope(seq, device="cpu")
        rope = model.rotary(0, seq, torch.float32)
        x = weights.get("tok_embeddings.weight", dtype=None)[calib].float() * mcfg.embed_scale  # the rows looked up
        chunk = max(1, 8192 // seq)
        bar = tqdm(total=mcfg.n_layers, desc="compress", unit="layer", disable=not progress, leave=False)
        for li, block in enumerate(model.layers):
            block.to_empty(device="cpu")
            for name, param in block.named_parameters():
                param.copy_(weights.get(f"layers.{li}.{name}"))
            if cfg.blocks and li not in cfg.blocks:
                _propagate(block, x, rope, chunk)
                kept = list(block.named_parameters())
            else:
                _compress_block(block, li, x, rope, chunk, cfg, mcfg, quantized, reports, pack=True)
                kept = [(n, p) for n, p in block.named_parameters() if f"layers.{li}.{n}" not in quantized]
                if spill_dir is not None:
                    names = [n for n in quantized if n.startswith(f"layers.{li}.")]
                    spill(quantized, names, Path(spill_dir) / f"block_{li:05d}.safetensors")
            for name, param in kept:  # norms (AWQ may have rescaled them), or a whole uncompressed block
                state[f"layers.{li}.{name}"] = param.detach().clone()
            block.to("meta")  # frees the block's fp32 weights
            bar.update()
        bar.close()
        state["norm.weight"] = weights.get("norm.weight")
        table_spec, tables = _tables(cfg, mcfg)
        for name in tables:
            if table_spec is not None:
                quantized[name] = _rtn_rows(weights, name, table_spec)
                if spill_dir is not None:
                    spill(quantized, [name], Path(spill_dir) / f"{name}.safetensors")
            else:
                state[name] = weights.get(name)
    return CompressResult(quantized=quantized, state=state, reports=reports)


def calibration_batch(tokenizer, text: str, samples: int, seq: int, seed: int):
    """`samples` windows of `seq` tokens at seeded random offsets of the tokenized text."""
    return calibration_windows(torch.tensor(tokenizer.encode(text, add_bos=False, special=False), dtype=torch.long),
                               samples, seq, seed)


def calibration_windows(ids, samples: int, seq: int, seed: int):
    """`samples` windows of `seq` tokens at seeded random offsets of a 1-D token tensor."""
    if ids.numel() < seq + 1:
        raise HardyError(f"calibration text has {ids.numel()} tokens; need more than --calib-seq {seq}")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seq, (samples,), generator=gen)
    return torch.stack([ids[s:s + seq] for s in starts.tolist()])
