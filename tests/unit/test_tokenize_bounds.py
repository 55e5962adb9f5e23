"""/tokenize's bound on `with_pieces` (issue 35: 2M tokens with pieces held an API process 9 s), and
the answers built and encoded off the event loop as the bytes JSONResponse would have sent."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from api import bodies
from api.errors import APIError
from api.routes.tokens import MAX_PIECES, DetokenizeRequest, TokenizeRequest, detokenized, tokenized
from core.infra.tokenizers import tokenizer_for
from tests.helpers import threads_of

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def tok():
    return tokenizer_for(MODEL)


def _text_of(tok, n: int) -> str:
    """A text of exactly `n` tokens (a word that is one token, repeated)."""
    word = " hello"
    assert len(tok.encode(word, add_special=False)) == 1
    text = word * n
    assert len(tok.encode(text, add_special=False)) == n
    return text


def test_pieces_up_to_the_bound_are_answered(tok):
    got = tokenized(tok, TokenizeRequest(content=_text_of(tok, MAX_PIECES), with_pieces=True))
    assert len(got["tokens"]) == MAX_PIECES
    assert got["tokens"][0] == {"id": tok.encode(" hello", add_special=False)[0], "piece": " hello"}


def test_pieces_above_the_bound_are_a_400_naming_the_param(tok):
    with pytest.raises(APIError) as e:
        tokenized(tok, TokenizeRequest(content=_text_of(tok, MAX_PIECES + 1), with_pieces=True))
    assert e.value.status == 400 and e.value.param == "with_pieces" and e.value.code == "too_many_tokens"
    assert str(MAX_PIECES) in e.value.message and str(MAX_PIECES + 1) in e.value.message


class _Counting:
    """The real tokenizer, counting the characters it is given to encode: the work a request costs."""

    def __init__(self, tok) -> None:
        self.tok, self.chars = tok, 0

    def encode(self, text: str, *, add_special: bool = True) -> list[int]:
        self.chars += len(text)
        return self.tok.encode(text, add_special=add_special)

    def token_text(self, t: int) -> str:
        return self.tok.token_text(t)


def test_an_8_mib_text_with_pieces_is_refused_before_it_is_tokenized_whole(tok):
    """The bound is checked before the work it bounds (issue 49): the refusal tokenizes about the
    bound's worth of text, not the 8 MiB (which took 4-5 s while another tenant's stream stalled)."""
    text = "hello world " * (8 * 1024 * 1024 // 12)
    counting = _Counting(tok)
    with pytest.raises(APIError) as e:
        tokenized(counting, TokenizeRequest(content=text, with_pieces=True))  # type: ignore[arg-type]
    assert e.value.code == "too_many_tokens" and "at least" in e.value.message
    bound_chars = len(_text_of(tok, MAX_PIECES))
    assert counting.chars < bound_chars + 64 * 1024 < len(text) // 8


def test_a_text_near_the_bound_is_counted_exactly_not_refused_by_the_slices(tok):
    """The slices' count is never held against a text the bound allows (their edges may add tokens)."""
    text = " ".join(["internationalization"] * 40_000)
    exact = len(tok.encode(text, add_special=False))
    assert MAX_PIECES * 0.5 < exact <= MAX_PIECES
    assert len(tokenized(tok, TokenizeRequest(content=text, with_pieces=True))["tokens"]) == exact


def test_ids_without_pieces_have_no_such_bound(tok):
    got = tokenized(tok, TokenizeRequest(content=_text_of(tok, MAX_PIECES + 1)))
    assert len(got["tokens"]) == MAX_PIECES + 1 and all(isinstance(t, int) for t in got["tokens"])


def test_detokenize_refuses_an_id_past_the_vocabulary(tok):
    with pytest.raises(APIError) as e:
        detokenized(tok, DetokenizeRequest(tokens=[1, tok.n_vocab + 5]))
    assert e.value.status == 400 and e.value.param == "tokens" and str(tok.n_vocab + 5) in e.value.message
    assert detokenized(tok, DetokenizeRequest(tokens=tok.encode("Hi there", add_special=False))) == {
        "content": "Hi there"
    }


@pytest.mark.parametrize(
    "value",
    [
        {"tokens": list(range(100_000))},
        {"tokens": [{"id": i, "piece": f'p{i} ✓ "q" \\ \n'} for i in range(20_000)]},
        {"object": "list", "data": [{"id": "b", "metadata": {"k": "v" * 300_000, "é": None}}] * 5, "has_more": False},
        {"tokens": []},
        {"a": [[1, 2], {"b": [True, 1.5, None]}], "c": "日本語 😀"},
        [],
    ],
)
def test_encode_gives_what_json_loads_reads_back(value):
    raw = bodies.encode(value)
    assert json.loads(raw) == value
    # compact, as FastAPI's JSONResponse sends it
    assert raw == json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def test_json_response_builds_and_encodes_on_a_thread(monkeypatch):
    seen = threads_of(monkeypatch, bodies, "encode")

    async def main():
        return await bodies.json_response(lambda n: {"tokens": list(range(n))}, 3), threading.get_ident()

    response, loop_thread = asyncio.run(main())
    assert response.body == b'{"tokens":[0,1,2]}' and response.media_type == "application/json"
    assert seen and loop_thread not in seen
