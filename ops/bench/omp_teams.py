"""A llama.cpp decode step with one OpenMP thread team in the process, and with two: the engine warmed
up on the main thread, then stepped on another (what the worker did from 2509e2b until the engine loop
made its engine on its own thread). Each case in a fresh process; 128 greedy tokens at one sequence.

    python -m ops.bench.omp_teams [THREADS]     # default: SPOOL_N_THREADS, else every core

With more team threads than CPUs libgomp stops spinning at its barriers; at 2 threads on the 2-core
VM a step took 29.4 ms instead of 11.2 (docs/performance.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

TOKENS = 128


def _one(where: str) -> float:
    from core.generation.params import GenerationParams
    from workers.engine.base import SeqSpec
    from workers.engine.warmup import warm_up
    from workers.runtime import build_engine

    eng = build_engine("smollm2-135m-instruct")
    if where == "main":
        warm_up(eng)
    took: list[float] = []

    def run() -> None:
        if where == "loop":
            warm_up(eng)
        ids = eng.tokenize("Once upon a time")
        params = GenerationParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, cache_prompt=False)
        eng.add(SeqSpec(("k", 0, 0), ids, TOKENS, params, seed=0, interactive=True, cache_scope=("k", 0, 0)))
        started, steps = time.perf_counter(), 0
        while eng.has_work():
            eng.step()
            steps += 1
        took.append(1000 * (time.perf_counter() - started) / steps)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return took[0]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("main", "loop"):
        print(f"{_one(sys.argv[1]):.2f}")
        return
    env = {**os.environ, "SPOOL_N_CTX": "2048", "SPOOL_LOG_FORMAT": "text"}
    if len(sys.argv) > 1:
        env["SPOOL_N_THREADS"] = sys.argv[1]
    for where, label in (
        ("main", "warmed up on the main thread (two teams)"),
        ("loop", "all on one thread (one team)"),
    ):
        out = subprocess.run(
            [sys.executable, "-m", "ops.bench.omp_teams", where], env=env, capture_output=True, text=True, check=True
        )
        print(f"{label}: {out.stdout.strip().splitlines()[-1]} ms a step", flush=True)


if __name__ == "__main__":
    main()
