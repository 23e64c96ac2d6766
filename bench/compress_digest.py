"""Digests of `compress_model`'s output on SmolLM2-135M block 19, for checking that a change leaves the
CPU results bit for bit as they were (GPTQ, AWQ, SparseGPT, Wanda 2:4 + int8 RTN; 8 calibration windows
of 256 WikiText-2 valid tokens). Run it on two checkouts and compare the lines:

    PYTHONPATH=src .venv/bin/python bench/compress_digest.py
    PYTHONPATH=/path/to/other/checkout/src .venv/bin/python bench/compress_digest.py
"""
from __future__ import annotations

import hashlib

from hardy.cli.compress import calibration_batch
from hardy.compress.pipeline import CompressConfig, compress_model
from hardy.data.text import read_text
from hardy.loading.load import load_model

SETTINGS = (dict(quant="gptq", bits=4, group_size=128), dict(quant="awq", bits=4, group_size=128),
            dict(prune="sparsegpt", sparsity="0.5"),
            dict(prune="wanda", sparsity="2:4", quant="rtn", bits=8, group_size=0))


def main() -> None:
    base = load_model("smollm2-135m")
    calib = calibration_batch(base.tokenizer, read_text("wikitext2-valid"), 8, 256, 0)
    for setting in SETTINGS:
        result = compress_model(load_model("smollm2-135m").model, CompressConfig(blocks=(19,), **setting), calib,
                                progress=False)
        h = hashlib.sha256()
        for name in sorted(result.state):
            h.update(name.encode())
            h.update(result.state[name].contiguous().numpy().tobytes())
        for name in sorted(result.quantized):
            for _, t in sorted(result.quantized[name].packed().items()):
                h.update(t.contiguous().numpy().tobytes())
        errors = [round(r.output_error, 6) for r in result.reports[:3]]
        print(f"{setting}: sha256 {h.hexdigest()[:16]}, first layer errors {errors}", flush=True)


if __name__ == "__main__":
    main()
