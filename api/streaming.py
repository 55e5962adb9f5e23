"""Following a job's event stream, and turning events into OpenAI completion chunks (SSE)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from fastapi.sse import format_sse_event

from core import events
from core.models import Job

# What to do when XREAD times out: look at the job row. Returns the row if it is terminal.
RowCheck = Callable[[], Awaitable[Job | None]]

HEARTBEAT = object()


async def follow(
    redis: aioredis.Redis, job_id: str, check_row: RowCheck, last_id: str = "0-0", block_ms: int = 2000
) -> AsyncIterator[tuple[str | None, dict[str, Any]] | object]:
    """Yield (entry id, event) from `last_id` on until a terminal event. When the stream is silent,
    yield HEARTBEAT and consult Postgres, which answers if the stream expired or was never written
    (a job that failed before its worker started, say)."""
    key = events.stream_key(job_id)
    while True:
        resp = await redis.xread({key: last_id}, block=block_ms, count=1000)
        if not resp:
            job = await check_row()
            if job is not None:
                for ev in synthesize(job):
                    yield None, ev
                return
            yield HEARTBEAT
            continue
        for entry_id, fields in resp[0][1]:
            last_id = entry_id if isinstance(entry_id, str) else entry_id.decode()
            ev = events.decode(fields)
            yield last_id, ev
            if events.is_terminal(ev):
                return


def synthesize(job: Job) -> list[dict[str, Any]]:
    """Events rebuilt from a terminal job row, for when its stream is gone."""
    if job.state == "succeeded":
        out: list[dict[str, Any]] = []
        for c in (job.result or {}).get("choices", []):
            ev = {
                "type": "delta",
                "choice": c["index"],
                "text": c["text"],
                "token_ids": [],
                "finish_reason": c["finish_reason"],
                "logprobs": c.get("logprobs"),
            }
            if "prompt_logprobs" in c:
                ev["prompt_logprobs"] = c["prompt_logprobs"]
            out.append(ev)
        return [*out, {"type": "done", "usage": job.usage}]
    if job.state == "cancelled":
        return [{"type": "cancelled"}]
    return [{"type": "error", "error": job.error or {"message": f"Job {job.state}.", "type": "server_error"}}]


def sse(data: dict[str, Any] | str, event_id: str | None = None) -> bytes:
    raw = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return format_sse_event(data_str=raw, id=event_id)


def sse_comment(text: str) -> bytes:
    return format_sse_event(comment=text)


class ChunkWriter:
    """Formats events as OpenAI `text_completion` chunks for one job."""

    def __init__(self, job: Job, include_usage: bool) -> None:
        self.base = {
            "id": job.id,
            "object": "text_completion",
            "created": int(job.created_at.timestamp()),
            "model": job.model,
        }
        self.include_usage = include_usage

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        # `usage` only on the final chunk: the reference schema has no null usage.
        body = {**self.base, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    def render(self, entry_id: str | None, ev: dict[str, Any]) -> list[bytes]:
        kind = ev.get("type")
        if kind == "delta":
            # Never an empty-text chunk unless it carries the finish_reason: benchmarks time the
            # first chunk as the first token.
            lp = ev.get("logprobs")
            if not ev["text"] and not ev.get("finish_reason") and not (lp and lp["tokens"]):
                return []
            choice = {
                "text": ev["text"],
                "index": ev["choice"],
                "logprobs": lp,
                "finish_reason": ev.get("finish_reason"),
            }
            if "prompt_logprobs" in ev:
                choice["prompt_logprobs"] = ev["prompt_logprobs"]
            return [sse(self._chunk([choice]), entry_id)]
        if kind == "done":
            out = [sse(self._chunk([], ev.get("usage")), entry_id)] if self.include_usage else []
            return [*out, sse("[DONE]")]
        if kind == "cancelled":
            err = {"message": "The job was cancelled.", "type": "cancelled", "param": None, "code": "cancelled"}
            return [sse({"error": err}, entry_id), sse("[DONE]")]
        if kind == "error":
            err = {"param": None, "code": None, **(ev.get("error") or {})}
            return [sse({"error": err}, entry_id), sse("[DONE]")]
        return []
