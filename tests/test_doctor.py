"""`hardy doctor`: the pre-flight table, its failures, and a check across two real processes."""
from __future__ import annotations

import json
from collections import namedtuple

from conftest import hardy_main, run_hardy


def rows(path) -> dict[str, list[dict]]:
    table: dict[str, list[dict]] = {}
    for row in json.loads(path.read_text()):
        table.setdefault(row["name"], []).append(row)
    return table


def test_one_process_passes_with_every_check_in_the_table(tmp_path):
    proc = hardy_main("doctor", "--run-dir", str(tmp_path / "run"), "--json", str(tmp_path / "t.json"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = rows(tmp_path / "t.json")
    assert set(table) == {"device", "clocks and temperature", "bf16/fp16", "checkpoint directory", "free space",
                          "write bandwidth", "collective", "shared filesystem", "versions"}
    assert table["collective"][0]["status"] == "n/a" and table["checkpoint directory"][0]["status"] == "pass"
    assert "torch 2." in table["versions"][0]["detail"] and "MB/s" in table["write bandwidth"][0]["detail"]
    assert "checkpoint directory" in proc.stdout and "PASS" in proc.stdout
    assert list((tmp_path / "run").iterdir()) == []  # its test files are gone


def test_an_unwritable_checkpoint_directory_fails_with_a_clear_message(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    proc = hardy_main("doctor", "--run-dir", str(blocker / "run"), "--json", str(tmp_path / "t.json"))
    assert proc.returncode == 1
    check = rows(tmp_path / "t.json")["checkpoint directory"][0]
    assert check["status"] == "fail" and "is not writable" in check["detail"] and str(blocker) in check["detail"]
    assert "1 check(s) failed: checkpoint directory" in proc.stderr


def test_too_little_free_space_for_the_jobs_checkpoints_fails(tmp_path, monkeypatch):
    from hardy.ops import doctor

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(doctor.shutil, "disk_usage", lambda path: usage(2**30, 2**30 - 2**20, 2**20))  # 1 MiB free
    proc = hardy_main("doctor", "--set", "model.preset=small", "--set", "checkpoint.keep=3",
                      "--run-dir", str(tmp_path / "run"), "--json", str(tmp_path / "t.json"))
    assert proc.returncode == 1
    check = rows(tmp_path / "t.json")["free space"][0]
    assert check["status"] == "fail" and "0.00 GiB free" in check["detail"] and "need" in check["detail"]


def test_two_ranks_measure_the_collective_against_the_probed_link(tmp_path, probe_profile):
    proc = run_hardy("doctor", "--nproc", "2", "--run-dir", str(tmp_path / "run"), "--hardware",
                     f"probe:{probe_profile}", "--json", str(tmp_path / "t.json"), timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = rows(tmp_path / "t.json")
    assert sorted(r["rank"] for r in table["device"]) == [0, 1]
    collective = table["collective"][0]
    assert collective["status"] in ("pass", "warn") and "over 2 ranks" in collective["detail"]
    assert "the planner expects" in collective["detail"] and "achieved" in collective["detail"]
    assert table["shared filesystem"][0]["status"] == "pass" and table["versions"][0]["status"] == "pass"
