"""Logits -> token ids: a pure tensor function composed of small filters.

Per step the engine builds one SamplingBatch from its requests (the only place that reads
Python lists), then calls sample(). Inside sample() there is no host sync: per-row settings are
[B] tensors, and what must be known on the host (the largest top_k, the number of logprobs,
which rows are seeded) was decided when the batch was built.

Order, as in HF transformers and vLLM:

    raw logits --log_softmax--> reported logprobs (the model's own distribution)
    raw logits -> structure mask (tokens a row's grammar forbids -> -inf) -> logit bias
               -> repetition penalty -> presence / frequency penalties
               -> greedy rows: argmax
               -> sampled rows: temperature -> top-k -> top-p -> min-p -> softmax
                  -> argmax(probs / q), q ~ Exponential(1) drawn with the row's generator

The exponential race picks token i with probability probs[i] (the index of the smallest of
independent Exp(rate=probs[i]) variables), and each row draws its own noise, so a seeded request
gets the same tokens whatever else is in the batch.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from kvlab.kernels import fused
from kvlab.kernels.transfer import upload
from kvlab.request import SamplingParams


@dataclass
class TokenIds:
    """Ragged token id lists as one padded tensor pair."""

    ids: Tensor  # [B, L] int64, padded with 0
    valid: Tensor  # [B, L] float32, 1 for a real token, 0 for padding

    @classmethod
    def build(cls, rows: Sequence[Sequence[int]], device: torch.device | str) -> TokenIds:
        """The rows' ids copied through one flat buffer (no Python list per padded row)."""
        lengths = [len(r) for r in rows]
        width = max(1, max(lengths, default=0))
        valid = torch.arange(width)[None, :] < torch.tensor(lengths, dtype=torch.int64)[:, None]
        flat: list[int] = []
        for r in rows:  # one list, then one array: array.extend converts item by item
            flat += r
        ids = torch.zeros(len(rows), width, dtype=torch.int64)
        if flat:
            ids[valid] = torch.frombuffer(array("q", flat), dtype=torch.int64)
        return cls(ids=ids.to(device), valid=valid.float().to(device))

    def counts(self, vocab_size: int) -> Tensor:
        """[B, V] float32: how many times each token id occurs in each row."""
        counts = torch.zeros(self.ids.shape[0], vocab_size, device=self.ids.device)
        return counts.scatter_add_(1, self.ids, self.valid)


@dataclass
class LogitBias:
    """Sparse per-row logit biases: entry i adds values[i] to logits[rows[i], ids[i]]."""

    rows: Tensor  # [N] int64
    ids: Tensor  # [N] int64
    values: Tensor  # [N] float32

    @classmethod
    def build(cls, params: Sequence[SamplingParams], device: torch.device | str
              ) -> LogitBias | None:
        entries = [(row, t, b) for row, p in enumerate(params) for t, b in p.logit_bias]
        if not entries:
            return None
        rows, ids, values = zip(*entries)
        return cls(_column(rows, device, torch.int64), _column(ids, device, torch.int64),
                   _column(values, device))

    def apply(self, logits: Tensor) -> Tensor:
        """A new [B, V] tensor with the biases added (the raw logits stay as they were)."""
        return logits.index_put((self.rows, self.ids), self.values, accumulate=True)


