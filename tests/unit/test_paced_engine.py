"""The paced engine: a GPU's step time modelled by sleeping, with a real engine's scheduling.

The clock is a recorder (no real sleeping), the vocabulary the real SmolLM2 one, so these tests check
the modelled time, the slots, preemption and resume exactly.
"""

from __future__ import annotations

import pytest

from ops.factories import params
from workers.engine.base import PromptEvent, SeqSpec, TokenEvent
from workers.engine.paced import PacedEngine, analytic_tok_s, step_seconds

MODEL = "smollm2-135m-instruct"


class Clock:
    def __init__(self) -> None:
        self.naps: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.naps.append(seconds)


def engine(max_batch: int = 64, reserved: int = 4, **kw) -> tuple[PacedEngine, Clock]:
    clock = Clock()
    # A stopped clock: the step's own work takes no modelled time, so the naps are the model's exactly.
    eng = PacedEngine(
        MODEL, n_ctx=2048, max_batch=max_batch, interactive_slots=reserved, sleep=clock, clock=lambda: 0.0, **kw
    )
    return eng, clock


def spec(key, n: int, prompt=(1, 2, 3, 4), interactive: bool = True, prior: int = 0, seed: int = 7) -> SeqSpec:
    return SeqSpec(key, list(prompt), n, params(), seed, prior=prior, interactive=interactive)


def step(eng: PacedEngine, out: dict) -> int:
    """One step, its tokens added to `out`; how many sequences decoded."""
    evs = eng.step()
    for e in evs:
        if isinstance(e, TokenEvent) and e.token_id is not None:
            out.setdefault(e.key, []).append(e.token_id)
    return sum(1 for e in evs if isinstance(e, TokenEvent))


def run(eng: PacedEngine, limit: int = 10_000, out: dict | None = None) -> tuple[dict, list[int]]:
    """Step until idle: tokens per key (added to `out`, the earlier steps' tokens), and how many
    sequences were live at each decode step."""
    out = {} if out is None else out
    live_per_step: list[int] = []
    for _ in range(limit):
        if not eng.has_work():
            break
        live_per_step.append(step(eng, out))
    return out, live_per_step


def test_one_token_per_sequence_per_step_and_the_modelled_time():
    eng, clock = engine(step_ms=8, seq_ms=0.25, prefill_tps=10_000)
    for i in range(4):
        eng.add(spec(i, 10, prompt=range(1, 101)))
    toks, live = run(eng)
    assert all(len(t) == 10 for t in toks.values()) and live == [4] * 10
    # one prefill nap of 400 prompt tokens, then 10 decode steps of 8 + 4 x 0.25 ms
    assert clock.naps[0] == pytest.approx(400 / 10_000)
    assert clock.naps[1:] == [pytest.approx(0.009)] * 10
    assert eng.slept_s == pytest.approx(0.04 + 0.09)
    assert analytic_tok_s(4, 8, 0.25) == pytest.approx(4 / 0.009)
    assert step_seconds(64, 8, 0.25) == pytest.approx(0.024)


def test_the_steps_own_work_is_taken_out_of_its_nap():
    """Choosing tokens stands for the GPU's sampling: a step whose Python took 3 ms naps 3 ms less."""
    clock = Clock()
    ticks = iter([0.0, 0.003] * 100)
    eng = PacedEngine(MODEL, n_ctx=2048, max_batch=4, sleep=clock, clock=lambda: next(ticks), prefill_tps=1e12)
    eng.add(spec(0, 2))
    run(eng)
    assert clock.naps[1:] == [pytest.approx(0.00825 - 0.003)] * 2


def test_tokens_are_deterministic_and_a_resumed_attempt_continues_them():
    eng, _ = engine()
    eng.add(spec("a", 12))
    full = run(eng)[0]["a"]
    eng.add(spec("b", 12))
    assert run(eng)[0]["b"] == full  # same prompt and seed: same tokens
    eng.add(spec("c", 12, seed=8))
    assert run(eng)[0]["c"] != full
    # the next attempt gets prompt + the 5 tokens already streamed, and asks for the other 7
    eng.add(spec("r", 7, prompt=[1, 2, 3, 4, *full[:5]], prior=5))
    assert run(eng)[0]["r"] == full[5:]


