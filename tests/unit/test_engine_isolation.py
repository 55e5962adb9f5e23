"""One sequence's failure in an engine step ends that sequence alone; a step that fails for no one
sequence lets every live sequence go to be retried (their attempts resume), never a permanent
failure of every co-batched tenant's job. A real engine (the paced one, its clock a no-op)
subclassed to fail on cue, stepped by the real EngineLoop thread."""

from __future__ import annotations

import queue

from ops.factories import params
from tests.helpers import drain
from workers.engine.base import SeqSpec, SequenceError
from workers.engine.loop import EngineLoop
from workers.engine.paced import PacedEngine

MODEL = "smollm2-135m-instruct"
TOKENS = 12


class Faulty(PacedEngine):
    def __init__(self) -> None:
        super().__init__(MODEL, n_ctx=2048, max_batch=8, interactive_slots=4, sleep=lambda s: None)
        self.poisoned: set = set()  # keys whose sequence fails on the next step
        self.step_faults = 0  # steps still to fail as a whole

    def step(self):
        if self.step_faults:
            self.step_faults -= 1
            raise RuntimeError("device lost")
        for key in self.poisoned & set(self.live):
            self.poisoned.discard(key)
            raise SequenceError(key, "its grammar broke")
        return super().step()


def spec(key: str) -> SeqSpec:
    return SeqSpec(key, [1, 2, 3, 4], TOKENS, params(), 7)


def test_one_sequences_error_fails_it_alone():
    eng = Faulty()
    eng.poisoned.add("bad")
    loop = EngineLoop(eng)
    q: queue.SimpleQueue = queue.SimpleQueue()
    loop.submit([spec("a"), spec("bad"), spec("b")], q.put)
    got = drain(q, {"a", "bad", "b"})
    assert got["bad"][-1].error == "its grammar broke" and not got["bad"][-1].retry
    for key in ("a", "b"):  # the co-batched sequences generate every token and end normally
        assert got[key][-1].error is None and got[key][-1].finish_reason == "length"
        assert sum(e.token_id is not None for e in got[key]) == TOKENS


def test_a_step_error_lets_every_live_sequence_go_to_be_retried():
    eng = Faulty()
    eng.step_faults = 1
    loop = EngineLoop(eng)
    q: queue.SimpleQueue = queue.SimpleQueue()
    loop.submit([spec("a"), spec("b")], q.put)
    got = drain(q, {"a", "b"})
    for key in ("a", "b"):
        assert got[key][-1].error == "engine step failed" and got[key][-1].retry
    assert not eng.has_work()  # the engine holds nothing of them: a retry starts clean
    # The loop goes on serving: a later sequence runs to its end.
    loop.submit([spec("c")], q.put)
    assert drain(q, {"c"})["c"][-1].finish_reason == "length"
