"""Chat templates: kvlab's rendering equals transformers' apply_chat_template; the Gemma fallback."""

from __future__ import annotations

import json

import jinja2
import pytest
from test_tokenizer_bpe import LLAMA3_REGEX, _train
from test_tokenizer_gemma import default_tokenizer

from kvlab.errors import RequestError
from kvlab.tokenizer import load_hf_tokenizer
from kvlab.tokenizer.chat import GEMMA_TEMPLATE, render_chat_template

CHATML_DEFAULT_SYSTEM = """\
{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'system' and loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Whitespace here depends on trim_blocks/lstrip_blocks; also bos_token, tojson, strftime_now,
# loop controls, namespace and the generation tag.
LLAMA3_STYLE = """\
{{ bos_token }}
{% set ns = namespace(n=0) %}
{% if tools is defined and tools %}
    <|start_header_id|>system<|end_header_id|>

    Date: {{ strftime_now("%Y") | length }} digits
    {% for t in tools %}
        {{ t | tojson(indent=2) }}
    {% endfor %}<|eot_id|>
{% endif %}
{% for message in messages %}
    {% if message.role == 'stop' %}{% break %}{% endif %}
    {% set ns.n = ns.n + 1 %}
    <|start_header_id|>{{ message['role'] }}<|end_header_id|>

{% if message.role == 'assistant' %}{% generation %}{{ message['content'] | trim }}{% endgeneration %}
{% else %}{{ message['content'] | trim }}{% endif %}<|eot_id|>
{% endfor %}
{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}{{ ns.n }}
"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": " 4 "}, {"role": "user", "content": "<html> & \"q\""}],
    [{"role": "user", "content": "日本語 😀"}, {"role": "assistant", "content": "ok", "x": None},
     {"role": "stop", "content": "never shown"}, {"role": "user", "content": "after"}],
]
TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "Now <UTC> & co",
                                            "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module", params=["chatml", "llama3"])
def hf_pair(request, tmp_path_factory):
    """(kvlab tokenizer, transformers tokenizer) for one directory and template."""
    from transformers import AutoTokenizer
    template = CHATML_DEFAULT_SYSTEM if request.param == "chatml" else LLAMA3_STYLE
    path = tmp_path_factory.mktemp(request.param)
    _train(LLAMA3_REGEX, True).save(str(path / "tokenizer.json"))
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
              "chat_template": template, "tokenizer_class": "PreTrainedTokenizerFast"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return load_hf_tokenizer(path), AutoTokenizer.from_pretrained(str(path))


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rendering_equals_transformers(hf_pair, conversation, add_generation_prompt):
    tok, ref = hf_pair
    for extra in ({}, {"tools": TOOLS}):
        expected = ref.apply_chat_template(conversation, tokenize=False,
                                           add_generation_prompt=add_generation_prompt, **extra)
        assert tok.apply_chat_template(conversation, add_generation_prompt, **extra) == expected


@pytest.mark.parametrize("final", ["Sure, here", " padded answer \n", ""])
def test_continue_final_message_equals_transformers(hf_pair, final):
    tok, ref = hf_pair
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": final}]
    expected = ref.apply_chat_template(conversation, tokenize=False, add_generation_prompt=False,
                                       continue_final_message=True)
    assert tok.apply_chat_template(conversation, False, continue_final_message=True) == expected


def test_continue_final_message_needs_its_text_in_the_prompt():
    template = "{% for m in messages %}{{ m.role }}{% endfor %}"  # writes no content
    with pytest.raises(RequestError, match="continue_final_message"):
        render_chat_template(template, [{"role": "user", "content": "gone"}],
                             add_generation_prompt=False, continue_final_message=True)


GEMMA_CHAT = [{"role": "system", "content": "You are terse."},
              {"role": "user", "content": "  Hi  "},
              {"role": "assistant", "content": "Hello!"},
              {"role": "user", "content": [{"type": "text", "text": "Bye"}]}]
GEMMA_PROMPT = ("<bos><start_of_turn>user\nYou are terse.\n\nHi<end_of_turn>\n"
                "<start_of_turn>model\nHello!<end_of_turn>\n"
                "<start_of_turn>user\nBye<end_of_turn>\n"
                "<start_of_turn>model\n")


@pytest.fixture(scope="module")
def gemma():
    return default_tokenizer()


def test_gemma_fallback_format(gemma):
    assert gemma.apply_chat_template(GEMMA_CHAT) == GEMMA_PROMPT
    no_prompt = gemma.apply_chat_template(GEMMA_CHAT, add_generation_prompt=False)
    assert no_prompt == GEMMA_PROMPT.removesuffix("<start_of_turn>model\n")
    assert gemma.apply_chat_template([{"role": "user", "content": "x"}]) == \
        "<bos><start_of_turn>user\nx<end_of_turn>\n<start_of_turn>model\n"


