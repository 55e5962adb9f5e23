"""A batch's `model` and `usage` (kept on its row by the trigger on jobs as lines end), a batch's
`output_expires_after` on the files it writes, an upload's `expires_after`, and the retention sweep
removing a file once it has expired (issue 51).

Real Postgres and Redis. The last test runs the API in-process (api/app.create_app under uvicorn on a
thread of its own, on this session's integration database) and reads it through the `openai` SDK;
validation, the lines' endings and finalization are the services the dispatcher and workers run."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from datetime import timedelta

import openai
import pytest
from sqlalchemy import func, select, text, update
from sqlalchemy.orm import Session, sessionmaker

from core.batches import ingest, progress
from core.config import Settings
from core.generation.events import ChoiceResult, JobResult, Usage
from core.infra.orm import Batch, File, FileChunk, Job, UsageDaily
from core.jobs.lifecycle import Lifecycle
from core.retention import sweep
from core.states import BatchStatus, JobState
from core.tenancy import quota
from ops import factories
from tests.integration.conftest import IT_DB, IT_REDIS, served_api

MODEL = "smollm2-135m-instruct"
RESULT = JobResult(choices=[ChoiceResult(index=0, text="ok", finish_reason="length")])


def _line(custom_id: str, model: str = MODEL) -> dict:
    return {
        "custom_id": custom_id,
        "url": "/v1/completions",
        "body": {"model": model, "prompt": "Hello", "max_tokens": 3},
    }


def _batch(session: Session, lines: list[dict]) -> tuple[int, str]:
    """A batch in `validating` of `lines` (its input file stored as one chunk): (tenant id, batch id)."""
    t = factories.tenant(session)
    _, key = factories.api_key(session, t)
    bid = factories.validating_batch(session, t, key, lines)
    session.commit()
    return t.id, bid


def _running(sessions: sessionmaker[Session], batch_id: str) -> list[Job]:
    """The batch's lines, claimed (running, started), in input order."""
    with sessions() as s:
        s.execute(
            update(Job)
            .where(Job.batch_id == batch_id)
            .values(state=JobState.running.value, started_at=func.now(), worker="w", lease_until=func.now())
        )
        s.commit()
        return list(s.scalars(select(Job).where(Job.batch_id == batch_id).order_by(Job.line_no)))


def _end_lines(sessions: sessionmaker[Session], rds, settings: Settings, batch_id: str) -> tuple[int, int, int]:
    """Lines ended as workers and clients end them: two succeed with their usage, the third is
    cancelled while running (billed its prompt, kept on its row just after the ending). The tokens
    of the three: (prompt, cached, completion)."""
    life = Lifecycle(sessions, rds, settings)
    a, b, c = _running(sessions, batch_id)
    assert life.succeed(a, RESULT, Usage(prompt_tokens=11, completion_tokens=5, cached_tokens=4), 0.1)
    assert life.succeed(b, RESULT, Usage(prompt_tokens=7, completion_tokens=3), 0.1)
    assert life.cancel(c.id, c.tenant_id) is not None
    with sessions() as s:
        kept = s.get_one(Job, c.id).usage or {}
    assert kept.get("prompt_tokens", 0) > 0  # a usage written after the ending: the second trigger's path
    return 11 + 7 + kept["prompt_tokens"], 4, 5 + 3 + kept.get("completion_tokens", 0)


