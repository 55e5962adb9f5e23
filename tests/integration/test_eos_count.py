"""A generated end-of-sequence token is a completion token (vLLM's rule, docs/parameters.md): in the
usage a worker records, on a resumed attempt, and in what a job that ends early bills. Real Postgres
and Redis, in-process runner; the engine is the null engine made to end with an end-of-sequence token."""

from __future__ import annotations

from dataclasses import replace

import pytest

from core.generation.events import Delta, decode, encode
from core.infra.orm import Job
from core.infra.streams import write
from core.jobs.lifecycle import Lifecycle
from core.states import JobState
from ops import factories
from workers.engine.base import PromptEvent, SeqSpec, TokenEvent
from workers.engine.loop import EngineLoop
from workers.engine.null import NullEngine
from workers.runner import JobRunner

MODEL = "smollm2-135m-instruct"
EOS = 2


class EndingEngine(NullEngine):
    """The null engine's first two words, then the end-of-sequence token (no text, as llama.cpp's
    engine reports it)."""

    def add(self, spec: SeqSpec) -> None:
        super().add(replace(spec, max_new_tokens=2))

    def step(self) -> list[TokenEvent | PromptEvent]:
        out: list[TokenEvent | PromptEvent] = []
        for ev in super().step():
            if isinstance(ev, TokenEvent) and ev.finish_reason == "length":  # the second word: the end follows
                out += [replace(ev, finish_reason=None), replace(ev, token_id=None, finish_reason="stop", eos_id=EOS)]
            else:
                out.append(ev)
        return out


@pytest.fixture(scope="module")
def loop():
    return EngineLoop(EndingEngine(MODEL, n_ctx=512, max_batch=4))


@pytest.mark.parametrize("logprobs", [None, 0])
def test_the_end_of_sequence_token_is_counted_and_marked_on_the_last_delta(
    session, sessions, rds, it_settings, loop, logprobs
):
    t = factories.tenant(session)
    job = factories.job(session, t, state=JobState.dispatched, params=factories.params(max_tokens=8, logprobs=logprobs))
    assert JobRunner(loop, it_settings, rds, sessions, "w-eos").run(job.id, 1) == "succeeded"
    row = session.get(Job, job.id, populate_existing=True)
    assert row.usage["completion_tokens"] == 3  # two words and the end of sequence
    deltas = [e for _, raw in write.entries(rds, job.id) if isinstance(e := decode(raw), Delta)]
    assert deltas[-1].eos is True and deltas[-1].finish_reason == "stop"
    if logprobs is not None:
        assert len(row.result["choices"][0]["scores"]) == 3  # as many scores as completion tokens


def test_a_resumed_attempt_keeps_counting_an_end_an_earlier_one_streamed(session, sessions, rds, it_settings, loop):
    t = factories.tenant(session)
    job = factories.job(session, t, state=JobState.dispatched, attempt=2, params=factories.params(max_tokens=8))
    # Attempt 1 streamed the whole choice, its end included, and died before recording the result.
    write.raise_fence(rds, job.id, 1, 60)
    words = EndingEngine(MODEL, n_ctx=512, max_batch=1)._words[:2]
    ended = Delta(attempt=1, choice=0, text="x", token_ids=words, finish_reason="stop", eos=True)
    write.append_fenced(rds, job.id, 1, [encode(ended)], 60, start=1)
    assert JobRunner(loop, it_settings, rds, sessions, "w-eos").run(job.id, 2) == "succeeded"
    row = session.get(Job, job.id, populate_existing=True)
    assert row.usage["completion_tokens"] == 3


def test_a_job_that_ends_early_bills_a_streamed_end_of_sequence(session, sessions, rds, it_settings):
    t = factories.tenant(session)
    job = factories.job(session, t, state=JobState.running, params=factories.params(n=2, max_tokens=8))
    write.raise_fence(rds, job.id, 1, 60)
    done = Delta(attempt=1, choice=0, text="ab", token_ids=[10, 11], finish_reason="stop", eos=True)
    going = Delta(attempt=1, choice=1, text="c", token_ids=[12])
    write.append_fenced(rds, job.id, 1, [encode(done), encode(going)], 60, start=1)
    assert Lifecycle(sessions, rds, it_settings).produced(job).completion_tokens == 4
