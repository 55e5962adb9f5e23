"""Engine-neutral generation parameters.

The API translates OpenAI JSON into these once, at the edge (api/schemas.py); workers and engines
only ever see this shape, stored with the job in Postgres.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

# A prompt is text, or token ids the client tokenized itself.
Prompt = str | list[int]


class GenerationParams(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int | None = 16  # None: up to the end of the context
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int = 0  # always set: the edge picks one when the client did not, so retries replay
    n: int = 1
    ignore_eos: bool = False

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GenerationParams:
        return cls.model_validate(data)


def choice_index(prompt_index: int, sample_index: int, n: int) -> int:
    """OpenAI numbers choices prompt-major: prompt i, sample j -> i * n + j."""
    return prompt_index * n + sample_index
