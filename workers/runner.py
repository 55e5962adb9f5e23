"""Runs one job attempt on the engine loop: claim, generate, stream events, settle.

The Celery task is a thin entrypoint over `JobRunner.run`. Every state change goes through
core/jobs.py; every event through core/events.py.
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass, field
from typing import Any

import redis
from sqlalchemy.orm import sessionmaker

from core import events, jobs, ratelimit, usage
from core.metrics import QUEUE_WAIT
from core.models import Job
from core.params import GenerationParams, choice_index
from core.settings import Settings
from workers.engine.base import PromptEvent, SeqSpec, TokenEvent
from workers.engine.loop import EngineLoop
from workers.engine.text import ChoiceText

log = logging.getLogger(__name__)


class JobError(Exception):
    """A job that cannot succeed; `error` is OpenAI's error object, stored on the job."""

    def __init__(
        self, message: str, type_: str = "invalid_request_error", code: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.error = {"message": message, "type": type_, "param": param, "code": code}


@dataclass
class _Logprobs:
    """OpenAI's completion logprobs, accumulated or for one delta."""

    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, token: str, lp: float | None, top: dict[str, float] | None, offset: int) -> None:
        self.tokens.append(token)
        self.token_logprobs.append(lp)
        self.top_logprobs.append(top)
        self.text_offset.append(offset)

    def extend(self, other: _Logprobs) -> None:
        for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(self, k).extend(getattr(other, k))

    def since(self, k: int) -> _Logprobs:
        return _Logprobs(self.tokens[k:], self.token_logprobs[k:], self.top_logprobs[k:], self.text_offset[k:])

    def __len__(self) -> int:
        return len(self.tokens)

    def to_json(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


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
    prefix_lp: _Logprobs | None = None
    prompt_logprobs: list[Any] | None = None
    lp: _Logprobs | None = None  # every generated token's logprobs; None when not asked for
    lp_sent: int = 0  # how many of them earlier deltas carried
    sum_lp: float = 0.0
    cached: int = 0


class JobRunner:
    def __init__(
        self, loop: EngineLoop, settings: Settings, redis_client: redis.Redis, sessions: sessionmaker, worker_name: str
    ) -> None:
        self.loop = loop
        self.settings = settings
        self.redis = redis_client
        self.sessions = sessions
        self.worker_name = worker_name

    # -- entrypoint -------------------------------------------------------------------------
    def run(self, job_id: str, attempt: int) -> str:
        with self.sessions() as s:
            job = s.execute(jobs.claim(job_id, attempt, self.worker_name, self.settings.lease_s)).scalar()
            s.commit()
        if job is None:
            log.info("job %s attempt %s: not claimable (duplicate or stale message); skipped", job_id, attempt)
            return "skipped"
        try:
            return _Attempt(self, job).run()
        except JobError as exc:
            self._fail(job, exc.error)
            return "failed"
        except Exception as exc:
            log.exception("job %s failed", job_id)
            self._fail(
                job,
                {"message": f"Generation failed: {exc}", "type": "server_error", "param": None, "code": "engine_error"},
            )
            return "failed"

    # -- helpers ----------------------------------------------------------------------------
    def append_events(self, job_id: str, evs: list[dict[str, Any]]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        events.queue_append(pipe, job_id, evs, self.settings.events_ttl_s, self.settings.events_maxlen)
        pipe.execute()

    def renew(self, job: Job) -> bool:
        with self.sessions() as s:
            ok = s.execute(jobs.renew_lease(job.id, job.attempt, self.settings.lease_s)).first() is not None
            s.commit()
        return ok

    def settle(
        self,
        job: Job,
        stmt: Any,
        outcome: str,
        *,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        engine_s: float = 0.0,
    ) -> bool:
        """Run a terminal transition and record the job's usage in the same transaction, then settle
        its rate-limit reservation. False when the transition matched nothing (cancelled, or no
        longer this attempt's job): then nothing is recorded here, whoever won did it."""
        with self.sessions() as s:
            won = s.execute(stmt).first() is not None
            if won:
                s.execute(
                    usage.record(
                        tenant_id=job.tenant_id,
                        key_id=job.key_id,
                        model=job.model,
                        prompt_tokens=prompt_tokens,
                        completion_tokens=completion_tokens,
                        gpu_seconds=engine_s,
                        outcome=outcome,
                    )
                )
            s.commit()
        if won:
            ratelimit.settle(self.redis, job.id, prompt_tokens + completion_tokens if outcome == "succeeded" else 0)
        return won

    def _fail(self, job: Job, error: dict[str, Any]) -> None:
        if self.settle(job, jobs.fail(job.id, job.attempt, error), "failed"):
            self.append_events(job.id, [{"type": "error", "attempt": job.attempt, "error": error}])


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

    # -- setup ------------------------------------------------------------------------------
    def _build(self) -> list[SeqSpec]:
        job, p, engine = self.job, self.p, self.engine
        prior = self._prior_progress() if job.attempt > 1 and not self.buffered else {}
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
                ch.lp = _Logprobs() if p.logprobs is not None else None
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

        m = LLMatcher(self.engine.ll_tokenizer(), self.p.grammar, log_level=0)
        if done_ids:
            m.consume_tokens(done_ids)
        if m.is_error():
            raise JobError(f"Invalid grammar: {m.get_error()}", param="grammar", code="invalid_grammar")
        return m

    # -- the attempt ------------------------------------------------------------------------
    def run(self) -> str:
        job = self.job
        if job.started_at is not None and job.created_at is not None:
            QUEUE_WAIT.labels(job.kind).observe((job.started_at - job.created_at).total_seconds())
        specs = self._build()
        if not self.buffered:
            self._publish([ch for ch in self.choices.values() if ch.prefix_ready])
        inbox: queue.SimpleQueue[TokenEvent | PromptEvent] = queue.SimpleQueue()
        self.loop.submit(specs, inbox.put)
        live = {s.key for s in specs}
        by_key = {ch.key: ch for ch in self.choices.values()}
        next_control = time.monotonic() + 0.5
        next_renew = time.monotonic() + self.settings.lease_s / 3
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
                touched = [self._accept(by_key[ev.key], ev, live) for ev in batch]
                if touched and not self.buffered:
                    self._publish(touched)
                now = time.monotonic()
                if now >= next_control:
                    next_control = now + 0.5
                    if self.runner.redis.exists(events.cancel_key(job.id)):
                        log.info("job %s cancelled; dropping its sequences", job.id)
                        return "cancelled"
                if now >= next_renew:
                    next_renew = now + self.settings.lease_s / 3
                    if not self.runner.renew(job):
                        log.info("job %s attempt %s lost its lease (cancelled or reassigned)", job.id, job.attempt)
                        return "lost"
        finally:
            if live:
                self.loop.cancel(list(live))

        final = self._select()
        if self.buffered:
            self._publish(list(final.values()), index_of={ch: i for i, ch in final.items()})
        result = {"choices": [self._result_choice(i, ch) for i, ch in sorted(final.items())]}
        prompt_tokens = sum(len(ids) for ids in self.prompts)
        completion_tokens = sum(len(ch.text.ids) for ch in self.choices.values())
        cached = sum(
            max((ch.cached for ch in self.choices.values() if ch.prompt == pi), default=0)
            for pi in range(len(self.prompts))
        )
        usage_body = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        won = self.runner.settle(
            job,
            jobs.succeed(job.id, job.attempt, result, usage_body),
            "succeeded",
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            engine_s=self.engine_s,
        )
        if not won:
            return "lost"
        self.runner.append_events(job.id, [{"type": "done", "attempt": job.attempt, "usage": usage_body}])
        return "succeeded"

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
        if ev.finish_reason and ev.finish_reason.startswith("error:"):
            raise RuntimeError(ev.finish_reason[6:])
        if ev.token_id is not None:
            offset = len(ch.prefix_text) + len(ch.text.text)
            ch.text.feed(ev.token_id)
            if ev.logprob is not None:
                ch.sum_lp += ev.logprob
            if ch.lp is not None:
                name = self.engine.token_text
                top = {name(t): lp for t, lp in (ev.top or [])}
                top.setdefault(name(ev.token_id), ev.logprob)
                ch.lp.add(name(ev.token_id), ev.logprob, top, offset)
        if ch.text.finish_reason == "stop":  # a stop string: the engine does not know yet
            self.loop.cancel([ch.key])
        elif ev.finish_reason:
            ch.text.finish(ev.finish_reason)
        if ch.text.finish_reason:
            ch.done = True
            live.discard(ch.key)
        return ch

    def _prompt_scores(self, ch: _Choice, entries: list) -> None:
        p, name = self.p, self.engine.token_text
        ids = self.prompts[ch.prompt]
        if p.echo and p.logprobs is not None:
            lp, offset = _Logprobs(), 0
            for tok, (logprob, _rank, top) in zip(ids, entries, strict=False):
                tops = None
                if logprob is not None:
                    tops = {name(t): v for t, v in (top or [])[: p.logprobs]}
                    tops.setdefault(name(tok), logprob)
                lp.add(name(tok), logprob, tops, offset)
                offset += len(name(tok))
            ch.prefix_lp = lp
        if p.prompt_logprobs is not None:
            out: list[Any] = []
            for tok, (logprob, rank, top) in zip(ids, entries, strict=False):
                if logprob is None:
                    out.append(None)
                    continue
                d = {
                    str(t): {"logprob": v, "rank": i + 1, "decoded_token": name(t)}
                    for i, (t, v) in enumerate((top or [])[: p.prompt_logprobs])
                }
                d.setdefault(str(tok), {"logprob": logprob, "rank": rank, "decoded_token": name(tok)})
                out.append(d)
            ch.prompt_logprobs = out
        ch.prefix_ready = True

    def _publish(self, touched: list[_Choice], index_of: dict[_Choice, int] | None = None) -> None:
        p, out = self.p, []
        for ch in dict.fromkeys(touched):  # each choice once, in arrival order
            if ch.closed:
                continue
            prefix = ch.prefix_ready and not ch.prefix_sent
            piece = ch.text.take()
            ids = ch.text.ids[ch.sent_ids :]
            # Prompt scores alone (no echo) ride on the first real delta: never an empty chunk first.
            if not piece and not ids and not ch.done and not (prefix and p.echo):
                continue
            ev: dict[str, Any] = {
                "type": "delta",
                "attempt": self.job.attempt,
                "choice": index_of[ch] if index_of else ch.index,
                "text": (ch.prefix_text if prefix else "") + piece,
                "token_ids": ids,
                "finish_reason": ch.text.finish_reason if ch.done else None,
            }
            if prefix:
                ch.prefix_sent = True
                ev["prefix_len"] = len(ch.prefix_text)
                if ch.prompt_logprobs is not None:
                    ev["prompt_logprobs"] = ch.prompt_logprobs
            if ch.lp is not None:
                delta = _Logprobs()
                if prefix and ch.prefix_lp is not None:
                    delta.extend(ch.prefix_lp)
                delta.extend(ch.lp.since(ch.lp_sent))
                ch.lp_sent = len(ch.lp)
                ev["logprobs"] = delta.to_json()
            ch.sent_ids = len(ch.text.ids)
            ch.closed = ch.done
            out.append(ev)
        if out:
            self.runner.append_events(self.job.id, out)

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

    def _result_choice(self, index: int, ch: _Choice) -> dict[str, Any]:
        lp = None
        if ch.lp is not None:
            full = _Logprobs()
            if ch.prefix_lp is not None:
                full.extend(ch.prefix_lp)
            full.extend(ch.lp)
            lp = full.to_json()
        out = {
            "index": index,
            "text": ch.prefix_text + ch.text.text,
            "logprobs": lp,
            "finish_reason": ch.text.finish_reason,
        }
        if self.p.prompt_logprobs is not None:
            out["prompt_logprobs"] = ch.prompt_logprobs
        return out

    def _prior_progress(self) -> dict[int, tuple[list[int], str, str | None, bool]]:
        """What earlier attempts already streamed, per choice: token ids, completion text sent
        (without the echoed prompt), finish, and whether the prompt part went out."""
        out: dict[int, tuple[list[int], str, str | None, bool]] = {}
        for _id, fields in self.runner.redis.xrange(events.stream_key(self.job.id)):
            ev = events.decode(fields)
            if ev.get("type") != "delta":
                continue
            ids, text, _, prefix = out.get(ev["choice"], ([], "", None, False))
            skip = ev.get("prefix_len", 0)
            out[ev["choice"]] = (
                ids + ev["token_ids"],
                text + ev["text"][skip:],
                ev["finish_reason"],
                prefix or "prefix_len" in ev,
            )
        return out
