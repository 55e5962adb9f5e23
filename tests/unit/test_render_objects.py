"""The file and batch objects, built by core/protocol/render.py (moved there from core/files and
core/batches): the exact fields a client and the openai SDK read, and the declared response models."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace

from core.generation.events import Usage
from core.protocol import render
from core.protocol.schemas import BatchObject, FileDeleted, FileObject
from core.states import BatchStatus

T0 = datetime(2026, 1, 1, tzinfo=UTC)
T0_S = 1767225600


def _file(**kw):
    base = dict(
        id="file-1", bytes=12, created_at=T0, filename="in.jsonl", purpose="batch", status="processed", expires_at=None
    )
    return SimpleNamespace(**{**base, **kw})


def test_a_file_object():
    body = render.file(_file())
    assert body == {
        "id": "file-1",
        "object": "file",
        "bytes": 12,
        "created_at": T0_S,
        "filename": "in.jsonl",
        "purpose": "batch",
        "status": "processed",
        "expires_at": None,
    }
    assert render.file(_file(expires_at=T0))["expires_at"] == T0_S
    FileObject.model_validate(body)
    deleted = render.file_deleted("file-1")
    assert deleted == {"id": "file-1", "object": "file", "deleted": True}
    FileDeleted.model_validate(deleted)


def _batch(**kw):
    stamps = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at")
    base = dict(
        id="batch_1",
        endpoint="/v1/completions",
        model="m",
        errors=None,
        input_file_id="file-1",
        completion_window="24h",
        status=BatchStatus.completed.value,
        output_file_id="file-2",
        error_file_id=None,
        meta={"k": "v"},
        created_at=T0,
        expires_at=T0,
        cancelled_at=None,
        **dict.fromkeys(stamps),
    )
    return SimpleNamespace(**{**base, **kw})


def test_a_batch_object_shows_its_files_only_when_told():
    counts = {"total": 3, "completed": 2, "failed": 1}
    body = render.batch(_batch(completed_at=T0), counts, Usage(prompt_tokens=5, completion_tokens=2), files_shown=True)
    assert list(body) == [
        "id",
        "object",
        "endpoint",
        "model",
        "errors",
        "input_file_id",
        "completion_window",
        "status",
        "output_file_id",
        "error_file_id",
        "created_at",
        "in_progress_at",
        "expires_at",
        "finalizing_at",
        "completed_at",
        "failed_at",
        "expired_at",
        "cancelling_at",
        "cancelled_at",
        "request_counts",
        "usage",
        "metadata",
    ]
    assert body["model"] == "m" and body["usage"]["input_tokens"] == 5 and body["usage"]["total_tokens"] == 7
    assert body["object"] == "batch" and body["request_counts"] == counts and body["metadata"] == {"k": "v"}
    assert body["output_file_id"] == "file-2" and body["completed_at"] == T0_S and body["in_progress_at"] is None
    BatchObject.model_validate(body)
    writing = render.batch(_batch(status=BatchStatus.finalizing.value), counts, Usage(), files_shown=False)
    assert writing["output_file_id"] is None and writing["error_file_id"] is None


def test_a_batch_error_list_is_a_list_object():
    errors = [{"code": "invalid_json", "message": "no", "param": None, "line": 1}]
    assert render.listing(errors) == {"object": "list", "data": errors}
