"""ExLlamaV3Engine on a real GPU, with the EXL3 model of SPOOL_TEST_EXL3_MODEL (tests/gpu/conftest.py;
it skips without CUDA, without exllamav3, or without that folder): what this engine does beyond what
both engines promise (test_exllama_engines.py): its sizing (chunk clamped to the context, a model that
cannot fit), its tokenizer, logprobs of the unedited distribution.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.drive import run, spec
from workers.engine.base import TokenEvent
from workers.engine.gpu_plan import DoesNotFit

pytestmark = pytest.mark.gpu


@pytest.fixture
def engine(exllamav3_engine: Any) -> Any:
    return exllamav3_engine


def test_small_context_starts_and_chunk_is_clamped(engine):
    assert engine.n_ctx == 1024 and engine._chunk <= 1024


def test_tokenizer_round_trip(engine):
    ids = engine.tokenize("Hello world")
    assert b"".join(engine.token_bytes(t) for t in ids).endswith(b"Hello world")


def test_logprobs_are_of_the_unedited_distribution(engine):
    plain = run(engine, [spec(engine, "lp", 4, temperature=0, ignore_eos=True, logprobs=3)])["lp"]
    biased = run(engine, [spec(engine, "lp2", 4, temperature=0, ignore_eos=True, logprobs=3, presence_penalty=2.0)])
    first = next(e for e in plain if isinstance(e, TokenEvent) and e.token_id is not None)
    other = next(e for e in biased["lp2"] if isinstance(e, TokenEvent) and e.token_id is not None)
    assert first.logprob is not None and first.logprob <= 0 and len(first.top or []) == 3
    assert first.top == other.top  # penalties change the pick, never the reported distribution


def test_a_model_that_cannot_fit_says_so(engine, monkeypatch):
    import torch

    from workers.engine.exllamav3 import ExLlamaV3Engine

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (1 << 20, 1 << 30))
    with pytest.raises(DoesNotFit, match="does not fit this GPU"):
        ExLlamaV3Engine("x", Path(os.environ["SPOOL_TEST_EXL3_MODEL"]), n_ctx=1024, max_batch=1)
