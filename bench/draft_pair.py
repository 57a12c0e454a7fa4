"""A target and draft pair for speculative decoding with a draft model: a random-weight target
shaped like Llama-3.2-1B with the real Llama 3 vocabulary, and a layer-skip draft (the
target's own first layers, final norm and tied head), as two GGUF files.

    .venv/bin/python bench/draft_pair.py [--out /tmp/kvlab-draft-pair] [--type Q8_0]
        [--draft-layers 2] [--scale 0.02] [--vocab FILE] [--check-prompts 3] [--check-tokens 48]

Writes OUT/target.gguf (16 layers, hidden 2048, 32/8 heads of 64, FFN 8192, tied output,
llama3 rope: bench/quant_peers.py's Llama-3.2-1B shape and N(0, 0.02) weights) and
OUT/draft.gguf (its first --draft-layers layers, final norm and head: their bytes copied
from the target), both with the tokenizer copied from llama.cpp's ggml-vocab-llama-bpe.gguf
and, where llama.cpp's templates folder beside it has one, Llama 3.2's chat template. Matrices are stored as --type (F16, Q8_0 or
Q4_K; kvlab's own quantizer), so both engines read the same bytes.

A random target's later layers would swamp what its first layers computed, and an early exit
would almost never guess its greedy token. So the target is made to agree with its truncated
self: the residual contributions of the layers past the draft's (their attn_output and
ffn_down) are multiplied by --scale; the target still runs all 16 layers at full cost, but
its prediction stays close to the draft's. The smaller --scale, the more often they agree:
with 2 draft layers, 0.05 agreed on 65 % of greedy tokens and 0.02 on 81 % (the check below,
2 prompts x 24 tokens, Q8_0).

The check at the end is honest about it: on the first of `kvlab loadtest`'s built-in
prompts (random weights copy nothing from a prompt, so any prompt serves), the target's
greedy continuation, teacher-forced through both models, gives the share of positions where
the draft's greedy token is the target's (the acceptance a draft of one token would see), and
how many distinct tokens the continuation holds (a random model that repeats itself makes
agreement trivial). Files that exist are kept where they were built with the same options
(their general.description says how); one built otherwise is an error, not reused.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from quant_peers import (  # the sibling script's Llama-3.2-1B shape, by path
    LlamaShape,
    _copy_tokenizer,
    _llama_metadata,
    llama_tensors,
    tensor_values,
)

from kvlab.engine import EngineConfig
from kvlab.harness.loadtest import builtin_prompts
from kvlab.kernels.ops import quantize
from kvlab.llm import LLM
from kvlab.request import SamplingParams

REPO = Path(__file__).resolve().parents[1]
VOCAB = REPO / ".cache/llama_cpp_python-0.3.36/models/ggml-vocab-llama-bpe.gguf"
TEMPLATE = "templates/meta-llama-Llama-3.2-3B-Instruct.jinja"  # beside the vocabulary
TYPES = {"F16": GGMLQuantizationType.F16, "Q8_0": GGMLQuantizationType.Q8_0,
         "Q4_K": GGMLQuantizationType.Q4_K}
SCALED = (".attn_output.weight", ".ffn_down.weight")  # a layer's writes to the residual


def pair_paths(folder: Path) -> tuple[Path, Path]:
    """(target, draft) in a folder this script wrote; a clear error where they are not."""
    target, draft = folder / "target.gguf", folder / "draft.gguf"
    for path in (target, draft):
        if not path.is_file():
            raise SystemExit(f"no {path.name} in {folder}: write the pair with "
                             f".venv/bin/python bench/draft_pair.py --out {folder}")
    return target, draft


@dataclasses.dataclass(frozen=True)
class PairSpec:
    shape: LlamaShape
    qtype: GGMLQuantizationType
    draft_layers: int
    scale: float  # on the residual writes of layers >= draft_layers


def stored(name: str, shape: tuple[int, ...], seed: int, spec: PairSpec) -> np.ndarray:
    """A tensor's bytes as the file keeps them: 1-D in f32, matrices at spec.qtype."""
    values = tensor_values(name, shape, spec.shape, seed)
    if len(shape) == 1:
        return values
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    if layer >= spec.draft_layers and name.endswith(SCALED):
        values = (values.astype(np.float32) * spec.scale).astype(np.float16)
    if spec.qtype == GGMLQuantizationType.F16:
        return values
    weight = quantize(torch.from_numpy(values.astype(np.float32)), spec.qtype)
    return weight.data.numpy()


def recipe(spec: PairSpec) -> str:
    """What the pair was built with, kept in both files (general.description)."""
    return (f"random-weight Llama-3.2-1B shape, {spec.qtype.name}; layer-skip draft of "
            f"{spec.draft_layers} layers; later layers' residual writes x {spec.scale:g}")


def write_target(path: Path, spec: PairSpec, vocab: Path) -> None:
    """All 16 layers, drawn as bench/quant_peers.py draws them, the later ones scaled."""
    tensors = []
    for seed, (name, dims) in enumerate(llama_tensors(spec.shape)):
        raw = None if len(dims) == 1 or spec.qtype == GGMLQuantizationType.F16 else spec.qtype
        tensors.append((name, stored(name, dims, seed, spec), raw))
    write_gguf(path, spec.shape, spec, vocab, tensors)


