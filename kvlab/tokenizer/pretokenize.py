"""llama.cpp's BPE pre-tokenizers: GGUF `tokenizer.ggml.pre` name -> how text is cut into words.

This module owns the table (`PRE_TOKENIZERS`) and the splitting. A pre-tokenizer is a short
sequence of regexes plus the per-vocabulary flags llama.cpp sets with it (ignore_merges, byte
alphabet or raw UTF-8, spaces escaped to U+2581, the default for adding BOS).

The splitting reproduces llama.cpp, not a Unicode regex engine, because the ids must be
llama.cpp's: each regex in the sequence cuts every piece left by the one before into its
matches and the unmatched stretches between them (both become pieces; an empty match only
cuts). llama.cpp runs a regex that names a category on a copy of the text with one stand-in
character per category, so there `\\p{Lu}` is any letter (only ASCII has case), and turns
non-ASCII whitespace into \\v; the patterns here are written so that on the text itself they
mean the same (see `_Step`).
"""

from __future__ import annotations

from dataclasses import dataclass

import regex

from kvlab.errors import ModelLoadError

# llama.cpp's std::regex sees one stand-in per category for a non-ASCII character, so
# \p{Lu} there is any letter; Unicode's \s is already its \s (ASCII's six plus the non-ASCII
# whitespace it maps to \v), and no whitespace character is a letter, number, mark,
# punctuation or symbol. So a regex runs on the text itself once the letter subcategories
# are widened to \p{L}.
_LETTER_SUBCATEGORY = regex.compile(r"\\p\{L[ultmo]\}")


class _Step:
    """One regex of the sequence, compiled with llama.cpp's meaning of its categories."""

    def __init__(self, pattern: str) -> None:
        self.regex = regex.compile(_LETTER_SUBCATEGORY.sub(r"\\p{L}", pattern))


# ---------------------------------------------------------------- pre-tokenizers

@dataclass(frozen=True)
class PreTokenizer:
    """How one family of vocabularies splits text into words before merging."""

    patterns: tuple[str, ...]
    ignore_merges: bool = False  # a word that is already a token is emitted whole
    byte_level: bool = True      # words spelled in GPT-2's byte alphabet (else raw UTF-8)
    escape_spaces: bool = False  # " " -> U+2581 before splitting (SentencePiece-style BPE)
    newline_tokens: bool = False  # a run of newlines that is a token is emitted whole
    add_bos: bool | None = None  # llama.cpp's default when the GGUF does not say
    always_bos: bool = False     # BOS even when the GGUF says not to (llama.cpp's Gemma 4 rule)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_steps", tuple(_Step(p) for p in self.patterns))

    def split(self, text: str) -> list[str]:
        """The words of `text`, in order; they concatenate back to `text`."""
        if self.escape_spaces:
            text = text.replace(" ", "\u2581")
        steps = self._steps  # type: ignore[attr-defined]
        if len(steps) == 1 and not steps[0].regex.groups:  # the common case, fast
            words = steps[0].regex.findall(text)
            if sum(map(len, words)) == len(text):  # no unmatched stretches
                return [w for w in words if w]
        spans = [(0, len(text))]
        for step in steps:
            spans = _cut(step.regex, text, spans)
        return [text[a:b] for a, b in spans]


