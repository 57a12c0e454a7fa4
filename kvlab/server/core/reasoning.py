"""Reasoning text apart from the answer: what a thinking model writes between its think
markers comes back as reasoning (OpenAI chat's `reasoning_content`, a Responses `reasoning`
item, an Anthropic `thinking` block, Ollama's `thinking`), never mixed into the content.

    reasoning_format(template)   the markers a chat template speaks, found by the first row
                                 of `FORMATS` whose text the template holds, or None for a
                                 model that does not think:
        <think> ... </think>                       Qwen3, QwQ, DeepSeek-R1, Kimi K2
                                                   Thinking, MiniMax-M2 and descendants
        <think>..</think><response>..</response>   Granite 3.x (the response tags dropped)
        <seed:think> ... </seed:think>             Seed-OSS
        <mm:think> ... </mm:think>                 MiniMax-M3
        <|channel>thought ... <channel|>           Gemma 4
        <|START_THINKING|> ... <|END_THINKING|>    Command-A, Command-R7B (the answer's
                                                   <|START_RESPONSE|> tags dropped)
        <|channel|>analysis<|message|> ... <|end|> gpt-oss harmony; the final channel's
                                                   header is dropped, a commentary tool call
                                                   stays in the content for the tool format
    ReasoningStream              splits streamed text deltas into (reasoning, content) deltas;
                                 a marker cut across two deltas is held back until it is whole
    split_reasoning              the same for a whole reply

Where the markers are special tokens (harmony's), `ReasoningFormat.markers` lists them so
decoding writes them into the text (`Serving.shown_special_ids`) and the splitter sees them.

A prompt may already open the block (DeepSeek-R1's and Qwen3's templates end the generation
prompt with `<think>`), so the stream is told whether it starts inside reasoning.

While decoding, the engine learns where the block lies from a `ReasoningGate` (its markers'
token ids, `Serving.reasoning_gate` builds it): a structure applies after the block, and a
reasoning budget forces the end marker (harmony's followed by the final channel's header,
`ReasoningFormat.answer_start`, so the answer comes in the channel it belongs to).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from kvlab.tokenizer.chat import template_variables


@dataclass(frozen=True)
class ReasoningFormat:
    """The markers of one way of writing reasoning apart from the answer."""

    start: str = "<think>"
    end: str = "</think>"
    switch: str | None = None  # the template variable that turns thinking on or off
    switch_values: tuple[Any, Any] = (True, False)  # its values for (on, off)
    dropped: tuple[str, ...] = ()  # markers around the answer, left out of the content
    tokens: tuple[str, ...] = ()  # special tokens the markers are written in
    # the header that opens the answer after the block (harmony's final channel): the gate
    # takes it as part of the end marker, so a budget forces it and a structure follows it
    answer_start: str = ""

    def opens(self, prompt_text: str) -> bool:
        """Whether a prompt ends inside an open reasoning block."""
        tail = prompt_text.rstrip()
        return tail.endswith(self.start)

    def closes(self, prompt_text: str) -> bool:
        """Whether a prompt ends just after a closed block (a template's thinking turned off)."""
        return prompt_text.rstrip().endswith(self.end)

    @property
    def markers(self) -> tuple[str, ...]:
        """Every marker the splitter reads; those that are one special token each must stay
        in the decoded text for it to see them."""
        return (self.start, self.end, *self.dropped, *self.tokens)


# Harmony (gpt-oss): the reply's analysis channel is the reasoning, its final channel the
# answer; the commentary channel's tool calls stay in the content for the tool format.
_HARMONY_FINAL = "<|channel|>final<|message|>"  # as the reply's first message, no header
_HARMONY_ANSWER = "<|start|>assistant" + _HARMONY_FINAL
HARMONY = ReasoningFormat("<|channel|>analysis<|message|>", "<|end|>",
                          dropped=(_HARMONY_ANSWER, _HARMONY_FINAL),
                          tokens=("<|start|>", "<|channel|>", "<|message|>", "<|end|>"),
                          answer_start=_HARMONY_ANSWER)


_COHERE_THINKING = ReasoningFormat("<|START_THINKING|>", "<|END_THINKING|>", "reasoning",
                                   dropped=("<|START_RESPONSE|>", "<|END_RESPONSE|>"))


@dataclass(frozen=True)
class _Row:
    needles: tuple[str, ...]  # all of them in the template's text: it speaks this format
    fmt: ReasoningFormat  # its switch holds where the template reads that variable


# The first row whose needles the template holds wins (Granite's also holds `</think>`).
FORMATS: tuple[_Row, ...] = (
    _Row(("<|channel|>analysis<|message|>",), HARMONY),
    # Seed-OSS: a thinking budget of 0 closes the block in the prompt, -1 leaves it open-ended
    _Row(("<seed:think>",), ReasoningFormat("<seed:think>", "</seed:think>",
                                            "thinking_budget", (-1, 0))),
    # Gemma 4: a thought channel; thinking off closes an empty one in the prompt
    _Row(("<|channel>thought",), ReasoningFormat("<|channel>thought", "<channel|>",
                                                 "enable_thinking",
                                                 tokens=("<|channel>", "<channel|>"))),
    # Command-A (Cohere2), then Command-R7B: the answer sits in <|START_RESPONSE|> tags
    _Row(("<|START_THINKING|>", "reasoning_effort"), _COHERE_THINKING),
    _Row(("<|START_THINKING|>",), replace(_COHERE_THINKING, switch="enable_thinking")),
    # MiniMax-M3: thinking_mode "enabled" opens the block in the prompt, "disabled" closes it
    _Row(("<mm:think>",), ReasoningFormat("<mm:think>", "</mm:think>",
                                          "thinking_mode", ("enabled", "disabled"))),
    # Granite 3.x, whose system prompt (`thinking` on) asks for <think></think> then
    # <response></response>; MiniMax-M2's <response> wraps tool results, not the answer
    _Row(("</think>", "<response></response>"),
         ReasoningFormat(switch="thinking", dropped=("<response>", "</response>"))),
    # Qwen3, QwQ, DeepSeek-R1, Kimi K2 Thinking, MiniMax-M2 and their descendants
    _Row(("</think>",), ReasoningFormat(switch="enable_thinking")),
)


def reasoning_format(template: str | None) -> ReasoningFormat | None:
    """The reasoning markers a chat template writes, or None when it has none."""
    if not template:
        return None
    for row in FORMATS:
        if all(n in template for n in row.needles):
            switch = row.fmt.switch
            if switch is not None and switch not in template_variables(template):
                return replace(row.fmt, switch=None)
            return row.fmt
    return None


class ReasoningStream:
    """Text deltas in, (reasoning, content) deltas out."""

    def __init__(self, fmt: ReasoningFormat, inside: bool = False) -> None:
        self.fmt = fmt
        self.inside = inside  # in a reasoning block now
        self.seen_start = inside
        self._held = ""  # text that may be the beginning of a marker

    def feed(self, delta: str) -> tuple[str, str]:
        text = self._held + delta
        self._held = ""
        reasoning, content = [], []
        while text:
            out = reasoning if self.inside else content
            markers = self._markers()
            hit = self._next_marker(text, markers, content)
            if hit is None:
                keep = max((_partial_suffix(text, m) for m in markers), default=0)
                out.append(text[:len(text) - keep])
                self._held = text[len(text) - keep:]
                break
            at, marker = hit
            out.append(text[:at])
            text = text[at + len(marker):]
            if marker in (self.fmt.start, self.fmt.end):
                self.seen_start |= not self.inside
                self.inside = not self.inside
        return "".join(reasoning), "".join(content)

    def _markers(self) -> tuple[str, ...]:
        """The markers that mean something now."""
        if self.inside:
            return (self.fmt.end,)
        return self.fmt.dropped + (() if self.seen_start else (self.fmt.start,))

    def _next_marker(self, text: str, markers: tuple[str, ...],
                     content: list[str]) -> tuple[int, str] | None:
        """The first marker in `text` that acts (where it is and which), if any."""
        hits = [(at, m) for m in markers if (at := text.find(m)) >= 0]
        hits = [(at, m) for at, m in hits
                if self.inside or m != self.fmt.start or self._may_open(content, text[:at])]
        return min(hits, default=None)

    def finish(self) -> tuple[str, str]:
        """What was held back (a marker that never completed is plain text)."""
        held, self._held = self._held, ""
        return (held, "") if self.inside else ("", held)

    def _may_open(self, content: list[str], before: str) -> bool:
        """A block opens once, before any answer text (whitespace aside)."""
        return not self.seen_start and not ("".join(content) + before).strip()


def split_reasoning(text: str, fmt: ReasoningFormat,
                    inside: bool = False) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole reply."""
    stream = ReasoningStream(fmt, inside)
    reasoning, content = stream.feed(text)
    more_r, more_c = stream.finish()
    reasoning, content = reasoning + more_r, content + more_c
    seen = stream.seen_start
    return (reasoning.strip() if seen else None), (content.lstrip("\n") if seen else content)


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
