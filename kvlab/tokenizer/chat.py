"""Chat templates: rendering a conversation to prompt text, and fallbacks for GGUFs without one.

Rendering matches transformers' `apply_chat_template`: a Jinja `ImmutableSandboxedEnvironment`
with trim_blocks/lstrip_blocks, loop controls, a `{% generation %}` tag, the `tojson` filter that
does not escape HTML, and the `raise_exception` / `strftime_now` globals. Some GGUFs carry no
`tokenizer.chat_template` (the default Gemma 3 270M has none); `FALLBACK_TEMPLATES` supplies the
model family's official format by `general.architecture`.
"""

from __future__ import annotations

import json
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
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_chat_template(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
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

    `variables` are extra template names: bos_token, eos_token, tools, enable_thinking, ...
    A template error (bad syntax, a `raise_exception` such as roles not alternating) becomes
    a `RequestError` carrying the template's message. `continue_final_message` ends the text
    where the last message's content ends (no end-of-turn), so the model continues it.
    """
    # As transformers does: keys whose value is None are dropped, templates test for presence.
    clean = [{k: v for k, v in m.items() if v is not None} for m in messages]
    if continue_final_message:
        clean = [*clean[:-1], _tagged(clean[-1] if clean else {})]
    try:
        text = compile_chat_template(template).render(
            messages=clean, add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.exceptions.TemplateError as e:
        raise RequestError(f"chat template failed: {e}") from None
    return _cut_at_tag(text) if continue_final_message else text


# As transformers continues a final message: its text gets this tag, the rendering is cut
# where the tag begins (and right-stripped if the template trimmed the text's end).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tagged(message: dict) -> dict:
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": content + _CONTINUE_TAG}
    if isinstance(content, list):
        for k in reversed(range(len(content))):
            block = content[k]
            if isinstance(block, dict) and isinstance(block.get("text"), str):
                blocks = [*content[:k], {**block, "text": block["text"] + _CONTINUE_TAG},
                          *content[k + 1:]]
                return {**message, "content": blocks}
    raise RequestError("continue_final_message: the final message has no text to continue")


def _cut_at_tag(text: str) -> str:
    at = text.rfind(_CONTINUE_TAG.strip())
    if at < 0:
        raise RequestError("continue_final_message: the chat template does not write the final "
                           "message's content, so there is no text to continue")
    return text[:at] if text.startswith(_CONTINUE_TAG, at) else text[:at].rstrip()
