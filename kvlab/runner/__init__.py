"""SchedulerOutput -> tensors -> logits: the model runner, its captured decode graphs, the
KV pager, and the tensor-parallel ranks that run one step on every shard (ranks.py)."""

from kvlab.runner.model_runner import WIDE_STEP_TOKENS, ModelRunner, StepLogits

__all__ = ["WIDE_STEP_TOKENS", "ModelRunner", "StepLogits"]
