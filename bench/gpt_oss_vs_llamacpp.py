"""gpt-oss on a tiny random checkpoint (sinks, window 4 by turns, YaRN, biased clamped-SwiGLU
experts), float experts and OpenAI's MXFP4 `_blocks` + `_scales`: each converted by llama.cpp's
own convert_hf_to_gguf.py, run in llama.cpp (llama-cpp-python) and in kvlab, against
transformers' fp32 logits (on the MXFP4-rounded weights for the MXFP4 row); prints max
|logit diff|.

    .venv/bin/python bench/gpt_oss_vs_llamacpp.py [--tokens 14]

The last column is kvlab with YaRN's ramp rounded to whole dimensions as llama.cpp rounds it
(ggml_rope_yarn_corr_dims); kvlab itself keeps gpt-oss's unrounded ramp (transformers'
truncate=false, which the GGUF cannot say), so kvlab-llama.cpp is that rounding. The llama.cpp
build and bindings are families_vs_llamacpp.py's (KVLAB_LLAMA_CPP_LIB, KVLAB_LLAMA_CPP_PY).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

import torch
from families_vs_llamacpp import kvlab_logits, llama_cpp_logits

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from kvlab import models
from kvlab.models import gpt_oss

from tiny_models import (
    build_gpt_oss,
    convert_with_llama_cpp,
    mxfp4_rounded,
    save_gpt_oss_mxfp4,
)


def _llama_cpp_rope(meta: dict):
    config = gpt_oss.config_from_gguf(meta)
    yarn = dataclasses.replace(config.rope.yarn, truncate=True)
    return dataclasses.replace(config, rope=dataclasses.replace(config.rope, yarn=yarn))


def rounded_ramp_logits(path: Path, ids: list[int]) -> torch.Tensor:
    """kvlab's logits with llama.cpp's whole-dimension YaRN ramp."""
    spec = dataclasses.replace(gpt_oss.SPEC, config_from_gguf=_llama_cpp_rope)
    models.ARCHITECTURES[spec.name] = spec
    try:
        return kvlab_logits(path, ids)
    finally:
        models.ARCHITECTURES[spec.name] = gpt_oss.SPEC


def row(name: str, hf_dir: Path, ref: torch.Tensor, ids: list[int]) -> str:
    converted = hf_dir.parent / f"{name}.gguf"
    why = convert_with_llama_cpp(hf_dir, converted)
    if why is not None:
        return f"{name:<8} {why.splitlines()[0]}"
    ours = kvlab_logits(converted, ids)
    theirs = llama_cpp_logits(converted, ids)
    diffs = [ours - ref, theirs - ref, ours - theirs,
             rounded_ramp_logits(converted, ids) - theirs]
    return f"{name:<8}" + "".join(f" {d.abs().max().item():>16.2e}" for d in diffs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=14)
    args = ap.parse_args()
    ids = torch.randint(0, 96, (args.tokens,), generator=torch.Generator().manual_seed(1))
    ids = ids.tolist()
    print(f"max |logit diff| over {args.tokens} positions (vocab 96, fp32)")
    print(f"{'experts':<8} {'kvlab-tf':>16} {'llama.cpp-tf':>16} {'kvlab-llama.cpp':>16} "
          f"{'rounded ramp-l.c':>16}")
    with tempfile.TemporaryDirectory() as work:
        out = Path(work)
        hf = build_gpt_oss(out)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
            ref_mx = mxfp4_rounded(hf)(torch.tensor([ids])).logits[0].float()
        print(row("f32", out / "hf", ref, ids), flush=True)
        save_gpt_oss_mxfp4(hf, out / "hf_mxfp4")
        print(row("mxfp4", out / "hf_mxfp4", ref_mx, ids), flush=True)


if __name__ == "__main__":
    main()
