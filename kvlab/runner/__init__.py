"""SchedulerOutput -> tensors -> logits: the model runner and its captured decode graphs."""

from kvlab.runner.model_runner import WIDE_STEP_TOKENS, ModelRunner, StepLogits

__all__ = ["WIDE_STEP_TOKENS", "ModelRunner", "StepLogits"]
