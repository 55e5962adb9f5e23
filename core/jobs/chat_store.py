"""OpenAI's stored chat completions: a chat completion created with `store: true` is kept and served by
`GET/POST/DELETE /v1/chat/completions/{id}`, `GET /v1/chat/completions` and `.../{id}/messages`.

A stored completion is its chat job: `kept` puts the request's messages and metadata into the job's
`chat` column under `stored` as the job is created (counted in the tenant's stored bytes like the rest
of the row), and everything here reads and writes that row. Decisions:

- `store` omitted or false: nothing is kept (OpenAI's default); the job is still Spool's job, readable
  at /v1/jobs/{id}, as every job is.
- Only a completion that succeeded is a stored completion: while its job is queued or running, or
  after it failed or was cancelled, it is a 404 here (as OpenAI shows a completion only once it is
  made) and is not listed; its job stays readable at /v1/jobs/{id}.
- Another tenant's id, an unknown id and a deleted completion are the same 404.
- Deleting drops the kept messages and metadata and marks the job deleted: it then reads as unknown
  through the job routes too (as a deleted response does); its usage stays in the ledger.

Blocking (sync sessions): each call runs off the event loop (the routes: on a prepare thread, in the
tenant's gate), where rows of megabytes are decoded and rendered.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, cast

from sqlalchemy import Table, func, literal, literal_column, select, text, tuple_
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Session, sessionmaker

from core.errors import DomainError, invalid, not_found
from core.infra.autocommit import one_statement
from core.infra.orm import Job
from core.jobs import transitions
from core.protocol import render
from core.protocol.schemas import ChatCompletionRequest, metadata_problem
from core.states import JobState

# Every id Spool issues fits this; anything else is answered before it reaches the database.
_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")

_JOBS = cast(Table, Job.__table__)
# The partial index's predicate (migration 0016), spelled as it is there so that the planner uses it
# (a bound parameter in its place would not match it).
_IS_STORED = text("(chat -> 'stored') IS NOT NULL")
_SUCCEEDED = _JOBS.c.state == JobState.succeeded.value
# A stored completion's row as the completion object needs it: every column rendering may read (the
# table's own, so a column added later, such as its tier, comes along), never its request (`params`,
# `prompts`) nor the messages it keeps (megabytes, read only by `messages`); its metadata apart.
_LIGHT = (
    *(c for c in _JOBS.c if c.name not in ("params", "prompts", "chat", "marks")),
    literal_column("chat - 'stored'", JSONB).label("chat"),
    literal_column("chat -> 'stored' -> 'metadata'", JSONB).label("metadata"),
)


def _mine(tenant_id: int, completion_id: str | None = None) -> list[Any]:
    """The tenant's stored completions (and of them, the one named)."""
    found = [_JOBS.c.tenant_id == tenant_id, _IS_STORED]
    return found if completion_id is None else [*found, _JOBS.c.id == completion_id]


def kept(body: ChatCompletionRequest) -> dict[str, Any] | None:
    """What a chat request with `store: true` keeps on its job's `chat` (None: not stored): its
    messages as sent, for `messages`, and its metadata (validated by the schema: 16 pairs, 64-char
    keys, 512-char values)."""
    if not body.store:
        return None
    messages = [m.model_dump(mode="json", exclude_none=True) for m in body.messages]
    return {"messages": messages, "metadata": body.metadata or {}}


def is_deleted(chat: Mapping[str, Any] | None) -> bool:
    """A stored chat completion that was deleted (`StoredChats.delete`)."""
    return bool((chat or {}).get("deleted"))


def metadata_filter(query: Mapping[str, str] | Any) -> dict[str, str]:
    """The `metadata[key]=value` pairs of a list request's query (how the SDK sends `metadata`), checked
    as metadata is."""
    found = {k[9:-1]: v for k, v in query.items() if k.startswith("metadata[") and k.endswith("]")}
    problem = metadata_problem(found)
    if problem:
        raise invalid("metadata", problem)
    return found


def _gone(completion_id: str) -> DomainError:
    return not_found(
        f"No stored chat completion with id '{completion_id[:128]}'. Only chat completions created with "
        "'store': true are kept, once they have succeeded.",
        param="completion_id",
        code="not_found",
    )


def _rendered(row: Any, fingerprints: render.Fingerprints) -> dict[str, Any]:
    return render.stored_chat_completion(row, fingerprints(row.model), row.metadata)


