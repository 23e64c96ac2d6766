"""The mutation score per module from a finished `mutmut run` (`make mutation`): one table, written to
runs/mutation/score.txt and printed, and every surviving mutant's diff in runs/mutation/survivors.diff
(candidates for new tests; `.venv/bin/mutmut show NAME` shows one).

mutmut 3 keeps its verdicts per mutated file in mutants/<path>.meta (JSON: exit code per mutant).
Run from the repository root, with mutmut installed (the Makefile's `mutation` target does both).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

try:
    from mutmut.stats import status_by_exit_code
except ImportError:  # mutmut 3.8.1's mapping (mutmut/stats.py), so a copied mutants/ still reads
    _CODES = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 2: "interrupted",
              None: "not checked", 34: "skipped", 35: "suspicious", 36: "timeout", 37: "caught by type check",
              -24: "timeout", 24: "timeout", 152: "timeout", 255: "timeout", -11: "segfault", -9: "segfault"}

    class _Codes(dict):
        def __missing__(self, key):
            return "suspicious"

    status_by_exit_code = _Codes(_CODES)

COLUMNS = ("killed", "timeout", "survived", "no tests", "other")


def verdicts(meta: Path) -> dict[str, str]:
    data = json.loads(meta.read_text(encoding="utf-8"))
    return {name: status_by_exit_code[code] for name, code in data["exit_code_by_key"].items()}


def table(rows: list[tuple[str, Counter]]) -> list[str]:
    head = ["module", "mutants", *COLUMNS, "score"]
    body = []
    for module, c in rows:
        total = sum(c.values())
        caught = c["killed"] + c["timeout"]
        body.append([module, str(total), *(str(c[k]) for k in COLUMNS),
                     f"{caught}/{total} = {100 * caught / total:.1f}%" if total else "-"])
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    fmt = lambda r: "  ".join(s.ljust(w) if i == 0 else s.rjust(w) for i, (s, w) in enumerate(zip(r, widths)))
    return [fmt(head), "  ".join("-" * w for w in widths), *map(fmt, body)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mutants", type=Path, default=Path("mutants"))
    ap.add_argument("--out", type=Path, default=Path("runs/mutation"))
    ap.add_argument("--header", default="", help="a line above the table (tool, date, machine)")
    args = ap.parse_args(argv)

    metas = sorted(args.mutants.rglob("*.py.meta"))
    if not metas:
        print(f"no mutmut results under {args.mutants}/: run `make mutation`", file=sys.stderr)
        return 1
    rows, survivors, total = [], [], Counter()
    for meta in metas:
        source = meta.relative_to(args.mutants).with_suffix("")  # src/hardy/fault/policy.py
        v = verdicts(meta)
        c = Counter(s if s in COLUMNS else "other" for s in v.values())
        rows.append((str(source), c))
        total += c
        survivors += [(source, name) for name, s in v.items() if s == "survived"]
    rows.append(("all", total))

    lines = [args.header] if args.header else []
    lines += table(rows)
    lines += ["", "score = (killed + timeout) / mutants; `no tests`: no selected test calls the mutated function.",
              f"{len(survivors)} survivors, with their diffs: {args.out / 'survivors.diff'}"]
    lines += ["", "survivors:"] + [f"  {name}" for _, name in survivors]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "score.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")

    try:  # the diffs, from the mutated files mutmut left (read-only use of its helper)
        from mutmut.mutation.diff_apply import get_diff_for_mutant

        diffs = [f"# {name}\n{get_diff_for_mutant(name, path=source)}" for source, name in survivors]
        (args.out / "survivors.diff").write_text("\n\n".join(diffs) + "\n", encoding="utf-8")
    except Exception as e:  # noqa: BLE001 - the score stands without the diffs
        print(f"(no survivors.diff: {type(e).__name__}: {e})", file=sys.stderr)

    end = lines.index("survivors:")
    print("\n".join(lines[:end - 1]))
    print(f"(the table and the survivors' names: {args.out / 'score.txt'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
