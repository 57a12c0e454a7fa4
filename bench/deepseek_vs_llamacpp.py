"""DeepSeek-V3 / V2 (multi-head latent attention) on tiny random checkpoints: each converted
by llama.cpp's own convert_hf_to_gguf.py (and quantized to Q8_0 by llama-quantize), run in
llama.cpp (llama-cpp-python) and in kvlab, against transformers' fp32 logits; prints max
|logit diff| per pair and the KV bytes per token kvlab keeps (the latent) against the
per-head K and V an expanded cache would keep.

    .venv/bin/python bench/deepseek_vs_llamacpp.py [--tokens 14]

Every position's logits: kvlab runs a one-token prefill then one decode step per token
(the latent cache read back each step). The Q8_0 rows differ by llama.cpp's own rounding of
activations to 8 bits, which kvlab's products share only in part; llama.cpp keeps its KV
cache in f16 (the 1e-4 of the F32 rows). The llama.cpp build and
bindings are families_vs_llamacpp.py's (KVLAB_LLAMA_CPP_LIB, KVLAB_LLAMA_CPP_PY);
llama-quantize is looked for in KVLAB_LLAMA_BIN (default llama.cpp/build/bin).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from families_vs_llamacpp import kvlab_logits, llama_cpp_logits

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from kvlab.models.loader import LoadOptions, load_model
from kvlab.weights.checkpoint import open_checkpoint

from tiny_models import build_deepseek, convert_with_llama_cpp

QUANTIZE = Path(os.environ.get("KVLAB_LLAMA_BIN", "llama.cpp/build/bin")) / "llama-quantize"
VARIANTS = {"v3": {}, "v3-yarn": {"rope_parameters": {
    "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
    "original_max_position_embeddings": 8, "mscale": 1.0, "mscale_all_dim": 1.0}},
    "v2": {"v2": True}}


def _diff(a: torch.Tensor, b: torch.Tensor) -> str:
    return f"{float((a - b).abs().max()):>10.2e}"


def rows(name: str, overrides: dict, ids: list[int], work: Path) -> list[str]:
    out = work / name
    hf = build_deepseek(out, **overrides)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    f32 = out / "f32.gguf"
    why = convert_with_llama_cpp(out / "hf", f32)
    if why is not None:
        return [f"{name:<8} {why.splitlines()[0]}"]
    lines = [f"{name:<8} {'HF':<5} kvlab-hf {_diff(kvlab_logits(out / 'hf', ids), ref)}"]
    files = [("F32", f32)]
    if QUANTIZE.exists():
        q8 = out / "q8_0.gguf"
        subprocess.run([str(QUANTIZE), str(f32), str(q8), "Q8_0"], check=True,
                       capture_output=True, timeout=600)
        files.append(("Q8_0", q8))
    for kind, path in files:
        ours, theirs = kvlab_logits(path, ids), llama_cpp_logits(path, ids)
        lines.append(f"{name:<8} {kind:<5} kvlab-hf {_diff(ours, ref)}  llama.cpp-hf "
                     f"{_diff(theirs, ref)}  kvlab-llama.cpp {_diff(ours, theirs)}")
    config = load_model(open_checkpoint(f32), LoadOptions()).config
    latent = config.kv_bytes_per_token(2)
    expanded = 2 * config.num_layers * config.num_heads * config.head_dim * 2
    lines.append(f"{name:<8} KV f16: {latent:.0f} B/token latent, {expanded} B/token as per-head "
                 f"K and V ({expanded / latent:.1f}x)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=14)
    args = parser.parse_args()
    ids = torch.randint(3, 96, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in VARIANTS.items():
            print("\n".join(rows(name, overrides, ids, Path(tmp))), flush=True)


if __name__ == "__main__":
    main()