def _cut(rx: regex.Pattern, text: str, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Each span cut into the regex's matches and the unmatched stretches between them."""
    out: list[tuple[int, int]] = []
    for start, end in spans:
        pos = 0
        for m in rx.finditer(text[start:end]):
            a, b = m.span()
            if a > pos:
                out.append((start + pos, start + a))
            if b > a:
                out.append((start + a, start + b))
            pos = b
        if start + pos < end:
            out.append((start + pos, end))
    return out


# Building blocks, named for what they match.
_CONTRACTION = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"  # ASCII case only
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_SPACE_TAIL = r"|\s*[\r\n]+|\s+(?!\S)|\s+"


def _llama3_like(digits: str, letters: str = r"\p{L}+",
                 other: str = r" ?[^\s\p{L}\p{N}]+[\r\n]*", tail: str = _SPACE_TAIL,
                 lead: str = _CONTRACTION + "|") -> str:
    """Contraction | optional non-letter + letters | digits | punctuation run | spaces."""
    return f"{lead}[^\\r\\n\\p{{L}}\\p{{N}}]?{letters}|{digits}|{other}{tail}"


def _cased_words(upper: str, lower: str, digits: str, contraction: str = "") -> str:
    """GPT-4o-style words: an upper run then a lower run, or the other way round."""
    lead = r"[^\r\n\p{L}\p{N}]?"
    return (f"{lead}{upper}*{lower}+{contraction}|{lead}{upper}+{lower}*{contraction}"
            f"|{digits}| ?[^\\s\\p{{L}}\\p{{N}}]+[\\r\\n/]*{_SPACE_TAIL}")


# Upper / lower "case" in llama.cpp's rewriting: only ASCII letters have one.
_UPPER = r"(?:(?=\p{L})[^a-z])"
_LOWER = r"(?:(?=\p{L})[^A-Z])"
_UPPER_M = r"(?:(?=[\p{L}\p{M}])[^a-z])"
_LOWER_M = r"(?:(?=[\p{L}\p{M}])[^A-Z])"
_CASED_ANY = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"  # every letter or mark, once collapsed
_CASED_LOW = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
# CJK ideographs, U+0800.., Hangul; whitespace in those ranges is \v to llama.cpp, so not in.
_CJK = r"(?:(?!\s)[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff])+"
# ASCII and full-width punctuation, quotes, CJK marks (U+3000 is whitespace, \v to llama.cpp)
_DEEPSEEK_PUNCT = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3001\u3002]+"
_HAN_KANA = r"[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_ASCII_PUNCT_WORD = r"[!-/:-@\[-`{-~][A-Za-z]+"
_SENTENCE_MARKS = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"
_NEWLINE_RUNS = r"[^\n]+|\n+"
# Digits in groups of three from the right; the stretch before a number joins its first group.
_DIGIT_GROUPS = r"[^\p{N}]*\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))"

_BAILING = (r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
            r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+")
_EXAONE_MOE = (_CONTRACTION + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+"
               r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+")
# Hangul, CJK punctuation, Bopomofo, Han and kana runs.
_YOUTU_SCRIPTS = ("[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014"
                  "\uff1a\uff1b\uff0c\u3001-\u303f\ufe30-\ufe4f]+|[\u3105-\u312f]+|" + _HAN_KANA)
# Han, kana, Thai, Lao, Khmer, Myanmar, Javanese, Hangul runs.
_AFMOE_SCRIPTS = ("[\u4e00-\u9fff\u3400-\u4dbf\u8c48-\ufaff\u3040-\u309f\u30a0-\u30ff"
                  "\uff65-\uff9f\u2f00-\u2fdf\u0e40-\u0e7f\u0e80-\u0eff\u1780-\u17ff"
                  "\u1000-\u109f\uaa60-\uaa7f\ua9e0-\ua9ff\uac00-\ud7af\u1100-\u11ff]+")

# Kimi K2: Han runs, then words of other letters (no marks, no case) with a contraction.
_HAN = ("[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002a6df\U0002a700-\U0002ebef"
        "\U0002f800-\U0002fa1f]")
_KIMI_K2 = (f"{_HAN}+|[^\\r\\n\\p{{L}}\\p{{N}}]?(?:(?!{_HAN})\\p{{L}})+"
            r"(?:'[sStTmMdD]|'[rR][eE]|'[vV][eE]|'[lL][lL])?"
            r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*" + _SPACE_TAIL)

_LLAMA3 = _llama3_like(r"\p{N}{1,3}")
_QWEN2 = _llama3_like(r"\p{N}")
_DEEPSEEK3_TAIL = (f"{_ASCII_PUNCT_WORD}|[^\\r\\n\\p{{L}}\\p{{P}}\\p{{S}}]?[\\p{{L}}\\p{{M}}]+"
                   r"| ?[\p{P}\p{S}]+")

_SETS: dict[str, PreTokenizer] = {
    "default": PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]")),
    "llama3": PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True),
    "dbrx": PreTokenizer((_LLAMA3,)),
    "chatglm": PreTokenizer((_LLAMA3,)),
    "glm4": PreTokenizer((_LLAMA3,), ignore_merges=True),
    "jais2": PreTokenizer((_llama3_like(r"\p{N}{1,3}", tail="|\\s*[\\r\\n]+" + "".join(
        f"|\\s{{{n}}}(?!\\S)" for n in (512, 256, 128, 64, 32, 16, 8, 4)) + r"|\s{1,2}(?!\S)|\s"),)),
    "deepseek-llm": PreTokenizer((r"[\r\n]", r"\s?[A-Za-z\p{LC}]+",
                                  _DEEPSEEK_PUNCT,
                                  r"\s+\Z", _CJK, r"\p{N}+")),
    "deepseek-coder": PreTokenizer((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")),
    "deepseek-v3": PreTokenizer((r"\p{N}{1,3}", _HAN_KANA,
                                 _DEEPSEEK3_TAIL + r"[\r\n]*" + _SPACE_TAIL)),
    "spark2_5": PreTokenizer((r"\p{N}{1,3}", _HAN_KANA,
                              _DEEPSEEK3_TAIL + r"|[\r\n]|\s+(?!\S)|\s+", r"\p{N}")),
    "youtu": PreTokenizer((_YOUTU_SCRIPTS,
                           _cased_words(_CASED_ANY, _CASED_LOW, r"\p{N}", _CONTRACTION + "?")),
                          ignore_merges=True),
    "falcon": PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]")),
    "starcoder": PreTokenizer((r"\p{N}", _GPT2)),
    "gpt-2": PreTokenizer((_GPT2,)),
    "qwen2": PreTokenizer((_QWEN2,)),
    "qwen35": PreTokenizer((_llama3_like(r"\p{N}", letters=r"[\p{L}\p{M}]+",
                                         other=r" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"),)),
    "ufakzeka": PreTokenizer((_llama3_like(r"\p{N}", lead=""),)),  # Qwen 2, no contractions
    "laguna": PreTokenizer((_NEWLINE_RUNS, _QWEN2)),
    "minicpm5": PreTokenizer((r"\p{N}{1,3}", _llama3_like(r"\p{N}+")), ignore_merges=True),
    "seed-coder": PreTokenizer((_llama3_like(r"\p{N}", other=r" ?[^\s\p{L}\p{N}\r\n]+"),)),
    "bailingmoe": PreTokenizer((_BAILING,)),
    "exaone-moe": PreTokenizer((_EXAONE_MOE,)),
    "bloom": PreTokenizer((_SENTENCE_MARKS,)),
    "viking": PreTokenizer((_SENTENCE_MARKS, r"\p{N}")),
    "tekken": PreTokenizer((_cased_words(_UPPER, _LOWER, r"\p{N}"),),
                           ignore_merges=True, add_bos=True),
    "gpt-4o": PreTokenizer((_cased_words(_UPPER, _LOWER, r"\p{N}{1,3}", _CONTRACTION + "?"),)),
    "granite-embed-multi-97m": PreTokenizer(
        (_cased_words(_UPPER_M, _LOWER_M, r"\p{N}{1,3}", _CONTRACTION + "?"),),
        ignore_merges=True),
    "tiny_aya": PreTokenizer((_DIGIT_GROUPS, _cased_words(_CASED_ANY, _CASED_LOW, r"\p{N}{1,3}",
                                                          _CONTRACTION + "?"))),
    "chameleon": PreTokenizer((r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
                               r"([\t\n]|    |  )", r"\p{N}", r"[\p{P}!-/:-@\[-`{-~]", _GPT2),
                              add_bos=True),
    "kimi-k2": PreTokenizer((_KIMI_K2,)),
    "superbpe": PreTokenizer((r"\p{N}+", r"(?=(?:[0-9]{3})+(?![0-9]))")),
    "afmoe": PreTokenizer((_DIGIT_GROUPS, _AFMOE_SCRIPTS,
                           _DEEPSEEK3_TAIL + r"[\r\n]*" + _SPACE_TAIL)),
    "gemma4": PreTokenizer((_NEWLINE_RUNS,), byte_level=False, escape_spaces=True,
                           newline_tokens=True, always_bos=True),
    "sarvam-moe": PreTokenizer((_NEWLINE_RUNS,), byte_level=False, escape_spaces=True),
}

