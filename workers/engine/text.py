"""Turning a choice's token stream into text: incremental UTF-8 and stop strings.

Engine-neutral: an engine only supplies each token's bytes. Text that could still be the start of a
stop string is held back, so the stop text is never sent to the client.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable


class ChoiceText:
    def __init__(self, stop: tuple[str, ...], token_bytes: Callable[[int], bytes]) -> None:
        self.stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self._token_bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.ids: list[int] = []
        self.text = ""
        self.emitted = 0  # characters of `text` already handed out
        self.finish_reason: str | None = None

    def feed(self, token_id: int) -> None:
        self.ids.append(token_id)
        self.text += self._decoder.decode(self._token_bytes(token_id))
        if self.stop:
            self._find_stop()

    def _find_stop(self) -> None:
        # An occurrence cannot start before `emitted`: it would have been found one token earlier.
        hits = [i for i in (self.text.find(s, self.emitted) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.finish_reason = "stop"

    def finish(self, reason: str) -> None:
        if self.finish_reason is None:
            self.text += self._decoder.decode(b"", final=True)
            self.finish_reason = reason

    def _held(self) -> int:
        """Length of the longest tail of the unsent text that could begin a stop string."""
        for k in range(min(self._hold, len(self.text) - self.emitted), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0

    def take(self) -> str:
        """The text that is now safe to send: all of it, less a tail that may begin a stop string."""
        end = len(self.text) if self.finish_reason else len(self.text) - self._held()
        piece = self.text[self.emitted : end]
        self.emitted = end
        return piece

    def restore(self, ids: list[int], sent_text: str) -> None:
        """Rebuild the state of a choice an earlier attempt streamed part of (crash resume)."""
        for t in ids:
            self.ids.append(t)
            self.text += self._decoder.decode(self._token_bytes(t))
        self.emitted = len(sent_text)
