"""Waiting out Postgres or Redis: a bounded backoff, never a failed job (only the engine's verdict
fails one). The backoff is core/infra/backoff.py's; what counts as unavailable, transient.py's."""

from __future__ import annotations

import logging
from typing import Any, NoReturn

from core.config import Settings
from core.infra.backoff import Backoff, retry
from core.infra.transient import TRANSIENT

log = logging.getLogger(__name__)


class Abandoned(Exception):
    """The infrastructure stayed away longer than `infra_retry_s`: this attempt lets go without
    failing the job; its lease lapses and the next attempt resumes from the streamed tokens."""


LETTING_GO: tuple[type[BaseException], ...] = (Abandoned, *TRANSIENT)


def retrying(
    settings: Settings, what: str, fn: Any, *args: Any, on_wait: Any = None, budget_s: float | None = None, **kw: Any
) -> Any:
    """Call `fn` until Postgres/Redis answer, with a bounded backoff, up to `budget_s` (default
    `infra_retry_s`). `on_wait` runs before each pause (an attempt keeps its lease while Redis is away)."""

    def waiting(exc: Exception, pause: float) -> None:
        log.warning("%s: infrastructure unavailable (%s: %s); retrying in %.1fs", what, type(exc).__name__, exc, pause)
        if on_wait is not None:
            on_wait()

    def abandon(exc: Exception) -> NoReturn:
        raise Abandoned(f"{what}: {type(exc).__name__}") from exc

    # A pause longer than a third of the lease lets it lapse between on_wait's renewals (a 3 s lease
    # and 5 s pauses: a 30 s Redis outage handed the job to a second attempt).
    backoff = Backoff(settings.infra_retry_s if budget_s is None else budget_s, settings.lease_s / 3)
    return retry(lambda: fn(*args, **kw), backoff, on_wait=waiting, give_up=abandon)
