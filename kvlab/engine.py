"""The engine: add_request / step / abort. The only place that joins tokenizer, scheduler,
runner and sampler.

One `core_step()` = schedule (plain Python) -> run the model on the packed batch -> sample
the sequences that reached the end of their known tokens -> CoreOutputs: token ids and the
finishes tokens decide (a decode step's tokens that end nothing as one DecodeTokens, by
column). The output processor (kvlab.output) makes them text (detokenizing,
stop strings); `step()` runs both, the server runs the processor on a thread of its own.
Not thread-safe: one thread drives it (the server runs it in a worker).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field

import torch

from kvlab import heap
from kvlab.cache import KVCacheManager
from kvlab.cache.pool_sizes import CacheBudget, PoolSizes, pool_sizes
from kvlab.cache.state_slots import StateUsage, state_usage
from kvlab.config import ModelConfig
from kvlab.cost import ModelSpec
from kvlab.errors import KvlabError, RequestError
from kvlab.kernels import set_num_threads, weight_bytes_read
from kvlab.kernels.transfer import upload
from kvlab.metrics import GenerationMetrics, RunCost
from kvlab.models.kv_store import KV_DTYPES, kv_bytes_per_element
from kvlab.models.loader import LoadedModel, LoadOptions, load_model, read_config
from kvlab.models.pooling import check_dimensions, finish, pool
from kvlab.models.sharding import SINGLE, check_split
from kvlab.output import OutputProcessor
from kvlab.request import (
    CoreOutput,
    DecodeTokens,
    FinishReason,
    RequestOutput,
    RequestTimings,
    SamplingParams,
    StepItem,
    Structure,
    TokenLogprob,
)
from kvlab.runner import ModelRunner, StepLogits
from kvlab.runner.decode_graph import GRAPH_MODES
from kvlab.runner.inflight import InFlight, StepLauncher
from kvlab.runner.ranks import LeaderRunner, Ranks, start_ranks
from kvlab.sampler import (
    SampleResult,
    SamplingBatch,
    SamplingCache,
    raw_logprobs,
    sample,
    target_probs,
)
from kvlab.scheduler import ScheduledSeq, Scheduler, SchedulerConfig, SchedulerOutput, Sequence
from kvlab.spec.draft import load_draft
from kvlab.spec.mtp import HiddenSpan, mtp_proposer
from kvlab.spec.proposer import METHODS, NgramProposer, Proposer
from kvlab.spec.stats import SpecCounts
from kvlab.spec.verify import judge
from kvlab.structured import StructuredOutputs, Template
from kvlab.tokenizer import Tokenizer, load_gguf_tokenizer, load_hf_tokenizer
from kvlab.weights.checkpoint import open_checkpoint
from kvlab.weights.default_model import default_model_path

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
EMBED_BATCH_TOKENS = 4096  # tokens of one embedding forward: bounds its activations


@dataclass(frozen=True)
class EngineConfig:
    dtype: str = "auto"  # compute dtype of dense weights; auto: float32 on CPU, bf16 on CUDA
    kv_dtype: str = "auto"  # auto: f16 on CPU (read as fp32 by the C attention), bf16 on CUDA
    block_size: int = 16
    kv_cache_gib: float = 2.0  # KV pool size; pages are only resident once used
    max_model_len: int | None = None  # default: the model's context, capped by the pool
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    # hybrid models' prefix cache: recurrent states saved every this many full blocks (and
    # at each prompt's last full block and a finished sequence's deepest one)
    state_snapshot_blocks: int = 16
    keep_quantized: bool = True
    group_rows: bool = True  # CPU: legacy and Q4_K/Q6_K as 8-row groups (kernels.group_rows)
    quantize: str | None = None
    threads: int | None = None
    device: str = "cpu"
    decode_graphs: str = "auto"  # CUDA graphs for decode steps: auto (on CUDA) | off | eager
    chat_template: str | None = None  # a Jinja chat template in place of the model's own
    # MoE models: each output carries the experts its sampled token's row was routed to
    # (RequestOutput.experts, for the visualiser); off, a step records nothing
    record_experts: bool = False
    # ranks the model is split over (kvlab.models.sharding); threads are per rank
    tensor_parallel_size: int = 1
    # speculative decoding: None (off) or a proposer (kvlab.spec: "ngram", prompt lookup),
    # and the most tokens it proposes per sequence and step
    speculative: str | None = None
    num_speculative: int = 4
    # False: always propose num_speculative tokens where the proposer finds them, instead of
    # sizing proposals from acceptance and step costs (kvlab.spec.adaptive)
    speculative_adaptive: bool = True
    draft_model: str | None = None  # speculative "draft": the model that proposes
    # schedule each decode step while the one before runs, its input ids taken from that
    # step's sampled ids on the device (kvlab.runner.inflight); steps that need the host's
    # decisions (prefill, structures, penalties, speculation) run synchronously
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        cuda = self.device.startswith("cuda")
        if self.dtype == "auto":
            object.__setattr__(self, "dtype", "bfloat16" if cuda else "float32")
        if self.kv_dtype == "auto":
            object.__setattr__(self, "kv_dtype", "bf16" if cuda else "f16")
        if self.decode_graphs not in GRAPH_MODES:
            raise KvlabError(f"decode graphs {self.decode_graphs!r} is not a mode (valid: "
                             f"{', '.join(GRAPH_MODES)})")
        if self.dtype not in DTYPES:
            raise KvlabError(f"--dtype {self.dtype!r} is not supported (valid: "
                             f"{', '.join(DTYPES)})")
        if self.kv_dtype not in KV_DTYPES:
            raise KvlabError(f"--kv-dtype {self.kv_dtype!r} is not supported (valid: "
                             f"{', '.join(KV_DTYPES)})")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise KvlabError(f"--device {self.device}: no CUDA device is available here "
                             "(valid: cpu)")
        if self.tensor_parallel_size < 1:
            raise KvlabError(f"--tensor-parallel-size {self.tensor_parallel_size}: it must be "
                             "at least 1")
        if self.speculative is not None and self.speculative not in METHODS:
            raise KvlabError(f"--speculative {self.speculative!r} is not a method (valid: "
                             f"{', '.join(METHODS)})")
        if (self.speculative == "draft") != (self.draft_model is not None):
            raise KvlabError("--draft-model goes with --speculative draft, and it needs one "
                             f"(got --speculative {self.speculative}, --draft-model "
                             f"{self.draft_model})")
        if self.speculative == "mtp" and self.tensor_parallel_size > 1:
            raise KvlabError("--speculative mtp runs on one rank: start without "
                             "--tensor-parallel-size")
        if self.num_speculative < 1:
            raise KvlabError(f"--num-speculative {self.num_speculative}: it must be at least 1")
        if self.state_snapshot_blocks < 1:
            raise KvlabError(f"state snapshots every {self.state_snapshot_blocks} blocks: it "
                             "must be at least 1")
        if self.block_size < 1 or self.kv_cache_gib <= 0 or self.max_num_seqs < 1:
            raise KvlabError("block size, KV cache size and max sequences must be positive")


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    block_size: int
    kv_bytes_per_token: int
    prefix_queries: int  # prompt tokens looked up in the prefix cache
    prefix_hits: int  # of which found
    weight_bytes_read: int = 0  # weight bytes the C kernels have read in this process
    speculative: SpecCounts = field(default_factory=SpecCounts)  # proposed / accepted tokens
    states: StateUsage | None = None  # recurrent state slots and snapshot rows; None: no state

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass(frozen=True)
class KVView:
    block_table: list[int]  # physical block ids, in position order
    num_tokens: int  # tokens whose K/V are in the cache
    num_cached_tokens: int  # of which the prefix cache served (the first blocks)
    block_size: int
    bytes_per_token: int
    state_slot: int | None = None  # its recurrent layers' state row; None: no recurrent layers


@dataclass(frozen=True)
class EngineSnapshot:
    """What an engine serves and how its KV cache is laid out; fixed once it is built."""

    model_name: str
    model: ModelConfig  # the served architecture (rank 0's shard under tensor parallel)
    spec: ModelSpec  # what a token costs, as loaded (kvlab.cost's vocabulary)
    weight_bytes: int  # the loaded weights as held in memory
    max_model_len: int
    kv_dtype: str
    block_size: int
    num_kv_blocks: int  # the paged pool's blocks
    kv_bytes_per_token: int  # stored per token, all layers
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool
    can_generate: bool = True  # False: an encoder that only embeds (kvlab.models.bert)
    pooling: str = "last"  # how embed() pools hidden states (kvlab.models.pooling)
    hidden_size: int = 0  # an embedding's width before any truncation
    num_state_slots: int = 0  # recurrent state rows, one per running sequence (0: none)
    num_snapshot_rows: int = 0  # state rows kept for prefix-cache hits
    state_bytes_per_seq: int = 0  # fp32 bytes of one sequence's state, all recurrent layers


@dataclass(eq=False)
class _Request:
    seq: Sequence
    generator: torch.Generator
    timings: RequestTimings = field(default_factory=RequestTimings)  # arrival, scheduling
    forced_tokens: int = 0  # output tokens its structure appended without sampling
    draft_tokens: int = 0  # tokens proposed for it (speculative decoding)
    accepted_tokens: int = 0  # of which the model kept
    # for _emit's plain tokens, fixed at add_request: the ids that end it (stop ids, EOS
    # unless ignored), and the token count from which a token takes _append's full path:
    # where it has ended (max_tokens, the context), or 0 where it wants logprobs
    ends: frozenset[int] = frozenset()
    limit: int = 0


@dataclass(eq=False)
class _PlainRun:
    """The columns of a DecodeTokens run that stay as they are while the same requests
    decode step after step (ids, prompt and cached counts, when scheduled, prefill time):
    kept from the last run, so a steady batch's step makes only its token and count
    columns. Only a synchronous step (a prefill, a preemption's recompute) changes them."""

    reqs: list[_Request]
    seqs: list[Sequence]
    request_ids: list[str]
    prompt_tokens: list[int]
    cached_tokens: list[int]
    scheduled: list[float | None]
    prefill_seconds: list[float]

    @classmethod
    def of(cls, reqs: list[_Request]) -> _PlainRun:
        seqs = [r.seq for r in reqs]
        times = [r.timings for r in reqs]
        return cls(reqs, seqs, [s.seq_id for s in seqs], [s.num_prompt_tokens for s in seqs],
                   [s.num_cached_tokens for s in seqs], [t.scheduled for t in times],
                   [t.prefill_seconds for t in times])

    def tokens(self, now: float) -> DecodeTokens:
        """The run's DecodeTokens: each request's last token, made at `now`."""
        seqs = self.seqs
        return DecodeTokens(
            self.request_ids, [s.token_ids[-1] for s in seqs],
            [len(s.token_ids) - p for s, p in zip(seqs, self.prompt_tokens)],
            self.prompt_tokens, self.cached_tokens, self.scheduled, self.prefill_seconds, now)


@dataclass(eq=False)
class _Verified:
    """One sequence's proposals checked against the model: the accepted ones, then the
    token drawn after them (and any its structure forced), as _append takes them."""

    req: _Request
    tokens: list[int]
    logprobs: list[TokenLogprob]
    num_accepted: int
    complete: bool  # its structure allows nothing more


class Engine:
    def __init__(self, loaded: LoadedModel, tokenizer: Tokenizer, config: EngineConfig,
                 model_name: str = "", ranks: Ranks | None = None) -> None:
        """`ranks`: the tensor-parallel group whose rank 0 this is (loaded is its shard)."""
        self.loaded, self.tokenizer, self.config = loaded, tokenizer, config
        self.model_name = model_name or loaded.config.name
        pools = self._pool_sizes(loaded.config, config)
        num_blocks = pools.num_blocks
        # a multi-token-prediction proposer also reads every step's hidden states (_feed_mtp)
        self.mtp = (mtp_proposer(loaded, config.num_speculative, config.kv_dtype, num_blocks,
                                 config.device, config.speculative_adaptive)
                    if config.speculative == "mtp" else None)
        proposer = self.mtp or self._proposer(config, loaded.config.vocab_size)
        # recurrent states take back rejected proposals from a backup row per slot
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                 pools.window, pools.state_slots, pools.snapshots,
                                 state_backups=proposer is not None)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs,
                                                   config.max_num_batched_tokens), self.kv,
                                   proposer)
        self.spec_counts = SpecCounts()
        quantized = any(t.qtype not in ("F32", "F16", "BF16") for t in loaded.tensors)
        args = {"num_blocks": num_blocks, "block_size": config.block_size,
                "kv_dtype": config.kv_dtype, "device": config.device, "quantized": quantized,
                "graphs": config.decode_graphs if ranks is None else "off",
                "max_batch": config.max_num_seqs,
                "num_window_blocks": pools.window.num_blocks if pools.window else None,
                "num_state_slots": self.kv.num_state_rows}
        self.runner = (ModelRunner(loaded.model, loaded.config, **args) if ranks is None
                       else LeaderRunner(ranks, loaded.model, loaded.config, **args))
        # an encoder keeps no KV: its context is the model's, not the pool's
        self.can_generate = loaded.config.causal
        capacity = num_blocks * config.block_size if self.can_generate else None
        self.max_model_len = min(config.max_model_len or loaded.config.max_position_embeddings,
                                 loaded.config.max_position_embeddings, capacity or 1 << 62)
        self.cost: RunCost = loaded.run_cost(kv_bytes_per_element(config.kv_dtype),
                                             window_released=pools.window is not None)
        self.requests: dict[str, _Request] = {}
        # host seconds of all steps so far, by phase (phase_seconds)
        self._phases = dict.fromkeys(("schedule", "execute", "sample"), 0.0)
        self._sampling = SamplingCache()  # the last step's sampling settings, for the next
        self.outputs = OutputProcessor(tokenizer)  # the requests' text, from core outputs
        self.structured = StructuredOutputs(tokenizer, loaded.config.vocab_size)
        self._compiling: dict[str, Future[Template]] = {}  # admitted once their grammar is
        # async scheduling: the step whose sampled ids the host has not read yet
        self._launcher = (StepLauncher(self.runner.device)
                          if config.async_scheduling and ranks is None
                          and self.kv.states is None and proposer is None
                          and not config.record_experts else None)
        self._inflight: InFlight | None = None
        self._plain: _PlainRun | None = None  # the last DecodeTokens run's kept columns
        self.runner.page_ahead(self.kv.high_water())  # a first request's pages, in the background

    @staticmethod
    def _proposer(config: EngineConfig, vocab_size: int) -> Proposer | None:
        """The speculative proposer the config asks for, if any."""
        if config.speculative == "ngram":
            return NgramProposer(config.num_speculative, config.speculative_adaptive)
        if config.speculative == "draft" and config.draft_model is not None:
            return load_draft(config.draft_model, config.num_speculative, vocab_size,
                              config.kv_dtype, config.kv_cache_gib, config.max_num_seqs,
                              config.device, DTYPES[config.dtype],
                              config.speculative_adaptive)
        return None

    @staticmethod
    def _pool_sizes(model: ModelConfig, config: EngineConfig) -> PoolSizes:
        """Blocks for the KV pools, and state slots for recurrent layers. Sliding-window
        layers get a pool of their own except where decode steps replay CUDA graphs, whose
        buffers hold one slot mapping."""
        budget = CacheBudget(kv_bytes_per_element(config.kv_dtype), config.block_size,
                             config.kv_cache_gib * 2**30, config.max_num_seqs,
                             config.max_num_batched_tokens,
                             config.max_num_seqs if config.enable_prefix_caching else 0,
                             config.state_snapshot_blocks, config.speculative is not None)
        if not model.causal:  # an encoder only embeds: one block stands for the pool
            return PoolSizes(1, None)
        graphs = config.decode_graphs == "eager" or (config.decode_graphs == "auto"
                                                     and config.device.startswith("cuda"))
        windowed = not graphs
        return pool_sizes(model, budget, windowed)

    @classmethod
    def from_model(cls, model_path: str | None = None,
                   config: EngineConfig | None = None) -> Engine:
        config = config or EngineConfig()
        if config.threads:
            torch.set_num_threads(config.threads)
            set_num_threads(config.threads)
        path = model_path or default_model_path()
        ckpt = open_checkpoint(path)
        options = LoadOptions(dtype=DTYPES[config.dtype], keep_quantized=config.keep_quantized,
                              device=config.device, quantize=config.quantize,
                              group_rows=config.group_rows, mtp=config.speculative == "mtp")
        ranks = None
        if config.tensor_parallel_size > 1:
            check_split(read_config(ckpt)[1], config.tensor_parallel_size)  # before spawning
            ranks = start_ranks(config.tensor_parallel_size, str(path), options, config.threads)
        try:
            # the tokenizer before the weights: building it takes a transient tens of MB,
            # better spent while the weights are not yet resident
            tokenizer = (load_gguf_tokenizer(ckpt.metadata) if ckpt.format == "gguf"
                         else load_hf_tokenizer(ckpt.path))
            loaded = load_model(ckpt, options, ranks.tp if ranks else SINGLE)
            ckpt.drop_vocabulary()  # the tokenizer holds its own
            ckpt.release_pages()  # what the loader left resident: metadata, skipped tensors
            heap.trim()
            if config.chat_template is not None:
                tokenizer = tokenizer.with_chat_template(config.chat_template)
            return cls(loaded, tokenizer, config, os.path.basename(str(path)), ranks)
        except BaseException:
            if ranks is not None:
                ranks.close()
            raise

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any (also done at exit)."""
        self._settle()
        if self._launcher is not None:
            self._launcher.close()
        self.runner.close()

    # ---- public API -------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams) -> list[int]:
        """Queue a request; returns its prompt token ids."""
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        if not self.can_generate:
            raise RequestError(f"{self.model_name} is an embedding model: it generates no "
                               "text; embed with it instead (Engine.embed, kvlab embed)")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._check_prompt(ids, params)
        grammar = None if params.structured is None else self.structured.prepare(
            params.structured)
        if grammar is not None and grammar.done():
            grammar.result()  # a structure that failed to compile: RequestError here
        seq = Sequence(request_id, ids, len(ids), params)
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
        gen = torch.Generator(device=self.runner.device).manual_seed(seed)
        ends = frozenset(params.stop_token_ids).union(
            () if params.ignore_eos else self.tokenizer.eos_ids)
        limit = (0 if params.logprobs is not None else
                 min(len(ids) + params.max_tokens, self.max_model_len))
        req = self.requests[request_id] = _Request(seq, gen, ends=ends, limit=limit)
        self.outputs.add(request_id, params, req.timings.arrival)
        if grammar is None:
            self.structured.start(request_id, None, params.reasoning)  # a budget alone
            self.scheduler.add(seq)
        else:  # waits here until its grammar is compiled (off this thread)
            self._compiling[request_id] = grammar
        return ids

    def prepare_structure(self, structure: Structure) -> None:
        """Compile a structure now (cached); raises RequestError if it cannot be used.

        Callers on other threads (the server's request workers) call this before
        add_request, so the engine thread only ever finds compiled grammars."""
        self.structured.compiler.compile(structure)

    def _check_prompt(self, ids: list[int], params: SamplingParams) -> None:
        if not ids:
            raise RequestError("the prompt is empty; send at least one token")
        vocab = self.loaded.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise RequestError(f"prompt token ids must be in [0, {vocab})")
        gate = params.reasoning
        if gate is not None and any(t >= vocab for t in gate.start_ids + gate.end_ids):
            raise RequestError(f"reasoning marker token ids must be in [0, {vocab})")
        outside = [t for t, _ in params.logit_bias if t >= vocab]
        if outside:
            raise RequestError(f"logit_bias token id {outside[0]} is outside the vocabulary: "
                               f"ids must be in [0, {vocab})")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise RequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = "
                f"{len(ids) + params.max_tokens} exceeds the context length "
                f"{self.max_model_len}; shorten the prompt or lower max_tokens")

    def abort(self, request_id: str) -> None:
        self.outputs.drop(request_id)
        req = self.requests.pop(request_id, None)
        if req is not None:
            self.scheduler.finish(req.seq)
            self._compiling.pop(request_id, None)
            self.structured.release(request_id)

    @property
    def phase_seconds(self) -> dict[str, float]:
        """Seconds all steps so far spent scheduling, building the runner's input tensors,
        running the model and sampling (bench/host_step.py prints them per step)."""
        inputs = self.runner.input_seconds
        return {"schedule": self._phases["schedule"], "inputs": inputs,
                "forward": self._phases["execute"] - inputs, "sample": self._phases["sample"]}

    def has_unfinished(self) -> bool:
        """Requests are running or waiting. A step still in flight for requests that have
        all ended is not one: the next core_step reads it and drops its tokens."""
        return self.scheduler.has_unfinished() or bool(self._compiling)

    def reserve_kv_memory(self, tokens: int | None = None) -> None:
        """Make the whole KV pool resident now instead of as blocks are first written; with
        `tokens`, only what a first sequence of that many tokens will write."""
        self.runner.reserve_kv(tokens)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_blocks_total=self.kv.num_blocks,
            kv_blocks_used=self.kv.num_blocks - self.kv.num_free_blocks,
            block_size=self.config.block_size, kv_bytes_per_token=self.cost.kv_bytes_per_token,
            prefix_queries=self.kv.prefix_stats.queries, prefix_hits=self.kv.prefix_stats.hits,
            weight_bytes_read=weight_bytes_read(), speculative=self.spec_counts.copy(),
            states=state_usage(self.kv.states, self.kv.snapshots))

    def kv_view(self, request_id: str) -> KVView | None:
        """Where a live request's KV cache lives: its block table and what came from the cache."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        seq = req.seq
        return KVView(block_table=self.kv.block_table(request_id),
                      num_tokens=seq.num_computed_tokens, num_cached_tokens=seq.num_cached_tokens,
                      block_size=self.config.block_size,
                      bytes_per_token=self.cost.kv_bytes_per_token,
                      state_slot=self.kv.states.slot(request_id) if self.kv.states else None)

    def snapshot(self) -> EngineSnapshot:
        """The served model and the KV layout, for front ends that describe the engine; it
        reads only what is fixed at construction, so any thread may call it."""
        c = self.config
        return EngineSnapshot(
            model_name=self.model_name, model=self.loaded.config, spec=self.cost.spec,
            weight_bytes=self.loaded.weight_bytes, max_model_len=self.max_model_len,
            kv_dtype=c.kv_dtype, block_size=c.block_size, num_kv_blocks=self.kv.num_blocks,
            kv_bytes_per_token=self.cost.kv_bytes_per_token, max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens,
            enable_prefix_caching=self.kv.enable_prefix_caching, can_generate=self.can_generate,
            pooling=self.loaded.pooling, hidden_size=self.loaded.config.hidden_size,
            num_state_slots=self.kv.states.num_slots if self.kv.states else 0,
            num_snapshot_rows=self.kv.snapshots.num_rows if self.kv.snapshots else 0,
            state_bytes_per_seq=self.loaded.config.state_bytes_per_seq())

    def embed(self, prompts: list[list[int]], normalize: bool = True,
              dimensions: int | None = None) -> torch.Tensor:
        """One vector per prompt [n, dimensions or hidden] fp32 on the CPU: the final hidden
        states pooled as the model asks (kvlab.models.pooling), truncated to `dimensions`,
        L2-normalized. Prompts run whole, a batch of up to EMBED_BATCH_TOKENS per forward,
        with no KV kept; on the engine's thread, between steps, as any engine call."""
        if self.config.tensor_parallel_size > 1:
            raise RequestError("embeddings run on one rank; start without tensor parallel")
        self._check_embed_prompts(prompts)
        check_dimensions(dimensions, self.loaded.config.hidden_size)
        self._settle()  # the runner is free only once a step in flight has finished
        vectors = []
        for batch in token_batches(prompts, EMBED_BATCH_TOKENS):
            hidden = self.runner.final_hidden(batch)
            vectors.append(pool(hidden, [len(p) for p in batch], self.loaded.pooling).cpu())
        return finish(torch.cat(vectors), dimensions, normalize)

    def _check_embed_prompts(self, prompts: list[list[int]]) -> None:
        if not prompts:
            raise RequestError("no input to embed; send at least one")
        vocab = self.loaded.config.vocab_size
        for i, ids in enumerate(prompts):
            if not ids:
                raise RequestError(f"input {i} is empty; send at least one token")
            if len(ids) > self.max_model_len:
                raise RequestError(f"input {i} has {len(ids)} tokens; the context holds "
                                   f"{self.max_model_len}")
            if any(not 0 <= t < vocab for t in ids):
                raise RequestError(f"input {i}: token ids must be in [0, {vocab})")

    def teacher_forced_logprobs(self, ids: list[int], prefill: int) -> torch.Tensor:
        """Next-token log-probs [len(ids) - prefill + 1, vocab] along a fixed sequence.

        The first `prefill` tokens run as one prefill pass, the rest one decode step each
        through the paged KV cache, as generation would; used to score a cache dtype or a
        kernel against a reference. Runs outside the scheduler: call it on an idle engine.
        """
        if self.has_unfinished():
            raise RequestError("teacher_forced_logprobs needs an idle engine")
        self._settle()
        seq_id = "teacher-forced"
        chunks = [(0, ids[:prefill])] + [(p, [ids[p]]) for p in range(prefill, len(ids))]
        rows = []
        try:
            for start, chunk in chunks:  # blocks as generation takes and releases them
                if not self.kv.allocate_slots(seq_id, start + len(chunk)):
                    raise RequestError(f"{len(ids)} tokens do not fit in the KV cache")
                rows.append(self.runner.execute(SchedulerOutput([ScheduledSeq(
                    seq_id, start, chunk, self.kv.block_table(seq_id), True, 0,
                    self.kv.window_table(seq_id), self.kv.state_slot(seq_id))])).logits[0])
                self.kv.release_out_of_window(seq_id, start + len(chunk))
        finally:
            self.kv.free(seq_id)
        return torch.log_softmax(torch.stack(rows), dim=-1)

    def metrics(self, out: RequestOutput) -> GenerationMetrics:
        """Timing summary of a finished request."""
        assert out.timings is not None
        return GenerationMetrics.from_timings(out.timings, self.cost, out.prompt_tokens,
                                              out.cached_tokens, out.output_tokens)

    # ---- one step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One core step, made text here; a request its processor ended at a stop string
        is aborted in the core at once."""
        processed = self.outputs.process(self.core_step())
        for request_id in processed.stopped:
            self.abort(request_id)
        return processed.outputs

    def core_step(self) -> list[StepItem]:
        """One step's token ids and finishes: a CoreOutput per request, or for a decode
        step's tokens that end nothing, DecodeTokens columns (_emit). With async scheduling,
        a decode step is launched here and its ids come out of the next core_step (see
        _continue)."""
        outputs = self._admit_compiled()
        if self._inflight is not None:
            return outputs + self._continue(self._inflight)
        scheduling = time.perf_counter()  # proposing (a draft model's passes) is in the step
        sched = self.scheduler.schedule()
        self._phases["schedule"] += time.perf_counter() - scheduling
        if not sched.scheduled:
            if self._compiling and not outputs:  # only compiles are pending: wait a little
                wait_futures(list(self._compiling.values()), timeout=0.005,
                             return_when="FIRST_COMPLETED")
            return outputs + self._stall_outputs()
        self.runner.page_ahead(self.kv.high_water())
        if self._overlappable(sched):
            seqs = [self.requests[s.seq_id].seq for s in sched.scheduled]
            flight = self._launch(sched, seqs, None)
            self.scheduler.update(sched, {seq.seq_id: seq for seq in seqs})
            return outputs + self._continue(flight)
        return outputs + self._run_sync(sched, scheduling)

    def _run_sync(self, sched: SchedulerOutput, scheduling: float) -> list[CoreOutput]:
        """Run a step and read its sampled ids at once (prefill, structures, proposals)."""
        outputs: list[CoreOutput] = []
        start = time.perf_counter()
        self._plain = None  # the step may change the kept columns (_account)
        step = self.runner.execute(sched, self.config.record_experts,
                                   hidden=self.mtp is not None)
        logits, checks = _split_rows(step)
        executed = time.perf_counter()
        self._phases["execute"] += executed - start
        sampled, allowed = self._sample(logits.seq_ids, logits.logits)
        self._phases["sample"] += time.perf_counter() - executed
        with torch.inference_mode():  # the rows are the runner's inference tensors
            verified = [self._verify(self.requests[seq_id], rows) for seq_id, rows in checks]
        now = time.perf_counter()
        self._account(sched, start, now)
        self._observe(sched, now - scheduling)
        for v in verified:  # rejected proposals go before their blocks could be cached
            self.scheduler.settle(v.req.seq, v.num_accepted)
        self.scheduler.update(sched, {s.seq_id: self.requests[s.seq_id].seq
                                      for s in sched.scheduled})
        if self.mtp is not None:
            self._feed_mtp(sched, step.hidden)
        counts = {} if allowed is None else {  # how many tokens each structure allowed
            row: self.structured.allowed_count(allowed, row)
            for row, seq_id in enumerate(logits.seq_ids) if self.structured.constrained(seq_id)}
        for row, seq_id in enumerate(logits.seq_ids):
            out = self._append_sampled(self.requests[seq_id], sampled, row, now)
            out.allowed_tokens = counts.get(row)
            if logits.experts is not None:
                out.experts = logits.experts[row].tolist()
            outputs.append(out)
        return outputs + [self._append_verified(v, now) for v in verified]

    # ---- async scheduling (kvlab.runner.inflight) ---------------------------------------

    def _overlappable(self, sched: SchedulerOutput) -> bool:
        """A step whose sampled ids the host may read later: one-token decode rows only,
        none constrained by a structure or penalized by the tokens it has produced."""
        if self._launcher is None or sched.num_tokens != len(sched.scheduled):
            return False
        requests, structured = self.requests, self.structured
        for s in sched.scheduled:
            p = requests[s.seq_id].seq.params
            if (not s.needs_logits or structured.constrained(s.seq_id)
                    or p.repetition_penalty != 1.0 or p.presence_penalty
                    or p.frequency_penalty):
                return False
        return True

    def _continue(self, flight: InFlight) -> list[StepItem]:
        """With `flight` launched: schedule the step after it, launch that one on the ids
        `flight` sampled (on the device), then read flight's ids and emit them."""
        scheduling = time.perf_counter()
        ahead = (self.scheduler.schedule_ahead(flight.sched, self.max_model_len)
                 if not self._compiling else None)
        self._inflight = None
        if ahead is not None:  # flight's sequences, in order, less those that end with it
            seqs = (flight.seqs if len(ahead.scheduled) == len(flight.seqs) else
                    [self.requests[s.seq_id].seq for s in ahead.scheduled])
            self._phases["schedule"] += time.perf_counter() - scheduling
            self.runner.page_ahead(self.kv.high_water())
            self._inflight = self._launch(ahead, seqs, flight)
            self.scheduler.update_ahead(ahead, seqs)
        else:
            flight.wait()
        return self._emit(flight)

    def _launch(self, sched: SchedulerOutput, seqs: list[Sequence],
                after: InFlight | None) -> InFlight:
        """Start a decode step; its input ids are `after`'s sampled ones where given."""
        assert self._launcher is not None
        batch = self._sampling_batch(seqs, None)
        ids = None
        if after is not None:
            sampled = after.sampled().token_ids  # waits for `after` to have sampled
            if after.seqs != seqs:  # some sequences left: each one's row of `after`
                rows = {seq.seq_id: i for i, seq in enumerate(after.seqs)}
                index = [rows[seq.seq_id] for seq in seqs]
                sampled = sampled[upload(torch.tensor(index), sampled.device)]
            ids = sampled

        def run() -> SampleResult:
            start = time.perf_counter()
            step = self.runner.execute(sched, input_ids=ids)
            executed = time.perf_counter()
            self._phases["execute"] += executed - start
            result = sample(step.logits, batch)
            self._phases["sample"] += time.perf_counter() - executed
            return result

        return self._launcher.launch(sched, seqs, run, batch.want_logprobs)

    def _emit(self, flight: InFlight) -> list[StepItem]:
        """A launched step's tokens, appended now; sequences that finished or were aborted
        since it was launched are left out (their token is never shown nor counted). The
        tokens that end nothing go out as DecodeTokens, a run of them between the outputs of
        rows that take _append's full path (a finish, logprobs), in row order."""
        tokens = flight.token_list()
        now = time.perf_counter()
        if flight.sched.follows is None:  # not the last step's batch one position on
            self._plain = None
        items: list[StepItem] = []
        plain: list[_Request] = []  # the current run of rows whose token ends nothing
        get = self.requests.get
        for row, seq in enumerate(flight.seqs):
            req = get(seq.seq_id)
            if req is None or req.seq is not seq:
                continue
            token, ids = tokens[row], seq.token_ids
            if token in req.ends or len(ids) + 1 >= req.limit:
                if plain:
                    items.append(self._decode_tokens(plain, now))
                    plain = []
                logprobs = ([self._logprob(flight.host(), row, token)]
                            if seq.params.logprobs is not None else [])
                items.append(self._append(req, [token], logprobs, now, complete=False))
                continue
            ids.append(token)  # what _append does where the token ends nothing
            plain.append(req)
        if plain:
            items.append(self._decode_tokens(plain, now))
        return items

    def _decode_tokens(self, reqs: list[_Request], now: float) -> DecodeTokens:
        """The columns of requests whose last token, made at `now`, ended nothing (as _output
        would make each one's CoreOutput); the last run's kept ones where it had the same
        requests (the lists compare by identity first, in C: no Python work per request)."""
        if self._plain is None or self._plain.reqs != reqs:
            self._plain = _PlainRun.of(reqs)
        return self._plain.tokens(now)

    def _settle(self) -> None:
        """Wait for a step in flight to finish (its ids are still emitted by core_step)."""
        if self._inflight is not None:
            self._inflight.wait()

    def _feed_mtp(self, sched: SchedulerOutput, hidden: torch.Tensor) -> None:
        """Hand the MTP proposer each sequence's hidden states of the tokens it kept (its
        rejected proposals' rows left out)."""
        spans, row = [], 0
        for s in sched.scheduled:
            seq = self.requests[s.seq_id].seq
            kept = s.token_ids[:seq.num_computed_tokens - s.start]
            if seq.draft is not None:
                spans.append(HiddenSpan(seq.draft, s.start, kept, row))
            row += len(s.token_ids)
        self.mtp.observe(spans, hidden)

    def _observe(self, sched: SchedulerOutput, seconds: float) -> None:
        """A decode step's time, for the proposer's cost fit (prefill steps do not say what
        a proposed token costs)."""
        proposer = self.scheduler.proposer
        if proposer is not None and not any(s.prefill_tokens for s in sched.scheduled):
            multi = any(len(s.token_ids) > 1 for s in sched.scheduled)
            proposer.observe_step(sched.num_tokens, multi, seconds)

    def _verify(self, req: _Request, rows: torch.Tensor) -> _Verified:
        """Check a sequence's proposals against its logits rows [1 + proposed, vocab]
        (kvlab.spec.verify); a structure's mask follows each accepted token, so a proposal
        it forbids has probability 0 and ends the run."""
        seq = req.seq
        drafts = seq.token_ids[seq.num_tokens - seq.num_draft_tokens:]
        base = seq.num_tokens - len(drafts)  # tokens before the first proposal
        constrained = self.structured.constrained(seq.seq_id)
        batch = self._verify_batch(req, drafts, range(len(drafts) + 1))
        probs = None if constrained else target_probs(rows, batch)
        tokens: list[int] = []
        forced, complete, kept = [], False, False
        for i in range(len(drafts) + 1):
            p = (probs[i] if probs is not None else
                 self._masked_probs(req, rows[i:i + 1], drafts[:i]))
            proposed = drafts[i] if i < len(drafts) else None
            token, kept = judge(p, proposed, seq.params.greedy, req.generator)
            tokens.append(token)
            if constrained:
                forced, complete = self._follow_structure(req, token, base + i)
            if not kept or forced or complete:
                break
        accepted = len(tokens) - (not kept)
        req.draft_tokens += len(drafts)
        req.accepted_tokens += accepted
        self.spec_counts.record(len(drafts), accepted)
        req.forced_tokens += len(forced)
        logprobs = self._verified_logprobs(req, rows, tokens, batch)
        if seq.params.logprobs is not None:
            logprobs += [TokenLogprob(t, 0.0, [(t, 0.0)]) for t in forced]
        return _Verified(req, tokens + forced, logprobs, accepted, complete)

    def _verify_batch(self, req: _Request, drafts: list[int], rows: range,
                      allowed: torch.Tensor | None = None) -> SamplingBatch:
        """Sampling settings of a sequence's verify rows: row i follows its first i
        proposals, which its penalties count as output."""
        seq, p = req.seq, req.seq.params
        out = seq.token_ids[seq.num_prompt_tokens:seq.num_tokens - seq.num_draft_tokens]
        counted = p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty
        outputs = [out + drafts[:i] if counted else [] for i in rows]
        n = len(outputs)
        return SamplingBatch.build([p] * n, [_penalty_ids(seq, prompt=True)] * n, outputs,
                                   [req.generator] * n, self.runner.device, allowed=allowed)

    def _masked_probs(self, req: _Request, row: torch.Tensor, drafts: list[int]
                      ) -> torch.Tensor:
        """Target probs [vocab] of one verify row under the structure's mask as it stands."""
        seq = req.seq
        allowed = self.structured.bitmask([seq.seq_id], [seq.params.ignore_eos])
        i = len(drafts)
        return target_probs(row, self._verify_batch(req, drafts, range(i, i + 1), allowed))[0]

    def _verified_logprobs(self, req: _Request, rows: torch.Tensor, tokens: list[int],
                           batch: SamplingBatch) -> list[TokenLogprob]:
        if req.seq.params.logprobs is None:
            return []
        ids = torch.tensor(tokens, dtype=torch.long, device=rows.device)
        result = raw_logprobs(rows[:len(tokens)].float(), ids, batch)
        return [self._logprob(result, i, t) for i, t in enumerate(tokens)]

    def _append_verified(self, v: _Verified, now: float) -> CoreOutput:
        """Emit a verify run's tokens: the accepted proposals are taken out and appended
        again by _append, which cuts the run at EOS, a stop token or max_tokens."""
        seq = v.req.seq
        del seq.token_ids[len(seq.token_ids) - v.num_accepted:]
        return self._append(v.req, v.tokens, v.logprobs, now, v.complete)

    def _admit_compiled(self) -> list[CoreOutput]:
        """Requests whose grammar finished compiling join the scheduler's queue."""
        failed = []
        for seq_id, grammar in list(self._compiling.items()):
            if not grammar.done():
                continue
            del self._compiling[seq_id]
            req = self.requests[seq_id]
            if grammar.exception() is not None:  # only if the caller did not prepare it
                failed.append(self._finish(req, FinishReason.ABORT))
                continue
            self.structured.start(seq_id, grammar.result(), req.seq.params.reasoning)
            self.scheduler.add(req.seq)
        return failed

    def _stall_outputs(self) -> list[CoreOutput]:
        """Nothing fits in the KV pool even alone: fail the oldest waiting request."""
        if not self.scheduler.waiting or self.scheduler.running:
            return []
        req = self.requests[self.scheduler.waiting[0].seq_id]
        return [self._finish(req, FinishReason.LENGTH)]

    def _sample(self, seq_ids: list[str], logits: torch.Tensor
                ) -> tuple[SampleResult | None, torch.Tensor | None]:
        """The sampled tokens, and the structures' bitmask they were drawn under (or None)."""
        if not seq_ids:
            return None, None
        seqs = [self.requests[i].seq for i in seq_ids]
        allowed = self.structured.bitmask(seq_ids, [s.params.ignore_eos for s in seqs])
        return sample(logits, self._sampling_batch(seqs, allowed)), allowed

    def _sampling_batch(self, seqs: list[Sequence], allowed: torch.Tensor | None
                        ) -> SamplingBatch:
        requests = self.requests
        return self._sampling.get(
            seqs, lambda s: (s.params, requests[s.seq_id].generator),
            lambda: SamplingBatch.build(
                [s.params for s in seqs], [_penalty_ids(s, prompt=True) for s in seqs],
                [_penalty_ids(s, prompt=False) for s in seqs],
                [requests[s.seq_id].generator for s in seqs], self.runner.device),
            self.runner.device, allowed)

    def _account(self, sched: SchedulerOutput, start: float, now: float) -> None:
        for s in sched.scheduled:
            t = self.requests[s.seq_id].timings
            if t.scheduled is None:
                t.scheduled = start
            if s.prefill_tokens:
                t.prefill_seconds += now - start

    def _append_sampled(self, req: _Request, sampled: SampleResult, row: int,
                        now: float) -> CoreOutput:
        token = sampled.token_list[row]
        want = req.seq.params.logprobs is not None
        logprobs = [self._logprob(sampled, row, token)] if want else []
        if not self.structured.constrained(req.seq.seq_id):
            return self._append(req, [token], logprobs, now, complete=False)
        forced, complete = self._follow_structure(req, token)
        req.forced_tokens += len(forced)
        logprobs += [TokenLogprob(t, 0.0, [(t, 0.0)]) for t in forced] if want else []
        return self._append(req, [token, *forced], logprobs, now, complete)

    def _follow_structure(self, req: _Request, token: int,
                          num_tokens: int | None = None) -> tuple[list[int], bool]:
        """(forced tokens that follow `token`, whether the structure is now complete);
        num_tokens: the sequence's length before `token` (default: as it stands)."""
        seq_id, seq = req.seq.seq_id, req.seq
        if token in self.tokenizer.eos_ids or not self.structured.accept(seq_id, token):
            return [], True  # EOS is only allowed where the structure is complete
        if self.structured.finished(seq_id):
            return [], True
        before = seq.num_tokens if num_tokens is None else num_tokens
        n_out = before + 1 - seq.num_prompt_tokens
        room = min(seq.params.max_tokens - n_out, self.max_model_len - before - 1)
        forced = self.structured.forced(seq_id, room)
        return forced, self.structured.finished(seq_id)

    def _append(self, req: _Request, tokens: list[int], logprobs: list[TokenLogprob],
                now: float, complete: bool) -> CoreOutput:
        """Append tokens (one sampled, then any forced), stopping where a token ends the
        request: EOS or a stop token id, max_tokens, the context; stop strings are the
        output processor's."""
        seq, params = req.seq, req.seq.params
        for i, token in enumerate(tokens):
            seq.token_ids.append(token)
            done = tokens[:i + 1], logprobs[:i + 1], now
            if token in params.stop_token_ids or (
                    not params.ignore_eos and token in self.tokenizer.eos_ids):
                return self._finish(req, FinishReason.STOP, *done, stop_token=True)
            n_out = len(seq.token_ids) - seq.num_prompt_tokens
            if n_out >= params.max_tokens or seq.num_tokens >= self.max_model_len:
                return self._finish(req, FinishReason.LENGTH, *done)
        if complete:  # the structure allows nothing more: end as EOS would
            return self._finish(req, FinishReason.STOP, tokens, logprobs, now)
        return self._output(req, tokens, None, logprobs, now)

    def _logprob(self, sampled: SampleResult, row: int, token: int) -> TokenLogprob:
        top = list(zip(sampled.top_ids[row].tolist(), sampled.top_logprobs[row].tolist()))
        return TokenLogprob(token, float(sampled.logprobs[row]), top)

    def _finish(self, req: _Request, reason: FinishReason, tokens: list[int] | None = None,
                logprobs: list[TokenLogprob] | None = None, now: float | None = None,
                stop_token: bool = False) -> CoreOutput:
        self.scheduler.finish(req.seq)
        self.requests.pop(req.seq.seq_id, None)
        self.structured.release(req.seq.seq_id)
        return self._output(req, tokens or [], reason, logprobs or [],
                            time.perf_counter() if now is None else now, stop_token)

    def _output(self, req: _Request, tokens: list[int], reason: FinishReason | None,
                logprobs: list[TokenLogprob], now: float, stop_token: bool = False
                ) -> CoreOutput:
        seq, t = req.seq, req.timings
        return CoreOutput(
            request_id=seq.seq_id, new_token_ids=tokens, finish_reason=reason,
            prompt_tokens=seq.num_prompt_tokens, cached_tokens=seq.num_cached_tokens,
            output_tokens=seq.num_tokens - seq.num_prompt_tokens, step_time=now,
            logprobs=logprobs, stop_token=stop_token, scheduled=t.scheduled,
            prefill_seconds=t.prefill_seconds, forced_tokens=req.forced_tokens,
            draft_tokens=req.draft_tokens, accepted_tokens=req.accepted_tokens)


def token_batches(prompts: list[list[int]], limit: int) -> list[list[list[int]]]:
    """Consecutive prompts grouped so that each group holds at most `limit` tokens (a
    longer prompt goes alone)."""
    batches: list[list[list[int]]] = [[]]
    size = 0
    for p in prompts:
        if batches[-1] and size + len(p) > limit:
            batches.append([])
            size = 0
        batches[-1].append(p)
        size += len(p)
    return batches


def _split_rows(logits: StepLogits) -> tuple[StepLogits, list[tuple[str, torch.Tensor]]]:
    """A step's logits as the one-row sequences' (sampled as before) and each verifying
    sequence's rows [1 + proposed, vocab]."""
    if logits.counts is None:
        return logits, []
    plain, plain_ids, checks, row = [], [], [], 0
    for seq_id, n in zip(logits.seq_ids, logits.counts):
        if n == 1:
            plain.append(row)
            plain_ids.append(seq_id)
        else:
            checks.append((seq_id, logits.logits[row:row + n]))
        row += n
    index = torch.tensor(plain, dtype=torch.long, device=logits.logits.device)
    experts = None if logits.experts is None else logits.experts[index.cpu()]
    return StepLogits(plain_ids, logits.logits.index_select(0, index), experts), checks


def _penalty_ids(seq: Sequence, prompt: bool) -> list[int]:
    """The token ids a row's penalties look at; none (no copy) when it has no penalty."""
    p = seq.params
    if prompt:
        return seq.token_ids[:seq.num_prompt_tokens] if p.repetition_penalty != 1.0 else []
    if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
        return seq.output_ids
    return []
