"""`kvlab info MODEL`: architecture, parameters, quant types and bytes, context, KV bytes;
a hybrid's recurrent layers and their state per sequence; latent attention's latent bytes."""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict

from kvlab.config import ModelConfig
from kvlab.models.loader import LoadedModel, LoadOptions, load_model
from kvlab.weights.checkpoint import open_checkpoint
from kvlab.weights.default_model import default_model_path


def register(subs: argparse._SubParsersAction) -> None:
    p = subs.add_parser("info", help="describe a model checkpoint")
    p.add_argument("model", nargs="?", default=None, help=".gguf file or HF directory")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def describe(loaded: LoadedModel, path: str) -> dict:
    c = loaded.config
    by_type: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for t in loaded.tensors:
        by_type[t.qtype][0] += math.prod(t.shape)
        by_type[t.qtype][1] += t.nbytes
    cost = loaded.run_cost(2)
    return {
        "path": path, "architecture": c.architecture, "name": c.name,
        "parameters": loaded.num_params, "weight_bytes": loaded.weight_bytes,
        "stored_weight_bytes": loaded.stored_weight_bytes,
        "quant_types": {k: {"parameters": v[0], "bytes": v[1]} for k, v in by_type.items()},
        "layers": c.num_layers, "hidden_size": c.hidden_size, "heads": c.num_heads,
        "kv_heads": c.num_kv_heads, "head_dim": c.head_dim, "vocab_size": c.vocab_size,
        "context_length": c.max_position_embeddings, "sliding_window": c.sliding_window,
        "kv_bytes_per_token_f16": int(c.kv_bytes_per_token(2)),
        "kv_bytes_per_token_f32": int(c.kv_bytes_per_token(4)),
        **_window_fields(c),
        "decode_bytes_per_token": cost.decode_weight_bytes,
        "decode_stored_bytes_per_token": cost.decode_stored_bytes,
        **_moe_fields(loaded), **_recurrent_fields(c), **_mla_fields(c),
    }


def _window_fields(c: ModelConfig) -> dict:
    """With sliding-window layers: KV bytes per token of the full-attention layers and the
    fixed cost of the sliding ones, which keep their last `window` positions only."""
    if not c.num_sliding_layers:
        return {}
    return {"sliding_layers": c.num_sliding_layers,
            "kv_full_bytes_per_token_f16": int(c.kv_bytes_per_token(2, sliding=False)),
            "kv_window_bytes_f16": int(c.kv_bytes_per_token(2, sliding=True)
                                       * c.sliding_window)}


def _recurrent_fields(c: ModelConfig) -> dict:
    """A hybrid's recurrent layers: their kind, and the fp32 state each sequence holds in
    them whatever its length (the KV figures then count the attention layers only)."""
    rc = c.recurrent
    if rc is None or not c.num_recurrent_layers:
        return {}
    return {"recurrent_layers": c.num_recurrent_layers, "recurrent_kind": rc.kind,
            "attention_layers": c.num_attention_layers,
            "mlp_only_layers": c.num_layers - c.num_attention_layers - c.num_recurrent_layers,
            "conv_state_shape": list(rc.conv_state_shape),
            "recurrent_state_shape": (list(rc.recurrent_state_shape)
                                      if rc.recurrent_state_shape else None),
            "state_bytes_per_seq": c.state_bytes_per_seq()}


def _mla_fields(c: ModelConfig) -> dict:
    """Latent attention: the latent each token keeps per layer, against the per-head K and V
    that the same heads would cache expanded."""
    mla = c.mla
    if mla is None:
        return {}
    expanded = c.num_heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim + mla.v_head_dim)
    return {"kv_lora_rank": mla.kv_lora_rank, "qk_rope_head_dim": mla.qk_rope_head_dim,
            "latent_width": mla.latent_width,
            "latent_bytes_per_token_f16": int(c.kv_bytes_per_token(2)),
            "expanded_kv_bytes_per_token_f16": 2 * c.num_layers * expanded}


