"""The one error type every route raises, and how each API spells it on the wire.

A handler raises `ApiError(status, message, type_, param, code)`; the app turns it into the
body of the API whose path was called: OpenAI's `{"error": {"message", "type", "param",
"code"}}` by default, Anthropic's `{"type": "error", "error": {...}}` under /v1/messages,
Ollama's `{"error": "..."}` under /api/. Each front end registers its shape for its paths, so
401s and 413s from the guard, 404s of unknown routes and 500s all reach a client in the form
its SDK parses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class ApiError(Exception):
    """An error the client caused or must be told about."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code)

    def body(self) -> dict[str, Any]:
        """OpenAI's shape (also the server's default)."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


ErrorShape = Callable[[ApiError], dict[str, Any]]


class ErrorShapes:
    """Which error body a path gets: the shape of the longest registered prefix, else
    OpenAI's."""

    def __init__(self) -> None:
        self._shapes: dict[str, ErrorShape] = {}

    def add(self, prefix: str, shape: ErrorShape) -> None:
        self._shapes[prefix] = shape

    def body(self, path: str, err: ApiError) -> dict[str, Any]:
        matches = [p for p in self._shapes if path.startswith(p)]
        if not matches:
            return err.body()
        return self._shapes[max(matches, key=len)](err)
