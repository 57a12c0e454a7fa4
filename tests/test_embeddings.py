"""Embeddings: a tiny random BERT (HF safetensors and llama.cpp's GGUF) and a tiny random
decoder against transformers, pooling and truncation, /v1/embeddings on an app over a real
tiny engine (shapes, base64, 400s, an encoder refusing generation), and once through the
official `openai` client against `kvlab serve` on the default model."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_server import start_server

from kvlab.engine import Engine, EngineConfig
from kvlab.server.apis import front_ends
from kvlab.server.core.app import create_app
from kvlab.server.core.async_engine import AsyncEngine
from kvlab.server.core.embedding import embed
from kvlab.server.core.errors import ApiError
from kvlab.server.core.serving import Serving

from tiny_models import build

WORDS = ["the", "cat", "sat", "on", "mat", "dog", "runs", "a", "hello", "world", "play",
         "emb", "##ed", "##ding", "##s", "##ing", ".", ",", "!", "?"]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
TEXTS = ["Hello world!", "the cat sat on the mat.", "Dogs playing, embedding?", "a zebra"]
CONFIG = EngineConfig(kv_cache_gib=0.01)


def build_bert(out: Path, pooling: str | None = None, seed: int = 0):
    """A random BertModel saved as HF safetensors with a WordPiece tokenizer.json (and
    sentence-transformers' 1_Pooling config when `pooling` is given)."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.BertConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=48, max_position_embeddings=64,
                        type_vocab_size=2)
    model = tf.BertModel(cfg, add_pooling_layer=False).eval()
    with torch.no_grad():  # norms away from 1 / 0 so a wrong convention shows
        for name, p in model.named_parameters():
            if "LayerNorm" in name:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if name.endswith("weight") else 0.0))
    model.save_pretrained(out, safe_serialization=True)
    tf.BertTokenizerFast(vocab={t: i for i, t in enumerate(VOCAB)}).save_pretrained(out)
    if pooling is not None:
        (out / "1_Pooling").mkdir()
        (out / "1_Pooling" / "config.json").write_text(json.dumps({
            "word_embedding_dimension": 32, "pooling_mode_cls_token": pooling == "cls",
            "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_lasttoken": False}))
    return model


def write_bert_gguf(model, path: Path, pooling_type: int, quantize: bool = False) -> None:
    """The model as llama.cpp's converter writes a `bert` GGUF (phantom-space vocabulary);
    `quantize`: the layers' matrices as Q8_0 where their rows are whole blocks."""
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(str(path), "bert")
    for key, value in (("block_count", cfg.num_hidden_layers),
                       ("context_length", cfg.max_position_embeddings),
                       ("embedding_length", cfg.hidden_size),
                       ("feed_forward_length", cfg.intermediate_size),
                       ("attention.head_count", cfg.num_attention_heads),
                       ("pooling_type", pooling_type)):
        w.add_uint32(f"bert.{key}", value)
    w.add_float32("bert.attention.layer_norm_epsilon", cfg.layer_norm_eps)
    w.add_bool("bert.attention.causal", False)
    _add_wordpiece_vocab(w)
    for name, t in _gguf_names(model):
        data = t.detach().float().numpy().astype(np.float32)
        if quantize and name.startswith("blk.") and data.ndim == 2 and data.shape[1] % 32 == 0:
            q8 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, gguf.quants.quantize(data, q8), raw_dtype=q8)
        else:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _add_wordpiece_vocab(w) -> None:
    """VOCAB as llama.cpp's converter writes a WordPiece vocabulary (phantom spaces)."""
    special = [t.startswith("[") for t in VOCAB]
    w.add_string("tokenizer.ggml.model", "bert")
    w.add_array("tokenizer.ggml.tokens", [t if s else t[2:] if t.startswith("##") else "\u2581" + t
                                          for t, s in zip(VOCAB, special)])
    w.add_array("tokenizer.ggml.token_type", [3 if s else 1 for s in special])
    w.add_uint32("tokenizer.ggml.token_type_count", 2)
    for name, token in (("bos", "[CLS]"), ("eos", "[SEP]"), ("seperator", "[SEP]"),
                        ("unknown", "[UNK]"), ("padding", "[PAD]")):
        w.add_uint32(f"tokenizer.ggml.{name}_token_id", VOCAB.index(token))


