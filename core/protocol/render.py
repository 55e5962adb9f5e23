"""Neutral results and events -> OpenAI's wire JSON: the module that builds every body the API
answers or a file holds (tests/unit/test_homes.py finds each kind built anywhere else).

A job's stored result, its stream events and its usage are engine-neutral (core/generation/events.py);
here they become a `text_completion`, its chunks, Spool's job object, a batch file's output and error
lines, the error envelope, the tokenize/detokenize answers, the file, batch, model, tenant and list
objects, or the Responses API's `response` object and its items. Two shapes are built beside it, each
with its reason: the Responses API's typed stream events (core/protocol/responses.py `Events`
numbers them, around the objects and items made here) and the webhook's Standard Webhooks envelope
(core/batches/webhooks.py `event_body`: workers deliver it, and workers never import core.protocol).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from datetime import datetime
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Protocol

from core.config import Settings
from core.generation import chat_template
from core.generation.events import (
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
from core.generation.params import GenerationParams
from core.registry import RegistryError, settings_for

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
    chat: dict[str, Any] | None
    result: dict[str, Any] | None
    usage: dict[str, Any] | None
    error: dict[str, Any] | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


def system_fingerprint(model: str, settings: Settings) -> str:
    """OpenAI's `system_fingerprint`: changes when what serves the model (engine, its settings,
    Spool's version) changes, so a client can tell two answers apart that came from different setups."""
    s = settings
    try:
        s = settings_for(model, s)
    except RegistryError:  # a job of a model no longer served
        pass
    raw = f"{model}|{s.engine}|{s.n_ctx}|{s.max_batch}|{s.model_path}|{_VERSION}"
    return "fp_" + hashlib.sha256(raw.encode()).hexdigest()[:10]


class Fingerprints:
    """Each model's `system_fingerprint` under one deployment's settings, worked out once per model.
    Built by whoever holds the settings (the API at startup, the batch keeper per pass) and read by
    the caller of `response`, `job` and `chunks_for`: rendering itself reads no settings."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._known: dict[str, str] = {}

    def __call__(self, model: str) -> str:
        fp = self._known.get(model)
        if fp is None:
            fp = self._known[model] = system_fingerprint(model, self.settings)
        return fp


def _ts(d: datetime | None) -> int | None:
    return int(d.timestamp()) if d else None


def usage(u: Usage) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }
    if u.accepted_prediction_tokens is not None:  # the request sent a `prediction`
        out["completion_tokens_details"] = {
            "accepted_prediction_tokens": u.accepted_prediction_tokens,
            "rejected_prediction_tokens": u.rejected_prediction_tokens or 0,
        }
    return out


def error(e: ErrorInfo) -> dict[str, Any]:
    return {"message": e.message, "type": e.type, "param": e.param, "code": e.code}


def envelope(err: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's error body, `{"error": {message, type, param, code}}`: every non-2xx answer, a failed
    batch line's body, the last chunk of a stream that failed."""
    return {"error": err}


