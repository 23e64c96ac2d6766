"""hardy compress: quantize (RTN / GPTQ / AWQ) and/or prune (magnitude / Wanda / SparseGPT) a model."""
from __future__ import annotations

import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path

from hardy.cli.common import add_model_args, load_from_args, requested_device
from hardy.compress.qlinear import quantized_modules
from hardy.compress.store import is_compressed_dir, save_compressed
from hardy.errors import HardyError
from hardy.formats.hf import open_hf_dir
from hardy.fsio import check_new_output
from hardy.loading.load import resolve_source, set_threads


def register(sub) -> None:
    p = sub.add_parser("compress", help="quantize and/or prune a model (writes a directory every hardy command loads)")
    add_model_args(p, gguf=False)  # compression starts from float weights
    p.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    p.add_argument("--quant", choices=["rtn", "gptq", "awq"], default=None)
    p.add_argument("--bits", type=int, default=4, choices=[8, 5, 4, 3])
    p.add_argument("--group-size", type=int, default=None,
                   help="input columns per scale (0 = per output channel); default 0 for 8 bits, 128 below")
    p.add_argument("--symmetric", action="store_true",
                   help="4/3 bits: the symmetric grid, (code - 2^(b-1)) * scale with no per-group min (GGUF Q4_0 "
                        "at 4 bits, group 32: 18 bytes per 32 weights against the default grid's 20)")
    p.add_argument("--prune", choices=["magnitude", "wanda", "sparsegpt"], default=None)
    p.add_argument("--sparsity", default="0.5", help="fraction of weights removed (0.5) or N:M (2:4)")
    p.add_argument("--prune-layers", default=None,
                   help="prune only these linears of every block, comma-separated from wq,wk,wv,wo,w1,w2,w3 "
                        "(default: all)")
    p.add_argument("--embeddings", choices=["int8", "same", "dense"], default="int8",
                   help="the embedding table (and the LM head, tied or not): int8 g32 RTN (default, as GGUF "
                        "files keep them), the same bits/group as the layers, or dense")
    p.add_argument("--quantize-embeddings", action="store_const", dest="embeddings", const="same",
                   help="= --embeddings same")
    p.add_argument("--no-act-order", action="store_true", help="GPTQ: quantize columns in their natural order")
    p.add_argument("--damp", type=float, default=0.01, help="GPTQ/SparseGPT dampening (fraction of mean diag H)")
    p.add_argument("--calib-data", default=None, help="calibration text file or bundled corpus (not the test set)")
    p.add_argument("--calib-samples", type=int, default=128)
    p.add_argument("--calib-seq", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def run(args) -> int:
    from hardy.compress.pipeline import (
        CompressConfig,
        calibration_batch,
        compress_from_disk,
        compress_model,
        parse_prune_layers,
    )
    from hardy.data.text import read_text

    group = args.group_size if args.group_size is not None else (0 if args.bits == 8 else 128)
    cfg = CompressConfig(quant=args.quant, bits=args.bits, group_size=group, symmetric=args.symmetric,
                         prune=args.prune, sparsity=args.sparsity,
                         prune_layers=parse_prune_layers(args.prune_layers),
                         embeddings=args.embeddings, act_order=not args.no_act_order,
                         damp=args.damp, calib_samples=args.calib_samples, calib_seq=args.calib_seq, seed=args.seed)
    text = read_text(args.calib_data) if args.calib_data else None  # bad input fails before the model loads
    if cfg.needs_calibration and text is None:
        raise HardyError(f"--{'quant' if cfg.quant in ('gptq', 'awq') else 'prune'} "
                         f"{cfg.quant if cfg.quant in ('gptq', 'awq') else cfg.prune} needs --calib-data")
    if args.dtype != "fp32":
        raise HardyError("hardy compress works on fp32 weights (--dtype fp32)")

    check_new_output(args.out)  # before the compression, which can take an hour

    # a Hugging Face directory compressed on the CPU: blocks streamed from disk, one at a time (on a
    # GPU the model is loaded whole onto it, as before)
    weights = _weights_on_disk(args.model) if requested_device(args).type == "cpu" else None
    if weights is not None:
        set_threads(getattr(args, "threads", None))
        mcfg, weights, tokenizer = weights
    else:
        loaded = load_from_args(args)

        if quantized_modules(loaded.model):
            raise HardyError(f"{args.model} is already quantized; compress its float original")
        mcfg, tokenizer = loaded.config, loaded.tokenizer
    if cfg.quant and cfg.bits == 4:
        for width in (mcfg.dim, mcfg.ffn_dim, mcfg.n_heads * mcfg.d_head):
            if width % 32:  # 4-bit codes pack in blocks of 32 columns (GGUF's layout)
                raise HardyError(f"4-bit quantization needs layer widths that are multiples of 32 ({width} is not)")
    calib = None
    if text is not None:
        seq = min(cfg.calib_seq, mcfg.max_seq_len)
        if tokenizer is None:
            raise HardyError(f"{args.model}: the model has no tokenizer to read --calib-data with")
        calib = calibration_batch(tokenizer, text, cfg.calib_samples, seq, cfg.seed)
    with contextlib.ExitStack() as stack:
        t0 = time.perf_counter()
        if weights is not None:  # each block's packed results wait in a file beside the output until it is written
            out_parent = Path(args.out).resolve().parent
            out_parent.mkdir(parents=True, exist_ok=True)
            spill_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix=".hardy-spill-", dir=out_parent))
            result = compress_from_disk(mcfg, weights, cfg, calib, progress=not args.no_progress, spill_dir=spill_dir)
        else:
            result = compress_model(loaded.model, cfg, calib, progress=not args.no_progress)
        seconds = time.perf_counter() - t0
        _save(args, mcfg, tokenizer, cfg, calib, result, seconds, group)
    return 0


