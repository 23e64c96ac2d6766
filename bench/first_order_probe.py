"""Why held-out perplexity cannot rank compression methods on a briefly trained model: for each setting,
the change of mean held-out NLL (ΔNLL), the KL from the dense model (fidelity, what GPTQ/AWQ/SparseGPT
improve), and the first-order term g·δ (g = the gradient of the held-out loss, δ = the weight change
the method made), with ΔNLL of the mirrored change −δ. Near an optimum g ≈ 0 and ΔNLL tracks KL; far
from one, g·δ (of either sign, a different draw for every trained instance) is as large as the
differences in KL between methods.

    .venv/bin/python bench/first_order_probe.py --model RUN --heldout heldout.txt --calib train.txt

Windows of --ctx tokens, every position scored; the dense logits are kept for the KL, so this is for
small vocabularies (the `mini` and `small` models), not SmolLM2.
"""
from __future__ import annotations

import argparse
import copy
import math

import torch
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
    from hardy.formats.load import load_model

    loaded = load_model(args.model)
    model, tok = loaded.model.eval(), loaded.tokenizer
    ids = tok.encode(read_text(args.heldout))
    n = (min(len(ids) - 1, args.max_tokens) // args.ctx) * args.ctx
    x = torch.tensor(ids[:n + 1])
    inputs, targets = x[:-1].view(-1, args.ctx), x[1:].view(-1, args.ctx)
    batches = [(inputs[i:i + args.batch], targets[i:i + args.batch]) for i in range(0, len(inputs), args.batch)]

    def loss(inp, tgt) -> torch.Tensor:  # this batch's share of the mean NLL over all scored tokens
        return F.cross_entropy(model(inp).float().flatten(0, 1), tgt.flatten(), reduction="sum") / targets.numel()

    model.zero_grad()
    for inp, tgt in batches:
        loss(inp, tgt).backward()
    grad = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    model.zero_grad()
    with torch.no_grad():
        dense_logp = [F.log_softmax(model(inp).float(), -1) for inp, _ in batches]
        dense_nll = sum(float(loss(inp, tgt)) for inp, tgt in batches)

    def nll_and_kl() -> tuple[float, float]:
        nll = kl = 0.0
        with torch.no_grad():
            for (inp, tgt), ref in zip(batches, dense_logp):
                logp = F.log_softmax(model(inp).float(), -1)
                nll += float(F.nll_loss(logp.flatten(0, 1), tgt.flatten(), reduction="sum"))
                kl += float((ref.exp() * (ref - logp)).sum())
        return nll / targets.numel(), kl / targets.numel()

    gnorm = math.sqrt(sum(float((g ** 2).sum()) for g in grad.values()))
    print(f"{args.model}: {targets.numel():,} held-out tokens, dense NLL {dense_nll:.4f}, "
          f"held-out gradient norm {gnorm:.3f}\n")
    base = copy.deepcopy(model.state_dict())
    calib = calibration_batch(tok, read_text(args.calib), args.calib_samples, args.ctx, seed=0)
    print("| setting | ΔNLL | KL | ΔNLL − KL | g·δ | ΔNLL(−δ) |\n|---|---|---|---|---|---|")
    for kw in SETTINGS:
        model.load_state_dict(base)
        compress_model(model, CompressConfig(calib_samples=args.calib_samples, calib_seq=args.ctx, **kw), calib,
                       progress=False)
        delta = {k: v - base[k] for k, v in model.state_dict().items()}
        first = sum(float((grad[k] * delta[k]).sum()) for k in grad)
        nll, kl = nll_and_kl()
        model.load_state_dict({k: base[k] - d for k, d in delta.items()})
        mirrored = nll_and_kl()[0]
        print(f"| {label(kw)} | {nll - dense_nll:+.5f} | {kl:.5f} | {nll - dense_nll - kl:+.5f} | {first:+.5f} "
              f"| {mirrored - dense_nll:+.5f} |", flush=True)


if __name__ == "__main__":
    main()
