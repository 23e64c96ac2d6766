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
