"""Runs job attempts on the engine loop: claim, run one attempt (workers/attempt.py), and end the
job as failed when the attempt could not succeed; its outcome is typed (workers/outcome.py).

The Celery task is a thin entrypoint over `JobRunner.run`. Every state change goes through
core/jobs (transitions, and the lifecycle that ends jobs); the worker produces engine-neutral events
and results only (core/generation/events.py): core/protocol renders them for clients.

Two things here are shared by every attempt on the worker:

- `SequenceShare`: sequences, not jobs, count against a tenant's share of the engine's slots. One
  tenant's sequences in the engine at once (live, or waiting there for a slot) are capped at
  `tenant_max_sequences` (default: all the slots but the `interactive_slots` reserved ones, at least
  one slot always left); a job's further sequences wait here, in order, and enter the engine as the
  tenant's earlier ones end. So an `n=128` job of one tenant never holds every slot: another
  tenant's sequence finds one at once.
- `LeaseKeeper`: an attempt's lease is renewed from the moment it starts, while its sequences are
  built (a grammar compiling, an earlier attempt's stream being read), not only once they run.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Hashable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import redis
from sqlalchemy.orm import sessionmaker

from core.config import Settings
from core.generation.events import ErrorInfo
from core.infra import logs
from core.infra.autocommit import one_statement
from core.infra.streams import write
from core.infra.transient import TRANSIENT
from core.jobs import transitions
from core.jobs.lifecycle import Lifecycle
from core.jobs.transitions import Claimed
from workers.attempt import Attempt
from workers.cancels import CancelWatch
from workers.engine.base import SeqSpec
from workers.engine.loop import EngineLoop, Sink
from workers.outcome import EngineError, JobError, Outcome
from workers.pump import StreamPump
from workers.retry import LETTING_GO, Abandoned, retrying

log = logging.getLogger(__name__)

# A message whose jobs this worker cannot claim (Postgres away for it: a partition, or an outage) goes
# back to its queue after this long, for another worker that can. Retrying the claim for the whole
# `infra_retry_s` held it here until the dispatcher's re-send (SPOOL_DISPATCH_TIMEOUT_S, 60 s by
# default), which could land on the same cut-off worker again.
CLAIM_RETRY_S = 3.0


def tenant_cap(settings: Settings, max_batch: int) -> int:
    """Sequences of one tenant a worker's engine holds at once: `tenant_max_sequences`, or every slot
    but the `interactive_slots` reserved ones (the CPU and paced engines have `max_batch` +
    `interactive_slots` slots; the GPU engines `max_batch`), and never all of them."""
    if settings.tenant_max_sequences:
        return settings.tenant_max_sequences
    reserved = settings.interactive_slots if settings.engine in ("llamacpp", "paced") else 0
    return max(1, max_batch + reserved - max(1, settings.interactive_slots))


class SequenceShare:
    """Hands attempts' sequences to the engine loop, at most `cap` of one tenant's at once (see the
    module's docstring). Thread-safe: attempts submit and cancel from their own threads, the stream
    pump releases ended sequences from its thread."""

    def __init__(self, loop: EngineLoop, cap: int) -> None:
        self.loop, self.cap = loop, max(1, cap)
        self._lock = threading.Lock()
        self._in: dict[int, set[Hashable]] = {}  # tenant -> its sequences in the engine
        # tenant -> its sequences waiting here: interactive ones first, each kind in arrival order
        self._held: dict[int, tuple[collections.deque, collections.deque]] = {}
        self._tenant: dict[Hashable, int] = {}
        self.most: dict[int, int] = {}  # most sequences of a tenant in the engine at once (tests, metrics)

    def submit(self, tenant: int, specs: list[SeqSpec], sink: Sink) -> None:
        with self._lock:
            self._in.setdefault(tenant, set())
            held = self._held.setdefault(tenant, (collections.deque(), collections.deque()))
            for spec in specs:
                self._tenant[spec.key] = tenant
                held[0 if spec.interactive else 1].append((spec, sink))
            go = self._fill(tenant)
        self._send(go)

    def release(self, keys: list[Hashable]) -> None:
        """These sequences ended in the engine (or never need to start): the tenant's next may go."""
        self._drop(keys, cancel=False)

    def cancel(self, keys: list[Hashable]) -> None:
        """Stop these sequences: those in the engine are cancelled there, those waiting here dropped."""
        self._drop(keys, cancel=True)

    def _drop(self, keys: list[Hashable], cancel: bool) -> None:
        stop: list[Hashable] = []
        go: list[tuple[SeqSpec, Sink]] = []
        with self._lock:
            touched: set[int] = set()
            for key in keys:
                tenant = self._tenant.pop(key, None)
                if tenant is None:
                    continue
                touched.add(tenant)
                inside = self._in.get(tenant, set())
                if key in inside:
                    inside.discard(key)
                    stop.append(key)
                else:
                    for q in self._held.get(tenant, ()):
                        for item in q:
                            if item[0].key == key:
                                q.remove(item)
                                break
            for tenant in touched:
                go += self._fill(tenant)
        if cancel and stop:
            self.loop.cancel(stop)
        self._send(go)

    def _fill(self, tenant: int) -> list[tuple[SeqSpec, Sink]]:
        """Under the lock: the tenant's waiting sequences that fit its share now."""
        inside = self._in.setdefault(tenant, set())
        inter, bulk = self._held.setdefault(tenant, (collections.deque(), collections.deque()))
        go = []
        while len(inside) < self.cap and (inter or bulk):
            spec, sink = (inter or bulk).popleft()
            inside.add(spec.key)
            go.append((spec, sink))
        if len(inside) > self.most.get(tenant, 0):
            self.most[tenant] = len(inside)
        if not inside and not inter and not bulk:  # nothing of this tenant left here
            self._in.pop(tenant, None)
            self._held.pop(tenant, None)
        return go

    def _send(self, go: list[tuple[SeqSpec, Sink]]) -> None:
        for spec, sink in go:  # in order: the loop's inbox keeps it
            self.loop.submit([spec], sink)


class LeaseKeeper:
    """Renews the leases of attempts that are still starting, every `lease_s / 3`, on one thread
    (started at the first use): a big grammar compiling or a long stream being read must not let the
    lease lapse, which would hand the job to a second attempt that starts the same work over."""

    def __init__(self, renew: Any, lease_s: float) -> None:
        self.renew, self.every = renew, lease_s / 3
        self._lock = threading.Lock()
        self._starting: dict[int, list[Any]] = {}  # id -> [job, next renewal due, lost]
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    @contextmanager
    def holding(self, job: Claimed) -> Iterator[list[Any]]:
        """While the block runs, `job`'s lease is renewed; the yielded entry's [2] says whether a
        renewal found the lease gone (cancelled or reassigned)."""
        entry: list[Any] = [job, time.monotonic() + self.every, False]
        with self._lock:
            self._starting[id(entry)] = entry
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)
                self._thread.start()
        try:
            yield entry
        finally:
            with self._lock:
                self._starting.pop(id(entry), None)

    def _run(self) -> None:
        while True:
            self._wake.wait(min(1.0, self.every / 2))
            now = time.monotonic()
            with self._lock:
                due = [e for e in self._starting.values() if e[1] <= now]
            for entry in due:
                entry[1] = now + self.every
                try:
                    if not self.renew(entry[0]):
                        entry[2] = True
                except TRANSIENT:
                    pass  # Postgres away: the next try may reach it; the lease may lapse meanwhile
                except Exception:
                    log.exception("renewing job %s's lease failed", entry[0].id)


