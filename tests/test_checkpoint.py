"""Checkpoint manager unit tests (single process): manifest coverage, background checksums, pruning."""
from __future__ import annotations

import json

import pytest
import torch

from hardy.checkpoint.manager import (MANIFEST, CheckpointCorrupt, CheckpointManager, hash_own_files,
                                      verify_manifest, write_manifest)
from hardy.model.config import get_preset
from hardy.model.transformer import build_model


@pytest.fixture()
def state():
    model = build_model(get_preset("micro"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    return model, opt


@pytest.mark.parametrize("asynchronous", [False, True])
def test_manifest_lists_every_file_and_pruning_keeps_k(tmp_path, state, asynchronous):
    model, opt = state
    mgr = CheckpointManager(tmp_path, keep=2, rank=0, device=torch.device("cpu"))
    for step in (1, 2, 3):
        mgr.save(step, model, opt, {"step": step}, {"rank": 0}, asynchronous=asynchronous)
        mgr.wait()
    mgr.close()  # background deletions done
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000003"]
    newest = root / "step_00000003"
    listed = set(json.loads((newest / MANIFEST).read_text())["files"])
    on_disk = {p.name for p in newest.iterdir()} - {MANIFEST, "COMPLETE"}
    assert listed == on_disk and {".metadata", "trainer.json", "rank_00000.json"} <= listed
    assert any(n.endswith(".distcp") for n in listed)
    verify_manifest(newest)
    (newest / "rank_00000.json").write_text("{}")
    with pytest.raises(CheckpointCorrupt, match="rank_00000.json"):
        verify_manifest(newest)


def test_files_no_rank_claimed_are_hashed_when_the_manifest_is_merged(tmp_path):
    (tmp_path / "rank_00000.json").write_text("{}")
    (tmp_path / "__7_0.distcp").write_bytes(b"x" * 10)  # a rank that did not report its checksums
    hash_own_files(tmp_path, 0)
    write_manifest(tmp_path)
    files = json.loads((tmp_path / MANIFEST).read_text())["files"]
    assert set(files) == {"rank_00000.json", "__7_0.distcp"} and files["__7_0.distcp"]["bytes"] == 10
    assert not list(tmp_path.glob(".hashes_rank_*"))
    verify_manifest(tmp_path)


def test_manifests_hold_xxh3_checksums_and_older_sha256_manifests_still_verify(tmp_path):
    import hashlib

    import xxhash

    payload = bytes(range(256)) * 40_000  # > one 8 MiB read block, so the checksum spans blocks
    (tmp_path / "__0_0.distcp").write_bytes(payload)
    write_manifest(tmp_path)
    entry = json.loads((tmp_path / MANIFEST).read_text())["files"]["__0_0.distcp"]
    assert entry == {"xxh3_128": xxhash.xxh3_128(payload).hexdigest(), "bytes": len(payload)}

    old = {"version": 1, "files": {"__0_0.distcp": {"sha256": hashlib.sha256(payload).hexdigest(),
                                                    "bytes": len(payload)}}}
    (tmp_path / MANIFEST).write_text(json.dumps(old))
    verify_manifest(tmp_path)  # a checkpoint saved before the change resumes
    altered = bytearray(payload)
    altered[-1] ^= 1  # same size, one bit in the last block: only the checksum can tell
    (tmp_path / "__0_0.distcp").write_bytes(altered)
    with pytest.raises(CheckpointCorrupt, match="checksum mismatch"):
        verify_manifest(tmp_path)
    write_manifest(tmp_path)
    verify_manifest(tmp_path)
    (tmp_path / "__0_0.distcp").write_bytes(payload)
    with pytest.raises(CheckpointCorrupt, match="checksum mismatch"):
        verify_manifest(tmp_path)

    (tmp_path / MANIFEST).write_text(json.dumps({"version": 2, "files": {"__0_0.distcp": {"bytes": len(payload)}}}))
    with pytest.raises(CheckpointCorrupt, match="the entry of __0_0.distcp needs bytes and a checksum"):
        verify_manifest(tmp_path)


def test_dcp_metadata_passes_the_allow_list_and_anything_else_is_refused(tmp_path, state):
    """The metadata DCP writes for a real model + optimizer unpickles under the allow-list; a pickle
    naming any other global, or bytes that are no pickle, is a one-line HardyError."""
    import pickle
    import shutil

    from hardy.checkpoint.safe_metadata import check_dcp_metadata
    from hardy.errors import HardyError

    model, opt = state
    mgr = CheckpointManager(tmp_path, keep=1, rank=0, device=torch.device("cpu"))
    mgr.save(1, model, opt, {"step": 1}, {"rank": 0}, asynchronous=False)
    mgr.wait()
    mgr.close()
    ckpt = tmp_path / "checkpoints" / "step_00000001"
    check_dcp_metadata(ckpt)
    for value, fragment in ((print, "refers to builtins.print"), (pickle.Pickler, "refers to _pickle.Pickler"),
                            (torch.zeros, "refers to builtins.getattr"), (shutil.rmtree, "refers to shutil.rmtree")):
        (ckpt / ".metadata").write_bytes(pickle.dumps({"storage": [value]}))
        with pytest.raises(HardyError, match=fragment):
            check_dcp_metadata(ckpt)
    (ckpt / ".metadata").write_bytes(b"\x80\x04not a pickle")
    with pytest.raises(HardyError, match="damaged"):
        check_dcp_metadata(ckpt)


def fail_writes_into(monkeypatch, step: int, err: int):
    """Injected at DCP's filesystem layer: every shard written into step `step`'s checkpoint fails with
    OSError(err) after its first bytes, as a full or failing disk would."""
    import contextlib
    import os

    from torch.distributed.checkpoint.filesystem import FileSystem

    original = FileSystem.create_stream

    class Failing:
        def __init__(self, stream):
            self.stream = stream

        def write(self, data):
            self.stream.write(bytes(data)[:16])
            raise OSError(err, os.strerror(err))

        def __getattr__(self, name):
            return getattr(self.stream, name)

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with original(self, path, mode) as stream:
            yield Failing(stream) if "w" in mode and f"step_{step:08d}" in str(path) else stream

    monkeypatch.setattr(FileSystem, "create_stream", create_stream)


def test_a_full_disk_ends_the_run_in_one_line_and_keeps_the_last_checkpoint(tmp_path, micro_dataset, monkeypatch):
    import errno

    from hardy.checkpoint.manager import step_dirs
    from hardy.errors import HardyError
    from trainutil import in_process

    fail_writes_into(monkeypatch, 4, errno.ENOSPC)
    with pytest.raises(HardyError) as caught:
        in_process(tmp_path / "run", micro_dataset, "train.steps=6", "checkpoint.interval=2",
                   "checkpoint.async_save=false")
    message = str(caught.value)
    root = tmp_path / "run" / "checkpoints"
    assert "\n" not in message and f"no space left in {root}" in message and "needs about" in message
    assert message.endswith("the resume point stays step_00000002")
    assert [step for step, _ in step_dirs(root)] == [2] and not list(root.glob(".step_00000004*"))
    verify_manifest(root / "step_00000002")


def test_a_failed_asynchronous_save_is_reported_and_training_goes_on(tmp_path, micro_dataset, monkeypatch):
    import errno

    from hardy.checkpoint.manager import step_dirs
    from trainutil import in_process, read_records

    fail_writes_into(monkeypatch, 4, errno.EIO)
    summary = in_process(tmp_path / "run", micro_dataset, "train.steps=6", "checkpoint.interval=2",
                         "checkpoint.async_save=true", "checkpoint.at_end=true")
    assert summary.steps == 6
    failed = [r for r in read_records(tmp_path / "run") if r["event"] == "checkpoint_failed"]
    assert len(failed) == 1 and "step 4 was not written (OSError: [Errno 5]" in failed[0]["error"]
    assert "the resume point stays step_00000002" in failed[0]["error"]
    root = tmp_path / "run" / "checkpoints"
    assert [step for step, _ in step_dirs(root)] == [6, 2] and not list(root.glob(".step_00000004*"))


def test_an_asynchronous_save_reports_its_written_hook_after_the_files_and_its_failure(tmp_path, state):
    """written() runs in the background writer once the files are on disk (the step it names is the
    save's, not the trainer's by then); an OSError from it fails the save on wait(), leaving no partial."""
    import errno

    from hardy.checkpoint.manager import SaveFailed, step_dirs

    model, opt = state
    mgr = CheckpointManager(tmp_path, keep=3, rank=0, device=torch.device("cpu"))
    seen = []
    mgr.save(1, model, opt, {"step": 1}, {"rank": 0},
             written=lambda: seen.append(sorted(p.name for p in (tmp_path / "checkpoints" / ".step_00000001.partial")
                                               .iterdir())), asynchronous=True)
    mgr.wait()
    assert any(n.endswith(".distcp") for n in seen[0]) and "rank_00000.json" in seen[0]

    def fail():
        raise OSError(errno.EIO, "injected")

    mgr.save(2, model, opt, {"step": 2}, {"rank": 0}, written=fail, asynchronous=True)
    with pytest.raises(SaveFailed, match=r"step 2 was not written \(OSError: \[Errno 5\] injected\); the resume "
                                         r"point stays step_00000001"):
        mgr.wait()
    mgr.close()
    assert [s for s, _ in step_dirs(tmp_path / "checkpoints")] == [1]
    assert not list((tmp_path / "checkpoints").glob(".step_00000002*"))


@pytest.mark.parametrize("name", ["../outside.bin", "/etc/hostname", "link.bin", "."])
def test_a_manifest_naming_files_outside_its_checkpoint_is_refused(tmp_path, name):
    """Names in a received manifest are confined to the checkpoint directory: a parent path, an
    absolute one or a link out of it is refused before any of those bytes are read."""
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"secret")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "rank_00000.json").write_text("{}")
    if name == "link.bin":
        (ckpt / "link.bin").symlink_to(outside)
    write_manifest(ckpt)  # a link is listed as any file would be
    manifest = json.loads((ckpt / MANIFEST).read_text())
    manifest["files"].setdefault(name, {"bytes": 6, "xxh3_128": "0" * 32})
    (ckpt / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointCorrupt, match="outside the checkpoint directory"):
        verify_manifest(ckpt)
