"""The Responses API's use cases (`/v1/responses`), on the chat job path.

A response is a chat job: `Responses.create_response` translates the request (with the stored chain
of its `previous_response_id`) into a chat request and creates the job through `Completions`, which
stores, admits and dispatches it as it does every chat completion (limits, fair scheduling,
Idempotency-Keys, usage). The job's `chat` column carries what only the Responses API reads
(core/protocol/responses.meta); the response id is the job id renamed (`resp_<hex>` <->
`cmpl-<hex>`). Reading, deleting and listing a response read and write that row; its stream is the
job's event stream (core/jobs/stream.py), rendered by core/protocol/responses.Events.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from core.errors import DomainError, ErrorKind, invalid, not_found
from core.generation.events import Event, TerminalRow, result_of
from core.infra import streams
from core.infra.autocommit import one_statement_async
from core.infra.orm import Job
from core.infra.transient import DATABASE
from core.jobs import transitions
from core.jobs.service import Completions, Created, check_model
from core.jobs.stream import HEARTBEAT, Ended, follow_batches
from core.protocol import render
from core.protocol import responses as wire
from core.protocol.responses import ResponseChat, ResponsesRequest
from core.states import JobState
from core.tenancy.keys import Principal

ENDPOINT = "/v1/responses"


def _gone(resp_id: str, param: str | None = None) -> DomainError:
    return not_found(f"Response with id '{resp_id[:128]}' not found.", param=param, code="response_not_found")


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
        earlier = await self.chain(req.previous_response_id, principal.tenant.id)
        chat = wire.to_chat(req, earlier, model)
        # An Idempotency-Key's request hash covers the chat request; what only the Responses API
        # reads (metadata, store, background, ...) is folded into the endpoint it is recorded under,
        # so the same key with other settings is refused (422), not answered with the first response.
        settings_hash = hashlib.sha256(json.dumps(chat.response, sort_keys=True).encode()).hexdigest()[:16]
        try:
            created = await self.create(
                principal,
                chat,
                idempotency_key,
                f"{ENDPOINT}#{settings_hash}",
                queued=bool(req.background),
                request_id=request_id,
                small=small,
            )
        except DomainError as exc:
            raise wire.rename(exc) from exc
        created.headers |= headers
        return created

    async def find(self, resp_id: str, tenant_id: int) -> Job | None:
        """A stored response of this tenant (None: absent, another tenant's, deleted, or never stored)."""
        job_id = wire.job_id_of(resp_id)
        if job_id is None:
            return None
        job = await self.get(job_id, tenant_id)
        if job is None or not render.is_response(job):
            return None
        m = render.response_meta(job)
        return None if m.get("deleted") or m.get("store") is False else job

    async def chain(self, resp_id: str | None, tenant_id: int) -> list[dict[str, Any]]:
        """The conversation of a `previous_response_id`, oldest first, as chat messages: each earlier
        response's input items and output. Instructions are not carried over (OpenAI's rule)."""
        rows: list[Job] = []
        at = resp_id
        while at is not None:
            if len(rows) >= wire.MAX_CHAIN:
                raise invalid(
                    "previous_response_id", f"The chain of previous responses is longer than {wire.MAX_CHAIN}."
                )
            job = await self.find(at, tenant_id)
            if job is None:
                raise _gone(at, "previous_response_id")
            if not transitions.is_terminal(job.state):
                raise DomainError(
                    ErrorKind.invalid,
                    f"Previous response '{at}' has not finished yet (status "
                    f"'{render.response_of(job)['status']}'); wait for it, then continue the conversation.",
                    param="previous_response_id",
                    code="previous_response_in_progress",
                )
            rows.append(job)
            at = render.response_meta(job).get("previous_response_id")
        out: list[dict[str, Any]] = []
        for job in reversed(rows):
            out += wire.chain_messages(job)
        return out

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
        reader: streams.Reader,
        job: Job,
        tenant_id: int,
        after: int | None = None,
        heavy: Callable[[], contextlib.AbstractAsyncContextManager[None]] | None = None,
    ) -> AsyncIterator[dict[str, Any] | object]:
        """The response's stream events from the start, or those numbered after `after`; HEARTBEAT
        while the job is silent. The job's stream is rendered one entry at a time, so the numbering is
        the same for every reader; once the stream is gone, the row's text is cut as the stream's
        entries were (their marks), which numbers it alike."""
        r = wire.Events(job)

        def fresh(evs: list[dict[str, Any]]) -> list[dict[str, Any]]:
            return [e for e in evs if after is None or e["sequence_number"] > after]

        for e in fresh(r.start()):
            yield e
        check = self._row_check(job.id, tenant_id)
        row = await check()
        if row is not None and not await _has_stream(reader, job.id):
            for ev in await _rebuilt(reader, job.id, row):
                for e in fresh(r.render(ev)):
                    yield e
            return
        following = (
            follow_batches(reader, job.id, check, last_id="0-0", heavy=heavy)  # a backlog: inside the tenant's gate
            if heavy is not None
            else follow_batches(reader, job.id, check, last_id="0-0")
        )
        async with contextlib.aclosing(following) as batches:
            async for batch in batches:
                if batch is HEARTBEAT:
                    yield HEARTBEAT
                    continue
                for _, item in batch:  # type: ignore[union-attr]
                    if isinstance(item, Ended):
                        return
                    for e in fresh(r.render(item)):
                        yield e


async def _has_stream(reader: streams.Reader, job_id: str) -> bool:
    """Whether the job's stream still holds its entries (an ended job's is kept only minutes)."""
    got = await reader.entries_upto(job_id, "+")
    return bool(got)


async def _rebuilt(reader: streams.Reader, job_id: str, row: Any) -> list[Event]:
    """An ended job's events from its row, its text cut as its stream's entries were (a cancelled
    job's: the text it had generated, which its row keeps)."""
    end = wire.terminal_of(row)
    if row.state not in (JobState.succeeded, JobState.cancelled):
        return [end]
    choices = [c for c in result_of(row).choices if c.index == 0]
    if not choices:
        return [end]
    marks = await reader.marks(job_id)
    return [*wire.rebuilt_deltas(choices[0].text, choices[0].finish_reason, marks or []), end]
