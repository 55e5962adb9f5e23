"""The CPU engine in-process with the real SmolLM2: interactive sequences never wait for batch
ones, and a displaced batch sequence continues to exactly the text it would have had."""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest

from core.generation.params import GenerationParams
from core.registry import smollm2_gguf
from ops.harness import ENGINE_THREADS
from workers.engine.base import PromptEvent, SeqSpec, TokenEvent
from workers.engine.llamacpp import LlamaCppEngine

PROMPTS = [
    "The history of the printing press begins",
    "A recipe for bread starts with",
    "Rivers flow to the sea because",
]


# Every promise here holds with speculative decoding forced on (drafts every step, no back-off) too.
@pytest.fixture(scope="module", params=["off", "force"])
def engine(request) -> LlamaCppEngine:
    # Two batch slots and no reserved ones: any interactive arrival while both are busy must displace.
    return LlamaCppEngine(
        "smollm2",
        smollm2_gguf(),
        n_ctx=512,
        max_batch=2,
        interactive_slots=0,
        n_threads=ENGINE_THREADS,
        speculative=request.param,
    )


def spec(engine, key, prompt: str, n: int, interactive: bool, temperature: float = 0.0, seed: int = 7) -> SeqSpec:
    ids = engine.tokenize(prompt)
    p = GenerationParams(max_tokens=n, temperature=temperature, ignore_eos=True, seed=seed)
    return SeqSpec(key, ids, n, p, seed, prompt_logprobs_len=len(ids), interactive=interactive)


def run(engine, batch: list[SeqSpec], late: list[SeqSpec] = (), at_step: int = 5):
    """Step the engine to the end; `late` sequences arrive at `at_step`. Returns tokens per key and
    the step at which each key produced its first token."""
    for s in batch:
        engine.add(s)
    tokens: dict = defaultdict(list)
    first: dict = {}
    step = 0
    while engine.has_work():
        if step == at_step:
            for s in late:
                engine.add(s)
        for ev in engine.step():
            if isinstance(ev, TokenEvent):
                assert ev.error is None, ev.error
                if ev.token_id is not None:
                    tokens[ev.key].append(ev.token_id)
                    first.setdefault(ev.key, step)
        step += 1
    return tokens, first


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_displaced_batch_sequences_continue_to_the_same_output(engine, temperature):
    batch = [spec(engine, ("b", i), p, 40, False, temperature) for i, p in enumerate(PROMPTS)]
    alone, _ = run(engine, batch)
    before = engine.preemptions
    batch = [spec(engine, ("b", i), p, 40, False, temperature) for i, p in enumerate(PROMPTS)]
    late = [spec(engine, ("i", 0), "Hello, my name is", 6, True)]
    mixed, first = run(engine, batch, late, at_step=5)
    assert engine.preemptions > before, "the interactive sequence should have displaced a batch one"
    assert first[("i", 0)] <= 5 + 1, "the interactive sequence waited for a batch slot"
    for i in range(len(PROMPTS)):
        assert mixed[("b", i)] == alone[("b", i)], f"batch sequence {i} changed when displaced"
    assert len(mixed[("i", 0)]) == 6


def test_interactive_cancelled_while_batch_is_displaced(engine):
    batch = [spec(engine, ("c", i), p, 30, False) for i, p in enumerate(PROMPTS[:2])]
    for s in batch:
        engine.add(s)
    for _ in range(3):
        engine.step()
    engine.add(spec(engine, ("ci", 0), "Hi", 30, True))
    engine.step()  # displaces one batch sequence
    engine.cancel(("c", 0))  # cancelling a displaced (or live) sequence must not leak or crash
    engine.cancel(("c", 1))
    engine.cancel(("ci", 0))
    for _ in range(3):
        engine.step()
    assert not engine.has_work()


def _cached(engine, key, prompt: str, scope) -> int:
    ids = engine.tokenize(prompt)
    p = GenerationParams(max_tokens=1, temperature=0.0)
    engine.add(SeqSpec(key, ids, 1, p, 0, prompt_logprobs_len=len(ids), interactive=True, cache_scope=scope))
    cached = None
    while engine.has_work():
        for ev in engine.step():
            if isinstance(ev, PromptEvent) and ev.key == key:
                cached = ev.cached
    assert cached is not None
    return cached


def test_prompt_prefixes_are_reused_only_within_a_tenant(engine):
    system = "You are the secret assistant of tenant A. The password is swordfish. " * 3
    assert _cached(engine, ("p", 1), system + "Hello", "tenant-a") == 0
    # Another tenant with the same prefix neither reuses it nor learns its length.
    assert _cached(engine, ("p", 2), system + "Hi", "tenant-b") == 0
    assert _cached(engine, ("p", 3), system + "Hey", "tenant-a") > 10


