"""One engine loop per worker process: a thread that owns the engine and steps every live sequence.

Celery task threads `submit` sequences and get their TokenEvents through a callback (usually a
queue.SimpleQueue.put); `cancel` removes them. Commands cross into the loop through one inbox, so
the engine itself needs no locking.

The loop is also every engine's watchdog: a sequence that gets no event for `stall_s` seconds
(SPOOL_SEQUENCE_STALL_S) while it is not waiting for a slot (the engine's `waiting_keys()`) is taken
out of the engine and failed with an error its client sees, so a sequence an engine lost track of
(a library result it could not map back, a job that never advances) cannot hold its attempt, its
lease renewals and its client forever.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Hashable

from workers.engine.base import Engine, PromptEvent, SeqSpec, SequenceError, TokenEvent

log = logging.getLogger(__name__)

Sink = Callable[[TokenEvent | PromptEvent], None]


STALL_S = 120.0  # core.config's sequence_stall_s default


def stall_message(seconds: float) -> str:
    return (
        f"the engine made no progress on this sequence for {seconds:.0f}s "
        "(SPOOL_SEQUENCE_STALL_S): it was stopped; the request failed"
    )


class EngineLoop:
    engine: Engine

    def __init__(
        self, engine: Engine | None = None, stall_s: float = STALL_S, *, make: Callable[[], Engine] | None = None
    ) -> None:
        """Steps `engine`, or the engine `make()` returns: made on the loop's own thread (loaded and
        warmed up there), and the constructor returns once it is, raising what `make` raised.

        Every llama.cpp call of a worker must come from this one thread: libgomp keeps an OpenMP thread
        team per calling thread, and once a process holds more team threads than CPUs (a warm-up on the
        main thread left a second team parked) its barriers stop spinning and sleep, which made every
        decode step of a 2-thread engine 2.6x slower (11 -> 29 ms for SmolLM2 at one sequence)."""
        if (engine is None) == (make is None):
            raise TypeError("EngineLoop takes an engine or a `make` that returns one")
        if engine is not None:
            self.engine = engine
        self.stall_s = stall_s
        self._progress: dict[Hashable, float] = {}  # monotonic time of each live sequence's last event
        self._next_watch = 0.0
        self.stalled = 0  # sequences the watchdog failed
        self._inbox: queue.SimpleQueue[tuple[str, object, Sink | None]] = queue.SimpleQueue()
        self._sinks: dict[Hashable, Sink] = {}
        self.max_live = 0  # most sequences live at once: concurrency evidence for tests and metrics
        self._busy: dict[Hashable, float] = {}  # engine seconds per sequence (step time / live count)
        self.steps = 0
        # Wall time inside engine steps, and between one step's return and the next step while
        # sequences were live: the host's share (events, callbacks, the GIL), which on a GPU is time
        # the GPU waits. The heartbeat logs both; the bench reads them.
        self.step_s = 0.0
        self.between_s = 0.0
        self._returned: float | None = None
        self._inside_since: float | None = None  # monotonic start of the engine call in progress
        made: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._start, args=(make, made), name="engine-loop", daemon=True)
        self._thread.start()
        if make is not None and (failed := made.get()) is not None:
            raise failed

    def _start(self, make: Callable[[], Engine] | None, made: queue.SimpleQueue[BaseException | None]) -> None:
        if make is not None:
            try:
                self.engine = make()
            except BaseException as exc:  # the caller raises it; this thread ends
                made.put(exc)
                return
            made.put(None)
        self._run()

    def submit(self, specs: list[SeqSpec], sink: Sink) -> None:
        for spec in specs:
            self._inbox.put(("add", spec, sink))

    def cancel(self, keys: list[Hashable]) -> None:
        for key in keys:
            self._inbox.put(("cancel", key, None))

    def live_count(self) -> int:
        """Sequences in the engine now (decoding, or waiting there for a slot)."""
        return len(self._sinks)

    def waiting_count(self) -> int:
        counter = getattr(self.engine, "waiting_count", None)
        return int(counter()) if callable(counter) else 0

    def stalled_for(self) -> float:
        """Seconds the engine has been inside one call (0 when idle or between calls). A healthy step
        takes milliseconds to a few seconds (a long prefill); minutes means the engine is wedged."""
        since = self._inside_since
        return 0.0 if since is None else time.monotonic() - since

    def _apply(self, cmd: str, arg: object, sink: Sink | None) -> None:
        self._inside_since = time.monotonic()
        try:
            self._apply_now(cmd, arg, sink)
        finally:
            self._inside_since = None

    def _apply_now(self, cmd: str, arg: object, sink: Sink | None) -> None:
        if cmd == "add":
            assert isinstance(arg, SeqSpec) and sink is not None
            self._sinks[arg.key] = sink
            self._progress[arg.key] = time.monotonic()
            try:
                self.engine.add(arg)
            except Exception as exc:  # a bad sequence must not take the loop down
                log.exception("engine refused sequence %s", arg.key)
                self._sinks.pop(arg.key, None)
                self._progress.pop(arg.key, None)
                sink(TokenEvent.failed(arg.key, str(exc)))
        elif cmd == "cancel":
            if self._sinks.pop(arg, None) is not None:
                self.engine.cancel(arg)
                self._busy.pop(arg, None)
                self._progress.pop(arg, None)

    def _drop(self, key: Hashable, ev: TokenEvent) -> None:
        sink = self._sinks.pop(key, None)
        self._busy.pop(key, None)
        self._progress.pop(key, None)
        try:
            self.engine.cancel(key)
        except Exception:
            log.exception("engine could not drop sequence %s", key)
        if sink is not None:
            sink(ev)

    def _watch(self, now: float) -> None:
        """Fail the sequences that made no progress for `stall_s` (checked a few times per period)."""
        if now < self._next_watch or not self._progress:
            return
        self._next_watch = now + min(max(self.stall_s / 4, 0.01), 1.0)
        waiting_keys = getattr(self.engine, "waiting_keys", None)
        waiting = waiting_keys() if callable(waiting_keys) else ()
        for key in waiting:  # waiting for a slot is not a stall: its clock starts when it gets one
            if key in self._progress:
                self._progress[key] = now
        for key, last in list(self._progress.items()):
            if now - last > self.stall_s:
                log.error("sequence %s made no progress for %.0fs: failing it", key, now - last)
                self.stalled += 1
                self._drop(key, TokenEvent.failed(key, stall_message(now - last), now))

    def _run(self) -> None:
        while True:
            # Block only when idle; otherwise take whatever arrived and keep stepping. With sequences
            # in hand but no engine work (an engine that lost them) wake up to watch them.
            if not self.engine.has_work():
                self._returned = None  # idle: not the host's time between steps
                try:
                    self._apply(
                        *self._inbox.get(timeout=min(max(self.stall_s / 4, 0.01), 1.0) if self._sinks else None)
                    )
                except queue.Empty:
                    pass
            while True:
                try:
                    self._apply(*self._inbox.get_nowait())
                except queue.Empty:
                    break
            self._watch(time.monotonic())
            if not self.engine.has_work():
                continue
            self.max_live = max(self.max_live, len(self._sinks))
            started = self._inside_since = time.monotonic()
            if self._returned is not None:
                self.between_s += started - self._returned
            try:
                events = self.engine.step()
            except SequenceError as exc:  # one sequence's fault: it alone ends; the others step on
                log.warning("engine failed sequence %s: %s", exc.key, exc)
                self._drop(exc.key, TokenEvent.failed(exc.key, str(exc)))
                continue
            except Exception:
                # Not attributable to one sequence: every live one lets go (its attempt is retried
                # and resumes from what it streamed) rather than failing every tenant's job for good.
                log.exception("engine step failed; its live sequences let go to be retried")
                for key in list(self._sinks):
                    self._drop(key, dataclasses.replace(TokenEvent.failed(key, "engine step failed"), retry=True))
                continue
            finally:
                self._inside_since = None
            self.steps += 1
            returned = time.monotonic()
            self.step_s += returned - started
            self._returned = returned if self._sinks else None
            share = (returned - started) / max(1, len(self._sinks))
            for key in self._sinks:
                self._busy[key] = self._busy.get(key, 0.0) + share
            for ev in events:
                target = self._sinks.get(ev.key)
                if target is None:
                    continue
                self._progress[ev.key] = returned
                if isinstance(ev, TokenEvent) and ev.ended:
                    del self._sinks[ev.key]
                    del self._progress[ev.key]
                    ev = dataclasses.replace(ev, engine_s=self._busy.pop(ev.key, 0.0))
                target(ev)
