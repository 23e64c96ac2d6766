"""GGUF files of every architecture hardy writes (`llama` with Mistral's SentencePiece vocabulary,
`qwen2`, `qwen3`, `gemma2`, `gemma3`), written with the `gguf` package from tiny random models built
by `transformers`, run in llama.cpp itself (llama-cpp-python, as the other interop tests): the same
greedy tokens, the same teacher-forced logits, and hardy reads its own file back as the model it wrote.
SentencePiece-style and Qwen-style vocabularies tokenize text as llama.cpp does."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from families import (SPM_FAMILIES, build_hf_model_for_gguf, byte_level_tokenizer, llama_cpp_greedy,
                      sentencepiece_tokenizer)
from hardy.formats.gguf_export import export_gguf
from hardy.infer.generate import SamplingConfig, generate
from hardy.loading.load import load_model

transformers = pytest.importorskip("transformers")
llama_cpp = pytest.importorskip("llama_cpp")
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text"]
ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
        "gemma3_text": "gemma3"}
GREEDY = 24
SEQ = 40  # five times the windowed layers' window


def _llama(path, n_ctx=128):
    # f32 KV cache: llama.cpp's f16 default would round the keys and values hardy keeps in fp32
    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=2, type_k=0, type_v=0, logits_all=True,
                           verbose=False)


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    """family -> (hardy's model from the transformers directory, the GGUF file hardy wrote from it)."""
    out = {}
    for family in FAMILIES:
        root = tmp_path_factory.mktemp(family)
        build_hf_model_for_gguf(transformers, family).save_pretrained(root / "hf")
        ours = load_model(str(root / "hf"))
        tok = sentencepiece_tokenizer(320, family == "mistral") if family in SPM_FAMILIES else byte_level_tokenizer()
        export_gguf(ours.model, ours.config, tok, root / "m.gguf", "F32")
        out[family] = (ours, root / "m.gguf")
    return out


@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_llama_cpp_gives_hardys_greedy_tokens_and_logits(ggufs, family):
    source, path = ggufs[family]
    ours = load_model(str(path))
    assert ours.model.cfg.family == source.config.family or family == "mistral"  # a windowless Mistral is a Llama
    llm = _llama(path)
    assert llm.metadata["general.architecture"] == ARCH[family]
    prompt = list(range(5, 15))
    theirs = llama_cpp_greedy(llm, prompt, GREEDY)
    assert generate(ours.model, prompt, SamplingConfig(max_new_tokens=GREEDY)).tokens == theirs
    tokens = torch.randint(4, 320, (SEQ,), generator=torch.Generator().manual_seed(7)).tolist()
    llm.reset()
    llm.eval(tokens)
    cpp = torch.from_numpy(np.asarray(llm.scores[:SEQ], dtype=np.float32))
    mine = ours.model(torch.tensor([tokens]))[0]
    assert (cpp - mine).abs().max() < 2e-3 * mine.abs().max()
    assert torch.equal(cpp.argmax(-1), mine.argmax(-1))
    # hardy reads its own file back as the model it wrote (fp32 weights: the same logits)
    torch.testing.assert_close(mine, source.model(torch.tensor([tokens]))[0], rtol=0, atol=1e-5)


def _text() -> str:
    from hardy.data.text import resolve_text_path

    return resolve_text_path("tinyshakespeare").read_text()[300_000:306_000] + " 12345 ßü 😀\t\n\n  x"


@pytest.mark.parametrize("space_prefix", [True, False])
def test_sentencepiece_vocabulary_tokenizes_as_llama_cpp(ggufs, tmp_path, space_prefix):
    """Scores decide the merges, unknown characters fall back to bytes, spaces are "▁", and a prefix
    space where the vocabulary asks for it (Mistral) or not (Gemma)."""
    ours, _ = ggufs["gemma3_text"]
    tok = sentencepiece_tokenizer(320, space_prefix)
    export_gguf(ours.model, ours.config, tok, tmp_path / "t.gguf", "F32")
    read_back = load_model(str(tmp_path / "t.gguf")).tokenizer
    llm = llama_cpp.Llama(model_path=str(tmp_path / "t.gguf"), vocab_only=True, verbose=False)
    text = _text()
    theirs = llm.tokenize(text.encode(), add_bos=False, special=False)
    assert read_back.encode(text, add_bos=False) == theirs
    assert tok.encode(text, add_bos=False) == theirs
    assert read_back.decode(theirs) == text


def test_qwen2_pre_tokenizer_splits_digits_as_llama_cpp(ggufs, tmp_path):
    ours, _ = ggufs["qwen2"]
    tok = byte_level_tokenizer()
    tok.pre = "qwen2"
    export_gguf(ours.model, ours.config, tok, tmp_path / "q.gguf", "F32")
    read_back = load_model(str(tmp_path / "q.gguf")).tokenizer
    llm = llama_cpp.Llama(model_path=str(tmp_path / "q.gguf"), vocab_only=True, verbose=False)
    text = "In 2024, 1234567 apples cost $89.99 -- don't you think? " + _text()
    ids = read_back.encode(text)
    assert ids == llm.tokenize(text.encode(), add_bos=False, special=False)
    assert len(read_back.encode("1234567")) == 7  # one token per digit (Llama 3's split would make 3)


def _rewrite(src, dst, changes: dict, drop=()) -> None:
    """A copy of a GGUF file with some metadata values changed (or dropped), tensors as they are."""
    import gguf

    from hardy.formats.gguf_reader import GGUFFile

    reader = GGUFFile(src)
    arch = reader.fields["general.architecture"]
    writer = gguf.GGUFWriter(str(dst), changes.get("general.architecture", arch))
    raw = gguf.GGUFReader(src)
    for name, field in raw.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture",) or name in drop:
            continue
        value = changes.get(name, field.contents())
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, value)
        else:
            writer.add_key_value(name, value, vtype)
    for name, value in changes.items():  # keys the file did not have
        if name not in raw.fields and name != "general.architecture":
            writer.add_key_value(name, value, gguf.GGUFValueType.INT32)
    for t in raw.tensors:
        writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_metadata_that_disagrees_with_the_tensors_is_a_one_line_error(ggufs, tmp_path):
    from conftest import hardy_main

    _, path = ggufs["qwen3"]
    cases = [({"qwen3.attention.key_length": 16}, "tensor blk.0.attn_k_norm.weight has shape (32,), the config implies (16,)"),
             ({"qwen3.attention.sliding_window": -1}, "qwen3.attention.sliding_window = -1 is negative"),
             ({"general.architecture": "mamba"}, "unsupported GGUF architecture 'mamba'")]
    for i, (changes, message) in enumerate(cases):
        bad = tmp_path / f"bad{i}.gguf"
        _rewrite(str(path), bad, changes)
        proc = hardy_main("generate", "--model", str(bad), "--prompt", "x")
        assert proc.returncode == 2 and message in proc.stderr, (changes, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_gemma3_without_a_window_is_global_everywhere_as_in_llama_cpp(ggufs, tmp_path):
    from hardy.loading.load import config_for

    _, path = ggufs["gemma3_text"]
    assert config_for(str(path)).kinds.count("sliding") == 5
    _rewrite(str(path), tmp_path / "nowindow.gguf", {}, drop=("gemma3.attention.sliding_window",))
    cfg = config_for(str(tmp_path / "nowindow.gguf"))
    assert cfg.kinds == ("full",) * 6 and cfg.sliding_window is None
