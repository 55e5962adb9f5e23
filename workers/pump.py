"""One thread per worker process that turns every live attempt's engine events into stream entries.

Each attempt used to take its tokens on a thread of its own: per token, the engine loop woke that
thread, which built its delta and handed it to the stream appender's thread, which woke it again
with the answer. At 64 sequences that was ~130 thread switches per decode step, and they were most
of the worker's CPU per token. Here the engine loop's events for every attempt go to this one
thread, which applies them to their choices, builds the deltas, and writes all jobs' entries in
one fenced-append script call per wake-up (each job still fenced by its own attempt). An attempt's
own thread only waits for the end and, meanwhile, polls for a cancel and renews its lease.

Errors reach the attempt they belong to: the engine's verdict on one sequence, a newer attempt's
fence, or Redis staying away past `infra_retry_s` (the entries already built are sent again with
the same positions until Redis answers, so a retried append writes nothing twice).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from functools import partial
from typing import TYPE_CHECKING, Any

from core.config import Settings
from core.infra.backoff import Backoff, retry
from core.infra.streams import write
from core.infra.transient import TRANSIENT
from workers.engine.base import PromptEvent, TokenEvent
from workers.retry import Abandoned

if TYPE_CHECKING:
    from workers.attempt import Attempt

log = logging.getLogger(__name__)


class StreamPump:
    def __init__(self, redis: Any, settings: Settings) -> None:
        self.redis, self.settings = redis, settings
        self._queue: queue.SimpleQueue[tuple[Attempt, TokenEvent | PromptEvent]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.flushes = 0  # pipelines sent (tests and the bench read it)

    def sink(self, attempt: Attempt) -> Any:
        """The engine loop's callback for one attempt's sequences."""
        with self._lock:  # started on first use: processes that never run a job hold no thread
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="stream-pump", daemon=True)
                self._thread.start()
        put = self._queue.put
        return lambda ev: put((attempt, ev))

    def _run(self) -> None:
        while True:
            items = [self._queue.get()]
            while True:  # everything the engine produced meanwhile: one pipeline for all of it
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                self._take(items)
            except Exception:  # never let the pump die: every attempt depends on it
                log.exception("stream pump failed on a batch of %d events", len(items))
                for a in dict.fromkeys(a for a, _ in items):
                    a.stop(RuntimeError("stream pump failed"))

    def _take(self, items: list[tuple[Attempt, TokenEvent | PromptEvent]]) -> None:
        touched: dict[Attempt, None] = {}
        for a, ev in items:
            if a.stopped:
                continue
            try:
                a.accept(ev)
            except Exception as exc:  # the engine's verdict (EngineError) or a retry (Abandoned): its alone
                a.stop(exc)
                continue
            touched[a] = None
        now = time.monotonic()
        out = [(a, d) for a in touched if (d := a.due_deltas(now))]
        if out:
            self._publish(out)
        for a in touched:
            if not a.stopped and not a.live:
                a.stop(None)

    def _publish(self, out: list) -> None:
        ready = [(a, a.payloads(deltas)) for a, deltas in out]
        rebuilt: set[Attempt] = set()
        # One wait for the whole publish, its rebuilt streams' appends included: one deadline.
        wait = Backoff(self.settings.infra_retry_s, self.settings.lease_s / 3)
        ttl = self.settings.events_ttl_s
        while ready:
            appends = [write.Append(a.job.id, a.job.attempt, payloads, ttl, len(a.log) + 1) for a, payloads in ready]
            try:
                results = retry(
                    partial(write.append_many, self.redis, appends), wait, retry_on=TRANSIENT, on_wait=_waiting
                )
            except TRANSIENT as exc:  # still away at the deadline
                for a, _ in ready:
                    a.stop(Abandoned(f"publish: {type(exc).__name__}"))
                return
            self.flushes += 1
            lost = []
            for (a, payloads), append, r in zip(ready, appends, results, strict=True):
                if r == write.LOST:
                    lost.append((a, payloads))
                    continue
                try:
                    a.logged(write.appended(r, append.job_id, append.attempt), payloads)
                except Exception as exc:  # Fenced, or this job's own script error
                    a.stop(exc)
            # Streams lost with a Redis restart (nothing was appended to them): each is rebuilt by
            # its attempt if it still owns the job (or it stops, Fenced), then appended to again.
            ready = []
            for a, payloads in lost:
                if a in rebuilt:
                    a.stop(Abandoned("publish: the stream was lost again right after its rebuild"))
                    continue
                rebuilt.add(a)
                try:
                    a.rebuild_lost_stream()
                    ready.append((a, payloads))
                except Exception as exc:
                    a.stop(exc if not isinstance(exc, TRANSIENT) else Abandoned(f"publish: {type(exc).__name__}"))


def _waiting(exc: Exception, pause: float) -> None:
    log.warning("stream pump: Redis unreachable (%s); retrying in %.1fs", type(exc).__name__, pause)
