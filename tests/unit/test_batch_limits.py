"""A batch's client-set values are bounded (issue 35): completion_window, metadata (OpenAI's limits),
and what a validation error quotes of a client's strings. Pure: the refusals come before any I/O."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from typing import Any

import pytest

from api.errors import error_response
from core.batches import ingest, progress, service
from core.config import Settings
from core.errors import DomainError
from core.infra.orm import Batch
from core.protocol.schemas import METADATA_MAX_PAIRS, metadata_problem


def _create(**kw: Any) -> DomainError:
    """service.create's answer for a request refused before it reads anything (no session, no Redis)."""
    args: dict[str, Any] = {
        "input_file_id": "file-x",
        "endpoint": "/v1/completions",
        "completion_window": "24h",
        "metadata": None,
        "webhook_url": None,
    } | kw
    with pytest.raises(DomainError) as caught:
        asyncio.run(service.create(None, None, None, Settings(), **args))  # type: ignore[arg-type]
    return caught.value


def _wire(exc: DomainError) -> tuple[int, dict[str, Any]]:
    r = error_response(exc)
    return r.status_code, json.loads(bytes(r.body))["error"]


@pytest.mark.parametrize("window", ["9999999d", "31d", "745h", "0s", "1" * 5000 + "d", "00000000000000001h"])
def test_a_completion_window_past_the_bounds_is_a_400_naming_it(window):
    """Before: "9999999d" overflowed datetime in expires_at (a 500); 5,000 digits broke int()."""
    status, err = _wire(_create(completion_window=window))
    assert status == 400 and err["param"] == "completion_window" and err["type"] == "invalid_request_error"
    assert "30d" in err["message"] or "duration" in err["message"]


@pytest.mark.parametrize(("window", "seconds"), [("24h", 86400), ("30d", 30 * 86400), ("720h", 2592000), ("1s", 1)])
def test_windows_within_the_bounds_are_taken(window, seconds):
    assert progress.window_problem(window) is None
    now = datetime.now(UTC)
    assert (progress.expires_at(now, window) - now).total_seconds() == seconds


def test_a_stored_window_past_the_bounds_never_overflows():
    now = datetime.now(UTC)
    assert (progress.expires_at(now, "9999999d") - now).total_seconds() == progress.MAX_WINDOW_S


@pytest.mark.parametrize(
    "meta",
    [
        {f"k{i}": "v" for i in range(METADATA_MAX_PAIRS + 1)},  # 17 pairs
        {"k" * 65: "v"},  # a 65-character key
        {"k": "v" * 513},  # a 513-character value
        {"k": 5},  # not a string
    ],
)
def test_metadata_past_openais_limits_is_a_400_naming_it(meta):
    status, err = _wire(_create(metadata=meta))
    assert status == 400 and err["param"] == "metadata", err
    assert len(err["message"]) < 200  # it says what is wrong, not what was sent


def test_metadata_at_openais_limits_passes():
    assert metadata_problem({f"k{i}": "v" for i in range(16)}) is None
    assert metadata_problem({"k" * 64: "v" * 512}) is None
    assert metadata_problem(None) is None and metadata_problem({}) is None


def _line_error(body: dict[str, Any], **line: Any) -> dict[str, Any]:
    b = Batch(id="batch_x", tenant_id=1, key_id=None, endpoint="/v1/completions")
    raw = json.dumps({"custom_id": "r1", "method": "POST", "url": "/v1/completions", "body": body} | line).encode()
    with pytest.raises(ingest._LineError) as caught:
        ingest._job_row(1, raw, b, Settings(unknown_params="error"))
    return caught.value.entry


@pytest.mark.parametrize(
    ("body", "line"),
    [
        ({"model": "m" * 5000, "prompt": "hi"}, {}),  # an unknown model's name
        ({"model": "x", "prompt": "hi", "z" * 5000: 1}, {}),  # an unknown request field
        ({"model": "x", "prompt": "hi"}, {f"{i}" + "y" * 3000: 1 for i in range(40)}),  # unknown line fields
        ({"model": "x", "prompt": "hi", "logit_bias": {"b" * 5000: 500}}, {}),  # a path through a client's key
    ],
)
def test_validation_errors_quote_a_clients_strings_cut_to_about_100_characters(body, line):
    """Before: each went into batches.errors whole (a 5,000-character model name, 40 field names of
    3,000 characters), up to SPOOL_BATCH_MAX_ERRORS of them per batch."""
    entry = _line_error(body, **line)
    assert len(entry["message"]) < 700 and "…" in entry["message"], entry
    assert not any(run * 101 in entry["message"] for run in "mzyb")  # no quoted string longer than ~100
    assert entry["param"] is None or len(entry["param"]) <= ingest.QUOTE_CHARS + 1


def test_short_client_strings_are_quoted_whole():
    entry = _line_error({"model": "no-such-model", "prompt": "hi"})
    assert entry["message"] == "The model 'no-such-model' does not exist." and entry["param"] == "body.model"
    assert ingest.clip("x" * 100) == "x" * 100 and ingest.clip("x" * 101) == "x" * 100 + "…"
