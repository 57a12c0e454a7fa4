"""Fill-in-the-middle: FIM tokens found in GGUF metadata and Hugging Face tokenizers, the
prompt's exact layout and cut, and /infill and /v1/completions `suffix` end to end on a tiny
random Qwen2 whose tokenizer has Qwen2.5-Coder's FIM tokens (the official openai client for
the completions route); the default model, which has none, is refused with a 400."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
import torch
from test_tokenizer_gemma import default_tokenizer
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from kvlab.engine import Engine, EngineConfig
from kvlab.server.apis import front_ends
from kvlab.server.core.app import create_app
from kvlab.server.core.async_engine import AsyncEngine
from kvlab.server.core.errors import ApiError
from kvlab.server.core.infill import (
    FimChunk,
    fim_layout,
    infill_prompt,
    repo_context,
    split_window,
)
from kvlab.server.core.serving import Serving
from kvlab.tokenizer import load_gguf_tokenizer, load_hf_tokenizer
from kvlab.tokenizer.bpe import byte_to_unicode
from kvlab.tokenizer.fim import FimTokens
from kvlab.weights.gguf_file import GGUFFile

from fake_engine import FakeEngine
from tiny_models import hf_config

QWEN_SPECIALS = ["<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
                 "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]
BYTES = 256  # the byte-level vocabulary comes first: a character's id is its byte
EOT, PRE, MID, SUF, PAD, REPO, SEP = range(BYTES, BYTES + len(QWEN_SPECIALS))
QWEN_FIM = FimTokens(prefix=PRE, suffix=SUF, middle=MID, pad=PAD, repo=REPO, file_sep=SEP)


def byte_ids(text: str) -> list[int]:
    """The merge-free byte-level vocabulary's ids of `text`."""
    return list(text.encode())


# ---- FIM tokens --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    """A byte-level tokenizer with Qwen2.5-Coder's special tokens, saved by transformers."""
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in byte_to_unicode().items()}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(QWEN_SPECIALS)
    path = tmp_path_factory.mktemp("qwen_coder")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def qwen_tok(qwen_dir):
    return load_hf_tokenizer(qwen_dir)


def test_hf_tokenizer_fim_tokens_by_text(qwen_tok) -> None:
    assert qwen_tok.fim == QWEN_FIM
    assert qwen_tok.encode("ab") == byte_ids("ab")
    # the pad, repo and file-separator markers end a middle, as llama.cpp counts them
    assert {EOT, PAD, REPO, SEP} <= set(qwen_tok.eos_ids) and PRE not in qwen_tok.eos_ids


