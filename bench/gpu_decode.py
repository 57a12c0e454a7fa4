"""Decode on CUDA: a random-weight model shaped like Llama-3.1-8B (bf16, 16 GB) at batch 1.

Prints kvlab's decode tok/s against the HBM roofline (bytes one step reads over the copy
bandwidth measured here) and against transformers' generate on the very same weight tensors,
how far kvlab's log-probs are from transformers' along one sequence, and aggregate decode
tok/s at larger batches (CUDA graphs per batch bucket).

    python3 bench/gpu_decode.py                      # on a CUDA machine, a few minutes
    python bench/gpu_decode.py --device cpu --layers 2 --hidden 256 --inter 512 --vocab 4096
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvlab.engine import Engine, EngineConfig
from kvlab.harness.llama_bench import bench_tg
from kvlab.models.loader import LoadOptions, load_model
from kvlab.request import SamplingParams
from kvlab.tokenizer import load_gguf_tokenizer
from kvlab.weights.checkpoint import TensorCheckpoint


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=14336)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("-p", "--prompt", type=int, default=128)
    ap.add_argument("-n", "--gen", type=int, default=128)
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("--batches", default="1,8,32")
    return ap.parse_args()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_bandwidth(device: str, gib: float = 4.0) -> float:
    """Device-to-device copy, bytes read plus written per second (median of 10)."""
    src = torch.empty(int(gib * 2**30) // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    times = []
    for i in range(13):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        if i >= 3:
            times.append(time.perf_counter() - start)
    del src, dst
    return 2 * gib * 2**30 / statistics.median(times)


def hf_model(args: argparse.Namespace):
    import transformers as tf

    cfg = tf.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.inter,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=131072,
        rms_norm_eps=1e-5, tie_word_embeddings=False, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(args.device):
            model = tf.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    return model.eval(), cfg  # bf16 parameters; rope buffers stay fp32


def numbered_tokenizer(vocab: int):
    """A byte-level vocabulary of distinct printable tokens: ids detokenize to "<123>"."""
    tokens = [chr(c) for c in range(33, 127)] + [f"<{i}>" for i in range(94, vocab)]
    return load_gguf_tokenizer({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [1] * vocab,
        "tokenizer.ggml.merges": ["! !"], "tokenizer.ggml.eos_token_id": vocab - 1,
        "tokenizer.ggml.add_bos_token": False})


def kvlab_engine(model, cfg, args: argparse.Namespace, max_seqs: int) -> Engine:
    tensors = {k: v.detach() for k, v in model.state_dict().items()}
    ckpt = TensorCheckpoint(cfg.to_dict(), tensors)
    loaded = load_model(ckpt, LoadOptions(dtype=torch.bfloat16, device=args.device))
    config = EngineConfig(device=args.device, dtype="bfloat16", kv_dtype="bf16",
                          kv_cache_gib=8.0, max_num_seqs=max_seqs, max_model_len=4096,
                          enable_prefix_caching=False,
                          decode_graphs="auto" if args.device.startswith("cuda") else "eager")
    return Engine(loaded, numbered_tokenizer(args.vocab), config, model_name="llama-8b-shape")


def hf_generate_tok_s(model, prompt: list[int], n: int, device: str) -> tuple[float, list[int]]:
    """transformers' greedy generate: decode tok/s (prefill time taken out) and its tokens."""
    ids = torch.tensor([prompt], device=device)

    def timed(new: int) -> tuple[float, torch.Tensor]:
        sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 attention_mask=torch.ones_like(ids), pad_token_id=0)
        sync(device)
        return time.perf_counter() - start, out

    timed(4)  # warm-up
    first, _ = timed(1)
    total, out = timed(n)
    return (n - 1) / (total - first), out[0, len(prompt):].tolist()


def kvlab_greedy(engine: Engine, prompt: list[int], n: int) -> list[int]:
    engine.add_request("greedy", prompt, SamplingParams(max_tokens=n, temperature=0,
                                                        ignore_eos=True))
    got: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            got.extend(out.new_token_ids)
    return got


