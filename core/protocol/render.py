"""Neutral results and events -> OpenAI's wire JSON. The only place that knows those shapes.

A job's stored result, its stream events and its usage are engine-neutral (core/jobs/events.py);
here they become a `text_completion`, its chunks, Spool's job object, or a batch output body.
"""

from __future__ import annotations

import hashlib
from datetime import datetime
from functools import lru_cache
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Protocol

from core.config import get_settings
from core.generation.params import GenerationParams
from core.jobs.events import (
    Cancelled,
    ChoiceResult,
    Delta,
    Done,
    ErrorInfo,
    Event,
    Failed,
    TokenScore,
    Usage,
    error_of,
    result_of,
    usage_of,
)

try:
    _VERSION = version("spool")
except PackageNotFoundError:  # running from a checkout that was never installed
    _VERSION = "dev"


class JobRecord(Protocol):
    """What rendering reads from a job (the ORM's Job has it; tests pass plain objects)."""

    id: str
    model: str
    state: str
    attempt: int
    params: dict[str, Any]
    result: dict[str, Any] | None
    usage: dict[str, Any] | None
    error: dict[str, Any] | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


@lru_cache
def fingerprint(model: str) -> str:
    """OpenAI's `system_fingerprint`: changes when what serves the model (engine, its settings,
    Spool's version) changes, so a client can tell two answers apart that came from different setups."""
    s = get_settings()
    raw = f"{model}|{s.engine}|{s.n_ctx}|{s.max_batch}|{s.fast_lane}|{_VERSION}"
    return "fp_" + hashlib.sha256(raw.encode()).hexdigest()[:10]


def _ts(d: datetime | None) -> int | None:
    return int(d.timestamp()) if d else None


