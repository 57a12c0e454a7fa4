"""Load test any OpenAI-compatible server (kvlab serve, vLLM, llama.cpp's llama-server).

Streaming requests are sent with a bounded concurrency (closed loop) or at a Poisson rate
(open loop, optionally capped), and each one is timed on the client, with vLLM's
definitions (benchmarks/serve):

    TTFT   send -> first chunk that carries text
    TPOT   (E2E - TTFT) / (output tokens - 1): the mean decode time per token of a request
    ITL    gaps between successive text chunks, pooled over all requests
    E2E    send -> last chunk
    goodput  requests per second that met every SLO (--slo ttft:MS, tpot:MS, e2el:MS)

Output tokens come from the server's usage (stream_options.include_usage); a server that
does not report usage has its text chunks counted instead. Unlike vLLM's client, a chat
stream's opening role-only chunk does not count as the first token.

With a JSON schema every request carries OpenAI's response_format (kvlab serve, vLLM and
llama-server all read it); the report then counts the replies that parse and follow the
schema, and gives the share of output tokens the server forced (appended without sampling),
from kvlab's usage.completion_tokens_details.forced_tokens.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvlab.errors import KvlabError

SLO_KEYS = ("ttft", "tpot", "e2el")
PERCENTILES = (("mean", None), ("p50", 0.5), ("p90", 0.9), ("p99", 0.99))

_TOPICS = ("a lighthouse keeper", "the history of tea", "how a CPU cache works",
           "a city under the sea", "training for a marathon", "the water cycle",
           "a robot learning to paint", "why the sky is blue", "a detective in Venice",
           "compound interest", "the first day of school", "how vaccines work",
           "a dragon who hates gold", "the rules of chess", "a journey on the Silk Road",
           "how to bake bread")
_TASKS = ("Write a short story about {}.", "Explain {} to a ten-year-old.",
          "Write a poem about {}.", "List five surprising facts about {}.")


@dataclass(frozen=True)
class Prompt:
    text: str | None = None  # for /v1/completions
    messages: list[dict[str, Any]] | None = None  # for /v1/chat/completions
    max_tokens: int | None = None

    def as_messages(self) -> list[dict[str, Any]]:
        return self.messages or [{"role": "user", "content": self.text or ""}]

    def as_text(self) -> str:
        if self.text is not None:
            return self.text
        return "\n".join(str(m.get("content", "")) for m in self.messages or [])


@dataclass(frozen=True)
class LoadConfig:
    url: str  # the server's base URL, with or without /v1
    model: str | None = None
    endpoint: str = "chat"  # chat | completions
    concurrency: int | None = None  # most requests in flight (None: unbounded with a rate)
    rate: float | None = None  # Poisson arrivals per second (None: as fast as allowed)
    num_requests: int = 32
    max_tokens: int = 128
    temperature: float = 0.0
    ignore_eos: bool = False
    seed: int = 0
    timeout: float = 600.0
    api_key: str | None = None
    json_schema: dict[str, Any] | None = None  # sent as response_format when given


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    text: str = ""  # the reply, as streamed
    forced_tokens: int | None = None  # of output_tokens; None when the server does not say
    cached_tokens: int = 0  # of prompt_tokens, served by the server's prefix cache

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def builtin_prompts() -> list[Prompt]:
    """Sixty-four short instructions of a few dozen tokens each."""
    return [Prompt(text=task.format(topic)) for task in _TASKS for topic in _TOPICS]


def load_prompts(path: str | Path) -> list[Prompt]:
    """JSONL: one object a line with "prompt" (text) or "messages", optional "max_tokens"."""
    prompts = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompts.append(Prompt(row.get("prompt"), row.get("messages"), row.get("max_tokens")))
        except (json.JSONDecodeError, AttributeError) as e:
            raise KvlabError(f"{path}:{n}: not a JSON object ({e})") from None
        if prompts[-1].text is None and not prompts[-1].messages:
            raise KvlabError(f"{path}:{n}: needs a \"prompt\" string or a \"messages\" list")
    if not prompts:
        raise KvlabError(f"{path} holds no prompts")
    return prompts


def load_schema(path: str | Path) -> dict[str, Any]:
    """A JSON schema file (an object at the top)."""
    try:
        schema = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise KvlabError(f"--json-schema {path}: cannot be read ({e.strerror or e})") from None
    except ValueError as e:
        raise KvlabError(f"--json-schema {path}: not JSON ({e})") from None
    if not isinstance(schema, dict):
        raise KvlabError(f"--json-schema {path}: a schema is a JSON object, "
                         f"got {type(schema).__name__}")
    return schema


def api_base(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


# ---- one request ----------------------------------------------------------------------------

def request_body(cfg: LoadConfig, prompt: Prompt, model: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "stream": True, "temperature": cfg.temperature,
                            "max_tokens": prompt.max_tokens or cfg.max_tokens,
                            "stream_options": {"include_usage": True}}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.json_schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "reply", "schema": cfg.json_schema}}
    if cfg.endpoint == "chat":
        body["messages"] = prompt.as_messages()
    else:
        body["prompt"] = prompt.as_text()
    return body


def chunk_text(chunk: dict[str, Any]) -> str:
    """The text a stream chunk carries (completions: text; chat: delta.content)."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    first = choices[0]
    return first.get("text") or (first.get("delta") or {}).get("content") or ""


