"""`kvlab chat`: multi-turn chat in the terminal with the model's chat template."""

from __future__ import annotations

import argparse
import sys

from kvlab.cli.common import add_model_flags, add_sampling_flags, engine_config, sampling_params
from kvlab.errors import KvlabError
from kvlab.llm import LLM


def register(subs: argparse._SubParsersAction) -> None:
    p = subs.add_parser("chat", help="multi-turn chat in the terminal")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--metrics", action="store_true", help="print timings after each reply")
    add_model_flags(p)
    add_sampling_flags(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.logprobs is not None:
        raise KvlabError("kvlab chat prints text only: --logprobs N is for "
                         "`kvlab run --json --logprobs N`")
    llm = LLM(args.model, engine_config(args))
    params = sampling_params(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print(f"kvlab chat with {llm.engine.model_name}; an empty line or Ctrl-D ends it.",
          file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        reply, last = [], None
        for out in llm.stream(llm.chat_prompt_ids(messages), params):
            sys.stdout.write(out.text_delta)
            sys.stdout.flush()
            reply.append(out.text_delta)
            last = out
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply).strip()})
        if args.metrics and last is not None:
            print(llm.engine.metrics(last).summary(), file=sys.stderr)
    return 0
