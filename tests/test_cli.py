"""The `hardy` command: happy paths on SmolLM2 and one-line errors with exit code 2."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import run_hardy


def assert_one_line_error(proc, *fragments):
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("hardy: error: ")
    assert "Traceback" not in proc.stderr
    for fragment in fragments:
        assert fragment in lines[0]


@pytest.fixture(scope="module")
def gpt2_gguf(tmp_path_factory):
    import gguf

    path = tmp_path_factory.mktemp("gguf") / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_missing_model_file(tmp_path):
    assert_one_line_error(run_hardy("generate", "--model", str(tmp_path / "nope.gguf"), "--prompt", "x"),
                          "not found", "nope.gguf")


def test_truncated_gguf(tmp_path, smollm2_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(smollm2_path.read_bytes()[:3_000_000])
    assert_one_line_error(run_hardy("generate", "--model", str(cut), "--prompt", "x"), "truncated", "cut.gguf")


def test_garbage_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    assert_one_line_error(run_hardy("info", "--model", str(bad)), "not a readable GGUF", "bad.gguf")


def test_unsupported_architecture(gpt2_gguf):
    assert_one_line_error(run_hardy("generate", "--model", str(gpt2_gguf), "--prompt", "x"),
                          "unsupported GGUF architecture", "'gpt2'")


def test_unknown_preset():
    assert_one_line_error(run_hardy("info", "--model", "llama9-1t"), "not a preset", "llama9-1t")


def test_unreadable_data_files(tmp_path):
    missing = run_hardy("eval", "perplexity", "--model", "smollm2-135m", "--data", str(tmp_path / "none.txt"))
    assert_one_line_error(missing, "data file not found")
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00\x80" * 100)
    assert_one_line_error(run_hardy("eval", "perplexity", "--model", "smollm2-135m", "--data", str(binary)),
                          "not UTF-8", "binary.txt")
    assert_one_line_error(run_hardy("eval", "perplexity", "--model", "smollm2-135m", "--data", str(tmp_path)),
                          "is a directory")


def test_bad_option_value_is_one_line():
    assert_one_line_error(run_hardy("eval", "perplexity", "--model", "smollm2-135m", "--data", "wikitext2-test",
                                    "--protocol", "bogus"), "--protocol")


def test_debug_shows_traceback(tmp_path):
    proc = run_hardy("--debug", "info", "--model", str(tmp_path / "x.gguf"))
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_info_counts_presets_without_weights():
    proc = run_hardy("info", "--model", "llama3.1-405b", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["parameters"] == 405_853_388_800


def test_generate_streams_a_chat_answer():
    # fp32 weights: the shipped Q4_1 file run natively (int8 activations, as llama.cpp runs it) answers
    # "L'Étoile, la Cité, ..." here, as llama.cpp itself does
    proc = run_hardy("generate", "--model", "smollm2-135m", "--chat", "--prompt", "What is the capital of France?",
                     "--max-new-tokens", "12", "--stats", "--threads", "2", "--gguf-weights", "float")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "decode:" in proc.stderr and "tokens/s" in proc.stderr


def test_eval_perplexity_short_slice_json():
    proc = run_hardy("eval", "perplexity", "--model", "smollm2-135m", "--data", "wikitext2-valid",
                     "--max-tokens", "1024", "--json", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["n_chunks"] == 2 and result["n_scored"] == 510
    assert 5 < result["ppl"] < 60 and result["se"] > 0


def test_export_refuses_a_non_empty_directory(tmp_path):
    (tmp_path / "keep.txt").write_text("precious")
    assert_one_line_error(run_hardy("export", "--model", "smollm2-135m", "--format", "safetensors",
                                    "--out", str(tmp_path)), "already exists")
    assert (tmp_path / "keep.txt").read_text() == "precious"
