"""Real models' chat templates (llama.cpp's collection) render as transformers renders them.

Each template in `$KVLAB_LLAMA_VOCABS/templates` renders a few conversations through kvlab's
`render_chat_template` and through transformers' `apply_chat_template(tokenize=False)` on a
tokenizer holding that template: the texts are equal, or both fail and kvlab's `RequestError`
carries the message transformers raised (roles not alternating, a variable the template
needs, ...). The clock is pinned on both sides, so templates that print today's date agree.
Where a template hands `tojson` a filter's lazy output (`tools | map(attribute='function') |
tojson`, llama.cpp's DeepSeek-R1 template), which transformers' json.dumps refuses and kvlab
writes as a list, transformers renders the same template with that output made a list first.
"""

from __future__ import annotations

import copy
import datetime
import os
import re
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from unittest import mock

import pytest

from kvlab.errors import RequestError
from kvlab.tokenizer import chat


def _templates() -> list[Path]:
    folder = os.environ.get("KVLAB_LLAMA_VOCABS")
    found = (Path(folder) / "templates") if folder else None
    return sorted(found.glob("*.jinja")) if found and found.is_dir() else []


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string", "description": "The city"}}}}}]

# Mistral's templates refuse tool-call ids that are not 9 alphanumeric characters (Mistral's
# own id format), so the conversation uses one such id, which every other template accepts.
CALL_ID = "call12345"


def tool_call(call_id: str = CALL_ID, arguments: dict | str | None = None) -> list[dict]:
    """A call (arguments as an object, as transformers passes them, or as OpenAI's JSON text)
    and its result."""
    fn = {"name": "get_weather", "arguments": arguments or {"city": "Paris"}}
    return [{"role": "assistant", "content": "",
             "tool_calls": [{"id": call_id, "type": "function", "function": fn}]},
            {"role": "tool", "tool_call_id": call_id, "name": "get_weather",
             "content": "Sunny, 21 C"}]


def parallel_calls() -> list[dict]:
    """Two calls in one turn, both results, then the answer and the next question."""
    ids, cities = ("call12345", "call67890"), ("Paris", "Rome")
    calls = [{"id": i, "type": "function",
              "function": {"name": "get_weather", "arguments": {"city": c}}}
             for i, c in zip(ids, cities, strict=True)]
    results = [{"role": "tool", "tool_call_id": i, "name": "get_weather", "content": w}
               for i, w in zip(ids, ("Sunny", "Rain"), strict=True)]
    return [{"role": "system", "content": "Use the tools."},
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"role": "assistant", "content": "Checking both.", "tool_calls": calls}, *results,
            {"role": "assistant", "content": "Paris is sunny, Rome rainy."},
            {"role": "user", "content": "Thanks!"}]


ASK = {"role": "user", "content": "What is the weather in Paris?"}
FIRST = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
THEN = {"role": "user", "content": "And 3+3?"}
COUNT = {"role": "user", "content": "Count to three."}

# kind -> (messages, apply_chat_template arguments)
CONVERSATIONS: dict[str, tuple[list[dict], dict]] = {
    "system_user": ([{"role": "system", "content": "You are terse."},
                     {"role": "user", "content": "Hi there!"}],
                    {"add_generation_prompt": True}),
    "multi_turn": ([*FIRST, THEN], {"add_generation_prompt": True}),
    "tools": ([ASK], {"tools": TOOLS, "add_generation_prompt": True}),
    "tool_call": ([ASK, *tool_call()], {"tools": TOOLS, "add_generation_prompt": True}),
    "continue_final": ([COUNT, {"role": "assistant", "content": "One, two"}],
                       {"continue_final_message": True, "add_generation_prompt": False}),
    # The same in other shapes a request may take: arguments as JSON text, an id that is not
    # Mistral's (its templates refuse it, and kvlab must carry that message), content blocks.
    "tool_call_json_arguments": ([ASK, *tool_call(arguments='{"city": "Paris"}')],
                                 {"tools": TOOLS, "add_generation_prompt": True}),
    "tool_call_other_id": ([ASK, *tool_call(call_id="call_0")],
                           {"tools": TOOLS, "add_generation_prompt": True}),
    "parallel_tool_calls": (parallel_calls(), {"tools": TOOLS, "add_generation_prompt": True}),
    # Text and a tool description beyond ASCII: tojson must not escape them, nor HTML.
    "unicode": ([{"role": "user", "content": "日本語 😀 <b>&</b>"}],
                {"tools": [{"type": "function", "function": {
                    "name": "lookup", "description": "Résumé, 中文 & <tags>",
                    "parameters": {"type": "object", "properties": {}}}}],
                 "add_generation_prompt": True}),
    "content_blocks": ([{"role": "system", "content": [{"type": "text", "text": "Be terse."}]},
                        {"role": "user", "content": [{"type": "text", "text": "Hi there!"}]}],
                       {"add_generation_prompt": True}),
    "continue_final_blocks": ([COUNT, {"role": "assistant",
                                       "content": [{"type": "text", "text": "One, two"}]}],
                              {"continue_final_message": True, "add_generation_prompt": False}),
    # A past turn's reasoning, under the standard name and under an older one.
    "reasoning": ([FIRST[0], {**FIRST[1], "reasoning_content": "Two and two make four."}, THEN],
                  {"add_generation_prompt": True}),
    "reasoning_alias": ([FIRST[0], {**FIRST[1], "reasoning": "Two and two make four."}, THEN],
                        {"add_generation_prompt": True}),
    "documents": ([{"role": "user", "content": "When is lunch?"}],
                  {"documents": [{"title": "Memo", "text": "Lunch is at noon."}],
                   "add_generation_prompt": True}),
}

