"""hardy export --format gguf: lossless where the formats match, exact F32 round trip, a tokenizer
llama.cpp accepts, and files the `gguf` package dequantizes to exactly hardy's numbers."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import hardy_main, run_hardy
from hardy.loading.load import load_model
from hardy.formats.names import unpermute_qk

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def compressed(mini_compressed):
    """The mini model quantized to int4 g32 (= Q4_1), symmetric int4 g32 (= Q4_0) and int8 g32 (= Q8_0)
    with hardy compress."""
    out = {f"int{bits}": mini_compressed("--bits", bits, "--group-size", "32", "--quantize-embeddings")
           for bits in ("4", "8")}
    out["int4sym"] = mini_compressed("--bits", "4", "--group-size", "32", "--symmetric", "--quantize-embeddings")
    return out


def _export(model_dir, out, qtype, as_user: bool = False) -> str:
    """`hardy export` in this interpreter, or (as_user) in a fresh one, where its log output is seen."""
    args = ("export", "--model", str(model_dir), "--format", "gguf", "--type", qtype, "--out", str(out))
    proc = run_hardy(*args) if as_user else hardy_main(*args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    if as_user:
        assert "gguf:" not in proc.stderr  # the writer's chatter is silenced
    return proc.stdout


def test_f32_export_imports_back_exactly(mini_run, tmp_path):
    from hardy.formats.gguf_io import load_gguf

    _export(mini_run / "run", tmp_path / "m.gguf", "F32", as_user=True)
    original = load_model(str(mini_run / "run"))
    cfg, state, tokenizer, fields = load_gguf(tmp_path / "m.gguf")
    assert cfg.norm_eps == pytest.approx(original.config.norm_eps, rel=1e-6)  # GGUF stores it as f32
    assert cfg.replace(name=original.config.name, norm_eps=original.config.norm_eps) == original.config
    ours = {k: v for k, v in original.model.state_dict().items() if not k.startswith("rope_") and k != "output.weight"}
    assert set(state) == set(ours)
    for name, tensor in ours.items():
        assert torch.equal(state[name], tensor), name
    text = (mini_run / "heldout.txt").read_text()[:2000]
    assert tokenizer.encode(text) == original.tokenizer.encode(text)
    assert fields["tokenizer.ggml.pre"] == "gpt-2" and fields["tokenizer.ggml.model"] == "gpt2"
    assert len(fields["tokenizer.ggml.tokens"]) == cfg.vocab_size and fields["tokenizer.ggml.merges"]
    again = load_model(str(tmp_path / "m.gguf"))
    from hardy.infer.generate import SamplingConfig, generate

    prompt = original.tokenizer.encode("KING HENRY:")
    sampling = SamplingConfig(max_new_tokens=16)
    assert generate(again.model, prompt, sampling).tokens == generate(original.model, prompt, sampling).tokens


@pytest.mark.parametrize("kind,qtype", [("int4", "Q4_1"), ("int4sym", "Q4_0"), ("int8", "Q8_0")])
def test_hardy_quantized_tensors_repack_losslessly(compressed, tmp_path, kind, qtype):
    from hardy.compress.store import load_compressed

    stdout = _export(compressed[kind], tmp_path / "q.gguf", qtype)
    cfg, _, quantized, _, _ = load_compressed(compressed[kind])
    assert f"{len(quantized)} tensors repacked" in stdout and "0 quantized" in stdout
    reader = gguf.GGUFReader(tmp_path / "q.gguf")
    by_name = {t.name: t for t in reader.tensors}
    from hardy.formats.names import to_format

    for name, qt in quantized.items():
        assert (qt.mins is None) == (kind != "int4"), name  # the symmetric grids store no mins
        t = by_name[to_format(name, "gguf")]
        assert t.tensor_type == gguf.GGMLQuantizationType[qtype], name
        values = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
        values = values.reshape(qt.shape)
        if name.endswith("wq.weight"):
            values = unpermute_qk(values, cfg.n_heads)
        elif name.endswith("wk.weight"):
            values = unpermute_qk(values, cfg.n_kv_heads)
        assert torch.equal(values, qt.dequantize()), name  # gguf's dequantization == hardy's, bit for bit


def test_quantized_exports_load_and_stay_close(mini_run, tmp_path):
    from hardy.eval.perplexity import perplexity

    dense = load_model(str(mini_run / "run"))
    tokens = dense.tokenizer.encode((mini_run / "heldout.txt").read_text())[:4096]

    def ppl(model):
        return perplexity(model, tokens, ctx=128, bos_id=None, batch_size=16).ppl

    base = ppl(dense.model)
    for qtype, tol in (("F16", 0.001), ("Q8_0", 0.01), ("Q4_0", 0.08), ("Q4_1", 0.08)):
        _export(mini_run / "run", tmp_path / f"{qtype}.gguf", qtype)
        assert abs(ppl(load_model(str(tmp_path / f"{qtype}.gguf")).model) / base - 1) < tol, qtype


def test_export_errors_are_one_line(mini_run, tmp_path):
    (tmp_path / "exists.gguf").write_bytes(b"x")
    proc = hardy_main("export", "--model", str(mini_run / "run"), "--format", "gguf", "--out", str(tmp_path / "exists.gguf"))
    assert proc.returncode == 2 and "already exists" in proc.stderr and "Traceback" not in proc.stderr
    assert (tmp_path / "exists.gguf").read_bytes() == b"x"  # nothing lost
    assert not list(tmp_path.glob(".exists.gguf.*"))
