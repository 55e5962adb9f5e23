"""A job's prompt: token ids, and the text to echo. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass
class Prompt:
    """One prompt as the engines see it: `ids` (normalized: FIM tokens added, cut to the context),
    and `text`, what `echo` returns verbatim (None: echo the detokenized ids, for a prompt given as
    ids or changed by normalization).

    Stored in `jobs.prompts` as `{"ids": [...], "text": ...}`; `to_json`/`from_json` are the only
    code that knows that shape."""

    ids: list[int]
    text: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"ids": self.ids, "text": self.text}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Prompt:
        return cls(list(raw.get("ids") or []), raw.get("text"))
