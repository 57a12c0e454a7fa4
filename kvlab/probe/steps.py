"""Whole engine steps, timed on a replica of the model to be predicted: what a real step
costs besides its kernels' isolated best runs.

The replica is a GGUF with the model's header (architecture, sizes, tokenizer, every tensor's
name, type and shape) and random blocks of the same types in place of the weights: a step's
speed does not depend on the values, so the probe needs only the model's header, and the
replica has its exact layer sizes. kvlab's own engine runs it, and each step shape below is
repeated (rounds interleaved), the median kept and the spread (IQR / median) reported:

    prefill 512, 512 at 512, 32      one chunk after 0, 512, 0 cached positions (the first
                                     two: the two chunks of a 1024-token prompt)
    decode 1 at 32, 1024, 4096       one sequence after a prompt of that length (the
                                     4096-token prompt prefilled once, then served by the
                                     prefix cache: its decodes sit in every round)
    decode 2, 4, 8, 16 at 32         batches of sequences decoding together
    decode 1 at 32, 1024 (f32, q8_0) the other KV dtypes (own engines)

all on the KV dtype kvlab's engine uses by default here (f16 on CPUs). There are at least
ROUNDS rounds, and more until they span WINDOW_S seconds: a shared machine's speed drifts by
10-25 % for tens of seconds at a time, and a median of rounds that all fell in one slow
stretch would hold that stretch for the machine. The decodes at three depths give the KV term
a factor per stretch of depth, as the C attention's cost per position grows once the cache
outgrows the caches; the four batch sizes a batch factor per size; the two chunk lengths a
prefill factor per length (32 rows use a product's weight reads worse).
`kvlab.estimate.step_model.fit_factors` turns them into the factors that scale the step model's
kernel-rate terms.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from kvlab.cost import ModelSpec
from kvlab.engine import Engine, EngineConfig
from kvlab.estimate.hardware import HardwareSpec, StepFactors
from kvlab.estimate.step_model import SeqWork, TimedStep, fit_factors, median_spread
from kvlab.kernels import quantize
from kvlab.probe.timing import torch_threads
from kvlab.request import SamplingParams
from kvlab.weights.gguf_file import GGUFFile

ROUNDS = 5  # repeats of every shape at least
WINDOW_S = 60.0  # and more, up to MAX_ROUNDS, until the repeats span this many seconds
MAX_ROUNDS = 25
CHUNK = 512  # the engine's token budget a step: kvlab's default
SHORT, DEEP, DEEPEST = 32, 2 * CHUNK, 8 * CHUNK  # prompt lengths timed
BATCHES = (2, 4, 8, 16)
DECODE_STEPS = 6  # decode steps timed per round and shape (their mean is one sample)
OTHER_KV = ("f32", "q8_0")
_KEEP_AS_IS = {"F32", "F16", "BF16"}  # small tensors (norms): copied, not randomised


def measure_steps(model_path: str | Path, model: ModelSpec, hw: HardwareSpec, threads: int,
                  rounds: int = ROUNDS, other_kv: tuple[str, ...] = OTHER_KV,
                  progress: Callable[[str], None] | None = None,
                  window_s: float = WINDOW_S) -> StepFactors:
    """Time the step shapes of the module docstring on a replica of `model_path` (at least
    `rounds` repeats, more until they span `window_s`) and fit the step model's factors for
    `model` on `hw` (its kernel rates) to them."""
    with tempfile.TemporaryDirectory(prefix="kvlab-probe-steps-") as tmp:
        replica = Path(tmp) / "replica.gguf"
        write_replica(model_path, replica)
        base = default_kv_dtype()
        with _engine(replica, threads, base) as engine:
            timed, done = _time_base(engine, rounds, window_s, base, progress)
        for kv_dtype in (d for d in other_kv if d != base):
            with _engine(replica, threads, kv_dtype) as engine:
                timed += _time_kv_dtype(engine, max(rounds - 2, 3), kv_dtype)
    return replace(fit_factors(model, hw, timed, name=model.name), rounds=done)


def default_kv_dtype() -> str:
    """The KV dtype kvlab's engine stores on this machine unless told otherwise."""
    return EngineConfig().kv_dtype


