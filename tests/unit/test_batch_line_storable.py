"""A batch line that Postgres could not store (a NUL, a lone surrogate) is refused at validation; the
check walks a line's values only when its bytes could hold one (core/batches/ingest.py)."""

from __future__ import annotations

import json

import pytest

from core.batches.ingest import _storable_line


def _walked(monkeypatch) -> list[object]:
    from core.batches import ingest

    seen: list[object] = []
    real = ingest._storable
    monkeypatch.setattr(ingest, "_storable", lambda obj: seen.append(obj) or real(obj))
    return seen


@pytest.mark.parametrize(
    ("raw", "ok"),
    [
        (json.dumps({"prompt": "a\u0000b"}).encode(), False),  # the escape \u0000
        (json.dumps({"prompt": "\ud800x"}).encode(), False),  # the escape \ud800
        ('{"prompt": "\ud800x"}'.encode("utf-8", "surrogatepass"), False),  # a surrogate's own UTF-8 bytes
        ('{"prompt": "한국어"}'.encode(), True),  # 0xED lead bytes that are not a surrogate
        (json.dumps({"prompt": "ok"}).encode("utf-16"), True),  # NUL bytes: another encoding, walked
        (json.dumps({"prompt": "caf\u00e9"}).encode(), True),  # an escape that is fine
    ],
)
def test_lines_that_could_hold_one_are_walked_and_judged(monkeypatch, raw, ok):
    seen = _walked(monkeypatch)
    assert _storable_line(raw, json.loads(raw)) is ok
    assert seen  # walked


def test_a_plain_line_is_not_walked(monkeypatch):
    seen = _walked(monkeypatch)
    raw = json.dumps({"custom_id": "r1", "body": {"prompt": "Ünïcödé 12345", "max_tokens": 4}}, ensure_ascii=False)
    assert _storable_line(raw.encode(), json.loads(raw)) is True
    assert not seen
