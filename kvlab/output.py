"""The output processor: the engine core's token-level results in, the RequestOutputs callers
read out. It owns each request's text: its incremental detokenizer, its stop strings, and the
counts and timings cut where the text ends.

    engine core (token ids)                 output processor (text), one state per request
    CoreOutput: new ids, logprobs,    ->    IncrementalDetokenizer -> StopStringFilter
    finishes tokens decide                  -> RequestOutput: text_delta, finish_reason,
    (EOS, stop ids, length, abort)             usage, logprobs, timings
    DecodeTokens: a decode step's     ->    a token whose text is known: a table look-up,
    tokens that end nothing, columns        its RequestOutput built when first read

A stop string is found here, possibly after the core has made more tokens for the request:
the processor finishes the request at the stop (finish reason "stop", the text cut as
StopStringFilter cuts it), drops every later token of it (never shown, never counted) and
names it in `Processed.stopped`, which the caller aborts in the core. Engine.step runs it
right after each core step; the server runs it on a thread of its own so that detokenizing
overlaps the next forward pass. `add` and `drop` may come from another thread than `process`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvlab.request import (
    CoreOutput,
    DecodeTokens,
    FinishReason,
    RequestOutput,
    RequestTimings,
    SamplingParams,
    StepItem,
    TokenLogprob,
)
from kvlab.stop import StopStringFilter
from kvlab.tokenizer import IncrementalDetokenizer, Tokenizer, TokenTexts


@dataclass(eq=False)
class _State:
    """One live request's text so far. `plain`: a token whose text is known (TokenTexts)
    is its delta as it stands: the detokenizer holds no partial character and is past the
    first token's space, and there are no stop strings to hold text back."""

    detok: IncrementalDetokenizer
    stops: StopStringFilter
    timings: RequestTimings
    plain: bool = False


@dataclass(eq=False)
class _PlainText:
    """Text of a DecodeTokens run's rows that took the table look-up: per row, its index in
    `tokens`, its delta and its request's timings. Its RequestOutputs are built when read."""

    tokens: DecodeTokens
    rows: list[tuple[int, str, RequestTimings]] = field(default_factory=list)

    def outputs(self) -> list[RequestOutput]:
        """As _made makes them from each row's CoreOutput, without building that
        CoreOutput (the columns exist to spare it). Positional, so its arguments must follow
        RequestOutput's field order; tests/test_decode_tokens.py compares it with one built
        by keyword."""
        b = self.tokens
        ids, tokens, prompt, cached, n_out = (b.request_ids, b.token_ids, b.prompt_tokens,
                                              b.cached_tokens, b.output_tokens)
        return [RequestOutput(ids[i], [tokens[i]], delta, False, None, prompt[i], cached[i],
                              n_out[i], [], t, 0, 0, 0, None, None)
                for i, delta, t in self.rows]


class Processed:
    """One core step's RequestOutputs (`outputs`, in its order) and the requests that ended
    at a stop string (`stopped`: abort them in the core). The outputs of plain decode tokens
    are built when `outputs` is first read, so a caller that reads only `stopped` pays for
    no per-request object."""

    def __init__(self) -> None:
        self.stopped: list[str] = []
        self._parts: list[RequestOutput | _PlainText] = []
        self._outputs: list[RequestOutput] | None = None

    def add(self, part: RequestOutput | _PlainText) -> None:
        self._parts.append(part)

    @property
    def outputs(self) -> list[RequestOutput]:
        if self._outputs is None:
            self._outputs = []
            for part in self._parts:
                if type(part) is _PlainText:
                    self._outputs += part.outputs()
                else:
                    self._outputs.append(part)
        return self._outputs


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.texts = TokenTexts(tokenizer)  # the tokens' own texts, shared by all requests
        self._states: dict[str, _State] = {}
        self._lock = threading.Lock()  # add/drop and process may run on different threads

    def add(self, request_id: str, params: SamplingParams, arrival: float) -> None:
        """Start a request's text; `arrival` is when the engine took it (perf_counter)."""
        detok = IncrementalDetokenizer(self.tokenizer, shown=frozenset(params.shown_special_ids))
        stops = StopStringFilter(params.stop, params.include_stop_str_in_output)
        with self._lock:
            self._states[request_id] = _State(detok, stops, RequestTimings(arrival=arrival))

    def drop(self, request_id: str) -> None:
        """Forget a request (aborted); its outputs still on their way are then ignored."""
        with self._lock:
            self._states.pop(request_id, None)

    @property
    def num_live(self) -> int:
        return len(self._states)

    def process(self, items: list[StepItem]) -> Processed:
        """The RequestOutputs of one core step, in its order; outputs of requests already
        finished here (a stop string) or dropped are left out. A plain request's one new
        token whose text is known (most decode steps) costs a table look-up; the others
        go through the detokenizer and the stop strings."""
        done = Processed()
        with self._lock:
            get = self._states.get
            states = [[get(r) for r in item.request_ids] if type(item) is DecodeTokens
                      else get(item.request_id) for item in items]
        for item, state in zip(items, states):
            if type(item) is DecodeTokens:
                self._decoded(item, state, done)
            elif state is not None:
                self._core(item, state, done)
        return done

    def _decoded(self, tokens: DecodeTokens, states: list[_State | None],
                 done: Processed) -> None:
        """A DecodeTokens run: its rows whose text is a table hit in columns, the others
        as their CoreOutputs."""
        known = self.texts.known
        text = _PlainText(tokens)
        kept = text.rows.append
        ids, scheduled, prefill = tokens.token_ids, tokens.scheduled, tokens.prefill_seconds
        step_time = tokens.step_time
        for i, state in enumerate(states):
            if state is None:
                continue
            if state.plain and (delta := known.get(ids[i])):
                kept((i, delta, state.timings))  # timed by run below: no call per row
                continue
            if text.rows:  # the rows so far go before this one
                _timed(text.rows, scheduled, prefill, step_time)
                done.add(text)
                text = _PlainText(tokens)
                kept = text.rows.append
            self._core(tokens.row(i), state, done)
        if text.rows:
            _timed(text.rows, scheduled, prefill, step_time)
            done.add(text)

    def _core(self, core: CoreOutput, state: _State, done: Processed) -> None:
        """One request's CoreOutput: a table look-up for a plain one-token delta, else
        the detokenizer and the stop strings."""
        tokens = core.new_token_ids
        if (state.plain and core.finish_reason is None and len(tokens) == 1
                and (delta := self.texts.known.get(tokens[0]))):
            t = state.timings
            _timed_one(t, core, 1)
            done.add(_made(core, tokens, delta, None, core.output_tokens, core.logprobs, t))
            return
        out = self._output(state, core)
        if out.finished:
            self.drop(core.request_id)
            if core.finish_reason is None:  # the core still runs it
                done.stopped.append(core.request_id)
        done.add(out)

    def _output(self, state: _State, core: CoreOutput) -> RequestOutput:
        delta, kept, reason = _text(state, core)
        for token in core.new_token_ids[:kept]:  # learn the texts of the tokens met
            self.texts.text(token)
        state.plain = not state.stops.stops and state.detok.settled
        if reason is not None:
            state.timings.finished = time.perf_counter()
        return _built(state.timings, core, delta, kept, reason)


