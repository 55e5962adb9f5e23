"""Runs one job attempt on the engine loop: claim, generate, stream events, settle.

The Celery task is a thin entrypoint over `JobRunner.run`. Every state change goes through
core/jobs (transitions, and the lifecycle that ends jobs); the worker produces engine-neutral events
and results only (core/jobs/events.py): core/protocol renders them for clients.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import redis
from sqlalchemy.exc import DisconnectionError, InterfaceError, OperationalError
from sqlalchemy.orm import sessionmaker

from core.config import Settings
from core.generation.params import GenerationParams, choice_index
from core.infra import kv, logs, streams
from core.infra.metrics import ITL, QUEUE_WAIT, TTFT
from core.infra.orm import Job
from core.jobs import transitions
from core.jobs.events import (
    ChoiceResult,
    Delta,
    ErrorInfo,
    JobResult,
    TokenScore,
    TopToken,
    Usage,
    decode,
    encode,
)
from core.jobs.lifecycle import Lifecycle
from workers.engine.base import PromptEvent, SeqSpec, TokenEvent
from workers.engine.loop import EngineLoop
from workers.engine.text import ChoiceText

log = logging.getLogger(__name__)


class JobError(Exception):
    """A job that cannot succeed because of what it asked for; stored on the job as its error."""

    def __init__(
        self, message: str, type_: str = "invalid_request_error", code: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.error = ErrorInfo(message=message, type=type_, param=param, code=code)


class EngineError(Exception):
    """The engine gave up on one of the job's sequences (its own verdict, not an outage)."""


# Postgres or Redis unreachable: a wait, never a failed job (only the engine's verdict fails one).
TRANSIENT: tuple[type[BaseException], ...] = (*kv.TRANSIENT, OperationalError, InterfaceError, DisconnectionError)


class Abandoned(Exception):
    """The infrastructure stayed away longer than `infra_retry_s`: this attempt lets go without
    failing the job; its lease lapses and the next attempt resumes from the streamed tokens."""


LETTING_GO: tuple[type[BaseException], ...] = (Abandoned, *TRANSIENT)


def retrying(settings: Settings, what: str, fn: Any, *args: Any, on_wait: Any = None, **kw: Any) -> Any:
    """Call `fn` until Postgres/Redis answer, with a bounded backoff, up to `infra_retry_s`.
    `on_wait` runs before each pause (an attempt keeps its lease while Redis is away)."""
    deadline = time.monotonic() + settings.infra_retry_s
    backoff = 0.2
    while True:
        try:
            return fn(*args, **kw)
        except TRANSIENT as exc:
            if time.monotonic() + backoff > deadline:
                raise Abandoned(f"{what}: {type(exc).__name__}") from exc
            log.warning(
                "%s: %s unreachable (%s); retrying in %.1fs", what, "infrastructure", type(exc).__name__, backoff
            )
            if on_wait is not None:
                on_wait()
            time.sleep(backoff)
            # A pause longer than a third of the lease lets it lapse between on_wait's renewals (a
            # 3 s lease and 5 s pauses: a 30 s Redis outage handed the job to a second attempt).
            backoff = min(backoff * 2, 5.0, settings.lease_s / 3)


@dataclass(eq=False)  # identity-hashed: used as a dict key while coalescing
class _Choice:
    index: int  # in candidate space: prompt * candidates + j (== the OpenAI index unless best_of > n)
    prompt: int
    text: ChoiceText
    key: tuple[str, int, int]
    sent_ids: int = 0  # how many of text.ids earlier events already carried
    done: bool = False  # finished: no more tokens accepted
    closed: bool = False  # its final delta (with finish_reason) has been published
    prefix_text: str = ""  # echoed prompt, returned before the completion
    prefix_ready: bool = False
    prefix_sent: bool = False
    prompt_scores: list[TokenScore | None] | None = None  # the prompt's tokens, scored, when asked
    lp: list[TokenScore] | None = None  # every generated token's logprobs; None when not asked for
    lp_sent: int = 0  # how many of them earlier deltas carried
    sum_lp: float = 0.0
    eos: bool = False  # ended by an end-of-sequence token it generated: counted as a completion token
    cached: int = 0
    last_token_at: float | None = None  # monotonic arrival of its last token (inter-token latency)


