"""Tiny random-weight checkpoints built with transformers, saved as safetensors and as GGUF.

The GGUF copy is written with the `gguf` package's writer using llama.cpp's conventions
(tensor names, Llama q/k row interleaving, Gemma's norm weights stored as 1 + w), so both
of kvlab's loaders can be checked against the same transformers reference.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import torch

ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "mistral", "gemma2", "phi3")
MOE_ARCHS = ("qwen3moe", "qwen2moe", "mixtral", "olmoe")
# the 2025 families: their own files (tests/test_families_2025.py)
FAMILIES_2025 = ("smollm3", "olmo2", "olmo3", "mistral3", "glm4moe")
_GGUF_ARCH = {"mistral": "llama", "mixtral": "llama",  # as llama.cpp's converter writes them
              "olmo3": "olmo2"}
_PERMUTED_QK = ("llama", "smollm3", "mistral3")  # llama.cpp interleaves their q/k rows
# Ministral 3's YaRN and Llama 4 query temperature, from position 8 on in a tiny model
MINISTRAL3_ROPE = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                   "original_max_position_embeddings": 8, "beta_fast": 32.0,
                   "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.5,
                   "llama_4_scaling_beta": 0.1}

_COMMON = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
           "rms_norm_eps": 1e-6, "tie_word_embeddings": False}


def hf_config(arch: str, **overrides):
    import transformers as tf

    if arch == "llama":
        return tf.LlamaConfig(**{**_COMMON, **overrides}, rope_theta=10000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    if arch == "qwen2":
        return tf.Qwen2Config(**_COMMON, rope_theta=1e6)
    if arch == "qwen3":
        return tf.Qwen3Config(**_COMMON, head_dim=16, rope_theta=1e6)
    if arch == "mistral":  # overrides may set a sliding_window (GGUF has none: HF only)
        return tf.MistralConfig(**{**_COMMON, "sliding_window": None, **overrides},
                                rope_theta=1e6)
    if arch == "phi3":  # q|k|v and gate|up fused in both files
        return tf.Phi3Config(**{**_COMMON, **overrides}, rope_theta=1e4, pad_token_id=0,
                             bos_token_id=1, eos_token_id=2)
    if arch == "gemma2":  # caps small enough to bend the scores and logits of a tiny model
        return tf.Gemma2Config(
            **{**_COMMON, "tie_word_embeddings": True, "num_hidden_layers": 4}, head_dim=16,
            query_pre_attn_scalar=16, sliding_window=4, attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0, attn_implementation="eager",
            layer_types=["sliding_attention", "full_attention"] * 2)
    if arch == "gemma3":
        # six layers: GGUF carries no layer pattern, Gemma 3's is five sliding then one global
        common = {**_COMMON, "tie_word_embeddings": True, "num_hidden_layers": 6}
        return tf.Gemma3TextConfig(
            **common, head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
            layer_types=["sliding_attention"] * 5 + ["full_attention"],
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default",
                                                   "rope_theta": 1e4}})
    if arch in FAMILIES_2025:
        return _config_2025(arch, **overrides)
    return _moe_config(arch, **overrides)


def _config_2025(arch: str, **overrides):
    """SmolLM3 (layer 3 without RoPE), OLMo 2, Ministral 3 (YaRN past 8 positions) and
    GLM-4.5 (first layer dense, 8 sigmoid-routed experts and a shared one, half rotary)."""
    import transformers as tf

    ids = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    if arch == "smollm3":
        return tf.SmolLM3Config(**{**_COMMON, "num_hidden_layers": 4, **overrides},
                                rope_theta=1e6, **ids)
    if arch == "olmo2":
        return tf.Olmo2Config(**{**_COMMON, **overrides}, rope_theta=5e5, **ids)
    if arch == "olmo3":  # layers 0-2 slide over 4 tokens; YaRN on the full layer only
        rope = {"full_attention": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0,
                                   "original_max_position_embeddings": 8, "beta_fast": 32.0,
                                   "beta_slow": 1.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 5e5}}
        return tf.Olmo3Config(**{**_COMMON, "num_hidden_layers": 4, "max_position_embeddings": 32,
                                 **overrides}, sliding_window=4, rope_parameters=rope, **ids)
    if arch == "mistral3":
        return tf.Ministral3Config(**{**_COMMON, "max_position_embeddings": 32, **overrides},
                                   head_dim=16, rope_parameters=dict(MINISTRAL3_ROPE), **ids)
    if arch == "glm4moe":
        glm = {"num_experts_per_tok": 2, "head_dim": 16, "n_routed_experts": 8,
               "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1,
               "routed_scaling_factor": 2.5, "norm_topk_prob": True, "use_qk_norm": True,
               "attention_bias": True}
        return tf.Glm4MoeConfig(**{**_COMMON, **glm, **overrides},
                                rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                 "partial_rotary_factor": 0.5}, **ids)
    raise ValueError(arch)


def multimodal_mistral3(out_dir: Path, seed: int = 0):
    """A Mistral3ForConditionalGeneration (Pixtral tower + the Ministral 3 text decoder)
    saved to out_dir/hf; returns the model."""
    import transformers as tf

    torch.manual_seed(seed)
    vision = tf.PixtralVisionConfig(hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                    num_attention_heads=2, image_size=32, patch_size=8,
                                    head_dim=16)
    cfg = tf.Mistral3Config(text_config=hf_config("mistral3"), vision_config=vision)
    model = tf.Mistral3ForConditionalGeneration(cfg).eval()
    model.save_pretrained(out_dir / "hf", safe_serialization=True)
    return model


def _moe_config(arch: str, **overrides):
    """Eight experts (Mixtral: four), two per token, small enough that some go unused."""
    import transformers as tf

    routed = {"num_experts_per_tok": 2, **overrides}
    if arch == "qwen3moe":
        return tf.Qwen3MoeConfig(**_COMMON, **routed, head_dim=16, num_experts=8,
                                 moe_intermediate_size=32, norm_topk_prob=True, rope_theta=1e6)
    if arch == "qwen2moe":
        return tf.Qwen2MoeConfig(**_COMMON, **routed, num_experts=8, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=64, rope_theta=1e6)
    if arch == "mixtral":
        return tf.MixtralConfig(**_COMMON, **routed, num_local_experts=4, rope_theta=1e6)
    if arch == "olmoe":
        return tf.OlmoeConfig(**{**_COMMON, "intermediate_size": 32}, **routed, num_experts=8,
                              pad_token_id=0, bos_token_id=1, eos_token_id=2)
    raise ValueError(arch)


def build(arch: str, out_dir: Path, seed: int = 0, **overrides):
    """Random model in fp32; writes out_dir/hf (safetensors) and out_dir/model.gguf.

    `overrides` change the Llama config (e.g. num_attention_heads) for shape-specific tests.
    """
    import transformers as tf

    torch.manual_seed(seed)
    cfg = hf_config(arch, **overrides)
    gemma = arch in ("gemma3", "gemma2")  # norms stored as w, applied as 1 + w
    cls = tf.Gemma3ForCausalLM if arch == "gemma3" else tf.AutoModelForCausalLM
    model = cls.from_config(cfg, torch_dtype=torch.float32) if arch != "gemma3" else cls(cfg)
    with torch.no_grad():  # random norms so a wrong norm convention shows
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.1 + (0.0 if gemma else 1.0))
            elif name.endswith("mlp.gate.weight"):  # routers far from ties between experts
                p.normal_(0.0, 0.5)
        for name, b in model.named_buffers():  # GLM-4.5's choice bias: it must matter
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    model.eval()
    model.save_pretrained(out_dir / "hf", safe_serialization=True)
    write_gguf(arch, model, out_dir / "model.gguf")
    return model


def write_gguf(arch: str, model, path: Path, quantize=None) -> None:
    """`quantize`: a gguf.GGMLQuantizationType for the expert tensors (others stay F32)."""
    import gguf

    cfg = model.config
    arch = _GGUF_ARCH.get(arch, arch)
    w = gguf.GGUFWriter(str(path), arch)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if arch != "glm4moe":
        w.add_uint32(f"{arch}.block_count", cfg.num_hidden_layers)
    w.add_uint32(f"{arch}.context_length", cfg.max_position_embeddings)
    w.add_uint32(f"{arch}.embedding_length", cfg.hidden_size)
    w.add_uint32(f"{arch}.feed_forward_length", cfg.intermediate_size)
    w.add_uint32(f"{arch}.attention.head_count", cfg.num_attention_heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", cfg.num_key_value_heads)
    w.add_uint32(f"{arch}.attention.key_length", head_dim)
    w.add_uint32(f"{arch}.attention.value_length", head_dim)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_uint32(f"{arch}.vocab_size", cfg.vocab_size)
    theta = _rope_theta(cfg, arch)
    w.add_float32(f"{arch}.rope.freq_base", theta)
    if arch in ("gemma3", "gemma2"):
        w.add_uint32(f"{arch}.attention.sliding_window", cfg.sliding_window)
    if arch == "gemma2":
        w.add_float32(f"{arch}.attn_logit_softcapping", cfg.attn_logit_softcapping)
        w.add_float32(f"{arch}.final_logit_softcapping", cfg.final_logit_softcapping)
    _add_moe_keys(w, arch, cfg)
    _add_keys_2025(w, arch, cfg)
    if _longrope(cfg):  # as llama.cpp's converter writes them; the factors are tensors
        original = cfg.original_max_position_embeddings
        scale = cfg.max_position_embeddings / original
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", original)
        w.add_float32(f"{arch}.rope.scaling.attn_factor",
                      math.sqrt(1 + math.log(scale) / math.log(original)))
    _add_byte_tokenizer(w, cfg.vocab_size)
    _write_tensors(w, _gguf_tensors(arch, model), quantize)


def _write_tensors(w, tensors, quantize) -> None:
    """Add (name, tensor) pairs as F32, the expert matrices as `quantize` when given, and
    write the file."""
    import gguf

    for name, t in tensors:
        data = t.detach().float().contiguous().numpy().astype(np.float32)
        if quantize is not None and name.endswith("_exps.weight"):
            data = gguf.quants.quantize(data, quantize)  # blocks along the last axis
            w.add_tensor(name, data, raw_dtype=quantize)
        else:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _add_moe_keys(w, arch: str, cfg) -> None:
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if not experts:
        return
    w.add_uint32(f"{arch}.expert_count", experts)
    w.add_uint32(f"{arch}.expert_used_count", cfg.num_experts_per_tok)
    inter = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    w.add_uint32(f"{arch}.expert_feed_forward_length", inter)
    if getattr(cfg, "shared_expert_intermediate_size", None):
        w.add_uint32(f"{arch}.expert_shared_feed_forward_length",
                     cfg.shared_expert_intermediate_size)


def _add_yarn_keys(w, arch: str, rope: dict) -> None:
    """YaRN's keys as llama.cpp's converter writes an HF rope_parameters dict."""
    w.add_string(f"{arch}.rope.scaling.type", "yarn")
    w.add_float32(f"{arch}.rope.scaling.factor", rope["factor"])
    w.add_uint32(f"{arch}.rope.scaling.original_context_length",
                 rope["original_max_position_embeddings"])
    w.add_float32(f"{arch}.rope.scaling.yarn_beta_fast", rope["beta_fast"])
    w.add_float32(f"{arch}.rope.scaling.yarn_beta_slow", rope["beta_slow"])


def _add_keys_2025(w, arch: str, cfg) -> None:
    """Metadata as llama.cpp's converter writes it for the 2025 families."""
    if arch == "mistral3":
        rope = cfg.rope_parameters
        _add_yarn_keys(w, arch, rope)
        w.add_float32(f"{arch}.rope.scaling.yarn_log_multiplier", rope["mscale_all_dim"])
        w.add_float32(f"{arch}.attention.temperature_scale", rope["llama_4_scaling_beta"])
    if arch == "olmo2" and getattr(cfg, "sliding_window", None):  # OLMo 3
        w.add_uint32(f"{arch}.attention.sliding_window", cfg.sliding_window)
        w.add_array(f"{arch}.attention.sliding_window_pattern",
                    [t == "sliding_attention" for t in cfg.layer_types])
        _add_yarn_keys(w, arch, cfg.rope_parameters["full_attention"])
    if arch == "glm4moe":  # block_count counts the one MTP layer _nextn_tensors adds
        w.add_uint32(f"{arch}.block_count", cfg.num_hidden_layers + 1)
        w.add_uint32(f"{arch}.nextn_predict_layers", 1)
        w.add_uint32(f"{arch}.rope.dimension_count",
                     int(cfg.head_dim * cfg.rope_parameters["partial_rotary_factor"]))
        w.add_uint32(f"{arch}.expert_shared_count", cfg.n_shared_experts)
        w.add_uint32(f"{arch}.leading_dense_block_count", cfg.first_k_dense_replace)
        w.add_uint32(f"{arch}.expert_gating_func", 2)  # sigmoid
        w.add_float32(f"{arch}.expert_weights_scale", cfg.routed_scaling_factor)
        w.add_bool(f"{arch}.expert_weights_norm", cfg.norm_topk_prob)