def batch_tok_s(engine: Engine, batch: int, n: int, prompt: int) -> float:
    """Aggregate decode tok/s of `batch` sequences, timed once every prefill is done (after
    a short untimed round that captures the batch's graph)."""
    _batch_round(engine, batch, 3, prompt)
    return _batch_round(engine, batch, n, prompt)


def _batch_round(engine: Engine, batch: int, n: int, prompt: int) -> float:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    for b in range(batch):
        engine.add_request(f"b{b}", [100 + (b * 7 + i) % 1000 for i in range(prompt)], params)
    started: set[str] = set()
    while len(started) < batch:  # the prefills (chunked under the token budget)
        started.update(out.request_id for out in engine.step())
    sync(engine.config.device)
    start, tokens = time.perf_counter(), 0
    while engine.has_unfinished():
        tokens += sum(len(out.new_token_ids) for out in engine.step())
    sync(engine.config.device)
    return tokens / (time.perf_counter() - start)


def logprob_gap(engine: Engine, model, ids: list[int], prefill: int) -> tuple[float, float]:
    """(max |d logprob| over each position's reference top-10, top-1 agreement)."""
    ours = engine.teacher_forced_logprobs(ids, prefill).float().cpu()
    with torch.inference_mode():
        ref = model(torch.tensor([ids], device=engine.config.device)).logits[0].float()
    ref = torch.log_softmax(ref, -1)[prefill - 1:].cpu()
    top = ref.topk(10, dim=-1).indices
    gap = (ours.gather(1, top) - ref.gather(1, top)).abs().max().item()
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    return gap, agree


def section(name: str, fn, *args):
    """Run one part; a failure prints its traceback and the other parts still run."""
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - report and go on: device time is scarce
        import traceback

        print(f"--- {name} failed:\n{traceback.format_exc()}", flush=True)
        return None


