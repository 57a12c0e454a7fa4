"""Fill-in-the-middle prompts: the ids a code model is given to write the text between a
prefix and a suffix, laid out as llama.cpp's server lays them out for /infill.

    [BOS]                                          when the model adds one
    [REPO]myproject\\n [SEP]a.py\\n <a.py> ...       repository-level context (input_extra)
    [SEP]filename\\n                                the file being edited
    [PRE] prefix prompt [SUF] suffix [MID]         the model writes on from here

(prefix-suffix-middle order). `prompt` is the text typed before the cursor on the current
line: it ends the prefix, as llama-server puts it, so the middle begins at the cursor. The repository block appears only when context files are
given, so a plain request is exactly the single-file prompt the models are trained on; its
names are llama.cpp's fixed placeholders ("myproject", "filename", a file without a name is
"tmp"), and a model without the repo / file-separator tokens gets each file after a
"--- snippet ---" line instead.

When the parts do not fit the room the reply leaves in the context, the prefix keeps its end
and the suffix its start (the code nearest the cursor), sharing the room 3:1 as llama.cpp
does, a part shorter than its share leaving the rest to the other; the context files fill
what remains, their last tokens kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvlab.server.core.bodies import Strict
from kvlab.server.core.errors import ApiError
from kvlab.server.core.serving import Serving
from kvlab.tokenizer import Tokenizer
from kvlab.tokenizer.fim import FimTokens

PREFIX_SHARE = 3  # of every 4 tokens of room, when prefix and suffix must both be cut
REPO_NAME = "myproject"
CURRENT_FILE = "filename"
SNIPPET_LINE = "\n\n--- snippet ---\n\n"  # between context files, without FIM file tokens
DEFAULT_REPLY_ROOM = 256  # context kept for the reply when a request sets no length


class FimChunk(Strict):
    """One context file (llama.cpp's input_extra item)."""

    filename: str = "tmp"
    text: str


@dataclass(frozen=True)
class InfillPrompt:
    ids: list[int]
    truncated: bool  # some of the prefix, suffix or context files did not fit


def fim_tokens(serving: Serving, param: str) -> FimTokens:
    """The served model's FIM tokens; a 400 when it has none."""
    fim = serving.tokenizer.fim
    if fim is None:
        raise ApiError(400, f"{serving.public_name} has no fill-in-the-middle tokens "
                            "(tokenizer.ggml.fim_*); use a code model such as Qwen2.5-Coder",
                       param=param)
    return fim


def reply_room(serving: Serving, max_tokens: int | None) -> int:
    """Context tokens kept for the reply: its length when set, else a default share."""
    if max_tokens is not None:
        return max_tokens
    return min(DEFAULT_REPLY_ROOM, serving.engine.max_model_len // 4)


def infill_prompt(serving: Serving, prefix: str | list[int], suffix: str, *,
                  prompt: str = "", extra: Sequence[FimChunk] = (), reply: int,
                  params: tuple[str, str] = ("input_prefix", "input_suffix")) -> InfillPrompt:
    """The FIM prompt for a prefix (text or ids) and a suffix, cut to leave `reply` tokens of
    the context free; `params` name the prefix and suffix fields in errors."""
    fim = fim_tokens(serving, params[1])
    budget = serving.engine.max_model_len - reply
    ids = [_ids(serving, text, param) for text, param in
           ((prefix, params[0]), (suffix, params[1]), (prompt, "prompt"))]
    for chunk in extra:
        serving.check_fits(chunk.text, "input_extra")
    repo = repo_context(serving.tokenizer, fim, extra) if extra else []
    tok = serving.tokenizer
    head = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []
    return fim_layout(fim, head, *ids, repo, budget)


def _ids(serving: Serving, text: str | list[int], param: str) -> list[int]:
    if not isinstance(text, str):
        return list(text)
    serving.check_fits(text, param)
    return serving.tokenizer.encode(text, add_special_tokens=False)


def repo_context(tok: Tokenizer, fim: FimTokens, extra: Sequence[FimChunk]) -> list[int]:
    """The repository-level block: each context file, then the current file's header."""
    def text(s: str) -> list[int]:
        return tok.encode(s, add_special_tokens=False)

    ids = [fim.repo, *text(REPO_NAME + "\n")] if fim.repo is not None else []
    for chunk in extra:
        if fim.file_sep is not None:
            ids += [fim.file_sep, *text(chunk.filename + "\n")]
        else:
            ids += text(SNIPPET_LINE)
        ids += text(chunk.text)
    if fim.file_sep is not None:
        ids += [fim.file_sep, *text(CURRENT_FILE + "\n")]
    return ids


def fim_layout(fim: FimTokens, head: list[int], prefix: list[int], suffix: list[int],
               prompt: list[int], repo: list[int], budget: int) -> InfillPrompt:
    """head repo PRE prefix prompt SUF suffix MID, cut to at most `budget` ids (the prompt,
    next to the cursor, is never cut)."""
    fixed = len(head) + 3 + len(prompt)  # BOS, the three markers, the text at the cursor
    window = budget - fixed
    if window < 0:
        raise ApiError(400, f"the infill prompt needs at least {fixed} tokens (its markers and "
                            f"a {len(prompt)}-token prompt) but the context leaves {budget} "
                            "after the reply's room; ask for a shorter reply or send a "
                            "shorter prompt", param="prompt", code="context_length_exceeded")
    n_prefix, n_suffix = split_window(window, len(prefix), len(suffix))
    n_repo = min(len(repo), window - n_prefix - n_suffix)
    ids = [*head, *repo[len(repo) - n_repo:], fim.prefix, *prefix[len(prefix) - n_prefix:],
           *prompt, fim.suffix, *suffix[:n_suffix], fim.middle]
    cut = (n_prefix, n_suffix, n_repo) != (len(prefix), len(suffix), len(repo))
    return InfillPrompt(ids, cut)


def split_window(window: int, n_prefix: int, n_suffix: int) -> tuple[int, int]:
    """(prefix tokens, suffix tokens) kept in `window` tokens: all of both when they fit,
    else 3:1, the part shorter than its share giving the rest to the other.

        window 8, prefix 20, suffix 20  ->  6, 2
        window 8, prefix 20, suffix 1   ->  7, 1
        window 8, prefix 3,  suffix 20  ->  3, 5
    """
    if n_prefix + n_suffix <= window:
        return n_prefix, n_suffix
    suffix_share = window * (4 - PREFIX_SHARE) // 4  # rounded down: the prefix matters more
    n_suffix = min(n_suffix, max(suffix_share, window - n_prefix))
    return min(n_prefix, window - n_suffix), n_suffix
