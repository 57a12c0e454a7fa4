"""`kvlab estimate`: roofline prediction of prefill, decode, memory and batching.

The model is a GGUF file, an HF config.json (or its directory), or a description
(`--params 8e9 --bits 4.5 ...`); with none of these, the default model. The hardware is a
built-in part (`--hardware rtx-4090`), this machine as `kvlab probe` measured it
(`--hardware this`, the default), or figures given with --bandwidth/--tflops/--memory.

`--engine kvlab` adds kvlab's own engine on this machine: a GGUF model over the rates
`kvlab probe` measured for kvlab's kernels and engine, scaled to the whole steps it timed,
in place of the roofline's 60-85 % (what `kvlab bench --estimate` checks against a run);
and kvlab serving `--concurrency` clients, each sending `--requests` / concurrency requests
one after another (closed loop, as `kvlab loadtest` does): kvlab's scheduler replayed over
the step model, with output tok/s, TTFT and ITL (what `kvlab loadtest --estimate` checks).

`--speculative K [--acceptance A] [--draft-model FILE.gguf]` adds speculative decoding: a
verify step of 1 + K rows a sequence yielding (1 - A^(K+1)) / (1 - A) tokens, its tok/s and
speed-up over plain decode at batch 1 and at --concurrency (kvlab.estimate.speculative).
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

from kvlab.errors import KvlabError
from kvlab.estimate import HardwareSpec, ModelSpec, Workload, estimate, format_estimate, known_parts
from kvlab.estimate.hardware import GB, Interconnect
from kvlab.estimate.parallel import format_parallel, predict_parallel
from kvlab.estimate.plot import plot_estimate
from kvlab.estimate.report import format_hardware_table
from kvlab.estimate.serving_replay import (
    RequestSpec,
    format_serving,
    predict_serving,
    serving_figures,
)
from kvlab.estimate.specs import load_model_spec, spec_from_description, spec_from_gguf
from kvlab.estimate.speculative import (
    DEFAULT_ACCEPTANCE,
    SpecEstimate,
    check_speculation,
    predict_speculative,
    step_seconds,
)
from kvlab.estimate.step_model import predict
from kvlab.estimate.workload import DEFAULT_EFFICIENCY, KV_BYTES_PER_ELEMENT
from kvlab.probe import resolve_hardware
from kvlab.scheduler import SchedulerConfig
from kvlab.weights.default_model import default_model_path

if TYPE_CHECKING:
    from kvlab.estimate.kernel_steps import KvlabPrediction

_SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_DESCRIPTION_FLAGS = ("params", "size_gb", "layers", "hidden", "heads", "kv_heads", "head_dim",
                      "vocab", "intermediate", "max_context")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "estimate", help="predict prefill, decode, memory and batching from specs (roofline)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?",
                   help=".gguf file, config.json or HF model directory (default: the default "
                        "model, unless described with --params)")
    _add_description_args(p.add_argument_group("model description, instead of a file"))
    _add_hardware_args(p.add_argument_group("hardware"))
    _add_workload_args(p.add_argument_group("workload"))
    _add_parallel_args(p.add_argument_group("parallel configurations (predicted)"))
    _add_speculative_args(p.add_argument_group("speculative decoding (predicted)"))
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the estimate as JSON")
    out.add_argument("--plot", metavar="FILE.png",
                     help="write tok/s against batch size and against context (matplotlib)")
    p.set_defaults(func=run)


def _add_description_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--params", type=_quantity, metavar="COUNT",
                   help="parameter count: 8e9, 8B, 270M")
    g.add_argument("--bits", type=float, metavar="BITS",
                   help="bits per weight (4.5 for Q4_K_M, 16 for bf16); also overrides the "
                        "dtype of a config.json")
    g.add_argument("--size-gb", type=float, metavar="GB",
                   help="weight bytes in GB (e.g. the file size)")
    for flag, what in (("layers", "transformer blocks"), ("hidden", "hidden size"),
                       ("heads", "query heads"), ("kv-heads", "key/value heads"),
                       ("head-dim", "head dimension"), ("vocab", "vocabulary size"),
                       ("intermediate", "MLP intermediate size"),
                       ("max-context", "the model's context limit")):
        g.add_argument(f"--{flag}", type=_positive_int, metavar="N", help=what)
    g.add_argument("--tied", action="store_true",
                   help="the output projection shares the embedding table")


def _add_hardware_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--hardware", metavar="NAME",
                   help="a part from --list-hardware, or `this` (the `kvlab probe` cache; the "
                        "default unless --bandwidth is given)")
    g.add_argument("--bandwidth", type=float, metavar="GB/s", help="memory bandwidth")
    g.add_argument("--tflops", type=float, metavar="T", help="sustained dense TFLOPS")
    g.add_argument("--memory", type=float, metavar="GiB",
                   help="memory size in GiB (the 'GB' of spec sheets)")
    g.add_argument("--list-hardware", action="store_true", help="list the built-in parts")


def _add_workload_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--prompt", type=_positive_int, default=512, metavar="TOKENS",
                   help="prompt tokens (512)")
    g.add_argument("--output", type=int, default=256, metavar="TOKENS", help="reply tokens (256)")
    g.add_argument("--concurrency", type=_positive_int, default=1, metavar="N",
                   help="sequences decoding together (1)")
    g.add_argument("--context", type=_positive_int, metavar="TOKENS",
                   help="KV context reserved per sequence (default: prompt + output)")
    g.add_argument("--kv-dtype", choices=list(KV_BYTES_PER_ELEMENT),
                   help="KV cache dtype (f16; kvlab's own engine: f32, its CPU default)")
    g.add_argument("--dtype", help="compute dtype for FLOP/s: fp32, bf16, fp16, ... "
                                   "(default: the part's own)")
    g.add_argument("--offload-layers", type=int, default=0, metavar="N",
                   help="layers whose weights and KV sit in a second, slower memory")
    g.add_argument("--offload-bandwidth", type=float, metavar="GB/s",
                   help="bandwidth of that memory")
    g.add_argument("--efficiency", type=float, nargs=2, metavar=("LOW", "HIGH"),
                   default=list(DEFAULT_EFFICIENCY),
                   help="share of the decode ceiling reached in practice (0.6 0.85)")
    g.add_argument("--engine", choices=("roofline", "kvlab"), default="roofline",
                   help="kvlab: also predict kvlab's own engine from the probed kernel rates "
                        "and whole steps (a GGUF model, --hardware this)")
    g.add_argument("--requests", type=_positive_int, metavar="N",
                   help="with --engine kvlab: requests served (default: 4 x concurrency)")
    g.add_argument("--max-num-seqs", type=_positive_int, default=16, metavar="N",
                   help="with --engine kvlab: the server's most sequences a step (16)")
    g.add_argument("--max-num-batched-tokens", type=_positive_int, default=512, metavar="N",
                   help="with --engine kvlab: the server's token budget a step (512)")


def _add_parallel_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--tensor-parallel-size", "--tp", type=_positive_int, default=1,
                   metavar="N", help="ranks the model is split over (1)")
    g.add_argument("--replicas", type=_positive_int, default=1, metavar="N",
                   help="whole copies serving together (1)")
    g.add_argument("--target-rps", type=float, metavar="R",
                   help="requests/s to serve: the replicas that needs")
    g.add_argument("--link-bandwidth", type=float, metavar="GB/s",
                   help="interconnect bandwidth per direction (default: the part's own)")
    g.add_argument("--link-latency", type=float, default=10.0, metavar="US",
                   help="with --link-bandwidth: microseconds per all-reduce step (10)")


def _add_speculative_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--speculative", type=_positive_int, metavar="K",
                   help="predict speculative decoding of K proposed tokens a step: tokens "
                        "per verify step, tok/s and the speed-up over plain decode")
    g.add_argument("--acceptance", type=float, metavar="A",
                   help=f"with --speculative: each proposed token's acceptance rate, in "
                        f"[0, 1) ({DEFAULT_ACCEPTANCE}; `kvlab bench --speculative` measures it)")
    g.add_argument("--draft-model", metavar="FILE.gguf",
                   help="with --speculative: the draft model that proposes (default: n-gram "
                        "lookup, free)")


def _parallel(args: argparse.Namespace, model: ModelSpec, hw: HardwareSpec,
              workload: Workload, single: Any) -> Any:
    """The tensor-parallel / replica prediction, when any of its flags asks for one."""
    if args.tensor_parallel_size == 1 and args.replicas == 1 and args.target_rps is None:
        return None

    link = (None if args.link_bandwidth is None
            else Interconnect.custom(args.link_bandwidth, args.link_latency))
    return predict_parallel(model, hw, workload, single, args.tensor_parallel_size,
                            args.replicas, args.target_rps, link)


def run(args: argparse.Namespace) -> int:
    if args.list_hardware:
        parts = known_parts()
        text = (json.dumps([hw.to_dict() for hw in parts], indent=2) + "\n" if args.json
                else format_hardware_table(parts))
        print(text, end="")
        return 0
    _check_model_args(args)
    hw = hardware_from_args(args)
    model = model_from_args(args)
    workload = Workload(
        prompt_tokens=args.prompt, output_tokens=args.output, concurrency=args.concurrency,
        context=args.context, kv_dtype=args.kv_dtype or "f16",
        offload_layers=args.offload_layers,
        offload_bandwidth=None if args.offload_bandwidth is None else args.offload_bandwidth * GB,
        efficiency=(args.efficiency[0], args.efficiency[1]), compute_dtype=args.dtype)
    result = estimate(model, hw, workload)
    parallel = _parallel(args, model, hw, workload, result)
    spec = _speculative(args, model, hw, workload)
    own = served = None
    if args.engine == "kvlab":
        kvlab_workload = replace(workload, concurrency=1, kv_dtype=args.kv_dtype or "f32")
        own = predict_kvlab(model, hw, kvlab_workload)
        served = serve_kvlab(model, hw, kvlab_workload, args)
    if args.json:
        out = result.to_dict()
        if own is not None and served is not None:
            out["kvlab"] = own.to_dict() | {"serving": served}
        if parallel is not None:
            out["parallel"] = asdict(parallel) | {"speedup": parallel.speedup}
        if spec is not None:
            out["speculative"] = spec.to_dict()
        print(json.dumps(out, indent=2))
    else:
        text = "" if own is None or served is None else own.format() + _serving_text(served)
        if parallel is not None:
            text += format_parallel(parallel)
        if spec is not None:
            text += spec.format()
        print(format_estimate(result) + text, end="")
    if args.plot:
        path = plot_estimate(result, args.plot)
        if not args.json:
            print(f"plot written to {path}")
    return 0


def _speculative(args: argparse.Namespace, model: ModelSpec, hw: HardwareSpec,
                 workload: Workload) -> SpecEstimate | None:
    """Speculation against plain decode at batch 1 and at --concurrency, mid-reply."""
    if args.speculative is None:
        return None
    acceptance = DEFAULT_ACCEPTANCE if args.acceptance is None else args.acceptance
    check_speculation(args.speculative, acceptance)
    context = workload.prompt_tokens + workload.output_tokens // 2
    own = args.engine == "kvlab"
    if own:  # kvlab's engine keeps an f32 cache unless told
        workload = replace(workload, kv_dtype=args.kv_dtype or "f32")
    step, source = step_seconds(model, hw, workload, context, own)
    draft = proposer = None
    if args.draft_model:
        draft_spec = load_model_spec(args.draft_model)
        draft, _ = step_seconds(draft_spec, hw, workload, context, own)
        proposer = f"the draft {draft_spec.name or args.draft_model}"
    return predict_speculative(step, args.speculative, acceptance, (1, args.concurrency),
                               draft, proposer or "n-gram lookup", source,
                               args.acceptance is not None)


def predict_kvlab(model: ModelSpec, hw: HardwareSpec, workload: Workload) -> KvlabPrediction:
    """kvlab's own engine for one sequence of `workload`."""
    _check_kvlab_kv(workload.kv_dtype, hw)
    return predict(model, hw, workload)