class JobRunner:
    def __init__(
        self, loop: EngineLoop, settings: Settings, redis_client: redis.Redis, sessions: sessionmaker, worker_name: str
    ) -> None:
        self.loop = loop
        self.settings = settings
        self.redis = redis_client
        self.sessions = sessions
        self.worker_name = worker_name
        self.lifecycle = Lifecycle(sessions, redis_client, settings)
        # One Redis round trip per decode step for all this worker's sequences, not one per sequence.
        self.lifecycle.appender = streams.GroupAppender(redis_client)
        self.batch_slot_wake: Any = None  # set by the worker process: called when an attempt ends

    # -- entrypoint -------------------------------------------------------------------------
    def run(self, job_id: str, attempt: int) -> str:
        try:
            job = retrying(self.settings, f"claim {job_id}", self._claim, job_id, attempt)
        except Abandoned:
            log.warning("job %s attempt %s: could not claim; the dispatcher re-sends it", job_id, attempt)
            return "abandoned"
        if job is None:
            log.info("job %s attempt %s: not claimable (duplicate or stale message); skipped", job_id, attempt)
            return "skipped"
        return self._run_claimed(job)

    def run_group(self, pairs: list[tuple[str, int]]) -> list[str]:
        """Several batch lines from one message: claimed in one statement, then run side by side,
        each an ordinary attempt (its own lease, fence, events and settlement)."""
        try:
            jobs = retrying(self.settings, f"claim {len(pairs)} jobs", self._claim_many, pairs)
        except Abandoned:
            log.warning("could not claim %d jobs; the dispatcher re-sends them", len(pairs))
            return ["abandoned"] * len(pairs)
        if len(jobs) < len(pairs):
            skipped = len(pairs) - len(jobs)
            log.info("%d of %d jobs not claimable (duplicate or stale message); skipped", skipped, len(pairs))
        if len(jobs) <= 1:
            return [self._run_claimed(j) for j in jobs]
        with ThreadPoolExecutor(max_workers=len(jobs), thread_name_prefix="group") as pool:
            return list(pool.map(self._run_claimed, jobs))

    def _claim_many(self, pairs: list[tuple[str, int]]) -> list[Job]:
        with self.sessions() as s:
            jobs = list(s.execute(*transitions.claim_many(pairs, self.worker_name, self.settings.lease_s)).scalars())
            s.commit()
        return jobs

    def _claim(self, job_id: str, attempt: int) -> Job | None:
        with self.sessions() as s:
            job = s.execute(*transitions.claim(job_id, attempt, self.worker_name, self.settings.lease_s)).scalar()
            s.commit()
        return job

    def _run_claimed(self, job: Job) -> str:
        try:
            with logs.bound(
                request_id=job.request_id, job_id=job.id, tenant_id=job.tenant_id, model=job.model, attempt=job.attempt
            ):
                log.info("job %s attempt %s started", job.id, job.attempt)
                return self._attempt(job)
        finally:
            # A batch line's end frees a slot the dispatcher fills at once. Interactive jobs do not
            # wake it: that made it run a full tick per request (a third of a core at 60 requests/s).
            if job.kind == "batch" and self.batch_slot_wake is not None:
                self.batch_slot_wake()

    def _attempt(self, job: Job) -> str:
        job_id, attempt = job.id, job.attempt
        try:
            return _Attempt(self, job).run()
        except streams.Fenced:
            log.info("job %s attempt %s was superseded by a newer attempt; stopping", job_id, attempt)
            return "lost"
        except LETTING_GO as exc:
            log.warning("job %s attempt %s let go (%s): its lease lapses and it resumes", job_id, attempt, exc)
            return "abandoned"
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
            return "abandoned"
        return "failed"

    def renew(self, job: Job) -> bool:
        with self.sessions() as s:
            ok = s.execute(transitions.renew_lease(job.id, job.attempt, self.settings.lease_s)).first() is not None
            s.commit()
        return ok


