"""The GPU engines' pure arithmetic: tenant-salted page hashes, chunk clamping, cache sizing."""

from __future__ import annotations

import hashlib

import pytest

from workers.engine.gpu_plan import (
    PAGE_SIZE,
    DoesNotFit,
    GiB,
    clamp_chunk,
    page_checksum,
    page_hashes,
    plan_cache,
    reused_tokens,
)

LONG = [(i * 7919) % 32000 for i in range(5 * PAGE_SIZE + 17)]  # five full pages and a partial one


def test_same_prompt_two_tenants_no_reuse_across_reuse_within() -> None:
    cache = set(page_hashes(LONG, "tenant-a"))  # tenant A's prompt is in the cache
    assert len(cache) == 5
    assert reused_tokens(cache, LONG, "tenant-a") == 5 * PAGE_SIZE  # A again: every full page
    assert reused_tokens(cache, LONG, "tenant-b") == 0  # B, same tokens: nothing
    assert not cache & set(page_hashes(LONG, "tenant-b"))  # no page of B collides with any of A
    assert reused_tokens(cache, LONG[: 2 * PAGE_SIZE] + [1] * 600, "tenant-a") == 2 * PAGE_SIZE  # shared prefix


def test_unscoped_chain_is_the_librarys_own() -> None:
    """Without a scope the chain equals exllamav2/v3's unsalted blake2b chain (first prev_hash None)."""
    import array

    first = hashlib.blake2b(array.array("q", LONG[:PAGE_SIZE]).tobytes(), digest_size=16).digest()
    assert page_hashes(LONG, None)[0] == first
    assert page_checksum(array.array("q", LONG[:PAGE_SIZE]).tobytes(), None) == first


@pytest.mark.parametrize(
    ("requested", "n_ctx", "cache", "want"),
    [
        (2048, 8192, 65536, 2048),
        (2048, 1024, 65536, 1024),  # n_ctx below the chunk: clamped, no assert at start
        (2048, 1000, 65536, 1024),  # rounded up to a page
        (2048, 8192, 1024, 1024),  # never beyond the cache
        (2100, 8192, 65536, 2048),  # a page multiple
    ],
)
def test_clamp_chunk(requested: int, n_ctx: int, cache: int, want: int) -> None:
    got = clamp_chunk(requested, n_ctx, cache)
    assert got == want and got % PAGE_SIZE == 0


def test_clamp_chunk_refuses_below_a_page() -> None:
    with pytest.raises(ValueError, match="at least 256"):
        clamp_chunk(100, 8192, 65536)


def test_plan_cache_capped_by_free_memory() -> None:
    # 8B model at ~5.5 GiB, fp16 KV 128 KiB/token, 24 GiB free: 8192 x 32 (32 GiB of cache) cannot fit.
    plan = plan_cache(
        free_bytes=24 * GiB, weights_bytes=int(5.5 * GiB), kv_bytes_per_token=128 * 1024, n_ctx=8192, max_batch=32
    )
    room = 24 * GiB - int(5.5 * GiB) - 2 * GiB
    assert plan.cache_tokens * 128 * 1024 <= room
    assert plan.cache_tokens % PAGE_SIZE == 0
    assert plan.max_batch == plan.cache_tokens // 8192 < 32


def test_plan_cache_takes_what_was_asked_when_it_fits() -> None:
    plan = plan_cache(
        free_bytes=80 * GiB, weights_bytes=6 * GiB, kv_bytes_per_token=128 * 1024, n_ctx=4096, max_batch=8
    )
    assert plan == plan.__class__(cache_tokens=4096 * 8, max_batch=8)


def test_plan_cache_clear_error_when_the_model_cannot_fit() -> None:
    with pytest.raises(DoesNotFit, match=r"does not fit this GPU.*lower n_ctx"):
        plan_cache(free_bytes=8 * GiB, weights_bytes=7 * GiB, kv_bytes_per_token=128 * 1024, n_ctx=8192, max_batch=4)


def test_kv_bytes_per_token_from_config() -> None:
    from workers.engine.gpu_plan import kv_bytes_per_token

    llama8b = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
    assert kv_bytes_per_token(llama8b) == 2 * 32 * 8 * 128 * 2 == 128 * 1024  # K and V, fp16
    assert kv_bytes_per_token({"text_config": llama8b}, bytes_per_value=1) == 64 * 1024


def test_exllamav2_starts_for_any_context():
    """exllamav2 clamps max_input_len to max_seq_len as it loads, then asserts the chunk (a page
    multiple) fits in it: n_ctx 1000 gave chunk 1024 over a model configured for 1000 tokens."""
    from workers.engine.gpu_plan import exl2_lengths

    for n_ctx, model_max, chunk in [(1000, 4096, 2048), (300, 131072, 2048), (8192, 8192, 2048), (5000, 4500, 4096)]:
        ctx, seq, got = exl2_lengths(n_ctx, model_max, chunk)
        max_input_len = min(got, seq)  # what ExLlamaV2.load leaves of config.max_input_len = chunk
        assert got % 256 == 0 and got <= max_input_len, (n_ctx, model_max, chunk, seq, got)
        assert ctx == min(n_ctx, model_max) and ctx <= seq <= model_max
    assert exl2_lengths(1000, 4096, 2048) == (1000, 1024, 1024)
