"""`spool bench`: a serving benchmark for any OpenAI-compatible `/v1/completions` URL.

Measures what serving benchmarks measure: time to first token (first chunk with text), inter-token
latency (per request: (last chunk - first chunk) / (tokens - 1), since servers coalesce tokens into
chunks), end-to-end latency, output tokens/s and requests/s, at a fixed concurrency or a Poisson
request rate. Output tokens come from the stream's final `usage` chunk when the server sends one,
else one per chunk.

The engine mode (ops/bench/engine.py) runs the same prompts straight on the engine loop in-process,
with no API, queue or Redis, and reports the same numbers, so the cost of the queue path is a ratio.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import ssl
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from pydantic import BaseModel

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a bicycle stays upright while moving.",
    "List some ideas for a rainy weekend afternoon.",
    "Describe the water cycle to a ten-year-old.",
    "What are the main differences between a violin and a viola?",
    "Give advice to someone learning to cook for the first time.",
    "Summarize the plot of a heist movie you would like to see.",
    "Why do cats purr? Give a few possible reasons.",
]


class BenchConfig(BaseModel):
    url: str = "http://127.0.0.1:8000"
    api_key: str | None = None
    model: str = "smollm2-135m-instruct"
    requests: int = 32
    concurrency: list[int] = [1, 4, 16]
    rate: float | None = None  # requests/s (Poisson); overrides concurrency as the pacing
    max_tokens: int = 128
    ignore_eos: bool = True
    temperature: float = 0.0
    # Sent explicitly to every server so that all do the same work: llama-server's own defaults
    # (top_k 40, top_p 0.95, min_p 0.05) differ from OpenAI's (no truncation), and a reused prompt
    # cache would measure the prompts' overlap rather than the engine.
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    cache_prompt: bool = False
    # False: plain JSON responses (what batch-style clients and evaluation harnesses send); TTFT and
    # ITL are then not measured, only end-to-end latency and throughput.
    stream: bool = True
    prompt: str | None = None
    prompts_file: str | None = None
    seed: int = 0
    label: str = "spool"

    def sampling(self) -> dict[str, int | float | bool]:
        """What every server is asked to do with a prompt, by OpenAI's names (GenerationParams' too):
        the HTTP bench sends them in each body, the engine bench hands them to the engine."""
        return self.model_dump(include={"max_tokens", "temperature", "top_p", "top_k", "min_p", "cache_prompt"})

    def prompts(self) -> list[str]:
        if self.prompt:
            base = [self.prompt]
        elif self.prompts_file:
            lines = Path(self.prompts_file).read_text().splitlines()
            base = [json.loads(x)["prompt"] if x.lstrip().startswith("{") else x for x in lines if x.strip()]
        else:
            base = PROMPTS
        rnd = random.Random(self.seed)
        return [rnd.choice(base) for _ in range(self.requests)]


@dataclass
class RequestResult:
    ok: bool
    ttft: float | None = None
    itl: float | None = None
    e2e: float = 0.0
    output_tokens: int = 0
    error: str | None = None


@dataclass
class Summary:
    label: str
    mode: str
    concurrency: int | None
    rate: float | None
    requests: int
    failed: int
    duration_s: float
    output_tokens: int
    output_tok_s: float
    requests_s: float
    ttft_ms: dict[str, float] = field(default_factory=dict)
    itl_ms: dict[str, float] = field(default_factory=dict)
    e2e_ms: dict[str, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)  # the first few distinct failures, to say why


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    xs = sorted(values)

    def pick(q: float) -> float:
        return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))] * 1000

    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "mean": statistics.fmean(xs) * 1000}


def summarize(
    label: str, mode: str, cfg: BenchConfig, conc: int | None, results: list[RequestResult], duration: float
) -> Summary:
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    return Summary(
        label=label,
        mode=mode,
        concurrency=conc,
        rate=cfg.rate,
        requests=len(results),
        failed=len(results) - len(ok),
        errors=sorted({r.error or "" for r in results if not r.ok})[:5],
        duration_s=duration,
        output_tokens=tokens,
        output_tok_s=tokens / duration if duration else 0.0,
        requests_s=len(ok) / duration if duration else 0.0,
        ttft_ms=percentiles([r.ttft for r in ok if r.ttft is not None]),
        itl_ms=percentiles([r.itl for r in ok if r.itl is not None]),
        e2e_ms=percentiles([r.e2e for r in ok]),
    )


async def _one(client: httpx.AsyncClient, cfg: BenchConfig, prompt: str) -> RequestResult:
    body: dict[str, object] = {"model": cfg.model, "prompt": prompt, **cfg.sampling(), "stream": cfg.stream}
    if cfg.stream:
        body["stream_options"] = {"include_usage": True}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if not cfg.stream:
        return await _one_json(client, body)
    start = time.perf_counter()
    first = last = None
    chunks = 0
    usage_tokens = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                return RequestResult(False, error=f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return RequestResult(False, error=str(chunk["error"])[:200])
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                if any(c.get("text") for c in chunk.get("choices", [])):
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    chunks += 1
    except httpx.HTTPError as exc:
        return RequestResult(False, error=repr(exc)[:200])
    end = time.perf_counter()
    tokens = usage_tokens if usage_tokens is not None else chunks
    itl = (last - first) / (tokens - 1) if first is not None and last is not None and tokens > 1 else None
    return RequestResult(
        True, ttft=(first - start) if first is not None else None, itl=itl, e2e=end - start, output_tokens=tokens
    )


async def _one_json(client: httpx.AsyncClient, body: dict) -> RequestResult:
    start = time.perf_counter()
    try:
        resp = await client.post("/v1/completions", json=body)
    except httpx.HTTPError as exc:
        return RequestResult(False, error=repr(exc)[:200])
    end = time.perf_counter()
    if resp.status_code != 200:
        return RequestResult(False, error=f"HTTP {resp.status_code}: {resp.content[:200]!r}")
    usage = resp.json().get("usage") or {}
    return RequestResult(True, e2e=end - start, output_tokens=int(usage.get("completion_tokens", 0)))


async def run_http(cfg: BenchConfig, conc: int | None) -> tuple[list[RequestResult], float]:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=max(conc or 64, 1) + 4)
    prompts = cfg.prompts()
    # One TLS context for every client: each httpx.AsyncClient building its own (certifi's bundle) took
    # 28 ms, and 64 of them, made as the streams started, held the client's loop for ~1.8 s, inside the
    # measured time and the first requests' TTFT (the seventh round's TTFT and ratio were that).
    tls = ssl.create_default_context()
    async with httpx.AsyncClient(base_url=cfg.url, headers=headers, timeout=600, limits=limits, verify=tls) as client:
        # A client (and one connection) per stream, as separate users would have, made before the clock
        # starts: one pool shared by 64 streams made httpcore scan every connection on every request
        # and answer (quadratic), up to 12 ms of client CPU per short job, starving the server of the
        # machine's second core whenever answers came in bursts.
        own = [
            httpx.AsyncClient(
                base_url=cfg.url, headers=headers, timeout=600, limits=httpx.Limits(max_connections=1), verify=tls
            )
            for _ in range(0 if cfg.rate else conc or 1)
        ]
        # Each stream's connection open before the clock, as a user's keep-alive connection is: 64
        # connects at once (and httpx's per-connection setup) are not the request path being measured.
        async with contextlib.AsyncExitStack() as opened:
            for c in own:
                await opened.enter_async_context(c)
            await asyncio.gather(*(c.get("/v1/models") for c in own))
            return await _measured(cfg, client, own, prompts)


async def _measured(
    cfg: BenchConfig, client: httpx.AsyncClient, own: list[httpx.AsyncClient], prompts: list[str]
) -> tuple[list[RequestResult], float]:
    start = time.perf_counter()
    if cfg.rate:
        rnd = random.Random(cfg.seed)
        tasks = []
        for p in prompts:
            tasks.append(asyncio.create_task(_one(client, cfg, p)))
            await asyncio.sleep(rnd.expovariate(cfg.rate))
        results = await asyncio.gather(*tasks)
    else:
        queue: asyncio.Queue[str] = asyncio.Queue()
        for p in prompts:
            queue.put_nowait(p)
        results = []

        async def worker(mine: httpx.AsyncClient) -> None:
            while not queue.empty():
                results.append(await _one(mine, cfg, queue.get_nowait()))

        await asyncio.gather(*(worker(c) for c in own))
    return list(results), time.perf_counter() - start


def bench_http(cfg: BenchConfig) -> list[Summary]:
    out = []
    for conc in [None] if cfg.rate else cfg.concurrency:
        results, duration = asyncio.run(run_http(cfg, conc))
        out.append(summarize(cfg.label, "http", cfg, conc, results, duration))
    return out


# -- reporting --------------------------------------------------------------------------------------
def bench_engine(cfg: BenchConfig) -> list[Summary]:
    """The same prompts on the engine alone (ops/bench/engine.py), in a process of its own: the engine
    lives in workers/, which the benchmark's client side does not import."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-m", "ops.bench.engine", cfg.model_dump_json()],
        check=True,
        capture_output=True,
        text=True,
        cwd=root,
    )
    return [Summary(**d) for d in json.loads(out.stdout.strip().splitlines()[-1])]