def _fresh(engine) -> None:
    """No slot keeps anything: the next sequences find their prefixes only where this test puts them."""
    for slot in engine._decoder.slot_tokens:
        engine._decoder.slot_tokens[slot] = []


def _seq(key, prompt: list[int], n: int, seed: int, scope) -> SeqSpec:
    p = GenerationParams(max_tokens=n, temperature=0.9, ignore_eos=True)
    return SeqSpec(key, list(prompt), n, p, seed, interactive=True, cache_scope=scope)


def _drain(engine, until=None) -> tuple[dict, dict]:
    """Step until no work is left (or `until()` holds): tokens and reported cached prefix, per key."""
    tokens: dict = defaultdict(list)
    cached: dict = {}
    while engine.has_work() and not (until and until(tokens)):
        for ev in engine.step():
            if isinstance(ev, PromptEvent):
                cached[ev.key] = ev.cached
            elif ev.token_id is not None:
                tokens[ev.key].append(ev.token_id)
    return tokens, cached


SHARED = "A long shared instruction that every choice of the request starts from. " * 6


def test_the_choices_of_one_prompt_prefill_it_once(engine):
    """n choices of one prompt: the first prefills it; the others wait that step and copy its KV
    stream (llama.cpp's cross-stream copy) instead of prefilling it beside it. Another tenant's
    sequence copies nothing, and neither does one sent with `cache_prompt: false`."""
    prompt = engine.tokenize(SHARED)
    _fresh(engine)
    before = engine._decoder.copies
    for c in range(3):
        engine.add(_seq(("n", c), prompt, 6, 40 + c, "t1"))
    _, cached = _drain(engine)
    # The module's engine has 2 slots: choice 1 copied choice 0's prompt; choice 2 found it in the
    # slot choice 0 left.
    assert cached[("n", 0)] == 0 and cached[("n", 1)] == len(prompt) - 1 == cached[("n", 2)], cached
    assert engine._decoder.copies == before + 1
    engine.add(_seq(("other", 0), prompt, 6, 1, "t2"))
    cold = GenerationParams(max_tokens=6, temperature=0.9, ignore_eos=True, cache_prompt=False)
    engine.add(SeqSpec(("cold", 0), list(prompt), 6, cold, 1, interactive=True, cache_scope="t1"))
    _, cached = _drain(engine)
    assert cached[("other", 0)] == 0 and cached[("cold", 0)] == 0
    assert engine._decoder.copies == before + 1


def test_a_copied_prefix_is_the_one_its_slot_held(engine):
    """The copy is exact: a sequence that continues from a prefix copied out of another slot samples
    the very tokens it samples continuing from the same prefix cached in its own slot."""
    prompt = engine.tokenize(SHARED)
    _fresh(engine)
    # A live sequence holds the prompt; the next one takes the other slot and copies it from there.
    engine.add(_seq(("holder", 0), prompt, 30, 5, "t1"))
    _drain(engine, until=lambda tokens: tokens.get(("holder", 0)))
    copies = engine._decoder.copies
    engine.add(_seq(("copied", 0), prompt, 12, 7, "t1"))
    copied, cached = _drain(engine)
    assert engine._decoder.copies == copies + 1 and cached[("copied", 0)] == len(prompt) - 1
    # Again, with the prefix in the sequence's own slot: a first run leaves it there, alone.
    _fresh(engine)
    engine.add(_seq(("holder", 1), prompt, 30, 5, "t1"))
    _drain(engine)
    engine.add(_seq(("own", 0), prompt, 12, 7, "t1"))
    own, cached = _drain(engine)
    assert engine._decoder.copies == copies + 1 and cached[("own", 0)] == len(prompt) - 1
    assert copied[("copied", 0)] == own[("own", 0)]


# A chat prompt (SmolLM2's template) whose greedy answer has near-ties: found by the fault harness,
# where answers resumed by a later attempt went another way than the undisturbed run's.
CHAT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nFault test 6: once upon a time<|im_end|>\n<|im_start|>assistant\n"
)


