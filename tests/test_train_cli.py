"""`hardy train` as users run it: config validation, resume, checkpoints, export of a run."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import hardy_main, run_hardy
from test_cli import assert_one_line_error
from trainutil import BASE, in_process, step_losses


def train_cli(*args):
    # in this interpreter: the same exit code and printed error as a subprocess, without ~3 s of imports each
    return hardy_main("train", *args)


@pytest.mark.parametrize("override,fragment", [
    ("optim.lr=-1", "optim.lr must be > 0"),
    ("optim.lrr=0.1", "unknown key optim.lrr"),
    ("train.steps=ten", "train.steps must be an integer"),
    ("train.activation_checkpoint=half", "train.activation_checkpoint"),
    ("precision.dtype=fp8", "precision.dtype"),
    ("parallel.tp=3", "1 is not divisible by 3"),
    ("parallel.dp_replicate=2", "multiply to 2, but the world size is 1"),
    ("model.preset=gpt9", "model.preset"),
    ("model.dropout=1.5", "model.dropout must be in [0, 1)"),
])
def test_bad_config_values_exit_2(tmp_path, override, fragment):
    proc = train_cli("--run-dir", str(tmp_path / "r"), "--set", override)
    assert_one_line_error(proc, fragment)


def test_malformed_toml_and_missing_data(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 3\n")
    assert_one_line_error(train_cli(str(bad)), "malformed TOML")
    assert_one_line_error(train_cli(str(tmp_path / "nope.toml")), "config file not found")
    assert_one_line_error(train_cli("--run-dir", str(tmp_path / "r"), "--set", f"data.path={tmp_path}/none"),
                          "not a prepared dataset")
    assert_one_line_error(train_cli("--run-dir", str(tmp_path / "r2"), "--set", "data.inputs=['/no/such/file.txt']"),
                          "not found")


def test_launch_validates_degrees_before_starting(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[parallel]\ntp = 2\ndp_shard = 2\ndp_replicate = 1\n")
    proc = run_hardy("launch", "--nproc", "2", str(cfg), "--run-dir", str(tmp_path / "r"))
    assert_one_line_error(proc, "multiply to 4, but the world size is 2")
    assert not (tmp_path / "r").exists()  # no process was started


@pytest.mark.parametrize("dropout", ["0", "0.2"])  # with dropout, the resumed RNG must draw the same masks
def test_resume_continues_exactly(tmp_path, micro_dataset, dropout):
    sets = ("checkpoint.interval=5", "checkpoint.at_end=true", f"model.dropout={dropout}")
    full = tmp_path / "full"
    in_process(full, micro_dataset, *sets)
    interrupted = tmp_path / "interrupted"
    in_process(interrupted, micro_dataset, *sets)
    # Pretend the run died after step 5: drop the later checkpoint and metrics, then restart it.
    shutil.rmtree(interrupted / "checkpoints" / "step_00000010")
    (interrupted / "metrics.jsonl").unlink()
    summary = in_process(interrupted, micro_dataset, *sets)
    assert summary.steps == 10
    assert step_losses(interrupted) == step_losses(full)[5:]  # bitwise-identical losses for steps 6..10
    from hardy.loading.load import load_model

    resumed_state = load_model(str(interrupted)).model.state_dict()
    for name, p in load_model(str(full)).model.state_dict().items():  # final weights are bitwise equal
        assert torch.equal(p, resumed_state[name]), name
    trainer_state = json.loads((interrupted / "checkpoints" / "step_00000010" / "trainer.json").read_text())
    assert trainer_state["step"] == 10 and trainer_state["config"]["model"]["preset"] == "micro"
    assert (full / "config.json").is_file()


def test_checkpoint_layout_and_export_of_a_run(tmp_path, micro_dataset):
    run = tmp_path / "run"
    in_process(run, micro_dataset, "train.steps=4", "checkpoint.at_end=true", "checkpoint.interval=2",
               "checkpoint.keep=1")
    steps = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert steps == ["step_00000004"]  # keep = 1 pruned step 2
    ckpt = run / "checkpoints" / "step_00000004"
    assert {"COMPLETE", "manifest.json", "trainer.json", "rank_00000.json", ".metadata"} <= {p.name for p in ckpt.iterdir()}
    out = tmp_path / "export"
    proc = run_hardy("export", "--model", str(run), "--format", "safetensors", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    from hardy.loading.load import load_model

    exported, from_run = load_model(str(out)), load_model(str(run))
    x = torch.randint(0, 512, (1, 32))
    with torch.no_grad():
        assert torch.equal(exported.model(x), from_run.model(x))
    gen = run_hardy("generate", "--model", str(run), "--prompt", "ROMEO:", "--max-new-tokens", "5")
    assert gen.returncode == 0, gen.stderr


def test_fine_tuning_starts_from_the_imported_weights(tmp_path, smollm2):
    from hardy.data.loader import PackedLoader
    from hardy.data.prepare import load_split, prepare
    from hardy.data.text import read_text

    src = tmp_path / "wiki.txt"
    src.write_text(read_text("wikitext2-valid")[:60_000])
    prepare([str(src)], "smollm2", tmp_path / "ds", seed=0)
    run = tmp_path / "ft"
    in_process(run, tmp_path / "ds", "model.init_from=smollm2-135m", "data.seq_len=32", "train.micro_batch=1",
               "train.steps=2", "optim.lr=1e-5")
    first = step_losses(run)[0]
    x, y = PackedLoader(load_split(tmp_path / "ds", "train"), 32, 1, seed=1234).next_batch()  # train.seed
    with torch.no_grad():
        expected = smollm2.model(x, targets=y).item()
    assert abs(first - expected) <= 1e-5 * expected
    assert first < 6  # a pretrained model, not a random one (~10.8 = ln 49152)


class _WritesAFile:
    """A pickle payload that creates `path` when unpickled (os.system, as an attacker would use it)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.path}",)


def test_a_received_checkpoint_cannot_run_code(tmp_path, micro_dataset):
    """A run directory from someone else, its DCP .metadata replaced by a payload and the manifest's
    checksums updated to match (they prove integrity, not authenticity): export and resume both end
    in a one-line error (exit 2) and the payload never runs."""
    import hashlib
    import pickle

    run = tmp_path / "run"
    in_process(run, micro_dataset, "train.steps=2", "checkpoint.at_end=true")
    ckpt = run / "checkpoints" / "step_00000002"
    marker = tmp_path / "payload-ran"
    payload = pickle.dumps(_WritesAFile(marker))
    (ckpt / ".metadata").write_bytes(payload)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"][".metadata"] = {"sha256": hashlib.sha256(payload).hexdigest(), "bytes": len(payload)}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))

    export = hardy_main("export", "--model", str(run), "--format", "safetensors", "--out", str(tmp_path / "out"))
    assert_one_line_error(export, ".metadata", "refers to posix.system", "refusing to load it")
    assert not (tmp_path / "out").exists()
    sets = [*BASE, f"data.path={micro_dataset}", "train.steps=4", "checkpoint.at_end=true"]
    resume = train_cli("--run-dir", str(run), *[arg for s in sets for arg in ("--set", s)])
    assert_one_line_error(resume, ".metadata", "refers to posix.system")
    assert not marker.exists()
    pickle.loads(payload)  # the payload itself is live: unrestricted, it does create the file
    assert marker.exists()