def _check_kvlab_kv(kv_dtype: str, hw: HardwareSpec) -> None:
    if kv_dtype not in KV_BYTES_PER_ELEMENT:  # the engine's stores, one table (kvlab.cost)
        raise KvlabError(f"kvlab's engine has no {kv_dtype} KV cache (valid: "
                         f"{', '.join(KV_BYTES_PER_ELEMENT)})")
    if kv_dtype != "f32" and hw.steps is None:
        raise KvlabError(f"a {kv_dtype} KV cache needs the whole-step timings of `kvlab probe` "
                         "(the kernel rates alone cover f32)")


def serve_kvlab(model: ModelSpec, hw: HardwareSpec, workload: Workload,
                args: argparse.Namespace) -> dict[str, Any]:
    """kvlab serving `--requests` requests of `workload` to `--concurrency` closed-loop
    clients: the figures of `kvlab.estimate.serving_replay.serving_figures`, and the load."""
    n = args.requests or 4 * args.concurrency
    spec = RequestSpec(workload.prompt_tokens, max(workload.output_tokens, 1))
    config = SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens)
    p = predict_serving(model, hw, [spec] * n, args.concurrency, config, workload.kv_dtype)
    return {"concurrency": args.concurrency, "requests": n, "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens, "steps": p.steps,
            "streaming": hw.stream is not None, **serving_figures(p)}