def test_a_resumed_sequence_continues_exactly_from_any_point(engine):
    """A resumed attempt gets the prompt plus the tokens streamed so far (`prior`). Prefilled in one
    batch, those tokens' KV differed slightly from their one-at-a-time decode, and greedy answers
    flipped at near-ties (2 of these 13 resume points; fails on the old engine). Fed back
    one per step, every resume point continues to the uninterrupted text."""
    ids = engine.tokenize(CHAT)
    p = GenerationParams(max_tokens=40, temperature=0.0, ignore_eos=True, cache_prompt=False)
    whole, _ = run(engine, [SeqSpec("whole", ids, 40, p, 0, interactive=False)])
    ref = whole["whole"]
    assert len(ref) == 40
    for k in range(1, 40, 3):
        resumed, _ = run(engine, [SeqSpec(("r", k), ids + ref[:k], 40 - k, p, 0, prior=k, interactive=False)])
        assert resumed[("r", k)] == ref[k:], f"resumed after {k} tokens went another way"


def test_a_sequence_displaced_again_while_it_replays_keeps_every_token(engine):
    """A displaced sequence that comes back to a slot which lost its cache re-decodes its earlier
    tokens one per step; displaced again in the middle of that, it must take the tokens it had not
    re-decoded yet with it. It kept only the last one (the rest of its context silently gone), and
    went on with another text: batch lines under bursts of interactive requests in the fault harness."""
    long_prompt = " ".join(["The committee met again to discuss the budget for the coming year."] * 4)
    # `b` holds the other slot throughout: long enough that drafts (its text repeats) do not end it early.
    alone, _ = run(engine, [spec(engine, "r", PROMPTS[1], 40, False), spec(engine, "b", long_prompt, 300, False)])
    before = engine.preemptions
    batch = [spec(engine, "r", PROMPTS[1], 40, False), spec(engine, "b", long_prompt, 300, False)]
    for s in batch:
        engine.add(s)
    tokens: dict = defaultdict(list)
    step = 0
    while engine.has_work():
        # Interactive arrivals, each displacing `r` (fewest tokens), while it is under way (by its tokens,
        # not steps: with drafts a step may bring several).
        if step % 3 == 2 and 3 <= len(tokens["r"]) < 36 and step <= 60:
            engine.add(spec(engine, ("i", step), "Hello, my name is", 2, True))
        for ev in engine.step():
            if isinstance(ev, TokenEvent) and ev.token_id is not None:
                tokens[ev.key].append(ev.token_id)
        step += 1
    assert engine.preemptions - before >= 5, "the interactive arrivals should have displaced r repeatedly"
    assert tokens["r"] == alone["r"], "the twice-displaced sequence lost part of its context"
    assert tokens["b"] == alone["b"]


def _scoring_run(engine, specs: list[SeqSpec], scored: list[bool] | None = None) -> tuple[dict, dict, dict]:
    """Step `specs` to the end: each key's prompt entries, the step of its PromptEvent, and the step
    of its first token; `scored` gets, per step, whether it held a prompt-scoring chunk."""
    for s in specs:
        engine.add(s)
    entries: dict = {}
    prompt_at: dict = {}
    first: dict = {}
    step = 0
    while engine.has_work():
        for ev in engine.step():
            if isinstance(ev, PromptEvent):
                entries[ev.key], prompt_at[ev.key] = ev.entries, step
            elif ev.token_id is not None:
                first.setdefault(ev.key, step)
        if scored is not None:
            scored.append(engine._decoder.scored_last)
        step += 1
    return entries, prompt_at, first


