"""The live visualiser: a page at /viz and the JSON and streaming endpoints behind it.

    GET  /viz                   the page (static HTML, CSS, JS: no build step, works offline)
    POST /viz/api/run           a run as NDJSON events (or SSE with ?format=sse): docs/viz.md
    GET  /viz/api/pool          the paged KV pool now: totals and the visualiser's block tables
    GET  /viz/api/options       model, KV layout, hardware table, presets, this machine's source
    GET  /viz/api/estimate      the what-if prediction (kvlab.estimate roofline) as JSON

Everything goes through the AsyncEngine's public methods: `snapshot` for what is served and
the KV layout, `add` for requests, `call` for the KV views, which run on the engine thread
between two steps.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import FileResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.types import Receive, Scope, Send

from kvlab.errors import KvlabError, RequestError
from kvlab.estimate import ModelSpec
from kvlab.estimate.specs import Architecture, architecture_from_config, spec_from_gguf
from kvlab.request import Structure
from kvlab.scheduler import SchedulerConfig
from kvlab.server.core.async_engine import AsyncEngine
from kvlab.server.core.bodies import parse_json_body
from kvlab.server.core.errors import ApiError
from kvlab.server.viz.events import LiveRequests, RunSpec, VizRun, pool_now, user_params
from kvlab.server.viz.predict import (
    PRESETS,
    QUANT_BITS,
    QUANT_LABELS,
    SERVED,
    THIS,
    MachineSource,
    hardware_choices,
    hardware_for,
    model_for,
    predict,
    this_machine,
)
from kvlab.weights.default_model import default_model_path

router = APIRouter()
STATIC = Path(__file__).with_name("static")
STATIC_TYPES = {"viz.js": "text/javascript", "viz.css": "text/css"}
MAX_USERS = 8


class VizRunRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    prompt: str
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    users: int = 1
    arrival: Literal["staggered", "together"] = "staggered"
    json_schema: dict[str, Any] | None = None  # the output must follow this schema


@dataclass
class VizState:
    """Per app: the live visualiser requests, and the estimator's inputs (built once)."""

    live: LiveRequests
    served: ModelSpec
    served_arch: Architecture
    machine: MachineSource | None = None
    machine_lock: asyncio.Lock | None = None

    async def this_machine(self) -> MachineSource:
        if self.machine_lock is None:
            self.machine_lock = asyncio.Lock()
        async with self.machine_lock:
            if self.machine is None:
                self.machine = await asyncio.to_thread(this_machine)
        return self.machine


def _engine(request: Request) -> AsyncEngine:
    return request.app.state.engine


async def _state(app: FastAPI) -> VizState:
    """Built on first use; reading the served model's GGUF directory takes a moment."""
    state = getattr(app.state, "viz", None)
    if state is None:
        served, arch = await asyncio.to_thread(_served_model, app.state.engine)
        state = getattr(app.state, "viz", None) or VizState(LiveRequests(), served, arch)
        app.state.viz = state
    return state


def _served_model(engine: AsyncEngine) -> tuple[ModelSpec, Architecture]:
    """The served model for the estimator: its GGUF file when that is the default model (the
    file names every matrix, which kvlab's own step model needs), else the engine's own spec
    of the model it loaded; and its shape, for the what-if quantizations."""
    served = engine.snapshot()
    try:
        path = default_model_path()
    except (KvlabError, OSError):  # no default model installed: the loaded one's spec
        path = None
    spec = (spec_from_gguf(path) if path is not None and path.name == engine.model_name
            else served.spec)
    return spec, architecture_from_config(served.model)


# ---- the page ----------------------------------------------------------------------------------


@router.get("/viz", include_in_schema=False)
async def page() -> FileResponse:
    return FileResponse(STATIC / "viz.html", media_type="text/html",
                        headers={"Cache-Control": "no-cache"})


@router.get("/viz/static/{name}", include_in_schema=False)
async def static(name: str) -> FileResponse:
    if name not in STATIC_TYPES:
        raise ApiError(404, f"no static file {name!r}; there are {', '.join(STATIC_TYPES)}")
    return FileResponse(STATIC / name, media_type=STATIC_TYPES[name],
                        headers={"Cache-Control": "no-cache"})


# ---- JSON endpoints ----------------------------------------------------------------------------


@router.get("/viz/api/options")
async def options(request: Request) -> dict[str, Any]:
    engine, state = _engine(request), await _state(request.app)
    machine = await state.this_machine()
    served = engine.snapshot()
    return {
        "model": engine.model_name, "max_model_len": engine.max_model_len,
        "block_size": served.block_size, "kv_dtype": served.kv_dtype,
        "kv_bytes_per_token": served.kv_bytes_per_token,
        "state_slots": served.num_state_slots, "state_bytes_per_seq": served.state_bytes_per_seq,
        "prefix_caching": served.enable_prefix_caching,
        "max_num_batched_tokens": served.max_num_batched_tokens,
        "max_users": min(MAX_USERS, engine.capacity),
        "this_machine": {"kind": machine.kind, "label": machine.label},
        "hardware": hardware_choices(machine),
        "models": [{"key": SERVED, "name": f"{engine.model_name} (served)"}]
        + [{"key": k, "name": label} for k, (label, _) in PRESETS.items()],
        "quants": [{"key": k, "name": QUANT_LABELS[k]} for k in ("file", *QUANT_BITS)],
    }


@router.get("/viz/api/pool")
async def pool(request: Request) -> dict[str, Any]:
    return await pool_now(_engine(request), (await _state(request.app)).live)


