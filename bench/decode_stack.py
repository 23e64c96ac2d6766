"""One decode step's time inside the fused block stack (hardy.infer.fused_decode: every block of the
model in one C++ call), without the embedding, LM head or Python around it: what the stack's own
scheduling costs on top of reading the weights. SmolLM2-135M compressed with the default
`hardy compress --bits 4` flags, one row at position 40, median of `--calls` calls, for each thread
count given; the LM head alone for comparison.

    .venv/bin/python bench/decode_stack.py --threads 1,2
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from decode_common import median_s  # noqa: E402
from quant_decode import compress_rtn  # noqa: E402  (the default compression, as the decode bench makes it)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()

    from hardy.infer.fused_decode import _fused_caches, fused_blocks
    from hardy.loading.load import load_model

    out = compress_rtn("smollm2-135m", 4, 32, "int8", Path(tempfile.mkdtemp(prefix="hardy-stack-")) / "default")
    model = load_model(str(out)).model
    model.setup_kv_cache(1, 256)
    stack = fused_blocks(model)
    keys, values = _fused_caches(model, [layer.attention.kv_cache for layer in model.layers])
    x, positions, h = torch.randn(1, model.cfg.dim), torch.tensor([40]), torch.randn(1, 1, model.cfg.dim)
    print(f"SmolLM2-135M default int4, {len(model.layers)} blocks, one row at position 40, median of {args.calls}")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        with torch.inference_mode():
            blocks = 1e3 * median_s(lambda: stack(x, positions, model.rope_cos, model.rope_sin, keys, values),
                                    args.calls)
            head = 1e3 * median_s(lambda: model.output(h), args.calls)
        print(f"  {threads} threads: block stack {blocks:.2f} ms, LM head {head:.2f} ms")


if __name__ == "__main__":
    main()
