"""The engine behind an asyncio server: one thread owns the engine, the event loop owns requests.

    event loop (HTTP handlers)                 engine thread (the only caller of Engine)
    add([...]) ---- command queue ---------->  add_request / abort, between steps
        ^                          ^           core_step(): token ids, one batch per step
        |                          | aborts at          |
        |                          | stop strings       v
    Generation.queue <- call_soon_threadsafe - output thread: Engine.outputs.process
                                               (detokenize, stop strings -> RequestOutputs)

Every Engine call happens on the engine thread, so the engine needs no lock; its output
processor (kvlab.output) runs on the output thread, so a step's text is made while the next
step runs. A request the processor ends at a stop string is aborted in the engine as a
client's disconnect is. Everything the handlers touch (the request -> Generation map, the
metrics) lives on the event loop thread. An engine other than Engine (a test's stand-in)
makes its text itself: its step() outputs go to the event loop as they are.
A Generation groups the engine requests of one API call (its n choices) behind one queue.
Closing a Generation aborts whatever of it is unfinished, which frees its KV blocks at once:
handlers close it when the client disconnects. A Generation with a deadline ends at it: its
unfinished choices stop where they are (finish reason "length", as llama-server's time limit
does) and are aborted in the engine.

If the engine thread dies, every waiting call and every queued command fails at once with
EngineUnavailable (503), new calls are refused and /health turns 503: nothing hangs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from kvlab.engine import Engine, EngineSnapshot, EngineStats
from kvlab.errors import RequestError
from kvlab.metrics import GenerationMetrics
from kvlab.request import FinishReason, RequestOutput, SamplingParams, StepItem, Structure
from kvlab.server.core.prom import ServerMetrics

log = logging.getLogger("kvlab.server")
T = TypeVar("T")
_STOP = object()
_Command = tuple[Any, "concurrent.futures.Future | None"]


class EngineOverloaded(Exception):
    """The bounded waiting queue is full (HTTP 503)."""


class EngineUnavailable(Exception):
    """The server is shutting down or the engine thread has died (HTTP 503)."""


class EngineStepError(Exception):
    """A step raised; the requests in flight were aborted (HTTP 500, or an SSE error event)."""


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


class Generation:
    """The outputs of one API call's engine requests, in the order the engine produced them."""

    def __init__(self, owner: AsyncEngine, requests: list[EngineRequest]) -> None:
        self.owner = owner
        self.requests = requests
        self.arrival = time.perf_counter()
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.last: dict[str, RequestOutput] = {}
        self.timer: asyncio.TimerHandle | None = None  # the deadline, when there is one

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        remaining = len(self.requests)
        while remaining:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            remaining -= item.finished
            yield item

    def push(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, RequestOutput):
            self.last[item.request_id] = item
        self.queue.put_nowait(item)

    def aborted_output(self, req: EngineRequest,
                       reason: FinishReason = FinishReason.ABORT) -> RequestOutput:
        """A final output for a request that was cut short (what it had produced so far)."""
        last = self.last.get(req.request_id)
        return RequestOutput(
            request_id=req.request_id, new_token_ids=[], text_delta="", finished=True,
            finish_reason=reason, prompt_tokens=len(req.prompt_ids),
            cached_tokens=last.cached_tokens if last else 0,
            output_tokens=last.output_tokens if last else 0,
            timings=last.timings if last else None)

    def close(self, reason: FinishReason = FinishReason.ABORT) -> None:
        """Abort whatever has not finished (idempotent); call it when the client goes away."""
        if self.timer is not None:
            self.timer.cancel()
        self.owner.close(self, reason)

    def expire(self) -> None:
        """The deadline: unfinished choices end with what they have ("length")."""
        self.owner.end_unfinished(self, FinishReason.LENGTH)
        self.close(FinishReason.LENGTH)


