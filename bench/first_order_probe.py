"""Why held-out perplexity cannot rank compression methods on a briefly trained model: for each setting,
the change of mean held-out NLL (ΔNLL), the KL from the dense model (fidelity, what GPTQ/AWQ/SparseGPT
improve), and the first-order term g·δ (g = the gradient of the held-out loss, δ = the weight change
the method made), with ΔNLL of the mirrored change −δ. Near an optimum g ≈ 0 and ΔNLL tracks KL; far
from one, g·δ (of either sign, a different draw for every trained instance) is as large as the
differences in KL between methods.

    .venv/bin/python bench/first_order_probe.py --model RUN --heldout heldout.txt --calib train.txt

Chunks of --ctx tokens, every position scored (`hardy eval` protocol "full"): NLL and KL are
`hardy.eval.compare.quality`'s. The held-out gradient is one backward pass over all of them, so this is
for small models (the `mini` and `small` ones), not SmolLM2.
"""
from __future__ import annotations

import argparse
import copy
import math

import torch.nn.functional as F

SETTINGS = ([dict(quant=q, bits=b, group_size=g) for b, g in ((4, 32), (4, 128), (3, 128))
             for q in ("rtn", "gptq", "awq")]
            + [dict(prune=p, sparsity=s) for s in ("0.5", "2:4") for p in ("magnitude", "sparsegpt")])


def label(kw: dict) -> str:
    if "quant" in kw:
        return f"{kw['quant']} int{kw['bits']} g{kw['group_size']}"
    return f"{kw['prune']} {kw['sparsity']}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--heldout", required=True, help="text file (or a hardy dataset name) to evaluate on")
    ap.add_argument("--calib", required=True, help="calibration text (the model's training text)")
    ap.add_argument("--calib-samples", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=49152)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()

    from hardy.cli.compress import calibration_batch
    from hardy.compress.pipeline import CompressConfig, compress_model
    from hardy.data.text import read_text
    from hardy.eval.compare import quality
    from hardy.eval.perplexity import chunk_batches, plan_chunks
    from hardy.loading.load import load_model

    loaded = load_model(args.model)
    model, tok = loaded.model.eval(), loaded.tokenizer
    ids = tok.encode(read_text(args.heldout))[:args.max_tokens]
    # the same chunks and scored positions as every NLL and KL below (`quality`, protocol "full")
    chunks = plan_chunks(len(ids), args.ctx, "full")
    scored = sum(c.last_scored - c.first_scored + 1 for c in chunks)

    def evaluate(*models) -> list[dict]:
        return quality([dense, *models], ids, args.ctx, "full", tok.bos_id, tok.add_bos, batch_size=args.batch)

    model.zero_grad()
    for group, batch in chunk_batches(chunks, ids, args.batch, "full", tok.bos_id, tok.add_bos):
        first, last = group[0].first_scored, group[0].last_scored
        logits = model.output(model.hidden_states(batch)[:, first:last + 1]).float()
        (F.cross_entropy(logits.flatten(0, 1), batch[:, first + 1:last + 2].flatten(), reduction="sum")
         / scored).backward()
    grad = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    model.zero_grad()
    dense = copy.deepcopy(model)
    dense_nll = math.log(evaluate()[0]["ppl"])

    gnorm = math.sqrt(sum(float((g ** 2).sum()) for g in grad.values()))
    print(f"{args.model}: {scored:,} held-out tokens scored, dense NLL {dense_nll:.4f}, "
          f"held-out gradient norm {gnorm:.3f}\n")
    base = copy.deepcopy(model.state_dict())
    calib = calibration_batch(tok, read_text(args.calib), args.calib_samples, args.ctx, seed=0)
    print("| setting | ΔNLL | KL | ΔNLL − KL | g·δ | ΔNLL(−δ) |\n|---|---|---|---|---|---|")
    for kw in SETTINGS:
        model.load_state_dict(base)
        compress_model(model, CompressConfig(calib_samples=args.calib_samples, calib_seq=args.ctx, **kw), calib,
                       progress=False)
        delta = {k: v - base[k] for k, v in model.state_dict().items()}
        linear = sum(float((grad[k] * delta[k]).sum()) for k in grad)
        ours = evaluate(model)[1]
        nll, kl = math.log(ours["ppl"]), ours["kl"]
        model.load_state_dict({k: base[k] - d for k, d in delta.items()})
        mirrored = math.log(evaluate(model)[1]["ppl"])
        print(f"| {label(kw)} | {nll - dense_nll:+.5f} | {kl:.5f} | {nll - dense_nll - kl:+.5f} | {linear:+.5f} "
              f"| {mirrored - dense_nll:+.5f} |", flush=True)


if __name__ == "__main__":
    main()