class JobRunner:
    def __init__(
        self, loop: EngineLoop, settings: Settings, redis_client: redis.Redis, sessions: sessionmaker, worker_name: str
    ) -> None:
        self.loop = loop
        self.settings = settings
        self.redis = redis_client
        self.sessions = sessions
        self.worker_name = worker_name
        # One Redis round trip per decode step for all this worker's sequences, not one per sequence.
        self.lifecycle = Lifecycle(sessions, redis_client, settings, appender=write.GroupAppender(redis_client))
        # Every attempt's engine events become stream entries on one thread (workers/pump.py).
        self.pump = StreamPump(redis_client, settings)
        # Every running job's cancel key asked in one round trip, not one EXISTS per job per 0.5 s.
        self.cancels = CancelWatch(redis_client)
        # Sequences, not jobs, count against a tenant's share of the engine's slots.
        self.share = SequenceShare(loop, tenant_cap(settings, loop.engine.max_batch))
        # Leases are renewed from the moment an attempt starts (a grammar compiling).
        self.keeper = LeaseKeeper(self.renew, settings.lease_s)
        self.slot_wake: Any = None  # set by the worker process: called when an attempt ends
        # Set by the worker process: told the attempts in hand whenever they change (prefix affinity's
        # load, core/infra/broker.py `route`).
        self.on_load: Any = None
        self.in_hand = 0
        self._in_hand_lock = threading.Lock()

    # -- entrypoint -------------------------------------------------------------------------
    def run(self, job_id: str, attempt: int) -> Outcome:
        try:
            job = retrying(self.settings, f"claim {job_id}", self._claim, job_id, attempt, budget_s=CLAIM_RETRY_S)
        except Abandoned:
            log.warning("job %s attempt %s: could not claim (Postgres away); its message goes back", job_id, attempt)
            return Outcome.unclaimed
        if job is None:
            log.info("job %s attempt %s: not claimable (duplicate or stale message); skipped", job_id, attempt)
            return Outcome.skipped
        return self._run_claimed(job)

    def run_group(self, pairs: list[tuple[str, int]]) -> list[Outcome]:
        """Several jobs from one message (batch lines from the dispatcher, a burst of new requests from
        the API): claimed in one statement, then run side by side, each an ordinary attempt (its own
        lease, fence, events and settlement)."""
        try:
            jobs = retrying(self.settings, f"claim {len(pairs)} jobs", self._claim_many, pairs, budget_s=CLAIM_RETRY_S)
        except Abandoned:
            log.warning("could not claim %d jobs (Postgres away); their message goes back", len(pairs))
            return [Outcome.unclaimed] * len(pairs)
        if len(jobs) < len(pairs):
            skipped = len(pairs) - len(jobs)
            log.info("%d of %d jobs not claimable (duplicate or stale message); skipped", skipped, len(pairs))
        if len(jobs) <= 1:
            return [self._run_claimed(j) for j in jobs]
        # This thread fences the whole group in one script call and starts its attempts (their
        # sequences go to the engine) before any follows on a thread of its own. Eight threads each
        # fencing and building side by side took turns at the GIL: in a burst of 64, ~11 ms of wall
        # time from a job's claim to its sequences in the engine, for ~1 ms of CPU.
        try:
            retrying(
                self.settings,
                f"fence {len(jobs)} jobs",
                write.raise_fences,
                self.redis,
                [(j.id, j.attempt) for j in jobs],
                self.settings.events_ttl_s,
            )
        except Abandoned:
            log.warning("could not fence %d claimed jobs; their leases lapse and they resume", len(jobs))
            return [Outcome.abandoned] * len(jobs)
        started: list[Attempt | None] = []
        for job in jobs:
            try:
                attempt: Attempt | None = Attempt(self, job, fenced=True)
            except Exception:  # a stored row it cannot read: its own thread meets it again, and fails it
                attempt = None
            if attempt is not None:
                with self._bound(job):
                    log.info("job %s attempt %s started", job.id, job.attempt)
                    # What can take long (a grammar to compile, a resumed stream to read) starts on
                    # its own thread (`run` starts it), so one tenant's job never holds the others'.
                    if not attempt.p.grammar and job.attempt == 1:
                        attempt.start()
            started.append(attempt)
        with ThreadPoolExecutor(max_workers=len(jobs), thread_name_prefix="group") as pool:
            return list(pool.map(self._run_claimed, jobs, started))

    def _claim_many(self, pairs: list[tuple[str, int]]) -> list[Claimed]:
        stmt = transitions.claim_many(pairs, self.worker_name, self.settings.lease_s)
        return transitions.claimed(one_statement(self.sessions, *stmt))

    def _claim(self, job_id: str, attempt: int) -> Claimed | None:
        stmt = transitions.claim(job_id, attempt, self.worker_name, self.settings.lease_s)
        found = transitions.claimed(one_statement(self.sessions, *stmt))
        return found[0] if found else None

    @staticmethod
    def _bound(job: Claimed) -> Any:
        return logs.bound(
            request_id=job.request_id, job_id=job.id, tenant_id=job.tenant_id, model=job.model, attempt=job.attempt
        )

    def _run_claimed(self, job: Claimed, started: Attempt | None = None) -> Outcome:
        """Run one claimed job's attempt to its outcome; `started`: already started (run_group)."""
        self._count(1)
        try:
            with self._bound(job):
                if started is None:
                    log.info("job %s attempt %s started", job.id, job.attempt)
                return self._attempt(job, started)
        finally:
            # Any end frees a slot the dispatcher fills at once: a batch line's, or a request's while
            # requests wait in Postgres for the fair dispatcher (a contended model). A woken pass with
            # nothing queued for its free slots is one index probe (core/dispatcher.py `tick`).
            self._count(-1)
            if self.slot_wake is not None:
                self.slot_wake()

    def _count(self, change: int) -> None:
        with self._in_hand_lock:
            self.in_hand += change
            n = self.in_hand
        if self.on_load is not None:
            try:
                self.on_load(n)
            except TRANSIENT:  # a load a moment stale only routes less well; the heartbeat sets it again
                log.warning("could not record this worker's load", exc_info=True)

    def _attempt(self, job: Claimed, started: Attempt | None = None) -> Outcome:
        job_id, attempt = job.id, job.attempt
        try:
            return (started or Attempt(self, job)).run()
        except write.Fenced:
            log.info("job %s attempt %s was superseded by a newer attempt; stopping", job_id, attempt)
            return Outcome.lost
        except LETTING_GO as exc:
            log.warning("job %s attempt %s let go (%s): its lease lapses and it resumes", job_id, attempt, exc)
            return Outcome.abandoned
        except JobError as exc:
            error = exc.error
        except EngineError as exc:
            log.warning("job %s: the engine failed it: %s", job_id, exc)
            error = ErrorInfo(message=f"Generation failed: {exc}", type="server_error", code="engine_error")
        except Exception:
            log.exception("job %s failed", job_id)
            error = ErrorInfo(message="Generation failed.", type="server_error", code="engine_error")
        try:
            retrying(self.settings, f"fail {job_id}", self.lifecycle.fail, job, error)
        except Abandoned:
            return Outcome.abandoned
        return Outcome.failed

    def renew(self, job: Claimed) -> bool:
        stmt = transitions.renew_lease(job.id, job.attempt, self.settings.lease_s)
        return bool(one_statement(self.sessions, stmt))
