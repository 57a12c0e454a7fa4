"""Hybrid models (LFM2, LFM2-MoE, Qwen3.5, Qwen3.5-MoE, Granite 4 hybrid dense and MoE,
Nemotron-H dense and MoE) on tiny random checkpoints: each converted by llama.cpp's convert_hf_to_gguf.py (f32), run in
llama.cpp (llama-cpp-python) and in kvlab, against transformers' fp32 logits; prints max
|logit diff| per family.

    .venv/bin/python bench/hybrid_vs_llamacpp.py [--tokens 14] [--families lfm2,qwen3_5]
    .venv/bin/python bench/hybrid_vs_llamacpp.py --speed [--hidden 1024 --layers 16 --quant Q8_0]

Columns: kvlab from the safetensors, kvlab from the converted GGUF and llama.cpp from the same
GGUF, each against transformers; then kvlab against llama.cpp. kvlab's rows come from a
prefill of the first half, then one decode step per token (the state slots and the paged
cache); llama.cpp's from one batch with logits for every position. Qwen3.5's key heads are
as wide as its value heads here (llama.cpp's qwen35 takes no other shape; real checkpoints
have them equal). Nemotron-H's layers are Mamba-2, attention, Mamba-2 and an MLP-only layer
(experts in the MoE one). llama.cpp's build: KVLAB_LLAMA_CPP_LIB / KVLAB_LLAMA_CPP_PY, as in
bench/families_vs_llamacpp.py.

--speed: each family at a larger random size (--hidden, --layers), converted, quantized by
llama-quantize (--quant), then `kvlab bench` and llama-bench on the same file (-p, -n):
prefill and decode tok/s of each and kvlab's ratio to llama.cpp. Figures taken while other
work shares the cores say little; run it on a quiet machine. Published shapes (Qwen3.5-0.8B,
LFM2-350M, granite-4.0-h-350m) with their real vocabularies: bench/shapes_vs_llamabench.py.
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


def _bench(cmd: list[str]) -> tuple[float, float]:
    """(prefill, decode) tok/s from `kvlab bench -o json` ({"results": [{tok_s_mean, ...}]})
    or llama-bench's JSON list ([{avg_ts, ...}]): the rows with n_gen 0 and n_prompt 0."""
    run = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=3600)
    if run.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} failed: {run.stderr[-800:]}")
    found = json.loads(run.stdout[min(i for i in (run.stdout.find("["), run.stdout.find("{"))
                                      if i >= 0):])
    rows = found["results"] if isinstance(found, dict) else found
    speed = [float(r.get("tok_s_mean", r.get("avg_ts", 0.0))) for r in rows]
    prefill = next(v for r, v in zip(rows, speed) if r["n_gen"] == 0)
    return prefill, next(v for r, v in zip(rows, speed) if r["n_prompt"] == 0)


def speed_shape(arch: str, hidden: int, layers: int) -> dict:
    """Config overrides of the --speed size: `hidden` wide, `layers` deep, each family's own
    head and state shapes, positions for any -p / -n (the tiny configs stop at 256)."""
    size = {"hidden_size": hidden, "num_hidden_layers": layers,
            "intermediate_size": 3 * hidden, "num_attention_heads": hidden // 64,
            "num_key_value_heads": hidden // 256, "vocab_size": 96,
            "max_position_embeddings": 1 << 17}
    if arch.startswith("granitehybrid"):  # Granite 4's shape: 64-wide SSM heads, 1 group
        size |= {"mamba_n_heads": hidden // 32, "mamba_d_head": 64, "mamba_n_groups": 1,
                 "mamba_d_state": 128, "mamba_chunk_size": 256,
                 "shared_intermediate_size": 3 * hidden}
    elif arch.startswith("nemotron_h"):  # Nemotron-H's shape: 64-wide SSM heads, 8 groups
        size |= {"mamba_num_heads": hidden // 32, "mamba_head_dim": 64, "n_groups": 8,
                 "ssm_state_size": 128, "chunk_size": 256, "head_dim": 128,
                 "moe_intermediate_size": hidden // 2,
                 "moe_shared_expert_intermediate_size": hidden}
    elif arch.startswith("qwen3_5"):  # the Qwen3.5 shape: 64-wide heads, value heads twice the key heads
        size |= {"head_dim": 64, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
                 "linear_num_key_heads": hidden // 128,
                 "linear_num_value_heads": hidden // 64}
    return size


def quantized_gguf(out: Path, quant: str) -> Path:
    """out/hf converted by llama.cpp's converter (f32), then quantized by llama-quantize to
    `quant`; RuntimeError saying why where either fails."""
    failed = convert_with_llama_cpp(out / "hf", out / "f32.gguf")
    if failed:
        raise RuntimeError(f"no GGUF: {failed}")
    model = out / f"{quant.lower()}.gguf"
    run = subprocess.run([str(BIN / "llama-quantize"), str(out / "f32.gguf"), str(model), quant],
                         capture_output=True, text=True, check=False)
    if run.returncode != 0:
        raise RuntimeError(f"llama-quantize {quant} failed: {run.stderr[-300:]}")
    return model


def speed_row(arch: str, args: argparse.Namespace, work: Path) -> str:
    out = work / arch
    build_hybrid(arch, out, **speed_shape(arch, args.hidden, args.layers))
    try:
        model = quantized_gguf(out, args.quant)
    except RuntimeError as e:
        return f"{arch:12s} {str(e)[:80]}"
    common = ["-m", str(model), "-p", str(args.prompt), "-n", str(args.gen), "-r", "3",
              "-o", "json"]
    pp, tg = _bench([sys.executable, "-m", "kvlab.cli.main", "bench", *common])
    pp_l, tg_l = _bench([str(BIN / "llama-bench"), *common])
    return (f"{arch:12s} {pp:9.1f} {pp_l:9.1f} {pp / pp_l:6.2f}x  "
            f"{tg:9.1f} {tg_l:9.1f} {tg / tg_l:6.2f}x")


BIN = Path(os.environ.get("KVLAB_LLAMA_CPP_LIB", "llama.cpp/build/bin"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=14)
    ap.add_argument("--families", default=",".join(HYBRID_ARCHS))
    ap.add_argument("--speed", action="store_true", help="tok/s against llama-bench instead")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--quant", default="Q8_0", help="llama-quantize's type name")
    ap.add_argument("-p", "--prompt", type=int, default=128)
    ap.add_argument("-n", "--gen", type=int, default=32)
    args = ap.parse_args()
    if args.speed:
        print(f"{'family':12s} {'pp kvlab':>9s} {'pp l.cpp':>9s} {'ratio':>7s}  "
              f"{'tg kvlab':>9s} {'tg l.cpp':>9s} {'ratio':>7s}   (tok/s, {args.quant}, "
              f"hidden {args.hidden}, {args.layers} layers)")
        with tempfile.TemporaryDirectory() as tmp:
            for arch in args.families.split(","):
                print(speed_row(arch, args, Path(tmp)), flush=True)
        return
    ids = torch.randint(0, 96, (args.tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    print(f"{'family':12s} {'kvlab hf':>10s} {'kvlab gguf':>10s} {'llama.cpp':>10s} "
          f"{'kv - l.cpp':>10s}   (max |logit diff| vs transformers, {args.tokens} tokens)")
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.families.split(","):
            print(family_row(arch, ids, Path(tmp)), flush=True)


if __name__ == "__main__":
    main()
