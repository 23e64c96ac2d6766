"""A stop signal that reaches a launched worker late: after its peers carried the stop out, or before its
handler existed. Either used to end in a worker killed by the signal, restarted by its agent, and
training on alone past the stop (the launcher then found no checkpoint of the stop and exited 1)."""
from __future__ import annotations

import signal

from torch.distributed import TCPStore

from conftest import hardy_main
from trainutil import BASE, in_process


def test_a_launched_worker_ignores_stop_signals_once_its_run_is_over(tmp_path, micro_dataset, monkeypatch):
    before, term = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)
    try:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "late-stop")  # as torchrun sets it for its workers
        in_process(tmp_path / "launched", micro_dataset, "train.steps=2")
        assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == term  # an agent still ends the worker with it

        signal.signal(signal.SIGUSR1, before)
        monkeypatch.delenv("TORCHELASTIC_RUN_ID")
        in_process(tmp_path / "alone", micro_dataset, "train.steps=2")  # a process of its own: handlers as before
        assert signal.getsignal(signal.SIGUSR1) == before
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_a_group_restarted_after_the_launcher_forwarded_a_stop_exits_0_without_training(
        tmp_path, micro_dataset, monkeypatch):
    from hardy.fault.live import ENV_GROUP, ENV_GROUPS, ENV_START, announce_stop, launcher_stopping

    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv(ENV_START, f"localhost:{store.port}")
    monkeypatch.setenv(ENV_GROUP, "1")
    monkeypatch.setenv(ENV_GROUPS, "2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert launcher_stopping(10) is None  # no stop forwarded yet: the restart rejoins

    announce_stop(store, "SIGTERM")
    assert launcher_stopping(10) == "SIGTERM"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert launcher_stopping(10) is None  # a first attempt is signalled itself, and its peers wait for it

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    run_dir = tmp_path / "run"
    sets = [*BASE, f"data.path={micro_dataset}", "fault.recovery=live", "parallel.dp_replicate=1"]
    proc = hardy_main("train", "--run-dir", str(run_dir), *[a for s in sets for a in ("--set", s)])
    assert proc.returncode == 0, proc.stderr
    assert "[group 1] the launcher forwarded SIGTERM: this restart of replica group 1 does not rejoin" in proc.stdout
    assert not (run_dir / "replica_1").exists()  # no step, no log, no checkpoint


def test_a_group_that_does_not_write_the_stop_checkpoint_waits_for_the_record_of_its_step(tmp_path):
    """The launcher of a node whose groups do not write the stop's checkpoint reports the stop when they
    exit; they exit only once the writer (another node's group, perhaps) recorded this step's checkpoint."""
    import threading

    from hardy.fault.preempt import read_preemption, record_preemption, wait_for_preemption

    record_preemption(tmp_path, 40, "ckpt/step_40", "SIGUSR1")  # an earlier run's stop at the same step
    stale = read_preemption(tmp_path)
    assert wait_for_preemption(tmp_path, 40, stale, timeout_s=0.3) is None  # not this run's: waited out
    assert wait_for_preemption(tmp_path, 40, None, timeout_s=0.3)["checkpoint"] == "ckpt/step_40"

    def write_later(step: int, delay: float) -> threading.Thread:
        thread = threading.Timer(delay, record_preemption, (tmp_path, step, f"ckpt/step_{step}", "SIGUSR1"))
        thread.start()
        return thread

    late = [write_later(39, 0.1), write_later(40, 0.6)]  # another step's record first: not the one awaited
    record = wait_for_preemption(tmp_path, 40, stale, timeout_s=10)
    assert record["checkpoint"] == "ckpt/step_40" and record["time"] > stale["time"]
    for thread in late:
        thread.join()
    (tmp_path / "preempted.json").write_text('{"step": 40, "checkpoint": null}')  # a stop without a checkpoint
    assert wait_for_preemption(tmp_path, 40, None, timeout_s=0.2) is None