@dataclass
class SamplingBatch:
    """Per-row sampling settings of one step as tensors. A field is None when no row uses it."""

    greedy: Tensor  # [B] bool
    temperature: Tensor  # [B] float32; 1 on greedy rows so nothing divides by 0
    top_k: Tensor | None  # [B] int64, 0 disables
    top_p: Tensor | None  # [B] float32, 1 disables
    min_p: Tensor | None  # [B] float32, 0 disables
    repetition_penalty: Tensor | None  # [B] float32, 1 disables
    seen_tokens: TokenIds | None  # prompt + output ids of rows with a repetition penalty
    presence_penalty: Tensor | None  # [B] float32
    frequency_penalty: Tensor | None  # [B] float32
    output_tokens: TokenIds | None  # output ids of rows with a presence/frequency penalty
    seeded_rows: list[tuple[int, torch.Generator]]  # sampled rows that own a generator
    any_unseeded_sampled: bool  # some sampled row draws from the default generator
    all_greedy: bool
    max_top_k: int
    num_logprobs: int  # K: the most top alternatives any row asked for
    want_logprobs: bool  # some row asked for logprobs (else they are not computed)
    allowed: Tensor | None = None  # [B, ceil(V / 32)] int32 token bitmask of constrained rows
    logit_bias: LogitBias | None = None  # the (row, token, bias) entries of biased rows

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        generators: list[torch.Generator | None],
        device: torch.device | str,
        allowed: Tensor | None = None,
    ) -> SamplingBatch:
        """Build once per step. A generator must live on `device`; None uses torch's default."""
        if not len(params) == len(prompt_ids) == len(output_ids) == len(generators):
            raise ValueError(
                f"one entry per row expected: {len(params)} params, {len(prompt_ids)} prompts, "
                f"{len(output_ids)} outputs, {len(generators)} generators"
            )
        greedy = [p.greedy for p in params]
        use_rep = [p.repetition_penalty != 1.0 for p in params]
        use_pf = [p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params]
        seen = [list(a) + list(b) if u else [] for a, b, u in zip(prompt_ids, output_ids, use_rep)]
        outputs = [list(b) if u else [] for b, u in zip(output_ids, use_pf)]
        return cls(
            greedy=_column(greedy, device, torch.bool),
            temperature=_column([1.0 if g else p.temperature for p, g in zip(params, greedy)], device),
            top_k=_column_if(any(p.top_k > 0 for p in params), [p.top_k for p in params], device,
                             torch.int64),
            top_p=_column_if(any(p.top_p < 1 for p in params), [p.top_p for p in params], device),
            min_p=_column_if(any(p.min_p > 0 for p in params), [p.min_p for p in params], device),
            repetition_penalty=_column_if(
                any(use_rep), [p.repetition_penalty for p in params], device
            ),
            seen_tokens=TokenIds.build(seen, device) if any(use_rep) else None,
            presence_penalty=_column_if(any(use_pf), [p.presence_penalty for p in params], device),
            frequency_penalty=_column_if(any(use_pf), [p.frequency_penalty for p in params], device),
            output_tokens=TokenIds.build(outputs, device) if any(use_pf) else None,
            seeded_rows=[(i, g) for i, g in enumerate(generators) if g is not None and not greedy[i]],
            any_unseeded_sampled=any(g is None and not gr for g, gr in zip(generators, greedy)),
            all_greedy=all(greedy),
            max_top_k=max((p.top_k for p in params), default=0),
            num_logprobs=max((p.logprobs or 0 for p in params), default=0),
            want_logprobs=any(p.logprobs is not None for p in params),
            allowed=allowed,
            logit_bias=LogitBias.build(params, device),
        )

    @cached_property
    def no_logprobs(self) -> tuple[Tensor, Tensor, Tensor]:
        """SampleResult's logprob columns where no row asked for them: NaN [B], and [B, 0]
        ids and log-probs; made once for every step of this batch (nothing writes them)."""
        rows, device = self.greedy.shape[0], self.greedy.device
        return (torch.full((rows,), float("nan"), device=device),
                torch.empty(rows, 0, dtype=torch.long, device=device),
                torch.empty(rows, 0, device=device))

    @property
    def penalized(self) -> bool:
        """Some row's penalties read its token ids."""
        return self.seen_tokens is not None or self.output_tokens is not None