# GGUF tokenizer.ggml.pre -> the set above it uses (llama.cpp's grouping of names).
_NAMES: dict[str, tuple[str, ...]] = {
    "default": ("default",),
    "llama3": ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
               "lfm2", "jina-v5-nano"),
    "dbrx": ("dbrx", "smaug-bpe"),
    "chatglm": ("chatglm-bpe",),
    "glm4": ("glm4", "glm5"),
    "jais2": ("jais-2",),
    "deepseek-llm": ("deepseek-llm",),
    "deepseek-coder": ("deepseek-coder",),
    "deepseek-v3": ("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"),
    "spark2_5": ("spark2_5",),
    "youtu": ("youtu",),
    "falcon": ("falcon",),
    "starcoder": ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone",
                  "minerva-7b", "mellum2"),
    "gpt-2": ("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de",
              "a.x-4.0", "mellum", "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe",
              "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4"),
    "qwen2": ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan",
              "solar-open", "grok-2"),
    "qwen35": ("qwen35",),
    "ufakzeka": ("ufakzeka",),
    "laguna": ("laguna",),
    "minicpm5": ("minicpm5",),
    "seed-coder": ("seed-coder",),
    "bailingmoe": ("bailingmoe", "bailingmoe2", "llada-moe"),
    "exaone-moe": ("exaone-moe",),
    "bloom": ("bloom", "poro-chat", "gpt3-finnish"),
    "viking": ("viking",),
    "tekken": ("tekken",),
    "gpt-4o": ("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"),
    "granite-embed-multi-97m": ("granite-embed-multi-97m",),
    "tiny_aya": ("tiny_aya", "cohere2moe"),
    "chameleon": ("chameleon",),
    "superbpe": ("superbpe",),
    "kimi-k2": ("kimi-k2",),
    "afmoe": ("afmoe",),
    "gemma4": ("gemma4", "granite-embed-multi-311m"),
    "sarvam-moe": ("sarvam-moe",),
}

PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    name: _SETS[key] for key, names in _NAMES.items() for name in names}

# Named by llama.cpp but not byte-pair pre-tokenizers kvlab implements.
_OUT_OF_SCOPE = {"whitespace": "the whitespace tokenizer model"}


def pre_tokenizer_for(name: str) -> PreTokenizer:
    """The pre-tokenizer of GGUF `tokenizer.ggml.pre` = `name`."""
    try:
        return PRE_TOKENIZERS[name]
    except KeyError:
        detail = f" ({_OUT_OF_SCOPE[name]} is not implemented)" if name in _OUT_OF_SCOPE else ""
        raise ModelLoadError(
            f"unsupported byte-level BPE pre-tokenizer tokenizer.ggml.pre={name!r}{detail}; "
            f"supported: {', '.join(sorted(PRE_TOKENIZERS))}") from None
