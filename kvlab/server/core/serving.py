"""What every API's calls are built against: the served model's names, its tokenizer, its
tool-call form, the limits its context sets, and the one way a conversation becomes a prompt.

Each API (OpenAI chat and completions, Responses, Anthropic Messages, Ollama) is a
translation layer: it turns its body into template messages, a `ToolPlan` and sampling
settings, and asks `Serving` for the prompt ids and the compiled structure; the engine request
underneath is the same for all of them. Building is blocking work (templates, tokenizing,
grammar compiling) and runs in a worker thread, never on the event loop.
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Any

from kvlab.errors import RequestError
from kvlab.request import ReasoningGate, SamplingParams, Structure
from kvlab.server.core.async_engine import AsyncEngine, EngineRequest
from kvlab.server.core.errors import ApiError
from kvlab.server.core.reasoning import ReasoningFormat, reasoning_format
from kvlab.server.core.tool_formats import FORMATS, detect_format
from kvlab.server.core.tools import ToolPlan, template_messages
from kvlab.tokenizer.chat import template_variables

# A normalizer (NFC, ...) may shorten text before tokenizing; bytes / token is bounded by this
# times the longest token's bytes.
_NORMALIZER_SLACK = 4


class Serving:
    """What every call on this server is built against (read-only once made).

    `aliases` are further names the served model answers to (`--served-model-name`);
    `any_model_name` answers every name (`--any-model-name`), for tools that hard-code one;
    `reasoning_budget` caps every thinking reply's reasoning (`--reasoning-budget`).
    """

    def __init__(self, engine: AsyncEngine, aliases: tuple[str, ...] = (),
                 any_model_name: bool = False, instance: str = "",
                 reasoning_budget: int | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        name = engine.model_name
        self.model_names = {name, name.removesuffix(".gguf"), *aliases}
        self.aliases = aliases
        self.public_name = aliases[0] if aliases else name
        self.any_model_name = any_model_name
        self.instance = instance
        longest = max((len(self.tokenizer.token_bytes(i))
                       for i in range(self.tokenizer.vocab_size)), default=16)
        self.max_prompt_bytes = engine.max_model_len * max(longest, 1) * _NORMALIZER_SLACK
        template = self.tokenizer.chat_template
        self.native_tools = template is not None and "tools" in template_variables(template)
        # the format the template teaches tool calls in: replies are read in it, and decoding
        # enforces it in auto mode where it can (ToolPlan.structure)
        self.tool_form = detect_format(template, self.native_tools)
        self.reasoning: ReasoningFormat | None = reasoning_format(template)
        # the tool-call and reasoning markers decoding would hide stay in the text, to be read
        markers = FORMATS[self.tool_form].tokens + (self.reasoning.markers if self.reasoning
                                                    else ())
        self.shown_special_ids = tuple(
            special_markers(self.tokenizer, tuple(dict.fromkeys(markers))).values())
        # the tool-call markers held as one special token each: the tool grammars write them
        # as that token (which decoding shows, as above), as a real model emits them
        self.marker_tokens = special_markers(self.tokenizer, FORMATS[self.tool_form].tokens)
        self.reasoning_budget = reasoning_budget

    def check_model(self, model: str | None) -> str:
        """The name to answer with: the one asked for when the server answers to it."""
        if model is None or model in self.model_names:
            return self.public_name
        if self.any_model_name:
            return model
        raise ApiError(404, f"The model `{model}` does not exist; this server serves "
                            f"{', '.join(sorted(self.model_names))} (kvlab serve "
                            "--served-model-name adds aliases, --any-model-name answers any "
                            "name)", param="model", code="model_not_found", type_="not_found_error")

    def state_id(self, prefix: str) -> str:
        """A new id for state this server keeps (a stored response): `prefix_hex`, or
        `prefix_<instance>_hex` among replicas, so the ingress can route back to it."""
        tag = f"{self.instance}_" if self.instance else ""
        return f"{prefix}_{tag}{uuid.uuid4().hex}"

    def check_fits(self, text: str, param: str) -> None:
        """Refuse, before tokenizing, text too long in bytes for any tokenization to fit."""
        if len(text) * 4 <= self.max_prompt_bytes:  # UTF-8 is at most 4 bytes a character
            return
        size = len(text.encode("utf-8", errors="surrogatepass"))
        if size > self.max_prompt_bytes:
            raise ApiError(400, f"the prompt is {size} bytes; no tokenization of that fits the "
                                f"context of {self.engine.max_model_len} tokens (at most "
                                f"{self.max_prompt_bytes} bytes could)", param=param,
                           code="context_length_exceeded")

    def prompt_text(self, prompt: str | list[int]) -> str:
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)

    def encode(self, prompt: str | list[int], param: str = "prompt") -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        self.check_fits(prompt, param)
        return self.tokenizer.encode(prompt)

    def chat_prompt(self, messages: list[dict[str, Any]], plan: ToolPlan | None,
                    param: str = "messages", prefill: bool | None = None,
                    **template_vars: Any) -> list[int]:
        """The prompt ids of a conversation (OpenAI-style template messages), with the tools
        shown as the template wants them.

        `prefill`: the final assistant message is the start of the reply, continued rather
        than closed (vLLM's `continue_final_message`, Anthropic's trailing assistant turn,
        llama-server's assistant prefill); None: so when the conversation ends with one."""
        self.check_generates(param)
        messages, extra = template_messages(messages, plan, self.native_tools)
        last_role = messages[-1].get("role") if messages else None
        if prefill is None:
            prefill = last_role == "assistant"
        elif prefill and last_role != "assistant":
            raise ApiError(400, f"continuing the final message needs the conversation to end "
                                f"with an assistant message, not {last_role!r}", param=param)
        tok = self.tokenizer
        try:
            flags = {"add_generation_prompt": not prefill, "continue_final_message": prefill}
            text = tok.apply_chat_template(messages, **flags, **extra, **template_vars)
            self.check_fits(text, param)
            return tok.encode_chat(messages, **flags, **extra, **template_vars)
        except RequestError as e:
            raise ApiError(400, str(e), param=param) from None

    def thinking_vars(self, think: bool | None, param: str) -> dict[str, Any]:
        """Template variables for a request's thinking switch (None: the model's default).
        Asking a model that does not think to think is refused, as Ollama refuses it."""
        if think is None:
            return {}
        if think and self.reasoning is None:
            raise ApiError(400, f"{self.public_name} does not support thinking: its chat "
                                "template writes no reasoning block", param=param)
        if self.reasoning is None or self.reasoning.switch is None:
            if not think and self.reasoning is not None:
                raise ApiError(400, f"{self.public_name} always thinks: its chat template has "
                                    "no switch to turn thinking off", param=param)
            return {}
        on, off = self.reasoning.switch_values
        return {self.reasoning.switch: on if think else off}

    def effort_vars(self, effort: str | None, param: str) -> dict[str, Any]:
        """Template variables for a reasoning effort (OpenAI's `reasoning_effort`): the
        template's own `reasoning_effort` where it reads one (gpt-oss), else the thinking
        switch (off for "none", on otherwise); a model with neither cannot act on it."""
        if effort is None:
            return {}
        template = self.tokenizer.chat_template
        if template is not None and "reasoning_effort" in template_variables(template):
            return {"reasoning_effort": effort}
        if self.reasoning is None and effort in ("none", "minimal"):
            return {}  # a model that does not think already reasons that little
        return self.thinking_vars(effort != "none", param)

    def reasoning_opens(self, prompt_ids: list[int]) -> bool:
        """Whether the prompt leaves the reply inside an open reasoning block."""
        if self.reasoning is None:
            return False
        return self.reasoning.opens(self._prompt_tail(prompt_ids))

    def _prompt_tail(self, prompt_ids: list[int]) -> str:
        """The prompt's last tokens as text, markers included."""
        return self.tokenizer.decode(prompt_ids[-8:], skip_special_tokens=False)

    def reasoning_gate(self, ids: list[int], structured: bool, budget: int | None = None,
                       chat: bool = True) -> ReasoningGate | None:
        """Where a reply's reasoning block lies, so the engine applies a structure after it
        and ends it at the budget (the smaller of the server's and the request's `budget`);
        None where the model does not think here or neither depends on it.

        A chat prompt that neither opens nor closes the block lets the reply open it (Qwen3's
        with thinking on); a raw prompt (`chat` False) is gated only where it opens it."""
        fmt = self.reasoning
        budgets = [b for b in (self.reasoning_budget, budget) if b is not None]
        if fmt is None or not (structured or budgets):
            return None
        tail = self._prompt_tail(ids)
        inside = fmt.opens(tail)
        if not inside and (fmt.closes(tail) or not chat):  # e.g. thinking turned off
            return None
        encode = self.tokenizer.encode
        return ReasoningGate(encode(fmt.start, add_special_tokens=False),
                             encode(fmt.end + fmt.answer_start, add_special_tokens=False),
                             inside,
                             min(budgets, default=None))

    def prepared(self, found: tuple[Structure, str] | None) -> Structure | None:
        """Compile the structure here (worker thread), so the engine finds it ready."""
        if found is None:
            return None
        structure, param = found
        try:
            self.engine.prepare_structure(structure)
        except RequestError as e:
            raise ApiError(400, str(e), param=param) from None
        return structure

    def engine_requests(self, prompts: list[list[int]], params: list[SamplingParams],
                        param: str = "messages", reasoning_budget: int | None = None,
                        chat: bool = True) -> list[EngineRequest]:
        """One engine request per (prompt, params) pair; a prompt the context cannot hold is
        refused here, not on the engine thread. On a thinking model each carries its
        reasoning gate (`reasoning_gate`; `reasoning_budget`: the request's own; `chat`
        False: raw prompts, not a chat template's)."""
        self.check_generates(param)
        call_id = uuid.uuid4().hex
        out = []
        for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
            self.check_length(ids, param)
            if self.shown_special_ids:
                p = replace(p, shown_special_ids=self.shown_special_ids)
            gate = self.reasoning_gate(ids, p.structured is not None, reasoning_budget, chat)
            if gate is not None:
                p = replace(p, reasoning=gate)
            out.append(EngineRequest(f"{call_id}-{i}", ids, p))
        return out

    def check_generates(self, param: str) -> None:
        """Refuse generation on an encoder the engine serves for embeddings only."""
        if not self.engine.can_generate:
            raise ApiError(400, f"{self.public_name} is an embedding model: it generates no "
                                "text; use /v1/embeddings (or Ollama's /api/embed)", param=param,
                           code="model_not_generative")

    def check_length(self, ids: list[int], param: str) -> None:
        limit = self.engine.max_model_len
        if len(ids) >= limit:
            raise ApiError(400, f"the prompt has {len(ids)} tokens; the context holds {limit} "
                                "(prompt + reply)", param=param, code="context_length_exceeded")

    def check_room(self, ids: list[int], max_tokens: int, param: str) -> None:
        """Refuse a reply length the context cannot hold after the prompt, naming the field
        the client set it with."""
        limit = self.engine.max_model_len
        if len(ids) + max_tokens > limit:
            raise ApiError(400, f"{param} is {max_tokens}, but the prompt has {len(ids)} tokens "
                                f"and the context holds {limit}: at most "
                                f"{max(0, limit - len(ids))} tokens are left for the reply",
                           param=param, code="context_length_exceeded")

    def default_max_tokens(self, ids: list[int]) -> int:
        """As vLLM: whatever the context leaves after the prompt."""
        return max(1, self.engine.max_model_len - len(ids))


def special_markers(tokenizer: Any, markers: tuple[str, ...]) -> dict[str, int]:
    """marker -> id of the markers that the vocabulary holds as one special token each
    (decoding leaves those out of the text unless told to write them)."""
    found = {}
    for marker in markers:
        ids = tokenizer.encode(marker, add_special_tokens=False)
        if len(ids) == 1 and tokenizer.is_special(ids[0]):
            found[marker] = ids[0]
    return found
