"""Required tool calls in each family's own format, end to end through `kvlab serve`.

Per family: a tiny random Llama-shaped model whose GGUF carries a real vocabulary from
llama.cpp's models folder (`KVLAB_LLAMA_VOCABS`; the vocabulary closest to the family's, or
Qwen2's byte-level one where the folder has none of its own), served by the real
`kvlab serve` with the family's real chat template (`--chat-template`). The official `openai`
client asks for a named tool; the grammar holds the random model to a call written in the
family's own format (`tool_grammars`), which the family's reader reads back: the call names
the tool with arguments valid against its schema, and streamed, the call's deltas
concatenate to the same arguments; through Responses and Anthropic Messages (the
`anthropic` client) the call is valid too, and streamed, the same as whole (greedy decoding with every prompt computed afresh, so both
requests write the same reply). `--reasoning-budget` ends a thinking template's block, which
a random model would not end itself.
A second request requires one of two tools, in parallel where the family can.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from test_server import start_server

from kvlab.weights.gguf_file import GGUFFile

import tiny_models

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
gguf = pytest.importorskip("gguf")

pytestmark = pytest.mark.slow

# format, template (llama.cpp's templates/), vocabulary (ggml-vocab-<name>.gguf)
FAMILIES = [
    ("qwen", "Qwen-Qwen2.5-7B-Instruct", "qwen2"),
    ("qwen3_coder", "Qwen3-Coder", "qwen35"),
    ("glm", "GLM-4.6", "qwen2"),
    ("kimi_k2", "moonshotai-Kimi-K2", "qwen2"),
    ("minimax_m2", "MiniMax-M2", "qwen2"),
    ("minimax_m1", "MiniMax-M1", "qwen2"),
    ("seed_oss", "ByteDance-Seed-OSS", "qwen2"),
    ("lfm2", "LFM2-8B-A1B", "qwen2"),
    ("granite", "ibm-granite-granite-3.3-2B-Instruct", "qwen2"),
    ("llama", "meta-llama-Llama-3.1-8B-Instruct", "llama-bpe"),
    ("functionary_v3_1", "meetkai-functionary-medium-v3.1", "llama-bpe"),
    ("functionary", "meetkai-functionary-medium-v3.2", "llama-bpe"),
    # Mistral Nemo's own vocabulary (Tekken) is byte-level BPE, as Qwen2's is; Mistral 7B's
    # is SentencePiece (Llama's), where a grammar's forced text must not take a space prefix
    ("mistral", "mistralai-Mistral-Nemo-Instruct-2407", "qwen2"),
    pytest.param("mistral", "mistralai-Mistral-Nemo-Instruct-2407", "llama-spm",
                 id="mistral-spm"),
    ("deepseek_r1", "llama-cpp-deepseek-r1", "deepseek-llm"),
    ("deepseek_v3_2", "deepseek-ai-DeepSeek-V3.2", "deepseek-llm"),
    ("gemma4", "google-gemma-4-31B-it", "gemma-4"),
    ("command_r", "CohereForAI-c4ai-command-r-plus-tool_use", "command-r"),
    ("command_r7b", "CohereForAI-c4ai-command-r7b-12-2024-tool_use", "command-r"),
]
CITIES = ["Paris", "Tokyo", "Lima"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city for some days",
    "parameters": {"type": "object", "required": ["city", "days"], "properties": {
        "city": {"type": "string", "enum": CITIES, "description": "The city"},
        "days": {"type": "integer", "minimum": 1, "maximum": 7,
                 "description": "How many days"}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "enum": CITIES, "description": "The city"}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris for three days?"}]


def _models_folder() -> Path | None:
    folder = os.environ.get("KVLAB_LLAMA_VOCABS")
    return Path(folder) if folder and (Path(folder) / "templates").is_dir() else None


@pytest.fixture(scope="module")
def folder() -> Path:
    found = _models_folder()
    if found is None:
        pytest.skip("set KVLAB_LLAMA_VOCABS to llama.cpp's models/ folder (its vocabularies "
                    "and templates/)")
    return found


def tiny_gguf(vocab: Path, out: Path) -> Path:
    """A tiny random Llama-shaped model with `vocab`'s tokenizer (every tokenizer.* key)."""
    import torch
    import transformers

    metadata = GGUFFile(vocab).metadata
    keys = {k: v for k, v in metadata.items() if k.startswith("tokenizer.")}
    torch.manual_seed(0)
    cfg = tiny_models.hf_config("llama", vocab_size=len(keys["tokenizer.ggml.tokens"]),
                                hidden_size=32, intermediate_size=48, num_attention_heads=2,
                                num_key_value_heads=1, num_hidden_layers=1,
                                max_position_embeddings=8192)
    model = transformers.LlamaForCausalLM(cfg).eval()

    def add_vocab(w, vocab_size: int) -> None:
        for key, value in keys.items():
            if isinstance(value, str):
                w.add_string(key, value)
            elif isinstance(value, bool):
                w.add_bool(key, value)
            elif isinstance(value, int):
                w.add_uint32(key, value)
            elif isinstance(value, float):
                w.add_float32(key, value)
            else:  # tokens, scores, token types, merges
                w.add_array(key, list(value))
    byte_tokenizer = tiny_models._add_byte_tokenizer
    tiny_models._add_byte_tokenizer = add_vocab  # the file's tokenizer is the real one
    try:
        tiny_models.write_gguf("llama", model, out)
    finally:
        tiny_models._add_byte_tokenizer = byte_tokenizer
    return out