def usage(u: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def error(e: ErrorInfo) -> dict[str, Any]:
    return {"message": e.message, "type": e.type, "param": e.param, "code": e.code}


# -- logprobs --------------------------------------------------------------------------------------


def _top(s: TokenScore, k: int | None) -> dict[str, float] | None:
    if s.logprob is None:
        return None
    out = {t.text: t.logprob for t in (s.top if k is None else s.top[:k])}
    out.setdefault(s.text, s.logprob)
    return out


def completion_logprobs(scores: list[TokenScore], k: int | None) -> dict[str, Any]:
    """OpenAI's legacy completion logprobs: parallel lists."""
    return {
        "tokens": [s.text for s in scores],
        "token_logprobs": [s.logprob for s in scores],
        "top_logprobs": [_top(s, k) for s in scores],
        "text_offset": [s.offset for s in scores],
    }


def prompt_logprobs(scores: list[TokenScore | None], k: int) -> list[Any]:
    """vLLM's `prompt_logprobs`: per prompt token, {token id: {logprob, rank, decoded_token}}."""
    out: list[Any] = []
    for s in scores:
        if s is None or s.logprob is None:
            out.append(None)
            continue
        d = {str(t.id): {"logprob": t.logprob, "rank": i + 1, "decoded_token": t.text} for i, t in enumerate(s.top[:k])}
        d.setdefault(str(s.id), {"logprob": s.logprob, "rank": s.rank, "decoded_token": s.text})
        out.append(d)
    return out


def _echo_scores(p: GenerationParams, prompt: list[TokenScore | None] | None) -> list[TokenScore]:
    if not (p.echo and p.logprobs is not None and prompt):
        return []
    return [s for s in prompt if s is not None]


def _choice(p: GenerationParams, index: int, text: str, finish: str | None, c: Delta | ChoiceResult) -> dict[str, Any]:
    lp = None
    if p.logprobs is not None and (c.scores is not None or c.prompt_scores):
        lp = completion_logprobs(_echo_scores(p, c.prompt_scores) + list(c.scores or []), p.logprobs)
    out: dict[str, Any] = {"text": text, "index": index, "logprobs": lp, "finish_reason": finish}
    if p.prompt_logprobs is not None and c.prompt_scores is not None:
        out["prompt_logprobs"] = prompt_logprobs(c.prompt_scores, p.prompt_logprobs)
    return out


# -- whole objects -----------------------------------------------------------------------------


def params_of(job: JobRecord) -> GenerationParams:
    return GenerationParams.from_json(job.params)


def completion(job: JobRecord) -> dict[str, Any]:
    """A finished job as OpenAI's `text_completion` object (API responses and batch output lines)."""
    p = params_of(job)
    choices = []
    for c in result_of(job).choices:
        ch = _choice(p, c.index, c.text, c.finish_reason, c)
        if p.prompt_logprobs is not None and "prompt_logprobs" not in ch:
            ch["prompt_logprobs"] = None
        choices.append(ch)
    return {
        "id": job.id,
        "object": "text_completion",
        "created": _ts(job.created_at),
        "model": job.model,
        "system_fingerprint": fingerprint(job.model),
        "choices": choices,
        "usage": usage(usage_of(job)) if job.usage is not None else None,
    }


def job(j: JobRecord) -> dict[str, Any]:
    """Spool's job object, for `Prefer: respond-async` and `GET /v1/jobs/{id}`."""
    return {
        "id": j.id,
        "object": "job",
        "model": j.model,
        "status": j.state,
        "attempt": j.attempt,
        "created_at": _ts(j.created_at),
        "started_at": _ts(j.started_at),
        "finished_at": _ts(j.finished_at),
        "usage": usage(usage_of(j)) if j.usage is not None else None,
        "error": error(error_of(j)) if j.error is not None else None,
        "result": completion(j) if j.state == "succeeded" else None,
        "events_url": f"/v1/jobs/{j.id}/events",
    }


def failure(j: JobRecord) -> dict[str, Any]:
    """The error object of a job that did not succeed."""
    return error(error_of(j))


def page(data: list[dict[str, Any]], more: bool) -> dict[str, Any]:
    """OpenAI's cursor-paginated list object."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": more,
    }


# -- stream chunks -----------------------------------------------------------------------------

DONE = "[DONE]"


class CompletionChunks:
    """A job's events as OpenAI `text_completion` chunks: dicts, or DONE (the caller frames SSE)."""

    def __init__(self, j: JobRecord, include_usage: bool) -> None:
        self.base = {
            "id": j.id,
            "object": "text_completion",
            "created": _ts(j.created_at),
            "model": j.model,
            "system_fingerprint": fingerprint(j.model),
        }
        self.params = params_of(j)
        self.include_usage = include_usage

    def _chunk(self, choices: list[dict[str, Any]], u: Usage | None = None) -> dict[str, Any]:
        # With include_usage, OpenAI sends `usage: null` on every chunk but the last.
        body: dict[str, Any] = {**self.base, "choices": choices}
        if u is not None:
            body["usage"] = usage(u)
        elif self.include_usage:
            body["usage"] = None
        return body

    def render(self, ev: Event) -> list[dict[str, Any] | str]:
        if isinstance(ev, Delta):
            # Never an empty-text chunk unless it carries the finish_reason or logprobs: benchmarks
            # time the first chunk as the first token.
            ch = _choice(self.params, ev.choice, ev.text, ev.finish_reason, ev)
            lp = ch["logprobs"]
            if not ev.text and not ev.finish_reason and not (lp and lp["tokens"]):
                return []
            return [self._chunk([ch])]
        if isinstance(ev, Done):
            return [*([self._chunk([], ev.usage)] if self.include_usage else []), DONE]
        if isinstance(ev, Cancelled):
            err = {"message": "The job was cancelled.", "type": "cancelled", "param": None, "code": "cancelled"}
            return [{"error": err}, DONE]
        if isinstance(ev, Failed):
            return [{"error": error(ev.error)}, DONE]
        return []