def _gguf_names(model):
    glob = {"embeddings.word_embeddings": "token_embd",
            "embeddings.position_embeddings": "position_embd",
            "embeddings.token_type_embeddings": "token_types",
            "embeddings.LayerNorm": "token_embd_norm"}
    layer = {"attention.self.query": "attn_q", "attention.self.key": "attn_k",
             "attention.self.value": "attn_v", "attention.output.dense": "attn_output",
             "attention.output.LayerNorm": "attn_output_norm", "intermediate.dense": "ffn_up",
             "output.dense": "ffn_down", "output.LayerNorm": "layer_output_norm"}
    for name, t in model.state_dict().items():
        stem, kind = name.rsplit(".", 1)
        if stem in glob:
            yield f"{glob[stem]}.{kind}", t
        elif stem.startswith("encoder.layer."):
            i, rest = stem.removeprefix("encoder.layer.").split(".", 1)
            yield f"blk.{i}.{layer[rest]}.{kind}", t


def reference(model, ids: list[int], pooling: str) -> torch.Tensor:
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0]
    return F.normalize(hidden.mean(0) if pooling == "mean" else hidden[0], dim=-1)


def hf_ids(model_dir: Path, text: str) -> list[int]:
    import transformers as tf

    return tf.AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"]


def _bge_vocab() -> Path | None:
    folder = os.environ.get("KVLAB_LLAMA_VOCABS")
    path = Path(folder) / "ggml-vocab-bert-bge.gguf" if folder else None
    return path if path is not None and path.is_file() else None


@pytest.mark.skipif(_bge_vocab() is None,
                    reason="set KVLAB_LLAMA_VOCABS to a folder of llama.cpp's ggml-vocab-*.gguf")
def test_wordpiece_gguf_matches_llama_cpps_test_vectors():
    """llama.cpp's own tokenizer test for its bert-bge vocabulary (ids without [CLS]/[SEP])."""
    from kvlab.tokenizer import load_gguf_tokenizer
    from kvlab.weights.gguf_file import GGUFFile

    path = _bge_vocab()
    tok = load_gguf_tokenizer(GGUFFile(path).metadata)
    texts = Path(f"{path}.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    expected = Path(f"{path}.out").read_text(encoding="utf-8").split("\n")
    assert len(texts) == len(expected) > 40
    for text, ids in zip(texts, expected):
        assert tok.encode(text, add_special_tokens=False) == [int(i) for i in ids.split()], text
    assert tok.encode("Hello world") == [101, 7592, 2088, 102]


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    """(model, HF dir without a pooling config, HF dir with mean pooling, GGUF with mean)."""
    root = tmp_path_factory.mktemp("bert")
    model = build_bert(root / "cls")
    build_bert(root / "mean", pooling="mean")
    write_bert_gguf(model, root / "bert.gguf", pooling_type=1)
    write_bert_gguf(model, root / "bert-q8_0.gguf", pooling_type=2, quantize=True)
    return model, root


@pytest.mark.parametrize("source,pooling", [("cls", "cls"), ("mean", "mean"),
                                            ("bert.gguf", "mean")])
def test_bert_matches_transformers(bert, source, pooling):
    model, root = bert
    engine = Engine.from_model(str(root / source), CONFIG)
    assert engine.snapshot().pooling == pooling and not engine.can_generate
    ids = [engine.tokenizer.encode(t) for t in TEXTS]
    assert ids == [hf_ids(root / "cls", t) for t in TEXTS]  # [CLS] ... [SEP], lowercased
    got = engine.embed(ids)
    want = torch.stack([reference(model, i, pooling) for i in ids])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.cat([engine.embed([i]) for i in ids]), got,
                               atol=1e-6, rtol=0)  # batch == one at a time


def test_quantized_bert_runs_the_q8_0_kernels_close_to_transformers(bert):
    model, root = bert
    engine = Engine.from_model(str(root / "bert-q8_0.gguf"), CONFIG)
    kinds = {t.name.split(".")[-1]: t.qtype for t in engine.loaded.tensors}
    assert kinds["q"].startswith("Q8_0") and kinds["up"].startswith("Q8_0"), kinds
    assert kinds["down"] == "F32"
    ids = [engine.tokenizer.encode(t) for t in TEXTS]
    want = torch.stack([reference(model, i, "cls") for i in ids])
    torch.testing.assert_close(engine.embed(ids), want, atol=2e-2, rtol=0)


