"""One visualiser run: N users send the same prompt; every engine step becomes an event.

    users 0..N-1 ---- AsyncEngine.add ----> engine thread
    their Generations --- pump tasks ---> inbox (one queue for the run)
    inbox: drain what is there -> one KV snapshot on the engine thread -> events

The KV snapshot (`AsyncEngine.call`) runs between two engine steps, so it is taken after the
step that produced the outputs in hand, perhaps a step later. That is exact enough: a live
request's block table only grows (append-only), so an event cuts the latest table it knows
to the blocks its own token count needs. Token and byte counts come from the outputs
themselves and are exact: after k generated tokens the cache holds prompt + k - 1 tokens
(the last sampled token has no K/V yet), as `GenerationMetrics.kv_tokens` counts them.

Event shapes are documented in docs/viz.md.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from kvlab.engine import Engine, EngineStats, KVView
from kvlab.errors import KvlabError
from kvlab.request import RequestOutput, SamplingParams
from kvlab.server.core.async_engine import (
    AsyncEngine,
    EngineOverloaded,
    EngineRequest,
    EngineStepError,
    EngineUnavailable,
    Generation,
)


@dataclass(frozen=True)
class RunSpec:
    prompt_ids: list[int]
    params: list[SamplingParams]  # one per user
    arrival: str = "staggered"  # each user arrives when the one before has its first token

    @property
    def users(self) -> int:
        return len(self.params)


@dataclass
class UserState:
    user: int
    request_id: str
    prompt_tokens: int
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    last_view: KVView | None = None
    done: bool = False
    draft_tokens: int = 0  # speculative decoding: proposals verified so far
    accepted_tokens: int = 0  # of which the model kept


class LiveRequests:
    """The visualiser's requests that hold KV blocks now, across every page and tab."""

    def __init__(self) -> None:
        self.users: dict[str, tuple[str, UserState]] = {}  # request id -> (run id, state)

    def ids(self) -> list[str]:
        return list(self.users)


