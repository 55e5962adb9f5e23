"""The one tokenizer interface the API and the engines share, and the context a deployment serves."""

from __future__ import annotations

from typing import Protocol

from core.config import Settings


class Tokenizer(Protocol):
    n_vocab: int
    train_context: int  # the model's own context length; deployments may serve less (SPOOL_N_CTX)

    def encode(self, text: str, *, add_special: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def token_text(self, token_id: int) -> str: ...

    def fim_tokens(self) -> tuple[int, int, int] | None: ...

    def chat_template(self) -> str | None:
        """The model's own Jinja chat template, if it carries one."""
        ...

    def special_text(self) -> tuple[str, str]:
        """(BOS, EOS) as text, for chat templates that write them."""
        ...


def context_length(tok: Tokenizer, settings: Settings) -> int:
    """The longest sequence a deployment serves: its setting, capped by the model's own context and,
    on the GPU engine, by the KV cache (a job larger than the cache would never start)."""
    ctx = min(settings.n_ctx, tok.train_context) if tok.train_context else settings.n_ctx
    if settings.engine == "exllamav2" and settings.exl2_cache_tokens:
        ctx = min(ctx, settings.exl2_cache_tokens)
    return ctx