def _serving_text(s: dict[str, Any]) -> str:
    table = format_serving([(s["concurrency"], s, None)])
    head = (f"serving   kvlab's scheduler (max {s['max_num_seqs']} sequences, "
            f"{s['max_num_batched_tokens']} tokens a step) over the step model"
            f"{' and the streaming path the probe timed' if s.get('streaming') else ''}: "
            f"{s['requests']} "
            f"requests from {s['concurrency']} closed-loop clients, {s['steps']:,} steps")
    return head + "\n" + "\n".join("          " + line for line in table.splitlines()) + "\n\n"


def _described(args: argparse.Namespace) -> list[str]:
    """The description flags given, as typed."""
    names = [f for f in _DESCRIPTION_FLAGS if getattr(args, f) is not None]
    return ["--" + f.replace("_", "-") for f in names] + (["--tied"] if args.tied else [])


def _check_model_args(args: argparse.Namespace) -> None:
    if args.speculative is None and (args.acceptance is not None or args.draft_model):
        flag = "--acceptance" if args.acceptance is not None else "--draft-model"
        raise KvlabError(f"{flag} applies with --speculative K (the tokens proposed a step)")
    if args.model and _described(args):
        raise KvlabError(f"give a model file or a description, not both (got {args.model} and "
                         f"{', '.join(_described(args))}); --bits may go with a config.json")
    if not args.model and not _described(args) and args.bits is not None:
        raise KvlabError("--bits needs a config.json or a description such as --params 8e9")


