"""Installs that fit the ecosystem: every package hardy imports is declared in pyproject.toml, each optional
component's packages sit in its extra (hardy.extras names them), and without any extra `train`,
`generate`, `compress` and `plan` run while `serve`, `eval rank` and plots say in one line which extra
to install."""
from __future__ import annotations

import ast
import importlib.metadata
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from hardy.extras import EXTRAS

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "src" / "hardy"
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
# import names whose distribution may not be installed here (GPU-only), by the name pyproject declares
NOT_INSTALLED_HERE = {"tensorboard": "tensorboard"}


def dist_name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].strip().lower().replace("_", "-")


def declared(group: str | None = None) -> set[str]:
    """Distribution names in `dependencies` (group None) or in one extra."""
    reqs = PROJECT["dependencies"] if group is None else PROJECT["optional-dependencies"][group]
    return {dist_name(r) for r in reqs}


def distributions_of(module: str) -> set[str]:
    found = importlib.metadata.packages_distributions().get(module)
    if found:
        return {d.lower().replace("_", "-") for d in found}
    assert module in NOT_INSTALLED_HERE, f"{module} is imported by hardy but installed by no distribution here"
    return {NOT_INSTALLED_HERE[module]}


def third_party_imports() -> dict[str, list[str]]:
    """Top-level module -> the files of src/hardy that import it (function-level imports too)."""
    found: dict[str, list[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                top = name.split(".")[0]
                if top != "hardy" and top not in sys.stdlib_module_names and top != "tomli":
                    found.setdefault(top, []).append(str(path.relative_to(SRC)))
    return found


def test_every_imported_package_is_declared():
    everything = declared() | {d for extra in PROJECT["optional-dependencies"] for d in declared(extra)}
    undeclared = {m: files[:3] for m, files in third_party_imports().items()
                  if not distributions_of(m) & everything}
    assert not undeclared, f"imported but declared nowhere in pyproject.toml: {undeclared}"


def test_each_extra_declares_its_modules_and_the_core_none_of_them():
    for extra, modules in EXTRAS.items():
        for module in modules:
            dists = distributions_of(module)
            assert dists & declared(extra), (extra, module, dists)
            assert not dists & declared(), f"{module} is in the core dependencies, so '{extra}' is not optional"
    assert {"all", "test"} <= set(PROJECT["optional-dependencies"])


BLOCKER = textwrap.dedent("""
    import importlib.abc, json, sys
    BLOCKED = set(sys.argv[1].split(","))

    class NotInstalled(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NotInstalled())
    for name in list(sys.modules):
        if name.split(".")[0] in BLOCKED:
            del sys.modules[name]
    from hardy.cli.main import main
    codes = {}
    for name, argv in json.loads(sys.argv[2]).items():
        print(f"== {name}", file=sys.stderr, flush=True)
        codes[name] = main(argv)
    print(json.dumps(codes))
""")


def test_without_extras_the_core_commands_run_and_the_others_name_their_extra(tmp_path):
    from hardy.data.text import resolve_text_path

    text = tmp_path / "t.txt"
    text.write_text(resolve_text_path("tinyshakespeare").read_text()[:60_000])
    run = tmp_path / "run"
    sets = ["model.preset=micro", f"data.path={tmp_path / 'ds'}", "data.seq_len=32", "train.micro_batch=4",
            "train.steps=2", "optim.warmup_steps=1", "log.progress=false", "checkpoint.at_end=true"]
    commands = {
        "prepare": ["data", "prepare", "--input", str(text), "--tokenizer", "bpe:300", "--out", str(tmp_path / "ds")],
        "train": ["train", "--run-dir", str(run), *[a for s in sets for a in ("--set", s)]],
        "generate": ["generate", "--model", str(run), "--prompt", "To be", "--max-new-tokens", "3"],
        "compress": ["compress", "--model", str(run), "--out", str(tmp_path / "int8"), "--quant", "rtn", "--bits", "8",
                     "--no-progress"],
        "plan": ["plan", "train", "--model", "llama3.1-8b", "--hardware", "h100-sxm", "--devices", "8"],
        "serve": ["serve", "--model", str(run)],
        "rank": ["eval", "rank", "--model", str(run)],
        "goodput plot": ["plan", "goodput", "--plot", str(tmp_path / "g.png")],
    }
    blocked = sorted({m for modules in EXTRAS.values() for m in modules} | {"pynvml"})
    proc = subprocess.run([sys.executable, "-c", BLOCKER, ",".join(blocked), json.dumps(commands)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    codes = json.loads(proc.stdout.strip().splitlines()[-1])
    assert codes == {"prepare": 0, "train": 0, "generate": 0, "compress": 0, "plan": 0, "serve": 2, "rank": 2,
                     "goodput plot": 2}, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hardy: error:")]
    assert errors == [
        "hardy: error: hardy serve needs hardy's 'serve' extra: pip install 'hardy[serve]' (not installed: fastapi, "
        "hypercorn, starlette, prometheus_client)",
        "hardy: error: hardy eval rank needs hardy's 'rank' extra: pip install 'hardy[rank]' (not installed: bm25s, "
        "Stemmer, ir_measures)",
        "hardy: error: --plot needs hardy's 'plots' extra: pip install 'hardy[plots]' (not installed: matplotlib)",
    ]
