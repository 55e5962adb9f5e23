"""Wire schemas (OpenAI's shapes) and the one translation from OpenAI JSON to GenerationParams."""

from __future__ import annotations

import secrets
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from core.models import Job
from core.params import GenerationParams

PromptField = str | list[str] | list[int] | list[list[int]]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool | None = None


class CompletionRequest(BaseModel):
    # Strict: "max_tokens": "5" is a 400, as with OpenAI. Unknown fields are a 400 naming them,
    # because a silently ignored parameter returns unconstrained output with a 200.
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    prompt: PromptField
    max_tokens: Annotated[int, Field(ge=-1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    seed: int | None = None
    n: Annotated[int, Field(ge=1, le=128)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: PromptField) -> PromptField:
        if isinstance(v, list):
            if not v:
                raise ValueError("the prompt array must not be empty")
            if isinstance(v[0], list) and any(not p for p in v):
                raise ValueError("token-id prompts must not be empty")
            if any(isinstance(t, int) and t < 0 for t in v):
                raise ValueError("token ids must be non-negative")
            if any(isinstance(p, list) and any(t < 0 for t in p) for p in v):
                raise ValueError("token ids must be non-negative")
        return v

    def prompts(self) -> list[str | list[int]]:
        """Normalize to a list of prompts, each text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def to_params(self, default_max_tokens: int) -> GenerationParams:
        if self.max_tokens == -1:
            max_tokens: int | None = None  # llama.cpp's "until the context is full"
        elif self.max_tokens is None:
            max_tokens = default_max_tokens
        else:
            max_tokens = self.max_tokens
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return GenerationParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            stop=tuple(s for s in stop if s),
            # Pick the seed here when the client did not: the job then replays identically when a
            # later attempt resumes it, and the seed is on record.
            seed=self.seed if self.seed is not None else secrets.randbits(63),
            n=self.n or 1,
            ignore_eos=bool(self.ignore_eos),
        )


def completion_body(job: Job) -> dict[str, Any]:
    """A finished job as OpenAI's `text_completion` object."""
    return {
        "id": job.id,
        "object": "text_completion",
        "created": int(job.created_at.timestamp()),
        "model": job.model,
        "choices": (job.result or {}).get("choices", []),
        "usage": job.usage,
        "system_fingerprint": None,
    }


def job_body(job: Job) -> dict[str, Any]:
    """Spool's job object, for `Prefer: respond-async` and `GET /v1/jobs/{id}`."""
    ts = lambda d: int(d.timestamp()) if d else None  # noqa: E731
    return {
        "id": job.id,
        "object": "job",
        "model": job.model,
        "state": job.state,
        "attempt": job.attempt,
        "created_at": ts(job.created_at),
        "started_at": ts(job.started_at),
        "finished_at": ts(job.finished_at),
        "usage": job.usage,
        "error": job.error,
        "result": completion_body(job) if job.state == "succeeded" else None,
        "events_url": f"/v1/jobs/{job.id}/events",
    }
