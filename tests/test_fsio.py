"""Atomic writes (hardy.fsio): what a reader sees is a whole old file or a whole new one."""
from __future__ import annotations

import threading

import pytest

from hardy.fsio import atomic_file, write_bytes_atomic


def test_two_writers_of_one_file_each_finish_and_one_whole_version_remains(tmp_path):
    """Two writers of the same path at once (two ranks, a retry beside a late first try): each writes
    to its own temporary name, so neither truncates the other's bytes or loses its rename."""
    target = tmp_path / "state.json"
    payloads = [bytes([65 + i]) * 3_000_000 for i in range(2)]
    inside, errors = threading.Barrier(2), []

    def write(data: bytes) -> None:
        try:
            with atomic_file(target, durable=False) as f:
                f.write(data[:1000])
                inside.wait(timeout=30)  # both temporaries open before either is renamed
                f.write(data[1000:])
        except Exception as e:  # noqa: BLE001 - the test reports what a writer raised
            errors.append(e)

    threads = [threading.Thread(target=write, args=(p,)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert target.read_bytes() in payloads
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]  # no temporary left behind


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "f.bin"
    write_bytes_atomic(target, b"old")
    with pytest.raises(RuntimeError):
        with atomic_file(target) as f:
            f.write(b"partial")
            raise RuntimeError("disk gone")
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]


def test_new_files_get_the_usual_permissions(tmp_path):
    """Not mkstemp's 0600: a checkpoint written by one user stays readable by the group as before."""
    import os
    import stat

    mask = os.umask(0o022)
    try:
        write_bytes_atomic(tmp_path / "g.bin", b"x")
    finally:
        os.umask(mask)
    assert stat.S_IMODE((tmp_path / "g.bin").stat().st_mode) == 0o644


def test_event_logs_keep_every_whole_line_around_lines_cut_short(tmp_path):
    """A writer killed mid-line leaves a cut line; after a restart the next writer appends right after
    it, so the cut can be anywhere: every whole object line is kept, in order, and nothing raises."""
    from hardy.fsio import read_json_lines

    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1}\n{"step": 2, "lo' + '{"step": 3}\n' + '\n[1, 2]\n{"step": 4}\n{"step": 5, "loss": 2.')
    assert read_json_lines(log) == [{"step": 1}, {"step": 4}]
    assert read_json_lines(tmp_path / "absent.jsonl") == []
