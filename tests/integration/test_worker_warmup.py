"""A worker is ready only after it has generated: `spool worker` loads its engine, runs a short real
generation, and only then announces itself. An engine that loads but cannot generate makes the worker
log the library's message, record it where /ready and the status page read it, and exit non-zero
before its first heartbeat."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from core.jobs import workers
from core.registry import smollm2_gguf
from ops.harness import ENGINE_THREADS
from tests.conftest import ROOT
from workers.engine.null import NullEngine
from workers.engine.warmup import PROMPT, WarmupFailed, warm_up

MODEL = "smollm2-135m-instruct"
BROKEN = "RuntimeError: no kernel image is available for execution on the device (stand-in)"

# The real worker entry point with an engine whose generation raises: what a GPU host whose kernels
# do not run looks like to Spool (the model loads, the first step fails).
FAILING_WORKER = f"""
import sys
from workers.engine.null import NullEngine

def step(self):
    raise RuntimeError({BROKEN.split(": ", 1)[1]!r})

NullEngine.step = step
from workers.__main__ import main
main([])
"""


def test_the_llamacpp_engine_generates_before_the_worker_is_ready():
    from workers.engine.llamacpp import LlamaCppEngine

    engine = LlamaCppEngine(
        MODEL, smollm2_gguf(), n_ctx=512, max_batch=2, interactive_slots=0, n_threads=ENGINE_THREADS
    )
    tokens = warm_up(engine)
    assert len(tokens) == 4 and all(0 <= t < engine.n_vocab for t in tokens)
    assert not engine.has_work()  # nothing of the warm-up stays in the engine
    assert engine.tokenize(PROMPT)


def test_a_warm_up_that_fails_says_why_in_the_librarys_words():
    class Broken(NullEngine):
        def step(self):
            raise RuntimeError("no kernel image is available for execution on the device (stand-in)")

    with pytest.raises(WarmupFailed, match="RuntimeError: no kernel image is available"):
        warm_up(Broken(MODEL, n_ctx=512, max_batch=2))
    assert len(warm_up(NullEngine(MODEL, n_ctx=512, max_batch=2))) == 4


def test_a_worker_that_cannot_generate_exits_nonzero_and_says_so_on_ready(rds, it_settings):
    from core.infra import redis_keys

    rds.delete(redis_keys.live_workers(MODEL))
    env = {
        **os.environ,
        "SPOOL_ENGINE": "null",
        "SPOOL_REDIS_URL": it_settings.redis_url,
        "SPOOL_DATABASE_URL": it_settings.database_url,
        "SPOOL_WORKER_MODELS": MODEL,
        "SPOOL_MODELS": MODEL,
    }
    env.pop("SPOOL_MODELS_FILE", None)
    out = subprocess.run(
        [sys.executable, "-c", FAILING_WORKER], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 78, out.stderr[-3000:]
    assert "could not start" in out.stderr and "no kernel image is available" in out.stderr
    # Never counted as live; its reason is where /ready and the status page read it.
    assert workers.live(rds, MODEL) == []
    (failure,) = workers.failures(rds, MODEL)
    assert failure.error.startswith("WarmupFailed: ") and "no kernel image is available" in failure.error
    assert time.time() - failure.at < 120
    rds.delete(redis_keys.live_workers(MODEL))