def test_gemma_fallback_renders_like_the_official_template():
    """The official Gemma 3 template (tokenizer_config.json of the -it models), via transformers."""
    from transformers.utils.chat_template_utils import render_jinja_template
    official = (
        "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n"
        "{%- if messages[0]['content'] is string -%}\n"
        "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n{%- else -%}\n"
        "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
        "{%- endif -%}\n{%- set loop_messages = messages[1:] -%}\n{%- else -%}\n"
        "{%- set first_user_prefix = \"\" -%}\n{%- set loop_messages = messages -%}\n{%- endif -%}\n"
        "{%- for message in loop_messages -%}\n"
        "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
        "{{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
        "{%- endif -%}\n{%- if (message['role'] == 'assistant') -%}\n{%- set role = \"model\" -%}\n"
        "{%- else -%}\n{%- set role = message['role'] -%}\n{%- endif -%}\n"
        "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
        "{%- if message['content'] is string -%}\n{{ message['content'] | trim }}\n"
        "{%- elif message['content'] is iterable -%}\n{%- for item in message['content'] -%}\n"
        "{%- if item['type'] == 'image' -%}\n{{ '<start_of_image>' }}\n"
        "{%- elif item['type'] == 'text' -%}\n{{ item['text'] | trim }}\n{%- endif -%}\n"
        "{%- endfor -%}\n{%- else -%}\n{{ raise_exception(\"Invalid content type\") }}\n"
        "{%- endif -%}\n{{ '<end_of_turn>\n' }}\n{%- endfor -%}\n"
        "{%- if add_generation_prompt -%}\n{{'<start_of_turn>model\n'}}\n{%- endif -%}\n")
    multimodal = [{"role": "system", "content": [{"type": "text", "text": "Sys "}]},
                  {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " a "}]}]
    for chat in (GEMMA_CHAT, multimodal, GEMMA_CHAT[1:3]):
        for gen in (True, False):
            (expected,), _ = render_jinja_template([chat], chat_template=official,
                                                   add_generation_prompt=gen, bos_token="<bos>")
            assert render_chat_template(GEMMA_TEMPLATE, chat, gen, bos_token="<bos>") == expected


def test_encode_chat_has_one_bos(gemma):
    ids = gemma.encode_chat([{"role": "user", "content": "hi"}])
    assert ids == [2, 105, 2364, 107, 2202, 106, 107, 105, 4368, 107]
    assert gemma.decode(ids, skip_special_tokens=False) == \
        "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"


def test_roles_must_alternate_is_a_request_error(gemma):
    with pytest.raises(RequestError, match="alternate"):
        gemma.apply_chat_template([{"role": "assistant", "content": "first"}])


def test_template_syntax_error_is_a_request_error():
    with pytest.raises(RequestError, match="chat template"):
        render_chat_template("{% for %}", [{"role": "user", "content": "x"}])


def test_sandbox_blocks_unsafe_attribute_access():
    with pytest.raises(RequestError, match="unsafe"):
        render_chat_template("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}",
                             [{"role": "user", "content": "x"}])


# What the context holds and how failures surface, each against transformers' renderer.
CONTEXT_PROBES = [
    "{{ tools is none }} {{ documents is none }} {{ tools is defined }}",
    "{% for m in messages %}{{ m.thinking }}|{{ m.reasoning_content }}|{{ m|length }};{% endfor %}",
    "{% set ns = namespace(n=1) %}{% set ns.n = ns.n + 1 %}{{ ns.n }}",
    "{% set ns = namespace(_n=1) %}{{ ns._n }}",
    "{% set ns = namespace(n=1) %}{% set ns._n = 2 %}{{ ns.n }}",
    "{{ messages[0].content + messages[0] }}",
    "{{ dict.fromkeys(['a'], 1) | tojson(indent=1, sort_keys=True, separators=(',', ':')) }}",
]
REASONING_CHAT = [{"role": "user", "content": "x"},
                  {"role": "assistant", "content": "y", "reasoning": "because"},
                  {"role": "assistant", "content": "z", "thinking": "t", "reasoning_content": "r"}]


@pytest.mark.parametrize("template", CONTEXT_PROBES)
def test_context_and_failures_equal_transformers(template):
    from transformers.utils.chat_template_utils import render_jinja_template
    try:
        (expected,), _ = render_jinja_template([REASONING_CHAT], chat_template=template)
    except Exception as e:  # noqa: BLE001 - the same failure must reach kvlab's caller
        with pytest.raises(RequestError) as got:
            render_chat_template(template, REASONING_CHAT)
        # the template's own message; the sandbox's refusals are worded apart, naming the same
        refused = isinstance(e, jinja2.exceptions.SecurityError) and "'_n'" in str(got.value)
        assert refused or str(e) in str(got.value)
    else:
        assert render_chat_template(template, REASONING_CHAT, False) == expected
