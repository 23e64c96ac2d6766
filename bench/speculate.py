"""Speculative decoding against plain greedy decoding, alternating, >= 5 repetitions: decode tokens/s on
prompts with much to copy (editing a given code file, quoting a given passage) and on prompts with
nothing to copy, at batch 1 (`generate`) and batch 4 (the serving engine, four such requests at once).

    .venv/bin/python bench/speculate.py --model smollm2-135m --reps 5 --speculate ngram

Issue 40's goal: >= 1.5x tokens/s on copy-heavy prompts and <= 3% slower on prompts with nothing to
copy, at batch 1 and batch 4. Each repetition uses a fresh speculator (its policy starts from nothing).
Both count decode only: batch 1 `GenerationStats.decode_s`; batch 4 the tokens after the last request's
first token, over the time from it to the last token.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from native import cpu_line, fmt, median_ci  # noqa: E402
from results import record, slug  # noqa: E402

CODE = '''import json
from pathlib import Path


def load_scores(path):
    """Read the scores file: one JSON object per line."""
    scores = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            scores.append(json.loads(line))
    return scores


def best_player(scores):
    best = None
    for entry in scores:
        if best is None or entry["points"] > best["points"]:
            best = entry
    return best


def average_points(scores):
    if not scores:
        return 0.0
    return sum(entry["points"] for entry in scores) / len(scores)
'''
PASSAGE = ("The lighthouse stood on a narrow spit of rock at the mouth of the bay. It was built in 1871 from "
           "granite quarried on the island, and its lamp burned whale oil until 1904, when the keepers switched "
           "to kerosene. The last keeper, Margaret Hale, left in 1962, after the light was automated. Today the "
           "tower is a museum, and visitors can climb its 112 steps to the gallery on clear afternoons.")
COPY = [
    f"Here is a Python file:\n\n{CODE}\nRename the function best_player to top_player. Reply with the whole file.",
    f"Here is a Python file:\n\n{CODE}\nAdd type hints to every function. Reply with the whole file.",
    f"Passage:\n{PASSAGE}\n\nQuote, word for word, the sentences of the passage about the keepers and the lamp.",
    f"Passage:\n{PASSAGE}\n\nRepeat the passage exactly, then say in one line when the light was automated.",
]
FREE = [
    "Write a short story about a dragon who learns to bake bread.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give five tips for staying focused while studying.",
    "Describe a walk through a forest in autumn.",
]


def encode(tok, text: str) -> list[int]:
    return tok.encode_chat(tok.apply_chat_template([{"role": "user", "content": text}]))


def batch1(loaded, prompts, spec, new_tokens) -> float:
    """Decode tokens/s over the prompts, one generation each."""
    from hardy.cli.common import speculator_for
    from hardy.infer.generate import SamplingConfig, generate

    tokens = seconds = 0.0
    for prompt in prompts:
        speculator = speculator_for(ARGS, spec, loaded, 1, len(prompt) + new_tokens, ARGS.kv) if spec else None
        out = generate(loaded.model, prompt, SamplingConfig(max_new_tokens=new_tokens),
                       stop_ids=loaded.tokenizer.stop_ids, speculator=speculator)
        tokens += out.stats.new_tokens - 1
        seconds += out.stats.decode_s
    return tokens / seconds


def batch4(loaded, prompts, spec, new_tokens) -> float:
    """Decode tokens/s of the requests served together: the tokens after the last request's first
    one, over the time from it to the last token (the prompts' prefill is not decode)."""
    from hardy.cli.common import speculator_for
    from hardy.infer.generate import SamplingConfig
    from hardy.serve.engine import Engine, Request

    context = max(map(len, prompts)) + new_tokens
    speculator = speculator_for(ARGS, spec, loaded, len(prompts), context, ARGS.kv) if spec else None
    engine = Engine(loaded.model, max_batch=len(prompts), context=context, kv_dtype=ARGS.kv, speculator=speculator)
    arrivals: list[list[float]] = [[] for _ in prompts]

    def listen(request, times):  # blocked in get(): no CPU taken from the engine
        while request.events.get(timeout=600)[0] == "token":
            times.append(time.perf_counter())

    try:
        requests = [Request(p, SamplingConfig(max_new_tokens=new_tokens), loaded.tokenizer.stop_ids) for p in prompts]
        listeners = [threading.Thread(target=listen, args=(r, t)) for r, t in zip(requests, arrivals)]
        for r, listener in zip(requests, listeners):
            engine.submit(r)
            listener.start()
        for listener in listeners:
            listener.join()
    finally:
        engine.close()
    start = max(times[0] for times in arrivals)
    later = [t for times in arrivals for t in times if t > start]
    return len(later) / (max(later) - start)


def record_row(row: dict) -> None:
    """Issue 40's goal for the row: >= 1.5x with much to copy, <= 3% slower with nothing to copy."""
    mode, copy = ARGS.speculate.split(":")[0], row["prompts"] == "copy"
    model = "" if ARGS.model == "smollm2-135m" else f"-{slug(ARGS.model)}"
    record(f"speculate-{mode}-{row['prompts']}-b{row['batch']}{model}", issue=40,
           goal=f"Speculation (--speculate {ARGS.speculate}), {'copy-heavy' if copy else 'nothing-to-copy'} prompts, "
           f"batch {row['batch']}, {Path(ARGS.model).name}",
           target=(">=", 1.5 if copy else 0.97), figure=f"{row['speculating'][0]:.1f} tok/s",
           baseline=f"plain decode {row['plain'][0]:.1f} tok/s", ratio=row["ratio"], runs=ARGS.reps)


def main() -> None:
    global ARGS
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--speculate", default="ngram")
    p.add_argument("--speculate-tokens", type=int, default=6)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batches", default="1,4", help="1 and/or 4")
    p.add_argument("--out", default=None, help="append the result as one JSON line")
    p.add_argument("--record", action="store_true", help="write each row's ratio to bench/results/ "
                   "(BENCHMARKS.md's table)")
    ARGS = p.parse_args()
    import torch

    from hardy.cli.common import parse_speculation, use_fast_prefill
    from hardy.formats.chat import use_chat_template
    from hardy.loading.load import load_model

    ARGS.dtype, ARGS.gguf_weights, ARGS.kv = "fp32", "native", torch.bfloat16
    spec = parse_speculation(ARGS)
    loaded = load_model(ARGS.model, gguf="native")
    use_fast_prefill(loaded)
    use_chat_template(loaded.tokenizer, None)
    sets = {"copy": [encode(loaded.tokenizer, t) for t in COPY], "free": [encode(loaded.tokenizer, t) for t in FREE]}
    print(f"# {cpu_line()}; {ARGS.model}; --speculate {ARGS.speculate} --speculate-tokens {ARGS.speculate_tokens}; "
          f"{ARGS.new_tokens} new tokens; {ARGS.reps} alternating repetitions", flush=True)
    rows = []
    for batch in map(int, ARGS.batches.split(",")):
        run = batch1 if batch == 1 else batch4
        for kind, prompts in sets.items():
            plain, fast = [], []
            for rep in range(ARGS.reps):  # the four prompts one after another (batch 1) or together
                plain.append(run(loaded, prompts, None, ARGS.new_tokens))
                fast.append(run(loaded, prompts, spec, ARGS.new_tokens))
                print(f"  batch {batch} {kind} rep {rep + 1}: plain {plain[-1]:.1f}, speculating {fast[-1]:.1f} tok/s",
                      flush=True)
            ratios = [f / q for f, q in zip(fast, plain)]
            row = {"batch": batch, "prompts": kind, "plain": median_ci(plain), "speculating": median_ci(fast),
                   "ratio": median_ci(ratios)}
            rows.append(row)
            print(f"batch {batch} {kind}: plain {fmt(*row['plain'])} tok/s, speculating {fmt(*row['speculating'])} "
                  f"tok/s, ratio {fmt(*row['ratio'], digits=2)}x", flush=True)
            if ARGS.record:
                record_row(row)
    if ARGS.out:
        with open(ARGS.out, "a") as f:
            f.write(json.dumps({"cpu": cpu_line(), "model": ARGS.model, "speculate": ARGS.speculate,
                                "tokens": ARGS.speculate_tokens, "new_tokens": ARGS.new_tokens, "rows": rows}) + "\n")


if __name__ == "__main__":
    main()