# (a marker the template writes, its BOS, its EOS); a template's bos_token/eos_token as the
# model's tokenizer would give them; other templates get "<s>" / "</s>".
FAMILY_TOKENS = [
    ("<|start_header_id|>", "<|begin_of_text|>", "<|eot_id|>"),
    ("<｜Assistant｜>", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    ("<start_of_turn>", "<bos>", "<eos>"),
    ("<|turn>", "<bos>", "<eos>"),
    ("<|im_start|>", None, "<|im_end|>"),
]


def special_tokens(template: str) -> dict[str, str]:
    bos, eos = next(((b, e) for mark, b, e in FAMILY_TOKENS if mark in template), ("<s>", "</s>"))
    return {k: v for k, v in (("bos_token", bos), ("eos_token", eos)) if v is not None}


@lru_cache(maxsize=4)
def reference_tokenizer(template: str):
    """A transformers tokenizer with this chat template (a one-word vocabulary: only the
    template and the special tokens matter when nothing is tokenized)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast
    vocab = Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=vocab, chat_template=template,
                                   **special_tokens(template))


class PinnedClock(datetime.datetime):
    @classmethod
    def now(cls, tz: datetime.tzinfo | None = None) -> PinnedClock:
        return cls(2026, 3, 14, 9, 26, 53, tzinfo=tz)


@contextmanager
def clock_pinned() -> Iterator[None]:
    """`strftime_now` reads PinnedClock's date in both renderers."""
    from transformers.utils import chat_template_utils
    with (mock.patch.object(chat_template_utils, "datetime", PinnedClock),
          mock.patch.object(chat, "datetime", PinnedClock)):
        yield


@pytest.fixture
def pinned_clock():
    with clock_pinned():
        yield


def outcome(expected: str | Exception, got: str | Exception) -> str:
    """"same text", "same error" (kvlab's RequestError carries transformers' message) or
    "differ"."""
    if not isinstance(expected, Exception):
        return "same text" if got == expected else "differ"
    if not isinstance(got, RequestError):
        return "differ"
    # transformers' own check that the continued text made it into the prompt words its
    # refusal differently; every other failure is the template's, message and all
    own = str(expected).startswith("continue_final_message")
    return "same error" if ("continue_final_message" if own else str(expected)) in str(got) \
        else "differ"


# a filter's lazy output piped into tojson, and the same with that output made a list
_LAZY_TOJSON = re.compile(r"(\|\s*(?:map|select|reject|selectattr|rejectattr)\([^()]*\)\s*)"
                          r"(\|\s*tojson)")


def render_both(template: str, kind: str) -> tuple[str | Exception, str | Exception]:
    messages, arguments = CONVERSATIONS[kind]
    listed = _LAZY_TOJSON.sub(r"\1| list \2", template)
    try:
        expected = reference_tokenizer(listed).apply_chat_template(
            copy.deepcopy(messages), tokenize=False, **arguments)
    except Exception as e:  # noqa: BLE001 - any failure is compared with kvlab's
        expected = e
    try:
        got = chat.render_chat_template(template, copy.deepcopy(messages),
                                        **special_tokens(template), **arguments)
    except RequestError as e:
        got = e
    return expected, got


@pytest.mark.skipif(not _templates(), reason="set KVLAB_LLAMA_VOCABS to llama.cpp's models/ "
                                             "folder (`make test` fetches it): its templates/ "
                                             "holds the chat templates")
@pytest.mark.parametrize("kind", CONVERSATIONS)
@pytest.mark.parametrize("path", _templates(), ids=lambda p: p.stem)
def test_template_renders_as_transformers(pinned_clock, path, kind):
    expected, got = render_both(path.read_text(encoding="utf-8"), kind)
    if not isinstance(expected, Exception):
        assert got == expected
    assert outcome(expected, got) != "differ", f"transformers: {expected!r}\nkvlab: {got!r}"


def main() -> None:
    """Print, per conversation kind, how many templates render the same text, fail the same
    way, or differ (and which)."""
    templates = _templates()
    print(f"{len(templates)} templates")
    with clock_pinned():
        for kind in CONVERSATIONS:
            seen = {p.stem: outcome(*render_both(p.read_text(encoding="utf-8"), kind))
                    for p in templates}
            counts = Counter(seen.values())
            differ = [name for name, o in seen.items() if o == "differ"]
            print(f"{kind:26} same text {counts['same text']:3}  same error "
                  f"{counts['same error']:3}  differ {counts['differ']:3}  {' '.join(differ)}")


if __name__ == "__main__":
    main()
