"""The margins behind tests/test_compress_smollm2.py: SmolLM2 with only the given blocks compressed,
every method of the tests, perplexity change on three 1,024-token slices of WikiText-2 test (the
test's slice, then from tokens 20,000 and 40,000), calibration as in the tests.

    .venv/bin/python bench/compress_test_margins.py --blocks 19,29
"""
from __future__ import annotations

import argparse
import time

from hardy.compress.pipeline import calibration_batch
from hardy.compress.pipeline import CompressConfig, compress_model
from hardy.data.text import read_text
from hardy.eval.perplexity import perplexity
from hardy.loading.load import load_model

SETTINGS = [dict(quant=q, bits=b, group_size=128) for b in (4, 3) for q in ("rtn", "gptq", "awq")] + \
           [dict(prune=p, sparsity=s) for s in ("0.5", "2:4") for p in ("magnitude", "wanda", "sparsegpt")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", default="19,29", help="comma-separated block indices")
    blocks = tuple(int(b) for b in parser.parse_args().blocks.split(","))
    loaded = load_model("smollm2-135m")
    model, tok = loaded.model, loaded.tokenizer
    calib = calibration_batch(tok, read_text("wikitext2-valid")[:100_000], 4, 128, seed=0)
    ids = tok.encode(read_text("wikitext2-test")[:200_000])
    slices = [ids[:1024], ids[20000:21024], ids[40000:41024]]
    base = {k: v.clone() for k, v in model.state_dict().items()}

    def ppls() -> list[float]:
        return [perplexity(model, s, ctx=512, bos_id=tok.bos_id, add_bos=tok.add_bos, batch_size=2).ppl for s in slices]

    dense = ppls()
    print(f"blocks {blocks}; dense PPL per slice: " + " / ".join(f"{p:.3f}" for p in dense))
    print(f"{'setting':<28} {'compress s':>10}  PPL change per slice")
    for kw in SETTINGS:
        model.load_state_dict(base)
        t0 = time.perf_counter()
        compress_model(model, CompressConfig(calib_samples=4, calib_seq=128, blocks=blocks, **kw), calib, progress=False)
        seconds = time.perf_counter() - t0
        name = " ".join(str(v) for v in kw.values())
        change = " / ".join(f"{100 * (p / d - 1):+.1f}%" for p, d in zip(ppls(), dense))
        print(f"{name:<28} {seconds:>10.1f}  {change}", flush=True)


if __name__ == "__main__":
    main()
