"""Chat templates render as `transformers.apply_chat_template` renders them: each family's own template
(tests/data/chat_templates, from the released models) on the same conversations gives the same text,
and a conversation a template refuses (raise_exception) is refused by both. hardy's built-in formats,
for files without a template, give what the families' own templates give."""
from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, models

from hardy.errors import HardyError
from hardy.formats.chat import CHATML, GEMMA, render_chat
from hardy.formats.tokenizer import HardyTokenizer

transformers = pytest.importorskip("transformers")
TEMPLATES = sorted((Path(__file__).parent / "data" / "chat_templates").glob("*.jinja"))
SPECIAL = ["<s>", "</s>", "<unk>", "<pad>"]

CONVERSATIONS = {
    "user": [{"role": "user", "content": "What is the capital of France? "}],
    "system": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."}],
    "turns": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! Ünïcödé — 😀"},
              {"role": "user", "content": "Count to three.\n"}],
    "system_turns": [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"},
                     {"role": "assistant", "content": "Bonjour"}, {"role": "user", "content": "Bye"}],
}


@pytest.fixture(scope="module")
def tokenizers_pair():
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(SPECIAL + ["a"])}, merges=[]))
    backend.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL])
    ours = HardyTokenizer(backend=backend, bos_id=0, eos_id=1, unk_id=2, pad_id=3)
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                                  unk_token="<unk>", pad_token="<pad>")
    return ours, theirs


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: p.stem)
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_renders_as_transformers_does(tokenizers_pair, template, conversation, generation_prompt):
    ours, theirs = tokenizers_pair
    ours.chat_template = template.read_text()
    messages = CONVERSATIONS[conversation]
    try:
        expected = theirs.apply_chat_template(messages, chat_template=ours.chat_template, tokenize=False,
                                              add_generation_prompt=generation_prompt)
    except Exception as refused:  # the template's own raise_exception: hardy must refuse too
        with pytest.raises(HardyError, match="chat template"):
            ours.apply_chat_template(messages, add_generation_prompt=generation_prompt)
        assert str(refused)
        return
    assert ours.apply_chat_template(messages, add_generation_prompt=generation_prompt) == expected


@pytest.mark.parametrize("conversation", ["user", "turns"])
def test_built_in_gemma_turns_are_gemmas_own(conversation):
    official = (Path(__file__).parent / "data" / "chat_templates" / "google-gemma-2-2b-it.jinja").read_text()
    messages = CONVERSATIONS[conversation]
    assert render_chat(GEMMA, messages, bos_token="<bos>") == render_chat(official, messages, bos_token="<bos>")
    # Gemma 3 folds a system message into the first user turn (Gemma 2's template refuses one)
    with_system = render_chat(GEMMA, [{"role": "system", "content": "Be brief."}] + messages, bos_token="<bos>")
    assert with_system.startswith("<bos><start_of_turn>user\nBe brief.\n\n")


@pytest.mark.parametrize("conversation", ["system", "system_turns"])
def test_built_in_chatml_is_qwens_with_a_system_message(conversation):
    official = (Path(__file__).parent / "data" / "chat_templates" / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    messages = CONVERSATIONS[conversation]
    assert render_chat(CHATML, messages) == render_chat(official, messages)
