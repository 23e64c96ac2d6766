"""Does a model's held-out perplexity reward damage? Perplexity of a trained hardy run after weakening
every MLP down projection (×0.9, no pruning) and after a logit temperature (final norm gain ÷ / × 1.1),
against the unchanged model on the same chunks, on three texts: the run's own held-out split, the start
of its training split, and an unseen evaluation text. A model whose unseen-text perplexity drops under
such damage ranks compression methods by how much they damage it, not by fidelity (BENCHMARKS.md).

    .venv/bin/python bench/damage_probe.py --model runs/small --eval-data wikitext2-test
    .venv/bin/python bench/damage_probe.py --model runs/small --eval-data tinyshakespeare --max-tokens 100000
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a hardy run directory (its prepared data is read too)")
    ap.add_argument("--eval-data", default="wikitext2-test")
    ap.add_argument("--max-tokens", type=int, default=None, help="only the first N tokens of the evaluation text")
    ap.add_argument("--train-tokens", type=int, default=60_000)
    ap.add_argument("--ctx", type=int, default=256)
    args = ap.parse_args()

    from hardy.data.prepare import load_index, load_split
    from hardy.data.text import read_text
    from hardy.eval.perplexity import paired_difference, perplexity
    from hardy.loading.load import load_model

    torch.set_num_threads(2)
    loaded = load_model(args.model)
    tok, model = loaded.tokenizer, loaded.model
    data = Path(args.model) / "data"
    load_index(data)  # a readable error when the run has no prepared data
    texts = {"held-out split": load_split(data, "val").tolist(),
             f"train[:{args.train_tokens}]": load_split(data, "train")[:args.train_tokens].tolist(),
             args.eval_data: tok.encode(read_text(args.eval_data))[:args.max_tokens]}
    base = {k: v.clone() for k, v in model.state_dict().items()}

    def damage(name: str) -> None:
        model.load_state_dict(base)
        with torch.no_grad():
            if name == "w2 x0.9":
                for layer in model.layers:
                    layer.feed_forward.w2.weight.mul_(0.9)
            elif name == "logits /1.1":
                model.norm.weight.div_(1.1)  # the LM head is linear: an exact temperature
            elif name == "logits x1.1":
                model.norm.weight.mul_(1.1)

    for text_name, tokens in texts.items():
        def evaluate():
            return perplexity(model, tokens, ctx=args.ctx, protocol="full", bos_id=tok.bos_id,
                              add_bos=tok.add_bos, batch_size=8)

        damage("none")
        dense = evaluate()
        print(f"{text_name}: dense {dense.ppl:.4f} ({dense.n_scored} tokens)", flush=True)
        for name in ("w2 x0.9", "logits /1.1", "logits x1.1"):
            damage(name)
            r = evaluate()
            z = paired_difference(dense.chunk_nll, r.chunk_nll).z
            print(f"  {name}: {r.ppl:.4f} ({100 * (r.ppl / dense.ppl - 1):+.2f}%, z = {z:+.1f})", flush=True)
    model.load_state_dict(base)


if __name__ == "__main__":
    main()