class SamplingCache:
    """Sampling settings kept across steps, so that a step's SamplingBatch costs what
    changed rather than a Python pass per setting over every row.

    The last step's batch is kept whole for a next step of the same rows (the same owners,
    in the same order); only the structures' mask is the step's own. Each owner (a
    sequence) also holds a row of a settings table, written when it first comes; a step
    with other rows gathers its owners' rows and reads every flag the batch needs from
    their column minima and maxima. A batch whose penalties read token ids (which grow
    every step) is built whole each step by `build`.

        table[slot] = greedy, temperature, top_k, top_p, min_p, repetition, presence,
                      frequency, logprobs, wants logprobs, penalized, biased   (float64)
    """

    _WIDTH = 12

    def __init__(self) -> None:
        self._owners: list[object] = []
        self._batch: SamplingBatch | None = None
        self._slots: dict[object, int] = {}  # owner -> its row of the table
        self._free: list[int] = []  # rows of owners that were forgotten
        self._rows: list[tuple[SamplingParams, torch.Generator | None]] = []  # by row
        self._table = torch.zeros(0, self._WIDTH, dtype=torch.float64)

    def get(self, owners: list[object],
            describe: Callable[[object], tuple[SamplingParams, torch.Generator | None]],
            build: Callable[[], SamplingBatch], device: torch.device | str,
            allowed: Tensor | None) -> SamplingBatch:
        """The batch for rows `owners` (hashable; each one's settings never change):
        describe(owner) gives a new owner's params and generator, build() a whole batch
        for these rows (called where penalties read token ids)."""
        batch = self._batch
        if batch is None or batch.penalized or owners != self._owners:
            batch = self._batch = self._gathered(owners, describe, build, device)
            self._owners = list(owners)
        return batch if allowed is None else dataclasses.replace(batch, allowed=allowed)

    def _gathered(self, owners: list[object], describe: Callable, build: Callable,
                  device: torch.device | str) -> SamplingBatch:
        if not owners:
            return build()
        if len(self._slots) > 2 * len(owners) + 64:  # forget owners that left
            self._slots = {o: self._slots[o] for o in owners if o in self._slots}
            kept = set(self._slots.values())
            self._free = [i for i in range(len(self._rows)) if i not in kept]
        known = self._slots.get
        slots = [known(o) for o in owners]
        if None in slots:
            slots = [self._slot(o, describe) if s is None else s for o, s in zip(owners, slots)]
        index = torch.tensor(slots, dtype=torch.long)
        cols = self._table.index_select(0, index)  # [B, WIDTH]
        low, high = cols.min(0).values.tolist(), cols.max(0).values.tolist()
        if high[10]:  # penalized rows: their token ids are the step's own
            return build()
        greedy = cols[:, 0].bool()

        def column(i: int, used: bool, dtype: torch.dtype = torch.float32) -> Tensor | None:
            return upload(cols[:, i].to(dtype), device) if used else None

        all_greedy = bool(low[0])
        rows = [self._rows[i] for i in slots] if not all_greedy or high[11] else []
        seeded, unseeded = [], False
        if not all_greedy:
            for r, (p, g) in enumerate(rows):
                if not p.greedy:
                    seeded += [(r, g)] if g is not None else []
                    unseeded = unseeded or g is None
        return SamplingBatch(
            greedy=upload(greedy, device), temperature=column(1, True), top_k=column(
                2, high[2] > 0, torch.int64), top_p=column(3, low[3] < 1),
            min_p=column(4, high[4] > 0), repetition_penalty=None, seen_tokens=None,
            presence_penalty=None, frequency_penalty=None, output_tokens=None,
            seeded_rows=seeded, any_unseeded_sampled=unseeded, all_greedy=all_greedy,
            max_top_k=int(high[2]), num_logprobs=int(high[8]),
            want_logprobs=bool(high[9]),
            logit_bias=LogitBias.build([p for p, _ in rows], device) if high[11] else None)

    def _slot(self, owner: object, describe: Callable) -> int:
        """owner's row of the table, written from describe(owner) when it first comes."""
        slot = self._slots.get(owner)
        if slot is not None:
            return slot
        p, generator = describe(owner)
        if self._free:
            slot = self._free.pop()
            self._rows[slot] = (p, generator)
        else:
            slot = len(self._rows)
            self._rows.append((p, generator))
        if slot >= len(self._table):  # the table doubles
            grown = self._table.new_zeros(max(8, 2 * len(self._table)), self._WIDTH)
            grown[:len(self._table)] = self._table
            self._table = grown
        penalized = p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty
        self._table[slot] = torch.tensor(
            [p.greedy, 1.0 if p.greedy else p.temperature, p.top_k, p.top_p, p.min_p,
             p.repetition_penalty, p.presence_penalty, p.frequency_penalty, p.logprobs or 0,
             p.logprobs is not None, bool(penalized), bool(p.logit_bias)], dtype=torch.float64)
        self._slots[owner] = slot
        return slot


