import hashlib, sys, torch
from hardy.formats.load import load_model
from hardy.compress.pipeline import CompressConfig, compress_model
from hardy.cli.compress import calibration_batch
from hardy.data.text import read_text
base = load_model("smollm2-135m")
calib = calibration_batch(base.tokenizer, read_text("wikitext2-valid"), 8, 256, 0)
for kw in (dict(quant="gptq", bits=4, group_size=128), dict(quant="awq", bits=4, group_size=128),
           dict(prune="sparsegpt", sparsity="0.5"), dict(prune="wanda", sparsity="2:4", quant="rtn", bits=8, group_size=0)):
    m = load_model("smollm2-135m").model
    r = compress_model(m, CompressConfig(blocks=(19,), **kw), calib, progress=False)
    h = hashlib.sha256()
    for k in sorted(r.state): h.update(k.encode()); h.update(r.state[k].contiguous().numpy().tobytes())
    for k in sorted(r.quantized):
        for n, t in sorted(r.quantized[k].packed().items()): h.update(t.contiguous().numpy().tobytes())
    print(kw, h.hexdigest()[:16], [round(x.output_error, 6) for x in r.reports][:3], flush=True)
