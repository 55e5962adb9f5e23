"""Creating and awaiting completion jobs: the use case behind POST /v1/completions.

`Completions.create` takes a validated wire request to a stored, admitted, dispatched job; `wait`
waits for a job's end. The route only chooses how to answer (stream, wait, or 202). Everything it
talks to (sessions, Redis, settings, Idempotency-Keys, the broker, tokenizers) is given at
construction (api/app.py), so a test can hand it fakes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import redis.asyncio as aioredis
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from core.config import Settings
from core.errors import DomainError, ErrorKind, invalid, not_found
from core.generation.events import Done, is_terminal
from core.generation.params import GenerationParams
from core.generation.prompt import Prompt
from core.generation.tokenizer import Tokenizer
from core.idempotency import Claim, Idempotency
from core.infra import redis_keys, threads
from core.infra.autocommit import one_statement_async
from core.infra.metrics import ADMITTED
from core.infra.orm import Job
from core.infra.streams import read
from core.infra.tokenizers import context_length, tokenizer_for
from core.infra.transient import DATABASE
from core.jobs import affinity, chat_store, live_workers, tiers, transitions
from core.jobs.follow import HEARTBEAT, follow
from core.jobs.submit import Send, Submitter
from core.protocol.schemas import ChatCompletionRequest, CompletionRequest
from core.protocol.translate import chat_to_generation, compile_constraint, reservation, to_generation
from core.registry import chat_template_for, resolve, settings_for
from core.states import JobState
from core.tenancy import limits, quota
from core.tenancy.admission import REQUEST_TAKEN, admit, precheck, refusal, take_request
from core.tenancy.keys import Principal
from core.tenancy.quota import Quotas

LIVE_CACHE_S = 1.0


@dataclass
class Created:
    job: Job
    headers: dict[str, str] = field(default_factory=dict)  # rate-limit and ignored-parameter headers
    replayed: bool = False  # an Idempotency-Key retry: the job the first request created


def check_model(model: str, settings: Settings) -> str:
    """The served model id a request's `model` names (an alias resolves), or a 404."""
    served = resolve(model, settings)
    if served is None:
        raise not_found(
            f"The model '{model}' does not exist or you do not have access to it.",
            param="model",
            code="model_not_found",
        )
    return served


# Tokens a prompt has at least, from its characters (a token's text is rarely 64 characters long),
# capped low so that a prompt truncated to a small context is never refused for more than it costs.
_CHARS_PER_TOKEN_MAX = 64
_FLOOR_CAP = 256


