"""The SmolLM2 tokenizer in both forms, the GGUF vocabulary (llama.cpp) and a Hugging Face
`tokenizer.json` made from it (ops/tokenizer_from_gguf.py), behind the one tokenizer interface:
the same ids for every text, the same bytes for every token, the same chat template."""

from __future__ import annotations

import inspect
import json

import pytest

from core.infra.tokenizers import HFTokenizer, tokenizer_for
from core.registry import smollm2_gguf

pytest.importorskip("gguf")

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    from ops.tokenizer_from_gguf import export

    folder = export(smollm2_gguf(), tmp_path_factory.mktemp("hf"))
    return tokenizer_for(MODEL), HFTokenizer(folder)


CORPUS = [
    "What is the capital of France?",
    "Hello  world\n\n  indented\tTabs 12345 3.14159 1,000,000",
    "Ünïcödé ✓ 日本語 😀 emoji, Ελληνικά, русский",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "def f(x):\n    return x**2  # comment\r\n",
    "   leading and trailing spaces   ",
    "",
    json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}}),
] + [inspect.getsource(json)[i : i + 400] for i in range(0, 12_000, 400)]


def test_every_text_gets_the_same_ids(both):
    gguf, hf = both
    for text in CORPUS:
        assert hf.encode(text, add_special=False) == gguf.encode(text, add_special=False), text[:60]
        assert hf.encode(text) == gguf.encode(text), text[:60]  # BOS handling agrees too


def test_every_token_decodes_to_the_same_bytes(both):
    gguf, hf = both
    assert hf.n_vocab == gguf.n_vocab
    for t in range(gguf.n_vocab):
        assert hf.token_bytes(t) == gguf.token_bytes(t), t


def test_chat_template_and_specials_agree(both):
    gguf, hf = both
    assert hf.chat_template() == gguf.chat_template()
    assert hf.special_text() == gguf.special_text()
    assert hf.fim_tokens() == gguf.fim_tokens()
