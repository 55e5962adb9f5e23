"""The engine loop is every engine's watchdog: a sequence the engine makes no progress on for
`stall_s` (SPOOL_SEQUENCE_STALL_S) is taken out of the engine and failed with an error its client
sees; a sequence waiting for a slot is not stalled. Real engines (the paced one, its naps short)
stepped by the real EngineLoop thread; one is made to lose a sequence as exllamav3 did with a job
whose prefill raised (its error result had no identifier: the sequence stayed live, never advancing)."""

from __future__ import annotations

import queue
import time

from ops.factories import params
from tests.helpers import drain
from workers.engine.base import SeqSpec
from workers.engine.loop import EngineLoop
from workers.engine.paced import PacedEngine

MODEL = "smollm2-135m-instruct"


class Losing(PacedEngine):
    """Keeps the sequences in `lost` live (has_work stays true) but never advances them."""

    def __init__(self, **kw) -> None:
        super().__init__(MODEL, n_ctx=2048, max_batch=8, interactive_slots=0, step_ms=2.0, seq_ms=0.0, **kw)
        self.lost: set = set()
        self.held: dict = {}
        self.cancelled: list = []

    def add(self, spec: SeqSpec) -> None:
        if spec.key in self.lost:
            self.held[spec.key] = spec
            return
        super().add(spec)

    def cancel(self, key) -> None:
        self.cancelled.append(key)
        self.held.pop(key, None)
        super().cancel(key)

    def has_work(self) -> bool:
        return bool(self.held) or super().has_work()

    def step(self):
        if not super().has_work():
            time.sleep(0.002)  # a GPU step with nothing of ours in it
            return []
        return super().step()


def spec(key: str, n: int = 10, prompt=(1, 2, 3, 4)) -> SeqSpec:
    return SeqSpec(key, list(prompt), n, params(), 7)


def test_a_sequence_that_never_advances_fails_with_an_error_the_client_sees():
    eng = Losing()
    eng.lost.add("lost")
    loop = EngineLoop(eng, stall_s=0.3)
    q: queue.SimpleQueue = queue.SimpleQueue()
    started = time.monotonic()
    loop.submit([spec("a", 5), spec("lost")], q.put)
    got = drain(q, {"a", "lost"})
    assert got["a"][-1].finish_reason == "length" and got["a"][-1].error is None
    (ended,) = got["lost"]
    assert ended.error is not None and "no progress" in ended.error and "SPOOL_SEQUENCE_STALL_S" in ended.error
    assert not ended.retry  # the request fails, with that message
    assert time.monotonic() - started >= 0.3
    assert "lost" in eng.cancelled and not eng.held and loop.stalled == 1  # the engine let go of it
    assert loop.live_count() == 0


def test_a_sequence_the_engine_forgot_entirely_is_failed_too():
    """An engine that dropped a sequence without a word (has_work false): the loop must not sleep on
    its inbox forever with the sequence's client waiting."""

    class Forgetting(Losing):
        def has_work(self) -> bool:
            return PacedEngine.has_work(self)

    eng = Forgetting()
    eng.lost.add("gone")
    loop = EngineLoop(eng, stall_s=0.2)
    q: queue.SimpleQueue = queue.SimpleQueue()
    loop.submit([spec("gone")], q.put)
    (ended,) = drain(q, {"gone"}, timeout=10)["gone"]
    assert ended.error is not None and "no progress" in ended.error


def test_waiting_for_a_slot_is_not_a_stall():
    """max_batch 1: the second sequence waits far longer than stall_s for the first to end, then
    generates every token; a live sequence's steady tokens are progress however long it runs."""
    eng = PacedEngine(MODEL, n_ctx=2048, max_batch=1, interactive_slots=0, step_ms=20.0, seq_ms=0.0)
    loop = EngineLoop(eng, stall_s=0.25)
    q: queue.SimpleQueue = queue.SimpleQueue()
    loop.submit([spec("first", 30, prompt=[1]), spec("second", 5, prompt=[2])], q.put)
    got = drain(q, {"first", "second"})
    for key, n in (("first", 30), ("second", 5)):
        assert got[key][-1].error is None and got[key][-1].finish_reason == "length"
        assert sum(e.token_id is not None for e in got[key]) == n
    assert loop.stalled == 0


def test_the_setting_reaches_the_workers_loop():
    from core.config import Settings

    assert Settings().sequence_stall_s == 120.0
    assert Settings(sequence_stall_s=5).sequence_stall_s == 5.0
