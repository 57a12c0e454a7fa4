"""How a reply's text becomes Ollama's pieces: reasoning (`thinking`), content, tool calls,
logprobs, and the final object's counts and durations.

    Split          text deltas -> (thinking, content) deltas, then the tool calls once the
                   reply ends (kvlab.server.core's ReasoningStream and ToolStream in a row)
    stats          Ollama's counts and nanosecond durations from the engine's RequestTimings
    ollama_calls   OpenAI-style tool calls -> Ollama's {function: {name, arguments: {...}}}
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from typing import Any

from kvlab.logprobs import clamped, token_text
from kvlab.request import RequestOutput, TokenLogprob
from kvlab.server.core.reasoning import ReasoningFormat, ReasoningStream
from kvlab.server.core.tools import ToolPlan, ToolStream
from kvlab.tokenizer import Tokenizer


class Split:
    """One reply's text deltas in, (thinking, content) deltas out; tool calls at the end."""

    def __init__(self, reasoning: ReasoningFormat | None, inside: bool,
                 plan: ToolPlan | None) -> None:
        self.reasoning = None if reasoning is None else ReasoningStream(reasoning, inside)
        self.tools = None if plan is None else ToolStream(plan)

    def feed(self, delta: str) -> tuple[str, str]:
        thinking, content = ("", delta) if self.reasoning is None else self.reasoning.feed(delta)
        return thinking, content if self.tools is None else self.tools.feed(content)

    def finish(self) -> tuple[str, str, list[dict[str, Any]]]:
        """(thinking, content, Ollama tool calls) still to send once the reply has ended."""
        thinking, content = ("", "") if self.reasoning is None else self.reasoning.finish()
        if self.tools is None:
            return thinking, content, []
        content = self.tools.feed(content)
        rest, calls = self.tools.finish()
        converted = ollama_calls(calls)
        if converted is None:  # arguments that are no object: no call Ollama can carry
            return thinking, content + self.tools.held, []
        return thinking, content + rest, converted


def ollama_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """Ollama writes a call's arguments as an object, not as JSON text; None when one
    call's arguments are not a JSON object."""
    out = []
    for i, call in enumerate(calls):
        fn = call["function"]
        try:
            args = json.loads(fn["arguments"])
        except ValueError:
            return None
        if not isinstance(args, dict):
            return None
        out.append({"function": {"index": i, "name": fn["name"], "arguments": args}})
    return out


def logprobs(tokenizer: Tokenizer, items: list[TokenLogprob]) -> list[dict[str, Any]]:
    """Ollama's shape: each token's text, logprob and bytes, with its top alternatives."""
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": token_text(tokenizer, token_id), "logprob": clamped(logprob),
                "bytes": list(tokenizer.token_bytes(token_id))}
    return [{**entry(i.token_id, i.logprob),
             "top_logprobs": [entry(t, lp) for t, lp in i.top]} for i in items]


def created_at() -> str:
    """RFC 3339 in UTC, as Ollama stamps each object."""
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


def stats(started: float, last: RequestOutput | None) -> dict[str, Any]:
    """The final object's figures. prompt_eval_count is the whole prompt (cached tokens
    included, so clients can count the context); load_duration is 0: the model was loaded
    when the server started."""
    t = last.timings if last is not None else None
    decode = 0.0
    if t is not None and t.first_token is not None:
        end = t.finished or (t.token_times[-1] if t.token_times else t.first_token)
        decode = end - t.first_token
    return {"total_duration": _ns(time.perf_counter() - started), "load_duration": 0,
            "prompt_eval_count": last.prompt_tokens if last else 0,
            "prompt_eval_duration": _ns(t.prefill_seconds) if t else 0,
            "eval_count": last.output_tokens if last else 0,
            "eval_duration": _ns(decode)}


def done_reason(last: RequestOutput | None) -> str:
    """stop (end of turn, a stop sequence), length (num_predict or the context), abort."""
    if last is None or last.finish_reason is None:
        return "stop"
    return last.finish_reason.value
