"""hardy's GGUF exports in llama.cpp itself (`make test` installs the pinned `llama-cpp-python`, which
compiles llama.cpp once per machine; pip keeps the built wheel): the file loads, llama.cpp tokenizes text
as hardy does (hardy's BPE exports a `tokenizer.ggml.pre` llama.cpp accepts), F32/F16 exports give
hardy's greedy tokens, and quantized exports agree with hardy's quantized model on >= 95% of
teacher-forced top-1 predictions."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import hardy_main
from hardy.loading.load import load_model

llama_cpp = pytest.importorskip("llama_cpp")

N_GREEDY = 24
N_FORCED = 256


def _llama(path, n_ctx=512):
    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=2, logits_all=True, verbose=False)


def _export(model_dir, out, qtype) -> None:
    proc = hardy_main("export", "--model", str(model_dir), "--format", "gguf", "--type", qtype, "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]


def _greedy(llm, prompt: list[int], n: int) -> list[int]:
    out = []
    for token in llm.generate(prompt, temp=0.0, reset=True):
        out.append(int(token))
        if len(out) == n:
            return out
    return out


@pytest.fixture(scope="module")
def text(mini_run) -> str:
    return (mini_run / "heldout.txt").read_text()[:6000]


@pytest.mark.parametrize("qtype", ["F32", "F16"])
def test_float_exports_give_hardys_greedy_tokens(mini_run, tmp_path, text, qtype):
    from hardy.infer.generate import SamplingConfig, generate

    hardy_model = load_model(str(mini_run / "run"))
    _export(mini_run / "run", tmp_path / "m.gguf", qtype)
    llm = _llama(tmp_path / "m.gguf")
    sample = text[:1500]
    assert llm.tokenize(sample.encode(), add_bos=False, special=False) == hardy_model.tokenizer.encode(sample)
    for start in ("KING HENRY:", "First Citizen:\nWe", "ROMEO:\nO, she"):
        prompt = hardy_model.tokenizer.encode(start)
        ours = generate(hardy_model.model, prompt, SamplingConfig(max_new_tokens=N_GREEDY)).tokens
        assert _greedy(llm, prompt, N_GREEDY) == ours, (qtype, start)


@pytest.mark.parametrize("bits,qtype", [("8", "Q8_0"), ("4", "Q4_1"), ("4", "Q4_0")])
def test_quantized_exports_agree_with_hardy_teacher_forced(mini_compressed, tmp_path, text, bits, qtype):
    """hardy int8 g32 / int4 g32 / symmetric int4 g32 repack losslessly into Q8_0 / Q4_1 / Q4_0: the
    two runtimes then differ only in arithmetic (llama.cpp also quantizes activations to 8 bits)."""
    grid = ["--symmetric"] if qtype == "Q4_0" else []
    src = mini_compressed("--bits", bits, "--group-size", "32", "--quantize-embeddings", *grid)
    _export(src, tmp_path / "q.gguf", qtype)
    quantized = load_model(str(src))
    tokens = quantized.tokenizer.encode(text)[:N_FORCED]
    assert len(tokens) == N_FORCED
    with torch.inference_mode():
        ours = quantized.model(torch.tensor([tokens]))[0].argmax(-1).numpy()
    llm = _llama(tmp_path / "q.gguf")
    llm.eval(tokens)
    theirs = np.asarray(llm.scores[:N_FORCED]).argmax(-1)
    agreement = float((ours == theirs).mean())
    print(f"{qtype}: top-1 agreement {agreement:.4f}")
    assert agreement >= 0.95, f"{qtype}: top-1 agreement {agreement:.3f}"


def test_the_installed_llama_cpp_has_no_amx_matmul():
    """`make test` builds llama.cpp with AMX masked: its AMX matmul dies with SIGILL on the Xeons CI runs
    on (a multi-token decode killed a pytest worker). A build with AMX reports AMX_INT8 or AMX_BF16 here."""
    info = llama_cpp.llama_print_system_info().decode()
    assert "AVX2 = 1" in info or "NEON = 1" in info  # the report is the CPU backend's feature list
    assert "AMX" not in info, info


@pytest.mark.parametrize("name,ftype", [("Q5_K_M", 17), ("Q4_K_M", 15)])
@torch.inference_mode()
def test_files_llama_cpp_quantized_to_k_quants_load_natively_as_their_dequantized_values(tmp_path, name, ftype):
    """A model quantized by llama.cpp's own quantizer (llama_model_quantize: Q5_K_M / Q4_K_M, with Q6_K
    where it gives more bits) loads in the K-quant forms without a rounding: prefill logits equal those
    of the file dequantized by the `gguf` package, and llama.cpp (which also rounds activations to 8
    bits) predicts the same next token at most positions."""
    import ctypes
    import sys

    import transformers

    sys.path.insert(0, str(Path(__file__).parent))
    from families import build_hf_model, byte_level_tokenizer
    from hardy.formats.gguf_export import export_gguf
    from hardy.formats.gguf_io import open_gguf

    build_hf_model(transformers, "llama", changes=dict(hidden_size=256, intermediate_size=512, head_dim=64)) \
        .save_pretrained(tmp_path / "hf")  # widths of whole 256-value super-blocks
    source = load_model(str(tmp_path / "hf"))
    export_gguf(source.model, source.config, byte_level_tokenizer(), tmp_path / "f32.gguf", "F32")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = ftype, 2
    out = tmp_path / f"{name}.gguf"
    assert llama_cpp.llama_model_quantize(str(tmp_path / "f32.gguf").encode(), str(out).encode(),
                                          ctypes.byref(params)) == 0
    types = {t.tensor_type.name for t in open_gguf(out).tensors}
    assert {name[:4], "Q6_K"} <= types, types
    native, floated = load_model(str(out), gguf="native"), load_model(str(out), gguf="float")
    assert all(m.quant_tensor().spec.super_block for m in native.model.modules() if hasattr(m, "quant_tensor"))
    tokens = torch.randint(4, 320, (64,), generator=torch.Generator().manual_seed(7)).tolist()
    ours = native.model(torch.tensor([tokens]))[0]
    assert torch.equal(ours, floated.model(torch.tensor([tokens]))[0])
    llm = _llama(out, n_ctx=128)
    llm.eval(tokens)
    theirs = np.asarray(llm.scores[:64]).argmax(-1)
    agreement = float((ours.argmax(-1).numpy() == theirs).mean())
    print(f"{name}: top-1 agreement with llama.cpp {agreement:.4f}")
    assert agreement >= 0.75, agreement  # a sanity check: the equality above is the claim