class _Attempt:
    """One attempt at one job: its choices, their sequences on the engine, and their events."""

    def __init__(self, runner: JobRunner, job: Job) -> None:
        self.runner = runner
        self.loop = runner.loop
        self.engine = runner.loop.engine
        self.settings = runner.settings
        self.job = job
        self.p = GenerationParams.from_json(job.params)
        self.prompts: list[list[int]] = [list(x["ids"]) for x in job.prompts]
        self.buffered = self.p.best_of > self.p.n  # best_of: publish only the winners, at the end
        self.choices: dict[int, _Choice] = {}
        self.engine_s = 0.0
        # Every entry of the job's stream so far (earlier attempts' too): if Redis loses the stream
        # (a restart), it is rebuilt with the same entry ids, so readers resume exactly where they were.
        self.log: list[tuple[str, str]] = []
        self.prior_eos: set[int] = set()  # choices an earlier attempt ended with a generated end-of-sequence token
        self._stream_checked = 0.0
        self._next_wait_renew = 0.0
        self._first_token_at: float | None = None

    # -- setup ------------------------------------------------------------------------------
    def _build(self) -> list[SeqSpec]:
        job, p, engine = self.job, self.p, self.engine
        # Fence older attempts off the stream before reading it: what they wrote before is read here,
        # anything later is refused (a worker that lost its lease may still be generating).
        retrying(
            self.settings,
            f"fence {job.id}",
            streams.raise_fence,
            self.runner.redis,
            job.id,
            job.attempt,
            self.settings.events_ttl_s,
        )
        if job.attempt > 1 and streams.trimmed(self.runner.redis, job.id):
            raise JobError(
                "This job's progress log was trimmed, so it cannot resume exactly.",
                type_="server_error",
                code="resume_impossible",
            )
        # Read (and logged: entry positions continue after them) even when not resumed from.
        prior = self._prior_progress() if job.attempt > 1 else {}
        if self.buffered:
            prior = {}
        wants_prompt_scores = p.prompt_logprobs is not None or (p.echo and p.logprobs is not None)
        specs: list[SeqSpec] = []
        for pi, ids in enumerate(self.prompts):
            room = engine.n_ctx - len(ids)
            if room < 0 or (room == 0 and p.max_tokens != 0):
                raise JobError(
                    f"This model's maximum context length is {engine.n_ctx} tokens; prompt {pi} has {len(ids)}.",
                    code="context_length_exceeded",
                    param="prompt",
                )
            budget = room if p.max_tokens is None else min(p.max_tokens, room)
            echo_text = self._echo_text(pi) if p.echo else ""
            for j in range(p.candidates):
                c = choice_index(pi, j, p.candidates)
                ch = _Choice(c, pi, ChoiceText(p.stop, engine.token_bytes), (job.id, job.attempt, c))
                ch.prefix_text = echo_text
                ch.lp = [] if p.logprobs is not None else None
                done_ids, sent, finish, prefix_sent = prior.get(c, ([], "", None, False))
                if done_ids or sent:
                    ch.text.restore(done_ids, sent)
                    ch.sent_ids = len(done_ids)
                ch.prefix_sent = prefix_sent
                scores = wants_prompt_scores and not prefix_sent
                # Echo without prompt scores can go out at once; with them, when the prompt is scored.
                ch.prefix_ready = not prefix_sent and p.echo and not scores
                self.choices[c] = ch
                if finish:
                    ch.done = ch.closed = True
                    ch.eos = c in self.prior_eos
                    continue
                specs.append(
                    SeqSpec(
                        key=ch.key,
                        prompt_ids=ids + done_ids,
                        max_new_tokens=max(budget - len(done_ids), 0),
                        params=p,
                        # A resumed choice cannot replay the dead attempt's RNG; offset keeps it seeded.
                        seed=(p.seed + c + 1_000_003 * len(done_ids)) % 2**63,
                        prior=len(done_ids),
                        matcher=self._matcher(done_ids) if p.grammar else None,
                        prompt_logprobs=(p.logprobs if p.prompt_logprobs is None else p.prompt_logprobs)
                        if scores
                        else None,
                        prompt_logprobs_len=len(ids),
                        interactive=job.kind != "batch",
                        cache_scope=job.tenant_id,  # one tenant's cached prefix is never another's
                    )
                )
        return specs

    def _echo_text(self, pi: int) -> str:
        given = self.job.prompts[pi].get("text")
        if given is not None:
            return given
        return b"".join(self.engine.token_bytes(t) for t in self.prompts[pi]).decode(errors="replace")

    def _matcher(self, done_ids: list[int]) -> Any:
        from llguidance import LLMatcher

        m = LLMatcher(self.engine.ll_tokenizer(), self.p.grammar or "", log_level=0)
        if done_ids:
            m.consume_tokens(done_ids)
        if m.is_error():
            raise JobError(f"Invalid grammar: {m.get_error()}", param="grammar", code="invalid_grammar")
        return m

    # -- the attempt ------------------------------------------------------------------------
    def run(self) -> str:
        job = self.job
        if job.started_at is not None and job.created_at is not None:
            QUEUE_WAIT.labels(job.model, job.kind).observe((job.started_at - job.created_at).total_seconds())
        specs = self._build()
        if not self.buffered:
            self._publish([ch for ch in self.choices.values() if ch.prefix_ready])
        inbox: queue.SimpleQueue[TokenEvent | PromptEvent] = queue.SimpleQueue()
        self.loop.submit(specs, inbox.put)
        live = {s.key for s in specs}
        by_key: dict[Hashable, _Choice] = {ch.key: ch for ch in self.choices.values()}
        next_control = time.monotonic() + 0.5
        next_renew = time.monotonic() + self.settings.lease_s / 3
        unsent: dict[_Choice, None] = {}  # touched since the last publish, in arrival order
        publish_every = self.settings.batch_publish_s if job.kind == "batch" else 0.0
        next_publish = 0.0
        try:
            while live:
                try:
                    batch = [inbox.get(timeout=0.25)]
                except queue.Empty:
                    batch = []
                while True:  # coalesce: one Redis round trip for everything that is ready
                    try:
                        batch.append(inbox.get_nowait())
                    except queue.Empty:
                        break
                for ev in batch:
                    unsent[self._accept(by_key[ev.key], ev, live)] = None
                now = time.monotonic()
                # A stream reader wants every token at once; a batch line's progress is only read to
                # resume it, and publishing it per token took CPU from the decode on small hosts.
                if unsent and not self.buffered and (now >= next_publish or any(ch.done for ch in unsent)):
                    self._publish(list(unsent))
                    unsent.clear()
                    next_publish = now + publish_every
                if now >= next_control:
                    next_control = now + 0.5
                    if self._cancelled():
                        log.info("job %s cancelled; dropping its sequences", job.id)
                        return "cancelled"
                if now >= next_renew:
                    next_renew = now + self.settings.lease_s / 3
                    if self.loop.stalled_for() > self.settings.engine_stall_s:
                        # A wedged engine must not keep its jobs: stop renewing, the lease lapses and the
                        # job resumes elsewhere from its streamed tokens.
                        raise Abandoned(f"engine stalled {self.loop.stalled_for():.0f}s")
                    if not retrying(self.settings, f"renew {job.id}", self.runner.renew, job):
                        log.info("job %s attempt %s lost its lease (cancelled or reassigned)", job.id, job.attempt)
                        return "lost"
        finally:
            if live:
                self.loop.cancel(list(live))

        final = self._select()
        if self.buffered:
            self._publish(list(final.values()), index_of={ch: i for i, ch in final.items()})
        result = JobResult(choices=[self._result_choice(i, ch) for i, ch in sorted(final.items())])
        cached = sum(
            max((ch.cached for ch in self.choices.values() if ch.prompt == pi), default=0)
            for pi in range(len(self.prompts))
        )
        u = Usage(
            prompt_tokens=sum(len(ids) for ids in self.prompts),
            # A generated end-of-sequence token is a completion token (as vLLM counts it, and as
            # logprobs list it): docs/parameters.md.
            completion_tokens=sum(len(ch.text.ids) + ch.eos for ch in self.choices.values()),
            cached_tokens=cached,
        )
        if not retrying(
            self.settings, f"finish {job.id}", self.runner.lifecycle.succeed, job, result, u, self.engine_s
        ):
            return "lost"
        return "succeeded"

    def _emit(self, out: list[Delta]) -> None:
        rds = self.runner.redis
        # Look for a lost stream at most once a second, not per publish (a hot path): a rebuild
        # rewrites every logged entry, so entries written into a fresh stream meanwhile are kept.
        now = time.monotonic()
        if self.log and now >= self._stream_checked + 1.0:
            self._stream_checked = now
            if not rds.exists(streams.stream_key(self.job.id)):
                self._rebuild_lost_stream()
        # Positional: this attempt's log holds every entry of the stream (earlier attempts' too).
        ids = self.runner.lifecycle.publish_deltas(self.job.id, self.job.attempt, out, start=len(self.log) + 1)
        self.log += zip(ids, (encode(e) for e in out), strict=True)

    def _rebuild_lost_stream(self) -> None:
        """The stream is gone (Redis restarted empty), and its fence with it: only the attempt that
        still owns the job may write it again. Ownership is asked of Postgres first (renewing the
        lease is the compare-and-set on state and attempt, and keeps a newer attempt from claiming
        the job while this one rebuilds); then the fence is raised to this attempt, and a fence
        already higher (a newer attempt got there) stops it before it writes anything."""
        job, rds, ttl = self.job, self.runner.redis, self.settings.events_ttl_s
        if not self.runner.renew(job):
            raise streams.Fenced(f"job {job.id}: attempt {job.attempt} no longer owns it; not rebuilding its stream")
        if streams.raise_fence(rds, job.id, job.attempt, ttl) > job.attempt:
            raise streams.Fenced(f"job {job.id}: attempt {job.attempt} was superseded; not rebuilding its stream")
        log.warning("job %s: its event stream was lost (Redis restarted?); rebuilding it", job.id)
        streams.rebuild(rds, job.id, self.log, ttl)

    def _renew_while_waiting(self) -> None:
        now = time.monotonic()
        if now < self._next_wait_renew:
            return
        self._next_wait_renew = now + self.settings.lease_s / 3
        try:
            self.runner.renew(self.job)
        except TRANSIENT:
            pass  # Postgres away too: the lease may lapse, and the job resumes elsewhere

    def _cancelled(self) -> bool:
        try:
            return bool(self.runner.redis.exists(streams.cancel_key(self.job.id)))
        except TRANSIENT:
            return False  # unknown while Redis is away: keep going; a cancel also ends the lease

    def _accept(self, ch: _Choice, ev: TokenEvent | PromptEvent, live: set) -> _Choice:
        """Apply one engine event to its choice."""
        if isinstance(ev, PromptEvent):
            ch.cached = ev.cached
            if ev.entries is not None and not ch.prefix_sent:
                self._prompt_scores(ch, ev.entries)
            return ch
        self.engine_s += ev.engine_s
        if ch.done:
            return ch
        if ev.error is not None:
            raise (Abandoned if ev.retry else EngineError)(ev.error)
        if ev.token_id is None and ev.eos_id is not None:
            ch.eos = True
        if ev.token_id is None and ev.eos_id is not None and ch.lp is not None and ev.logprob is not None:
            name = self.engine.token_text
            top = [TopToken(id=t, text=name(t), logprob=lp) for t, lp in (ev.top or [])]
            offset = len(ch.prefix_text) + len(ch.text.text)
            ch.lp.append(TokenScore(id=ev.eos_id, text=name(ev.eos_id), logprob=ev.logprob, offset=offset, top=top))
        if ev.token_id is not None:
            now = time.monotonic()
            if self._first_token_at is None:
                self._first_token_at = now
                if self.job.created_at is not None:
                    TTFT.labels(self.job.model, self.job.kind).observe(time.time() - self.job.created_at.timestamp())
            elif ch.last_token_at is not None:
                ITL.labels(self.job.model).observe(now - ch.last_token_at)
            ch.last_token_at = now
            offset = len(ch.prefix_text) + len(ch.text.text)
            ch.text.feed(ev.token_id)
            if ev.logprob is not None:
                ch.sum_lp += ev.logprob
            if ch.lp is not None:
                name = self.engine.token_text
                top = [TopToken(id=t, text=name(t), logprob=lp) for t, lp in (ev.top or [])]
                ch.lp.append(
                    TokenScore(id=ev.token_id, text=name(ev.token_id), logprob=ev.logprob, offset=offset, top=top)
                )
        if ch.text.finish_reason == "stop":  # a stop string: the engine does not know yet
            self.loop.cancel([ch.key])
        elif ev.finish_reason:
            ch.text.finish(ev.finish_reason)
        if ch.text.finish_reason:
            ch.done = True
            live.discard(ch.key)
        return ch

    def _prompt_scores(self, ch: _Choice, entries: list) -> None:
        """The engine's scores of the prompt's tokens (the first has none), neutral: protocol/render
        makes echo logprobs and vLLM's prompt_logprobs of them."""
        name = self.engine.token_text
        out: list[TokenScore | None] = []
        offset = 0
        for tok, (logprob, rank, top) in zip(self.prompts[ch.prompt], entries, strict=False):
            alts = [TopToken(id=t, text=name(t), logprob=v) for t, v in (top or [])] if logprob is not None else []
            out.append(TokenScore(id=tok, text=name(tok), logprob=logprob, rank=rank, offset=offset, top=alts))
            offset += len(name(tok))
        ch.prompt_scores = out
        ch.prefix_ready = True

    def _publish(self, touched: list[_Choice], index_of: dict[_Choice, int] | None = None) -> None:
        out: list[Delta] = []
        for ch in dict.fromkeys(touched):  # each choice once, in arrival order
            if ch.closed:
                continue
            prefix = ch.prefix_ready and not ch.prefix_sent
            piece = ch.text.take()
            ids = ch.text.ids[ch.sent_ids :]
            # Prompt scores alone (no echo) ride on the first real delta: never an empty chunk first.
            if not piece and not ids and not ch.done and not (prefix and self.p.echo):
                continue
            scores = None
            if ch.lp is not None:
                scores = ch.lp[ch.lp_sent :]
                ch.lp_sent = len(ch.lp)
            out.append(
                Delta(
                    attempt=self.job.attempt,
                    choice=index_of[ch] if index_of else ch.index,
                    text=(ch.prefix_text if prefix else "") + piece,
                    token_ids=ids,
                    finish_reason=ch.text.finish_reason if ch.done else None,
                    eos=True if ch.done and ch.eos else None,
                    prefix_len=len(ch.prefix_text) if prefix else None,
                    prompt_scores=ch.prompt_scores if prefix else None,
                    scores=scores,
                )
            )
            if prefix:
                ch.prefix_sent = True
            ch.sent_ids = len(ch.text.ids)
            ch.closed = ch.done
        if out:
            # While Redis is away the attempt waits here, and keeps renewing its lease in Postgres: an
            # outage must not hand the job to a second attempt, which would find the stream empty.
            retrying(self.settings, f"publish {self.job.id}", self._emit, out, on_wait=self._renew_while_waiting)

    def _select(self) -> dict[int, _Choice]:
        """The returned choices by OpenAI index: all, or best_of's top n per prompt by mean logprob."""
        p = self.p
        if p.best_of <= p.n:
            return self.choices
        out: dict[int, _Choice] = {}
        for pi in range(len(self.prompts)):
            cands = sorted(
                (ch for ch in self.choices.values() if ch.prompt == pi),
                key=lambda ch: ch.sum_lp / max(1, len(ch.text.ids)),
                reverse=True,
            )
            for j, ch in enumerate(cands[: p.n]):
                out[choice_index(pi, j, p.n)] = ch
        return out

    def _result_choice(self, index: int, ch: _Choice) -> ChoiceResult:
        return ChoiceResult(
            index=index,
            text=ch.prefix_text + ch.text.text,
            finish_reason=ch.text.finish_reason,
            prefix_len=len(ch.prefix_text),
            scores=ch.lp,
            prompt_scores=ch.prompt_scores,
        )

    def _prior_progress(self) -> dict[int, tuple[list[int], str, str | None, bool]]:
        """What earlier attempts already streamed, per choice: token ids, completion text sent
        (without the echoed prompt), finish, and whether the prompt part went out."""
        out: dict[int, tuple[list[int], str, str | None, bool]] = {}
        for entry_id, raw in streams.entries(self.runner.redis, self.job.id):
            self.log.append((entry_id, raw))
            ev = decode(raw)
            if not isinstance(ev, Delta):
                continue
            ids, text, _, prefix = out.get(ev.choice, ([], "", None, False))
            if ev.eos:
                self.prior_eos.add(ev.choice)
            out[ev.choice] = (
                ids + ev.token_ids,
                text + ev.text[ev.prefix_len or 0 :],
                ev.finish_reason,
                prefix or ev.prefix_len is not None,
            )
        return out
