"""Flags shared by the subcommands that load a model, and their mapping to engine settings."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvlab.engine import EngineConfig
from kvlab.errors import KvlabError
from kvlab.models.loader import QUANTIZE_CHOICES
from kvlab.request import SamplingParams, Structure
from kvlab.spec.proposer import METHODS


def add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None,
                   help="a .gguf file or an HF model directory (default: Gemma 3 270M Q4_K_M)")
    p.add_argument("--dtype", default="auto",
                   help="compute dtype: float32 | bfloat16 (auto: float32 on CPU, bf16 on CUDA)")
    p.add_argument("--kv-dtype", default="auto",
                   help="KV cache dtype: f32 | bf16 | f16 | q8_0 (auto: f16 on CPU, bf16 on CUDA)")
    p.add_argument("--threads", "-t", type=int, default=None,
                   help="CPU threads (per rank with --tensor-parallel-size)")
    p.add_argument("--tensor-parallel-size", "--tp", type=int, default=1, metavar="N",
                   help="split the model's heads and MLP columns over N ranks of "
                        "torch.distributed: N - 1 spawned workers, or the ranks torchrun "
                        "started (gloo on CPUs, NCCL on CUDA)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length cap")
    p.add_argument("--kv-cache-gib", type=float, default=2.0, help="KV cache pool size in GiB")
    p.add_argument("--dequantize", action="store_true",
                   help="dequantize GGUF weights to the compute dtype at load")
    p.add_argument("--no-group-rows", action="store_true",
                   help="keep quantized matrices in the file's row order (by default Q8_0, "
                        "Q5_0, Q4_0, Q4_K, Q6_K run in 8-row groups: same values, faster)")
    p.add_argument("--quantize", choices=QUANTIZE_CHOICES, default=None,
                   help="quantize a safetensors model's weights at load")
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template file to use in place of the model's own")
    p.add_argument("--async-scheduling", choices=("on", "off"), default="on",
                   help="on (default): schedule each decode step while the one before runs, "
                        "its input ids taken from that step's sampled ids on the device (same "
                        "output; prefill, structured output, penalties and speculation steps "
                        "run synchronously); off: every step in turn")


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", "-n", type=int, default=128)
    p.add_argument("--temperature", "--temp", type=float, default=0.0,
                   help="0 means greedy (the default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stop-token-id", type=int, action="append", default=[])
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="each generated token's logprob and its N most likely alternatives "
                        "(reported in kvlab run's --json record)")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE",
                       help="the output must be JSON valid against this schema file")
    shape.add_argument("--json-object", action="store_true", help="the output must be a JSON object")
    shape.add_argument("--grammar", metavar="FILE",
                       help="the output must follow this grammar (GBNF 'root ::= ...' or Lark)")
    shape.add_argument("--regex", metavar="R", help="the output must match this regex in full")


def add_speculative_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative", choices=METHODS, default=None,
                   help="speculative decoding: ngram proposes the tokens that followed the "
                        "last few tokens' earlier occurrence in the prompt or output, draft "
                        "those a smaller model (--draft-model) decodes, mtp those the model's "
                        "own multi-token-prediction layer guesses (GLM-4.5, DeepSeek-V3, "
                        "Qwen3.5 checkpoints that ship it); the model verifies them in one step "
                        "(output unchanged)")
    p.add_argument("--draft-model", default=None, metavar="PATH",
                   help="with --speculative draft: a .gguf file or HF directory of a model "
                        "with the same vocabulary")
    p.add_argument("--num-speculative", type=int, default=None, metavar="K",
                   help="most tokens proposed per sequence and step (default 4); fewer where "
                        "proposals keep failing or the step is compute-bound")
    p.add_argument("--speculative-adaptive", choices=("on", "off"), default=None,
                   help="on (default): size each sequence's proposal from its acceptance "
                        "rate and the measured step and draft costs, none where it does not "
                        "pay; off: a fixed k, --num-speculative tokens every step wherever "
                        "the proposer has them")


def speculative_config(args: argparse.Namespace) -> dict[str, object]:
    """EngineConfig fields of the --speculative flags."""
    if args.speculative is None:
        given = [flag for flag, value in (("--num-speculative", args.num_speculative),
                                          ("--draft-model", args.draft_model),
                                          ("--speculative-adaptive", args.speculative_adaptive))
                 if value is not None]
        if given:
            verb = "applies" if len(given) == 1 else "apply"
            raise KvlabError(f"{' and '.join(given)} {verb} with --speculative; add "
                             "--speculative ngram, draft or mtp")
        return {}
    k = args.num_speculative
    return {"speculative": args.speculative, "num_speculative": 4 if k is None else k,
            "draft_model": args.draft_model,
            "speculative_adaptive": args.speculative_adaptive != "off"}


def engine_config(args: argparse.Namespace, **overrides: object) -> EngineConfig:
    fields = {"dtype": args.dtype, "kv_dtype": args.kv_dtype, "threads": args.threads,
              "max_model_len": args.max_model_len, "kv_cache_gib": args.kv_cache_gib,
              "keep_quantized": not args.dequantize, "quantize": args.quantize,
              "group_rows": not args.no_group_rows, "device": args.device,
              "tensor_parallel_size": args.tensor_parallel_size,
              "chat_template": read_text(args.chat_template, "--chat-template"),
              "async_scheduling": args.async_scheduling == "on"}
    fields.update(overrides)
    return EngineConfig(**fields)  # type: ignore[arg-type]


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        seed=args.seed, stop=tuple(args.stop), stop_token_ids=tuple(args.stop_token_id),
        ignore_eos=args.ignore_eos, logprobs=args.logprobs, structured=structure(args))


def structure(args: argparse.Namespace) -> Structure | None:
    """The --json-schema / --json-object / --grammar / --regex constraint, if any."""
    if args.json_schema is not None:
        return Structure("json_schema", read_text(args.json_schema, "--json-schema") or "")
    if args.json_object:
        return Structure("json_object")
    if args.grammar is not None:
        return Structure("grammar", read_text(args.grammar, "--grammar") or "")
    if args.regex is not None:
        return Structure("regex", args.regex)
    return None


def read_text(path: str | None, flag: str) -> str | None:
    """A text file named by a flag; a missing or unreadable one is a one-line error."""
    if path is None:
        return None
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise KvlabError(f"{flag} {path}: cannot be read ({e.strerror or e})") from None
