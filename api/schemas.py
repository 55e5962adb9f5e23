"""Wire schemas: OpenAI's request and response shapes, with the seed documents' extensions.

Validation of types and ranges lives here; turning a request into engine-neutral parameters lives
in api/translate.py (the one place that does it).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator

from core.jobs import completion_body
from core.models import Job

__all__ = ["CompletionRequest", "completion_body", "job_body", "page"]

PromptPiece = str | int
Prompt = str | list[PromptPiece | list[PromptPiece]]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool | None = None


class ToolFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: ToolFunction


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: dict[str, str]


class GrammarSpec(BaseModel):
    """mistral.rs's grammar object."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["regex", "lark", "json_schema", "gbnf"]
    value: Any


Float = Annotated[float, Field(allow_inf_nan=False)]


class CompletionRequest(BaseModel):
    # Strict: "max_tokens": "5" is a 400, as with OpenAI. Fields nobody declared are collected
    # (extra="allow") and refused by the route, naming them, unless the deployment relaxes that.
    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)

    model: str
    prompt: Prompt
    suffix: str | None = None
    # Length
    max_tokens: Annotated[int, Field(ge=-1)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    ignore_eos: bool | None = None
    # Sampling
    temperature: Annotated[Float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Float, Field(ge=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[Float, Field(ge=0, le=1)] | None = None
    typical_p: Annotated[Float, Field(gt=0, le=1)] | None = None
    # Penalties
    presence_penalty: Annotated[Float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[Float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[Float, Field(gt=0, le=10)] | None = Field(
        None, validation_alias=AliasChoices("repetition_penalty", "repeat_penalty")
    )
    dry_multiplier: Annotated[Float, Field(ge=0)] | None = None
    dry_base: Annotated[Float, Field(ge=1)] | None = None
    dry_allowed_length: Annotated[int, Field(ge=0)] | None = None
    dry_sequence_breakers: list[str] | None = None
    mirostat: Literal[0, 1, 2] | None = None
    mirostat_tau: Annotated[Float, Field(ge=0)] | None = Field(
        None, validation_alias=AliasChoices("mirostat_tau", "mirostat_target")
    )
    mirostat_eta: Annotated[Float, Field(ge=0)] | None = Field(
        None, validation_alias=AliasChoices("mirostat_eta", "mirostat_lr")
    )
    logit_bias: dict[str, Annotated[Float, Field(ge=-100, le=100)]] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**64 - 1)] | None = None
    # Stopping and choices
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    n: Annotated[int, Field(ge=1, le=128)] | None = None
    best_of: Annotated[int, Field(ge=0, le=20)] | None = None
    # Log-probabilities (Llama Stack sends a boolean)
    logprobs: bool | Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # Constrained output
    grammar: str | GrammarSpec | None = None
    json_schema: dict[str, Any] | str | None = None
    response_format: dict[str, Any] | None = None
    regex: str | None = None
    guided_choice: list[str] | None = None
    # Context overflow
    context_length_exceeded_behavior: Literal["truncate", "error"] | None = None
    truncate_sequence: bool | None = None
    # Serving
    cache_prompt: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: Annotated[int, Field(ge=-100, le=100)] | None = None  # within the tenant: higher runs first
    # Accepted for compatibility; no effect on a text-completion model
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    images: list[str] | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_shape(cls, v: Prompt) -> Prompt:
        if isinstance(v, str):
            return v
        if not v:
            raise ValueError("the prompt array must not be empty")
        for item in v:
            pieces = item if isinstance(item, list) else [item]
            if isinstance(item, list) and not item:
                raise ValueError("a prompt inside the array must not be empty")
            if any(isinstance(t, int) and t < 0 for t in pieces):
                raise ValueError("token ids must be non-negative")
        return v

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


def _ts(d: Any) -> int | None:
    return int(d.timestamp()) if d else None


def job_body(job: Job) -> dict[str, Any]:
    """Spool's job object, for `Prefer: respond-async` and `GET /v1/jobs/{id}`."""
    return {
        "id": job.id,
        "object": "job",
        "model": job.model,
        "state": job.state,
        "attempt": job.attempt,
        "created_at": _ts(job.created_at),
        "started_at": _ts(job.started_at),
        "finished_at": _ts(job.finished_at),
        "usage": job.usage,
        "error": job.error,
        "result": completion_body(job) if job.state == "succeeded" else None,
        "events_url": f"/v1/jobs/{job.id}/events",
    }


def page(data: list[dict[str, Any]], more: bool) -> dict[str, Any]:
    """OpenAI's cursor-paginated list object."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": more,
    }
