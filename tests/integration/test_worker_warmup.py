"""A worker is ready only after it has generated: `spool worker` loads its engine, runs a short real
generation, and only then announces itself. An engine that loads but cannot generate makes the worker
log the library's message, record it where /ready and the status page read it, and exit non-zero
before its first heartbeat."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from core.jobs import live_workers
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
    assert live_workers.live(rds, MODEL) == []
    (failure,) = live_workers.failures(rds, MODEL)
    assert failure.error.startswith("WarmupFailed: ") and "no kernel image is available" in failure.error
    assert time.time() - failure.at < 120
    rds.delete(redis_keys.live_workers(MODEL))


# The worker's own engine loop (workers/runtime.engine_loop) in a fresh process, with a 2-thread
# llama.cpp: the process's native threads (those Python did not start) once the loop has generated,
# then once the main thread has generated too. A thread's first parallel region gives it an OpenMP
# team, here one helper thread: if the main thread had one already (the worker's warm-up ran there),
# the second count equals the first.
ONE_TEAM = """
import os, queue, threading, json
from core.generation.params import GenerationParams
from workers.engine.base import SeqSpec
from workers.engine.warmup import warm_up
from workers.runtime import build_engine, engine_loop


def native():
    return len({int(t) for t in os.listdir("/proc/self/task")} - {t.native_id for t in threading.enumerate()})


loop = engine_loop("smollm2-135m-instruct", 60.0)
done = queue.SimpleQueue()
ids = loop.engine.tokenize("Once upon a time")
spec = SeqSpec(("k", 0, 0), ids, 8, GenerationParams(temperature=0.0, max_tokens=8, ignore_eos=True), seed=0,
               interactive=True, cache_scope=("k", 0, 0))
loop.submit([spec], done.put)
while not getattr(done.get(timeout=120), "ended", False):
    pass
after_loop = native()
warm_up(build_engine("smollm2-135m-instruct"))  # on the main thread
print(json.dumps({"after_loop": after_loop, "after_main": native()}))
os._exit(0)
"""


def test_the_worker_loads_and_warms_its_engine_on_the_loops_own_thread():
    """Every llama.cpp call of a worker comes from its engine loop's thread: libgomp keeps an OpenMP
    team per calling thread, and with a second team (the warm-up on the main thread) parked, its
    barriers stopped spinning and every 2-thread decode step took 2.6x as long (BENCHMARKS.md). Once
    the worker's loop has generated, the main thread holds no team: a generation there adds one."""
    env = {**os.environ, "SPOOL_N_THREADS": "2", "SPOOL_N_CTX": "512", "SPOOL_LOG_FORMAT": "text"}
    out = subprocess.run(
        [sys.executable, "-c", ONE_TEAM], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["after_main"] == seen["after_loop"] + 1, seen


def test_an_engine_made_on_the_loop_thread_raises_its_failure_in_the_caller():
    from workers.engine.loop import EngineLoop

    made_on: list[int] = []

    def make() -> NullEngine:
        import threading

        made_on.append(threading.get_ident())
        return NullEngine(MODEL, n_ctx=512, max_batch=2)

    loop = EngineLoop(make=make)
    assert made_on == [loop._thread.ident] and isinstance(loop.engine, NullEngine)

    def broken() -> NullEngine:
        raise WarmupFailed("RuntimeError: no kernel image (stand-in)")

    with pytest.raises(WarmupFailed, match="no kernel image"):
        EngineLoop(make=broken)
    with pytest.raises(TypeError):
        EngineLoop()
