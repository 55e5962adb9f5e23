"""What both GPU engines promise, each test run on ExLlamaV2Engine (a tiny random-weight Llama) and on
ExLlamaV3Engine (the EXL3 model of SPOOL_TEST_EXL3_MODEL), built in tests/gpu/conftest.py. They check lengths,
determinism, batching, cancellation, grammar, logit bias, prefix reuse within a tenant only, and
presence/frequency penalties that leave the prompt alone. Random weights make the exllamav2 text
meaningless but the mechanics checkable. What one engine alone does: test_exllamav2_engine.py,
test_exllamav3_engine.py.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from typing import Any

import pytest

from tests.gpu.drive import finish, run, spec, tokens
from workers.engine.base import PromptEvent

pytestmark = pytest.mark.gpu


@pytest.fixture(params=["exllamav2", "exllamav3"])
def engine(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(f"{request.param}_engine")


def test_greedy_generates_max_new_tokens_deterministically(engine):
    out = run(engine, [spec(engine, "g", 24, temperature=0, ignore_eos=True)])["g"]
    assert isinstance(out[0], PromptEvent)
    assert len(tokens(out)) == 24 and finish(out) == "length"
    again = run(engine, [spec(engine, "g2", 24, temperature=0, ignore_eos=True)])["g2"]
    assert tokens(again) == tokens(out)


def test_same_seed_same_tokens(engine):
    a = run(engine, [spec(engine, "a", 32, temperature=1.0, ignore_eos=True, seed=11)])["a"]
    b = run(engine, [spec(engine, "b", 32, temperature=1.0, ignore_eos=True, seed=11)])["b"]
    assert tokens(a) == tokens(b) and len(tokens(a)) == 32


def test_batch_runs_together(engine):
    specs = [spec(engine, f"s{i}", 16, temperature=1.0, ignore_eos=True, seed=i) for i in range(4)]
    out = run(engine, specs)
    assert all(len(tokens(out[s.key])) == 16 and finish(out[s.key]) == "length" for s in specs)


def test_cancel_stops_a_sequence_and_spares_the_others(engine):
    engine.add(spec(engine, "keep", 40, temperature=0, ignore_eos=True))
    engine.add(spec(engine, "drop", 400, temperature=0, ignore_eos=True))
    seen: dict[str, list] = defaultdict(list)
    while len(tokens(seen["drop"])) < 3:
        for ev in engine.step():
            seen[ev.key].append(ev)
    engine.cancel("drop")
    after = run(engine, [])
    assert "drop" not in after
    assert len(tokens(seen["keep"] + after["keep"])) == 40
    assert not engine.has_work()


def test_regex_constraint_holds(engine):
    from llguidance import LLMatcher

    pattern = r"[0-9]{3}-[a-z]{2}"
    matcher = LLMatcher(engine.ll_tokenizer(), LLMatcher.grammar_from_regex(pattern), log_level=0)
    s = dataclasses.replace(spec(engine, "re", 30, temperature=1.0), matcher=matcher)
    out = run(engine, [s])["re"]
    text = b"".join(engine.token_bytes(t) for t in tokens(out)).decode()
    assert re.fullmatch(pattern, text), text
    assert finish(out) == "stop"


def test_logit_bias_wins_greedy(engine):
    target = engine.tokenize(" banana")[-1]  # the last: a tokenizer may put BOS first
    out = run(engine, [spec(engine, "lb", 8, temperature=0, ignore_eos=True, logit_bias={target: 100.0})])["lb"]
    assert tokens(out) == [target] * 8


def test_prefix_reuse_within_a_tenant_never_across(engine):
    """Paged (flash-attn) or not, a tenant's cached prompt serves that tenant only, and the PromptEvent's
    `cached` (the usage's cached_tokens) says so. CI runs the same on the library's own generator with
    CUDA stubbed (tests/unit/test_gpu_promises.py); this is the real cache."""
    long = " ".join(["the quick brown fox jumps over the lazy dog"] * 60)  # > 2 pages of 256 tokens
    a1 = run(engine, [spec(engine, "a1", 2, prompt=long, scope="tenant-a", temperature=0)])["a1"]
    a2 = run(engine, [spec(engine, "a2", 2, prompt=long, scope="tenant-a", temperature=0)])["a2"]
    b1 = run(engine, [spec(engine, "b1", 2, prompt=long, scope="tenant-b", temperature=0)])["b1"]
    assert isinstance(a1[0], PromptEvent) and a1[0].cached == 0
    assert a2[0].cached >= 512 and b1[0].cached == 0


def test_presence_and_frequency_leave_the_prompt_alone(engine):
    """On a prompt of one repeated phrase, output-only penalties cannot change the first greedy token
    (CI shows the sampler part on the library's own code: tests/unit/test_gpu_promises.py)."""
    prompt = "The cat. " * 60 + "The"
    plain = run(engine, [spec(engine, "pp", 1, prompt=prompt, temperature=0, ignore_eos=True)])["pp"]
    pen = spec(
        engine, "pq", 1, prompt=prompt, temperature=0, ignore_eos=True, presence_penalty=2.0, frequency_penalty=2.0
    )
    assert tokens(run(engine, [pen])["pq"]) == tokens(plain)