def _column(
    values: Sequence[float], device: torch.device | str, dtype: torch.dtype = torch.float32
) -> Tensor:
    return upload(torch.tensor(values, dtype=dtype), device)


def _column_if(
    used: bool,
    values: Sequence[float],
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
) -> Tensor | None:
    """The [B] column of a setting, or None when no row uses it (its filter is then skipped)."""
    return _column(values, device, dtype) if used else None


@dataclass
class SampleResult:
    """The chosen tokens and their log-probabilities under the raw model distribution."""

    token_ids: Tensor  # [B] int64
    logprobs: Tensor  # [B] float32: log_softmax(raw logits) at the chosen token (NaN when
    # no row of the batch asked for logprobs)
    top_ids: Tensor  # [B, K] int64, K = batch.num_logprobs (may be 0)
    top_logprobs: Tensor  # [B, K] float32

    @cached_property
    def token_list(self) -> list[int]:
        """token_ids as Python ints, read back once for all rows."""
        return self.token_ids.tolist()


# --- filters: [B, V] logits in, new [B, V] logits out; per-row settings as [B] tensors ---


def apply_repetition_penalty(logits: Tensor, seen: Tensor, penalty: Tensor) -> Tensor:
    """HF semantics: on seen tokens, positive logits are divided by the penalty, others multiplied."""
    r = penalty[:, None]
    penalized = torch.where(logits > 0, logits / r, logits * r)
    return torch.where(seen, penalized, logits)


def apply_presence_frequency_penalty(
    logits: Tensor, counts: Tensor, presence: Tensor, frequency: Tensor
) -> Tensor:
    """OpenAI semantics over output tokens: logit -= frequency * count + presence * (count > 0)."""
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0).float()


def apply_temperature(logits: Tensor, temperature: Tensor) -> Tensor:
    return logits / temperature[:, None]


def apply_top_k(logits: Tensor, top_k: Tensor, max_top_k: int) -> Tensor:
    """Keep each row's k largest logits (ties with the k-th are kept); k = 0 keeps all."""
    max_k = min(max_top_k, logits.shape[-1])
    if max_k <= 0:
        return logits
    top_values = logits.topk(max_k, dim=-1).values  # [B, max_k], descending
    kth = top_values.gather(1, (top_k.clamp(1, max_k) - 1)[:, None])  # [B, 1]
    kth = kth.masked_fill((top_k <= 0)[:, None], float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: Tensor, top_p: Tensor) -> Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches top_p."""
    sorted_logits, order = logits.sort(dim=-1)  # ascending
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = cumulative <= (1 - top_p)[:, None]
    drop_sorted[:, -1] = False  # the most likely token always stays
    drop = torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Drop tokens with probability below min_p times the top token's (in log space)."""
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p)[:, None]
    return logits.masked_fill(logits < threshold, float("-inf"))


# --- composition ---


def apply_penalties(logits: Tensor, batch: SamplingBatch) -> Tensor:
    vocab = logits.shape[-1]
    if batch.repetition_penalty is not None and batch.seen_tokens is not None:
        seen = batch.seen_tokens.counts(vocab) > 0
        logits = apply_repetition_penalty(logits, seen, batch.repetition_penalty)
    presence, frequency = batch.presence_penalty, batch.frequency_penalty
    if batch.output_tokens is not None and presence is not None and frequency is not None:
        counts = batch.output_tokens.counts(vocab)
        logits = apply_presence_frequency_penalty(logits, counts, presence, frequency)
    return logits


