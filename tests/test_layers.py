"""The package layering, checked on every import statement in src/hardy (function-level ones too):
dependencies flow one way, cli → eval/plan/serve → train/infer/compress/loading → parallel/checkpoint/
fault → data/ops → formats → model → core, with no cycle between packages. `loading` (everything
`--model` accepts) sits beside compress because it swaps in compress's quantized modules.

An import inside a function is there for start-up time or an optional dependency, never to dodge a
cycle: outside `cli` each one says why in a comment (on its line, or on the line above its group);
the command line imports each command's machinery in its handler, and a test checks that those
modules really are left out of start-up."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "hardy"
LEVEL = {"core": 0, "model": 1, "formats": 2, "data": 3, "ops": 3, "parallel": 4, "checkpoint": 4, "fault": 4,
         "train": 5, "infer": 5, "compress": 5, "loading": 5, "eval": 6, "plan": 6, "serve": 6, "demo": 7, "cli": 8}


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


def test_imports_flow_one_way():
    upward = sorted({(a, b, f) for a, b, f in imports() if LEVEL[b] > LEVEL[a]})
    assert not upward, f"imports against the layering (importer, imported, file): {upward}"


def test_no_import_cycle_between_packages():
    graph = defaultdict(set)
    for a, b, _ in imports():
        graph[a].add(b)

    def reaches(start: str, goal: str, seen: set) -> bool:
        return any(n == goal or (n not in seen and not seen.add(n) and reaches(n, goal, seen)) for n in graph[start])

    cycles = sorted((a, b) for a in list(graph) for b in graph[a] if reaches(b, a, set()))
    assert not cycles, f"packages that import each other (directly or around a loop): {cycles}"


# The reasons an import may sit inside a function: start-up time, an optional dependency (an extra), or
# an import order another call must come first for (matplotlib's backend).
REASON = re.compile(r"#\s*(start-up|optional|order)\b")


def function_level_imports(root: Path = SRC) -> list[tuple[str, int, bool]]:
    """(file, line, has a reason) for every import inside a function body: a comment on its line, or on
    the comment block above its group, that starts with one of REASON's words."""
    found = []
    for path in sorted(root.rglob("*.py")):
        source = path.read_text()
        lines = source.splitlines()
        nested = sorted({(node.lineno, node.end_lineno) for fn in ast.walk(ast.parse(source, str(path)))
                         if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) for node in ast.walk(fn)
                         if isinstance(node, (ast.Import, ast.ImportFrom))})
        reasoned_ends = set()
        for first, last in nested:
            comment = REASON.search(lines[first - 1])
            top = first - 2  # the first line of the comment block right above, if any
            while top > 0 and lines[top - 1].strip().startswith("#") and lines[top].strip().startswith("#"):
                top -= 1
            above = REASON.match(lines[top].strip())
            if comment or above or (first - 1) in reasoned_ends:
                reasoned_ends.add(last)
            found.append((str(path.relative_to(root)), first, last in reasoned_ends))
    return found


def test_every_function_level_import_outside_the_command_line_says_why():
    bare = [f"{f}:{line}" for f, line, reasoned in function_level_imports() if not reasoned and not f.startswith("cli/")]
    assert not bare, f"imports inside functions without a reason (start-up time, optional dependency): {bare}"


def test_the_command_lines_lazy_imports_keep_start_up_light():
    """What `hardy --help` loads: the parser of every command, none of their engines (which is why
    cli handlers import inside the function)."""
    code = ("import sys; from hardy.cli.main import build_parser; build_parser(); "
            "print(' '.join(sorted(sys.modules)))")
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                timeout=120).stdout.split())
    heavy = {"hardy.train.trainer", "hardy.serve.api", "hardy.compress.pipeline", "hardy.eval.perplexity",
             "hardy.infer.generate", "fastapi", "hypercorn", "matplotlib"}
    assert "hardy.cli.serve" in loaded and heavy & loaded == set(), sorted(heavy & loaded)


def test_the_checker_sees_function_level_imports(tmp_path, monkeypatch):
    """The analysis itself: an import inside a function body counts (most of the debt hides there)."""
    fake = tmp_path / "hardy"
    (fake / "model").mkdir(parents=True)
    (fake / "cli").mkdir()
    (fake / "model" / "__init__.py").write_text("")
    (fake / "model" / "llama.py").write_text("def f():\n    from hardy.cli.main import main\n")
    monkeypatch.setattr(__import__(__name__), "SRC", fake)
    assert ("model", "cli", "model/llama.py") in imports()


def test_the_reason_checker_tells_a_bare_import_from_an_explained_one(tmp_path):
    (tmp_path / "m.py").write_text("def f():\n    import json\n\n\ndef g():\n    # start-up: heavy\n"
                                   "    import json\n    import csv\n\n\ndef h():\n    import csv  # optional\n\n\n"
                                   "def k():\n    import csv  # whatever\n    # a comment that gives no reason\n"
                                   "    import json  # noqa: F401\n")
    assert function_level_imports(tmp_path) == [("m.py", 2, False), ("m.py", 7, True), ("m.py", 8, True),
                                                ("m.py", 12, True), ("m.py", 16, False), ("m.py", 18, False)]


def test_one_dtype_map_and_one_cpuinfo_reader():
    """hardy.devices holds the dtype-name map and the /proc/cpuinfo reader; nothing else builds its own."""
    dtype_maps, cpuinfo_readers = [], []
    for path in sorted(SRC.rglob("*.py")):
        rel = str(path.relative_to(SRC))
        text = path.read_text()
        if "/proc/cpuinfo" in text.replace('"""/proc/cpuinfo', ""):
            cpuinfo_readers.append(rel)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Dict) and {"fp32", "bf16"} <= {k.value for k in node.keys
                                                                   if isinstance(k, ast.Constant)}:
                if any(isinstance(v, ast.Attribute) and v.attr == "bfloat16" for v in node.values):
                    dtype_maps.append(rel)
    assert dtype_maps == ["devices.py"] and cpuinfo_readers == ["devices.py"], (dtype_maps, cpuinfo_readers)
