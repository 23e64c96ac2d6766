"""How long `hardy demo` takes on this machine (issue 23's goal: <= 5 minutes after install).

Runs the demo REPEATS times in fresh interpreters, as `make demo` does, and prints the wall time of
each run and the median time of every stage, against the 300-s goal.

    .venv/bin/python bench/demo_bench.py --repeats 3 --dir /tmp/demo-bench
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from native import median_ci  # noqa: E402
from results import record  # noqa: E402

GOAL_S = 300.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/demo-bench"))
    ap.add_argument("--record", action="store_true", help="write the wall time to bench/results/ "
                    "(BENCHMARKS.md's table)")
    args = ap.parse_args()
    walls, stages = [], {}
    for i in range(args.repeats):
        run_dir = args.dir / f"run{i}"
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "hardy", "demo", "--run-dir", str(run_dir)],
                              capture_output=True, text=True)
        wall = time.perf_counter() - t0  # the command as a user times it: interpreter start-up included
        if proc.returncode:
            print(proc.stdout[-2000:], proc.stderr[-2000:], file=sys.stderr)
            return 1
        results = json.loads((run_dir / "demo.json").read_text())
        walls.append(wall)
        for s in results["stages"]:
            stages.setdefault(s["name"], []).append(s["seconds"])
        incidents = [i["kind"] for i in results["train"]["incidents"]]
        print(f"run {i + 1}: {wall:.1f} s, goodput {100 * results['train']['goodput']['goodput']:.1f}%, "
              f"incidents {incidents}", flush=True)
    print("\n| stage | median s |\n|---|---|")
    for name, secs in stages.items():
        print(f"| {name} | {statistics.median(secs):.1f} |")
    median = statistics.median(walls)
    print(f"| **hardy demo, whole command** | **{median:.1f}** (runs: {', '.join(f'{w:.0f}' for w in walls)}) |")
    print(f"\nmedian / 300-s goal = {median / GOAL_S:.2f}")
    if args.record:
        record("make-demo-wall-time", issue=23, goal="make demo wall time", target=("<=", GOAL_S),
               figure=f"{median:.1f} s (runs {', '.join(f'{w:.0f}' for w in walls)} s)", baseline=None,
               ratio=median_ci(walls), runs=args.repeats, digits=1, unit="s", alternating=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
