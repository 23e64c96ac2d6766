"""The package layering, checked on every import statement in src/hardy (function-level ones too):
dependencies flow one way, cli → eval/plan/serve → train/infer/compress/loading → parallel/checkpoint/
fault → data/ops → formats → model → core, with no cycle between packages. `loading` (everything
`--model` accepts) sits beside compress because it swaps in compress's quantized modules.

The imports that still go the wrong way are listed below, each by file, as known debt: the test fails
on any new one, and on a listed one that has gone (so the list only shrinks)."""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "hardy"
LEVEL = {"core": 0, "model": 1, "formats": 2, "data": 3, "ops": 3, "parallel": 4, "checkpoint": 4, "fault": 4,
         "train": 5, "infer": 5, "compress": 5, "loading": 5, "eval": 6, "plan": 6, "serve": 6, "cli": 7}
# (importing package, imported package, file): issue 22 item 5 removes these
KNOWN_UPWARD = {
    ("formats", "compress", "formats/gguf_export.py"),  # finds compress's quantized modules in a model
    ("formats", "compress", "formats/gguf_quant.py"),  # compress's compiled converter and tiled layout
}


def package_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "hardy":
        return None
    if len(parts) > 1 and (SRC / parts[1]).is_dir():
        return parts[1]
    return "core"


def imports() -> list[tuple[str, str, str]]:
    """(importing package, imported package, file) for every `hardy` import in the source tree."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        here = rel.parts[0] if len(rel.parts) > 1 else "core"
        if str(rel) == "__main__.py":
            here = "cli"  # `python -m hardy` is the command line
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                there = package_of(name)
                if there is not None and there != here:
                    found.append((here, there, str(rel)))
    return found


def test_every_package_has_a_level():
    packages = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages <= set(LEVEL), sorted(packages - set(LEVEL))


def test_imports_flow_one_way_except_the_listed_debt():
    upward = {(a, b, f) for a, b, f in imports() if LEVEL[b] > LEVEL[a]}
    assert upward - KNOWN_UPWARD == set(), f"new imports against the layering: {sorted(upward - KNOWN_UPWARD)}"
    assert KNOWN_UPWARD - upward == set(), f"fixed, so take them off KNOWN_UPWARD: {sorted(KNOWN_UPWARD - upward)}"


def test_no_import_cycle_between_packages_apart_from_the_debt():
    graph = defaultdict(set)
    debt = {(a, b) for a, b, _ in KNOWN_UPWARD}
    for a, b, _ in imports():
        if (a, b) not in debt:
            graph[a].add(b)

    def reaches(start: str, goal: str, seen: set) -> bool:
        return any(n == goal or (n not in seen and not seen.add(n) and reaches(n, goal, seen)) for n in graph[start])

    cycles = sorted((a, b) for a in list(graph) for b in graph[a] if reaches(b, a, set()))
    assert not cycles, f"packages that import each other (directly or around a loop): {cycles}"


def test_the_checker_sees_function_level_imports(tmp_path, monkeypatch):
    """The analysis itself: an import inside a function body counts (most of the debt hides there)."""
    fake = tmp_path / "hardy"
    (fake / "model").mkdir(parents=True)
    (fake / "cli").mkdir()
    (fake / "model" / "__init__.py").write_text("")
    (fake / "model" / "llama.py").write_text("def f():\n    from hardy.cli.main import main\n")
    monkeypatch.setattr(__import__(__name__), "SRC", fake)
    assert ("model", "cli", "model/llama.py") in imports()
