"""How much faster could int4 re-ranking be than fp32 on this CPU? Re-ranking is prefill (one forward
over the candidates, no decode), so its time is the GEMMs plus what does not shrink with the weights'
precision (attention, norms, activations). This measures both on SmolLM2-135M at re-ranking's shape,
then the best int8 GEMM torch ships for x86 CPUs (FBGEMM's u8 x s8, through dynamic quantization:
the integer multiply-add path an int4/int8 kernel would use) against the fp32 GEMM, per layer shape.
The bound printed is Amdahl's: fp32 time x (other share + GEMM share / int8 speed-up) — what an
integer prefill as fast as FBGEMM's would give, before any dequantization or scale work of its own.

    .venv/bin/python bench/int8_gemm_bound.py --threads 2 --tokens 1536
"""
from __future__ import annotations

import argparse
import warnings

import torch
from decode_common import median_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=1536, help="tokens per scoring pass (20 candidates of ~77)")
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from hardy.loading.load import load_model

    model = load_model("smollm2-135m").model.eval()
    rows = 20
    tokens = torch.randint(0, model.cfg.vocab_size, (rows, args.tokens // rows))
    with torch.inference_mode():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                model.hidden_states(tokens, 0)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    gemm = sum(e.self_cpu_time_total for e in events if e.key in ("aten::mm", "aten::addmm", "aten::bmm"))
    share = gemm / total
    print(f"SmolLM2-135M fp32 forward, {rows} x {args.tokens // rows} tokens, {args.threads} threads: "
          f"GEMMs {share:.0%} of the time (torch profiler, self time)")

    d, f, kv = model.cfg.dim, model.cfg.ffn_dim, model.cfg.n_kv_heads * (model.cfg.dim // model.cfg.n_heads)
    shapes = {"q / o": (d, d), "k / v": (d, kv), "gate / up": (d, f), "down": (f, d)}
    weights = {"q / o": 2, "k / v": 2, "gate / up": 2, "down": 1}  # each shape's count per block: FLOP weights
    print(f"  {'layer (K -> N)':<22} {'fp32 GFLOP/s':>12} {'int8 GOP/s':>11} {'int8 / fp32':>11}")
    fp32_time = int8_time = 0.0
    for name, (k, n) in shapes.items():
        x, w = torch.randn(args.tokens, k), torch.randn(n, k)
        linear = torch.nn.Linear(k, n, bias=False)
        linear.weight.data = w
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao's deprecation notice
            dynamic = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(linear), {torch.nn.Linear},
                                                             dtype=torch.qint8)
        with torch.inference_mode():
            t32 = median_s(lambda: x @ w.t(), args.repeats)
            t8 = median_s(lambda: dynamic(x), args.repeats)
        flops = 2 * args.tokens * k * n
        fp32_time += weights[name] * t32
        int8_time += weights[name] * t8
        print(f"  {name + f' ({k} -> {n})':<22} {flops / t32 / 1e9:12.1f} {flops / t8 / 1e9:11.1f} {t32 / t8:10.2f}x")
    speedup = fp32_time / int8_time
    bound = (1 - share) + share / speedup
    print(f"  a block's GEMMs: int8 {speedup:.2f}x the fp32 rate")
    print(f"best int8 prefill / fp32 prefill >= {bound:.2f} (Amdahl: {1 - share:.0%} unchanged + {share:.0%} / {speedup:.2f})")


if __name__ == "__main__":
    main()
