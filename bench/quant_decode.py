"""Decode tokens/s at batch 1 for SmolLM2-135M: hardy fp32 / int8 / int4 (the fused kernels) against
`transformers` fp32 on the same weights and, where `llama-cpp-python` is installed, llama.cpp
running hardy's own GGUF exports (Q8_0, Q4_0, Q4_1). Runs alternate so machine noise hits all;
medians and ratios are printed.

    .venv/bin/python bench/quant_decode.py --threads 2 --new-tokens 128 --repeats 5

The quantized models are RTN (no calibration needed for speed): int8 per channel and int4 g32
(= Q4_1), with the embedding / tied LM head quantized too ("+emb") — and int4 with it left in fp32,
to show what the 28 M-parameter head costs.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from decode_common import add_decode_args, transformers_smollm2


def compress_rtn(base, bits: int, group: int, embeddings: str, out: Path):
    from hardy.compress.pipeline import CompressConfig, compress_model
    from hardy.compress.store import save_compressed
    from hardy.loading.load import load_model

    src = load_model(base)
    cfg = CompressConfig(quant="rtn", bits=bits, group_size=group, embeddings=embeddings)
    result = compress_model(src.model, cfg, None, progress=False)
    save_compressed(src.config, result.state, result.quantized, src.tokenizer, out, {"bench": True})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_decode_args(ap)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--pair", action="store_true",
                    help="only the issue's pair: the default `hardy compress --bits 4` against llama.cpp on the shipped Q4_1")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from hardy.formats.gguf_export import export_gguf
    from hardy.loading.load import load_model
    from hardy.infer.generate import SamplingConfig, generate

    tmp = Path(tempfile.mkdtemp(prefix="hardy-qdecode-"))
    if args.pair:
        return pair(args, tmp)
    variants = {"hardy fp32": "smollm2-135m",
                "hardy int8 +emb": compress_rtn("smollm2-135m", 8, 0, "same", tmp / "int8"),
                "hardy int4 g32 +emb": compress_rtn("smollm2-135m", 4, 32, "same", tmp / "int4"),
                "hardy int4 g32 (default)": compress_rtn("smollm2-135m", 4, 32, "int8", tmp / "int4-int8emb"),
                "hardy int4 g32 dense emb": compress_rtn("smollm2-135m", 4, 32, "dense", tmp / "int4-fp32emb")}
    models = {name: load_model(str(spec)) for name, spec in variants.items()}
    models["hardy shipped Q4_1, native"] = load_model("smollm2-135m", gguf="native")
    tok = models["hardy fp32"].tokenizer
    prompt = tok.encode(args.prompt)
    cfg = SamplingConfig(max_new_tokens=args.new_tokens)
    runners = {}
    for name, loaded in models.items():
        runners[name] = (lambda m=loaded.model: generate(m, prompt, cfg).stats.decode_tps)

    if not args.no_hf:
        run_hf = transformers_smollm2(prompt, args.new_tokens, tok.eos_id)
        runners["transformers fp32"] = lambda: args.new_tokens / run_hf()[0]

    try:
        import llama_cpp
    except ImportError:
        llama_cpp = None
        print("(llama-cpp-python is not installed: no llama.cpp rows; `pip install llama-cpp-python` compiles it)")
    if llama_cpp is not None:
        from hardy.formats.packaged import smollm2_gguf_path

        for qtype, source in (("Q8_0", "hardy int8 +emb"), ("Q4_0", "hardy fp32"), ("Q4_1", "hardy int4 g32 +emb"),
                              ("Q4_1 shipped", None)):
            path = tmp / f"smollm2-{qtype}.gguf"
            if source is None:
                path = smollm2_gguf_path()
            else:
                src = models[source]
                export_gguf(src.model, src.config, src.tokenizer, path, qtype)
            runners[f"llama.cpp {qtype}" + ("" if source is None else " (hardy export)")] = llama_runner(llama_cpp, path, args)

    rates = alternate(runners, args.repeats)
    med = {name: statistics.median(r) for name, r in rates.items()}
    base = med["hardy fp32"]
    print(f"SmolLM2-135M, batch 1, {args.threads} threads, {len(prompt)}-token prompt, {args.new_tokens} new tokens, "
          f"median of {args.repeats}")
    print(f"  {'model':<32} {'decode tok/s':>12} {'vs hardy fp32':>14}")
    for name, rate in med.items():
        print(f"  {name:<32} {rate:12.1f} {rate / base:13.2f}x")
    for name in med:
        if name.startswith("llama.cpp Q4"):
            for ours in ("hardy int4 g32 +emb", "hardy int4 g32 (default)", "hardy shipped Q4_1, native"):
                print(f"  {ours} / {name}: {med[ours] / med[name]:.2f}x")


def alternate(runners: dict, repeats: int) -> dict[str, list[float]]:
    """Each runner's results over `repeats` rounds, the runners taking turns within a round (machine
    noise then hits all), after one warm-up call each."""
    for fn in runners.values():
        fn()
    rates = {name: [] for name in runners}
    for _ in range(repeats):
        for name, fn in runners.items():
            rates[name].append(fn())
    return rates


def llama_runner(llama_cpp, path: Path, args):
    llm = llama_cpp.Llama(model_path=str(path), n_threads=args.threads, n_ctx=512, verbose=False)

    def run():
        # Decode only, like hardy's decode_tps: time from the first new token to the last;
        # every token after the first is one llama_decode of one token (no stop at EOS).
        llm.reset()
        stamps = []
        for _ in llm.generate(llm.tokenize(args.prompt.encode(), add_bos=False), temp=0.0, reset=True):
            stamps.append(time.perf_counter())
            if len(stamps) == args.new_tokens:
                break
        return (len(stamps) - 1) / (stamps[-1] - stamps[0])

    return run


def pair(args, tmp: Path) -> None:
    """The default int4 model and llama.cpp on the shipped file, alternating `--repeats` times."""
    import llama_cpp

    from hardy.infer.generate import SamplingConfig, generate
    from hardy.formats.packaged import smollm2_gguf_path
    from hardy.loading.load import load_model

    ours = load_model(str(compress_rtn("smollm2-135m", 4, 32, "int8", tmp / "default")))
    prompt = ours.tokenizer.encode(args.prompt)
    cfg = SamplingConfig(max_new_tokens=args.new_tokens)
    runners = {"hardy default int4": lambda: generate(ours.model, prompt, cfg).stats.decode_tps,
               "llama.cpp shipped Q4_1": llama_runner(llama_cpp, smollm2_gguf_path(), args)}
    rates = alternate(runners, args.repeats)
    for name, r in rates.items():
        print(f"  {name:<24} median {statistics.median(r):6.1f} tok/s  runs " + " ".join(f"{x:.1f}" for x in r))
    ratio = statistics.median(rates["hardy default int4"]) / statistics.median(rates["llama.cpp shipped Q4_1"])
    print(f"  default / llama.cpp shipped Q4_1: {ratio:.2f}x ({args.repeats} alternating pairs, {args.threads} threads, "
          f"{args.new_tokens} new tokens)")


if __name__ == "__main__":
    main()