def _save(args, mcfg, tokenizer, cfg, calib, result, seconds: float, group: int) -> None:
    """The report, the output directory (its quantized tensors read back from the spill files, if any)
    and the summary lines."""
    errors = [r.output_error for r in result.reports]
    rtn_errors = [r.rtn_output_error for r in result.reports if r.rtn_output_error is not None]
    report = {"layers": len(result.reports), "mean_output_error": statistics.fmean(errors),
              "mean_rtn_output_error": statistics.fmean(rtn_errors) if rtn_errors else None,
              "seconds": seconds, "per_layer": [vars(r) for r in result.reports]}
    meta = {"source": args.model, "compress": cfg.to_dict(),
            "calibration": {"data": args.calib_data, "samples": int(calib.shape[0]) if calib is not None else 0,
                            "seq": int(calib.shape[1]) if calib is not None else 0},
            "report": report}
    save_compressed(mcfg, result.state, result.quantized, tokenizer, args.out, meta)
    pruned = f"{cfg.prune} {cfg.sparsity}" + (f" of {','.join(cfg.prune_layers)}" if cfg.prune_layers else "")
    what = " + ".join(x for x in (pruned if cfg.prune else "",
                                  f"{cfg.quant} int{cfg.bits} g{group}" if cfg.quant else "") if x)
    line = f"compressed {args.model} ({what}) in {seconds:.1f} s: mean layer-output error {report['mean_output_error']:.4f}"
    if report["mean_rtn_output_error"] is not None and cfg.quant != "rtn":
        line += f" (RTN {report['mean_rtn_output_error']:.4f})"
    print(line)
    print(f"wrote {args.out} ({json.dumps(cfg.spec().to_dict()) if cfg.quant else 'float weights, pruned'})")


def _weights_on_disk(spec: str):
    """(config, LazyWeights, tokenizer) for a Hugging Face directory of float weights, else None (a
    GGUF file, a run directory or a preset load whole; a `hardy compress` directory is refused)."""
    kind, path = resolve_source(spec)
    if kind != "hf":
        return None
    if is_compressed_dir(path):
        raise HardyError(f"{spec} is already quantized; compress its float original")

    return open_hf_dir(path)

