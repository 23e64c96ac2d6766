"""Streaming data at corpus scale: a generated corpus of --gb GB is prepared (`hardy data prepare`, SmolLM2's
tokenizer) and trained from (`hardy train`, the micro preset), each in its own process; their peak RSS and
prepare's throughput are reported.

    .venv/bin/python bench/prepare_stream.py --gb 4 --dir /tmp/stream-bench

Issue 39's goal: a 4 GB generated corpus is prepared and trained from with the process RSS <= 1.5 GiB.
The corpus: documents of 100-2,000 words drawn from WikiText-2's vocabulary, 1% of them exact copies
and 1% near copies (a tail of words replaced) of earlier ones, so de-duplication has work to do.
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path


def generate(path: Path, gb: float, seed: int = 0) -> int:
    from hardy.data.text import read_text

    words = read_text("wikitext2-valid").split()
    rng, docs, kept = random.Random(seed), 0, []
    with open(path, "w") as f:
        while f.tell() < gb * 2 ** 30:
            roll = rng.random()
            if kept and roll < 0.01:
                doc = rng.choice(kept)
            elif kept and roll < 0.02:
                base = rng.choice(kept).split()
                cut = max(1, len(base) // 20)
                doc = " ".join(base[:-cut] + [rng.choice(words) for _ in range(cut)])
            else:
                doc = " ".join(rng.choice(words) for _ in range(rng.randint(100, 2000)))
            if rng.random() < 0.001 and len(kept) < 1000:
                kept.append(doc)
            f.write(doc + "\n\n")
            docs += 1
    return docs


PEAK_OF = ("import resource, subprocess, sys\n"
           "code = subprocess.run(sys.argv[1:]).returncode\n"
           "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)\n"
           "sys.exit(code)")


def child_peak(cmd: list[str], log: Path) -> tuple[float, float]:
    """(seconds, peak RSS bytes) of a command, measured by a runner whose only child it is."""
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.run([sys.executable, "-c", PEAK_OF, *cmd], stdout=out, stderr=subprocess.PIPE, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed: see {log}\n{proc.stderr[-2000:]}")
    return time.perf_counter() - t0, int(proc.stderr.strip().splitlines()[-1]) * 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=4.0)
    ap.add_argument("--dir", default="/tmp/stream-bench")
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    corpus = root / "corpus.txt"
    t0 = time.perf_counter()
    docs = generate(corpus, args.gb)
    print(f"generated {corpus.stat().st_size / 2 ** 30:.2f} GiB, {docs:,} documents in {time.perf_counter() - t0:.0f} s",
          flush=True)
    hardy = [sys.executable, "-m", "hardy"]
    prep_s, prep_peak = child_peak(hardy + ["data", "prepare", "--input", str(corpus), "--tokenizer", "smollm2",
                                            "--out", str(root / "ds"), "--val-fraction", "0.001"], root / "prepare.log")
    index = json.loads((root / "ds" / "index.json").read_text())
    train_s, train_peak = child_peak(hardy + ["train", "--run-dir", str(root / "run"), "--set", "model.preset=micro",
                                              "--set", f"data.path={root / 'ds'}", "--set", "data.seq_len=256",
                                              "--set", f"train.steps={args.steps}", "--set", "log.progress=false",
                                              "--set", "checkpoint.at_end=false"], root / "train.log")
    print((root / "prepare.log").read_text()[-1500:])
    size = corpus.stat().st_size
    print("| measure | value |\n|---|---|")
    print(f"| corpus | {size / 2 ** 30:.2f} GiB, {docs:,} documents |")
    print(f"| kept / tokens | {index['report']['kept']:,} documents, {index['splits']['train']['tokens']:,} train tokens |")
    print(f"| prepare | {prep_s:.0f} s ({size / prep_s / 2 ** 20:.1f} MiB/s), peak RSS {prep_peak / 2 ** 30:.2f} GiB |")
    print(f"| train ({args.steps} steps, micro) | {train_s:.0f} s, peak RSS {train_peak / 2 ** 30:.2f} GiB |")


if __name__ == "__main__":
    main()
