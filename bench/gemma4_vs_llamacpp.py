"""Gemma 4 on tiny random checkpoints (tests/tiny_models.py's three shapes: per-layer inputs
with shared KV, keys as values, and that with routed experts): each converted by llama.cpp's
convert_hf_to_gguf.py (f32), run in llama.cpp (llama-cpp-python) and in kvlab, against
transformers' fp32 logits; prints max |logit diff| per shape.

    .venv/bin/python bench/gemma4_vs_llamacpp.py [--tokens 14] [--shapes ple_shared,moe]

Columns: kvlab from the safetensors, kvlab from the converted GGUF and llama.cpp from the same
GGUF, each against transformers; then kvlab against llama.cpp. kvlab's rows are one decode
step per token through the paged cache; llama.cpp's one batch with logits for every position.
llama.cpp's build: KVLAB_LLAMA_CPP_LIB / KVLAB_LLAMA_CPP_PY, as in
bench/families_vs_llamacpp.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests"), str(Path(__file__).parent)]

from families_vs_llamacpp import kvlab_logits, llama_cpp_logits

from tiny_models import build_gemma4, convert_with_llama_cpp

SHAPES = ("ple_shared", "k_eq_v", "moe")


def shape_row(shape: str, ids: list[int], work: Path) -> str:
    out = work / shape
    hf = build_gemma4(out, k_eq_v=shape != "ple_shared", moe=shape == "moe")
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    # the converter counts the vocabulary it keeps in tokenizer.json
    vocab = {chr(0x100 + i): i for i in range(hf.config.vocab_size)}
    (out / "hf" / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab},
                                                           "added_tokens": []}))
    ours_hf = (kvlab_logits(out / "hf", ids) - ref).abs().max()
    failed = convert_with_llama_cpp(out / "hf", out / "converted.gguf")
    if failed:
        return f"{shape:12s} {ours_hf:10.2e}  (no GGUF: {failed[-80:]})"
    ours = kvlab_logits(out / "converted.gguf", ids)
    try:
        theirs = llama_cpp_logits(out / "converted.gguf", ids)
    except RuntimeError as e:
        return (f"{shape:12s} {ours_hf:10.2e} {(ours - ref).abs().max():10.2e}"
                f"  (llama.cpp: {str(e)[-80:]})")
    return (f"{shape:12s} {ours_hf:10.2e} {(ours - ref).abs().max():10.2e} "
            f"{(theirs - ref).abs().max():10.2e} {(ours - theirs).abs().max():10.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=14)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()
    ids = torch.randint(3, 90, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    print(f"{'shape':12s} {'kvlab hf':>10s} {'kvlab gguf':>10s} {'llama.cpp':>10s} "
          f"{'kv vs lc':>10s}   (max |logit diff| against transformers fp32)")
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            print(shape_row(shape, ids, Path(tmp)), flush=True)


if __name__ == "__main__":
    main()
