"""Engine-neutral generation parameters.

The API translates OpenAI JSON (and the seed documents' extensions and aliases) into these once, at
the edge (core/protocol/translate.py); workers and engines only ever see this shape, stored with the job.
Every field here is honoured by every engine, or refused at the edge with a 400 naming it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_serializer

# llama.cpp's default DRY sequence breakers.
DEFAULT_DRY_BREAKERS = ("\n", ":", '"', "*")


_RETIRED = frozenset({"reproducible"})


class GenerationParams(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    # Length
    max_tokens: int | None = 16  # None: up to the end of the context
    min_tokens: int = 0  # end-of-sequence is suppressed until this many tokens exist
    ignore_eos: bool = False
    # Sampling (temperature 0 = greedy)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    typical_p: float = 1.0
    # Penalties
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    penalty_last_n: int | None = None  # the penalties' window in tokens; None: the whole context
    dry_multiplier: float = 0.0  # 0 = DRY off
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_sequence_breakers: tuple[str, ...] = DEFAULT_DRY_BREAKERS
    mirostat: int = 0  # 0 off, 1 Mirostat, 2 Mirostat 2.0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    logit_bias: dict[int, float] = {}  # added to the logits; -inf bans the token
    # Reproducibility: always set; the edge picks one when the client did not, so retries replay.
    seed: int = 0
    # Stopping
    stop: tuple[str, ...] = ()
    # Choices: n returned per prompt, best_of generated per prompt (best by mean token logprob)
    n: int = 1
    best_of: int = 1
    # Log-probabilities
    logprobs: int | None = None  # top alternatives per token (completions 0..5, chat 0..20); None = none
    echo: bool = False
    prompt_logprobs: int | None = None  # vLLM's: per prompt token, its logprob and the top k
    # Constrained decoding: an llguidance grammar (core/generation/constraints.py), already validated
    grammar: str | None = None
    # Prefix reuse across requests
    cache_prompt: bool = True
    # Speculative decoding (workers/engine/drafts.py): "off"; "prediction" (drafts from the client's
    # prediction only); "auto" (the prediction, else prompt lookup); "force" (auto with no back-off:
    # SPOOL_SPECULATIVE=force, for tests). Output is the same either way: only its speed changes.
    speculative: Literal["off", "prediction", "auto", "force"] = "prediction"
    prediction: tuple[int, ...] = ()  # OpenAI's `prediction`, tokenized (chat), bounded by the context

    @field_serializer("logit_bias", when_used="json")
    def _bias_json(self, bias: dict[int, float]) -> dict[int, float | str]:
        # A banned token (llama.cpp's `false`) has a bias of -inf, which JSON and Postgres' jsonb cannot
        # hold: it is stored as "-inf", which validation reads back as -inf.
        return {t: "-inf" if b == float("-inf") else b for t, b in bias.items()}

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GenerationParams:
        # Jobs stored while the CPU engine had a fast path beside its exact one carry the field that chose
        # between them (`reproducible`), gone since: dropped on read.
        return cls.model_validate({k: v for k, v in data.items() if k not in _RETIRED})

    @property
    def greedy(self) -> bool:
        """The one rule every engine follows: a temperature of 0 (or below) takes the most likely token."""
        return self.temperature <= 0

    @property
    def candidates(self) -> int:
        """Sequences generated per prompt."""
        return max(self.n, self.best_of)

    @property
    def needs_token_logprobs(self) -> bool:
        return self.logprobs is not None or self.best_of > self.n


def choice_index(prompt_index: int, sample_index: int, n: int) -> int:
    """OpenAI numbers choices prompt-major: prompt i, sample j -> i * n + j."""
    return prompt_index * n + sample_index