class AsyncEngine:
    def __init__(self, engine: Engine, max_waiting: int = 128) -> None:
        self.engine = engine
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.tokenizer = engine.tokenizer
        self.can_generate = engine.can_generate  # False: an encoder, embeddings only
        self.capacity = engine.config.max_num_seqs + max_waiting
        self.metrics = ServerMetrics(engine.model_name)
        self.stats: EngineStats = engine.stats()  # snapshot, refreshed by the engine thread
        self.accepting = False
        self._owner: dict[str, Generation] = {}  # live request id -> its Generation
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        # an Engine's text is made on the output thread, from its core steps' outputs
        self._outputs = engine.outputs if isinstance(engine, Engine) else None
        self._output_thread: threading.Thread | None = None
        self._to_output: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread_done = False  # set by the engine thread as it exits, however it exits
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- lifecycle (event loop thread) ----------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvlab-engine", daemon=True)
        if self._outputs is not None:
            self._output_thread = threading.Thread(target=self._run_outputs,
                                                   name="kvlab-outputs", daemon=True)
            self._output_thread.start()
        self._thread.start()
        self.accepting = True

    async def stop(self, timeout: float = 10.0) -> None:
        """Refuse new requests, abort the unfinished ones, then stop the engine thread."""
        self.end_all()
        self._commands.put((_STOP, None))
        for thread in (self._thread, self._output_thread):  # the output thread ends after it
            if thread is not None:
                await asyncio.to_thread(thread.join, timeout)

    def end_all(self) -> None:
        """Refuse new requests and end every unfinished one now (finish reason "abort")."""
        self.accepting = False
        for gen in self._live_generations():
            self.end_unfinished(gen, FinishReason.ABORT)
            gen.close()

    @property
    def alive(self) -> bool:
        outputs = self._output_thread is None or self._output_thread.is_alive()
        return (self._thread is not None and self._thread.is_alive() and not self._thread_done
                and outputs)

    @property
    def num_live(self) -> int:
        return len(self._owner)

    # ---- requests (event loop thread) -----------------------------------------------------

    async def add(self, requests: list[EngineRequest],
                  deadline: float | None = None) -> Generation:
        """Queue one API call's engine requests; raises RequestError, EngineOverloaded, ...

        `deadline` is on the event loop's clock (`loop.time()`): the call ends there.
        """
        if not self.accepting or not self.alive:
            raise EngineUnavailable("the server is shutting down" if self.alive
                                    else "the engine is not running")
        if len(requests) > self.capacity:
            raise RequestError(f"one call may run at most {self.capacity} sequences (prompts x "
                               f"n), got {len(requests)}")
        if len(self._owner) + len(requests) > self.capacity:
            self.metrics.rejected.inc()
            raise EngineOverloaded(f"the server is at capacity ({self.capacity} requests "
                                   "running or waiting); retry later")
        gen = Generation(self, requests)
        for req in requests:
            self._owner[req.request_id] = gen
        try:
            await self.call(lambda engine: _add_all(engine, requests))
        except BaseException:  # a bad request, or the client left while we waited
            for req in requests:
                self._owner.pop(req.request_id, None)
                self._send(_abort(req.request_id))
            raise
        if deadline is not None:
            gen.timer = asyncio.get_running_loop().call_at(deadline, gen.expire)
        return gen

    def close(self, gen: Generation, reason: FinishReason = FinishReason.ABORT) -> None:
        for req in gen.requests:
            if self._owner.get(req.request_id) is gen:
                del self._owner[req.request_id]
                self._send(_abort(req.request_id))
                self.metrics.observe(gen.aborted_output(req, reason), gen.arrival, reason.value)

    def end_unfinished(self, gen: Generation, reason: FinishReason) -> None:
        """Give each unfinished request of `gen` a final output (before closing it)."""
        for req in gen.requests:
            if self._owner.get(req.request_id) is gen:
                gen.push(gen.aborted_output(req, reason))

    def _live_generations(self) -> list[Generation]:
        return list({id(g): g for g in self._owner.values()}.values())

    def snapshot(self) -> EngineSnapshot:
        """What the engine serves and its KV layout (fixed: read from any thread)."""
        return self.engine.snapshot()

    def generation_metrics(self, out: RequestOutput) -> GenerationMetrics:
        """TTFT, tok/s, ITL, GB/s and FLOP/s of a finished output (from the engine's fixed
        cost, so no trip to the engine thread)."""
        return self.engine.metrics(out)

    def prepare_structure(self, structure: Structure) -> None:
        """Compile a structure (any thread; cached); raises RequestError if unusable."""
        self.engine.prepare_structure(structure)

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run fn(engine) on the engine thread between two steps and return its result."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._commands.put((fn, fut))
        if not self.alive:  # the thread may have died after it last emptied the queue
            self._fail_commands()
        return await asyncio.wrap_future(fut)

    def _send(self, fn: Callable[[Engine], Any]) -> None:
        if not self._thread_done:
            self._commands.put((fn, None))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            gen = self._owner.get(out.request_id)
            if gen is None:  # closed meanwhile; its abort is on its way
                continue
            if out.finished:
                del self._owner[out.request_id]
                reason = out.finish_reason.value if out.finish_reason else "stop"
                self.metrics.observe(out, gen.arrival, reason)
            gen.push(out)

    def _fail(self, error: BaseException) -> None:
        for gen in self._live_generations():
            gen.push(error)
            gen.close()

    def _fail_commands(self) -> None:
        """Fail every queued command (the engine thread is gone: none of them will run)."""
        while True:
            try:
                _, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if fut is not None and fut.set_running_or_notify_cancel():
                fut.set_exception(EngineUnavailable("the engine thread has stopped"))

    # ---- the engine thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._run_commands(block=not self.engine.has_unfinished()):
                if self.engine.has_unfinished():
                    self._step()
                self.stats = self.engine.stats()
        except BaseException as e:  # the thread dies: nobody may wait on it from now on
            log.exception("the engine thread died")
            self._thread_done = True  # before the failures are posted: /health agrees with them
            self._deliver(self._fail, EngineUnavailable(f"the engine thread has stopped: {e}"))
        finally:
            self._thread_done = True
            self._fail_commands()
            self._to_output.put(None)  # the output thread ends once it has made the rest
        log.info("engine thread stopped")

    def _step(self) -> None:
        try:
            outputs = (self.engine.step() if self._outputs is None
                       else self.engine.core_step())
        except Exception as e:  # keep serving: fail the requests in flight, not the server
            log.exception("engine step failed; aborting the requests in flight")
            self._deliver(self._fail, EngineStepError(f"engine step failed: {e}"))
            return
        if not outputs:
            return
        if self._outputs is None:
            self._post(self._dispatch, outputs)
        else:
            self._to_output.put(lambda: self._make_text(outputs))

    def _deliver(self, fn: Callable[[Any], None], arg: Any) -> None:
        """Post fn(arg) to the event loop after the outputs already on their way."""
        if self._outputs is None:
            self._post(fn, arg)
        else:
            self._to_output.put(lambda: self._post(fn, arg))

    # ---- the output thread ----------------------------------------------------------------

    def _run_outputs(self) -> None:
        """Make each core step's outputs text, in step order, until the engine thread ends."""
        while (job := self._to_output.get()) is not None:
            job()
        log.info("output thread stopped")

    def _make_text(self, items: list[StepItem]) -> None:
        assert self._outputs is not None
        try:
            processed = self._outputs.process(items)
            outputs = processed.outputs  # built here, when first read
        except Exception as e:  # as a failed step: fail the requests in flight
            log.exception("making the step's text failed; aborting the requests in flight")
            self._post(self._fail, EngineStepError(f"engine step failed: {e}"))
            return
        for request_id in processed.stopped:  # ended at a stop string: the core stops it too
            self._send(_abort(request_id))
        if outputs:
            self._post(self._dispatch, outputs)

    def _post(self, fn: Callable[[Any], None], arg: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:  # the loop closed under us during shutdown
            pass

    def _run_commands(self, block: bool) -> bool:
        """Run the queued commands; False once told to stop. Idle: wait for the first one."""
        try:
            item = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            fn, fut = item
            if fn is _STOP:
                return False
            _execute(self.engine, fn, fut)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return True


class EngineCall:
    """What every API call does with the engine: its engine requests go in as one
    Generation at `submit`, `submitted()` reads their outputs, `close` aborts whatever of them
    is unfinished (idempotent). A call class sets `engine` and `gen` (None until submitted)
    and says which requests it runs."""

    engine: AsyncEngine
    gen: Generation | None

    def engine_requests(self) -> list[EngineRequest]:
        raise NotImplementedError

    async def submit(self, deadline: float | None = None) -> None:
        """Queue the engine requests (none: nothing to run); raises RequestError,
        EngineOverloaded, ... `deadline` is on the event loop's clock."""
        requests = self.engine_requests()
        if requests:
            self.gen = await self.engine.add(requests, deadline)

    def close(self) -> None:
        if self.gen is not None:
            self.gen.close()

    def submitted(self) -> Generation:
        if self.gen is None:
            raise RuntimeError(f"{type(self).__name__} was not submitted")
        return self.gen


def _execute(engine: Engine, fn: Callable[[Engine], Any],
             fut: concurrent.futures.Future | None) -> None:
    if fut is not None and not fut.set_running_or_notify_cancel():
        return
    try:
        result = fn(engine)
    except Exception as e:
        if fut is None:
            log.exception("engine command failed")
        else:
            fut.set_exception(e)
        return
    if fut is not None:
        fut.set_result(result)


def _add_all(engine: Engine, requests: list[EngineRequest]) -> None:
    """All or nothing: if one is refused, the ones already added are taken back."""
    added: list[str] = []
    try:
        for req in requests:
            engine.add_request(req.request_id, req.prompt_ids, req.params)
            added.append(req.request_id)
    except Exception:
        for request_id in added:
            engine.abort(request_id)
        raise


def _abort(request_id: str) -> Callable[[Engine], None]:
    return lambda engine: engine.abort(request_id)
