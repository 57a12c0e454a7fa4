"""ModelSpec from the default GGUF, HF config.json files and descriptions; the FLOP and KV
arithmetic checked against brute force on tiny models."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvlab.cost import causal_span_sum
from kvlab.errors import KvlabError
from kvlab.estimate import HardwareSpec, LayerSpec, ModelSpec, Workload, estimate
from kvlab.estimate.specs import (
    architecture_from_config,
    layer_windows,
    load_model_spec,
    spec_from_description,
    spec_from_gguf,
    spec_from_hf_config,
)
from kvlab.models.loader import LoadOptions, load_model
from kvlab.weights.checkpoint import open_checkpoint
from kvlab.weights.default_model import default_model_path

GEMMA3_270M_CONFIG = {  # the text model of google/gemma-3-270m as HF describes it
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 640,
    "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 4,
    "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262144, "sliding_window": 512,
    "max_position_embeddings": 32768, "torch_dtype": "bfloat16",
}
LLAMA_3_1_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False,
    "max_position_embeddings": 131072, "torch_dtype": "bfloat16",
}


@pytest.fixture(scope="module")
def gemma() -> ModelSpec:
    try:
        path = default_model_path()
    except Exception as e:  # noqa: BLE001 - any failure to get the file means: skip
        pytest.skip(f"default model unavailable: {e}")
    return spec_from_gguf(path)


def _write_config(tmp_path: Path, cfg: dict) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


# -- the default model ---------------------------------------------------------------------


def test_default_gguf_parameters_and_bytes(gemma: ModelSpec) -> None:
    assert gemma.n_params == 268_098_176
    assert round(gemma.embedding_share, 2) == 0.63  # the embedding is 63 % of the parameters
    assert gemma.tied_output and gemma.output_bytes == 178_257_920  # Q8_0 table, read in full
    assert gemma.weight_bytes == 246_587_904
    # every block weight + the tied output matrix + one 680-byte embedding row
    assert gemma.decode_weight_bytes(1) == 246_587_904 + 680
    assert round(gemma.decode_weight_bytes(1) / 1e6, 1) == 246.6


def test_default_gguf_sliding_window_kv(gemma: ModelSpec) -> None:
    assert gemma.n_layers == 18 and gemma.max_context == 32768
    assert [i for i, lyr in enumerate(gemma.layers) if lyr.window is None] == [5, 11, 17]
    assert all(lyr.window == 512 for i, lyr in enumerate(gemma.layers) if (i + 1) % 6)
    per_token = 2 * 18 * 1 * 256 * 2  # 2 x layers x kv_heads x head_dim x f16 bytes
    assert gemma.kv_bytes_per_token(2.0) == per_token == 18 * 1024
    assert gemma.kv_bytes(512, 2.0) == 512 * per_token  # inside the window: every layer grows
    # past it only the 3 global layers keep growing; the 15 sliding ones hold 512 tokens
    assert gemma.kv_bytes(32768, 2.0) == 2 * 256 * 2 * (3 * 32768 + 15 * 512)
    assert gemma.kv_bytes(32768, 2.0) / 32768 == 3312  # bytes per token at full context


def test_default_gguf_prefill_flop(gemma: ModelSpec) -> None:
    block_params = sum(lyr.dense_params for lyr in gemma.layers)
    assert block_params == 18 * (2 * 640 * 1024 + 2 * 640 * 256 + 3 * 640 * 2048)
    e = estimate(gemma, HardwareSpec.custom(100, 1), Workload(prompt_tokens=1000,
                                                             output_tokens=1))
    attention = 18 * 2 * 4 * 512 * causal_span_sum(1000, None)  # if no layer slid
    attention -= 15 * 2 * 4 * 512 * (causal_span_sum(1000, None) - causal_span_sum(1000, 512))
    expected = 1000 * 2 * block_params + attention + 2 * 262144 * 640  # logits: last only
    assert e.prefill_flop == pytest.approx(expected)


def test_hf_config_of_the_same_model_agrees_with_the_gguf(gemma: ModelSpec,
                                                          tmp_path: Path) -> None:
    hf = spec_from_hf_config(_write_config(tmp_path, GEMMA3_270M_CONFIG))
    assert hf.n_params == pytest.approx(gemma.n_params, rel=1e-3)
    assert [lyr.window for lyr in hf.layers] == [lyr.window for lyr in gemma.layers]
    assert hf.kv_bytes(4096, 2.0) == gemma.kv_bytes(4096, 2.0)
    assert hf.weight_bytes == pytest.approx(2 * hf.n_params, rel=1e-6)  # bf16
    assert hf.tied_output


# -- HF config.json ---------------------------------------------------------------------------


def test_hf_llama_3_1_8b(tmp_path: Path) -> None:
    spec = load_model_spec(_write_config(tmp_path, LLAMA_3_1_8B_CONFIG))
    assert spec.n_params == pytest.approx(8.03e9, rel=1e-3)
    assert spec.kv_bytes_per_token(2.0) == 128 * 1024
    assert not spec.tied_output
    assert spec.decode_weight_bytes(1) < spec.weight_bytes  # the input table: one row a token
    four_bit = load_model_spec(tmp_path, bits=4.5)  # the directory works too
    assert four_bit.weight_bytes == pytest.approx(spec.n_params * 4.5 / 8, rel=1e-6)


def test_hf_layer_types_and_nested_text_config(tmp_path: Path) -> None:
    text = dict(GEMMA3_270M_CONFIG, num_hidden_layers=4,
                layer_types=["sliding_attention", "full_attention"] * 2)
    spec = spec_from_hf_config(_write_config(tmp_path, {"text_config": text}))
    assert [lyr.window for lyr in spec.layers] == [512, None, 512, None]


def test_hf_config_without_dtype_asks_for_bits(tmp_path: Path) -> None:
    cfg = {k: v for k, v in LLAMA_3_1_8B_CONFIG.items() if k != "torch_dtype"}
    with pytest.raises(KvlabError, match="--bits"):
        spec_from_hf_config(_write_config(tmp_path, cfg))


def test_hf_moe_reads_only_routed_experts_at_batch_1(tmp_path: Path) -> None:
    cfg = dict(LLAMA_3_1_8B_CONFIG, num_local_experts=8, num_experts_per_tok=2)
    spec = spec_from_hf_config(_write_config(tmp_path, cfg))
    assert spec.expert_fraction(1) == pytest.approx(2 / 8)
    assert spec.expert_fraction(64) == pytest.approx(1.0, abs=1e-6)
    assert spec.decode_weight_bytes(1) < spec.decode_weight_bytes(16) < spec.weight_bytes + 1


# -- descriptions -----------------------------------------------------------------------------


def test_description_needs_bits_or_size() -> None:
    with pytest.raises(KvlabError, match="--bits"):
        spec_from_description(params=8e9)
    with pytest.raises(KvlabError, match="between 1 and 32"):
        spec_from_description(params=8e9, bits=-4)
    with pytest.raises(KvlabError, match="--layers must be a positive integer"):
        spec_from_description(params=8e9, bits=4, layers=0)
    with pytest.raises(KvlabError, match="--params"):
        spec_from_description(bits=4)


def test_description_from_architecture_alone_matches_hf() -> None:
    spec = spec_from_description(layers=32, hidden=4096, heads=32, kv_heads=8,
                                      intermediate=14336, vocab=128256, bits=16)
    assert spec.n_params == pytest.approx(8.03e9, rel=1e-3)
    assert spec.kv_bytes_per_token(2.0) == 128 * 1024
    assert spec.output_flop == 2 * 128256 * 4096


def test_description_with_vocab_separates_tables() -> None:
    spec = spec_from_description(params=8e9, bits=8, vocab=100_000, hidden=4000)
    assert spec.lookup_params == spec.output_params == 400_000_000
    assert spec.matmul_flop_per_token() == pytest.approx(2 * (8e9 - 2 * 400e6), rel=1e-6)
    # untied: the input table is read one row at a time, the output table in full
    assert spec.decode_weight_bytes(1) == pytest.approx(8e9 - 400e6 + 4000, rel=1e-6)


# -- the arithmetic against brute force --------------------------------------------------------


@pytest.mark.parametrize("tokens, window", [(0, None), (1, 4), (4, 4), (5, 3), (100, 7),
                                            (9, None), (3, 10)])
def test_causal_span_sum(tokens: int, window: int | None) -> None:
    brute = sum(min(i, window) if window else i for i in range(1, tokens + 1))
    assert causal_span_sum(tokens, window) == brute


def test_layer_windows_pattern() -> None:
    assert layer_windows(12, 512, 6) == [512] * 5 + [None] + [512] * 5 + [None]
    assert layer_windows(4, 64, 2) == [64, None, 64, None]
    assert layer_windows(3, 64, None) == [64, 64, 64]


def _tiny_model() -> ModelSpec:
    layers = (LayerSpec(dense_bytes=1000, dense_params=2000, kv_elements=8,
                        attn_flop_per_key=32, window=3),
              LayerSpec(dense_bytes=1000, dense_params=2000, kv_elements=8,
                        attn_flop_per_key=32))
    return ModelSpec(name="tiny", source="test", n_params=5000, weight_bytes=2600, layers=layers,
                     lookup_params=500, lookup_row_bytes=10, output_params=500,
                     output_bytes=500, other_bytes=100)


def test_prefill_attention_matches_a_position_loop() -> None:
    model = _tiny_model()
    brute = sum(32 * min(i, 3) + 32 * i for i in range(1, 11))
    assert model.prefill_attention_flop(10) == brute
    assert model.attention_flop(np.array([2.0, 10.0])).tolist() == [32 * 4, 32 * 13]


def test_decode_step_against_hand_arithmetic() -> None:
    model = _tiny_model()
    # 2 layers + norms + full output table + one embedding row
    assert model.decode_weight_bytes(1) == 2000 + 100 + 500 + 10
    hw = HardwareSpec.custom(bandwidth_gbs=1e-6, tflops=1e3)  # 1000 B/s, compute is free
    e = estimate(model, hw, Workload(prompt_tokens=9, output_tokens=2, kv_dtype="f32"))
    kv_read = 4 * (8 * 3 + 8 * 10)  # the one decode step attends 10 positions
    assert e.decode_tok_s_ceiling == pytest.approx(1000 / (2610 + kv_read))


def test_synthetic_moe_gguf_untied_hybrid(tmp_path: Path) -> None:
    """A tiny GGUF written with the gguf package: routed experts, an untied output matrix, a
    layer without attention, and a sliding window whose layout the estimator does not know."""
    from gguf import GGUFWriter

    path = tmp_path / "tiny-moe.gguf"
    writer = GGUFWriter(str(path), arch="qwen3moe")
    writer.add_block_count(2)
    writer.add_embedding_length(16)
    writer.add_head_count(4)
    writer.add_head_count_kv([2, 0])
    writer.add_context_length(128)
    writer.add_expert_count(4)
    writer.add_expert_used_count(2)
    writer.add_sliding_window(8)
    shapes = {"token_embd.weight": (32, 16), "output.weight": (32, 16), "output_norm.weight": (16,),
              "blk.0.attn_q.weight": (16, 16), "blk.0.attn_k.weight": (8, 16),
              "blk.0.attn_v.weight": (8, 16), "blk.0.attn_output.weight": (16, 16),
              "blk.0.attn_norm.weight": (16,)}
    for i in range(2):
        shapes |= {f"blk.{i}.ffn_gate_inp.weight": (4, 16),
                   f"blk.{i}.ffn_gate_exps.weight": (4, 8, 16),
                   f"blk.{i}.ffn_up_exps.weight": (4, 8, 16),
                   f"blk.{i}.ffn_down_exps.weight": (4, 16, 8)}
    for name, shape in shapes.items():
        writer.add_tensor(name, np.zeros(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    spec = spec_from_gguf(path)
    assert spec.n_params == sum(int(np.prod(s)) for s in shapes.values())
    assert not spec.tied_output and spec.output_bytes == 32 * 16 * 4
    assert spec.lookup_row_bytes == 16 * 4
    assert [lyr.window for lyr in spec.layers] == [None, None]  # unknown layout: full attention
    assert [lyr.kv_elements for lyr in spec.layers] == [2 * (4 + 4), 0]
    assert [lyr.attn_flop_per_key for lyr in spec.layers] == [2 * 4 * 8, 0]
    experts = 3 * 4 * 8 * 16
    assert spec.layers[1].expert_params == experts and spec.layers[1].dense_params == 4 * 16
    assert spec.active_params == spec.n_params - 2 * experts // 2  # 2 of 4 experts unread
    attention = 2 * 16 * 16 + 2 * 8 * 16
    assert spec.matmul_flop_per_token() == 2 * (attention + 2 * 4 * 16 + 2 * experts / 2)
    expected = (spec.weight_bytes - 32 * 16 * 4 + 16 * 4  # input table: one row
                - 2 * experts * 4 / 2)  # half of the routed experts at batch 1
    assert spec.decode_weight_bytes(1) == pytest.approx(expected)


def test_a_loaded_model_costs_what_its_file_says() -> None:
    """One cost vocabulary: the spec the engine builds from the model it loaded (its bytes as
    stored) and the spec the estimator reads from the file's header agree in every figure a
    prediction or a run's GB/s and FLOP/s uses."""
    try:
        path = default_model_path()
    except Exception as e:  # noqa: BLE001 - any failure to get the file means: skip
        pytest.skip(f"default model unavailable: {e}")
    model = load_model(open_checkpoint(path), LoadOptions())
    loaded, header = model.model_spec(stored=True), spec_from_gguf(path)
    for field in ("n_params", "weight_bytes", "lookup_params", "lookup_row_bytes",
                  "output_params", "output_bytes", "other_bytes", "tied_output", "vocab_size",
                  "hidden_size", "max_context", "architecture"):
        assert getattr(loaded, field) == getattr(header, field), field
    for batch in (1, 8):
        assert loaded.decode_weight_bytes(batch) == header.decode_weight_bytes(batch)
    assert loaded.matmul_flop_per_token() == header.matmul_flop_per_token()
    for context in (100, 700, 5000):
        assert loaded.kv_bytes(context, 2) == header.kv_bytes(context, 2)
        assert loaded.attention_flop(context) == header.attention_flop(context)
    assert [(lyr.dense_bytes, lyr.dense_params, lyr.window, lyr.kv_elements, lyr.heads)
            for lyr in loaded.layers] == \
        [(lyr.dense_bytes, lyr.dense_params, lyr.window, lyr.kv_elements, lyr.heads)
         for lyr in header.layers]
    windows = tuple(lyr.window for lyr in header.layers)
    assert architecture_from_config(model.config).windows == windows
