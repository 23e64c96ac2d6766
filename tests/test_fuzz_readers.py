"""Malformed model files end in a one-line error (HardyError: exit 2 from the CLI), never a traceback,
within seconds and bounded memory, and nothing is written: a fixed corpus of damaged variants of the
real SmolLM2 GGUF (every section: the fixed header, each key/value's key, type and value, the
tokenizer's arrays, tensor infos, the data) and property-based damage (hypothesis) to GGUF files
and Hugging Face directories (safetensors, config.json, tokenizer.json) of the `mini` model."""
from __future__ import annotations

import json
import shutil
import struct

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import hardy_main, run_hardy
from fuzz_models import gguf_map, gguf_variants, load_each, write_variant
from hardy.errors import HardyError
from hardy.loading.load import load_model
from test_cli import assert_one_line_error


def test_damaged_smollm2_files_end_in_one_line_errors_fast_and_small(smollm2_path, tmp_path):
    data = smollm2_path.read_bytes()
    variants = gguf_variants(data, every_tensor=90)  # every kind of damage, for three of its 272 tensors
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    jobs = []
    for i, (name, (head, size)) in enumerate(variants.items()):
        write_variant(corpus / f"v{i:03d}.gguf", head, size)
        jobs.append({"name": name, "path": str(corpus / f"v{i:03d}.gguf"), "gguf": "native"})
    before = sorted(p.name for p in corpus.iterdir())
    results = load_each(jobs, tmp_path)
    crashes = [f"{r['name']}: {r['detail']}" for r in results if r["outcome"] == "crash"]
    assert not crashes, "\n\n".join(crashes)
    errors = [r for r in results if r["outcome"] == "error"]
    # truncations, absurd counts and lengths, unknown types, bad tensor infos: all of them refused
    fatal = ("count absurd", "version 9", ": string length absurd", ": element count absurd", ": unknown value type",
             ": element type unknown", ": element count one more", ": dimension", ": offset", ": type unknown")
    must_fail = [r for r in results if r["name"].startswith("cut") or any(f in r["name"] for f in fatal)]
    assert all(r["outcome"] == "error" for r in must_fail), [r["name"] for r in must_fail if r["outcome"] != "error"]
    assert len(must_fail) > 150 and all("\n" not in r["detail"] and r["detail"] for r in errors)
    slowest = max(results, key=lambda r: r["seconds"])
    assert slowest["seconds"] < 5, slowest
    biggest = max(results, key=lambda r: r["peak"])
    assert biggest["peak"] < len(data) + (512 << 20), biggest  # at most the model itself, never an absurd count
    assert sorted(p.name for p in corpus.iterdir()) == before  # nothing written beside the inputs
    # and the CLI says it in one line with exit code 2
    for name in ("cut in kv tokenizer.ggml.merges elements", "tensor count absurd", "kv llama.block_count: value absurd"):
        path = next(j["path"] for j in jobs if j["name"] == name)
        assert_one_line_error(run_hardy("generate", "--model", path, "--prompt", "x", "--max-new-tokens", "1"), path)


# ------------------------------------------------------------------ property-based: the mini model
@pytest.fixture(scope="module")
def mini_gguf(mini_run, tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "mini.Q8_0.gguf"
    proc = hardy_main("export", "--model", str(mini_run / "run"), "--format", "gguf", "--type", "Q8_0",
                      "--out", str(path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return path.read_bytes(), gguf_map(path.read_bytes())[1]


def loads_or_refuses(path, **kwargs) -> None:
    """The property: a load either works or raises HardyError with a one-line message."""
    try:
        load_model(str(path), **kwargs)
    except HardyError as e:
        assert str(e) and "\n" not in str(e)


FUZZ = settings(max_examples=60, deadline=5000, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                       HealthCheck.too_slow])


@FUZZ
@given(data=st.data())
def test_any_damage_to_a_gguf_file_is_refused_or_harmless(mini_gguf, tmp_path, data):
    good, header_end = mini_gguf
    damaged = bytearray(good)
    kind = data.draw(st.sampled_from(["cut", "bytes", "u64", "u32"]))
    if kind == "cut":
        damaged = damaged[:data.draw(st.integers(0, len(good) - 1))]
    else:
        for _ in range(data.draw(st.integers(1, 6))):
            at = data.draw(st.integers(0, header_end - 8))
            if kind == "bytes":
                damaged[at] = data.draw(st.integers(0, 255))
            else:
                value = data.draw(st.sampled_from([0, 1, 7, 2 ** 31, 2 ** 32 - 1, 2 ** 62, 2 ** 64 - 1]))
                fmt = "<Q" if kind == "u64" else "<I"
                struct.pack_into(fmt, damaged, at, value & (2 ** (8 * struct.calcsize(fmt)) - 1))
    path = tmp_path / "damaged.gguf"
    path.write_bytes(bytes(damaged))
    loads_or_refuses(path, gguf=data.draw(st.sampled_from(["float", "native"])))


@pytest.fixture(scope="module")
def mini_hf(mini_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("fuzz") / "mini-hf"
    proc = hardy_main("export", "--model", str(mini_run / "run"), "--format", "safetensors", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    load_model(str(out))  # the undamaged directory loads
    return out


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-2 ** 63, 2 ** 63) | st.floats() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                           max_leaves=6)


@FUZZ
@given(data=st.data())
def test_any_damage_to_a_hugging_face_directory_is_refused_or_harmless(mini_hf, tmp_path, data):
    target = tmp_path / "damaged"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(mini_hf, target)
    kind = data.draw(st.sampled_from(["config value", "config key", "config text", "weights cut", "weights header",
                                      "header length", "tokenizer cut"]))
    config_file, weights = target / "config.json", target / "model.safetensors"
    if kind.startswith("config"):
        config = json.loads(config_file.read_text())
        key = data.draw(st.sampled_from(sorted(config)))
        if kind == "config value":
            config[key] = data.draw(JSON_VALUES)
            config_file.write_text(json.dumps(config))
        elif kind == "config key":
            del config[key]
            config_file.write_text(json.dumps(config))
        else:
            text = json.dumps(config)
            config_file.write_text(text[:data.draw(st.integers(0, len(text) - 1))])
    elif kind == "weights cut":
        raw = weights.read_bytes()
        weights.write_bytes(raw[:data.draw(st.integers(0, len(raw) - 1))])
    elif kind == "weights header":  # damage inside the JSON header: dtypes, shapes, offsets
        raw = bytearray(weights.read_bytes())
        n = struct.unpack_from("<Q", raw)[0]
        for _ in range(data.draw(st.integers(1, 4))):
            raw[8 + data.draw(st.integers(0, n - 1))] = data.draw(st.sampled_from(list(b'0129"{}[],:-eF')))
        weights.write_bytes(bytes(raw))
    elif kind == "header length":
        raw = bytearray(weights.read_bytes())
        struct.pack_into("<Q", raw, 0, data.draw(st.sampled_from([0, 1, 7, len(raw), 2 ** 62, 2 ** 64 - 1])))
        weights.write_bytes(bytes(raw))
    else:
        tok = target / "tokenizer.json"
        text = tok.read_text()
        tok.write_text(text[:data.draw(st.integers(0, len(text) - 1))])
    before = sorted(p.name for p in target.iterdir())
    loads_or_refuses(target)
    assert sorted(p.name for p in target.iterdir()) == before