async def send(client: httpx.AsyncClient, cfg: LoadConfig, prompt: Prompt,
               model: str) -> RequestResult:
    """One streaming request, timed from just before it is sent."""
    path = "/chat/completions" if cfg.endpoint == "chat" else "/completions"
    result = RequestResult(ok=False)
    start = time.perf_counter()
    try:
        async with client.stream("POST", api_base(cfg.url) + path,
                                 json=request_body(cfg, prompt, model)) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return result
            await _read_stream(resp, result, start)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def _read_stream(resp: httpx.Response, result: RequestResult, start: float) -> None:
    """Fill result from the server-sent events: text chunk times, usage, an error event."""
    last, parts = start, []
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            result.error = str(chunk["error"])[:200]
            return
        now = time.perf_counter()
        if text := chunk_text(chunk):
            if not parts:
                result.ttft = now - start
            else:
                result.itl.append(now - last)
            parts.append(text)
            last = now
        _read_usage(result, chunk.get("usage") or {})
    result.latency = last - start
    result.output_tokens = result.output_tokens or len(parts)
    result.text = "".join(parts)
    result.ok = bool(parts)
    result.error = "" if result.ok else "the stream carried no text"


def _read_usage(result: RequestResult, usage: dict[str, Any]) -> None:
    result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
    result.output_tokens = usage.get("completion_tokens", result.output_tokens)
    details = usage.get("prompt_tokens_details") or {}
    result.cached_tokens = details.get("cached_tokens") or result.cached_tokens
    forced = (usage.get("completion_tokens_details") or {}).get("forced_tokens")
    if forced is not None:
        result.forced_tokens = forced


# ---- a run ----------------------------------------------------------------------------------

async def resolve_model(client: httpx.AsyncClient, cfg: LoadConfig) -> str:
    if cfg.model:
        return cfg.model
    try:
        resp = await client.get(api_base(cfg.url) + "/models")
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise KvlabError(f"could not list the models at {cfg.url} ({e}); pass --model") from e


async def _arrivals(cfg: LoadConfig) -> Any:
    """Yield request indices at Poisson times (rate) or at once (closed loop)."""
    rng = random.Random(cfg.seed)
    for i in range(cfg.num_requests):
        yield i
        if cfg.rate:
            await asyncio.sleep(rng.expovariate(cfg.rate))


async def run_load(cfg: LoadConfig, prompts: list[Prompt],
                   warmup: int = 1) -> tuple[list[RequestResult], float, str]:
    """All requests of one run: (results, wall seconds, model name)."""
    limit = cfg.concurrency or (None if cfg.rate else 1)
    gate = asyncio.Semaphore(limit) if limit else None
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=limit or 1000, max_keepalive_connections=limit or 100)
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout, connect=10.0),
                                 limits=limits, headers=headers) as client:
        model = await resolve_model(client, cfg)
        for i in range(warmup):
            await send(client, cfg, prompts[i % len(prompts)], model)

        async def one(i: int) -> RequestResult:
            if gate is None:
                return await send(client, cfg, prompts[i % len(prompts)], model)
            async with gate:
                return await send(client, cfg, prompts[i % len(prompts)], model)

        start = time.perf_counter()
        tasks = [asyncio.create_task(one(i)) async for i in _arrivals(cfg)]
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start, model


