"""hardy demo: the main job on this machine — probe, plan, prepare, train through injected failures,
evaluate, compress, generate — and a report of it all (RUN_DIR/report.html)."""
from __future__ import annotations

from pathlib import Path

from hardy.errors import HardyError
from hardy.extras import require as require_extra


def register(sub) -> None:
    p = sub.add_parser("demo", help="the whole story: probe, plan, train through injected failures, "
                                    "evaluate, compress, generate, and an HTML report")
    p.add_argument("--run-dir", type=Path, default=Path("runs/demo"),
                   help="where everything goes (default runs/demo; a previous demo's is replaced)")
    p.add_argument("--steps", type=int, default=320, help="training steps (default 320)")
    p.add_argument("--nproc", type=int, default=2, help="training processes (default 2)")
    p.add_argument("--faults", default=None, help="fault.inject spec (default: a NaN, a crash and a hang spread "
                                                  "over the run); '' for none")
    p.add_argument("--eval-tokens", type=int, default=16384, help="held-out tokens for perplexity (default 16384)")
    p.add_argument("--probe", type=Path, default=None, metavar="FILE",
                   help="a profile of this machine from `hardy probe --out FILE` (or an earlier demo's "
                        "RUN_DIR/hardware-profile.json), used instead of probing again")
    p.set_defaults(func=run)


def run(args) -> int:
    require_extra("plots", "hardy demo (its report's plots)")
    require_extra("ft", "hardy demo (its live-recovery stage)")
    from hardy.demo.job import DemoOptions, run_demo

    if args.eval_tokens < 256:
        raise HardyError(f"--eval-tokens must be >= 256 (got {args.eval_tokens})")
    results = run_demo(DemoOptions(run_dir=args.run_dir, steps=args.steps, nproc=args.nproc, faults=args.faults,
                                   eval_tokens=args.eval_tokens, probe_file=args.probe))
    print()
    width = max(len(s["name"]) for s in results["stages"])
    for s in results["stages"]:
        print(f"  {s['name']:<{width}}  {s['seconds']:6.1f} s  {s['summary']}")
    print(f"hardy demo: done in {results['wall_s']:.0f} s; report: {args.run_dir / 'report.html'}")
    return 0
