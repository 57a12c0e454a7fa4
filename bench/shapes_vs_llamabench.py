"""kvlab against llama-bench on published model shapes: random weights, real vocabularies.

    .venv/bin/python bench/shapes_vs_llamabench.py hybrids  [-t 2] [-r 3] [-p 512] [-n 128]
    .venv/bin/python bench/shapes_vs_llamabench.py families [-t 2] [-r 3] [-p 512] [-n 128]
    .venv/bin/python bench/shapes_vs_llamabench.py moe --workdir /tmp/kvlab-moe-shapes [-r 3]
    .venv/bin/python bench/shapes_vs_llamabench.py hybrids --build-only   (files, no timings)
    .venv/bin/python bench/shapes_vs_llamabench.py families --smoke       (-p 16 -n 4, once each)

Each shape is a row of SHAPES: a published checkpoint's config, the llama.cpp vocabulary
file its tokenizer comes from (padded with "[PAD<i>]" tokens to the checkpoint's vocabulary
size, as llama.cpp's converter pads one) and how its file is made, each step skipped when
its output exists in --workdir (/tmp/kvlab-shapes):
  hf         transformers builds the model from the config (random bf16 weights), llama.cpp's
             convert_hf_to_gguf.py writes it as F16 (its tensor names and layouts), then
             llama-quantize makes the Q4_K_M file; the intermediates are deleted;
  deepseek2  DeepSeek-V2-Lite's tensors written directly as random Q8_0 blocks under
             llama.cpp's converter's names (too large to build in transformers here), then
             llama-quantize --allow-requantize makes the Q4_K_M file;
  gpt-oss    bench/moe_families_peers.py's writer: MXFP4 experts, Q8_0 elsewhere (llama.cpp's
             MXFP4_MOE file type, the form gpt-oss is released and converted in), timed as
             written;
  moe        bench/moe_peers.py's writer, under llama.cpp's converter's names and keys for
             olmoe, qwen2moe, qwen3moe and Mixtral (`llama` with experts): llama-quantize
             --dry-run on a sparse F16 skeleton picks each tensor's Q4_K_M type, then the
             file is written straight from numpy as random blocks of those types (saving
             an F16 copy of ~15 GB and llama-quantize's pass over it, ~35 min a file on two
             busy cores). The larger checkpoints keep fewer layers than published, so that
             each file stays under ~5 GB (the report says how many): per-layer figures keep
             their meaning, the embedding and output matrices weigh more.
Vocabularies: Gemma 4 E2B (gemma-4) and DeepSeek-V2-Lite (deepseek-llm) have their own;
Qwen3.5 has the qwen35 file's 151936 tokens padded to 248320; the Qwen MoE shapes the qwen2
file's 151936, Mixtral llama-spm's 32000, OLMoE gpt-neox's 50277 (its padding dropped)
padded to 50304 (OLMoE's tokenizer is a GPT-NeoX BPE); the others' are not among llama.cpp's
files, so a BPE vocabulary of near size stands in: LFM2 falcon's 65024 padded to 65536,
granite deepseek-llm's 100015 (its padding dropped) padded to 100352, gpt-oss Llama 3's
128256 padded to 201088. The embedding and output matrices have the published sizes.
Then, on every file, `kvlab bench` and llama-bench run alternately, one repetition each per
round (bench/quant_peers.py's scheme), and the table prints median pp/tg tok/s and the
ratio kvlab / llama.cpp against the targets. Hybrids also run tg at --depth (16000) tokens
of context on both engines (llama-bench -p 0 -d, so no prompt test at that depth) and print
depth-tg over depth-0 tg for each. For the MLA shape the KV bytes per token kvlab holds
(`kvlab info`) are printed beside llama.cpp's (its KV buffer size over its cells, from
llama-bench -v).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moe_families_peers as mfp  # the sibling scripts' helpers, by path
import moe_peers as mp
import quant_peers as qp

# llama.cpp's converter and vocabulary files: the tree `make test` unpacks from the
# llama-cpp-python sdist, or KVLAB_LLAMA_CONVERTER; its binaries: KVLAB_LLAMA_BIN or --llama-bin
LLAMA_CPP = Path(os.environ.get("KVLAB_LLAMA_CONVERTER", Path(__file__).resolve().parent.parent
                                / ".cache" / "llama_cpp_python-0.3.36"))
LLAMA_BIN = Path(os.environ.get("KVLAB_LLAMA_BIN", qp.LLAMA_BIN))
TARGETS = {"pp": 1.2, "tg": 1.1}  # kvlab / llama.cpp
DEPTH_TARGET = 0.9  # tg at depth over tg at depth 0


@dataclass(frozen=True)
class Shape:
    """A published checkpoint's shape and how its benchmark file is made."""

    name: str
    area: str  # "hybrids" | "families" | "moe"
    source: str  # "hf" | "deepseek2" | "gpt-oss" | "moe"
    vocab: str  # llama.cpp's models/ggml-vocab-<vocab>.gguf
    config: dict = field(default_factory=dict)
    config_class: str = ""  # transformers' config and model classes (source "hf")
    model_class: str = ""
    saved: dict = field(default_factory=dict)  # config.json fields as the checkpoint writes them
    quant: str | None = "Q4_K_M"  # None: timed as written
    published_layers: int = 0  # the checkpoint's, where the file has fewer; 0: all of them