def error_body(
    message: str | None, type_: str | None, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The error envelope from its fields (api/errors.py answers every DomainError with it; a failed
    batch line's stored error may lack a message or type: null then, as before)."""
    return envelope({"message": message, "type": type_, "param": param, "code": code})


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


def completion(job: JobRecord, fingerprint: str) -> dict[str, Any]:
    """A finished job as OpenAI's `text_completion` object (API responses and batch output lines);
    `fingerprint`: its model's `system_fingerprint` (`Fingerprints`)."""
    p = params_of(job)
    choices = []
    for c in result_of(job).choices:
        ch = _choice(p, c.index, c.text, c.finish_reason, c)
        if p.prompt_logprobs is not None and "prompt_logprobs" not in ch:
            ch["prompt_logprobs"] = None
        choices.append(ch)
    # Not in OpenAI's legacy object, which has no tiers; the SDK keeps the extra field.
    return {**_finished(job, fingerprint, "text_completion", choices), "service_tier": service_tier(job)}


def _finished(job: JobRecord, fingerprint: str, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    """A finished completion or chat completion around its choices."""
    return {
        "id": job.id,
        "object": kind,
        "created": _ts(job.created_at),
        "model": job.model,
        "system_fingerprint": fingerprint,
        "choices": choices,
        "usage": usage(usage_of(job)) if job.usage is not None else None,
    }


def job(j: JobRecord, fingerprint: str) -> dict[str, Any]:
    """Spool's job object, for `Prefer: respond-async` and `GET /v1/jobs/{id}` (`fingerprint`: for its
    result)."""
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
        "result": response(j, fingerprint) if j.state == "succeeded" else None,
        "events_url": f"/v1/jobs/{j.id}/events",
    }


def failure(j: JobRecord) -> dict[str, Any]:
    """The error object of a job that did not succeed (its body: `envelope(failure(j))`)."""
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


def listing(data: list[dict[str, Any]]) -> dict[str, Any]:
    """OpenAI's plain list object (no cursor): models, tenants, keys, usage rows."""
    return {"object": "list", "data": data}


# -- Spool's own objects: models, tenants, keys, usage, webhook secret -----------------------------

MODEL_CREATED = 1735689600  # fixed: the model list is configuration, not a dated object


def model(name: str, model_id: str, context_length: int | None, live_workers: int) -> dict[str, Any]:
    """A served model or an alias of one (`alias_of`); `live_workers` 0: synchronous requests for it
    get a 503 with Retry-After."""
    out: dict[str, Any] = {
        "id": name,
        "object": "model",
        "created": MODEL_CREATED,
        "owned_by": "spool",
        "context_length": context_length,
        "live_workers": live_workers,
    }
    if name != model_id:
        out["alias_of"] = model_id
    return out


TENANT_LIMITS = (
    "weight",
    "rpm",
    "tpm",
    "tpd",
    "max_concurrent",
    "max_queued",
    "max_storage_bytes",
    "max_stored_bytes",
    "max_redis_bytes",
    "allow_priority",
)


class TenantRecord(Protocol):
    """What rendering reads from a tenant (the ORM's Tenant has it, with its limits)."""

    id: int
    name: str
    created_at: datetime


class KeyRecord(Protocol):
    id: int
    tenant_id: int
    prefix: str
    name: str | None
    scope: str
    revoked: bool
    rpm: int | None
    tpm: int | None
    expires_at: datetime | None
    created_at: datetime


def tenant(t: TenantRecord) -> dict[str, Any]:
    """A tenant and its limits (the admin API; `spool tenant ... --json`)."""
    return {
        "object": "tenant",
        "id": t.id,
        "name": t.name,
        **{f: getattr(t, f) for f in TENANT_LIMITS},
        "created_at": _ts(t.created_at),
    }


def api_key(k: KeyRecord, plain: str | None = None) -> dict[str, Any]:
    """An API key, never its secret: `plain` is given only by the call that created it, the one time
    the key is shown."""
    out: dict[str, Any] = {
        "object": "api_key",
        "id": k.id,
        "tenant_id": k.tenant_id,
        "prefix": k.prefix,
        "name": k.name,
        "scope": k.scope,
        "revoked": k.revoked,
        "rpm": k.rpm,
        "tpm": k.tpm,
        "expires_at": _ts(k.expires_at),
        "created_at": _ts(k.created_at),
    }
    if plain is not None:
        out["key"] = plain
    return out


def usage_row(row: Mapping[Any, Any]) -> dict[str, Any]:
    """One row of usage per day, model and service tier (and key)."""
    d = dict(row)
    d["day"] = d["day"].isoformat()
    d["gpu_seconds"] = round(float(d["gpu_seconds"]), 3)
    for k in ("requests", "failed", "prompt_tokens", "completion_tokens"):
        d[k] = int(d[k])
    return d


def stored_bytes(counts: Mapping[str, int | None], limits: Mapping[str, int | None]) -> dict[str, Any]:
    """A tenant's bytes per store (jobs, files, redis) and its limit on each (None: no limit)."""
    return {
        **{k: counts.get(k) for k in ("jobs", "files", "redis")},
        "limits": {k: limits.get(k) or None for k in limits},
    }


def tenants_stored(counts: Mapping[int, Mapping[str, int | None]]) -> list[dict[str, Any]]:
    """Every tenant's bytes per store, by tenant id."""
    return [{"tenant_id": t, **{k: c.get(k, 0) for k in ("jobs", "files", "redis")}} for t, c in sorted(counts.items())]


def webhook_secret(secret: str) -> dict[str, Any]:
    return {"object": "webhook_secret", "secret": secret}


# -- tokenize / detokenize (llama.cpp's server shapes) -----------------------------------------------


def tokens(ids: list[int], pieces: list[str] | None = None) -> dict[str, Any]:
    """The /tokenize answer: the ids, or with `pieces` (one text per id) each id with its text."""
    if pieces is None:
        return {"tokens": ids}
    return {"tokens": [{"id": t, "piece": p} for t, p in zip(ids, pieces, strict=True)]}


def detokenized(content: str) -> dict[str, Any]:
    """The /detokenize answer."""
    return {"content": content}


# -- files and batches -----------------------------------------------------------------------------


class FileRecord(Protocol):
    """What rendering reads from a stored file (the ORM's File has it)."""

    id: str
    bytes: int
    created_at: datetime
    filename: str
    purpose: str
    status: str
    expires_at: datetime | None


def file(f: FileRecord) -> dict[str, Any]:
    """OpenAI's file object."""
    return {
        "id": f.id,
        "object": "file",
        "bytes": f.bytes,
        "created_at": _ts(f.created_at),
        "filename": f.filename,
        "purpose": f.purpose,
        "status": f.status,
        "expires_at": _ts(f.expires_at),
    }


def file_deleted(file_id: str) -> dict[str, Any]:
    return {"id": file_id, "object": "file", "deleted": True}


class BatchRecord(Protocol):
    """What rendering reads from a batch (the ORM's Batch has it)."""

    id: str
    endpoint: str
    model: str | None
    errors: dict[str, Any] | None
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None
    error_file_id: str | None
    meta: dict[str, Any] | None
    created_at: datetime
    in_progress_at: datetime | None
    expires_at: datetime
    finalizing_at: datetime | None
    completed_at: datetime | None
    failed_at: datetime | None
    expired_at: datetime | None
    cancelling_at: datetime | None
    cancelled_at: datetime | None


def batch(b: BatchRecord, counts: dict[str, int], used: Usage, files_shown: bool) -> dict[str, Any]:
    """OpenAI's batch object. The domain says what rendering cannot know: its `request_counts`, what
    its ended lines used (`usage`, in the Responses API's shape, as OpenAI's batch shows it), and
    whether its result files are whole yet (`files_shown`; core/batches/progress.batch_json)."""
    return {
        "id": b.id,
        "object": "batch",
        "endpoint": b.endpoint,
        "model": b.model,
        "errors": b.errors,
        "input_file_id": b.input_file_id,
        "completion_window": b.completion_window,
        "status": b.status,
        "output_file_id": b.output_file_id if files_shown else None,
        "error_file_id": b.error_file_id if files_shown else None,
        "created_at": _ts(b.created_at),
        "in_progress_at": _ts(b.in_progress_at),
        "expires_at": _ts(b.expires_at),
        "finalizing_at": _ts(b.finalizing_at),
        "completed_at": _ts(b.completed_at),
        "failed_at": _ts(b.failed_at),
        "expired_at": _ts(b.expired_at),
        "cancelling_at": _ts(b.cancelling_at),
        "cancelled_at": _ts(b.cancelled_at),
        "request_counts": counts,
        "usage": response_usage(used),
        "metadata": b.meta,
    }


# -- stream chunks -----------------------------------------------------------------------------

DONE = "[DONE]"


class CompletionChunks:
    """A job's events as OpenAI `text_completion` chunks: dicts, or DONE (the caller frames SSE)."""

    def __init__(self, j: JobRecord, include_usage: bool, fingerprint: str) -> None:
        self.base = {
            "id": j.id,
            "object": "text_completion",
            "created": _ts(j.created_at),
            "model": j.model,
            "system_fingerprint": fingerprint,
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
            return [error_body("The job was cancelled.", "cancelled", None, "cancelled"), DONE]
        if isinstance(ev, Failed):
            return [envelope(error(ev.error)), DONE]
        return []


# -- chat ------------------------------------------------------------------------------------------


def _token_entry(text: str, logprob: float | None) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def chat_logprobs(scores: list[TokenScore], k: int) -> dict[str, Any]:
    """OpenAI's chat logprobs: `{"content": [{token, logprob, bytes, top_logprobs: [...]}]}`."""
    return {
        "content": [
            {
                **_token_entry(s.text, s.logprob),
                "top_logprobs": [_token_entry(t.text, t.logprob) for t in s.top[:k]],
            }
            for s in scores
        ],
        "refusal": None,
    }


def _call_id(job_id: str, choice: int, i: int) -> str:
    # The same id whichever way the job is read (response, stream replay, job object, batch output).
    return "call_" + hashlib.sha256(f"{job_id}:{choice}:{i}".encode()).hexdigest()[:24]


def _tool_calls(job_id: str, choice: int, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"id": _call_id(job_id, choice, i), "type": "function", "function": c} for i, c in enumerate(calls)]


def _message(job: JobRecord, index: int, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
    """The assistant message of one choice, with its tool calls parsed out when tools were offered."""
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    if (job.chat or {}).get("tools"):
        content, calls = chat_template.parse_tool_calls(text, (job.chat or {}).get("forced"))
        if calls:
            message["content"] = content or None
            message["tool_calls"] = _tool_calls(job.id, index, calls)
            finish = "tool_calls" if finish in ("stop", None) else finish
    return message, finish


def service_tier(job: JobRecord) -> str:
    """The tier that served the job (core/jobs/tiers.py), which every completion, chunk and response
    echoes."""
    return getattr(job, "service_tier", None) or "default"


def chat_completion(job: JobRecord, fingerprint: str) -> dict[str, Any]:
    """A finished chat job as OpenAI's `chat.completion` object."""
    k = (job.chat or {}).get("top_logprobs")
    choices = []
    for c in result_of(job).choices:
        message, finish = _message(job, c.index, c.text, c.finish_reason)
        lp = chat_logprobs(list(c.scores or []), k) if k is not None and c.scores is not None else None
        choices.append({"index": c.index, "message": message, "logprobs": lp, "finish_reason": finish})
    return {**_finished(job, fingerprint, "chat.completion", choices), "service_tier": service_tier(job)}


def response(job: JobRecord, fingerprint: str) -> dict[str, Any]:
    """A finished job in the shape of the endpoint that created it."""
    return chat_completion(job, fingerprint) if job.chat is not None else completion(job, fingerprint)


def batch_body(job: JobRecord, fingerprint: str) -> dict[str, Any]:
    """A batch output line's body: the finished job in the shape of the batch's endpoint (a line of a
    `/v1/responses` batch is a `response` object; `job`'s `result` stays its chat completion)."""
    return response_of(job) if is_response(job) else response(job, fingerprint)


def batch_line_id(job_id: str) -> str:
    """A batch file line's `id`: its job's, renamed (`cmpl-<hex>` -> `batch_req_<hex>`)."""
    return "batch_req_" + job_id.removeprefix(JOB_PREFIX)


def batch_answered_line(job_id: str, custom_id: str | None, status_code: int, body: dict[str, Any]) -> dict[str, Any]:
    """A line of a batch's output file (status 200, `batch_body`) or error file (a failed request:
    its status and `envelope`), in OpenAI's batch format."""
    return {
        "id": batch_line_id(job_id),
        "custom_id": custom_id,
        "response": {"status_code": status_code, "request_id": job_id, "body": body},
        "error": None,
    }


def batch_unrun_line(job_id: str, custom_id: str | None, code: str | None, message: str) -> dict[str, Any]:
    """A line of a batch's error file for a request that never ran (its batch expired or was cancelled)."""
    return {
        "id": batch_line_id(job_id),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }


class ChatChunks(CompletionChunks):
    """A chat job's events as `chat.completion.chunk`s: the role first, then content deltas, then the
    finish_reason. With tools offered, text that may be a tool call is held back until it is known:
    calls go out as `tool_calls` deltas, anything else as content."""

    def __init__(self, j: JobRecord, include_usage: bool, fingerprint: str) -> None:
        super().__init__(j, include_usage, fingerprint)
        self.base["object"] = "chat.completion.chunk"
        self.base["service_tier"] = service_tier(j)
        self.job = j
        self.k = (j.chat or {}).get("top_logprobs")
        self.tools = bool((j.chat or {}).get("tools"))
        self.forced: list[str] | None = (j.chat or {}).get("forced")
        self.started: set[int] = set()
        self.held: dict[int, str] = {}  # per choice: text that may still turn out to be a tool call

    def _delta(self, index: int, delta: dict[str, Any], finish: str | None = None, lp: Any = None) -> dict[str, Any]:
        return self._chunk([{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}])

    def render(self, ev: Event) -> list[dict[str, Any] | str]:
        if not isinstance(ev, Delta):
            return super().render(ev)
        out: list[dict[str, Any] | str] = []
        i = ev.choice
        if i not in self.started:
            self.started.add(i)
            out.append(self._delta(i, {"role": "assistant", "content": ""}))
        lp = chat_logprobs(list(ev.scores), self.k) if self.k is not None and ev.scores else None
        text = ev.text
        if self.tools:
            held = self.held.get(i, "") + text
            if ev.finish_reason is None and (self.forced or _maybe_tool_call(held)):
                self.held[i] = held
                if lp is not None:
                    out.append(self._delta(i, {}, None, lp))
                return out
            self.held.pop(i, None)
            content, calls = chat_template.parse_tool_calls(held, self.forced) if ev.finish_reason else (held, [])
            if calls:
                deltas = [{"index": n, **call} for n, call in enumerate(_tool_calls(self.job.id, i, calls))]
                out.append(self._delta(i, {**({"content": content} if content else {}), "tool_calls": deltas}))
                finish = "tool_calls" if ev.finish_reason == "stop" else ev.finish_reason
                out.append(self._delta(i, {}, finish, lp))
                return out
            text = held
        if text or lp is not None:
            out.append(self._delta(i, {"content": text}, None, lp))
        if ev.finish_reason:
            out.append(self._delta(i, {}, ev.finish_reason))
        return out


def _maybe_tool_call(text: str) -> bool:
    """Whether held text could still be (the start of) a tool call."""
    t = text.lstrip()
    opener = chat_template.TOOL_CALL_OPEN
    return t.startswith(opener) or opener.startswith(t) or t.startswith("{") or (t == "" and text != "")


def chunks_for(job: JobRecord, include_usage: bool, fingerprint: str) -> CompletionChunks:
    kind = ChatChunks if job.chat is not None else CompletionChunks
    return kind(job, include_usage, fingerprint)


# -- the Responses API's objects (`/v1/responses`) ------------------------------------------------
# A response is a chat job (core/protocol/responses.py translates the request and renders the job's
# events as typed stream events); here its row, or a stream's state, becomes a `response` object.

RESPONSE_PREFIX, JOB_PREFIX = "resp_", "cmpl-"


def response_id(job_id: str) -> str:
    """A response's id is its job's, renamed: `cmpl-<hex>` <-> `resp_<hex>`, both ways, everywhere."""
    return RESPONSE_PREFIX + job_id.removeprefix(JOB_PREFIX)


def response_item_id(kind: str, job_id: str, *where: Any) -> str:
    """A stable id for an item of a response (`msg_…`, `fc_…`): every API process names it alike."""
    raw = ":".join(str(w) for w in (job_id, kind, *where))
    return f"{kind}_" + hashlib.sha256(raw.encode()).hexdigest()[:32]


def response_meta(job: JobRecord) -> dict[str, Any]:
    """What the job keeps for the Responses API alone (core/protocol/responses.meta)."""
    return (job.chat or {}).get("response") or {}


def is_response(job: JobRecord) -> bool:
    return bool((job.chat or {}).get("response"))


def response_error(e: ErrorInfo) -> dict[str, Any]:
    """A failed `response` object's `error`."""
    return {"code": e.code or "server_error", "message": e.message}


def response_usage(u: Usage) -> dict[str, Any]:
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.total_tokens,
    }


def response_message_item(job_id: str, text: str, status: str, logprobs: list[Any] | None = None) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    return {
        "id": response_item_id("msg", job_id, 0),
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [part],
    }


def response_call_item(job_id: str, n: int, call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    return {
        "id": response_item_id("fc", job_id, n),
        "type": "function_call",
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": status,
    }


def _response_logprobs(lp: dict[str, Any] | None) -> list[Any]:
    """Chat's logprobs (`{"content": [...]}`) in the Responses shape."""
    return [
        {
            "token": e["token"],
            "logprob": e["logprob"],
            "bytes": e["bytes"],
            "top_logprobs": [
                {"token": t["token"], "logprob": t["logprob"], "bytes": t["bytes"]} for t in e["top_logprobs"]
            ],
        }
        for e in (lp or {}).get("content") or []
    ]


def response_output(job: JobRecord, status: str | None = None) -> tuple[list[dict[str, Any]], str | None]:
    """A job's output items (its chat completion's message, then its tool calls) and its finish
    reason: a succeeded job's, or what a cancelled one had generated (its partial result; `status`:
    the items' status then, `incomplete`)."""
    done = chat_completion(job, "")
    if not done["choices"]:
        return [], None
    choice = done["choices"][0]
    msg, finish = choice["message"], choice["finish_reason"]
    status = status or ("incomplete" if finish == "length" else "completed")
    out = []
    calls = msg.get("tool_calls") or []
    if msg.get("content") or not calls:
        out.append(
            response_message_item(job.id, msg.get("content") or "", status, _response_logprobs(choice.get("logprobs")))
        )
    out += [response_call_item(job.id, n, c, status) for n, c in enumerate(calls)]
    return out, finish


_RESPONSE_STATUS = {
    "queued": "queued",
    "dispatched": "queued",
    "running": "in_progress",
    "failed": "failed",
    "expired": "failed",
    "cancelled": "cancelled",
}


def response_of(job: JobRecord) -> dict[str, Any]:
    """A job as OpenAI's `response` object, in whatever state it is. A cancelled one shows what it
    had generated when it was cancelled (its usage, billed, and its partial text, as its row keeps
    them: `Lifecycle.cancel` in core/jobs/lifecycle.py)."""
    m = response_meta(job)
    output: list[dict[str, Any]] = []
    incomplete = None
    err = None
    if job.state == "succeeded":
        output, finish = response_output(job)
        status = "incomplete" if finish == "length" else "completed"
        if finish == "length":
            incomplete = {"reason": "max_output_tokens"}
    else:
        status = _RESPONSE_STATUS.get(job.state, "in_progress")
        if status == "failed":
            err = response_error(error_of(job))
        elif status == "cancelled" and job.result:
            output, _ = response_output(job, "incomplete")
    finished = job.finished_at if status == "completed" else None
    u = usage_of(job) if job.usage is not None else None
    return response_object(job, m, status, output, u, err, incomplete, finished)


def response_object(
    job: JobRecord,
    m: dict[str, Any],
    status: str,
    output: list[dict[str, Any]],
    u: Usage | None,
    err: dict[str, Any] | None,
    incomplete: dict[str, Any] | None,
    completed_at: datetime | float | None = None,
) -> dict[str, Any]:
    """The `response` object of a job (`m`: its `response_meta`) with this status, output and usage:
    a stored job's (`response_of`) or a stream's snapshot (core/protocol/responses.Events)."""
    done_at = _ts(completed_at) if isinstance(completed_at, datetime) else completed_at
    return {
        "id": response_id(job.id),
        "object": "response",
        "created_at": _ts(job.created_at),
        "status": status,
        "background": m.get("background", False),
        "completed_at": done_at,
        "error": err,
        "incomplete_details": incomplete,
        "instructions": m.get("instructions"),
        "max_output_tokens": m.get("max_output_tokens"),
        "max_tool_calls": m.get("max_tool_calls"),
        "model": job.model,
        "output": output,
        "parallel_tool_calls": m.get("parallel_tool_calls", True),
        "previous_response_id": m.get("previous_response_id"),
        "prompt_cache_key": m.get("prompt_cache_key"),
        "reasoning": m.get("reasoning") or {"effort": None, "summary": None},
        "safety_identifier": m.get("safety_identifier"),
        "service_tier": service_tier(job),
        "store": m.get("store", True),
        "temperature": m.get("temperature"),
        "text": m.get("text") or {"format": {"type": "text"}},
        "tool_choice": m.get("tool_choice", "auto"),
        "tools": m.get("tools") or [],
        "top_logprobs": m.get("top_logprobs", 0),
        "top_p": m.get("top_p"),
        "truncation": m.get("truncation", "disabled"),
        "usage": response_usage(u) if u is not None else None,
        "user": m.get("user"),
        "metadata": m.get("metadata") or {},
    }


def response_deleted(resp_id: str) -> dict[str, Any]:
    return {"id": resp_id, "object": "response", "deleted": True}


# -- stored chat completions (`store: true`, core/jobs/chat_store.py) -------------------------------


def stored_chat_completion(job: JobRecord, fingerprint: str, metadata: dict[str, str] | None) -> dict[str, Any]:
    """A stored chat completion, as the stored-completion routes answer it: the object its create
    answered, with its `metadata` (OpenAI's stored object echoes it)."""
    return {**chat_completion(job, fingerprint), "metadata": metadata or {}}


def chat_completion_deleted(completion_id: str) -> dict[str, Any]:
    return {"id": completion_id, "object": "chat.completion.deleted", "deleted": True}


def stored_chat_message(completion_id: str, index: int, message: Mapping[str, Any]) -> dict[str, Any]:
    """One message a stored completion was asked with (`message`: as the request sent it), in OpenAI's
    shape: its `content` as one string (parts joined as the prompt joined them) and, when it was sent
    as parts, those in `content_parts`."""
    content = message.get("content")
    parts = content if isinstance(content, list) else None
    out: dict[str, Any] = {
        "id": f"{completion_id}-{index}",
        "role": message["role"],
        "content": "\n".join(p.get("text") or "" for p in parts) if parts is not None else content,
        "name": message.get("name"),
        "content_parts": parts,
    }
    for extra in ("tool_calls", "tool_call_id", "refusal"):
        if message.get(extra) is not None:
            out[extra] = message[extra]
    return out
