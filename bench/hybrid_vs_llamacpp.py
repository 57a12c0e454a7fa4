"""Hybrid models (LFM2, Qwen3.5, Qwen3.5-MoE) on tiny random checkpoints: each converted by
llama.cpp's convert_hf_to_gguf.py (f32), run in llama.cpp (llama-cpp-python) and in kvlab,
against transformers' fp32 logits; prints max |logit diff| per family.

    .venv/bin/python bench/hybrid_vs_llamacpp.py [--tokens 14] [--families lfm2,qwen3_5]

Columns: kvlab from the safetensors, kvlab from the converted GGUF and llama.cpp from the same
GGUF, each against transformers; then kvlab against llama.cpp. kvlab's rows come from a
prefill of the first half, then one decode step per token (the state slots and the paged
cache); llama.cpp's from one batch with logits for every position. Qwen3.5's key heads are
as wide as its value heads here (llama.cpp's qwen35 takes no other shape; real checkpoints
have them equal). llama.cpp's build: KVLAB_LLAMA_CPP_LIB / KVLAB_LLAMA_CPP_PY, as in
bench/families_vs_llamacpp.py.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests"), str(Path(__file__).parent)]

from families_vs_llamacpp import llama_cpp_logits

from kvlab.models.loader import LoadOptions, load_model
from kvlab.runner import ModelRunner
from kvlab.scheduler import ScheduledSeq, SchedulerOutput
from kvlab.weights.checkpoint import open_checkpoint

from tiny_models import HYBRID_ARCHS, build_hybrid, convert_with_llama_cpp

# llama.cpp's qwen35 needs key heads as wide as value heads
OVERRIDES = {"qwen3_5": {"linear_key_head_dim": 16}, "qwen3_5_moe": {"linear_key_head_dim": 16}}


def kvlab_logits(path: Path, ids: list[int]) -> torch.Tensor:
    """Logits at every position: the first half as one prefill, then a decode step each."""
    loaded = load_model(open_checkpoint(path), LoadOptions())
    runner = ModelRunner(loaded.model, loaded.config, 32, 4, num_state_slots=1)
    table, half = list(range(-(-len(ids) // 4))), len(ids) // 2

    def step(start: int, chunk: list[int]) -> torch.Tensor:
        s = ScheduledSeq("a", start, chunk, table, True, len(chunk), state_slot=0)
        return runner.execute(SchedulerOutput([s])).logits[0]

    # each prefill restarts from a zero state; the last leaves it after the first half
    rows = [step(0, ids[:n]) for n in range(1, half + 1)]
    rows += [step(p, [ids[p]]) for p in range(half, len(ids))]
    return torch.stack(rows)


def family_row(arch: str, ids: list[int], work: Path) -> str:
    out = work / arch
    hf = build_hybrid(arch, out, **OVERRIDES.get(arch, {}))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    failed = convert_with_llama_cpp(out / "hf", out / "model.gguf")
    ours_hf = kvlab_logits(out / "hf", ids)
    if failed:
        return f"{arch:12s} {(ours_hf - ref).abs().max():10.2e}  (no GGUF: {failed[:60]})"
    ours = kvlab_logits(out / "model.gguf", ids)
    try:
        theirs = llama_cpp_logits(out / "model.gguf", ids)
    except RuntimeError as e:
        return (f"{arch:12s} {(ours_hf - ref).abs().max():10.2e} {(ours - ref).abs().max():10.2e}"
                f"  (llama.cpp: {str(e)[-80:]})")
    return (f"{arch:12s} {(ours_hf - ref).abs().max():10.2e} {(ours - ref).abs().max():10.2e} "
            f"{(theirs - ref).abs().max():10.2e} {(ours - theirs).abs().max():10.2e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=14)
    ap.add_argument("--families", default=",".join(HYBRID_ARCHS))
    args = ap.parse_args()
    ids = torch.randint(0, 96, (args.tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    print(f"{'family':12s} {'kvlab hf':>10s} {'kvlab gguf':>10s} {'llama.cpp':>10s} "
          f"{'kv - l.cpp':>10s}   (max |logit diff| vs transformers, {args.tokens} tokens)")
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.families.split(","):
            print(family_row(arch, ids, Path(tmp)), flush=True)


if __name__ == "__main__":
    main()
