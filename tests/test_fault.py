"""Fault tolerance on CPU/gloo: exact resume after kills, damaged checkpoints, NaN, spikes, hangs."""
from __future__ import annotations

import json
import random

import pytest

from trainutil import assert_bitwise_equal, launch

LAYOUTS = {"single": (1, ()), "ddp2": (2, ()), "fsdp2": (2, ("parallel.dp_shard=2",))}
# A start-up/step watchdog turns any stuck rendezvous after a kill into one more restart.
COMMON = ("train.steps=12", "checkpoint.interval=4", "checkpoint.at_end=true", "checkpoint.keep=5",
          "fault.startup_timeout_s=30", "fault.hang_timeout_s=30")
KILL_STEP = random.Random(2024).randint(5, 11)  # a seeded random step between checkpoints


@pytest.fixture(scope="module")
def baselines(tmp_path_factory, micro_dataset):
    root = tmp_path_factory.mktemp("fault_base")
    done = {}

    def get(layout):
        if layout not in done:
            nproc, sets = LAYOUTS[layout]
            launch(root / layout, micro_dataset, nproc, *COMMON, *sets)
            done[layout] = root / layout / "checkpoints" / "step_00000012"
        return done[layout]

    return get


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("fault", [f"kill@{KILL_STEP}", "kill_in_ckpt@8"])
def test_killed_run_resumes_bitwise(tmp_path, micro_dataset, baselines, layout, fault):
    nproc, sets = LAYOUTS[layout]
    run = tmp_path / "run"
    proc = launch(run, micro_dataset, nproc, *COMMON, *sets, f'fault.inject="{fault}"', max_restarts=3)
    assert "resumed from step_" in proc.stdout
    fired = json.loads((run / "faults_fired.json").read_text())
    assert len(fired) == 1 and fired[0].startswith(fault.split("@")[0] + "@")
    if fault.startswith("kill_in_ckpt"):
        # the interrupted save left no COMPLETE checkpoint behind: the restart used step 4
        assert "resumed from step_00000004" in proc.stdout
    assert_bitwise_equal(run / "checkpoints" / "step_00000012", baselines(layout))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["goodput"]["restarts"] >= 1 and summary["goodput"]["losses_s"]["restarts"] > 0


def test_corrupted_newest_checkpoint_falls_back_with_a_warning(tmp_path, micro_dataset, baselines):
    run = tmp_path / "run"
    proc = launch(run, micro_dataset, 1, *COMMON, 'fault.inject="corrupt_ckpt@8,kill@10"', max_restarts=2)
    out = proc.stdout + proc.stderr
    assert "skipping damaged checkpoint step_00000008" in out and "__0_0.distcp" in out
    assert "resumed from step_00000004" in out
    assert_bitwise_equal(run / "checkpoints" / "step_00000012", baselines("single"))


def test_truncated_newest_checkpoint_falls_back(tmp_path, micro_dataset):
    run = tmp_path / "run"
    launch(run, micro_dataset, 1, "train.steps=8", "checkpoint.interval=4", "checkpoint.at_end=true")
    newest = run / "checkpoints" / "step_00000008" / "__0_0.distcp"
    newest.write_bytes(newest.read_bytes()[:100])
    proc = launch(run, micro_dataset, 1, "train.steps=10", "checkpoint.interval=4")
    out = proc.stdout + proc.stderr
    assert "skipping damaged checkpoint step_00000008" in out and "truncated" in out
    assert "resumed from step_00000004" in out


def test_nan_is_skipped_and_training_continues(tmp_path, micro_dataset):
    run = tmp_path / "run"
    launch(run, micro_dataset, 2, "train.steps=8", 'fault.inject="nan@4@rank1"')
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["event"] == "step"]
    assert [r["skipped"] for r in steps] == [False] * 3 + [True] + [False] * 4  # NaN on rank 1 skips everywhere
    assert all(r["loss"] is not None for r in steps if not r["skipped"])
    assert json.loads((run / "summary.json").read_text())["skipped_steps"] == 1


def test_loss_spike_rolls_back_and_skips_batches(tmp_path, micro_dataset):
    run = tmp_path / "run"
    launch(run, micro_dataset, 1, "train.steps=16", "checkpoint.interval=5", 'fault.inject="spike@12"',
           "fault.spike_warmup=5", "fault.spike_window=10")
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    rollback = [r for r in records if r["event"] == "rollback"]
    assert len(rollback) == 1
    assert rollback[0]["from_step"] == 12 and rollback[0]["to_step"] == 10 and rollback[0]["skipped_batches"] == 2
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rollbacks"] == 1 and summary["steps"] == 16
    assert summary["goodput"]["losses_s"]["rollbacks"] > 0


