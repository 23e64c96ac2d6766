"""BENCHMARKS.md's generated table (bench/summary.py) and the result files behind it (bench/results.py): the
repository passes its own check, and the check fails on a stale table and on a README/docs figure that
is in no row."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
import results  # noqa: E402
import summary  # noqa: E402


def test_the_repository_passes_its_own_check(capsys):
    assert summary.main(["--check"]) == 0, capsys.readouterr().out


def make_root(tmp_path: Path, readme: str, docs: dict[str, str] | None = None) -> Path:
    """A repository with one result (8B decode 9.30 vs 7.29 tok/s, 1.28× [1.20, 1.33]) and its table."""
    (tmp_path / "bench").mkdir()
    results.record("decode-8b", issue=40, goal="Decode tg128, 8B-shaped Q4_0, vs llama-bench", target=(">=", 1.25),
                   figure="9.30 tok/s", baseline="llama-bench 7.29 tok/s", ratio=(1.284, 1.2, 1.333), runs=5,
                   directory=tmp_path / "bench" / "results")
    (tmp_path / "BENCHMARKS.md").write_text(f"# Benchmarks\n\n{summary.BEGIN}\n{summary.END}\n\nhistory\n")
    (tmp_path / "README.md").write_text(readme)
    (tmp_path / "docs").mkdir()
    for name, text in (docs or {}).items():
        (tmp_path / "docs" / name).write_text(text)
    assert summary.main(["--root", str(tmp_path)]) == 0
    return tmp_path


def check(root: Path, capsys) -> tuple[int, str]:
    capsys.readouterr()
    rc = summary.main(["--check", "--root", str(root)])
    return rc, capsys.readouterr().out


def test_the_table_is_generated_from_the_result_files(tmp_path, capsys):
    root = make_root(tmp_path, "hardy decodes at 9.30 tok/s, 1.28× [1.20, 1.33] llama-bench's.\n")
    table = (root / "BENCHMARKS.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| Decode tg128"))
    assert "| 9.30 tok/s | llama-bench 7.29 tok/s | 1.28× [1.20, 1.33] | ≥ 1.25× | met at the median only | 5 alt. |" in row
    assert table.endswith("\n\nhistory\n")  # only the part between the markers is rewritten
    assert check(root, capsys)[0] == 0

    # a result changes: the table is stale until bench/summary.py runs again
    path = root / "bench" / "results" / "decode-8b.json"
    result = json.loads(path.read_text())
    result["ratio"]["low"] = 1.1
    path.write_text(json.dumps(result))
    rc, out = check(root, capsys)
    assert rc == 1 and "BENCHMARKS.md: the table is not the one bench/results/ gives" in out
    assert summary.main(["--root", str(root)]) == 0
    rc, out = check(root, capsys)  # the table is fresh again; the README still quotes the old interval
    assert rc == 1 and out.startswith("README.md:1: [1.20, 1.33] is in no row")


def test_a_figure_in_no_row_fails_the_check_naming_its_line(tmp_path, capsys):
    root = make_root(tmp_path, "Fast.\n", {"serving.md": "# Serving\n\nIt decodes at 9.30 tok/s.\nAnd at 12.5 tok/s.\n"})
    rc, out = check(root, capsys)
    assert rc == 1
    assert out.splitlines() == [f"docs/serving.md:4: 12.5 tok/s is in no row of BENCHMARKS.md's table (record it in "
                                f"bench/results/, or label the paragraph: {', '.join(summary.LABELS)})"]


@pytest.mark.parametrize("text", [
    "1.4× faster",                       # a ratio
    "between 1.28–1.4× llama-bench's",   # either end of a range
    "[1.20, 1.35] per pair",             # an interval
    "it reads 31 GB/s",                  # a rate
    "the demo takes 3 minutes",          # a duration
    "7.29× llama-bench's",               # a number the row shows, but as a rate, not a ratio
    "9.30 GB/s",                         # a number the row shows with another unit
])
def test_each_kind_of_figure_is_held_to_the_table(tmp_path, capsys, text):
    assert check(make_root(tmp_path, f"Measured: {text}.\n"), capsys)[0] == 1


@pytest.mark.parametrize("text", [
    "```sh\nhardy bench  # 12.5 tok/s\n```\n",                      # code block
    "Run `--slow 2x` to see it.\n",                                 # inline code
    "The goal is 2.5× llama-bench's; it needs ≥ 3.1× batch 1.\n",    # goals and bounds
    "A product: 6 × MAD, 2 × buffer bytes.\n",                     # products written with spaces
    "Peaks below 2× the file.\n",
    "*Planner prediction:* 52.7 tok/s on two sockets.\n\n| a | b |\n|---|---|\n| 1.56× | 300.4 tok/s |\n",
    "- *Published:* SGLang is 2.5–4× faster.\n- hardy: 1.28×.\n",
])
def test_code_bounds_and_labelled_paragraphs_are_not_figures(tmp_path, capsys, text):
    rc, out = check(make_root(tmp_path, text), capsys)
    assert rc == 0, out


def test_a_label_covers_its_paragraph_and_table_not_the_next_paragraph(tmp_path, capsys):
    text = ("*Planner prediction:* two sockets give 52.7 tok/s.\n\n| x |\n|---|\n| 1.56× |\n\n"
            "- 2.2× with pages spread\n\nMeasured here: 4.4 tok/s.\n\n- *Published:* 3.3× elsewhere\n- 5.5× ours\n")
    rc, out = check(make_root(tmp_path, text), capsys)
    assert rc == 1
    assert [line.split(" is in no row")[0] for line in out.splitlines()] == ["README.md:9: 4.4 tok/s",
                                                                            "README.md:12: 5.5×"]


@pytest.mark.parametrize("op, target, ratio, runs, expected", [
    (">=", 1.25, (1.28, 1.26, 1.33), 5, "met"),
    (">=", 1.25, (1.28, 1.20, 1.33), 5, "met at the median only"),
    (">=", 1.25, (1.20, 1.10, 1.30), 5, "not met"),
    (">=", 1.25, (1.28, 1.26, 1.33), 3, "not established (fewer than 5 runs)"),
    (">=", 1.25, (1.28, None, None), 5, "not established (no interval)"),
    ("<=", 12.0, (11.5, None, None), 0, "met"),  # a deterministic computation
    ("<=", 12.0, (12.5, None, None), 0, "not met"),
    ("<=", 2.0, (1.5, 1.2, 1.9), 5, "met"),
    ("<=", 2.0, (1.5, 1.2, 2.2), 5, "met at the median only"),
    ("<=", 2.0, (2.1, 1.9, 2.3), 7, "not met"),
])
def test_status_holds_the_interval_to_the_goal(op, target, ratio, runs, expected):
    result = {"target": {"op": op, "value": target}, "runs": runs,
              "ratio": dict(zip(("median", "low", "high"), ratio))}
    assert summary.status(result) == expected


def test_a_damaged_result_file_is_named(tmp_path):
    directory = tmp_path / "results"
    path = results.record("x", issue=1, goal="g", target=None, figure="1 tok/s", baseline=None, ratio=(1, 1, 1),
                          runs=5, directory=directory)
    recorded = json.loads(path.read_text())
    assert recorded["command"].startswith(".venv/bin/python ") and recorded["cpu"] and recorded["source"] == "bench"
    del recorded["cpu"]
    path.write_text(json.dumps(recorded))
    with pytest.raises(SystemExit, match=r"x\.json: a result file needs cpu"):
        results.load_all(directory)
    path.write_text("{")
    with pytest.raises(SystemExit, match=r"x\.json: not a readable JSON result"):
        results.load_all(directory)
    with pytest.raises(ValueError, match="a target bound"):
        results.record("y", issue=1, goal="g", target=("==", 1.0), figure=None, baseline=None, ratio=(1, 1, 1),
                       runs=5, directory=directory)
