"""DeepSeek-V2's group-limited routing (topk_method group_limited_greedy): the softmax
scores' top k taken only within the topk_group of n_group groups whose best score is
highest. The rule on hand-made scores (against transformers' router and against the other
two rules it is not), and on the tiny V2 model that the logits tests run, where it changes
the chosen experts."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers as tf

from kvlab.config import MoeConfig
from kvlab.errors import ModelLoadError
from kvlab.models import deepseek2, moe
from kvlab.models.loader import LoadOptions, load_model
from kvlab.weights.checkpoint import open_checkpoint

from tiny_models import build_deepseek, deepseek_config

GROUPED = {"v2": True, "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
           "num_experts_per_tok": 3}

# two groups of four experts: group 0's best (3.0) beats group 1's (2.9), though group 1's
# two best sum higher (5.7 against 5.5) and expert 4 is the second best overall
LOGITS = torch.tensor([[3.0, 2.5, -1.0, -1.0, 2.9, 2.8, -1.0, -1.0]])
ROUTING = MoeConfig(num_experts=8, experts_per_token=2, expert_intermediate_size=4,
                    norm_topk_prob=False, groups=2, top_groups=1, routed_scale=2.5)


def _chosen(moe_config: MoeConfig) -> tuple[set[int], torch.Tensor]:
    weights, ids = moe.route(LOGITS, torch.eye(8), moe_config)
    order = ids[0].argsort()
    return set(ids[0].tolist()), weights[0, order]


def test_group_limited_greedy_keeps_the_groups_with_the_best_expert():
    ids, weights = _chosen(ROUTING)
    assert ids == {0, 1}
    probs = torch.softmax(LOGITS[0], dim=0)
    torch.testing.assert_close(weights, probs[[0, 1]] * 2.5)  # not renormalised
    assert _chosen(dataclasses.replace(ROUTING, groups=1, top_groups=1))[0] == {0, 4}
    sigmoid_rule = moe.keep_groups(LOGITS, ROUTING, lambda g: g.topk(2, dim=-1).values.sum(-1))
    assert set(sigmoid_rule.topk(2).indices[0].tolist()) == {4, 5}


def test_group_limited_greedy_equals_transformers_router():
    config = tf.DeepseekV2Config(hidden_size=8, num_attention_heads=2, n_routed_experts=8,
                                 num_experts_per_tok=2,
                                 topk_method="group_limited_greedy", n_group=2, topk_group=1,
                                 routed_scaling_factor=2.5)
    router = tf.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter(config)
    torch.manual_seed(0)
    h = torch.cat([LOGITS, torch.randn(31, 8) * 2])
    with torch.no_grad():
        router.weight.copy_(torch.eye(8))
        _, ref_w, ref_ids = router(h)
    weights, ids = moe.route(h, torch.eye(8), ROUTING)
    ref_order, order = ref_ids.argsort(dim=1), ids.argsort(dim=1)
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(weights.gather(1, order), ref_w.gather(1, ref_order))


def test_hf_config_reads_the_groups():
    cfg = deepseek_config(**GROUPED).to_dict()
    routing = deepseek2.config_from_hf(cfg).moe
    assert (routing.scoring, routing.groups, routing.top_groups) == ("softmax", 4, 2)
    greedy = deepseek2.config_from_hf({**cfg, "topk_method": "greedy"}).moe
    assert (greedy.groups, greedy.top_groups) == (1, 1)
    with pytest.raises(ModelLoadError, match="group_limited_greedy"):
        deepseek2.config_from_hf({**cfg, "topk_method": "noaux_tc"})


def test_the_tiny_model_routes_differently_with_groups(tmp_path):
    """The logits tests' V2 variant (three of eight experts, two of four groups kept): its
    routers' choice with the groups differs from the top three over all experts for most
    tokens, so a router that ignored the groups would fail them."""
    build_deepseek(tmp_path, **GROUPED)
    loaded = load_model(open_checkpoint(tmp_path / "hf"), LoadOptions())
    routing = loaded.config.moe
    h = torch.randn(64, loaded.config.hidden_size, generator=torch.Generator().manual_seed(0))
    changed = 0
    for layer in loaded.model.layers:
        if "router" in layer:
            grouped = moe.route(h, layer["router"], routing)[1].sort(dim=1).values
            flat = moe.route(h, layer["router"], dataclasses.replace(
                routing, groups=1, top_groups=1))[1].sort(dim=1).values
            changed += int((grouped != flat).any(dim=1).sum())
    assert changed > 10