def test_persistent_spikes_stop_with_a_clear_message(tmp_path, micro_dataset):
    with pytest.raises(AssertionError, match="after 0 rollback"):
        launch(tmp_path / "run", micro_dataset, 1, "train.steps=16", 'fault.inject="spike@12"',
               "fault.spike_warmup=5", "fault.spike_window=10", "fault.max_rollbacks=0")


def test_hang_dumps_stacks_and_the_launcher_restarts(tmp_path, micro_dataset):
    run = tmp_path / "run"
    proc = launch(run, micro_dataset, 1, "train.steps=10", "checkpoint.interval=3", 'fault.inject="hang@6"',
                  "fault.hang_timeout_s=2", max_restarts=1)
    dumps = list((run / "stacks").glob("hang-*-rank0.txt"))
    assert len(dumps) == 1
    text = dumps[0].read_text()
    assert "no step completed" in text and "in hang" in text and "train_step" in text
    assert "resumed from step_00000003" in proc.stdout
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 10 and summary["goodput"]["losses_s"]["hang_detect"] >= 2


def test_auto_interval_checkpoints_by_young_daly(tmp_path, micro_dataset):
    """checkpoint.interval=auto: a first save at step 1 measures the stall, then each save comes at the
    first step at which the Daly optimum for the last stall and the job's MTBF has passed since the
    one before: never sooner, and no later than the step after the one that reached it."""
    from hardy.fault.policy import daly_interval

    run = tmp_path / "run"
    mtbf_s = 0.2  # a 0.2-second job MTBF makes the optimum about 0.1 s: a save every few micro steps
    launch(run, micro_dataset, 1, "train.steps=60", "checkpoint.interval=auto",
           f"checkpoint.device_mtbf_hours={mtbf_s / 3600}", "checkpoint.keep=100", "checkpoint.at_end=false")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    saves = [r for r in records if r["event"] == "checkpoint"]
    step_time = {r["step"]: r["time"] for r in records if r["event"] == "step"}
    assert saves[0]["step"] == 1 and len(saves) >= 3
    slack = 0.005  # between a save's end and its event line
    for before, save in zip(saves, saves[1:]):
        interval = daly_interval(max(before["stall_s"], 1e-3), mtbf_s)
        assert save["time"] - before["time"] >= interval - slack, (before, save, interval)
        if save["step"] - 2 > before["step"]:  # the step before the saving one had not reached the interval
            assert step_time[save["step"] - 2] - before["time"] < interval + slack, (before, save, interval)


@pytest.mark.parametrize("layout", ["single", "ddp2"])
def test_async_checkpoints_resume_bitwise(tmp_path, micro_dataset, baselines, layout):
    nproc, sets = LAYOUTS[layout]
    run = tmp_path / "run"
    proc = launch(run, micro_dataset, nproc, *COMMON, *sets, "checkpoint.async_save=true", 'fault.inject="kill@10"',
                  max_restarts=3)
    # step 8's save completes in the background, before the kill at step 10 or not: the restart resumes
    # from the newest save that had become COMPLETE by then (as its event says), and exactly
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    starts = [i for i, r in enumerate(records) if r["event"] == "start"]
    assert len(starts) >= 2, "the kill did not restart the job"
    first = records[starts[0]:starts[1]]
    assert [r["step"] for r in first if r["event"] == "checkpoint"] == [4, 8]  # both saves were started
    completed = [r["step"] for r in first if r["event"] == "checkpoint_complete"]
    assert completed, [{k: r.get(k) for k in ("event", "step", "resumed_from")} for r in records if r["event"] != "step"]
    newest = max(completed)
    assert records[starts[1]]["resumed_from"].endswith(f"step_{newest:08d}")
    assert f"resumed from step_{newest:08d}" in proc.stdout
    assert_bitwise_equal(run / "checkpoints" / "step_00000012", baselines(layout))


def test_spike_before_any_checkpoint_skips_the_step(tmp_path, micro_dataset):
    run = tmp_path / "run"
    launch(run, micro_dataset, 1, "train.steps=12", 'fault.inject="spike@9"', "fault.spike_warmup=5",
           "fault.spike_window=8")
    records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    rollback = [r for r in records if r["event"] == "rollback"][0]
    assert rollback["checkpoint"] is None and rollback["to_step"] == 9 and rollback["skipped_batches"] == 0
    steps = [r["step"] for r in records if r["event"] == "step"]
    assert steps == list(range(1, 13))  # the schedule and the step counter stay in step
    summary = json.loads((run / "summary.json").read_text())
    assert summary["skipped_steps"] == 1 and summary["rollbacks"] == 1