def write_gguf(path, extra_tokens: list[str], keys: dict[str, int]) -> None:
    import gguf

    tokens = [chr(c) for c in range(33, 127)] + ["\u0120", "\u010a"] + extra_tokens
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "default")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", [1] * 96 + [3] * len(extra_tokens))
    w.add_array("tokenizer.ggml.merges", ["! !"])
    w.add_uint32("tokenizer.ggml.eos_token_id", 96)
    for key, value in keys.items():
        w.add_uint32(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gguf_tokenizer(tmp_path, extra_tokens: list[str], keys: dict[str, int]):
    path = tmp_path / "tok.gguf"
    write_gguf(path, extra_tokens, keys)
    return load_gguf_tokenizer(GGUFFile(path).metadata)


def test_gguf_fim_keys(tmp_path) -> None:
    # keys name the ids, whatever their text
    names = ["<eos>", "<a>", "<b>", "<c>", "<d>", "<e>", "<f>"]
    keys = {f"tokenizer.ggml.fim_{k}_token_id": 97 + i
            for i, k in enumerate(["pre", "suf", "mid", "pad", "rep", "sep"])}
    tok = gguf_tokenizer(tmp_path, names, keys)
    assert tok.fim == FimTokens(prefix=97, suffix=98, middle=99, pad=100, repo=101,
                                file_sep=102)
    assert {100, 101, 102} <= set(tok.eos_ids)
    assert tok.encode("x<a>y") == [ord("x") - 33, 97, ord("y") - 33]


def test_gguf_older_keys_and_text_fallback(tmp_path) -> None:
    old = {"tokenizer.ggml.prefix_token_id": 97, "tokenizer.ggml.suffix_token_id": 98,
           "tokenizer.ggml.middle_token_id": 99}
    tok = gguf_tokenizer(tmp_path, ["<eos>", "<1>", "<2>", "<3>"], old)
    assert tok.fim == FimTokens(97, 98, 99)
    # no keys: StarCoder's texts, found as llama.cpp's loader finds them
    tok = gguf_tokenizer(tmp_path, ["<eos>", "<fim_middle>", "<fim_prefix>", "<fim_suffix>",
                                    "<fim_pad>"], {})
    assert tok.fim == FimTokens(prefix=98, suffix=99, middle=97, pad=100)
    # CodeLlama's and DeepSeek-Coder's spellings
    tok = gguf_tokenizer(tmp_path, ["<eos>", "▁<PRE>", "▁<SUF>", "▁<MID>"], {})
    assert tok.fim == FimTokens(97, 98, 99)
    tok = gguf_tokenizer(tmp_path, ["<eos>", "<｜fim▁begin｜>", "<｜fim▁hole｜>",
                                    "<｜fim▁end｜>"], {})
    assert tok.fim == FimTokens(97, 98, 99)


def test_no_fim_tokens(tmp_path) -> None:
    # two of the three markers are not enough; a key outside the vocabulary is no id
    tok = gguf_tokenizer(tmp_path, ["<eos>", "<|fim_prefix|>", "<|fim_suffix|>"],
                         {"tokenizer.ggml.fim_mid_token_id": 5000})
    assert tok.fim is None
    assert default_tokenizer().fim is None


# ---- the prompt --------------------------------------------------------------------------


def test_split_window() -> None:
    assert split_window(100, 30, 20) == (30, 20)  # both fit
    assert split_window(8, 20, 20) == (6, 2)  # 3:1
    assert split_window(8, 20, 1) == (7, 1)  # a short suffix leaves its share to the prefix
    assert split_window(8, 3, 20) == (3, 5)  # and a short prefix to the suffix
    assert split_window(1, 5, 5) == (1, 0)
    assert split_window(0, 5, 5) == (0, 0)


def test_layout_order_and_cut() -> None:
    fim = FimTokens(prefix=-1, suffix=-2, middle=-3)
    prefix, suffix, prompt, repo = [1, 2, 3, 4, 5, 6, 7, 8], [11, 12, 13, 14], [21], [31, 32]
    whole = fim_layout(fim, [0], prefix, suffix, prompt, repo, budget=100)
    assert whole.ids == [0, 31, 32, -1, *prefix, 21, -2, *suffix, -3] and not whole.truncated
    # 12 ids: BOS, 3 markers, the prompt, leaving 7 for prefix and suffix (6:1, the suffix's
    # quarter rounded down), none for the repo context; the prefix keeps its end, the suffix
    # its start
    cut = fim_layout(fim, [0], prefix, suffix, prompt, repo, budget=12)
    assert cut.ids == [0, -1, 3, 4, 5, 6, 7, 8, 21, -2, 11, -3] and cut.truncated
    # the repo context fills what prefix and suffix leave, its end kept
    some = fim_layout(fim, [], [1], [2], [], [31, 32, 33], budget=7)
    assert some.ids == [32, 33, -1, 1, -2, 2, -3] and some.truncated
    with pytest.raises(ApiError, match="needs at least 5 tokens"):
        fim_layout(fim, [0], prefix, suffix, prompt, repo, budget=4)


def serving_on(tok, max_model_len: int = 4096) -> Serving:
    engine = FakeEngine(model_name="coder.gguf", tokenizer=tok, max_model_len=max_model_len)
    return Serving(AsyncEngine(engine))  # type: ignore[arg-type]


def test_prompt_ids_with_repo_context(qwen_tok) -> None:
    serving = serving_on(qwen_tok)
    plain = infill_prompt(serving, "def f(", "\n    return x", prompt="x", reply=16)
    assert plain.ids == [PRE, *byte_ids("def f("), *byte_ids("x"), SUF,
                         *byte_ids("\n    return x"), MID]
    extra = [FimChunk(filename="a.py", text="A = 1\n"), FimChunk(text="B")]
    ids = infill_prompt(serving, "p", "s", extra=extra, reply=16).ids
    assert ids == [REPO, *byte_ids("myproject\n"), SEP, *byte_ids("a.py\n"),
                   *byte_ids("A = 1\n"), SEP, *byte_ids("tmp\n"), *byte_ids("B"),
                   SEP, *byte_ids("filename\n"), PRE, *byte_ids("p"), SUF, *byte_ids("s"),
                   MID]
    assert repo_context(qwen_tok, QWEN_FIM, extra) == ids[:ids.index(PRE)]


def test_prompt_without_file_tokens_uses_snippet_lines(qwen_tok) -> None:
    bare = FimTokens(PRE, SUF, MID)
    ids = repo_context(qwen_tok, bare, [FimChunk(filename="a.py", text="A")])
    assert ids == byte_ids("\n\n--- snippet ---\n\nA")


def test_prompt_cut_to_the_context(qwen_tok) -> None:
    serving = serving_on(qwen_tok, max_model_len=40)
    # 40 - 8 for the reply - 3 markers - 1 prompt = 28: 21 of the prefix, 7 of the suffix
    cut = infill_prompt(serving, "a" * 50, "b" * 50, prompt="c", reply=8)
    assert cut.truncated and len(cut.ids) == 32
    assert cut.ids == [PRE, *byte_ids("a" * 21), *byte_ids("c"), SUF, *byte_ids("b" * 7), MID]


# ---- end to end on a tiny Qwen2 coder ----------------------------------------------------


@pytest.fixture(scope="module")
def coder_engine(qwen_dir):
    """A random three-layer Qwen2 beside the FIM tokenizer: a Hugging Face directory."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = hf_config("qwen2")
    cfg.vocab_size = BYTES + len(QWEN_SPECIALS)
    cfg.eos_token_id = EOT
    tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(
        qwen_dir, safe_serialization=True)
    engine = Engine.from_model(str(qwen_dir), EngineConfig(block_size=4, kv_cache_gib=0.05,
                                                            max_num_seqs=4))
    assert engine.tokenizer.fim == QWEN_FIM and engine.max_model_len == 256
    return engine


def run_app(engine, body) -> None:
    """Run `body(client)` against the app on `engine`; no engine request is left after."""
    async def main() -> None:
        ae = AsyncEngine(engine, max_waiting=4)
        app = create_app(ae, front_ends())
        await ae.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://t", timeout=60) as client:
                await body(client)
                health = (await client.get("/health")).json()
                assert health["num_requests"] == 0, health
        finally:
            await ae.stop()
    asyncio.run(asyncio.wait_for(main(), timeout=120))


PREFIX, SUFFIX = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"
GREEDY = {"temperature": 0.0, "n_predict": 12}


def events(text: str) -> list[dict]:
    lines = [line for line in text.split("\n\n") if line]
    assert all(line.startswith("data: ") for line in lines), text
    return [json.loads(line[6:]) for line in lines]


def test_infill_answers_in_llama_cpp_shape(coder_engine) -> None:
    expected = [PRE, *byte_ids(PREFIX), *byte_ids("re"), SUF, *byte_ids(SUFFIX), MID]

    async def body(client: httpx.AsyncClient) -> None:
        r = await client.post("/infill", json={"input_prefix": PREFIX, "input_suffix": SUFFIX,
                                               "prompt": "re", **GREEDY})
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["stop"] is True and got["model"] == coder_engine.model_name
        assert got["tokens_evaluated"] == len(expected) and not got["truncated"]
        assert got["stop_type"] in ("eos", "limit") and got["stopping_word"] == ""
        assert 1 <= got["tokens_predicted"] <= 12 and len(got["tokens"]) == got["tokens_predicted"]
        assert got["stop_type"] == "limit" or got["tokens"][-1] in coder_engine.tokenizer.eos_ids
        t = got["timings"]
        assert t["prompt_n"] + t["cache_n"] == len(expected)
        assert t["predicted_n"] == got["tokens_predicted"]
        # the same ids sent as a plain completion give the same greedy text
        plain = await client.post("/v1/completions", json={
            "prompt": expected, "max_tokens": 12, "temperature": 0.0})
        assert plain.json()["choices"][0]["text"] == got["content"]

        r = await client.post("/infill", json={"input_prefix": PREFIX, "input_suffix": SUFFIX,
                                               "prompt": "re", "stream": True, **GREEDY})
        assert r.headers["content-type"].startswith("text/event-stream")
        chunks = events(r.text)
        *partial, final = chunks
        assert all(c["stop"] is False for c in partial) and final["stop"] is True
        assert "".join(c["content"] for c in partial) == got["content"]
        assert final["content"] == "" and final["stop_type"] == got["stop_type"]
        assert final["tokens_predicted"] == got["tokens_predicted"]
    run_app(coder_engine, body)


def test_infill_stop_word_and_context_files(coder_engine) -> None:
    async def body(client: httpx.AsyncClient) -> None:
        base = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "temperature": 0.0,
                "n_predict": 24, "input_extra": [{"filename": "util.py", "text": "X = 1\n"}]}
        full = (await client.post("/infill", json=base)).json()
        assert full["tokens_evaluated"] == len(repo_context(
            coder_engine.tokenizer, QWEN_FIM, [FimChunk(filename="util.py", text="X = 1\n")])
        ) + len(byte_ids(PREFIX + SUFFIX)) + 3
        text = full["content"]
        if len(text) < 4:
            pytest.skip(f"the random model ended after {text!r}")
        stop = text[2:4]
        got = (await client.post("/infill", json={**base, "stop": [stop, "\x00never"]})).json()
        assert got["stop_type"] == "word" and got["stopping_word"] == stop
        assert got["content"] == text[:text.index(stop)]
    run_app(coder_engine, body)


def test_infill_cuts_a_long_prefix(coder_engine) -> None:
    async def body(client: httpx.AsyncClient) -> None:
        r = await client.post("/infill", json={"input_prefix": "x = 1\n" * 100,
                                               "input_suffix": "y", "n_predict": 4})
        got = r.json()
        assert r.status_code == 200 and got["truncated"] is True
        assert got["tokens_evaluated"] == 256 - 4  # the context less the reply's room
    run_app(coder_engine, body)


def test_completions_suffix_through_the_openai_client(coder_engine) -> None:
    expected = [PRE, *byte_ids(PREFIX), SUF, *byte_ids(SUFFIX), MID]

    async def body(client: httpx.AsyncClient) -> None:
        oai = openai.AsyncOpenAI(base_url="http://t/v1", api_key="none", http_client=client)
        fim = await oai.completions.create(model=coder_engine.model_name, prompt=PREFIX, suffix=SUFFIX,
                                           max_tokens=10, temperature=0.0)
        plain = await oai.completions.create(model=coder_engine.model_name, prompt=expected,
                                             max_tokens=10, temperature=0.0)
        assert fim.usage.prompt_tokens == len(expected)
        assert fim.choices[0].text == plain.choices[0].text
        stream = await oai.completions.create(model=coder_engine.model_name, prompt=PREFIX,
                                              suffix=SUFFIX, max_tokens=10, temperature=0.0,
                                              stream=True)
        assert "".join([c.choices[0].text async for c in stream]) == fim.choices[0].text
    run_app(coder_engine, body)


def test_bad_infill_bodies(coder_engine) -> None:
    async def body(client: httpx.AsyncClient) -> None:
        for bad, param, words in [
            ({"input_prefix": "a", "cache_prompt": True}, "cache_prompt", "unknown field"),
            ({"input_extra": [{"filename": "a.py"}]}, "input_extra.0", "text"),
            ({"input_extra": [{"text": "a", "lang": "py"}]}, "input_extra.0", "unknown field"),
            ({"n_predict": 0}, "n_predict", "-1"),
            ({"temperature": "hot"}, "temperature", "invalid value"),
            ({"model": "other"}, "model", "does not exist"),
            ({"n_predict": 400}, "prompt", "shorter reply"),
        ]:
            r = await client.post("/infill", json=bad)
            assert r.status_code in (400, 404), r.text
            err = r.json()["error"]
            assert err["param"] == param and words in err["message"], (bad, err)
    run_app(coder_engine, body)


# ---- a model without FIM tokens ----------------------------------------------------------


def test_default_model_has_no_fim() -> None:
    name = "gemma-3-270m-q4_k_m.gguf"
    message = (f"{name} has no fill-in-the-middle tokens (tokenizer.ggml.fim_*); use a code "
               "model such as Qwen2.5-Coder")
    engine = FakeEngine(model_name=name, tokenizer=default_tokenizer())

    async def body(client: httpx.AsyncClient) -> None:
        r = await client.post("/infill", json={"input_prefix": "def f(", "input_suffix": ")"})
        assert r.status_code == 400 and r.json()["error"]["message"] == message
        oai = openai.AsyncOpenAI(base_url="http://t/v1", api_key="none", http_client=client)
        with pytest.raises(openai.BadRequestError) as e:
            await oai.completions.create(model=name, prompt="def f(", suffix=")")
        assert e.value.body["message"] == message and e.value.body["param"] == "suffix"
    run_app(engine, body)
