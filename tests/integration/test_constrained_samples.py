"""The statistical checks of constrained output (chat: 50 sampled choices each; completions: 100 of
each constraint) driven in-process: the
request translated as the API translates it (`core.jobs.service.translate`), stored as a job row in
the real Postgres, run by the worker's job runner on the real SmolLM2 engine (publishing to the real
Redis), and the stored result rendered as the API renders it (`core.protocol.render`). Only HTTP is
left out; each of these has one sample on the wire, through the `openai` SDK, in tests/e2e/test_chat.py.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable

import jsonschema
import pytest

from core.infra.orm import Job
from core.infra.tokenizers import tokenizer_for
from core.jobs.service import translate
from core.protocol import render
from core.protocol.schemas import ChatCompletionRequest, CompletionRequest
from core.registry import smollm2_gguf
from core.states import JobState
from ops import factories
from ops.harness import ENGINE_THREADS
from tests import openapi
from tests.helpers import CONSTRAINTS, PERSON, WEATHER
from workers.engine.llamacpp import LlamaCppEngine
from workers.engine.loop import EngineLoop
from workers.runner import JobRunner

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def loop() -> EngineLoop:
    # The test stack's engine: its context and slots (ops/harness.py), one thread per shard.
    engine = LlamaCppEngine(
        MODEL, smollm2_gguf(), n_ctx=1024, max_batch=16, interactive_slots=4, n_threads=ENGINE_THREADS
    )
    return EngineLoop(engine)


@pytest.fixture
def run(session, sessions, rds, it_settings, loop) -> Callable[..., dict]:
    """`_run` on this test's Postgres session, Redis and the module's engine."""
    return functools.partial(_run, session, sessions, rds, it_settings, loop)


def _run(session, sessions, rds, it_settings, loop, **body) -> dict:
    """A request run as a job to its end (a chat one if it has messages): the body the API would answer."""
    chat = "messages" in body
    req = (ChatCompletionRequest if chat else CompletionRequest).model_validate({"model": MODEL, **body})
    params, prompts, meta = translate(req, it_settings, tokenizer_for(MODEL))
    t = factories.tenant(session)
    job = factories.job(
        session, t, state=JobState.dispatched, params=params, prompts=[p.to_json() for p in prompts], chat=meta
    )
    assert JobRunner(loop, it_settings, rds, sessions, "w-constrained").run(job.id, 1) == "succeeded"
    row = session.get(Job, job.id, populate_existing=True)
    body = render.response(row, "fp_test")
    openapi.validate(body, "CreateChatCompletionResponse" if chat else "CreateCompletionResponse")
    return body


def _fifty(run, question: str, **body) -> list[dict]:
    """50 samples at temperature 1 of one user question: the choices, all 50 of them there."""
    choices = run(messages=[{"role": "user", "content": question}], n=50, temperature=1.0, **body)["choices"]
    assert len(choices) == 50
    return choices


def test_json_schema_strict_gives_valid_json_in_50_of_50_samples(run):
    person = {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": PERSON}}
    choices = _fifty(run, "Describe a person as JSON.", response_format=person, seed=3, max_tokens=120)
    for c in choices:
        assert c["finish_reason"] == "stop", c
        jsonschema.validate(json.loads(c["message"]["content"]), PERSON)
    assert len({c["message"]["content"] for c in choices}) > 5  # really sampled, not one answer 50 times


def test_a_named_tool_choice_yields_valid_calls_in_50_of_50_samples(run):
    named = {"type": "function", "function": {"name": "get_weather"}}
    choices = _fifty(
        run, "What's the weather like in Paris?", tools=[WEATHER], tool_choice=named, seed=5, max_tokens=80
    )
    for c in choices:
        assert c["finish_reason"] == "tool_calls", c
        assert c["message"]["tool_calls"] and c["message"]["content"] is None
        call = c["message"]["tool_calls"][0]
        assert call["type"] == "function" and call["function"]["name"] == "get_weather"
        assert call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])


@pytest.mark.parametrize("name", sorted(CONSTRAINTS))
def test_a_completion_constraint_holds_in_100_samples(run, name):
    constraint, check = CONSTRAINTS[name]
    choices = []
    for seed in (1, 2):
        body = run(prompt="Answer:", n=50, temperature=1.0, seed=seed, max_tokens=40, **constraint)
        choices += body["choices"]
    assert len(choices) == 100
    finished = [c for c in choices if c["finish_reason"] == "stop"]
    assert len(finished) >= 95, f"only {len(finished)} of 100 finished inside max_tokens"
    bad = [c["text"] for c in finished if not check(c["text"])]
    assert not bad, bad[:5]
