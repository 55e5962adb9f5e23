"""Runs one job attempt on the engine loop: claim, generate, stream events, settle.

The Celery task is a thin entrypoint over `JobRunner.run`. Every state change goes through
core/jobs.py; every event through core/events.py.
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass
from typing import Any

import redis
from sqlalchemy.orm import sessionmaker

from core import events, jobs
from core.models import Job
from core.params import GenerationParams, choice_index
from core.settings import Settings
from workers.engine.base import SeqSpec, TokenEvent
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


@dataclass(eq=False)  # identity-hashed: used as a dict key while coalescing
class _Choice:
    text: ChoiceText
    key: tuple[str, int, int]
    sent_ids: int = 0  # how many of text.ids earlier events already carried
    done: bool = False  # finished: no more tokens accepted
    closed: bool = False  # its final delta (with finish_reason) has been published


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
            return self._generate(job)
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

    # -- generation -------------------------------------------------------------------------
    def _generate(self, job: Job) -> str:
        params = GenerationParams.from_json(job.params)
        engine = self.loop.engine
        prompt_ids = [engine.tokenize(p) if isinstance(p, str) else list(p) for p in job.prompts]
        prior = self._prior_progress(job) if job.attempt > 1 else {}

        choices: dict[int, _Choice] = {}
        specs: list[SeqSpec] = []
        ended: list[dict[str, Any]] = []
        for pi, ids in enumerate(prompt_ids):
            room = engine.n_ctx - len(ids)
            if room <= 0:
                raise JobError(
                    f"This model's maximum context length is {engine.n_ctx} tokens; prompt {pi} has {len(ids)}.",
                    code="context_length_exceeded",
                    param="prompt",
                )
            budget = room if params.max_tokens is None else min(params.max_tokens, room)
            for j in range(params.n):
                c = choice_index(pi, j, params.n)
                ch = _Choice(ChoiceText(params.stop, engine.token_bytes), (job.id, job.attempt, c))
                done_ids, sent, finish = prior.get(c, ([], "", None))
                if done_ids or sent:
                    ch.text.restore(done_ids, sent)
                    ch.sent_ids = len(done_ids)
                choices[c] = ch
                left = budget - len(done_ids)
                if finish or left <= 0:
                    ch.text.finish(finish or "length")
                    ch.done = ch.closed = True
                    if not finish:  # nothing to generate (max_tokens 0): still say why it ended
                        ended.append(
                            {
                                "type": "delta",
                                "attempt": job.attempt,
                                "choice": c,
                                "text": "",
                                "token_ids": [],
                                "finish_reason": "length",
                            }
                        )
                    continue
                specs.append(
                    SeqSpec(
                        key=ch.key,
                        prompt_ids=ids + done_ids,
                        max_new_tokens=left,
                        temperature=params.temperature,
                        top_p=params.top_p,
                        # A resumed choice cannot replay the dead attempt's RNG; offset keeps it seeded.
                        seed=(params.seed + c + 1_000_003 * len(done_ids)) % 2**63,
                        ignore_eos=params.ignore_eos,
                    )
                )

        if ended:
            self._append(job.id, ended)
        inbox: queue.SimpleQueue[TokenEvent] = queue.SimpleQueue()
        self.loop.submit(specs, inbox.put)
        live = {s.key for s in specs}
        by_key = {ch.key: ch for ch in choices.values()}
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
                if batch:
                    self._publish(job, [by_key[ev.key] for ev in batch], batch, live)
                now = time.monotonic()
                if now >= next_control:
                    next_control = now + 0.5
                    if self.redis.exists(events.cancel_key(job.id)):
                        log.info("job %s cancelled; dropping its sequences", job.id)
                        return "cancelled"
                if now >= next_renew:
                    next_renew = now + self.settings.lease_s / 3
                    with self.sessions() as s:
                        renewed = s.execute(jobs.renew_lease(job.id, job.attempt, self.settings.lease_s)).first()
                        s.commit()
                    if renewed is None:
                        log.info("job %s attempt %s lost its lease (cancelled or reassigned)", job.id, job.attempt)
                        return "lost"
        finally:
            if live:
                self.loop.cancel(list(live))

        ordered = [choices[c] for c in sorted(choices)]
        result = {
            "choices": [
                {"index": c, "text": ch.text.text, "logprobs": None, "finish_reason": ch.text.finish_reason}
                for c, ch in zip(sorted(choices), ordered, strict=True)
            ]
        }
        prompt_tokens = sum(len(ids) for ids in prompt_ids)
        completion_tokens = sum(len(ch.text.ids) for ch in ordered)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        with self.sessions() as s:
            won = s.execute(jobs.succeed(job.id, job.attempt, result, usage)).first()
            s.commit()
        if won is None:
            return "lost"
        self._append(job.id, [{"type": "done", "attempt": job.attempt, "usage": usage}])
        return "succeeded"

    def _publish(self, job: Job, touched: list[_Choice], batch: list[TokenEvent], live: set) -> None:
        for ch, ev in zip(touched, batch, strict=True):
            if ch.done:
                continue
            if ev.finish_reason and ev.finish_reason.startswith("error:"):
                raise RuntimeError(ev.finish_reason[6:])
            if ev.token_id is not None:
                ch.text.feed(ev.token_id)
            if ch.text.finish_reason == "stop":  # a stop string: the engine does not know yet
                self.loop.cancel([ch.key])
            elif ev.finish_reason:
                ch.text.finish(ev.finish_reason)
            if ch.text.finish_reason:
                ch.done = True
                live.discard(ch.key)
        out = []
        for ch in dict.fromkeys(touched):  # each choice once, in arrival order
            if ch.closed:
                continue
            piece = ch.text.take()
            ids = ch.text.ids[ch.sent_ids :]
            if not piece and not ids and not ch.done:
                continue
            ch.sent_ids = len(ch.text.ids)
            ch.closed = ch.done
            finish = ch.text.finish_reason if ch.done else None
            out.append(
                {
                    "type": "delta",
                    "attempt": job.attempt,
                    "choice": ch.key[2],
                    "text": piece,
                    "token_ids": ids,
                    "finish_reason": finish,
                }
            )
        if out:
            self._append(job.id, out)

    # -- helpers ----------------------------------------------------------------------------
    def _append(self, job_id: str, evs: list[dict[str, Any]]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        events.queue_append(pipe, job_id, evs, self.settings.events_ttl_s, self.settings.events_maxlen)
        pipe.execute()

    def _prior_progress(self, job: Job) -> dict[int, tuple[list[int], str, str | None]]:
        """What earlier attempts already streamed, per choice: token ids, text sent, finish."""
        out: dict[int, tuple[list[int], str, str | None]] = {}
        for _id, fields in self.redis.xrange(events.stream_key(job.id)):
            ev = events.decode(fields)
            if ev.get("type") != "delta":
                continue
            ids, text, _ = out.get(ev["choice"], ([], "", None))
            out[ev["choice"]] = (ids + ev["token_ids"], text + ev["text"], ev["finish_reason"])
        return out

    def _fail(self, job: Job, error: dict[str, Any]) -> None:
        with self.sessions() as s:
            won = s.execute(jobs.fail(job.id, job.attempt, error)).first()
            s.commit()
        if won is not None:
            self._append(job.id, [{"type": "error", "attempt": job.attempt, "error": error}])
