"""Waiting out Postgres or Redis: a bounded backoff, never a failed job (only the engine's verdict
fails one)."""

from __future__ import annotations

import logging
import time
from typing import Any

from core.config import Settings
from core.infra import transient

log = logging.getLogger(__name__)

# Postgres or Redis unavailable (unreachable, or Redis refusing writes for now): a wait, never a
# failed job. The one definition is core/infra/transient.py.
TRANSIENT = transient.TRANSIENT


class Abandoned(Exception):
    """The infrastructure stayed away longer than `infra_retry_s`: this attempt lets go without
    failing the job; its lease lapses and the next attempt resumes from the streamed tokens."""


LETTING_GO: tuple[type[BaseException], ...] = (Abandoned, *TRANSIENT)


def retrying(
    settings: Settings, what: str, fn: Any, *args: Any, on_wait: Any = None, budget_s: float | None = None, **kw: Any
) -> Any:
    """Call `fn` until Postgres/Redis answer, with a bounded backoff, up to `budget_s` (default
    `infra_retry_s`). `on_wait` runs before each pause (an attempt keeps its lease while Redis is away)."""
    deadline = time.monotonic() + (settings.infra_retry_s if budget_s is None else budget_s)
    backoff = 0.2
    while True:
        try:
            return fn(*args, **kw)
        except Exception as exc:
            if not transient.is_transient(exc):
                raise
            if time.monotonic() + backoff > deadline:
                raise Abandoned(f"{what}: {type(exc).__name__}") from exc
            log.warning(
                "%s: infrastructure unavailable (%s: %s); retrying in %.1fs", what, type(exc).__name__, exc, backoff
            )
            if on_wait is not None:
                on_wait()
            time.sleep(backoff)
            # A pause longer than a third of the lease lets it lapse between on_wait's renewals (a
            # 3 s lease and 5 s pauses: a 30 s Redis outage handed the job to a second attempt).
            backoff = min(backoff * 2, 5.0, settings.lease_s / 3)