def test_a_batch_shows_its_model_and_the_usage_its_lines_were_billed(session, sessions, rds, it_settings):
    """Before: the batch object had neither `model` nor `usage`."""
    tenant_id, bid = _batch(session, [_line("a"), _line("b"), _line("c")])
    assert ingest.validate(sessions, bid, it_settings) == BatchStatus.in_progress
    prompt, cached, completion = _end_lines(sessions, rds, it_settings, bid)

    with sessions() as s:
        shown = progress.batch_json(s.get_one(Batch, bid))
        billed = s.execute(
            select(func.sum(UsageDaily.prompt_tokens), func.sum(UsageDaily.completion_tokens)).where(
                UsageDaily.tenant_id == tenant_id
            )
        ).one()
    assert shown["model"] == MODEL
    assert shown["usage"]["input_tokens"] == prompt and shown["usage"]["output_tokens"] == completion
    assert shown["usage"]["input_tokens_details"]["cached_tokens"] == cached
    assert shown["usage"]["output_tokens_details"]["reasoning_tokens"] == 0
    assert shown["usage"]["total_tokens"] == prompt + completion
    assert (prompt, completion) == tuple(billed)  # exactly what billing counted for its lines
    assert shown["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    # The SDK reads it as OpenAI's batch.
    parsed = openai.types.Batch.model_validate(shown)
    assert parsed.model == MODEL and parsed.usage is not None and parsed.usage.input_tokens == prompt

    # Nothing counted twice: a duplicate ending, or a second write of the same usage, adds nothing.
    life = Lifecycle(sessions, rds, it_settings)
    with sessions() as s:
        first = s.scalars(select(Job).where(Job.batch_id == bid, Job.line_no == 1)).one()
        assert not life.succeed(first, RESULT, Usage(prompt_tokens=99, completion_tokens=99), 0.1)
        s.execute(text("UPDATE jobs SET usage = usage WHERE batch_id = :b"), {"b": bid})
        s.commit()
        again = progress.batch_json(s.get_one(Batch, bid, populate_existing=True))
    assert again["usage"] == shown["usage"]


@pytest.fixture
def two_models(monkeypatch, it_settings: Settings) -> Iterator[Settings]:
    """A deployment serving a second model (the same weights under another id): the tokenizers read
    the process's settings, so the environment says so too."""
    from core.config import get_settings
    from core.registry import smollm2_gguf

    two = {"models": f"{MODEL},twin", "model_path": str(smollm2_gguf())}
    for name, value in two.items():
        monkeypatch.setenv(f"SPOOL_{name.upper()}", value)
    get_settings.cache_clear()
    yield it_settings.model_copy(update=two)
    monkeypatch.undo()
    get_settings.cache_clear()


def test_a_batch_of_several_models_names_them_all_in_order(session, sessions, two_models):
    settings = two_models
    _, bid = _batch(session, [_line("a", "twin"), _line("b"), _line("c", "twin")])
    assert ingest.validate(sessions, bid, settings) == BatchStatus.in_progress
    with sessions() as s:
        assert progress.batch_json(s.get_one(Batch, bid))["model"] == f"twin,{MODEL}"


# -- through the API and the SDK -------------------------------------------------------------------


@pytest.fixture(scope="module")
def api_base(sessions: sessionmaker[Session]) -> Iterator[str]:
    env = {"SPOOL_DATABASE_URL": IT_DB, "SPOOL_REDIS_URL": IT_REDIS, "SPOOL_LOG_FORMAT": "text"}
    with served_api(env) as served:
        yield served.base + "/v1"


def _shift(sessions: sessionmaker[Session], file_id: str, seconds: int) -> None:
    """Move a file's clock `seconds` back: as if it had been created that long ago."""
    with sessions() as s:
        back = timedelta(seconds=seconds)
        s.execute(
            update(File)
            .where(File.id == file_id)
            .values(created_at=File.created_at - back, expires_at=File.expires_at - back)
        )
        s.commit()


def test_expiry_through_the_sdk_and_the_sweep_that_removes_expired_files(sessions, rds, it_settings, api_base):
    """Before: `expires_after` and `output_expires_after` were ignored (uploads kept 30 days, result
    files never expired) and the batch showed no `model` or `usage`."""
    with sessions() as s:
        t = factories.tenant(s)
        key, _ = factories.api_key(s, t)
        tenant_id = t.id
    client = openai.OpenAI(base_url=api_base, api_key=key, max_retries=0)
    data = ("\n".join(json.dumps({**_line(c), "method": "POST"}) for c in "abc") + "\n").encode()

    # Refused as OpenAI refuses them, naming the field, before anything is kept.
    for bad, param in (
        ({"anchor": "created_at", "seconds": 60}, "expires_after.seconds"),
        ({"anchor": "last_active_at", "seconds": 3600}, "expires_after.anchor"),
    ):
        with pytest.raises(openai.BadRequestError) as exc:
            client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch", expires_after=bad)  # type: ignore[arg-type]
        assert exc.value.body["param"] == param  # type: ignore[index]
    assert client.files.list().data == []

    f = client.files.create(
        file=("in.jsonl", io.BytesIO(data)), purpose="batch", expires_after={"anchor": "created_at", "seconds": 3600}
    )
    assert f.expires_at == f.created_at + 3600
    assert client.files.retrieve(f.id).expires_at == f.created_at + 3600

    with pytest.raises(openai.BadRequestError) as exc:
        client.batches.create(
            input_file_id=f.id,
            endpoint="/v1/completions",
            completion_window="24h",
            output_expires_after={"anchor": "created_at", "seconds": 2592001},
        )
    assert exc.value.body["param"] == "output_expires_after.seconds"  # type: ignore[index]
    b = client.batches.create(
        input_file_id=f.id,
        endpoint="/v1/completions",
        completion_window="24h",
        output_expires_after={"anchor": "created_at", "seconds": 7200},
    )
    assert b.model is None  # known once its lines are validated

    # The dispatcher's validation, the lines' endings and the batch keeper's passes.
    assert ingest.validate(sessions, b.id, it_settings) == BatchStatus.in_progress
    prompt, cached, completion = _end_lines(sessions, rds, it_settings, b.id)
    life = Lifecycle(sessions, rds, it_settings)
    for _ in range(3):
        progress.advance(sessions, life)
    b = client.batches.retrieve(b.id)
    assert b.status == "completed" and b.model == MODEL and b.usage is not None
    assert (b.usage.input_tokens, b.usage.input_tokens_details.cached_tokens) == (prompt, cached)
    assert (b.usage.output_tokens, b.usage.total_tokens) == (completion, prompt + completion)
    assert b.output_file_id and b.error_file_id
    outputs = [client.files.retrieve(b.output_file_id), client.files.retrieve(b.error_file_id)]
    assert all(o.expires_at == o.created_at + 7200 for o in outputs)

    # The sweep at the time it runs: nothing has expired yet.
    sweep(sessions, it_settings)
    assert client.files.retrieve(f.id).id == f.id
    with sessions() as s:
        assert s.scalar(quota.files_of(tenant_id)) == len(data)
    # An hour later the upload has expired: gone (404), its content and its storage with it.
    _shift(sessions, f.id, 3601)
    assert sweep(sessions, it_settings)["files"] >= 1
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)
    with pytest.raises(openai.NotFoundError):
        client.files.content(f.id)
    with sessions() as s:
        assert s.scalar(select(func.count()).select_from(FileChunk).where(FileChunk.file_id == f.id)) == 0
        assert s.scalar(quota.files_of(tenant_id)) == 0
    # The batch's files are kept until their own expiry, then go the same way.
    assert client.files.retrieve(b.output_file_id).id == b.output_file_id
    for o in outputs:
        _shift(sessions, o.id, 7201)
    sweep(sessions, it_settings)
    for o in outputs:
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(o.id)