def _add_byte_tokenizer(w, vocab_size: int) -> None:
    """A merge-free byte-level BPE vocabulary: printable ASCII, then space and newline."""
    tokens = [chr(c) for c in range(33, 127)] + ["\u0120", "\u010a"]
    assert len(tokens) == vocab_size
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "default")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", [1] * vocab_size)
    w.add_array("tokenizer.ggml.merges", ["! !"])
    w.add_uint32("tokenizer.ggml.eos_token_id", vocab_size - 1)
    w.add_bool("tokenizer.ggml.add_bos_token", False)


def _rope_theta(cfg, arch: str) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    if "full_attention" in params:  # Gemma 3, OLMo 3: the full-attention layers' theta
        return float(params["full_attention"]["rope_theta"])
    return float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",
          "mlp.gate": "ffn_gate_inp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
          "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
          "mlp.shared_expert.up_proj": "ffn_up_shexp",
          "mlp.shared_expert.down_proj": "ffn_down_shexp"}
_LAYER_LLAMA = {"post_attention_layernorm": "ffn_norm"}
_LAYER_POST_NORMS = {"post_attention_layernorm": "post_attention_norm",  # OLMo 2
                     "post_feedforward_layernorm": "post_ffw_norm"}
_LAYER_GLM = {"post_attention_layernorm": "post_attention_norm",  # its pre-MLP norm
              "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
              "mlp.shared_experts.up_proj": "ffn_up_shexp",
              "mlp.shared_experts.down_proj": "ffn_down_shexp"}
