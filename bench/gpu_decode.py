"""Decode on CUDA: a random-weight model shaped like Llama-3.1-8B (bf16, 16 GB) at batch 1.

Prints kvlab's decode tok/s against the HBM roofline (bytes one step reads over the copy
bandwidth measured here) and against transformers' generate on the very same weight tensors,
how far kvlab's log-probs are from transformers' along one sequence, and aggregate decode
tok/s at larger batches (CUDA graphs per batch bucket). Then the same shape as Q4_K_M (the
random weights quantized by kvlab's own quantizers into a GGUF, bench/random_gguf.py): GPU
memory and batch-1 tok/s against bf16. Last, serving: a random Llama-3.2-1B-shaped F16 GGUF
under `kvlab serve`, swept by `kvlab loadtest` over concurrencies (output tok/s, TPOT).

    python3 bench/gpu_decode.py                      # on a CUDA machine, about 5 minutes
    python bench/gpu_decode.py --device cpu --layers 2 --hidden 256 --inter 512 --vocab 4096
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from random_gguf import Shape, tokenizer_metadata, write_f16, write_q4_k_m

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
    ap.add_argument("--batches", default="8,64")
    ap.add_argument("--parts", default="bf16,q4_k_m,serve",
                    help="which parts run: bf16 (8B decode), q4_k_m, serve (the 1B sweep)")
    ap.add_argument("--sweep", default="1,16,64", help="kvlab loadtest concurrencies")
    ap.add_argument("--sweep-tokens", type=int, default=64, help="output tokens a request")
    ap.add_argument("--sweep-shape", default=None,
                    help="layers,hidden,inter,heads,kv_heads of the served model (default: "
                         "Llama-3.2-1B's on CUDA, the decode model's shape elsewhere)")
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
    return load_gguf_tokenizer(tokenizer_metadata(vocab))


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
    return generate(engine, [(prompt, greedy(n))])[0]


def greedy(n: int, stop_token_ids: tuple[int, ...] = ()) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True,
                          stop_token_ids=stop_token_ids)


def generate(engine: Engine, jobs: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    """Each request's tokens, the requests run side by side."""
    for i, (prompt, params) in enumerate(jobs):
        engine.add_request(f"gen{i}", prompt, params)
    got: dict[str, list[int]] = {f"gen{i}": [] for i in range(len(jobs))}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
    return list(got.values())


def batch_tok_s(engine: Engine, batch: int, n: int, prompt: int) -> float:
    """Aggregate decode tok/s of `batch` sequences, timed once every prefill is done (after
    a short untimed round that captures the batch's graph)."""
    _batch_round(engine, batch, 3, prompt)
    return _batch_round(engine, batch, n, prompt)


def _batch_round(engine: Engine, batch: int, n: int, prompt: int) -> float:
    params = greedy(n)
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


def prompt_ids(n: int, vocab: int, offset: int = 0) -> list[int]:
    """n token ids spread over the vocabulary's first 5100 (fewer for a small one)."""
    span = min(5000, vocab - 100)
    return [100 + (offset + i * 37) % span for i in range(n)]


