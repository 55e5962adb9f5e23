"""Pure arithmetic shared by the GPU engines (exllamav2, exllamav3): page-hash salting per tenant,
prefill chunk clamping and cache/batch sizing from free GPU memory. No torch, no CUDA: unit-tested
on CPU (tests/unit/test_gpu_plan.py).

Both libraries key their prefix cache by a chain of 16-byte blake2b hashes over 256-token pages,
the first page hashed with no predecessor (`prev_hash=None`). Any job whose first pages match reuses
them, whoever sent them. Seeding the chain with a per-tenant salt instead of None makes equal
prompts of two tenants hash apart at every page, so neither reuse nor `cached_tokens` crosses tenants.

How the engines apply it (their Job subclasses, workers/engine/exllamav2.py and exllamav3.py):
- the library's page checksum is wrapped once (`salted_checksum`) so that, while one of our jobs
  hashes (`hashing_for(salt)`: queueing, pages completed during generation), a chain root of None
  means that job's salt. Full-page reuse (`page_hashes`, `all_unique_hashes`, the dedupe of a page
  completed during generation, exllamav3's CPU and disk tiers) goes by these hashes.
- the libraries also copy a *partial* page from any cached page with the same predecessor hash; for
  a prompt's first page that predecessor is None, shared by every tenant. Pages remember the scope
  of the job that last held them (`claim_pages`), and while a job prefills, first pages of other
  scopes are hidden from that search (`own_first_pages_only`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PAGE_SIZE = 256  # exllamav2's and exllamav3's page (tokens)


def scope_salt(scope: Hashable) -> bytes | None:
    """The predecessor hash of a tenant's first page; None (the libraries' own) when unscoped."""
    if scope is None:
        return None
    return hashlib.blake2b(repr(scope).encode(), digest_size=16, person=b"spool-scope").digest()


def cache_salt(scope: Hashable, cache_prompt: bool, key: Hashable) -> bytes | None:
    """A sequence's chain salt: its tenant's, or one of its own when it asked for no prefix reuse
    (`cache_prompt: false`, which llama.cpp's engine honours too): its pages are then found by no one."""
    return scope_salt(scope) if cache_prompt else scope_salt(("no-reuse", key))


_SALT: ContextVar[bytes | None] = ContextVar("spool_page_salt", default=None)


def salted_checksum(checksum: Callable[[Any, bytes | None], bytes]) -> Callable[[Any, bytes | None], bytes]:
    """The library's `checksum(tensor, prev_hash)` with a chain root of None read as the salt of the
    job now hashing (`hashing_for`); outside one, exactly the library's. Wrapping twice is a no-op."""
    if getattr(checksum, "spool_salted", False):
        return checksum

    def checksum_salted(tensor: Any, prev_hash: bytes | None) -> bytes:
        return checksum(tensor, _SALT.get() if prev_hash is None else prev_hash)

    checksum_salted.spool_salted = True  # type: ignore[attr-defined]
    return checksum_salted


@contextmanager
def hashing_for(salt: bytes | None) -> Iterator[None]:
    token = _SALT.set(salt)
    try:
        yield
    finally:
        _SALT.reset(token)


UNCLAIMED = b"spool-unclaimed"  # the scope of a page no job of ours has held yet
HIDDEN_ROOT = b"spool-hidden-root"  # a predecessor hash no page search looks for (not 16 bytes)


def claim_pages(pages: Iterable[Any], salt: bytes | None) -> None:
    """Record that a job of this scope now holds (and writes) these cache pages. A page taken while
    it still holds an earlier job's tokens (`can_revert`) goes back to them if this job never writes
    it; it remembers its scope for that (`release_pages`)."""
    for page in pages:
        if page.can_revert:
            page.spool_scope_revert = getattr(page, "spool_scope", UNCLAIMED)
        page.spool_scope = salt


def release_pages(pages: Iterable[Any]) -> None:
    """Before the library releases a job's pages: one the job never wrote (still `can_revert`, and
    this job its last holder) reverts to its earlier tokens, and so to their scope."""
    for page in pages:
        if page.can_revert and page.ref_count == 1:
            page.spool_scope = getattr(page, "spool_scope_revert", UNCLAIMED)


class ClaimsPages:
    """Mixed into an engine's job class before the library's (`class ScopedJob(ClaimsPages, Job)`): the
    cache pages the library hands the job's sequences are claimed for its scope (`claim_pages`), and
    released (`release_pages`) as the library takes them back."""

    spool_salt: bytes | None
    sequences: list[Any]  # the library job's

    def allocate_pages(self) -> Any:
        out = super().allocate_pages()  # type: ignore[misc]
        for seq in self.sequences:
            claim_pages(seq.allocated_pages, self.spool_salt)
        return out

    def deallocate_pages(self) -> Any:
        for seq in self.sequences:
            release_pages(seq.allocated_pages or [])
        return super().deallocate_pages()  # type: ignore[misc]


@contextmanager
def own_first_pages_only(pages: Iterable[Any], salt: bytes | None) -> Iterator[None]:
    """While a job of this scope prefills: first pages (predecessor None) last held by another scope
    are out of the library's partial-page search, which looks for `prev_hash == None`."""
    hidden = [p for p in pages if p.prev_hash is None and getattr(p, "spool_scope", UNCLAIMED) != salt]
    for p in hidden:
        p.prev_hash = HIDDEN_ROOT
    try:
        yield
    finally:
        for p in hidden:
            if p.prev_hash == HIDDEN_ROOT:
                p.prev_hash = None


def page_checksum(page: bytes, prev_hash: bytes | None) -> bytes:
    """The libraries' `_tensor_blake2b_checksum` over a page's int64 token bytes."""
    h = hashlib.blake2b(digest_size=16)
    if prev_hash is not None:
        h.update(prev_hash)
    h.update(page)
    return h.digest()


def page_hashes(ids: Sequence[int], scope: Hashable, page_size: int = PAGE_SIZE) -> list[bytes]:
    """The hash chain of a prompt's full pages as the engine keys them (the cache-key mapping)."""
    import array

    prev = scope_salt(scope)
    out: list[bytes] = []
    for a in range(0, len(ids) - len(ids) % page_size, page_size):
        prev = page_checksum(array.array("q", ids[a : a + page_size]).tobytes(), prev)
        out.append(prev)
    return out


def reused_tokens(cached: set[bytes], ids: Sequence[int], scope: Hashable, page_size: int = PAGE_SIZE) -> int:
    """Prompt tokens a sequence would reuse from pages already cached (leading matching pages)."""
    n = 0
    for h in page_hashes(ids, scope, page_size):
        if h not in cached:
            break
        n += page_size
    return n


def clamp_chunk(requested: int, n_ctx: int, cache_tokens: int, page_size: int = PAGE_SIZE) -> int:
    """Prefill chunk: a positive multiple of the page size no larger than the context (rounded up to
    a page) nor the cache. exllamav2 asserts `max_chunk_size <= max_input_len` and a page multiple;
    a model with n_ctx below the default 2048 chunk must start rather than assert."""
    if requested < page_size:
        raise ValueError(f"prefill chunk size must be at least {page_size}, not {requested}")
    ceiling = min(_round_up(n_ctx, page_size), cache_tokens - cache_tokens % page_size)
    return max(page_size, min(requested - requested % page_size, ceiling))


def exl2_lengths(n_ctx: int, model_max: int, chunk: int, page_size: int = PAGE_SIZE) -> tuple[int, int, int]:
    """(context per sequence, the model's configured max_seq_len, prefill chunk) for exllamav2, which
    asserts at start that the chunk (a page multiple) is at most `max_input_len`, and clamps
    `max_input_len` to `max_seq_len` as it loads: a context that is not a page multiple and below the
    chunk (n_ctx 1000: chunk 1024 > max_seq_len 1000) stopped the worker. The model is configured for
    the context rounded up to a page (capped by its own maximum); sequences keep the asked context."""
    n_ctx = min(n_ctx, model_max)
    seq = min(_round_up(n_ctx, page_size), model_max)
    ceiling = max(seq - seq % page_size, page_size)
    return n_ctx, seq, clamp_chunk(chunk, n_ctx, ceiling, page_size)


def _round_up(n: int, page_size: int = PAGE_SIZE) -> int:
    return -(-n // page_size) * page_size


class DoesNotFit(RuntimeError):
    """The model cannot be served on this GPU: the message says what is short and by how much."""


@dataclass(frozen=True)
class CachePlan:
    cache_tokens: int
    max_batch: int


GiB = 1024**3


def plan_cache(
    *,
    free_bytes: int,
    weights_bytes: int,
    kv_bytes_per_token: int,
    n_ctx: int,
    max_batch: int,
    requested_tokens: int | None = None,
    reserve_bytes: int = 2 * GiB,
    page_size: int = PAGE_SIZE,
) -> CachePlan:
    """Cache size and batch from free GPU memory, before anything is loaded.

    After the weights and a reserve (activations, the prefill chunk's attention, CUDA context) the
    rest may hold KV pages; the cache is what was asked for (`requested_tokens`, else n_ctx x
    max_batch) capped by that room, and at least one full-length sequence. max_batch is cut so that
    every running sequence can reach the full context only if the cache holds it: the paged
    generator would otherwise start sequences it has to stall. Raises DoesNotFit when not even one
    sequence of n_ctx fits.
    """
    if kv_bytes_per_token <= 0 or n_ctx <= 0 or max_batch <= 0:
        raise ValueError("kv_bytes_per_token, n_ctx and max_batch must be positive")
    one = _round_up(n_ctx, page_size)
    room = free_bytes - weights_bytes - reserve_bytes
    fits = max(room, 0) // kv_bytes_per_token
    fits -= fits % page_size
    if fits < one:
        need = weights_bytes + reserve_bytes + one * kv_bytes_per_token
        raise DoesNotFit(
            f"the model does not fit this GPU: weights {weights_bytes / GiB:.1f} GiB + reserve "
            f"{reserve_bytes / GiB:.1f} GiB + one {n_ctx}-token sequence's cache "
            f"{one * kv_bytes_per_token / GiB:.2f} GiB = {need / GiB:.1f} GiB, but {free_bytes / GiB:.1f} GiB "
            "is free; lower n_ctx, quantize the cache, or use a smaller quantization"
        )
    want = _round_up(requested_tokens if requested_tokens else n_ctx * max_batch, page_size)
    tokens = max(min(want, fits), one)
    return CachePlan(cache_tokens=tokens, max_batch=max(1, min(max_batch, tokens // one)))


def kv_bytes_per_token(config: dict[str, Any], bytes_per_value: int = 2) -> int:
    """K and V of every layer for one token (fp16 cache unless quantized), from config.json."""
    text = config.get("text_config", config)
    layers = int(text["num_hidden_layers"])
    heads = int(text.get("num_key_value_heads") or text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"])
    return 2 * layers * heads * head_dim * bytes_per_value


def weights_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def cap_context(n_ctx: int, model_max: int | None) -> int:
    """A sequence's context, capped by the model's own maximum (config.json's max_position_embeddings,
    as the library reads it); a model that states none keeps the asked context."""
    return min(n_ctx, model_max) if model_max and model_max > 0 else n_ctx


# The oldest Linux driver each CUDA major runs on (NVIDIA's CUDA release notes, "minor version
# compatibility": a CUDA 12.x torch starts on any r525+ driver), and what exllamav3's own kernels need
# beyond it: its compressed (EXL3) kernels need r570 (CUDA 12.8's driver).
CUDA_MAJOR_DRIVER = {12: (525, 60, 13), 13: (580, 65, 6)}
LIBRARY_DRIVER = {"exllamav3": (570, 0, 0)}


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.strip().split(".") if p.isdigit())


def min_driver(library: str, torch_cuda: str) -> tuple[int, ...]:
    major = _version(torch_cuda)[0] if _version(torch_cuda) else 0
    return max(CUDA_MAJOR_DRIVER.get(major, (0,)), LIBRARY_DRIVER.get(library, (0,)))


def cuda_problem(library: str, torch_cuda: str | None, driver: str | None, available: bool) -> str | None:
    """Why a GPU engine cannot start on this host, in words an operator can act on, or None.
    `torch_cuda`: torch.version.cuda (None for a CPU build); `driver`: the NVIDIA driver's version as
    nvidia-smi reports it (None without one); `available`: torch.cuda.is_available(). An old driver
    makes torch see no device at all; it must read as an old driver, not as a missing GPU."""
    if torch_cuda is None:
        return (
            f"the {library} engine needs a CUDA build of torch; this one is a CPU build "
            "(docs/gpu.md: torch 2.8.0 from https://download.pytorch.org/whl/cu128)"
        )
    need = min_driver(library, torch_cuda)
    if driver is not None and _version(driver) < need:
        why = f"torch's CUDA {torch_cuda} and {library} need driver >= {'.'.join(map(str, need))}"
        return f"the NVIDIA driver {driver} is too old for the {library} engine: {why}; update it (docs/gpu.md, step 1)"
    if not available:
        if driver is None:
            return f"the {library} engine needs a CUDA GPU: nvidia-smi finds no NVIDIA driver or device on this host"
        return (
            f"the {library} engine needs a CUDA GPU: torch (CUDA {torch_cuda}) sees none although NVIDIA driver "
            f"{driver} is loaded (CUDA_VISIBLE_DEVICES, or a container started without its GPUs)"
        )
    return None
