"""Waiting out Postgres or Redis: the one bounded backoff (issue 36).

Every wait for the infrastructure pauses 0.2 s, then twice as long each time up to 5 s (or a lower
cap: a worker's third of its lease), and gives up once the next pause would end past its deadline.
What counts as unavailable is core/infra/transient.py. `retry` calls a function under such a
backoff (workers/retry.py, workers/pump.py, core/jobs/lifecycle.py); a loop that never gives up
paces itself with a `Backoff` alone (the stream hub's shared read, core/infra/streams/read.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from core.infra.transient import is_transient

T = TypeVar("T")

FIRST_S = 0.2
MAX_S = 5.0


class Backoff:
    """The pauses of one wait: FIRST_S, doubling up to `cap_s` (never over MAX_S), within `budget_s`
    from now (None: no deadline)."""

    def __init__(self, budget_s: float | None = None, cap_s: float = MAX_S) -> None:
        self.deadline = None if budget_s is None else time.monotonic() + budget_s
        self.cap_s = min(cap_s, MAX_S)
        self.pause = FIRST_S  # the next pause (the first is FIRST_S even under a lower cap)

    def fits(self) -> bool:
        """Whether the next pause ends by the deadline."""
        return self.deadline is None or time.monotonic() + self.pause <= self.deadline

    def step(self) -> float:
        """The next pause; the one after it is twice as long, up to the cap."""
        pause, self.pause = self.pause, min(self.pause * 2, self.cap_s)
        return pause

    def reset(self) -> None:
        self.pause = FIRST_S


def retry(
    fn: Callable[[], T],
    backoff: Backoff,
    *,
    retry_on: tuple[type[BaseException], ...] | Callable[[BaseException], bool] = is_transient,
    on_wait: Callable[[Exception, float], None] | None = None,
    give_up: Callable[[Exception], T] | None = None,
) -> T:
    """`fn()` until it returns. An error `retry_on` accepts (a tuple of classes, or a predicate) is
    waited out: `on_wait(error, pause)`, then the pause. Once the next pause would end past the
    backoff's deadline, `give_up(error)` answers instead (by default the error is raised). Any other
    error is raised at once, and so is whatever `on_wait` raises."""
    while True:
        try:
            return fn()
        except Exception as exc:
            if not (isinstance(exc, retry_on) if isinstance(retry_on, tuple) else retry_on(exc)):
                raise
            if not backoff.fits():
                if give_up is None:
                    raise
                return give_up(exc)
            if on_wait is not None:
                on_wait(exc, backoff.pause)
            time.sleep(backoff.step())
