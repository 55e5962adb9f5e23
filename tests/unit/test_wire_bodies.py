"""The bodies core/protocol/render.py builds for other modules (moved there in issue 36), byte for byte
as the API and the batch writer sent them before: a batch file's output and error lines, the error
envelope, the tokenize/detokenize answers. The expected bytes were taken from the code before the
move; a change here is a change on the wire."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from types import SimpleNamespace

import pytest

from api import errors
from api.routes.tokens import DetokenizeRequest, TokenizeRequest, detokenized, tokenized
from core.batches import progress
from core.errors import DomainError, ErrorKind
from ops.factories import params

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _compact(body: object) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def _job(state: str, **kw: object) -> SimpleNamespace:
    base = dict(
        id="cmpl-ab12",
        custom_id="line-7",
        model="m",
        state=state,
        attempt=1,
        params=params().to_json(),
        chat=None,
        result=None,
        usage=None,
        error=None,
        created_at=T0,
        started_at=None,
        finished_at=None,
    )
    return SimpleNamespace(**{**base, **kw})


def _fp(_model: str) -> str:
    return "fp_x"


SUCCEEDED = _job(
    "succeeded",
    result={"choices": [{"index": 0, "text": "hi", "finish_reason": "stop"}]},
    usage={"prompt_tokens": 3, "completion_tokens": 1},
)
LINES = {
    "succeeded": (
        SUCCEEDED,
        True,
        b'{"id":"batch_req_ab12","custom_id":"line-7","response":{"status_code":200,"request_id":"cmpl-ab12",'
        b'"body":{"id":"cmpl-ab12","object":"text_completion","created":1767225600,"model":"m",'
        b'"system_fingerprint":"fp_x","choices":[{"text":"hi","index":0,"logprobs":null,"finish_reason":"stop"}],'
        b'"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4,'
        b'"prompt_tokens_details":{"cached_tokens":0}},"service_tier":"default"}},"error":null}',
    ),
    "expired": (
        _job("expired"),
        False,
        b'{"id":"batch_req_ab12","custom_id":"line-7","response":null,"error":{"code":"batch_expired",'
        b'"message":"This line was not run before the batch\'s completion window ended."}}',
    ),
    "cancelled": (
        _job("cancelled"),
        False,
        b'{"id":"batch_req_ab12","custom_id":"line-7","response":null,"error":{"code":"batch_cancelled",'
        b'"message":"This line was not run: the batch was cancelled."}}',
    ),
    "failed": (
        _job("failed", error={"message": "bad", "type": "invalid_request_error", "param": "x", "code": "c"}),
        False,
        b'{"id":"batch_req_ab12","custom_id":"line-7","response":{"status_code":400,"request_id":"cmpl-ab12",'
        b'"body":{"error":{"message":"bad","type":"invalid_request_error","param":"x","code":"c"}}},"error":null}',
    ),
    "failed, over a limit": (
        _job("failed", error={"message": "slow down", "type": "tokens"}),
        False,
        b'{"id":"batch_req_ab12","custom_id":"line-7","response":{"status_code":429,"request_id":"cmpl-ab12",'
        b'"body":{"error":{"message":"slow down","type":"tokens","param":null,"code":null}}},"error":null}',
    ),
    "failed, no error kept": (
        _job("failed"),
        False,
        b'{"id":"batch_req_ab12","custom_id":"line-7","response":{"status_code":500,"request_id":"cmpl-ab12",'
        b'"body":{"error":{"message":"The request failed.","type":"server_error","param":null,"code":null}}},'
        b'"error":null}',
    ),
}


@pytest.mark.parametrize("case", list(LINES))
def test_a_batch_files_lines_are_byte_identical(case: str) -> None:
    job, to_output, expected = LINES[case]
    ok, line = progress._line(job, _fp)  # type: ignore[arg-type]
    assert ok is to_output
    assert _compact(line) == expected


def test_the_error_envelope_is_byte_identical() -> None:
    exc = DomainError(ErrorKind.invalid, "No.", param="prompt", code="invalid_value")
    answer = errors.error_response(exc)
    assert answer.status_code == 400
    assert (
        answer.body
        == b'{"error":{"message":"No.","type":"invalid_request_error","param":"prompt","code":"invalid_value"}}'
    )


class _Tok:
    n_vocab = 10

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        return [len(w) for w in text.split()]

    def token_text(self, t: int) -> str:
        return "x" * t

    def decode(self, ids: list[int]) -> str:
        return " ".join("x" * t for t in ids)


def test_the_tokenize_bodies_are_byte_identical() -> None:
    tok = _Tok()
    assert _compact(tokenized(tok, TokenizeRequest(content="a bb"))) == b'{"tokens":[1,2]}'  # type: ignore[arg-type]
    pieces = tokenized(tok, TokenizeRequest(content="a bb", with_pieces=True))  # type: ignore[arg-type]
    assert _compact(pieces) == b'{"tokens":[{"id":1,"piece":"x"},{"id":2,"piece":"xx"}]}'
    assert _compact(detokenized(tok, DetokenizeRequest(tokens=[1, 2]))) == b'{"content":"x xx"}'  # type: ignore[arg-type]
