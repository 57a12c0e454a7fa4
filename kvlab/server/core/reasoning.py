"""Reasoning text apart from the answer: what a thinking model writes between its think
markers comes back as reasoning (OpenAI chat's `reasoning_content`, a Responses `reasoning`
item, an Anthropic `thinking` block, Ollama's `thinking`), never mixed into the content.

    reasoning_format(template)   the markers a chat template speaks (`<think>` ... `</think>`,
                                 as Qwen3, QwQ, DeepSeek-R1 and their descendants write), or
                                 None for a model that does not think
    ReasoningStream              splits streamed text deltas into (reasoning, content) deltas;
                                 a marker cut across two deltas is held back until it is whole
    split_reasoning              the same for a whole reply

A prompt may already open the block (DeepSeek-R1's and Qwen3's templates end the generation
prompt with `<think>`), so the stream is told whether it starts inside reasoning.

While decoding, the engine learns where the block lies from a `ReasoningGate` (its markers'
token ids, `Serving.reasoning_gate` builds it): a structure applies after the block, and a
reasoning budget forces the end marker.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.tokenizer.chat import template_variables


@dataclass(frozen=True)
class ReasoningFormat:
    start: str = "<think>"
    end: str = "</think>"
    switch: str | None = None  # the template variable that turns thinking on or off

    def opens(self, prompt_text: str) -> bool:
        """Whether a prompt ends inside an open reasoning block."""
        tail = prompt_text.rstrip()
        return tail.endswith(self.start)

    def closes(self, prompt_text: str) -> bool:
        """Whether a prompt ends just after a closed block (a template's thinking turned off)."""
        return prompt_text.rstrip().endswith(self.end)


def reasoning_format(template: str | None) -> ReasoningFormat | None:
    """The reasoning markers a chat template writes, or None when it has none."""
    if not template or "</think>" not in template:
        return None
    switch = "enable_thinking" if "enable_thinking" in template_variables(template) else None
    return ReasoningFormat(switch=switch)


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
            marker = self.fmt.end if self.inside else self.fmt.start
            at = text.find(marker)
            if at >= 0 and (self.inside or self._may_open(content, text[:at])):
                (reasoning if self.inside else content).append(text[:at])
                text = text[at + len(marker):]
                self.seen_start |= not self.inside
                self.inside = not self.inside
                continue
            keep = _partial_suffix(text, marker)
            (reasoning if self.inside else content).append(text[:len(text) - keep])
            self._held = text[len(text) - keep:]
            break
        return "".join(reasoning), "".join(content)

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
