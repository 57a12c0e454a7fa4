"""The Responses API's stored responses: what `previous_response_id`, `GET /v1/responses/{id}`,
`DELETE` and `input_items` read.

One `ResponseStore` per server process, in memory and bounded two ways: at most `max_entries`
responses (the oldest evicted first) and none older than `max_age_s` seconds. Each entry holds
the response's JSON and its conversation as Responses items: the items before it (from the
responses it continued), its own input, and its output, so a continuation replays prior input,
prior output, then the new input. Entries are immutable once stored; a lock guards the map,
since calls are built in worker threads while routes answer on the event loop.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvlab.server.core.errors import ApiError

DEFAULT_MAX_ENTRIES = 512
DEFAULT_MAX_AGE_S = 3600.0


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the Response object as it was answered
    prior: tuple[dict[str, Any], ...]  # the conversation's items before this response's input
    input: tuple[dict[str, Any], ...]  # its own input items
    output: tuple[dict[str, Any], ...]  # its output items

    def conversation(self) -> list[dict[str, Any]]:
        """Every item up to and including this response's output."""
        return [*self.prior, *self.input, *self.output]


class ResponseStore:
    """A bounded, thread-safe map of response id -> StoredResponse."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES,
                 max_age_s: float = DEFAULT_MAX_AGE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_entries < 1 or not max_age_s > 0:
            raise ValueError(f"a response store holds >= 1 entries for > 0 s, got "
                             f"max_entries={max_entries}, max_age_s={max_age_s}")
        self.max_entries = max_entries
        self.max_age_s = max_age_s
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, tuple[float, StoredResponse]] = OrderedDict()

    def put(self, response_id: str, entry: StoredResponse) -> None:
        with self._lock:
            now = self._clock()
            self._entries.pop(response_id, None)
            self._entries[response_id] = (now, entry)
            self._expire(now)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            self._expire(self._clock())
            found = self._entries.get(response_id)
        return None if found is None else found[1]

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._entries.pop(response_id, None) is not None

    def __len__(self) -> int:
        with self._lock:
            self._expire(self._clock())
            return len(self._entries)

    def _expire(self, now: float) -> None:
        """Drop entries past their age; insertion order is age order, so stop at a young one."""
        while self._entries:
            stored_at, _ = next(iter(self._entries.values()))
            if now - stored_at <= self.max_age_s:
                return
            self._entries.popitem(last=False)


def not_found(response_id: str, param: str | None = None) -> ApiError:
    """OpenAI's 404 for a response id the store does not hold."""
    what = "Previous response" if param == "previous_response_id" else "Response"
    return ApiError(404, f"{what} with id '{response_id}' not found (it was never stored, "
                         "was deleted, or was evicted from this server's store)",
                    param=param, code="previous_response_not_found" if param else None)