_LAYER_GEMMA = {"post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}


def _gguf_tensors(arch: str, model):
    cfg = model.config
    gemma = arch in ("gemma3", "gemma2")
    table = {**_LAYER, **(_LAYER_GEMMA if gemma else _LAYER_LLAMA)}
    table.update(_LAYER_POST_NORMS if arch == "olmo2" else
                 _LAYER_GLM if arch == "glm4moe" else {})
    for name, t in model.state_dict().items():
        if name == "model.embed_tokens.weight":
            yield "token_embd.weight", t
        elif name == "model.norm.weight":
            yield "output_norm.weight", t + 1 if gemma else t
        elif name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                yield "output.weight", t
        elif ".mlp.experts." in name:
            yield from _expert_tensors(name, t)
        elif name.endswith("mlp.gate.e_score_correction_bias"):
            yield f"blk.{name.split('.')[2]}.exp_probs_b.bias", t
        elif name.startswith("model.layers."):
            yield _layer_tensor(arch, cfg, name, t, table)
    if arch == "llama":
        yield "rope_freqs.weight", _llama3_freq_factors(model)
    if arch == "glm4moe":
        yield from _nextn_tensors(cfg)
    longrope = _longrope(cfg)
    if longrope:
        yield "rope_factors_short.weight", torch.tensor(longrope["short_factor"])
        yield "rope_factors_long.weight", torch.tensor(longrope["long_factor"])


def _longrope(cfg) -> dict | None:
    scaling = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    return scaling if scaling.get("rope_type") == "longrope" else None


def _expert_tensors(name: str, t: torch.Tensor):
    """transformers' fused [experts, 2 * inter, hidden] gate|up and [experts, hidden, inter]
    down -> llama.cpp's ffn_{gate,up,down}_exps, each [experts, out, in]."""
    i = name.split(".")[2]
    if name.endswith("gate_up_proj"):
        gate, up = t.chunk(2, dim=1)
        yield f"blk.{i}.ffn_gate_exps.weight", gate
        yield f"blk.{i}.ffn_up_exps.weight", up
    else:
        yield f"blk.{i}.ffn_down_exps.weight", t


def _layer_tensor(arch: str, cfg, name: str, t: torch.Tensor, table: dict):
    _, _, i, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    if arch in ("gemma3", "gemma2") and module.endswith("norm"):
        t = t + 1
    if arch in _PERMUTED_QK and module in ("self_attn.q_proj", "self_attn.k_proj"):
        heads = cfg.num_attention_heads if "q_proj" in module else cfg.num_key_value_heads
        t = _permute(t, heads)
    return f"blk.{i}.{table[module]}.{kind}", t


def _nextn_tensors(cfg):
    """GLM-4.5's multi-token-prediction block after the last layer, as llama.cpp names it
    (random: a loader that ran it would change the logits)."""
    i, hidden = cfg.num_hidden_layers, cfg.hidden_size
    yield f"blk.{i}.nextn.eh_proj.weight", torch.randn(hidden, 2 * hidden)
    yield f"blk.{i}.nextn.enorm.weight", torch.randn(hidden)
    yield f"blk.{i}.nextn.hnorm.weight", torch.randn(hidden)
    yield f"blk.{i}.attn_norm.weight", torch.randn(hidden)


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter interleaves each head's rotary halves for ggml's rope."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .transpose(1, 2).reshape(w.shape))


def _llama3_freq_factors(model) -> torch.Tensor:
    """Per-frequency divisors that turn plain rope into llama3-scaled rope."""
    rotary = model.model.rotary_emb
    head_dim = rotary.inv_freq.shape[0] * 2
    theta = _rope_theta(model.config, "llama")
    plain = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    return plain / rotary.inv_freq.float()


# ---- hybrid models: recurrent layers beside attention ---------------------------------------

HYBRID_ARCHS = ("lfm2", "qwen3_5", "qwen3_5_moe", "granitehybrid", "granitehybrid_moe",
                "lfm2_moe", "nemotron_h", "nemotron_h_moe")
# llama.cpp's converter (convert_hf_to_gguf.py with conversion/ and gguf-py/), which
# `make test` unpacks from the llama-cpp-python sdist; KVLAB_LLAMA_CONVERTER names another tree
LLAMA_CPP = Path(os.environ.get("KVLAB_LLAMA_CONVERTER", Path(__file__).resolve().parent.parent
                                / ".cache" / "llama_cpp_python-0.3.36"))


def hybrid_config(arch: str, **overrides):
    """Four layers, recurrent ones first and between: LFM2 conv / attention alternating,
    Qwen3.5 three Gated DeltaNet layers then one gated attention layer, with twice as many
    value heads as key heads (the grouped layout GGUF reorders) and keys narrower than
    values (llama.cpp's qwen35 takes only equal widths: override linear_key_head_dim).
    `overrides` change the config."""
    import transformers as tf

    common = {**_COMMON, "num_hidden_layers": 4, **overrides}
    if arch in ("lfm2", "lfm2_moe"):  # conv / attention by turns over every layer asked for
        n = common["num_hidden_layers"]
        common.setdefault("layer_types", (["conv", "full_attention"] * n)[:n])
    if arch == "lfm2":
        return tf.Lfm2Config(**common, conv_L_cache=3, norm_eps=1e-5,
                             block_auto_adjust_ff_dim=False)
    if arch == "lfm2_moe":  # a dense first layer, then eight experts of which two run
        return tf.Lfm2MoeConfig(**{**common, "tie_word_embeddings": True}, conv_L_cache=3,
                                norm_eps=1e-6,  # tied: llama.cpp's lfm2moe has no output
                                num_dense_layers=1, num_experts=8, num_experts_per_tok=2,
                                moe_intermediate_size=32)  # GGUF has no routed scale
    delta = {"head_dim": 16, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 8,
             "linear_value_head_dim": 16, "linear_num_key_heads": 2,
             "linear_num_value_heads": 4,
             "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                 "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0]}}
    delta = {k: v for k, v in delta.items() if k not in overrides}
    if arch == "qwen3_5":
        return tf.Qwen3_5TextConfig(**common, **delta)
    if arch == "qwen3_5_moe":
        experts = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 48}
        return tf.Qwen3_5MoeTextConfig(**{**experts, **common}, **delta)
    if arch.startswith("granitehybrid"):
        return granite_hybrid_config(common, moe=arch.endswith("_moe"))
    if arch.startswith("nemotron_h"):
        return nemotron_h_config(common, moe=arch.endswith("_moe"))
    raise ValueError(arch)


