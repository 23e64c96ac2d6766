"""Chat templates: the model file's own Jinja template rendered the way `transformers` renders it
(`apply_chat_template`: a sandboxed environment with trim_blocks and lstrip_blocks, loop controls, a
`tojson` that keeps non-ASCII text, `raise_exception`, `strftime_now`, the special tokens by name), so
the same messages give the same prompt text in both.

A file without a template (base models: the Gemma 3 270M GGUF has none) can use a built-in one for the
turn format its vocabulary shows, as llama.cpp falls back to its built-in formats; `--chat-template
FILE` gives any other. Which one is used is said once on stderr.
"""
from __future__ import annotations

import json
import sys
from datetime import datetime

from jinja2 import TemplateError, TemplateSyntaxError, ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from hardy.errors import HardyError


def _raise_exception(message):
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    return env


def check_template(text: str, where: str) -> None:
    """A template that does not parse is refused up front, with its line."""
    try:
        environment().parse(text)
    except TemplateSyntaxError as e:
        raise HardyError(f"{where}: line {e.lineno}: {e.message}") from None


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool = True, **variables) -> str:
    """The prompt text for `messages` (variables: bos_token, eos_token ..., tools, as transformers passes)."""
    try:
        return environment().from_string(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            **{"tools": None, "documents": None, **variables})
    except TemplateSyntaxError as e:
        raise HardyError(f"chat template: line {e.lineno}: {e.message}") from None
    except TemplateError as e:  # raise_exception() in the template: the messages do not fit it
        raise HardyError(f"chat template: {e}") from None


# Built-in turn formats, by a special token the vocabulary has (hardy's own templates, written from
# each format's documented layout).
GEMMA = (
    "{{ bos_token }}"
    "{% set ns = namespace(prefix='') %}"
    "{% if messages and messages[0]['role'] == 'system' %}{% set ns.prefix = messages[0]['content'] + '\n\n' %}"
    "{% set messages = messages[1:] %}{% endif %}"
    "{% for m in messages %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Gemma turns must alternate user / assistant') }}{% endif %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ ns.prefix if loop.first else '' }}{{ m['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for m in messages %}{% if m['role'] == 'system' %}{% set ns.system = m['content'] + '\n\n' %}"
    "{% elif m['role'] == 'user' %}[INST] {{ ns.system }}{{ m['content'] }}[/INST]{% set ns.system = '' %}"
    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
BUILT_IN = (("<start_of_turn>", "gemma", GEMMA), ("<|im_start|>", "chatml", CHATML),
            ("<|start_header_id|>", "llama3", LLAMA3), ("[INST]", "mistral", MISTRAL))


def built_in_template(tokenizer) -> tuple[str, str] | None:
    """(name, template) of the built-in turn format the vocabulary's special tokens show, or None."""
    for token, name, template in BUILT_IN:
        if tokenizer.backend.token_to_id(token) is not None:
            return name, template
    return None


def use_chat_template(tokenizer, path: str | None = None, required: bool = True) -> None:
    """Before chat prompts: `path` (--chat-template) replaces the file's template; a file without one
    gets the built-in format for its vocabulary, said on stderr; neither is a one-line error where
    `required` (generate --chat), and no chat where not (serve: completions still work)."""
    if path is not None:
        tokenizer.chat_template = read_template_file(path)
        return
    if tokenizer.chat_template:
        return
    found = built_in_template(tokenizer)
    if found is None:
        if not required:
            return
        raise HardyError("this model has no chat template and its vocabulary shows no known turn format; "
                         "give one with --chat-template FILE")
    name, tokenizer.chat_template = found
    print(f"hardy: the model file has no chat template; using hardy's built-in {name} format", file=sys.stderr)


def read_template_file(path: str) -> str:
    """A chat template file, refused up front (exit 2) when unreadable, empty or not valid Jinja."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise HardyError(f"--chat-template {path}: cannot read it ({e})") from None
    if not text.strip():
        raise HardyError(f"--chat-template {path}: the file is empty")
    check_template(text, f"--chat-template {path}")
    return text