def test_bert_engine_refuses_generation_and_keeps_no_pool(bert):
    from kvlab.errors import RequestError
    from kvlab.request import SamplingParams

    engine = Engine.from_model(str(bert[1] / "cls"), CONFIG)
    assert engine.kv.num_blocks == 1 and engine.max_model_len == 64
    with pytest.raises(RequestError, match="embedding model"):
        engine.add_request("r", [2, 5, 3], SamplingParams(max_tokens=2))


NOMIC = {"vocab_size": len(VOCAB), "n_embd": 32, "n_head": 4, "n_layer": 2, "n_inner": 48,
         "n_positions": 64, "layer_norm_epsilon": 1e-12, "rotary_emb_base": 1000.0,
         "type_vocab_size": 2}


def nomic_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under nomic-embed-text's HF names."""
    gen = torch.Generator().manual_seed(seed)
    d, inner = NOMIC["n_embd"], NOMIC["n_inner"]

    def rand(*shape: int, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * (0.1 if mean else 0.2) + mean

    sd = {"embeddings.word_embeddings.weight": rand(len(VOCAB), d),
          "embeddings.token_type_embeddings.weight": rand(2, d),
          "emb_ln.weight": rand(d, mean=1.0), "emb_ln.bias": rand(d)}
    for i in range(NOMIC["n_layer"]):
        p = f"encoder.layers.{i}."
        sd |= {p + "attn.Wqkv.weight": rand(3 * d, d), p + "attn.out_proj.weight": rand(d, d),
               p + "mlp.fc11.weight": rand(inner, d), p + "mlp.fc12.weight": rand(inner, d),
               p + "mlp.fc2.weight": rand(d, inner), p + "norm1.weight": rand(d, mean=1.0),
               p + "norm1.bias": rand(d), p + "norm2.weight": rand(d, mean=1.0),
               p + "norm2.bias": rand(d)}
    return sd


def nomic_reference(sd: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """nomic-bert's forward written out from its definition (post-norm blocks, rotate-half
    rotary over whole heads, y = fc11(x) * silu(fc12(x))), then mean pooling, normalized."""
    d, heads, eps = NOMIC["n_embd"], NOMIC["n_head"], NOMIC["layer_norm_epsilon"]
    hd = d // heads

    def norm(x, name):
        return F.layer_norm(x, (d,), sd[name + ".weight"], sd[name + ".bias"], eps)

    inv = 1.0 / NOMIC["rotary_emb_base"] ** (torch.arange(0, hd, 2).float() / hd)
    angles = torch.arange(len(ids)).float()[:, None] * inv[None]
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1)[:, None] for f in (torch.cos, torch.sin))

    def rotate(t):  # [n, heads, hd]
        return t * cos + torch.cat([-t[..., hd // 2:], t[..., :hd // 2]], dim=-1) * sin

    x = sd["embeddings.word_embeddings.weight"][ids] + sd[
        "embeddings.token_type_embeddings.weight"][0]
    x = norm(x, "emb_ln")
    for i in range(NOMIC["n_layer"]):
        p = f"encoder.layers.{i}."
        q, k, v = (x @ sd[p + "attn.Wqkv.weight"].T).reshape(len(ids), 3, heads, hd).unbind(1)
        scores = torch.einsum("qhd,khd->hqk", rotate(q), rotate(k)) / hd ** 0.5
        att = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(len(ids), d)
        x = norm(x + att @ sd[p + "attn.out_proj.weight"].T, p + "norm1")
        h = (x @ sd[p + "mlp.fc11.weight"].T) * F.silu(x @ sd[p + "mlp.fc12.weight"].T)
        x = norm(x + h @ sd[p + "mlp.fc2.weight"].T, p + "norm2")
    return F.normalize(x.mean(0), dim=-1)


def write_nomic(sd: dict[str, torch.Tensor], root: Path) -> None:
    """HF directory (safetensors, config.json, the BERT tokenizer) and llama.cpp's GGUF."""
    import gguf
    import transformers as tf
    from safetensors.torch import save_file

    hf = root / "hf"
    hf.mkdir()
    save_file(sd, str(hf / "model.safetensors"))
    (hf / "config.json").write_text(json.dumps({
        "architectures": ["NomicBertModel"], "model_type": "nomic_bert", **NOMIC,
        "activation_function": "swiglu", "rotary_emb_fraction": 1.0, "prenorm": False,
        "qkv_proj_bias": False, "mlp_fc1_bias": False, "mlp_fc2_bias": False}))
    tf.BertTokenizerFast(vocab={t: i for i, t in enumerate(VOCAB)}).save_pretrained(hf)
    w = gguf.GGUFWriter(str(root / "nomic.gguf"), "nomic-bert")
    for key, name in (("block_count", "n_layer"), ("context_length", "n_positions"),
                      ("embedding_length", "n_embd"), ("feed_forward_length", "n_inner"),
                      ("attention.head_count", "n_head")):
        w.add_uint32(f"nomic-bert.{key}", NOMIC[name])
    w.add_float32("nomic-bert.attention.layer_norm_epsilon", NOMIC["layer_norm_epsilon"])
    w.add_float32("nomic-bert.rope.freq_base", NOMIC["rotary_emb_base"])
    w.add_uint32("nomic-bert.pooling_type", 1)
    _add_wordpiece_vocab(w)
    names = {"embeddings.word_embeddings": "token_embd", "emb_ln": "token_embd_norm",
             "embeddings.token_type_embeddings": "token_types", "attn.Wqkv": "attn_qkv",
             "attn.out_proj": "attn_output", "mlp.fc11": "ffn_up", "mlp.fc12": "ffn_gate",
             "mlp.fc2": "ffn_down", "norm1": "attn_output_norm", "norm2": "layer_output_norm"}
    for name, t in sd.items():
        stem, kind = name.rsplit(".", 1)
        if stem.startswith("encoder.layers."):
            i, rest = stem.removeprefix("encoder.layers.").split(".", 1)
            stem = f"blk.{i}.{names[rest]}"
        w.add_tensor(f"{names.get(stem, stem)}.{kind}", t.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("source", ["hf", "nomic.gguf"])
def test_nomic_bert_matches_its_definition(tmp_path, source):
    sd = nomic_weights()
    write_nomic(sd, tmp_path)
    engine = Engine.from_model(str(tmp_path / source), CONFIG)
    assert engine.snapshot().pooling == "mean" and not engine.can_generate
    ids = [engine.tokenizer.encode(t) for t in TEXTS]
    want = torch.stack([nomic_reference(sd, i) for i in ids])
    torch.testing.assert_close(engine.embed(ids), want, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3")
    model = build("qwen3", root)
    return model, Engine.from_model(str(root / "model.gguf"), CONFIG), root / "model.gguf"


def test_decoder_last_token_matches_transformers(qwen3):
    model, engine, _ = qwen3
    prompts = [[5, 9, 11, 40, 2], [7], [60, 61, 62]]
    got = engine.embed(prompts, normalize=False)
    with torch.no_grad():  # the base model's output is after the final norm
        want = torch.stack([model.model(torch.tensor([p])).last_hidden_state[0, -1]
                            for p in prompts])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(engine.embed(prompts), F.normalize(want, dim=-1), atol=1e-5,
                               rtol=0)
    alone = torch.cat([engine.embed([p], normalize=False) for p in prompts])
    # fp32 products of other shapes may round otherwise (AVX-512 GEMM kernels go by shape)
    torch.testing.assert_close(alone, got, atol=1e-6, rtol=1e-6)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks  # no block was taken


@pytest.mark.parametrize("arch", ["gemma3", "qwen3moe"])
def test_sliding_window_and_moe_decoders_match_transformers(tmp_path, arch):
    """Gemma 3's sliding layers (window 4) over prompts longer than the window, and routed
    experts: the last token's final hidden state, as transformers computes it."""
    model = build(arch, tmp_path)
    engine = Engine.from_model(str(tmp_path / "model.gguf"), CONFIG)
    prompts = [[5, 9, 11, 40, 2, 7, 8, 30, 31], [7], [60, 61, 62, 63, 64, 65]]
    with torch.no_grad():
        want = torch.stack([model.model(torch.tensor([p])).last_hidden_state[0, -1]
                            for p in prompts])
    torch.testing.assert_close(engine.embed(prompts, normalize=False), want, atol=1e-4, rtol=0)


def test_an_embedding_models_eos_ends_its_texts_but_not_chat_prompts(qwen3, tmp_path):
    """GGUF's add_eos_token and a tokenizer.json post-processor's trailing token (as
    Qwen3-Embedding's) end every encoded text, as llama.cpp and transformers encode it."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, processors

    from kvlab.tokenizer import load_gguf_tokenizer, load_hf_tokenizer
    from kvlab.weights.checkpoint import open_checkpoint

    meta = open_checkpoint(qwen3[2]).metadata
    tok = load_gguf_tokenizer({**meta, "tokenizer.ggml.add_eos_token": True})
    assert tok.encode("ab") == [*tok.encode("ab", add_special_tokens=False), 95]
    assert load_gguf_tokenizer(meta).encode("ab")[-1] != 95
    hf = tokenizers.Tokenizer(models.BPE({"a": 0, "b": 1, "</s>": 2}, []))
    hf.pre_tokenizer, hf.decoder = pre_tokenizers.ByteLevel(), decoders.ByteLevel()
    hf.add_special_tokens(["</s>"])
    hf.post_processor = processors.TemplateProcessing(single="$A </s>",
                                                      special_tokens=[("</s>", 2)])
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}))
    tok = load_hf_tokenizer(tmp_path)
    assert tok.encode("ab") == hf.encode("ab").ids == [0, 1, 2]
    assert tok.encode_chat([{"role": "user", "content": "ab"}]) == [0, 1]


def test_llm_embeds_texts(bert):
    from kvlab.llm import LLM

    llm = LLM(str(bert[1] / "mean"), CONFIG)
    want = llm.engine.embed([llm.tokenizer.encode(t) for t in TEXTS[:2]], dimensions=5)
    np.testing.assert_allclose(llm.embed(TEXTS[:2], dimensions=5), want, atol=1e-7)
    assert len(llm.embed(TEXTS[0])) == 1


def test_dimensions_truncate_then_normalize(qwen3):
    _, engine, _ = qwen3
    full = engine.embed([[3, 4, 5]], normalize=False)
    cut = engine.embed([[3, 4, 5]], dimensions=8)
    torch.testing.assert_close(cut, F.normalize(full[:, :8], dim=-1))
    assert cut.shape == (1, 8)


def run_app(engine: Engine, body) -> None:
    async def main() -> None:
        ae = AsyncEngine(engine)
        app = create_app(ae, front_ends())
        await ae.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://t") as client:
                await body(client)
        finally:
            await ae.stop()
    asyncio.run(asyncio.wait_for(main(), timeout=60))


def test_openai_route_shapes_and_base64(qwen3):
    _, engine, _ = qwen3
    want = engine.embed([engine.tokenizer.encode("ab c"), [4, 5, 6]])

    async def body(client):
        r = await client.post("/v1/embeddings", json={"input": ["ab c", "de"], "user": "u1"})
        data = r.json()
        assert r.status_code == 200 and data["object"] == "list"
        assert [d["index"] for d in data["data"]] == [0, 1]
        assert data["usage"] == {"prompt_tokens": 6, "total_tokens": 6}
        np.testing.assert_allclose(data["data"][0]["embedding"], want[0].numpy(), atol=1e-6)
        r = await client.post("/v1/embeddings", json={"input": [[4, 5, 6]], "dimensions": 4,
                                                      "encoding_format": "base64"})
        vec = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
        np.testing.assert_allclose(vec, F.normalize(want[1:, :4] / want[1:, :4].norm())[0],
                                   atol=1e-6)
        r = await client.post("/v1/embeddings", json={"input": [4, 5, 6]})  # one id list
        np.testing.assert_allclose(r.json()["data"][0]["embedding"], want[1].numpy(), atol=1e-6)
    run_app(engine, body)


def test_embeddings_run_beside_generation_on_one_engine(qwen3):
    _, engine, _ = qwen3
    want = engine.embed([[4, 5, 6]])[0]

    async def body(client):
        gen = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 40,
                                                   "ignore_eos": True})
        emb = [client.post("/v1/embeddings", json={"input": [[4, 5, 6]]}) for _ in range(3)]
        done, *embedded = await asyncio.gather(gen, *emb)
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 40
        for r in embedded:
            np.testing.assert_allclose(r.json()["data"][0]["embedding"], want, atol=1e-6)
        assert engine.kv.num_free_blocks == engine.kv.num_blocks  # all released after
    run_app(engine, body)


@pytest.mark.parametrize("fields,param,says", [
    ({"input": []}, "input", "is empty"),
    ({"input": ""}, "input", "empty string"),
    ({"input": [[]]}, "input", "no tokens"),
    ({"input": [1, 500]}, "input", "token id 500"),
    ({"input": "x" * 300}, "input", "context holds 256"),
    ({"input": ["x"] * 2049}, "input", "at most 2048"),
    ({"input": "x", "dimensions": 0}, "dimensions", "[1, 64]"),
    ({"input": "x", "dimensions": 65}, "dimensions", "[1, 64]"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format", ""),
    ({"input": "x", "truncate": True}, "truncate", "unknown field"),
    ({"input": 5}, "input", ""),
    ({"input": "x", "model": "other"}, "model", "does not exist"),
])
def test_openai_route_refuses_bad_input(qwen3, fields, param, says):
    async def body(client):
        r = await client.post("/v1/embeddings", json=fields)
        assert r.status_code in (400, 404), r.text
        err = r.json()["error"]
        assert err["param"] == param and says in err["message"], err
    run_app(qwen3[1], body)


def test_encoder_server_embeds_and_refuses_generation(bert):
    engine = Engine.from_model(str(bert[1] / "mean"), CONFIG)

    async def body(client):
        r = await client.post("/v1/embeddings", json={"input": TEXTS})
        assert r.status_code == 200 and len(r.json()["data"]) == len(TEXTS)
        for path, fields in (("/v1/completions", {"prompt": "hi"}),
                             ("/v1/chat/completions",
                              {"messages": [{"role": "user", "content": "hi"}]})):
            r = await client.post(path, json={"model": "mean", **fields})
            assert r.status_code == 400, r.text
            assert "is an embedding model" in r.json()["error"]["message"]
    run_app(engine, body)


def test_truncation_keeps_the_closing_sep(bert):
    engine = Engine.from_model(str(bert[1] / "bert.gguf"), CONFIG)
    long_text = "cat " * 100

    async def main():
        ae = AsyncEngine(engine)
        await ae.start()
        try:
            serving = Serving(ae)
            with pytest.raises(ApiError, match="context holds 64"):
                await embed(serving, [long_text], truncate=False)
            return await embed(serving, [long_text, "a cat"], truncate=True)
        finally:
            await ae.stop()

    out = asyncio.run(main())
    cat = VOCAB.index("cat")
    ids = [VOCAB.index("[CLS]"), *[cat] * 62, VOCAB.index("[SEP]")]
    assert out.prompt_tokens == 64 + 4
    want = engine.embed([ids, engine.tokenizer.encode("a cat")])
    np.testing.assert_allclose(out.vectors, want, atol=1e-6)


def kvlab(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvlab.cli.main", *args], input=stdin,
                          capture_output=True, text=True, timeout=120, check=False)


def test_cli_prints_the_engines_vectors(bert):
    path = str(bert[1] / "bert.gguf")
    engine = Engine.from_model(path, CONFIG)
    want = engine.embed([engine.tokenizer.encode(t) for t in TEXTS[:2]], dimensions=8)
    out = kvlab("embed", "-m", path, *TEXTS[:2], "--dimensions", "8")
    assert out.returncode == 0, out.stderr
    record = json.loads(out.stdout)
    assert record["pooling"] == "mean" and len(record["data"]) == 2
    np.testing.assert_allclose([d["embedding"] for d in record["data"]], want, atol=1e-6)
    lines = kvlab("embed", "-m", path, "--format", "jsonl", "--no-normalize",
                  stdin="\n".join(TEXTS[:2]) + "\n").stdout.splitlines()
    raw = engine.embed([engine.tokenizer.encode(TEXTS[1])], normalize=False)[0]
    np.testing.assert_allclose(json.loads(lines[1])["embedding"], raw, atol=1e-6)
    too_long = kvlab("embed", "-m", path, "cat " * 100)
    assert too_long.returncode == 2 and "context holds 64" in too_long.stderr


@pytest.mark.slow
def test_openai_client_against_kvlab_serve(tmp_path):
    import openai

    with start_server(tmp_path / "serve.log") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
        texts = ["The cat sat on the mat.", "A dog runs.", "The cat sat on the mat."]
        out = client.embeddings.create(model="gemma-3-270m-q4_k_m.gguf", input=texts)
        vecs = np.array([d.embedding for d in out.data])  # the client asked for base64
        assert vecs.shape == (3, 640) and out.usage.prompt_tokens > 0
        np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
        np.testing.assert_allclose(vecs[0], vecs[2], atol=1e-6)
        floats = client.embeddings.create(model="gemma-3-270m-q4_k_m.gguf", input=texts[:1],
                                          encoding_format="float", dimensions=64)
        assert len(floats.data[0].embedding) == 64
        with pytest.raises(openai.BadRequestError, match="dimensions"):
            client.embeddings.create(model="gemma-3-270m-q4_k_m.gguf", input="x",
                                     dimensions=100000)
