"""The worker path with constraints and many sequences, in-process with the real llama.cpp engine
(SmolLM2) on real Postgres and Redis:

- a `guided_choice` of 1,900 entries runs end to end, its grammar compiled once for all of a job's
  sequences (compiles counted, not timed);
- the lease is renewed while an attempt is still starting (a grammar compiling), so a compile longer
  than the lease does not hand the job to a second attempt;
- sequences, not jobs, count against a tenant's share of the engine's slots: a wide (`n=24`; `n=128` alike) job of a
  tenant with `max_concurrent=1` leaves a slot for another tenant's request.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import llguidance
import pytest

from core.generation import constraints
from core.generation.events import Delta, decode
from core.infra.orm import Job
from core.infra.streams import write
from core.jobs.lifecycle import Lifecycle
from core.registry import smollm2_gguf
from core.states import JobState
from ops import factories
from ops.harness import ENGINE_THREADS
from tests.conftest import wait_for
from workers.engine.llamacpp import LlamaCppEngine
from workers.engine.loop import EngineLoop
from workers.runner import JobRunner, tenant_cap

MODEL = "smollm2-135m-instruct"
# A job 12x wider than its tenant's share of the engine (an n=128 job behaves the same, only slower).
N = 24


@pytest.fixture(scope="module")
def engine() -> LlamaCppEngine:
    # Two batch slots and one reserved for interactive work: three slots.
    return LlamaCppEngine(MODEL, smollm2_gguf(), n_ctx=512, max_batch=2, interactive_slots=1, n_threads=ENGINE_THREADS)


@pytest.fixture(scope="module")
def loop(engine) -> EngineLoop:
    return EngineLoop(engine)


@pytest.fixture
def settings(it_settings):
    return it_settings.model_copy(update={"engine": "llamacpp", "max_batch": 2, "interactive_slots": 1})


@pytest.fixture
def compiles(monkeypatch) -> list[float]:
    """Every LLMatcher llguidance builds from a grammar (a compile), with the seconds it took."""
    real = llguidance.LLMatcher
    seen: list[float] = []

    def counted(*a: Any, **k: Any) -> Any:
        started = time.monotonic()
        m = real(*a, **k)
        seen.append(time.monotonic() - started)
        return m

    monkeypatch.setattr(llguidance, "LLMatcher", counted)
    return seen


def _prompt(engine, text: str) -> list[dict[str, Any]]:
    return [{"ids": engine.tokenize(text), "text": None}]


def _texts(rds, job_id: str) -> dict[int, str]:
    out: dict[int, str] = {}
    for _, raw in write.entries(rds, job_id):
        ev = decode(raw)
        if isinstance(ev, Delta):
            out[ev.choice] = out.get(ev.choice, "") + ev.text
    return out


def test_nineteen_hundred_choices_run_and_compile_once_per_job(
    session, sessions, rds, settings, engine, loop, compiles
):
    choices = [f"label-{i:04d}" for i in range(1900)]
    grammar = constraints.build(guided_choice=choices)
    t = factories.tenant(session)
    p = factories.params(max_tokens=12, n=4, best_of=4, temperature=0.8, seed=11, grammar=grammar)
    job = factories.job(session, t, state=JobState.dispatched, params=p, prompts=_prompt(engine, "Pick a label:"))
    engine.ll_tokenizer()  # llguidance's view of the vocabulary: built once per engine, not a compile
    assert JobRunner(loop, settings, rds, sessions, "w-choice").run(job.id, 1) == "succeeded"
    row = session.get(Job, job.id, populate_existing=True)
    texts = [c["text"] for c in row.result["choices"]]
    assert len(texts) == 4 and all(x in choices for x in texts), texts
    assert len(compiles) == 1  # one compile for the job's four sequences (it was one per sequence)


def test_the_lease_is_renewed_while_a_grammar_compiles(session, sessions, rds, settings, engine, loop, monkeypatch):
    short = settings.model_copy(update={"lease_s": 1.5})
    real = llguidance.LLMatcher

    def slow(*a: Any, **k: Any) -> Any:
        time.sleep(3.0)  # a compile longer than the lease (a big grammar on a busy host)
        return real(*a, **k)

    monkeypatch.setattr(llguidance, "LLMatcher", slow)
    t = factories.tenant(session)
    p = factories.params(max_tokens=4, grammar=constraints.build(guided_choice=["yes", "no"]))
    job = factories.job(session, t, state=JobState.dispatched, params=p, prompts=_prompt(engine, "Answer:"))
    engine.ll_tokenizer()
    outcome: list[str] = []
    worker = threading.Thread(
        target=lambda: outcome.append(JobRunner(loop, short, rds, sessions, "w-slow").run(job.id, 1))
    )
    worker.start()
    try:
        wait_for(lambda: session.get(Job, job.id, populate_existing=True).state == JobState.running.value, 10, "claim")
        # Past the lease the claim took (1.5 s): only a renewal during the compile keeps the job.
        time.sleep(2.2)  # time passing is the point: the claim's lease would have lapsed by now
        assert Lifecycle(sessions, rds, short).reap().get("requeued", 0) == 0
    finally:
        worker.join(30)
    assert outcome == ["succeeded"]


def test_a_wide_job_leaves_slots_for_another_tenant(session, sessions, rds, settings, engine, loop):
    assert tenant_cap(settings, engine.max_batch) == 2  # of the engine's three slots
    greedy = factories.tenant(session, max_concurrent=1)
    other = factories.tenant(session)
    big = factories.job(
        session,
        greedy,
        state=JobState.dispatched,
        params=factories.params(max_tokens=3, n=N, best_of=N, ignore_eos=True),
        prompts=_prompt(engine, "Count:"),
    )
    small = factories.job(
        session,
        other,
        state=JobState.dispatched,
        params=factories.params(max_tokens=3, ignore_eos=True),
        prompts=_prompt(engine, "Hello"),
    )
    runner = JobRunner(loop, settings, rds, sessions, "w-share")
    outcome: list[str] = []
    worker = threading.Thread(target=lambda: outcome.append(runner.run(big.id, 1)))
    worker.start()
    try:
        wait_for(lambda: _texts(rds, big.id), 30, "the big job's first tokens")
        assert runner.run(small.id, 1) == "succeeded"
        # The other tenant's request did not wait for the N sequences ahead of it: most of them had
        # not even started when it ended.
        ended = sum(1 for _, raw in write.entries(rds, big.id) if getattr(decode(raw), "finish_reason", None))
        assert ended < N // 2, f"{ended} of the big job's {N} sequences ended before the other tenant's one"
    finally:
        worker.join(120)
    assert outcome == ["succeeded"]
    assert runner.share.most[greedy.id] <= 2  # never more of its sequences in the engine than its share
    row = session.get(Job, big.id, populate_existing=True)
    assert len(row.result["choices"]) == N and row.usage["completion_tokens"] == N * 3