def _every(period: int, layers: int, kind: str, other: str, offset: int = 0) -> list[str]:
    return [kind if (i + 1 - offset) % period == 0 else other for i in range(layers)]


LFM2_ATTENTION = (2, 5, 8, 10, 12, 14)  # LFM2-350M's full_attn_idxs
GRANITE_ATTENTION = (10, 13, 17, 27)  # granite-4.0-h-350m's attention layers

SHAPES = [
    Shape("qwen3.5-0.8b", "hybrids", "hf", "qwen35", config_class="Qwen3_5TextConfig",
          model_class="Qwen3_5ForCausalLM", config={
              "vocab_size": 248320, "hidden_size": 1024, "intermediate_size": 3584,
              "num_hidden_layers": 24, "num_attention_heads": 8, "num_key_value_heads": 2,
              "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 16,
              "linear_key_head_dim": 128, "linear_value_head_dim": 128,
              "linear_conv_kernel_dim": 4, "tie_word_embeddings": True,
              "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
              "layer_types": _every(4, 24, "full_attention", "linear_attention"),
              "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                                  "partial_rotary_factor": 0.25,
                                  "mrope_section": [11, 11, 10]}}),
    Shape("lfm2-350m", "hybrids", "hf", "falcon", config_class="Lfm2Config",
          model_class="Lfm2ForCausalLM", config={
              "vocab_size": 65536, "hidden_size": 1024, "intermediate_size": 6656,
              "block_auto_adjust_ff_dim": True, "block_multiple_of": 256,
              "block_ffn_dim_multiplier": 1.0, "num_hidden_layers": 16,
              "num_attention_heads": 16, "num_key_value_heads": 8, "conv_L_cache": 3,
              "max_position_embeddings": 128000, "norm_eps": 1e-5, "tie_word_embeddings": True,
              "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
              "layer_types": ["full_attention" if i in LFM2_ATTENTION else "conv"
                              for i in range(16)]}),
    Shape("granite-4.0-h-350m", "hybrids", "hf", "deepseek-llm",
          config_class="GraniteMoeHybridConfig", model_class="GraniteMoeHybridForCausalLM",
          config={
              "vocab_size": 100352, "hidden_size": 768, "intermediate_size": 2048,
              "shared_intermediate_size": 2048, "num_hidden_layers": 32,
              "num_attention_heads": 12, "num_key_value_heads": 4,
              "num_local_experts": 0, "num_experts_per_tok": 0,
              "mamba_n_heads": 48, "mamba_d_head": 32, "mamba_n_groups": 1,
              "mamba_d_state": 128, "mamba_d_conv": 4, "mamba_expand": 2,
              "mamba_chunk_size": 256, "position_embedding_type": "nope",
              "embedding_multiplier": 12.0, "residual_multiplier": 0.246,
              "attention_multiplier": 0.015625, "logits_scaling": 3.0,
              "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
              "tie_word_embeddings": True,
              "layer_types": ["attention" if i in GRANITE_ATTENTION else "mamba"
                              for i in range(32)]},
          saved={"layer_types": ["attention" if i in GRANITE_ATTENTION else "mamba"
                                 for i in range(32)]}),
    Shape("gpt-oss-20b", "families", "gpt-oss", "llama-bpe", quant=None,
          config={"vocab": 201088}),
    Shape("gemma-4-e2b", "families", "hf", "gemma-4", config_class="Gemma4TextConfig",
          model_class="Gemma4ForCausalLM", config={
              "vocab_size": 262144, "vocab_size_per_layer_input": 262144,
              "hidden_size": 1536, "hidden_size_per_layer_input": 256,
              "intermediate_size": 6144, "use_double_wide_mlp": True,
              "num_hidden_layers": 35, "num_attention_heads": 8, "num_key_value_heads": 1,
              "head_dim": 256, "global_head_dim": 512, "num_kv_shared_layers": 20,
              "sliding_window": 512, "final_logit_softcapping": 30.0,
              "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": True, "pad_token_id": 0, "bos_token_id": 2,
              "eos_token_id": 1,
              "layer_types": _every(5, 35, "full_attention", "sliding_attention"),
              "rope_parameters": {
                  "full_attention": {"rope_type": "proportional", "rope_theta": 1e6,
                                     "partial_rotary_factor": 0.25},
                  "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}),
    Shape("deepseek-v2-lite", "families", "deepseek2", "deepseek-llm", config={
        "vocab": 102400, "hidden": 2048, "layers": 27, "heads": 16, "kv_lora": 512,
        "qk_nope": 128, "qk_rope": 64, "v_head": 128, "ffn": 10944, "expert_ffn": 1408,
        "experts": 64, "experts_used": 6, "shared": 2, "dense_layers": 1,
        "context": 163840, "rope_theta": 10000.0, "yarn_factor": 40.0,
        "yarn_original": 4096, "yarn_log_mul": 0.0707, "rms_eps": 1e-6}),
    # config: bench/moe_peers.py's MoeShape fields, from each checkpoint's config.json
    Shape("olmoe-1b-7b", "moe", "moe", "gpt-neox", config={
        "arch": "olmoe", "layers": 16, "hidden": 2048, "heads": 16, "kv_heads": 16,
        "head_dim": 128, "experts": 64, "experts_used": 8, "expert_ffn": 1024, "ffn": 1024,
        "qk_norm": "whole", "vocab": 50304, "context": 4096, "rope_theta": 1e4,
        "rms_eps": 1e-5}),
    Shape("qwen1.5-moe-a2.7b-12L", "moe", "moe", "qwen2", published_layers=24, config={
        "arch": "qwen2moe", "layers": 12, "hidden": 2048, "heads": 16, "kv_heads": 16,
        "head_dim": 128, "experts": 60, "experts_used": 4, "expert_ffn": 1408, "ffn": 5632,
        "shared_ffn": 5632, "qk_norm": "", "qkv_bias": True, "vocab": 151936,
        "context": 8192, "rope_theta": 1e6, "rms_eps": 1e-6}),
    Shape("qwen3-30b-a3b-11L", "moe", "moe", "qwen2", published_layers=48, config={
        "arch": "qwen3moe", "layers": 11, "hidden": 2048, "heads": 32, "kv_heads": 4,
        "head_dim": 128, "experts": 128, "experts_used": 8, "expert_ffn": 768, "ffn": 6144,
        "qk_norm": "head", "vocab": 151936, "context": 40960, "rope_theta": 1e6,
        "rms_eps": 1e-6}),
    Shape("mixtral-8x7b-5L", "moe", "moe", "llama-spm", published_layers=32, config={
        "arch": "llama", "layers": 5, "hidden": 4096, "heads": 32, "kv_heads": 8,
        "head_dim": 128, "experts": 8, "experts_used": 2, "expert_ffn": 14336,
        "ffn": 14336, "qk_norm": "", "vocab": 32000, "context": 32768, "rope_theta": 1e6,
        "rms_eps": 1e-5}),
]


# ---------------------------------------------------------------- building the files


def vocab_file(shape: Shape) -> Path:
    return LLAMA_CPP / "models" / f"ggml-vocab-{shape.vocab}.gguf"


def build_hf_checkpoint(shape: Shape, out: Path) -> None:
    """The model from its config in transformers, random bf16 weights (norm weights
    near their trained values' scale), saved as safetensors."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        cfg = getattr(tf, shape.config_class)(**shape.config)
        model = getattr(tf, shape.model_class)(cfg).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.normal_(1.0, 0.05)
    model.save_pretrained(out, safe_serialization=True)
    del model
    if shape.saved:
        path = out / "config.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | shape.saved))


# llama.cpp's converter on a checkpoint without tokenizer files: the tokenizer keys come
# from a llama.cpp vocabulary file (padded to the config's vocab_size); no MTP layers
_CONVERT = """
import sys
from pathlib import Path
root, src, out, bench, vocab = (Path(a) for a in sys.argv[1:6])
sys.path[:0] = [str(root), str(root / "gguf-py"), str(bench)]
import torch, gguf
import convert_hf_to_gguf  # noqa: F401  (registers the model classes)
from conversion import ModelBase, ModelType, get_model_architecture, get_model_class
import quant_peers
hparams = ModelBase.load_hparams(src, False)
cls = get_model_class(get_model_architecture(hparams, ModelType.TEXT), mmproj=False)
def real_vocab(self):
    quant_peers.copy_tokenizer(self.gguf_writer, vocab, self.hparams["vocab_size"])
cls.set_vocab = real_vocab
cls.no_mtp = True
with torch.inference_mode():
    cls(src, gguf.LlamaFileType.MOSTLY_F16, out).write()
"""


def convert_f16(hf_dir: Path, out: Path, vocab: Path, vocab_size: int) -> None:
    """hf_dir -> out (F16). A tokenizer.json of vocab_size placeholder entries goes beside
    the weights first: the Gemma converters count the vocabulary they keep in it."""
    names = {f"<{i}>": i for i in range(vocab_size)}
    (hf_dir / "tokenizer.json").write_text(json.dumps({"model": {"vocab": names},
                                                       "added_tokens": []}))
    part = out.with_suffix(".part")
    cmd = [sys.executable, "-c", _CONVERT, str(LLAMA_CPP), str(hf_dir), str(part),
           str(Path(__file__).resolve().parent), str(vocab)]
    run = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if run.returncode != 0:
        raise qp.QuantizeFailed(f"llama.cpp's converter failed: {run.stderr[-1500:]}")
    part.rename(out)


# ---- DeepSeek-V2-Lite: multi-head latent attention, q without a low-rank step


def deepseek2_tensors(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape) in llama.cpp's converter's names: K/V up-projections split
    per head into attn_k_b [heads, kv_lora, nope] and attn_v_b [heads, v, kv_lora]."""
    d, h, r = c["hidden"], c["heads"], c["kv_lora"]
    e, f, shared = c["experts"], c["expert_ffn"], c["expert_ffn"] * c["shared"]
    tensors = [("token_embd.weight", (c["vocab"], d))]
    for i in range(c["layers"]):
        tensors += [(f"blk.{i}.{name}.weight", shape) for name, shape in (
            ("attn_norm", (d,)), ("attn_q", (h * (c["qk_nope"] + c["qk_rope"]), d)),
            ("attn_kv_a_mqa", (r + c["qk_rope"], d)), ("attn_kv_a_norm", (r,)),
            ("attn_k_b", (h, r, c["qk_nope"])), ("attn_v_b", (h, c["v_head"], r)),
            ("attn_output", (d, h * c["v_head"])), ("ffn_norm", (d,)))]
        if i < c["dense_layers"]:
            tensors += [(f"blk.{i}.ffn_{k}.weight", s) for k, s in (
                ("gate", (c["ffn"], d)), ("up", (c["ffn"], d)), ("down", (d, c["ffn"])))]
        else:
            tensors += [(f"blk.{i}.{k}.weight", s) for k, s in (
                ("ffn_gate_inp", (e, d)), ("ffn_gate_exps", (e, f, d)),
                ("ffn_up_exps", (e, f, d)), ("ffn_down_exps", (e, d, f)),
                ("ffn_gate_shexp", (shared, d)), ("ffn_up_shexp", (shared, d)),
                ("ffn_down_shexp", (d, shared)))]
    return tensors + [("output_norm.weight", (d,)), ("output.weight", (c["vocab"], d))]


def _deepseek2_metadata(w, c: dict) -> None:
    arch = "deepseek2"
    w.add_string("general.name", "DeepSeek-V2-Lite-shaped (random weights)")
    w.add_uint32("general.file_type", 7)  # MOSTLY_Q8_0
    for key, value in (
            ("block_count", c["layers"]), ("context_length", c["context"]),
            ("embedding_length", c["hidden"]), ("feed_forward_length", c["ffn"]),
            ("attention.head_count", c["heads"]), ("attention.head_count_kv", 1),
            ("attention.key_length", c["kv_lora"] + c["qk_rope"]),
            ("attention.value_length", c["kv_lora"]),
            ("attention.key_length_mla", c["qk_nope"] + c["qk_rope"]),
            ("attention.value_length_mla", c["v_head"]),
            ("attention.kv_lora_rank", c["kv_lora"]), ("expert_count", c["experts"]),
            ("expert_used_count", c["experts_used"]), ("expert_group_count", 1),
            ("expert_group_used_count", 1), ("leading_dense_block_count", c["dense_layers"]),
            ("expert_feed_forward_length", c["expert_ffn"]),
            ("expert_shared_count", c["shared"]), ("rope.dimension_count", c["qk_rope"]),
            ("vocab_size", c["vocab"]),
            ("rope.scaling.original_context_length", c["yarn_original"])):
        w.add_uint32(f"{arch}.{key}", value)
    for key, value in (("rope.freq_base", c["rope_theta"]),
                       ("attention.layer_norm_rms_epsilon", c["rms_eps"]),
                       ("expert_weights_scale", 1.0), ("rope.scaling.factor", c["yarn_factor"]),
                       ("rope.scaling.yarn_log_multiplier", c["yarn_log_mul"])):
        w.add_float32(f"{arch}.{key}", value)
    w.add_string(f"{arch}.rope.scaling.type", "yarn")


def write_deepseek2_q8_0(path: Path, vocab: Path, c: dict) -> None:
    """Matrices as random Q8_0 blocks, norms 1.0 and routers N(0, 0.02) in F32, streamed
    one tensor at a time via a .part file."""
    import gguf

    part = path.with_suffix(".part")
    w = gguf.GGUFWriter(str(part), "deepseek2")
    _deepseek2_metadata(w, c)
    qp.copy_tokenizer(w, vocab, c["vocab"])
    specs = deepseek2_tensors(c)
    f32 = [len(s) == 1 or "ffn_gate_inp" in n for n, s in specs]
    for (name, shape), is_f32 in zip(specs, f32):
        if is_f32:
            w.add_tensor_info(name, shape, np.dtype(np.float32), math.prod(shape) * 4)
        else:
            byte_shape = (*shape[:-1], shape[-1] // 32 * 34)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), math.prod(byte_shape),
                              raw_dtype=mfp.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for seed, ((name, shape), is_f32) in enumerate(zip(specs, f32)):
        if not is_f32:
            w.write_tensor_data(mfp.q8_0_bytes(shape, seed))
        elif len(shape) == 1:
            w.write_tensor_data(np.ones(shape, np.float32))
        else:
            rng = np.random.default_rng(seed)
            w.write_tensor_data(rng.standard_normal(shape, dtype=np.float32) * 0.02)
    w.close()
    part.rename(path)


def _quantize(source: Path, shape: Shape, args: argparse.Namespace) -> Path:
    """llama-quantize source -> the shape's file; the source is deleted once it exists."""
    out = qp.quantize(source, shape.quant, args.llama_bin,
                      allow_requantize=source.name.endswith("Q8_0.gguf"))
    source.unlink()
    return out


def ensure_file(shape: Shape, args: argparse.Namespace) -> Path:
    """The benchmark file of `shape`, built if it is not in args.workdir yet."""
    work = args.workdir
    final = work / f"{shape.name}-{shape.quant or 'MXFP4_MOE'}.gguf"
    if final.exists():
        print(f"# have {final} ({final.stat().st_size / 1e9:.2f} GB)")
        return final
    start = time.perf_counter()
    vocab = vocab_file(shape)
    if shape.source == "gpt-oss":
        print(f"# writing {final}", flush=True)
        mfp.write_gpt_oss_gguf(final, vocab, mfp.GptOssShape(vocab=shape.config["vocab"]),
                               "q8_0")
    elif shape.source == "deepseek2":
        source = work / f"{shape.name}-Q8_0.gguf"
        print(f"# writing {source} (random Q8_0 blocks)", flush=True)
        write_deepseek2_q8_0(source, vocab, shape.config)
        final = _quantize(source, shape, args)
    elif shape.source == "moe":
        mp.ensure_quantized(final, vocab, mp.MoeShape(name=shape.name, **shape.config),
                            shape.quant, args.llama_bin)
    else:
        hf_dir, f16 = work / f"{shape.name}-hf", work / f"{shape.name}-F16.gguf"
        if not f16.exists():
            if not hf_dir.exists():
                print(f"# building {hf_dir} (transformers, random bf16)", flush=True)
                build_hf_checkpoint(shape, hf_dir.with_suffix(".part"))
                hf_dir.with_suffix(".part").rename(hf_dir)
            print(f"# converting to {f16} (llama.cpp's convert_hf_to_gguf.py)", flush=True)
            convert_f16(hf_dir, f16, vocab, shape.config["vocab_size"])
            shutil.rmtree(hf_dir)
        final = _quantize(f16, shape, args)
    print(f"#   {final.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - start:.0f} s")
    return final


# ---------------------------------------------------------------- engines


@dataclass(frozen=True)
class DepthRun:
    """One repetition: pp and tg tok/s, and tg at the depth where one was asked for."""

    pp: float
    tg: float
    tg_deep: float | None = None

    def note(self) -> str:
        deep = f", tg at depth {self.tg_deep:.2f}" if self.tg_deep else ""
        return f"pp {self.pp:.1f}, tg {self.tg:.2f}{deep} tok/s"


@dataclass(frozen=True)
class Engine:
    """kvlab bench or llama-bench, as the commands one repetition runs (llama-bench runs
    its depth test apart, with no prompt test at that depth)."""

    name: str
    llama_bin: Path | None = None  # None: kvlab

    def commands(self, model: Path, args: argparse.Namespace, depth: int) -> list[list[str]]:
        common = ["-m", str(model), "-r", "1", "-t", str(args.t), "-o", "json"]
        if self.llama_bin is None:
            deep = ["-d", f"0,{depth}"] if depth else []
            return [qp.KVLAB_CLI + ["bench", *common, "-p", str(args.p), "-n", str(args.n),
                                    *deep]]
        bench = [str(self.llama_bin / "llama-bench"), *common]
        cmds = [bench + ["-p", str(args.p), "-n", str(args.n)]]
        return cmds + ([bench + ["-p", "0", "-n", str(args.n), "-d", str(depth)]]
                       if depth else [])

    def parse(self, outputs: list[str], args: argparse.Namespace, depth: int) -> DepthRun:
        if self.llama_bin is None:
            out = outputs[0]
            rows = {r["test"]: r["tok_s_mean"]
                    for r in json.loads(out[out.index("{"):])["results"]}
            return DepthRun(rows[f"pp{args.p}"], rows[f"tg{args.n}"],
                            rows.get(f"tg{args.n}@d{depth}") if depth else None)
        tests = [t for out in outputs for t in json.loads(out[out.index("["):])]

        def pick(n_prompt: int, n_gen: int, n_depth: int) -> float:
            return next(t["avg_ts"] for t in tests if t["n_prompt"] == n_prompt
                        and t["n_gen"] == n_gen and t.get("n_depth", 0) == n_depth)

        return DepthRun(pick(args.p, 0, 0), pick(0, args.n, 0),
                        pick(0, args.n, depth) if depth else None)


def run_engine(engine: Engine, model: Path, args: argparse.Namespace, depth: int) -> DepthRun:
    outputs = []
    for cmd in engine.commands(model, args, depth):
        try:
            proc = subprocess.run(cmd, check=False, capture_output=True, text=True,
                                  timeout=qp.ENGINE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise qp.EngineFailed(f"timed out after {qp.ENGINE_TIMEOUT_S} s") from None
        if proc.returncode != 0:
            raise qp.EngineFailed(f"exit {proc.returncode}: "
                                  f"{qp._error_line(proc.stderr + proc.stdout)}")
        outputs.append(proc.stdout)
    try:
        return engine.parse(outputs, args, depth)
    except (ValueError, KeyError, IndexError, StopIteration) as e:
        raise qp.EngineFailed(f"unreadable output ({e!r}): {outputs[-1][-300:]!r}") from None


# ---------------------------------------------------------------- KV bytes per token


def kvlab_kv_bytes(model: Path) -> str:
    """`kvlab info --json`'s KV figures (the latent where the model has one)."""
    proc = subprocess.run(qp.KVLAB_CLI + ["info", "--json", str(model)], check=False,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return f"kvlab info failed: {qp._error_line(proc.stderr)}"
    info = json.loads(proc.stdout[proc.stdout.index("{"):])
    keys = ("latent_bytes_per_token_f16", "expanded_kv_bytes_per_token_f16",
            "kv_bytes_per_token_f16")
    return ", ".join(f"{k} {info[k]}" for k in keys if k in info)


_KV_LINE = re.compile(r"llama_kv_cache: size = +([\d.]+) MiB \( *(\d+) cells")


def llama_kv_bytes(model: Path, args: argparse.Namespace) -> str:
    """llama.cpp's KV buffer over its cells, from the load log of a one-token llama-bench."""
    cmd = [str(args.llama_bin / "llama-bench"), "-m", str(model), "-p", "0", "-n", "1",
           "-r", "1", "-t", str(args.t), "-v"]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    found = _KV_LINE.search(proc.stderr + proc.stdout)
    if not found:
        return f"no 'llama_kv_cache: size' line (exit {proc.returncode})"
    mib, cells = float(found[1]), int(found[2])
    return (f"about {mib * 2**20 / cells:.0f} bytes/token ({mib} MiB, as its log rounds it, "
            f"over {cells} cells, f16)")


# ---------------------------------------------------------------- the report


def report(shape: Shape, model: Path, series: dict[str, qp.Series],
           args: argparse.Namespace, depth: int) -> None:
    layers = (f"{shape.config['layers']} of {shape.published_layers} layers; "
              if shape.published_layers else "")
    print(f"\n== {shape.name}: {model.name} ({model.stat().st_size / 1e9:.2f} GB; {layers}"
          f"{args.t} threads, median of {args.r} alternating rounds, tok/s)")
    tests = [(f"pp{args.p}", "pp", TARGETS["pp"]), (f"tg{args.n}", "tg", TARGETS["tg"])]
    if depth:
        tests.append((f"tg{args.n}@d{depth}", "tg_deep", TARGETS["tg"]))
    print(f"{'test':<16}{'kvlab':>10}{'llama.cpp':>12}{'ratio':>9}{'target':>9}")
    for test, attr, target in tests:
        ours, theirs = (series[n].median(attr) for n in ("kvlab", "llama.cpp"))
        ratio = f"{ours / theirs:.2f}x" if ours and theirs else "-"
        print(f"{test:<16}{_cell(ours):>10}{_cell(theirs):>12}{ratio:>9}{target:>8.1f}x")
    if depth:
        kept = [f"{n} {deep / tg:.2f}" for n, s in series.items()
                if (deep := s.median("tg_deep")) and (tg := s.median("tg"))]
        print(f"tg at depth {depth} / depth 0: {', '.join(kept) or '-'} "
              f"(target >= {DEPTH_TARGET:.2f} for kvlab)")
    for name, s in series.items():
        if s.error is not None:
            print(f"{name} failed: {s.error}")


def _cell(value: float | None) -> str:
    return "failed" if value is None else f"{value:.2f}"


# ---------------------------------------------------------------- main


def smoke(model: Path, engines: list[Engine], args: argparse.Namespace) -> None:
    """-p 16 -n 4, one repetition each: the file loads and generates in both engines."""
    tiny = argparse.Namespace(**{**vars(args), "p": 16, "n": 4})
    for engine in engines:
        start = time.perf_counter()
        try:
            run = run_engine(engine, model, tiny, 0)
            note = f"ok (pp16 {run.pp:.1f}, tg4 {run.tg:.1f} tok/s)"
        except qp.EngineFailed as e:
            note = f"FAILED {e}"
        print(f"smoke {engine.name:<10} {model.name}: {note} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("area", choices=("hybrids", "families", "moe"))
    qp.add_run_args(ap, "Q4_K_M", "/tmp/kvlab-shapes")
    ap.set_defaults(llama_bin=LLAMA_BIN)
    ap.add_argument("--shapes", default="", help="comma-separated names (default: the area's)")
    ap.add_argument("--depth", type=int, default=16000, help="tg depth for the hybrids (0: none)")
    ap.add_argument("--build-only", action="store_true", help="build the files, time nothing")
    ap.add_argument("--smoke", action="store_true", help="-p 16 -n 4 once per engine and file")
    args = ap.parse_args(argv)
    qp.check_run_args(ap, args, [])
    names = {s.name for s in SHAPES}
    wanted = [n for n in args.shapes.split(",") if n]
    if unknown := [n for n in wanted if n not in names]:
        ap.error(f"unknown --shapes {unknown}; valid: {sorted(names)}")
    args.chosen = [s for s in SHAPES if (s.name in wanted if wanted else s.area == args.area)]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    engines = [Engine("kvlab"), Engine("llama.cpp", args.llama_bin)]
    print(f"# CPU: {qp.cpu_kind()}")
    files = []
    for shape in args.chosen:  # every file first: the timings then run alone
        try:
            files.append((shape, ensure_file(shape, args)))
        except qp.QuantizeFailed as e:
            print(f"# {shape.name}: {e}")
    if args.build_only:
        return
    for shape, model in files:
        if args.smoke:
            smoke(model, engines, args)
        else:
            depth = args.depth if shape.area == "hybrids" else 0
            series = qp.bench_file(model, engines, args,
                                   run_one=functools.partial(run_engine, depth=depth))
            report(shape, model, series, args, depth)
        if shape.source == "deepseek2":
            print(f"MLA KV cache per token: kvlab {kvlab_kv_bytes(model)}; "
                  f"llama.cpp {llama_kv_bytes(model, args)}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
