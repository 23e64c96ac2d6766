"""`hardy demo`: the event lines a watcher of a run sees, the run-directory guard, and a shortened demo
end to end (report sections with numbers from that run)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import hardy_main, run_hardy

from hardy.demo.events import RunWatcher
from hardy.demo.job import MARKER, prepare_run_dir
from hardy.demo.report import SECTIONS
from hardy.errors import HardyError


def _write(run_dir: Path, events: list[dict], partial: str = "") -> None:
    with open(run_dir / "metrics.jsonl", "a") as f:
        for e in events:
            f.write(json.dumps(e) + "\n")
        f.write(partial)


def _step(step: int, t: float, **extra) -> dict:
    return {"event": "step", "step": step, "time": t, "loss": 5.0 - 0.01 * step, "step_time_s": 0.5,
            "tokens_per_s": 2000.0, **extra}


def test_an_injected_hang_names_its_rank_when_another_watchdog_fires_first(tmp_path):
    """Rank 0 stalls itself; rank 1, waiting in rank 0's collective, may time out first (a loaded
    machine): the line names the rank that hung, not the one whose watchdog reported."""
    w = RunWatcher(tmp_path, total_steps=12, progress_every=100)
    start = {"event": "start", "step": 0, "time": 100.0, "device": "cpu",
             "config": {"resolved": {"model": {"name": "micro"}, "world_size": 2}}}
    _write(tmp_path, [start, _step(1, 101.0), _step(2, 102.0)])
    w.poll()
    (tmp_path / "hang_rank1.jsonl").write_text(json.dumps({"event": "hang", "rank": 1, "time": 109.0,
                                                           "detect_s": 6.1}) + "\n")
    (tmp_path / "faults_fired.json").write_text(json.dumps(["hang@3@rank0"]))
    _write(tmp_path, [{"event": "start", "step": 2, "time": 112.0, "resumed_from": "ckpt/step_2"}])
    assert w.poll() == ["rank 0 hung (injected) at step 3 → watchdog stopped it after 6.1 s → restarted, "
                        "resumed from step 2 in 3.0 s"]


def test_watcher_names_each_failure_and_its_recovery(tmp_path):
    w = RunWatcher(tmp_path, total_steps=12, progress_every=100)
    assert w.poll() == []  # nothing written yet
    start = {"event": "start", "step": 0, "time": 100.0, "device": "cpu",
             "config": {"resolved": {"model": {"name": "micro"}, "world_size": 2}}}
    _write(tmp_path, [start, _step(1, 101.0), _step(2, 102.0)], partial='{"event": "step", "st')
    assert w.poll() == ["training started: micro on 2 process(es), cpu, 12 steps"]
    (tmp_path / "faults_fired.json").write_text(json.dumps(["nan@3@rank0"]))
    # the rest of the half-written line arrives: it was held back, not lost or misread
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('ep": 3, "time": 103.0, "loss": NaN, "skipped": true, "step_time_s": 0.5, "tokens_per_s": 0}\n')
    assert w.poll() == ["step 3: loss not finite (NaN injected) → update skipped, training goes on"]
    # a crash after step 5, found by the next attempt's start (resumed from the checkpoint of step 4)
    _write(tmp_path, [_step(4, 104.0), _step(5, 105.0)])
    (tmp_path / "faults_fired.json").write_text(json.dumps(["kill@6@rank1", "nan@3@rank0"]))
    _write(tmp_path, [{"event": "start", "step": 4, "time": 109.5, "resumed_from": "ckpt/step_4"}])
    assert w.poll() == ["rank 1 killed (injected) at step 6 → restarted, resumed from step 4 in 4.5 s"]
    # a hang: the watchdog's report, then the restart
    _write(tmp_path, [_step(5, 110.0), _step(6, 111.0)])
    (tmp_path / "hang_rank0.jsonl").write_text(json.dumps({"event": "hang", "rank": 0, "time": 118.0,
                                                           "detect_s": 6.5}) + "\n")
    (tmp_path / "faults_fired.json").write_text(json.dumps(["hang@7@rank0", "kill@6@rank1", "nan@3@rank0"]))
    _write(tmp_path, [{"event": "start", "step": 6, "time": 121.0, "resumed_from": "ckpt/step_6"}])
    assert w.poll() == ["rank 0 hung (injected) at step 7 → watchdog stopped it after 6.5 s → restarted, "
                        "resumed from step 6 in 3.0 s"]
    # a failure nobody injected is called what it is
    _write(tmp_path, [_step(7, 122.0), _step(8, 123.0), {"event": "start", "step": 8, "time": 130.0}])
    assert w.poll() == ["a training process failed after step 8 (not injected; its log is in the run dir) → "
                        "restarted, resumed from step 8 in 7.0 s"]
    _write(tmp_path, [_step(12, 134.0), {"event": "end", "time": 135.0, "steps": 12, "final_loss": 4.88,
                                         "tokens_per_s": 1900.0, "goodput": {"goodput": 0.5, "restarts": 3}}])
    assert w.poll() == ["step 12/12: loss 4.880, 0.50 s/step, 2,000 tokens/s",
                        "training finished: 12 steps, final loss 4.880, 1,900 tokens/s in its last attempt, "
                        "goodput 50.0% over 3 restart(s)"]
    assert [(i.kind, i.step, i.injected, i.resumed_from) for i in w.incidents] == [
        ("nan", 3, True, None), ("killed", 6, True, 4), ("hung", 7, True, 6), ("failed", 9, False, 8)]


def test_run_dir_guard(tmp_path):
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(HardyError, match="not a previous demo's"):
        prepare_run_dir(other)
    assert (other / "notes.txt").read_text() == "keep me"
    old = tmp_path / "old-demo"
    old.mkdir()
    (old / MARKER).write_text("{}")
    (old / "report.html").write_text("stale")
    prepare_run_dir(old)
    assert sorted(p.name for p in old.iterdir()) == [MARKER]


def test_bad_arguments_are_one_line(tmp_path):
    r = hardy_main("demo", "--run-dir", str(tmp_path / "d"), "--steps", "5")
    assert r.returncode == 2 and "at least 20 steps" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "d").exists()


def test_a_probe_file_that_is_not_a_profile_is_refused_before_anything_runs(tmp_path, probe_profile):
    bad = tmp_path / "bad.json"
    profile = json.loads(probe_profile.read_text())
    del profile["duration_s"]  # the planner does not read it; the demo's report does
    for text, message in (("not json", "is not JSON"), (json.dumps({"schema": 0}), "not a hardy probe profile"),
                          (json.dumps(profile), "no duration_s")):
        bad.write_text(text)
        r = hardy_main("demo", "--run-dir", str(tmp_path / "d"), "--probe", str(bad))
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "d").exists()


def test_short_demo_end_to_end(tmp_path, probe_profile):
    """The whole demo on this machine, with the session's `hardy probe --quick` profile (the probe itself
    is tests/test_probe.py's): the demo with --probe FILE uses it instead of probing again."""
    run_dir = tmp_path / "demo"
    r = run_hardy("demo", "--run-dir", str(run_dir), "--steps", "40", "--eval-tokens", "2048", "--probe",
                  str(probe_profile), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    assert f"(from {probe_profile})" in out
    assert json.loads((run_dir / "hardware-profile.json").read_text()) == json.loads(probe_profile.read_text())
    # one line per event on the screen; the ranks' own output in the run directory
    assert "Traceback" not in out + r.stderr
    assert re.search(r"step \d+: loss not finite \(NaN injected\) → update skipped", out)
    kill = re.search(r"rank 0 killed \(injected\) at step (\d+) → restarted, resumed from step (\d+) in [\d.]+ s", out)
    hang = re.search(r"rank 0 hung \(injected\) at step (\d+) → watchdog stopped it after [\d.]+ s → restarted, "
                     r"resumed from step (\d+)", out)
    assert kill and hang, out
    for m in (kill, hang):
        assert int(m.group(2)) < int(m.group(1))  # resumed from a checkpoint before the failure
    assert out.rstrip().endswith(f"report: {run_dir / 'report.html'}")
    # the same job under live recovery: the survivor went on, with the restart's recovery time beside it
    live = re.search(r"live recovery: group 1 killed at step 10: group 0 went on after ([\d.]+) s \(restart "
                     r"recovery above: ([\d.]+) s\)", out)
    assert live and float(live.group(1)) < float(live.group(2)), out
    logs = list((run_dir / "logs").rglob("stdout.log"))
    assert {p.parent.name for p in logs} == {"0", "1"} and len({p.parent.parent.name for p in logs}) == 3

    results = json.loads((run_dir / MARKER).read_text())
    page = (run_dir / "report.html").read_text()
    for name in SECTIONS:
        assert f">{name}</h2>" in page
    assert page.count("data:image/png;base64,") == 5  # plan, loss, goodput, telemetry, compression
    # numbers from this run, as the report prints them
    train = results["train"]
    assert f"{100 * train['goodput']['goodput']:.1f}%" in page
    assert f"{results['evaluate']['ppl']:.2f}" in page
    for inc in train["incidents"]:
        assert inc["line"].replace("→", "&rarr;") in page or inc["line"] in page
    for row in results["compress"]:
        assert f"{row['ppl']:.2f}" in page and f"{row['decode_tps']:,.0f}" in page
    assert [row["name"] for row in results["compress"]] == ["fp32", "int8", "int4"]
    sizes = {row["name"]: row["size_bytes"] for row in results["compress"]}
    assert sizes["int4"] < sizes["int8"] < sizes["fp32"]
    end = next(e for e in train["events"] if e["event"] == "end")
    assert end["steps"] == 40 and train["goodput"]["restarts"] == 2
    assert len(train["telemetry"]) == 2 and all(train["telemetry"].values())  # both ranks sampled
    assert results["generate"]["text"]
    assert results["live"]["steps"] == 40 and f"{results['live']['stall_s']:.2f} s beyond" in page
