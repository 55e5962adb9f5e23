"""What a generation says while it runs, and what it leaves when it ends: typed and engine-neutral.

The output side of `GenerationParams`: workers produce these; only core/protocol renders them in
OpenAI's shapes (completion or chat), so the same job can be shown as a `text_completion`, its
chunks, or a batch output line. They live here, below both, so that core/protocol depends on
nothing but core/generation. They travel through the job's Redis stream as JSON, one event per
entry (core/jobs/follow.py reads it).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from core.states import JobState


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class TopToken(_Model):
    id: int
    text: str
    logprob: float


class TokenScore(_Model):
    """One token's log-probability (None for a prompt's first token), its rank among the vocabulary
    where known, where it starts in the choice's text, and the best alternatives (best first)."""

    id: int
    text: str
    logprob: float | None = None  # events are encoded without nulls: every nullable field defaults
    rank: int | None = None
    offset: int = 0
    top: list[TopToken] = []


class Usage(_Model):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # OpenAI's Predicted Outputs: draft tokens from the request's `prediction` the model accepted (they
    # are in the completion) and rejected (verified, then dropped); None when it sent no prediction.
    # Prompt-lookup drafts are not counted here: the client did not predict them.
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class ErrorInfo(_Model):
    """Why a job failed, in words a client can act on; `type` is OpenAI's error type."""

    message: str
    type: str = "server_error"
    param: str | None = None
    code: str | None = None


def _now() -> float:
    return time.time()


class Delta(_Model):
    """New text for one choice. The first delta of a choice may carry the echoed prompt (its length
    is `prefix_len`) and the prompt's scores; `scores` covers the generated tokens of this delta."""

    type: Literal["delta"] = "delta"
    attempt: int = 0
    choice: int
    text: str
    token_ids: list[int] = []
    finish_reason: str | None = None
    eos: bool | None = None  # on a choice's last delta: it ended with an end-of-sequence token, a completion token
    prefix_len: int | None = None
    prompt_scores: list[TokenScore | None] | None = None
    scores: list[TokenScore] | None = None
    t: float = Field(default_factory=_now)


class Done(_Model):
    type: Literal["done"] = "done"
    attempt: int = 0
    usage: Usage
    # The stored result (`JobResult` as JSON) when it is small: an API waiting for the job answers
    # from this event instead of reading the row back (`Completions.wait`, core/jobs/service.py).
    result: dict[str, Any] | None = None
    t: float = Field(default_factory=_now)


class Failed(_Model):
    type: Literal["error"] = "error"
    attempt: int = 0
    error: ErrorInfo
    t: float = Field(default_factory=_now)


class Cancelled(_Model):
    type: Literal["cancelled"] = "cancelled"
    t: float = Field(default_factory=_now)


Event = Annotated[Delta | Done | Failed | Cancelled, Field(discriminator="type")]
TERMINAL = (Done, Failed, Cancelled)
_EVENT: TypeAdapter[Event] = TypeAdapter(Event)


def encode(ev: Delta | Done | Failed | Cancelled) -> str:
    return ev.model_dump_json(exclude_defaults=False, exclude_none=True)


def decode(raw: str | bytes) -> Event:
    return _EVENT.validate_json(raw)


def is_terminal(ev: Any) -> bool:
    return isinstance(ev, TERMINAL)


class ChoiceResult(_Model):
    """One finished choice. `text` includes the echoed prompt (its first `prefix_len` characters)."""

    index: int
    text: str
    finish_reason: str | None = None
    prefix_len: int = 0
    scores: list[TokenScore] | None = None
    prompt_scores: list[TokenScore | None] | None = None


class JobResult(_Model):
    choices: list[ChoiceResult]


class TerminalRow(Protocol):
    """What a finished job row offers to rebuild its events (the ORM's Job has it)."""

    state: str
    result: dict[str, Any] | None
    usage: dict[str, Any] | None
    error: dict[str, Any] | None


# Results up to this much text, without scores, ride along in their `Done` event.
INLINE_RESULT_CHARS = 8192


def inline_result(result: JobResult, stored: dict[str, Any]) -> dict[str, Any] | None:
    """`stored` (the result as the job row holds it) if it may ride in the `Done` event, else None."""
    small = sum(len(c.text) for c in result.choices) <= INLINE_RESULT_CHARS
    return stored if small and not any(c.scores or c.prompt_scores for c in result.choices) else None


def result_of(row: TerminalRow) -> JobResult:
    return JobResult.model_validate(row.result or {"choices": []})


def usage_of(row: TerminalRow) -> Usage:
    u = row.usage or {}
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", u.get("cached_tokens", 0))
    return Usage(
        prompt_tokens=u.get("prompt_tokens", 0),
        completion_tokens=u.get("completion_tokens", 0),
        cached_tokens=cached,
        accepted_prediction_tokens=u.get("accepted_prediction_tokens"),
        rejected_prediction_tokens=u.get("rejected_prediction_tokens"),
    )


def error_of(row: TerminalRow) -> ErrorInfo:
    return ErrorInfo.model_validate(row.error or {"message": f"Job {row.state}.", "type": "server_error"})


def from_row(row: TerminalRow) -> list[Event]:
    """Events rebuilt from a terminal job row, for when its stream is gone."""
    if row.state == JobState.succeeded:
        out: list[Event] = [
            Delta(
                choice=c.index,
                text=c.text,
                finish_reason=c.finish_reason,
                prefix_len=c.prefix_len,
                scores=c.scores,
                prompt_scores=c.prompt_scores,
            )
            for c in result_of(row).choices
        ]
        return [*out, Done(usage=usage_of(row))]
    if row.state == JobState.cancelled:
        return [Cancelled()]
    return [Failed(error=error_of(row))]
