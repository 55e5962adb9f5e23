"""One engine loop per worker process: a thread that owns the engine and steps every live sequence.

Celery task threads `submit` sequences and get their TokenEvents through a callback (usually a
queue.SimpleQueue.put); `cancel` removes them. Commands cross into the loop through one inbox, so
the engine itself needs no locking.
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


class EngineLoop:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
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
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

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
            try:
                self.engine.add(arg)
            except Exception as exc:  # a bad sequence must not take the loop down
                log.exception("engine refused sequence %s", arg.key)
                self._sinks.pop(arg.key, None)
                sink(TokenEvent.failed(arg.key, str(exc)))
        elif cmd == "cancel":
            if self._sinks.pop(arg, None) is not None:
                self.engine.cancel(arg)
                self._busy.pop(arg, None)

    def _drop(self, key: Hashable, ev: TokenEvent) -> None:
        sink = self._sinks.pop(key, None)
        self._busy.pop(key, None)
        try:
            self.engine.cancel(key)
        except Exception:
            log.exception("engine could not drop sequence %s", key)
        if sink is not None:
            sink(ev)

    def _run(self) -> None:
        while True:
            # Block only when idle; otherwise take whatever arrived and keep stepping.
            if not self.engine.has_work():
                self._returned = None  # idle: not the host's time between steps
                self._apply(*self._inbox.get())
            while True:
                try:
                    self._apply(*self._inbox.get_nowait())
                except queue.Empty:
                    break
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
                if isinstance(ev, TokenEvent) and ev.ended:
                    del self._sinks[ev.key]
                    ev = dataclasses.replace(ev, engine_s=self._busy.pop(ev.key, 0.0))
                target(ev)