class StoredChats:
    """The stored-completion routes' use cases, on the tenant's chat jobs."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.sessions = sessions

    def _one(self, stmt: Any, completion_id: str) -> Any:
        """The one row `stmt` finds or writes, or the 404 (an id Spool never issues: before any read)."""
        rows = one_statement(self.sessions, stmt) if _ID.fullmatch(completion_id) else []
        if not rows:
            raise _gone(completion_id)
        return rows[0]

    def retrieve(self, completion_id: str, tenant_id: int, fingerprints: render.Fingerprints) -> dict[str, Any]:
        """The completion object as its create answered it, with its metadata."""
        stmt = select(*_LIGHT).where(*_mine(tenant_id, completion_id), _SUCCEEDED)
        return _rendered(self._one(stmt, completion_id), fingerprints)

    def page(
        self,
        tenant_id: int,
        fingerprints: render.Fingerprints,
        *,
        after: str | None = None,
        limit: int = 20,
        order: str = "asc",
        metadata: Mapping[str, str] | None = None,
        model: str | None = None,
    ) -> dict[str, Any]:
        """A page of the tenant's stored completions, oldest first (`order`: asc) or newest first: those
        whose metadata holds every pair of `metadata` and, given `model`, of that model."""
        asc = order == "asc"
        stmt = select(*_LIGHT).where(*_mine(tenant_id), _SUCCEEDED)
        if metadata:
            stmt = stmt.where(literal_column("chat -> 'stored' -> 'metadata'", JSONB).contains(dict(metadata)))
        if model is not None:
            stmt = stmt.where(_JOBS.c.model == model)
        if after is not None:
            # Any of the tenant's jobs places the page: one deleted since the last page still does.
            cursor = select(_JOBS.c.created_at, _JOBS.c.id).where(_JOBS.c.tenant_id == tenant_id, _JOBS.c.id == after)
            found = one_statement(self.sessions, cursor) if _ID.fullmatch(after) else []
            if not found:
                raise invalid("after", f"No chat completion with id '{after[:128]}' to list after.")
            here, there = tuple_(_JOBS.c.created_at, _JOBS.c.id), tuple_(found[0].created_at, found[0].id)
            stmt = stmt.where(here > there if asc else here < there)
        keys = (_JOBS.c.created_at, _JOBS.c.id)
        stmt = stmt.order_by(*(k if asc else k.desc() for k in keys)).limit(limit + 1)
        rows = one_statement(self.sessions, stmt)
        return render.page([_rendered(r, fingerprints) for r in rows[:limit]], len(rows) > limit)

    def update(
        self, completion_id: str, tenant_id: int, metadata: dict[str, str] | None, fingerprints: render.Fingerprints
    ) -> dict[str, Any]:
        """Replaces the completion's metadata (the only field OpenAI lets one change; null clears it)."""
        meta = func.jsonb_set(_JOBS.c.chat, literal_column("'{stored,metadata}'"), literal(metadata or {}, JSONB))
        stmt = transitions.update_chat([*_mine(tenant_id, completion_id), _SUCCEEDED], meta).returning(*_LIGHT)
        return _rendered(self._one(stmt, completion_id), fingerprints)

    def delete(self, completion_id: str, tenant_id: int) -> dict[str, Any]:
        """Forgets the completion: its kept messages and metadata go, and its job reads as deleted."""
        forgotten = literal_column("(chat - 'stored') || '{\"deleted\": true}'::jsonb", JSONB)
        stmt = transitions.update_chat([*_mine(tenant_id, completion_id), _SUCCEEDED], forgotten).returning(_JOBS.c.id)
        self._one(stmt, completion_id)
        return render.chat_completion_deleted(completion_id)

    def messages(
        self, completion_id: str, tenant_id: int, *, after: str | None = None, limit: int = 20, order: str = "asc"
    ) -> dict[str, Any]:
        """A page of the messages the completion was asked with, in the order sent (`order`: asc)."""
        kept_messages = literal_column("chat -> 'stored' -> 'messages'", JSONB).label("messages")
        stmt = select(kept_messages).where(*_mine(tenant_id, completion_id), _SUCCEEDED)
        row = self._one(stmt, completion_id)
        items = [render.stored_chat_message(completion_id, n, m) for n, m in enumerate(row.messages or [])]
        if order != "asc":
            items.reverse()
        start = 0
        if after is not None:
            ids = [m["id"] for m in items]
            if after not in ids:
                raise invalid("after", f"No message with id '{after[:128]}' in this chat completion.")
            start = ids.index(after) + 1
        window = items[start:]
        return render.page(window[:limit], len(window) > limit)
