"""Chat templates: rendering a conversation to prompt text, and fallbacks for GGUFs without one.

Rendering matches transformers' `apply_chat_template`: a Jinja `ImmutableSandboxedEnvironment`
with trim_blocks/lstrip_blocks, loop controls, a `{% generation %}` tag, the `tojson` filter that
does not escape HTML (indent, separators, sort_keys), the `raise_exception` / `strftime_now` /
`dict` globals, a `namespace` that refuses underscore names, and the same context: `messages` (None-valued keys dropped, reasoning under all
its names), `tools` and `documents` (None when not given), `add_generation_prompt`. Any failure
of the template becomes a `RequestError` carrying its message. One step beyond transformers, as
llama.cpp's renderer does: `tojson` writes Jinja's lazy sequences (the output of `map`,
`select`, `reject`) as lists, so `tools | map(attribute='function') | tojson` (DeepSeek-R1's
template in llama.cpp) renders where transformers' json.dumps refuses a generator. Some GGUFs carry no
`tokenizer.chat_template` (the default Gemma 3 270M has none); `FALLBACK_TEMPLATES` supplies the
model family's official format by `general.architecture`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime
from functools import lru_cache
from typing import Any, ClassVar

import jinja2
import jinja2.meta
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvlab.errors import RequestError

# Gemma's official format: no system role, so a system message is folded into the first user
# turn ("<system>\n\n<user>"); the assistant is called "model"; turns end "<end_of_turn>\n".
GEMMA_TEMPLATE = """\
{{- bos_token -}}
{%- macro text_of(content) -%}
  {%- if content is string -%}{{ content | trim }}
  {%- else -%}
    {%- for part in content -%}
      {%- if part.type == "image" -%}<start_of_image>
      {%- elif part.type == "text" -%}{{ part.text | trim }}
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- set turns = messages -%}
{%- set system = "" -%}
{%- if messages and messages[0].role == "system" -%}
  {%- set c = messages[0].content -%}
  {%- set system = (c if c is string else c[0].text) + "\n\n" -%}
  {%- set turns = messages[1:] -%}
{%- endif -%}
{%- for message in turns -%}
  {%- if (message.role == "user") != (loop.index0 % 2 == 0) -%}
    {{- raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") -}}
  {%- endif -%}
  {{- "<start_of_turn>" + ("model" if message.role == "assistant" else message.role) + "\n" -}}
  {{- system if loop.first else "" -}}
  {{- text_of(message.content) -}}
  {{- "<end_of_turn>\n" -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- "<start_of_turn>model\n" -}}{%- endif -%}
"""

# ChatML, as Qwen 2/3 write it (Qwen adds a default system prompt only in some releases).
CHATML_TEMPLATE = """\
{%- for message in messages -%}
  {{- "<|im_start|>" + message.role + "\n" + message.content + "<|im_end|>\n" -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- "<|im_start|>assistant\n" -}}{%- endif -%}
"""

FALLBACK_TEMPLATES: dict[str, str] = {  # GGUF general.architecture -> chat template
    "gemma": GEMMA_TEMPLATE,
    "gemma2": GEMMA_TEMPLATE,
    "gemma3": GEMMA_TEMPLATE,
    "qwen2": CHATML_TEMPLATE,
    "qwen3": CHATML_TEMPLATE,
}


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks;
    for inference it renders its body unchanged."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys, default=_lazy_sequence)


def _lazy_sequence(value: Any) -> list:
    """A filter's lazy output (`map`, `select`, ... give generators) as the list it yields."""
    if isinstance(value, Iterator):
        return list(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, without the type itself (whose
    attributes would reach Python's internals)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _check_namespace_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"a chat template namespace cannot hold the underscore name {name!r}; rename it")


class _Namespace(jinja2.utils.Namespace):
    """Jinja's `namespace()`, refusing underscore names: the sandbox hides such attributes on
    every other object, and a namespace must not become a way around that."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # `self` may also be an attribute's name
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


@lru_cache(maxsize=16)
def compile_chat_template(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    env.globals["dict"] = _TemplateDict()
    return env.from_string(template)


@lru_cache(maxsize=16)
def template_variables(template: str) -> frozenset[str]:
    """The names a template reads from its context (`tools`, `enable_thinking`, ...)."""
    env = ImmutableSandboxedEnvironment(extensions=[_GenerationTag, loopcontrols])
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(template)))
    except jinja2.exceptions.TemplateError:
        return frozenset()


def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool = True,
                         continue_final_message: bool = False, **variables: Any) -> str:
    """Render `messages` (dicts with role/content) to prompt text.

    `variables` are extra template names: bos_token, eos_token, tools, documents,
    enable_thinking, ... Any template failure (bad syntax, a `raise_exception` such as roles not
    alternating, an expression the request's data breaks) becomes a `RequestError` carrying the
    template's message. `continue_final_message` ends the text where the last message's content
    ends (no end-of-turn), so the model continues it.
    """
    chat = [_template_message(m) for m in messages]
    continued = None
    if continue_final_message:
        continued = _continued_text(chat[-1] if chat else {})
        chat = [*chat[:-1], _tagged(chat[-1])]
    context = {"tools": None, "documents": None, **variables}
    try:
        text = compile_chat_template(template).render(
            messages=chat, add_generation_prompt=add_generation_prompt, **context)
    except jinja2.exceptions.TemplateError as e:
        raise RequestError(f"chat template failed: {e}") from None
    except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as e:
        # the template's own expressions failing on this request's data (a dict added to a str)
        raise RequestError(f"chat template failed: {type(e).__name__}: {e}") from None
    return text if continued is None else _cut_at_tag(text, continued)


# Names a message's reasoning comes under; templates read the first (gpt-oss reads "thinking").
_REASONING_NAMES = ("reasoning_content", "thinking", "reasoning")


def _template_message(message: dict) -> dict:
    """The message as templates see it: keys whose value is None dropped (templates test for
    presence), and its reasoning, under whichever name it came, under all the names read."""
    clean = {k: v for k, v in message.items() if v is not None}
    reasoning = next((clean[k] for k in _REASONING_NAMES if k in clean), None)
    if reasoning is None:
        return clean
    return {"thinking": reasoning, **clean, "reasoning_content": reasoning}


# As transformers continues a final message: its text gets this tag, the rendering is cut
# where the tag begins (and right-stripped if the template trimmed the text's end).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _continued_text(message: dict) -> str:
    """The text a continued final message ends with: its content, or its last text block."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    for block in reversed(content if isinstance(content, list) else []):
        if isinstance(block, dict) and isinstance(block.get("text"), str):
            return block["text"]
    raise RequestError("continue_final_message: the final message has no text to continue")


def _tagged(message: dict) -> dict:
    content = message["content"]
    if isinstance(content, str):
        return {**message, "content": content + _CONTINUE_TAG}
    k = max(i for i, b in enumerate(content) if isinstance(b, dict) and isinstance(b.get("text"), str))
    block = content[k]
    blocks = [*content[:k], {**block, "text": block["text"] + _CONTINUE_TAG}, *content[k + 1:]]
    return {**message, "content": blocks}


def _cut_at_tag(text: str, continued: str) -> str:
    at = text.rfind(_CONTINUE_TAG.strip())
    if at < 0 or continued.strip() not in text:
        raise RequestError("continue_final_message: the chat template does not write the final "
                           "message's content as given, so there is no text to continue")
    return text[:at] if text.startswith(_CONTINUE_TAG, at) else text[:at].rstrip()
