"""Prefix affinity: which worker a request should go to, so that its prompt finds its prefix cached.

Each engine keeps the prompts it served in its own KV cache (per tenant). With N workers for a model
and any worker taking any message, a conversation's next turn lands on another worker (N-1)/N of the
time and prefills its whole history again. Here a request gets a key that stays the same across a
conversation's turns; core/infra/broker.py `route` ranks the model's live workers for it by rendezvous
hashing (its home first, then where it spills: a worker loaded past a bound, a key past its rate).

The key, in order of preference (each salted with the tenant, so no tenant can aim at another's):
- the request's `prompt_cache_key` (OpenAI's own routing hint);
- a chat's messages up to its first user message (system prompt and opening question): the same for
  every turn of one conversation, and for a Responses chain, whose expansion starts with them;
- a completion's first `PREFIX_TOKENS` prompt tokens.

Pure: no I/O (tests/unit/test_affinity.py).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

# A completion prompt's leading tokens that name its "conversation": a long shared preamble (few-shot
# examples, a document) is what a cache keeps; the tail is what differs between requests.
PREFIX_TOKENS = 128


def _salted(tenant_id: int, kind: str, payload: bytes) -> int:
    """A signed 64-bit key (a Postgres bigint) of the tenant, the key's kind and its payload."""
    digest = hashlib.blake2b(f"{tenant_id}\x00{kind}\x00".encode() + payload, digest_size=8, person=b"spool-aff")
    return int.from_bytes(digest.digest(), "big", signed=True)


def from_cache_key(tenant_id: int, prompt_cache_key: str) -> int:
    return _salted(tenant_id, "k", prompt_cache_key.encode())


def from_messages(tenant_id: int, messages: Sequence[Any]) -> int:
    """`messages` (dicts or models with `model_dump`) through the first user one."""
    head: list[Any] = []
    for m in messages:
        d = m.model_dump(mode="json", exclude_none=True) if hasattr(m, "model_dump") else m
        head.append(d)
        if isinstance(d, dict) and d.get("role") == "user":
            break
    return _salted(tenant_id, "m", json.dumps(head, sort_keys=True, ensure_ascii=False).encode())


def from_tokens(tenant_id: int, ids: Sequence[int]) -> int:
    lead = ids[:PREFIX_TOKENS]
    return _salted(tenant_id, "p", b"".join(int(t).to_bytes(4, "little", signed=True) for t in lead))