GRANITE_LAYER_TYPES = ["mamba", "attention", "mamba", "attention"]


def granite_hybrid_config(common: dict, moe: bool):
    """Granite 4 hybrid: Mamba-2 (8 heads of 16 in 2 groups, state 16, scan chunks of 8) and
    attention without RoPE by turns, Granite's four multipliers away from 1, the shared MLP
    alone or beside eight experts of which two run."""
    import transformers as tf

    layers = common["num_hidden_layers"]
    defaults = {
        "layer_types": (GRANITE_LAYER_TYPES * layers)[:layers],
        # dense: the shared MLP is the MLP, as wide as intermediate_size (llama.cpp's n_ff)
        "shared_intermediate_size": 48 if moe else common["intermediate_size"],
        "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 2, "mamba_d_state": 16,
        "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 8,
        "position_embedding_type": "nope", "embedding_multiplier": 6.0,
        "residual_multiplier": 0.5, "attention_multiplier": 0.2, "logits_scaling": 3.0,
        "bos_token_id": None, "eos_token_id": None,  # generate's min_new_tokens bans an eos
        "num_local_experts": 8 if moe else 0, "num_experts_per_tok": 2 if moe else 0}
    return tf.GraniteMoeHybridConfig(**{**defaults, **common})


NEMOTRON_PATTERNS = {False: "M*M-", True: "M*ME"}


def nemotron_h_config(common: dict, moe: bool):
    """Nemotron-H: one mixer per layer, Mamba-2 (8 heads of 16 in 2 groups, state 16, scan
    chunks of 8), attention without RoPE (heads 16 wide, not hidden / heads), and a relu2
    MLP ("-") or eight relu2 experts of which two run, sigmoid-routed with a choice bias and
    scaled by 2.5, beside a shared expert ("E")."""
    import transformers as tf

    layers = common.pop("num_hidden_layers")
    defaults = {
        "hybrid_override_pattern": (NEMOTRON_PATTERNS[moe] * layers)[:layers],
        "layer_norm_epsilon": common.pop("rms_norm_eps"), "head_dim": 16,
        "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 16,
        "conv_kernel": 4, "chunk_size": 8, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 48,
        "routed_scaling_factor": 2.5, "bos_token_id": None, "eos_token_id": None}
    return tf.NemotronHConfig(**{**defaults, **common})


