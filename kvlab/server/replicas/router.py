"""Which replica serves a request: prefix-cache affinity through Serve's request router.

A replica's prefix cache only helps requests whose leading KV blocks it already holds, so
requests that begin alike should land on the same replica. The ingress derives a routing key
from the request body (`routing_key`) and passes it with the call; `PrefixRouter` (a Ray
Serve `RequestRouter`, run inside the ingress's handle) maps the key onto the replicas:

    body -> leading text -> first full "blocks" of characters -> sha1 -> key
    key  -> rendezvous hashing over replica ids -> [first, second, ...] (stable per key)
    first, unless it is busy -> Serve picks the less loaded of {first, second}

The key hashes characters, not tokens: tokenizing in the ingress would load the tokenizer
there and spend its CPU on every body, while the leading characters of the prompt (or of
the chat messages, roles included) decide the leading tokens just as well. One block is
taken as `block_size * chars_per_token` characters; a prompt shorter than one block gets no
key (nothing of it would be cached) and is routed by load alone. Rendezvous hashing moves
only the keys of a replica that comes or goes.

State a replica keeps, a stored Responses response, is found only on that replica: its id
carries the replica's id (`resp_<replica>_<hex>`), and a request that reads it (a
`previous_response_id`, `GET` / `DELETE /v1/responses/{id}`) is pinned there (`PIN` keys).

"Busy" is read from Serve's cached queue lengths: a replica is busy when it holds
`imbalance` more requests than the least loaded one, or as many as it accepts.
`RoundRobinRouter` is the plain baseline to measure the affinity against (Serve's own
power-of-two-choices router is the other).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import re
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

PIN = "replica:"  # a routing key naming the one replica that can answer
_STATE_ID = re.compile(r"resp_(.+)_[0-9a-f]{32}")
_RESPONSE_PATH = re.compile(r"/v1/responses/([^/]+)(?:/input_items)?")
ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
                "/api/chat", "/api/generate")


def leading_text(body: Any) -> str:
    """The text a request's prompt starts with, in any API's body: the system text (Anthropic's
    `system`, Ollama's `system`, Responses' `instructions`), then the chat messages (or
    Responses' `input`), or the first prompt."""
    if not isinstance(body, dict):
        return ""
    system = _content_text(body.get("system")) + _content_text(body.get("instructions"))
    turns = body.get("messages", body.get("input"))
    if isinstance(turns, list):
        return system + "".join(f"{m.get('role')}\n{_content_text(m.get('content'))}\n"
                                for m in turns if isinstance(m, dict))
    if isinstance(turns, str):  # Responses' input as one string
        return system + turns
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0] if isinstance(prompt[0], (str, list)) else prompt
    if isinstance(prompt, list):  # token ids
        return system + " ".join(str(t) for t in prompt)
    return system + (prompt if isinstance(prompt, str) else "")


def _content_text(content: Any) -> str:
    if isinstance(content, list):  # content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def routing_key(path: str, body: bytes, block_chars: int, blocks: int) -> str | None:
    """The key of the request's first full blocks (at most `blocks`), or None when it has none.

    A body that is not valid JSON gets no key: the replica will answer it with the 400.
    """
    pinned = pinned_key(path, body)
    if pinned is not None or path not in ROUTED_PATHS:
        return pinned
    try:
        text = leading_text(json.loads(body))
    except (ValueError, UnicodeDecodeError):
        return None
    full = min(blocks, len(text) // block_chars)
    if full == 0:
        return None
    return hashlib.sha1(text[:full * block_chars].encode("utf-8", "surrogatepass")).hexdigest()


def pinned_key(path: str, body: bytes) -> str | None:
    """`PIN + replica id` for a request that reads state one replica keeps, else None."""
    found = _RESPONSE_PATH.fullmatch(path)
    state_id = found.group(1) if found else None
    if path == "/v1/responses" and b"previous_response_id" in body:
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            return None
        state_id = data.get("previous_response_id") if isinstance(data, dict) else None
    owner = _STATE_ID.fullmatch(state_id) if isinstance(state_id, str) else None
    return PIN + owner.group(1) if owner else None


def pinned_replica(key: str | None,
                   candidates: list[RunningReplica]) -> RunningReplica | None:
    """The replica a PIN key names, if it is still running."""
    if key is None or not key.startswith(PIN):
        return None
    wanted = key[len(PIN):]
    return next((r for r in candidates if r.replica_id.unique_id == wanted), None)


def rendezvous_order(key: str, replica_ids: list[str]) -> list[str]:
    """Replica ids from most to least preferred for this key (highest random weight first)."""
    def weight(rid: str) -> bytes:
        return hashlib.blake2b(f"{key}|{rid}".encode(), digest_size=8).digest()
    return sorted(replica_ids, key=weight, reverse=True)


def is_busy(queue_len: int | None, least: int, capacity: int, imbalance: int) -> bool:
    """Too loaded to take a request for affinity's sake (None: not known, taken as idle)."""
    q = queue_len or 0
    return q >= capacity or q - least >= imbalance


class PrefixRouter(RequestRouter):
    """Same leading blocks, same replica; a busy first choice spills to the less loaded of two."""

    def initialize_state(self, imbalance: int = 4, **_: Any) -> None:
        self.imbalance = imbalance

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        key = pending_request.kwargs.get("prefix_key") if pending_request else None
        pinned = pinned_replica(key, candidate_replicas)
        if pinned is not None:
            return [[pinned]]
        if key is None or key.startswith(PIN) or len(candidate_replicas) < 2:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        ranked = [by_id[rid] for rid in rendezvous_order(key, list(by_id))]
        cache = self.replica_queue_len_cache
        least = min(cache.get(r.replica_id) or 0 for r in ranked)
        first = ranked[0]
        if is_busy(cache.get(first.replica_id), least, first.max_ongoing_requests,
                   self.imbalance):
            return [ranked[:2], ranked[2:]]
        return [[first], ranked[1:]]


class RoundRobinRouter(RequestRouter):
    """Each replica in turn, blind to prefixes and load: the baseline."""

    def initialize_state(self, **_: Any) -> None:
        self._turn = itertools.count()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        key = pending_request.kwargs.get("prefix_key") if pending_request else None
        pinned = pinned_replica(key, candidate_replicas)
        if pinned is not None:
            return [[pinned]]
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        i = next(self._turn) % len(ordered)
        return [[ordered[i]], ordered[i + 1:] + ordered[:i]]
