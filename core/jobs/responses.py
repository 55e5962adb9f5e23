"""The Responses API's use cases (`/v1/responses`), on the chat job path.

A response is a chat job: `Responses.create_response` translates the request (with the stored chain
of its `previous_response_id`) into a chat request and creates the job through `Completions`, which
stores, admits and dispatches it as it does every chat completion (limits, fair scheduling,
Idempotency-Keys, usage). The job's `chat` column carries what only the Responses API reads
(core/protocol/responses.meta); the response id is the job id renamed (`resp_<hex>` <->
`cmpl-<hex>`). Reading, deleting and listing a response read and write that row; its stream is the
job's event stream (core/jobs/follow.py), rendered by core/protocol/responses.Events.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, cast

from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from core.errors import DomainError, ErrorKind, invalid, not_found
from core.generation.events import Event, TerminalRow, is_terminal, result_of
from core.infra import threads
from core.infra.autocommit import one_statement_async
from core.infra.orm import Job
from core.infra.streams import read
from core.infra.transient import DATABASE
from core.jobs import transitions
from core.jobs.follow import HEARTBEAT, Ended, follow_grouped, row_marks
from core.jobs.service import Completions, Created, check_model, forgotten
from core.protocol import render
from core.protocol import responses as wire
from core.protocol.responses import ResponseChat, ResponsesRequest
from core.states import JobState
from core.tenancy.admission import REQUEST_TAKEN
from core.tenancy.keys import Principal

ENDPOINT = "/v1/responses"

# The previous response's row as far as bounding its chain needs: no input, no output.
_HEAD = text(
    "SELECT state, chain_links, chain_bytes, "
    "coalesce(chat->'response'->>'deleted', 'false') = 'true' OR chat->'response'->>'store' = 'false' AS hidden "
    "FROM jobs WHERE id = :id AND tenant_id = :tenant AND chat->'response' IS NOT NULL"
)
# The whole chain in one statement, newest first, at most :most links; JSON comes back as text, parsed
# on a prepare thread, not by the driver on the event loop.
_CHAIN = text(
    "WITH RECURSIVE chain(id, prev, depth) AS ("
    " SELECT id, chat->'response'->>'previous_response_id', 1 FROM jobs WHERE id = :id AND tenant_id = :tenant"
    " UNION ALL"
    " SELECT j.id, j.chat->'response'->>'previous_response_id', c.depth + 1 FROM chain c"
    " JOIN jobs j ON j.id = 'cmpl-' || substr(c.prev, 6) AND j.tenant_id = :tenant"
    " WHERE left(c.prev, 5) = 'resp_' AND c.depth < :most)"
    " SELECT j.id, j.state, j.model, j.created_at, j.chat::text AS chat, j.result::text AS result"
    " FROM chain c JOIN jobs j ON j.id = c.id ORDER BY c.depth"
)
# A live stream's group of this many events or fewer is rendered on the loop (a token or a few); a
# backlog, or the end (the whole response object), on a prepare thread.
_ON_LOOP_EVENTS = 16
_NOT_ENDED = {JobState.queued: "queued", JobState.dispatched: "queued", JobState.running: "in_progress"}


@dataclass
class Batch:
    """Stream events to send together; `heavy`: built off the loop, so framed off it too (the caller
    holds the tenant's gate while it frames and sends them, when the group was built inside it)."""

    events: list[dict[str, Any]]
    heavy: bool = False


def _gone(resp_id: str, param: str | None = None) -> DomainError:
    return not_found(f"Response with id '{resp_id[:128]}' not found.", param=param, code="response_not_found")


def _too_long(why: str) -> DomainError:
    return invalid("previous_response_id", f"The chain of previous responses {why}; start a new conversation.")


def _ended(resp_id: str, state: str) -> None:
    if not transitions.is_terminal(state):
        raise DomainError(
            ErrorKind.invalid,
            f"Previous response '{resp_id[:128]}' has not finished yet (status "
            f"'{_NOT_ENDED.get(JobState(state), 'in_progress')}'); wait for it, then continue the conversation.",
            param="previous_response_id",
            code="previous_response_in_progress",
        )


def _link(row: Any) -> Any:
    """A chain row (`_CHAIN`) as the record `chain_messages` renders."""
    chat, result = json.loads(row.chat) if row.chat else None, json.loads(row.result) if row.result else None
    return SimpleNamespace(
        id=row.id, state=row.state, model=row.model, created_at=row.created_at, chat=chat, result=result, usage=None
    )


def _chain(rows: list[Any], most: int) -> list[dict[str, Any]]:
    """The conversation of a `previous_response_id` (`rows`: its chain, newest first), oldest first, as
    chat messages: each earlier response's input items and output. Instructions are not carried over
    (OpenAI's rule). Blocking: on a prepare thread."""
    links = [_link(r) for r in rows]
    if len(links) > most:
        raise _too_long(f"is longer than {most}")
    for n, job in enumerate(links):
        resp_id = render.response_id(job.id)
        if n and (not render.is_response(job) or forgotten(job)):  # the head was checked: `chain_head`
            raise _gone(resp_id, "previous_response_id")
        _ended(resp_id, job.state)
    last = render.response_meta(links[-1]).get("previous_response_id") if links else None
    if last is not None:
        raise _gone(last, "previous_response_id")  # a link the chain names is not there
    out: list[dict[str, Any]] = []
    for job in reversed(links):
        out += wire.chain_messages(job)
    return out


def _translate(req: ResponsesRequest, rows: list[Any] | None, model: str, most: int) -> tuple[ResponseChat, str]:
    """The request, with its chain's messages, as the chat request it runs as, and the hash of its
    settings. An Idempotency-Key's request hash covers the chat request; what only the Responses API
    reads (metadata, store, background, ...) is folded into the endpoint it is recorded under, so the
    same key with other settings is refused (422), not answered with the first response."""
    if rows is not None and not rows:
        raise _gone(req.previous_response_id or "", "previous_response_id")  # deleted since `chain_head`
    chat = wire.to_chat(req, [] if rows is None else _chain(rows, most), model)
    settings_hash = hashlib.sha256(json.dumps(chat.response, sort_keys=True).encode()).hexdigest()[:16]
    return chat, settings_hash


class Responses(Completions):
    """`Completions`, with the Responses API's own reads and writes. The chat request it creates
    jobs from (`ResponseChat`) carries the response's settings and items into the job's `chat`."""

    def _prepare(self, body: Any) -> Any:
        tok, ms, (params, prompts, chat) = super()._prepare(body)
        if isinstance(body, ResponseChat):
            chat = {**(chat or {}), "response": body.response}
        return tok, ms, (params, prompts, chat)

    async def create_response(
        self,
        principal: Principal,
        req: ResponsesRequest,
        idempotency_key: str | None = None,
        request_id: str | None = None,
        small: bool = False,
    ) -> Created:
        """The job a Responses request runs as: stored, admitted and dispatched (a background one is
        accepted while no worker serves its model, as `Prefer: respond-async` is on chat)."""
        headers: dict[str, str] = {}
        unknown = wire.unknown_fields(req)
        if unknown:
            if self.settings.unknown_params != "ignore":
                raise invalid(unknown[0], f"Unrecognized request argument supplied: {unknown[0]}", "unknown_parameter")
            headers["x-spool-ignored-params"] = ",".join(unknown)
        model = check_model(req.model, self.settings)
        tenant_id = principal.tenant.id
        # A chain's size is known from one row before any of it is read, and the tenant's limits take
        # the request before it is expanded: what a small body costs to expand is bounded and counted.
        chained = req.previous_response_id is not None
        if chained:
            await self.chain_head(req.previous_response_id, tenant_id)  # type: ignore[arg-type]
        token = REQUEST_TAKEN.set(await self.admit_request(principal))
        most = self.settings.responses_chain_max_links
        try:
            if chained:
                rows = await self.chain_rows(req.previous_response_id, tenant_id)  # type: ignore[arg-type]
                chat, settings_hash = await threads.run("prepare", _translate, req, rows, model, most)
            elif small:
                chat, settings_hash = _translate(req, None, model, most)
            else:
                chat, settings_hash = await threads.run("prepare", _translate, req, None, model, most)
            created = await self.create(
                principal,
                chat,
                idempotency_key,
                f"{ENDPOINT}#{settings_hash}",
                queued=bool(req.background),
                request_id=request_id,
                small=small and not chained,  # a chain is templated and tokenized on a thread
            )
        except DomainError as exc:
            raise wire.rename(exc) from exc
        finally:
            REQUEST_TAKEN.reset(token)
        created.headers |= headers
        return created

    async def find(self, resp_id: str, tenant_id: int) -> Job | None:
        """A stored response of this tenant (None: absent, another tenant's, deleted, or never stored)."""
        job_id = wire.job_id_of(resp_id)
        if job_id is None:
            return None
        job = await self.get(job_id, tenant_id)
        if job is None or not render.is_response(job) or forgotten(job):
            return None
        return job

    async def exists(self, resp_id: str, tenant_id: int) -> str | None:
        """The job id of a stored response of this tenant, or None, from a few small columns: nothing
        of its input, instructions or output is read (those are loaded by `load`, off the loop)."""
        job_id = wire.job_id_of(resp_id)
        if job_id is None:
            return None
        found = await one_statement_async(self.sessions, _HEAD, {"id": job_id, "tenant": tenant_id})
        return job_id if found and not found[0].hidden else None

    @staticmethod
    def load(sessions: sessionmaker[Session], job_id: str, tenant_id: int) -> Job | None:
        """The response's whole row on a sync session (blocking: a prepare thread's work, since its
        JSON may be megabytes that the driver decodes): what `exists` found, or None once forgotten."""
        with sessions() as session:
            job = session.execute(transitions.get_for_tenant(job_id, tenant_id)).scalar()
        return None if job is None or forgotten(job) else job

    async def chain_head(self, resp_id: str, tenant_id: int) -> None:
        """Whether a `previous_response_id` may be continued, from its row's chain size alone (no
        input or output read): a 404 when it is gone, a 400 while it runs or when its chain holds
        more responses or stored bytes than a continuation may expand."""
        job_id = wire.job_id_of(resp_id)
        found = (
            None
            if job_id is None
            else await one_statement_async(self.sessions, _HEAD, {"id": job_id, "tenant": tenant_id})
        )
        if not found or found[0].hidden:
            raise _gone(resp_id, "previous_response_id")
        head = found[0]
        _ended(resp_id, head.state)
        s = self.settings
        if head.chain_links > s.responses_chain_max_links:
            raise _too_long(f"holds {head.chain_links} responses, more than {s.responses_chain_max_links}")
        if head.chain_bytes > s.responses_chain_max_bytes:
            raise _too_long(f"holds {head.chain_bytes} bytes of stored input, more than {s.responses_chain_max_bytes}")

    async def chain_rows(self, resp_id: str, tenant_id: int) -> list[Any]:
        """Every response of the chain, newest first, in one statement (its JSON as text)."""
        most = self.settings.responses_chain_max_links
        return await one_statement_async(
            self.sessions, _CHAIN, {"id": wire.job_id_of(resp_id), "tenant": tenant_id, "most": most + 1}
        )

    async def delete(self, resp_id: str, tenant_id: int) -> bool:
        job_id = wire.job_id_of(resp_id)
        if job_id is None:
            return False
        found = await one_statement_async(
            self.sessions, transitions.FORGET_RESPONSE, {"id": job_id, "tenant": tenant_id}
        )
        return bool(found)

    def _row_check(self, job_id: str, tenant_id: int):
        async def check() -> TerminalRow | None:
            try:
                row = await self.get(job_id, tenant_id)
            except DATABASE:
                return None  # Postgres is restarting: the stream goes on; asked again at the next silence
            return row if row is not None and transitions.is_terminal(row.state) else None

        return check

    async def events(
        self,
        reader: read.Reader,
        job: Job,
        tenant_id: int,
        after: int | None = None,
        heavy: Callable[[], contextlib.AbstractAsyncContextManager[None]] | None = None,
    ) -> AsyncIterator[Batch | object]:
        """The response's stream events from the start, or those numbered after `after`, in groups;
        HEARTBEAT while the job is silent. The job's stream is rendered one entry at a time, so the
        numbering is the same for every reader; once the stream is gone, the row's text is cut as the
        stream's entries were (their marks), which numbers it alike. What scales with the response
        (its snapshots hold `instructions` and tools; a backlog, an end rebuilt from the row, the
        final object) is built on a prepare thread, the snapshots and rebuilt ends inside `heavy`
        (the tenant's gate), held while the caller frames and sends them."""
        r = wire.Events(job)
        gate = heavy or contextlib.nullcontext

        def fresh(evs: list[dict[str, Any]]) -> list[dict[str, Any]]:
            return [e for e in evs if after is None or e["sequence_number"] > after]

        def render_all(evs: list[Event]) -> list[dict[str, Any]]:
            return [e for ev in evs for e in fresh(r.render(ev))]

        async with gate():
            yield Batch(await threads.run("prepare", lambda: fresh(r.start())), heavy=True)
        check = self._row_check(job.id, tenant_id)
        row = await check()
        if row is not None:
            async with gate():
                if not await _has_stream(reader, job.id):
                    marks = row_marks(row) or await reader.marks(job.id)  # the row's; an older Spool's in Redis
                    rebuilt = await threads.run("prepare", lambda: render_all(_rebuilt(row, marks)))
                    yield Batch(rebuilt, heavy=True)
                    return
        following = (
            follow_grouped(reader, job.id, check, last_id="0-0", heavy=heavy)  # a backlog: inside the tenant's gate
            if heavy is not None
            else follow_grouped(reader, job.id, check, last_id="0-0")
        )
        async with contextlib.aclosing(following) as groups:
            async for group in groups:
                if group is HEARTBEAT:
                    yield HEARTBEAT
                    continue
                items = cast(list[tuple[str | None, Event | Ended]], group)
                ended = next((n for n, (_, item) in enumerate(items) if isinstance(item, Ended)), None)
                evs = [item for _, item in items[:ended] if not isinstance(item, Ended)]
                if len(evs) > _ON_LOOP_EVENTS or any(is_terminal(ev) for ev in evs):
                    yield Batch(await threads.run("prepare", render_all, evs), heavy=True)
                else:
                    yield Batch(render_all(evs))
                if ended is not None:
                    return


async def _has_stream(reader: read.Reader, job_id: str) -> bool:
    """Whether the job's stream still holds its entries (an ended job's is kept only minutes): its
    first entry, never the whole stream."""
    return bool(await reader.page(job_id, "0-0", 1))


def _rebuilt(row: Any, marks: list[read.Mark] | None) -> list[Event]:
    """An ended job's events from its row, its text cut as its stream's entries were (`marks`; a
    cancelled job's: the text it had generated, which its row keeps). Blocking: on a prepare thread."""
    end = wire.terminal_of(row)
    if row.state not in (JobState.succeeded, JobState.cancelled):
        return [end]
    choices = [c for c in result_of(row).choices if c.index == 0]
    if not choices:
        return [end]
    return [*wire.rebuilt_deltas(choices[0].text, choices[0].finish_reason, marks or []), end]
