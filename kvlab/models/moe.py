"""The mixture-of-experts MLP the MoE architecture files share: router, top-k, the chosen
experts' products on just their tokens, and an optional shared expert.

Per layer and step: the router scores every expert for each of the T tokens, each token keeps
its top k, and the tokens are grouped by expert. Each expert with at least one token runs
gate|up (one Stacked product) -> SwiGLU -> down on those rows alone, so its weights are read
once per step however many tokens chose it; the results, scaled by their routing weights, are
added back into the tokens' rows. A batch-1 decode step reads k experts, not all of them.

    Experts       per-expert weights, as loaded (quantized blocks stay quantized); with
                  gpt-oss's options: biases on gate|up and down, and the ClampedSwiglu gate
    route         router logits -> (weights [T, k], expert ids [T, k]), as transformers does
    route_topk_softmax   gpt-oss's order: router with bias, top-k of the logits, softmax
                  over those k
    moe_mlp       the layer's MLP output [T, hidden]
    MoeModel      the Llama decoder with this MLP (attention variants come from the config)

Also the checkpoint names and config keys the MoE families share (llama.cpp's GGUF names are
one convention for all of them; the per-family HF names live in the architecture files).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvlab.config import MoeConfig
from kvlab.errors import ModelLoadError
from kvlab.kernels import fused
from kvlab.models.decode_c import kernel_desc
from kvlab.models.layers import Stacked, Weight, geglu, linear, relu2, swiglu
from kvlab.models.llama import LlamaModel
from kvlab.models.spec import gguf_get

# llama.cpp's per-layer MoE tensors: experts stacked [n_expert, out, in] (torch order)
GGUF_LAYER = {"ffn_gate_inp.weight": "router", "ffn_gate_exps.weight": "gate_exps",
              "ffn_up_exps.weight": "up_exps", "ffn_down_exps.weight": "down_exps",
              "ffn_gate_inp_shexp.weight": "shexp_router", "ffn_gate_shexp.weight": "shexp_gate",
              "ffn_up_shexp.weight": "shexp_up", "ffn_down_shexp.weight": "shexp_down"}
# transformers' Qwen-MoE / OLMoE layout: save_pretrained writes one matrix per expert, a model
# in memory holds them fused as [experts, 2 * inter, hidden] and [experts, hidden, inter]
HF_LAYER = {"mlp.gate.weight": "router", "mlp.experts.gate_up_proj": "gate_up_exps",
            "mlp.experts.down_proj": "down_exps"}
HF_EXPERTS = {"mlp.experts.{e}.gate_proj.weight": "gate_exps",
              "mlp.experts.{e}.up_proj.weight": "up_exps",
              "mlp.experts.{e}.down_proj.weight": "down_exps"}


def hf_shared_expert(module: str) -> dict[str, str]:
    """A shared expert's HF names under `module` -> kvlab's (GLM-4.5: mlp.shared_experts)."""
    return {f"{module}.{p}_proj.weight": f"shexp_{p}" for p in ("gate", "up", "down")}


def moe_from_hf(cfg: dict[str, Any], inter_key: str = "moe_intermediate_size",
                norm_topk_prob: bool | None = None) -> MoeConfig:
    """MoeConfig from an HF config; `norm_topk_prob` fixed by a family that has no key.
    The expert count is `num_experts` or (Mixtral, and transformers 5 for every family)
    `num_local_experts`."""
    norm = cfg.get("norm_topk_prob", False) if norm_topk_prob is None else norm_topk_prob
    count = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not count:
        raise ModelLoadError("an MoE config needs num_experts or num_local_experts")
    return MoeConfig(num_experts=int(count),
                     experts_per_token=int(cfg["num_experts_per_tok"]),
                     expert_intermediate_size=int(cfg[inter_key]), norm_topk_prob=bool(norm),
                     shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size")
                                                  or 0))


def moe_from_gguf(meta: dict[str, Any], arch: str, norm_topk_prob: bool) -> MoeConfig:
    """MoeConfig from `{arch}.expert_*` keys; llama.cpp fixes the renormalisation per family
    (its converters write `expert_weights_norm` only for some), so the family gives a default."""
    g = gguf_get(meta, arch)
    count, used = int(g("expert_count")), int(g("expert_used_count"))
    if not 0 < used <= count:
        raise ModelLoadError(f"{arch}.expert_used_count is {used}, valid: 1..{count} "
                             "(expert_count)")
    return MoeConfig(num_experts=count, experts_per_token=used,
                     expert_intermediate_size=int(g("expert_feed_forward_length",
                                                    g("feed_forward_length"))),
                     norm_topk_prob=bool(g("expert_weights_norm", norm_topk_prob)),
                     shared_intermediate_size=int(g("expert_shared_feed_forward_length", 0)))


@dataclass(frozen=True)
class ClampedSwiglu:
    """gpt-oss's expert gate on gate|up halves: gate clamped above at `limit`, up clamped to
    [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""

    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        gate, up = y.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


@dataclass(frozen=True)
class Experts:
    """One layer's routed experts; expert e is gate_up[e] ([2 * inter, hidden]) and down[e],
    each product plus its bias row where the layer has biases (gpt-oss), and `gate` between
    them (None: SwiGLU)."""

    gate_up: tuple[Stacked, ...]
    down: tuple[Weight, ...]  # [hidden, inter] each
    gate_up_bias: torch.Tensor | None = None  # fp32 [E, 2 * inter]: gate | up halves
    down_bias: torch.Tensor | None = None  # fp32 [E, hidden]
    # on gate|up [n, 2 * inter] -> [n, inter]: None (SwiGLU), gpt-oss's clamped SwiGLU, or
    # another function of the halves (Gemma 4: layers.geglu), which runs in torch; experts
    # without a gate product hold up alone in gate_up and this is its activation
    # (Nemotron-H's squared ReLU), elementwise on [n, inter]
    gate: ClampedSwiglu | Callable[[torch.Tensor], torch.Tensor] | None = None
    # int64 [E, 3, 5]: what fused.moe_experts takes, or None when some expert has no C path
    c_table: torch.Tensor | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.gate_up) != len(self.down):
            raise ValueError(f"{len(self.gate_up)} gate/up experts but {len(self.down)} down")
        object.__setattr__(self, "c_table", _c_table(self))

    def __len__(self) -> int:
        return len(self.down)

    def __reduce__(self) -> tuple:
        """Copies and pickles rebuild through __init__: c_table gets the new addresses."""
        return (Experts, (self.gate_up, self.down, self.gate_up_bias, self.down_bias,
                          self.gate))

    def run(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e on rows x [n, hidden] -> [n, hidden]."""
        up_bias = None if self.gate_up_bias is None else self.gate_up_bias[e]
        down_bias = None if self.down_bias is None else self.down_bias[e]
        gate_up = linear(x, self.gate_up[e], up_bias)
        h = swiglu(gate_up) if self.gate is None else self.gate(gate_up)
        return linear(h, self.down[e], down_bias)


def _c_table(experts: Experts) -> torch.Tensor | None:
    """Each expert's gate|up (one or two parts) and down as the C products take them; None
    unless every expert has C kernels and the experts share their types and shapes (the
    biases and clamped SwiGLU, gpt-oss's, Gemma 4's GeGLU and Nemotron-H's relu2 of an up
    product without a gate are options of the C call; another gate is not)."""
    if not fused.ENABLED or not experts.down:
        return None
    if experts.gate not in (None, geglu, relu2) and not isinstance(experts.gate, ClampedSwiglu):
        return None
    rows = [_c_row(gate_up, down) for gate_up, down in zip(experts.gate_up, experts.down)]
    if None in rows:
        return None
    table = torch.tensor(rows, dtype=torch.int64)  # [E, 3, 5]: (qt, ptr, rows, cols, bytes)
    shapes = table[:, :, [0, 2, 3, 4]]
    (_, _, gate_rows, gate_cols, _), (_, _, up_rows, up_cols, _), (_, _, hidden, inter, _) = (
        table[0].tolist())
    if experts.gate is relu2:  # up alone: [inter, hidden]
        fits = gate_rows == inter and gate_cols == hidden and up_rows == 0
    else:
        fits = (gate_rows + up_rows == 2 * inter and gate_cols == hidden
                and up_cols in (0, hidden) and (up_rows == 0 or gate_rows == inter))
    return table if fits and not bool((shapes != shapes[0]).any()) else None


def _c_row(gate_up: Stacked, down: Weight) -> list[list[int]] | None:
    parts = [kernel_desc(p) for p in gate_up.parts]
    if not 1 <= len(parts) <= 2 or None in parts or kernel_desc(down) is None:
        return None
    return [parts[0], parts[1] if len(parts) == 2 else [0] * 5, kernel_desc(down)]


def route(h: torch.Tensor, router: Weight, moe: MoeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """h [T, hidden] -> routing weights [T, k] (h's dtype) and expert ids [T, k] (int64).

    Softmax over all experts in fp32, then top-k, then (norm_topk_prob) renormalised over the
    k: the order of every transformers MoE file kvlab loads. With groups (DeepSeek-V2's
    group_limited_greedy) the top k is taken within the `top_groups` groups whose best
    probability is highest."""
    logits = linear(h, router)
    probs = torch.softmax(logits.float(), dim=-1)
    choice = probs if moe.groups == 1 else keep_groups(probs, moe, lambda g: g.amax(dim=-1))
    ids = torch.topk(choice, moe.experts_per_token, dim=-1).indices
    top = probs.gather(1, ids)
    if moe.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return (top * moe.routed_scale).to(h.dtype), ids  # DeepSeek-V2 scales them


def keep_groups(choice: torch.Tensor, moe: MoeConfig,
                group_score: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """choice [T, E] with the experts outside the `top_groups` best of `groups` consecutive
    groups set to -inf; group_score maps [T, groups, E / groups] -> [T, groups]."""
    t, e = choice.shape
    best = group_score(choice.view(t, moe.groups, e // moe.groups))  # [T, groups]
    keep = torch.zeros_like(best, dtype=torch.bool)
    keep.scatter_(1, best.topk(moe.top_groups, dim=-1, sorted=False).indices, True)
    return choice.masked_fill(~keep.repeat_interleave(e // moe.groups, dim=1), float("-inf"))


def route_topk_softmax(h: torch.Tensor, router: Weight, bias: torch.Tensor,
                       k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's routing: logits of the router with its bias [T, E], the top k of them,
    softmax over those k in fp32 -> (weights [T, k] in h's dtype, expert ids [T, k])."""
    top, ids = torch.topk(linear(h, router, bias).float(), k, dim=-1)
    return torch.softmax(top, dim=-1).to(h.dtype), ids


def route_sigmoid(h: torch.Tensor, router: Weight, bias: torch.Tensor,
                  moe: MoeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """route for a sigmoid router with a choice bias (DeepSeek-V3's noaux_tc, GLM-4.5), as
    transformers does it: scores sigmoid(logits) in fp32; the choice ranks scores + bias,
    within the `top_groups` groups whose two best biased scores sum highest; the weights
    are the chosen experts' unbiased scores, renormalised (norm_topk_prob) and scaled by
    routed_scale."""
    scores = torch.sigmoid(linear(h.float(), router).float())  # [T, E]
    choice = scores + bias
    if moe.groups > 1:
        choice = keep_groups(choice, moe, lambda g: g.topk(2, dim=-1).values.sum(dim=-1))
    ids = torch.topk(choice, moe.experts_per_token, dim=-1, sorted=False).indices
    top = scores.gather(1, ids)
    if moe.norm_topk_prob:
        top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
    return (top * moe.routed_scale).to(h.dtype), ids


def run_experts(h: torch.Tensor, experts: Experts, weights: torch.Tensor,
                ids: torch.Tensor) -> torch.Tensor:
    """sum over each token's k chosen experts of weight * expert(token): [T, hidden]."""
    if experts.c_table is not None and fused.fits(h, weights):
        gate = experts.gate
        clamp = (gate.alpha, gate.limit) if isinstance(gate, ClampedSwiglu) else None
        return fused.moe_experts(h, ids, weights, experts.c_table, experts.gate_up_bias,
                                 experts.down_bias, clamp, gelu=gate is geglu,
                                 relu2=gate is relu2)
    return run_experts_each(h, experts, weights, ids)


def run_experts_each(h: torch.Tensor, experts: Experts, weights: torch.Tensor,
                     ids: torch.Tensor) -> torch.Tensor:
    """run_experts one product call per expert (dense weights, no C extension); the C path
    computes the same products on the same 8-bit blocks."""
    if h.shape[0] == 1:  # batch-1 decode: k products on the one row, nothing to gather
        out = torch.zeros_like(h)
        for e, w in zip(ids[0].tolist(), weights[0].tolist()):
            out.add_(experts.run(e, h), alpha=w)
        return out
    # the T * k (token, slot) pairs sorted by expert: each expert's rows are one run
    #   ids [[2, 0], [0, 1]] -> flat [2, 0, 0, 1] -> order [1, 2, 3, 0] (experts 0 0 1 2)
    t, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    x = h.index_select(0, order // k)
    scale = weights.reshape(-1)[order, None]
    y = torch.empty_like(x)
    start = 0
    for e, n in enumerate(torch.bincount(flat, minlength=len(experts)).tolist()):
        if n:
            y[start:start + n] = experts.run(e, x[start:start + n]) * scale[start:start + n]
            start += n
    # back to (token, slot) order, then each token's k results summed (a gather and a sum:
    # torch's CPU index_add_ is far slower)
    return y.index_select(0, torch.argsort(order)).view(t, k, -1).sum(dim=1)


def moe_mlp(h: torch.Tensor, layer: dict, moe: MoeConfig,
            trace: list[torch.Tensor] | None = None) -> torch.Tensor:
    """The routed experts plus, where the layer has one, the shared expert (gated by
    sigmoid(shexp_router . h) where the layer has that gate); the chosen expert ids [T, k]
    are appended to `trace` when one is given."""
    weights, ids = (route(h, layer["router"], moe) if moe.scoring == "softmax" else
                    route_sigmoid(h, layer["router"], layer["router_bias"], moe))
    if trace is not None:
        trace.append(ids)
    out = run_experts(h, layer["experts"], weights, ids)
    if "shexp_gate_up" in layer:
        shared = linear(swiglu(linear(h, layer["shexp_gate_up"])), layer["shexp_down"])
        if "shexp_router" in layer:
            shared = torch.sigmoid(linear(h, layer["shexp_router"])) * shared
        out += shared
    return out


class MoeModel(LlamaModel):
    """The Llama decoder whose layers with a router run the mixture of experts (layers
    without one, e.g. Qwen2-MoE's `mlp_only_layers`, keep the dense SwiGLU)."""

    def mlp(self, h: torch.Tensor, layer: dict[str, Weight],
            trace: list[torch.Tensor] | None = None) -> torch.Tensor:
        if "router" not in layer:
            return super().mlp(h, layer)
        # each rank holds a slice of every expert's columns: one all-reduce of the sum
        return self.tp.all_reduce(moe_mlp(h, layer, self.config.moe, trace))