def batch1_tok_s(engine: Engine, args: argparse.Namespace, bw: float) -> float:
    """Batch-1 decode tok/s (llama-bench's tg at the prompt's depth), printed against the
    copy-bandwidth ceiling of the bytes one step reads."""
    prompt = prompt_ids(args.prompt, args.vocab)
    kvlab_greedy(engine, prompt, 8)  # warm-up and graph capture for batch 1
    tg = bench_tg(engine, args.gen, args.reps, depth=args.prompt, bandwidth_gb_s=bw / 1e9)
    per_token = engine.cost.decode_bytes(args.prompt + args.gen // 2)
    ceiling = bw / per_token
    print(f"  bytes read per decode step   {per_token / 1e9:.2f} GB")
    print(f"  HBM ceiling (copy bw)        {ceiling:.1f} tok/s")
    print(f"  kvlab decode                 {tg.tok_s_mean:.1f} ± {tg.tok_s_std:.1f} tok/s = "
          f"{tg.tok_s_mean / ceiling:.0%} of the ceiling, {tg.gb_s:.0f} GB/s", flush=True)
    return tg.tok_s_mean


def report_batch1(engine: Engine, model, args: argparse.Namespace, bw: float) -> float:
    print(f"\nbatch 1, {args.prompt}-token prompt, {args.gen} generated, {args.reps} reps")
    tok_s = batch1_tok_s(engine, args, bw)
    prompt = prompt_ids(args.prompt, args.vocab)
    ours = kvlab_greedy(engine, prompt, args.gen)
    hf_tok_s, theirs = hf_generate_tok_s(model, prompt, args.gen, args.device)
    same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
    print(f"  transformers generate        {hf_tok_s:.1f} tok/s -> kvlab "
          f"{tok_s / hf_tok_s:.2f}x")
    print(f"  greedy tokens equal to transformers' for the first {same} of {len(ours)}",
          flush=True)
    return tok_s


def report_logprobs(engine: Engine, model) -> None:
    ids = prompt_ids(48, model.config.vocab_size)
    gap, agree = logprob_gap(engine, model, ids, 16)
    print(f"log-probs vs transformers (prefill 16, then 32 decode steps): max |d| over "
          f"top-10 {gap:.3f}, top-1 agreement {agree:.0%}", flush=True)


def report_async_check(engine: Engine, args: argparse.Namespace) -> None:
    """Async scheduling against the synchronous engine on the same weights: three greedy
    requests in a padded graph bucket (four rows), the first ended by a stop token that no
    limit foresees (the step already launched carries its row, dropped), the second by its
    limit, the third running on alone. Tokens may part where a changed batch shape rounds a
    near-tie differently; an error here is a bug of the async path."""
    config = dataclasses.replace(engine.config, async_scheduling=False, kv_cache_gib=1.0)
    sync_engine = Engine(engine.loaded, engine.tokenizer, config, model_name="synchronous")
    prompts = [prompt_ids(max(1, args.prompt // (b + 1)), args.vocab, b * 11) for b in range(3)]
    first = kvlab_greedy(sync_engine, prompts[0], 24)
    stop = next((t for i, t in enumerate(first) if i >= 4 and t not in first[:i]), first[4])
    jobs = [(prompts[0], greedy(24, (stop,))), (prompts[1], greedy(9)),
            (prompts[2], greedy(24))]
    want, got = generate(sync_engine, jobs), generate(engine, jobs)
    sync_engine.close()
    same = [next((i for i, (a, b) in enumerate(zip(w, g)) if a != b), min(len(w), len(g)))
            for w, g in zip(want, got)]
    print(f"async scheduling vs synchronous, 3 requests ending at different steps: "
          f"{sum(w == g for w, g in zip(want, got))} of 3 equal (lengths {[len(g) for g in got]}"
          f" vs {[len(w) for w in want]}, equal prefixes {same})", flush=True)


def report_batches(engine: Engine, args: argparse.Namespace) -> None:
    for batch in (int(b) for b in args.batches.split(",")):
        rate = batch_tok_s(engine, batch, min(64, args.gen), args.prompt)
        print(f"  batch {batch:>3}: {rate:8.1f} tok/s aggregate decode", flush=True)


def report_step_split(engine: Engine, args: argparse.Namespace) -> None:
    """Batches 1 and 8, where the engine seats that many (its graph buckets go no higher)."""
    for batch in (b for b in (1, 8) if b <= engine.config.max_num_seqs):
        section(f"step split, batch {batch}", _step_split, engine, args, batch)


def _step_split(engine: Engine, args: argparse.Namespace, batch: int) -> None:
    """Where a decode step goes: graph replay alone against a whole engine step, and the
    kernels of one step (the static pass run eagerly under the profiler)."""
    graphs = engine.runner.graphs
    params = greedy(60)
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
    """The kernels of one step; where the Triton plan runs, also without it (the per-op
    path), for the launches it saves."""
    model = graphs.model
    plan = model.gpu_plan
    for label, use in (("Triton plan", plan), ("per-op torch", None)):
        if label == "Triton plan" and plan is None:
            continue
        model.gpu_plan = use
        try:
            print(f"  {label}:", flush=True)
            _profile_step(graphs, bucket, device)
        finally:
            model.gpu_plan = plan


def _profile_step(graphs, bucket, device: str) -> None:
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


HF_NAMES = {"token_embd": "model.embed_tokens.weight", "output": "lm_head.weight",
            "attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
            "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}


def write_q4_k_m_file(model, args: argparse.Namespace, out: Path) -> Path:
    """The 8B shape as Q4_K_M, quantized from the bf16 model's own random weights."""
    params = dict(model.named_parameters())

    def sample(kind: str) -> torch.Tensor:
        name = HF_NAMES[kind]
        if "." not in name:  # a layer matrix: layer 0's
            part = "self_attn" if kind.startswith("attn") else "mlp"
            name = f"model.layers.0.{part}.{name}.weight"
        return params[name].detach()

    shape = Shape(args.layers, args.hidden, args.inter, args.heads, args.kv_heads, args.vocab)
    path = out / "llama-8b-shape-q4_k_m.gguf"
    start = time.perf_counter()
    write_q4_k_m(path, shape, sample)
    print(f"\nQ4_K_M GGUF of the same shape: {path.stat().st_size / 1e9:.2f} GB, quantized "
          f"and written in {time.perf_counter() - start:.1f} s", flush=True)
    return path


def report_q4_k_m(path: Path, args: argparse.Namespace, bw: float,
                  bf16: tuple[float | None, int]) -> None:
    """GPU memory and batch-1 decode of the Q4_K_M file, against the bf16 run."""
    bf16_tok_s, bf16_bytes = bf16
    before = _allocated(args.device)
    config = EngineConfig(device=args.device, kv_dtype="bf16", kv_cache_gib=KV_GIB,
                          max_num_seqs=8, max_model_len=4096, enable_prefix_caching=False,
                          decode_graphs="auto" if args.device.startswith("cuda") else "eager")
    start = time.perf_counter()
    engine = Engine.from_model(str(path), config)
    resident = _allocated(args.device) - before
    weights = engine.loaded.weight_bytes
    print(f"  loaded in {time.perf_counter() - start:.1f} s; weights as held "
          f"{weights / 1e9:.2f} GB ({weights / bf16_bytes:.0%} of bf16's {bf16_bytes / 1e9:.2f} "
          f"GB); {_decode_path(engine)}", flush=True)
    if args.device.startswith("cuda"):
        print(f"  GPU memory allocated by the engine {resident / 2**30:.2f} GiB (weights + "
              f"{KV_GIB:g} GiB KV pool)", flush=True)
    print(f"batch 1 Q4_K_M, {args.prompt}-token prompt, {args.gen} generated")
    tok_s = batch1_tok_s(engine, args, bw)
    if bf16_tok_s:
        print(f"  Q4_K_M / bf16 batch-1 tok/s   {tok_s / bf16_tok_s:.2f}x "
              f"({bf16_tok_s:.1f} tok/s bf16)", flush=True)
    engine.close()


def sweep_shape(args: argparse.Namespace) -> Shape:
    """Llama-3.2-1B's shape on CUDA (tied embeddings), the decode model's elsewhere."""
    if args.sweep_shape:
        layers, hidden, inter, heads, kv = (int(v) for v in args.sweep_shape.split(","))
    elif args.device.startswith("cuda"):
        layers, hidden, inter, heads, kv = 16, 2048, 8192, 32, 8
    else:
        layers, hidden, inter, heads, kv = (args.layers, args.hidden, args.inter, args.heads,
                                            args.kv_heads)
    return Shape(layers, hidden, inter, heads, kv, args.vocab, tied=True)


def report_serving(args: argparse.Namespace, out: Path) -> None:
    """`kvlab serve` on an F16 GGUF, `kvlab loadtest` at each concurrency of --sweep."""
    shape = sweep_shape(args)
    path = out / "llama-1b-shape-f16.gguf"
    start = time.perf_counter()
    write_f16(path, shape)
    print(f"\nserving: random Llama ({shape.layers} layers, hidden {shape.hidden}) F16 GGUF "
          f"{path.stat().st_size / 1e9:.2f} GB written in {time.perf_counter() - start:.1f} s",
          flush=True)
    levels = [int(c) for c in args.sweep.split(",")]
    with _server(path, args, max(levels), out / "serve.log") as url:
        start = time.perf_counter()  # unmeasured: captures the batch buckets' decode graphs
        _loadtest(url, max(levels), max(levels), 16)
        print(f"  warm-up round at c={max(levels)}: {time.perf_counter() - start:.1f} s",
              flush=True)
        for c in levels:
            s = _loadtest(url, c, max(8, 2 * c), args.sweep_tokens)
            print(f"  c={c:>3}: {s['output_throughput']:8.1f} output tok/s, TPOT p50 "
                  f"{s['tpot_ms']['p50']:6.2f} ms, TTFT p50 {s['ttft_ms']['p50']:7.1f} ms, "
                  f"{s['completed']}/{s['num_requests']} completed", flush=True)


def _kvlab(*argv: str) -> list[str]:
    return [sys.executable, "-m", "kvlab.cli.main", *argv]


@contextlib.contextmanager
def _server(path: Path, args: argparse.Namespace, seqs: int, log: Path):
    """A `kvlab serve` subprocess on a free port, until /health answers; stopped at exit."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = _kvlab("serve", "--model", str(path), "--device", args.device, "--port", str(port),
                 "--max-num-seqs", str(seqs), "--max-model-len", "4096", "--kv-cache-gib",
                 str(KV_GIB if args.device.startswith("cuda") else 1), "--log-level", "warning")
    start = time.perf_counter()
    with open(log, "wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        while proc.poll() is None and not _healthy(url):
            if time.perf_counter() - start > 300:
                raise TimeoutError("kvlab serve did not answer /health within 300 s")
            time.sleep(0.5)
        if proc.poll() is not None:
            raise RuntimeError(f"kvlab serve exited:\n{log.read_text()[-3000:]}")
        print(f"  kvlab serve --device {args.device} ready in {time.perf_counter() - start:.1f} "
              "s", flush=True)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _healthy(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url + "/health", timeout=2).status_code == 200
    return False


def _loadtest(url: str, concurrency: int, requests: int, tokens: int) -> dict:
    done = subprocess.run(
        _kvlab("loadtest", "--url", url, "--endpoint", "completions", "-c", str(concurrency),
               "-n", str(requests), "--max-tokens", str(tokens), "--ignore-eos", "--json"),
        capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"kvlab loadtest -c {concurrency} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def _decode_path(engine: Engine) -> str:
    """Which decode layers run: the Triton plan (kvlab.models.decode_gpu), the one C call, or
    torch's per-op kernels."""
    model = engine.runner.model  # a LlamaModel: the shapes here are Llama's
    if model.gpu_plan is not None:
        return "decode layers: Triton kernels (decode_gpu)"
    if model.c_plan is not None:
        return "decode layers: one C call (decode_c)"
    return "decode layers: torch per-op"


def _allocated(device: str) -> int:
    return torch.cuda.memory_allocated() if device.startswith("cuda") else 0


def _release(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


KV_GIB = 8.0


def main() -> None:
    args = parse()
    dev, parts = args.device, set(args.parts.split(","))
    bw = copy_bandwidth(dev, 4.0 if dev.startswith("cuda") else 0.25)
    print(f"device {torch.cuda.get_device_name() if dev.startswith('cuda') else 'cpu'}; "
          f"copy bandwidth {bw / 1e9:.0f} GB/s (read + write)", flush=True)
    with tempfile.TemporaryDirectory(prefix="kvlab-gpu-bench-") as tmp:
        q4_path, bf16 = None, (None, 0)
        if parts & {"bf16", "q4_k_m"}:
            q4_path, bf16 = run_bf16(args, bw, parts, Path(tmp))
        _release(dev)
        if q4_path is not None:
            section("Q4_K_M", report_q4_k_m, q4_path, args, bw, bf16)
            _release(dev)
        if "serve" in parts:
            section("serving sweep", report_serving, args, Path(tmp))


def run_bf16(args: argparse.Namespace, bw: float, parts: set[str],
             out: Path) -> tuple[Path | None, tuple[float | None, int]]:
    """The bf16 model's parts; returns the Q4_K_M file made from its weights (if asked) and
    bf16's (batch-1 tok/s, weight bytes) for the comparison."""
    dev = args.device
    start = time.perf_counter()
    model, cfg = hf_model(args)
    weight_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
    print(f"random Llama-shaped model: {weight_gb:.2f} GB bf16, built in "
          f"{time.perf_counter() - start:.1f} s", flush=True)
    engine = kvlab_engine(model, cfg, args, max(int(b) for b in args.batches.split(",")))
    print(f"  {_decode_path(engine)}", flush=True)
    tok_s = None
    if "bf16" in parts:
        tok_s = section("batch 1", report_batch1, engine, model, args, bw)
        section("log-probs", report_logprobs, engine, model)
        section("async check", report_async_check, engine, args)
        section("step split", report_step_split, engine, args)
        section("batches", report_batches, engine, args)
        if dev.startswith("cuda"):
            print(f"  graph buckets captured: {sorted(engine.runner.graphs.buckets)}; "
                  f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    q4_path = (section("Q4_K_M file", write_q4_k_m_file, model, args, out)
               if "q4_k_m" in parts else None)
    return q4_path, (tok_s, engine.loaded.weight_bytes)


if __name__ == "__main__":
    main()
