"""What the decode benches share: their command-line options, a median timer and the `transformers` baseline
(SmolLM2-135M fp32 from the same GGUF, greedy, exactly `new_tokens` tokens)."""
from __future__ import annotations

import statistics
import time


def add_decode_args(ap) -> None:
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt", default="The history of the Roman Empire begins with")


def transformers_smollm2(prompt: list[int], new_tokens: int, pad_id: int | None):
    """A callable running one greedy generation with transformers: returns (seconds, new token ids)."""
    import torch
    import transformers

    from hardy.formats.packaged import smollm2_gguf_path

    path = smollm2_gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    ids = torch.tensor([prompt])

    @torch.inference_mode()
    def run():
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=pad_id)
        return time.perf_counter() - t0, out[0, len(prompt):].tolist()

    return run


def median_s(fn, n: int = 7) -> float:
    """Median seconds of `n` calls of fn, after one warm-up call."""
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
