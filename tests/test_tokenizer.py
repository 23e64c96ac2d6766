"""Tokenizer built from GGUF metadata: round trips and parity with transformers."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hardy.data.text import read_text
from hardy.errors import HardyError


@pytest.fixture(scope="session")
def tok(smollm2_path):
    from hardy.formats.gguf_io import gguf_fields, open_gguf
    from hardy.formats.tokenizer import tokenizer_from_gguf_fields

    return tokenizer_from_gguf_fields(gguf_fields(open_gguf(smollm2_path)))


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_roundtrip_arbitrary_unicode(tok, text):
    """Any text round-trips exactly, or is refused when its bytes have no token (never silently lost)."""
    lossy = tok.backend.decode(tok.backend.encode(text).ids, skip_special_tokens=False) != text
    if lossy:
        with pytest.raises(HardyError, match="cannot encode"):
            tok.encode(text)
    else:
        assert tok.decode(tok.encode(text)) == text


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\x04\x06\x13\x14\x16\x1d",
                                      max_codepoint=0x3FFFF) | st.characters(min_codepoint=0xC0000), max_size=200))
def test_roundtrip_everything_the_vocab_covers(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_unrepresentable_characters_are_refused(tok):
    # SmolLM2's vocabulary lacks the bytes of six control characters and of planes 4-11.
    for text in ("a\x04b", "x\U00040000", "\U000bffff"):
        with pytest.raises(HardyError, match="cannot encode"):
            tok.encode(text)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
                | st.text(st.characters(codec="ascii", min_codepoint=32), max_size=20), max_size=8))
def test_special_tokens_stay_whole(tok, parts):
    text = "".join(parts)
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    for special in ("<|im_start|>", "<|im_end|>"):
        assert ids.count(tok.backend.token_to_id(special)) == text.count(special)


def _samples():
    out = []
    for corpus in ("wikitext2-test", "tinyshakespeare"):
        text = read_text(corpus)
        out += [text[i:i + 3000] for i in (0, len(text) // 3, 2 * len(text) // 3)]
    return out


def test_ids_match_transformers_tokenizer(tok, hf_gguf_tokenizer):
    for sample in _samples() + ["Numbers: 1234567 3.14159 -42 1e10", "  leading  spaces\n\n\ttabs"]:
        assert tok.encode(sample) == hf_gguf_tokenizer(sample, add_special_tokens=True)["input_ids"]


def test_digits_are_split_individually(tok):
    # SmolLM2's pre-tokenizer ("smollm" in llama.cpp) isolates every digit.
    ids = tok.encode("2024")
    assert [tok.decode([i]) for i in ids] == ["2", "0", "2", "4"]


def test_bos_policy_follows_metadata(tok):
    assert tok.add_bos is False  # SmolLM2: tokenizer.ggml.add_bos_token = false
    assert tok.encode("hi", add_bos=True)[0] == tok.bos_id


def test_stream_decoder_joins_multibyte_characters(tok):
    text = "naïve café — 日本語 🙂"
    stream = tok.stream_decoder()
    assert "".join(stream.step(i) for i in tok.encode(text)) == text


@pytest.mark.parametrize("damage", ['{"bos_token": "<s>", ', '["not", "an", "object"]', b"\xff\xfe{}"])
def test_a_damaged_tokenizer_config_is_one_line_naming_the_file(family_dirs, tmp_path, damage):
    """A model directory whose tokenizer_config.json is cut short, not an object or not UTF-8: the
    command stops with exit code 2 and one line naming that file, not a JSON traceback."""
    import shutil
    import subprocess
    import sys

    from conftest import REPO

    model = tmp_path / "m"
    shutil.copytree(family_dirs["llama"], model)
    config = model / "tokenizer_config.json"
    config.write_bytes(damage if isinstance(damage, bytes) else damage.encode())
    proc = subprocess.run([sys.executable, "-m", "hardy", "generate", "--model", str(model), "--prompt", "hi",
                           "--max-new-tokens", "2"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and str(config) in proc.stderr