def to_json(summaries: list[Summary]) -> list[dict]:
    return [asdict(s) for s in summaries]


def ratios(summaries: list[Summary]) -> list[dict]:
    """Each HTTP server's throughput and TTFT against the engine alone, at each concurrency."""
    engine = {s.concurrency: s for s in summaries if s.mode == "engine"}
    out = []
    for s in summaries:
        eng = engine.get(s.concurrency)
        if s.mode == "http" and eng and eng.output_tok_s:
            out.append(
                {
                    "label": s.label,
                    "concurrency": s.concurrency,
                    "throughput_ratio": s.output_tok_s / eng.output_tok_s,
                    "ttft_p50_added_ms": s.ttft_ms.get("p50", 0) - eng.ttft_ms.get("p50", 0),
                }
            )
    return out


def print_table(summaries: list[Summary]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="spool bench")
    for col in (
        "label",
        "mode",
        "conc",
        "reqs",
        "fail",
        "out tok/s",
        "req/s",
        "TTFT p50/p90/p99 ms",
        "ITL p50/p90/p99 ms",
        "E2E p50/p90/p99 ms",
    ):
        t.add_column(col, justify="right")

    def trio(d: dict[str, float]) -> str:
        return "/".join(f"{d[k]:.0f}" if d.get(k, 0) >= 10 else f"{d.get(k, 0):.1f}" for k in ("p50", "p90", "p99"))

    for s in summaries:
        conc = str(s.concurrency) if s.concurrency is not None else f"{s.rate}/s"
        t.add_row(
            s.label,
            s.mode,
            conc,
            str(s.requests),
            str(s.failed),
            f"{s.output_tok_s:.1f}",
            f"{s.requests_s:.2f}",
            trio(s.ttft_ms),
            trio(s.itl_ms),
            trio(s.e2e_ms),
        )
    console = Console(width=max(Console().width, 150))
    console.print(t)
    for r in ratios(summaries):
        console.print(
            f"concurrency {r['concurrency']}: {r['label']} = {r['throughput_ratio']:.2f} x the engine alone; "
            f"TTFT p50 +{r['ttft_p50_added_ms']:.0f} ms"
        )


def plot(summaries: list[Summary], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[Summary]] = {}
    for s in summaries:
        series.setdefault(f"{s.label} ({s.mode})", []).append(s)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name, ss in series.items():
        xs = [s.concurrency or 0 for s in ss]
        a.plot(xs, [s.output_tok_s for s in ss], marker="o", label=name)
        b.plot(xs, [s.ttft_ms.get("p50", 0) for s in ss], marker="o", label=name)
    a.set(xlabel="concurrency", ylabel="output tokens/s", title="Throughput")
    b.set(xlabel="concurrency", ylabel="ms", title="TTFT p50")
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
