"""Resume verification at checkpoint scale: N ranks checksumming their shares of a checkpoint's files
(`hardy.checkpoint.manager.verify_manifest(dir, rank, world)`, as `find_resumable` runs it) against
reading the same bytes once without checksums, both from a cold page cache, alternating, >= 5 reps.

    .venv/bin/python bench/verify_bench.py --gb 20 --ranks 4 --reps 5

Issue 39's goal: verifying a 20 GB checkpoint with 4 ranks takes <= 1.2x the time to read it once.
The checkpoint is synthetic (random bytes in DCP-like shard files plus its manifest); the page cache is
dropped before every timed pass (root: /proc/sys/vm/drop_caches), else the result says it was warm.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from native import cpu_line, fmt, median_ci  # noqa: E402


def build(directory: Path, total_gb: float, files: int) -> None:
    from hardy.checkpoint.manager import write_manifest

    directory.mkdir(parents=True, exist_ok=True)
    size = int(total_gb * 2 ** 30 / files)
    block = os.urandom(1 << 24)
    for i in range(files):
        path = directory / f"__{i % 8}_{i}.distcp"
        if path.exists() and path.stat().st_size == size:
            continue
        with open(path, "wb") as f:
            left = size
            while left:
                n = min(left, len(block))
                f.write(block[:n])
                left -= n
    if not (directory / "manifest.json").exists():
        write_manifest(directory)


def drop_caches() -> bool:
    subprocess.run(["sync"], check=False)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def read_share(directory: str, rank: int, world: int) -> int:
    import json

    from hardy.checkpoint.manager import HASH_BLOCK, share

    files = json.loads((Path(directory) / "manifest.json").read_text())["files"]
    total, block = 0, bytearray(HASH_BLOCK)  # the verifier's own block size and unbuffered reads
    for name in share(files, rank, world):
        with open(Path(directory) / name, "rb", buffering=0) as f:
            while n := f.readinto(block):
                total += n
    return total


def verify_share(directory: str, rank: int, world: int) -> int:
    from hardy.checkpoint.manager import verify_manifest

    verify_manifest(Path(directory), rank, world)
    return rank


def warm(_: int) -> int:
    import hardy.checkpoint.manager  # noqa: F401 (the import is the point)

    return 0


def timed(pool, fn, directory: Path, world: int) -> float:
    t0 = time.perf_counter()
    list(pool.map(fn, [str(directory)] * world, range(world), [world] * world))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=20.0)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--files", type=int, default=32, help="shard files in the checkpoint")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default="/tmp/hardy-verify-bench")
    args = ap.parse_args()
    directory = Path(args.dir)
    build(directory, args.gb, args.files)
    cold = drop_caches()
    reads, verifies, ratios = [], [], []
    with ProcessPoolExecutor(args.ranks) as pool:
        list(pool.map(warm, range(args.ranks)))  # workers started, hardy imported, before any timing
        for rep in range(args.reps):
            drop_caches()
            reads.append(timed(pool, read_share, directory, args.ranks))
            drop_caches()
            verifies.append(timed(pool, verify_share, directory, args.ranks))
            ratios.append(verifies[-1] / reads[-1])
            print(f"rep {rep + 1}: read {reads[-1]:.2f} s, verify {verifies[-1]:.2f} s, ratio {ratios[-1]:.2f}",
                  flush=True)
    size = sum(f.stat().st_size for f in directory.iterdir()) / 2 ** 30
    print(f"\n{size:.1f} GiB checkpoint, {args.ranks} ranks, {cpu_line()}, page cache "
          f"{'dropped before each pass' if cold else 'WARM (not root: could not drop it)'}")
    print("| measure | median [95% interval] |\n|---|---|")
    print(f"| read once ({args.ranks} readers, no checksum), s | {fmt(*median_ci(reads))} |")
    print(f"| verify ({args.ranks} ranks, each its share), s | {fmt(*median_ci(verifies))} |")
    print(f"| verify / read, per pair | {fmt(*median_ci(ratios), digits=2)} |")
    print(f"| read rate, GiB/s | {fmt(*median_ci([size / r for r in reads]))} |")


if __name__ == "__main__":
    main()