def write_draft(path: Path, target: Path, spec: PairSpec, vocab: Path) -> None:
    """The target's first layers, norm and tied head: its tensors' bytes, copied."""
    shape = dataclasses.replace(spec.shape, layers=spec.draft_layers)
    stored_tensors = {t.name: t for t in GGUFReader(str(target)).tensors}
    tensors = []
    for name, dims in llama_tensors(shape):
        t = stored_tensors[name]
        quantized = t.tensor_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
        tensors.append((name, t.data, t.tensor_type if quantized else None))
    write_gguf(path, shape, spec, vocab, tensors)


def write_gguf(path: Path, shape: LlamaShape, spec: PairSpec, vocab: Path,
               tensors: list[tuple[str, np.ndarray, GGMLQuantizationType | None]]) -> None:
    """A Llama GGUF of `shape` with the Llama 3 tokenizer (and chat template) and `tensors`
    (name, stored array, its block type where quantized), via a .part file renamed when
    complete, so an interrupted run is never taken for a finished one."""
    part = path.with_suffix(".part")
    w = GGUFWriter(str(part), "llama")
    _llama_metadata(w, shape)
    w.add_string("general.description", recipe(spec))
    _copy_tokenizer(w, vocab, shape.vocab)
    template = vocab.parent / TEMPLATE
    if template.is_file():
        w.add_string("tokenizer.chat_template", template.read_text())
    for name, data, raw in tensors:
        w.add_tensor_info(name, data.shape, data.dtype, data.nbytes, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, data, _ in tensors:
        w.write_tensor_data(data)
    w.close()
    part.rename(path)


def ensure(path: Path, spec: PairSpec, write: Callable[[Path], None]) -> None:
    """Write `path` unless it exists; an existing file must have been built as `spec` asks."""
    if path.exists():
        field = GGUFReader(str(path)).fields.get("general.description")
        built = field.contents() if field is not None else "(no recipe)"
        if built != recipe(spec):
            raise SystemExit(f"{path} was built as {built!r}, not {recipe(spec)!r}: delete "
                             "it or pass another --out")
        print(f"# have {path}")
        return
    start = time.perf_counter()
    print(f"# writing {path}: {recipe(spec)}", flush=True)
    write(path)
    print(f"#   {path.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - start:.0f} s")


def agreement(target: LLM, draft: LLM, prompts: list[str], tokens: int) -> None:
    """Per prompt: how often the draft's greedy token, given the target's greedy context, is
    the target's; and how varied the target's continuation is."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    agree = total = 0
    for i, prompt in enumerate(prompts):
        ids = target.chat_prompt_ids([{"role": "user", "content": prompt}])
        out = target.generate(ids, params)[0].token_ids
        forced = ids + out[:-1]
        want = target.engine.teacher_forced_logprobs(forced, len(ids)).argmax(-1)
        got = draft.engine.teacher_forced_logprobs(forced, len(ids)).argmax(-1)
        same = int((want == got).sum())
        agree, total = agree + same, total + len(out)
        print(f"  prompt {i}: draft agrees on {same}/{len(out)} tokens; the target's "
              f"continuation has {len(set(out))} distinct tokens: "
              f"{target.tokenizer.decode(out)[:60]!r}")
    print(f"draft's greedy token is the target's at {100 * agree / total:.0f} % of "
          f"{total} positions (teacher-forced on the target's greedy text)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/kvlab-draft-pair"))
    ap.add_argument("--type", choices=sorted(TYPES), default="Q8_0")
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--scale", type=float, default=0.02,
                    help="factor on attn_output and ffn_down of the layers past the draft's")
    ap.add_argument("--vocab", type=Path, default=VOCAB,
                    help="llama.cpp's ggml-vocab-llama-bpe.gguf (the Llama 3 tokenizer)")
    ap.add_argument("--check-prompts", type=int, default=3, help="0: skip the check")
    ap.add_argument("--check-tokens", type=int, default=48)
    ap.add_argument("-t", type=int, default=2, help="threads of the check")
    args = ap.parse_args()
    shape = LlamaShape()
    if not 1 <= args.draft_layers < shape.layers:
        raise SystemExit(f"--draft-layers {args.draft_layers}: must be 1 .. {shape.layers - 1}")
    if not math.isfinite(args.scale) or args.scale < 0:
        raise SystemExit(f"--scale {args.scale}: must be a finite number >= 0")
    spec = PairSpec(shape, TYPES[args.type], args.draft_layers, args.scale)
    args.out.mkdir(parents=True, exist_ok=True)
    target, draft = args.out / "target.gguf", args.out / "draft.gguf"
    ensure(target, spec, lambda path: write_target(path, spec, args.vocab))
    ensure(draft, spec, lambda path: write_draft(path, target, spec, args.vocab))
    if args.check_prompts:
        config = EngineConfig(threads=args.t, max_num_seqs=1)
        agreement(LLM(str(target), config), LLM(str(draft), config),
                  [p.as_text() for p in builtin_prompts()[:args.check_prompts]],
                  args.check_tokens)


if __name__ == "__main__":
    main()
