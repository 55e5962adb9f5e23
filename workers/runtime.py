"""The worker process's singletons: the engine (loaded once), its loop, and the job runner."""

from __future__ import annotations

import logging
import os
import socket
import time
from functools import lru_cache
from typing import Any

from core.config import Settings, get_settings
from core.infra import kv
from core.infra.db import sync_sessions
from core.registry import model_path, settings_for
from workers.engine.base import Engine
from workers.engine.loop import EngineLoop
from workers.engine.warmup import warm_up
from workers.runner import JobRunner

log = logging.getLogger(__name__)


def batch_slots(model_id: str, settings: Settings) -> int:
    """Batch lines a worker takes for a model (its heartbeat tells the dispatcher): the engine's batch,
    which is the registry's `max_batch` for that model where it sets one, plus the prefetched lines.
    Before, the global SPOOL_MAX_BATCH was advertised: a registry batch of 48 got 18 lines."""
    max_batch = settings_for(model_id, settings).max_batch
    return max_batch + settings.prefetch_for(max_batch)


def build_engine(model_id: str) -> Engine:
    s = settings_for(model_id, get_settings())  # the model's own engine, context, batch and weights
    sized: dict[str, Any] = {"n_ctx": s.n_ctx, "max_batch": s.max_batch}  # every engine's
    cache: dict[str, Any] = {"cache_size": s.exl2_cache_tokens, "chunk": s.exl2_chunk_size}  # both ExLlamas'
    if s.engine == "llamacpp":
        from workers.engine.llamacpp import LlamaCppEngine

        return LlamaCppEngine(
            model_id, model_path(s, model_id), **sized, n_threads=s.n_threads, interactive_slots=s.interactive_slots
        )
    if s.engine == "exllamav2":
        from workers.engine.exllamav2 import ExLlamaV2Engine  # imports torch and CUDA: only here

        return ExLlamaV2Engine(model_id, model_path(s, model_id), **sized, **cache, cache_quant=s.exl2_cache_quant)
    if s.engine == "null":
        from workers.engine.null import NullEngine

        return NullEngine(model_id, **sized)
    if s.engine == "paced":
        from workers.engine.paced import PacedEngine

        return PacedEngine(
            model_id,
            **sized,
            interactive_slots=s.interactive_slots,
            step_ms=s.paced_step_ms,
            seq_ms=s.paced_seq_ms,
            prefill_tps=s.paced_prefill_tps,
        )
    if s.engine == "exllamav3":
        from workers.engine.exllamav3 import ExLlamaV3Engine  # imports torch and CUDA: only here

        return ExLlamaV3Engine(model_id, model_path(s, model_id), **sized, **cache)
    raise ValueError(f"unknown engine {s.engine!r}: `llamacpp`, `exllamav2`, `exllamav3`, `null` or `paced`")


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def ready_engine(model_id: str) -> Engine:
    """The model's engine, loaded and shown to generate (workers/engine/warmup.py): a worker announces
    itself only after this. Raises WarmupFailed (or the load's own error) with the library's message."""
    engine = build_engine(model_id)
    started = time.monotonic()
    tokens = warm_up(engine)
    log.info("%s: warm-up generated %d tokens in %.2fs", model_id, len(tokens), time.monotonic() - started)
    return engine


def engine_loop(model_id: str, stall_s: float) -> EngineLoop:
    """The worker's engine loop: its engine loaded and warmed up on the loop's own thread, so every
    engine call comes from that one thread (EngineLoop: one OpenMP team for llama.cpp)."""
    return EngineLoop(make=lambda: ready_engine(model_id), stall_s=stall_s)


@lru_cache
def runner() -> JobRunner:
    s = get_settings()
    model_id = s.worker_model_ids[0]
    loop = engine_loop(model_id, s.sequence_stall_s)
    name = worker_name()
    log.info("worker %s serving %s", name, model_id)
    return JobRunner(loop, s, kv.client(s.redis_url), sync_sessions(), name)