def model_from_args(args: argparse.Namespace) -> ModelSpec:
    if _described(args):
        return spec_from_description(
            params=args.params, bits=args.bits,
            size_bytes=None if args.size_gb is None else args.size_gb * GB, layers=args.layers,
            hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
            head_dim=args.head_dim, vocab=args.vocab, intermediate=args.intermediate,
            tied=args.tied, max_context=args.max_context)
    if args.model:
        return load_model_spec(args.model, args.bits)

    return spec_from_gguf(default_model_path())


def hardware_from_args(args: argparse.Namespace) -> HardwareSpec:
    if args.hardware is None and args.bandwidth is not None:
        if args.tflops is None:
            raise KvlabError("--bandwidth needs --tflops too (sustained dense TFLOPS), or "
                             "--hardware NAME to take the other figures from a known part")
        return HardwareSpec.custom(args.bandwidth, args.tflops, args.memory)
    spec = resolve_hardware(args.hardware or "this")
    return spec.with_overrides(args.bandwidth, args.tflops, args.memory)


def _quantity(text: str) -> float:
    """'8e9', '8B', '270M', '1.5T' -> a count."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmbgt]?)\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count; write 8e9, 8B or 270M")
    return float(match.group(1)) * _SUFFIXES.get(match.group(2), 1.0)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value