# the MoE keys transformers writes into every Nemotron-H config.json; NVIDIA's dense
# checkpoints have none, and llama.cpp's converter takes any of them for the MoE variant
_NEMOTRON_MOE_KEYS = ("moe_intermediate_size", "moe_latent_size", "n_group", "topk_group",
                      "moe_shared_expert_intermediate_size", "moe_shared_expert_overlap",
                      "n_routed_experts", "n_shared_experts", "norm_topk_prob",
                      "num_experts_per_tok", "routed_scaling_factor", "mtp_layers_block_type",
                      "num_nextn_predict_layers")


def _nemotron_config_json(path: Path, moe: bool) -> None:
    """config.json as NVIDIA's checkpoints write it: the hybrid_override_pattern string and
    num_hidden_layers, not transformers' layers_block_type; MoE keys only in the MoE one."""
    saved = json.loads(path.read_text())
    kinds = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
    pattern = "".join(kinds[t] for t in saved.pop("layers_block_type"))
    saved |= {"hybrid_override_pattern": pattern, "num_hidden_layers": len(pattern)}
    for key in () if moe else _NEMOTRON_MOE_KEYS:
        saved.pop(key, None)
    path.write_text(json.dumps(saved))


def build_hybrid(arch: str, out_dir: Path, seed: int = 0, **overrides):
    """Random fp32 hybrid model saved as out_dir/hf (safetensors); norms and routers random
    so that a wrong norm convention or expert choice shows."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = hybrid_config(arch, **overrides)
    cls = {"lfm2": tf.Lfm2ForCausalLM, "qwen3_5": tf.Qwen3_5ForCausalLM,
           "qwen3_5_moe": tf.Qwen3_5MoeForCausalLM,
           "granitehybrid": tf.GraniteMoeHybridForCausalLM,
           "granitehybrid_moe": tf.GraniteMoeHybridForCausalLM,
           "lfm2_moe": tf.Lfm2MoeForCausalLM, "nemotron_h": tf.NemotronHForCausalLM,
           "nemotron_h_moe": tf.NemotronHForCausalLM}[arch]
    model = cls(cfg).float().eval()
    zero_centered = arch.startswith("qwen3_5")  # 1 + w norms (not linear_attn.norm)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                centre = 0.0 if zero_centered and "linear_attn.norm" not in name else 1.0
                p.copy_(torch.randn_like(p) * 0.1 + centre)
            elif name.endswith(("mlp.gate.weight", "router.layer.weight",
                                "feed_forward.gate.weight", "mixer.gate.weight")):
                p.normal_(0.0, 0.5)
        for name, b in model.named_buffers():  # LFM2-MoE's and Nemotron-H's choice bias
            if name.endswith(("expert_bias", "e_score_correction_bias")):
                b.normal_(0.0, 0.3)
    model.save_pretrained(out_dir / "hf", safe_serialization=True)
    if arch.startswith("granitehybrid"):  # layer types as Granite's own configs name them
        path = out_dir / "hf" / "config.json"
        saved = json.loads(path.read_text())
        saved["layer_types"] = ["mamba" if t == "linear_attention" else "attention"
                                for t in cfg.layer_types]
        path.write_text(json.dumps(saved))
    if arch.startswith("nemotron_h"):
        _nemotron_config_json(out_dir / "hf" / "config.json", moe=arch.endswith("_moe"))
    return model


def build_qwen35_mtp(arch: str, out_dir: Path, seed: int = 0):
    """A Qwen3.5 (arch "qwen3_5" or "qwen3_5_moe") of four main layers whose checkpoint also
    carries a multi-token-prediction layer, as Qwen's do (transformers writes none): built
    with a fifth, full-attention layer, which is moved to mtp.layers.0.*, beside random
    mtp.fc and the 1 + w norms mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden and
    mtp.norm; config.json says 4 layers and mtp_num_hidden_layers 1. Returns the
    five-layer transformers model and the mtp.* tensors other than the layer's."""
    from safetensors.torch import load_file, save_file

    types = ["linear_attention"] * 3 + ["full_attention"] * 2
    model = build_hybrid(arch, out_dir, seed, num_hidden_layers=5, layer_types=types)
    torch.manual_seed(seed + 1)
    hidden = model.config.hidden_size
    own = {"mtp.fc.weight": torch.randn(hidden, 2 * hidden) * 0.2,
           **{f"mtp.{n}.weight": torch.randn(hidden) * 0.1
              for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}}
    (path,) = (out_dir / "hf").glob("*.safetensors")
    prefix = "model.layers.4."
    tensors = {("mtp.layers.0." + k[len(prefix):] if k.startswith(prefix) else k): v
               for k, v in load_file(path).items()}
    save_file({**tensors, **own}, path, metadata={"format": "pt"})
    config = json.loads((out_dir / "hf" / "config.json").read_text())
    config.update(num_hidden_layers=4, layer_types=types[:4], mtp_num_hidden_layers=1)
    (out_dir / "hf" / "config.json").write_text(json.dumps(config))
    return model, own


def byte_tokenizer_metadata(vocab_size: int) -> dict:
    """GGUF tokenizer metadata of the byte-level vocabulary _add_byte_tokenizer writes."""
    tokens = [chr(c) for c in range(33, 127)] + ["\u0120", "\u010a"]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
            "tokenizer.ggml.tokens": tokens[:vocab_size],
            "tokenizer.ggml.token_type": [1] * vocab_size,
            "tokenizer.ggml.merges": ["! !"], "tokenizer.ggml.eos_token_id": vocab_size - 1,
            "tokenizer.ggml.add_bos_token": False}