@router.get("/viz/api/estimate")
async def what_if(request: Request, hardware: str = THIS, model: str = SERVED,
                  quant: str = "file", prompt_tokens: int | None = Query(None, ge=1),
                  prompt: str | None = None, output_tokens: int = Query(64, ge=1),
                  concurrency: int = Query(1, ge=1), kv_dtype: str | None = None
                  ) -> dict[str, Any]:
    """Predicted TTFT, tok/s and response time; give prompt_tokens or the prompt text."""
    engine, state = _engine(request), await _state(request.app)
    if prompt_tokens is None:
        if prompt is None:
            raise ApiError(400, "give prompt_tokens (a count) or prompt (text to tokenize)",
                           param="prompt_tokens")
        prompt_tokens = max(1, len(await asyncio.to_thread(engine.tokenizer.encode, prompt)))
    machine = await state.this_machine()
    hw = hardware_for(hardware, machine)
    spec = model_for(model, quant, state.served, state.served_arch)
    served = engine.snapshot()
    if kv_dtype is None:  # the served engine's own layout on this machine, else a GPU's f16
        native = hardware == THIS and model == SERVED
        kv_dtype = served.kv_dtype if native else "f16"
    scheduler = SchedulerConfig(served.max_num_seqs, served.max_num_batched_tokens)
    result = await asyncio.to_thread(predict, spec, hw, prompt_tokens, output_tokens,
                                     concurrency, kv_dtype, scheduler)
    result["hardware"]["source"] = machine.label if hardware == THIS else "built-in table"
    return result


# ---- the run stream ----------------------------------------------------------------------------


class RunStream(StreamingResponse):
    """A run's events; the run's requests are aborted however the response ends."""

    def __init__(self, content: AsyncIterator[str], run: VizRun, sse: bool) -> None:
        media = "text/event-stream" if sse else "application/x-ndjson"
        super().__init__(content, media_type=media,
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.run = run

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.run.close()


@router.post("/viz/api/run")
async def run(request: Request, format: Literal["ndjson", "sse"] = "ndjson") -> Response:
    engine, state = _engine(request), await _state(request.app)
    body = await asyncio.to_thread(_parse, await request.body())
    if not 1 <= body.users <= min(MAX_USERS, engine.capacity):
        raise ApiError(400, f"users must be in [1, {min(MAX_USERS, engine.capacity)}], got "
                            f"{body.users}", param="users")
    ids = await asyncio.to_thread(engine.tokenizer.encode, body.prompt)
    if not body.prompt or not ids:
        raise ApiError(400, "the prompt is empty; type at least one word", param="prompt")
    base = body.model_dump(exclude={"prompt", "users", "arrival", "json_schema"})
    structure = await _structure(engine, body.json_schema)
    spec = RunSpec(ids, user_params({**base, "structured": structure}, body.users), body.arrival)
    machine = await state.this_machine()
    viz_run = VizRun(engine, state.live, spec)
    await viz_run.start()  # a refused request is a plain 400 / 503 before the stream starts
    try:
        first = viz_run.start_event({
            "model": engine.model_name, "params": {**base, "json_schema": body.json_schema},
            "this_machine": {"kind": machine.kind, "label": machine.label},
            "prediction": await _prediction(engine, state, machine, len(ids), body.max_tokens,
                                            body.users),
            "pool": await pool_now(engine, state.live)})
    except BaseException:
        viz_run.close()
        raise
    return RunStream(_encode(_with_predictions(viz_run, first, engine, state, machine),
                             format == "sse"), viz_run, format == "sse")


async def _structure(engine: AsyncEngine, schema: dict[str, Any] | None) -> Structure | None:
    """The run's JSON schema, compiled off the event loop (a bad one is a 400)."""
    if schema is None:
        return None
    structure = Structure("json_schema", json.dumps(schema))
    try:
        await asyncio.to_thread(engine.prepare_structure, structure)
    except RequestError as e:
        raise ApiError(400, str(e), param="json_schema") from None
    return structure


def _parse(raw: bytes) -> VizRunRequest:
    body = parse_json_body(raw)
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return VizRunRequest.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise ApiError(400, f"invalid value for '{where}': {err['msg']} "
                            f"(got {err.get('input')!r})", param=where or None) from None


async def _prediction(engine: AsyncEngine, state: VizState, machine: MachineSource,
                      prompt_tokens: int, output_tokens: int, users: int) -> dict[str, Any]:
    """This machine's prediction for the served model, with the engine's KV dtype."""
    result = await asyncio.to_thread(predict, state.served, machine.hardware, prompt_tokens,
                                     output_tokens, users, engine.snapshot().kv_dtype)
    result["hardware"]["source"] = machine.label
    return result


async def _with_predictions(viz_run: VizRun, first: dict[str, Any], engine: AsyncEngine,
                            state: VizState, machine: MachineSource
                            ) -> AsyncIterator[dict[str, Any]]:
    """The run's events; each `done` carries the prediction for what that user really ran
    (prompt tokens the prefix cache did not serve, tokens actually generated)."""
    yield first
    async for event in viz_run.events():
        if event["event"] == "done":
            computed = event["prompt_tokens"] - event["cached_tokens"]
            event["prediction"] = await _prediction(engine, state, machine, computed,
                                                    event["output_tokens"], viz_run.spec.users)
        yield event


async def _encode(events: AsyncIterator[dict[str, Any]], sse: bool) -> AsyncIterator[str]:
    async for event in events:
        line = json.dumps(event, ensure_ascii=False)
        yield f"event: {event['event']}\ndata: {line}\n\n" if sse else line + "\n"