def _text(state: _State, core: CoreOutput) -> tuple[str, int, FinishReason | None]:
    """(text delta, how many of the new tokens it keeps, finish reason or None)."""
    detok, stops = state.detok, state.stops
    tokens = core.new_token_ids
    written = tokens[:-1] if core.stop_token else tokens  # a stop token is counted, not written
    delta = ""
    for i, token in enumerate(written):
        delta += stops.push(detok.push(token))
        if stops.stopped:
            return delta, i + 1, FinishReason.STOP
    if core.finish_reason is not None:
        delta += stops.push(detok.flush()) + stops.flush()
    return delta, len(tokens), core.finish_reason


def _timed(rows: list[tuple[int, str, RequestTimings]], scheduled: Sequence[float | None],
           prefill_seconds: Sequence[float], step_time: float, tokens: int = 1) -> None:
    """Each row (i, _, t) of a step, recorded in its timings t: when the request was
    scheduled (scheduled[i]), its prefill time (prefill_seconds[i]) and the `tokens` tokens
    the step kept of it (the first one its first token)."""
    times = [step_time] * tokens
    for i, _, t in rows:
        t.scheduled, t.prefill_seconds = scheduled[i], prefill_seconds[i]
        if tokens:
            t.token_times += times
            if t.first_token is None:
                t.first_token = step_time


def _timed_one(t: RequestTimings, core: CoreOutput, tokens: int) -> None:
    """One request's CoreOutput recorded in its timings t, keeping `tokens` of its tokens."""
    _timed([(0, "", t)], (core.scheduled,), (core.prefill_seconds,), core.step_time, tokens)


def _built(t: RequestTimings, core: CoreOutput, delta: str, kept: int,
           reason: FinishReason | None) -> RequestOutput:
    """The RequestOutput of `core` keeping its first `kept` tokens, its timings updated."""
    _timed_one(t, core, kept)
    ids, logprobs = core.new_token_ids, core.logprobs
    if kept < len(ids):  # tokens after a stop string: never shown nor counted
        ids, logprobs = ids[:kept], logprobs[:kept]
    return _made(core, ids, delta, reason, core.output_tokens - (len(core.new_token_ids) - kept),
                 logprobs, t)


def _made(core: CoreOutput, ids: list[int], delta: str, reason: FinishReason | None,
          output_tokens: int, logprobs: list[TokenLogprob], t: RequestTimings) -> RequestOutput:
    """core as a RequestOutput with these tokens, text and counts. Positional (keywords
    cost twice as much), so its arguments must follow RequestOutput's field order."""
    return RequestOutput(
        core.request_id, ids, delta, reason is not None, reason, core.prompt_tokens,
        core.cached_tokens, output_tokens, logprobs, t, core.forced_tokens, core.draft_tokens,
        core.accepted_tokens, core.allowed_tokens, core.experts)
