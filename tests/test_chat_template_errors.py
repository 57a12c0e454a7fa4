"""A chat template that refuses a conversation (`raise_exception`) is the client's error: a
400 in each API's own shape carrying the template's own message, and no engine request is
left behind. Driven by the official `openai` client on the fake engine, with the template
rendered as the real tokenizer renders it."""

from __future__ import annotations

import httpx
import pytest

from kvlab.tokenizer.chat import render_chat_template

from fake_engine import FakeEngine, FakeTokenizer, run_on_app

openai = pytest.importorskip("openai")

MESSAGE = "no system role: put the instructions in the first user turn"
TEMPLATE = ("{% for m in messages %}{% if m.role == 'system' %}"
            "{{ raise_exception('" + MESSAGE + "') }}{% endif %}"
            "<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")


class RefusingTokenizer(FakeTokenizer):
    """Characters as tokens; the chat template rendered with kvlab's renderer."""

    chat_template = TEMPLATE

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, **variables: object) -> str:
        return render_chat_template(TEMPLATE, messages,
                                    add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message, **variables)


class CountingEngine(FakeEngine):
    """Counts the requests that reach it."""

    added = 0

    def add_request(self, request_id, prompt, params) -> None:
        self.added += 1
        super().add_request(request_id, prompt, params)


def test_a_template_that_raises_is_a_400_with_its_message() -> None:
    engine = CountingEngine(model_name="m.gguf", tokenizer=RefusingTokenizer(), reply="Hello")
    got: dict[str, object] = {}

    async def body(client: httpx.AsyncClient, app) -> None:
        oa = openai.AsyncOpenAI(base_url="http://t/v1", api_key="none", http_client=client,
                                max_retries=0)
        with pytest.raises(openai.BadRequestError) as refused:
            await oa.chat.completions.create(model="m.gguf", messages=[
                {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
        got["error"] = refused.value.body
        got["status"] = refused.value.status_code
        ok = await oa.chat.completions.create(
            model="m.gguf", messages=[{"role": "user", "content": "Hi"}])
        got["ok"] = ok.choices[0].message.content
        r = await client.post("/v1/messages", json={
            "model": "m.gguf", "max_tokens": 8, "system": "Be brief.",
            "messages": [{"role": "user", "content": "Hi"}]})
        got["anthropic"] = (r.status_code, r.json())
    run_on_app(engine, body)
    assert got["status"] == 400
    error = got["error"]
    assert isinstance(error, dict) and MESSAGE in error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] == "messages"
    assert got["ok"] == "Hello"  # the same template answers a conversation it accepts
    status, answer = got["anthropic"]  # type: ignore[misc]
    assert status == 400 and answer["type"] == "error"
    assert answer["error"]["type"] == "invalid_request_error"
    assert MESSAGE in answer["error"]["message"]
    assert engine.added == 1 and not engine.live  # only the accepted conversation ran