def write_replica(source: str | Path, path: Path) -> None:
    """`source` byte for byte up to its tensor data (header, metadata, tensor directory),
    then random blocks of each tensor's type at each tensor's offset; small float tensors
    (norms) are copied as they are."""
    src = GGUFFile(source)
    infos = sorted(src.tensors.values(), key=lambda t: t.offset)
    with open(path, "wb") as out:
        out.write(src.head(infos[0].offset))
        for t in infos:
            out.write(b"\0" * (t.offset - out.tell()))
            data = src.raw(t.name)
            if t.qtype.name not in _KEEP_AS_IS:
                data = _random_blocks(t.qtype, t.shape)
            out.write(data.tobytes())


def _random_blocks(qtype: Any, shape: tuple[int, ...]) -> np.ndarray:
    """uint8 `qtype` blocks for a tensor of `shape`: a tile of small random values
    quantized, repeated (the quantizers are slow; a product's speed does not depend on
    values)."""
    import torch


    cols = shape[-1]
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    tile_rows = min(rows, 16)
    gen = torch.Generator().manual_seed(rows + cols)
    tile = quantize(torch.randn(tile_rows, cols, generator=gen) * 0.05, qtype).data.numpy()
    tile = tile.reshape(tile_rows, -1)
    return np.ascontiguousarray(np.tile(tile, (-(-rows // tile_rows), 1))[:rows]).reshape(-1)


@contextmanager
def _engine(path: Path, threads: int, kv_dtype: str) -> Iterator[Any]:
    import torch


    with torch_threads(torch.get_num_threads()):  # the engine's runner changes it
        # the prefix cache serves only the deepest prompt again (the others are random)
        yield Engine.from_model(str(path), EngineConfig(
            threads=threads, kv_dtype=kv_dtype, enable_prefix_caching=True,
            max_num_batched_tokens=CHUNK, max_num_seqs=max(BATCHES),
            max_model_len=DEEPEST + 2 * CHUNK))


class _Requests:
    """Random prompts of ordinary token ids, one request id each."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.n = engine, 0
        vocab = engine.loaded.config.vocab_size
        self.low, self.high = min(1000, vocab // 2), min(vocab, 50_000)
        self.rng = np.random.default_rng(0)

        self.fixed: dict[int, list[int]] = {}  # prompts sent again: the prefix cache's

    def add(self, prompt: int, max_tokens: int = 64, again: bool = False) -> str:
        """A request of a random `prompt`-token prompt; `again`: the same one each time."""
        self.n += 1
        ids = [int(t) for t in self.rng.integers(self.low, self.high, prompt)]
        if again:
            ids = self.fixed.setdefault(prompt, ids)
        self.engine.add_request(f"probe-{self.n}", ids, SamplingParams(
            max_tokens=max_tokens, temperature=0, ignore_eos=True))
        return f"probe-{self.n}"

    def first_token(self, rid: str) -> None:
        """Steps until `rid` has sampled its first token (its prompt, however cached)."""
        while not any(o.request_id == rid and o.new_token_ids for o in self.engine.step()):
            pass

    def clear(self, ids: list[str]) -> None:
        for rid in ids:
            self.engine.abort(rid)
        while self.engine.has_unfinished():
            self.engine.step()


def _timed_step(engine: Any) -> float:
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def _decode_mean(engine: Any, steps: int = DECODE_STEPS) -> float:
    engine.step()  # the first decode after a prefill: threads and caches settle
    return sum(_timed_step(engine) for _ in range(steps)) / steps


def _time_base(engine: Any, rounds: int, window_s: float, kv_dtype: str,
               progress: Callable[[str], None] | None) -> tuple[list[TimedStep], int]:
    """The shapes of the module docstring at `kv_dtype`, each over interleaved repeats: at
    least `rounds`, more until they span `window_s` seconds (at most MAX_ROUNDS); and how
    many ran."""
    req, samples = _Requests(engine), {}
    deepest = _deepest(engine)
    _decode_round(engine, req, deepest)  # warm-up: first touch of the weights and KV pool
    start, done = time.perf_counter(), 0
    while done < rounds or (done < MAX_ROUNDS and time.perf_counter() - start < window_s):
        done += 1
        if progress:
            progress(f"engine steps, round {done} (at least {rounds}, over {window_s:.0f} s)")
        for name, seconds in _decode_round(engine, req, deepest).items():
            samples.setdefault(name, []).append(seconds)
    after = DECODE_STEPS / 2 + 1  # mean decode position past the prompt
    shapes = {"prefill 512": (SeqWork(CHUNK, 0, logits=False),),
              "prefill 512 at 512": (SeqWork(CHUNK, CHUNK),), "prefill 32": (SeqWork(SHORT, 0),)}
    for prompt in (SHORT, DEEP) + deepest:
        shapes[f"decode 1 at {prompt}"] = (SeqWork(1, int(prompt + after)),)
    for batch in BATCHES:
        shapes[f"decode {batch} at {SHORT}"] = tuple(SeqWork(1, int(SHORT + after))
                                                     for _ in range(batch))
    return [TimedStep(name, shapes[name], *median_spread(s), kv_dtype=kv_dtype)
            for name, s in _paired(samples, f"decode 1 at {SHORT}").items()], done


def _paired(samples: dict[str, list[float]], reference: str) -> dict[str, list[float]]:
    """Each decode shape's repeats as the median `reference` step times its ratio to the
    `reference` of its own round: the depth and batch factors are differences between
    decodes, which a load that changes between rounds would otherwise blur.

        round   ref   deep          ratio    paired
        1       10    14            1.40     14.0   (ref median 10)
        2       20    27 (loaded)   1.35     13.5
    """
    ref = samples[reference]
    level = float(np.median(ref))
    return {name: ([level * x / r for x, r in zip(s, ref)]
                   if name.startswith("decode") and name != reference else s)
            for name, s in samples.items()}


def _deepest(engine: Any) -> tuple[int, ...]:
    """The deepest prompt timed: DEEPEST, or as deep as the model's context holds it and
    its decodes (in whole blocks); none where that is not past DEEP."""
    block = engine.config.block_size
    deepest = min(DEEPEST, (engine.max_model_len - DECODE_STEPS - 2) // block * block)
    return (deepest,) if deepest > DEEP + CHUNK else ()


def _decode_round(engine: Any, req: _Requests, deepest: tuple[int, ...]) -> dict[str, float]:
    """One repeat of every shape: seconds of each."""
    out = {}
    ids = [req.add(DEEP)]
    out["prefill 512"] = _timed_step(engine)  # the first chunk: no token sampled
    out["prefill 512 at 512"] = _timed_step(engine)
    out[f"decode 1 at {DEEP}"] = _decode_mean(engine)
    req.clear(ids)
    ids = [req.add(SHORT)]
    out["prefill 32"] = _timed_step(engine)
    out[f"decode 1 at {SHORT}"] = _decode_mean(engine)
    req.clear(ids)
    for prompt in deepest:  # prefilled in the warm-up round, then from the prefix cache
        ids = [req.add(prompt, max_tokens=DECODE_STEPS + 2, again=True)]
        req.first_token(ids[0])
        out[f"decode 1 at {prompt}"] = _decode_mean(engine)
        req.clear(ids)
    for batch in BATCHES:
        ids = [req.add(SHORT) for _ in range(batch)]
        engine.step()  # every prompt in one step: batch x SHORT <= CHUNK
        out[f"decode {batch} at {SHORT}"] = _decode_mean(engine, max(2, DECODE_STEPS // 2))
        req.clear(ids)
    return out


def _time_kv_dtype(engine: Any, rounds: int, kv_dtype: str) -> list[TimedStep]:
    """Decode of one sequence after a SHORT and after a DEEP prompt with a `kv_dtype` cache:
    the short ones first, then the deep one (prefilled once) in as many rounds; their
    difference is the KV term, whatever other work shares the machine meanwhile."""
    req, short = _Requests(engine), []
    for _ in range(rounds):
        ids = [req.add(SHORT)]
        engine.step()
        short.append(_decode_mean(engine))
        req.clear(ids)
    rid = req.add(DEEP, max_tokens=(rounds + 1) * (DECODE_STEPS + 1) + 2)
    engine.step()
    engine.step()
    _decode_mean(engine)  # warm-up
    deep = [_decode_mean(engine) for _ in range(rounds)]
    req.clear([rid])
    after = DECODE_STEPS / 2 + 1
    context = int(DEEP + (rounds + 1) * (DECODE_STEPS + 1) / 2 + DECODE_STEPS)
    return [TimedStep(f"decode 1 at {SHORT} {kv_dtype}", (SeqWork(1, int(SHORT + after)),),
                      *median_spread(short), kv_dtype=kv_dtype),
            TimedStep(f"decode 1 at {DEEP} {kv_dtype}", (SeqWork(1, context),),
                      *median_spread(deep), kv_dtype=kv_dtype)]