# llama.cpp's converter, run on a tiny checkpoint: its model class as convert_hf_to_gguf.py
# picks it, the byte vocabulary above in place of a tokenizer file, no MTP layers.
# Nemotron-H's config.json is read as written (the converter's own path where transformers
# cannot parse a config): through transformers 5's NemotronHConfig it would find MoE keys in
# a dense config and layer names it does not map
_CONVERT = """
import json, sys
from pathlib import Path
RAW_CONFIG = {"nemotron_h"}
root, src, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
sys.path[:0] = [str(root), str(root / "gguf-py")]
import torch, gguf
import convert_hf_to_gguf  # noqa: F401  (registers the model classes)
from conversion import ModelBase, ModelType, get_model_architecture, get_model_class
if json.loads((src / "config.json").read_text()).get("model_type") in RAW_CONFIG:
    ModelBase.load_hparams = staticmethod(
        lambda d, is_mistral_format=False: json.loads((Path(d) / "config.json").read_text()))
hparams = ModelBase.load_hparams(src, False)
cls = get_model_class(get_model_architecture(hparams, ModelType.TEXT), mmproj=False)
def byte_vocab(self):
    n = self.hparams["vocab_size"]
    tokens = [chr(c) for c in range(33, 127)] + ["\\u0120", "\\u010a"]
    w = self.gguf_writer
    w.add_tokenizer_model("gpt2"); w.add_tokenizer_pre("default")
    w.add_token_list(tokens[:n]); w.add_token_types([1] * n); w.add_token_merges(["! !"])
    w.add_eos_token_id(n - 1); w.add_add_bos_token(False)
cls.set_vocab = byte_vocab
for inner in list(vars(cls).values()):  # Mistral 3 converts through a nested model class
    if isinstance(inner, type) and hasattr(inner, "set_vocab"):
        inner.set_vocab = byte_vocab
cls.no_mtp = True
with torch.inference_mode():
    cls(src, gguf.LlamaFileType.ALL_F32, out, eager=True).write()
"""


def convert_with_llama_cpp(hf_dir: Path, out: Path) -> str | None:
    """Write out (GGUF, f32) with llama.cpp's converter; the reason it could not, or None."""
    import subprocess
    import sys

    if not (LLAMA_CPP / "convert_hf_to_gguf.py").exists():
        return f"llama.cpp's converter is not at {LLAMA_CPP}"
    run = subprocess.run([sys.executable, "-c", _CONVERT, str(LLAMA_CPP), str(hf_dir), str(out)],
                         check=False, capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        return f"llama.cpp's converter failed: {run.stderr[-2000:]}"
    return None


# ---- gpt-oss: sinks, alternating sliding window, YaRN, biased clamped-SwiGLU experts --------

def gpt_oss_config():
    """Four layers sliding / full by turns (window 4, so 14 tokens pass it), YaRN over an
    original context of 64, eight experts of which two run, gpt-oss's SwiGLU clamp."""
    import transformers as tf

    return tf.GptOssConfig(
        **{**_COMMON, "intermediate_size": 32, "num_hidden_layers": 4}, head_dim=16,
        num_local_experts=8, num_experts_per_tok=2, sliding_window=4,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 64},
        attn_implementation="eager")