def prompt_floor(body: CompletionRequest | ChatCompletionRequest) -> int:
    """A lower bound of the tokens a request will be charged, known before its prompt is tokenized."""
    if isinstance(body, ChatCompletionRequest):
        chars = sum(len(m.text() or "") for m in body.messages)
        return min(_FLOOR_CAP, max(1, chars // _CHARS_PER_TOKEN_MAX))
    pieces = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    flat = [q for p in pieces for q in (p if isinstance(p, list) else [p])]
    ids = sum(1 for p in flat if isinstance(p, int))
    chars = sum(len(p) for p in flat if isinstance(p, str))
    return min(_FLOOR_CAP, max(1, ids + chars // _CHARS_PER_TOKEN_MAX))


def forgotten(job: Any) -> bool:
    """A response deleted, or never stored (`store: false`), or a stored chat completion deleted: every
    route that reads jobs answers it as it answers an unknown id, not only the API that deleted it."""
    m = (job.chat or {}).get("response") or {}
    return bool(m.get("deleted")) or m.get("store") is False or chat_store.is_deleted(job.chat)


def _affinity(body: CompletionRequest | ChatCompletionRequest, prompts: list[Any], tenant_id: int) -> int:
    """The request's prefix-affinity key (core/jobs/affinity.py): which worker's cache should serve it."""
    if isinstance(body, ChatCompletionRequest):
        if body.prompt_cache_key:
            return affinity.from_cache_key(tenant_id, body.prompt_cache_key)
        return affinity.from_messages(tenant_id, body.messages)
    return affinity.from_tokens(tenant_id, prompts[0].ids if prompts else [])


class Completions:
    """The completion use case. `send` hands jobs to Celery (core/infra/broker.AsyncSender);
    `tokenizers` finds a model's tokenizer (core/infra/tokenizers.tokenizer_for, loaded once)."""

    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        rds: aioredis.Redis,
        settings: Settings,
        keys: Idempotency,
        send: Send,
        tokenizers: Callable[[str], Tokenizer] = tokenizer_for,
    ) -> None:
        self.sessions, self.redis, self.settings, self.keys = sessions, rds, settings, keys
        self.submit = Submitter(
            sessions, send, self.capacity, lambda: live_workers.wake_dispatcher_async(rds), self.fleet
        )
        self.tokenizers = tokenizers
        self.quotas = Quotas(sessions, rds, settings)
        self._warm: set[str] = set()  # models whose tokenizer this process has loaded
        self._live_until: dict[str, float] = {}  # model -> until when a live worker was last seen
        self._slots: dict[str, int] = {}  # model -> its live workers' slots, as last seen
        self._fleet: dict[str, list[tuple[str, int]]] = {}  # model -> its live workers (name, slots), as last seen

    async def _live(self, model: str) -> bool:
        """Whether a worker serves `model`. A yes is kept for a second (a worker is taken for gone only
        after `live_workers.LIVE_S` of silence anyway): one Redis round trip per model per second, not per
        request. A no is asked again each time, so a worker that comes back is seen at once."""
        now = time.monotonic()
        if self._live_until.get(model, 0.0) > now:
            return True
        live = await live_workers.live_async(self.redis, model)
        self._slots[model] = live_workers.slots(live)
        self._fleet[model] = live_workers.fleet(live)
        if live:
            self._live_until[model] = now + LIVE_CACHE_S
            return True
        self._live_until.pop(model, None)
        return False

    async def has_worker(self, model: str) -> bool:
        """Whether a worker serves `model` now (a yes kept for a second: `_live`)."""
        return await self._live(model)

    def capacity(self, model: str) -> int:
        """How many of a model's requests may be in flight before a new one waits in Postgres for the fair
        dispatcher: its live workers' slots, as last seen (within a second), the bound the dispatcher keeps
        too (core/dispatcher.py). None live: every request waits there until one is."""
        return self._slots.get(model, 0)

    def fleet(self, model: str) -> list[tuple[str, int]]:
        """A model's live workers (name, slots) as last seen (within a second): where prefix affinity may
        send its requests (core/jobs/affinity.py). Off (SPOOL_AFFINITY): none, so any worker takes any."""
        return self._fleet.get(model, []) if self.settings.affinity else []

    async def create(
        self,
        principal: Principal,
        body: CompletionRequest | ChatCompletionRequest,
        idempotency_key: str | None = None,
        endpoint: str = "/v1/completions",
        queued: bool = False,
        request_id: str | None = None,
        small: bool = False,
    ) -> Created:
        """`queued`: the client asked for a 202 and will poll, so it is accepted even while no worker
        serves the model; a request that waits or streams gets a 503 with Retry-After instead.
        `small`: the body was small (api/bodies.INLINE_BYTES); unless it asks for a grammar, it is
        prepared on the loop (a short prompt's tokens cost less than a thread hop)."""
        payload = None  # only a key's request hash needs it; a big body's dump is not for the event loop
        if idempotency_key is not None:
            payload = await threads.run(
                "prepare", lambda: body.model_dump(mode="json", exclude_unset=True, by_alias=False)
            )
        async with self.keys.held(principal.tenant.id, idempotency_key, endpoint, payload) as claim:
            if claim is not None and claim.replay is not None:
                job = await self.get(claim.replay, principal.tenant.id)
                if job is not None:
                    return Created(job, {"idempotent-replayed": "true"}, replayed=True)
            return await self._create(principal, body, claim, queued, request_id, small)

    async def _create(
        self,
        principal: Principal,
        body: CompletionRequest | ChatCompletionRequest,
        claim: Claim | None,
        queued: bool,
        request_id: str | None = None,
        small: bool = False,
    ) -> Created:
        settings, rds = self.settings, self.redis
        headers: dict[str, str] = {}
        unknown = body.unknown_fields()
        if unknown:
            if settings.unknown_params != "ignore":
                raise invalid(unknown[0], f"Unrecognized request argument supplied: {unknown[0]}", "unknown_parameter")
            headers["x-spool-ignored-params"] = ",".join(unknown)
        body.model = check_model(body.model, settings)
        tenant = principal.tenant
        tier = tiers.resolve(body.service_tier, tenant.allow_priority)
        if tier == tiers.Tier.flex:  # refused at once while the flex lane is full: nothing counted or taken
            await tiers.check_flex(self.sessions, body.model, settings.flex_max_queued)
        # A model that may have no worker (min_workers 0) holds the request for one instead of refusing.
        held = settings_for(body.model, settings).min_workers == 0
        live = await self._live(body.model)  # asked even when it may wait: it refreshes `fleet` too
        if not queued and not live and not held:
            raise DomainError(
                ErrorKind.unavailable,
                f"No worker is serving '{body.model}' right now; retry shortly, or send the request with "
                "'Prefer: respond-async' to queue it.",
                param="model",
                code="model_not_loaded",
                headers={"retry-after": "5"},
            )
        # Refused before the prompt is counted when even its floor could not be admitted (a tenant out of
        # tokens per minute or day, or of queued places): counting 8 MiB of prompt costs seconds of CPU.
        await precheck(rds, principal, prompt_floor(body))
        constrained = body.constrained()
        if small and body.model in self._warm and not constrained:
            tok, ms, (params, prompts, chat, stored, need, key) = self._stored_form(body, tenant.id)
        else:
            tok, ms, (params, prompts, chat, stored, need, key) = await threads.run(
                "prepare", self._stored_form, body, tenant.id
            )
            self._warm.add(body.model)  # its tokenizer is loaded: the next small request may stay on the loop
        # The tenant's stored bytes (and Redis bytes) before its rate limits: nothing is stored or taken.
        await self.quotas.check(tenant, need)
        job = transitions.new_job(
            tenant_id=tenant.id,
            key_id=principal.key.id,
            model=body.model,
            params=stored[0],
            prompts=stored[1],
            stream=bool(body.stream),
            user=body.user,
            priority=body.priority or 0,
            service_tier=tier.value,
            reserved_tokens=reservation(params, prompts, context_length(tok, ms)),
            chat=chat,
            request_id=request_id,
            affinity=key,
        )
        headers |= await admit(rds, principal, job.id, job.reserved_tokens)
        try:
            if constrained:
                # Compiled only now, once the tenant's limits have taken the request: a tenant over its
                # quota is refused before any grammar is built (its size was checked in `_prepare`).
                grammar = await threads.run("prepare", compile_constraint, body, ms)
                job.params = params.model_copy(update={"grammar": grammar}).to_json()
            await self.submit(job, cap=tenant.max_concurrent, claim=claim)
        except BaseException:
            await limits.settle_async(rds, job.id, 0)  # nothing was stored: give the limits back
            raise
        ADMITTED.labels(str(tenant.id), body.model).inc()
        return Created(job, headers)

    def _prepare(self, body: CompletionRequest | ChatCompletionRequest) -> tuple[Tokenizer, Settings, Any]:
        """Off the event loop in one hop: the tokenizer (loaded once), this model's settings (engine,
        context, batch) and the translated request."""
        tok = self.tokenizers(body.model)
        ms = settings_for(body.model, self.settings)
        params, prompts, chat = translate(body, ms, tok, compile=False)
        kept = chat_store.kept(body) if isinstance(body, ChatCompletionRequest) else None
        if kept is not None:  # `store: true`: kept for the stored-completion routes (core/jobs/chat_store.py)
            chat = {**(chat or {}), "stored": kept}
        return tok, ms, (params, prompts, chat)

    def _stored_form(
        self, body: CompletionRequest | ChatCompletionRequest, tenant_id: int
    ) -> tuple[Tokenizer, Settings, Any]:
        """`_prepare`, then the job's params and prompts as they will be stored, the bytes the job
        stores (for the tenant's stored-bytes quota) and its affinity key: serialized in the same hop,
        never on the loop for a large body."""
        tok, ms, (params, prompts, chat) = self._prepare(body)
        stored = (params.to_json(), [p.to_json() for p in prompts])
        need = quota.json_bytes(*stored, chat)
        return tok, ms, (params, prompts, chat, stored, need, _affinity(body, prompts, tenant_id))

    async def get(self, job_id: str, tenant_id: int, *, without_result: bool = False) -> Job | None:
        query = transitions.get_for_tenant(job_id, tenant_id, without_result=without_result)
        async with self.sessions() as session:
            return (await session.execute(query)).scalar()

    async def readable(self, job_id: str, tenant_id: int, *, without_result: bool = False) -> Job | None:
        """`get`, for a client's read: None for a response that was deleted or never stored."""
        job = await self.get(job_id, tenant_id, without_result=without_result)
        return None if job is None or forgotten(job) else job

    async def admit_request(self, principal: Principal) -> dict[str, str]:
        """The request's place among its tenant's limits taken before work its body does not show (a
        chain of earlier responses to expand): its requests per minute (unless the edge took them,
        api/request_gate.py) and a look at its unfinished jobs. Returns the headers, or raises OpenAI's
        429. Set them as `REQUEST_TAKEN` for `create`, whose admission then takes only the rest."""
        taken = REQUEST_TAKEN.get()
        headers = taken if taken is not None else await take_request(self.redis, principal)
        cap = principal.tenant.max_queued or 0
        if cap:
            live = await self.redis.zcount(
                redis_keys.tenant_limit(principal.tenant.id, "active"), time.time() * 1000, "+inf"
            )
            if live >= cap:
                raise refusal(principal.tenant.id, limits.Decision(False, "queued_jobs", 1.0, headers))
        return headers

    async def wait(self, reader: read.Reader, job: Job, tenant_id: int, timeout_s: float) -> Job | None:
        """`job` with its ending (state, result, usage, error and times) filled in once it has ended;
        None if it is still running after `timeout_s`. A small result comes in the `Done` event itself
        (state, attempt, result and usage set; the times are not read). Otherwise only the ending's
        columns are read back, with Core: the rest of the row is what the API stored or read already,
        and a whole ORM row per answered request was a tenth of the API's CPU on short jobs."""

        async def ending() -> Any:
            found = await one_statement_async(
                self.sessions, transitions.ENDING, {"b_id": job.id, "b_tenant": tenant_id}
            )
            return found[0] if found else None

        async def ended() -> Any:
            try:
                row = await ending()
            except DATABASE:
                return None  # Postgres is restarting: keep following the stream, ask again later
            return row if row is not None and transitions.is_terminal(row.state) else None

        try:
            async with asyncio.timeout(timeout_s):
                async for item in follow(reader, job.id, ended):
                    if item is not HEARTBEAT and is_terminal(item[1]):  # type: ignore[index]
                        ev = item[1]  # type: ignore[index]
                        if isinstance(ev, Done) and ev.result is not None:
                            # Its result rode along (a small one): the answer needs no read-back.
                            return _with_ending(job, _ending_of(job, ev))
                        break
                # The job is stored: an outage now must cost a wait (or a 202 to poll), never a 5xx.
                while True:
                    try:
                        row = await ending()
                        break
                    except DATABASE:
                        await asyncio.sleep(1.0)
        except TimeoutError:
            return None
        return None if row is None else _with_ending(job, row)


def _ending_of(job: Job, done: Done) -> Any:
    """The ending a `Done` event that carries its result tells (what `transitions.ENDING` reads)."""
    usage = done.usage.model_dump(mode="json")
    values = {"state": JobState.succeeded.value, "attempt": done.attempt, "result": done.result, "usage": usage}
    return SimpleNamespace(**{"error": None, "started_at": job.started_at, "finished_at": job.finished_at, **values})


def _with_ending(job: Job, row: Any) -> Job:
    for name in transitions.ENDING_COLUMNS:
        setattr(job, name, getattr(row, name))
    return job


def translate(
    body: CompletionRequest | ChatCompletionRequest, settings: Settings, tok: Tokenizer, compile: bool = True
) -> tuple[GenerationParams, list[Prompt], dict[str, Any] | None]:
    """Either endpoint's request -> (params, prompts, how a chat job renders; None for completions).
    The API and the batch validator both call this. `compile=False`: a constraint is size-checked but
    not compiled (the API compiles it after admission: `compile_constraint`)."""
    if isinstance(body, ChatCompletionRequest):
        return chat_to_generation(body, settings, tok, chat_template_for(body.model, settings, tok), compile)
    params, prompts = to_generation(body, settings, tok, compile)
    return params, prompts, None