@pytest.fixture(scope="module")
def models(folder: Path, tmp_path_factory) -> Callable[[str], Path]:
    """vocabulary name -> its tiny model, each built once, when first asked for."""
    built: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("tiny_vocab_models")

    def model(name: str) -> Path:
        if name not in built:
            built[name] = tiny_gguf(folder / f"ggml-vocab-{name}.gguf", root / f"{name}.gguf")
        return built[name]
    return model


def streamed_calls(client: openai.OpenAI, **request: object) -> list[tuple[str, str]]:
    calls: dict[int, list[str]] = {}
    for chunk in client.chat.completions.create(stream=True, **request):
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if d.function and d.function.name:
                calls[d.index] = [d.function.name, d.function.arguments or ""]
            elif d.function and d.function.arguments:
                calls[d.index][1] += d.function.arguments
    return [(n, a) for n, a in (calls[i] for i in sorted(calls))]


def other_apis(server, model: str) -> list[dict]:
    """The named call's arguments through Responses and Anthropic Messages, whole and
    streamed (each stream's argument fragments joined)."""
    client = server.client()
    flat = [{"type": "function", **t["function"]} for t in (WEATHER, TIME)]
    ask = {"model": model, "input": ASK[0]["content"], "tools": flat, "temperature": 0,
           "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 120}
    got = [json.loads(next(i.arguments for i in client.responses.create(**ask).output
                           if i.type == "function_call"))]
    pieces = [e.delta for e in client.responses.create(stream=True, **ask)
              if e.type == "response.function_call_arguments.delta"]
    got.append(json.loads("".join(pieces)))
    an = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
             for t in (WEATHER, TIME)]
    ask = {"model": model, "max_tokens": 120, "messages": ASK, "tools": tools,
           "tool_choice": {"type": "tool", "name": "get_weather"},
           "extra_body": {"temperature": 0}}  # this client sends sampling only as extra_body
    got.append(next(b.input for b in an.messages.create(**ask).content if b.type == "tool_use"))
    with an.messages.stream(**ask) as stream:
        pieces = [e.delta.partial_json for e in stream if e.type == "content_block_delta"
                  and e.delta.type == "input_json_delta"]
    got.append(json.loads("".join(pieces)))
    return got


def check_call(name: str, arguments: str) -> None:
    args = json.loads(arguments)
    if name == "get_weather":
        assert set(args) == {"city", "days"} and args["city"] in CITIES
        assert isinstance(args["days"], int) and 1 <= args["days"] <= 7
    else:
        assert name == "get_time" and args["city"] in CITIES and set(args) == {"city"}


@pytest.mark.parametrize("form, template, vocab", FAMILIES,
                         ids=[getattr(f, "id", None) or (f.values if hasattr(f, "values") else f)[0]
                              for f in FAMILIES])
def test_a_required_call_in_the_familys_format(form, template, vocab, folder, models,
                                               tmp_path) -> None:
    with start_server(tmp_path / "serve.log", "--model", str(models(vocab)),
                      "--chat-template", str(folder / "templates" / f"{template}.jinja"),
                      "--reasoning-budget", "4", "--max-model-len", "8192",
                      "--max-num-seqs", "2", "--no-prefix-caching") as server:
        client = server.client()
        model = client.models.list().data[0].id
        base = {"model": model, "messages": ASK, "temperature": 0, "max_tokens": 120}
        named = {**base, "tools": [WEATHER, TIME],
                 "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
        r = client.chat.completions.create(**named)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        whole = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert len(whole) == 1 and whole[0][0] == "get_weather"
        check_call(*whole[0])
        assert streamed_calls(client, **named) == whole
        responses, streamed_responses, messages, streamed_messages = other_apis(server, model)
        assert responses == streamed_responses and messages == streamed_messages
        for args in (responses, messages):  # a thinking template's switch may differ by API
            check_call("get_weather", json.dumps(args))
        required = {**base, "tools": [WEATHER, TIME], "tool_choice": "required"}
        r = client.chat.completions.create(**required)
        calls = [(c.function.name, c.function.arguments)
                 for c in r.choices[0].message.tool_calls or []]
        assert 1 <= len(calls) <= 2 and r.choices[0].finish_reason == "tool_calls"
        for call in calls:
            check_call(*call)
        assert streamed_calls(client, **required) == calls