def apply_sampling_filters(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Temperature, then top-k, top-p and min-p: the distribution sampled rows draw from."""
    logits = apply_temperature(logits, batch.temperature)
    if batch.top_k is not None:
        logits = apply_top_k(logits, batch.top_k, batch.max_top_k)
    if batch.top_p is not None:
        logits = apply_top_p(logits, batch.top_p)
    if batch.min_p is not None:
        logits = apply_min_p(logits, batch.min_p)
    return logits


def exponential_noise(like: Tensor, batch: SamplingBatch) -> Tensor:
    """[B, V] Exp(1) noise; each seeded row is drawn with its own generator."""
    q = torch.empty_like(like)
    if batch.any_unseeded_sampled:
        q.exponential_()
    if batch.seeded_rows:
        rows = q.unbind(0)  # the row views at once: an index per row costs as much again
        for row, generator in batch.seeded_rows:
            rows[row].exponential_(generator=generator)
    return q.clamp_min_(torch.finfo(q.dtype).tiny)  # a 0 draw would divide 0 probs by 0


def adjusted_logits(logits: Tensor, batch: SamplingBatch, keep_raw: bool) -> Tensor:
    """Structure mask, logit bias and penalties on fp32 logits; the mask is applied in place
    unless keep_raw (the raw logits are still needed)."""
    if batch.allowed is not None:
        masked = logits.clone() if keep_raw else logits
        allowed = fused.mask_logits_(masked, batch.allowed)
    else:
        allowed = logits
    biased = batch.logit_bias.apply(allowed) if batch.logit_bias is not None else allowed
    return apply_penalties(biased, batch)


def sample(logits: Tensor, batch: SamplingBatch) -> SampleResult:
    """Pick one token per row. logits: [B, V]; nothing here syncs with the host."""
    if logits.dtype != torch.float32:  # a no-op .float() still costs a dispatch
        logits = logits.float()
    penalized = adjusted_logits(logits, batch, keep_raw=batch.want_logprobs)
    token_ids = fused.argmax(penalized)
    if not batch.all_greedy:
        probs = apply_sampling_filters(penalized, batch).softmax(dim=-1)
        sampled = fused.argmax(probs / exponential_noise(probs, batch))
        token_ids = torch.where(batch.greedy, token_ids, sampled)
    return raw_logprobs(logits, token_ids, batch)


def target_probs(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """[B, V] fp32: the distribution sample() draws each row's token from (one-hot at the
    argmax on greedy rows), for verifying proposed tokens against it. logits stay as given."""
    penalized = adjusted_logits(logits.float(), batch, keep_raw=True)
    greedy = torch.zeros_like(penalized).scatter_(1, fused.argmax(penalized)[:, None], 1.0)
    if batch.all_greedy:
        return greedy
    probs = apply_sampling_filters(penalized, batch).softmax(dim=-1)
    return torch.where(batch.greedy[:, None], greedy, probs)


def raw_logprobs(logits: Tensor, token_ids: Tensor, batch: SamplingBatch) -> SampleResult:
    """token_ids with their log-probs and each row's top alternatives under the raw
    distribution (NaN and none when no row asked for logprobs)."""
    if not batch.want_logprobs:  # a pass over the whole vocabulary saved per step
        return SampleResult(token_ids, *batch.no_logprobs)
    # log-probs of the raw distribution without materializing a [B, V] log_softmax
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    top_logits, top_ids = logits.topk(batch.num_logprobs, dim=-1)
    return SampleResult(
        token_ids=token_ids,
        logprobs=(logits.gather(1, token_ids[:, None]) - lse).squeeze(1),
        top_ids=top_ids,
        top_logprobs=top_logits - lse,
    )