def build_gpt_oss(out_dir: Path, seed: int = 0):
    """Random fp32 gpt-oss saved as out_dir/hf and (the gguf writer, llama.cpp's names)
    out_dir/model.gguf. Biases and sinks random, gate|up weights large enough that the
    SwiGLU clamp at 7 bites, routers far from ties."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.GptOssForCausalLM(gpt_oss_config()).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.randn_like(p) * 0.1 + 1.0)
            elif name.endswith(("bias", "sinks", "gate_up_proj")) or "router" in name:
                p.normal_(0.0, 0.5)
            elif name.endswith("down_proj"):
                p.normal_(0.0, 0.05)
    model.save_pretrained(out_dir / "hf", safe_serialization=True)
    write_gpt_oss_gguf(model, out_dir / "model.gguf")
    return model


def write_gpt_oss_gguf(model, path: Path, quantize=None) -> None:
    """As llama.cpp's converter writes gpt-oss (`gpt-oss`): gate and up experts apart as
    [experts, out, in], biases beside them, sinks as attn_sinks.weight, YaRN keys.
    `quantize`: a gguf.GGMLQuantizationType for the expert matrices (others F32)."""
    import gguf

    cfg, arch = model.config, "gpt-oss"
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (("block_count", cfg.num_hidden_layers),
                       ("context_length", cfg.max_position_embeddings),
                       ("embedding_length", cfg.hidden_size),
                       ("feed_forward_length", cfg.intermediate_size),
                       ("attention.head_count", cfg.num_attention_heads),
                       ("attention.head_count_kv", cfg.num_key_value_heads),
                       ("attention.key_length", cfg.head_dim),
                       ("attention.value_length", cfg.head_dim),
                       ("attention.sliding_window", cfg.sliding_window),
                       ("vocab_size", cfg.vocab_size)):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_float32(f"{arch}.rope.freq_base", cfg.rope_parameters["rope_theta"])
    _add_yarn_keys(w, arch, cfg.rope_parameters)
    _add_moe_keys(w, arch, cfg)
    _add_byte_tokenizer(w, cfg.vocab_size)
    _write_tensors(w, _gpt_oss_tensors(model), quantize)


_GPT_OSS_LAYER = {"input_layernorm.weight": "attn_norm.weight",
                  "post_attention_layernorm.weight": "post_attention_norm.weight",
                  "self_attn.sinks": "attn_sinks.weight",
                  "mlp.router.weight": "ffn_gate_inp.weight",
                  "mlp.router.bias": "ffn_gate_inp.bias",
                  **{f"self_attn.{p}_proj.{kind}": f"attn_{g}.{kind}"
                     for p, g in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output"))
                     for kind in ("weight", "bias")}}


def _gpt_oss_tensors(model):
    """HF's x @ W experts with interleaved gate / up -> llama.cpp's per-expert [out, in]."""
    yield "token_embd.weight", model.model.embed_tokens.weight
    yield "output_norm.weight", model.model.norm.weight
    yield "output.weight", model.lm_head.weight
    for i, layer in enumerate(model.model.layers):
        for name, t in layer.state_dict().items():
            if name in _GPT_OSS_LAYER:
                yield f"blk.{i}.{_GPT_OSS_LAYER[name]}", t
        ex = layer.mlp.experts
        gate_up = ex.gate_up_proj.transpose(1, 2)  # [E, 2 * inter, hidden]
        yield f"blk.{i}.ffn_gate_exps.weight", gate_up[:, ::2]
        yield f"blk.{i}.ffn_up_exps.weight", gate_up[:, 1::2]
        yield f"blk.{i}.ffn_down_exps.weight", ex.down_proj.transpose(1, 2)
        yield f"blk.{i}.ffn_gate_exps.bias", ex.gate_up_proj_bias[:, ::2]
        yield f"blk.{i}.ffn_up_exps.bias", ex.gate_up_proj_bias[:, 1::2]
        yield f"blk.{i}.ffn_down_exps.bias", ex.down_proj_bias


def save_gpt_oss_mxfp4(model, out_dir: Path) -> None:
    """The model as OpenAI publishes gpt-oss: experts as MXFP4 `_blocks` [E, out, in / 32,
    16] (element 2j in byte j's low nibble, 2j + 1 in its high one) and E8M0 `_scales`
    [E, out, in / 32], rounded by gguf's quantizer; everything else as saved."""
    import gguf
    from safetensors.torch import save_file

    tensors = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    for i, layer in enumerate(model.model.layers):
        ex, prefix = layer.mlp.experts, f"model.layers.{i}.mlp.experts."
        for name, w in (("gate_up_proj", ex.gate_up_proj), ("down_proj", ex.down_proj)):
            del tensors[prefix + name]
            rows = w.detach().transpose(1, 2).float().contiguous().numpy()  # [E, out, in]
            q = gguf.quants.quantize(rows, gguf.GGMLQuantizationType.MXFP4)
            q = torch.from_numpy(q).reshape(*rows.shape[:2], -1, 17)
            elems = torch.cat([q[..., 1:] & 0x0F, q[..., 1:] >> 4], dim=-1)  # GGML: j, j + 16
            tensors[prefix + name + "_blocks"] = (elems[..., 0::2] | elems[..., 1::2] << 4
                                                  ).contiguous()
            tensors[prefix + name + "_scales"] = q[..., 0].contiguous()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (out_dir / "config.json").write_text(json.dumps(config))


def _mxfp4_values(t: torch.Tensor) -> torch.Tensor:
    """t's values after MXFP4 (blocks of 32 along the last axis), as gguf rounds them."""
    import gguf

    mx = gguf.GGMLQuantizationType.MXFP4
    q = gguf.quants.quantize(t.detach().float().contiguous().numpy(), mx)
    return torch.from_numpy(gguf.quants.dequantize(q, mx)).reshape(t.shape)


def mxfp4_rounded(model):
    """A copy of a gpt-oss model whose experts hold their MXFP4-rounded values."""
    import copy

    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for layer in rounded.model.layers:
            ex = layer.mlp.experts  # MXFP4 rows run along hidden (gate|up) and inter (down)
            ex.gate_up_proj.copy_(_mxfp4_values(ex.gate_up_proj.transpose(1, 2)).transpose(1, 2))
            ex.down_proj.copy_(_mxfp4_values(ex.down_proj.transpose(1, 2)).transpose(1, 2))
    return rounded


# ---- DeepSeek-V3 / V2: multi-head latent attention, sigmoid-routed grouped experts ---------

def deepseek_config(v2: bool = False, **overrides):
    """Three layers, the first dense; latent attention with a 32-wide latent, 16 + 8 query
    dims per head (8 rotated) and 16-wide values; DeepSeek-V3: eight experts in four groups
    of which two are kept, two experts per token and a shared one; V2: softmax routing.
    `overrides` change the config (q_lora_rank None: q is one product)."""
    import transformers as tf

    common = {**_COMMON, "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32,
              "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
              "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
              "n_shared_experts": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5,
              "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    if v2:
        return tf.DeepseekV2Config(**{**common, "topk_method": "greedy", "n_group": 1,
                                      "topk_group": 1, **overrides})
    # scoring_func / topk_method as DeepSeek-V3's own config.json has them (llama.cpp's
    # converter reads the router's kind from scoring_func)
    return tf.DeepseekV3Config(**{**common, "n_group": 4, "topk_group": 2,
                                  "norm_topk_prob": True, "scoring_func": "sigmoid",
                                  "topk_method": "noaux_tc", **overrides})


def build_deepseek(out_dir: Path, seed: int = 0, v2: bool = False, **overrides):
    """Random fp32 DeepSeek model saved as out_dir/hf (safetensors); norms, routers and the
    choice bias random so that a wrong convention or expert choice shows."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(deepseek_config(v2, **overrides),
                                                torch_dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.1 + 1.0)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    model.save_pretrained(out_dir / "hf", safe_serialization=True)
    return model


# ---- Gemma 4: per-layer inputs, KV sharing, full layers of their own shape ------------------

def gemma4_config(**overrides):
    """Six layers (sliding and full by turns; window 4), full layers 32 wide against the
    sliding ones' 16, proportional RoPE on a quarter of them; the last two layers read the
    K/V of layers 2 and 3 (llama.cpp takes the last two unshared layers to be sliding then
    full) and have double-wide MLPs; 16-wide per-layer inputs; logits capped
    at 3. `k_eq_v=True` gives the large models' form instead: no per-layer inputs, no
    sharing, full layers with one KV head and keys for values; `moe=True` adds to that
    four routed experts (two per token) beside each dense MLP, as 26B-A4B has."""
    import transformers as tf

    k_eq_v = overrides.pop("k_eq_v", False)
    if overrides.pop("moe", False):
        overrides = {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
                     "moe_intermediate_size": 32, **overrides}
    shape = ({"attention_k_eq_v": True, "num_global_key_value_heads": 1,
              "num_kv_shared_layers": 0, "hidden_size_per_layer_input": 0}
             if k_eq_v else {"num_kv_shared_layers": 2, "hidden_size_per_layer_input": 16,
                             "use_double_wide_mlp": True})
    rope = {"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                               "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    return tf.Gemma4TextConfig(**{
        **_COMMON, "tie_word_embeddings": True, "num_hidden_layers": 6, "head_dim": 16,
        "global_head_dim": 32, "sliding_window": 4, "vocab_size_per_layer_input": 96,
        "layer_types": ["sliding_attention", "full_attention"] * 3,
        "final_logit_softcapping": 3.0, "rope_parameters": rope, "pad_token_id": 0,
        "bos_token_id": 2, "eos_token_id": 1, **shape, **overrides})


def build_gemma4(out_dir: Path, seed: int = 0, **overrides):
    """Random Gemma4ForCausalLM in fp32 (norms and layer scalars random too) -> out_dir/hf and
    out_dir/model.gguf, written as llama.cpp's converter names and describes it."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.Gemma4ForCausalLM(gemma4_config(**overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.1 + 1.0)
            elif name.endswith("router.proj.weight"):  # routers far from ties between experts
                p.normal_(0.0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(torch.rand_like(b) + 0.5)
    model.save_pretrained(out_dir / "hf", safe_serialization=True)
    write_gemma4_gguf(model, out_dir / "model.gguf")
    return model


def write_gemma4_gguf(model, path: Path) -> None:
    import gguf

    cfg, arch = model.config, "gemma4"
    w = gguf.GGUFWriter(str(path), arch)
    full = [t == "full_attention" for t in cfg.layer_types]
    first_shared = cfg.num_hidden_layers - cfg.num_kv_shared_layers
    # head sizes and KV heads are per layer in transformers' config: a full and a sliding one
    glob, local = (cfg.per_layer_config[full.index(f)] for f in (True, False))
    global_dim, global_kv = glob.head_dim, glob.num_key_value_heads
    wide = 2 if cfg.use_double_wide_mlp else 1
    for key, value in (("block_count", cfg.num_hidden_layers),
                       ("context_length", cfg.max_position_embeddings),
                       ("embedding_length", cfg.hidden_size),
                       ("attention.head_count", cfg.num_attention_heads),
                       ("attention.key_length", global_dim),
                       ("attention.value_length", global_dim),
                       ("attention.key_length_swa", local.head_dim),
                       ("attention.value_length_swa", local.head_dim),
                       ("attention.sliding_window", cfg.sliding_window),
                       ("attention.shared_kv_layers", cfg.num_kv_shared_layers),
                       ("embedding_length_per_layer_input", cfg.hidden_size_per_layer_input),
                       ("rope.dimension_count", global_dim),
                       ("rope.dimension_count_swa", local.head_dim)):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_array(f"{arch}.feed_forward_length",
                [cfg.intermediate_size * (wide if i >= first_shared else 1)
                 for i in range(cfg.num_hidden_layers)])
    w.add_array(f"{arch}.attention.head_count_kv",
                [global_kv if f else local.num_key_value_heads for f in full])
    w.add_array(f"{arch}.attention.sliding_window_pattern", [not f for f in full])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_float32(f"{arch}.rope.freq_base", cfg.rope_parameters["full_attention"]["rope_theta"])
    w.add_float32(f"{arch}.rope.freq_base_swa",
                  cfg.rope_parameters["sliding_attention"]["rope_theta"])
    w.add_float32(f"{arch}.final_logit_softcapping", cfg.final_logit_softcapping)
    if cfg.enable_moe_block:
        w.add_uint32(f"{arch}.expert_count", cfg.num_experts)
        w.add_uint32(f"{arch}.expert_used_count", cfg.top_k_experts)
        w.add_uint32(f"{arch}.expert_feed_forward_length", cfg.moe_intermediate_size)
    _add_byte_tokenizer(w, cfg.vocab_size)
    _write_tensors(w, _gemma4_tensors(model, global_dim), None)


_GEMMA4_GLOBALS = {"model.embed_tokens.weight": "token_embd.weight",
                   "model.norm.weight": "output_norm.weight",
                   "model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
                   "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
                   "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight"}
_GEMMA4_LAYER = {**_LAYER, **_LAYER_GEMMA, "per_layer_input_gate": "inp_gate",
                 "per_layer_projection": "proj", "post_per_layer_input_norm": "post_norm",
                 "pre_feedforward_layernorm_2": "pre_ffw_norm_2",
                 "post_feedforward_layernorm_1": "post_ffw_norm_1",
                 "post_feedforward_layernorm_2": "post_ffw_norm_2"}
# the MoE layers' whole names after blk.N. (llama.cpp keeps both router scales as .scale)
_GEMMA4_MOE = {"layer_scalar": "layer_output_scale.weight",
               "router.proj.weight": "ffn_gate_inp.weight", "router.scale": "ffn_gate_inp.scale",
               "router.per_expert_scale": "ffn_down_exps.scale",
               "experts.gate_up_proj": "ffn_gate_up_exps.weight",
               "experts.down_proj": "ffn_down_exps.weight"}


def _gemma4_tensors(model, global_dim: int):
    """llama.cpp's names; norms as stored (Gemma 4 applies w, not 1 + w); rope_freqs: 1 on
    the full layers' rotated pairs, 1e30 (no rotation) on the rest."""
    rotated = int(global_dim * model.config.rope_parameters["full_attention"]
                  ["partial_rotary_factor"] / 2)
    yield "rope_freqs.weight", torch.tensor([1.0] * rotated + [1e30] * (global_dim // 2 - rotated))
    for name, t in model.state_dict().items():
        if name in _GEMMA4_GLOBALS:
            yield _GEMMA4_GLOBALS[name], t
        elif name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            if rest in _GEMMA4_MOE:
                yield f"blk.{i}.{_GEMMA4_MOE[rest]}", t
            else:
                module, kind = rest.rsplit(".", 1)
                yield f"blk.{i}.{_GEMMA4_LAYER[module]}.{kind}", t
