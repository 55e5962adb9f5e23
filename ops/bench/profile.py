"""Where a CPU engine step's time goes: `python -m ops.bench.profile [--seqs 1,4,16] [--temperature 0,0.8]`.

Runs N sequences of T tokens straight on the llama.cpp engine (no loop thread, no queue) and splits
each step's wall time into llama.cpp's forward pass (`llama_decode`), sampling (the per-sequence
`_sample`: masks, argmax or llama.cpp's sampler chain, event), and the rest (building the batch,
admitting, bookkeeping), by timing wrappers around those calls. Prints one Markdown row per case.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from typing import Any

import llama_cpp as llc

from core.config import get_settings
from core.generation.params import GenerationParams
from core.registry import settings_for
from workers.engine.base import SeqSpec, TokenEvent
from workers.engine.llamacpp import LlamaCppEngine
from workers.runtime import model_path

PROMPT = "Describe the water cycle to a ten-year-old."


class Timer:
    def __init__(self) -> None:
        self.spent: dict[str, float] = {}

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.spent[name] = self.spent.get(name, 0.0) + time.perf_counter() - t

        return timed


def run(engine: LlamaCppEngine, timer: Timer, nseq: int, temperature: float, tokens: int) -> dict[str, float]:
    ids = engine.tokenize(PROMPT)
    p = GenerationParams(max_tokens=tokens, temperature=temperature, ignore_eos=True, cache_prompt=False)
    for i in range(nseq):
        engine.add(SeqSpec(("profile", nseq, temperature, i), ids, tokens, p, i))
    engine.step()  # the prefill step: not what a decode step costs
    timer.spent.clear()
    steps, generated = 0, 0
    t0 = time.perf_counter()
    while engine.has_work():
        generated += sum(1 for ev in engine.step() if isinstance(ev, TokenEvent) and ev.token_id is not None)
        steps += 1
    wall = time.perf_counter() - t0
    decode, sample = timer.spent.get("decode", 0.0), timer.spent.get("sample", 0.0)
    return {
        "step_ms": 1000 * wall / steps,
        "decode_ms": 1000 * decode / steps,
        "sample_ms": 1000 * sample / steps,
        "other_ms": 1000 * (wall - decode - sample) / steps,
        "tok_s": generated / wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seqs", default="1,4,16")
    ap.add_argument("--temperature", default="0,0.8")
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    model = get_settings().model_ids[0]
    s = settings_for(model, get_settings())
    timer = Timer()
    # The engine looks these up on the module at call time, so wrapping them here times every call.
    llc.llama_decode = timer.wrap("decode", llc.llama_decode)
    LlamaCppEngine._sample = timer.wrap("sample", LlamaCppEngine._sample)  # type: ignore[method-assign]
    engine = LlamaCppEngine(model, model_path(s, model), n_ctx=s.n_ctx, max_batch=s.max_batch, n_threads=s.n_threads)
    print("| sequences | temperature | step ms | llama_decode ms | sampling ms | rest ms | tokens/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for temp in (float(x) for x in args.temperature.split(",")):
        for n in (int(x) for x in args.seqs.split(",")):
            r = run(engine, timer, n, temp, args.tokens)
            print(
                f"| {n} | {temp:g} | {r['step_ms']:.2f} | {r['decode_ms']:.2f} | {r['sample_ms']:.2f} "
                f"| {r['other_ms']:.2f} | {r['tok_s']:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
