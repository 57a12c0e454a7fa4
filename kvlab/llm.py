"""`LLM(model).generate(prompts, params)`, streaming and `embed(texts)`, on top of the
batch-first engine."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvlab.engine import Engine, EngineConfig
from kvlab.metrics import GenerationMetrics
from kvlab.request import FinishReason, RequestOutput, SamplingParams, TokenLogprob


@dataclass
class Completion:
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    metrics: GenerationMetrics | None = None


class LLM:
    def __init__(self, model: str | None = None, config: EngineConfig | None = None) -> None:
        self.engine = Engine.from_model(model, config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: str | list[int] | list[str | list[int]],
                 params: SamplingParams | None = None) -> list[Completion]:
        """All prompts run together in one continuous batch; results in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = params or SamplingParams()
        added = [self._add(p, params) for p in prompts]
        ids = [request_id for request_id, _ in added]
        results = {request_id: Completion(prompt_ids) for request_id, prompt_ids in added}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                self._collect(results[out.request_id], out)
        return [results[i] for i in ids]

    def stream(self, prompt: str | list[int],
               params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield each step's output for one prompt as it is produced."""
        request_id, _ = self._add(prompt, params or SamplingParams())
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == request_id:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort(request_id)

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> Completion:
        return self.generate([self.chat_prompt_ids(messages)], params)[0]

    def chat_prompt_ids(self, messages: list[dict]) -> list[int]:
        """Messages rendered with the model's chat template, then tokenized (one BOS)."""
        return self.tokenizer.encode_chat(messages, add_generation_prompt=True)

    def embed(self, texts: str | list[str], normalize: bool = True,
              dimensions: int | None = None) -> list[list[float]]:
        """One vector per text, pooled as the model asks (Engine.embed)."""
        texts = [texts] if isinstance(texts, str) else texts
        ids = [self.tokenizer.encode(t) for t in texts]
        return self.engine.embed(ids, normalize, dimensions).tolist()

    def _add(self, prompt: str | list[int], params: SamplingParams) -> tuple[str, list[int]]:
        if params.structured is not None:  # a structure that cannot be used: RequestError now
            self.engine.prepare_structure(params.structured)
        request_id = f"llm-{next(self._ids)}"
        return request_id, self.engine.add_request(request_id, prompt, params)

    def _collect(self, c: Completion, out: RequestOutput) -> None:
        c.text += out.text_delta
        c.token_ids.extend(out.new_token_ids)
        c.logprobs.extend(out.logprobs)
        if out.finished:
            c.finish_reason = out.finish_reason
            c.metrics = self.engine.metrics(out)
