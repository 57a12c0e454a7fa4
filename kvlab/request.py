"""Plain data types that cross module boundaries: sampling settings, requests, outputs.

Stdlib only. The engine fills these; the CLI, the server and the benchmarks read them.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from kvlab.errors import RequestError

STRUCTURE_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class Structure:
    """What the output must be, enforced while decoding (kvlab.structured compiles it).

    kind: "json_schema" (value: the schema as JSON text), "json_object" (any JSON object;
    value ignored), "regex" (value: the pattern, matched in full), "choice" (value: a JSON
    list of strings), "grammar" (value: EBNF / GBNF text, `root ::= ...`, or Lark).
    """

    kind: str
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURE_KINDS:
            raise RequestError(f"structure kind {self.kind!r} is not one of "
                               f"{', '.join(STRUCTURE_KINDS)}")


@dataclass(frozen=True)
class ReasoningGate:
    """Where a thinking model's reasoning block lies in its reply, so that a structure applies
    from the block's end, not to it, and a budget can end the block (kvlab.structured.gate).

    start_ids / end_ids: the block's markers as the tokenizer encodes them; inside: the prompt
    already opened the block (else the reply may open it with its first token); budget:
    reasoning tokens after which the end marker is forced (None: no limit).
    """

    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]
    inside: bool = False
    budget: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "start_ids", tuple(self.start_ids))
        object.__setattr__(self, "end_ids", tuple(self.end_ids))
        if not self.end_ids or not (self.inside or self.start_ids):
            raise RequestError("a reasoning gate needs its end marker's token ids, and its "
                               "start marker's unless the prompt opens the block")
        if self.budget is not None and self.budget < 0:
            raise RequestError(f"the reasoning budget must be >= 0 tokens, got {self.budget}")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop (OpenAI / vLLM semantics)."""

    max_tokens: int = 128
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 or -1 disables
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # 1 disables; divides positive logits of seen tokens
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to report per token
    include_stop_str_in_output: bool = False
    structured: Structure | None = None  # JSON schema, regex, choice or grammar to follow
    # added to the logits of these token ids before sampling (OpenAI: -100 bans, 100 forces);
    # a mapping is accepted and kept as sorted (token id, bias) pairs
    logit_bias: tuple[tuple[int, float], ...] = ()
    # special tokens written into the text all the same (a chat template's tool-call markers,
    # which calls are read by); the others are left out of it
    shown_special_ids: tuple[int, ...] = ()
    # a thinking model's reasoning block: `structured` applies after it; its budget ends it
    reasoning: ReasoningGate | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "shown_special_ids", tuple(self.shown_special_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        self.validate()

    def validate(self) -> None:
        checks = [
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (-1 <= self.top_k < (1 << 31),
             f"top_k must be >= 1, or 0 / -1 to disable, got {self.top_k}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0,
             f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (-2 <= self.presence_penalty <= 2,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.logprobs is None or 0 <= self.logprobs <= 20,
             f"logprobs must be in [0, 20], got {self.logprobs}"),
            (all(isinstance(s, str) and s for s in self.stop),
             "stop must be a list of non-empty strings"),
            (self.seed is None or -(1 << 63) <= self.seed < (1 << 64),
             f"seed must be a 64-bit integer, got {self.seed}"),
            (all(-100 <= b <= 100 for _, b in self.logit_bias),
             "logit_bias values must be in [-100, 100]"),
            (all(t >= 0 for t, _ in self.logit_bias), "logit_bias token ids must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise RequestError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # cancelled by the caller


@dataclass
class TokenLogprob:
    """The chosen token's log-probability and the top alternatives at that step."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestTimings:
    """Wall-clock marks of one request (time.perf_counter seconds)."""

    arrival: float = field(default_factory=time.perf_counter)
    scheduled: float | None = None  # first step that computed any of its tokens
    first_token: float | None = None
    finished: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per generated token
    prefill_seconds: float = 0.0  # time of the steps that computed its prompt

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def queue_seconds(self) -> float | None:
        return None if self.scheduled is None else self.scheduled - self.arrival

    @property
    def inter_token_latencies(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.token_times)]


@dataclass
class CoreOutput:
    """What one engine step decided for one request, in tokens only; the output processor
    (kvlab.output) makes it the RequestOutput callers read. The finishes here are the ones
    tokens decide: EOS or a stop token id, max_tokens or the context, a complete structure,
    an abort. Stop strings are the processor's."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    output_tokens: int  # generated so far, new_token_ids included
    step_time: float  # perf_counter when the step made new_token_ids
    logprobs: list[TokenLogprob] = field(default_factory=list)
    stop_token: bool = False  # the last new token is EOS or a stop token id: counted, not text
    scheduled: float | None = None  # first step that computed any of its tokens
    prefill_seconds: float = 0.0  # time of the steps that computed its prompt
    forced_tokens: int = 0  # as RequestOutput's
    draft_tokens: int = 0
    accepted_tokens: int = 0
    allowed_tokens: int | None = None
    experts: list[list[int]] | None = None


@dataclass(eq=False)
class DecodeTokens:
    """A decode step's tokens that end nothing, by column: row i gave request_ids[i] the one
    new token token_ids[i], with no finish, logprobs or forced / proposed tokens; `row(i)` is
    the CoreOutput it stands for. The engine emits one of these for the plain rows of an
    async decode step: one object per step, not one per request, since building an object
    per request would dominate a large batch's host time; the output processor reads the
    columns."""

    request_ids: list[str]
    token_ids: list[int]
    output_tokens: list[int]  # generated so far, this token included
    prompt_tokens: list[int]
    cached_tokens: list[int]
    scheduled: list[float | None]
    prefill_seconds: list[float]
    step_time: float  # perf_counter when the step made the tokens

    def __len__(self) -> int:
        return len(self.request_ids)

    def row(self, i: int) -> CoreOutput:
        """Row i as its CoreOutput. Positional, so its arguments must follow CoreOutput's
        field order; tests/test_decode_tokens.py compares it with one built by keyword."""
        return CoreOutput(self.request_ids[i], [self.token_ids[i]], None, self.prompt_tokens[i],
                          self.cached_tokens[i], self.output_tokens[i], self.step_time, [],
                          False, self.scheduled[i], self.prefill_seconds[i])


# one core step's results, in row order: a request's own output, or a run of plain tokens
StepItem = CoreOutput | DecodeTokens


@dataclass
class RequestOutput:
    """What one engine step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: FinishReason | None
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    output_tokens: int  # generated so far
    logprobs: list[TokenLogprob] = field(default_factory=list)
    timings: RequestTimings | None = None
    forced_tokens: int = 0  # of output_tokens, appended by the structure without sampling
    draft_tokens: int = 0  # tokens proposed for it so far (speculative decoding)
    accepted_tokens: int = 0  # of which the model accepted
    allowed_tokens: int | None = None  # tokens the structure allowed this step's sampled one
    # with EngineConfig.record_experts on an MoE model: per MoE layer, the expert ids the
    # sampled token's position was routed to (the step's last position of this request)
    experts: list[list[int]] | None = None
