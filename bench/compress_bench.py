"""Quality of every compression setting on one model: perplexity (llama.cpp protocol) on evaluation
text the model never saw, the change against the dense model, and the mean layer-output error on
calibration data against plain RTN's — with the orderings issue 6 asks for checked at the end, each
perplexity ordering with its paired difference over the same chunks (z = Δ mean NLL / its standard
error; |z| < 2 is within the chunk-to-chunk noise of this evaluation text).

    .venv/bin/python bench/compress_bench.py --model runs/small --calib-data run-split \
        --eval-data run-split --ctx 256 --kl
    .venv/bin/python bench/compress_bench.py --model smollm2-135m --calib-data wikitext2-valid \
        --calib-samples 64 --eval-data wikitext2-test --max-tokens 65536 --settings 1,2,3,7,8,9

Every setting starts from the same dense weights and the same calibration windows (seeded).
"""
from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

ALL = ([("rtn", 8, 0, None, None)]
       + [(q, b, g, None, None) for b, g in ((4, 32), (4, 128), (3, 128)) for q in ("rtn", "gptq", "awq")]
       + [(None, None, None, p, s) for s in ("0.5", "2:4") for p in ("magnitude", "wanda", "sparsegpt")]
       + [("gptq", 8, 0, "sparsegpt", "2:4")])

# --calib-data / --eval-data value naming the run's own prepared splits (train for calibration, val to evaluate)
RUN_SPLIT = "run-split"


