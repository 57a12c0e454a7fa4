"""`kvlab bench -p 512 -n 128 -r 5 [-d 1024,4096] [-o md|json|csv] [--estimate]
[--profile-layers]`."""

from __future__ import annotations

import argparse
import json

from kvlab.cli.bench_estimate import print_check
from kvlab.cli.common import (
    add_model_flags,
    add_speculative_flags,
    engine_config,
    speculative_config,
)
from kvlab.engine import Engine
from kvlab.errors import KvlabError
from kvlab.estimate.speculative import SpecRun
from kvlab.harness.decode_split import LayerSplit, format_splits, profiled_tg
from kvlab.harness.llama_bench import BenchResult, bench_pp, bench_tg, format_table, weight_check
from kvlab.metrics import RunCost
from kvlab.probe import this_machine
from kvlab.spec.stats import SpecCounts
from kvlab.weights.default_model import default_model_path


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") \
            from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"values must be >= 0, got {text!r}")
    return values


def register(subs: argparse._SubParsersAction) -> None:
    p = subs.add_parser("bench", help="prefill and decode speed, llama-bench style")
    p.add_argument("-p", "--n-prompt", type=_ints, default=[512], help="prompt lengths")
    p.add_argument("-n", "--n-gen", type=_ints, default=[128], help="tokens to generate")
    p.add_argument("-r", "--repetitions", type=int, default=5)
    p.add_argument("-d", "--depth", type=_ints, default=[0],
                   help="KV cache depths for the tg tests, e.g. 0,1024,4096")
    p.add_argument("-b", "--batch-size", type=int, default=512,
                   help="prompt tokens per step, as llama-bench's -ub (the batch one pass "
                        "computes, 512 by default in both): a longer prompt prefills in "
                        "chunks of this many, so memory stays bounded")
    p.add_argument("-o", "--output", choices=("md", "json", "csv"), default="md")
    p.add_argument("--estimate", action="store_true",
                   help="print the estimator's prediction beside each measurement")
    p.add_argument("--profile-layers", action="store_true",
                   help="time the one-call C decode's layers by kind (attention, recurrent "
                        "mixer, MLP, tail) in each tg test and print ms per token of each, the rest "
                        "of the step as head/other")
    add_model_flags(p)
    add_speculative_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.repetitions < 1 or args.batch_size < 1:
        raise KvlabError(f"-r and -b must be >= 1, got {args.repetitions} and {args.batch_size}")
    if args.profile_layers and args.speculative:
        raise KvlabError("--profile-layers times plain decode steps (speculative verify steps "
                         "leave the one C call): run it without --speculative")
    # a pp test generates one token after its prompt, a tg test n after its depth
    longest = max([p + 1 for p in args.n_prompt] + [d + max(args.n_gen) + 1 for d in args.depth])
    config = engine_config(args, enable_prefix_caching=False, max_num_seqs=1,
                           max_num_batched_tokens=args.batch_size,
                           max_model_len=args.max_model_len or max(longest, 2048),
                           **speculative_config(args))
    engine = Engine.from_model(args.model, config)
    bandwidth = _machine_bandwidth()
    _run_one_warmup(engine, max(args.n_prompt, default=0))
    results = [bench_pp(engine, p, args.repetitions) for p in args.n_prompt if p]
    accepted: dict[str, SpecCounts] = {}  # per tg test, its proposals (speculative runs)
    splits: list[LayerSplit] = []  # --profile-layers: per tg test, its time by layer kind
    for d in args.depth:
        for n in filter(None, args.n_gen):
            before = engine.stats().speculative
            if args.profile_layers:
                result, split = profiled_tg(engine, n, args.repetitions, d, bandwidth)
                splits += [split] if split else []
            else:
                result = bench_tg(engine, n, args.repetitions, d, bandwidth_gb_s=bandwidth)
            results.append(result)
            if engine.config.speculative:
                accepted[results[-1].test] = _since(before, engine.stats().speculative)
    _print(results, args.output, engine, accepted, splits)
    if args.profile_layers and args.output != "json":
        print(format_splits(splits) if splits else
              "layer profile: no decode step ran in the one C call (it times only that path)")
    if args.estimate:
        print_check(str(args.model or default_model_path()), results, args.threads,
                    quantized=engine.runner.kernel_decode, kv_dtype=engine.config.kv_dtype,
                    speculative=_spec_runs(results, accepted), draft_path=args.draft_model, method=engine.config.speculative)
    return 0


def _run_one_warmup(engine: Engine, n_prompt: int) -> None:
    """First calls page in the weights and warm the allocator; not part of any figure. The
    prompt is the longest pp test's, as llama-bench warms up with the test's whole prompt:
    a first prefill of that size grows its buffers (the kept prefill output, the KV pages)."""
    bench_tg(engine, 4, 1)
    bench_pp(engine, n_prompt or 32, 1)


def _machine_bandwidth() -> float | None:
    try:

        return this_machine().bandwidth / 1e9
    except Exception:  # noqa: BLE001 - no probe cache yet: the share column stays empty
        return None


def _routed_note(cost: RunCost) -> str:
    if not cost.spec.experts:
        return ""
    return f"; {cost.spec.experts_used} of {cost.spec.experts} experts per layer and token"


def _parallel_note(size: int) -> str:
    if size == 1:
        return ""
    return (f"; tensor parallel {size}: bytes and GB/s are rank 0's (its share of the layers, "
            "the embedding and head whole), FLOP/s too")


def _since(before: SpecCounts, after: SpecCounts) -> SpecCounts:
    return SpecCounts(after.runs - before.runs, after.drafted - before.drafted,
                      after.accepted - before.accepted)


def _spec_runs(results: list[BenchResult], counts: dict[str, SpecCounts]
               ) -> dict[str, SpecRun]:
    """Each speculative tg test's counts over the tokens its repetitions decoded."""
    return {r.test: SpecRun(r.n_gen * len(r.samples), c.runs, c.drafted, c.accepted)
            for r in results if (c := counts.get(r.test)) is not None}


def _print(results: list[BenchResult], fmt: str, engine: Engine,
           accepted: dict[str, SpecCounts], splits: list[LayerSplit]) -> None:
    if fmt == "json":
        layer_ms = {s.test: {"layer_ms": s.ms, "layer_steps": s.steps} for s in splits}
        rows = [{**r.as_dict(), **({"drafted_tokens": accepted[r.test].drafted,
                                    "accepted_tokens": accepted[r.test].accepted}
                                   if r.test in accepted else {}),
                 **layer_ms.get(r.test, {})} for r in results]
        print(json.dumps({"model": engine.model_name, "results": rows}, indent=2))
        return
    print(f"model: {engine.model_name}, weights {engine.loaded.weight_bytes / 1e6:.1f} MB, "
          f"decode reads {engine.cost.decode_weight_bytes / 1e6:.1f} MB of weights per token "
          f"({engine.cost.decode_stored_bytes / 1e6:.1f} MB as the file stores them)"
          + _routed_note(engine.cost) + _parallel_note(engine.config.tensor_parallel_size))
    print(format_table(results, fmt))
    for test, c in accepted.items():  # beside each tg test's t/s
        print(f"{test}: speculative {engine.config.speculative} (up to "
              f"{engine.config.num_speculative} per step): {c.accepted} of {c.drafted} "
              f"proposed tokens accepted, acceptance rate {100 * c.acceptance_rate:.1f} %")
    check = weight_check(results, engine.cost.decode_weight_bytes)
    if check and fmt == "md":
        print(check)
