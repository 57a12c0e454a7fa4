"""`kvlab loadtest --estimate`: the model, this machine's probe and the server's scheduler
settings, checked, for kvlab.estimate.serving_check to replay each measured load."""

from __future__ import annotations

import argparse

from kvlab.engine import EngineConfig
from kvlab.errors import KvlabError
from kvlab.estimate.kernel_steps import unsupported_reason
from kvlab.estimate.serving_check import Predictor
from kvlab.estimate.specs import spec_from_gguf
from kvlab.models.kv_store import KV_DTYPES
from kvlab.probe import resolve_hardware
from kvlab.scheduler import SchedulerConfig
from kvlab.weights.default_model import default_model_path


def predictor(args: argparse.Namespace) -> Predictor:
    """The model, this machine's probe and the server's scheduler settings, checked."""
    if args.server_max_num_seqs < 1 or args.server_max_num_batched_tokens < 1:
        raise KvlabError("--server-max-num-seqs and --server-max-num-batched-tokens must be "
                         ">= 1")
    hw = resolve_hardware("this")
    model = spec_from_gguf(args.estimate_model or default_model_path())
    reason = unsupported_reason(model, hw)
    if reason:
        raise KvlabError(f"--estimate: kvlab's step model does not apply: {reason}")
    kv_dtype = args.server_kv_dtype
    if kv_dtype == "auto":
        kv_dtype = EngineConfig().kv_dtype
    if kv_dtype not in KV_DTYPES:
        raise KvlabError(f"--server-kv-dtype {kv_dtype!r}: valid: auto, {', '.join(KV_DTYPES)}")
    config = SchedulerConfig(args.server_max_num_seqs, args.server_max_num_batched_tokens)
    return Predictor(model, hw, config, kv_dtype)