def label(q, b, g, p, s) -> str:
    parts = []
    if p:
        parts.append(f"{p} {s}")
    if q:
        parts.append(f"{q} int{b}" + (f" g{g}" if g else " per-channel"))
    return " + ".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--calib-data", default="wikitext2-valid",
                    help=f"a text, or {RUN_SPLIT!r}: windows of the training split of the hardy run given as --model")
    ap.add_argument("--calib-samples", type=int, default=128)
    ap.add_argument("--calib-seq", type=int, default=512)
    ap.add_argument("--calib-seed", type=int, default=0, help="which calibration windows are drawn")
    ap.add_argument("--eval-data", default="wikitext2-test",
                    help=f"a text, or {RUN_SPLIT!r}: the held-out split of the hardy run given as --model "
                         "(documents of its training texts it never saw)")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--kl", action="store_true",
                    help="also KL divergence and top-1 agreement against the dense model on the same positions "
                         "(runs the dense model beside each setting: evaluation takes twice as long)")
    ap.add_argument("--settings", default="all", help="all, or a comma list of indices into the table")
    ap.add_argument("--prune-layers", default=None,
                    help="prune only these linears of each block (comma list of wq,wk,wv,wo,w1,w2,w3): "
                         "which layers make a pruning method win or lose")
    args = ap.parse_args()

    import copy

    import torch

    from hardy.compress.pipeline import calibration_batch, calibration_windows
    from hardy.compress.pipeline import CompressConfig, compress_model, parse_prune_layers
    from hardy.data.prepare import load_split
    from hardy.data.text import read_text
    from hardy.eval.compare import quality
    from hardy.eval.perplexity import paired_difference, perplexity
    from hardy.loading.load import load_model

    loaded = load_model(args.model)
    tok = loaded.tokenizer
    seq = min(args.calib_seq, loaded.config.max_seq_len)

    def split_tokens(split):  # the run's own prepared split, tokenized by its own tokenizer
        return load_split(Path(args.model) / "data", split).astype("int64")

    if args.calib_data == RUN_SPLIT:
        calib = calibration_windows(torch.from_numpy(split_tokens("train")), args.calib_samples, seq,
                                    seed=args.calib_seed)
    else:
        calib = calibration_batch(tok, read_text(args.calib_data), args.calib_samples, seq, seed=args.calib_seed)
    tokens = split_tokens("val").tolist() if args.eval_data == RUN_SPLIT else tok.encode(read_text(args.eval_data))
    if args.max_tokens:
        tokens = tokens[:args.max_tokens]
    base = {k: v.clone() for k, v in loaded.model.state_dict().items()}

    dense_model = copy.deepcopy(loaded.model) if args.kl else None

    def evaluate() -> dict:
        """ppl and each chunk's mean NLL; with --kl also kl and top1 against the dense model."""
        if dense_model is None:
            r = perplexity(loaded.model, tokens, ctx=args.ctx, bos_id=tok.bos_id, add_bos=tok.add_bos,
                           batch_size=args.batch)
            return {"ppl": r.ppl, "chunk_nll": r.chunk_nll}
        return quality([dense_model, loaded.model], tokens, args.ctx, "llama.cpp", tok.bos_id, tok.add_bos,
                       batch_size=args.batch)[1]

    t0 = time.perf_counter()
    dense = evaluate()["ppl"]
    print(f"{args.model}: dense PPL {dense:.4f} on {len(tokens)} tokens of {args.eval_data} "
          f"(llama.cpp protocol, ctx {args.ctx}; {time.perf_counter() - t0:.0f} s); calibration {calib.shape[0]} x "
          f"{calib.shape[1]} tokens of {args.calib_data}", flush=True)
    settings = ALL if args.settings == "all" else [ALL[int(i)] for i in args.settings.split(",")]
    prune_layers = parse_prune_layers(args.prune_layers)
    if prune_layers:
        print(f"pruning only {','.join(prune_layers)} of each block")
    # "cols ≤10% kept": input columns of the pruned linears with under a tenth of their weights left,
    # i.e. an input feature as good as removed (a mask that follows ‖X_j‖ more than |W| does this)
    # with --kl, ΔNLL = KL(dense ‖ compressed) + a calibration term Σ_v (1[v=y] − p_dense(v))·(log p_dense − log p)(v),
    # zero in expectation where the dense model's predictions are the text's true distribution; negative
    # where any perturbation of an over-confident model moves its predictions toward the truth
    kl_head = " KL vs dense | ΔNLL − KL | top-1 |" if args.kl else ""
    print(f"| setting | PPL | vs dense |{kl_head} layer-output error | RTN's error | cols ≤10% kept | compress s |")
    print("|---|---|---|" + "---|---|---|" * args.kl + "---|---|---|---|")
    results = {}
    for q, b, g, p, s in settings:
        loaded.model.load_state_dict(base)
        cfg = CompressConfig(quant=q, bits=b or 4, group_size=g or 0, prune=p, sparsity=s or "0.5",
                             prune_layers=prune_layers if p else (), calib_samples=calib.shape[0],
                             calib_seq=calib.shape[1])
        t0 = time.perf_counter()
        result = compress_model(loaded.model, cfg, calib, progress=False)
        took = time.perf_counter() - t0
        evaluated = evaluate()
        ppl = evaluated["ppl"]
        # the mean over the layers the setting changed (with --prune-layers the others are exact)
        changed = [r for r in result.reports
                   if q or not p or cfg.prunes(r.linear)]
        err = statistics.fmean(r.output_error for r in changed)
        dropped = "-"
        if p:
            cols = torch.cat([(result.state[r.name] != 0).float().mean(0) < 0.1 for r in changed])
            dropped = f"{100 * cols.float().mean().item():.1f}%"
        rtn_errs = [r.rtn_output_error for r in result.reports if r.rtn_output_error is not None]
        rtn_err = statistics.fmean(rtn_errs) if rtn_errs else None
        name = label(q, b, g, p, s)
        results[name] = (ppl, err, rtn_err, evaluated)
        kl_cells = (f" {evaluated['kl']:.5f} | {math.log(ppl / dense) - evaluated['kl']:+.5f} | "
                    f"{100 * evaluated['top1']:.2f}% |") if args.kl else ""
        print(f"| {name} | {ppl:.4f} | {100 * (ppl / dense - 1):+.2f}% |{kl_cells} {err:.4f} | "
              f"{'-' if rtn_err is None else f'{rtn_err:.4f}'} | {dropped} | {took:.0f} |", flush=True)
        del result
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    print()
    checks = []

    def vs(x, ref) -> str:
        d = paired_difference(ref[3]["chunk_nll"], x[3]["chunk_nll"])
        kl = f"; KL vs dense {x[3]['kl']:.5f} vs {ref[3]['kl']:.5f}" if args.kl else ""
        return f"{x[0]:.4f} vs {ref[0]:.4f} (z = {d.z:+.1f}{'' if d.significant() else ', within noise'}{kl})"

    if "rtn int8 per-channel" in results:
        d = results["rtn int8 per-channel"][0] / dense - 1
        checks.append(("int8 RTN ΔPPL ≤ 0.5%", abs(d) <= 0.005, f"{100 * d:+.2f}%"))
    for b, g in ((4, 32), (4, 128), (3, 128)):
        r = results.get(f"rtn int{b} g{g}")
        for m in ("gptq", "awq"):
            x = results.get(f"{m} int{b} g{g}")
            if r and x:
                checks.append((f"{m} int{b} g{g}: PPL ≤ RTN", x[0] <= r[0], vs(x, r)))
                if args.kl:  # fidelity to the dense model, which held-out PPL of a small model may not rank
                    checks.append((f"{m} int{b} g{g}: KL vs dense < RTN's", x[3]["kl"] < r[3]["kl"],
                                   f"{x[3]['kl']:.5f} vs {r[3]['kl']:.5f}"))
                checks.append((f"{m} int{b} g{g}: layer error ≥ 10% below RTN", x[1] <= 0.9 * x[2],
                               f"{x[1]:.4f} vs {x[2]:.4f}"))
    for s in ("0.5", "2:4"):
        mag = results.get(f"magnitude {s}")
        for m in ("wanda", "sparsegpt"):
            x = results.get(f"{m} {s}")
            if mag and x:
                checks.append((f"{m} {s}: PPL < magnitude", x[0] < mag[0], vs(x, mag)))
                if args.kl:
                    checks.append((f"{m} {s}: KL vs dense < magnitude's", x[3]["kl"] < mag[3]["kl"],
                                   f"{x[3]['kl']:.5f} vs {mag[3]['kl']:.5f}"))
    for what, ok, detail in checks:
        print(f"  [{'ok' if ok else 'MISSED'}] {what}: {detail}")


if __name__ == "__main__":
    main()
