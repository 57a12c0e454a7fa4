"""`kvlab run "prompt"`: stream the continuation to stdout, then metrics to stderr."""

from __future__ import annotations

import argparse
import json
import sys

from kvlab.cli.common import (
    add_model_flags,
    add_sampling_flags,
    add_speculative_flags,
    engine_config,
    sampling_params,
    speculative_config,
)
from kvlab.errors import KvlabError
from kvlab.llm import LLM
from kvlab.logprobs import completion_logprobs


def register(subs: argparse._SubParsersAction) -> None:
    p = subs.add_parser("run", help="generate text from a prompt and report timings")
    p.add_argument("prompt")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt as one user turn with the model's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON record instead")
    add_model_flags(p)
    add_sampling_flags(p)
    add_speculative_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.logprobs is not None and not args.json:
        raise KvlabError("--logprobs N goes into the --json record; add --json (the text "
                         "stream has no place for them)")
    params = sampling_params(args)
    llm = LLM(args.model, engine_config(args, **speculative_config(args)))
    if args.chat:
        ids = llm.chat_prompt_ids([{"role": "user", "content": args.prompt}])
    else:
        ids = llm.tokenizer.encode(args.prompt)
    # the KV pages this sequence will write are faulted in now, not inside its TTFT
    llm.engine.reserve_kv_memory(tokens=len(ids) + params.max_tokens)
    text, logprobs, last = [], [], None
    for out in llm.stream(ids, params):
        text.append(out.text_delta)
        logprobs.extend(out.logprobs)
        if not args.json:
            sys.stdout.write(out.text_delta)
            sys.stdout.flush()
        last = out
    assert last is not None
    metrics = llm.engine.metrics(last)
    if args.json:
        record = {"model": llm.engine.model_name, "text": "".join(text),
                  "finish_reason": last.finish_reason.value if last.finish_reason else None,
                  "logprobs": (None if args.logprobs is None
                               else completion_logprobs(llm.tokenizer, logprobs, args.logprobs)),
                  "metrics": metrics.as_dict(),
                  "speculative": {"drafted_tokens": last.draft_tokens,
                                  "accepted_tokens": last.accepted_tokens}}
        print(json.dumps(record))
    else:
        sys.stdout.write("\n")
        print(f"\n--- {llm.engine.model_name} ({last.finish_reason.value}) ---",
              file=sys.stderr)
        print(metrics.summary(), file=sys.stderr)
        if last.draft_tokens:
            print(f"speculative: {last.accepted_tokens} of {last.draft_tokens} proposed tokens "
                  f"accepted ({100 * last.accepted_tokens / last.draft_tokens:.0f} %)",
                  file=sys.stderr)
    return 0