# ---- the report -----------------------------------------------------------------------------

def _percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def distribution_ms(values: list[float]) -> dict[str, float]:
    """mean, p50, p90, p99 of seconds, in milliseconds (zeros when there are none)."""
    if not values:
        return {name: 0.0 for name, _ in PERCENTILES}
    return {name: 1e3 * (sum(values) / len(values) if q is None else _percentile(values, q))
            for name, q in PERCENTILES}


def parse_slos(specs: list[str]) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos = {}
    for spec in specs:
        key, _, value = spec.partition(":")
        try:
            slos[key] = float(value)
        except ValueError:
            raise KvlabError(f"--slo {spec!r}: expected KEY:MILLISECONDS") from None
        if key not in SLO_KEYS or slos[key] <= 0:
            raise KvlabError(f"--slo {spec!r}: key must be one of {', '.join(SLO_KEYS)} "
                             "and the bound positive")
    return slos


def meets(r: RequestResult, slos: dict[str, float]) -> bool:
    got = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.latency}
    return all(1e3 * got[key] <= bound for key, bound in slos.items())


@dataclass
class Summary:
    url: str
    model: str
    endpoint: str
    concurrency: int | None
    rate: float | None
    num_requests: int
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tok/s
    total_token_throughput: float  # (input + output) tok/s
    goodput: float | None  # requests meeting every SLO / s
    slo_ms: dict[str, float]
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2el_ms: dict[str, float]
    errors: list[str]
    total_cached_tokens: int = 0  # of total_input_tokens, served by the server's prefix cache
    forced_share: float | None = None  # forced / output tokens, where the server reports it
    valid: int | None = None  # completed replies that passed valid_check (with a schema)
    valid_check: str = ""  # "JSON schema" (jsonschema validated) or "JSON parse"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(cfg: LoadConfig, model: str, results: list[RequestResult], duration: float,
              slos: dict[str, float]) -> Summary:
    ok = [r for r in results if r.ok]
    n_in = sum(r.prompt_tokens for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    per_s = 1.0 / duration if duration > 0 else 0.0
    return Summary(
        url=cfg.url, model=model, endpoint=cfg.endpoint, concurrency=cfg.concurrency,
        rate=cfg.rate, num_requests=len(results), completed=len(ok),
        failed=len(results) - len(ok), duration_s=duration, total_input_tokens=n_in,
        total_output_tokens=n_out, request_throughput=len(ok) * per_s,
        output_throughput=n_out * per_s, total_token_throughput=(n_in + n_out) * per_s,
        goodput=sum(meets(r, slos) for r in ok) * per_s if slos else None, slo_ms=slos,
        ttft_ms=distribution_ms([r.ttft for r in ok]),
        tpot_ms=distribution_ms([r.tpot for r in ok if r.tpot is not None]),
        itl_ms=distribution_ms([gap for r in ok for gap in r.itl]),
        e2el_ms=distribution_ms([r.latency for r in ok]),
        errors=sorted({r.error for r in results if not r.ok})[:5],
        total_cached_tokens=sum(r.cached_tokens for r in ok),
        forced_share=forced_share(ok), **validity(ok, cfg.json_schema))


def forced_share(results: list[RequestResult]) -> float | None:
    """Forced / output tokens over the replies whose server reported forced tokens."""
    reported = [r for r in results if r.forced_tokens is not None]
    if not reported:
        return None
    total = sum(r.output_tokens for r in reported)
    return sum(r.forced_tokens or 0 for r in reported) / total if total else 0.0


def validity(results: list[RequestResult], schema: dict[str, Any] | None) -> dict[str, Any]:
    """How many replies parse as JSON and, where jsonschema imports, follow the schema."""
    if schema is None:
        return {}
    follows = schema_validator(schema)
    return {"valid": sum(is_valid_json(r.text, follows) for r in results),
            "valid_check": "JSON parse" if follows is None else "JSON schema"}


def schema_validator(schema: dict[str, Any]) -> Callable[[Any], bool] | None:
    """The schema's check of a JSON value, or None where the jsonschema package is missing."""
    try:
        import jsonschema
    except ImportError:
        return None
    return jsonschema.validators.validator_for(schema)(schema).is_valid


def is_valid_json(text: str, follows: Callable[[Any], bool] | None = None) -> bool:
    """Whether text parses as JSON and, given a check, passes it."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return follows is None or bool(follows(value))


def format_summary(s: Summary) -> str:
    load = (f"concurrency {s.concurrency or 'unbounded'}"
            + (f", rate {s.rate:g} req/s" if s.rate else ""))
    lines = [
        f"{'=' * 22} kvlab loadtest {'=' * 22}",
        f"server       {s.url}  ({s.endpoint}, {s.model})",
        f"load         {load}",
        f"requests     {s.completed} completed, {s.failed} failed in {s.duration_s:.2f} s",
        (f"tokens       {s.total_input_tokens} in ({s.total_cached_tokens} from the prefix "
         f"cache), {s.total_output_tokens} out"),
        (f"throughput   {s.request_throughput:.2f} req/s   "
         f"{s.output_throughput:.1f} output tok/s   {s.total_token_throughput:.1f} total tok/s"),
    ]
    if s.goodput is not None:
        slo = ", ".join(f"{k}<={v:g}ms" for k, v in s.slo_ms.items())
        lines.append(f"goodput      {s.goodput:.2f} req/s  ({slo})")
    if s.forced_share is not None or s.valid is not None:
        lines.append("structured   " + structured_figures(s))
    lines.append(f"{'':14}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for label, dist in (("TTFT (ms)", s.ttft_ms), ("TPOT (ms)", s.tpot_ms),
                        ("ITL (ms)", s.itl_ms), ("E2E (ms)", s.e2el_ms)):
        lines.append(f"{label:14}" + "".join(f"{dist[k]:10.1f}" for k, _ in PERCENTILES))
    lines += [f"error        {e}" for e in s.errors]
    return "\n".join(lines)


def structured_figures(s: Summary) -> str:
    """'forced 41.2% of output tokens   valid: 16/16 (JSON schema)', the parts known."""
    parts = []
    if s.forced_share is not None:
        parts.append(f"forced {100 * s.forced_share:.1f}% of output tokens")
    if s.valid is not None:
        parts.append(f"valid: {s.valid}/{s.completed} ({s.valid_check})")
    return "   ".join(parts)


def format_sweep(runs: list[Summary]) -> str:
    head = (f"{'conc':>5} {'req/s':>7} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} "
            f"{'TPOT p50':>9} {'ITL p50':>8} {'E2E p50':>9} {'failed':>6}")
    rows = [f"{s.concurrency or 0:>5} {s.request_throughput:>7.2f} {s.output_throughput:>10.1f} "
            f"{s.ttft_ms['p50']:>9.1f} {s.ttft_ms['p99']:>9.1f} {s.tpot_ms['p50']:>9.1f} "
            f"{s.itl_ms['p50']:>8.1f} {s.e2el_ms['p50']:>9.1f} {s.failed:>6}" for s in runs]
    return "\n".join([head, *rows, "(latencies in ms)"])


def plot_sweep(runs: list[Summary], path: str | Path) -> None:
    """Throughput and latency against concurrency, side by side (PNG, matplotlib Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [s.concurrency or 0 for s in runs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(x, [s.output_throughput for s in runs], "o-", label="output tok/s")
    left.plot(x, [s.total_token_throughput for s in runs], "s--", label="total tok/s")
    left.set(xlabel="concurrency", ylabel="tokens / s", title="Throughput")
    for label, key, q in (("TTFT p50", "ttft_ms", "p50"), ("TPOT p50", "tpot_ms", "p50"),
                          ("ITL p99", "itl_ms", "p99"), ("E2E p50", "e2el_ms", "p50")):
        right.plot(x, [getattr(s, key)[q] for s in runs], "o-", label=label)
    right.set(xlabel="concurrency", ylabel="ms", title="Latency", yscale="log")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(v) for v in x])
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"{runs[0].model} at {runs[0].url}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