def _moe_fields(loaded: LoadedModel) -> dict:
    """Experts, active parameters and the weight bytes a decode step reads at a few batch
    sizes (the distinct experts a batch routes to grow with it); {} for dense models."""
    moe = loaded.config.moe
    if moe is None:
        return {}
    cost = loaded.run_cost(2)
    return {"experts": moe.num_experts, "experts_used": moe.experts_per_token,
            "shared_expert": bool(moe.shared_intermediate_size),
            "active_parameters": loaded.active_params,
            "decode_bytes_per_step": {b: round(cost.spec.decode_weight_bytes(b))
                                      for b in (1, 4, 16, 64)}}


def _print_recurrent(info: dict) -> None:
    if "recurrent_layers" not in info:
        return
    shapes = f"conv {info['conv_state_shape']}" + (
        f" + state {info['recurrent_state_shape']}" if info["recurrent_state_shape"] else "")
    print(f"  counted in    the attention layers only ({info['attention_layers']} of "
          f"{info['layers']}); the recurrent ones keep no KV" + _mlp_only(info))
    print(f"recurrent       {info['recurrent_layers']} {info['recurrent_kind']} layers, fp32 "
          f"state {info['state_bytes_per_seq'] / 1024:.1f} KiB per sequence (any length; "
          f"{shapes} per layer)")


def _mlp_only(info: dict) -> str:
    """The MLP-only layers (Nemotron-H's), which keep neither KV nor a state."""
    n = info["mlp_only_layers"]
    return "" if not n else (", nor does the 1 MLP-only layer" if n == 1
                             else f", nor do the {n} MLP-only layers")


def _print_mla(info: dict) -> None:
    if "latent_width" not in info:
        return
    print(f"  latent        {info['latent_width']} values per token per layer (rank "
          f"{info['kv_lora_rank']} + rotary {info['qk_rope_head_dim']}): "
          f"{info['latent_bytes_per_token_f16'] / 1024:.1f} KiB/token f16, where per-head K/V "
          f"would take {info['expanded_kv_bytes_per_token_f16'] / 1024:.1f} KiB/token")


def run(args: argparse.Namespace) -> int:
    path = str(args.model or default_model_path())
    info = describe(load_model(open_checkpoint(path), LoadOptions()), path)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"{info['name']} ({info['architecture']})  {path}")
    print(f"parameters      {info['parameters'] / 1e6:.1f} M, weights "
          f"{info['weight_bytes'] / 1e6:.1f} MB in memory, "
          f"{info['stored_weight_bytes'] / 1e6:.1f} MB in the file")
    for qtype, v in sorted(info["quant_types"].items(), key=lambda kv: -kv[1]["bytes"]):
        print(f"  {qtype:6s} {v['parameters'] / 1e6:9.2f} M params  {v['bytes'] / 1e6:9.2f} MB")
    if "experts" in info:
        print(f"experts         {info['experts_used']} of {info['experts']} per token"
              + (" + a shared expert" if info["shared_expert"] else "")
              + f", {info['active_parameters'] / 1e6:.1f} M parameters active per token")
    print(f"layers {info['layers']}, hidden {info['hidden_size']}, heads {info['heads']} "
          f"(KV {info['kv_heads']}), head dim {info['head_dim']}, vocab {info['vocab_size']}")
    window = info["sliding_window"]
    print(f"context length  {info['context_length']}"
          + (f" (sliding window {window} on local layers)" if window else ""))
    print(f"KV cache        {info['kv_bytes_per_token_f16'] / 1024:.1f} KiB/token in f16, "
          f"{info['kv_bytes_per_token_f32'] / 1024:.1f} KiB/token in f32")
    _print_recurrent(info)
    _print_mla(info)
    if "sliding_layers" in info:
        full = info["layers"] - info["sliding_layers"]
        print(f"  held          {info['kv_full_bytes_per_token_f16'] / 1024:.1f} KiB/token f16 "
              f"in the {full} full-attention layers + a fixed "
              f"{info['kv_window_bytes_f16'] / 2**20:.1f} MiB in the {info['sliding_layers']} "
              f"sliding ones (their last {window} positions)")
    print(f"decode reads    {info['decode_bytes_per_token'] / 1e6:.1f} MB of weights per token "
          f"as held in memory ({info['decode_stored_bytes_per_token'] / 1e6:.1f} MB as the "
          "file stores them)")
    for batch, nbytes in info.get("decode_bytes_per_step", {}).items():
        if batch > 1:
            print(f"  batch {batch:3d}     {nbytes / 1e6:.1f} MB per step (expected distinct "
                  "experts)")
    return 0
