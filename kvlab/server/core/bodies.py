"""Request bodies, from bytes to a validated object, for every API's routes.

    parse_json_body   bytes -> JSON value: nesting bounded before `json.loads` recurses,
                      NaN / Infinity and lone UTF-16 surrogates refused
    Strict            the pydantic base of every body: strict types (`"max_tokens": "5"` is a
                      400, not a silent cast) and unknown fields refused by name
    parse             JSON value -> body model; the first problem becomes a 400 that names
                      the field (and, for an unknown one, lists the fields that act)
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

from kvlab.server.core.errors import ApiError

MAX_JSON_DEPTH = 64  # objects and arrays inside each other; API bodies need about 6
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # runs, not chars: fast


def json_depth(body: bytes) -> int:
    """The deepest nesting of objects and arrays in a JSON text (strings skipped)."""
    skeleton = np.frombuffer(_JSON_STRING.sub(b"", body), dtype=np.uint8)
    step = (np.isin(skeleton, (ord("["), ord("{"))).astype(np.int32)
            - np.isin(skeleton, (ord("]"), ord("}"))))
    return int(np.cumsum(step).max(initial=0))


def parse_json_body(body: bytes) -> Any:
    """The decoded body; a 400 naming the problem for bad JSON or nesting past the bound."""
    depth = json_depth(body)
    if depth > MAX_JSON_DEPTH:
        raise ApiError(400, f"the JSON body nests {depth} levels deep; at most {MAX_JSON_DEPTH} "
                            "are accepted")
    try:
        value = json.loads(body, parse_constant=_no_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"could not parse the JSON body: {e}") from None
    _check_unicode(value)
    return value


def _check_unicode(value: Any) -> None:
    """Refuse lone UTF-16 surrogates ("\\ud800" escapes): JSON allows them, text cannot hold them."""
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ApiError(400, f"the body holds a lone UTF-16 surrogate "
                                    f"({value[e.start]!a}), which is not a Unicode character; "
                                    "send valid text") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key)
            _check_unicode(item)
    elif isinstance(value, list):
        for item in value:
            _check_unicode(item)


def _no_constant(name: str) -> Any:
    """NaN and Infinity are not JSON (Python's decoder accepts them by default)."""
    raise json.JSONDecodeError(f"{name} is not a JSON value", name, 0)


class Strict(BaseModel):
    # a field kvlab does not act on is refused by name, never silently dropped
    model_config = ConfigDict(strict=True, extra="forbid")



def parse(model: type[BaseModel], body: Any) -> Any:
    """Validate a decoded JSON body; the first problem becomes a 400 naming the field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(part) for part in err["loc"]]
        param = ".".join(loc[:2] if len(loc) > 1 and loc[1].isdigit() else loc[:1]) or None
        if err["type"] == "extra_forbidden":
            raise ApiError(400, f"unknown field '{'.'.join(loc)}' is not supported by this "
                                f"server; the fields it acts on: "
                                f"{', '.join(_fields(model, loc))}",
                           param=param) from None
        got = err.get("input")
        raise ApiError(400, f"invalid value for '{'.'.join(loc)}': {err['msg']} "
                            f"(got {got!r})", param=param) from None


def _fields(model: type[BaseModel], loc: list[str]) -> list[str]:
    """The fields of the object at `loc` (the body, or a nested object such as a part)."""
    for part in loc[:-1]:
        annotation = model.model_fields.get(part)
        inner = getattr(annotation, "annotation", None) if annotation else None
        candidates = [a for a in getattr(inner, "__args__", (inner,))
                      if isinstance(a, type) and issubclass(a, BaseModel)]
        if not candidates:
            break
        model = candidates[0]
    return sorted(model.model_fields)