def kv_record(tokens: int, cached_tokens: int, view: KVView | None, block_size: int,
              bytes_per_token: int) -> dict[str, Any]:
    """One request's KV cache after `tokens` tokens are stored.

        block_size 4, tokens 10, cached 4:   [c c c c | t t t t | t t . .]
        blocks = ceil(10 / 4) = 3; block 0 came from the prefix cache
    """
    blocks = -(-tokens // block_size)
    table = list(view.block_table[:blocks]) if view is not None else []
    return {"tokens": tokens, "bytes": tokens * bytes_per_token, "blocks": blocks,
            "block_table": table, "cached_tokens": cached_tokens,
            "cached_blocks": cached_tokens // block_size}


def pool_record(stats: EngineStats, live: LiveRequests,
                views: dict[str, KVView | None]) -> dict[str, Any]:
    """The whole paged pool: totals, and the block tables of the visualiser's requests."""
    requests = []
    for rid, view in views.items():
        if view is None or rid not in live.users:
            continue
        run_id, state = live.users[rid]
        requests.append({"request_id": rid, "run_id": run_id, "user": state.user,
                         "block_table": view.block_table, "tokens": view.num_tokens,
                         "cached_blocks": view.num_cached_tokens // view.block_size,
                         "state_slot": view.state_slot})
    return {"event": "pool", "blocks_total": stats.kv_blocks_total,
            "blocks_used": stats.kv_blocks_used, "block_size": stats.block_size,
            "usage": stats.kv_usage, "running": stats.num_running, "waiting": stats.num_waiting,
            "prefix_queries": stats.prefix_queries, "prefix_hits": stats.prefix_hits,
            "requests": requests, "states": states_record(stats, live)}


def states_record(stats: EngineStats, live: LiveRequests) -> dict[str, Any] | None:
    """A hybrid model's recurrent state rows beside the KV blocks: each slot's owner (the
    visualiser's requests by run and user, others as "other"), and the snapshot rows the
    prefix cache keeps; None for a model without recurrent layers.

        slots      0       1       2     3          snapshot rows: 5 of 8 used, 4 saved
        owner    u0/r1   other    u1/r1  free
    """
    states = stats.states
    if states is None:
        return None
    slots: list[dict[str, Any] | None] = [None] * states.slots_total
    for rid, slot in states.owners.items():
        run_id, state = live.users.get(rid, (None, None))
        slots[slot] = ({"request_id": rid, "run_id": run_id, "user": state.user}
                       if state is not None else {"request_id": None})
    return {"slots_total": states.slots_total, "slots_used": states.slots_used,
            "slots": slots, "snapshot_rows_total": states.snapshot_rows_total,
            "snapshot_rows_used": states.snapshot_rows_used,
            "snapshots_saved": states.snapshots_saved}


def pool_views(engine: Engine, ids: list[str]) -> tuple[EngineStats, dict[str, KVView | None]]:
    """Runs on the engine thread: pool totals and each live request's KV view."""
    return engine.stats(), {rid: engine.kv_view(rid) for rid in ids}


async def pool_now(engine: AsyncEngine, live: LiveRequests) -> dict[str, Any]:
    stats, views = await engine.call(partial(pool_views, ids=live.ids()))
    return pool_record(stats, live, views)


class VizRun:
    """Drives one run's users through the AsyncEngine and yields its events as dicts."""

    def __init__(self, engine: AsyncEngine, live: LiveRequests, spec: RunSpec) -> None:
        self.engine, self.live, self.spec = engine, live, spec
        self.run_id = f"viz-{uuid.uuid4().hex[:12]}"
        self.tokenizer = engine.tokenizer
        served = engine.snapshot()
        self.block_size = served.block_size
        self.bytes_per_token = served.kv_bytes_per_token
        self.states = [UserState(i, f"{self.run_id}-u{i}", len(spec.prompt_ids))
                       for i in range(spec.users)]
        self.inbox: asyncio.Queue[tuple[UserState, RequestOutput | BaseException]] = \
            asyncio.Queue()
        self.gens: list[Generation] = []
        self.pumps: list[asyncio.Task[None]] = []
        self.added = 0
        self.started = time.perf_counter()

    # ---- users in -------------------------------------------------------------------------

    async def start(self) -> None:
        """Add the first user (all of them when they arrive together); errors raise here."""
        await self._add(self.spec.users if self.spec.arrival == "together" else 1)

    async def _add(self, count: int) -> None:
        states = self.states[self.added:self.added + count]
        reqs = [EngineRequest(s.request_id, self.spec.prompt_ids, self.spec.params[s.user])
                for s in states]
        gen = await self.engine.add(reqs)
        self.added += count
        self.gens.append(gen)
        for s in states:
            self.live.users[s.request_id] = (self.run_id, s)
        by_id = {s.request_id: s for s in states}
        self.pumps.append(asyncio.ensure_future(self._pump(gen, by_id)))

    async def _pump(self, gen: Generation, by_id: dict[str, UserState]) -> None:
        first = next(iter(by_id.values()))
        try:
            async for out in gen:
                self.inbox.put_nowait((by_id[out.request_id], out))
        except EngineStepError as e:  # the engine step failed: report it as an event
            self.inbox.put_nowait((first, e))

    def close(self) -> None:
        """Abort what is unfinished and forget the run's requests (idempotent)."""
        for gen in self.gens:
            gen.close()
        for task in self.pumps:
            task.cancel()
        for s in self.states:
            self.live.users.pop(s.request_id, None)

    # ---- events out -----------------------------------------------------------------------

    def start_event(self, extra: dict[str, Any]) -> dict[str, Any]:
        ids = self.spec.prompt_ids
        return {"event": "start", "run_id": self.run_id, "users": self.spec.users,
                "arrival": self.spec.arrival,
                "request_ids": [s.request_id for s in self.states],
                "prompt": {"token_ids": ids, "tokens": [self.token_text(t) for t in ids]},
                "block_size": self.block_size, "kv_bytes_per_token": self.bytes_per_token,
                **extra}

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        try:
            while not all(s.done for s in self.states):
                batch = [await self.inbox.get()]
                while not self.inbox.empty():
                    batch.append(self.inbox.get_nowait())
                stats, views = await self._pool_views()
                for state, item in batch:
                    if isinstance(item, BaseException):
                        yield {"event": "error", "message": str(item)}
                        return
                    if views.get(state.request_id) is not None:
                        state.last_view = views[state.request_id]
                    for event in self._step_events(state, item):
                        yield event
                yield pool_record(stats, self.live, views)
                try:
                    await self._admit_next(batch)
                except (KvlabError, EngineOverloaded, EngineUnavailable) as e:
                    yield {"event": "error", "message": f"user {self.added + 1} was refused: {e}"}
                    return
        finally:
            self.close()
        yield {"event": "end", "run_id": self.run_id,
               "elapsed_s": time.perf_counter() - self.started}

    async def _pool_views(self) -> tuple[EngineStats, dict[str, KVView | None]]:
        if not self.engine.alive:  # shutting down: no engine thread to ask any more
            return self.engine.stats, {}
        return await self.engine.call(partial(pool_views, ids=self.live.ids()))

    async def _admit_next(self, batch: list[tuple[UserState, Any]]) -> None:
        """Staggered arrival: the next user comes once the newest one has its first token."""
        if self.added >= self.spec.users:
            return
        newest = self.states[self.added - 1]
        if any(s is newest for s, _ in batch) and newest.output_ids:
            await self._add(1)

    def _step_events(self, state: UserState, out: RequestOutput) -> list[dict[str, Any]]:
        verify = self._verify_event(state, out)
        accepted = verify["accepted"] if verify is not None else 0
        first, events = len(state.output_ids), []
        for i, token in enumerate(out.new_token_ids):
            state.output_ids.append(token)
            events.append(self._token_event(state, out, token))
            if i < accepted:  # a verify run's kept proposals lead the step's tokens
                events[-1]["proposal"] = "accepted"
            if out.experts is not None and i == 0:  # the sampled token's routing (MoE)
                events[-1]["experts"] = out.experts
            if out.allowed_tokens is not None:  # a structure: the first was sampled from
                # `allowed_tokens` choices, the rest were forced (computed next step as a chunk)
                events[-1]["structure"] = ({"forced": True} if i else
                                           {"forced": False, "allowed": out.allowed_tokens})
        if events:  # the text that became final this step rides on its last token
            events[-1]["text_delta"] = out.text_delta
        state.text += out.text_delta
        if verify is not None:
            # the model's own token: after the kept proposals, before any a structure forced
            events.append({**verify, "index": min(first + accepted, len(state.output_ids) - 1)})
        if out.finished:
            state.done = True
            self.live.users.pop(state.request_id, None)
            events.append(self._done_event(state, out))
        return events

    def _verify_event(self, state: UserState, out: RequestOutput) -> dict[str, Any] | None:
        """This step's verify run of the user's proposals, from the difference of the
        cumulative counts; None when the step verified none.

            proposals  d1 d2 d3 d4     accepted 2, rejected 2
            tokens     d1 d2 t         t: the model's own token where d3 was
        """
        proposed = out.draft_tokens - state.draft_tokens
        accepted = out.accepted_tokens - state.accepted_tokens
        state.draft_tokens, state.accepted_tokens = out.draft_tokens, out.accepted_tokens
        if not proposed:
            return None
        return {"event": "verify", "request_id": state.request_id, "user": state.user,
                "proposed": proposed, "accepted": accepted, "rejected": proposed - accepted,
                "draft_tokens": out.draft_tokens, "accepted_tokens": out.accepted_tokens,
                "acceptance_rate": out.accepted_tokens / out.draft_tokens}

    def _token_event(self, state: UserState, out: RequestOutput, token: int) -> dict[str, Any]:
        k = len(state.output_ids)  # tokens generated so far, this one included
        t = out.timings
        assert t is not None
        at = t.token_times[k - 1]
        event: dict[str, Any] = {
            "event": "prefill" if k == 1 else "decode", "request_id": state.request_id,
            "user": state.user, "index": k - 1,
            "token": {"id": token, "text": self.token_text(token)},
            "text_delta": "", "t_ms": 1e3 * (at - t.arrival),
            "kv": kv_record(out.prompt_tokens + k - 1, out.cached_tokens, state.last_view,
                            self.block_size, self.bytes_per_token)}
        if k == 1:
            event.update(prompt_tokens=out.prompt_tokens, cached_tokens=out.cached_tokens,
                         computed_tokens=out.prompt_tokens - out.cached_tokens,
                         queue_ms=1e3 * (t.queue_seconds or 0.0),
                         prefill_ms=1e3 * t.prefill_seconds, ttft_ms=1e3 * (at - t.arrival))
        else:
            event["itl_ms"] = 1e3 * (at - t.token_times[k - 2])
        return event

    def _done_event(self, state: UserState, out: RequestOutput) -> dict[str, Any]:
        metrics = None
        if out.timings is not None and out.output_tokens:
            metrics = self.engine.generation_metrics(out).as_dict()
        kv_tokens = out.prompt_tokens + max(0, out.output_tokens - 1)
        return {"event": "done", "request_id": state.request_id, "user": state.user,
                "finish_reason": out.finish_reason.value if out.finish_reason else None,
                "prompt_tokens": out.prompt_tokens, "cached_tokens": out.cached_tokens,
                "output_tokens": out.output_tokens, "output_token_ids": state.output_ids,
                "draft_tokens": out.draft_tokens, "accepted_tokens": out.accepted_tokens,
                "text": state.text, "metrics": metrics,
                "kv": kv_record(kv_tokens, out.cached_tokens, state.last_view, self.block_size,
                                self.bytes_per_token)}

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)


def user_params(base: dict[str, Any], users: int) -> list[SamplingParams]:
    """One SamplingParams per user; a given seed becomes seed, seed + 1, ... so sampled
    users differ from each other but each run repeats."""
    seed = base.get("seed")
    return [SamplingParams(**{**base, "seed": None if seed is None else seed + i})
            for i in range(users)]
