"""Compression with the weights streamed from disk (`hardy compress` on a Hugging Face directory): the
same numbers as compressing the loaded model, bit for bit, with one block resident at a time; and the
streaming safetensors writer / lazy reader it rests on."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import hardy_main
from hardy.compress import pipeline
from hardy.compress.pipeline import CompressConfig, compress_from_disk, compress_model
from hardy.compress.store import SpilledQuant
from hardy.errors import HardyError
from hardy.formats.hf import open_hf_dir
from hardy.formats.lazy_weights import write_safetensors
from hardy.loading.load import load_model


@pytest.fixture(scope="module")
def mini_hf(mini_run, tmp_path_factory):
    """The trained `mini` model exported as a Hugging Face directory, fp32 and bf16."""
    out = tmp_path_factory.mktemp("hf")
    dirs = {}
    for dtype in ("fp32", "bf16"):
        dirs[dtype] = out / dtype
        proc = hardy_main("export", "--model", str(mini_run / "run"), "--format", "safetensors", "--dtype", dtype,
                          "--out", str(dirs[dtype]))
        assert proc.returncode == 0, proc.stderr[-2000:]
    return dirs


def _calib(mini_run, tokenizer):
    from hardy.compress.pipeline import calibration_batch

    return calibration_batch(tokenizer, (mini_run / "train.txt").read_text(), 8, 64, seed=0)


@pytest.mark.parametrize("dtype,kw", [
    ("fp32", dict(quant="gptq", bits=4, group_size=32)),
    ("bf16", dict(quant="awq", bits=4, group_size=32, embeddings="same")),
    ("fp32", dict(quant="rtn", bits=8, group_size=0, prune="wanda", sparsity="2:4")),
])
def test_streamed_compression_equals_the_in_memory_one(mini_hf, mini_run, monkeypatch, tmp_path, dtype, kw):
    cfg = CompressConfig(calib_samples=8, calib_seq=64, **kw)
    loaded = load_model(str(mini_hf[dtype]))
    calib = _calib(mini_run, loaded.tokenizer)
    reference = compress_model(loaded.model, cfg, calib, progress=False)

    mcfg, weights, _ = open_hf_dir(mini_hf[dtype])
    seen = []
    inner = pipeline._compress_block

    def one_block_resident(block, li, *args, **kwargs):  # every other block is still (or again) on meta
        others = [p.device.type for j, b in enumerate(model_layers) if j != li for p in b.parameters()]
        seen.append((li, set(others), {p.device.type for p in block.parameters()}))
        return inner(block, li, *args, **kwargs)

    built = pipeline.meta_transformer

    def capture(c):
        model = built(c)
        model_layers.extend(model.layers)
        return model

    model_layers: list = []
    monkeypatch.setattr(pipeline, "_compress_block", one_block_resident)
    monkeypatch.setattr(pipeline, "meta_transformer", capture)
    streamed = compress_from_disk(mcfg, weights, cfg, calib, progress=False, spill_dir=tmp_path)
    assert [li for li, _, _ in seen] == list(range(mcfg.n_layers))
    # every block's packed results left memory for a spill file when the block was done
    assert all(isinstance(q, SpilledQuant) for q in streamed.quantized.values())
    assert len(list(tmp_path.glob("block_*.safetensors"))) == mcfg.n_layers
    assert all(others == {"meta"} and mine == {"cpu"} for _, others, mine in seen)
    assert set(streamed.quantized) == set(reference.quantized)
    for name, q in reference.quantized.items():
        assert all(torch.equal(a, b) for a, b in zip(streamed.quantized[name].packed().values(), q.packed().values()))
    # the float tensors that stay float (norms, AWQ-rescaled): the in-memory state less the quantized
    floats = {n: t for n, t in reference.state.items() if n not in reference.quantized and n != "output.weight"}
    assert set(streamed.state) == set(floats) and len(floats) == 2 * mcfg.n_layers + 1
    for name, t in streamed.state.items():
        assert torch.equal(t, floats[name]), name
    assert [r.output_error for r in streamed.reports] == [r.output_error for r in reference.reports]


def test_cli_compresses_a_hf_directory_from_disk(mini_hf, mini_run, tmp_path):
    """`hardy compress --model DIR` takes the streaming path and writes a model every command loads,
    with the same tensors as compressing the run directory the export came from."""
    args = ["--quant", "gptq", "--bits", "4", "--group-size", "32", "--calib-data", str(mini_run / "train.txt"),
            "--calib-samples", "4", "--calib-seq", "64", "--no-progress"]
    for model, out in ((mini_hf["fp32"], tmp_path / "disk"), (mini_run / "run", tmp_path / "memory")):
        proc = hardy_main("compress", "--model", str(model), "--out", str(out), *args)
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert not list(tmp_path.glob(".hardy-spill-*"))  # the spill files went with the run
    disk, memory = load_file(str(tmp_path / "disk" / "model.safetensors")), load_file(
        str(tmp_path / "memory" / "model.safetensors"))
    assert set(disk) == set(memory) and all(torch.equal(disk[k], memory[k]) for k in disk)
    assert json.loads((tmp_path / "disk" / "quantization.json").read_text())["tensors"]
    gen = hardy_main("generate", "--model", str(tmp_path / "disk"), "--prompt", "KING:", "--max-new-tokens", "4")
    assert gen.returncode == 0 and gen.stdout.startswith("KING:")
    again = hardy_main("compress", "--model", str(tmp_path / "disk"), "--out", str(tmp_path / "x"), "--quant", "rtn")
    assert again.returncode == 2 and "already quantized" in again.stderr
    taken = hardy_main("compress", "--model", str(mini_hf["fp32"]), "--out", str(tmp_path / "disk"), *args)
    assert taken.returncode == 2 and "already exists" in taken.stderr  # refused before compressing


def test_streaming_writer_round_trips_and_refuses_a_wrong_tensor(tmp_path):
    tensors = {"a": torch.randn(3, 5).bfloat16(), "b": torch.arange(7, dtype=torch.float32), "c": torch.zeros(0, 4)}
    entries = [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    made = []

    def make(name):
        made.append(name)
        return tensors[name]

    path = write_safetensors(tmp_path / "w.safetensors", entries, make, metadata={"format": "pt"})
    assert made == ["a", "b", "c"]  # one at a time, in header order
    back = load_file(str(path))
    assert set(back) == set(tensors) and all(torch.equal(back[k], v) for k, v in tensors.items())
    with pytest.raises(HardyError, match="header says"):
        write_safetensors(tmp_path / "bad.safetensors", entries, lambda name: torch.ones(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]  # no partial file left


def test_lazy_reader_reads_what_safetensors_wrote_and_refuses_damaged_files(tmp_path):
    """The pread-based reader against files the `safetensors` package wrote: every tensor and row
    range equal; a cut or garbled file is a one-line HardyError when opened or read."""
    from safetensors.torch import save_file

    from hardy.formats.lazy_weights import LazyWeights

    tensors = {"model.embed_tokens.weight": torch.randn(10, 4).bfloat16(), "model.norm.weight": torch.randn(4),
               "model.layers.0.mlp.down_proj.weight": torch.randn(4, 6).half()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    lazy = LazyWeights(tmp_path, ["model.safetensors"])
    assert sorted(lazy.names()) == ["layers.0.feed_forward.w2.weight", "norm.weight", "tok_embeddings.weight"]
    assert torch.equal(lazy.get("tok_embeddings.weight", dtype=None), tensors["model.embed_tokens.weight"])
    assert torch.equal(lazy.get("layers.0.feed_forward.w2.weight"), tensors["model.layers.0.mlp.down_proj.weight"].float())
    assert torch.equal(lazy.rows("tok_embeddings.weight", 3, 7), tensors["model.embed_tokens.weight"][3:7].float())
    raw = (tmp_path / "model.safetensors").read_bytes()
    bad = tmp_path / "bad"
    bad.mkdir()
    for case, data in {"cut header": raw[:20], "huge header": (2 ** 40).to_bytes(8, "little") + raw[8:],
                       "not json": raw[:8] + b"{" * (len(raw) - 8)}.items():
        (bad / "model.safetensors").write_bytes(data)
        with pytest.raises(HardyError, match="cannot read safetensors"):
            LazyWeights(bad, ["model.safetensors"])
    (bad / "model.safetensors").write_bytes(raw[:-8])  # the last tensor's bytes cut: refused at open
    with pytest.raises(HardyError, match="malformed header entry"):
        LazyWeights(bad, ["model.safetensors"])