def report_batch1(engine: Engine, model, args: argparse.Namespace, bw: float) -> None:
    prompt = [100 + (i * 37) % 5000 for i in range(args.prompt)]
    kvlab_greedy(engine, prompt, 8)  # warm-up and graph capture for batch 1
    tg = bench_tg(engine, args.gen, args.reps, depth=args.prompt, bandwidth_gb_s=bw / 1e9)
    per_token = engine.cost.decode_bytes(args.prompt + args.gen // 2)
    ceiling = bw / per_token
    print(f"\nbatch 1, {args.prompt}-token prompt, {args.gen} generated, {args.reps} reps")
    print(f"  bytes read per decode step   {per_token / 1e9:.2f} GB")
    print(f"  HBM ceiling (copy bw)        {ceiling:.1f} tok/s")
    print(f"  kvlab decode                 {tg.tok_s_mean:.1f} ± {tg.tok_s_std:.1f} tok/s = "
          f"{tg.tok_s_mean / ceiling:.0%} of the ceiling, {tg.gb_s:.0f} GB/s", flush=True)
    ours = kvlab_greedy(engine, prompt, args.gen)
    hf_tok_s, theirs = hf_generate_tok_s(model, prompt, args.gen, args.device)
    same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
    print(f"  transformers generate        {hf_tok_s:.1f} tok/s -> kvlab "
          f"{tg.tok_s_mean / hf_tok_s:.2f}x")
    print(f"  greedy tokens equal to transformers' for the first {same} of {len(ours)}",
          flush=True)


def report_logprobs(engine: Engine, model) -> None:
    ids = [100 + (i * 37) % 5000 for i in range(48)]
    gap, agree = logprob_gap(engine, model, ids, 16)
    print(f"log-probs vs transformers (prefill 16, then 32 decode steps): max |d| over "
          f"top-10 {gap:.3f}, top-1 agreement {agree:.0%}", flush=True)


def report_batches(engine: Engine, args: argparse.Namespace) -> None:
    for batch in (int(b) for b in args.batches.split(",")):
        rate = batch_tok_s(engine, batch, min(64, args.gen), args.prompt)
        print(f"  batch {batch:>3}: {rate:8.1f} tok/s aggregate decode", flush=True)


def report_step_split(engine: Engine, args: argparse.Namespace) -> None:
    for batch in (1, 8):
        section(f"step split, batch {batch}", _step_split, engine, args, batch)


def _step_split(engine: Engine, args: argparse.Namespace, batch: int) -> None:
    """Where a decode step goes: graph replay alone against a whole engine step, and the
    kernels of one step (the static pass run eagerly under the profiler)."""
    graphs = engine.runner.graphs
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    for b in range(batch):
        engine.add_request(f"split{b}", [100 + (b * 7 + i) % 1000 for i in range(args.prompt)],
                           params)
    started: set[str] = set()
    while len(started) < batch:
        started.update(out.request_id for out in engine.step())
    for _ in range(3):  # the bucket's graph is captured
        engine.step()
    sync(args.device)
    start = time.perf_counter()
    for _ in range(40):
        engine.step()
    sync(args.device)
    step_ms = (time.perf_counter() - start) * 25
    while engine.has_unfinished():
        engine.step()
    key = min(k for k in graphs.buckets if k[0] >= batch)
    bucket = graphs.buckets[key]
    replay = bucket.graph.replay if bucket.graph is not None else lambda: graphs._forward(bucket)
    sync(args.device)
    start = time.perf_counter()
    for _ in range(40):
        replay()
    sync(args.device)
    replay_ms = (time.perf_counter() - start) * 25
    print(f"  bucket {key}: graph replay {replay_ms:.2f} ms, engine step {step_ms:.2f} ms "
          f"(host work between replays {step_ms - replay_ms:.2f} ms)", flush=True)
    if args.device.startswith("cuda"):
        _profile(graphs, bucket, args.device)


def _profile(graphs, bucket, device: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        graphs._forward(bucket)
        sync(device)
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]  # kernels only
    gemm = [e for e in events if any(m in e.key for m in ("nvjet", "gemm", "gemv"))]
    total_us = sum(e.self_device_time_total for e in events)
    gemm_us = sum(e.self_device_time_total for e in gemm)
    print(f"  one step's kernels (eager, profiled): {sum(e.count for e in events)} launches, "
          f"{total_us / 1e3:.2f} ms; matrix products {sum(e.count for e in gemm)} launches, "
          f"{gemm_us / 1e3:.2f} ms ({total_us and gemm_us / total_us:.0%})", flush=True)
    top = sorted(events, key=lambda e: -e.self_device_time_total)[:6]
    for e in top:
        print(f"    {e.self_device_time_total / 1e3:6.2f} ms  {e.count:4d}x  {e.key[:70]}")


def main() -> None:
    args = parse()
    dev = args.device
    bw = copy_bandwidth(dev, 4.0 if dev.startswith("cuda") else 0.25)
    print(f"device {torch.cuda.get_device_name() if dev.startswith('cuda') else 'cpu'}; "
          f"copy bandwidth {bw / 1e9:.0f} GB/s (read + write)", flush=True)
    start = time.perf_counter()
    model, cfg = hf_model(args)
    weight_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    print(f"random Llama-shaped model: {weight_gb:.2f} GB bf16, built in "
          f"{time.perf_counter() - start:.1f} s", flush=True)
    engine = kvlab_engine(model, cfg, args, max(int(b) for b in args.batches.split(",")))
    section("batch 1", report_batch1, engine, model, args, bw)
    section("log-probs", report_logprobs, engine, model)
    section("step split", report_step_split, engine, args)
    section("batches", report_batches, engine, args)
    if dev.startswith("cuda"):
        print(f"  graph buckets captured: {sorted(engine.runner.graphs.buckets)}; "
              f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
