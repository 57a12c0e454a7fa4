"""A fake engine for the server's tests: each running request emits one character per step.

It has the surface the AsyncEngine and the app use (add_request / step / abort / stats and a
character-level tokenizer), so the server's own logic runs unchanged around it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

from kvlab.engine import EngineStats
from kvlab.errors import RequestError
from kvlab.request import FinishReason, RequestOutput, RequestTimings, SamplingParams
from kvlab.server.apis import front_ends
from kvlab.server.core.app import create_app
from kvlab.server.core.async_engine import AsyncEngine
from kvlab.server.core.guard import ServerLimits


class FakeTokenizer:
    eos_ids = (0,)
    bos_id = None
    add_bos = False
    vocab_size = 256
    chat_template = None
    suffix_id = None
    fim = None  # no fill-in-the-middle tokens

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)

    def token_bytes(self, token_id: int) -> bytes:
        return chr(token_id).encode()

    def is_special(self, token_id: int) -> bool:
        return False  # one token per character: no control tokens

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, **variables: object) -> str:
        return "".join(m["content"] for m in messages)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, **variables: object) -> list[int]:
        return self.encode(self.apply_chat_template(messages))


@dataclass
class FakeConfig:
    max_num_seqs: int = 2


@dataclass
class FakeEngine:
    model_name: str = "fake.gguf"
    max_model_len: int = 4096
    config: FakeConfig = field(default_factory=FakeConfig)
    tokenizer: FakeTokenizer = field(default_factory=FakeTokenizer)
    live: dict[str, tuple[int, SamplingParams, int]] = field(default_factory=dict)
    aborted: list[str] = field(default_factory=list)
    fail_next_step: bool = False
    can_generate: bool = True
    reply: str = ""  # when set: each request writes this text, a character a step, then stops

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise RequestError("prompt + max_tokens exceeds the context length")
        self.live[request_id] = (len(prompt), params, 0)

    def abort(self, request_id: str) -> None:
        if self.live.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.live)

    def step(self) -> list[RequestOutput]:
        if self.fail_next_step:
            self.fail_next_step = False
            raise ValueError("boom")
        time.sleep(0.002)  # a step takes time, so clients can act between steps
        outs = []
        for rid, (n_prompt, params, n_out) in list(self.live.items()):
            n_out += 1
            char = self.reply[n_out - 1] if self.reply else "a"
            ended = bool(self.reply) and n_out >= len(self.reply)
            done = ended or n_out >= params.max_tokens
            self.live[rid] = (n_prompt, params, n_out)
            if done:
                del self.live[rid]
            reason = None if not done else FinishReason.STOP if ended else FinishReason.LENGTH
            outs.append(RequestOutput(rid, [ord(char)], char, done, reason,
                                      n_prompt, 0, n_out, timings=RequestTimings()))
        return outs

    def stats(self) -> EngineStats:
        return EngineStats(len(self.live), 0, 10, len(self.live), 16, 64, 0, 0)


def run_on_app(engine: object, body: Callable[[httpx.AsyncClient, object], Awaitable[None]],
               limits: ServerLimits | None = None) -> None:
    """Run `await body(client, app)` against the server's app (every front end) on `engine`;
    afterwards no request may be left running, in the AsyncEngine or the engine."""
    async def main() -> None:
        ae = AsyncEngine(engine, max_waiting=4)  # type: ignore[arg-type]
        app = create_app(ae, front_ends(), limits=limits or ServerLimits())
        await ae.start()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://t") as client:
                await body(client, app)
            live = getattr(engine, "live", {})
            for _ in range(200):  # aborts reach the engine thread between steps
                if not live and ae.num_live == 0:
                    break
                await asyncio.sleep(0.01)
            assert not live and ae.num_live == 0, "requests were left running"
        finally:
            await ae.stop()
    asyncio.run(asyncio.wait_for(main(), timeout=60))
