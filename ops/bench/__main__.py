"""`spool bench` (core/cli runs `python -m ops.bench` with its arguments): a serving benchmark of any
OpenAI-compatible URL, and of the engine alone, in one report (ops/bench/client.py)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from ops.bench import client as b

app = typer.Typer(add_completion=False)


@app.command()
def bench(
    url: str = typer.Option("http://127.0.0.1:8000", help="Base URL of any OpenAI-compatible server."),
    api_key: str | None = typer.Option(None, envvar="SPOOL_API_KEY", help="Bearer key (or SPOOL_API_KEY)."),
    model: str = typer.Option("smollm2-135m-instruct"),
    mode: str = typer.Option("http", help="http, engine (in-process, no queue), or http,engine for the ratio."),
    concurrency: str = typer.Option("1,4,16", help="Comma-separated concurrency levels."),
    rate: float | None = typer.Option(None, help="Poisson request rate (req/s) instead of fixed concurrency."),
    requests: int = typer.Option(32, help="Requests per level."),
    max_tokens: int = typer.Option(128),
    ignore_eos: bool = typer.Option(True, help="Generate exactly max_tokens (fair across servers)."),
    temperature: float = typer.Option(0.0),
    stream: bool = typer.Option(True, help="Stream (SSE); --no-stream sends plain JSON requests (no TTFT/ITL)."),
    prompt: str | None = typer.Option(None, help="One fixed prompt (default: sampled from built-in prompts)."),
    prompts_file: str | None = typer.Option(None, help="Prompts, one per line (text or JSON with 'prompt')."),
    label: str = typer.Option("spool", help="Name of the server in the report."),
    compare_url: str | None = typer.Option(None, help="A second server measured in the same run (e.g. llama-server)."),
    compare_label: str = typer.Option("other", help="Its name in the report."),
    json_out: str | None = typer.Option(None, "--json", help="Write the summaries as JSON here."),
    plot_out: str | None = typer.Option(None, "--plot", help="Write a PNG plot here."),
) -> None:
    """Benchmark a server (and/or the engine alone): TTFT, ITL, E2E p50/p90/p99, tokens/s, requests/s."""
    cfg = b.BenchConfig(
        url=url,
        api_key=api_key,
        model=model,
        requests=requests,
        rate=rate,
        max_tokens=max_tokens,
        ignore_eos=ignore_eos,
        temperature=temperature,
        stream=stream,
        prompt=prompt,
        prompts_file=prompts_file,
        label=label,
        concurrency=[int(c) for c in concurrency.split(",") if c.strip()],
    )
    summaries: list[b.Summary] = []
    for m in [x.strip() for x in mode.split(",")]:
        if m == "http":
            summaries += b.bench_http(cfg)
        elif m == "engine":
            summaries += b.bench_engine(cfg)
        else:
            raise typer.BadParameter(f"unknown mode {m!r}")
    if compare_url:
        summaries += b.bench_http(cfg.model_copy(update={"url": compare_url, "label": compare_label}))
    b.print_table(summaries)
    if json_out:
        Path(json_out).write_text(
            json.dumps(
                {
                    "config": cfg.model_dump(exclude={"api_key"}),
                    "summaries": b.to_json(summaries),
                    "ratios": b.ratios(summaries),
                },
                indent=2,
            )
        )
    if plot_out:
        b.plot(summaries, plot_out)


if __name__ == "__main__":
    app(prog_name="spool bench")