def test_max_batch_caps_batch_sequences_and_interactive_slots_are_extra():
    eng, _ = engine(max_batch=3, reserved=2)
    for i in range(8):
        eng.add(spec(("b", i), 5, interactive=False))
    got: dict = {}
    step(eng, got)
    assert len(eng.live) == 3 and eng.waiting_count() == 5
    eng.add(spec("i1", 5))
    eng.add(spec("i2", 5))
    step(eng, got)
    assert len(eng.live) == 5 and eng.preemptions == 0  # the reserved slots take interactive work at once
    toks, live = run(eng, out=got)
    assert max(live) <= 5 and len(toks) == 10 and all(len(t) == 5 for t in toks.values())


def test_an_interactive_sequence_displaces_a_batch_one_which_keeps_its_output():
    ref, _ = engine()
    ref.add(spec("b0", 20, interactive=False, prompt=[9, 9]))
    ref.add(spec("b1", 20, interactive=False, prompt=[8, 8]))
    expected = run(ref)[0]

    eng, _ = engine(max_batch=2, reserved=0)
    eng.add(spec("b0", 20, interactive=False, prompt=[9, 9]))
    eng.add(spec("b1", 20, interactive=False, prompt=[8, 8]))
    got: dict = {}
    for _ in range(3):
        step(eng, got)
    eng.add(spec("i", 4))
    toks, live = run(eng, out=got)
    assert eng.preemptions == 1 and max(live) <= 2
    assert toks["b0"] == expected["b0"] and toks["b1"] == expected["b1"]  # the displaced one lost nothing
    assert len(toks["i"]) == 4


def test_cancel_and_prefill_only():
    eng, _ = engine()
    eng.add(spec("x", 50))
    eng.add(spec("y", 0))
    evs = eng.step()
    assert {e.key for e in evs if isinstance(e, PromptEvent)} == {"x", "y"}
    assert any(isinstance(e, TokenEvent) and e.key == "y" and e.finish_reason == "length" for e in evs)
    eng.cancel("x")
    assert not eng.has_work()


def test_a_fresh_sequence_gets_the_null_engines_tokens():
    """The paced engine is the null engine's output at a GPU's pace: `spool bench --mode engine` with
    either, and any Spool stack in front of either, must produce the same text for the same prompt."""
    from workers.engine.null import NullEngine

    null = NullEngine(MODEL, n_ctx=2048, max_batch=64)
    eng, _ = engine()
    for key, prompt, seed in (("a", [5, 6, 7], 0), ("b", list(range(1, 40)), 123), ("c", [1], 7)):
        null.add(spec(key, 17, prompt=prompt, seed=seed))
        eng.add(spec(key, 17, prompt=prompt, seed=seed))
    want: dict = {}
    step(null, want)  # the null engine emits every token in one step
    assert run(eng)[0] == want


def test_under_the_real_engine_loop_max_batch_holds_and_cancel_frees_the_slot():
    import queue

    from workers.engine.loop import EngineLoop

    eng = PacedEngine(MODEL, n_ctx=2048, max_batch=2, interactive_slots=0, step_ms=0.2, seq_ms=0.0)
    loop = EngineLoop(eng)
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    loop.submit([spec(("b", i), 30, interactive=False, prompt=[i + 1]) for i in range(3)], inbox.put)
    first: list = []
    while len(first) < 2:  # the first token of each live sequence arrives
        ev = inbox.get(timeout=10)
        if isinstance(ev, TokenEvent) and ev.key not in first:
            first.append(ev.key)
    assert ("b", 2) not in first and eng.waiting_count() == 1  # max_batch 2: the third waits
    loop.cancel([first[0]])
    ends: set = set()
    seen: set = set()
    while len(ends) < 2:
        ev = inbox.get(timeout=10)
        if isinstance(ev, TokenEvent):
            seen.add(ev.key)
            if ev.finish_reason is not None:
                ends.add(ev.key)
    assert ends == {first[1], ("b", 2)} and ("b", 2) in seen  # the cancelled one's slot went to the third
