"""One attempt at one job, its I/O: fence the stream, read what earlier attempts streamed, submit
the sequences, then follow the engine's events, publishing deltas, polling for a cancel, renewing
the lease and watching for a stalled engine, and finally end the job through the lifecycle.

What is made of the events is pure (workers/choices.py, workers/resume.py); this module only moves
it between the engine, Redis and Postgres.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from core.generation.events import Delta, JobResult, decode, encode
from core.generation.params import GenerationParams, choice_index
from core.generation.prompt import Prompt
from core.infra.metrics import ITL, QUEUE_WAIT, TTFT
from core.infra.streams import write
from core.infra.transient import TRANSIENT
from core.jobs.transitions import Claimed
from core.states import JobKind
from workers import choices, resume
from workers.choices import Choice
from workers.engine.base import PromptEvent, SeqSpec, TokenEvent
from workers.engine.text import ChoiceText
from workers.outcome import EngineError, JobError, Outcome
from workers.retry import Abandoned, retrying

if TYPE_CHECKING:
    from workers.runner import JobRunner

log = logging.getLogger(__name__)


class Attempt:
    def __init__(self, runner: JobRunner, job: Claimed, *, fenced: bool = False) -> None:
        self.runner = runner
        self.fenced = fenced  # a claimed group's fences are raised together (JobRunner.run_group)
        self._started = False
        self._start_error: Exception | None = None
        self.loop = runner.loop
        self.engine = runner.loop.engine
        self.settings = runner.settings
        self.job = job
        self.p = GenerationParams.from_json(job.params)
        self.given = [Prompt.from_json(x) for x in job.prompts]  # as stored: ids and the text to echo
        self.prompts: list[list[int]] = [p.ids for p in self.given]
        self.buffered = self.p.best_of > self.p.n  # best_of: publish only the winners, at the end
        self.choices: dict[int, Choice] = {}
        self.engine_s = 0.0
        # Every entry of the job's stream so far (earlier attempts' too): if Redis loses the stream
        # (a restart), it is rebuilt with the same entry ids, so readers resume exactly where they were.
        self.log: list[tuple[str, str]] = []
        self._next_wait_renew = 0.0
        self._first_token_at: float | None = None
        # Following the engine (the stream pump's side; the attempt's thread reads them once ended).
        self.live: set[Hashable] = set()
        self._by_key: dict[Hashable, Choice] = {}
        self._unsent: dict[Choice, None] = {}  # touched since the last publish, in arrival order
        self._publish_every = self._next_publish = 0.0
        self.stopped = False
        self._error: BaseException | None = None
        self._ended = threading.Event()  # set by `stop` (the pump) or by a cancel seen (`_on_cancel`)
        self._cancel_seen = False
        self._itl = ITL.labels(job.model)  # per token: a labelled child looked up once, not per call

    # -- setup ------------------------------------------------------------------------------
    def _build(self) -> list[SeqSpec]:
        job, p, engine, rds = self.job, self.p, self.engine, self.runner.redis
        # Fence older attempts off the stream before reading it: what they wrote before is read here,
        # anything later is refused (a worker that lost its lease may still be generating).
        if not self.fenced:
            ttl = self.settings.events_ttl_s
            retrying(self.settings, f"fence {job.id}", write.raise_fence, rds, job.id, job.attempt, ttl)
        if job.attempt > 1 and write.trimmed(rds, job.id):
            raise JobError(
                "This job's progress log was trimmed, so it cannot resume exactly.",
                type_="server_error",
                code="resume_impossible",
            )
        # Read (and logged: entry positions continue after them) even when not resumed from.
        self.log = write.entries(rds, job.id) if job.attempt > 1 else []
        prior = {} if self.buffered else resume.prior_progress(decode(raw) for _, raw in self.log)
        wants_scores = p.prompt_logprobs is not None or (p.echo and p.logprobs is not None)
        # The constraint is compiled once for the job; each sequence gets a copy of the compiled
        # matcher (a copy costs well under a millisecond; a compile, for a big grammar, seconds).
        compiled = self._compile() if p.grammar else None
        specs: list[SeqSpec] = []
        for pi, ids in enumerate(self.prompts):
            total = resume.budget(engine.n_ctx, len(ids), p.max_tokens, pi)
            echo_text = self._echo_text(pi) if p.echo else ""
            for j in range(p.candidates):
                c = choice_index(pi, j, p.candidates)
                ch = Choice(c, pi, ChoiceText(p.stop, engine.token_bytes), (job.id, job.attempt, c))
                ch.prefix_text = echo_text
                ch.lp = [] if p.logprobs is not None else None
                before = prior.get(c, resume.Prior())
                ch.resume(before, p.echo, wants_scores)
                self.choices[c] = ch
                if ch.done:
                    continue
                done = before.ids
                specs.append(
                    SeqSpec(
                        key=ch.key,
                        prompt_ids=ids + done,
                        max_new_tokens=resume.remaining(total, len(done)),
                        params=p,
                        seed=resume.seed_for(p.seed, c, len(done)),
                        prior=len(done),
                        matcher=self._matcher(compiled, done) if compiled is not None else None,
                        prompt_logprobs=(p.logprobs if p.prompt_logprobs is None else p.prompt_logprobs)
                        if wants_scores and not before.prefix_sent
                        else None,
                        prompt_logprobs_len=len(ids),
                        # A flex request runs in batch slots, displaced by interactive work like a line.
                        interactive=job.kind != JobKind.batch and job.service_tier != "flex",
                        cache_scope=job.tenant_id,  # one tenant's cached prefix is never another's
                    )
                )
        return specs

    def _echo_text(self, pi: int) -> str:
        given = self.given[pi].text
        if given is not None:
            return given
        return b"".join(self.engine.token_bytes(t) for t in self.prompts[pi]).decode(errors="replace")

    def _compile(self) -> Any:
        """The job's grammar compiled for this engine's vocabulary: once per attempt."""
        import llguidance

        m = llguidance.LLMatcher(self.engine.ll_tokenizer(), self.p.grammar or "", log_level=0)
        if m.is_error():
            raise JobError(f"Invalid grammar: {m.get_error()}", param="grammar", code="invalid_grammar")
        return m

    @staticmethod
    def _matcher(compiled: Any, done_ids: list[int]) -> Any:
        """A sequence's own matcher: a copy of the compiled one, advanced past its earlier tokens."""
        m = compiled.deep_copy()
        if done_ids:
            m.consume_tokens(done_ids)
        if m.is_error():
            raise JobError(f"Invalid grammar: {m.get_error()}", param="grammar", code="invalid_grammar")
        return m

    # -- the attempt ------------------------------------------------------------------------
    def start(self) -> None:
        """Build the sequences and hand them to the engine. A claimed group starts its attempts this
        way on one thread before any follows (JobRunner.run_group); an error is kept, and `run`
        raises it on the attempt's own thread, where every outcome is settled."""
        try:
            self._start()
        except Exception as exc:
            self._start_error = exc
        self._started = True

    def _start(self) -> None:
        job, every = self.job, self.settings
        if job.started_at is not None and job.created_at is not None:
            QUEUE_WAIT.labels(job.model, job.kind).observe((job.started_at - job.created_at).total_seconds())
        specs = self._build()
        if not self.buffered:
            self._publish([ch for ch in self.choices.values() if ch.prefix_ready])
        # The stream pump (workers/pump.py) takes this attempt's engine events, publishes its deltas
        # and says when it has ended; this thread meanwhile polls for a cancel and renews the lease.
        self.live = {s.key for s in specs}
        self._by_key = {ch.key: ch for ch in self.choices.values()}
        # Bulk work publishes its progress every `batch_publish_s`, not every token: a batch line, and a
        # flex request whose client waits for the whole answer (its CPU is the default tier's latency).
        bulk = job.kind == JobKind.batch or (job.service_tier == "flex" and not job.stream)
        self._publish_every = every.batch_publish_s if bulk else 0.0
        if self.live:
            # Through the tenant's share of the engine's slots (workers/runner.SequenceShare).
            self.runner.share.submit(job.tenant_id, specs, self.runner.pump.sink(self))
        else:
            self.stop(None)

    def run(self) -> Outcome:
        job, every = self.job, self.settings
        if not self._started:
            # The lease is renewed from here on, while the sequences are built (a grammar compiles),
            # not only once they run: a long compile must not let the job be handed to another attempt.
            with self.runner.keeper.holding(job) as held:
                self._start()
            if held[2]:
                log.info("job %s attempt %s lost its lease while starting", job.id, job.attempt)
                if self.live:
                    self.runner.share.cancel(list(self.live))
                return Outcome.lost
        elif self._start_error is not None:
            raise self._start_error
        next_renew = time.monotonic() + every.lease_s / 3
        watch = self.runner.cancels
        watch.watch(job.id, self._on_cancel)
        try:
            while True:
                self._ended.wait(0.5)
                if self.stopped:  # the pump ended it (done, or an error): that wins over a late cancel
                    break
                if self._cancel_seen:
                    log.info("job %s cancelled; dropping its sequences", job.id)
                    return Outcome.cancelled
                if time.monotonic() >= next_renew:
                    next_renew = time.monotonic() + every.lease_s / 3
                    if self.loop.stalled_for() > every.engine_stall_s:
                        # A wedged engine must not keep its jobs: stop renewing, the lease lapses and the
                        # job resumes elsewhere from its streamed tokens.
                        raise Abandoned(f"engine stalled {self.loop.stalled_for():.0f}s")
                    if not retrying(every, f"renew {job.id}", self.runner.renew, job):
                        log.info("job %s attempt %s lost its lease (cancelled or reassigned)", job.id, job.attempt)
                        return Outcome.lost
            if self._error is not None:
                raise self._error
        finally:
            watch.unwatch(job.id, self._on_cancel)
            self.stopped = True  # the pump drops whatever else arrives for it
            if self.live:
                self.runner.share.cancel(list(self.live))
        final = choices.best_of(self.choices, len(self.prompts), self.p.n, self.p.candidates)
        if self.buffered:
            self._publish(list(final.values()), index_of={ch: i for i, ch in final.items()})
        result = JobResult(choices=[choices.result(i, ch) for i, ch in sorted(final.items())])
        u = choices.usage(self.choices.values(), [len(ids) for ids in self.prompts], bool(self.p.prediction))
        if not retrying(every, f"finish {job.id}", self.runner.lifecycle.succeed, job, result, u, self.engine_s):
            return Outcome.lost
        return Outcome.succeeded

    # -- called by the stream pump's thread while the attempt follows ---------------------------
    def accept(self, ev: TokenEvent | PromptEvent) -> None:
        """Apply one engine event; its choice is published with the next due deltas."""
        self._unsent[self._accept(self._by_key[ev.key], ev, self.live)] = None

    def due_deltas(self, now: float) -> list[Delta]:
        """What the touched choices have new to say, when it is due: at once for a stream reader; a
        batch line's progress is only read to resume it, so every `batch_publish_s` (publishing it per
        token took CPU from the decode on small hosts) and when a choice ends."""
        if not self._unsent or self.buffered:
            return []
        if now < self._next_publish and not any(ch.done for ch in self._unsent):
            return []
        out = choices.deltas(list(self._unsent), self.job.attempt, self.p.echo)
        self._unsent.clear()
        self._next_publish = now + self._publish_every
        return out

    def payloads(self, out: list[Delta]) -> list[str]:
        return [encode(e) for e in out]

    def logged(self, ids: list[str], payloads: list[str]) -> None:
        """Entries written: this attempt's log holds every entry of the stream (earlier attempts' too)."""
        self.log += zip(ids, payloads, strict=True)

    def stop(self, error: BaseException | None) -> None:
        """The attempt's following is over: it ended (None) or `error` is raised in its thread."""
        if not self.stopped:
            self.stopped, self._error = True, error
            self._ended.set()

    def _accept(self, ch: Choice, ev: TokenEvent | PromptEvent, live: set) -> Choice:
        """Apply one engine event to its choice."""
        if isinstance(ev, PromptEvent):
            choices.take_prompt(ch, ev, self.prompts[ch.prompt], self.engine.token_text)
            return ch
        self.engine_s += ev.engine_s
        if ch.done:
            return ch
        if ev.error is not None:
            raise (Abandoned if ev.retry else EngineError)(ev.error)
        if ev.token_id is not None:
            self._time_token(ch)
        if choices.take_token(ch, ev, self.engine.token_text):
            self.runner.share.cancel([ch.key])
        if ch.done:
            live.discard(ch.key)
            self.runner.share.release([ch.key])  # the tenant's next sequence may take its place
        return ch

    def _time_token(self, ch: Choice) -> None:
        now = time.monotonic()
        if self._first_token_at is None:
            self._first_token_at = now
            if self.job.created_at is not None:
                TTFT.labels(self.job.model, self.job.kind).observe(time.time() - self.job.created_at.timestamp())
        elif ch.last_token_at is not None:
            self._itl.observe(now - ch.last_token_at)
        ch.last_token_at = now

    # -- publishing -------------------------------------------------------------------------
    def _publish(self, touched: list[Choice], index_of: dict[Choice, int] | None = None) -> None:
        out = choices.deltas(touched, self.job.attempt, self.p.echo, index_of)
        if out:
            # While Redis is away the attempt waits here, and keeps renewing its lease in Postgres: an
            # outage must not hand the job to a second attempt, which would find the stream empty.
            retrying(self.settings, f"publish {self.job.id}", self._emit, out, on_wait=self._renew_while_waiting)

    def _emit(self, out: list[Delta]) -> None:
        # Positional: this attempt's log holds every entry of the stream (earlier attempts' too).
        publish = self.runner.lifecycle.publish_deltas
        try:
            ids = publish(self.job.id, self.job.attempt, out, start=len(self.log) + 1)
        except write.StreamLost:  # nothing was appended: rebuild (or stop, Fenced), then append
            self.rebuild_lost_stream()
            ids = publish(self.job.id, self.job.attempt, out, start=len(self.log) + 1)
        self.logged(ids, self.payloads(out))

    def rebuild_lost_stream(self) -> None:
        """The stream is gone (Redis restarted empty), and its fence with it: only the attempt that
        still owns the job may write it again. Ownership is asked of Postgres first (renewing the
        lease is the compare-and-set on state and attempt, and keeps a newer attempt from claiming
        the job while this one rebuilds); then the fence is raised to this attempt, and a fence
        already higher (a newer attempt got there) stops it before it writes anything."""
        job, rds, ttl = self.job, self.runner.redis, self.settings.events_ttl_s
        if not self.runner.renew(job):
            raise write.Fenced(f"job {job.id}: attempt {job.attempt} no longer owns it; not rebuilding its stream")
        if write.raise_fence(rds, job.id, job.attempt, ttl) > job.attempt:
            raise write.Fenced(f"job {job.id}: attempt {job.attempt} was superseded; not rebuilding its stream")
        log.warning("job %s: its event stream was lost (Redis restarted?); rebuilding it", job.id)
        write.rebuild(rds, job.id, self.log, ttl)

    def _renew_while_waiting(self) -> None:
        now = time.monotonic()
        if now < self._next_wait_renew:
            return
        self._next_wait_renew = now + self.settings.lease_s / 3
        try:
            owned = self.runner.renew(self.job)
        except TRANSIENT:
            return  # Postgres away too: the lease may lapse, and the job resumes elsewhere
        if not owned:  # the dispatcher gave the job to another worker (this one is cut from Redis)
            raise write.Fenced(f"job {self.job.id}: attempt {self.job.attempt} lost its lease while Redis was away")

    def _on_cancel(self) -> None:
        """Called by the worker's cancel watch (workers/cancels.py) when the job's cancel key is set."""
        self._cancel_seen = True
        self._ended.set()
