"""SmolLM3, OLMo 2, Ministral 3 and GLM-4.5 on tiny random checkpoints: each converted by
llama.cpp's own convert_hf_to_gguf.py (f32), run in llama.cpp (through llama-cpp-python) and
in kvlab, against transformers' fp32 logits; prints max |logit diff| per family.

    .venv/bin/python bench/families_vs_llamacpp.py [--tokens 14] [--families smollm3,olmo2]

Columns: kvlab from the safetensors, kvlab from the converted GGUF and llama.cpp from the same
GGUF, each against transformers; then kvlab against llama.cpp on that GGUF. kvlab's rows come
from a one-token prefill and then one decode step per token (the paged-cache path);
llama.cpp's from one batch with logits for every position. Set KVLAB_LLAMA_CPP_LIB (default
llama.cpp/build/bin) and KVLAB_LLAMA_CPP_PY (llama-cpp-python's source and its pylib) to
point at another build.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from kvlab.models.loader import LoadOptions, load_model
from kvlab.runner import ModelRunner
from kvlab.scheduler import ScheduledSeq, SchedulerOutput
from kvlab.weights.checkpoint import open_checkpoint

from tiny_models import FAMILIES_2025, build, convert_with_llama_cpp

LIB = os.environ.get("KVLAB_LLAMA_CPP_LIB", "llama.cpp/build/bin")
PY = os.environ.get("KVLAB_LLAMA_CPP_PY",
                    "llama-cpp-python")
# llama.cpp's logits for every position of one batch, as JSON rows
_LLAMA_CPP = """
import json, sys
from llama_cpp import Llama
llm = Llama(sys.argv[1], logits_all=True, n_ctx=256, verbose=False)
ids = json.loads(sys.argv[2])
llm.eval(ids)
print(json.dumps([list(map(float, row)) for row in llm.scores[:len(ids)]]))
"""


def llama_cpp_logits(path: Path, ids: list[int]) -> torch.Tensor:
    env = {**os.environ, "LLAMA_CPP_LIB_PATH": LIB, "PYTHONPATH": PY}
    run = subprocess.run([sys.executable, "-c", _LLAMA_CPP, str(path), json.dumps(ids)],
                         env=env, capture_output=True, text=True, check=False, timeout=600)
    if run.returncode != 0:
        raise RuntimeError(f"llama.cpp on {path.name} failed: {run.stderr[-1500:]}")
    return torch.tensor(json.loads(run.stdout.strip().splitlines()[-1]))


def kvlab_logits(path: Path, ids: list[int]) -> torch.Tensor:
    """Logits at every position: token 0 as a prefill, then one decode step per token."""
    loaded = load_model(open_checkpoint(path), LoadOptions())
    runner = ModelRunner(loaded.model, loaded.config, 32, 4)
    table = list(range(len(ids) // 4 + 1))
    rows = []
    for pos, token in enumerate(ids):
        seq = ScheduledSeq("a", pos, [token], table, True, 1 if pos == 0 else 0)
        rows.append(runner.execute(SchedulerOutput([seq])).logits[0])
    return torch.stack(rows)


def family_row(arch: str, ids: list[int], work: Path) -> str:
    out = work / arch
    hf = build(arch, out)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    converted = out / "converted.gguf"
    why = convert_with_llama_cpp(out / "hf", converted)
    if why is not None:
        return f"{arch:<10} {why.splitlines()[0]}"
    ours_hf, ours_gguf = kvlab_logits(out / "hf", ids), kvlab_logits(converted, ids)
    theirs = llama_cpp_logits(converted, ids)
    diffs = [(ours_hf - ref), (ours_gguf - ref), (theirs - ref), (ours_gguf - theirs)]
    return f"{arch:<10}" + "".join(f" {d.abs().max().item():>14.2e}" for d in diffs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=14)
    ap.add_argument("--families", default=",".join(FAMILIES_2025))
    args = ap.parse_args()
    ids = torch.randint(0, 96, (args.tokens,), generator=torch.Generator().manual_seed(1))
    print(f"max |logit diff| over {args.tokens} positions (vocab 96, fp32)")
    print(f"{'family':<10} {'kvlab hf-tf':>14} {'kvlab gguf-tf':>14} {'llama.cpp-tf':>14} "
          f"{'kvlab-llama.cpp':>14}")
    with tempfile.TemporaryDirectory() as work:
        for arch in args.families.split(","):
            print(family_row(arch, ids.tolist(), Path(work)), flush=True)


if __name__ == "__main__":
    main()