def test_each_rank_checksums_its_share_and_all_agree_on_a_damaged_checkpoint(tmp_path, micro_dataset):
    """Resume verification split across 3 ranks: a file only rank 2 checksums is damaged; the verdicts
    meet on the rendezvous store, so every rank skips that checkpoint and resumes from the one before."""
    from hardy.checkpoint.manager import MANIFEST, share

    run = tmp_path / "run"
    launch(run, micro_dataset, 3, "train.steps=8", "checkpoint.interval=4", "checkpoint.at_end=true")
    newest = run / "checkpoints" / "step_00000008"
    files = json.loads((newest / MANIFEST).read_text())["files"]
    shares = [share(files, r, 3) for r in range(3)]
    assert sorted(sum(shares, [])) == sorted(files) and all(shares)  # every file once, every rank some
    victim = newest / shares[2][0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only a checksum finds it
    victim.write_bytes(bytes(data))
    proc = launch(run, micro_dataset, 3, "train.steps=10", "checkpoint.interval=4")
    out = proc.stdout + proc.stderr
    assert f"skipping damaged checkpoint step_00000008: {victim}: checksum mismatch" in out
    assert "resumed from step_00000004" in out


def test_checksum_shares_balance_bytes():
    from hardy.checkpoint.manager import share

    files = {f"f{i}": {"bytes": size} for i, size in enumerate([900, 500, 400, 300, 300, 100, 50, 10])}
    loads = [sum(files[n]["bytes"] for n in share(files, r, 3)) for r in range(3)]
    assert sum(loads) == 2560 and max(loads) - min(loads) <= 100, loads
    assert share(files, 0, 1) == sorted(files, key=lambda n: -files[n]["bytes"])


def test_resume_on_another_number_of_processes_repeats_and_skips_no_sample(tmp_path, micro_dataset):
    """FSDP over 4 processes, resumed on 2 (the global batch kept by grad_accum 2), then on 4 again: DCP
    reshards the model and optimizer, the data goes on from the saved global sample index, and the
    sample ids every rank logged cover the stream once, without a gap."""
    run = tmp_path / "run"
    common = ("parallel.dp_shard=-1", "parallel.dp_replicate=1", "log.sample_ids=true", "checkpoint.at_end=true",
              "checkpoint.interval=100")
    launch(run, micro_dataset, 4, *common, "train.steps=4")
    two = launch(run, micro_dataset, 2, *common, "train.steps=8", "train.grad_accum=2")
    assert "resumed from step_00000004 (saved by 4 processes, resharded to 2; the data goes on from sample 64)" \
        in two.stdout
    four = launch(run, micro_dataset, 4, *common, "train.steps=12")
    assert "resumed from step_00000008 (saved by 2 processes, resharded to 4" in four.stdout
    records = [json.loads(line) for path in sorted(run.glob("sample_ids_rank*.jsonl"))
               for line in path.read_text().splitlines()]
    assert sorted({r["step"] for r in records}) == list(range(1, 13))
    ids = sorted(q for r in records for q in r["samples"])
    assert ids == list(range(12 * 16))  # 16 samples a step (4 x 4, then 2 x 2 x 4): each once


# COMMON's 30 s watchdogs without restarts: a loaded machine's slow start-up would fail the run itself
SAVES = ("train.steps=12", "checkpoint.interval=4", "checkpoint.at_end=true", "checkpoint.keep=5")


def test_a_write_failing_on_one_rank_is_agreed_on_and_the_run_goes_on(tmp_path, micro_dataset):
    """Rank 1's files of the step-8 checkpoint fail to write (EIO) while rank 0's succeed: both ranks drop
    that checkpoint, rank 0 reports it, training goes on, and the next save completes."""
    from hardy.checkpoint.manager import step_dirs

    run = tmp_path / "run"
    launch(run, micro_dataset, 2, *SAVES, "checkpoint.async_save=false", 'fault.inject="io_error@8@rank1"')
    failed = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
              if '"checkpoint_failed"' in line]
    assert len(failed) == 1 and failed[0]["step"] == 8
    assert "another rank's write failed" in failed[0]["error"] and "resume point stays step_00000004" in failed[0]["error"]
    assert [s for s, _ in step_dirs(run / "checkpoints")] == [12, 4]


def test_a_full_disk_on_one_rank_stops_every_rank_with_one_line(tmp_path, micro_dataset):
    from hardy.checkpoint.manager import step_dirs

    run = tmp_path / "run"
    with pytest.raises(AssertionError) as failed:
        launch(run, micro_dataset, 2, *SAVES, "checkpoint.async_save=false", 'fault.inject="disk_full@8@rank1"')
    lines = [line for line in str(failed.value).splitlines() if "no space left in" in line]
    assert len(lines) == 1 and lines[0].startswith("hardy: error: checkpoint of step 8: no space left in")
    assert "Traceback" not in str(failed.value)
    assert [s for s, _ in step_dirs(run / "checkpoints")] == [4]
