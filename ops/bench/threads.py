"""llama.cpp's token rate by thread count on this machine: why ops/test.sh gives each shard's engine one
thread (two one-thread engines side by side generate more than one two-thread engine).

    python -m ops.bench.threads 2        # one engine, two threads
    python -m ops.bench.threads 1 1      # two one-thread engines at once, a process each
"""

from __future__ import annotations

import subprocess
import sys
import time


def one(threads: int, tokens: int = 200) -> str:
    from llama_cpp import Llama

    from core.registry import smollm2_gguf

    llm = Llama(str(smollm2_gguf()), n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False)
    t0, c0 = time.monotonic(), time.process_time()
    out = llm("Once upon a time", max_tokens=tokens, temperature=0)
    n, wall = out["usage"]["completion_tokens"], time.monotonic() - t0  # type: ignore[index]
    return f"threads={threads} tokens={n} tok/s={n / wall:.1f} cpu_s/token={(time.process_time() - c0) / n:.4f}"


def main(argv: list[str]) -> None:
    if len(argv) == 1:
        print(one(int(argv[0])))
        return
    procs = [subprocess.Popen([sys.executable, "-m", "ops.bench.threads", a]) for a in argv]
    for p in procs:
        p.wait()


if __name__ == "__main__":
    main(sys.argv[1:] or ["2"])
