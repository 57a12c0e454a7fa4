"""How far kvlab's quantized kernels and llama.cpp each sit from transformers' fp32 reference
on the same GGUF: teacher-forced along transformers' 32-token greedy continuation of three
prompts, |log-prob difference| over the reference's top-5 and top-1 agreement.

    .venv/bin/python bench/golden_vs_llamacpp.py        (needs the [peers] extra)

With `--positions N`: top-1 agreement over N teacher-forced decode positions of the text
`kvlab kv-quality` uses, against kvlab with weights dequantized to fp32 (which matches
transformers to 2e-3 in log-prob), for kvlab's quantized kernels and for llama.cpp.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from llama_cpp import Llama
from transformers import AutoModelForCausalLM

from kvlab.engine import Engine, EngineConfig
from kvlab.harness.kv_quality import TEXT
from kvlab.weights.default_model import default_model_path

PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a small village"]


def llama_cpp_logprobs(llm: Llama, ids: list[int], n_prompt: int) -> torch.Tensor:
    """The prompt in one batch, then one token per eval, as generation runs."""
    llm.reset()
    llm.eval(ids[:n_prompt])
    rows = [np.array(llm.scores[n_prompt - 1])]
    for t in ids[n_prompt:]:
        llm.eval([t])
        rows.append(np.array(llm.scores[llm.n_tokens - 1]))
    return torch.log_softmax(torch.tensor(np.stack(rows)).float(), -1)


def summary(ref: torch.Tensor, got: torch.Tensor) -> str:
    top5 = ref.topk(5, dim=-1).indices
    diff = (got.gather(1, top5) - ref.gather(1, top5)).abs().amax(-1)
    agree = int((got.argmax(-1) == ref.argmax(-1)).sum())
    return (f"top-5 |d logprob| mean {diff.mean():.3f} max {diff.max():.3f}, "
            f"top-1 {agree}/{ref.shape[0]}")


def long_run(path, positions: int, prefill: int = 16) -> None:
    dense = Engine.from_model(str(path), EngineConfig(threads=2, keep_quantized=False))
    engine = Engine.from_model(str(path), EngineConfig(threads=2))
    ids = dense.tokenizer.encode(TEXT)
    while len(ids) < prefill + positions:
        ids += dense.tokenizer.encode(" " + TEXT, add_special_tokens=False)
    ids = ids[:prefill + positions]
    llm = Llama(model_path=str(path), n_ctx=len(ids) + 16, n_threads=2, logits_all=True,
                verbose=False)
    with torch.inference_mode():
        ref = dense.teacher_forced_logprobs(ids, prefill)
        ours = engine.teacher_forced_logprobs(ids, prefill)
    print(f"{positions} positions vs dequantized fp32 weights:")
    print(f"  kvlab kernels {summary(ref, ours)}")
    print(f"  llama.cpp     {summary(ref, llama_cpp_logprobs(llm, ids, prefill))}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--positions", type=int, default=0)
    args = ap.parse_args()
    path = default_model_path()
    if args.positions:
        long_run(path, args.positions)
        return
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              dtype=torch.float32).eval()
    engine = Engine.from_model(str(path), EngineConfig(threads=2))
    llm = Llama(model_path=str(path), n_ctx=256, n_threads=2, logits_all=True, verbose=False)
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode(prompt)
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)
            ref = torch.log_softmax(hf(out).logits[0, len(ids) - 1:].float(), -1)
        full = out[0].tolist()
        ours = engine.teacher_forced_logprobs(full, len(ids))
        print(f"{prompt[:24]!r:<28} kvlab     {summary(ref, ours)}")
        print(f"{'':<28} llama.cpp {summary(ref, llama_cpp_logprobs(llm, full, len(ids)))}")


if __name__ == "__main__":
    main()