def test_prompt_scoring_is_spread_over_steps_while_others_go_on(monkeypatch):
    """Two sequences scoring 300-token prompts (echo with logprobs) no longer fill whole steps with
    scored rows: a third request's prompt goes in at once and its tokens come while they are still
    scoring, and their scores are those of each prompt scored alone in one pass."""
    from workers.engine import llamacpp

    eng = LlamaCppEngine(
        "smollm2", smollm2_gguf(), n_ctx=4096, max_batch=4, interactive_slots=0, n_threads=ENGINE_THREADS
    )
    ids = eng.tokenize("one two three " * 100)[:300]
    p = GenerationParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=2)

    def scorer(key: str) -> SeqSpec:
        return SeqSpec(key, ids, 2, p, 7, prompt_logprobs=2, prompt_logprobs_len=len(ids))

    other = spec(eng, "other", "Hello, my name is", 6, False)
    scored: list[bool] = []
    entries, prompt_at, first = _scoring_run(eng, [scorer("s0"), scorer("s1"), other], scored)
    steps = (len(ids) - 1) // llamacpp.SCORE_CHUNK - 1  # whole chunks of 64, the last one with the rest
    assert prompt_at["s0"] >= steps and prompt_at["s1"] >= 2 * steps, prompt_at  # one chunk a step
    assert first["other"] <= 1 < min(prompt_at["s0"], prompt_at["s1"]), (first, prompt_at)  # it went on meanwhile
    # While `other` generates (its 6 tokens from its first), a scoring chunk goes in every other step.
    during = scored[first["other"] + 1 : first["other"] + 6]
    assert any(during) and not any(a and b for a, b in itertools.pairwise(during)), scored

    solo, at, _ = _scoring_run(eng, [scorer("solo")])  # scored alone, in chunks
    assert at["solo"] == steps
    monkeypatch.setattr(llamacpp, "SCORE_CHUNK", 10**6)  # the reference: every row in one step
    ref, at, _ = _scoring_run(eng, [scorer("ref")])
    assert at["ref"] == 0

    def lps(key: str, got: dict) -> list[float]:
        return [lp for lp, _, _ in got[key][1:]]

    assert len(solo["solo"]) == len(ref["ref"]) == len(ids)
    assert lps("solo", solo) == pytest.approx(lps("ref", ref), abs=1e-4)  # chunking itself changes no score
    assert [[t for t, _ in e[2]] for e in solo["solo"][1:]] == [[t for t, _ in e[2]] for e in ref["ref"][1:]]
    # Beside another sequence, llama.cpp splits the step into equal pieces per sequence (split_equal),
    # and pieces under 64 rows take another kernel: the same scores up to that kernel's rounding.
    for key in ("s0", "s1"):
        assert len(entries[key]) == len(ids)
        assert lps(key, entries) == pytest.approx(lps("ref", ref), abs=0.5)


def test_a_long_prompt_beside_a_generating_sequence_goes_in_a_little_a_step(engine):
    """Issue 49's Responses scenarios: a 1,000-token prompt went in as 512-token chunks, and each such
    step held every generating stream for seconds on this CPU. Beside a generating sequence a step now
    takes at most PREFILL_BESIDE_DECODE prompt tokens (a tail under 64 rows goes with the chunk before
    it), so the generating one gets a token every step; alone, a prompt still takes the whole batch."""
    from workers.engine import llamacpp

    gen = spec(engine, "gen", "Hello, my name is", 40, False)
    long_ids = engine.tokenize("one two three " * 100)[:300]
    p = GenerationParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.add(gen)
    while not any(isinstance(ev, TokenEvent) and ev.key == "gen" for ev in engine.step()):
        pass  # the generating sequence past its own prompt
    engine.add(SeqSpec("long", long_ids, 1, p, 7, prompt_logprobs_len=0, interactive=False))
    sizes: list[int] = []
    gen_tokens = 0
    while True:
        events = engine.step()
        sizes.append(engine._decoder.batch.n_tokens)
        gen_tokens += sum(1 for ev in events if isinstance(ev, TokenEvent) and ev.key == "gen")
        if any(isinstance(ev, TokenEvent) and ev.key == "long" for ev in events):
            break  # its prompt is in: its first token came
    while engine.has_work():
        engine.step()
    most = 1 + llamacpp.PREFILL_BESIDE_DECODE + llamacpp.PREFILL_BESIDE_DECODE - 1
    assert max(sizes) <= most and len(sizes) >= 300 // most, sizes  # a chunk a step, not 300 at once
    assert gen_tokens >= len(sizes) - 1  # the generating sequence stepped on all the while


def test_a_scoring_chunk_over_the_prefill_budget_still_goes_in_beside_generation(engine):
    """A prompt of 100 positions to score is one scoring chunk of 99 rows (never cut under 64): held to
    the 64-token prefill budget it never went in while another sequence generated, and the watchdog
    failed it after 120 s (ops/hostile.py logprob_job_in_a_loop, 2026-11-29)."""
    gen = spec(engine, "gen2", "Hello, my name is", 60, False)
    ids = engine.tokenize("one two three " * 40)[:100]
    p = GenerationParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    engine.add(gen)
    while not any(isinstance(ev, TokenEvent) and ev.key == "gen2" for ev in engine.step()):
        pass
    engine.add(SeqSpec("scored", ids, 1, p, 7, prompt_logprobs=1, prompt_logprobs_len=len(ids)))
    gen_left = True
    scored_first = None
    for step in range(50):
        events = engine.step()
        if any(isinstance(ev, TokenEvent) and ev.key == "scored" and ev.token_id is not None for ev in events):
            scored_first = step
            break
        gen_left = "gen2" in engine._decoder.live
    while engine.has_work():
        engine.step()
    assert scored_first is not None and scored_first <= 3 and gen_left, (scored_first, gen_left)
